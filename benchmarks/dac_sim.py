"""A discrete-event simulation of many producers committing through one catalog, driving the *pure* DAC policy.

Nothing here does I/O: every producer owns a :class:`lakestream_iceberg.dac.CommitPolicy` whose clock is the
simulator's virtual clock, so thousands of producers run in seconds and the policy's decisions are exactly the ones the
real :class:`lakestream_iceberg.commit.CommitLoop` would take.

Model (optimistic concurrency against a compare-and-swap, one shared catalog, every producer on its own CPU):

* a producer's ``commit()`` call writes its data files (``write_s``), waits the policy's pacing delay, then makes
  attempts. An attempt reads the head (version ``v0``), works for a *critical section* ``c`` drawn from a lognormal
  fitted to measured attempt durations, then sends its compare-and-swap to the catalog;
* the catalog serialises compare-and-swaps (a FIFO server, ``cas_s`` each): a swap wins iff the head is still ``v0``;
* a lost attempt re-reads the head right away (that is when lakestream's loop measures the foreign commits it lost
  to), sleeps the retry delay and tries again. ``refresh_after_sleep`` says whether the head is read again after the
  sleep (pyiceberg's retry does; lakestream's ``CommitLoop`` at the time of writing re-plans on the head it read
  *before* the sleep, so any commit landing during the sleep dooms the next attempt);
* a producer commits back to back: the next call starts when the previous one returns.

Strategies: ``dac`` (CommitPolicy as shipped), ``fixed`` (no pacing, constant retry delay, same budget as DAC) and
``pyiceberg`` (pyiceberg 0.12's default: the first attempt on the producer's own stale view, then 4 retries with
100 ms * 2^a backoff + up to 10 % jitter, refreshing after each sleep; the commit fails after the 5th loss).

Run ``python benchmarks/dac_sim.py --producers 64 256 1024`` for a quick table.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import Table, jain_index, percentile  # noqa: E402

from lakestream_iceberg.dac import CommitPolicy, PolicyConfig  # noqa: E402

__all__ = ["DacV1Policy", "FixedBackoffPolicy", "LatencyModel", "SimResult", "simulate", "STRATEGIES"]


# ------------------------------------------------------------------------------------------------ policies


class FixedBackoffPolicy(CommitPolicy):
    """Lakestream's commit loop with a naive policy: never pace, retry after a constant delay.

    Used by the benchmark as the "fixed backoff" baseline (real runs and simulation alike).
    """

    def __init__(self, *, clock: Callable[[], float], rng: random.Random | None = None, delay_s: float = 0.05,
                 config: PolicyConfig | None = None) -> None:
        super().__init__(clock=clock, rng=rng, config=config)
        self.delay_s = delay_s

    def pacing_delay(self) -> float:
        return 0.0

    def retry_delay(self, attempt: int) -> float:
        return self.delay_s


class PyIcebergRetry:
    """pyiceberg 0.12's ``Transaction.commit_transaction`` retry schedule (defaults of ``commit.retry.*``)."""

    def __init__(self, *, rng: random.Random, num_retries: int = 4, min_wait_s: float = 0.1, max_wait_s: float = 60.0):
        self._rng = rng
        self.num_retries = num_retries
        self.min_wait_s = min_wait_s
        self.max_wait_s = max_wait_s
        self.conflicts = 0

    def observe_head(self, step: int, at: float | None = None) -> None:  # pyiceberg keeps no state
        pass

    def record_attempt(self, *, started: float, ended: float, won: bool, head_step: int, foreign: int) -> None:
        if not won:
            self.conflicts += 1

    def pacing_delay(self) -> float:
        return 0.0

    def retry_delay(self, attempt: int) -> float:
        wait = min(self.min_wait_s * 2 ** (attempt - 1), self.max_wait_s)
        return wait + self._rng.uniform(0, 0.1 * wait)



@dataclass(frozen=True)
class _V1Config:
    ewma_alpha: float = 0.2
    rate_window_s: float = 5.0
    parse_s_per_byte: float = 2e-8
    min_critical_s: float = 0.001
    max_wait_s: float = 2.0


