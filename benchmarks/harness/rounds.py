"""Rounds in alternating order: whatever drifts on a shared machine (load, caches, writeback) hits every variant.

>>> [alternating(("kafka", "lake"), i) for i in range(3)]
[('kafka', 'lake'), ('lake', 'kafka'), ('kafka', 'lake')]
>>> rotating(("a", "b", "c"), 1)
('b', 'c', 'a')
>>> list(interleaved(2, ("x", "y")))
[(0, 'x'), (0, 'y'), (1, 'y'), (1, 'x')]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

__all__ = ["alternating", "interleaved", "rotating"]

T = TypeVar("T")


def alternating(variants: Sequence[T], round_no: int) -> tuple[T, ...]:
    """The variants as given in even rounds, reversed in odd ones."""
    return tuple(variants) if round_no % 2 == 0 else tuple(reversed(variants))


def rotating(variants: Sequence[T], round_no: int) -> tuple[T, ...]:
    """The variants rotated by ``round_no``: each one leads in turn (for three or more)."""
    k = round_no % len(variants) if variants else 0
    return tuple(variants[k:]) + tuple(variants[:k])


def interleaved(rounds: int, variants: Sequence[T]) -> Iterator[tuple[int, T]]:
    """``(round, variant)`` for every round, the variants in alternating order."""
    for round_no in range(rounds):
        for variant in alternating(variants, round_no):
            yield round_no, variant
