"""Checkpoint watermarks as Iceberg snapshot tags, and forks (branches) from them.

``checkpoint(name, step=S)`` commits one small *anchor* snapshot whose table state is exactly step S's files (the
files of the step the trainer checkpointed after), tagged ``name``. It is not on any branch; its parent is the
snapshot that published S (when still retained) and its summary records S, the source branch and snapshot. So:

* the tag pins only what resuming or forking from S needs, never older data: a plain tag on step S's own snapshot
  would pin every step up to S (each TGB appends), and storage would never shrink while the checkpoint lives;
* resuming from S reads S+1, S+2, ... from the branch as before: byte-identical replay;
* ``fork(checkpoint, branch=...)`` creates an Iceberg branch at the anchor: producers on it continue at S+1, with
  fresh producer sequences (the fork is a new timeline), and the source branch keeps its history;
* any Iceberg reader sees an ordinary tag on a valid snapshot.

Every change here is one compare-and-swap commit that also asserts the source branch head it was planned on, so it
can never race lifecycle GC into tagging a step that GC is collecting.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.snapshots import Operation, Snapshot
from pyiceberg.table.update import (
    AssertRefSnapshotId,
    AssertTableUUID,
    RemoveSnapshotRefUpdate,
)

from lakestream_iceberg.errors import CheckpointError
from lakestream_iceberg.format.checkpoints import KEY_CREATED_AT, KEY_SOURCE_BRANCH, Checkpoint, checkpoint_of
from lakestream_iceberg.format.checks import check_branch, check_int
from lakestream_iceberg.format.expiry import ancestors
from lakestream_iceberg.format.lineage import branch_state
from lakestream_iceberg.format.snapshots import SnapshotBuilder, set_ref
from lakestream_iceberg.format.summary import KEY_CHECKPOINT, KEY_SOURCE_SNAPSHOT, OP_APPEND, OP_CHECKPOINT, StreamState
from lakestream_iceberg.write.plan import Done, Plan

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

def _summary(snapshot: Snapshot | None) -> dict[str, str]:
    return dict(snapshot.summary.additional_properties) if snapshot is not None and snapshot.summary else {}


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: "$" would let a trailing "\n" in

__all__ = ["Checkpoint"]


def check_name(name: str, metadata: TableMetadata) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == "main":
        raise CheckpointError(
            f"checkpoint name {name!r} is invalid: use 1-128 letters, digits, '.', '_' or '-' starting with a letter or "
            "digit (and not 'main'); it becomes an Iceberg tag"
        )
    if name in metadata.refs:
        raise CheckpointError(f"a checkpoint, tag or branch named {name!r} already exists; release it or pick another name")


def plan_checkpoint(stream: StreamTable, metadata: TableMetadata, *, name: str, step: int, branch: str,
                    planned: set[int] | None = None) -> Plan[Checkpoint] | Done[Checkpoint]:
    """``planned``: the anchor snapshot ids this call planned in earlier attempts (the function adds each one it
    plans). When one of them is the tag's, an attempt whose outcome was unknown (the reply lost) landed: ``Done``."""
    if planned:
        ref = metadata.refs.get(name) if isinstance(name, str) else None
        found = checkpoint_of(metadata, name) if ref is not None and ref.snapshot_id in planned else None
        if found is not None:
            return Done(found)
    check_name(name, metadata)
    step = check_int(step, what="checkpoint step", error=CheckpointError)  # True is not step 1; numpy integers are
    check_branch(metadata, branch, stream=stream.name, doing="cannot checkpoint", error=CheckpointError)
    head = metadata.snapshot_by_name(branch)
    if head is None:
        raise CheckpointError(f"branch {branch!r} of {stream.name} does not exist or has no steps")
    state = branch_state(metadata, head, stream=stream.name, branch=branch)
    if step < 1 or step > state.step:
        raise CheckpointError(f"cannot checkpoint step {step!r} of {stream.name} (branch {branch!r}): its published "
                              f"steps are 1..{state.step}")
    entries = stream.index.entries(head, step)
    if step < state.collected_below:  # a fork's branch starts at its checkpoint: nothing below it was ever on it
        raise CheckpointError(f"cannot checkpoint step {step} of {stream.name} (branch {branch!r}): the steps below "
                              f"{state.collected_below} are gone (collected by GC, or before the branch's fork); "
                              f"checkpoint a step from {state.collected_below} to {state.step}")
    if not entries:
        raise CheckpointError(f"cannot checkpoint step {step} of {stream.name} (branch {branch!r}): it was already "
                              "collected by lifecycle GC")
    builder = SnapshotBuilder(metadata)
    snapshot_id, sequence_number = builder.next_ids()
    planner = stream.manifest_planner(metadata)
    manifest = planner.existing(snapshot_id=snapshot_id, sequence_number=sequence_number, entries=entries)
    by_id = {s.snapshot_id: s for s in metadata.snapshots}  # snapshot_by_id scans the list: quadratic in retention
    source = next((sid for sid in ancestors(metadata, head.snapshot_id, len(by_id), by_id=by_id)
                   if StreamState.of(by_id[sid]).step == step
                   and _summary(by_id[sid]).get("lakestream.op", OP_APPEND) == OP_APPEND), None)
    manifest_list = planner.write_list([manifest], snapshot_id=snapshot_id, parent_id=source, sequence_number=sequence_number)
    rows = sum(e.data_file.record_count for e in entries)
    size = sum(e.data_file.file_size_in_bytes for e in entries)
    created_ms = int(time.time() * 1000)  # the anchor's timestamp_ms follows its parent's, which may be in the future
    # a fork of it starts a timeline here: the anchor and every snapshot committed after it name it (lineage.py)
    anchor_state = StreamState(op=OP_CHECKPOINT, step=step, producers={}, collected_below=step, timeline=snapshot_id)
    # its table state is the one step (totals given), listed as EXISTING: it adds and removes nothing
    snapshot = builder.snapshot(
        snapshot_id=snapshot_id, sequence_number=sequence_number,
        parent=by_id[source] if source is not None else None, manifest_list=manifest_list,
        operation=Operation.DELETE,
        totals={"total-records": str(rows), "total-data-files": str(len(entries)), "total-files-size": str(size),
                "total-delete-files": "0", "total-position-deletes": "0", "total-equality-deletes": "0"},
        properties=anchor_state.properties(**{KEY_CHECKPOINT: name, KEY_SOURCE_BRANCH: branch, KEY_CREATED_AT: str(created_ms),
                                              **({KEY_SOURCE_SNAPSHOT: str(source)} if source is not None else {})}),
    )
    builder.add(snapshot, tag=name)
    if planned is not None:
        planned.add(snapshot_id)
    result = Checkpoint(name=name, step=step, snapshot_id=snapshot_id,
                        created_at=datetime.fromtimestamp(created_ms / 1000, tz=timezone.utc), branch=branch,
                        source_snapshot_id=source, sequence_number=sequence_number)
    return Plan(
        tuple(builder.updates),
        (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref=name, snapshot_id=None),
         AssertRefSnapshotId(ref=branch, snapshot_id=head.snapshot_id)),
        result,
        planner.written,
        planner.settle,
    )


