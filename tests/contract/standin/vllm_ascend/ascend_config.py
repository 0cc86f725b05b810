"""``vllm_ascend.ascend_config`` as recent releases have it, reduced to what the ftkit plugin
meets: ``init_ascend_config(vllm_config)`` builds the Ascend configuration from
``vllm_config.additional_config`` and rejects every key it does not know (vllm-ascend's
``AscendConfig`` is a pydantic dataclass with ``extra="forbid"``)."""

from __future__ import annotations

from typing import Any

#: A few of the keys vllm-ascend knows (the real class has many more).
KNOWN_KEYS = frozenset({"refresh", "enable_cpu_binding", "weight_nz_mode",
                        "ft_communication_abort_timeout", "ascend_compilation_config"})


class AscendConfig:
    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"1 validation error for AscendConfig: {unknown[0]}: Extra "
                             "inputs are not permitted")
        self.__dict__.update(kwargs)


def init_ascend_config(vllm_config: Any) -> AscendConfig:
    additional_config = vllm_config.additional_config or {}
    return AscendConfig(**{k: v for k, v in additional_config.items() if k != "refresh"})
