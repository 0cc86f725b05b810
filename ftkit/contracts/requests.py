"""The ids of a run's requests: how the runner names them and how a worker recognises them.

The scenario runner (through the engine session) submits request ``index`` of run ``run_id``
as ``ftkit:<run_id>:<index>``, and a request resumed after ``offset`` output tokens as
``ftkit:<run_id>:<index>+<offset>``; vLLM appends a random suffix (``-...``) to the id it uses
internally, and gives each completion of a request with ``n > 1`` a child request of its own,
``<sample>_<id>``. The injector in every worker finds a fault's request by this id.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

REQUEST_ID = "ftkit:{run_id}:{index}"
_REQUEST_ID_RE = re.compile(
    r"^(?:(?P<sample>\d+)_)?ftkit:(?P<run>[A-Za-z0-9_.]+):(?P<index>\d+)(?:\+(?P<offset>\d+))?(?:-|$)")


class RequestRef(NamedTuple):
    run_id: str
    index: int
    #: Output tokens the request had produced before it was resumed (0: not resumed).
    offset: int = 0
    #: The completion, for a child request of a request with ``n > 1`` (0 otherwise).
    sample: int = 0


def request_id(run_id: str, index: int, offset: int = 0, sample: int | None = None) -> str:
    """The id of request ``index``; ``offset``: resumed after that many output tokens;
    ``sample``: one completion of a request with ``n > 1``, submitted as a request of its own
    (the id vLLM gives such a completion)."""
    rid = REQUEST_ID.format(run_id=run_id, index=index)
    rid = f"{rid}+{offset}" if offset else rid
    return rid if sample is None else f"{sample}_{rid}"


def parse_request_id(req_id: str) -> RequestRef | None:
    m = _REQUEST_ID_RE.match(req_id)
    if not m:
        return None
    return RequestRef(m.group("run"), int(m.group("index")), int(m.group("offset") or 0),
                      int(m.group("sample") or 0))


def request_matcher(run_id: str, index: int) -> Callable[[str], bool]:
    """A test for the ids vLLM uses for request ``index`` of run ``run_id``: resumed or not,
    with or without vLLM's suffix, any of its completions."""
    prefix = request_id(run_id, index)

    def matches(rid: str) -> bool:
        if rid[:1].isdigit():  # a child request: <sample>_<id>
            rid = rid.partition("_")[2]
        return rid == prefix or rid.startswith((prefix + "-", prefix + "+"))

    return matches


#: vLLM's OpenAI server names the engine request of a client's request from its
#: ``X-Request-Id`` (or a random id): ``cmpl-<id>-<prompt>`` for the completions API (one per
#: prompt of the request), ``chatcmpl-<id>`` for the chat API (which renders one prompt). A
#: request resumed by a restarted engine (``ftkit.vllm.restart``) has ``+ftkit<offset>``
#: appended; then the engine appends ``-<8 hex>`` (unless vLLM's
#: ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set), and a completion of a request with
#: ``n > 1`` gets ``<sample>_`` in front.
_SERVED_ID = (r"^(?:(?P<sample>\d+)_)?(?P<api>cmpl|chatcmpl)-(?P<body>.+?)"
              r"(?:\+ftkit(?P<offset>\d+))?{suffix}$")
#: Ids with the engine's random suffix, and without (randomization off).
_SERVED_ID_RE = {True: re.compile(_SERVED_ID.format(suffix="-[0-9a-f]{8}")),
                 False: re.compile(_SERVED_ID.format(suffix=""))}
_COMPLETION_BODY_RE = re.compile(r"^(?P<client>.+)-(?P<prompt>\d+)$")
_RANDOMIZATION_OFF_ENV = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"


class ServedRequestRef(NamedTuple):
    """What the engine id of a served request says (``parse_served_request_id``)."""

    #: ``completions`` or ``chat``.
    api: str
    #: The client's ``X-Request-Id`` (or the id the server drew for it).
    client_id: str
    #: The prompt's index in a completions request (0 for chat).
    prompt: int = 0
    #: The completion, for a child request of a request with ``n > 1`` (0 otherwise).
    sample: int = 0
    #: Output tokens the request had produced before it was resumed (0: not resumed).
    offset: int = 0


def _randomized(environ: Mapping[str, str]) -> bool:
    return environ.get(_RANDOMIZATION_OFF_ENV, "0").strip().lower() in ("", "0", "false")


def parse_served_request_id(engine_id: str, environ: Mapping[str, str] = os.environ
                            ) -> ServedRequestRef | None:
    """The parts of ``engine_id``, the id a vLLM server's engine uses for a request of the
    completions or chat API (fresh or resumed, any completion of ``n > 1``); ``None`` for
    any other id. The one parser every matcher of served requests uses."""
    m = _SERVED_ID_RE[_randomized(environ)].match(engine_id)
    if m is None:
        return None
    body = m.group("body")
    if m.group("api") == "chatcmpl":
        api, client, prompt = "chat", body, 0
    else:
        parts = _COMPLETION_BODY_RE.match(body)
        if parts is None:
            return None
        api, client, prompt = "completions", parts.group("client"), int(parts.group("prompt"))
    return ServedRequestRef(api, client, prompt, int(m.group("sample") or 0),
                            int(m.group("offset") or 0))


def served_request_matches(engine_id: str, client_id: str) -> bool:
    """Whether ``engine_id``, the id a vLLM server's engine uses for a request, is that of the
    request a client sent with ``X-Request-Id: client_id`` (exactly that id: ``user`` is not
    ``user-2``), fresh or resumed, any of its completions."""
    ref = parse_served_request_id(engine_id)
    return ref is not None and ref.client_id == client_id


def served_resume_id(engine_id: str, offset: int) -> str:
    """The id of served request ``engine_id`` resumed after ``offset`` output tokens."""
    return f"{engine_id}+ftkit{offset}"


def resumed_offset(req_id: str) -> int:
    """How many output tokens the request of engine id ``req_id`` had produced before it was
    resumed (0: not resumed), in a run of ftkit's (``<id>+<offset>``) or in a server
    (``served_resume_id``). The workers fast-forward a resumed seeded request's generator
    by it and show its penalties the earlier tokens as outputs."""
    ref = parse_request_id(req_id)
    if ref is not None:
        return ref.offset
    served = parse_served_request_id(req_id)
    return served.offset if served is not None else 0
