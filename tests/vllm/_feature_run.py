"""Run in a child process by the integration tests: one workload on engines of its own
(plain, or ftkit's with a fault plan, optionally with repairs switched off), so that a test can
use engine settings, environment and patches the session's shared engines do not have.

Usage: ``_feature_run.py CONFIG_JSON``. CONFIG keys: model, engine_args, tensor_parallel_size
(default 1), nodes (the Ray nodes, default 1), ray_address (a Ray cluster to join),
multiprocess (the engine core in a process of its own; default: at tensor parallel 2 and
more), env (environment variables set before the first engine starts), event_log_dir, prompts,
sampling (``SamplingSpec.to_mapping()``), submit_after_steps, and runs: a list of ``{"name",
"recovery" (bool), "faults" (``FaultSpec`` dicts), "cripple" (a name of ``CRIPPLES`` or
``EVERYWHERE``, a list of them switched off together, or null; those of ``CRIPPLES`` patch
this process only, so not the workers of a multi-process engine; those of ``EVERYWHERE`` reach
every process the engines start), "max_restarts" (engine restarts after a process died,
default 0), "transports" (also return each rank's collectives by path,
``ftkit_transport_counts``), "listening" (also return the TCP sockets every process below this
one listens on after the run, ``procs.listening``), "fresh_engine" (start a new engine even if
the last run's fits), "workload" (optional: any of CONFIG's keys above but env, for this
run)}``, run one after the other. A run uses the last run's engine where that one fits and
was left whole (``_Engines``), else an engine of its own; its cripples are undone after it.

Prints one ``RESULT <json>`` line: per run name, every completion's tokens, logprobs, finish
and stop reason and text, the run's error, its engine restarts, the lost KV recomputed (per
rank), its seconds (its engine's start included) and, for a single-process engine, what its
scheduler did (``schedule``: the requests preempted, the tokens each request found in the
prefix cache when it was first scheduled, and the steps that prefilled several requests); and
under ``ENGINE_STARTS`` the number of engines started, restarts included.
"""

import contextlib
import json
import os
import shutil
import sys
import time
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
#: name -> code that replaces one attribute through ``_switch(owner, attribute, name,
#: make)``, ``make(original)`` giving the crippled one. ``_switches`` joins the codes of a
#: child's cripples into one ``sitecustomize``, loaded by every process the engines start
#: (they inherit ``PYTHONPATH``) and run in this one too (an engine in this process). Each
#: replaced attribute calls the crippled code only while its name is in the switch file
#: (``SWITCH_FILE_ENV``), which this process rewrites before each run: one engine can serve
#: runs with different repairs switched off.
EVERYWHERE: dict[str, str] = {
    # Rollback of execute_model: block ids, new requests, the batch stay as the attempt left.
    "no_rollback_execute": """\
from ftkit.vllm import runner_state
_switch(runner_state.V1RunnerState, "rollback_execute", "no_rollback_execute",
        lambda original: lambda self, scheduler_output: None)
""",
    # Rollback of sample_tokens: neither generators nor output tokens are put back.
    "no_rollback_sample": """\
from ftkit.vllm import runner_state
_switch(runner_state.V1RunnerState, "rollback_sample", "no_rollback_sample",
        lambda original: lambda self, record: None)
""",
    # The generators' states are not recorded, so a rolled-back sampling does not restore
    # them (the rest of the sample rollback is intact).
    "no_generator_restore": """\
from ftkit.vllm import runner_state
def _begin_without_generators(begin):
    def begin_sample(self, scheduler_output):
        record = begin(self, scheduler_output)
        record.generators = ()
        return record
    return begin_sample
_switch(runner_state.V1RunnerState, "begin_sample", "no_generator_restore",
        _begin_without_generators)
""",
    # The persistent batch is never emptied: not by a rollback, not after a round.
    "no_batch_reset": """\
from ftkit.vllm import runner_state
_switch(runner_state.V1RunnerState, "reset_batch", "no_batch_reset",
        lambda original: lambda self: None)
""",
    # Lost KV is not recomputed.
    "no_kv_recompute": """\
from ftkit.vllm import kv_recompute
_switch(kv_recompute.KvRecompute, "run", "no_kv_recompute",
        lambda original: lambda self, scheduler_output, call: None)
""",
    # Lost KV is recomputed by prefills alone, of the positions its request had decoded too.
    "decodes_prefilled": """\
from ftkit.vllm import kv_recompute
_switch(kv_recompute, "_prefilled", "decodes_prefilled",
        lambda original: lambda req_id, prompt_token_ids, prompt_embeds: 1 << 30)
""",
    # A resumed request's prompt is prefilled as vLLM schedules it, the tokens it had decoded
    # before the engine died included.
    "resume_prefilled": """\
from ftkit.vllm import kv_recompute
_switch(kv_recompute.ResumedPrefill, "rewrite", "resume_prefilled",
        lambda original: lambda self, scheduler_output: (scheduler_output, []))
""",
    # A forward pass that a peer completed is not re-run with the failed one: only a failed
    # sampling makes every rank re-run its step (as before pipeline parallelism).
    "no_forward_replay": """\
from ftkit.contracts.step import RpcKind
from ftkit.recovery import coordinator
def _sampling_replay_only(original):
    def replay_point(statuses):
        sampling = [s for s in statuses if s.reruns and s.rpc_kind is RpcKind.SAMPLE]
        if not sampling:
            return None
        first = min(sampling, key=lambda s: s.rpc)
        return coordinator.Replay(rpc=first.rpc - 1, step=first.step)
    return replay_point
_switch(coordinator, "replay_point", "no_forward_replay", _sampling_replay_only)
""",
    # Weights hit by a memory error are not reloaded.
    "no_reload": """\
from ftkit.vllm import memory
_switch(memory.RunnerMemory, "reload_params", "no_reload",
        lambda original: lambda self, names: [])
""",
    # Penalties and bad words of a resumed request count only what it produced after the
    # resume (the sampler is not shown its earlier tokens: ``show_earlier_outputs``).
    "earlier_outputs": """\
from ftkit.vllm import worker
_switch(worker, "show_earlier_outputs", "earlier_outputs", lambda original: lambda runner: None)
""",
    # A resumed seeded request's generator starts from its seed again.
    "no_fast_forward": """\
from ftkit.vllm import runner_state
_switch(runner_state, "fast_forward", "no_fast_forward",
        lambda original: lambda runner, done: [])
""",
}
#: Names the file whose words are the ``EVERYWHERE`` cripples switched on (see there).
SWITCH_FILE_ENV = "FTKIT_TEST_CRIPPLES_ON"
#: What every ``sitecustomize`` of ``_switches`` begins with.
_SWITCH = """\
import os as _os


def _on(name):
    try:
        with open(_os.environ["%s"], encoding="utf-8") as f:
            return name in f.read().split()
    except (KeyError, OSError):
        return False


def _switch(owner, attribute, name, make):
    original = owner.__dict__[attribute]
    crippled = make(original)

    def switched(*args, **kwargs):
        return (crippled if _on(name) else original)(*args, **kwargs)

    setattr(owner, attribute, switched)


""" % SWITCH_FILE_ENV


