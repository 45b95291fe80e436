"""How a stream is laid out as a plain Iceberg table, and the ``lakestream.*`` table properties that configure it.

A stream's table schema is the payload schema plus two columns, ``_step`` (long) and ``_rank`` (int). ``_step`` is an
identity partition field and is never stored in the data files: the manifest entry of a file carries it in its
partition tuple, so the step is decided at commit time, after the compare-and-swap is won, and a commit that loses the
race is rebuilt with a new step without rewriting any data. Where ``_rank`` lives depends on the stream's layout
(``lakestream.layout``, fixed when the stream is created):

* ``per-rank``: ``_rank`` is a second identity partition field. A rank's shard of one step is exactly one Parquet file
  (one row group) holding the payload columns only; its manifest entry carries ``(_step, _rank)``. A rank reads exactly
  its own bytes in one GET, and a step costs ``world_size`` data files (PUTs) and manifest entries.
* ``packed``: the partition spec is ``_step`` alone and a step is one Parquet file holding every rank's rows in rank
  order, ``_rank`` stored as a column (see :mod:`lakestream_iceberg.format.packed`). A step costs one PUT and one
  manifest entry whatever the world size; a rank reads the file's footer and the row groups holding its rows (range
  reads). Consecutive ranks share a row group of up to ``lakestream.layout.packed.row-group-bytes`` (256 KiB), which
  keeps the footer small when shards are tiny (a rank then reads its neighbours' rows of the same row group too).

Either way the table is a plain Iceberg table: Iceberg's column-projection rules (spec: "return the value from
partition metadata if an identity transform exists for the field") fill partition-only columns in, so
``table.scan().to_arrow()`` returns every retained sample with its step and rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform

from lakestream_iceberg.errors import ConfigError, RankError, SchemaMismatchError, ShardCountError
from lakestream_iceberg.format.checks import check_int

STEP_COLUMN = "_step"
RANK_COLUMN = "_rank"
RESERVED_COLUMNS = frozenset({STEP_COLUMN, RANK_COLUMN})

FORMAT_VERSION = "1"

# Table properties. Dashed keys under ``lakestream.``, like Iceberg's own ``commit.retry.num-retries``.
PROP_VERSION = "lakestream.format-version"
PROP_WORLD_SIZE = "lakestream.world-size"
PROP_RETAIN_SNAPSHOTS = "lakestream.snapshots.retain-last"
PROP_RETAIN_MAX = "lakestream.snapshots.retain-max"
# Iceberg's own snapshot-retention properties, honoured by the expiry every commit does in passing (when set)
PROP_MAX_SNAPSHOT_AGE_MS = "history.expire.max-snapshot-age-ms"
PROP_MIN_SNAPSHOTS_TO_KEEP = "history.expire.min-snapshots-to-keep"
PROP_MERGE_FANOUT = "lakestream.manifest.merge-fanout"
PROP_MAX_MERGE_ENTRIES = "lakestream.manifest.max-merge-entries"
PROP_MANIFEST_CACHE_BYTES = "lakestream.manifest.cache-bytes"
PROP_COMMIT_TIMEOUT_MS = "lakestream.commit.timeout-ms"
PROP_COMMIT_MAX_ATTEMPTS = "lakestream.commit.max-attempts"
PROP_GC_GRACE_MS = "lakestream.gc.grace-period-ms"
PROP_IO_RETRY_TIMEOUT_MS = "lakestream.io.retry-timeout-ms"
PROP_GROUP_COMMIT = "lakestream.commit.group.enabled"
PROP_GROUP_MAX_BATCHES = "lakestream.commit.group.max-batches"
PROP_GROUP_STAGING = "lakestream.commit.group.staging"
PROP_LAYOUT = "lakestream.layout"
PROP_PACKED_ROW_GROUP_BYTES = "lakestream.layout.packed.row-group-bytes"

LAYOUT_PER_RANK = "per-rank"
LAYOUT_PACKED = "packed"
LAYOUTS = (LAYOUT_PER_RANK, LAYOUT_PACKED)

# Where group commit's staged intents are kept (write/intent_store.py): "catalog" (rows of a SQL catalog's database),
# "storage" (files under the table's data/_staging/), "auto" (the catalog where it has an intent table, else storage)
STAGING_AUTO, STAGING_CATALOG, STAGING_STORAGE = "auto", "catalog", "storage"
STAGINGS = (STAGING_AUTO, STAGING_CATALOG, STAGING_STORAGE)
# Stream.create picks the packed layout from this world size on, unless lakestream.layout is given. Measured
# (benchmarks/vs_kafka.py, W=8, one run per layout): packed ingests 1 MiB batches 2.1x (1 producer) to 2.2x (8)
# faster and 16 MiB batches from 8 producers 2.9x faster than per-rank, whose W files and manifest entries per step
# dominate the commit; below 8 ranks the difference is small and per-rank reads are exact (docs/concepts.md, "Layouts").
PACKED_FROM_WORLD_SIZE = 8

# The GC grace rule: lakestream.gc.grace-period-ms >= GRACE_PER_COMMIT_TIMEOUT x lakestream.commit.timeout-ms. A staged
# batch is publishable while younger than half the grace period (write/staging.py), and the commit that publishes it
# may take up to the commit timeout: its files are then at most grace/2 + timeout <= grace old, so GC (which deletes
# unreferenced files only once older than the grace period) cannot delete them under a commit in flight.
GRACE_PER_COMMIT_TIMEOUT = 2


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """Stream-wide settings, read from the table's ``lakestream.*`` properties.

    Attributes:
        world_size: Number of ranks (shards) in every global batch.
        retain_snapshots: Snapshots of each branch kept in table metadata by normal commits (older untagged ones are
            expired in the same commit, so commit cost does not grow with history; their data stays in the table).
        retain_max_age_ms: Snapshots of a branch younger than this are kept too (Iceberg's
            ``history.expire.max-snapshot-age-ms``; unset: 0, off), so a streaming reader of another engine whose
            trigger interval is shorter finds the snapshot it stopped at; at most ``retain_max`` per branch.
        retain_max: The most snapshots per branch that ``retain_max_age_ms`` keeps: the bound on metadata.json.
        merge_fanout: How many manifests of one level are merged into one of the next level (bounds the manifest list).
        max_merge_entries: No merge rewrites more entries than this (bounds the worst commit).
        manifest_cache_bytes: The byte bound (an estimate of the Python objects) of the process-wide cache of manifest
            lists and manifest entries that this stream's producers and readers use
            (:class:`~lakestream_iceberg.format.manifests.ManifestCache`): a process's memory does not grow with the
            steps the table holds. Streams with the same value share one cache per process. What a merge or a lookup
            needs and the cache no longer holds is read from storage again; 0 keeps nothing.
        commit_timeout_ms: Wall-clock budget of one ``commit()`` call, retries included.
        commit_max_attempts: Attempt budget of one ``commit()`` call.
        gc_grace_ms: Unreferenced files younger than this are never deleted (a producer may still be committing them).
            Must be at least ``GRACE_PER_COMMIT_TIMEOUT`` (2) x ``commit_timeout_ms`` (the GC grace rule, see
            ``GRACE_PER_COMMIT_TIMEOUT``); a stream whose properties break it is refused (:class:`ConfigError`).
        io_retry_timeout_ms: How long data-file writes and reads retry a transient storage failure (S3 restarting,
            connection refused, 5xx) before the error propagates.
        group_commit: Group commit (see :mod:`lakestream_iceberg.write.staging`): a producer that is not alone stages its
            batch, and one compare-and-swap publishes every staged batch, each as its own snapshot.
        group_max_batches: The most batches one group commit publishes (bounds one commit's critical section).
        group_staging: Where staged intents are kept: ``catalog`` (rows of the SQL catalog's database; SQLite or
            PostgreSQL ``SqlCatalog`` only) or ``storage`` (files under ``data/_staging/``). ``auto`` (the default of
            ``Stream.create``) is resolved when the stream is created: ``catalog`` where the catalog can keep them,
            ``storage`` elsewhere, and the result is stored, so every producer uses the same. A stream without the
            property (created by an earlier release) stages files.
        layout: ``per-rank`` (one data file per rank and step) or ``packed`` (one data file per step); see the module
            docstring. Fixed when the stream is created (a table created before layouts existed is ``per-rank``).
        packed_row_group_bytes: Packed layout: consecutive ranks share a row group while it holds at most this many
            bytes (of Arrow data), so a rank reads less than this beyond its own rows; a rank larger than this is a row
            group alone.
    """

    world_size: int
    retain_snapshots: int = 8
    retain_max_age_ms: int = 0
    retain_max: int = 2_000
    merge_fanout: int = 16
    max_merge_entries: int = 4096
    manifest_cache_bytes: int = 64 << 20
    commit_timeout_ms: int = 300_000
    commit_max_attempts: int = 1_000
    gc_grace_ms: int = 3_600_000
    io_retry_timeout_ms: int = 120_000
    group_commit: bool = True
    group_max_batches: int = 32
    group_staging: str = STAGING_AUTO
    layout: str = LAYOUT_PER_RANK
    packed_row_group_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        for name, (key, minimum) in _INT_FIELDS.items():
            object.__setattr__(self, name, check_int(getattr(self, name), what=f"{key} ({name})", minimum=minimum))
        if not isinstance(self.group_commit, bool):
            raise ConfigError(f"{PROP_GROUP_COMMIT} (group_commit) must be a bool, got {self.group_commit!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"{PROP_LAYOUT} (layout) must be one of {', '.join(map(repr, LAYOUTS))}, got {self.layout!r}")
        if self.group_staging not in STAGINGS:
            raise ConfigError(f"{PROP_GROUP_STAGING} (group_staging) must be one of {', '.join(map(repr, STAGINGS))}, "
                              f"got {self.group_staging!r}")
        need = GRACE_PER_COMMIT_TIMEOUT * self.commit_timeout_ms
        if self.gc_grace_ms < need:
            raise ConfigError(
                f"table property {PROP_GC_GRACE_MS}={self.gc_grace_ms} is shorter than {GRACE_PER_COMMIT_TIMEOUT} x "
                f"{PROP_COMMIT_TIMEOUT_MS}={self.commit_timeout_ms}: GC could delete the files of a batch that a commit "
                f"may still publish (the GC grace rule, see docs/guide/retention.md). Set {PROP_GC_GRACE_MS} to at least {need} or "
                f"{PROP_COMMIT_TIMEOUT_MS} to at most {self.gc_grace_ms // GRACE_PER_COMMIT_TIMEOUT} (an existing "
                "table: with pyiceberg, table.transaction().set_properties({...}).commit_transaction())"
            )

    @classmethod
    def from_properties(cls, properties: Mapping[str, str]) -> StreamConfig:
        defaults = cls(world_size=1)

        def as_int(key: str, default: int, minimum: int) -> int:
            raw = properties.get(key)
            if raw is None:
                return default
            try:
                value = int(raw)
            except (TypeError, ValueError):
                raise ConfigError(f"table property {key}={raw!r} is not an integer; set it with an integer value") from None
            if value < minimum:
                raise ConfigError(f"table property {key}={value} must be >= {minimum}")
            return value

        def as_bool(key: str, default: bool) -> bool:
            raw = properties.get(key)
            if raw is None:
                return default
            if raw.strip().lower() not in ("true", "false"):
                raise ConfigError(f"table property {key}={raw!r} is not a boolean; set it to 'true' or 'false'")
            return raw.strip().lower() == "true"

        if PROP_WORLD_SIZE not in properties:
            raise ConfigError(f"table property {PROP_WORLD_SIZE} is missing; was the stream created with Stream.create()?")
        ints = {name: as_int(key, getattr(defaults, name), minimum) for name, (key, minimum) in _INT_FIELDS.items()}
        # Iceberg's history.expire.min-snapshots-to-keep raises the count kept (never lowers lakestream's own)
        ints["retain_snapshots"] = max(ints["retain_snapshots"], as_int(PROP_MIN_SNAPSHOTS_TO_KEEP, 0, 1))
        layout = properties.get(PROP_LAYOUT, LAYOUT_PER_RANK)
        if layout not in LAYOUTS:
            raise ConfigError(f"table property {PROP_LAYOUT}={layout!r} is not a layout; use one of {', '.join(LAYOUTS)}")
        # absent: a stream created by a release that staged files only; its producers may still run that release
        staging = properties.get(PROP_GROUP_STAGING, STAGING_STORAGE)
        if staging not in STAGINGS:
            raise ConfigError(f"table property {PROP_GROUP_STAGING}={staging!r} is not a staging place; use one of "
                              f"{', '.join(STAGINGS)}")
        return cls(**ints, group_commit=as_bool(PROP_GROUP_COMMIT, defaults.group_commit), layout=layout,
                   group_staging=staging)

    @property
    def packed(self) -> bool:
        return self.layout == LAYOUT_PACKED

    def to_properties(self) -> dict[str, str]:
        return {
            PROP_VERSION: FORMAT_VERSION,
            PROP_WORLD_SIZE: str(self.world_size),
            PROP_RETAIN_SNAPSHOTS: str(self.retain_snapshots),
            PROP_RETAIN_MAX: str(self.retain_max),
            **({PROP_MAX_SNAPSHOT_AGE_MS: str(self.retain_max_age_ms)} if self.retain_max_age_ms else {}),
            PROP_MERGE_FANOUT: str(self.merge_fanout),
            PROP_MAX_MERGE_ENTRIES: str(self.max_merge_entries),
            PROP_MANIFEST_CACHE_BYTES: str(self.manifest_cache_bytes),
            PROP_COMMIT_TIMEOUT_MS: str(self.commit_timeout_ms),
            PROP_COMMIT_MAX_ATTEMPTS: str(self.commit_max_attempts),
            PROP_GC_GRACE_MS: str(self.gc_grace_ms),
            PROP_IO_RETRY_TIMEOUT_MS: str(self.io_retry_timeout_ms),
            PROP_GROUP_COMMIT: str(self.group_commit).lower(),
            PROP_GROUP_MAX_BATCHES: str(self.group_max_batches),
            PROP_GROUP_STAGING: self.group_staging,
            PROP_LAYOUT: self.layout,
            PROP_PACKED_ROW_GROUP_BYTES: str(self.packed_row_group_bytes),
            # Exactly one retry owner for lakestream's commits: its commit loop, which never commits through pyiceberg's
            # retrying Transaction.commit_transaction. Iceberg's commit.retry.* stay at their defaults, so another
            # engine's maintenance commit (Spark's expire_snapshots) retries when it loses to a producer's.
            # Spark's expire_snapshots keeps this many snapshots by default: with 2, its usual run after a
            # rewrite_manifests keeps the lakestream snapshot below Spark's (docs/interop.md).
            PROP_MIN_SNAPSHOTS_TO_KEEP: "2",
            # Old metadata.json files are dropped by the commit loop once this many newer versions exist.
            "write.metadata.previous-versions-max": "16",
            "write.metadata.delete-after-commit.enabled": "true",
        }


_INT_FIELDS: dict[str, tuple[str, int]] = {  # StreamConfig field -> (table property, minimum)
    "world_size": (PROP_WORLD_SIZE, 1),
    "retain_snapshots": (PROP_RETAIN_SNAPSHOTS, 2),
    "retain_max_age_ms": (PROP_MAX_SNAPSHOT_AGE_MS, 0),
    "retain_max": (PROP_RETAIN_MAX, 2),
    "merge_fanout": (PROP_MERGE_FANOUT, 2),
    "max_merge_entries": (PROP_MAX_MERGE_ENTRIES, 1),
    "manifest_cache_bytes": (PROP_MANIFEST_CACHE_BYTES, 0),
    "commit_timeout_ms": (PROP_COMMIT_TIMEOUT_MS, 1),
    "commit_max_attempts": (PROP_COMMIT_MAX_ATTEMPTS, 1),
    "gc_grace_ms": (PROP_GC_GRACE_MS, 0),
    "io_retry_timeout_ms": (PROP_IO_RETRY_TIMEOUT_MS, 0),
    "group_max_batches": (PROP_GROUP_MAX_BATCHES, 1),
    "packed_row_group_bytes": (PROP_PACKED_ROW_GROUP_BYTES, 1),
}


def table_arrow_schema(payload: pa.Schema) -> pa.Schema:
    """The Arrow schema of the Iceberg table: the payload plus ``_step`` and ``_rank``."""
    if not isinstance(payload, pa.Schema) or len(payload) == 0:
        raise SchemaMismatchError(f"a stream's payload schema is a pyarrow Schema with at least one column, got {payload!r}")
    clash = RESERVED_COLUMNS.intersection(payload.names)
    if clash:
        raise SchemaMismatchError(
            f"payload column(s) {sorted(clash)} are reserved by lakestream (step and rank are added for you); rename them"
        )
    if len(set(payload.names)) != len(payload.names):
        raise SchemaMismatchError("payload schema has duplicate column names; give every column a unique name")
    plain = pa.schema([pa.field(f.name, f.type, nullable=f.nullable) for f in payload])
    # Optional, not required: pyiceberg fills partition-projected values only into optional fields (0.12).
    return plain.append(pa.field(STEP_COLUMN, pa.int64())).append(pa.field(RANK_COLUMN, pa.int32()))


def partition_spec(schema: Schema, layout: str = LAYOUT_PER_RANK) -> PartitionSpec:
    """Identity partitions on ``_step`` and (per-rank layout) ``_rank``: one data file per (step, rank), or per step."""
    step = PartitionField(source_id=schema.find_field(STEP_COLUMN).field_id, field_id=1000, transform=IdentityTransform(),
                          name=STEP_COLUMN)
    if layout == LAYOUT_PACKED:
        return PartitionSpec(step)
    return PartitionSpec(
        step,
        PartitionField(source_id=schema.find_field(RANK_COLUMN).field_id, field_id=1001, transform=IdentityTransform(), name=RANK_COLUMN),
    )


def layout_of_spec(spec: PartitionSpec, schema: Schema) -> str | None:
    """The layout a table's partition spec implements (None: neither, the table was changed by hand)."""
    sources = [(schema.find_column_name(f.source_id), type(f.transform)) for f in spec.fields]
    if sources == [(STEP_COLUMN, IdentityTransform), (RANK_COLUMN, IdentityTransform)]:
        return LAYOUT_PER_RANK
    if sources == [(STEP_COLUMN, IdentityTransform)]:
        return LAYOUT_PACKED
    return None


def payload_schema(schema: Schema) -> Schema:
    """The Iceberg schema of the data files: the table schema without the partition-only columns."""
    return schema.select(*[f.name for f in schema.fields if f.name not in RESERVED_COLUMNS])


def file_schema(schema: Schema, layout: str, payload: pa.Schema | None = None, *, stream: str = "the stream") -> Schema:
    """The Iceberg schema of a layout's data files: the payload, and ``_rank`` as the last column when packed.

    With ``payload`` (the stream's payload schema, ``lakestream.arrow-schema``), the payload columns are those of the
    stream, whatever other columns the table's schema gained since (schema evolution by another engine): producers
    keep writing the stream's columns, and Iceberg readers return nulls for an added optional column.

    Raises:
        SchemaMismatchError: The table's schema no longer holds a payload column (dropped or renamed), changed its
            type to one the payload cannot be written as, or gained a required column lakestream cannot write.
    """
    if payload is not None:
        _check_evolution(schema, payload, stream)
        names = set(payload.names)
    else:
        names = {f.name for f in schema.fields if f.name not in RESERVED_COLUMNS}
    if layout == LAYOUT_PACKED:
        names.add(RANK_COLUMN)
    return schema.select(*[f.name for f in schema.fields if f.name in names])


def _check_evolution(schema: Schema, payload: pa.Schema, stream: str) -> None:
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    fix = ("lakestream producers write the stream's payload schema (table property lakestream.arrow-schema); revert the "
           "change, or write the new columns to a new stream")
    by_name = {f.name: f for f in schema.fields}
    for field in payload:
        found = by_name.get(field.name)
        if found is None:
            raise SchemaMismatchError(f"the table schema of {stream} no longer has the payload column {field.name!r} "
                                      f"(dropped or renamed by another engine): {fix}")
        target = schema_to_pyarrow(Schema(found), include_field_ids=False).field(0).type
        try:
            pa.schema([field]).empty_table().cast(pa.schema([pa.field(field.name, target)]))
        except (pa.ArrowException, ValueError, TypeError):
            raise SchemaMismatchError(f"the table schema of {stream} changed the type of payload column {field.name!r} "
                                      f"from {field.type} to {found.field_type}, which it cannot be written as: {fix}") from None
    added = [f.name for f in schema.fields if f.required and f.name not in RESERVED_COLUMNS and f.name not in payload.names]
    if added:
        raise SchemaMismatchError(f"the table schema of {stream} gained required column(s) {added} that lakestream "
                                  f"producers cannot write (an optional column is fine: readers see nulls): {fix}")


def payload_names(schema: Schema) -> list[str]:
    return [f.name for f in schema.fields if f.name not in RESERVED_COLUMNS]


def check_shards(shards: object, *, world_size: int, expected: pa.Schema) -> list[pa.Table]:
    """Validate a global batch before anything is written; raise a :class:`BatchError` naming the fix."""
    return check_batch(shards, world_size=world_size, expected=expected)[0]


def check_batch(shards: object, *, world_size: int, expected: pa.Schema) -> tuple[list[pa.Table], pa.Table | None]:
    """:func:`check_shards`, and the shards concatenated in rank order when the common case checked them in one go
    (every shard a ``pa.Table`` of one schema; else None): the packed layout's writer starts from it instead of
    concatenating the ranks a second time."""
    if isinstance(shards, (pa.Table, pa.RecordBatch)) or not isinstance(shards, (list, tuple)):
        raise ShardCountError(
            f"shards must be a list of {world_size} pyarrow Tables (one per rank), got {type(shards).__name__}"
        )
    if len(shards) != world_size:
        raise ShardCountError(
            f"got {len(shards)} shards but the stream's world size is {world_size}; pass exactly one pyarrow Table per "
            f"rank (an empty table for a rank with no samples)"
        )
    nested = [_has_required(want.type) for want in expected]  # once per batch, not per rank
    fields = list(expected)
    to_scan = [i for i, want in enumerate(fields) if not want.nullable or nested[i]]  # columns whose values need a look
    if (whole := _all_valid(shards, expected, fields, to_scan, nested)) is not None:
        return list(shards), whole
    out: list[pa.Table] = []
    checked: list[pa.Schema] = []  # shard schemas whose names and types matched (most batches: one)
    for rank, shard in enumerate(shards):
        if isinstance(shard, pa.RecordBatch):
            shard = pa.Table.from_batches([shard])
        if not isinstance(shard, pa.Table):
            raise SchemaMismatchError(f"shard for rank {rank} is a {type(shard).__name__}, expected a pyarrow Table")
        schema = shard.schema
        known = any(schema.equals(seen) for seen in checked)
        if not known:
            if schema.names != expected.names:
                raise SchemaMismatchError(
                    f"shard for rank {rank} has columns {schema.names}, the stream expects {expected.names} (same order)"
                )
            for field, want in zip(schema, fields):
                if not field.type.equals(want.type):
                    raise SchemaMismatchError(
                        f"shard for rank {rank}: column {field.name!r} is {field.type}, the stream expects {want.type}; "
                        f"cast it (e.g. table.cast(schema)) before committing"
                    )
        for i in to_scan if shard.num_rows else ():
            name, column = fields[i].name, shard.column(i)
            if not fields[i].nullable and column.null_count:
                raise SchemaMismatchError(f"shard for rank {rank}: column {name!r} is required but has nulls")
            if nested[i]:
                for chunk in column.chunks:
                    if (path := _required_null(chunk, name)) is not None:
                        raise SchemaMismatchError(
                            f"shard for rank {rank}: nested field {path!r} is required (not nullable) but holds a null "
                            "under a non-null parent; fill it in, or make the field nullable in the stream's schema"
                        )
        if not known and len(checked) < 4:
            checked.append(schema)
        out.append(shard)
    return out, None


def _all_valid(shards: list[object] | tuple[object, ...], expected: pa.Schema, fields: list[pa.Field], to_scan: list[int],
               nested: list[bool]) -> pa.Table | None:
    """The common case in a few Arrow calls, however many ranks: every shard a ``pa.Table`` with one and the same
    schema (``concat_tables`` refuses anything else) whose names and types are the stream's, and no null where a
    column or nested field is required; then the shards concatenated (zero-copy: the shards' chunks, in rank order).
    None sends the batch through the per-rank checks, which name the rank."""
    if not all(type(shard) is pa.Table for shard in shards):
        return None
    try:
        whole = pa.concat_tables(shards)  # zero-copy: it only collects the shards' chunks
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    schema = whole.schema
    if schema.names != expected.names or not all(field.type.equals(want.type) for field, want in zip(schema, fields)):
        return None
    for i in to_scan:
        column = whole.column(i)
        if not fields[i].nullable and column.null_count:
            return None
        if nested[i] and any(_required_null(chunk, fields[i].name) is not None for chunk in column.chunks):
            return None
    return whole


def _children(data_type: pa.DataType) -> list[pa.Field]:
    if pa.types.is_struct(data_type):
        return [data_type.field(i) for i in range(data_type.num_fields)]
    if pa.types.is_map(data_type):
        return [data_type.key_field, data_type.item_field]
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type) or pa.types.is_fixed_size_list(data_type):
        return [data_type.value_field]
    return []


