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

import pyarrow as pa
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform

from lakestream_iceberg.errors import ConfigError, RankError, SchemaMismatchError
from lakestream_iceberg.format import properties as props
from lakestream_iceberg.format.checks import check_int
from lakestream_iceberg.format.properties import CONFIG_FIELDS, LAYOUT_PACKED, LAYOUT_PER_RANK

STEP_COLUMN = "_step"
RANK_COLUMN = "_rank"
RESERVED_COLUMNS = frozenset({STEP_COLUMN, RANK_COLUMN})

# Table properties: declared once in format/properties.py (key, type, default, unit, bounds, when a change applies).
# The PROP_* names are their keys, for the modules and scripts that name a property in a message or a test.
PROP_VERSION = props.FORMAT_VERSION.key
PROP_WORLD_SIZE = props.WORLD_SIZE.key
PROP_RETAIN_SNAPSHOTS = props.RETAIN_LAST.key
PROP_RETAIN_MAX = props.RETAIN_MAX.key
PROP_MAX_SNAPSHOT_AGE_MS = props.MAX_SNAPSHOT_AGE.key
PROP_MIN_SNAPSHOTS_TO_KEEP = props.MIN_SNAPSHOTS_TO_KEEP.key
PROP_MERGE_FANOUT = props.MERGE_FANOUT.key
PROP_MAX_MERGE_ENTRIES = props.MAX_MERGE_ENTRIES.key
PROP_MANIFEST_CACHE_BYTES = props.MANIFEST_CACHE_BYTES.key
PROP_COMMIT_TIMEOUT_MS = props.COMMIT_TIMEOUT.key
PROP_COMMIT_MAX_ATTEMPTS = props.COMMIT_MAX_ATTEMPTS.key
PROP_GC_GRACE_MS = props.GC_GRACE.key
PROP_IO_RETRY_TIMEOUT_MS = props.IO_RETRY_TIMEOUT.key
PROP_GROUP_COMMIT = props.GROUP_COMMIT.key
PROP_GROUP_MAX_BATCHES = props.GROUP_MAX_BATCHES.key
PROP_GROUP_STAGING = props.GROUP_STAGING.key
PROP_LAYOUT = props.LAYOUT.key
PROP_PACKED_ROW_GROUP_BYTES = props.PACKED_ROW_GROUP_BYTES.key

FORMAT_VERSION = props.FORMAT_VERSION.created


def check_format_version(properties: Mapping[str, str], *, stream: str | None = None) -> None:
    """Refuse (:class:`ConfigError`) a table whose ``lakestream.format-version`` this release does not read: a stream a
    newer lakestream_iceberg made or upgraded may lay its steps out in ways this one would misread or write over. An
    absent property is left to the caller (a table without it is no stream)."""
    raw = properties.get(PROP_VERSION)
    if raw is None or raw in props.FORMAT_VERSION.choices:
        return
    where = f"stream {stream}" if stream else "the table"
    raise ConfigError(
        f"{where} has table property {PROP_VERSION}={raw!r}, and this release of lakestream_iceberg reads format "
        f"version {', '.join(props.FORMAT_VERSION.choices)} only: a newer lakestream_iceberg made or upgraded it. "
        "Upgrade lakestream_iceberg in every process that uses the stream (do not change the property: the steps "
        "would be misread)"
    )

# Stream.create picks the packed layout from this world size on, unless lakestream.layout is given. Measured
# (benchmarks/vs_kafka.py, W=8, one run per layout): packed ingests 1 MiB batches 2.1x (1 producer) to 2.2x (8)
# faster and 16 MiB batches from 8 producers 2.9x faster than per-rank, whose W files and manifest entries per step
# dominate the commit; below 8 ranks the difference is small and per-rank reads are exact (docs/concepts.md, "Layouts").
PACKED_FROM_WORLD_SIZE = 8

# The GC grace rule: lakestream.gc.grace-period-ms >= GRACE_PER_COMMIT_TIMEOUT x lakestream.commit.timeout-ms. A staged
# batch is publishable while younger than half the grace period (write/staging.py, StreamConfig.staged_max_age_s), and
# the commit that publishes it may take up to the commit timeout: its files are then at most grace/2 + timeout <= grace
# old, so GC (which deletes unreferenced files only once older than the grace period) cannot delete them under a
# commit in flight.
GRACE_PER_COMMIT_TIMEOUT = 2