class _Switches:
    """The ``EVERYWHERE`` cripples ``names``, in place in this process and in every process
    started after (``sitecustomize``), all off until ``turn_on`` names them."""

    def __init__(self, names: list[str]) -> None:
        import tempfile

        self.names = names
        self.folder = tempfile.mkdtemp(prefix="ftkit-cripple-")
        self.file = os.path.join(self.folder, "on")
        Path(self.file).write_text("")
        code = _SWITCH + "".join(EVERYWHERE[name] for name in names)
        Path(self.folder, "sitecustomize.py").write_text(code)
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = self.folder + (os.pathsep + saved if saved else "")
        os.environ[SWITCH_FILE_ENV] = self.file
        exec(compile(code, "<cripple switches>", "exec"), {"__name__": "_cripple_switches"})

    def turn_on(self, names: list[str]) -> Callable[[], None]:
        """Switch ``names`` on, in every process; return what switches them off again."""
        unknown = [name for name in names if name not in self.names]
        if unknown:
            raise ValueError(f"cripples not loaded in this child: {unknown}")
        Path(self.file).write_text(" ".join(names))
        return lambda: Path(self.file).write_text("")

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _cripple_names(plan: dict) -> list[str]:
    """The cripples of a run: its ``cripple``, one name, a list of them or none."""
    cripple = plan.get("cripple")
    return [cripple] if isinstance(cripple, str) else list(cripple or ())


def _everywhere_in(config: dict) -> list[str]:
    """The ``EVERYWHERE`` cripples of any run of ``config``."""
    names = []
    for plan in config["runs"]:
        for name in _cripple_names(plan):
            if name in EVERYWHERE and name not in names:
                names.append(name)
    return names


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


#: A repair switched off in this process: name -> patch (returns its undo). Those of
#: ``EVERYWHERE`` are switched (``_Switches``).
CRIPPLES: dict[str, Callable[[], Callable[[], None]]] = {
    "resume_prompt_only": _resume_from_the_prompt_alone,
    "kv": lambda: _patch(KvRecompute, "run", lambda self, scheduler_output, call: None),
    "prefix": _no_prefix_hits,
    "layout": _batch_in_scheduler_order,
    "shadow": _resumed_text_from_the_new_engine,
    "child_seed": _one_seed_for_every_sample,
    "no_revive": _no_revive,
}
#: The key of ``RESULT`` that holds the number of engines started (not a run's name).
ENGINE_STARTS = "engine_starts"
#: Cripples whose damage outlives their run (the weights stay as the fault left them): the
#: next run gets an engine of its own.
LASTING = {"no_reload"}


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

    def clear(self) -> None:
        """Forget what the scheduler did so far (a new run on the same engine)."""
        self.preempted, self.prefix_hits, self.joint_prefills = [], {}, []

    def to_mapping(self) -> dict | None:
        if not self.active:
            return None
        return {"preempted": self.preempted,
                "prefix_hits": {str(k): v for k, v in sorted(self.prefix_hits.items())},
                "joint_prefills": self.joint_prefills}


