"""Run in a child process by the integration tests: one workload on engines of its own
(plain, or ftkit's with a fault plan, optionally with one repair switched off), so that
a test can use engine settings, environment and patches the session's shared engines do not
have.

Usage: ``_feature_run.py CONFIG_JSON``. CONFIG keys: model, engine_args, tensor_parallel_size
(default 1), nodes (the Ray nodes, default 1), ray_address (a Ray cluster to join), multiprocess (the engine core in a process of its own; default: at tensor
parallel 2 and more), env (environment variables set before the first engine starts), event_log_dir,
prompts, sampling (``SamplingSpec.to_mapping()``), submit_after_steps, and runs: a list of
``{"name", "recovery" (bool), "faults" (``FaultSpec`` dicts), "cripple" (a name of
``CRIPPLES``, a list of them switched off together, or null; most patch this process only, so
not the workers of a multi-process engine; those of ``EVERYWHERE`` also reach every process the
engine starts), "max_restarts" (engine restarts after a process died, default 0), "transports" (also return
each rank's collectives by path, ``ftkit_transport_counts``), "listening" (also return
the TCP sockets every process below this one listens on after the run, ``procs.listening``),
"workload"
(optional: any of CONFIG's keys above but env, for this run)}``, run one after the other, each
on an engine of its own (its cripples are undone after its run). Prints one
``RESULT <json>`` line: per run name, every completion's tokens, logprobs, finish and stop
reason and text, the run's error, its engine restarts, the lost KV recomputed (per rank) and, for a single-process engine, what its
scheduler did (``schedule``: the requests preempted, the tokens each request found in the
prefix cache when it was first scheduled, and the steps that prefilled several requests).
"""

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ftkit import procs
from ftkit.config import RecoveryConfig
from ftkit.contracts.eventlog import KvRecomputed, only, read_events
from ftkit.contracts.job import SamplingSpec
from ftkit.contracts.plan import FaultPlan
from ftkit.contracts.requests import parse_request_id
from ftkit.scenario import EngineSpec, FaultSpec
from ftkit.vllm.engine import EngineSession
from ftkit.vllm import kv_recompute, workload
from ftkit.vllm.kv_recompute import KvRecompute


def _patch(owner: Any, name: str, value: Any) -> Callable[[], None]:
    saved = owner.__dict__[name]
    setattr(owner, name, value)
    return lambda: setattr(owner, name, saved)


def _no_prefix_hits() -> Callable[[], None]:
    """Requests that reuse prefix-cached blocks are never recomputed."""
    find = KvRecompute._find_work

    def find_work(self, scheduler_output):
        work, seen = find(self, scheduler_output)
        return [w for w in work if w.new is None], seen

    return _patch(KvRecompute, "_find_work", find_work)


def _batch_in_scheduler_order() -> Callable[[], None]:
    """After the recompute passes the batch is left empty, as before ftkit kept its rows:
    the step re-adds them in the scheduler's order, not in vLLM's."""
    return _patch(kv_recompute, "lay_out",
                  lambda runner, req_ids: kv_recompute.empty_batch(runner.input_batch))


def _resumed_text_from_the_new_engine() -> Callable[[], None]:
    """A resumed request's stop strings and text are the new engine's alone, as before the
    front end fed its original request's detokenizer the whole stream (``_Shadow``)."""
    def params(self, index, produced=0, sample=None):
        from vllm import SamplingParams

        kwargs = self.sampling.for_request(index)
        if sample is not None:  # one completion of several, as ``Workload.params`` has it
            kwargs["n"] = 1
            if kwargs.get("seed") is not None:
                kwargs["seed"] = int(kwargs["seed"]) + sample
        if produced:
            kwargs["max_tokens"] = int(kwargs["max_tokens"]) - produced
        kwargs.setdefault("logprobs", 0)
        return SamplingParams(**kwargs)

    undo_params = _patch(workload.Workload, "params", params)
    undo_shadow = _patch(workload, "_Shadow", lambda *args: None)
    return lambda: (undo_params(), undo_shadow())


def _one_seed_for_every_sample() -> Callable[[], None]:
    """A resumed completion of a request with ``n > 1`` keeps the request's own seed, not the
    seed vLLM gives that completion (the request's seed plus its sample index)."""
    params = workload.Workload.params

    def same_seed(self, index, produced=0, sample=None):
        return params(self, index, produced, None if sample is None else 0)

    return _patch(workload.Workload, "params", same_seed)


