"""The kind-specific ``params`` of a fault, one strict model per kind.

The scenario rules validate a fault's ``params`` against its kind's model (unknown keys and
wrong types are errors with the field path ``faults[i].params.<key>``); the injector reads
them through the same models, so the defaults live here only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ftkit.faults import FaultKind


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class NoParams(_Params):
    """This kind takes no params."""


class UceParams(_Params):
    region: Literal["kv", "weights", "activation"] = Field(
        "kv", description="what the error hits: KV cache blocks of the fault's request, a "
                          "model parameter, or an activation buffer of the step")
    parameter: str | None = Field(
        None, min_length=1, description="region weights: the parameter hit (default: the "
                                        "model's final norm weight)")


class HangParams(_Params):
    op_timeout_s: float = Field(
        2.0, gt=0, le=600, description="the operator timeout that ends the hung operator "
                                       "(torch_npu's set_op_timeout_ms on Ascend)")


class ProcessKillParams(_Params):
    target: Literal["rank", "engine"] = Field(
        "rank", description="rank: SIGKILL the worker process of the fault's rank; engine: "
                            "SIGKILL the engine core process")


PARAMS: dict[FaultKind, type[_Params]] = {
    FaultKind.LINK_BREAK: NoParams,
    FaultKind.LINK_FLAP: NoParams,
    FaultKind.DEVICE_RESET: NoParams,
    FaultKind.UCE: UceParams,
    FaultKind.HANG: HangParams,
    FaultKind.OOM: NoParams,
    FaultKind.PROCESS_KILL: ProcessKillParams,
}


def parse_params(kind: FaultKind, raw: dict[str, Any] | None) -> Any:
    """The params of a fault of ``kind``, defaults filled in; raises pydantic's
    ``ValidationError`` for bad ones."""
    return PARAMS[kind].model_validate(dict(raw or {}))
