"""Bring a branch back after another engine changed a stream's data or expired its state.

A foreign snapshot (see :mod:`lakestream_iceberg.format.lineage`) stops every commit and read of the branch with
:class:`~lakestream_iceberg.errors.ForeignSnapshotError` in two cases, and ``Stream.repair()`` has a way back for each,
one compare-and-swap that asserts the head it was planned on (a producer or another engine committing meanwhile makes
it re-plan):

* **it changed data** (an append, a delete, an overwrite, ``rewrite_data_files``): the branch ref moves back to the
  nearest snapshot lakestream wrote below it (Iceberg's rollback). Every published step is in that snapshot's table
  state, so nothing published is lost; the foreign snapshots leave the branch, their files stay until expiry or
  lifecycle GC removes them;
* **it changed no data, but the snapshots below it that recorded the stream's state were expired** (Spark's
  ``rewrite_manifests`` then ``expire_snapshots(retain_last => 1)``): the state is read back from the newest earlier
  ``metadata.json`` in the table's metadata log that still lists that lineage, and a ``repair`` snapshot carrying it is
  committed on top of the foreign head (a re-base: the foreign snapshots changed no data, so the table state is the
  one that state describes). It publishes no step; producers go on at the next one, re-commits of published
  ``(producer, seq)`` pairs are duplicates. When no metadata file of the log holds the lineage any more, repair refuses
  and says what is left to do.

When the foreign snapshots are main's very first ones (another engine wrote into the stream before its first step was
published), there is nothing below them to roll back to and nothing was expired: repair removes main's ref, which
leaves the stream as it was created (no step published; the next commit publishes step 1). The foreign snapshots stay
in the metadata until expiry.

Metadata-only foreign snapshots on an intact lineage need no repair and are left where they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pyiceberg.serializers import FromInputFile
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import Operation, Snapshot
from pyiceberg.table.update import (
    AddSnapshotUpdate,
    AssertRefSnapshotId,
    AssertTableUUID,
    RemoveSnapshotRefUpdate,
    SetSnapshotRefUpdate,
)

from lakestream_iceberg.connect.integers import parse_int
from lakestream_iceberg.errors import ForeignSnapshotError, LifecycleError
from lakestream_iceberg.format.checkpoints import KEY_SOURCE_BRANCH
from lakestream_iceberg.format.lineage import Lineage, branch_state, describe, fork_on_main, is_lakestream, lineage
from lakestream_iceberg.format.snapshots import SnapshotBuilder, set_ref
from lakestream_iceberg.format.summary import KEY_CHECKPOINT, KEY_SOURCE_SNAPSHOT, OP_CHECKPOINT, OP_REPAIR, StreamState
from lakestream_iceberg.write.plan import Done, Plan

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["PlannedRepair", "RepairReport", "plan_repair"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RepairReport:
    """What :meth:`Stream.repair` found and did.

    Attributes:
        branch: The branch repaired.
        foreign: The foreign snapshots removed from the branch (rollback) or re-based on (newest first; empty: nothing
            to repair).
        rolled_back_to: The lakestream snapshot the branch points at now after a rollback (None: not rolled back).
        step: The branch's head step after the repair.
        dry_run: Only planned: nothing was committed.
        rebased_on: The foreign head a ``repair`` snapshot was committed on, carrying the state read back from the
            metadata log (None: not re-based).
        changes: What each foreign snapshot did, in ``foreign``'s order, from its summary (``append:
            added-data-files=1, added-records=4``): after a rollback, these changes have left the branch (their files
            stay until GC removes them).
        cleared: The foreign snapshots were main's first ones (written before any step was published), and main's ref
            was (or, in a dry run, would be) removed: the stream is as it was created, its next step is step 1.
    """

    branch: str
    foreign: tuple[int, ...]
    rolled_back_to: int | None
    step: int
    dry_run: bool
    rebased_on: int | None = None
    changes: tuple[str, ...] = ()
    cleared: bool = False

    @property
    def repaired(self) -> bool:
        """Whether this call changed the branch (rolled it back, re-based it or cleared it; never for a dry run)."""
        return (self.rolled_back_to is not None or self.rebased_on is not None or self.cleared) and not self.dry_run


@dataclass(frozen=True)
class PlannedRepair:
    """One attempt's swap of a repair: ``branch`` from ``head`` to ``target`` (a new ``repair`` snapshot when ``new``,
    an older snapshot of the branch otherwise, None when main's ref is removed), and its report."""

    head: int
    target: int | None
    new: bool
    report: RepairReport

    def landed(self, lineage: set[int]) -> bool:
        """Whether the branch's lineage (its head and every ancestor) shows this swap: a re-base's new snapshot is in
        it, or a rollback's target is while the head it moved away from is not (a removal of main's ref: see
        :func:`plan_repair`, which finds main without a ref, or made again by a commit since: then main no longer leads
        back to the head the removal moved it from)."""
        if self.target is None:
            return self.head not in lineage
        return self.target in lineage and (self.new or self.head not in lineage)


