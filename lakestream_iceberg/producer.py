"""Producers publish global batches: write the shards once, then commit them as one snapshot, exactly once.

A producer is identified by a stable id (``"prep-0"``) and numbers its batches 0, 1, 2, ... (its *seq*). The table is
the only state: ``next_seq`` is read from the head snapshot's producer table, so a producer killed at any point and
restarted with the same id continues with no gap and no duplicate. See :mod:`lakestream_iceberg.commit` for the loop
and :mod:`lakestream_iceberg.dac` for its pacing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.snapshots import Operation, Snapshot, SnapshotSummaryCollector, Summary, update_snapshot_summaries
from pyiceberg.table.update import (
    AddSnapshotUpdate,
    AssertRefSnapshotId,
    AssertTableUUID,
    RemoveSnapshotsUpdate,
    SetSnapshotRefUpdate,
    TableUpdate,
)

from lakestream_iceberg.commit import CommitLoop, Done, Plan
from lakestream_iceberg.diagnose import config_errors
from lakestream_iceberg.errors import SequenceError
from lakestream_iceberg.expiry import ancestors, expirable
from lakestream_iceberg.layout import check_shards
from lakestream_iceberg.summary import KEY_ATTEMPTS, OP_APPEND, ProducerState, StreamState
from lakestream_iceberg.writer import StagedBatch, check_producer_id

if TYPE_CHECKING:
    from lakestream_iceberg.stream import Stream

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


class Producer:
    """Publishes global batches into one branch of a stream. Obtain one with :meth:`Stream.producer`.

    Example:
        >>> producer = stream.producer("prep-0")                          # doctest: +SKIP
        >>> result = producer.commit([shard_rank0, shard_rank1])           # doctest: +SKIP
        >>> result.step, result.seq, result.duplicate                      # doctest: +SKIP
        (1, 0, False)
    """

    def __init__(self, stream: Stream, producer_id: str, *, branch: str, loop: CommitLoop) -> None:
        self._stream = stream
        self.producer_id = check_producer_id(producer_id)
        self.branch = branch
        self._loop = loop

    @property
    def policy(self) -> object:
        """The producer's DAC state (see :class:`lakestream_iceberg.dac.CommitPolicy`)."""
        return self._loop.policy

    @property
    def next_seq(self) -> int:
        """The next sequence number this producer id has not published, read from the table."""
        metadata = self._loop.refresh(deadline=time.monotonic() + self._stream.config.commit_timeout_ms / 1000)
        return self._state(metadata).next_seq(self.producer_id)

    def _state(self, metadata: TableMetadata) -> StreamState:
        head = metadata.snapshot_by_name(self.branch)
        return StreamState.parse(head.summary.additional_properties if head is not None and head.summary else None)

    def commit(self, shards: Sequence[pa.Table], *, seq: int | None = None, allow_gap: bool = False) -> CommitResult:
        """Publish one global batch (one shard per rank) as the next step, exactly once.

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
            CommitTimeoutError: The commit budget ran out; nothing was published; retry with the same seq.
            CommitOutcomeUnknownError: The catalog stayed unreachable; retry with the same seq to reconcile.
        """
        with config_errors(self._stream.io.properties, action=f"committing to {self._stream.name}"):
            return self._commit(shards, seq=seq, allow_gap=allow_gap)

    def _commit(self, shards: Sequence[pa.Table], *, seq: int | None, allow_gap: bool) -> CommitResult:
        started = time.monotonic()
        stream = self._stream
        checked = check_shards(shards, world_size=stream.world_size, expected=stream.payload_arrow_schema)
        state = self._state(self._loop.table.metadata if self._loop_fresh() else self._refresh())
        if seq is None:
            seq = state.next_seq(self.producer_id)
        self._check_seq(seq, state, allow_gap)
        if (known := self._published(self._loop.table.metadata, seq)) is not None:
            return CommitResult(**known, seq=seq, producer=self.producer_id, attempts=0, duplicate=True,
                                latency_s=time.monotonic() - started)

        staged = stream.writer.write(producer=self.producer_id, seq=seq, shards=checked)

        def plan(metadata: TableMetadata, attempt: int) -> Plan[CommitResult] | Done[CommitResult]:
            current = self._state(metadata)
            if (found := self._published(metadata, seq)) is not None:
                return Done(CommitResult(**found, seq=seq, producer=self.producer_id, attempts=attempt, duplicate=True,
                                         rows=staged.rows, bytes=staged.size_bytes))
            self._check_seq(seq, current, allow_gap)
            return self._plan_append(metadata, current, staged, attempt)

        outcome = self._loop.run(plan)
        result = outcome.result
        return CommitResult(
            step=result.step,
            snapshot_id=result.snapshot_id,
            seq=seq,
            producer=self.producer_id,
            attempts=outcome.attempts,
            duplicate=result.duplicate,
            rows=staged.rows,
            bytes=staged.size_bytes,
            latency_s=time.monotonic() - started,
        )

    # -- internals ----------------------------------------------------------------------------------------------------
    def _loop_fresh(self) -> bool:
        return self._loop._fresh  # noqa: SLF001 - the loop and its producer share the table view

    def _refresh(self) -> TableMetadata:
        return self._loop.refresh(deadline=time.monotonic() + self._stream.config.commit_timeout_ms / 1000)

    def _check_seq(self, seq: int, state: StreamState, allow_gap: bool) -> None:
        if not isinstance(seq, int) or seq < 0:
            raise SequenceError(f"seq must be a non-negative integer, got {seq!r}")
        expected = state.next_seq(self.producer_id)
        if seq > expected and not allow_gap:
            raise SequenceError(
                f"producer {self.producer_id!r} on branch {self.branch!r} would skip from seq {expected} to {seq}; "
                f"commit seq {expected} first, or pass allow_gap=True to skip on purpose"
            )

    def _published(self, metadata: TableMetadata, seq: int) -> dict[str, int | None] | None:
        """Where (producer, seq) was published, or None when it was not."""
        known = self._state(metadata).producers.get(self.producer_id)
        if known is None or known.seq < seq:
            return None
        if known.seq == seq:
            return {"step": known.step, "snapshot_id": known.snapshot_id}
        head = metadata.snapshot_by_name(self.branch)
        for snapshot_id in ancestors(metadata, head.snapshot_id if head else None, len(metadata.snapshots)):
            snap = metadata.snapshot_by_id(snapshot_id)
            st = StreamState.parse(snap.summary.additional_properties if snap and snap.summary else None)
            if st.op == OP_APPEND and st.producer == self.producer_id and st.seq == seq:
                return {"step": st.step, "snapshot_id": snapshot_id}
        step = self._stream.index.step_of_file(metadata, self.branch, f"/data/{self.producer_id}/{seq:012d}-")
        return {"step": step, "snapshot_id": None}

    def _plan_append(self, metadata: TableMetadata, state: StreamState, staged: StagedBatch, attempt: int) -> Plan[CommitResult]:
        stream = self._stream
        parent = metadata.snapshot_by_name(self.branch)
        parent_id = parent.snapshot_id if parent is not None else None
        step = state.step + 1
        snapshot_id = metadata.new_snapshot_id()
        sequence_number = metadata.next_sequence_number()
        data_files = staged.data_files(step=step, spec_id=metadata.default_spec_id)

        planner = stream.manifest_planner(metadata)
        added = planner.added(snapshot_id=snapshot_id, sequence_number=sequence_number, data_files=data_files)
        manifests = planner.merged([added, *planner.parent_manifests(parent)], snapshot_id=snapshot_id, sequence_number=sequence_number)
        manifest_list = planner.write_list(manifests, snapshot_id=snapshot_id, parent_id=parent_id, sequence_number=sequence_number)

        producers = dict(state.producers)
        producers[self.producer_id] = ProducerState(staged.seq, step, snapshot_id)
        new_state = StreamState(op=OP_APPEND, step=step, producers=producers, collected_below=state.collected_below,
                                producer=self.producer_id, seq=staged.seq)
        collector = SnapshotSummaryCollector()
        spec, schema = metadata.spec(), metadata.schema()
        for data_file in data_files:
            collector.add_file(data_file, schema=schema, partition_spec=spec)
        summary = update_snapshot_summaries(
            Summary(Operation.APPEND, **collector.build(), **new_state.properties(**{KEY_ATTEMPTS: str(attempt)})),
            previous_summary=parent.summary if parent is not None else None,
        )
        snapshot = Snapshot(
            snapshot_id=snapshot_id,
            parent_snapshot_id=parent_id,
            sequence_number=sequence_number,
            manifest_list=manifest_list,
            summary=summary,
            schema_id=metadata.current_schema_id,
        )
        updates: list[TableUpdate] = [
            AddSnapshotUpdate(snapshot=snapshot),
            SetSnapshotRefUpdate(ref_name=self.branch, type=SnapshotRefType.BRANCH, snapshot_id=snapshot_id,
                                 parent_snapshot_id=parent_id),
        ]
        expired = expirable(metadata, retain_last=stream.config.retain_snapshots - 1)
        if expired:
            updates.append(RemoveSnapshotsUpdate(snapshot_ids=expired))
        requirements = (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref=self.branch, snapshot_id=parent_id))
        result = CommitResult(step=step, snapshot_id=snapshot_id, seq=staged.seq, producer=self.producer_id,
                              attempts=attempt, duplicate=False)
        return Plan(tuple(updates), requirements, result, planner.written)
