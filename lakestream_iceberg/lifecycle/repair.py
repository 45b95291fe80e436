"""Bring a branch back after another engine changed a stream's data: roll it back to its last lakestream snapshot.

A foreign snapshot that changes data (see :mod:`lakestream_iceberg.format.lineage`) stops every commit and read of
the branch with :class:`~lakestream_iceberg.errors.ForeignSnapshotError`. ``Stream.repair()`` moves the branch ref
back to the nearest snapshot lakestream wrote below it, in one compare-and-swap that asserts the head it was planned
on (a producer or another engine committing meanwhile makes it re-plan). Every published step is in that snapshot's
table state, so nothing published is lost; the foreign snapshots leave the branch (Iceberg's rollback), their files
stay until expiry or lifecycle GC removes them. Metadata-only foreign snapshots (``rewrite_manifests``) need no repair
and are left where they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.update import AssertRefSnapshotId, AssertTableUUID, SetSnapshotRefUpdate

from lakestream_iceberg.errors import ForeignSnapshotError, LifecycleError
from lakestream_iceberg.format.lineage import branch_state, lineage
from lakestream_iceberg.format.summary import StreamState
from lakestream_iceberg.write.commit import Done, Plan

__all__ = ["RepairReport", "plan_repair"]


@dataclass(frozen=True)
class RepairReport:
    """What :meth:`Stream.repair` found and did.

    Attributes:
        branch: The branch repaired.
        foreign: The foreign snapshots removed from the branch, newest first (empty: nothing to repair).
        rolled_back_to: The lakestream snapshot the branch points at now (None: it was not moved).
        step: The branch's head step after the repair.
        dry_run: Only planned: nothing was committed.
    """

    branch: str
    foreign: tuple[int, ...]
    rolled_back_to: int | None
    step: int
    dry_run: bool

    @property
    def repaired(self) -> bool:
        return self.rolled_back_to is not None and not self.dry_run


def plan_repair(metadata: TableMetadata, *, stream: str, branch: str, dry_run: bool) -> Plan[RepairReport] | Done[RepairReport]:
    """The rollback of ``branch`` to its last lakestream snapshot, when a foreign snapshot above it changed data.

    Raises:
        LifecycleError: ``branch`` is not a branch of the stream.
        ForeignSnapshotError: The lineage was expired below the foreign snapshots: there is no lakestream snapshot to
            roll back to (the message says what to do instead).
    """
    ref = metadata.refs.get(branch)
    if ref is None or ref.snapshot_ref_type != SnapshotRefType.BRANCH:
        raise LifecycleError(f"stream {stream} has no branch {branch!r} to repair; its branches: "
                             f"{sorted(n for n, r in metadata.refs.items() if r.snapshot_ref_type == SnapshotRefType.BRANCH)}")
    head = metadata.snapshot_by_id(ref.snapshot_id)
    found = lineage(metadata, head)
    if found.changed is None:  # nothing to roll back; a broken lineage raises here with its own advice
        state = branch_state(metadata, head, stream=stream, branch=branch)
        return Done(RepairReport(branch=branch, foreign=(), rolled_back_to=None, step=state.step, dry_run=dry_run))
    if found.base is None:
        raise ForeignSnapshotError(
            f"branch {branch!r} of stream {stream} cannot be repaired automatically: below its foreign snapshots "
            f"({', '.join(str(s.snapshot_id) for s in found.foreign)}) no snapshot lakestream wrote is left (expired). "
            "Point the branch at a retained checkpoint instead (stream.checkpoints() lists them; with pyiceberg: "
            "table.manage_snapshots().rollback_to_snapshot(ID).commit() for main)",
            snapshot_id=found.foreign[-1].snapshot_id,
        )
    report = RepairReport(branch=branch, foreign=tuple(s.snapshot_id for s in found.foreign),
                          rolled_back_to=found.base.snapshot_id, step=StreamState.of(found.base).step, dry_run=dry_run)
    if dry_run:
        return Done(report)
    return Plan(
        (SetSnapshotRefUpdate(ref_name=branch, type=SnapshotRefType.BRANCH, snapshot_id=found.base.snapshot_id),),
        (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref=branch, snapshot_id=ref.snapshot_id)),
        report,
        [],
    )
