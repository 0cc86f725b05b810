"""Every repair switched off, one at a time, at tensor parallel 1 and 2: the same fault that
ftkit's full repair survives exactly (tokens and logprobs of a plain engine) then damages the
tokens or logprobs, where that repair says it would.

Each tensor-parallel size runs in one child process (``_feature_run.py``): a plain engine
(no ftkit) gives the fault-free run, ftkit's engine with every fault of the module the repaired
one, and then one engine per crippled repair, with only the fault that repair handles. Cripples
that live in the workers are loaded as ``sitecustomize`` by every process of the engine
(``_feature_run.EVERYWHERE``); the resume cripple lives in the front end.

The workload: request 0 greedy, request 1 seeded (temperature 0.8), both with the logprob of
each sampled token; every engine core in a process of its own (a process kill's target).
At TP 1 the rollback of execute, the KV recompute and the weight reload have their crippled
tests elsewhere (``test_recovery_tp1``, ``test_fault_catalogue``). Switching the whole sample
rollback off shows, in this workload, as the generator restore does: the seeded request's
stream breaks at the faulted token (the greedy request is unaffected).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import feature_run

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


def _runs(tp: int) -> list[dict]:
    f = _faults(tp)
    crippled = {  # cripple -> the fault its repair handles
        1: {"no_rollback_sample": "sample", "no_generator_restore": "sample",
            "no_batch_reset": "execute", "no_fast_forward": "kill"},
        2: {"no_rollback_execute": "execute", "no_rollback_sample": "sample",
            "no_generator_restore": "sample", "no_batch_reset": "execute",
            "no_kv_recompute": "reset", "no_reload": "weights",
            "resume_prompt_only": "kill", "no_fast_forward": "kill"}}[tp]
    runs = [{"name": "plain", "recovery": False},
            {"name": "ftkit", "recovery": True, "max_restarts": 1,
             "faults": [f[k] for k in ("sample", "execute", "reset", "weights", "kill")]}]
    for cripple, fault in crippled.items():
        runs.append({"name": cripple, "recovery": True, "cripple": cripple,
                     "faults": [f[fault]], "max_restarts": 1 if fault == "kill" else 0})
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
    """ftkit's run, with every fault of the module: tokens and logprobs as the plain engine's."""
    _ran(result, "plain")
    _ran(result, "ftkit", restarts=1)
    assert result["ftkit"]["kv"], "the device reset's lost KV was recomputed"
    assert _exact(result, "ftkit", 0) and _exact(result, "ftkit", 1)


def _seeded_stream_breaks_at(result: dict, run: str, at: int, restarts: int = 0) -> None:
    """Only the seeded request 1 goes wrong, from its token ``at`` on (token and logprob);
    the greedy request 0 stays exact."""
    _ran(result, run, restarts)
    assert _damage(result, run, 1) == (at, at)
    assert _exact(result, run, 0)


def _late_kv_damage(result: dict, run: str) -> None:
    """A block id the faulted step gave request 0 is in its block table twice: its KV is
    overwritten when it reaches a later block, so its logprobs go wrong well after the
    faulted token (then its tokens); request 1 got no block in that step and stays exact."""
    _ran(result, run)
    token, logprob = _damage(result, run, 0)
    assert logprob is not None and logprob > NEW_BLOCK
    assert token is not None and token >= logprob
    assert _exact(result, run, 1)


# --- tensor parallel 1 ----------------------------------------------------------------------

def test_tp1_with_every_repair_every_fault_is_exact(tp1):
    _repaired(tp1)


def test_tp1_without_sample_rollback_the_seeded_stream_breaks_at_the_faulted_token(tp1):
    _seeded_stream_breaks_at(tp1, "no_rollback_sample", SAMPLE_AT)


def test_tp1_without_generator_restore_the_seeded_stream_breaks_at_the_faulted_token(tp1):
    _seeded_stream_breaks_at(tp1, "no_generator_restore", SAMPLE_AT)


def test_tp1_without_batch_reset_a_rolled_back_block_corrupts_later_kv(tp1):
    _late_kv_damage(tp1, "no_batch_reset")


def test_tp1_without_fast_forward_the_resumed_seeded_stream_breaks_at_the_kill(tp1):
    _seeded_stream_breaks_at(tp1, "no_fast_forward", KILL_AT, restarts=1)


# --- tensor parallel 2 ----------------------------------------------------------------------

def test_tp2_with_every_repair_every_fault_is_exact(tp2):
    _repaired(tp2)


def test_tp2_without_execute_rollback_a_rolled_back_block_corrupts_later_kv(tp2):
    _late_kv_damage(tp2, "no_rollback_execute")


def test_tp2_without_sample_rollback_the_seeded_stream_breaks_at_the_faulted_token(tp2):
    _seeded_stream_breaks_at(tp2, "no_rollback_sample", SAMPLE_AT)


def test_tp2_without_generator_restore_the_seeded_stream_breaks_at_the_faulted_token(tp2):
    _seeded_stream_breaks_at(tp2, "no_generator_restore", SAMPLE_AT)


def test_tp2_without_batch_reset_a_rolled_back_block_corrupts_later_kv(tp2):
    _late_kv_damage(tp2, "no_batch_reset")


def test_tp2_without_fast_forward_the_resumed_seeded_stream_breaks_at_the_kill(tp2):
    _seeded_stream_breaks_at(tp2, "no_fast_forward", KILL_AT, restarts=1)


def _broken_from_the_step_of(result: dict, run: str, at: int) -> None:
    """Every request goes wrong in the faulted step (request 0's token ``at``; request 1,
    admitted with it or a step later, at its token of that step or the next), token and
    logprob at once; all before is exact."""
    _ran(result, run)
    assert _damage(result, run, 0) == (at, at)
    token, logprob = _damage(result, run, 1)
    assert token == logprob and token in (at - 1, at)


def test_tp2_without_kv_recompute_every_request_breaks_at_the_device_reset(tp2):
    _broken_from_the_step_of(tp2, "no_kv_recompute", RESET_AT)


def test_tp2_without_weight_reload_every_request_breaks_at_the_weights_error(tp2):
    _broken_from_the_step_of(tp2, "no_reload", WEIGHTS_AT)


def test_tp2_resumed_from_the_prompt_alone_the_requests_start_over_after_the_kill(tp2):
    run = "resume_prompt_only"
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
