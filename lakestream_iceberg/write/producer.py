"""Producers publish global batches: write the shards once, then commit them as one snapshot, exactly once.

A producer is identified by a stable id (``"prep-0"``) and numbers its batches 0, 1, 2, ... (its *seq*). The table is
the only state: ``next_seq`` is read from the head snapshot's producer table, so a producer killed at any point and
restarted with the same id continues with no gap and no duplicate.

One call: check the batch, open its seq on the head (:class:`~lakestream_iceberg.write.head.ProducerHead`; a published
seq is a duplicate, nothing is written), write the data files, stage them when others are committing (group commit),
then hand one :class:`~lakestream_iceberg.write.planner.BatchPlanner` to the producer's
:class:`~lakestream_iceberg.write.commit.CommitLoop`, paced by :mod:`lakestream_iceberg.write.dac`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pyarrow as pa

from lakestream_iceberg.connect.diagnose import config_errors
from lakestream_iceberg.errors import CommitOutcomeUnknownError, CommitTimeoutError, SequenceError
from lakestream_iceberg.format.checks import check_int
from lakestream_iceberg.format.layout import check_batch
from lakestream_iceberg.format.table import after_gc
from lakestream_iceberg.write.commit import CommitLoop
from lakestream_iceberg.write.head import ProducerHead
from lakestream_iceberg.write.plan import Outcome
from lakestream_iceberg.write.planner import BatchPlanner, Published, stage_batch
from lakestream_iceberg.write.staging import StagingArea
from lakestream_iceberg.write.writer import BatchWriter, check_producer_id

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["CommitResult", "Producer"]


@dataclass(frozen=True, kw_only=True)
class CommitResult:
    """What one ``Producer.commit`` did.

    Attributes:
        step: The global step the batch was published as (``None`` only for a duplicate whose step was collected).
        snapshot_id: The Iceberg snapshot that published it (``None`` likewise).
        seq: The producer sequence number of the batch.
        attempts: Compare-and-swap attempts this call made (0 when the duplicate was known before writing).
        duplicate: True when (producer, seq) was already published; nothing new was published.
        rows: Samples in the batch, all ranks.
        bytes: Bytes of data files written for the batch.
        latency_s: Wall time of the call.
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
                 staging: StagingArea) -> None:
        self._stream = stream
        self._writer = writer
        self._staging = staging
        self.producer_id = check_producer_id(producer_id)
        self.branch = branch
        self._loop = loop
        self._head = ProducerHead(stream, producer_id=self.producer_id, branch=branch, loop=loop)
        self._peeked_next = 0  # this id's next seq, as the light read that answered its last commit showed it

    @property
    def policy(self) -> object:
        """The producer's DAC state (see :class:`lakestream_iceberg.write.dac.CommitPolicy`)."""
        return self._loop.policy

    @property
    def next_seq(self) -> int:
        """The next sequence number this producer id has not published, read from the table."""
        return self._head.next_seq(self._head.state(self._head.refresh()))

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
        """
        with config_errors(self._stream.io.properties, action=f"committing to {self._stream.name}"):
            return self._commit(shards, seq=seq, allow_gap=allow_gap)

    def _commit(self, shards: Sequence[pa.Table], *, seq: int | None, allow_gap: bool) -> CommitResult:
        started, began_at = time.monotonic(), time.time()
        stream = self._stream
        if seq is not None:  # before anything is written: True is not seq 1, and numpy integers become ints
            seq = check_int(seq, what="seq", error=SequenceError, minimum=0,
                            hint="a producer's sequence numbers start at 0; pass seq=None to take the next one")
        checked, whole = check_batch(shards, world_size=stream.world_size, expected=stream.payload_arrow_schema)
        opened = self._open(seq, allow_gap)
        if isinstance(opened, CommitResult):
            return replace(opened, latency_s=time.monotonic() - started)
        seq = opened
        staged = self._writer.write(producer=self.producer_id, seq=seq, shards=checked, whole=whole)
        intent = stage_batch(self._staging, self._head, staged, allow_gap) if self._stages() else None
        planner = BatchPlanner(head=self._head, staging=self._staging, policy=self._loop.policy, staged=staged, seq=seq,
                               allow_gap=allow_gap, began_at=began_at, intent=intent)
        outcome = self._publish(planner)
        published = outcome.result
        if outcome.peeked:
            self._peeked_next = seq + 1
        intent = planner.intent  # a lost swap may have staged it since (BatchPlanner.escalate)
        if outcome.landed:
            self._staging.remove(published.intents + published.stale)
        elif intent is not None and not (outcome.carried_after is not None and not self._staging.exists(intent.path)):
            self._staging.remove([intent.path])
        if published.step is not None:
            self._loop.policy.record_published(step=published.step, at=time.monotonic(),
                                               carried_after=None if outcome.landed else outcome.carried_after)
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
        if not loop.fresh and self._stages() and (opens := head.opens(seq)) is not None:
            # The loaded view is older than the head (a new producer starts from the stream's) and the batch will be
            # staged: a light read of the head shows ``seq`` as this id's next one, so it is neither a duplicate nor a
            # gap there, which is all a full read would check before writing. Whoever plans its publication reads the
            # head fully and checks it again; when another producer's commit carries it, the light read that answers
            # the call is the only read of the head (a fresh id of an elastic pool reloads no metadata). Alone, the
            # full read is made here as before: its own commit plans on it.
            return opens
        state = head.state(loop.metadata if loop.fresh else head.refresh())
        if seq is None:
            seq = head.next_seq(state)
        head.check_seq(seq, state, allow_gap)
        known = after_gc(lambda: head.published(loop.metadata, seq), refresh=head.refresh)
        if known is None:
            return seq
        return CommitResult(**known, seq=seq, producer=self.producer_id, attempts=0, duplicate=True)

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
