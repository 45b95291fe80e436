"""Producers publish global batches: write the shards once, then commit them as one snapshot, exactly once.

A producer is identified by a stable id (``"prep-0"``) and numbers its batches 0, 1, 2, ... (its *seq*). The table is
the only state: ``next_seq`` is read from the head snapshot's producer table, so a producer killed at any point and
restarted with the same id continues with no gap and no duplicate.

One call: check the batch, open its seq on the head (:class:`~lakestream_iceberg.write.head.ProducerHead`; a published
seq is a duplicate, nothing is written), write the data files, stage them when others are committing (group commit),
then hand one :class:`~lakestream_iceberg.write.planner.BatchPlanner` to the producer's
:class:`~lakestream_iceberg.write.commit.CommitLoop`, paced by :mod:`lakestream_iceberg.write.dac`.

``submit`` does the same in the background (:mod:`lakestream_iceberg.write.background`): the batch is checked and given
its seq in the caller's thread, and the producer's committer thread writes and commits it while the caller prepares the
next one. Both paths produce their :class:`CommitResult` in one method (``Producer._commit``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING

import pyarrow as pa
from pyiceberg.table.metadata import TableMetadata

from lakestream_iceberg.connect.diagnose import config_errors, explain, one_line, transient
from lakestream_iceberg.connect.metrics import catalog_label, observe_commit, observe_failed_commit, prepare
from lakestream_iceberg.errors import (
    CommitError,
    CommitOutcomeUnknownError,
    CommitTimeoutError,
    ConfigError,
    LakestreamError,
    ProducerConflictError,
    ProducerFailedError,
    SequenceError,
)
from lakestream_iceberg.format.batches import check_batch
from lakestream_iceberg.format.checks import check_bool, check_int
from lakestream_iceberg.format.summary import MAX_SEQ
from lakestream_iceberg.format.table import after_gc
from lakestream_iceberg.write.background import CommitQueue, Submitted
from lakestream_iceberg.write.commit import CommitLoop
from lakestream_iceberg.write.head import ProducerHead
from lakestream_iceberg.write.own_batches import OwnBatches
from lakestream_iceberg.write.plan import Outcome
from lakestream_iceberg.write.planner import BatchPlanner, Published, stage_batch
from lakestream_iceberg.write.staging import StagingArea
from lakestream_iceberg.write.writer import BatchWriter, check_producer_id

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["CommitResult", "Producer"]


@dataclass(frozen=True, kw_only=True)
class CommitResult:
    """What one ``Producer.commit`` (or one batch of ``Producer.submit``) did.

    Attributes:
        step: The global step the batch was published as (``None`` only for a duplicate whose step was collected).
        snapshot_id: The Iceberg snapshot that published it (``None`` likewise).
        seq: The producer sequence number of the batch.
        producer: The id of the producer that committed it.
        attempts: Compare-and-swap attempts this call made (0 when the duplicate was known before writing).
        duplicate: True when (producer, seq) was already published; nothing new was published.
        rows: Samples in the batch, all ranks.
        bytes: Bytes of data files written for the batch.
        latency_s: Wall time of the call (``submit``: from the submit to the batch's publication, queueing included).
        carried: True when the batch was published by another producer's group commit (see
            :mod:`lakestream_iceberg.write.staging`) rather than by this call's own compare-and-swap.
        group: How many batches the commit that published it published (its snapshot's group; 1 for a lone commit,
            and for a duplicate whose snapshot expired).
    """

    step: int | None
    snapshot_id: int | None
    seq: int
    producer: str
    attempts: int
    duplicate: bool
    rows: int = 0
    bytes: int = 0
    latency_s: float = 0.0
    carried: bool = False
    group: int = 1


def _check_timeout(timeout_s: object) -> float | None:
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
        raise ConfigError(f"timeout_s must be a number of seconds >= 0 or None (wait as long as it takes), got {timeout_s!r}")
    # longer than threading can wait (inf, 1e12): as long as it takes (a lock's wait raises OverflowError on it)
    return None if timeout_s >= threading.TIMEOUT_MAX else float(timeout_s)


class _RolledBack(Exception):
    """A batch the producer numbered cannot take its seq: the branch was rolled back below it (a gap), or a batch of
    that seq the producer published before a rollback is back on the branch (a fast-forward to the old head). Not raised
    out of the producer: the batch is published as ``next_seq`` instead."""

    def __init__(self, next_seq: int) -> None:
        super().__init__(next_seq)
        self.next_seq = next_seq


@dataclass(frozen=True, kw_only=True)
class _Checked:
    """A batch that passed :func:`check_batch`: its shards, concatenated when the check did it, and its gap rule."""

    shards: list[pa.Table]
    whole: pa.Table | None
    seq: int | None  # as the caller passed it, checked
    allow_gap: bool


@dataclass(frozen=True)
class _FailedCall:
    """A ``commit(seq=None)`` call that raised after writing its batch as ``seq``: the batch may still be published."""

    seq: int
    shards: list[pa.Table]

    def same(self, shards: list[pa.Table]) -> bool:
        """Whether ``shards`` is that batch again (equal tables, shard by shard; Arrow compares the values, so a batch
        rebuilt or sliced anew is the same, whatever its buffers)."""
        return len(shards) == len(self.shards) and all(a.equals(b) for a, b in zip(shards, self.shards, strict=True))


class Producer:
    """Publishes global batches into one branch of a stream. Obtain one with :meth:`lakestream_iceberg.Stream.producer`;
    the constructor's arguments (the stream, the branch, its commit loop, writer and staging area) are internal.

    Example:
        >>> producer = stream.producer("prep-0")                          # doctest: +SKIP
        >>> result = producer.commit([shard_rank0, shard_rank1])           # doctest: +SKIP
        >>> result.step, result.seq, result.duplicate                      # doctest: +SKIP
        (1, 0, False)
    """

    def __init__(self, stream: StreamTable, producer_id: str, *, branch: str, loop: CommitLoop, writer: BatchWriter,
                 staging: StagingArea, max_in_flight: int = 2) -> None:
        self._stream = stream
        self._writer = writer
        self._staging = staging
        self.producer_id = check_producer_id(producer_id)
        self.branch = branch
        self._loop = loop
        self._head = ProducerHead(stream, producer_id=self.producer_id, branch=branch, loop=loop)
        self._peeked_next = 0  # this id's next seq, as the light read that answered its last commit showed it
        self._failed: _FailedCall | None = None  # the last call, when it was a seq=None call that failed after writing
        self.max_in_flight = check_int(max_in_flight, what="max_in_flight", minimum=1,
                                       hint="the batches a producer may have queued or committing in the background")
        self._lock = threading.RLock()  # held by every commit (caller's or committer thread) and every read of the head
        self._queue: CommitQueue[_Checked, CommitResult] | None = None  # started by the first submit
        self._next_submit = 0  # the seq the next submit takes (valid once the queue is started)
        self._closed = False  # close() was called: no more commits or submits
        self._pid = os.getpid()  # the process whose committer thread and lock these are (see _own)
        self._sent = OwnBatches()  # how it tells its own batches from another writer's of the same id
        self._queue_next = 0  # the seq a batch submitted with seq=None is published as: after the queue's last one
        prepare()  # the metrics client's import and registration, here rather than inside the first commit

    @property
    def policy(self) -> object:
        """The producer's DAC state (see :class:`lakestream_iceberg.write.dac.CommitPolicy`)."""
        return self._loop.policy

    @property
    def next_seq(self) -> int:
        """The next sequence number this producer id has not published, read from the table (batches submitted and
        not yet published are not counted)."""
        self._own()
        with self._lock:  # the committer thread reads and adopts the same table view
            metadata = self._head.refresh()
            following = self._head.next_seq(self._head.state(metadata))
            self._follows(metadata, following - 1)  # the first read of the table: what an earlier incarnation published
            return following

    def commit(self, shards: Sequence[pa.Table], *, seq: int | None = None, allow_gap: bool = False) -> CommitResult:
        """Publish one global batch (one shard per rank) as the next step, exactly once.

        When other producers are active the batch is staged and may be published by another producer's group commit
        (see :mod:`lakestream_iceberg.write.staging`): it is still its own snapshot and step, and the result says
        ``carried=True``. The call returns once the batch is published, by whichever producer.

        Args:
            shards: One pyarrow Table per rank, ``len(shards) == world_size``; sizes may differ, empty is allowed.
            seq: This producer's sequence number for the batch; defaults to :attr:`next_seq`. Re-committing a
                published seq publishes nothing and returns the original result with ``duplicate=True``.
            allow_gap: Permit ``seq > next_seq`` (skipped sequence numbers are then never published).

        Returns:
            The :class:`CommitResult`.

        Raises:
            ShardCountError, SchemaMismatchError: The batch is malformed; nothing was written.
            SequenceError: ``seq`` would leave a gap (and ``allow_gap`` is false) or is negative.
            CommitTimeoutError: The commit budget ran out; this call published nothing (a staged batch was
                withdrawn, though a group commit that had already read it may still publish it); retry with the same
                seq, which is reconciled either way.
            CommitOutcomeUnknownError: The catalog stayed unreachable; retry with the same seq to reconcile (a staged
                batch stays staged, so another producer may publish it meanwhile).
            ProducerFailedError: Only once :meth:`submit` was used: then this call queues the batch behind the
                submitted ones and waits for it, and a failure stops the producer as it does for a submitted batch.

        Thread-safety: ``commit`` and ``submit`` may be called from several threads; a commit made while no batch was
        ever submitted runs in the calling thread (holding the producer's lock), later ones go through the queue, so
        batches never interleave and seqs stay in call order.
        """
        self._own()
        if self._queue is None:
            with self._lock:
                if self._queue is None:
                    self._refuse_closed()
                    started = time.monotonic()
                    checked = self._check(shards, seq=seq, allow_gap=allow_gap)
                    with config_errors(self._stream.io.properties, action=f"committing to {self._stream.name}",
                                       catalog=self._stream.table.catalog.name):
                        return self._commit(checked, seq=checked.seq, started=started)
        # submit() was used: the batch queues behind the submitted ones, in order, and this call waits for it
        self._queue.refuse_own_thread("commit() after a submit")  # a done-callback would wait for its own thread
        return self.submit(shards, seq=seq, allow_gap=allow_gap).result()

    def submit(self, shards: Sequence[pa.Table], *, seq: int | None = None, allow_gap: bool = False,
               timeout_s: float | None = None) -> Future[CommitResult]:
        """Publish one global batch in the background: check it, give it its seq, queue it, and return at once.

        The producer's committer thread writes the batch's data files and commits it exactly as :meth:`commit` does,
        while the caller prepares its next batch (the commit's wait on the catalog and the file system no longer idles
        the caller's core). Batches publish in submit order, as consecutive seqs of this producer. At most
        ``max_in_flight`` batches (``Stream.producer(..., max_in_flight=2)``) are queued or committing: a submit
        beyond that waits for a slot. The shards must not change after the call (pyarrow tables do not; numpy arrays
        they wrap must be left alone until the future is done).

        When a commit fails, its future holds the exception, every batch queued behind it fails with
        :class:`~lakestream_iceberg.errors.ProducerFailedError` without being written or published, and the producer
        takes no more batches: open a new producer with the same id, which resumes from the table's state (a published
        seq is never published twice; the next seq is the first unpublished one). A refusal stops it in the same way,
        e.g. :class:`~lakestream_iceberg.errors.ForeignSnapshotError`: after ``Stream.repair()``, open a new producer
        (one that only ever used :meth:`commit` goes on by itself, with the refused seq). A process killed with batches in
        flight loses exactly the ones not yet published, in the same way. Call :meth:`flush` or :meth:`close` (or use
        the producer as a context manager) before the process exits: the committer is a daemon thread, and what is
        still queued when the interpreter exits is not published.

        Example:
            >>> with stream.producer("prep-0") as producer:                   # doctest: +SKIP
            ...     futures = [producer.submit(prepare(raw)) for raw in source]
            >>> futures[-1].result().step                                      # doctest: +SKIP
            12

        Args:
            shards: One pyarrow Table per rank, as for :meth:`commit`.
            seq: The batch's seq; defaults to the one after the last submitted (the table's next seq at the first;
                after another engine rolled the branch back below it, the rolled-back head's next seq, and the batches
                queued behind it follow on).
                When another writer of the id published that seq meanwhile, the future raises
                :class:`~lakestream_iceberg.errors.ProducerConflictError` (an explicit ``seq`` that is published is a
                replay: ``duplicate=True``).
            allow_gap: Permit ``seq`` beyond the next one (skipped seqs are never published); a batch the producer
                numbers (``seq=None``) never skips.
            timeout_s: How long to wait for a free slot (None: as long as it takes).

        Returns:
            A :class:`concurrent.futures.Future` of the batch's :class:`CommitResult` (it cannot be cancelled).

        Raises:
            ShardCountError, SchemaMismatchError, SequenceError: The batch is malformed; nothing was queued.
            CommitTimeoutError: No slot freed within ``timeout_s``; nothing was queued and no seq was taken.
            ProducerFailedError: An earlier batch of this producer failed (or it is closed); nothing was queued.
            ConfigError: Called from a done-callback of a submitted batch's future (the committer thread) while no slot
                is free: it would wait for that thread itself. :meth:`flush`, :meth:`close` and :meth:`commit` (after a
                submit) refuse such a callback in the same way.
        """
        submitted_at = time.monotonic()
        self._own()
        timeout_s = _check_timeout(timeout_s)
        checked = self._check(shards, seq=seq, allow_gap=allow_gap)
        if self._queue is None:
            self._start_queue()
        assert self._queue is not None

        def take_seq() -> Submitted[_Checked]:  # under the queue's lock: seqs in queue order
            taken = self._next_submit if checked.seq is None else checked.seq
            if taken > self._next_submit and not allow_gap:
                raise SequenceError(
                    f"producer {self.producer_id!r} would skip from seq {self._next_submit} to {taken}: its next seq is "
                    f"{self._next_submit} (the one after its last submitted batch, or the table's next seq before its "
                    "first submit); pass seq=None to take it, or allow_gap=True to skip on purpose")
            self._next_submit = max(self._next_submit, taken + 1)
            return Submitted(seq=taken, payload=checked, submitted_at=submitted_at)

        return self._queue.put(take_seq, timeout_s=timeout_s)

    def flush(self, *, timeout_s: float | None = None) -> int:
        """Wait until every submitted batch is published; how many are still in flight (0: all of them are).

        Args:
            timeout_s: How long to wait at most (None: until every batch is published).

        Returns:
            The batches still in flight when it returned (0: all published).

        Raises:
            ProducerFailedError: A submitted batch failed (its future holds the error); see :meth:`submit`.
        """
        self._own()
        timeout_s = _check_timeout(timeout_s)
        return 0 if self._queue is None else self._queue.flush(timeout_s=timeout_s)

    def close(self, *, timeout_s: float | None = None) -> int:
        """:meth:`flush`, then stop the committer thread; the batches still in flight (0: all published).

        A closed producer takes no more submits.

        Args:
            timeout_s: How long to wait for the flush at most (None: until every batch is published).

        Returns:
            The batches still in flight when it returned (0: all published).

        Raises:
            ProducerFailedError: A submitted batch failed (its future holds the error); see :meth:`submit`.
        """
        self._own()
        timeout_s = _check_timeout(timeout_s)
        queue = self._queue
        if queue is not None:
            queue.refuse_own_thread("close()")  # before anything closes: a done-callback cannot wait for itself
        self._closed = True  # a producer that never submitted takes no more commits either
        return 0 if queue is None else queue.close(timeout_s=timeout_s)

    def __enter__(self) -> Producer:
        return self

    def __reduce__(self) -> tuple[object, ...]:
        """Refused: a producer holds its committer thread and lock, and a copy in another process would be a second
        live writer of its id. The stream pickles (as its address): send it and the id instead."""
        raise ConfigError(
            f"a Producer cannot be pickled or sent to another process (producer {self.producer_id!r}): the stream pickles "
            f"as its address, so send the stream (or open it there) and call stream.producer({self.producer_id!r}) in "
            "that process, and use the id in one live process at a time"
        )

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._own()
        if exc is None:
            self.close()
            return
        self._closed = True  # already failing: closed all the same, without hiding that error behind a flush's
        if self._queue is not None:
            try:
                self._queue.close(timeout_s=None)
            except ProducerFailedError:
                pass

    def _own(self) -> None:
        """In a process forked from the one that made this producer: the parent's committer thread does not exist here
        (a batch queued on its queue would wait forever) and the parent's lock may have been held at the fork, so the
        child starts with a lock and, at its first submit, a committer of its own. Batches in flight at the fork are
        the parent's to publish; the child's next submit takes the table's next seq."""
        if self._pid != (pid := os.getpid()):
            self._pid, self._lock, self._queue = pid, threading.RLock(), None

    def _refuse_closed(self) -> None:
        if self._closed:
            raise ProducerFailedError(f"the producer is closed; open a new producer with the same id "
                                      f"({self.producer_id!r}): it resumes from the table's state")

    def _start_queue(self) -> None:
        with self._lock:  # after a commit made in this thread or another: the table's next seq includes it
            if self._queue is None:
                self._refuse_closed()
                self._next_submit = self._queue_next = self.next_seq
                self._queue = CommitQueue(publish=self._publish_submitted, max_in_flight=self.max_in_flight,
                                          name=f"lakestream-commit-{self.producer_id}",
                                          fix=f"open a new producer with the same id ({self.producer_id!r}): it resumes "
                                              "from the table's state, and each seq is published once")

    def _publish_submitted(self, job: Submitted[_Checked]) -> CommitResult:
        # A batch submitted with seq=None is published after the queue's last published batch, not as the seq it took
        # (job.seq): the same while the branch only grows, but once another engine rolled it back, the queue's batches
        # follow on from the rolled-back head (see _publish_checked), and an explicit seq the caller read from that
        # head (next_seq) is followed, not taken again.
        numbered = job.payload.seq is None
        with self._lock, config_errors(self._stream.io.properties, action=f"committing to {self._stream.name}",
                                       catalog=self._stream.table.catalog.name):
            result = self._commit(job.payload, seq=self._queue_next if numbered else job.seq, started=job.submitted_at)
            self._queue_next = result.seq + 1 if numbered else max(self._queue_next, result.seq + 1)
            return result

    def _check(self, shards: Sequence[pa.Table], *, seq: int | None, allow_gap: bool) -> _Checked:
        """The batch checked against the stream before anything is written: raises a BatchError when malformed."""
        stream = self._stream
        allow_gap = check_bool(allow_gap, what="allow_gap", error=SequenceError)  # "False" is truthy: no gap by mistake
        if seq is not None:  # before anything is written: True is not seq 1, and numpy integers become ints
            seq = check_int(seq, what="seq", error=SequenceError, minimum=0, maximum=MAX_SEQ,
                            hint="a producer's sequence numbers start at 0; pass seq=None to take the next one")
        shards, whole = check_batch(shards, world_size=stream.world_size, expected=stream.payload_arrow_schema)
        return _Checked(shards=shards, whole=whole, seq=seq, allow_gap=allow_gap)

    def _commit(self, checked: _Checked, *, seq: int | None, started: float) -> CommitResult:
        """Publish a checked batch (both :meth:`commit` and the committer thread of :meth:`submit` come here), and
        record it in the commit metrics (:mod:`lakestream_iceberg.connect.metrics`; nothing without the extra)."""
        try:
            result = self._publish_checked(checked, seq=seq, started=started)
        except Exception:
            observe_failed_commit(stream=self._stream.name, branch=self.branch, catalog=catalog_label(self._stream.table))
            raise
        observe_commit(result, stream=self._stream.name, branch=self.branch, staging=self._staging,
                       catalog=catalog_label(self._stream.table), table=self._stream.table.metadata.location)
        return result

    def _publish_checked(self, checked: _Checked, *, seq: int | None, started: float) -> CommitResult:
        """Publish a checked batch as ``seq`` (None: the table's next seq). A batch the producer numbered itself
        (``seq=None``, or submitted so) follows a rollback of the branch by another engine: once the head shows the
        id's next seq below the one it took, it is published as that one (a submit queue's later batches with it)."""
        while True:
            try:
                return self._publish_seq(checked, seq=seq, started=started)
            except _RolledBack as rolled:
                if seq is not None:
                    seq = rolled.next_seq

    def _rolled_back(self, seq: int) -> int | None:
        """The id's next seq on the head the last plan read, when it is below ``seq``: the branch was rolled back (its
        seqs from there on left it) after this producer numbered ``seq``; else None."""
        head = self._head
        try:
            following = head.next_seq(head.state(self._loop.metadata))
        except Exception:  # noqa: BLE001 - the refusal that was raised says it; nothing to renumber on
            return None
        return following if following < seq else None

    def _publish_seq(self, checked: _Checked, *, seq: int | None, started: float) -> CommitResult:
        allow_gap = checked.allow_gap and checked.seq is not None  # a batch it numbered never skips: it follows the head
        numbered_here = seq is None  # commit(seq=None): the table numbers it (a submitted batch has its seq already)
        failed = self._failed  # kept until a call succeeds, or fails after writing its batch
        retry = numbered_here and failed is not None and failed.same(checked.shards)
        if retry and failed is not None:
            # the call after a seq=None call that failed having written its batch, with that batch again: its retry,
            # of that seq, whether or not it was published since and whatever this producer's view shows
            seq = failed.seq
        elif numbered_here and failed is not None:
            # another batch: numbered on the head as it is now, so never taken for the failed call's, should that
            # have been published since the producer's view was read (it would have been answered duplicate=True)
            self._loop.mark_stale()
        try:
            opened = self._open(seq, allow_gap)
        except SequenceError as exc:  # a submitted batch's seq checked on a head read since a rollback (next_seq)
            if checked.seq is None and seq is not None and (following := self._rolled_back(seq)) is not None:
                raise _RolledBack(following) from exc
            raise
        if isinstance(opened, CommitResult):
            if checked.seq is None and seq is not None and not retry:
                if self._sent.returned(seq):  # its own batch that a rollback took off the branch is back
                    raise _RolledBack(self._head.next_seq(self._head.state(self._loop.metadata)))
                raise self._taken(opened)
            self._failed = None
            return replace(opened, latency_s=time.monotonic() - started)
        seq = opened
        try:
            staged = self._writer.write(producer=self.producer_id, seq=seq, shards=checked.shards, whole=checked.whole)
        except OSError as exc:
            if not transient(exc) or explain(exc, self._stream.io.properties) is not None:
                raise  # a missing bucket, refused credentials, an unreachable endpoint: config_errors names the setting
            error = CommitTimeoutError(  # throttled, failing: the object store, through lakestream's retries
                f"producer {self.producer_id!r}: writing the data files of seq {seq} to {self._stream.name} kept "
                f"failing for lakestream.io.retry-timeout-ms ({self._stream.config.io_retry_timeout_s:g}s; the last: "
                f"{one_line(exc)}); nothing was published. Retry the batch "
                "(the same seq, or seq=None) once the object store recovers, or raise lakestream.io.retry-timeout-ms"
            )
            error.why = f"failures of the object store (the last: {one_line(exc)})"
            raise error from exc
        try:
            intent = stage_batch(self._staging, self._head, staged, allow_gap) if self._stages() else None
            planner = BatchPlanner(head=self._head, staging=self._staging, policy=self._loop.policy, staged=staged,
                                   seq=seq, allow_gap=allow_gap, since=self._sent.made_at,
                                   earlier=self._sent.failed_tokens(seq), intent=intent)
            outcome = self._publish(planner)
        except SequenceError as exc:
            self._sent.failed(seq, staged.token)
            if checked.seq is None and (following := self._rolled_back(seq)) is not None:
                raise _RolledBack(following) from exc  # numbered on a head that a rollback took back: renumber
            raise
        except BaseException as exc:
            self._sent.failed(seq, staged.token)  # staged or sent: it may still be published (see OwnBatches)
            # its next call tells a retry of this batch from the next batch by comparing them
            self._failed = _FailedCall(seq, checked.shards) if numbered_here else None
            if isinstance(exc, (CommitTimeoutError, CommitOutcomeUnknownError)) and exc.seq is None:
                # The caller retries with this seq: one it did not number (seq=None) is known only from here, and
                # another producer object (after a restart) numbers a seq=None retry after the table's last seq,
                # which may be this very batch's.
                exc.seq = seq
                # seq=None through this producer object only for a batch it numbered: after an explicit seq it keeps
                # no failed batch, and numbers a seq=None one after the seq the table shows last
                how = (", or with seq=None through this producer object (its next call takes the same batch for the "
                       "retry); another producer object" if numbered_here else "; this or another producer object")
                exc.args = (f"producer {self.producer_id!r} seq {seq}: {exc}. Retry this batch with seq={seq}{how} "
                            "numbers a seq=None batch after the seq the table shows last, which may be this batch's, "
                            "and would publish it again", *exc.args[1:])
            elif checked.seq is None and (not isinstance(exc, LakestreamError) or isinstance(exc, ConfigError)
                                          or type(exc) is CommitError) and hasattr(exc, "add_note"):  # 3.11+
                # a refusal (ConfigError: a REST catalog's 403 to the commit or to reading the table back; CommitError:
                # a read-only catalog database) may end a call whose earlier attempt's outcome was unknown
                exc.add_note(f"lakestream: producer {self.producer_id!r} had written this batch as seq {seq}, and it "
                             f"may still be published: retry it with seq={seq}, or with seq=None through this producer "
                             "object (another one may number it after that seq, and publish it again)")
            raise
        published = outcome.result
        if outcome.landed:
            self._saw(outcome.metadata)  # the head it committed: a rollback it planned on is seen now
        # its batch, or one judged an earlier incarnation's: a replay is answered the same
        self._sent.answered(seq, None if published.duplicate else staged.token)
        if outcome.peeked:
            self._peeked_next = seq + 1
        intent = planner.intent  # a lost swap may have staged it since (BatchPlanner.escalate)
        if outcome.landed:
            self._staging.remove(published.intents + published.stale)
        elif intent is not None and not (outcome.carried_after is not None and not self._staging.exists(intent.path)):
            self._staging.remove([intent.path])
        if checked.seq is None and published.duplicate and (self._sent.returned(seq) or (
                failed is not None and not retry and seq == failed.seq)):
            # Its own batch of that seq, published before a rollback, is back (the planner's head), or the failed
            # call's batch was published while this one, another, was on its way: not this batch, which follows on
            # after it (on the head read again).
            self._loop.mark_stale()
            raise _RolledBack(self._head.next_seq(self._head.state(self._loop.metadata)))
        if published.step is not None:
            self._loop.policy.record_published(step=published.step, at=time.monotonic(),
                                               carried_after=None if outcome.landed else outcome.carried_after)
        self._failed = None
        return CommitResult(step=published.step, snapshot_id=published.snapshot_id, seq=seq, producer=self.producer_id,
                            attempts=outcome.sent if intent is not None else outcome.attempts,
                            duplicate=published.duplicate, rows=staged.rows, bytes=staged.size_bytes,
                            latency_s=time.monotonic() - started, carried=intent is not None and not outcome.landed,
                            group=published.group)

    def _open(self, seq: int | None, allow_gap: bool) -> int | CommitResult:
        """The seq this call publishes, checked against the head (no gap unless ``allow_gap``), or the result of a
        duplicate: ``seq`` is published already, and nothing is written."""
        loop, head = self._loop, self._head
        if loop.peeked and seq in (None, self._peeked_next):
            # The last commit was answered from a light read of the head (it was carried): the loaded metadata is
            # older than that head, which showed this id's next seq. Planning reads the head fully and checks it again.
            head.check_branch(loop.metadata)
            return self._peeked_next
        if (not loop.fresh and self._sent.first_seen is None and self._stages() and (light := head.opens(seq)) is not None
                and self._sent.follows(light[0] - 1)):
            # The loaded view is older than the head (a new producer starts from the stream's) and the batch will be
            # staged: a light read of the head shows ``seq`` as this id's next one, so it is neither a duplicate nor a
            # gap there, which is all a full read would check before writing. Whoever plans its publication reads the
            # head fully and checks it again; when another producer's commit carries it, the light read that answers
            # the call is the only read of the head (a fresh id of an elastic pool reloads no metadata). Alone, the
            # full read is made here as before: its own commit plans on it. When the id's seq before it is another
            # writer's, the full read below finds out whose. Only at the producer's first read: later, whether the
            # head still descends from the one it read last (a rollback) takes a full read (see _follows).
            self._sent.seen = light[1]
            return light[0]
        reused = loop.fresh  # the head as this producer last read or committed it, not read for this call
        state = head.state(loop.metadata if reused else head.refresh())
        last = head.last_seq(state)
        follows = self._follows(loop.metadata, last)
        if seq is None:
            seq = last + 1
        try:
            head.check_seq(seq, state, allow_gap)
        except SequenceError:
            if not reused:
                raise
            # A gap on the view as this producer last read or committed it, not on the head: its own batch of a call
            # that failed after staging may have been carried since, or another writer of the id (a live twin) may
            # have published past it. Refused on the head as it is now (a conflict, when the seq is another writer's),
            # never on an old view ("commit seq N first" for an N that is published).
            loop.mark_stale()
            return self._open(seq, allow_gap)
        known = after_gc(lambda: head.published(loop.metadata, seq), refresh=head.refresh)
        if known is None:
            if not follows and last < seq:  # the id's last seq is neither this producer's nor an earlier incarnation's
                assert self._sent.first_seen is not None
                first_seen = self._sent.first_seen
                # reads the batch's data file where its snapshot expired: listed by a head that GC may have swept since
                after_gc(lambda: head.check_follows(loop.metadata, last=last, seq=seq, first_seen=first_seen,
                                                    since=self._sent.made_at, earlier=self._sent.failed_tokens(last)),
                         refresh=head.refresh)
                self._sent.answered(last)  # its own from a failed call, or an earlier incarnation's that landed late
            return seq
        if reused:
            # A duplicate is answered without a commit, so nothing checked that view: another engine may have rolled
            # the branch back since, and the seq left it. Answer from the head.
            loop.mark_stale()
            return self._open(seq, allow_gap)
        if seq not in self._sent:  # published by another producer object: a replay unless another live writer's
            after_gc(lambda: head.check_replay(loop.metadata, known, seq=seq, since=self._sent.made_at,
                                               earlier=self._sent.failed_tokens(seq)), refresh=head.refresh)
            self._sent.answered(seq)
        return CommitResult(**known, seq=seq, producer=self.producer_id, attempts=0, duplicate=True)

    def _follows(self, metadata: TableMetadata, last: int) -> bool:
        """Whether this id's last seq ``last`` on the branch's head in ``metadata`` (a full read) may be followed
        without a check (:meth:`OwnBatches.follows`). When the head no longer descends from the one the producer last
        read or committed (another engine rolled the branch back), what it recorded about the seqs after the rollback
        point no longer says who published them: the fence follows the branch back first (:meth:`OwnBatches.rebase`)."""
        self._saw(metadata)
        return self._sent.follows(last)

    def _saw(self, metadata: TableMetadata) -> None:
        """Record the branch's head in ``metadata`` as the one the producer read last, after following a rollback
        since the one before (see :meth:`_follows`)."""
        sent = self._sent
        if sent.seen is not None and (kept := self._head.left(metadata, sent.seen)) is not None:
            sent.rebase(kept)
        if (head := metadata.snapshot_by_name(self.branch)) is not None:
            sent.seen = (head.snapshot_id, head.sequence_number or 0)

    def _taken(self, published: CommitResult) -> ProducerConflictError:
        """A batch submitted with ``seq=None`` was numbered by this producer (the seq after its last submitted one),
        but that seq is published already: not a replay of this batch, another live writer of the id published it
        (a second producer object, a process forked from this one, another process). Reporting it as a duplicate
        would drop the batch without a word."""
        where = "a step since collected" if published.step is None else f"step {published.step}"
        return ProducerConflictError(
            f"producer {self.producer_id!r} seq {published.seq} on branch {self.branch!r} was published as {where} "
            f"by another writer of the same id while this producer numbered its submitted batches "
            f"itself (seq=None); this batch is not a replay of that one and was not published. Another live producer "
            f"(another process, a forked child, a second Stream.producer({self.producer_id!r})) is using the id: give "
            f"every live producer its own id, then open a new producer with this id: it resumes from the table's state"
        )

    def _publish(self, planner: BatchPlanner) -> Outcome[Published]:
        """``CommitLoop.run`` of ``planner``; a staged batch that is not published is withdrawn from group commit."""
        try:
            return self._loop.run(planner)
        except CommitTimeoutError as exc:
            if planner.intent is None:
                raise
            self._staging.remove([planner.intent.path])
            raise CommitTimeoutError(
                f"{exc}. Its staged batch was withdrawn, but a group commit of another producer that had already read "
                "it may still publish it: retrying with the same seq is safe either way (it is reconciled, not duplicated)"
            ) from exc
        except CommitOutcomeUnknownError:
            raise  # the catalog stayed unreachable: a staged batch stays staged (the retry reconciles either way)
        except Exception:
            # Refused (a seq that would leave a gap after a rollback, the branch gone, a conflicting writer) or failed:
            # the caller is told this batch was not published, so no later group commit may publish it.
            if planner.intent is not None:
                self._staging.remove([planner.intent.path])
            raise

    def _contended(self) -> bool:
        """Whether other producers are committing to the stream (as far as the head's producer table tells)."""
        policy = self._loop.policy
        return policy.contenders >= 1.5 and not policy.quiet  # a mostly idle catalog: commit directly (dac.quiet)

    def _stages(self) -> bool:
        """Whether this commit stages its batch for group commit: others are committing and group commit is on."""
        config = self._stream.config
        return config.group_commit and config.group_max_batches >= 2 and self._contended()
