"""The pure DAC policy (lakestream_iceberg.write.dac): injected clock, seeded RNG, no I/O, microseconds per test.

The last tests run a small slot simulation of several producers (optimistic concurrency against one
compare-and-swap, like ``benchmarks/dac_sim.py`` but self-contained) to check the law's properties as a system:
alone never waits, the contention estimate converges to the true producer count, shares are fair.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from lakestream_iceberg.errors import ConfigError
from lakestream_iceberg.write.dac import CommitPolicy, PolicyConfig


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Held:
    """A staged batch as the commit loop's hold sees it (the ``Carry`` protocol), from plain functions."""

    staged_at: float
    gone: Callable[[], bool]
    ahead: Callable[[], list[tuple[str, int]] | None] = lambda: None

    def published(self, metadata: object) -> bool:
        return False

    def queued(self) -> int:
        return 0

    def answer(self, peek: object, attempt: int) -> None:
        return None


def policy(seed: int = 0, clock: Clock | None = None, **config: float) -> CommitPolicy:
    return CommitPolicy(clock=clock or Clock(), rng=random.Random(seed), config=PolicyConfig(**config) if config else None)


def win(p: CommitPolicy, clock: Clock, step: int, duration: float = 0.010) -> None:
    p.record_attempt(started=clock.t, ended=clock.t + duration, won=True, head_step=step, foreign=0)
    clock.t += duration


# ------------------------------------------------------------------------------------------------ estimates


def test_critical_section_is_a_running_geometric_mean_floored_by_the_metadata_model() -> None:
    clock = Clock()
    p = policy(clock=clock, ewma_alpha=1.0)
    assert p.critical_section_s == PolicyConfig().min_critical_s  # nothing measured yet
    win(p, clock, 1, duration=0.020)
    assert p.critical_section_s == pytest.approx(0.020)
    q = policy(clock=Clock(), ewma_alpha=0.5)
    for d in (0.010, 0.040):
        q.record_attempt(started=0.0, ended=d, won=True, head_step=1, foreign=0)
    assert q.critical_section_s == pytest.approx(math.sqrt(0.010 * 0.040))  # one outlier does not double it
    q.observe_metadata(10_000_000)  # 10 MB of metadata at 2e-8 s/byte: at least 0.2 s
    assert q.critical_section_s == pytest.approx(0.2)


def test_contenders_from_own_step_gaps_is_exact_for_a_round_robin() -> None:
    clock = Clock()
    p = policy(clock=clock)
    p.observe_head(100)
    assert p.contenders == 1.0
    for k in range(1, 10):
        win(p, clock, 100 + 16 * k)
    assert p.contenders == 16.0


def test_a_pause_of_the_producer_is_not_contention() -> None:
    clock = Clock()
    p = policy(clock=clock)
    p.observe_head(0)
    steps = [4, 8, 12, 512, 516, 520, 524, 528]  # one commit in four, but it paused while 500 steps were committed
    for step in steps:
        win(p, clock, step)
    assert p.contenders == 4.0
    clock.t += 0.002
    assert p.pacing_delay() < 4 * p.slot_s * 1.1


def test_contenders_from_the_producer_table_counts_recent_producers_and_self() -> None:
    clock = Clock()
    p = policy(clock=clock)
    # 5 producers committed within the last steps, 3 stopped long ago; this one never committed: 5 + itself
    p.observe_head(1000, producers=[996, 997, 998, 999, 1000, 10, 20, 30])
    assert p.contenders == 6.0
    win(p, clock, 1001)
    p.observe_head(1001, producers=[996, 997, 998, 999, 1000, 1001, 10, 20, 30])
    assert p.contenders == 6.0  # now it is in the table: counted once


def test_alone_the_table_and_the_gaps_both_say_one() -> None:
    clock = Clock()
    p = policy(clock=clock)
    q = policy(clock=clock)
    for step in range(1, 50):
        p.observe_head(step - 1, producers=[step - 1] if step > 1 else [])
        win(p, clock, step)
        q.observe_head(step - 1)
        win(q, clock, step)
    assert p.contenders == 1.0
    assert q.contenders == 1.0


# ------------------------------------------------------------------------------------------------ pacing


