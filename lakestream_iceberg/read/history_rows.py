"""The rows of the history views (:mod:`lakestream_iceberg.read.history`): plain functions over a stream's metadata,
each view one list of dicts, and the ``samples`` view's data.

Which facts each view's columns hold, and what expiry and GC take from them, is in the history module's docstring.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from pyiceberg.io import FileIO

from lakestream_iceberg.connect.integers import INT32_MAX, INT32_MIN, parse_int
from lakestream_iceberg.errors import LakestreamError, ReadError
from lakestream_iceberg.format.checkpoints import list_checkpoints
from lakestream_iceberg.format.checkpoints import utc_from_ms as _utc_from_ms
from lakestream_iceberg.format.expiry import ancestors
from lakestream_iceberg.format.index import is_packed, rank_of
from lakestream_iceberg.format.layout import RANK_COLUMN, STEP_COLUMN
from lakestream_iceberg.format.lineage import is_lakestream
from lakestream_iceberg.format.manifest_facts import stream_entry
from lakestream_iceberg.format.summary import (
    KEY_ATTEMPTS,
    KEY_COMMITTER,
    KEY_GROUP,
    KEY_OP,
    KEY_PRODUCER,
    KEY_SEQ,
    KEY_STEP,
    OP_APPEND,
    StreamState,
)
from lakestream_iceberg.read.reader import StepFiles, read_file

if TYPE_CHECKING:
    from pyiceberg.manifest import DataFile, ManifestEntry
    from pyiceberg.table.snapshots import Snapshot

    from lakestream_iceberg.format.table import StreamTable

__all__ = ["adder_rows", "batch_rows", "checkpoint_rows", "file_rows", "live_entries", "parse_data_path", "producer_rows",
           "read_samples", "snapshot_rows", "step_rows", "utc_from_ms"]


_DATA_PATH = re.compile(r"/data/(?P<producer>[^/]+)/(?P<seq>[0-9]+)-(?P<token>[^-/]+)-(?:r(?P<rank>[0-9]+)|packed)\.parquet$")
def parse_data_path(path: str) -> tuple[str, int, int | None] | None:
    """``(producer, seq, rank)`` from a data file path ``.../data/<producer>/<seq>-<token>-r<rank>.parquet`` (rank None:
    ``...-packed.parquet``, the packed layout's file of every rank); None for another path, or a seq or rank no long or
    int holds."""
    match = _DATA_PATH.search(path)
    if match is None:
        return None
    seq = parse_int(match["seq"], minimum=0)
    rank = None if match["rank"] is None else parse_int(match["rank"], minimum=0, maximum=INT32_MAX)
    if seq is None or rank is None and match["rank"] is not None:
        return None
    return match["producer"], seq, rank


def utc_from_ms(ms: int | float | None) -> datetime | None:
    """An Iceberg millisecond timestamp as an aware UTC datetime; None when absent or past what a datetime holds (the
    year 9999: another engine wrote microseconds, and every later snapshot is dated after it), never an error; the
    raw value stays in the snapshot's metadata."""
    return None if ms is None else _utc_from_ms(ms)


def _summary(snapshot: Snapshot | None) -> dict[str, str]:
    if snapshot is None or snapshot.summary is None:
        return {}
    return dict(snapshot.summary.additional_properties)


def _int(value: str | None, *, int32: bool = False) -> int | None:
    """A summary value as an int; None when absent or malformed (no integer as Iceberg reads one: ``" 5"``, ``"٥"``), a
    value its view's column (a long, or an int with ``int32``) cannot hold included (history shows what is there: the
    raw value stays in the ``summary`` column, and reading the head still raises ``CorruptStateError``)."""
    return parse_int(value, minimum=INT32_MIN, maximum=INT32_MAX) if int32 else parse_int(value)


# -- row builders (plain functions over the stream; each view is one Arrow table) -------------------------------------
def live_entries(stream: StreamTable, *, branch: str) -> list[ManifestEntry]:
    """The manifest entries of every live data file of the branch head, ordered by (step, rank); rows another engine
    added without a stream's partition (a null or non-positive step, a null rank) are no step's and not shown."""
    head = stream.head(branch=branch)
    if head is None:
        return []
    entries = [e for m in stream.cache.manifests(stream.io, head) for e in stream.cache.entries(stream.io, m)
               if stream_entry(e.data_file)]
    return sorted(entries, key=lambda e: (int(e.data_file.partition[0]), rank_of(e)))


def _file_row(data_file: DataFile, *, step: int, snapshot_id: int | None, world_size: int) -> dict[str, Any]:
    parsed = parse_data_path(data_file.file_path)
    packed = is_packed(data_file)
    return {
        "path": data_file.file_path, "step": step, "rank": None if packed else int(data_file.partition[1]),
        "ranks": world_size if packed else 1, "records": data_file.record_count, "bytes": data_file.file_size_in_bytes,
        "producer": parsed[0] if parsed else None, "seq": parsed[1] if parsed else None, "snapshot_id": snapshot_id,
    }


def file_rows(entries: Iterable[ManifestEntry], *, world_size: int) -> list[dict[str, Any]]:
    """One row per live data file (works for steps whose snapshot was expired: manifests keep the adding snapshot);
    ``rank`` is NULL for a packed layout's file, which holds every rank."""
    return [_file_row(e.data_file, step=int(e.data_file.partition[0]), snapshot_id=e.snapshot_id, world_size=world_size)
            for e in entries]


def snapshot_rows(stream: StreamTable, *, branch: str) -> list[dict[str, Any]]:
    """The branch head and its retained ancestors, oldest first."""
    metadata = stream.table.metadata
    head = stream.head(branch=branch)
    by_id = {s.snapshot_id: s for s in metadata.snapshots}  # snapshot_by_id scans the list: quadratic in retention
    rows = [_snapshot_row(snapshot_id, by_id.get(snapshot_id))
            for snapshot_id in ancestors(metadata, head.snapshot_id if head else None, len(by_id), by_id=by_id)]
    rows.reverse()
    return rows


def _snapshot_row(snapshot_id: int, snapshot: Snapshot | None) -> dict[str, Any]:
    full = summary = _summary(snapshot)
    if snapshot is not None and KEY_STEP in summary and not is_lakestream(snapshot):
        # another engine's snapshot that copied a lakestream snapshot's keys (naming that one in lakestream.snapshot-id,
        # or a cherry-pick's source-snapshot-id): it published no step, so none of its lakestream columns is read (the
        # copied step was joined to it in batches and tail); the ``summary`` column still shows every key
        summary = {k: v for k, v in summary.items() if not k.startswith("lakestream.")}
    operation = snapshot.summary.operation if snapshot and snapshot.summary else None
    return {
        "snapshot_id": snapshot_id, "parent_id": snapshot.parent_snapshot_id if snapshot else None,
        "committed_at": utc_from_ms(snapshot.timestamp_ms) if snapshot else None, "op": summary.get(KEY_OP),
        "operation": getattr(operation, "value", operation), "step": _int(summary.get(KEY_STEP)),
        "producer": summary.get(KEY_PRODUCER), "seq": _int(summary.get(KEY_SEQ)),
        "attempts": _int(summary.get(KEY_ATTEMPTS), int32=True),
        "committer": summary.get(KEY_COMMITTER, summary.get(KEY_PRODUCER)),
        "group_size": _int(summary.get(KEY_GROUP, "1" if KEY_STEP in summary else None), int32=True),
        "summary": json.dumps({"operation": getattr(operation, "value", operation), **full}, sort_keys=True),
    }


def adder_rows(stream: StreamTable, files: list[dict[str, Any]], snapshots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the retained snapshots that added live files but are not the branch's own ancestors: a fork's lineage
    starts at its checkpoint anchor, so the step the fork starts at was published by a snapshot of the source branch
    (still retained there, so ``batches`` joins it)."""
    own = {s["snapshot_id"] for s in snapshots}
    wanted = {f["snapshot_id"] for f in files if f["snapshot_id"] is not None} - own
    if not wanted:
        return []
    return [_snapshot_row(s.snapshot_id, s) for s in stream.table.metadata.snapshots if s.snapshot_id in wanted]


def batch_rows(files: list[dict[str, Any]], snapshots: list[dict[str, Any]],
               adders: Iterable[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """One row per step: the step's files (from manifests) joined with its snapshot when it is still retained
    (``adders``: retained snapshots outside the branch's lineage that added live files, see :func:`adder_rows`)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in files:
        by_step.setdefault(row["step"], []).append(row)
    published = {s["step"]: s for s in snapshots if s["op"] == OP_APPEND and s["step"] is not None}
    for adder in adders:  # joined only by the files it added, never a step the branch's own lineage published
        step = adder["step"]
        if adder["op"] == OP_APPEND and step is not None and step not in published and any(
                f["snapshot_id"] == adder["snapshot_id"] for f in by_step.get(step, [])):
            published[step] = adder
    out = []
    for step in sorted(set(by_step) | set(published)):
        snap = published.get(step)
        step_files = sorted(by_step.get(step, []), key=lambda r: r["rank"] or 0)
        first = step_files[0] if step_files else {}
        per_rank = all(f["rank"] is not None for f in step_files)  # packed: one file, per-rank figures in its footer
        samples = [f["records"] for f in step_files]
        sizes = [f["bytes"] for f in step_files]
        out.append({
            "step": step,
            "snapshot_id": snap["snapshot_id"] if snap else first.get("snapshot_id"),
            "parent_id": snap["parent_id"] if snap else None,
            "producer": snap["producer"] if snap else first.get("producer"),
            "seq": snap["seq"] if snap else first.get("seq"),
            "committed_at": snap["committed_at"] if snap else None,
            "attempts": snap["attempts"] if snap else None,
            "committer": snap["committer"] if snap else None,
            "group_size": snap["group_size"] if snap else None,
            "ranks": sum(f["ranks"] for f in step_files) if step_files else None,
            "samples": sum(samples) if step_files else None,
            "bytes": sum(sizes) if step_files else None,
            "samples_per_rank": samples if step_files and per_rank else None,
            "bytes_per_rank": sizes if step_files and per_rank else None,
            "retained": snap is not None,
            "collected": not step_files,
        })
    return out


def step_rows(stream: StreamTable, steps: Iterable[int], *, branch: str) -> list[dict[str, Any]]:
    """``batches`` rows of a few steps without reading every manifest (used by ``lakestream tail``).

    The stream's current metadata is used as is (``wait_for`` and ``state`` refresh it); ``snapshot_id`` is NULL for a
    step whose snapshot was already expired.
    """
    wanted = list(steps)
    try:  # a collected step has no files whatever a reload shows: locate would reload the table to say so, each time
        collected_below = stream.branch_state(branch=branch).collected_below
    except LakestreamError:  # e.g. another engine's head: locate reloads the view and says what is wrong
        collected_below = 1
    files: list[dict[str, Any]] = []
    for step in wanted:
        if step < collected_below:
            continue
        try:
            located = stream.locate(step, branch=branch)
        except ReadError:
            continue
        files += [_file_row(f, step=step, snapshot_id=None, world_size=stream.world_size) for f in located]
    keep = set(wanted)
    snapshots = [s for s in snapshot_rows(stream, branch=branch) if s["step"] in keep]
    return [row for row in batch_rows(files, snapshots) if row["step"] in keep]


def producer_rows(state: StreamState, batches: list[dict[str, Any]], io: FileIO) -> list[dict[str, Any]]:
    """One row per producer the head knows, idle (compacted) ones included; ``active``: still in the head's summary."""
    commits: dict[str, int] = {}
    for row in batches:
        if row["producer"] is not None:
            commits[row["producer"]] = commits.get(row["producer"], 0) + 1
    return [
        {"producer": pid, "last_seq": p.seq, "last_step": p.step, "last_snapshot_id": p.snapshot_id,
         "commits": commits.get(pid, 0), "lag": state.step - p.step, "active": pid in state.producers}
        for pid, p in sorted(state.all_producers(io).items())
    ]


class _Pins:
    """One branch's live files ordered by step, with running totals from each file on, so what a checkpoint pins is
    a bisection, not a pass over every file: with a checkpoint every few steps the ``checkpoints`` view cost
    O(tags x steps) (1,000 tags over 10,000 steps: seconds for every ``history``)."""

    def __init__(self, stream: StreamTable, entries: list[ManifestEntry]) -> None:
        self._stream = stream
        files = sorted((e.data_file for e in entries), key=lambda f: int(f.partition[0]))
        self.steps = [int(f.partition[0]) for f in files]
        self.live = set(self.steps)
        self.paths = {f.file_path for f in files}
        n = len(files)
        self.bytes_from, self.steps_from = [0] * (n + 1), [0] * (n + 1)  # bytes and distinct steps of files[i:]
        for i in range(n - 1, -1, -1):
            self.bytes_from[i] = self.bytes_from[i + 1] + files[i].file_size_in_bytes
            self.steps_from[i] = self.steps_from[i + 1] + (i == n - 1 or self.steps[i] != self.steps[i + 1])
        self._outside: dict[str, list[DataFile]] = {}  # per manifest: its stream files the branch no longer holds

    def outside(self, anchor: Snapshot | None) -> list[DataFile]:
        """The anchor's files that are not live on the branch (anchors share manifests: each is read once)."""
        out: list[DataFile] = []
        if anchor is None:
            return out
        cache, io = self._stream.cache, self._stream.io
        for manifest in cache.manifests(io, anchor):
            found = self._outside.get(manifest.manifest_path)
            if found is None:
                found = self._outside[manifest.manifest_path] = [
                    e.data_file for e in cache.entries(io, manifest)
                    if stream_entry(e.data_file) and e.data_file.file_path not in self.paths]
            out += found
        return out

    def figures(self, extra: list[DataFile], low: int, high: int | None) -> tuple[int, int, int]:
        """Steps, files and bytes of the live files at steps ``low`` to ``high`` (exclusive; None: no bound) and of
        ``extra`` below ``high``."""
        i = bisect.bisect_left(self.steps, low)
        j = len(self.steps) if high is None else max(i, bisect.bisect_left(self.steps, high))
        extra = [f for f in extra if high is None or int(f.partition[0]) < high]
        shared = {s for f in extra if low <= (s := int(f.partition[0])) and s in self.live}  # counted with the live
        steps = self.steps_from[i] - self.steps_from[j] + len({int(f.partition[0]) for f in extra} - shared)
        return steps, j - i + len(extra), self.bytes_from[i] - self.bytes_from[j] + sum(f.file_size_in_bytes for f in extra)


def checkpoint_rows(stream: StreamTable, entries_by_branch: dict[str, list[ManifestEntry]] | None = None) -> list[dict[str, Any]]:
    """Every checkpoint (all branches) and what it pins on its branch.

    A checkpoint at step S is a tag on an anchor snapshot holding step S's files; resuming from it reads S+1, S+2, ...
    from its branch, and lifecycle GC collects only the steps older than the oldest retained checkpoint of a branch.
    So a checkpoint *pins* steps S..head of its branch (``pinned_*``), and releasing it would let GC collect only
    what no other checkpoint pins (``exclusive_*``: the steps from S up to the next newer checkpoint on the branch,
    non-zero only for the oldest one, and zero for a branch's only checkpoint: GC collects nothing on a branch without
    a checkpoint).
    """
    metadata = stream.table.metadata
    given = dict(entries_by_branch or {})
    checkpoints = list_checkpoints(metadata)
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    steps_of: dict[str, list[int]] = {}  # per branch, its checkpoints' steps in order (list_checkpoints sorts by step)
    for ckpt in checkpoints:
        steps_of.setdefault(ckpt.branch, []).append(ckpt.step)
    pins: dict[str, _Pins] = {}
    rows = []
    for ckpt in checkpoints:
        if ckpt.branch not in pins:
            entries = given[ckpt.branch] if ckpt.branch in given else (
                live_entries(stream, branch=ckpt.branch) if ckpt.branch in metadata.refs else [])
            pins[ckpt.branch] = _Pins(stream, entries)
        branch = pins[ckpt.branch]
        extra = branch.outside(by_id.get(ckpt.snapshot_id))
        pinned_steps, pinned_files, pinned_bytes = branch.figures(extra, ckpt.step, None)
        same_branch = steps_of[ckpt.branch]
        oldest = same_branch[0]
        newer = bisect.bisect_right(same_branch, ckpt.step)
        upper = same_branch[newer] if newer < len(same_branch) else None
        # Releasing the oldest lets GC collect up to the next newer one; releasing the only one frees nothing (a branch
        # without a checkpoint loses nothing, lifecycle.gc)
        exclusive = (0, 0, 0) if ckpt.step != oldest or upper is None or bisect.bisect_right(same_branch, oldest) > 1 \
            else branch.figures(extra, ckpt.step, upper)
        rows.append({
            "name": ckpt.name, "branch": ckpt.branch, "step": ckpt.step, "snapshot_id": ckpt.snapshot_id,
            "source_snapshot_id": ckpt.source_snapshot_id, "created_at": ckpt.created_at,
            "pinned_steps": pinned_steps, "pinned_files": pinned_files, "pinned_bytes": pinned_bytes,
            "exclusive_steps": exclusive[0], "exclusive_bytes": exclusive[2],
        })
    return rows


def read_samples(
    stream: StreamTable, entries: Iterable[ManifestEntry], *, steps: Iterable[int] | None = None, progress: bool = False
) -> pa.Table:
    """The committed samples of ``steps`` (all live steps when None) with ``_step`` and ``_rank`` columns.

    Each data file is read once (a per-rank file: one rank's shard; a packed file: every rank's, ``_rank`` stored in it);
    the files come from ``entries`` (see :func:`live_entries`) so a range costs no per-step manifest lookup.
    """
    rank_field = pa.field(RANK_COLUMN, pa.int32())
    schema = stream.payload_arrow_schema.append(pa.field(STEP_COLUMN, pa.int64())).append(rank_field)
    wanted = None if steps is None else set(steps)
    work = [e.data_file for e in entries if wanted is None or int(e.data_file.partition[0]) in wanted]
    iterator: Iterable[DataFile] = work
    if progress and work:
        from tqdm.auto import tqdm

        iterator = tqdm(work, desc="reading samples", unit="shard", leave=False, disable=None)  # terminals only
    parts = []
    for data_file in iterator:
        step = int(data_file.partition[0])
        if is_packed(data_file):  # packed: every rank's rows, read (and checked) as a reader reads them
            with StepFiles(stream.io, [data_file], world_size=stream.world_size, packed=True,
                           schema=stream.payload_arrow_schema) as packed:
                counts = packed.counts
                shard = packed.read_ranges([(r, 0, n) for r, n in enumerate(counts)])
            shard = shard.append_column(pa.field(STEP_COLUMN, pa.int64()), pa.array([step] * shard.num_rows, pa.int64()))
            ranks = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
            parts.append(shard.append_column(rank_field, pa.array(ranks, pa.int32())))
            continue
        rank = int(data_file.partition[1])
        shard = read_file(stream.io, data_file, stream.payload_arrow_schema)
        shard = shard.append_column(pa.field(STEP_COLUMN, pa.int64()), pa.array([step] * shard.num_rows, pa.int64()))
        shard = shard.append_column(rank_field, pa.array([rank] * shard.num_rows, pa.int32()))
        parts.append(shard)
    return pa.concat_tables(parts) if parts else schema.empty_table()
