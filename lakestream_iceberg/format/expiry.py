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

import time
from collections.abc import Iterable, Mapping
from typing import TypedDict

from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import SnapshotRef
from pyiceberg.table.snapshots import Snapshot

from lakestream_iceberg.format.layout import StreamConfig
from lakestream_iceberg.format.lineage import is_lakestream


def ancestors(metadata: TableMetadata, snapshot_id: int | None, limit: int, *,
              by_id: dict[int, Snapshot] | None = None) -> list[int]:
    """Up to ``limit`` snapshot ids from ``snapshot_id`` back along parent links (the snapshot itself first).

    ``by_id``: the metadata's snapshots by id, when the caller has them (a commit keeping snapshots by age walks
    thousands: the summary is read as its plain dict, not through pydantic's attribute lookup)."""
    if by_id is None:
        by_id = {s.snapshot_id: s for s in metadata.snapshots}
    out: list[int] = []
    current = by_id.get(snapshot_id) if snapshot_id is not None else None
    while current is not None and len(out) < limit:
        out.append(current.snapshot_id)
        if _is_anchor(current):
            break  # a fork's lineage starts at its checkpoint anchor: do not pin the source branch's history
        current = by_id.get(current.parent_snapshot_id) if current.parent_snapshot_id is not None else None
    return list(out)


# Whether a snapshot is a checkpoint anchor, by (snapshot id, manifest list): a snapshot never changes, and a commit
# keeping snapshots by age asks it of thousands of them (a summary read through pydantic costs ~10 us). Bounded.
_ANCHORS: dict[tuple[int, str], bool] = {}
_MAX_ANCHORS = 16_384


def _is_anchor(snapshot: Snapshot) -> bool:
    key = (snapshot.snapshot_id, snapshot.manifest_list)
    found = _ANCHORS.get(key)
    if found is None:
        found = snapshot.summary is not None and snapshot.summary.additional_properties.get("lakestream.op") == "checkpoint"
        if len(_ANCHORS) >= _MAX_ANCHORS:
            _ANCHORS.clear()
        _ANCHORS[key] = found
    return found


def protected(metadata: TableMetadata, *, retain_last: int, extra: Iterable[int] = (), max_age_ms: int = 0,
              retain_max: int = 0, now_ms: int | None = None, fewer: Mapping[str, int] | None = None) -> set[int]:
    """What no commit may expire: every ref's snapshot, the ``retain_last`` newest ancestors of each branch head, and,
    with ``max_age_ms``, every ancestor younger than that, up to ``retain_max`` per branch (the bound on metadata); a
    branch ref's own retention counts as well (:func:`branch_retention`).

    ``fewer``: per branch, how many fewer ancestors to keep (at least 1): the snapshots a commit adds on top of that
    branch's head. Every other branch keeps its whole window."""
    keep = set(extra)
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    for name, ref in metadata.refs.items():
        keep.add(ref.snapshot_id)
        if ref.snapshot_ref_type == "branch":
            branch_last, branch_age = branch_retention(ref, retain_last=retain_last, max_age_ms=max_age_ms)
            cutoff = now_ms - branch_age
            less = (fewer or {}).get(name, 0)
            last, most = (max(1, branch_last - less), max(1, retain_max - less)) if less else (branch_last, retain_max)
            by_age = branch_age > 0 and most > last
            lineage = ancestors(metadata, ref.snapshot_id, most if by_age else last, by_id=by_id)
            keep.update(lineage[:last])
            keep.update(sid for sid in lineage[last:] if by_id[sid].timestamp_ms >= cutoff)
            keep.update(_state_lineage(by_id, ref.snapshot_id))
    return keep


def branch_retention(ref: SnapshotRef | None, *, retain_last: int, max_age_ms: int) -> tuple[int, int]:
    """A branch's ``(retain_last, max_age_ms)``: the table's, with the branch ref's own retention where another engine
    set one (Spark's ``ALTER TABLE ... CREATE BRANCH ... WITH SNAPSHOT RETENTION n SNAPSHOTS / d DAYS``): its
    ``min-snapshots-to-keep`` raises the count kept (never lowers lakestream's), its ``max-snapshot-age-ms`` replaces
    the table's ``history.expire.max-snapshot-age-ms``, as in Iceberg's own expiry."""
    if ref is None:
        return retain_last, max_age_ms
    last = max(retain_last, ref.min_snapshots_to_keep or 0)
    return last, ref.max_snapshot_age_ms if ref.max_snapshot_age_ms is not None else max_age_ms


