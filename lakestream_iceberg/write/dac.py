"""Decentralized Adaptive Commit (DAC): the commit pacing and retry policy, pure (no I/O, injected clock and RNG).

Producers publish through one serialisation point, the catalog's compare-and-swap. An attempt occupies that point
"virtually" for its critical section ``c`` (refresh the table, write the manifests, swap the pointer): two attempts
whose critical sections overlap conflict and one of them is wasted, and where producers share CPUs the loser also
slowed the winner down. No producer talks to another, but all of them read the same head snapshot, and every commit
carries a global step number and the table of every producer's last step. From that a producer measures:

* ``c``: a running geometric mean (EWMA of the logarithm) of its own attempt durations, i.e. their typical value,
  not dragged up by the occasional attempt stalled by a busy CPU or disk; floored by a cost model of the metadata it
  must parse and rewrite (``metadata_bytes * parse_s_per_byte``), so a cold producer on a big table does not
  underestimate it;
* ``n``, the producers sharing the catalog: the producers of the head's producer table whose last commit lies within
  the last ``active_horizon * n`` steps (every active producer commits about once per ``n`` steps), when the commit
  loop passes that table to :meth:`CommitPolicy.observe_head`; otherwise the largest *step gap* between its own last
  ``gap_window`` commits (it published step 100, then step 116: sixteen commits per commit of its own), outliers
  over four times the median ignored (a producer that paused is not facing contention). Both are
  exactly 1 for a producer that is alone. The table count is the same for every producer; the gap estimate is not
  (a producer that got less than its share sees bigger gaps), so it is only the fallback;
* its *age rank* (table only): how many active producers have waited longer than it since their last commit.

The control law is a self-clocked round robin: one commit per slot (``slot = c * (1 + slot_margin)``), each
producer once per ``n`` slots. That keeps the aggregate attempt rate near the throughput optimum of a shared
compare-and-swap: everyone attempting at once wastes almost every attempt, everyone waiting too long idles it.

* **pacing** (before each commit): the producer's next commit should land ``n`` slots after its previous one, so it
  waits ``n * slot * U(1 - pacing_jitter, 1 + pacing_jitter) - elapsed - c`` (``elapsed``: time since its previous
  commit landed, e.g. writing the data files; ``c``: the attempt itself), at least 0. Alone (``n = 1``) it never
  waits, and a producer that commits rarely never waits either, because its turn is long due. The jitter is small:
  everybody has the same period, and re-randomising all phases every round would only add collisions (in the
  simulation the jitter width matters little; the collisions come from the spread of ``c`` itself).
* **retry** (after a lost compare-and-swap, attempt ``a >= 1``):
  - with the producer table: ``slot * (older + U(0, 1))``, where ``older`` is its age rank: the producers that have
    waited longer go first, one slot each (FIFO order without a queue: the commit that waited longest retries at
    once, which keeps the latency tail short and the shares fair). A producer not yet in the table (it never
    committed) does not know its rank and draws it from a window of ``min(2^(a-1), n)`` slots: binary exponential
    backoff bounded by the round-robin period, which resolves a cold start of many producers at once;
  - without the table: ``U(0, 1) * retry_slots * c / a``: retry almost at once, sooner with every loss, so older
    commits get priority, unlike exponential backoff, whose windows grow with every loss and starve exactly the
    commits that have waited longest.
  The table-based retry assumes the commit loop reads the head again after a retry sleep (a plan made before a long
  sleep is stale by the time it is sent); the fallback keeps its sleeps shorter than a critical section.
* every wait is capped by ``max_wait_s``; the caller's commit budget (time and attempts) bounds the loop.

**Group commit** (the default once a producer is not alone, see :mod:`lakestream_iceberg.write.staging`): a producer stages
its written batch as an intent and *holds* it; any commit publishes every staged batch, each as its own snapshot, in
one compare-and-swap. A round-robin of single commits cannot beat one producer's rate (every commit still pays a whole
critical section, serialised); a group commit pays the fixed part (refresh, metadata rewrite, swap) once per group, and
a producer whose batch rode in another's commit made no attempt at all, so the aggregate rate grows with the number of
producers instead of shrinking. The law decides who commits the next group and when:

* every head records how many batches its commit published (``group``), so every producer sees the same last group
  and its own *position* in it (batches are ordered by staging time there). Position 0, the producer that staged
  first last round, commits next: it publishes whatever is staged as soon as its own batch is staged (``hold_gather``
  of its own critical sections later, 0 by default: whoever re-stages late rides in the next group, and the catalog
  never idles). Position ``p`` holds ``p`` slots, so it commits only if everyone before it had nothing staged: a
  producer that stopped, or is slow, costs one slot, never a stall. A producer outside the last group ranks after it
  (``k + older``). Positions past ``hold_max_slots`` (and producers that never published, counted as the last of
  the ``n``) hold that many slots, plus one per ``group_max_batches`` positions beyond (a group commit carries at
  most that many batches, so that is how many group commits are ahead of them), plus a uniform draw over one more
  to keep them apart: a wait bounded by the round when most producers have stopped;
* here a slot is the largest of the producer's own slot, a high quantile of the time its staged batches waited
  until a commit carried them (the quantile, not the typical value, because firing while a slow commit that would
  have carried it is still in flight wastes a whole group's critical section), and the slot of the critical section
  the last group's committer reports in the head (``lakestream.group-commit-ms``): a newcomer that never committed or
  was carried knows from it how long a group commit takes, instead of firing into one. The report counts while group
  commits are recent (within the active horizon of steps); a pool that shrank to producers committing directly
  forgets it;
* while holding, it polls whether its intent still exists (``poll_interval``: a 32nd of a slot, 2-100 ms; before the
  typical wait until it was carried, a quarter of the time left to it, see ``poll_delay``); once gone, its batch was
  published and it returns without an attempt. Where the catalog has a cheap pointer read (SQL catalogs), it polls the
  pointer instead and acts when the head moves: its intent gone or its batch in the new head means carried; its batch
  *leading the queue* of staged batches (every intent staged before it, in the store's order, published) means
  commit now (``lead_queue``, on by default; ``hold_delay(led=True)`` then only bounds the hold: position 0 too holds
  a slot). That starts each group commit right after the previous one landed, and never while one is in flight. A
  head that stays put for ``idle_after_s`` (three group commits) means the producers ahead of it stopped or are
  stuck, and it commits at once instead of waiting out its slots;
* a producer whose attempt lost and whose batch was not carried by the winner holds again from its position;
* a *quiet* catalog needs no groups: when ``step rate x critical section`` (the step rate from the heads the producer
  saw, the critical section its own or the last group committer's) is under ``quiet_utilization`` (0.3), producers
  that take turns now and then commit directly, as if alone; a lost swap makes it group commit again at once.

The policy is simulated at scale (and on shared CPUs) in ``benchmarks/dac_sim.py`` and measured in
``benchmarks/commit_scaling.py``.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lakestream_iceberg.errors import ConfigError

__all__ = ["CommitPolicy", "PolicyConfig"]


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """Tunables of the control law (see the module docstring and ``benchmarks/commit_scaling.py``)."""

    ewma_alpha: float = 0.2
    gap_window: int = 8
    active_horizon: float = 3.0
    min_horizon_steps: int = 16
    slot_margin: float = 0.25
    pacing_jitter: float = 0.1
    retry_slots: float = 0.5
    parse_s_per_byte: float = 2e-8
    min_critical_s: float = 0.001
    max_wait_s: float = 30.0
    hold_gather: float = 0.0
    hold_jitter: float = 0.1
    hold_max_slots: int = 4
    carry_spread: float = 2.0
    group_max_batches: int = 32
    min_poll_s: float = 0.002
    max_poll_s: float = 0.1
    quiet_utilization: float = 0.3
    rate_window: int = 8
    lead_queue: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.ewma_alpha <= 1:
            raise ConfigError(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        if self.gap_window < 1 or self.min_horizon_steps < 1 or self.active_horizon <= 1:
            raise ConfigError("gap_window and min_horizon_steps must be >= 1 and active_horizon > 1")
        if not 0 <= self.pacing_jitter < 1:
            raise ConfigError(f"pacing_jitter must be in [0, 1), got {self.pacing_jitter}")
        if self.slot_margin < 0 or self.retry_slots < 0 or self.max_wait_s < 0:
            raise ConfigError("slot_margin, retry_slots and max_wait_s must be >= 0")
        if self.group_max_batches < 1:
            raise ConfigError(f"group_max_batches must be >= 1, got {self.group_max_batches}")
        if self.hold_gather < 0 or self.hold_jitter < 0 or not 0 < self.min_poll_s <= self.max_poll_s:
            raise ConfigError("hold_gather and hold_jitter must be >= 0 and 0 < min_poll_s <= max_poll_s")
        if self.quiet_utilization < 0 or self.rate_window < 2:
            raise ConfigError("quiet_utilization must be >= 0 and rate_window >= 2")


class CommitPolicy:
    """The DAC state of one producer. Feed it measurements, ask it how long to wait.

    Example:
        >>> import random
        >>> p = CommitPolicy(clock=lambda: 0.0, rng=random.Random(1))
        >>> p.pacing_delay()
        0.0
        >>> p.observe_head(0)
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
        self._log_critical: float | None = None  # EWMA of log(attempt duration): a running geometric mean
        self._metadata_bytes = 0
        self._baseline: int | None = None  # the first head step seen: where the first gap starts
        self._wins: deque[int] = deque(maxlen=self._cfg.gap_window + 1)  # steps of own commits (oldest first)
        self._last_win_end: float | None = None
        self._last_win_step: int | None = None
        self._active: float | None = None  # active producers in the head's producer table (when reported)
        self._older: int | None = None  # active producers that have waited longer than this one (when in the table)
        self._log_carry: float | None = None  # EWMA of log(seconds a staged batch waited until a commit carried it)
        self._log_carry_dev = 0.0  # EWMA of |log(wait) - _log_carry|: how much those waits spread
        self._head: tuple[int, list[int], int] | None = None  # last head seen: (step, producers' last steps, group)
        self._position: int | None = None  # own place in the head's group ordering (group commit)
        self._head_group_s = 0.0  # the last group committer's reported critical section
        self._head_group_step = 0  # the head step that reported it (a report older than the horizon is stale)
        self._lost = False  # lost a swap since its last published batch (contended, whatever the head's table says)
        self._heads: deque[tuple[float, int]] = deque(maxlen=self._cfg.rate_window + 1)  # (time seen, head step)
        self.conflicts = 0
        self.carried = 0

    def inherit(self, predecessor: CommitPolicy) -> None:
        """Start from what ``predecessor`` learned: a producer that takes over from another in the same process (an
        elastic worker that takes a fresh producer id every few batches) is the same contender for the catalog.

        Copied: the timings (critical section, waits until carried, the group committer's reported time, metadata
        size, the step rate) and the place in the commit order (the step and time of the predecessor's last published batch, which
        the head's producer table still lists). Without it every new id would start as a stranger, hold for several
        slots behind everybody, and a pool that rotates ids would stall each time the producer whose turn it was
        took a new id.
        """
        for name in ("_log_critical", "_metadata_bytes", "_log_carry", "_log_carry_dev", "_head_group_s",
                     "_head_group_step", "_baseline", "_last_win_end", "_last_win_step", "_active"):
            setattr(self, name, getattr(predecessor, name))
        self._wins = deque(predecessor._wins, maxlen=self._wins.maxlen)
        self._heads = deque(predecessor._heads, maxlen=self._heads.maxlen)
        self._head = predecessor._head
        self._rank()

    # -- measurements -------------------------------------------------------------------------------------------------
    def observe_metadata(self, size_bytes: int) -> None:
        """The size of the table metadata the producer just read."""
        self._metadata_bytes = max(0, int(size_bytes))

    def observe_head(self, step: int, at: float | None = None, *, producers: Iterable[int] | None = None,
                     group: int = 1, group_commit_s: float | None = None) -> None:
        """The head step seen at a refresh, and optionally the last step of every producer in the head's table.

        ``producers`` is the ``lakestream.producers`` summary of the head (one last published step per producer id,
        this producer's own included once it has committed); ``group`` how many batches the head's commit published
        (steps ``step - group + 1 .. step``), ``group_commit_s`` the typical critical section its committer reported
        for its group commits (a newcomer, or a producer always carried, learns from it how long a group commit takes).
        ``at`` (when the head was seen) is accepted for callers that have it; it is unused.
        """
        if self._baseline is None:
            self._baseline = step
        if self._heads and step < self._heads[-1][1]:  # the branch was rolled back or re-created: a new history
            self._heads.clear()
            self._head_group_step = min(self._head_group_step, step)  # its report ages from here
        if not self._heads or step > self._heads[-1][1]:
            self._heads.append((self._clock(), step))
        if group_commit_s is not None and group_commit_s > 0:
            self._head_group_s, self._head_group_step = group_commit_s, step
        if producers is None:
            return
        steps = sorted(producers)
        self._head = (step, steps, max(1, int(group)))
        self._rank()

    def _rank(self) -> None:
        """Count the active producers and rank this one among them, from the last head seen."""
        if self._head is None:
            return
        step, steps, group = self._head
        mine = self._last_win_step
        # Active: committed within the last ``active_horizon * n`` steps. The horizon grows with the count it finds
        # (a fixed point, reached in a few rounds); it shrinks across calls once producers stop committing.
        n = self._active if self._active is not None else self.contenders
        horizon = 0
        while True:
            wanted = max(self._cfg.min_horizon_steps, math.ceil(self._cfg.active_horizon * n))
            if wanted <= horizon:
                break
            horizon = wanted
            recent = len(steps) - bisect.bisect_right(steps, step - horizon)
            in_table = mine is not None and mine > step - horizon
            n = float(max(1, recent + (0 if in_table else 1)))
        self._active = n
        if in_table and mine is not None:  # in_table implies mine is not None (the loop runs once: min_horizon_steps >= 1)
            first = bisect.bisect_right(steps, step - horizon)
            self._older = bisect.bisect_left(steps, mine, lo=first) - first  # active producers with an older last commit
            if mine > step - group:  # in the head's group: its place there
                self._position = mine - (step - group) - 1
            else:  # after the whole group, then by age
                self._position = group + self._older
        else:
            self._older = None
            self._position = None

    def record_attempt(self, *, started: float, ended: float, won: bool, head_step: int, foreign: int) -> None:
        """One attempt's outcome: its critical section, whether the swap was won, and the commits that beat it.

        ``head_step`` is the step this producer published when ``won``, else the head it saw after losing;
        ``foreign`` is how many commits landed between its refresh and its compare-and-swap.
        """
        log_d = math.log(max(ended - started, 1e-6))
        a = self._cfg.ewma_alpha
        self._log_critical = log_d if self._log_critical is None else (1 - a) * self._log_critical + a * log_d
        if self._baseline is None:
            self._baseline = head_step - 1 if won else head_step - max(0, foreign)
        if won:
            if not self._wins:
                self._wins.append(min(self._baseline, head_step - 1))
            self._wins.append(head_step)
            self._last_win_end = ended
            self._last_win_step = head_step
            self._older = self._position = None  # ranked again at the next head seen
            self._lost = False
        else:
            self.conflicts += 1
            self._lost = True

    def record_published(self, *, step: int, at: float, carried_after: float | None = None) -> None:
        """Own batch published as ``step`` at ``at``; ``carried_after``: it rode in another producer's commit (group
        commit) after being staged for that many seconds, with no attempt of its own."""
        if carried_after is not None:
            self.carried += 1
            log_w = math.log(max(carried_after, 1e-6))
            a = self._cfg.ewma_alpha
            if self._log_carry is None:
                self._log_carry = log_w
            else:
                self._log_carry_dev = (1 - a) * self._log_carry_dev + a * abs(log_w - self._log_carry)
                self._log_carry = (1 - a) * self._log_carry + a * log_w
            if not self._wins:
                self._wins.append(min(self._baseline if self._baseline is not None else step - 1, step - 1))
            self._wins.append(step)
            self._last_win_end = at
        self._last_win_step = step
        self._lost = False
        self._rank()

    # -- decisions ----------------------------------------------------------------------------------------------------
    @property
    def critical_section_s(self) -> float:
        modelled = self._metadata_bytes * self._cfg.parse_s_per_byte
        measured = math.exp(self._log_critical) if self._log_critical is not None else modelled
        return max(self._cfg.min_critical_s, measured, modelled)

    @property
    def contenders(self) -> float:
        """Producers sharing the catalog: the active ones of the head's producer table when it is reported, else
        the largest recent step gap between this producer's own commits, ignoring gaps over ``4 x`` the median (a
        pause of this producer is not contention). 1 until it has committed."""
        if self._active is not None:
            return self._active
        if len(self._wins) < 2:
            return 1.0
        steps = list(self._wins)
        gaps = sorted(b - a for a, b in zip(steps, steps[1:], strict=False))
        median = gaps[len(gaps) // 2]
        return max(1.0, float(max(g for g in gaps if g <= 4 * median)))

    @property
    def slot_s(self) -> float:
        """One commit's share of the catalog: the critical section plus a margin for its variance."""
        return self.critical_section_s * (1.0 + self._cfg.slot_margin)

    @property
    def group_slot_s(self) -> float:
        """A slot under group commit: the largest of one's own slot, a high quantile (``carry_spread`` mean absolute
        deviations above the typical value, in log space) of the waits until a commit carried one's batch, and the
        slot of the last group committer's reported critical section."""
        carry = 0.0
        if self._log_carry is not None:  # a high quantile, not the typical wait: a slow commit is still in flight
            carry = math.exp(self._log_carry + self._cfg.carry_spread * self._log_carry_dev)
        return max(self.slot_s, carry, self.group_commit_s * (1.0 + self._cfg.slot_margin))

    @property
    def group_commit_s(self) -> float:
        """The critical section the last group committer reported (``lakestream.group-commit-ms``), while group
        commits are recent: 0 once the branch moved on for longer than the active horizon (``active_horizon x n``
        steps, at least ``min_horizon_steps``) with no group commit, e.g. a pool that shrank to producers committing
        directly. A report from a burst long past would otherwise lengthen every hold and keep the catalog from
        counting as quiet for good."""
        if not self._head_group_s:
            return 0.0
        latest = self._heads[-1][1] if self._heads else self._head_group_step
        horizon = max(self._cfg.min_horizon_steps, math.ceil(self._cfg.active_horizon * self.contenders))
        return self._head_group_s if latest - self._head_group_step <= horizon else 0.0

    @property
    def step_rate(self) -> float | None:
        """Steps per second landing on the branch, from the heads this producer saw (None until it saw ``rate_window``
        new heads spread over some time). Until the current time: a stream that went idle has a falling rate."""
        if len(self._heads) <= self._cfg.rate_window:
            return None
        (t0, s0), (_, s1) = self._heads[0], self._heads[-1]
        elapsed = self._clock() - t0
        return (s1 - s0) / elapsed if elapsed > 0 else None

    @property
    def quiet(self) -> bool:
        """The catalog is mostly idle: steps land so rarely that a commit's critical section overlaps another one
        less than ``quiet_utilization`` of the time (``step rate x critical section``, the larger of its own and the
        one the last group's committer reported). Producers that commit in
        turns, each now and then (paced producers, a consumer-bound pipeline), then commit directly instead of
        staging and holding a slot for a group that would not form; a lost swap still joins group commit at once."""
        rate = self.step_rate
        busy_s = max(self.critical_section_s, self.group_commit_s)  # a producer always carried: the committer's time
        return rate is not None and not self._lost and rate * busy_s < self._cfg.quiet_utilization

    @property
    def wants_queue(self) -> bool:
        """Whether :meth:`hold_delay` needs ``queued``: the head's producer table shows no contention, yet this
        producer lost a swap since it last published (a cold start, where every producer thought itself alone)."""
        return self._lost and self.contenders < 1.5

    def hold_delay(self, *, waited: float, queued: int | None = None, led: bool = False) -> float:
        """Group commit: seconds to keep holding a staged batch (``waited`` seconds so far) before committing it (and
        everything else staged) oneself; 0 commits now. Alone it never holds.

        ``led``: the holder commits as soon as its batch leads the queue of staged batches (see
        ``Hold.wait``), so the hold computed here is only the bound for when that never happens (the producer
        whose batch is ahead died): the producer in position 0 holds one slot too instead of committing at once,
        which would fire into a commit still in flight, and every position one slot more.

        ``queued`` (used when :attr:`wants_queue`): how many staged batches are older than this one, from a listing of
        the staging folder. Producers that all believed themselves alone and lost to each other then take turns by
        age: the oldest commits at once (publishing the others' batches with its own), the next ones hold one slot
        each after a slot of margin for that first, larger commit; without the queue they would all re-plan at once
        and all but one would lose again."""
        n = self.contenders
        if n < 1.5:
            if not self._lost or queued is None or queued <= 0:
                return 0.0
            cap = self._cfg.hold_max_slots
            slots = 1 + min(cap, queued) + max(0, queued - cap) / self._cfg.group_max_batches
            slots += self._rng.uniform(0.0, self._cfg.hold_jitter)
            return min(self._cfg.max_wait_s, max(0.0, slots * self.group_slot_s - max(0.0, waited)))
        gather = self._cfg.hold_gather * self.slot_s
        cap = self._cfg.hold_max_slots
        if self._position == 0 and not led:  # its turn: no jitter (everybody else holds at least a slot)
            slots = 0.0
        elif self._position is not None and self._position < cap:
            slots = self._position + (1 if led else 0) + self._rng.uniform(0.0, self._cfg.hold_jitter)
        else:  # far back, or never published: past the cap, one slot per group of batches ahead of it
            ahead = self._position if self._position is not None else n
            slots = min(cap, ahead) + max(0.0, ahead - cap) / self._cfg.group_max_batches + self._rng.uniform(0.0, 1.0)
        return min(self._cfg.max_wait_s, max(0.0, gather + slots * self.group_slot_s - max(0.0, waited)))

    def poll_interval(self) -> float:
        """How often a holding producer checks whether its staged batch was published."""
        return min(self._cfg.max_poll_s, max(self._cfg.min_poll_s, self.group_slot_s / 32))

    def poll_delay(self, *, waited: float) -> float:
        """How long a holding producer sleeps before it next checks whether its staged batch was published (``waited``:
        seconds since it was staged): a quarter of what is left until the typical wait until a commit carried one of
        its batches, at least :meth:`poll_interval` and at most ``max_poll_s``. The checks gather where carries
        happen, a few before (each check is a request: a HEAD on object storage), then every ``poll_interval``."""
        poll = self.poll_interval()
        if self._log_carry is None:
            return poll
        return min(self._cfg.max_poll_s, max(poll, (math.exp(self._log_carry) - max(0.0, waited)) / 4))

    @property
    def leads_queue(self) -> bool:
        """Whether a holder commits as soon as its batch leads the queue of staged batches (see ``hold_delay(led=)``;
        the commit loop checks it where the catalog has a cheap pointer read)."""
        return self._cfg.lead_queue

    @property
    def idle_after_s(self) -> float:
        """How long the head may stay where it is while this producer holds a staged batch before it stops holding and
        commits (everything staged) itself: three group commits' critical sections (the last group committer's
        report, or its own), at least ``4 * min_poll_s``. The producers whose turn came first have stopped or
        are stuck; waiting out its position's slots would leave the catalog idle (a pool whose workers are finishing
        held the last batches for up to 1.3 s)."""
        return max(4 * self._cfg.min_poll_s, 3 * max(self.group_commit_s, self.critical_section_s))

    def pacing_delay(self) -> float:
        """Seconds to wait before the first attempt of the next commit (0 when alone or when the turn is due)."""
        n = self.contenders
        if n < 1.5 or self._last_win_end is None:
            return 0.0
        jitter = self._cfg.pacing_jitter
        period = n * self.slot_s * self._rng.uniform(1.0 - jitter, 1.0 + jitter)
        elapsed = self._clock() - self._last_win_end
        return min(self._cfg.max_wait_s, max(0.0, period - elapsed - self.critical_section_s))

    def retry_delay(self, attempt: int) -> float:
        """Seconds to wait after losing attempt number ``attempt`` (1-based)."""
        attempt = max(1, attempt)
        if self._active is None:  # no producer table: retry almost at once, sooner with every loss
            window = self._cfg.retry_slots * self.critical_section_s / attempt
            return min(self._cfg.max_wait_s, self._rng.uniform(0.0, 1.0) * window)
        if self._older is not None:  # ranked: the producers that waited longer go first, one slot each
            slots = self._older + self._rng.uniform(0.0, 1.0)
        else:  # not in the table yet: exponential backoff bounded by the round-robin period
            slots = self._rng.uniform(0.0, 1.0) * min(2.0 ** min(attempt - 1, 64), self.contenders)  # 2.0**1024 raises
        return min(self._cfg.max_wait_s, slots * self.slot_s)
