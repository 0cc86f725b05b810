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


def inject_live_fault(url: str, fault: dict[str, Any], secret: str | None,
           timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Ask the server at ``url`` (``http://HOST:PORT``) to plan ``fault`` (the route's JSON:
    ``control.FAULT_KEYS``); what it planned. ``InjectRefused`` when the server says no,
    ``FtkitError`` when it cannot be reached or is no server of ftkit's."""
    target = url.rstrip("/") + INJECT_PATH
    if not target.startswith(("http://", "https://")):
        raise FtkitError(f"--url must start with http:// or https://, got {url!r}")
    headers = {"Content-Type": "application/json"}
    if secret:
        headers[SECRET_HEADER] = secret
    request = urllib.request.Request(target, data=json.dumps(fault).encode(), headers=headers,
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        status = exc.code
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


__all__ = ["DEFAULT_TIMEOUT_S", "INJECT_SECRET_ENV", "InjectRefused", "inject_live_fault"]
