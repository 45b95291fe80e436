"""The planner of one ``Producer.commit`` call: what the commit loop drives to publish the caller's batch.

One :class:`BatchPlanner` is made per call, once the batch's data files are written. The loop
(:class:`~lakestream_iceberg.write.commit.CommitLoop`) drives it through the two small protocols of
:mod:`lakestream_iceberg.write.commit`:

* :class:`~lakestream_iceberg.write.commit.Planner`: :meth:`BatchPlanner.plan` turns a head into either ``Done`` (the
  batch is published already: carried by another producer's group commit, or an earlier attempt whose outcome was
  unknown landed after all) or a ``Plan``: one compare-and-swap publishing the batch and every eligible batch other
  producers staged, one snapshot each (:mod:`lakestream_iceberg.format.snapshots` builds them). :meth:`BatchPlanner.
  escalate` stages the batch when a producer that committed alone loses a swap.
* :class:`~lakestream_iceberg.write.commit.Carry`, while the batch is staged (group commit): whether its intent is
  gone, whether a head shows it published, its place in the queue of staged batches, and the final answer from a light
  read of the head (:meth:`BatchPlanner.answer`).

The planner holds the call's state: the batch, its seq, and its intent once staged (:attr:`BatchPlanner.intent`,
read by the producer when the loop returns).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pyiceberg.manifest import ManifestFile
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Operation, Snapshot
from pyiceberg.table.update import AssertRefSnapshotId, AssertTableUUID, RemoveSnapshotsUpdate, TableUpdate

from lakestream_iceberg.connect.diagnose import transient
from lakestream_iceberg.errors import CommitTimeoutError, CorruptStateError
from lakestream_iceberg.format.expiry import expirable, retention
from lakestream_iceberg.format.layout import PROP_GC_GRACE_MS, staged_max_age_s
from lakestream_iceberg.format.manifests import ManifestPlanner
from lakestream_iceberg.format.producers import compact
from lakestream_iceberg.format.snapshots import SnapshotBuilder
from lakestream_iceberg.format.summary import KEY_ATTEMPTS, MAX_SEQ, OP_APPEND, ProducerState, StreamState
from lakestream_iceberg.write.dac import CommitPolicy
from lakestream_iceberg.write.head import ProducerHead
from lakestream_iceberg.write.intent import Intent
from lakestream_iceberg.write.plan import Carry, Done, Peek, Plan
from lakestream_iceberg.write.staging import StagingArea
from lakestream_iceberg.write.writer import StagedBatch

log = logging.getLogger(__name__)

__all__ = ["STAGING_SCAN_S", "BatchPlanner", "Published", "stage_batch"]

STAGING_SCAN_S = 0.1  # how often a producer that believes it is alone looks for batches others staged


@dataclass(frozen=True, kw_only=True)
class Published:
    """A planned (or found) publication of the caller's batch.

    Attributes:
        step, snapshot_id: Where it is (or will be) published (None: collected, expired).
        group: Batches the publishing snapshot's commit published (1 for a lone commit).
        duplicate: Published before this call (an earlier call, or an earlier incarnation's staged batch).
        intents: The staged batches the commit publishes (removed once it lands).
        stale: Intents that can never be published (removed likewise).
    """

    step: int | None
    snapshot_id: int | None
    group: int
    duplicate: bool = False
    intents: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Batch:
    """A batch one commit may publish: this producer's own, or one another producer staged."""

    batch: StagedBatch
    allow_gap: bool
    staged_at: float  # unix seconds
    intent: str | None  # its intent's path (None: not staged)


def stage_batch(staging: StagingArea, head: ProducerHead, staged: StagedBatch, allow_gap: bool) -> Intent | None:
    """Stage ``staged`` for group commit (None when group commit is off, or when the intent cannot be staged now:
    the catalog's database or the store is unreachable. The batch is then committed directly, by its producer,
    whose commit has its own handling of an outage: retries, reconciliation, ``CommitOutcomeUnknownError``. An
    intent that did land although its staging failed is published at most once all the same: its seq is checked
    against the head like any other)."""
    config = head.stream.config
    if not config.group_commit or config.group_max_batches < 2:
        return None
    try:
        return staging.stage(branch=head.branch, batch=staged, allow_gap=allow_gap)
    except Exception as exc:
        if not transient(exc):
            raise
        log.warning("cannot stage batch seq %d of producer %r for group commit (%s); committing it directly",
                    staged.seq, head.producer_id, type(exc).__name__)
        return None


class BatchPlanner:
    """One commit call of one producer: plans the publication of ``staged`` as ``seq`` (see the module docstring).

    Args:
        head: The producer's reads of its branch's head.
        staging: Where batches are staged for group commit.
        policy: The producer's commit policy (its typical critical section is recorded in group commits).
        staged: The batch, its data files written.
        seq: Its producer sequence number, checked against the head on every plan.
        allow_gap: Whether ``seq`` may skip past the producer's next one.
        since: When the producer was made (unix seconds): a batch of this seq staged (or committed directly in a
            snapshot made) before is an earlier incarnation's; one staged or committed later is another live writer's.
        earlier: Tokens of this producer's own earlier calls of this seq that failed after writing: batches of them
            are its own, not another writer's.
        intent: The batch's intent when it is staged already (None: committed alone until :meth:`escalate`).
    """

    def __init__(self, *, head: ProducerHead, staging: StagingArea, policy: CommitPolicy, staged: StagedBatch, seq: int,
                 allow_gap: bool, since: float, earlier: frozenset[str] = frozenset(), intent: Intent | None) -> None:
        self._head = head
        self._staging = staging
        self._policy = policy
        self._staged = staged
        self._seq = seq
        self._allow_gap = allow_gap
        self._since = since
        self._earlier = earlier
        self._opened_max_age_s = head.stream.config.staged_max_age_s  # half the GC grace period, as opened
        self._max_age_s = self._opened_max_age_s  # and as the head planned on says (see plan)
        self.intent: Intent | None = None
        self.staged_at = 0.0
        self._own = _Batch(staged, allow_gap, time.time(), None)
        if intent is not None:
            self._staged_as(intent)

    # -- Planner: what the commit loop asks on every attempt ---------------------------------------------------------
    def plan(self, metadata: TableMetadata, attempt: int) -> Plan[Published] | Done[Published]:
        """``Done`` when ``metadata`` shows the batch published, else one compare-and-swap publishing it (with every
        eligible staged batch of others, group commit), planned on ``metadata``'s head of the branch.

        Raises:
            SequenceError: ``seq`` would leave a gap on this head (e.g. after a rollback).
            CommitTimeoutError: The batch's files are older than half the GC grace period (see :meth:`_check_age`).
            ProducerConflictError: Another live writer published this seq under the same producer id.
        """
        # another engine may have lowered the grace period since the stream was opened: GC opened since deletes what
        # is older than the new one, so no batch older than half of it (this call's own, or a staged one) is published
        self._max_age_s = min(self._opened_max_age_s, staged_max_age_s(metadata.properties))
        current = self._head.state(metadata)
        if (found := self._head.published(metadata, self._seq)) is not None:
            # Published meanwhile: carried by another producer's group commit, or our own commit whose outcome was
            # unknown landed after all (both: our token, so this call published it), or an earlier incarnation's
            # staged batch was carried (a duplicate). No token to compare: a staged batch counts as this call's (only
            # it could be carried under this id since), a lone one as published before (an earlier call's).
            mine = self._head.check_publisher(metadata, found, self._staged, since=self._since, earlier=self._earlier)
            duplicate = mine is False if self.intent is not None else mine is not True
            return Done(Published(**found, duplicate=duplicate))
        self._head.check_seq(self._seq, current, self._allow_gap)
        return self._plan_group(metadata, current, attempt)

    def carry(self) -> Carry[Published] | None:
        """This planner as the loop's :class:`Carry` while the batch is staged (None: committed alone)."""
        return self if self.intent is not None else None

    def escalate(self) -> Carry[Published] | None:
        """Lost a swap while committing alone: others are committing too, so stage the batch for them."""
        intent = stage_batch(self._staging, self._head, self._staged, self._allow_gap)
        if intent is None:
            return None
        self._staged_as(intent)
        return self

    # -- Carry: what the loop asks while it holds the staged batch ---------------------------------------------------
    def gone(self) -> bool:
        """Whether the batch's intent is gone: a commit published it and removed it."""
        return not self._exists()

    def published(self, metadata: TableMetadata) -> bool:
        return self._head.published(metadata, self._seq) is not None

    def queued(self) -> int:
        assert self.intent is not None
        return self._staging.queued(self._head.branch, self.intent.path, max_age_s=self._max_age_s)

    def ahead(self) -> list[tuple[str, int]] | None:
        """The batches staged before this one that a commit could publish: a dead incarnation's copy of this id's seq
        (or an older seq) is never published, so it does not count."""
        assert self.intent is not None
        listed = self._staging.ahead(self._head.branch, self.intent.path, max_age_s=self._max_age_s)
        producer_id = self._head.producer_id
        return None if listed is None else [(p, s) for p, s in listed if p != producer_id or s > self._seq]

    def answer(self, peek: Peek, attempt: int) -> Published | None:
        """Carried: where the head's producer table says this seq was published, if that snapshot holds this call's
        batch (its token); anything else (an earlier incarnation's batch, a compacted id, an expired snapshot) is
        decided by :meth:`plan` on a full read."""
        producer_id, seq = self._head.producer_id, self._seq
        known = peek.state.producers.get(producer_id)
        if known is None or known.seq != seq or known.snapshot_id is None:
            return None
        at = peek.states(known.snapshot_id)
        if at is None or at.token is None or at.token != self._staged.token or \
                (at.producer, at.seq, at.step) != (producer_id, seq, known.step):
            return None
        return Published(step=known.step, snapshot_id=known.snapshot_id, group=at.group)

    # -- internals ----------------------------------------------------------------------------------------------------
    def _staged_as(self, intent: Intent) -> None:
        self.intent = intent
        self.staged_at = time.monotonic()  # the loop's clock
        self._exists = self._staging.watch(intent.path)
        self._own = _Batch(self._staged, self._allow_gap, intent.staged_at, intent.path)

    def _check_age(self, batch: StagedBatch) -> None:
        """Refuse (:class:`CommitTimeoutError`) the batch once its files are older than half the GC grace period
        (``StreamConfig.staged_max_age_s``): the same bound as other producers' staged batches."""
        age = batch.age_s(time.time(), time.monotonic()) or 0.0  # the larger of the two clocks' (StagedBatch.age_s)
        if age > self._max_age_s:
            raise CommitTimeoutError(
                f"batch seq {batch.seq} of producer {self._head.producer_id!r} was written {age:.1f}s ago, longer than "
                f"half of {PROP_GC_GRACE_MS} ({self._max_age_s:.1f}s): GC may already have deleted its files, so it is "
                "not published. Retry the same call (same seq): the retry writes the files again"
            )

    def _eligible(self, state: StreamState) -> tuple[list[_Batch], list[str]]:
        """Other producers' staged batches this commit may publish on top of ``state`` (oldest first, capped), and
        intents that can never be published (their seq is already published, or superseded by this call's)."""
        stream, own = self._head.stream, self._own
        if not stream.config.group_commit:
            return [], []
        stale: list[str] = []
        newest: dict[str, Intent] = {}
        # A producer that committed alone lists the staging folder at most every STAGING_SCAN_S: producers that lost to
        # it have staged their batches there, and it publishes them with its own (then they are in the table and
        # everybody uses group commit). With contention, every plan lists it.
        every = 0.0 if own.intent is not None else STAGING_SCAN_S
        for intent in self._staging.pending(self._head.branch, max_age_s=self._max_age_s, every_s=every):
            batch = intent.batch
            if batch.producer == self._head.producer_id:
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

    def _plan_group(self, metadata: TableMetadata, state: StreamState, attempt: int) -> Plan[Published]:
        """One compare-and-swap publishing this call's batch and (group commit) every eligible staged batch, one
        snapshot each, oldest staged first. The batch is refused once its files are too old (:meth:`_check_age`):
        GC deletes unreferenced files older than the grace period, and this commit may take up to the commit timeout.
        """
        self._check_age(self._own.batch)
        others, stale = self._eligible(state)
        batches = sorted([self._own, *others], key=lambda b: b.staged_at)
        size = len(batches)
        if state.step > MAX_SEQ - size:  # a step is an Iceberg long (the _step partition value): it could not be written
            raise CorruptStateError(
                f"branch {self._head.branch!r} of stream {self._head.stream.name} has head step {state.step}: the next "
                f"step would not fit a 64-bit Iceberg long, and lakestream never counts that far. The head's summary "
                "was written by another tool or corrupted: point the branch back to the last good snapshot (e.g. "
                "pyiceberg's table.manage_snapshots().rollback_to_snapshot(ID).commit()); nothing was published"
            )
        parent = metadata.snapshot_by_name(self._head.branch)
        base_id = parent.snapshot_id if parent is not None else None
        group = _GroupCommit(self._head, metadata, state, parent, size=size, attempt=attempt,
                             critical_ms=self._policy.critical_section_s * 1000 if size > 1 else None)
        step = snapshot_id = 0
        # on object storage the group's manifests and lists are written concurrently (waited for by the swap)
        with group.planner.concurrent_writes():
            for i, item in enumerate(batches):
                snapshot = group.add(item, step=state.step + 1 + i, carried=item is not self._own and item.intent is not None)
                if item is self._own:
                    step, snapshot_id = state.step + 1 + i, snapshot.snapshot_id
        # counted on the parent: the group's snapshots join what this branch keeps (other branches keep their window)
        expired = expirable(metadata, **retention(metadata), fewer={self._head.branch: size})
        updates: list[TableUpdate] = group.builder.updates
        if expired:
            updates.append(RemoveSnapshotsUpdate(snapshot_ids=expired))
        requirements = (AssertTableUUID(uuid=metadata.table_uuid),
                        AssertRefSnapshotId(ref=self._head.branch, snapshot_id=base_id))
        published = Published(step=step, snapshot_id=snapshot_id, group=size,
                              intents=[b.intent for b in batches if b.intent is not None], stale=stale)
        # on object storage the manifests and lists may still be in flight: the swap waits for them right after it
        # wrote metadata.json (both writes overlap), before the catalog's update
        return Plan(tuple(updates), requirements, published, group.planner.written, group.planner.settle,
                    ready=group.planner.wait_written)


class _GroupCommit:
    """The snapshots of one planned compare-and-swap, added one batch at a time on top of each other: each inner
    snapshot's batch gets its own manifest on top of the earlier ones; the group's head gets one manifest for the whole
    group (alone: just its batch), merged with the parent's, and the producer table with idle producers compacted."""

    def __init__(self, head: ProducerHead, metadata: TableMetadata, state: StreamState, parent: Snapshot | None, *,
                 size: int, attempt: int, critical_ms: float | None) -> None:
        self._stream, self._committer, self._branch = head.stream, head.producer_id, head.branch
        self._metadata, self._state, self._parent = metadata, state, parent
        self._group, self._attempt, self._added, self._critical_ms = size, attempt, 0, critical_ms
        self.builder = SnapshotBuilder(metadata)
        self.planner: ManifestPlanner = self._stream.manifest_planner(metadata, publishing=True)
        self._manifests = self.planner.parent_manifests(parent)
        self._own_manifests: list[ManifestFile] = []  # this group's manifests so far, one per batch, newest first
        self._producers = dict(state.producers)

    def add(self, item: _Batch, *, step: int, carried: bool) -> Snapshot:
        """The snapshot publishing ``item`` as ``step`` on top of the previous one (the parent for the first)."""
        planner, staged, metadata = self.planner, item.batch, self._metadata
        last = self._added == self._group - 1
        self._added += 1
        snapshot_id, sequence_number = self.builder.next_ids()
        data_files = staged.data_files(step=step, spec_id=metadata.default_spec_id)
        if not last:
            added = planner.added(snapshot_id=snapshot_id, sequence_number=sequence_number, data_files=data_files,
                                  inner=True)
            self._own_manifests.insert(0, added)
            listed = [*self._own_manifests, *self._manifests]
        else:
            added = planner.group(earlier=self._own_manifests, snapshot_id=snapshot_id, sequence_number=sequence_number,
                                  data_files=data_files) if self._own_manifests else \
                planner.added(snapshot_id=snapshot_id, sequence_number=sequence_number, data_files=data_files)
            listed = planner.merged([added, *self._manifests], snapshot_id=snapshot_id, sequence_number=sequence_number)
        parent = self._parent
        manifest_list = planner.write_list(listed, snapshot_id=snapshot_id,
                                           parent_id=parent.snapshot_id if parent is not None else None,
                                           sequence_number=sequence_number, inner=not last)
        new_state = self._state_after(item, step=step, snapshot_id=snapshot_id, last=last, carried=carried)
        snapshot = self.builder.snapshot(snapshot_id=snapshot_id, sequence_number=sequence_number, parent=parent,
                                         manifest_list=manifest_list, operation=Operation.APPEND, added=data_files,
                                         properties=new_state.properties(**{KEY_ATTEMPTS: str(self._attempt)}))
        self.builder.add(snapshot, branch=self._branch)
        self._parent = snapshot
        return snapshot

    def _state_after(self, item: _Batch, *, step: int, snapshot_id: int, last: bool, carried: bool) -> StreamState:
        """The stream state the snapshot publishing ``item`` records."""
        staged, producers = item.batch, self._producers
        previous = producers.get(staged.producer)  # active: keeps its first step; else it (re)enters now
        first = step if previous is None else (previous.step if previous.first is None else previous.first)
        producers[staged.producer] = ProducerState(staged.seq, step, snapshot_id, first)
        files = self._state.producer_files
        if last:  # the head this commit leaves: idle producers compacted out of the summary
            compacted = compact(self._stream.io, self._metadata.location, step=step, active=producers, files=files)
            self._producers, files = compacted.active, compacted.files
            self.planner.written.extend(compacted.written)
        return StreamState(op=OP_APPEND, step=step, producers=dict(self._producers),
                           collected_below=self._state.collected_below, producer=staged.producer, seq=staged.seq,
                           group=self._group, committer=self._committer, group_commit_ms=self._critical_ms,
                           producer_files=files, token=staged.token or None,
                           staged_at_ms=int(item.staged_at * 1000) if carried else None,
                           sent_at_ms=None if carried else int(item.staged_at * 1000), timeline=self._state.timeline)