class DacV1Policy:
    """The first DAC policy (rate-ratio contention estimate, U(0.5, 1.5) pacing, 2 s cap), kept for comparison."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        config: PolicyConfig | None = None,
    ) -> None:
        self._clock = clock
        self._rng = rng or random.Random()
        self._cfg = config or _V1Config()
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


@dataclass(frozen=True)
class Strategy:
    """How a simulated producer's commit loop behaves."""

    name: str
    make: Callable[[Callable[[], float], random.Random], object]
    max_attempts: int
    timeout_s: float
    refresh_before_first: bool  # read the head before the first attempt (lakestream) or commit on the own view (pyiceberg)
    refresh_after_sleep: bool  # read the head again after a retry sleep
    table: bool = False  # the loop passes the head's producer table (last step of every producer) to the policy


def _dac(config: PolicyConfig | None = None) -> Callable[[Callable[[], float], random.Random], object]:
    return lambda clock, rng: CommitPolicy(clock=clock, rng=rng, config=config)


STRATEGIES: dict[str, Strategy] = {
    # "dac" is the shipped loop: it hands the head's producer table to the policy and re-reads the head after a sleep
    "dac": Strategy("dac", _dac(), 1000, 300.0, True, True, table=True),
    "dac-no-table": Strategy("dac-no-table", _dac(), 1000, 300.0, True, False),
    "dac-v1": Strategy("dac-v1", lambda clock, rng: DacV1Policy(clock=clock, rng=rng), 1000, 300.0, True, False),
    "fixed": Strategy("fixed", lambda clock, rng: FixedBackoffPolicy(clock=clock, rng=rng), 1000, 300.0, True, False),
    "pyiceberg": Strategy("pyiceberg", lambda clock, rng: PyIcebergRetry(rng=rng), 5, 1800.0, False, True),
}


# ------------------------------------------------------------------------------------------------ latency model


@dataclass(frozen=True)
class LatencyModel:
    """Durations of one producer's work, fitted to measurements (seconds).

    Attributes:
        critical_median_s, critical_sigma: lognormal critical section of one attempt (refresh + plan + swap).
        write_s: per-commit work outside the critical section (writing the data files, bookkeeping).
        cas_s: service time of one compare-and-swap at the catalog (the only shared resource of the model).
        source: where the numbers came from.
    """

    critical_median_s: float = 0.012
    critical_sigma: float = 0.35
    write_s: float = 0.005
    cas_s: float = 0.002
    source: str = "default"

    @classmethod
    def fit(cls, critical_s: Sequence[float], write_s: Sequence[float] = (), *, cas_s: float = 0.002,
            source: str = "fitted") -> LatencyModel:
        """Lognormal maximum-likelihood fit (mean and std of the logs) of measured critical sections."""
        logs = [math.log(x) for x in critical_s if x > 0]
        if len(logs) < 2:
            raise ValueError("need at least two positive critical-section samples to fit a latency model")
        mu = statistics.fmean(logs)
        sigma = statistics.pstdev(logs)
        write = statistics.median(write_s) if write_s else cls.write_s
        return cls(critical_median_s=math.exp(mu), critical_sigma=sigma, write_s=max(0.0, write), cas_s=cas_s,
                   source=source)

    def critical(self, rng: random.Random) -> float:
        return self.critical_median_s * math.exp(rng.gauss(0.0, self.critical_sigma))

    @property
    def critical_mean_s(self) -> float:
        return self.critical_median_s * math.exp(self.critical_sigma**2 / 2)


# ------------------------------------------------------------------------------------------------ simulation