class StreamConfig:
    """Stream-wide settings, read from the table's properties: one attribute per declaration of
    :mod:`lakestream_iceberg.format.properties` that has a ``field`` (its doc says what it means), parsed and checked
    by that declaration. Durations are held in milliseconds as stored; read them in seconds (``commit_timeout_s``,
    ``gc_grace_s``, ``io_retry_timeout_s``, ``retain_max_age_s``, ``staged_max_age_s``).

    ``StreamConfig(world_size=4, layout="packed")`` takes the attributes by keyword (others: a new stream's defaults);
    :meth:`from_properties` reads a table's. Two rules span properties: ``retain_snapshots`` is raised to Iceberg's
    ``history.expire.min-snapshots-to-keep``, and the GC grace rule (``GRACE_PER_COMMIT_TIMEOUT``) is enforced: a stream
    whose properties break it is refused (:class:`ConfigError`).
    """

    world_size: int
    retain_snapshots: int
    retain_max_age_ms: int
    retain_max: int
    merge_fanout: int
    max_merge_entries: int
    manifest_cache_bytes: int
    commit_timeout_ms: int
    commit_max_attempts: int
    gc_grace_ms: int
    io_retry_timeout_ms: int
    group_commit: bool
    group_max_batches: int
    group_staging: str
    layout: str
    packed_row_group_bytes: int

    def __init__(self, **values: object) -> None:
        unknown = sorted(values.keys() - CONFIG_FIELDS.keys())
        if unknown:
            raise ConfigError(f"StreamConfig has no setting {', '.join(unknown)}; it has {', '.join(CONFIG_FIELDS)}")
        for name, prop in CONFIG_FIELDS.items():
            if name in values:
                value = prop.check(values[name], what=f"{prop.key} ({name})")
            elif prop.initial is None:
                raise ConfigError(f"{prop.key} ({name}) is required")
            else:
                value = prop.initial
            object.__setattr__(self, name, value)
        need = GRACE_PER_COMMIT_TIMEOUT * self.commit_timeout_ms
        if self.gc_grace_ms < need:
            raise ConfigError(
                f"table property {PROP_GC_GRACE_MS}={self.gc_grace_ms} is shorter than {GRACE_PER_COMMIT_TIMEOUT} x "
                f"{PROP_COMMIT_TIMEOUT_MS}={self.commit_timeout_ms}: GC could delete the files of a batch that a commit "
                f"may still publish (the GC grace rule, see docs/guide/retention.md). Set {PROP_GC_GRACE_MS} to at least {need} or "
                f"{PROP_COMMIT_TIMEOUT_MS} to at most {self.gc_grace_ms // GRACE_PER_COMMIT_TIMEOUT} (an existing "
                "table: with pyiceberg, table.transaction().set_properties({...}).commit_transaction())"
            )

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"StreamConfig is immutable: {name} cannot be set (change the table property instead)")

    def as_dict(self) -> dict[str, int | bool | str]:
        return {name: getattr(self, name) for name in CONFIG_FIELDS}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StreamConfig) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.as_dict().items()))

    def __repr__(self) -> str:
        return f"StreamConfig({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"

    @classmethod
    def from_properties(cls, properties: Mapping[str, str], *, stream: str | None = None) -> StreamConfig:
        """The settings of a table with these properties (of ``stream``, for the errors); an absent property takes its
        declared default.

        Raises:
            ConfigError: A property holds a value lakestream cannot use (names it and the fix), the stream's world
                size is missing, or its format version is one this release does not read (:func:`check_format_version`).
        """
        if PROP_WORLD_SIZE not in properties:
            raise ConfigError(f"table property {PROP_WORLD_SIZE} is missing; was the stream created with Stream.create()?")
        check_format_version(properties, stream=stream)
        values = {name: prop.get(properties) for name, prop in CONFIG_FIELDS.items()}
        # Iceberg's history.expire.min-snapshots-to-keep raises the count kept (never lowers lakestream's own)
        values["retain_snapshots"] = max(props.RETAIN_LAST.get(properties) or 0,
                                         props.MIN_SNAPSHOTS_TO_KEEP.get(properties) or 0)
        return cls(**values)

    @property
    def packed(self) -> bool:
        return self.layout == LAYOUT_PACKED

    @property
    def commit_timeout_s(self) -> float:
        return props.COMMIT_TIMEOUT.seconds(self.commit_timeout_ms)

    @property
    def gc_grace_s(self) -> float:
        return props.GC_GRACE.seconds(self.gc_grace_ms)

    @property
    def io_retry_timeout_s(self) -> float:
        return props.IO_RETRY_TIMEOUT.seconds(self.io_retry_timeout_ms)

    @property
    def retain_max_age_s(self) -> float:
        return props.MAX_SNAPSHOT_AGE.seconds(self.retain_max_age_ms)

    @property
    def staged_max_age_s(self) -> float:
        """How old a staged batch may be and still be published: the grace period less the longest commit the GC
        grace rule allows (half of it), so GC never deletes the files of a batch a commit may still publish."""
        return self.gc_grace_s * (1 - 1 / GRACE_PER_COMMIT_TIMEOUT)

    def to_properties(self) -> dict[str, str]:
        """The table properties of a new stream with these settings: lakestream's own, the Iceberg ones lakestream
        sets (``created``), and those of a field that differ from their default.

        Exactly one retry owner for lakestream's commits: its commit loop, which never commits through pyiceberg's
        retrying ``Transaction.commit_transaction``; Iceberg's ``commit.retry.*`` stay at their defaults, so another
        engine's maintenance commit (Spark's ``expire_snapshots``) retries when it loses to a producer's.
        """
        out: dict[str, str] = {}
        for prop in props.PROPERTIES:
            value = getattr(self, prop.field) if prop.field else prop.created
            if value is None or not prop.own and prop.created is None and value == prop.default:
                continue
            out[prop.key] = prop.format(value)  # type: ignore[arg-type]
        return out


