"""Producers publish global batches: write the shards once, then commit them as one snapshot, exactly once.

A producer is identified by a stable id (``"prep-0"``) and numbers its batches 0, 1, 2, ... (its *seq*). The table is
the only state: ``next_seq`` is read from the head snapshot's producer table, so a producer killed at any point and
restarted with the same id continues with no gap and no duplicate. See :mod:`lakestream_iceberg.write.commit` for the loop
and :mod:`lakestream_iceberg.write.dac` for its pacing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
from pyiceberg.manifest import ManifestFile
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Operation
from pyiceberg.table.update import (
    AssertRefSnapshotId,
    AssertTableUUID,
    RemoveSnapshotsUpdate,
    TableUpdate,
)

from lakestream_iceberg.connect.diagnose import config_errors, transient
from lakestream_iceberg.errors import (
    CommitError,
    CommitOutcomeUnknownError,
    CommitTimeoutError,
    ForeignSnapshotError,
    SequenceError,
)
from lakestream_iceberg.format.checks import check_branch, check_int
from lakestream_iceberg.format.expiry import expirable, retention
from lakestream_iceberg.format.layout import PROP_GC_GRACE_MS, check_batch
from lakestream_iceberg.format.producers import compact
from lakestream_iceberg.format.snapshots import SnapshotBuilder
from lakestream_iceberg.format.summary import KEY_ATTEMPTS, OP_APPEND, ProducerState, StreamState
from lakestream_iceberg.format.table import after_gc
from lakestream_iceberg.write.commit import Carry, CommitLoop, Done, Peek, Plan
from lakestream_iceberg.write.intent import Intent
from lakestream_iceberg.write.reconcile import Found, check_publisher, find_published
from lakestream_iceberg.write.staging import StagingArea
from lakestream_iceberg.write.writer import BatchWriter, StagedBatch, check_producer_id

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["CommitResult", "Producer"]

STAGING_SCAN_S = 0.1  # how often a producer that believes it is alone looks for batches others staged


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
        self._peeked_next = 0  # this id's next seq, as the light read that answered its last commit showed it

    @property
    def policy(self) -> object:
        """The producer's DAC state (see :class:`lakestream_iceberg.write.dac.CommitPolicy`)."""
        return self._loop.policy

    @property
    def next_seq(self) -> int:
        """The next sequence number this producer id has not published, read from the table."""
        metadata = self._loop.refresh(deadline=time.monotonic() + self._stream.config.commit_timeout_ms / 1000)
        return self._state(metadata).next_seq(self._stream.io, self.producer_id)

    def _check_branch(self, metadata: TableMetadata) -> None:
        check_branch(metadata, self.branch, stream=self._stream.name, error=CommitError,
                     doing=f"producer {self.producer_id!r} cannot commit to")  # deleted or re-tagged since: never a tag

    def _state(self, metadata: TableMetadata) -> StreamState:
        self._check_branch(metadata)
        try:
            return self._stream.branch_state(branch=self.branch, metadata=metadata)
        except ForeignSnapshotError:
            self._loop.mark_stale()  # the next call reads the head again: it may have been repaired meanwhile
            raise

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
        if self._loop.peeked and seq in (None, self._peeked_next):
            # The last commit was answered from a light read of the head (it was carried): the loaded metadata is
            # older than that head, which showed this id's next seq. Planning reads the head fully and checks it again.
            self._check_branch(self._loop.table.metadata)
            seq = self._peeked_next
        elif not self._loop_fresh() and self._stages() and (opens := self._head_opens(seq)) is not None:
            # The loaded view is older than the head (a new producer starts from the stream's) and the batch will be
            # staged: a light read of the head shows ``seq`` as this id's next one, so it is neither a duplicate nor a
            # gap there, which is all a full read would check before writing. Whoever plans its publication reads the
            # head fully and checks it again; when another producer's commit carries it, the light read that answers
            # the call is the only read of the head (a fresh id of an elastic pool reloads no metadata). Alone, the
            # full read is made here as before: its own commit plans on it.
            seq = opens
        else:
            state = self._state(self._loop.table.metadata if self._loop_fresh() else self._refresh())
            if seq is None:
                seq = state.next_seq(self._stream.io, self.producer_id)
            self._check_seq(seq, state, allow_gap)
            known = after_gc(lambda: self._published(self._loop.table.metadata, seq), refresh=self._refresh)
            if known is not None:
                return CommitResult(**known, seq=seq, producer=self.producer_id, attempts=0, duplicate=True,
                                    latency_s=time.monotonic() - started)

        staged = self._writer.write(producer=self.producer_id, seq=seq, shards=checked, whole=whole)
        intent = self._stage(staged, allow_gap) if self._stages() else None
        # ``own`` changes once: when a producer that committed alone loses a swap, it stages the batch (escalate)
        own = [_Batch(staged, allow_gap, intent.staged_at if intent else time.time(), intent.path if intent else None)]

        def plan(metadata: TableMetadata, attempt: int) -> Plan[_Published] | Done[_Published]:
            current = self._state(metadata)
            if (found := self._published(metadata, seq)) is not None:
                # Published meanwhile: carried by another producer's group commit, or our own commit whose outcome
                # was unknown landed after all (both: our token), or an earlier incarnation's staged batch was carried.
                mine = self._check_publisher(metadata, found, staged, since=began_at)
                return Done(_Published(CommitResult(**found, seq=seq, producer=self.producer_id, attempts=attempt,
                                                    duplicate=own[0].intent is None or not mine, rows=staged.rows,
                                                    bytes=staged.size_bytes)))
            self._check_seq(seq, current, allow_gap)
            return self._plan_group(metadata, current, own[0], attempt)

        def answer(peek: Peek, attempt: int) -> _Published | None:
            """Carried: where the head's producer table says this seq was published, if that snapshot holds this
            call's batch (its token); anything else (an earlier incarnation's batch, a compacted id, an expired
            snapshot) is decided by the planner on a full read."""
            known = peek.state.producers.get(self.producer_id)
            if known is None or known.seq != seq or known.snapshot_id is None:
                return None
            at = peek.states(known.snapshot_id)
            if at is None or at.token is None or at.token != staged.token or (at.producer, at.seq, at.step) != \
                    (self.producer_id, seq, known.step):
                return None
            return _Published(CommitResult(step=known.step, snapshot_id=known.snapshot_id, seq=seq,
                                           producer=self.producer_id, attempts=attempt, duplicate=False,
                                           rows=staged.rows, bytes=staged.size_bytes))

        def carry_for(staged_intent: Intent) -> Carry:
            staging = self._staging
            exists = staging.watch(staged_intent.path)
            max_age_s = self._stream.config.gc_grace_ms / 2000

            def ahead() -> list[tuple[str, int]] | None:
                """The batches staged before this one that a commit could publish: a dead incarnation's copy of this
                id's seq (or an older seq) is never published, so it does not count."""
                listed = staging.ahead(self.branch, staged_intent.path, max_age_s=max_age_s)
                return None if listed is None else [(p, s) for p, s in listed if p != self.producer_id or s > seq]

            return Carry(staged_at=time.monotonic(), gone=lambda: not exists(),
                         published=lambda metadata: self._published(metadata, seq) is not None,
                         queued=lambda: staging.queued(self.branch, staged_intent.path, max_age_s=max_age_s),
                         answer=answer, ahead=ahead)

        def escalate() -> Carry | None:
            """Lost a swap while committing alone: others are committing too, so stage the batch for them."""
            nonlocal intent
            intent = self._stage(staged, allow_gap)
            if intent is None:
                return None
            own[0] = _Batch(staged, allow_gap, intent.staged_at, intent.path)
            return carry_for(intent)

        try:
            outcome = self._loop.run(plan, carry=carry_for(intent) if intent is not None else None, escalate=escalate)
        except CommitTimeoutError as exc:
            if intent is None:
                raise
            self._staging.remove([intent.path])
            raise CommitTimeoutError(
                f"{exc}. Its staged batch was withdrawn, but a group commit of another producer that had already read "
                "it may still publish it: retrying with the same seq is safe either way (it is reconciled, not duplicated)"
            ) from exc
        except CommitOutcomeUnknownError:
            raise  # the catalog stayed unreachable: a staged batch stays staged (the retry reconciles either way)
        except Exception:
            # Refused (a seq that would leave a gap after a rollback, the branch gone, a conflicting writer) or failed:
            # the caller is told this batch was not published, so no later group commit may publish it.
            if intent is not None:
                self._staging.remove([intent.path])
            raise
        published = outcome.result
        if outcome.peeked:
            self._peeked_next = seq + 1
        if outcome.landed:
            self._staging.remove(published.intents + published.stale)
        elif intent is not None and not (outcome.carried_after is not None and not self._staging.exists(intent.path)):
            self._staging.remove([intent.path])
        result = published.result
        if result.step is not None:
            self._loop.policy.record_published(step=result.step, at=time.monotonic(),
                                               carried_after=None if outcome.landed else outcome.carried_after)
        return CommitResult(
            step=result.step,
            snapshot_id=result.snapshot_id,
            seq=seq,
            producer=self.producer_id,
            attempts=outcome.sent if intent is not None else outcome.attempts,
            duplicate=result.duplicate,
            rows=staged.rows,
            bytes=staged.size_bytes,
            latency_s=time.monotonic() - started,
            carried=intent is not None and not outcome.landed,
        )

    def _contended(self) -> bool:
        """Whether other producers are committing to the stream (as far as the head's producer table tells)."""
        policy = self._loop.policy
        return policy.contenders >= 1.5 and not policy.quiet  # a mostly idle catalog: commit directly (dac.quiet)

    def _stages(self) -> bool:
        """Whether this commit stages its batch for group commit: others are committing and group commit is on."""
        config = self._stream.config
        return config.group_commit and config.group_max_batches >= 2 and self._contended()

    def _stage(self, staged: StagedBatch, allow_gap: bool) -> Intent | None:
        """Stage the batch for group commit (None when group commit is off, or when the intent cannot be staged now:
        the catalog's database or the store is unreachable. The batch is then committed directly, by this producer,
        whose commit has its own handling of an outage: retries, reconciliation, ``CommitOutcomeUnknownError``. An
        intent that did land although its staging failed is published at most once all the same: its seq is checked
        against the head like any other)."""
        config = self._stream.config
        if not config.group_commit or config.group_max_batches < 2:
            return None
        try:
            return self._staging.stage(branch=self.branch, batch=staged, allow_gap=allow_gap)
        except Exception as exc:
            if not transient(exc):
                raise
            log.warning("cannot stage batch seq %d of producer %r for group commit (%s); committing it directly",
                        staged.seq, self.producer_id, type(exc).__name__)
            return None

    # -- internals ----------------------------------------------------------------------------------------------------
    def _loop_fresh(self) -> bool:
        return self._loop._fresh  # noqa: SLF001 - the loop and its producer share the table view

    def _refresh(self) -> TableMetadata:
        return self._loop.refresh(deadline=time.monotonic() + self._stream.config.commit_timeout_ms / 1000)

    def _head_opens(self, seq: int | None) -> int | None:
        """This id's next seq as a light read of the head shows it (:meth:`CommitLoop.peek`), when that is ``seq`` or
        ``seq`` is None; else (a duplicate, a gap, a head the light read cannot tell) None: read the head fully."""
        self._check_branch(self._loop.table.metadata)  # a branch that is no branch is refused before anything is written
        peek = self._loop.peek()
        if peek is None:
            return None
        try:
            expected = peek.state.next_seq(self._stream.io, self.producer_id)
        except Exception:  # noqa: BLE001 - e.g. a producer-state file unreadable now: the full read retries or reports
            return None
        return expected if seq in (None, expected) else None

    def _check_seq(self, seq: int, state: StreamState, allow_gap: bool) -> None:
        expected = state.next_seq(self._stream.io, self.producer_id)
        if seq > expected and not allow_gap:
            raise SequenceError(
                f"producer {self.producer_id!r} on branch {self.branch!r} would skip from seq {expected} to {seq}; "
                f"commit seq {expected} first, or pass allow_gap=True to skip on purpose"
            )

    def _check_publisher(self, metadata: TableMetadata, found: Found, staged: StagedBatch, *, since: float) -> bool:
        return check_publisher(self._stream.io, metadata, found, staged, producer_id=self.producer_id,
                               branch=self.branch, since=since)

    def _published(self, metadata: TableMetadata, seq: int) -> Found | None:
        return find_published(self._stream, metadata, self._state(metadata), producer_id=self.producer_id,
                              branch=self.branch, seq=seq)

    def _check_age(self, batch: StagedBatch) -> None:
        max_age_s = self._stream.config.gc_grace_ms / 2000
        age = time.time() - batch.written_at if batch.written_at is not None else 0.0
        if age > max_age_s:
            raise CommitTimeoutError(
                f"batch seq {batch.seq} of producer {self.producer_id!r} was written {age:.1f}s ago, longer than half of "
                f"{PROP_GC_GRACE_MS} ({max_age_s:.1f}s): GC may already have deleted its files, so it is not "
                "published. Retry the same call (same seq): the retry writes the files again"
            )

    def _eligible(self, state: StreamState, own: _Batch) -> tuple[list[_Batch], list[str]]:
        """Other producers' staged batches this commit may publish on top of ``state`` (oldest first, capped), and
        intents that can never be published (their seq is already published, or superseded by ``own``)."""
        stream = self._stream
        stale: list[str] = []
        newest: dict[str, Intent] = {}
        if not stream.config.group_commit:
            return [], []
        # A producer that committed alone lists the staging folder at most every STAGING_SCAN_S: producers that lost to
        # it have staged their batches there, and it publishes them with its own (then they are in the table and
        # everybody uses group commit). With contention, every plan lists it.
        every = 0.0 if own.intent is not None else STAGING_SCAN_S
        for intent in self._staging.pending(self.branch, max_age_s=stream.config.gc_grace_ms / 2000, every_s=every):
            batch = intent.batch
            if batch.producer == self.producer_id:
                if intent.path != own.intent and batch.seq <= own.batch.seq:
                    stale.append(intent.path)  # a dead incarnation's: already published, or the same seq as ours
                continue
            expected = state.next_seq(stream.io, batch.producer)
            if batch.seq < expected:
                stale.append(intent.path)
            elif batch.seq == expected:  # a gap (allow_gap) is published only by its owner's own commit
                known = newest.get(batch.producer)  # one per producer: the newest copy of its next seq
                if (known is None or intent.staged_since > known.staged_since) and self._staging.verified(intent):
                    newest[batch.producer] = intent
        others = sorted(newest.values(), key=lambda i: i.staged_since)[: max(0, stream.config.group_max_batches - 1)]
        return [_Batch(i.batch, i.allow_gap, i.staged_since, i.path) for i in others], stale

    def _plan_group(self, metadata: TableMetadata, state: StreamState, own: _Batch, attempt: int) -> Plan[_Published]:
        """One compare-and-swap publishing ``own`` and (group commit) every eligible staged batch, one snapshot each.

        ``own`` is refused (:class:`CommitTimeoutError`) once its files are older than half the GC grace period, the
        same bound as other producers' staged batches: GC deletes unreferenced files older than the grace period, and
        this commit may take up to the commit timeout (at most half the grace period, see ``StreamConfig``).
        """
        stream = self._stream
        self._check_age(own.batch)
        others, stale = self._eligible(state, own)
        batches = sorted([own, *others], key=lambda b: b.staged_at)
        group = len(batches)
        parent = metadata.snapshot_by_name(self.branch)
        base_id = parent.snapshot_id if parent is not None else None
        builder = SnapshotBuilder(metadata)
        planner = stream.manifest_planner(metadata)
        manifests = planner.parent_manifests(parent)
        own_manifests: list[ManifestFile] = []  # this group's manifests so far, one per batch, newest first
        producers = dict(state.producers)
        result: CommitResult | None = None
        # on object storage the group's manifests and lists are written concurrently (waited for by the swap)
        with planner.concurrent_writes():
            for i, item in enumerate(batches):
                staged = item.batch
                step = state.step + 1 + i
                snapshot_id, sequence_number = builder.next_ids()
                data_files = staged.data_files(step=step, spec_id=metadata.default_spec_id)
                if i < group - 1:  # a snapshot inside the group: its batch's manifest on top of the earlier ones
                    added = planner.added(snapshot_id=snapshot_id, sequence_number=sequence_number, data_files=data_files,
                                          inner=True)
                    own_manifests.insert(0, added)
                    listed = [*own_manifests, *manifests]
                else:  # the group's head: one manifest for the whole group (alone: just its batch), then merges
                    added = planner.group(earlier=own_manifests, snapshot_id=snapshot_id, sequence_number=sequence_number,
                                          data_files=data_files) if own_manifests else \
                        planner.added(snapshot_id=snapshot_id, sequence_number=sequence_number, data_files=data_files)
                    listed = planner.merged([added, *manifests], snapshot_id=snapshot_id, sequence_number=sequence_number)
                manifest_list = planner.write_list(listed, snapshot_id=snapshot_id,
                                                   parent_id=parent.snapshot_id if parent is not None else None,
                                                   sequence_number=sequence_number, inner=i < group - 1)
                previous = producers.get(staged.producer)  # active: keeps its first step; else it (re)enters now
                first = step if previous is None else (previous.step if previous.first is None else previous.first)
                producers[staged.producer] = ProducerState(staged.seq, step, snapshot_id, first)
                files = state.producer_files
                if i == group - 1:  # the head this commit leaves: idle producers compacted out of the summary
                    compacted = compact(stream.io, metadata.location, step=step, active=producers, files=files)
                    producers, files = compacted.active, compacted.files
                    planner.written.extend(compacted.written)
                carried = item is not own and item.intent is not None
                new_state = StreamState(op=OP_APPEND, step=step, producers=dict(producers),
                                        collected_below=state.collected_below, producer=staged.producer, seq=staged.seq,
                                        group=group, committer=self.producer_id,
                                        group_commit_ms=self._loop.policy.critical_section_s * 1000 if group > 1 else None,
                                        producer_files=files, token=staged.token or None,
                                        staged_at_ms=int(item.staged_at * 1000) if carried else None)
                snapshot = builder.snapshot(snapshot_id=snapshot_id, sequence_number=sequence_number, parent=parent,
                                            manifest_list=manifest_list, operation=Operation.APPEND, added=data_files,
                                            properties=new_state.properties(**{KEY_ATTEMPTS: str(attempt)}))
                builder.add(snapshot, branch=self.branch)
                if item is own:
                    result = CommitResult(step=step, snapshot_id=snapshot_id, seq=staged.seq, producer=self.producer_id,
                                          attempts=attempt, duplicate=False)
                parent = snapshot
        # counted on the parent: the group's snapshots join what is kept
        kept = retention(metadata)
        expired = expirable(metadata, **{**kept, "retain_last": max(1, kept["retain_last"] - group),
                                         "retain_max": max(1, kept["retain_max"] - group)})
        updates: list[TableUpdate] = builder.updates
        if expired:
            updates.append(RemoveSnapshotsUpdate(snapshot_ids=expired))
        requirements = (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref=self.branch, snapshot_id=base_id))
        assert result is not None
        intents = [b.intent for b in batches if b.intent is not None]
        # on object storage the manifests and lists may still be in flight: the swap waits for them right after it
        # wrote metadata.json (both writes overlap), before the catalog's update
        return Plan(tuple(updates), requirements, _Published(result, intents, stale), planner.written, planner.settle,
                    ready=planner.wait_written)


@dataclass(frozen=True)
class _Batch:
    """A batch one commit may publish: this producer's own, or one another producer staged."""

    batch: StagedBatch
    allow_gap: bool
    staged_at: float  # unix seconds
    intent: str | None  # its intent's path (None: not staged)


@dataclass(frozen=True)
class _Published:
    """A planned (or found) publication of the caller's batch; ``intents`` are the staged batches the commit publishes
    (removed once it lands), ``stale`` intents that can never be published (removed likewise)."""

    result: CommitResult
    intents: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