@dataclass
class SimResult:
    strategy: str
    producers: int
    duration_s: float
    commits: int
    failed: int
    attempts: int
    lost: int
    latencies: list[float] = field(repr=False, default_factory=list)
    per_producer: list[int] = field(repr=False, default_factory=list)
    contenders_est: list[float] = field(repr=False, default_factory=list)

    @property
    def throughput(self) -> float:
        return self.commits / self.duration_s if self.duration_s else math.nan

    @property
    def wasted(self) -> float:
        return self.lost / self.attempts if self.attempts else math.nan

    @property
    def p50(self) -> float:
        return percentile(self.latencies, 50)

    @property
    def p99(self) -> float:
        return percentile(self.latencies, 99)

    @property
    def jain(self) -> float:
        return jain_index(self.per_producer)

    def row(self) -> dict[str, float | int | str]:
        est = statistics.median(self.contenders_est) if self.contenders_est else math.nan
        return {
            "strategy": self.strategy, "producers": self.producers, "commits_per_s": self.throughput,
            "failed": self.failed, "attempts": self.attempts, "wasted_frac": self.wasted,
            "p50_s": self.p50, "p99_s": self.p99, "p99_over_p50": self.p99 / self.p50 if self.p50 else math.nan,
            "jain": self.jain, "contenders_est_median": est,
        }


_WRITE_DONE, _ATTEMPT, _CRITICAL_DONE, _CAS_DONE = range(4)