@pytest.mark.parametrize("table", [False, True])
def test_alone_never_waits(table: bool) -> None:
    clock = Clock()
    p = policy(clock=clock)
    assert p.pacing_delay() == 0.0  # first commit
    for step in range(1, 200):
        p.observe_head(step - 1, producers=[step - 1] if table and step > 1 else None)
        assert p.pacing_delay() == 0.0
        win(p, clock, step, duration=random.Random(step).uniform(0.005, 0.050))
        clock.t += 0.003  # writing the next batch's data files


def test_pacing_yields_one_slot_to_each_other_producer() -> None:
    clock = Clock()
    p = policy(clock=clock, pacing_jitter=0.0, slot_margin=0.25, ewma_alpha=1.0)
    p.observe_head(0)
    for k in range(1, 10):
        win(p, clock, 4 * k, duration=0.010)  # one commit in four: n = 4
    clock.t += 0.002  # the data files of the next batch
    # the next commit should land 4 slots (4 * 12.5 ms) after the last one: minus 2 ms elapsed, minus the attempt itself
    assert p.pacing_delay() == pytest.approx(4 * 0.0125 - 0.002 - 0.010)
    clock.t += 1.0  # a producer that commits rarely: its turn is long due
    assert p.pacing_delay() == 0.0


def test_pacing_jitter_bounds() -> None:
    clock = Clock()
    p = policy(clock=clock, pacing_jitter=0.1, ewma_alpha=1.0)
    p.observe_head(0)
    for k in range(1, 10):
        win(p, clock, 8 * k, duration=0.010)
    slot = 0.0125
    delays = [p.pacing_delay() for _ in range(2000)]
    assert min(delays) >= 8 * slot * 0.9 - 0.010 - 1e-12
    assert max(delays) <= 8 * slot * 1.1 - 0.010 + 1e-12


# ------------------------------------------------------------------------------------------------ retries


def test_retry_window_shrinks_with_the_attempt_number_without_a_table() -> None:
    clock = Clock()
    p = policy(clock=clock, ewma_alpha=1.0, retry_slots=0.5)
    p.record_attempt(started=0.0, ended=0.020, won=False, head_step=3, foreign=3)
    means = []
    for attempt in range(1, 9):
        draws = [p.retry_delay(attempt) for _ in range(3000)]
        assert max(draws) <= 0.5 * 0.020 / attempt + 1e-12  # the window: retry_slots * c / a
        means.append(statistics.fmean(draws))
    assert all(later < earlier for earlier, later in zip(means, means[1:], strict=False))


def test_ranked_retry_lets_the_producers_that_waited_longer_go_first() -> None:
    clock = Clock()
    p = policy(clock=clock, ewma_alpha=1.0, slot_margin=0.0)
    p.observe_head(0, producers=[])
    win(p, clock, 10, duration=0.010)  # its last commit: step 10
    # head 20; of the 6 other active producers, 2 last committed before step 10: they have waited longer
    p.observe_head(20, producers=[8, 9, 10, 15, 18, 19, 20])
    p.record_attempt(started=clock.t, ended=clock.t + 0.010, won=False, head_step=21, foreign=1)
    draws = [p.retry_delay(1) for _ in range(2000)]
    assert min(draws) >= 2 * 0.010 - 1e-12 and max(draws) <= 3 * 0.010 + 1e-12
    p.observe_head(22, producers=[21, 22, 10, 15, 18, 19, 20])  # both went: now it is the oldest
    assert max(p.retry_delay(2) for _ in range(2000)) <= 0.010 + 1e-12


def test_a_producer_not_yet_in_the_table_backs_off_exponentially_up_to_the_period() -> None:
    clock = Clock()
    p = policy(clock=clock, ewma_alpha=1.0, slot_margin=0.0)
    p.observe_head(500, producers=list(range(437, 501)))  # 64 active producers, this one never committed: n = 65
    p.record_attempt(started=0.0, ended=0.010, won=False, head_step=501, foreign=1)
    for attempt, slots in [(1, 1), (2, 2), (3, 4), (7, 64), (8, 65), (20, 65), (1025, 65), (10**6, 65)]:
        draws = [p.retry_delay(attempt) for _ in range(3000)]
        assert max(draws) <= slots * 0.010 + 1e-12
        assert max(draws) > 0.9 * slots * 0.010