#: Repairs switched off in every process of the engine, workers of every rank included:
#: name -> (code, the ``(module, class or None, attribute)`` it replaces). The code is loaded
#: as ``sitecustomize`` by every process the engine starts (they inherit ``PYTHONPATH``) and
#: run in this one too (an engine in this process); this process's attributes are put back
#: after the run.
EVERYWHERE: dict[str, tuple[str, list[tuple[str, str | None, str]]]] = {
    # Rollback of execute_model: block ids, new requests, the batch stay as the attempt left.
    "no_rollback_execute": ("""\
from ftkit.vllm import runner_state
runner_state.V1RunnerState.rollback_execute = lambda self, scheduler_output: None
""", [("ftkit.vllm.runner_state", "V1RunnerState", "rollback_execute")]),
    # Rollback of sample_tokens: neither generators nor output tokens are put back.
    "no_rollback_sample": ("""\
from ftkit.vllm import runner_state
runner_state.V1RunnerState.rollback_sample = lambda self, record: None
""", [("ftkit.vllm.runner_state", "V1RunnerState", "rollback_sample")]),
    # The generators' states are not recorded, so a rolled-back sampling does not restore
    # them (the rest of the sample rollback is intact).
    "no_generator_restore": ("""\
from ftkit.vllm import runner_state
_begin = runner_state.V1RunnerState.begin_sample
def _begin_without_generators(self, scheduler_output):
    record = _begin(self, scheduler_output)
    record.generators = ()
    return record
runner_state.V1RunnerState.begin_sample = _begin_without_generators
""", [("ftkit.vllm.runner_state", "V1RunnerState", "begin_sample")]),
    # The persistent batch is never emptied: not by a rollback, not after a round.
    "no_batch_reset": ("""\
from ftkit.vllm import runner_state
runner_state.V1RunnerState.reset_batch = lambda self: None
""", [("ftkit.vllm.runner_state", "V1RunnerState", "reset_batch")]),
    # Lost KV is not recomputed.
    "no_kv_recompute": ("""\
from ftkit.vllm import kv_recompute
kv_recompute.KvRecompute.run = lambda self, scheduler_output, call: None
""", [("ftkit.vllm.kv_recompute", "KvRecompute", "run")]),
    # Lost KV is recomputed by prefills alone, of the positions its request had decoded too.
    "decodes_prefilled": ("""\
from ftkit.vllm import kv_recompute
kv_recompute._prefilled = lambda req_id, prompt_token_ids, prompt_embeds: 1 << 30
""", [("ftkit.vllm.kv_recompute", None, "_prefilled")]),
    # A resumed request's prompt is prefilled as vLLM schedules it, the tokens it had decoded
    # before the engine died included.
    "resume_prefilled": ("""\
from ftkit.vllm import kv_recompute
kv_recompute.ResumedPrefill.rewrite = lambda self, scheduler_output: (scheduler_output, [])
""", [("ftkit.vllm.kv_recompute", "ResumedPrefill", "rewrite")]),
    # A forward pass that a peer completed is not re-run with the failed one: only a failed
    # sampling makes every rank re-run its step (as before pipeline parallelism).
    "no_forward_replay": ("""\
from ftkit.contracts.step import RpcKind
from ftkit.recovery import coordinator
def _sampling_replay_only(statuses):
    sampling = [s for s in statuses if s.reruns and s.rpc_kind is RpcKind.SAMPLE]
    if not sampling:
        return None
    first = min(sampling, key=lambda s: s.rpc)
    return coordinator.Replay(rpc=first.rpc - 1, step=first.step)
coordinator.replay_point = _sampling_replay_only
""", [("ftkit.recovery.coordinator", None, "replay_point")]),
    # Weights hit by a memory error are not reloaded.
    "no_reload": ("""\
from ftkit.vllm import memory
memory.RunnerMemory.reload_params = lambda self, names: []
""", [("ftkit.vllm.memory", "RunnerMemory", "reload_params")]),
    # Penalties and bad words of a resumed request count only what it produced after the
    # resume (the sampler is not shown its earlier tokens: ``show_earlier_outputs``).
    "earlier_outputs": ("""\
from ftkit.vllm import worker
worker.show_earlier_outputs = lambda runner: None
""", [("ftkit.vllm.worker", None, "show_earlier_outputs")]),
    # A resumed seeded request's generator starts from its seed again.
    "no_fast_forward": ("""\
from ftkit.vllm import runner_state
runner_state.fast_forward = lambda runner, done: []
""", [("ftkit.vllm.runner_state", None, "fast_forward")]),
}


