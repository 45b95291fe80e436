"""The Arrow schemas of the history views (:mod:`lakestream_iceberg.read.history`): the columns DuckDB and the CLI
show, one schema per view."""

from __future__ import annotations

import pyarrow as pa

__all__ = ["BATCHES_SCHEMA", "CHECKPOINTS_SCHEMA", "FILES_SCHEMA", "PRODUCERS_SCHEMA", "SNAPSHOTS_SCHEMA"]

_TS = pa.timestamp("ms", tz="UTC")

FILES_SCHEMA = pa.schema([
    ("path", pa.string()), ("step", pa.int64()), ("rank", pa.int32()), ("records", pa.int64()), ("bytes", pa.int64()),
    ("producer", pa.string()), ("seq", pa.int64()), ("snapshot_id", pa.int64()),
])
SNAPSHOTS_SCHEMA = pa.schema([
    ("snapshot_id", pa.int64()), ("parent_id", pa.int64()), ("committed_at", _TS), ("op", pa.string()),
    ("operation", pa.string()), ("step", pa.int64()), ("producer", pa.string()), ("seq", pa.int64()),
    ("attempts", pa.int32()), ("committer", pa.string()), ("group_size", pa.int32()), ("summary", pa.string()),
])
BATCHES_SCHEMA = pa.schema([
    ("step", pa.int64()), ("snapshot_id", pa.int64()), ("parent_id", pa.int64()), ("producer", pa.string()),
    ("seq", pa.int64()), ("committed_at", _TS), ("attempts", pa.int32()), ("committer", pa.string()),
    ("group_size", pa.int32()), ("ranks", pa.int32()), ("samples", pa.int64()),
    ("bytes", pa.int64()), ("samples_per_rank", pa.list_(pa.int64())), ("bytes_per_rank", pa.list_(pa.int64())),
    ("retained", pa.bool_()), ("collected", pa.bool_()),
])
PRODUCERS_SCHEMA = pa.schema([
    ("producer", pa.string()), ("last_seq", pa.int64()), ("last_step", pa.int64()), ("last_snapshot_id", pa.int64()),
    ("commits", pa.int64()), ("lag", pa.int64()), ("active", pa.bool_()),
])
CHECKPOINTS_SCHEMA = pa.schema([
    ("name", pa.string()), ("branch", pa.string()), ("step", pa.int64()), ("snapshot_id", pa.int64()),
    ("source_snapshot_id", pa.int64()), ("created_at", _TS), ("pinned_steps", pa.int64()), ("pinned_files", pa.int64()),
    ("pinned_bytes", pa.int64()), ("exclusive_steps", pa.int64()), ("exclusive_bytes", pa.int64()),
])