def _has_required(data_type: pa.DataType) -> bool:
    """Whether a type has a non-nullable field anywhere below it."""
    return any(not f.nullable or _has_required(f.type) for f in _children(data_type))


def _required_null(array: pa.Array, path: str) -> str | None:
    """The path of a non-nullable nested field holding a null where every parent is non-null (None: there is none).

    ``array`` holds only values whose parents are all non-null: each level keeps its non-null slots before looking at
    their children, so a null under a null (nullable) parent is fine, as Arrow and Parquet define it.
    """
    data_type = array.type
    if not _has_required(data_type):
        return None
    valid = array.filter(array.is_valid()) if array.null_count else array
    if pa.types.is_struct(data_type):
        children = [(f, valid.field(i)) for i, f in enumerate(_children(data_type))]
    elif pa.types.is_map(data_type):
        valid = array.filter(array.is_valid())  # compact: keys/items of a MapArray ignore its slice offset
        start, stop = valid.offsets[0].as_py(), valid.offsets[-1].as_py()
        children = [(data_type.key_field, valid.keys.slice(start, stop - start)),
                    (data_type.item_field, valid.items.slice(start, stop - start))]
    else:  # lists: flatten() skips null lists and honours the slice
        children = [(data_type.value_field, valid.flatten())]
    for child_field, child in children:
        child_path = f"{path}.{child_field.name}"
        if not child_field.nullable and child.null_count:
            return child_path
        if (found := _required_null(child, child_path)) is not None:
            return found
    return None


def check_rank(rank: int, world_size: int) -> int:
    """``rank`` as an int (numpy integers accepted), or :class:`RankError` when it is not in ``0..world_size-1``."""
    rank = check_int(rank, what="rank", error=RankError)
    if not 0 <= rank < world_size:
        raise RankError(f"rank {rank!r} is outside 0..{world_size - 1} (the stream's world size is {world_size})")
    return rank
