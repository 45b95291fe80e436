"""Snapshots that other engines write on a stream's branch, and where the stream's state is found under them.

A stream stays a plain Iceberg table, so Spark, Trino, Flink or pyiceberg may commit to it: maintenance that changes
no data (``rewrite_manifests``), or writes that do (an append, a ``DELETE``, an overwrite, ``rewrite_data_files``).
Their snapshots carry no ``lakestream.*`` summary keys (a cherry-pick that copied another snapshot's, naming it in
Iceberg's ``source-snapshot-id``, counts as another engine's too). The rule, applied wherever the state of a branch
head is read (commits, reads, GC, checkpoints):

* the stream's state is the one recorded by the nearest snapshot at or below the head that lakestream wrote, so step
  numbering counts lakestream steps only and a foreign snapshot never resets it;
* a foreign snapshot that changes **no data** (every added/removed file and record count of its summary is zero) is
  passed over: commits go on on top of it, reads go through it;
* a foreign snapshot that **changes data** is refused: the published steps are no longer what the stream's state
  says, so neither a commit (which would carry that state forward) nor a read may go on.
  :class:`~lakestream_iceberg.errors.ForeignSnapshotError` names it and the way back, ``Stream.repair()``, which
  rolls the branch back to its last lakestream snapshot (:mod:`lakestream_iceberg.lifecycle.repair`);
* a lineage that ends in an expired snapshot before any lakestream snapshot is refused the same way: the state is
  not reachable.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH
from pyiceberg.table.snapshots import Snapshot

from lakestream_iceberg.connect.integers import parse_int
from lakestream_iceberg.errors import CorruptStateError, ForeignSnapshotError
from lakestream_iceberg.format.checkpoints import KEY_SOURCE_BRANCH
from lakestream_iceberg.format.summary import (
    KEY_CHECKPOINT,
    KEY_SNAPSHOT_ID,
    KEY_SOURCE_SNAPSHOT,
    KEY_STEP,
    OP_CHECKPOINT,
    StreamState,
)

__all__ = ["Lineage", "branch_state", "changes_data", "describe", "fork_on_main", "is_lakestream", "lineage"]

# The summary counts of Iceberg's SnapshotSummary that record a change of the table's rows or files; any non-zero one
# makes a snapshot a data change.
_CHANGE_KEYS = (
    "added-data-files", "deleted-data-files", "added-delete-files", "removed-delete-files",
    "added-records", "deleted-records", "added-position-deletes", "removed-position-deletes",
    "added-equality-deletes", "removed-equality-deletes", "added-position-delete-files",
    "removed-position-delete-files", "added-equality-delete-files", "removed-equality-delete-files",
    "added-dvs", "removed-dvs",
)


# Iceberg's SnapshotSummary key naming the snapshot a cherry-pick (Spark's cherrypick_snapshot, a WAP publish) picked;
# lakestream never writes it (its checkpoints record lakestream.source-snapshot-id)
_CHERRY_PICKED_FROM = "source-snapshot-id"


def is_lakestream(snapshot: Snapshot) -> bool:
    """Whether lakestream wrote the snapshot: its summary records a step, for this snapshot.

    A tool that copies a snapshot's properties onto its own (Iceberg Java's cherry-pick does not, but a tool may; an
    append with the head's properties copied: pyiceberg's ``append(snapshot_properties=...)``, Spark's
    ``snapshot-property.*`` options) carries a state that is not this snapshot's: such a snapshot names another id in
    ``lakestream.snapshot-id`` (lakestream records its own there; snapshots written before it did record none), or
    the picked one in ``source-snapshot-id``."""
    if snapshot.summary is None:
        return False
    props = snapshot.summary.additional_properties
    if KEY_STEP not in props or _CHERRY_PICKED_FROM in props:
        return False
    written_for = props.get(KEY_SNAPSHOT_ID)
    return written_for is None or written_for == str(snapshot.snapshot_id)


def changes_data(snapshot: Snapshot) -> bool:
    """Whether a foreign snapshot changed the table's rows or files, from its summary.

    A snapshot that records no counts at all is a change unless its operation is ``replace`` (which by Iceberg's
    definition changes no rows: ``rewrite_manifests``); one that records counts is a change when any is non-zero or
    when it replaced partitions."""
    summary = snapshot.summary
    if summary is None:
        return True
    props = summary.additional_properties
    counts = [props[k] for k in _CHANGE_KEYS if k in props]
    if any(parse_int(c) != 0 for c in counts) or props.get("replace-partitions") == "true":  # " 0": no engine's zero
        return True
    return not counts and summary.operation.value != "replace"


@dataclass(frozen=True)
class Lineage:
    """A branch head's lineage down to its nearest lakestream snapshot.

    ``base``: that snapshot (None when there is none: a new stream, or a lineage cut by expiry, see ``broken``);
    ``foreign``: the foreign snapshots above it, newest first; ``broken``: the lineage was cut by expiry before any
    lakestream snapshot: it reached a parent id that the metadata no longer lists (Iceberg Java's expiry), or a root
    whose table state holds data files (pyiceberg's expiry clears the parent id of a snapshot whose parent it
    removed), where only a stream with nothing published yet could start."""

    base: Snapshot | None
    foreign: tuple[Snapshot, ...] = ()
    broken: bool = False

    @property
    def changed(self) -> Snapshot | None:
        """The oldest foreign snapshot that changed data (None: every foreign snapshot is metadata-only)."""
        return next((s for s in reversed(self.foreign) if changes_data(s)), None)


def lineage(metadata: TableMetadata, head: Snapshot | None) -> Lineage:
    """``head``'s lineage down to the nearest snapshot lakestream wrote (``head`` itself in the usual case).

    Raises:
        CorruptStateError: The parent links of foreign snapshots lead back to one already walked (a loop).
    """
    if head is None or is_lakestream(head):
        return Lineage(head)
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    foreign: list[Snapshot] = []
    seen: set[int] = set()
    current: Snapshot | None = head
    while current is not None and not is_lakestream(current):
        if current.snapshot_id in seen:  # a parent link back into the walked lineage: it would be walked forever
            raise CorruptStateError(
                f"snapshot {foreign[0].snapshot_id}'s lineage loops: the parent links of snapshots "
                f"{', '.join(str(s.snapshot_id) for s in foreign)} lead back to snapshot {current.snapshot_id}. Another "
                "engine wrote these snapshots with wrong parent ids, or the metadata was edited; point the branch at "
                "the last snapshot lakestream wrote (main: pyiceberg's "
                "table.manage_snapshots().set_current_snapshot(ID).commit(); another branch: Spark's ALTER TABLE ... "
                "REPLACE BRANCH)"
            )
        seen.add(current.snapshot_id)
        foreign.append(current)
        parent = current.parent_snapshot_id
        current = by_id.get(parent) if parent is not None else None
        if parent is not None and current is None:
            return Lineage(None, tuple(foreign), broken=True)
    if current is None and _holds_data(foreign[-1]):
        return Lineage(None, tuple(foreign), broken=True)
    return Lineage(current, tuple(foreign))


def _holds_data(snapshot: Snapshot) -> bool:
    """Whether a snapshot's table state holds data files, from its summary's total (unknown: yes)."""
    props = snapshot.summary.additional_properties if snapshot.summary is not None else {}
    return parse_int(props.get("total-data-files")) != 0


def branch_state(metadata: TableMetadata, head: Snapshot | None, *, stream: str, branch: str) -> StreamState:
    """The stream's state on a branch whose head is ``head``: its own when lakestream wrote it, else its nearest
    lakestream ancestor's, through foreign snapshots that change no data.

    Raises:
        ForeignSnapshotError: A foreign snapshot above that ancestor changed data, or the lineage was expired before
            reaching one. The message names the snapshot and how to bring the branch back.
    """
    if head is None or is_lakestream(head):
        _refuse_fork_on_main(metadata, head, stream=stream, branch=branch)
        return StreamState.of(head)
    found = lineage(metadata, head)
    changed = found.changed
    if changed is not None:
        raise ForeignSnapshotError(_changed_message(found, changed, stream=stream, branch=branch),
                                   snapshot_id=changed.snapshot_id)
    if found.broken:
        oldest = found.foreign[-1]
        raise ForeignSnapshotError(
            f"branch {branch!r} of stream {stream}: its head {head.snapshot_id} was written by another engine, and its "
            f"lineage ends at snapshot {oldest.snapshot_id}, whose parent was expired "
            "before lakestream committed on top of it: the stream's state (head step, producer sequences) is not in this "
            "metadata, and a commit could republish published batches. Run stream.repair() (or `lakestream repair`): "
            "it reads the state back from the table's metadata log and re-bases it on this head. Keep "
            "history.expire.min-snapshots-to-keep at 2 or more so that expiry keeps a lakestream snapshot",
            snapshot_id=oldest.snapshot_id,
        )
    _refuse_fork_on_main(metadata, found.base, stream=stream, branch=branch)
    return StreamState.of(found.base)


def fork_on_main(base: Snapshot | None, branch: str) -> bool:
    """Whether ``base``, the lakestream snapshot a branch's state is read from, is a fork's and the branch is ``main``.

    A checkpoint's anchor holds its step alone and no producer sequences, and on a fork (``Stream.fork`` makes a new
    branch at it) it starts a new timeline, which every snapshot committed after it names (``lakestream.timeline``).
    ``main`` is never made by a fork, so it is on one because another engine moved it there: to a checkpoint's tag
    (Spark's ``set_current_snapshot(ref => 'ckpt')``, ``REPLACE BRANCH main``, pyiceberg's
    ``set_current_snapshot(ref_name=...)``) or to a fork's head (Spark's ``fast_forward('main', 'fork')``, which
    Iceberg allows as the anchor's parent is main's step). Read as main's state, the steps below the fork's start
    would leave main and its producers would publish their published sequences again."""
    if branch != MAIN_BRANCH or base is None:
        return False
    state = StreamState.of(base)
    return state.op == OP_CHECKPOINT or state.timeline is not None


def _refuse_fork_on_main(metadata: TableMetadata, base: Snapshot | None, *, stream: str, branch: str) -> None:
    if not fork_on_main(base, branch):
        return
    assert base is not None
    state = StreamState.of(base)
    if state.op != OP_CHECKPOINT:  # a snapshot committed on a fork
        anchor = metadata.snapshot_by_id(state.timeline) if state.timeline is not None else None
        props = anchor.summary.additional_properties if anchor is not None and anchor.summary is not None else {}
        start = f"checkpoint {props[KEY_CHECKPOINT]!r} (step {StreamState.of(anchor).step})" \
            if anchor is not None and KEY_CHECKPOINT in props else f"the checkpoint anchor {state.timeline}"
        raise ForeignSnapshotError(
            f"branch 'main' of stream {stream}: its head's state is snapshot {base.snapshot_id} (step {state.step}), "
            f"which was committed on a fork whose timeline starts at {start}, where another engine moved main (a "
            "fast_forward or set_current_snapshot to the fork's head). A fork's producer sequences start afresh at its "
            "checkpoint and it holds none of the steps before it, so on main those steps would be lost and producers "
            "would publish their published batches again; lakestream neither commits on it nor reads through it. Run "
            "stream.repair() (or `lakestream repair`) to roll main back to where it was before it was moved. A fork "
            "stays a branch of its own: keep producing and training on it by its name",
            snapshot_id=base.snapshot_id,
        )
    props = base.summary.additional_properties if base.summary is not None else {}
    name, step = props.get(KEY_CHECKPOINT, "?"), state.step
    source = parse_int(props.get(KEY_SOURCE_SNAPSHOT), plus=False)
    kept = (source is not None and metadata.snapshot_by_id(source) is not None
            and props.get(KEY_SOURCE_BRANCH, MAIN_BRANCH) == MAIN_BRANCH)
    raise ForeignSnapshotError(
        f"branch 'main' of stream {stream}: its head is snapshot {base.snapshot_id}, the anchor of checkpoint "
        f"{name!r} (step {step}), where another engine set it (a set_current_snapshot or REPLACE BRANCH to the "
        f"checkpoint's tag). An anchor holds step {step} alone and no producer sequences, so on main the steps below "
        f"it would be lost and producers would publish their published batches again; lakestream neither commits on "
        "it nor reads through it. Run stream.repair() (or `lakestream repair`) to roll main back to "
        + (f"snapshot {source}, which published step {step} with every step before it" if kept else
           "where it was before it was moved (the checkpoint's step is not a retained snapshot of main)")
        + ". To resume training from a checkpoint, use LakestreamDataset.from_checkpoint; to go on from it as a new "
        "timeline, fork it (Stream.fork)",
        snapshot_id=base.snapshot_id,
    )


def describe(snapshot: Snapshot) -> str:
    """What a (foreign) snapshot did, from its summary: its operation, the engine that wrote it when recorded, and its
    non-zero change counts (``append: added-data-files=1, added-records=4``)."""
    props = snapshot.summary.additional_properties if snapshot.summary is not None else {}
    engine = props.get("engine-name") or props.get("app-id")
    operation = snapshot.summary.operation.value if snapshot.summary is not None else "unknown"
    counts = ", ".join(f"{k}={props[k]}" for k in _CHANGE_KEYS if parse_int(props.get(k, "0")) != 0)
    return f"{operation}{', by ' + engine if engine else ''}{': ' + counts if counts else ''}"


def _changed_message(found: Lineage, changed: Snapshot, *, stream: str, branch: str) -> str:
    base = found.base
    back = (f"roll the branch back to snapshot {base.snapshot_id} (step {StreamState.of(base).step}), the last one "
            "lakestream wrote" if base is not None else "roll the branch back to the last snapshot lakestream wrote")
    return (
        f"branch {branch!r} of stream {stream}: snapshot {changed.snapshot_id} ({describe(changed)}) was written by "
        "another engine and "
        "changes the stream's data, so its steps may no longer hold what was published; lakestream neither commits on "
        "it nor reads through it. Run stream.repair() (or `lakestream repair`) to "
        f"{back}: every published step stays intact and the foreign change is dropped from the branch. Change a "
        "stream's data only on a fork (Stream.fork) or after its producers are done"
    )
