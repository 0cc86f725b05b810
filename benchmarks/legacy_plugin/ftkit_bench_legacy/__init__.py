"""Benchmark only: the fault-free per-step costs of the earlier recovery design for vLLM-Ascend.

This is not part of ftkit and never ships with it. ``make bench`` installs it into the
virtual environment so that ``benchmarks/overhead.py`` can run a plain vLLM engine that pays,
on every step, what the earlier design (an unmerged vllm-ascend pull request) paid:

* a full copy of the persistent batch's token-id table (``max_num_seqs x max_model_len``
  int32), twice per step: before ``execute_model`` and before ``sample_tokens``;
* a world-wide all-gather of a status tensor (on the world group's gloo group) and a device
  synchronise, once per step, before ``execute_model``;
* a monitor thread that wakes once a second to look for faults.

It does nothing unless the engine's ``additional_config`` has the key ``ftkit_bench_legacy``
(a mapping; ``{"poll_s": 1.0}`` sets the monitor's period). It coexists with ftkit's own
plugin: both wrap ``WorkerBase.__init__`` and then the step methods of the worker instance,
each only for its own key. ``ftkit_bench_legacy_stats`` (reached through ``collective_rpc``)
tells what it did, so a benchmark can prove the costs were paid.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

KEY = "ftkit_bench_legacy"
#: Marks this plugin's wrapper of ``WorkerBase.__init__`` (ftkit uses a mark of its own).
_MARK = "__ftkit_bench_legacy_wrapped__"


def register() -> None:
    """vLLM general plugin entry point: idempotent, in every vLLM process.

    The same hook as ftkit's own plugin (``ftkit.vllm.plugin.register``), written out here on
    purpose: this package must not depend on ftkit's internals, which it is measured against.
    """
    from vllm.v1.worker import worker_base

    original = worker_base.WorkerBase.__init__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, *args, **kwargs)
        install(self, vllm_config)

    setattr(__init__, _MARK, True)
    worker_base.WorkerBase.__init__ = __init__


def install(worker: Any, vllm_config: Any) -> LegacyStepCosts | None:
    """Wrap ``worker``'s step methods if the engine asked for the legacy costs."""
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(KEY)
    if raw is None or getattr(worker, "_ftkit_bench_legacy", None) is not None:
        return None
    costs = LegacyStepCosts(worker, poll_s=float(dict(raw).get("poll_s", 1.0)))
    worker._ftkit_bench_legacy = costs
    for name in ("execute_model", "sample_tokens"):
        inner = getattr(worker, name)
        setattr(worker, name, functools.partial(getattr(costs, name), inner))
    worker.ftkit_bench_legacy_stats = costs.stats
    return costs


class LegacyStepCosts:
    def __init__(self, worker: Any, poll_s: float) -> None:
        self.worker = worker
        self.poll_s = poll_s
        self.copies = 0
        self.copied_bytes = 0
        self.gathers = 0
        self.polls = 0
        self._monitor: threading.Thread | None = None
        self._stop = threading.Event()
        self._snapshot: Any = None
        #: What the earlier design's monitor looked at once a second.
        self.fault_reported = threading.Event()

    # --- the wrapped step methods -------------------------------------------------------------

    def execute_model(self, inner: Any, scheduler_output: Any) -> Any:
        self._start_monitor()
        self._copy_token_table()
        self._barrier()
        return inner(scheduler_output)

    def sample_tokens(self, inner: Any, grammar_output: Any) -> Any:
        self._copy_token_table()
        return inner(grammar_output)

    def stats(self) -> dict[str, Any]:
        return {"copies": self.copies, "copied_bytes": self.copied_bytes,
                "gathers": self.gathers, "polls": self.polls,
                "monitor_alive": bool(self._monitor and self._monitor.is_alive())}

    # --- the costs ----------------------------------------------------------------------------

    def _copy_token_table(self) -> None:
        table = self.worker.model_runner.input_batch.token_ids_cpu_tensor
        self._snapshot = table.clone()
        self.copies += 1
        self.copied_bytes += table.numel() * table.element_size()

    def _barrier(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            from vllm.distributed.parallel_state import get_world_group

            group = get_world_group().cpu_group
            status = torch.zeros(1, dtype=torch.int64)
            gathered = [torch.empty_like(status) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, status, group=group)
            self.gathers += 1
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        else:
            torch.cpu.synchronize()

    def _start_monitor(self) -> None:
        if self._monitor is not None:
            return
        self._monitor = threading.Thread(target=self._poll, name="legacy-monitor", daemon=True)
        self._monitor.start()

    def _poll(self) -> None:
        # The earlier design's monitor: wake up every poll_s, look at the status, sleep again.
        while not self._stop.wait(self.poll_s):
            self.polls += 1
            if self.fault_reported.is_set():
                return