def _lineage(metadata: TableMetadata, snapshot_id: int) -> set[int]:
    """``snapshot_id`` and every ancestor the metadata still holds, along parent links."""
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    out: set[int] = set()
    current = by_id.get(snapshot_id)
    while current is not None and current.snapshot_id not in out:
        out.add(current.snapshot_id)
        current = by_id.get(current.parent_snapshot_id) if current.parent_snapshot_id is not None else None
    return out


def plan_repair(stream: StreamTable, metadata: TableMetadata, *, branch: str, dry_run: bool,
                planned: list[PlannedRepair] | None = None) -> Plan[RepairReport] | Done[RepairReport]:
    """The rollback of ``branch`` to its last lakestream snapshot, when a foreign snapshot above it changed data; the
    re-base of its state on the foreign head, when only the snapshots recording the state were expired.

    ``planned``: the swaps this call planned in earlier attempts (the function adds each one it plans). When the
    branch shows one of them, an attempt whose outcome was unknown (the reply lost) landed: ``Done`` with that
    attempt's report, not "nothing to repair".

    Raises:
        LifecycleError: ``branch`` is not a branch of the stream.
        ForeignSnapshotError: There is no lakestream snapshot to roll back to, or no state to re-base on (the message
            says what to do instead).
    """
    name = stream.name
    ref = metadata.refs.get(branch)
    if ref is None and branch == MAIN_BRANCH:  # nothing published yet: main gets its Iceberg ref with the first step
        removal = next((p for p in planned or () if p.target is None), None)
        if removal is not None:  # an attempt that removed main's ref landed (its reply was lost)
            return Done(removal.report)
        return Done(RepairReport(branch=branch, foreign=(), rolled_back_to=None, step=0, dry_run=dry_run))
    if ref is None or ref.snapshot_ref_type != SnapshotRefType.BRANCH:
        raise LifecycleError(f"stream {name} has no branch {branch!r} to repair; its branches: "
                             f"{sorted(n for n, r in metadata.refs.items() if r.snapshot_ref_type == SnapshotRefType.BRANCH)}")
    if planned:
        shown = _lineage(metadata, ref.snapshot_id)
        for earlier in planned:
            if earlier.landed(shown):
                return Done(earlier.report)
    head = metadata.snapshot_by_id(ref.snapshot_id)
    found = lineage(metadata, head)
    if found.changed is None and found.broken:
        assert head is not None  # lineage() reports a broken lineage only below a head it walked (None: Lineage(None))
        return _planned(_plan_rebase(stream, metadata, head, found, branch=branch, dry_run=dry_run), planned)
    if fork_on_main(found.base, branch):  # a foreign change on top of it too: main leaves the fork all the same
        assert found.base is not None and ref is not None
        return _planned(_plan_off_fork(stream, metadata, found, found.base, ref.snapshot_id, dry_run=dry_run), planned)
    if found.changed is None:  # nothing to roll back
        state = branch_state(metadata, head, stream=name, branch=branch)
        return Done(RepairReport(branch=branch, foreign=(), rolled_back_to=None, step=state.step, dry_run=dry_run))
    if (found.base is None and branch == MAIN_BRANCH and _on_an_empty_table(found.foreign[-1])
            and not _published_before(stream, metadata)):
        assert ref is not None
        cleared = RepairReport(branch=branch, foreign=tuple(s.snapshot_id for s in found.foreign), rolled_back_to=None,
                               step=0, dry_run=dry_run, changes=tuple(describe(s) for s in found.foreign), cleared=True)
        if dry_run:
            return Done(cleared)
        return _planned(Plan(
            (RemoveSnapshotRefUpdate(ref_name=branch),),
            (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref=branch, snapshot_id=ref.snapshot_id)),
            cleared,
            [],
        ), planned)
    if found.base is None:
        raise ForeignSnapshotError(
            f"branch {branch!r} of stream {name} cannot be repaired automatically: below its foreign snapshots "
            f"({', '.join(str(s.snapshot_id) for s in found.foreign)}), one of which changed data, no snapshot "
            "lakestream wrote is left (expired). Revert the foreign change with the engine that made it; repair can "
            "then re-base the stream's state",
            snapshot_id=found.foreign[-1].snapshot_id,
        )
    report = RepairReport(branch=branch, foreign=tuple(s.snapshot_id for s in found.foreign),
                          rolled_back_to=found.base.snapshot_id, step=StreamState.of(found.base).step, dry_run=dry_run,
                          changes=tuple(describe(s) for s in found.foreign))
    if dry_run:
        return Done(report)
    return _planned(Plan(
        (set_ref(branch, SnapshotRefType.BRANCH, found.base.snapshot_id, current=ref),),
        (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref=branch, snapshot_id=ref.snapshot_id)),
        report,
        [],
    ), planned)


