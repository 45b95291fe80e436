"""How a checkpoint lies in Iceberg: a tag on an *anchor* snapshot whose summary records the step, the source branch
and the snapshot that published the step (see :mod:`lakestream_iceberg.lifecycle.checkpoint` for how one is made)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.snapshots import Snapshot

from lakestream_iceberg.connect.integers import parse_int
from lakestream_iceberg.errors import CorruptStateError
from lakestream_iceberg.format.summary import KEY_CHECKPOINT, KEY_SOURCE_SNAPSHOT, KEY_STEP, StreamState

if TYPE_CHECKING:
    from lakestream_iceberg.format.index import StepIndex

KEY_SOURCE_BRANCH = "lakestream.source-branch"
# When the checkpoint was committed, by the committer's clock (ms since the epoch). The anchor's timestamp_ms is no
# clock reading where an earlier snapshot is dated in the future (another engine wrote microseconds as milliseconds,
# a skewed clock): Iceberg's snapshot timestamps must not go back, so every later snapshot is dated after it.
KEY_CREATED_AT = "lakestream.created-at-ms"

__all__ = ["Checkpoint", "checkpoint_of", "list_checkpoints", "on_timeline", "utc_from_ms"]


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A checkpoint watermark: resuming from it continues at ``step + 1`` of ``branch``.

    Attributes:
        name: The Iceberg tag name.
        step: The last step the checkpointed trainer consumed.
        snapshot_id: The tagged anchor snapshot (its state holds step ``step`` only).
        created_at: When the checkpoint was committed (UTC).
        branch: The branch the checkpoint was taken on.
        source_snapshot_id: The snapshot that published ``step``.
        sequence_number: The anchor's sequence number: the order in which checkpoints were committed, which no clock
            decides (``created_at`` is the clock of the host that made it; hosts' clocks differ). None: not known.
    """

    name: str
    step: int
    snapshot_id: int
    created_at: datetime
    branch: str
    source_snapshot_id: int | None
    sequence_number: int | None = None


def _summary(snapshot: Snapshot | None) -> dict[str, str]:
    return dict(snapshot.summary.additional_properties) if snapshot is not None and snapshot.summary else {}



def utc_from_ms(ms: float) -> datetime | None:
    """A millisecond timestamp as an aware UTC datetime; None when no datetime can hold it (past the year 9999)."""
    try:
        return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    except (OverflowError, ValueError, OSError):
        return None


def checkpoint_of(metadata: TableMetadata, name: str, *, by_id: dict[int, Snapshot] | None = None) -> Checkpoint | None:
    """The checkpoint tagged ``name`` (None: no tag of that name, or not on a lakestream anchor of that name).
    ``by_id``: the metadata's snapshots by id, when the caller has them (``snapshot_by_id`` scans the list)."""
    ref = metadata.refs.get(name)
    if ref is None or ref.snapshot_ref_type != SnapshotRefType.TAG:
        return None
    snapshot = by_id.get(ref.snapshot_id) if by_id is not None else metadata.snapshot_by_id(ref.snapshot_id)
    summary = _summary(snapshot)
    if snapshot is None or summary.get(KEY_CHECKPOINT) != name:
        return None
    source = summary.get(KEY_SOURCE_SNAPSHOT)
    step = StreamState.of(snapshot).step
    if step < 1:  # no step recorded (read as 0), or 0: checkpoint() takes steps from 1; resuming would replay from 1
        raise CorruptStateError(
            f"checkpoint tag {name!r} is on snapshot {snapshot.snapshot_id}, whose summary records "
            f"{KEY_STEP}={summary.get(KEY_STEP)!r} (lakestream writes the checkpointed step, 1 or more): the tag was "
            "written by another tool or its summary was corrupted; remove the tag "
            f"(table.manage_snapshots().remove_tag({name!r}).commit()) or point it at a lakestream checkpoint"
        )
    return Checkpoint(
        name=name,
        step=step,
        snapshot_id=snapshot.snapshot_id,
        created_at=_created_at(name, summary.get(KEY_CREATED_AT), snapshot.timestamp_ms),
        branch=summary.get(KEY_SOURCE_BRANCH, "main"),
        source_snapshot_id=_snapshot_id(name, source),
        sequence_number=snapshot.sequence_number,
    )


def _snapshot_id(name: str, raw: object) -> int | None:
    """The source snapshot id a checkpoint's summary records (None: not recorded)."""
    if raw is None or raw == "":
        return None
    found = parse_int(raw, plus=False)  # a snapshot id is a long
    if found is not None:
        return found
    raise CorruptStateError(
        f"checkpoint tag {name!r} has a malformed {KEY_SOURCE_SNAPSHOT}={str(raw)[:64]!r} in its summary (lakestream "
        "writes a snapshot id): the tag was written by another tool or its summary was corrupted; remove the tag "
        f"(table.manage_snapshots().remove_tag({name!r}).commit()) or point it at a lakestream checkpoint"
    )


def _created_at(name: str, raw: str | None, timestamp_ms: int) -> datetime:
    """When the checkpoint was committed: its recorded ``lakestream.created-at-ms``, else (anchors written before it was
    recorded) its snapshot's timestamp."""
    ms = parse_int(raw, minimum=0, plus=False)
    found = utc_from_ms(ms) if ms is not None else None
    if found is None and raw is None:
        found = utc_from_ms(timestamp_ms)
    if found is None:
        raise CorruptStateError(
            f"checkpoint tag {name!r} has no readable creation time ({KEY_CREATED_AT}={str(raw)[:64]!r}, snapshot "
            f"timestamp-ms={timestamp_ms}): the tag was written by another tool or its summary was corrupted; remove "
            f"the tag (table.manage_snapshots().remove_tag({name!r}).commit()) or point it at a lakestream checkpoint"
        )
    return found


def list_checkpoints(metadata: TableMetadata) -> list[Checkpoint]:
    by_id = {s.snapshot_id: s for s in metadata.snapshots}  # one scan, not one per tag: thousands of both are usual
    found = (checkpoint_of(metadata, name, by_id=by_id) for name in metadata.refs)
    return sorted((c for c in found if c is not None), key=lambda c: (c.step, c.created_at))


def on_timeline(index: StepIndex, checkpoint: Checkpoint, *, anchor: Snapshot | None, head: Snapshot | None) -> bool:
    """Whether the branch whose head is ``head`` holds the very files of the checkpoint's step that its ``anchor``
    holds: the checkpoint is on that branch's timeline. A checkpoint names its branch, not the timeline: after another
    engine moved the branch back under it (a rollback, REPLACE BRANCH), or dropped the branch and a fork made it again
    under its name, the branch holds no such step or other files at it, though it may publish past the step again."""
    pinned = {e.data_file.file_path for e in index.entries(anchor, checkpoint.step)}
    return bool(pinned) and pinned == {e.data_file.file_path for e in index.entries(head, checkpoint.step)}
