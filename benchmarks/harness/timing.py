"""Timing helpers of paced and saturated loads: sleep until a moment, the batches of a producer's run.

>>> list(batches(mode="paced", start=0.0, count=3, interval=0.0))
[0, 1, 2]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["batches", "sleep_until", "timed"]


def sleep_until(t: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``t`` (at once when it has)."""
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of one call of ``fn``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def batches(*, mode: str, start: float, duration: float = 0.0, count: int = 0, interval: float = 0.0,
            offset: float = 0.0) -> Iterator[int]:
    """The sequence numbers of one producer's batches, each yielded when it is due.

    ``saturate``: back to back until ``start + duration`` (at least one batch, however late the producer woke up);
    ``paced``: batch ``seq`` due at ``start + interval * (seq + offset)`` (an offset in 0..1 spreads several producers
    over an interval), ``count`` batches, or (``count`` 0) as long as ``start + duration`` has not passed."""
    if mode not in ("saturate", "paced"):
        raise ValueError(f"mode must be 'saturate' or 'paced', got {mode!r}")
    seq = 0
    while True:
        if mode == "saturate":
            if seq and time.monotonic() >= start + duration:
                return
        else:
            if (seq >= count) if count else (time.monotonic() >= start + duration):
                return
            sleep_until(start + interval * (seq + offset))
        yield seq
        seq += 1