class _Engines:
    """The engine of the last run, kept for the next run if that one needs the same engine
    (model, arguments, ranks, recovery on or off, where the engine core runs) and the last
    run left it whole: it ended without an error and switched off no ``LASTING`` repair.
    Kept, its prefix cache is emptied; a run may ask for a new one (``fresh_engine``).
    ``starts`` counts the engines started, restarts after a process died included."""

    def __init__(self) -> None:
        self.session: EngineSession | None = None
        self.spy: _ScheduleSpy | None = None
        self.key: str | None = None
        self.whole = False
        self.starts = 0

    def get(self, key: str, make: Callable[[], EngineSession], fresh: bool) -> EngineSession:
        if self.session is not None and key == self.key and self.whole and not fresh \
                and self.session.dead is None:
            self.session.reset_prefix_cache()
            return self.session
        self.close()
        self.session, self.key = make(), key
        self.session.start()
        self.starts += 1
        self.spy = _ScheduleSpy(self.session)
        return self.session

    def ran(self, whole: bool, restarts: int) -> None:
        self.whole = whole
        self.starts += restarts

    def close(self) -> None:
        session, self.session, self.spy, self.key = self.session, None, None, None
        if session is not None:
            session.close()


def run(config: dict, plan: dict, engines: _Engines, switches: _Switches | None) -> dict:
    config = {**config, **plan.get("workload", {})}
    spec = EngineSpec(model=config["model"], args=config.get("engine_args", {}),
                      tensor_parallel_size=config.get("tensor_parallel_size", 1),
                      nodes=config.get("nodes", 1), ray_address=config.get("ray_address"))
    config.setdefault("multiprocess", None)
    names = _cripple_names(plan)
    undo = _cripple(names, switches)
    started = time.monotonic()
    try:
        result = _run(config, spec, plan, engines)
        result["seconds"] = round(time.monotonic() - started, 1)
    except BaseException:
        engines.close()
        raise
    finally:
        undo()
    engines.ran(result["error"] is None and not LASTING & set(names), result["restarts"])
    return result


def _cripple(names: list[str], switches: _Switches | None) -> Callable[[], None]:
    """Switch off the repairs ``names``; return the undo of them all."""
    unknown = [name for name in names if name not in CRIPPLES and name not in EVERYWHERE]
    if unknown or len(set(names)) < len(names):
        raise ValueError(f"cripples unknown or repeated: {names}")
    with contextlib.ExitStack() as undos:  # on a failure, what was switched off goes back
        everywhere = [name for name in names if name in EVERYWHERE]
        if everywhere:
            assert switches is not None, "main loads every run's EVERYWHERE cripples"
            undos.callback(switches.turn_on(everywhere))
        for name in names:
            if name not in EVERYWHERE:
                undos.callback(CRIPPLES[name]())
        return undos.pop_all().close  # undone in reverse order


def _run(config: dict, spec: EngineSpec, plan: dict, engines: _Engines) -> dict:
    recovery = None
    if plan["recovery"]:
        recovery = RecoveryConfig(enabled=True, max_reinference=3,
                                  event_log_dir=config["event_log_dir"])
    faults = [FaultSpec.model_validate(f) for f in plan.get("faults", [])]
    key = json.dumps([spec.model_dump(mode="json"), recovery is not None,
                      config["multiprocess"]], sort_keys=True)
    engine = engines.get(key, lambda: EngineSession(spec, recovery=recovery,
                                                    multiprocess=config["multiprocess"]),
                         fresh=plan.get("fresh_engine", False))
    spy = engines.spy
    spy.clear()
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
    everywhere = _everywhere_in(config)
    switches = _Switches(everywhere) if everywhere else None
    engines = _Engines()
    results = {}
    try:
        for plan in config["runs"]:
            results[plan["name"]] = run(config, plan, engines, switches)
            # The next run reads only its own events.
            for path in Path(config["event_log_dir"]).glob("*"):
                path.unlink()
    finally:
        engines.close()
        if switches is not None:
            switches.close()
    results[ENGINE_STARTS] = engines.starts
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
    procs.exit_quickly(0)  # as ftkit's engine hosts end: vLLM's heap is not torn down (2 s)