def test_every_wait_is_capped() -> None:
    clock = Clock()
    p = policy(clock=clock, max_wait_s=1.5)
    p.observe_metadata(5_000_000_000)  # a modelled critical section of 100 s
    p.observe_head(0, producers=list(range(1, 1001)))
    win(p, clock, 5000, duration=50.0)
    assert p.pacing_delay() <= 1.5
    assert all(p.retry_delay(a) <= 1.5 for a in range(1, 50))
    q = policy(clock=Clock(), max_wait_s=1.5)
    q.observe_metadata(5_000_000_000)
    assert all(q.retry_delay(a) <= 1.5 for a in range(1, 50))


def test_same_seed_same_decisions() -> None:
    def run(seed: int) -> list[float]:
        clock = Clock()
        p = policy(seed, clock)
        p.observe_head(0)
        out = []
        for k in range(1, 30):
            win(p, clock, 3 * k)
            out += [p.pacing_delay(), p.retry_delay(k % 5 + 1)]
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("bad", [{"ewma_alpha": 0.0}, {"pacing_jitter": 1.0}, {"gap_window": 0}, {"active_horizon": 1.0},
                                 {"max_wait_s": -1.0}])
def test_config_is_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        PolicyConfig(**bad)


# ------------------------------------------------------------------------------------------------ slot simulation


def simulate(n: int, *, table: bool, seconds: float = 30.0, seed: int = 1) -> dict[str, object]:
    """``n`` back-to-back producers, optimistic concurrency against one compare-and-swap, virtual time.

    An attempt reads the head, works for a critical section ``c`` (10 ms +- 30 %), and wins iff no other commit
    landed meanwhile. The loop refreshes before the first attempt and after every retry sleep (and, with ``table``,
    hands the head's producer table to the policy); writing a batch takes 3 ms.
    """
    rng = random.Random(seed)
    clock = Clock()
    policies = [CommitPolicy(clock=clock, rng=random.Random(rng.getrandbits(32))) for _ in range(n)]
    head = 0
    last: dict[int, int] = {}
    events: list[tuple[float, int, str, int]] = []
    tie = 0
    base = [0] * n
    began = [0.0] * n
    attempt = [0] * n
    commits = [0] * n
    paces: list[float] = []
    estimates: list[list[float]] = [[] for _ in range(n)]

    def push(t: float, kind: str, i: int) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(events, (t, tie, kind, i))

    for i in range(n):
        push(rng.uniform(0, 0.01), "write", i)
    while events:
        t, _, kind, i = heapq.heappop(events)
        if t > seconds:
            break
        clock.t = t
        p = policies[i]
        if kind == "write":
            attempt[i] = 0
            push(t + 0.003, "pace", i)
        elif kind == "pace":
            delay = p.pacing_delay()
            paces.append(delay)
            push(t + delay, "attempt", i)
        elif kind == "attempt":
            attempt[i] += 1
            base[i] = head
            p.observe_head(head, producers=list(last.values()) if table else None)
            began[i] = t
            push(t + 0.010 * rng.uniform(0.7, 1.3), "swap", i)
        else:
            if head == base[i]:
                head += 1
                last[i] = head
                commits[i] += 1
                p.record_attempt(started=began[i], ended=t, won=True, head_step=head, foreign=0)
                estimates[i].append(p.contenders)
                push(t, "write", i)
            else:
                p.observe_head(head, producers=list(last.values()) if table else None)
                p.record_attempt(started=began[i], ended=t, won=False, head_step=head, foreign=head - base[i])
                push(t + p.retry_delay(attempt[i]), "attempt", i)
    return {"commits": commits, "paces": paces, "estimates": estimates}