def _no_checkpoint(metadata: TableMetadata, name: str, *, doing: str, instead: str) -> CheckpointError:
    """The error for a ``name`` that marks no checkpoint; a tag or branch another engine made under it is named as
    such (stream.checkpoints() does not list it, so 'no checkpoint' alone reads like a typo)."""
    ref = metadata.refs.get(name) if isinstance(name, str) else None
    if ref is None or ref.snapshot_ref_type != SnapshotRefType.TAG or checkpoint_of(metadata, name) is not None:
        also = f" ({name!r} is a branch)" if ref is not None and ref.snapshot_ref_type == SnapshotRefType.BRANCH else ""
        return CheckpointError(f"no checkpoint named {name!r} to {doing}{also}; list them with stream.checkpoints()")
    snapshot = metadata.snapshot_by_id(ref.snapshot_id)
    step = StreamState.of(snapshot).step if snapshot is not None else "N"
    return CheckpointError(f"{name!r} is a tag another engine or a person made (at step {step}), not a lakestream "
                           f"checkpoint, so lakestream does not {doing.split()[0]} it; {instead.format(step=step)}")


def plan_release(metadata: TableMetadata, *, name: str, planned: list[int] | None = None) -> Plan[None] | Done[None]:
    """``planned``: the anchors this call planned to untag in earlier attempts (the function adds each one). When the
    tag is gone after one, an attempt whose outcome was unknown landed (or another release did it): ``Done``."""
    if planned and name not in metadata.refs:
        return Done(None)
    found = checkpoint_of(metadata, name)
    if found is None:
        raise _no_checkpoint(metadata, name, doing="release",
                             instead=f"remove it with the engine that made it (pyiceberg: table.manage_snapshots()"
                                     f".remove_tag({name!r}).commit(); Spark: ALTER TABLE ... DROP TAG)")
    if planned is not None:
        planned.append(found.snapshot_id)
    return Plan((RemoveSnapshotRefUpdate(ref_name=name),),
                (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref=name, snapshot_id=found.snapshot_id)),
                None, [], settle=_forget_if_lost(planned, found.snapshot_id))


