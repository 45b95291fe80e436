"""Group commit's hold: how long a staged batch waits for another producer's commit to carry it, and the waiting.

Before each attempt of a staged batch (:mod:`lakestream_iceberg.write.staging`) the commit loop
(:mod:`lakestream_iceberg.write.commit`) asks :meth:`Hold.delay` how long to hold, from the policy
(:mod:`lakestream_iceberg.write.dac`), and waits in :meth:`Hold.wait`, which polls whether the batch is gone
(:meth:`Carry.gone`: another commit carried it) or, where the catalog pointer is cheap to read (SQL catalogs), whether
the head moved: then the batch was carried, or leads the queue of staged batches (:meth:`Carry.ahead`) and is
committed at once. The light read of the head that showed the batch published is kept for the loop's answer
(:meth:`Hold.take_peek`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pyiceberg.table.metadata import TableMetadata

from lakestream_iceberg.connect.notify import CommitNotices
from lakestream_iceberg.connect.pointer import PointerWatch
from lakestream_iceberg.write.dac import CommitPolicy
from lakestream_iceberg.write.plan import Carry, Peek

__all__ = ["Hold"]

log = logging.getLogger("lakestream_iceberg.write.commit")


class Hold:
    """The hold of one commit loop (one table view).

    Args:
        policy: The producer's commit policy: hold lengths, poll delays, the idle and queue rules.
        branch: The branch committed to (for messages).
        probe: Returns the table's catalog pointer probe, or None where the catalog has none (REST) or it cannot be
            made now.
        peek: Reads the head lightly (:meth:`CommitLoop.peek`); None when it must be read fully.
        clock, sleep: ``time.monotonic`` and ``time.sleep``, or a test's.
        notices: Returns the table's commit notifications, or None where its catalog sends none (not PostgreSQL).
    """

    def __init__(self, *, policy: CommitPolicy, branch: str, probe: Callable[[], Callable[[], str | None] | None],
                 peek: Callable[[], Peek | None], clock: Callable[[], float], sleep: Callable[[float], None],
                 notices: Callable[[], CommitNotices | None] = lambda: None) -> None:
        self.policy = policy
        self._notices = notices
        self._branch = branch
        self._probe = probe
        self._peek = peek
        self._clock = clock
        self._sleep = sleep
        self._carried_peek: Peek | None = None  # the light read of the head a hold found its batch published in
        self._blind = False  # a hold's light read of the head failed: it polls its intent instead

    def delay(self, carry: Carry[Any], *, attempt: int, head: TableMetadata) -> float:
        """How long attempt ``attempt`` of the staged batch holds before it plans on ``head``: not at all after a lost
        swap whose new head already shows the batch published (the winner carried it), else what the policy says for
        the time since the batch was staged (first attempt), the queue of staged batches (when the policy asks for
        it) and whether the head can be watched."""
        if attempt > 1 and carry.published(head):
            return 0.0
        waited = self._clock() - carry.staged_at if attempt == 1 else 0.0
        queued = carry.queued() if self.policy.wants_queue else None
        led = self.policy.leads_queue and self._probe() is not None
        return self.policy.hold_delay(waited=waited, queued=queued, led=led)

    def wait(self, seconds: float, carry: Carry[Any]) -> bool:
        """Wait up to ``seconds`` for the staged batch to be carried; True when it was. False (commit now) as soon as:

        * the batch leads the queue of staged batches (``carry.ahead``): every batch staged before it is published.
          Checked when the hold starts and whenever the head moves, read from the catalog pointer where that is
          cheap (SQL catalogs): the commit ahead of it landed, so the catalog is free and nobody else is due. A
          commit then starts as soon as the previous one landed, with whatever was staged meanwhile, and while it
          runs the producers it did not carry write their next batches;
        * the head has not moved for ``policy.idle_after_s``: nobody is committing (the producers ahead stopped).

        On PostgreSQL the hold listens for commit notifications meanwhile (:class:`~lakestream_iceberg.connect.notify.
        CommitNotices`): it wakes as soon as a commit lands, and once notifications have proven to arrive it reads the
        pointer when one comes (and every half ``idle_after_s``, for commits that send none) instead of at every poll.
        Without a pointer probe (REST catalogs) it holds for ``seconds``, polling whether its intent is gone."""
        start = self._clock()
        end = start + seconds
        idle_s = self.policy.idle_after_s
        probe = self._probe()
        lead = self.policy.leads_queue and probe is not None
        watch = PointerWatch(probe, start, every_s=0.0 if lead else idle_s / 4) if lead or seconds > idle_s else None
        self._carried_peek = None
        notices = self._notices() if lead else None
        seen = notices.start() if notices is not None else None
        try:
            return self._hold(carry, seconds, end, watch, lead=lead, notices=notices, seen=seen)
        finally:
            if notices is not None and seen is not None:
                notices.stop(moved=watch is not None and watch.moves > 0)

    def _hold(self, carry: Carry[Any], seconds: float, end: float, watch: PointerWatch | None, *, lead: bool,
              notices: CommitNotices | None, seen: int | None) -> bool:
        """:meth:`wait`'s loop (``notices`` listening, ``seen`` their count, when it has them)."""
        idle_s = self.policy.idle_after_s
        polls = not lead  # whether every poll checks the intent (with ``lead``: on every move of the head)
        while (now := self._clock()) < end:
            if lead and watch is not None and watch.moved(now):
                place = self._place(carry)
                if place is not None:
                    return place
                polls = polls or self._blind
            delay = min(self.policy.poll_delay(waited=now - carry.staged_at), end - now)
            if notices is None or seen is None or watch is None:  # no notifications: poll
                self._sleep(delay)
            else:
                if notices.proven and not polls:  # the pointer is read when a notification comes, and as a safety net
                    watch.every_s = max(delay, idle_s / 2)
                    delay = min(watch.every_s, end - now)
                if (count := notices.wait(seen, delay)) != seen:
                    seen = count
                    watch.due()
            if (polls or (watch is not None and not watch.readable)) and carry.gone():  # no pointer now: the intent
                return True
            if watch is not None and seconds > idle_s and watch.idle_for(self._clock()) >= idle_s:
                log.debug("head of branch %s idle for %.3fs while holding: committing now", self._branch, idle_s)
                return False
        return False

    def take_peek(self) -> Peek | None:
        """The light read of the head that showed the held batch published, once (None when the hold read none)."""
        peek, self._carried_peek = self._carried_peek, None
        return peek

    def _place(self, carry: Carry[Any]) -> bool | None:
        """The held batch's place once the head moved: True when it was carried (the light read that shows it is kept
        for :meth:`take_peek`), False when it leads the queue (every batch staged before it is published, or a gap only its
        owner publishes), None to keep holding. Sets ``_blind`` when the head could not be read lightly (then every poll checks the intent)."""
        self._blind = False
        if carry.gone():  # published, and its committer removed the intent
            return True
        ahead = carry.ahead()
        if ahead is None:  # no longer listed (published and removed since), or the listing failed
            return True if carry.gone() else None
        if not ahead:
            return False
        peek = self._peek()
        if peek is None:
            self._blind = True
            return None
        if carry.answer(peek, 0) is not None:  # published by the commit that moved it
            self._carried_peek = peek
            return True
        producers = peek.state.producers
        # Listed before it and still to wait for: only a producer's next seq, which any commit may carry. A seq the
        # head shows published is a leftover (its committer removes it right after); one past the next is a gap only
        # its owner's own commit publishes (allow_gap), and a dead owner's stays staged until it is too old to count.
        if all((known := producers.get(producer)) is not None and seq != known.seq + 1 for producer, seq in ahead):
            return False
        return None