def _everywhere(*names: str) -> Callable[[], None]:
    """Switch off the repairs ``names`` of ``EVERYWHERE`` together: their codes, one after the
    other, make one ``sitecustomize``; the undo puts every attribute back."""
    import importlib
    import tempfile

    code = "".join(EVERYWHERE[name][0] for name in names)
    saved_attrs = []
    for name in names:
        for module, owner, attr in EVERYWHERE[name][1]:
            obj = importlib.import_module(module)
            if owner is not None:
                obj = getattr(obj, owner)
            saved_attrs.append((obj, attr, obj.__dict__[attr]))
    patch_dir = tempfile.mkdtemp(prefix="ftkit-cripple-")
    Path(patch_dir, "sitecustomize.py").write_text(code)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = patch_dir + (os.pathsep + saved if saved else "")
    label = "+".join(names)
    exec(compile(code, f"<cripple {label}>", "exec"), {"__name__": f"_cripple_{label}"})

    def undo() -> None:
        for obj, attr, value in reversed(saved_attrs):
            setattr(obj, attr, value)
        shutil.rmtree(patch_dir, ignore_errors=True)
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved

    return undo


def _resume_from_the_prompt_alone() -> Callable[[], None]:
    """A resumed request is submitted again with its original prompt only: the tokens it had
    produced are dropped (its id and budgets still count them)."""
    from vllm.inputs import TokensPrompt

    resume_sample = workload.Workload._resume_sample

    class _Engine:
        def __init__(self, engine: Any, prompt_ids: list[int]) -> None:
            self._engine, self._prompt_ids = engine, prompt_ids

        def add_request(self, rid, prompt, params):
            return self._engine.add_request(
                rid, TokensPrompt(prompt_token_ids=self._prompt_ids), params)

        def __getattr__(self, name):
            return getattr(self._engine, name)

    def without_tokens(self, engine, req, several):
        return resume_sample(self, _Engine(engine, list(self.prompt_token_ids[req.index])),
                             req, several)

    return _patch(workload.Workload, "_resume_sample", without_tokens)


def _no_revive() -> Callable[[], None]:
    """A lost Ray node is not started again before the engine that replaces the dead one
    (whose ranks then find no place: a short bound on that wait)."""
    from ftkit.bounds import RAY_PLACEMENT_TIMEOUT_ENV
    from ftkit.vllm.ray_cluster import RayCluster

    saved = os.environ.get(RAY_PLACEMENT_TIMEOUT_ENV)
    os.environ[RAY_PLACEMENT_TIMEOUT_ENV] = "10"
    undo_revive = _patch(RayCluster, "revive", lambda self: [])

    def undo() -> None:
        undo_revive()
        if saved is None:
            os.environ.pop(RAY_PLACEMENT_TIMEOUT_ENV, None)
        else:
            os.environ[RAY_PLACEMENT_TIMEOUT_ENV] = saved

    return undo


#: A repair switched off: name -> patch (returns its undo).
CRIPPLES: dict[str, Callable[[], Callable[[], None]]] = {
    **{name: (lambda name=name: _everywhere(name)) for name in EVERYWHERE},
    "resume_prompt_only": _resume_from_the_prompt_alone,
    "kv": lambda: _patch(KvRecompute, "run", lambda self, scheduler_output, call: None),
    "prefix": _no_prefix_hits,
    "layout": _batch_in_scheduler_order,
    "shadow": _resumed_text_from_the_new_engine,
    "child_seed": _one_seed_for_every_sample,
    "no_revive": _no_revive,
}


