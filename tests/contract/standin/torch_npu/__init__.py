"""A stand-in for the parts of torch_npu that ftkit uses, for the contract tests.

No NPU is attached to the machines ftkit is built on. This package takes torch_npu's place
(it is put first on ``sys.path`` of a test's rank processes, or into ``sys.modules`` of an
in-process test) and behaves as torch_npu's documentation and source say, on a simulated
device whose HCCL is real gloo (``_standin``):

* ``torch_npu.npu.stop_device(device_id)`` returns 0; device work then raises
  ``RuntimeError("FORCE STOP." ...)`` (torch_npu/utils/_error_code.py), a collective that was
  blocked included, and every HCCL communicator of the device is suspended (watchdog stop);
* ``torch_npu.npu.restart_device(...)`` clears the stop and repairs reported memory errors;
  with ``rebuild_all_resources=True`` and without ``disable_tensor_unsafe_check=True`` it
  marks every tensor unsafe. Its signature is the newer ``(device_id,
  rebuild_all_resources=False, disable_tensor_unsafe_check=False)`` or, with the environment
  variable ``FTKIT_STANDIN_RESTART_SIGNATURE=old``, the older ``(device_id,
  rebuild_all_resources=False)``;
* ``torch.distributed.reinit_process_group(group=None, rebuild_link=True)`` is patched in on
  import, as torch_npu does: ``rebuild_link=False`` resumes the HCCL communicators of every
  group torch knows on the calling thread's current device; ``True`` aborts the communicator
  of ``group`` (the default group when ``None``), which is built again at its next use;
  gloo groups are left alone;
* ``check_uce_in_memory(device_id)`` and ``utils._get_uce_addr()`` report the memory errors
  a test injected (``_standin.inject_uce``) as ``[{"ptr": ..., "size": ...}]``;
* ``set_op_timeout_ms(ms)`` is recorded; ``get_rng_state`` / ``set_rng_state`` act on a
  generator of the simulated device; ``set_device`` / ``current_device`` are per thread, as
  on the real device;
* an ``hccl`` group answers ``_get_backend(device).get_hccl_comm_name(rankid, init_comm=True)``
  with its communicator's name, and takes ``all_to_all_single`` and
  ``all_gather_into_tensor`` (vllm-ascend's all-to-all MoE dispatch); the fused
  ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2`` find their EP
  communicator by that name (``_moe``; a name from before a link rebuild no longer resolves).

``FTKIT_STANDIN_MISSING`` (comma-separated names) leaves APIs out, as an older release would:
names of ``torch_npu.npu`` functions, ``_get_uce_addr``, or ``reinit_process_group``.
Every call is recorded in ``torch_npu._standin.DEVICE.calls``.
"""

__version__ = "2.14.0+ftkit.standin"

from torch_npu import _standin, npu  # noqa: E402
from torch_npu._moe import (  # noqa: E402
    npu_moe_distribute_combine_v2,
    npu_moe_distribute_dispatch_v2,
)

_standin.install()

__all__ = ["npu", "npu_moe_distribute_combine_v2", "npu_moe_distribute_dispatch_v2",
           "__version__"]
