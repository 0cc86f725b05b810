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