def plan_fork(metadata: TableMetadata, *, name: str, branch: str, expected: Checkpoint | None = None,
              planned: list[Checkpoint] | None = None) -> Plan[Checkpoint] | Done[Checkpoint]:
    """The fork of checkpoint ``name`` as ``branch``; ``expected`` (a :class:`Checkpoint` the caller holds) must be
    the one the tag still marks: a checkpoint of another stream, or one released and made again under its name, would
    fork another step without a word.

    ``planned``: the checkpoints this call planned to fork in earlier attempts (the function adds each one). When
    ``branch`` is a branch whose lineage starts at one of their anchors, an attempt whose outcome was unknown (the
    reply lost) landed, and producers may have committed on it since: ``Done``."""
    if planned and isinstance(branch, str):
        ref = metadata.refs.get(branch)
        if ref is not None and ref.snapshot_ref_type == SnapshotRefType.BRANCH:
            by_id = {s.snapshot_id: s for s in metadata.snapshots}
            lineage = set(ancestors(metadata, ref.snapshot_id, len(by_id), by_id=by_id))
            for earlier in planned:
                if earlier.snapshot_id in lineage:
                    return Done(earlier)
    found = checkpoint_of(metadata, name)
    if found is None:
        raise _no_checkpoint(metadata, name, doing="fork from",
                             instead="make a checkpoint of its step with stream.checkpoint('NAME', step={step}) and "
                                     "fork that")
    if expected is not None and expected.snapshot_id != found.snapshot_id:
        raise CheckpointError(
            f"checkpoint {name!r} of this stream is at step {found.step} (snapshot {found.snapshot_id}), not the "
            f"checkpoint given (step {expected.step}, snapshot {expected.snapshot_id}): it is another stream's, or was "
            "released and made again since; pass this stream's checkpoint (stream.checkpoints()) or its name"
        )
    if not isinstance(branch, str) or not _NAME.fullmatch(branch) or branch in metadata.refs:
        raise CheckpointError(f"cannot create branch {branch!r}: the name is invalid or already used by a tag or branch")
    if planned is not None:
        planned.append(found)
    return Plan(
        (set_ref(branch, SnapshotRefType.BRANCH, found.snapshot_id),),
        (AssertTableUUID(uuid=metadata.table_uuid), AssertRefSnapshotId(ref=branch, snapshot_id=None),
         AssertRefSnapshotId(ref=name, snapshot_id=found.snapshot_id)),
        found,
        [],
        settle=_forget_if_lost(planned, found),
    )


def _forget_if_lost(planned: list[Any] | None, item: Any) -> Callable[[bool, Snapshot | None], None] | None:
    """A plan's ``settle`` that takes ``item`` out of ``planned`` again once its swap was lost (a definite failure:
    another process changed the ref first). Only an attempt whose outcome stayed unknown may have landed; one that lost
    did not, and the ref as the next attempt finds it is another process's (a concurrent release of the same tag, a
    fork of the same checkpoint as the same branch), refused as before."""
    if planned is None:
        return None

    def settle(landed: bool, _head: Snapshot | None) -> None:
        if not landed and item in planned:
            planned.remove(item)

    return settle
