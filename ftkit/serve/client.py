"""The client side of ``ftkit inject``: plans a fault in a running server
(``ftkit.serve.control``) over HTTP, with the standard library only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from ftkit.errors import FtkitError
from ftkit.serve.control import INJECT_PATH, SECRET_ENV, SECRET_HEADER

#: How long ``ftkit inject`` waits for the server's answer. The server bounds its own wait for
#: the engine (``control.RPC_TIMEOUT_S``, 60 s) and answers within it.
DEFAULT_TIMEOUT_S = 90.0


class InjectRefused(FtkitError):
    """The server answered, and did not plan the fault; ``status``: its HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


#: The environment variable that holds the server's secret, read by ``ftkit inject`` too.
INJECT_SECRET_ENV = SECRET_ENV


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are answered, never followed: the secret goes to the URL given, nowhere
    else."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def inject_live_fault(url: str, fault: dict[str, Any], secret: str | None,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Ask the server at ``url`` (``http://HOST:PORT``) to plan ``fault`` (the route's JSON:
    ``control.FAULT_KEYS``); its answer, ``{"planned": {...}}`` (checked: what was planned,
    with its index). ``InjectRefused`` when the server says no, ``FtkitError`` when it cannot
    be reached, redirects (never followed: the secret would go with it) or answers what no
    ftkit server answers."""
    target = url.rstrip("/") + INJECT_PATH
    if not target.startswith(("http://", "https://")):
        raise FtkitError(f"--url must start with http:// or https://, got {url!r}")
    headers = {"Content-Type": "application/json"}
    if secret:
        headers[SECRET_HEADER] = secret
    request = urllib.request.Request(target, data=json.dumps(fault).encode(), headers=headers,
                                     method="POST")
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        status = exc.code
        if 300 <= status < 400:
            raise FtkitError(f"{target} answered HTTP {status}, a redirect to "
                             f"{exc.headers.get('Location') or '(no location)'}: ftkit inject "
                             f"does not follow redirects (its secret would go along); give "
                             f"the server's own URL") from None
        try:
            answer = json.loads(exc.read())
            message = answer.get("error") or answer.get("message")
        except (ValueError, AttributeError):
            message = None
        if status == 404:
            raise InjectRefused(
                f"{target} does not exist: the server does not load ftkit's endpoint plugin "
                f"(start it with `ftkit serve`, or with VLLM_PLUGINS naming ftkit)",
                status) from None
        raise InjectRefused(message or f"HTTP {status} {exc.reason}", status) from None
    except urllib.error.URLError as exc:
        raise FtkitError(f"cannot reach {url}: {exc.reason}") from None
    except TimeoutError:
        raise FtkitError(f"{url} did not answer within {timeout_s:.0f} s") from None
    except (ValueError, OSError) as exc:
        raise FtkitError(f"bad answer from {url}: {exc}") from None
    problem = _answer_problem(answer)
    if problem is not None:
        raise FtkitError(f"bad answer from {target}: {problem} (is it a server of ftkit's?): "
                         f"{json.dumps(answer)[:200]}")
    return answer


def _answer_problem(answer: Any) -> str | None:
    """What is wrong with the route's answer, or ``None`` (``control.describe``'s shape)."""
    planned = answer.get("planned") if isinstance(answer, dict) else None
    if not isinstance(planned, dict):
        return "no 'planned' object"
    index, rank = planned.get("index"), planned.get("rank")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        return "no fault index"
    if not isinstance(planned.get("kind"), str):
        return "no fault kind"
    if rank != "all" and (not isinstance(rank, int) or isinstance(rank, bool)):
        return "no rank"
    if not isinstance(planned.get("phase"), str) or not isinstance(planned.get("times"), int):
        return "no phase or times"
    if ("request_id" in planned) == ("after_steps" in planned):
        return "neither a request nor a step"
    return None


__all__ = ["DEFAULT_TIMEOUT_S", "INJECT_SECRET_ENV", "InjectRefused", "inject_live_fault"]
