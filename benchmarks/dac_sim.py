"""A discrete-event simulation of many producers committing through one catalog, driving the *pure* DAC policy.

Nothing here does I/O: every producer owns a :class:`lakestream_iceberg.write.dac.CommitPolicy` whose clock is the
simulator's virtual clock, so thousands of producers run in seconds and the policy's decisions are exactly the ones the
real :class:`lakestream_iceberg.write.commit.CommitLoop` would take.

Shared model (optimistic concurrency against a compare-and-swap, one shared catalog, every producer on its own CPU):

* a producer's ``commit()`` call writes its data files (``write_s``), then makes attempts. An attempt reads the head
  (version ``v0``), works for a *critical section* ``c`` drawn from a lognormal fitted to measured attempt durations
  (refresh, manifests, metadata), then sends its compare-and-swap to the catalog;
* the catalog serialises compare-and-swaps (a FIFO server, ``cas_s`` each): a swap wins iff the head is still ``v0``;
* a producer commits back to back: the next call starts when the previous one returns;
* ``cpus=k``: producers share ``k`` CPUs by processor sharing; writes, intent writes and critical sections are CPU
  work, sleeping and holding are not.

``dac`` and ``dac-single`` (and ``fixed-group``) run the shipped ``Producer.commit`` + ``CommitLoop.run`` step by step,
one generator per producer, calling the policy in the same order and with the same arguments as the real code
(``observe_head`` with the head's producer table, group and reported group commit time at every refresh and after
a win, ``record_attempt``, ``record_published``, ``pacing_delay``/``retry_delay``/``hold_delay``/``poll_interval``).
The first call of a producer reads the head; later calls start from the loop's own view, and a producer that
believes it is alone plans on that view without reading the head again.

Group commit (``dac``; ``lakestream.commit.group.enabled``, the default):

* a producer that is not alone (``contenders >= 1.5``, and the catalog not ``quiet``) writes its batch, stages an intent (``stage_s`` of CPU; the
  intent is visible to listings from then on, ordered by when it was created) and holds ``hold_delay`` seconds;
* while holding it polls every ``poll_interval``: polls are not simulated one by one. When a swap publishes its batch
  at ``T`` (the committer deletes the intents it published the instant its swap lands), the holder wakes at its first
  poll tick at or after ``T`` (the hold's end at the latest), reads the head and returns: *carried*, no swap of its own.
  Otherwise it wakes when the hold ends, reads the head and plans;
* a plan publishes its own batch and the oldest staged batches of others (every staged batch whose seq is the next one
  on the head it plans on), ``group_max`` (32) in all, each as its own step in staging order: one swap with a critical
  section ``c(k) = c1 * (1 + beta * (k - 1))``, ``c1`` drawn as for one batch (``beta`` 0.55: measured, a 16-batch
  group commit took ~80 ms where a single one took ~8-9 ms). Listing staged intents is free (a producer committing
  alone uses a listing up to 0.1 s old, like ``BatchPlanner._eligible``);
* a group's snapshots report its committer's typical critical section (``lakestream.group-commit-ms``: the
  committer's ``critical_section_s`` when it planned, groups of more than one batch only); every producer reading
  the head hands it to the policy (``observe_head(..., group_commit_s=...)``), which holds at least that long a slot;
* a lost swap reads the head; when that head already shows its batch published (the winner carried it,
  ``Carry.published``) the loop returns at once without holding, otherwise it holds again and retries. A producer
  that committed directly (alone) and lost stages its batch then ("escalates") and continues as above;
* not modelled: the intent write and the listing as catalog or storage load, failed storage calls, intents that age
  out (``gc_grace_ms / 2``), deletion delays.

``dac-single`` is the same loop with group commit off: every commit is its own swap, paced (``pacing_delay``) and
retried (``retry_delay``, re-reading the head after a sleep) by the round-robin law.

The other strategies run the older single-batch model (``refresh_before_first`` / ``refresh_after_sleep`` describe
their loops; a lost attempt re-reads the head right away, which is when lakestream's loop measures the foreign
commits it lost to): ``fixed`` (no pacing, constant retry delay, same budget as DAC, no group commit), ``pyiceberg``
(pyiceberg 0.12's default: the first attempt on the producer's own stale view, then 4 retries with 100 ms * 2^a
backoff + up to 10 % jitter, refreshing after each sleep; the commit fails after the 5th loss), ``dac-no-table`` (DAC
from step gaps only, no producer table) and ``dac-v1`` (the first DAC policy).

Metrics: ``commits`` are batches published (a carried batch counts for its owner), ``attempts`` compare-and-swaps
sent, ``wasted`` the fraction of them lost, ``carried`` the fraction of commits published by another producer's swap,
``batches_per_cas`` the mean batches per winning swap.

Run ``python benchmarks/dac_sim.py --producers 64 256 1024`` for a quick table. ``--cold-start 5`` adds a table of
the start-up: swaps won and lost in the first 5 s (from t=0, warm-up included), lost afterwards, the time of the
last lost swap, and the batches published per second in those first 5 s against the steady rate (``vs steady``: does
the start-up hold the throughput?); e.g. ``--producers 1024 --strategies dac --cold-start 5`` (all start within one critical section) and
the same with ``--stagger 30`` (producers start within 30 s).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Table, jain_index, percentile  # noqa: E402

from lakestream_iceberg.write.dac import CommitPolicy, PolicyConfig  # noqa: E402

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
    loop: bool = False  # simulate the shipped CommitLoop + Producer step by step (``_simulate_loop``)
    group: bool = False  # group commit on (``lakestream.commit.group.enabled``); only with ``loop``
    group_max: int = 32  # ``lakestream.commit.group.max-batches``


def _dac(config: PolicyConfig | None = None) -> Callable[[Callable[[], float], random.Random], object]:
    return lambda clock, rng: CommitPolicy(clock=clock, rng=rng, config=config)


STRATEGIES: dict[str, Strategy] = {
    # "dac" is the shipped loop with its defaults: group commit on, the head's producer table handed to the policy
    "dac": Strategy("dac", _dac(), 1000, 300.0, True, True, table=True, loop=True, group=True),
    # the same loop with group commit off (lakestream.commit.group.enabled=false): every commit is its own swap
    "dac-single": Strategy("dac-single", _dac(), 1000, 300.0, True, True, table=True, loop=True),
    "dac-no-table": Strategy("dac-no-table", _dac(), 1000, 300.0, True, False),
    "dac-v1": Strategy("dac-v1", lambda clock, rng: DacV1Policy(clock=clock, rng=rng), 1000, 300.0, True, False),
    "fixed": Strategy("fixed", lambda clock, rng: FixedBackoffPolicy(clock=clock, rng=rng), 1000, 300.0, True, False),
    # what commit_scaling's real "fixed" runs now are: the shipped loop (group commit on) with FixedBackoffPolicy,
    # which inherits the DAC hold; only its direct commits (alone, or before escalating) use the constant retry
    "fixed-group": Strategy("fixed-group", lambda clock, rng: FixedBackoffPolicy(clock=clock, rng=rng), 1000, 300.0,
                            True, True, table=True, loop=True, group=True),
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
        beta: group commit: the critical section of a swap publishing ``k`` batches is ``c1 * (1 + beta * (k - 1))``
            with ``c1`` drawn as for one batch (measured: a 16-batch group commit took ~80 ms where a single one took
            ~8-9 ms, i.e. beta ~0.55).
        stage_s: group commit: writing one batch's intent file.
        source: where the numbers came from.
    """

    critical_median_s: float = 0.012
    critical_sigma: float = 0.35
    write_s: float = 0.005
    cas_s: float = 0.002
    beta: float = 0.55
    stage_s: float = 0.0005
    source: str = "default"

    @classmethod
    def fit(cls, critical_s: Sequence[float], write_s: Sequence[float] = (), *, cas_s: float = 0.002,
            beta: float = 0.55, stage_s: float = 0.0005, source: str = "fitted") -> LatencyModel:
        """Lognormal maximum-likelihood fit (mean and std of the logs) of measured critical sections."""
        logs = [math.log(x) for x in critical_s if x > 0]
        if len(logs) < 2:
            raise ValueError("need at least two positive critical-section samples to fit a latency model")
        mu = statistics.fmean(logs)
        sigma = statistics.pstdev(logs)
        write = statistics.median(write_s) if write_s else cls.write_s
        return cls(critical_median_s=math.exp(mu), critical_sigma=sigma, write_s=max(0.0, write), cas_s=cas_s,
                   beta=beta, stage_s=stage_s, source=source)

    def critical(self, rng: random.Random, batches: int = 1) -> float:
        """One attempt's critical section; ``batches`` > 1: a group commit publishing that many batches."""
        c1 = self.critical_median_s * math.exp(rng.gauss(0.0, self.critical_sigma))
        return c1 if batches <= 1 else c1 * (1.0 + self.beta * (batches - 1))

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
    carried: int = 0  # commits (batches) published by another producer's swap, with no swap of their own
    swaps_won: int = 0  # compare-and-swaps won
    swap_batches: int = 0  # batches those swaps published
    # (time, won, batches published) of every swap from t=0
    swap_log: list[tuple[float, bool, int]] = field(repr=False, default_factory=list)

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

    def cold_start(self, window_s: float) -> dict[str, float | int]:
        """Swaps from t=0 (warm-up included): won and lost in the first ``window_s`` seconds, lost later, and the time
        of the last lost swap (when losses stopped; near the end of the run when they never do)."""
        early = [won for t, won, _ in self.swap_log if t < window_s]
        lost_times = [t for t, won, _ in self.swap_log if not won]
        published = sum(n for t, won, n in self.swap_log if won and t < window_s)
        return {
            "won_early": sum(early), "lost_early": len(early) - sum(early),
            "published_early_per_s": published / window_s,
            "vs_steady": published / window_s / self.throughput if self.throughput else math.nan,
            "lost_later": sum(1 for t in lost_times if t >= window_s),
            "last_loss_s": max(lost_times) if lost_times else math.nan,
        }

    def row(self) -> dict[str, float | int | str]:
        est = statistics.median(self.contenders_est) if self.contenders_est else math.nan
        return {
            "strategy": self.strategy, "producers": self.producers, "commits_per_s": self.throughput,
            "failed": self.failed, "attempts": self.attempts, "wasted_frac": self.wasted,
            "p50_s": self.p50, "p99_s": self.p99, "p99_over_p50": self.p99 / self.p50 if self.p50 else math.nan,
            "jain": self.jain, "contenders_est_median": est,
            "carried": self.carried / self.commits if self.commits else math.nan,
            "batches_per_cas": self.swap_batches / self.swaps_won if self.swaps_won else math.nan,
        }


