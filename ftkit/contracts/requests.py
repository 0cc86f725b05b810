"""The ids of a run's requests: how the runner names them and how a worker recognises them.

The scenario runner (through the engine session) submits request ``index`` of run ``run_id``
as ``ftkit:<run_id>:<index>``, and a request resumed after ``offset`` output tokens as
``ftkit:<run_id>:<index>+<offset>``; vLLM appends a random suffix (``-...``) to the id it uses
internally, and gives each completion of a request with ``n > 1`` a child request of its own,
``<sample>_<id>``. The injector in every worker finds a fault's request by this id.
"""

from __future__ import annotations

import re
from collections.abc import Callable
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


#: The prefix vLLM's OpenAI server gives the id of a client's request (``cmpl-``,
#: ``chatcmpl-``), and the child prefix of one completion of a request with ``n > 1``.
_SERVED_PREFIX_RE = re.compile(r"^(?:\d+_)?[A-Za-z]+-")


def served_request_matches(engine_id: str, client_id: str) -> bool:
    """Whether ``engine_id``, the id a vLLM server's engine uses for a request, is that of the
    request a client sent with ``X-Request-Id: client_id``. The server builds it as
    ``cmpl-<client_id>-<prompt>`` (completions) or ``chatcmpl-<client_id>`` (chat), then the
    engine appends ``-<8 hex>``; a completion of ``n > 1`` adds ``<sample>_`` in front."""
    m = _SERVED_PREFIX_RE.match(engine_id)
    if m is None:
        return False
    rest = engine_id[m.end():]
    return rest.startswith(client_id + "-")


#: A served request resumed by a restarted engine (``ftkit.vllm.restart``) has the id of the
#: original with ``+ftkit<offset>`` appended (then vLLM's own ``-<8 hex>``).
_SERVED_RESUMED_RE = re.compile(r"\+ftkit(?P<offset>\d+)(?:-[0-9a-fA-F]+)?$")


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
    m = _SERVED_RESUMED_RE.search(req_id)
    return int(m.group("offset")) if m else 0
