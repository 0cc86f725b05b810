"""Deterministic random prompts for ``workload.random_prompts``.

The same ``(count, min_words, max_words, seed)`` gives the same prompts on every machine and
every Python version: the words come from the fixed list ``WORDS`` and the choices from
SplitMix64, a 64-bit generator written out here (not ``random`` and never ``hash()``, whose
results may change between Python versions and processes).

Changing ``WORDS`` or the generator changes the prompts of existing scenarios. That is safe
for caches, whose keys hold the prompts themselves (``Scenario.workload_key``), but it moves
the token positions that scenario authors chose, so do it only on purpose.
"""

from __future__ import annotations

#: Plain English words; a prompt is a space-separated sequence of them.
WORDS: tuple[str, ...] = tuple(
    """
    the a of to in and on with for from over under after before about into through
    quick brown fox lazy dog river mountain city ocean forest light dark night day sun
    moon star cloud rain snow wind fire water earth stone tree leaf flower bird fish
    horse cat mouse house door window road bridge train ship plane car book story music
    song voice word letter number garden market school table chair paper bread apple
    summer winter morning evening village island valley field hill lake sea sky storm
    old new small large bright quiet warm cold green blue red white long short early late
    walks runs sings reads writes builds opens carries finds watches follows remembers
    one two three four five six seven eight nine ten
    """.split()
)

_MASK64 = (1 << 64) - 1


class SplitMix64:
    """SplitMix64 (Steele, Lea, Flood 2014): a tiny generator with fully specified output."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def next_u64(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """An integer in ``[0, n)``; the modulo bias (below 2**-50 here) does not matter."""
        return self.next_u64() % n


def random_prompts(count: int, min_words: int, max_words: int, seed: int) -> list[str]:
    """``count`` prompts of ``min_words`` to ``max_words`` words each (both inclusive)."""
    if count < 0 or min_words < 1 or max_words < min_words:
        raise ValueError(f"bad prompt bounds: count={count} words={min_words}..{max_words}")
    rng = SplitMix64(seed)
    prompts = []
    for _ in range(count):
        n_words = min_words + rng.below(max_words - min_words + 1)
        prompts.append(" ".join(WORDS[rng.below(len(WORDS))] for _ in range(n_words)))
    return prompts
