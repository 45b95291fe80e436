"""The background commit of a producer: one committer thread that publishes submitted batches in submit order.

:meth:`Producer.submit <lakestream_iceberg.write.producer.Producer.submit>` checks a batch in the caller's thread, gives
it its seq and queues it here; the committer thread writes its data files and commits it (the same code as
``Producer.commit``) while the caller prepares its next batch, as Kafka's ``producer.send()`` returns a future and
``flush()`` waits for them. At most ``max_in_flight`` batches are queued or committing: a submit beyond that waits for a
slot (backpressure), so a producer never holds more than that many prepared batches in memory.

When a commit fails, its future gets the exception and every batch queued behind it fails with
:class:`~lakestream_iceberg.errors.ProducerFailedError` without being written or published: publishing a later seq after
a failed one would leave a gap in the producer's seqs. The queue then takes no more batches; a new producer with the same
id resumes from the table (its next seq is the first one not published).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from lakestream_iceberg.errors import CommitTimeoutError, ConfigError, ProducerFailedError

__all__ = ["CommitQueue", "Submitted"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class Submitted(Generic[T]):
    """One queued batch: its seq, what the committer needs to publish it, and when it was submitted."""

    seq: int
    payload: T
    submitted_at: float  # time.monotonic()


@dataclass(kw_only=True)
class _Failure:
    seq: int
    error: BaseException


@dataclass(kw_only=True)
class _Slot(Generic[T, R]):
    job: Submitted[T]
    future: Future[R] = field(default_factory=Future)


class CommitQueue(Generic[T, R]):
    """Bounded, ordered queue of submitted batches and the thread that publishes them with ``publish``.

    Args:
        publish: Publishes one batch and returns its result; raises when it was not published.
        max_in_flight: Batches queued or committing at most (>= 1).
        name: The committer thread's name (the producer id is in it).
        fix: What the caller should do after a failure (appended to ProducerFailedError messages).
    """

    def __init__(self, *, publish: Callable[[Submitted[T]], R], max_in_flight: int, name: str, fix: str) -> None:
        self._publish = publish
        self._max = max_in_flight
        self._fix = fix
        self._cond = threading.Condition()
        self._queue: deque[_Slot[T, R]] = deque()
        self._in_flight = 0  # queued + the one committing
        self._failure: _Failure | None = None
        self._closed = False
        # the thread holds the queue only while it has work: a queue (and producer) dropped unclosed is collected once
        # idle, and the thread ends, as ThreadPoolExecutor's workers do
        self._thread = threading.Thread(target=_committer, args=(weakref.ref(self, _wake(self._cond)), self._cond),
                                        name=name, daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Batches queued or committing now."""
        with self._cond:
            return self._in_flight

    def put(self, make: Callable[[], Submitted[T]], *, timeout_s: float | None) -> Future[R]:
        """Queue the batch ``make()`` builds once a slot is free (``make`` runs under the queue's lock, so that seqs are
        given in queue order and a submit that times out takes none).

        Raises:
            ProducerFailedError: An earlier batch failed (or the queue is closed); nothing was queued.
            CommitTimeoutError: No slot freed within ``timeout_s``; nothing was queued.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._raise_if_stopped()
                if self._in_flight < self._max:
                    break
                self.refuse_own_thread("a submit that waits for a free slot")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommitTimeoutError(
                        f"could not queue the batch within {timeout_s} s: {self._in_flight} batches are in flight "
                        f"(max_in_flight={self._max}); nothing was queued and no seq was taken, submit it again"
                    )
                self._cond.wait(left)
            slot: _Slot[T, R] = _Slot(job=make())
            slot.future.set_running_or_notify_cancel()  # a queued batch cannot be cancelled: its seq is taken
            self._queue.append(slot)
            self._in_flight += 1
            self._cond.notify_all()
            return slot.future

    def flush(self, *, timeout_s: float | None) -> int:
        """Wait until every queued batch is published or failed; the batches still in flight (0 when all are done).

        Raises:
            ProducerFailedError: A batch failed: the first failure, and what to do.
        """
        self.refuse_own_thread("flush()")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight:  # after a failure too, until _fail has every future done (it zeroes _in_flight)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return self._in_flight
                self._cond.wait(left)
            if self._failure is not None:
                raise self._failed_error("a batch it submitted was not published")
            return 0

    def close(self, *, timeout_s: float | None) -> int:
        """:meth:`flush`, then stop the committer thread once nothing is in flight; the batches left in flight."""
        self.refuse_own_thread("close()")
        try:
            left = self.flush(timeout_s=timeout_s)
        finally:
            with self._cond:  # closed even with batches left in flight: the committer publishes them, then stops
                self._closed = True
                self._cond.notify_all()
        if not left:
            self._thread.join(timeout_s)
        return left

    # -- the committer thread (_committer) ----------------------------------------------------------------------------
    def _next(self) -> _Slot[T, R] | None:
        """The batch to publish next, or None when closed and idle (the thread ends); called under the lock with work
        or ``_closed`` there."""
        return self._queue[0] if self._queue else None

    def _has_work(self) -> bool:
        return bool(self._queue) or self._closed

    def _publish_one(self, slot: _Slot[T, R]) -> None:
        try:
            result = self._publish(slot.job)
        except BaseException as exc:  # noqa: BLE001 - the future carries it to the caller
            self._fail(slot, exc)
            return
        slot.future.set_result(result)  # before the slot frees: a flush that returns finds every future done
        self._done(slot)

    def _done(self, slot: _Slot[T, R]) -> None:
        with self._cond:
            self._queue.popleft()
            self._in_flight -= 1
            self._cond.notify_all()

    def _fail(self, slot: _Slot[T, R], exc: BaseException) -> None:
        with self._cond:  # failed before its future is: a submit made once the caller sees the error is refused
            self._failure = _Failure(seq=slot.job.seq, error=exc)
        slot.future.set_exception(exc)  # its done-callbacks run here: not under the queue's lock
        with self._cond:
            behind = list(self._queue)[1:]
            for other in behind:  # under the lock, so that a flush that returns finds every future done
                other.future.set_exception(self._failed_error(
                    f"batch seq {other.job.seq} was not published (nothing of it was written)"))
            self._queue.clear()
            self._in_flight = 0
            self._cond.notify_all()

    def refuse_own_thread(self, what: str) -> None:
        """Raise ConfigError when called on the committer thread: a done-callback of a submitted batch's future runs
        there, and waiting there for the queue would wait for that thread itself, forever."""
        if threading.current_thread() is self._thread:
            raise ConfigError(f"{what} in a done-callback of a submitted batch's future would wait forever: the callback "
                              "runs on the producer's committer thread, which publishes the batches it would wait for; "
                              "flush, close or submit from the thread that submits")

    def _raise_if_stopped(self) -> None:
        if self._failure is not None:
            raise self._failed_error("it takes no more batches")
        if self._closed:
            raise ProducerFailedError(f"the producer is closed; {self._fix}")

    def _failed_error(self, what: str) -> ProducerFailedError:
        failure = self._failure
        assert failure is not None
        error = ProducerFailedError(
            f"{what}: its batch seq {failure.seq} failed first ({type(failure.error).__name__}: {failure.error}), and "
            f"batches behind a failed one are never published (that would leave a gap); {self._fix}"
        )
        error.__cause__ = failure.error
        return error


def _wake(cond: threading.Condition) -> Callable[[object], None]:
    """The weakref callback that wakes an idle committer once its queue is collected, so that it ends."""
    def wake(_: object) -> None:
        with cond:
            cond.notify_all()
    return wake


def _committer(ref: weakref.ref[CommitQueue[T, R]], cond: threading.Condition) -> None:
    """The committer thread: publishes queued batches in order; ends when the queue is closed and idle, or collected.

    It holds the queue while batches are queued (a producer dropped unclosed still publishes what it submitted, and
    their futures complete), and only a weak reference while idle."""
    queue = ref()
    while queue is not None:
        with cond:
            while not queue._has_work():  # noqa: SLF001 - the queue's own thread
                del queue
                cond.wait()
                queue = ref()
                if queue is None:
                    return  # dropped unclosed with nothing queued: nothing is left to publish
            slot = queue._next()  # noqa: SLF001
            if slot is None:
                return  # closed and idle
        queue._publish_one(slot)  # noqa: SLF001
        del slot  # a published batch's data is not kept while idle