def staged_max_age_s(properties: Mapping[str, str]) -> float:
    """:attr:`StreamConfig.staged_max_age_s` of a table with these properties (its ``lakestream.gc.grace-period-ms``).

    Raises:
        ConfigError: The grace period is not a duration lakestream reads.
    """
    grace_ms = props.GC_GRACE.get(properties)
    grace_ms = props.GC_GRACE.default if grace_ms is None else grace_ms
    return props.GC_GRACE.seconds(int(grace_ms or 0)) * (1 - 1 / GRACE_PER_COMMIT_TIMEOUT)


def table_arrow_schema(payload: pa.Schema) -> pa.Schema:
    """The Arrow schema of the Iceberg table: the payload plus ``_step`` and ``_rank``."""
    if not isinstance(payload, pa.Schema) or len(payload) == 0:
        raise SchemaMismatchError(f"a stream's payload schema is a pyarrow Schema with at least one column, got {payload!r}")
    # in any case: DuckDB (the history views) and engines that fold names to lower case (Trino; Spark by default)
    # resolve _STEP and _step as one column: `SELECT _step FROM samples` read the payload's _STEP
    clash = {name for name in payload.names if name.lower() in RESERVED_COLUMNS}
    if clash:
        raise SchemaMismatchError(
            f"payload column(s) {sorted(clash)} are reserved by lakestream in any letter case (step and rank are added "
            "for you as _step and _rank); rename them"
        )
    if len(set(payload.names)) != len(payload.names):
        raise SchemaMismatchError("payload schema has duplicate column names; give every column a unique name")
    plain = pa.schema([pa.field(f.name, _widened(f.type), nullable=f.nullable) for f in payload])
    # Optional, not required: pyiceberg fills partition-projected values only into optional fields (0.12).
    return plain.append(pa.field(STEP_COLUMN, pa.int64())).append(pa.field(RANK_COLUMN, pa.int32()))


