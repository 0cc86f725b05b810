"""``-k EXPRESSION``: which scenarios of a run are selected by name, as pytest's ``-k`` does."""

from __future__ import annotations

import re
from collections.abc import Callable

_K_TOKEN = re.compile(r"\(|\)|[^\s()]+")
_K_KEYWORDS = {"and", "or", "not"}


def name_matcher(expression: str) -> Callable[[str], bool]:
    """A predicate on scenario names for ``-k EXPRESSION``, like pytest's ``-k``.

    A word matches a name that contains it (case-insensitive). Words combine with ``not``,
    ``and``, ``or`` (in that precedence) and parentheses: ``oom and not (flap or exhausted)``.
    Raises ``ValueError`` for an empty or malformed expression.
    """
    tokens = _K_TOKEN.findall(expression)
    if not tokens:
        raise ValueError("empty expression")
    position = 0

    def peek() -> str | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> str:
        nonlocal position
        token = peek()
        if token is None:
            raise ValueError("unexpected end of expression")
        position += 1
        return token

    def either() -> Callable[[str], bool]:
        parts = [both()]
        while peek() == "or":
            take()
            parts.append(both())
        return lambda name: any(part(name) for part in parts)

    def both() -> Callable[[str], bool]:
        parts = [negation()]
        while peek() == "and":
            take()
            parts.append(negation())
        return lambda name: all(part(name) for part in parts)

    def negation() -> Callable[[str], bool]:
        token = take()
        if token == "not":
            inner = negation()
            return lambda name: not inner(name)
        if token == "(":
            inner = either()
            if peek() != ")":
                raise ValueError("missing ')'")
            take()
            return inner
        if token in _K_KEYWORDS or token == ")":
            raise ValueError(f"unexpected {token!r}")
        word = token.lower()
        return lambda name: word in name.lower()

    predicate = either()
    if position != len(tokens):
        raise ValueError(f"unexpected {tokens[position]!r}")
    return predicate