def _state_lineage(by_id: dict[int, Snapshot], snapshot_id: int) -> list[int]:
    """A branch head's foreign snapshots (no ``lakestream.step``: e.g. Spark's ``rewrite_manifests``) down to and with
    the nearest one lakestream wrote, which records the branch's state (just the head, usually). However many foreign
    snapshots stack up beyond the retention window, expiring that one would leave the branch no state to commit or read
    on (every commit and read then refuses until a repair); each between must stay too, to keep the parent links."""
    out: dict[int, None] = {}  # ordered, and a loop of parent links (refused elsewhere) ends the walk
    current = by_id.get(snapshot_id)
    while current is not None and current.snapshot_id not in out:
        out[current.snapshot_id] = None
        if is_lakestream(current):
            break
        current = by_id.get(current.parent_snapshot_id) if current.parent_snapshot_id is not None else None
    return list(out)


def young(metadata: TableMetadata, snapshot_id: int, *, max_age_ms: int, retain_max: int,
          now_ms: int | None = None, ref: SnapshotRef | None = None, **_: int) -> set[int]:
    """The ancestors of ``snapshot_id`` (itself included) that age retention keeps: younger than ``max_age_ms`` (or
    the branch ``ref``'s own ``max-snapshot-age-ms``), at most ``retain_max`` (none when the age is 0). Takes
    :func:`retention`'s arguments."""
    if ref is not None and ref.max_snapshot_age_ms is not None:
        max_age_ms = ref.max_snapshot_age_ms
    if max_age_ms <= 0:
        return set()
    cutoff = (now_ms if now_ms is not None else int(time.time() * 1000)) - max_age_ms
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    return {sid for sid in ancestors(metadata, snapshot_id, retain_max, by_id=by_id) if by_id[sid].timestamp_ms >= cutoff}


class Retention(TypedDict):
    """The retention arguments of :func:`protected`, :func:`young` and :func:`expirable` (:func:`retention`)."""

    retain_last: int
    max_age_ms: int
    retain_max: int


def retention(metadata: TableMetadata) -> Retention:
    """The retention arguments of :func:`protected` and :func:`expirable`, from the properties of the metadata a
    commit is planned on: a retention changed on a live stream (``ALTER TABLE ... SET TBLPROPERTIES``, pyiceberg's
    ``set_properties``) applies from the next commit of every producer, with no reopening.

    Raises:
        ConfigError: A retention property holds a value lakestream cannot use (names it).
    """
    key = tuple(sorted(metadata.properties.items()))
    found = _RETENTIONS.get(key)
    if found is None:
        config = StreamConfig.from_properties(metadata.properties)
        found = Retention(retain_last=config.retain_snapshots, max_age_ms=config.retain_max_age_ms,
                          retain_max=config.retain_max)
        if len(_RETENTIONS) >= 64:
            _RETENTIONS.clear()
        _RETENTIONS[key] = found
    return found.copy()


_RETENTIONS: dict[tuple[tuple[str, str], ...], Retention] = {}


def expirable(metadata: TableMetadata, *, retain_last: int, extra_keep: Iterable[int] = (), limit: int = 256,
              max_age_ms: int = 0, retain_max: int = 0, now_ms: int | None = None,
              fewer: Mapping[str, int] | None = None) -> list[int]:
    """Snapshot ids that no ref needs and that fall outside every branch's retention window (oldest first; ``fewer``:
    see :func:`protected`)."""
    keep = protected(metadata, retain_last=retain_last, extra=extra_keep, max_age_ms=max_age_ms, retain_max=retain_max,
                     now_ms=now_ms, fewer=fewer)
    old = sorted((s for s in metadata.snapshots if s.snapshot_id not in keep), key=lambda s: s.timestamp_ms)
    return [s.snapshot_id for s in old[:limit]]
