"""The kind-specific ``params`` of a fault, parsed by its kind's strict model.

Each kind's model is registered with the kind (``ftkit.kinds``, e.g. ``UceParams`` in
``ftkit.kinds.uce``). The scenario rules validate a fault's ``params`` against it (unknown keys
and wrong types are errors with the field path ``faults[i].params.<key>``); the injector reads
them through the same models, so the defaults live there only.
"""

from __future__ import annotations

from typing import Any

from ftkit.faults import FaultKind
from ftkit.kinds import kind_spec


def params_model(kind: FaultKind) -> Any:
    """The pydantic model of ``kind``'s params."""
    return kind_spec(kind).params


def parse_params(kind: FaultKind, raw: dict[str, Any] | None) -> Any:
    """The params of a fault of ``kind``, defaults filled in; raises pydantic's
    ``ValidationError`` for bad ones."""
    return params_model(kind).model_validate(dict(raw or {}))