def jain(xs: list[int]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


@pytest.mark.parametrize("table", [False, True])
def test_simulated_alone_never_waits(table: bool) -> None:
    result = simulate(1, table=table, seconds=5.0)
    assert result["commits"][0] > 300  # back to back: ~13 ms per commit
    assert set(result["paces"]) == {0.0}


@pytest.mark.parametrize("n", [2, 3, 8, 16])
def test_simulated_estimate_converges_to_the_producer_count_and_shares_are_fair(n: int) -> None:
    result = simulate(n, table=True)
    late = [est for per in result["estimates"] for est in per[len(per) // 2:]]  # second half of each producer's commits
    assert statistics.median(late) == n
    assert jain(result["commits"]) >= 0.95
    assert min(result["commits"]) > 0


@pytest.mark.parametrize("n", [2, 4, 8])
def test_simulated_gap_estimate_without_a_table_tracks_the_producer_count(n: int) -> None:
    result = simulate(n, table=False)
    late = [est for per in result["estimates"] for est in per[len(per) // 2:]]
    assert n <= statistics.median(late) <= 2 * n  # the largest recent gap: at least n, not wildly more
    assert min(result["commits"]) > 0


# ------------------------------------------------------------------------------------------------ group commit


def grouped(position_step: int, *, head: int = 100, group: int = 8, producers: int = 8, seed: int = 0,
            **config: float) -> CommitPolicy:
    """A policy that committed once (30 ms critical section) and whose own batch is at ``position_step`` of a head
    whose commit published ``group`` batches; ``producers`` producers are active, one per recent step."""
    clock = Clock()
    p = policy(seed, clock=clock, **config)
    p.record_attempt(started=0.0, ended=0.030, won=True, head_step=head - 50, foreign=0)
    steps = [head - i for i in range(producers)]
    p.observe_head(head, producers=steps, group=group)
    p.record_published(step=position_step, at=clock.t)
    return p


def test_hold_alone_is_zero_and_the_head_groups_first_batch_commits_at_once() -> None:
    clock = Clock()
    alone = policy(clock=clock)
    win(alone, clock, 1)
    alone.observe_head(1, producers=[1])
    assert alone.contenders == 1.0 and alone.hold_delay(waited=0.0) == 0.0
    first = grouped(93)  # head 100, group of 8: steps 93..100, this producer's batch was the first
    assert first.contenders == 8.0 and first.hold_delay(waited=0.0) == 0.0


def test_a_holder_that_leads_the_queue_holds_one_slot_more_as_a_bound_only() -> None:
    """With the queue rule (``led``: the loop commits as soon as the batch leads the queue of staged batches) the hold
    is only the bound for a queue whose first batch never goes: position 0 no longer commits at once (it would fire
    into the commit still in flight), and every position holds one slot more."""
    slot = grouped(94).group_slot_s
    assert grouped(93).hold_delay(waited=0.0) == 0.0
    assert slot <= grouped(93).hold_delay(waited=0.0, led=True) <= 1.1 * slot + 1e-9
    for pos in (1, 2, 3):
        assert (pos + 1) * slot <= grouped(93 + pos, seed=pos).hold_delay(waited=0.0, led=True) <= (pos + 1.1) * slot + 1e-9
    clock = Clock()
    alone = policy(clock=clock)
    win(alone, clock, 1)
    alone.observe_head(1, producers=[1])
    assert alone.hold_delay(waited=0.0, led=True) == 0.0  # alone: never holds


def test_hold_grows_one_slot_per_position_and_is_capped() -> None:
    slot = grouped(94).group_slot_s
    holds = [grouped(93 + pos, seed=pos).hold_delay(waited=0.0) for pos in range(8)]
    for pos, hold in enumerate(holds[:4]):  # positions 1..3: pos slots plus a jitter of at most 0.1 slot
        assert pos * slot <= hold <= (pos + 0.1) * slot + 1e-9
    for pos, hold in enumerate(holds[4:], start=4):  # past hold_max_slots (4): 4 slots, 1 per 32 further, a draw
        assert (4 + (pos - 4) / 32) * slot <= hold <= (5 + (pos - 4) / 32) * slot
    assert grouped(95).hold_delay(waited=10 * slot) == 0.0  # already waited long enough: commit now


def test_a_producer_outside_the_last_group_ranks_after_it() -> None:
    p = grouped(90, group=4)  # the head's group is steps 97..100; this producer's batch is older
    assert p.hold_delay(waited=0.0) >= 4 * p.group_slot_s


def test_carry_waits_set_the_group_slot_to_a_high_quantile_not_the_typical_value() -> None:
    clock = Clock()
    p = policy(clock=clock, ewma_alpha=0.2)
    win(p, clock, 10, duration=0.010)
    assert p.group_slot_s == pytest.approx(p.slot_s)  # nothing carried yet: its own slot
    waits = [0.1, 0.3] * 20
    for i, w in enumerate(waits):
        p.record_published(step=20 + i, at=clock.t, carried_after=w)
    typical = math.exp(statistics.fmean(math.log(w) for w in waits))
    assert p.carried == len(waits)
    assert 0.3 <= p.group_slot_s <= 1.0 and p.group_slot_s > 1.5 * typical
    assert PolicyConfig().min_poll_s <= p.poll_interval() <= PolicyConfig().max_poll_s
    assert p.poll_interval() == pytest.approx(min(PolicyConfig().max_poll_s, p.group_slot_s / 32))


def test_a_holder_polls_sparsely_until_the_typical_carry_and_then_every_poll_interval() -> None:
    """Each poll is a request (a HEAD on object storage): before the typical wait until its batches were carried a
    holder sleeps a quarter of the time left to it, then polls every poll_interval; without carries it polls as
    before."""
    clock = Clock()
    p = policy(clock=clock)
    win(p, clock, 10, duration=0.002)
    assert p.poll_delay(waited=0.0) == p.poll_interval()  # never carried: no typical wait to aim at
    for i in range(30):
        p.record_published(step=20 + i, at=clock.t, carried_after=0.08)
    poll = p.poll_interval()
    assert poll < 0.01
    assert p.poll_delay(waited=0.0) == pytest.approx(0.02)  # (0.08 - 0) / 4
    assert p.poll_delay(waited=0.04) == pytest.approx(0.01)
    assert p.poll_delay(waited=0.079) == poll and p.poll_delay(waited=5.0) == poll  # at and past the typical wait
    # a hold that starts with no carry seen checks (0.02, 0.035, 0.046, ...): far fewer checks than every poll_interval
    waited, checks = 0.0, 0
    while waited < 0.08:
        waited += p.poll_delay(waited=waited)
        checks += 1
    assert checks < 0.08 / poll / 2
    slow = policy(clock=clock)
    win(slow, clock, 10, duration=0.002)
    for i in range(30):
        slow.record_published(step=20 + i, at=clock.t, carried_after=5.0)
    assert slow.poll_delay(waited=0.0) == PolicyConfig().max_poll_s  # capped: a long typical wait never means deaf


def test_the_commit_loop_holds_with_the_policys_poll_delays() -> None:
    """The hold sleeps what poll_delay says for the time since the batch was staged, and stops at the first check
    that finds the batch carried."""
    from lakestream_iceberg.write.hold import Hold

    clock = Clock()
    p = policy(clock=clock)
    win(p, clock, 10, duration=0.002)
    for i in range(30):
        p.record_published(step=20 + i, at=clock.t, carried_after=0.08)
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.t += seconds

    hold = Hold(policy=p, branch="main", probe=lambda: None, peek=lambda: None, clock=clock, sleep=sleep)
    checks = []
    staged_at = clock.t
    carry = Held(staged_at=staged_at, gone=lambda: checks.append(clock.t) or len(checks) >= 6)
    assert hold.wait(10.0, carry)
    expected, t = [], staged_at
    for _ in range(6):
        expected.append(p.poll_delay(waited=t - staged_at))
        t += expected[-1]
    assert sleeps == pytest.approx(expected) and sleeps[0] == pytest.approx(0.02) and len(checks) == 6


def test_the_hold_delay_is_the_policys_except_after_a_lost_swap_whose_head_shows_the_batch_published() -> None:
    """Hold.delay: a retry whose freshly read head already shows the batch published (the winner carried it) does not
    hold; otherwise the policy decides, from the time since the batch was staged (first attempt only), its place in
    the queue of staged batches (asked only when the policy wants it) and whether the head can be watched."""
    from lakestream_iceberg.write.hold import Hold

    clock = Clock()
    p = grouped(93)  # its batch opened the head's group: no hold of its own
    asked: list[str] = []

    class Carried(Held):
        def published(self, metadata: object) -> bool:
            asked.append("published")
            return metadata == "head showing it"

        def queued(self) -> int:
            asked.append("queued")
            return 0

    carry = Carried(staged_at=clock.t, gone=lambda: False)
    holds: list[dict[str, object]] = []
    p.hold_delay = lambda **kw: holds.append(kw) or 0.25  # type: ignore[method-assign]

    def hold(probe: object) -> Hold:
        return Hold(policy=p, branch="main", probe=lambda: probe, peek=lambda: None, clock=clock,  # type: ignore[arg-type,return-value]
                    sleep=lambda s: None)

    clock.t = 0.4
    assert hold(None).delay(carry, attempt=2, head="head showing it") == 0.0 and not holds  # carried: no hold
    assert hold(None).delay(carry, attempt=2, head="older head") == 0.25
    assert holds[-1] == {"waited": 0.0, "queued": None, "led": False}  # a retry: the time waited counts no more
    assert hold(lambda: "m-1.json").delay(carry, attempt=1, head="older head") == 0.25
    assert holds[-1]["waited"] == pytest.approx(0.4) and holds[-1]["led"] is p.leads_queue
    assert asked == ["published", "published"]  # the first attempt never asks; the queue only when wanted
    assert not p.wants_queue
    q = policy(clock=clock)
    q.record_attempt(started=0.0, ended=0.100, won=False, head_step=1, foreign=1)  # a cold-start loser: wants its place
    assert q.wants_queue
    q.hold_delay = lambda **kw: holds.append(kw) or 0.5  # type: ignore[method-assign]
    assert Hold(policy=q, branch="main", probe=lambda: None, peek=lambda: None, clock=clock,
                sleep=lambda s: None).delay(carry, attempt=1, head="older head") == 0.5
    assert holds[-1]["queued"] == 0 and asked[-1] == "queued"


def test_a_holder_stops_holding_once_the_head_stays_put_for_three_group_commits() -> None:
    """A head that does not move for idle_after_s while a batch is held means the producers ahead stopped: the hold
    ends (False: commit now) instead of lasting its slots; a head that keeps moving never ends it early."""
    from lakestream_iceberg.write.hold import Hold

    clock = Clock()
    p = policy(clock=clock)
    win(p, clock, 10, duration=0.010)
    assert p.idle_after_s == pytest.approx(3 * p.critical_section_s)

    def sleep(seconds: float) -> None:
        clock.t += seconds

    def loop_with(probe: object) -> Hold:
        return Hold(policy=p, branch="main", probe=lambda: probe, peek=lambda: None, clock=clock,  # type: ignore[arg-type,return-value]
                    sleep=sleep)

    never = Held(staged_at=clock.t, gone=lambda: False)
    start = clock.t
    assert not loop_with(lambda: "m-1.json").wait(600.0, never)
    assert p.idle_after_s <= clock.t - start <= p.idle_after_s + 2 * p.poll_interval() + p.idle_after_s / 4
    moves = iter(range(10**6))
    start = clock.t
    assert not loop_with(lambda: f"m-{next(moves)}.json").wait(2.0, never)
    assert clock.t - start == pytest.approx(2.0)  # held the whole time: the head kept moving
    start = clock.t
    assert not loop_with(None).wait(2.0, never)  # no pointer probe (e.g. REST): holds as before
    assert clock.t - start == pytest.approx(2.0)


def test_a_holder_commits_once_its_batch_leads_the_queue_of_staged_batches() -> None:
    """The queue rule in the loop, on a fake clock: a batch with nothing staged before it commits when the hold starts,
    without sleeping; one behind an unpublished batch holds while the head stays put; once the head moves, it commits
    when what was ahead is published (shown by a light read of the head) or gone, and returns as carried when its own
    intent is gone. Without a pointer probe (REST) the rule is off."""
    from lakestream_iceberg.format.summary import ProducerState, StreamState
    from lakestream_iceberg.write.hold import Hold
    from lakestream_iceberg.write.plan import Peek

    clock = Clock()
    p = policy(clock=clock)
    win(p, clock, 10, duration=0.010)

    def sleep(seconds: float) -> None:
        clock.t += seconds

    head = {"location": "m-1.json", "published": {}}

    def peek() -> Peek:
        return Peek(StreamState(op="append", step=10, producers={
            name: ProducerState(seq, 10, 1) for name, seq in head["published"].items()}), lambda _id: None)

    def loop_with(probe: object, sleep: Callable[[float], None] = sleep) -> Hold:
        return Hold(policy=p, branch="main", probe=lambda: probe, peek=peek, clock=clock, sleep=sleep)  # type: ignore[arg-type,return-value]

    probe = lambda: head["location"]  # noqa: E731
    first = Held(staged_at=clock.t, gone=lambda: False, ahead=lambda: [])
    start = clock.t
    assert loop_with(probe).wait(600.0, first) is False and clock.t == start  # nothing ahead: at once

    ahead = [("x", 3)]
    behind = Held(staged_at=clock.t, gone=lambda: False, ahead=lambda: list(ahead))
    moves = []

    def moving_sleep(seconds: float) -> None:
        clock.t += seconds
        if clock.t - start >= p.idle_after_s / 2 and not moves:  # the commit ahead lands: x's seq 3 is published
            moves.append(clock.t)
            head["location"], head["published"] = "m-2.json", {"x": 3}

    start = clock.t
    assert loop_with(probe, moving_sleep).wait(600.0, behind) is False
    # right after the move (the idle rule would end it idle_after_s after the move, its slots after 600 s)
    assert moves and moves[0] <= clock.t <= moves[0] + p.poll_interval() + 1e-9 < moves[0] + p.idle_after_s

    # the head moves but the batch ahead is still unpublished: it keeps holding (here until the bound)
    head["published"] = {}
    ahead[:] = [("y", 0)]
    flips = iter(range(10**6))
    stuck = Held(staged_at=clock.t, gone=lambda: False, ahead=lambda: list(ahead))
    start = clock.t
    assert loop_with(lambda: f"m-{next(flips)}.json").wait(2.0, stuck) is False
    assert clock.t - start == pytest.approx(2.0)
    # its own intent gone at a move: carried
    gone = Held(staged_at=clock.t, gone=lambda: True, ahead=lambda: None)
    assert loop_with(probe).wait(2.0, gone) is True
    # the pointer cannot be read right now (the database unreachable): it polls its intent meanwhile
    def failing() -> str:
        raise OSError("catalog unreachable")

    polled: list = []
    unreadable = Held(staged_at=clock.t, gone=lambda: polled.append(clock.t) or len(polled) >= 3, ahead=lambda: [("y", 0)])
    assert loop_with(failing).wait(2.0, unreadable) is True and len(polled) == 3
    # no pointer probe: the rule is off (it holds its slots, polling the intent)
    start = clock.t
    assert loop_with(None).wait(2.0, Held(staged_at=clock.t, gone=lambda: False, ahead=lambda: [])) is False
    assert clock.t - start == pytest.approx(2.0)


def test_group_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="hold_gather"):
        PolicyConfig(hold_gather=-1)
    with pytest.raises(ConfigError, match="min_poll_s"):
        PolicyConfig(min_poll_s=0.2, max_poll_s=0.1)


def test_far_back_producers_wait_one_slot_per_group_of_batches_ahead() -> None:
    p = grouped(5000 - 300, head=5000, group=32, producers=1024)  # 1,024 producers; 723 published before it
    assert p.contenders >= 1000
    ahead = p._position  # noqa: SLF001 - the rank the hold is computed from: the last group, then the older ones
    assert ahead == 32 + 723
    slot = p.group_slot_s
    hold = p.hold_delay(waited=0.0)
    assert (4 + (ahead - 4) / 32) * slot <= hold <= (5 + (ahead - 4) / 32) * slot


def test_a_successor_keeps_its_predecessors_turn_and_timings() -> None:
    """An elastic worker takes a fresh producer id: the new id's policy holds like the old one, not like a stranger."""
    first = grouped(93)  # its batch opened the head's group: it commits next, at once
    stranger = policy(1)
    stranger.observe_head(100, producers=[100 - i for i in range(8)], group=8)
    assert stranger.hold_delay(waited=0.0) >= 4 * stranger.group_slot_s  # never published: behind everybody
    successor = policy(2)
    successor.inherit(first)
    assert successor.contenders == first.contenders == 8.0
    assert successor.critical_section_s == first.critical_section_s
    assert successor.hold_delay(waited=0.0) == 0.0
    third = grouped(96)
    heir = policy(3)
    heir.inherit(third)
    slot = heir.group_slot_s
    assert 3 * slot <= heir.hold_delay(waited=0.0) <= 3.1 * slot + 1e-9  # position 3, like its predecessor


def test_cold_start_losers_take_turns_by_their_place_in_the_staging_queue() -> None:
    clock = Clock()
    p = policy(clock=clock)
    assert not p.wants_queue and p.hold_delay(waited=0.0, queued=3) == 0.0  # alone, never lost: commits at once
    p.record_attempt(started=0.0, ended=0.100, won=False, head_step=1, foreign=1)  # everybody thought itself alone
    assert p.contenders == 1.0 and p.wants_queue
    slot = p.group_slot_s
    assert p.hold_delay(waited=0.0, queued=0) == 0.0  # the oldest staged batch: commits (and carries the rest) now
    assert p.hold_delay(waited=0.0, queued=None) == 0.0  # no listing: as before
    for queued in (1, 2, 3):  # one slot of margin for the first, larger commit, then one slot per batch ahead
        assert (1 + queued) * slot <= p.hold_delay(waited=0.0, queued=queued) <= (1.1 + queued) * slot + 1e-9
    p.record_published(step=5, at=clock.t, carried_after=0.2)  # carried: no longer a loser
    assert not p.wants_queue


def test_a_mostly_idle_catalog_is_quiet_and_a_busy_one_is_not() -> None:
    """Producers that commit now and then (paced, 2 x 10 per second, 10 ms commits) need no group commit: the catalog
    is busy 10-20 % of the time, so they commit directly instead of holding a slot for a group that would not form."""
    clock = Clock()
    p = policy(clock=clock)
    win(p, clock, 1)  # critical section 10 ms
    step = 1
    for _ in range(8):  # two steps land every 100 ms (its own and another producer's)
        assert not p.quiet  # the rate is not known before rate_window new heads
        clock.t += 0.1
        step += 2
        p.observe_head(step, producers=[step - 1, step], group=1)
    clock.t += 0.1
    step += 2
    p.observe_head(step, producers=[step - 1, step], group=1)
    assert p.contenders >= 1.5 and p.step_rate == pytest.approx(20.0, rel=0.05)  # not alone, yet quiet:
    assert p.quiet  # 20 steps/s x 10 ms = 0.2 < 0.3
    p.record_attempt(started=clock.t, ended=clock.t + 0.01, won=False, head_step=step + 1, foreign=1)
    assert not p.quiet  # lost a swap: contended after all, whatever the rate says
    win(p, clock, step + 2)
    assert p.quiet
    clock.t += 30.0  # nothing lands for a long time: the rate falls, still quiet
    assert p.quiet and p.step_rate < 1.0
    p.observe_head(3, producers=[2, 3], group=1)  # the branch was rolled back: its old rate says nothing
    assert p.step_rate is None and not p.quiet

    busy = policy(clock=(c2 := Clock()))
    win(busy, c2, 1)
    for i in range(12):  # a step every 5 ms: 200 steps/s x 10 ms = 2.0
        c2.t += 0.005
        busy.observe_head(2 + i, producers=[1 + i, 2 + i], group=1)
    assert busy.step_rate == pytest.approx(200.0, rel=0.05) and not busy.quiet
    carried = policy(clock=(c3 := Clock()))  # never committed itself: its critical section is the 1 ms floor
    for i in range(12):
        c3.t += 0.03
        carried.observe_head(8 * (i + 1), producers=[8 * i + k for k in range(1, 9)], group=8, group_commit_s=0.04)
    assert not carried.quiet  # 267 steps/s x the committer's reported 40 ms: busy


def test_a_group_committers_report_applies_while_group_commits_are_recent_then_expires() -> None:
    clock = Clock()
    p = policy(clock=clock)
    win(p, clock, 1)  # its own critical section: 10 ms
    for i in range(12):  # a burst of group commits, each reporting 80 ms
        clock.t += 0.1
        p.observe_head(8 * (i + 1), producers=[8 * i + k for k in range(1, 9)], group=8, group_commit_s=0.08)
    assert p.group_commit_s == pytest.approx(0.08)
    assert p.group_slot_s == pytest.approx(0.08 * 1.25)  # the committer's slot, not its own 12.5 ms
    head = 96
    for _ in range(40):  # then two producers commit directly, alternating: no group commit any more
        clock.t += 0.1
        head += 1
        p.observe_head(head, producers=[head - 1, head], group=1)
        if head - 96 <= 16:  # within the horizon (16 steps: min_horizon_steps, 3 x 2 producers is less)
            assert p.group_commit_s == pytest.approx(0.08), head
    assert p.group_commit_s == 0.0 and p.group_slot_s == pytest.approx(p.slot_s)  # stale: its own slot again
    assert p.quiet  # 10 steps/s x its own 10 ms; the old 80 ms report (0.8) no longer counts
    p.observe_head(head + 2, producers=[head + 1, head + 2], group=2, group_commit_s=0.03)  # grouping again
    assert p.group_commit_s == pytest.approx(0.03)
    successor = policy(clock=clock)
    successor.inherit(p)  # a fresh id of the same worker keeps the report and its age
    assert successor.group_commit_s == pytest.approx(0.03)


def test_quiet_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="quiet_utilization"):
        PolicyConfig(quiet_utilization=-0.1)
    with pytest.raises(ConfigError, match="rate_window"):
        PolicyConfig(rate_window=1)