def next_event(now: float, work_done: float, timers: list, cpu_jobs: list,
               rate: Callable[[], float]) -> tuple[float, float, bool]:
    """The simulators' clock (processor sharing): when the next timer fires or the next CPU job finishes, the CPU work
    every running job has received by then, and whether that event is a CPU job's."""
    t_timer = timers[0][0] if timers else math.inf
    t_cpu = now + (cpu_jobs[0][0] - work_done) / rate() if cpu_jobs else math.inf
    t = min(t_timer, t_cpu)
    if cpu_jobs and t < math.inf:
        work_done += (t - now) * rate()
    return t, work_done, t_cpu <= t_timer


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

    Metrics count what happens after the warm-up: commits (batches published) completed, commit() latencies of calls
    completed, attempts (compare-and-swaps sent) and lost ones, commits per producer (for Jain's index), commits
    carried by another producer's group commit, and batches per winning swap.
    """
    strat = STRATEGIES[strategy] if isinstance(strategy, str) else strategy
    warm = duration_s * 0.25 if warmup_s is None else warmup_s
    if strat.loop:
        return _simulate_loop(producers, strat, model, duration_s=duration_s, warm=warm, seed=seed, cpus=cpus,
                              background=background, stagger_s=stagger_s)
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
        t, done, from_cpu = next_event(now, work_done, timers, cpu_jobs, rate)
        if t > end:
            break
        now, work_done = t, done
        if from_cpu:
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
            res.swap_log.append((now, version == base[i], 1 if version == base[i] else 0))
            if version == base[i]:
                version += 1
                own_view[i] = version
                last_step[i] = version
                policy.record_attempt(started=attempt_began[i], ended=now, won=True, head_step=version, foreign=0)
                if counted:
                    res.commits += 1
                    res.swaps_won += 1
                    res.swap_batches += 1
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


@dataclass(eq=False)
class _Batch:
    """One producer's batch in the loop simulation (its data files are written)."""

    owner: int
    staged_at: float  # its place in a group's order: intent creation (staged), else the end of the write
    prev_step: int | None  # the owner's last published step when it was written (its seq is the next one)
    step: int | None = None  # published as this step
    staged: bool = False  # its intent is in the staging folder (not yet published, not withdrawn)
    key: tuple[float, int] = (0.0, 0)  # sort key in the staging folder


# what a producer process waits for: ("work", cpu_s) | ("sleep", s) | ("cas",) | ("hold", s, poll_s, batch)
_Request = tuple


def _simulate_loop(
    producers: int,
    strat: Strategy,
    model: LatencyModel,
    *,
    duration_s: float,
    warm: float,
    seed: int,
    cpus: int | None,
    background: int,
    stagger_s: float | None,
) -> SimResult:
    """The shipped ``Producer.commit`` / ``CommitLoop.run`` as one generator per producer (see the module docstring).

    Every call into the policy is made in the order the real code makes it, with the same arguments (times on the
    virtual clock). Holding is not simulated poll by poll: a holder whose intent disappears (its batch was published at
    ``T``) wakes at its first poll tick at or after ``T`` (``start + j * poll``, the hold's end at the latest), exactly
    when ``CommitLoop._hold`` would notice; otherwise it wakes when the hold ends.
    """
    end = warm + duration_s
    rng = random.Random(seed)
    now = 0.0

    def clock() -> float:
        return now

    policies = [strat.make(clock, random.Random(rng.getrandbits(64))) for _ in range(producers)]
    res = SimResult(strat.name, producers, duration_s, 0, 0, 0, 0, per_producer=[0] * producers)
    group_on = strat.group and strat.group_max >= 2  # stage_batch (write/planner.py) returns None otherwise
    others_max = max(0, strat.group_max - 1) if strat.group else 0
    cache_len = 2 * strat.group_max  # a cached listing keeps its oldest intents only (enough for one plan)

    # the catalog: the head step, its group, the critical section its committer reported (lakestream.group-commit-ms,
    # group commits only), and the producer table (last published step per producer)
    version = 0
    head_group = 1
    head_group_s: float | None = None
    last_step: dict[int, int] = {}
    catalog_free = 0.0
    # the staging folder, oldest intent first
    staging: list[tuple[float, int, _Batch]] = []
    tie = 0
    # per producer: the loop's table view and freshness, its last staging listing, and a hold in progress
    view = [0] * producers
    fresh = [False] * producers  # Stream.producer() marks a new loop stale
    listed: list[tuple[float, list[_Batch]]] = [(-math.inf, [])] * producers
    holds: dict[int, tuple[_Batch, float, float, float]] = {}  # producer -> (batch, start, poll, end)

    timers: list[tuple[float, int, int, int, object]] = []  # (time, tie, producer, token, value to resume with)
    cpu_jobs: list[tuple[float, int, int, int]] = []  # (virtual finish, tie, producer, token): processor sharing
    work_done = 0.0
    token = [0] * producers  # a process waits for one thing at a time; a stale wake-up carries an old token

    def rate() -> float:
        running = len(cpu_jobs) + background
        return 1.0 if cpus is None or running <= cpus else cpus / running

    def wake_at(t: float, i: int, value: object = None) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(timers, (t, tie, i, token[i], value))

    def refresh(i: int) -> None:
        """CommitLoop.refresh: read the head; _observe hands its step, producer table, group and reported group
        commit time to the policy."""
        view[i] = version
        fresh[i] = True
        observe(i)

    def observe(i: int) -> None:
        """CommitLoop._observe of the head."""
        policies[i].observe_head(version, producers=last_step.values(), group=head_group, group_commit_s=head_group_s)

    def stage(b: _Batch, at: float) -> None:
        """StagingArea.stage: the intent (created at ``at``, Intent.staged_at) is in the folder from now on."""
        nonlocal tie
        tie += 1
        b.staged_at = at
        b.staged = True
        b.key = (at, tie)
        bisect.insort(staging, (at, tie, b))  # ties are unique: batches are never compared

    def unstage(b: _Batch) -> None:
        if b.staged:
            b.staged = False
            del staging[bisect.bisect_left(staging, b.key)]

    def listing(i: int, every: float) -> list[_Batch]:
        """StagingArea.pending: the staged intents, oldest first; ``every`` > 0 answers from a recent listing."""
        if every > 0 and now - listed[i][0] < every:
            return listed[i][1]
        out = [e[2] for e in staging[:cache_len + 1]]
        listed[i] = (now, out)
        return out

    def eligible(b: _Batch, v: int) -> bool:
        """BatchPlanner._eligible: the batch's seq is its owner's next one on the head ``v`` (not yet published there)."""
        return (b.prev_step is None or b.prev_step <= v) and (b.step is None or b.step > v)

    def publish(b: _Batch, step: int) -> None:
        """A winning swap published ``b``; its committer deletes the intent at once, and a holder notices at its next
        poll tick."""
        b.step = step
        last_step[b.owner] = step
        unstage(b)
        held = holds.get(b.owner)
        if held is not None and held[0] is b:
            _, start, poll, until = held
            del holds[b.owner]
            ticks = max(1, math.ceil((now - start) / poll - 1e-9))
            token[b.owner] += 1  # cancels the wake-up at the hold's end
            wake_at(min(until, start + ticks * poll), b.owner, True)

    def process(i: int, delay: float) -> Generator[_Request, object, None]:
        nonlocal version, head_group, head_group_s
        policy = policies[i]
        yield ("sleep", delay)
        while True:
            # ---- Producer._commit
            call_start = now
            if not fresh[i]:
                refresh(i)
            yield ("work", model.write_s)
            own = _Batch(i, now, last_step.get(i))
            carry_at: float | None = None  # Carry.staged_at: when the intent was written
            if group_on and policy.contenders >= 1.5 and not policy.quiet:  # Producer._contended: stage it
                created = now
                yield ("work", model.stage_s)
                stage(own, created)
                carry_at = now
            escalate = group_on
            # ---- CommitLoop.run
            deadline = now + strat.timeout_s
            if carry_at is None:
                delay = policy.pacing_delay()
                if delay > 0:
                    yield ("sleep", delay)
            reuse = fresh[i] and policy.contenders < 1.5  # alone: our own last commit is still the head
            if not (reuse or carry_at is not None):
                refresh(i)
            stale = carry_at is not None
            attempt = 0
            carried_after: float | None = None
            outcome = ""
            while True:
                attempt += 1
                if carry_at is not None:
                    waited = now - carry_at if attempt == 1 else 0.0
                    # after a lost swap the head just read may already show the batch published (Carry.published)
                    published = attempt > 1 and own.step is not None and own.step <= view[i]
                    # Carry.queued: a listing of the staging folder, only when the policy asks (a cold start)
                    queued = bisect.bisect_left(staging, own.key) if own.staged and policy.wants_queue else None
                    hold = 0.0 if published else policy.hold_delay(waited=waited, queued=queued)
                    if hold > 0:
                        seconds = min(hold, max(0.0, deadline - now))
                        poll = policy.poll_interval()
                        if seconds > 0 and (yield ("hold", seconds, poll, own)):
                            carried_after = now - carry_at
                        stale = True
                    if stale:
                        refresh(i)
                        stale = False
                began = now
                base = view[i]
                # the planner: Done when the head it plans on already has the batch
                if own.step is not None and own.step <= base:
                    if carry_at is not None and carried_after is None:
                        carried_after = now - carry_at
                    outcome = "carried"
                    break
                others: list[_Batch] = []
                if others_max:  # BatchPlanner._eligible: a producer committing alone lists the folder every 0.1 s
                    for b in listing(i, 0.0 if carry_at is not None else 0.1):
                        if b.owner != i and eligible(b, base):
                            others.append(b)
                            if len(others) >= others_max:
                                break
                batches = sorted([own, *others], key=lambda b: b.staged_at)
                # BatchPlanner._plan_group: a group's snapshots report the committer's typical critical section (in ms,
                # one decimal, as StreamState.properties writes it)
                reported = float(f"{policy.critical_section_s * 1000:.1f}") if len(batches) > 1 else None
                yield ("work", model.critical(rng, len(batches)))
                yield ("cas",)
                counted = now >= warm
                if counted:
                    res.attempts += 1
                res.swap_log.append((now, version == base, len(batches) if version == base else 0))
                if version == base:  # won: every batch of the plan becomes a step, in staging order
                    for b in batches:
                        version += 1
                        publish(b, version)
                    head_group = len(batches)
                    head_group_s = reported / 1000 if reported else None  # CommitLoop._observe: absent or 0 -> None
                    view[i] = version
                    fresh[i] = True
                    if counted:
                        res.swaps_won += 1
                        res.swap_batches += len(batches)
                    policy.record_attempt(started=began, ended=now, won=True, head_step=version, foreign=0)
                    observe(i)
                    outcome = "won"
                    break
                # lost: refresh, measure, maybe escalate to group commit
                if counted:
                    res.lost += 1
                fresh[i] = False
                refresh(i)
                foreign = max(0, version - base)
                policy.record_attempt(started=began, ended=now, won=False, head_step=base + foreign, foreign=foreign)
                if carry_at is None and escalate:  # not alone after all: stage the batch and join group commit
                    escalate = False
                    created = now
                    yield ("work", model.stage_s)
                    stage(own, created)
                    carry_at = now
                if attempt >= strat.max_attempts or now >= deadline:
                    outcome = "failed"
                    break
                if carry_at is not None:
                    continue  # hold again, from its position in the new head's group
                delay = policy.retry_delay(attempt)
                if delay > 0:
                    yield ("sleep", delay)
                    refresh(i)
            # ---- back in Producer._commit
            counted = now >= warm
            if outcome == "failed":
                unstage(own)  # the intent is withdrawn
                if counted:
                    res.failed += 1
                continue
            assert own.step is not None
            policy.record_published(step=own.step, at=now, carried_after=None if outcome == "won" else carried_after)
            if counted:
                res.commits += 1
                res.per_producer[i] += 1
                res.latencies.append(now - call_start)
                if outcome != "won":
                    res.carried += 1
                est = getattr(policy, "contenders", None)
                if est is not None:
                    res.contenders_est.append(float(est))

    spread = model.critical_median_s if stagger_s is None else stagger_s
    procs = [None] * producers
    for i in sorted(range(producers), key=lambda _: rng.random()):
        procs[i] = process(i, rng.uniform(0, spread))

    def dispatch(i: int, request: _Request) -> None:
        nonlocal catalog_free, tie
        kind = request[0]
        if kind == "work":
            if cpus is None:
                wake_at(now + request[1], i)
            else:
                tie += 1
                heapq.heappush(cpu_jobs, (work_done + request[1], tie, i, token[i]))
        elif kind == "sleep":
            wake_at(now + request[1], i)
        elif kind == "cas":  # the catalog serves swaps one at a time, in arrival order
            catalog_free = max(now, catalog_free) + model.cas_s
            wake_at(catalog_free, i)
        else:  # hold: until the intent disappears (next poll tick) or the hold ends
            _, seconds, poll, b = request
            if b.step is not None:  # already published: noticed at the first poll
                wake_at(now + min(seconds, poll), i, True)
            else:
                holds[i] = (b, now, poll, now + seconds)
                wake_at(now + seconds, i, False)

    for i in range(producers):
        dispatch(i, next(procs[i]))
    while True:
        t, done, from_cpu = next_event(now, work_done, timers, cpu_jobs, rate)
        if t > end:
            break
        now, work_done = t, done
        if from_cpu:
            _, _, i, tok = heapq.heappop(cpu_jobs)
            value = None
        else:
            _, _, i, tok, value = heapq.heappop(timers)
        if tok != token[i]:
            continue  # a hold's end, cancelled because the batch was published first
        if value is False:
            holds.pop(i, None)
        dispatch(i, procs[i].send(value))
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--producers", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--strategies", nargs="+", default=["dac", "dac-single", "fixed", "pyiceberg"],
                        choices=sorted(STRATEGIES))
    parser.add_argument("--duration", type=float, default=120.0, help="virtual seconds measured (after 25%% warm-up)")
    parser.add_argument("--critical-ms", type=float, default=12.0)
    parser.add_argument("--sigma", type=float, default=0.35)
    parser.add_argument("--write-ms", type=float, default=5.0)
    parser.add_argument("--cas-ms", type=float, default=2.0)
    parser.add_argument("--beta", type=float, default=LatencyModel.beta,
                        help="group commit: critical section of k batches = c1 * (1 + beta * (k - 1))")
    parser.add_argument("--stage-ms", type=float, default=LatencyModel.stage_s * 1000, help="writing one intent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus", type=int, default=None, help="producers share this many CPUs (default: one each)")
    parser.add_argument("--background", type=int, default=0, help="always-busy processes competing for --cpus")
    parser.add_argument("--stagger", type=float, default=None, help="producers start within this many seconds")
    parser.add_argument("--cold-start", type=float, default=None, metavar="SECONDS",
                        help="also print swaps won and lost in the first SECONDS from t=0 (warm-up included), lost "
                             "later, and the time of the last lost swap")
    args = parser.parse_args(argv)
    model = LatencyModel(critical_median_s=args.critical_ms / 1000, critical_sigma=args.sigma,
                         write_s=args.write_ms / 1000, cas_s=args.cas_ms / 1000, beta=args.beta,
                         stage_s=args.stage_ms / 1000, source="command line")
    table = Table(f"simulated producers (critical section median {args.critical_ms} ms, sigma {args.sigma}, "
                  f"group beta {args.beta}; commits = batches published)",
                  ["strategy", "P", "commits/s", "failed", "swaps", "wasted", "carried", "b/swap", "p50 ms", "p99 ms",
                   "p99/p50", "Jain", "n est", "wall s"])
    cold = None
    if args.cold_start is not None:
        stagger = "one critical section" if args.stagger is None else f"{args.stagger:g} s"
        cold = Table(f"cold start (producers start within {stagger}; swaps from t=0, run of "
                     f"{args.duration * 1.25:g} s)",
                     ["strategy", "P", f"won <{args.cold_start:g}s", f"lost <{args.cold_start:g}s",
                      f"lost >={args.cold_start:g}s", "last loss s", f"published/s <{args.cold_start:g}s",
                      "vs steady"])
    for n in args.producers:
        for name in args.strategies:
            t0 = time.monotonic()
            result = simulate(n, name, model, duration_s=args.duration, seed=args.seed, cpus=args.cpus,
                              background=args.background, stagger_s=args.stagger)
            if cold is not None:
                c = result.cold_start(args.cold_start)
                cold.add(name, n, c["won_early"], c["lost_early"], c["lost_later"], c["last_loss_s"],
                         c["published_early_per_s"], c["vs_steady"])
            r = result.row()
            table.add(name, n, r["commits_per_s"], r["failed"], r["attempts"], r["wasted_frac"], r["carried"],
                      r["batches_per_cas"], r["p50_s"] * 1000, r["p99_s"] * 1000, r["p99_over_p50"], r["jain"],
                      r["contenders_est_median"], time.monotonic() - t0)
    print(table)
    if cold is not None:
        print(cold)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
