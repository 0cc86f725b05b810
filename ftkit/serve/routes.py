"""The HTTP side of ``ftkit.serve.control``: its route, for FastAPI (imported only in the
server, where vLLM brings FastAPI). FastAPI reads the handlers' annotations at run time, so
this module keeps them as real objects (no postponed annotations)."""

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ftkit.serve.control import (INJECT_PATH, MAX_BODY_BYTES, SECRET_HEADER, BadFault, Control,
                                 EngineUnavailable, Refused)

log = logging.getLogger("ftkit")


class _TooLarge(Exception):
    pass


async def _read_body(request: Request) -> bytes:
    """The body, read only up to ``MAX_BODY_BYTES`` (``_TooLarge`` past it): the route is
    open to anyone who reaches the port, and reads nothing more of what it refuses."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _TooLarge
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _TooLarge
    return bytes(body)


async def inject(request: Request) -> JSONResponse:
    """``POST /ftkit/inject``: plan the fault of the JSON body (``control.live_fault``).
    200 with what was planned; 403 refused (checked before the body is read), 413 a body past
    ``MAX_BODY_BYTES``, 422 a bad fault, 503 no engine or no answer from it."""
    control = getattr(request.app.state, "ftkit_control", None)
    if not isinstance(control, Control):
        return JSONResponse({"error": "ftkit's control is not initialised"}, 503)
    presented = request.headers.get(SECRET_HEADER)
    try:
        control.check_secret(presented)
        try:
            body = json.loads(await _read_body(request))
        except _TooLarge:
            return JSONResponse({"error": f"the body is larger than {MAX_BODY_BYTES} bytes"},
                                413)
        except ValueError:
            body = None
        return JSONResponse(await control.inject(body, presented))
    except Refused as exc:
        log.warning("ftkit: refused an injection from %s: %s",
                    request.client.host if request.client else "?", exc)
        return JSONResponse({"error": str(exc)}, 403)
    except BadFault as exc:
        return JSONResponse({"error": str(exc)}, 422)
    except EngineUnavailable as exc:
        return JSONResponse({"error": str(exc)}, 503)


def router() -> APIRouter:
    routes = APIRouter()
    routes.add_api_route(INJECT_PATH, inject, methods=["POST"])
    return routes
