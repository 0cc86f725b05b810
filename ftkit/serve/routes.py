"""The HTTP side of ``ftkit.serve.control``: its route, for FastAPI (imported only in the
server, where vLLM brings FastAPI). FastAPI reads the handlers' annotations at run time, so
this module keeps them as real objects (no postponed annotations)."""

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ftkit.serve.control import (INJECT_PATH, SECRET_HEADER, BadFault, Control,
                                 EngineUnavailable, Refused)

log = logging.getLogger("ftkit")


async def inject(request: Request) -> JSONResponse:
    """``POST /ftkit/inject``: plan the fault of the JSON body (``control.live_fault``).
    200 with what was planned; 403 refused, 400 a bad fault, 503 no engine: nothing
    planned."""
    control = getattr(request.app.state, "ftkit_control", None)
    if not isinstance(control, Control):
        return JSONResponse({"error": "ftkit's control is not initialised"}, 503)
    try:
        body = await request.json()
    except ValueError:
        body = None
    try:
        return JSONResponse(await control.inject(body, request.headers.get(SECRET_HEADER)))
    except Refused as exc:
        log.warning("ftkit: refused an injection from %s: %s",
                    request.client.host if request.client else "?", exc)
        return JSONResponse({"error": str(exc)}, 403)
    except BadFault as exc:
        return JSONResponse({"error": str(exc)}, 400)
    except EngineUnavailable as exc:
        return JSONResponse({"error": str(exc)}, 503)


def router() -> APIRouter:
    routes = APIRouter()
    routes.add_api_route(INJECT_PATH, inject, methods=["POST"])
    return routes