def _on_an_empty_table(snapshot: Snapshot) -> bool:
    """Whether ``snapshot``, a root (no parent id), was written on a table state without data files: its summary's
    totals hold only the files it added, and it deleted none. Main then published no step before it, since every step
    adds data files (an empty shard too) and GC keeps the oldest retained checkpoint's step: a root whose parent id
    pyiceberg's expiry cleared below a published stream counts that parent's files in its totals. A summary without
    the counts: not known, False. Not enough alone: another engine's delete of every row leaves a table state without
    data files on a published stream too (the caller also asks that no snapshot of the metadata is lakestream's)."""
    if snapshot.parent_snapshot_id is not None or snapshot.summary is None:
        return False
    props = snapshot.summary.additional_properties
    total, added = parse_int(props.get("total-data-files")), parse_int(props.get("added-data-files", "0"))
    deleted = parse_int(props.get("deleted-data-files", "0"))
    return total is not None and total == added and deleted == 0


def _published_before(stream: StreamTable, metadata: TableMetadata) -> bool:
    """Whether the table holds, or held, a snapshot lakestream wrote: steps were published on main (every lakestream
    snapshot, a checkpoint's or a fork's too, comes from main's steps), so main is not one to clear, whatever its root's
    summary says (another engine's delete of every row, an append and an expiry leave one like a first snapshot's).
    The table's snapshots, then its earlier metadata files (the metadata log; unreadable ones are skipped)."""
    if any(is_lakestream(s) for s in metadata.snapshots):
        return True
    for entry in reversed(metadata.metadata_log):
        try:
            earlier = FromInputFile.table_metadata(stream.io.new_input(entry.metadata_file))
        except Exception as exc:  # noqa: BLE001 - deleted (delete-after-commit) or unreadable: the others tell
            log.debug("metadata file %s unreadable (%s)", entry.metadata_file, type(exc).__name__)
            continue
        if earlier.table_uuid == metadata.table_uuid and any(is_lakestream(s) for s in earlier.snapshots):
            return True
    return False


def _planned(plan: Plan[RepairReport] | Done[RepairReport],
             planned: list[PlannedRepair] | None) -> Plan[RepairReport] | Done[RepairReport]:
    """Record ``plan``'s swap in ``planned`` (see :func:`plan_repair`): the branch's ref update, from the head its
    requirement names to the snapshot it sets (a snapshot the plan adds is a re-base's new one)."""
    if planned is None or isinstance(plan, Done):
        return plan
    added = {u.snapshot.snapshot_id for u in plan.updates if isinstance(u, AddSnapshotUpdate)}
    target = next((u.snapshot_id for u in plan.updates if isinstance(u, SetSnapshotRefUpdate)), None)
    head = next(r.snapshot_id for r in plan.requirements if isinstance(r, AssertRefSnapshotId))
    if head is not None:
        planned.append(PlannedRepair(head=head, target=target, new=target in added, report=plan.result))
    return plan


def _plan_off_fork(stream: StreamTable, metadata: TableMetadata, found: Lineage, base: Snapshot, head_id: int, *,
                   dry_run: bool) -> Plan[RepairReport] | Done[RepairReport]:
    """Main moved onto a fork's timeline by another engine (see :func:`~lakestream_iceberg.format.lineage.
    fork_on_main`): a checkpoint's anchor (``base``) goes back to the snapshot that published the checkpoint's step
    when it is retained and the checkpoint was taken on main (the rollback to that step the move meant, every step
    before it and the producers' sequences with it); otherwise, and for a fork's head, main goes back to its head
    before the move (the newest one of the table's snapshot log that is retained and holds main's own state)."""
    anchor = StreamState.of(base).op == OP_CHECKPOINT
    props = base.summary.additional_properties if base.summary is not None else {}
    moved = {base.snapshot_id, *(s.snapshot_id for s in found.foreign)}
    # the source snapshot is main's own step only for a checkpoint taken on main (a fork's step holds the fork's timeline)
    own = anchor and props.get(KEY_SOURCE_BRANCH, MAIN_BRANCH) == MAIN_BRANCH
    candidates = [parse_int(props.get(KEY_SOURCE_SNAPSHOT), plus=False)] if own else []
    candidates += [entry.snapshot_id for entry in reversed(metadata.snapshot_log) if entry.snapshot_id not in moved]
    target = None
    for snapshot_id in candidates:
        snapshot = metadata.snapshot_by_id(snapshot_id) if snapshot_id is not None else None
        if snapshot is None:
            continue
        there = lineage(metadata, snapshot)
        if there.base is not None and there.changed is None and not there.broken and not fork_on_main(there.base, "main"):
            target = snapshot
            break
    moved_to = (f"the anchor of checkpoint {props.get(KEY_CHECKPOINT, '?')!r} (snapshot {base.snapshot_id}, step "
                f"{StreamState.of(base).step} alone)" if anchor else
                f"snapshot {base.snapshot_id} of a fork's timeline (step {StreamState.of(base).step})")
    if target is None:
        raise ForeignSnapshotError(
            f"branch 'main' of stream {stream.name} cannot be repaired automatically: another engine set it to "
            f"{moved_to}, and neither the snapshot that published the checkpoint's step nor main's earlier heads are "
            "retained. Point main at a snapshot lakestream wrote on it if a backup of the metadata has one, or create "
            "a new stream for the producers",
            snapshot_id=base.snapshot_id)
    report = RepairReport(branch="main", foreign=tuple(s.snapshot_id for s in (*found.foreign, base)),
                          rolled_back_to=target.snapshot_id, step=branch_state(metadata, target, stream=stream.name,
                                                                               branch="main").step,
                          dry_run=dry_run, changes=(*(describe(s) for s in found.foreign), f"main set to {moved_to}"))
    if dry_run:
        return Done(report)
    return Plan(
        (set_ref("main", SnapshotRefType.BRANCH, target.snapshot_id, current=metadata.refs["main"]),),
        (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref="main", snapshot_id=head_id)),
        report,
        [],
    )