def _widened(kind: pa.DataType) -> pa.DataType:
    """``kind`` with every uint32 made int64: pyiceberg types uint32 as Iceberg's 32-bit signed int, which cannot hold
    its upper half (every batch holding such a value was refused), and long holds them all. The stream's payload
    schema keeps uint32: producers cast to long when writing, readers cast back."""
    if pa.types.is_uint32(kind):
        return pa.int64()
    if pa.types.is_struct(kind):
        return pa.struct([kind.field(i).with_type(_widened(kind.field(i).type)) for i in range(kind.num_fields)])
    if pa.types.is_map(kind):
        return pa.map_(kind.key_field.with_type(_widened(kind.key_type)),
                       kind.item_field.with_type(_widened(kind.item_type)), keys_sorted=kind.keys_sorted)
    if pa.types.is_fixed_size_list(kind):
        return pa.list_(kind.value_field.with_type(_widened(kind.value_type)), kind.list_size)
    if pa.types.is_large_list(kind):
        return pa.large_list(kind.value_field.with_type(_widened(kind.value_type)))
    if pa.types.is_list(kind):
        return pa.list_(kind.value_field.with_type(_widened(kind.value_type)))
    return kind


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
    stream, in its order, whatever other columns the table's schema gained or however it ordered them since (schema
    evolution by another engine): producers keep writing the stream's columns, and Iceberg readers return nulls for an
    added optional column.

    Raises:
        SchemaMismatchError: The table's schema no longer holds a payload column or a field inside one (dropped or
            renamed), changed its type to one the payload cannot be written as, gained a required column or nested
            field lakestream cannot write, or made one the payload allows nulls in required.
    """
    if payload is not None:
        _check_evolution(schema, payload, stream)
        names = set(payload.names)
    else:
        names = {f.name for f in schema.fields if f.name not in RESERVED_COLUMNS}
    if layout == LAYOUT_PACKED:
        names.add(RANK_COLUMN)
    selected = schema.select(*[f.name for f in schema.fields if f.name in names])
    if payload is None:
        return selected
    # In the payload's order, whatever order the table's schema has now (another engine may move a column: a legal
    # change, Iceberg readers match columns by field id): producers write and readers read the stream's columns in it.
    by_name = {f.name: f for f in selected.fields}
    order = [*payload.names, RANK_COLUMN] if layout == LAYOUT_PACKED else list(payload.names)
    return Schema(*[by_name[name] for name in order], schema_id=selected.schema_id)


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
        # pyarrow casts a struct by field name, dropping a field the target lacks and filling one it adds with nulls:
        # a nested field dropped or renamed lost its values, one made or added as required was written with nulls
        problem = _nested_problem(field.type, found.field_type, field.name) or \
            _required_problem(field.nullable, found.required, field.name)
        if problem is not None:
            raise SchemaMismatchError(f"the table schema of {stream} {problem}: {fix}")
    added = [f.name for f in schema.fields if f.required and f.name not in RESERVED_COLUMNS and f.name not in payload.names]
    if added:
        raise SchemaMismatchError(f"the table schema of {stream} gained required column(s) {added} that lakestream "
                                  f"producers cannot write (an optional column is fine: readers see nulls): {fix}")


def _required_problem(nullable: bool, required: bool, path: str) -> str | None:
    """A field the payload allows nulls in that the table now requires (another engine's ``SET NOT NULL``, pyiceberg's
    ``update_column(..., required=True)``): a producer would write its nulls into a required field, which Iceberg
    readers refuse or read as values that cannot be null."""
    if nullable and required:
        return (f"made payload field {path!r} required, but the stream's payload schema allows nulls in it (its "
                "producers write them); make it optional again (pyiceberg: update_schema().update_column("
                f"{_path_arg(path)}, required=False))")
    return None


def _path_arg(path: str) -> str:
    parts = path.split(".")
    return repr(parts[0]) if len(parts) == 1 else repr(tuple(parts))


def _nested_problem(kind: pa.DataType, found: object, path: str) -> str | None:
    """What another engine changed inside a nested payload column (``path``) that its files cannot be written with:
    a struct field dropped or renamed, a required one added, an optional one made required (None: nothing). Leaf types
    are checked by the caller's cast; a nested type that became another kind fails that cast."""
    from pyiceberg.types import ListType, MapType, StructType

    if pa.types.is_struct(kind) and isinstance(found, StructType):
        fields = {f.name: f for f in found.fields}
        for i in range(kind.num_fields):
            child = kind.field(i)
            match = fields.get(child.name)
            where = f"{path}.{child.name}"
            if match is None:
                return f"no longer has the payload field {where!r} (dropped or renamed by another engine)"
            problem = _nested_problem(child.type, match.field_type, where) or \
                _required_problem(child.nullable, match.required, where)
            if problem is not None:
                return problem
        names = set(kind.names)
        added = [f"{path}.{f.name}" for f in found.fields if f.required and f.name not in names]
        if added:
            return f"gained required field(s) {added} that lakestream producers cannot write (an optional one is fine)"
        return None
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) and \
            isinstance(found, ListType):
        where = f"{path}.element"
        return _nested_problem(kind.value_type, found.element_type, where) or \
            _required_problem(kind.value_field.nullable, found.element_required, where)
    if pa.types.is_map(kind) and isinstance(found, MapType):
        return _nested_problem(kind.key_type, found.key_type, f"{path}.key") or \
            _nested_problem(kind.item_type, found.value_type, f"{path}.value") or \
            _required_problem(kind.item_field.nullable, found.value_required, f"{path}.value")
    return None


def payload_names(schema: Schema) -> list[str]:
    return [f.name for f in schema.fields if f.name not in RESERVED_COLUMNS]


def check_rank(rank: int, world_size: int) -> int:
    """``rank`` as an int (numpy integers accepted), or :class:`RankError` when it is not in ``0..world_size-1``."""
    rank = check_int(rank, what="rank", error=RankError)
    if not 0 <= rank < world_size:
        raise RankError(f"rank {rank!r} is outside 0..{world_size - 1} (the stream's world size is {world_size})")
    return rank
