"""Warnings that recur on a path every call takes, bounded per process: :class:`WarningLimit`.

A transient failure is retried where it happens (a read, an upload, a commit attempt), and each retry used to log a
WARNING of its own. On a store that throttles a fleet (S3's ``503 SlowDown`` to 1,000 trainer ranks, each reading
with a few threads) that is a line per retry per thread per process, the same words thousands of times. As Kafka's
and Ray's clients do, a process now says it once per kind of failure and interval, and counts the rest into the next
warning of that kind; every one of them is still logged at DEBUG.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable

__all__ = ["WarningLimit"]


class WarningLimit:
    """At most one WARNING per ``key`` every ``interval_s`` seconds of this process through ``logger``; the others are
    logged at DEBUG and counted, and the next WARNING of the key says how many there were and over how long.

    Keys must come from a bounded set (an exception's class name, a fixed kind), never a step, a path or an id."""

    def __init__(self, logger: logging.Logger, *, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self.interval_s, self._clock = logger, interval_s, clock
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}  # key -> when it was last logged at WARNING
        self._quiet: dict[Hashable, int] = {}  # key -> how many were logged at DEBUG only since then
        _LIMITS.add(self)

    def _after_fork_in_child(self) -> None:
        # A process of its own: a fresh lock (another thread of the parent may have held it at the fork: the child's
        # first warning then waited forever), and its own counts (the parent reports its quiet ones itself).
        self._lock = threading.Lock()
        self._last.clear()
        self._quiet.clear()

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at WARNING, or at DEBUG when the key's last WARNING is younger than the interval;
        returns whether it was a WARNING."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._quiet[key] = self._quiet.get(key, 0) + 1
                loud, quiet, since = False, 0, 0.0
            else:
                loud, quiet, since = True, self._quiet.pop(key, 0), (now - last if last is not None else 0.0)
                self._last[key] = now
        if not loud:
            self._log.debug(msg, *args, stacklevel=2)
        elif quiet:
            self._log.warning(msg + " (and %d more like it in the last %.0fs, logged at DEBUG)", *args, quiet, since,
                              stacklevel=2)
        else:
            self._log.warning(msg, *args, stacklevel=2)
        return loud


_LIMITS: weakref.WeakSet[WarningLimit] = weakref.WeakSet()


def _reset_after_fork_in_child() -> None:
    for limit in list(_LIMITS):
        limit._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork_in_child)
