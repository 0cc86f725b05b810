"""vLLM's own judgement of one request's sampling fields, for scenario validation.

``ftkit.scenario.rules`` asks here whether vLLM accepts each request's ``SamplingParams``
fields, so that a scenario is refused with its file, line and field when it is validated, not
when its run starts. This module imports vLLM only when asked, and nothing of ftkit.

What a caller may rely on: both functions answer ``None`` when vLLM cannot be imported
(a machine with only the scenario tools): validation then rests on the scenario models' type
checks, and vLLM judges the values when the engine starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Refusal:
    """vLLM refused a request's fields: ``field`` is the one its error is about (``None`` if
    it names none of the fields given) and ``message`` vLLM's own words."""

    field: str | None
    message: str


def sampling_param_names() -> frozenset[str] | None:
    """The field names of vLLM's ``SamplingParams`` (a msgspec struct)."""
    params = _sampling_params()
    return None if params is None else frozenset(params.__struct_fields__)


def refusal(kwargs: dict[str, Any]) -> Refusal | None:
    """Why ``SamplingParams(**kwargs)`` fails, or ``None`` when vLLM accepts it (or is not
    installed). Unknown names are the caller's to check (``sampling_param_names``)."""
    params = _sampling_params()
    if params is None:
        return None
    from vllm.exceptions import VLLMValidationError

    try:
        params(**kwargs)
    except (VLLMValidationError, ValueError, TypeError) as exc:
        message = str(exc.args[0]) if exc.args else str(exc)
        return Refusal(_blamed_field(exc, message, kwargs), message)
    return None


def default_max_logprobs() -> int | None:
    """vLLM's default bound on the logprobs a request may ask for (``--max-logprobs``)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return None
    return int(EngineArgs.max_logprobs)


def _sampling_params() -> Any:
    try:
        from vllm.sampling_params import SamplingParams
    except ImportError:
        return None
    return SamplingParams


def _blamed_field(exc: Exception, message: str, kwargs: dict[str, Any]) -> str | None:
    """The field an error is about: the one vLLM names (``VLLMValidationError.parameter``),
    or else the field its message names first ("min_tokens must be less than or equal to
    max_tokens=8")."""
    named = getattr(exc, "parameter", None)
    if named in kwargs:
        return named
    hits = [(found.start(), name) for name in kwargs
            if (found := re.search(rf"\b{re.escape(name)}\b", message))]
    return min(hits)[1] if hits else None