def simulate(
    producers: int,
    strategy: Strategy | str,
    model: LatencyModel,
    *,
    duration_s: float = 60.0,
    warmup_s: float | None = None,
    seed: int = 0,
    cpus: int | None = None,
    background: int = 0,
    stagger_s: float | None = None,
) -> SimResult:
    """Simulate ``producers`` back-to-back committers for ``warmup_s + duration_s`` virtual seconds.

    ``cpus=None`` gives every producer its own CPU (a distributed deployment). ``cpus=k`` makes all producers share
    ``k`` CPUs by processor sharing (like P processes on one machine): data writes and critical sections are CPU
    work, and ``background`` always-busy processes of other tenants compete for the same CPUs. Producers start at
    uniform random times within ``stagger_s`` (default: one critical section, i.e. all at once).

    Metrics count what happens after the warm-up: commits completed, commit() latencies of calls completed, attempts
    and lost attempts made, commits per producer (for Jain's index).
    """
    strat = STRATEGIES[strategy] if isinstance(strategy, str) else strategy
    warm = duration_s * 0.25 if warmup_s is None else warmup_s
    end = warm + duration_s
    rng = random.Random(seed)
    now = 0.0

    def clock() -> float:
        return now

    policies = [strat.make(clock, random.Random(rng.getrandbits(64))) for _ in range(producers)]
    version = 0  # the head step
    catalog_free = 0.0
    timers: list[tuple[float, int, int, int]] = []  # (time, tie, kind, producer)
    cpu_jobs: list[tuple[float, int, int, int]] = []  # (virtual finish, tie, kind, producer): processor sharing
    work_done = 0.0  # virtual CPU time every running job has received so far
    counter = 0

    call_start = [0.0] * producers
    attempt_no = [0] * producers
    attempt_began = [0.0] * producers
    base = [0] * producers  # head version the current attempt plans on
    own_view = [0] * producers  # head version of the producer's own table view
    last_step: dict[int, int] = {}  # the head's producer table: last published step per producer

    res = SimResult(strat.name, producers, duration_s, 0, 0, 0, 0, per_producer=[0] * producers)

    def rate() -> float:
        running = len(cpu_jobs) + background
        return 1.0 if cpus is None or running <= cpus else cpus / running

    def timer(t: float, kind: int, i: int) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(timers, (t, counter, kind, i))

    def work(seconds: float, kind: int, i: int) -> None:
        nonlocal counter
        counter += 1
        if cpus is None:
            heapq.heappush(timers, (now + seconds, counter, kind, i))
        else:
            heapq.heappush(cpu_jobs, (work_done + seconds, counter, kind, i))

    def start_call(i: int, t: float) -> None:
        call_start[i] = t
        attempt_no[i] = 0
        work(model.write_s, _WRITE_DONE, i)

    def observe(i: int) -> None:
        if strat.table:
            policies[i].observe_head(version, now, producers=last_step.values())
        else:
            policies[i].observe_head(version, now)

    spread = model.critical_median_s if stagger_s is None else stagger_s
    for i in sorted(range(producers), key=lambda _: rng.random()):
        timer(rng.uniform(0, spread), -1, i)  # -1: start the first call

    while True:
        t_timer = timers[0][0] if timers else math.inf
        t_cpu = now + (cpu_jobs[0][0] - work_done) / rate() if cpu_jobs else math.inf
        t = min(t_timer, t_cpu)
        if t > end:
            break
        if cpu_jobs:
            work_done += (t - now) * rate()
        now = t
        if t_cpu <= t_timer:
            _, _, kind, i = heapq.heappop(cpu_jobs)
        else:
            _, _, kind, i = heapq.heappop(timers)
        policy = policies[i]
        if kind == -1:
            start_call(i, now)
        elif kind == _WRITE_DONE:
            timer(now + policy.pacing_delay(), _ATTEMPT, i)
        elif kind == _ATTEMPT:
            attempt_no[i] += 1
            attempt_began[i] = now
            if strat.refresh_before_first if attempt_no[i] == 1 else strat.refresh_after_sleep:
                own_view[i] = version
                observe(i)
            base[i] = own_view[i]
            work(model.critical(rng), _CRITICAL_DONE, i)
        elif kind == _CRITICAL_DONE:  # the swap goes to the catalog, which serves swaps one at a time
            catalog_free = max(now, catalog_free) + model.cas_s
            timer(catalog_free, _CAS_DONE, i)
        else:  # _CAS_DONE: decided now, in catalog order
            counted = now >= warm
            if counted:
                res.attempts += 1
            if version == base[i]:
                version += 1
                own_view[i] = version
                last_step[i] = version
                policy.record_attempt(started=attempt_began[i], ended=now, won=True, head_step=version, foreign=0)
                if counted:
                    res.commits += 1
                    res.per_producer[i] += 1
                    res.latencies.append(now - call_start[i])
                    est = getattr(policy, "contenders", None)
                    if est is not None:
                        res.contenders_est.append(float(est))
                start_call(i, now)
                continue
            foreign = version - base[i]
            own_view[i] = version  # lakestream re-reads the head right after a loss (pyiceberg after the sleep)
            observe(i)
            policy.record_attempt(started=attempt_began[i], ended=now, won=False, head_step=version, foreign=foreign)
            if counted:
                res.lost += 1
            if attempt_no[i] >= strat.max_attempts or now - call_start[i] >= strat.timeout_s:
                if counted:
                    res.failed += 1
                start_call(i, now)
                continue
            timer(now + policy.retry_delay(attempt_no[i]), _ATTEMPT, i)
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--producers", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--strategies", nargs="+", default=["dac", "fixed", "pyiceberg"], choices=sorted(STRATEGIES))
    parser.add_argument("--duration", type=float, default=120.0, help="virtual seconds measured (after 25%% warm-up)")
    parser.add_argument("--critical-ms", type=float, default=12.0)
    parser.add_argument("--sigma", type=float, default=0.35)
    parser.add_argument("--write-ms", type=float, default=5.0)
    parser.add_argument("--cas-ms", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus", type=int, default=None, help="producers share this many CPUs (default: one each)")
    parser.add_argument("--background", type=int, default=0, help="always-busy processes competing for --cpus")
    parser.add_argument("--stagger", type=float, default=None, help="producers start within this many seconds")
    args = parser.parse_args(argv)
    model = LatencyModel(critical_median_s=args.critical_ms / 1000, critical_sigma=args.sigma,
                         write_s=args.write_ms / 1000, cas_s=args.cas_ms / 1000, source="command line")
    table = Table(f"simulated producers (critical section median {args.critical_ms} ms, sigma {args.sigma})",
                  ["strategy", "P", "commits/s", "failed", "wasted", "p50 ms", "p99 ms", "p99/p50", "Jain", "n est"])
    for n in args.producers:
        for name in args.strategies:
            r = simulate(n, name, model, duration_s=args.duration, seed=args.seed, cpus=args.cpus,
                         background=args.background, stagger_s=args.stagger).row()
            table.add(name, n, r["commits_per_s"], r["failed"], r["wasted_frac"], r["p50_s"] * 1000, r["p99_s"] * 1000,
                      r["p99_over_p50"], r["jain"], r["contenders_est_median"])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
