"""Contract tests of the hardware backends: the torch_npu stand-in (``standin/``), loaded in
place of torch_npu, and the CUDA backend's torch APIs exercised on gloo.

``load_torch_npu(restart_signature=..., missing=...)`` imports the stand-in into this process
as ``torch_npu`` for one test and takes it (and the ``reinit_process_group`` it patches into
``torch.distributed``) away afterwards, so no other test sees a torch_npu.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

STANDIN_DIR = Path(__file__).resolve().parent / "standin"
# The multi-process rig (tests/multiprocess/_harness.py) serves these tests too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiprocess"))


def _torch_npu_modules() -> dict[str, Any]:
    return {k: v for k, v in sys.modules.items() if k == "torch_npu" or k.startswith("torch_npu.")}


@pytest.fixture
def load_torch_npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    saved = _torch_npu_modules()
    had_reinit = hasattr(dist, "reinit_process_group")
    saved_reinit = getattr(dist, "reinit_process_group", None)

    def load(restart_signature: str = "new", missing: tuple[str, ...] = ()) -> Any:
        for name in _torch_npu_modules():
            del sys.modules[name]
        monkeypatch.setenv("FTKIT_STANDIN_RESTART_SIGNATURE", restart_signature)
        monkeypatch.setenv("FTKIT_STANDIN_MISSING", ",".join(missing))
        sys.path.insert(0, str(STANDIN_DIR))
        try:
            module = importlib.import_module("torch_npu")
        finally:
            sys.path.remove(str(STANDIN_DIR))
        assert module.__file__.startswith(str(STANDIN_DIR))
        module._standin.reset()
        return module

    yield load
    for name in _torch_npu_modules():
        del sys.modules[name]
    sys.modules.update(saved)
    if had_reinit:
        dist.reinit_process_group = saved_reinit
    elif hasattr(dist, "reinit_process_group"):
        del dist.reinit_process_group