def _plan_rebase(stream: StreamTable, metadata: TableMetadata, head: Snapshot, found: Lineage, *, branch: str,
                 dry_run: bool) -> Plan[RepairReport] | Done[RepairReport]:
    """A ``repair`` snapshot on ``head`` carrying the state of the lineage's expired lakestream snapshot, read back from
    the newest metadata file of the log that lists it."""
    oldest = found.foreign[-1].snapshot_id
    state = _state_from_log(stream, metadata, oldest)
    if state is None:
        raise ForeignSnapshotError(
            f"branch {branch!r} of stream {stream.name} cannot be repaired automatically: its head {head.snapshot_id} was "
            f"written by another engine, the snapshots below it that recorded the stream's state (below {oldest}) "
            "were expired, and no metadata file of the table's metadata log lists them any more. Committing now could "
            "republish published batches. Create a new stream for the producers (this table still reads as it is), or "
            "register an older metadata.json with the catalog if a backup has one; keep "
            "history.expire.min-snapshots-to-keep at 2 or more so that expiry keeps a lakestream snapshot",
            snapshot_id=found.foreign[-1].snapshot_id,
        )
    report = RepairReport(branch=branch, foreign=tuple(s.snapshot_id for s in found.foreign), rolled_back_to=None,
                          step=state.step, dry_run=dry_run, rebased_on=head.snapshot_id,
                          changes=tuple(describe(s) for s in found.foreign))
    if dry_run:
        return Done(report)
    builder = SnapshotBuilder(metadata)
    planner = stream.manifest_planner(metadata)
    snapshot_id, sequence_number = builder.next_ids()
    manifest_list = planner.write_list(planner.parent_manifests(head), snapshot_id=snapshot_id,
                                       parent_id=head.snapshot_id, sequence_number=sequence_number)
    repaired = replace(state, op=OP_REPAIR, producer=None, seq=None, group=1, committer=None, group_commit_ms=None,
                       token=None, staged_at_ms=None)
    snapshot = builder.snapshot(snapshot_id=snapshot_id, sequence_number=sequence_number, parent=head,
                                manifest_list=manifest_list, operation=Operation.APPEND,
                                properties=repaired.properties())
    builder.add(snapshot, branch=branch)
    return Plan(tuple(builder.updates),
                (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref=branch, snapshot_id=head.snapshot_id)),
                report, planner.written, planner.settle)


def _state_from_log(stream: StreamTable, metadata: TableMetadata, oldest: int) -> StreamState | None:
    """The stream's state below snapshot ``oldest`` (the oldest foreign snapshot left of the lineage), through
    foreign snapshots that changed no data, from the newest earlier metadata file that still lists a lakestream
    snapshot below it; None when none does."""
    for entry in reversed(metadata.metadata_log):
        try:
            earlier = FromInputFile.table_metadata(stream.io.new_input(entry.metadata_file))
        except Exception as exc:  # noqa: BLE001 - deleted (delete-after-commit) or unreadable: try an older one
            log.debug("metadata file %s unreadable (%s)", entry.metadata_file, type(exc).__name__)
            continue
        if earlier.table_uuid != metadata.table_uuid:
            continue
        snapshot = earlier.snapshot_by_id(oldest)
        if snapshot is None:
            continue
        there = lineage(earlier, snapshot)
        if there.changed is not None:
            return None  # a data change below: no state describes this table
        if there.base is not None:
            return StreamState.of(there.base)
    return None
