"""Generation under injected faults, checked against the fault-free run of the same engine.

``ftkit_injector.generate`` runs the prompts under the test's ``ftkit_fault`` markers and
returns each request's token ids; ``ftkit_baseline`` gives the tokens without faults.
Afterwards ``ftkit_injector`` holds what ftkit recorded for the call: ``fired`` (one event
per rank and failing attempt), ``faults`` (one record per marker), ``rounds`` (the
recovery rounds), ``error`` (the engine's error, if the fault was surfaced) and ``logprobs``;
``assert_exact()`` compares every completion with the fault-free run as the scenario runner's
oracle does: logprobs bit for bit, finish reasons and text too.
"""

import pytest

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "a small boat crossed the quiet river at night",
    "one two three four five six seven",
]


@pytest.mark.ftkit_fault(kind="oom", rank=0, at={"request": 0, "token": 5}, times=2)
def test_oom_during_decode_is_recovered_exactly(ftkit_injector, ftkit_baseline):
    tokens = ftkit_injector.generate(PROMPTS, max_tokens=16)

    assert ftkit_injector.error is None
    assert tokens == ftkit_baseline(PROMPTS, max_tokens=16)
    assert ftkit_injector.faults[0].attempts == 2
    assert [r.decision for r in ftkit_injector.rounds] == ["recompute", "recompute"]
    ftkit_injector.assert_exact()


@pytest.mark.ftkit_fault(kind="oom", rank=0, at={"request": 2, "token": 9}, phase="sample")
def test_seeded_sampling_draws_the_same_tokens_after_a_rerun(ftkit_injector, ftkit_baseline):
    sampling = dict(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    tokens = ftkit_injector.generate(PROMPTS, **sampling)

    assert ftkit_injector.error is None
    assert tokens == ftkit_baseline(PROMPTS, **sampling)
    assert len(ftkit_injector.fired) == 1
    ftkit_injector.assert_exact()


# This test needs another engine setting: ftkit starts an engine of its own for it.
@pytest.mark.ftkit_settings(max_reinference=1)
@pytest.mark.ftkit_fault(kind="oom", rank=0, at={"request": 1, "token": 4}, times=2)
def test_a_fault_beyond_max_reinference_is_surfaced_not_hidden(ftkit_injector, ftkit_baseline):
    expected = ftkit_baseline(PROMPTS, max_tokens=16)  # before the fault ends the engine
    tokens = ftkit_injector.generate(PROMPTS, max_tokens=16)

    assert ftkit_injector.error is not None
    assert not ftkit_injector.faults[0].recovered
    # Every token that did come out before the fault surfaced is right.
    for got, want in zip(tokens, expected):
        assert got == want[:len(got)]
    assert len(tokens[1]) <= 4
