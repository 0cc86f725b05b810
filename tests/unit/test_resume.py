"""Generators of rows whose sampled token vLLM discards are parked while the step samples."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ftkit.vllm.resume import park_discarded_generators, restore_generators


def _runner(discard: list[bool], generators: dict[int, torch.Generator]):
    batch = SimpleNamespace(generators=generators, num_reqs=len(discard))
    return SimpleNamespace(input_batch=batch,
                           discard_request_mask=SimpleNamespace(np=np.array(discard + [True])))


def test_only_the_discarded_rows_generators_are_parked_and_put_back():
    gens = {0: torch.Generator(), 2: torch.Generator(), 3: torch.Generator()}
    originals = dict(gens)
    runner = _runner([False, False, True, False], gens)
    parked = park_discarded_generators(runner)
    # Row 2 is a partial prefill chunk; the mask's padding past num_reqs is not read.
    assert parked == {2: originals[2]}
    assert runner.input_batch.generators == {0: originals[0], 3: originals[3]}
    restore_generators(runner, parked)
    assert runner.input_batch.generators == originals
    assert all(runner.input_batch.generators[i] is originals[i] for i in originals)


def test_nothing_to_park():
    runner = _runner([False, False], {0: torch.Generator()})
    assert park_discarded_generators(runner) is None
    assert park_discarded_generators(_runner([True], {})) is None
    # A runner without V1's persistent batch (another platform's, or not built yet).
    assert park_discarded_generators(SimpleNamespace()) is None


def test_a_cpu_generator_cannot_be_rewound_as_vllm_does_for_a_discarded_row():
    # Why parking is needed: vLLM rewinds a discarded row's generator by its offset.
    gen = torch.Generator()
    try:
        gen.set_offset(gen.get_offset() - 4)
    except RuntimeError as exc:
        assert "offset" in str(exc)
    else:  # pragma: no cover - a torch whose CPU generators gained offsets
        raise AssertionError("CPU generators have offsets now: parking may be unnecessary")
