"""Reading a stream as it grows: watching the head cheaply, pumping steps in order with prefetch, fetching shard files.
The torch-facing layer is :mod:`lakestream_iceberg.read.dataset`.

A follow-mode reader asks "did the head move?" many times per second, so the question must cost almost nothing when
the answer is no. :class:`HeadWatcher` asks the catalog for the table's *metadata pointer* only and reads the new
``metadata.json`` (through the table's own FileIO, never a second catalog round trip) only when the pointer moved:

* SQL catalogs (SQLite, PostgreSQL): one indexed ``SELECT metadata_location FROM iceberg_tables`` on the catalog's own
  SQLAlchemy engine.
* Any other catalog (REST, Glue, Hive): ``Table.refresh()`` (those catalogs answer with the full metadata anyway).

Between polls it sleeps on an adaptive schedule (:class:`ArrivalClock`): while steps arrive at a steady rate it sleeps
until shortly before the earliest moment the next one can plausibly land, then polls every ``poll_s``; when steps stop
coming it backs off exponentially to ``max_poll_s``. On PostgreSQL catalogs it also listens for the commit
notifications lakestream's own commits send (:mod:`lakestream_iceberg.connect.notify`) and wakes on one at once.

Reopening a stream in another process (:class:`~lakestream_iceberg.read.stream_ref.StreamRef`) is in
:mod:`lakestream_iceberg.read.stream_ref`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from itertools import pairwise
from typing import Any, Protocol, TypeVar

from pyiceberg.io import FileIO
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import Snapshot

from lakestream_iceberg.connect.notify import HeadListener
from lakestream_iceberg.connect.pointer import refresh_if_moved
from lakestream_iceberg.errors import LakestreamError, ReadError, ReadTimeoutError, StepError, StreamError
from lakestream_iceberg.format.checks import check_int
from lakestream_iceberg.format.layout import check_format_version
from lakestream_iceberg.format.table import StreamTable, after_gc, check_fixed
from lakestream_iceberg.read.reader import read_file

log = logging.getLogger(__name__)

FAILURES_LOGGED = 100  # while the catalog cannot be reached, a warning at the first failed poll and every 100th

__all__ = ["ArrivalClock", "HeadSource", "HeadWatcher", "consumer_lag", "fetch_table", "pump_steps"]

class ArrivalClock:
    """When new heads showed up, and when it is worth asking again: the follow-mode poll schedule.

    Each time a poll finds the head moved, the arrival is dated halfway between that poll and the previous one (the
    commit landed somewhere in between). From the last ``ARRIVALS_KEPT`` arrivals:

    * **steady** (at least ``MIN_ARRIVALS`` arrivals, the last one less than ``IDLE_AFTER`` typical (median) intervals
      ago): no step is expected before ``last arrival + shortest recent interval``, so the watcher sleeps until a
      margin (``max(poll_s, EARLY_MARGIN * shortest)``) before that moment (at most ``max_poll_s``) and from then on
      polls every ``poll_s``, without backoff, until the step shows;
    * **idle** (too little history, or no step for ``IDLE_AFTER`` typical intervals): exponential backoff from
      ``poll_s`` to ``max_poll_s``, as before.

    Catalog load: at most ``1 / poll_s`` pointer queries per second while steps arrive, and only in the window between
    the earliest plausible arrival and the actual one (producers committing every 50 ms with ``poll_s = 2 ms`` and
    10 ms of jitter: about 5-10 queries per step); ``1 / max_poll_s`` per second when idle. A pointer query on a SQL
    catalog is one indexed ``SELECT`` (about 50-80 us on a local SQLite file). A producer that speeds up is seen late by
    at most the old shortest interval once, after which the shorter interval is the new bound; one that slows down only
    costs extra polls (bounded as above) until ``IDLE_AFTER`` intervals pass.
    """

    ARRIVALS_KEPT = 9  # the last 8 intervals
    MIN_ARRIVALS = 3  # two intervals before the schedule is trusted
    IDLE_AFTER = 4.0  # typical intervals without a step: the producers paused, back off
    EARLY_MARGIN = 0.1  # wake this fraction of the shortest interval before the earliest plausible arrival

    def __init__(self) -> None:
        self._arrivals: deque[float] = deque(maxlen=self.ARRIVALS_KEPT)

    def note(self, previous_poll: float | None, this_poll: float) -> None:
        """A poll at ``this_poll`` (monotonic seconds) found a new head; the poll before it was at ``previous_poll``."""
        self._arrivals.append(this_poll if previous_poll is None else (previous_poll + this_poll) / 2)

    def delay(self, now: float, *, poll_s: float, max_poll_s: float) -> float | None:
        """Seconds to sleep before the next poll while steps arrive steadily; None when idle (the caller backs off)."""
        arrivals = self._arrivals
        if len(arrivals) < self.MIN_ARRIVALS:
            return None
        gaps = sorted(b - a for a, b in pairwise(arrivals))
        typical, shortest, last = gaps[len(gaps) // 2], gaps[0], arrivals[-1]
        if now - last > self.IDLE_AFTER * typical:
            return None
        early = last + shortest - max(poll_s, self.EARLY_MARGIN * shortest) - now
        return max(poll_s, min(early, max_poll_s))


class HeadWatcher:
    """Keeps one stream's table view at the branch head, reloading metadata only when the catalog pointer moved.

    Args:
        stream: The stream whose ``table`` view is kept current (its metadata is replaced in place, like ``refresh``).
        branch: The branch to follow.
        io: The FileIO to read ``metadata.json`` with (default: the table's).
        existed: The caller saw ``branch`` as a branch before (a dataset made on it): its ref missing now is a drop
            (``ReadError``), whatever the view given shows.
    """

    def __init__(self, stream: StreamTable, *, branch: str, io: FileIO | None = None, listen: bool = True,
                 existed: bool = False) -> None:
        self._stream = stream
        self._branch = branch
        self._io = io or stream.io
        self.polls = 0
        self.reloads = 0
        self._listen = listen  # PostgreSQL catalogs: wake on commit notifications (connect/notify.py)
        self._listener: HeadListener | None = None
        self.clock = ArrivalClock()
        self._seen: int | None = None  # the highest head step seen so far
        self._failures = 0  # polls that could not reach the catalog, in a row (wait)
        self._last_poll: float | None = None
        # the branch was seen (in the view given, or at a poll since): its ref gone since is a drop, not a fork yet to
        # be made; a dataset's iteration or lag() that starts after the drop holds a view that still shows it
        ref = stream.table.metadata.refs.get(branch)
        self._had_branch = existed or (ref is not None and ref.snapshot_ref_type == SnapshotRefType.BRANCH)
        self._existed = existed

    @property
    def notifications(self) -> int:
        """Commit notifications received so far (always 0 on catalogs that send none)."""
        return self._listener.received if self._listener is not None else 0

    @property
    def listening(self) -> bool:
        """Whether commit notifications wake this watcher (a live LISTEN connection on a PostgreSQL catalog)."""
        return self._listener is not None and self._listener.alive

    def pause(self, seconds: float, stop: threading.Event | None = None) -> bool | None:
        """Sleep up to ``seconds``, less when a commit notification arrives (True) or ``stop`` is set (None)."""
        # a poll_s past what threading can wait (about 292 years) raised OverflowError, killing the relay's poll thread
        seconds = min(max(0.0, seconds), threading.TIMEOUT_MAX)
        if self._listen and self._listener is None:
            self._listen = False  # open once
            self._listener = HeadListener.open(self._stream.table)
        listener = self._listener
        if listener is None or not listener.alive:
            if stop is None:
                time.sleep(seconds)
                return False
            return None if stop.wait(seconds) else False
        end = time.monotonic() + seconds
        while True:
            if stop is not None and stop.is_set():
                return None
            left = end - time.monotonic()
            if left <= 0:
                return False
            if listener.wait(min(left, 0.1)):  # short slices: ``stop`` is noticed within 0.1 s
                return True

    def close(self) -> None:
        """Release the notification connection, if any (also released when the watcher is garbage-collected)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def check(self) -> bool:
        """Bring the table view up to date; True when the metadata changed."""
        self.polls += 1
        now = time.monotonic()
        changed = refresh_if_moved(self._stream.table, io=self._io)
        self.reloads += changed
        # Every poll, not only when the metadata changed: a refusal leaves the new metadata in the view, so a caller
        # that retried (wait_for again, a DataLoader iterated again) found it unchanged and read on unchecked.
        # A newer lakestream_iceberg may upgrade a followed stream: its steps would be misread
        properties = self._stream.table.metadata.properties
        check_format_version(properties, stream=self._stream.name)
        # world size, layout, payload schema changed by another engine: producers opened since lay steps out by
        # the new value, which this reader would refuse as damaged files (or read as another shape)
        check_fixed(properties, self._stream.fixed, stream=self._stream.name,
                    left="a follower opened before reads no further step")
        self._check_branch()  # every poll: the view may have moved in place (a commit through the same table object)
        if changed or self._seen is None:
            step = self.head()[0]
            if self._seen is not None and step > self._seen:
                self.clock.note(self._last_poll, now)
            elif self._seen is not None and step < self._seen:  # rolled back (another engine, an operator)
                log.warning(
                    "the head of %s (branch %r) moved back from step %d to step %d: steps %d-%d a reader of it may "
                    "have delivered are no longer on the branch, and a follower does not deliver the steps published "
                    "again under those numbers. Restart the readers from step %d (start_step=) or an earlier "
                    "checkpoint", self._stream.name, self._branch, self._seen, step, step + 1, self._seen, step + 1)
                self._seen = step  # a step published again after it counts as an arrival; warned once per move back
            self._seen = step if self._seen is None else max(self._seen, step)
        self._last_poll = now
        return changed

    def _check_branch(self) -> None:
        """Refuse (:class:`ReadError`) a followed branch that another engine or a person dropped, or replaced by a tag:
        no step would ever be published on it, and a tag's snapshot read as its head is no branch's state; and a
        checkpoint's tag followed as a branch (it never moves)."""
        ref = self._stream.table.metadata.refs.get(self._branch)
        if ref is not None and ref.snapshot_ref_type == SnapshotRefType.BRANCH:
            self._had_branch = True
            return
        if ref is None and not self._had_branch:
            return  # main of a stream with no step yet, or a fork about to be made
        if ref is None and self._branch == MAIN_BRANCH and not self._seen and not self._existed:
            # main seen holding no step (another engine's snapshot written before the first step, refused): repair
            # removed main's ref, which leaves the stream as created; the next commit publishes step 1 on it
            self._had_branch = False
            return
        if not self._had_branch:  # a tag from the start: no engine replaced anything
            raise ReadError(
                f"{self._branch!r} of {self._stream.name} is a checkpoint's tag, not a branch: it pins step "
                f"{self.head()[0]} and never moves, so no later step will be published on it. Wait on or follow a "
                "branch (the checkpoint's own, or a fork of it: stream.fork(checkpoint, branch=...))"
            )
        what = "is a tag now, not a branch" if ref is not None else "no longer exists"
        raise ReadError(
            f"branch {self._branch!r} of {self._stream.name} {what}: another engine or a person "
            f"{'replaced it' if ref is not None else 'dropped it'} while it was followed (Spark: ALTER TABLE ... DROP "
            "BRANCH; pyiceberg: manage_snapshots().remove_branch), so no step will be published on it. Follow another "
            "branch (stream.checkpoints() and the table's refs list them), or fork it again from a checkpoint"
        )

    def latest(self) -> tuple[int, Snapshot | None]:
        """The head step and snapshot of now (:meth:`check`, then :meth:`head`)."""
        self.check()
        return self.head()

    def head(self) -> tuple[int, Snapshot | None]:
        """The head step and snapshot of the branch in the current table view (no I/O)."""
        metadata = self._stream.table.metadata
        snapshot = metadata.snapshot_by_name(self._branch)
        return self._stream.branch_state(branch=self._branch, metadata=metadata).step, snapshot

    def wait(
        self,
        step: int,
        *,
        timeout: float | None,
        stop: threading.Event,
        poll_s: float = 0.02,
        max_poll_s: float = 0.5,
    ) -> tuple[int, Snapshot | None] | None:
        """Block until ``step`` is published; return ``(head step, head snapshot)``, or None when ``stop`` was set.
        ``timeout`` runs from the start, and again from each step published meanwhile (``step`` may be several steps
        ahead: a DataLoader worker's next).

        Polls on the :class:`ArrivalClock` schedule: every ``poll_s`` from shortly before the next step is due while
        steps arrive steadily, else exponential backoff from ``poll_s`` to ``max_poll_s``; catalog errors are retried
        the same way.

        Raises:
            ReadTimeoutError: ``timeout`` seconds passed first (``None`` waits forever).
            ReadError: The branch was dropped, or replaced by a tag, while it was followed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = self.head()[0]  # a step published meanwhile restarts the timeout (see below)
        delay = poll_s
        error: BaseException | None = None
        while True:
            try:
                self.check()
                if self._failures:
                    log.info("polling %s works again after %d failure(s)", self._stream.name, self._failures)
                error, self._failures = None, 0
            except LakestreamError:
                raise  # the table was read and is wrong (re-created, malformed): waiting cannot fix it
            except Exception as exc:  # the catalog is unreachable for now: keep trying until the deadline
                self._failures += 1  # a warning at the first failure and every FAILURES_LOGGED-th, per rank
                if self._failures == 1 or self._failures % FAILURES_LOGGED == 0:
                    log.warning("polling %s failed %d time(s) in a row (%s); retrying, backing off to every %gs",
                                self._stream.name, self._failures, type(exc).__name__, max_poll_s)
                error = exc
            head = self.head()
            if head[0] >= step:
                return head
            if timeout is not None and head[0] > seen:
                # the producers are publishing: a DataLoader worker (every k-th step) waits for k steps at a time, and
                # its timeout, "seconds without a new step", timed out a steady stream slower than timeout / k
                seen, deadline = head[0], time.monotonic() + timeout
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ReadTimeoutError(
                    f"step {step} of {self._stream.name} (branch {self._branch!r}) was not published within {timeout}s "
                    f"(head step is {head[0]}); are the producers running? Raise the dataset's timeout= to wait longer"
                ) from error
            # steps due soon are polled for every poll_s, but not while the catalog cannot be reached: back off then
            planned = None if error is not None else self.clock.delay(time.monotonic(), poll_s=poll_s,
                                                                      max_poll_s=max_poll_s)
            sleep = delay if planned is None else planned
            woke = self.pause(sleep if remaining is None else min(sleep, remaining), stop)
            if woke is None:
                return None
            if woke:  # a commit landed: poll fast again
                delay = poll_s
            elif planned is None:
                delay = min(delay * 2, max_poll_s)


class HeadSource(Protocol):
    """What :func:`pump_steps` asks of a head watcher: :class:`HeadWatcher` (the catalog, from this process) or
    :class:`~lakestream_iceberg.read.relay_client.RelayWatcher` (the host's head relay)."""

    def check(self) -> bool: ...

    def head(self) -> tuple[int, Any]: ...

    def latest(self) -> tuple[int, Any]: ...

    def wait(self, step: int, *, timeout: float | None, stop: threading.Event, poll_s: float = 0.02,
             max_poll_s: float = 0.5) -> tuple[int, Any] | None: ...

    def close(self) -> None: ...


T = TypeVar("T")


def pump_steps(
    watcher: HeadSource,
    load: Callable[[Any, int], T],
    *,
    first: int,
    stride: int,
    end: int | None,
    follow: bool,
    prefetch: int,
    timeout: float | None,
    poll_s: float,
    max_poll_s: float,
    stop: threading.Event,
    closers: list[Callable[[], None]],
) -> Generator[tuple[int, T], None, None]:
    """``(step, load(snapshot, step))`` for ``first, first + stride, ...`` up to ``end``, in order, each step once.

    ``load`` runs in a pool of ``prefetch`` threads, up to ``prefetch`` steps ahead of the consumer (in the calling
    thread when 0). Without ``follow`` the pump ends at the head it first sees; with it, it waits for unpublished steps
    (``watcher.wait``: bounded backoff, ``timeout``). Setting ``stop`` and calling the shutdown it appends to
    ``closers`` ends it from another thread; no pool thread outlives the pump.

    A load that raises ``FileNotFoundError`` (lifecycle GC deleted files of the head it was given: a manifest list of
    an expired snapshot, a collected step's data file) runs again once, in the calling thread, on the current head
    (``watcher.check()``): a retained step is then read, and a collected one raises the loader's error for it.
    """

    def poll(ask: Callable[[], object]) -> None:  # a follow-mode pump rides out a catalog hiccup (the next wait retries)
        try:
            ask()
        except StreamError:
            raise  # the table is gone or another one (dropped, created again): its head is no step of this stream
        except Exception:
            if not follow:
                raise

    poll(watcher.check)
    head, snapshot = watcher.head()
    pool = ThreadPoolExecutor(prefetch, thread_name_prefix="lakestream-read") if prefetch else None
    pending: deque[Future[T]] = deque()

    def shutdown(wait: bool = False) -> None:
        for future in pending:
            future.cancel()
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)

    def run_now(at: Snapshot | None, number: int) -> Future[T]:  # prefetch 0: load here; errors surface on result()
        done: Future[T] = Future()
        try:
            done.set_result(load(at, number))
        except Exception as exc:
            done.set_exception(exc)
        return done

    closers.append(shutdown)
    step, submit = first, first
    try:
        while (end is None or step <= end) and not stop.is_set():
            if step > head:
                if not follow:
                    return
                waited = watcher.wait(step, timeout=timeout, stop=stop, poll_s=poll_s, max_poll_s=max_poll_s)
                if waited is None:
                    return
                head, snapshot = waited
            elif follow and submit > head and len(pending) < prefetch:
                # lets prefetch run ahead of the consumer: a pointer query directly, a local request through the
                # relay (a check there would make the holder poll the catalog for every reader at every step)
                poll(watcher.latest)
                head, snapshot = watcher.head()
            while submit <= head and (end is None or submit <= end) and len(pending) <= prefetch:
                if pool is None:
                    pending.append(run_now(snapshot, submit))
                else:
                    try:
                        pending.append(pool.submit(load, snapshot, submit))
                    except RuntimeError:  # shut down from another thread
                        if stop.is_set():
                            return
                        raise
                submit += stride
            def on_head(number: int = step) -> T:  # the step resolved again on the current head, after a GC
                nonlocal head, snapshot
                head, snapshot = watcher.head()
                return load(snapshot, number)

            try:
                item = after_gc(pending.popleft().result, refresh=watcher.check, again=on_head)
            except CancelledError:
                if stop.is_set():
                    return
                raise
            if stop.is_set():
                return
            yield step, item
            step += stride
    finally:
        closers.remove(shutdown)
        shutdown(wait=True)  # at most the reads in flight
        watcher.close()


fetch_table = read_file  # one shard file, one read (see lakestream_iceberg.read.reader.read_file)


def consumer_lag(stream: StreamTable, delivered_step: int, *, branch: str = "main") -> int:
    """How many published steps a consumer that has delivered ``delivered_step`` is behind the head (>= 0).

    Example:
        >>> consumer_lag(stream, 40)     # head step 42 -> 2     # doctest: +SKIP
        2

    Raises:
        ConfigError: The stream has no branch of that name.
    """
    delivered_step = check_int(delivered_step, what="delivered_step", error=StepError, minimum=0,
                               hint="0 when nothing was delivered yet")
    watcher = HeadWatcher(stream, branch=branch)
    watcher.check()
    stream.require_ref(branch, doing="no consumer lag on")  # a misspelt branch read as an empty one: lag 0, "caught up"
    return max(0, watcher.head()[0] - delivered_step)

