"""Every repair switched off at tensor parallel 1 and 2: the same fault that ftkit's full
repair survives exactly (tokens and logprobs of a plain engine) then damages the tokens or
logprobs, where that repair says it would.

Each tensor-parallel size runs in one child process (``_feature_run.py``): a plain engine
(no ftkit) gives the fault-free run, ftkit's engine with every fault of the module the repaired
one, and then the same engine with crippled repairs, each run with only the faults its
repairs handle (the weight reload's last: the weights it leaves damaged stay so). Cripples
that live in the workers are loaded as ``sitecustomize`` by every process of the engine and
switched on for their run alone (``_feature_run.EVERYWHERE``); the resume cripple lives in the
front end.

The workload: request 0 greedy, request 1 seeded (temperature 0.8), both with the logprob of
each sampled token; every engine core in a process of its own (a process kill's target).
At TP 1 the rollback of execute, the KV recompute and the weight reload have their crippled
tests elsewhere (``test_recovery_tp1``, ``test_fault_catalogue``). Switching the whole sample
rollback off shows, in this workload, as the generator restore does: the seeded request's
stream breaks at the faulted token.

Most cripples run alone. A sample-repair cripple and an execute-repair cripple share an engine
with both faults (``PAIRED``): the sample fault damages only the seeded request 1 (at its token
``SAMPLE_AT``), the execute fault only the greedy request 0 (late), so each request shows one
cripple's damage, and the pair's tests ask for both, exactly as each cripple's run alone shows
it (request 1 at ``SAMPLE_AT``, token and logprob; request 0's logprobs after ``NEW_BLOCK``,
then its tokens). The two repairs barely meet: the execute fault's recovery undoes only its
step's forward pass (``rollback_execute``, with its batch reset), never a sampling, so it runs
no code a sample cripple changed. The sample fault's recovery does run its step's
``rollback_execute``, but that step gives no request a block nor starts one: what an execute
cripple changes there is only that the batch is not laid out afresh. Whether that matters was
checked by running each pair beside its cripples alone, at TP 1 and 2: the same first
differences, token and logprob, on both requests. Not paired: the generator restore with the
batch reset (run so at TP 2, request 0 breaks at ``NEW_BLOCK`` itself, not late), and anything
with a kill or a fault that breaks every request (the resumed engine re-prefills request 0's
KV, and the late damage no longer shows; a request broken early hides a later damage).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ENGINE_STARTS, feature_run

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

PROMPTS = ["the quick brown fox jumps over the lazy dog", "one two three four five"]
MAX_TOKENS = 88
SAMPLING = {"max_tokens": MAX_TOKENS, "requests": [{}, {"temperature": 0.8, "seed": 1234}]}
#: Request 0's step that gives it its second KV block (a duplicated block id bites when it
#: reaches the third, at position 64).
NEW_BLOCK = 15
#: Request 1's (seeded) sampling fault.
SAMPLE_AT = 10
#: Device reset and weights error, in request 0's steps.
RESET_AT, WEIGHTS_AT = 20, 25
#: The process kill, in request 1's step of this token.
KILL_AT = 30


def _fault(kind: str, rank, request: int, token: int, phase: str = "forward", **params) -> dict:
    return {"kind": kind, "rank": rank, "at": {"request": request, "token": token},
            "phase": phase, "params": params}


def _faults(tp: int) -> dict[str, dict]:
    last = tp - 1  # the rank whose output the engine does not read, at TP 2
    return {"execute": _fault("oom", last, 0, NEW_BLOCK),
            "sample": _fault("oom", 0, 1, SAMPLE_AT, "sample"),
            "reset": _fault("device_reset", last, 0, RESET_AT),
            "weights": _fault("uce", last, 0, WEIGHTS_AT, region="weights"),
            "kill": (_fault("process_kill", 0, 1, KILL_AT, target="engine") if tp == 1
                     else _fault("process_kill", 1, 1, KILL_AT))}


#: Cripples run together, their faults with them (see the module docstring): one run each,
#: per tensor-parallel size.
PAIRED = {1: [("no_rollback_sample", "no_batch_reset")],
          2: [("no_rollback_sample", "no_batch_reset"),
              ("no_generator_restore", "no_rollback_execute")]}
#: The crippled repairs per tensor-parallel size -> the fault each handles.
CRIPPLED = {
    1: {"no_rollback_sample": "sample", "no_generator_restore": "sample",
        "no_batch_reset": "execute", "no_fast_forward": "kill"},
    2: {"no_rollback_execute": "execute", "no_rollback_sample": "sample",
        "no_generator_restore": "sample", "no_batch_reset": "execute",
        "no_kv_recompute": "reset", "resume_prompt_only": "kill", "no_fast_forward": "kill",
        "no_reload": "weights"}}  # last: its damaged weights stay (``_feature_run.LASTING``)


def _groups(tp: int) -> list[tuple[str, ...]]:
    """The cripples of each crippled run: the pairs, then every other cripple alone."""
    paired = [c for pair in PAIRED[tp] for c in pair]
    return PAIRED[tp] + [(c,) for c in CRIPPLED[tp] if c not in paired]


def _run_of(tp: int, cripple: str) -> str:
    """The name of the run ``cripple`` is switched off in."""
    return next("+".join(group) for group in _groups(tp) if cripple in group)


def _runs(tp: int) -> list[dict]:
    f = _faults(tp)
    runs = [{"name": "plain", "recovery": False},
            {"name": "ftkit", "recovery": True, "max_restarts": 1,
             "faults": [f[k] for k in ("sample", "execute", "reset", "weights", "kill")]}]
    for group in _groups(tp):
        faults = [CRIPPLED[tp][c] for c in group]
        assert len(set(faults)) == len(faults), f"{group}: their repairs handle one fault"
        runs.append({"name": "+".join(group), "recovery": True, "cripple": list(group),
                     "faults": [f[k] for k in faults],
                     "max_restarts": 1 if "kill" in faults else 0})
    return runs


def _child(config: dict) -> dict:
    return feature_run(config, timeout_s=1400)


def _results(tiny_model: str, events: Path, tp: int) -> dict:
    return _child({"model": tiny_model, "tensor_parallel_size": tp, "multiprocess": True,
                   "prompts": PROMPTS, "sampling": SAMPLING, "runs": _runs(tp),
                   "event_log_dir": str(events)})


@pytest.fixture(scope="module")
def tp1(tiny_model, tmp_path_factory) -> dict:
    return _results(tiny_model, tmp_path_factory.mktemp("events-tp1"), 1)


@pytest.fixture(scope="module")
def tp2(tiny_model, tmp_path_factory) -> dict:
    return _results(tiny_model, tmp_path_factory.mktemp("events-tp2"), 2)


def _first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def _damage(result: dict, run: str, request: int) -> tuple[int | None, int | None]:
    """Where request ``request`` of ``run`` first differs from the plain engine's: (token,
    logprob of the sampled token)."""
    want, got = result["plain"]["outputs"][request], result[run]["outputs"][request]
    return (_first_difference(got["tokens"], want["tokens"]),
            _first_difference(got["logprobs"], want["logprobs"]))


def _exact(result: dict, run: str, request: int) -> bool:
    return _damage(result, run, request) == (None, None)


def _ran(result: dict, run: str, restarts: int = 0) -> None:
    assert result[run]["error"] is None, result[run]["error"]
    assert result[run]["restarts"] == restarts
    assert [len(o["tokens"]) for o in result[run]["outputs"]] == [MAX_TOKENS] * 2


def _repaired(result: dict) -> None:
    """ftkit's run, with every fault of the module: tokens and logprobs as the plain engine's.
    It runs on a fresh engine; the crippled runs after it on the same one (each cripple is
    switched on for its run alone), and the engines that replace it after each kill."""
    _ran(result, "plain")
    _ran(result, "ftkit", restarts=1)
    assert result["ftkit"]["kv"], "the device reset's lost KV was recomputed"
    assert _exact(result, "ftkit", 0) and _exact(result, "ftkit", 1)
    restarts = sum(run["restarts"] for name, run in result.items() if name != ENGINE_STARTS)
    assert result[ENGINE_STARTS] == 2 + restarts  # the plain engine and ftkit's


def _seeded_stream_breaks_at(result: dict, run: str, at: int, restarts: int = 0) -> None:
    """Only the seeded request 1 goes wrong, from its token ``at`` on (token and logprob);
    the greedy request 0 stays exact."""
    _ran(result, run, restarts)
    assert _damage(result, run, 1) == (at, at)
    assert _exact(result, run, 0)


def _sample_and_late_kv_damage(result: dict, run: str) -> None:
    """A sample repair and an execute repair switched off together (``PAIRED``), each with its
    fault; each request shows one cripple's damage, as that cripple's run alone does.

    The sample cripple's: the seeded request 1 goes wrong from its faulted token on (token
    and logprob). The execute cripple's: a block id the faulted step gave request 0 is in its
    block table twice: its KV is overwritten when it reaches a later block, so its logprobs go
    wrong well after the faulted token (then its tokens); request 1 got no block in that
    step."""
    _ran(result, run)
    assert _damage(result, run, 1) == (SAMPLE_AT, SAMPLE_AT)
    token, logprob = _damage(result, run, 0)
    assert logprob is not None and logprob > NEW_BLOCK
    assert token is not None and token >= logprob


# --- tensor parallel 1 ----------------------------------------------------------------------

@pytest.mark.exhaustive  # each repair is switched off at TP 2 in the fast tier
def test_tp1_with_every_repair_every_fault_is_exact(tp1):
    _repaired(tp1)


@pytest.mark.exhaustive  # each repair is switched off at TP 2 in the fast tier
def test_tp1_without_sample_rollback_the_seeded_stream_breaks_at_the_faulted_token(tp1):
    _sample_and_late_kv_damage(tp1, _run_of(1, "no_rollback_sample"))


@pytest.mark.exhaustive  # each repair is switched off at TP 2 in the fast tier
def test_tp1_without_generator_restore_the_seeded_stream_breaks_at_the_faulted_token(tp1):
    _seeded_stream_breaks_at(tp1, _run_of(1, "no_generator_restore"), SAMPLE_AT)


@pytest.mark.exhaustive  # each repair is switched off at TP 2 in the fast tier
def test_tp1_without_batch_reset_a_rolled_back_block_corrupts_later_kv(tp1):
    _sample_and_late_kv_damage(tp1, _run_of(1, "no_batch_reset"))


@pytest.mark.exhaustive  # each repair is switched off at TP 2 in the fast tier
def test_tp1_without_fast_forward_the_resumed_seeded_stream_breaks_at_the_kill(tp1):
    _seeded_stream_breaks_at(tp1, _run_of(1, "no_fast_forward"), KILL_AT, restarts=1)


# --- tensor parallel 2 ----------------------------------------------------------------------

def test_tp2_with_every_repair_every_fault_is_exact(tp2):
    _repaired(tp2)


def test_tp2_without_execute_rollback_a_rolled_back_block_corrupts_later_kv(tp2):
    _sample_and_late_kv_damage(tp2, _run_of(2, "no_rollback_execute"))


def test_tp2_without_sample_rollback_the_seeded_stream_breaks_at_the_faulted_token(tp2):
    _sample_and_late_kv_damage(tp2, _run_of(2, "no_rollback_sample"))


def test_tp2_without_generator_restore_the_seeded_stream_breaks_at_the_faulted_token(tp2):
    _sample_and_late_kv_damage(tp2, _run_of(2, "no_generator_restore"))


def test_tp2_without_batch_reset_a_rolled_back_block_corrupts_later_kv(tp2):
    _sample_and_late_kv_damage(tp2, _run_of(2, "no_batch_reset"))


def test_tp2_without_fast_forward_the_resumed_seeded_stream_breaks_at_the_kill(tp2):
    _seeded_stream_breaks_at(tp2, _run_of(2, "no_fast_forward"), KILL_AT, restarts=1)


def _broken_from_the_step_of(result: dict, run: str, at: int) -> None:
    """Every request goes wrong in the faulted step (request 0's token ``at``; request 1,
    admitted with it or a step later, at its token of that step or the next), token and
    logprob at once; all before is exact."""
    _ran(result, run)
    assert _damage(result, run, 0) == (at, at)
    token, logprob = _damage(result, run, 1)
    assert token == logprob and token in (at - 1, at)


def test_tp2_without_kv_recompute_every_request_breaks_at_the_device_reset(tp2):
    _broken_from_the_step_of(tp2, _run_of(2, "no_kv_recompute"), RESET_AT)


def test_tp2_without_weight_reload_every_request_breaks_at_the_weights_error(tp2):
    _broken_from_the_step_of(tp2, _run_of(2, "no_reload"), WEIGHTS_AT)


def test_tp2_resumed_from_the_prompt_alone_the_requests_start_over_after_the_kill(tp2):
    run = _run_of(2, "resume_prompt_only")
    _ran(tp2, run, restarts=1)
    want, got = tp2["plain"]["outputs"], tp2[run]["outputs"]
    # Greedy request 0 (admitted with request 1 or a step earlier) restarts its stream: right
    # after the kill it produces the plain run's tokens and logprobs from its first on.
    token, logprob = _damage(tp2, run, 0)
    assert token == logprob and token in (KILL_AT, KILL_AT + 1)
    assert got[0]["tokens"][token:] == want[0]["tokens"][:MAX_TOKENS - token]
    assert got[0]["logprobs"][token:] == want[0]["logprobs"][:MAX_TOKENS - token]
    # Seeded request 1 goes wrong at its token of the kill.
    assert _damage(tp2, run, 1) == (KILL_AT, KILL_AT)
