"""Decentralized Adaptive Commit (DAC): the commit pacing and retry policy, pure (no I/O, injected clock and RNG).

Producers publish through one serialisation point, the catalog's compare-and-swap. An attempt holds that point
"virtually" for its critical section ``c`` (refresh the table, write the manifests, swap the pointer); two attempts
whose critical sections overlap conflict and one of them is wasted. A producer cannot see the others, but it can
measure everything needed to avoid that waste:

* ``c``: the EWMA of its own attempt durations, floored by a cost model of the metadata it must parse and rewrite
  (``metadata_bytes * parse_s_per_byte``), so a cold producer on a big table does not underestimate it;
* ``lambda``: the global commit rate, from the step numbers it sees advance at each refresh (its own commits included);
* ``n``: the number of active producers, ``n = lambda / own_rate`` (global rate over its own success rate), raised
  to at least ``k + 1`` when ``k`` foreign commits landed inside one of its critical sections.

The control law keeps the aggregate attempt rate near one per critical section, the throughput optimum of a
shared slot (everyone attempting at once wastes almost every attempt; everyone waiting too long idles the catalog):

* **pacing** (before each commit): a producer that just published waits ``(n - 1) * c * U(0.5, 1.5)`` before its next
  attempt, i.e. it yields one slot to each of the others. With one producer ``n = 1`` and it never waits.
* **retry** (after a lost compare-and-swap, attempt ``a >= 1``): wait ``U(0, 2) * max(1, n - 1) * c / (1 + a / 2)``.
  The window is the slot count the others need, so retries spread evenly; dividing it by the attempt number gives
  older commits priority (they retry sooner), which approximates FIFO order without a queue and keeps the latency
  tail short (p99/p50) and the producers' shares fair (Jain's index), unlike exponential backoff, whose windows grow
  with every loss and starve exactly the commits that have waited longest.
* every wait is capped by ``max_wait_s``; the caller's commit budget (time and attempts) bounds the loop.

Nothing here talks to another producer; the policy is simulated at scale in ``benchmarks/commit_scaling.py``.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CommitPolicy", "PolicyConfig"]


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """Tunables of the control law (defaults were fitted on SQLite and PostgreSQL catalogs, see README)."""

    ewma_alpha: float = 0.2
    rate_window_s: float = 5.0
    parse_s_per_byte: float = 2e-8
    min_critical_s: float = 0.001
    max_wait_s: float = 2.0


class CommitPolicy:
    """The DAC state of one producer. Feed it measurements, ask it how long to wait.

    Example:
        >>> import random
        >>> p = CommitPolicy(clock=lambda: 0.0, rng=random.Random(1))
        >>> p.pacing_delay()
        0.0
        >>> p.record_attempt(started=0.0, ended=0.02, won=True, head_step=1, foreign=0)
        >>> p.pacing_delay()  # alone: never waits
        0.0
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        config: PolicyConfig | None = None,
    ) -> None:
        self._clock = clock
        self._rng = rng or random.Random()
        self._cfg = config or PolicyConfig()
        self._critical_s: float | None = None
        self._metadata_bytes = 0
        self._steps: deque[tuple[float, int]] = deque()  # (time, head step) observations
        self._wins: deque[float] = deque()  # times of own successful commits
        self._contenders = 1.0
        self.conflicts = 0

    # -- measurements -------------------------------------------------------------------------------------------------
    def observe_metadata(self, size_bytes: int) -> None:
        """The size of the table metadata the producer just read."""
        self._metadata_bytes = max(0, int(size_bytes))

    def observe_head(self, step: int, at: float | None = None) -> None:
        """The head step seen at a refresh (drives the global commit-rate estimate)."""
        now = self._clock() if at is None else at
        self._steps.append((now, step))
        self._trim(now)

    def record_attempt(self, *, started: float, ended: float, won: bool, head_step: int, foreign: int) -> None:
        """One attempt's outcome: its critical section, whether the swap was won, and the commits that beat it."""
        duration = max(0.0, ended - started)
        a = self._cfg.ewma_alpha
        self._critical_s = duration if self._critical_s is None else (1 - a) * self._critical_s + a * duration
        self.observe_head(head_step, ended)
        if won:
            self._wins.append(ended)
        else:
            self.conflicts += 1
        self._trim(ended)
        estimate = self._rate_ratio()
        if foreign > 0:
            estimate = max(estimate, foreign + 1.0)
        self._contenders = (1 - a) * self._contenders + a * estimate

    # -- decisions ----------------------------------------------------------------------------------------------------
    @property
    def critical_section_s(self) -> float:
        modelled = self._metadata_bytes * self._cfg.parse_s_per_byte
        measured = self._critical_s if self._critical_s is not None else modelled
        return max(self._cfg.min_critical_s, measured, modelled)

    @property
    def contenders(self) -> float:
        return max(1.0, self._contenders)

    def pacing_delay(self) -> float:
        """Seconds to wait before the first attempt of the next commit."""
        others = self.contenders - 1.0
        if others < 0.5:
            return 0.0
        return min(self._cfg.max_wait_s, others * self.critical_section_s * self._rng.uniform(0.5, 1.5))

    def retry_delay(self, attempt: int) -> float:
        """Seconds to wait after losing attempt number ``attempt`` (1-based)."""
        window = max(1.0, self.contenders - 1.0) * self.critical_section_s / (1.0 + attempt / 2.0)
        return min(self._cfg.max_wait_s, self._rng.uniform(0.0, 2.0) * window)

    # -- internals ----------------------------------------------------------------------------------------------------
    def _trim(self, now: float) -> None:
        horizon = now - self._cfg.rate_window_s
        while len(self._steps) > 2 and self._steps[0][0] < horizon:
            self._steps.popleft()
        while self._wins and self._wins[0] < horizon:
            self._wins.popleft()

    def _rate_ratio(self) -> float:
        """Global commits over own commits in the observation window (>= 1)."""
        if len(self._steps) < 2 or not self._wins:
            return self._contenders
        (t0, s0), (t1, s1) = self._steps[0], self._steps[-1]
        if t1 <= t0 or s1 <= s0:
            return self._contenders
        own = sum(1 for t in self._wins if t >= t0)
        if own == 0:
            return self._contenders
        return max(1.0, (s1 - s0) / own)
