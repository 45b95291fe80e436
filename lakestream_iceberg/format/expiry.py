"""Which snapshots a commit may expire in passing, so table metadata stays bounded as steps accumulate.

Pure functions over :class:`TableMetadata`. A snapshot is kept when a ref (branch head, checkpoint tag) points at it or
when it is among the ``retain_last`` newest ancestors of a branch head; every other snapshot is expired by the next
commit. Expiring a snapshot removes it from metadata only: its data files stay in the table state (the head's
manifests still list them) until lifecycle GC collects their steps, and readers find a step's files through the head's
manifests, not through the step's own snapshot.

Expiring never drops a ref (Iceberg removes every ref pointing at a removed snapshot): only snapshots that no ref of
the metadata a commit is planned on points at are expirable, and a ref created while that commit is in flight points
at a new snapshot or at the target of a tag that already existed (a fork asserts its checkpoint's tag), which that
metadata protects. A producer's commit asserts only its own branch, and needs no more. The whole argument, and GC's
two commits, are in :mod:`lakestream_iceberg.lifecycle.gc` ("Forks and GC").
"""

from __future__ import annotations

from collections.abc import Iterable

from pyiceberg.table.metadata import TableMetadata


def ancestors(metadata: TableMetadata, snapshot_id: int | None, limit: int) -> list[int]:
    """Up to ``limit`` snapshot ids from ``snapshot_id`` back along parent links (the snapshot itself first)."""
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    out: list[int] = []
    current = by_id.get(snapshot_id) if snapshot_id is not None else None
    while current is not None and len(out) < limit:
        out.append(current.snapshot_id)
        if current.summary is not None and current.summary.get("lakestream.op") == "checkpoint":
            break  # a fork's lineage starts at its checkpoint anchor: do not pin the source branch's history
        current = by_id.get(current.parent_snapshot_id) if current.parent_snapshot_id is not None else None
    return out


def protected(metadata: TableMetadata, *, retain_last: int, extra: Iterable[int] = ()) -> set[int]:
    keep = set(extra)
    for ref in metadata.refs.values():
        keep.add(ref.snapshot_id)
        if ref.snapshot_ref_type == "branch":
            keep.update(ancestors(metadata, ref.snapshot_id, retain_last))
    return keep


def expirable(metadata: TableMetadata, *, retain_last: int, extra_keep: Iterable[int] = (), limit: int = 256) -> list[int]:
    """Snapshot ids that no ref needs and that fall outside every branch's retention window (oldest first)."""
    keep = protected(metadata, retain_last=retain_last, extra=extra_keep)
    old = sorted((s for s in metadata.snapshots if s.snapshot_id not in keep), key=lambda s: s.timestamp_ms)
    return [s.snapshot_id for s in old[:limit]]