class _ScheduleSpy:
    """What vLLM's scheduler decided, seen from its ``schedule()`` outputs."""

    def __init__(self, engine: EngineSession) -> None:
        #: [request index, its output tokens] per preemption.
        self.preempted: list[list[int]] = []
        self.prefix_hits: dict[int, int] = {}
        #: Per step that prefilled several requests: their indices.
        self.joint_prefills: list[list[int]] = []
        core = getattr(engine.llm.llm_engine.engine_core, "engine_core", None)
        self.active = core is not None
        if not self.active:
            return  # the scheduler lives in another process
        scheduler = core.scheduler
        schedule = scheduler.schedule

        def spied(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            for req_id in out.preempted_req_ids or ():
                request = scheduler.requests[req_id]
                self.preempted.append([self._index(req_id), request.num_output_tokens])
            for new in out.scheduled_new_reqs:
                index = self._index(new.req_id)
                if index not in self.prefix_hits:
                    self.prefix_hits[index] = new.num_computed_tokens
            # (``schedule()`` already counts the tokens it scheduled as computed.)
            prefilling = [self._index(r) for r, n in out.num_scheduled_tokens.items()
                          if scheduler.requests[r].num_computed_tokens - n
                          < scheduler.requests[r].num_prompt_tokens]
            if len(prefilling) > 1:
                self.joint_prefills.append(prefilling)
            return out

        scheduler.schedule = spied

    @staticmethod
    def _index(req_id: str) -> int:
        ref = parse_request_id(req_id)
        return ref.index if ref is not None else -1

    def to_mapping(self) -> dict | None:
        if not self.active:
            return None
        return {"preempted": self.preempted,
                "prefix_hits": {str(k): v for k, v in sorted(self.prefix_hits.items())},
                "joint_prefills": self.joint_prefills}


def run(config: dict, plan: dict) -> dict:
    config = {**config, **plan.get("workload", {})}
    spec = EngineSpec(model=config["model"], args=config.get("engine_args", {}),
                      tensor_parallel_size=config.get("tensor_parallel_size", 1),
                      nodes=config.get("nodes", 1), ray_address=config.get("ray_address"))
    config.setdefault("multiprocess", None)
    undo = _cripple(plan.get("cripple"))
    try:
        return _run(config, spec, plan)
    finally:
        undo()


def _cripple(names: str | list[str] | None) -> Callable[[], None]:
    """Switch off the repairs ``names`` (one name of ``CRIPPLES``, a list of them, or none);
    return the undo of them all. Those of ``EVERYWHERE`` share one ``sitecustomize``."""
    names = [names] if isinstance(names, str) else list(names or ())
    unknown = [name for name in names if name not in CRIPPLES]
    if unknown or len(set(names)) < len(names):
        raise ValueError(f"cripples unknown or repeated: {names}")
    with contextlib.ExitStack() as undos:  # on a failure, what was switched off goes back
        everywhere = [name for name in names if name in EVERYWHERE]
        if everywhere:
            undos.callback(_everywhere(*everywhere))
        for name in names:
            if name not in EVERYWHERE:
                undos.callback(CRIPPLES[name]())
        return undos.pop_all().close  # undone in reverse order


def _run(config: dict, spec: EngineSpec, plan: dict) -> dict:
    recovery = None
    if plan["recovery"]:
        recovery = RecoveryConfig(enabled=True, max_reinference=3,
                                  event_log_dir=config["event_log_dir"])
    faults = [FaultSpec.model_validate(f) for f in plan.get("faults", [])]
    with EngineSession(spec, recovery=recovery, multiprocess=config["multiprocess"]) as engine:
        spy = _ScheduleSpy(engine)
        run_id = engine.new_run_id()
        if recovery is not None:
            engine.set_fault_plan(FaultPlan.from_specs(run_id, faults))
        out = engine.generate(config["prompts"], SamplingSpec.from_mapping(config["sampling"]),
                              run_id=run_id, submit_after_steps=config.get("submit_after_steps"),
                              max_restarts=plan.get("max_restarts", 0))
        transports = None
        if plan.get("transports") and out.error is None:
            transports = engine.llm.collective_rpc("ftkit_transport_counts")
        # Every process below this one, the engine's and its Ray cluster's, still running.
        listening = procs.listening(procs.descendants(psutil.Process())) \
            if plan.get("listening") else None
    kv = []
    if recovery is not None:
        kv = [{"rank": e.rank, "requests": e.requests, "tokens": e.tokens}
              for e in only(read_events(config["event_log_dir"]), KvRecomputed)]
    return {"error": out.error,
            "outputs": [{"key": list(r.key), "tokens": r.token_ids, "logprobs": r.logprobs,
                         "finish_reason": r.finish_reason, "stop_reason": r.stop_reason,
                         "text": r.text} for r in out.requests],
            "restarts": len(out.restarts), "transports": transports, "listening": listening,
            "kv": kv, "schedule": spy.to_mapping()}


def main() -> None:
    config = json.loads(sys.argv[1])
    os.environ.update(config.get("env", {}))
    results = {}
    for plan in config["runs"]:
        results[plan["name"]] = run(config, plan)
        # The next run reads only its own events.
        for path in Path(config["event_log_dir"]).glob("*"):
            path.unlink()
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
