"""Writing a global batch's data files: once per batch, before any commit attempt.

Per-rank layout: each rank's shard becomes one Parquet file with a single row group, holding the payload columns only
(step and rank live in the manifest entry's partition tuple, see :mod:`lakestream_iceberg.format.layout`), so a rank reads
exactly its own bytes. Packed layout: the whole batch becomes one Parquet file, ranks in order with a ``_rank`` column
(see :mod:`lakestream_iceberg.format.packed`). Either way the step is not in the files: a commit that loses the
compare-and-swap re-uses them with a new step, and no data is rewritten.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.io import FileIO
from pyiceberg.io.pyarrow import (
    DataFileStatistics,
    data_file_statistics_from_parquet_metadata,
    parquet_path_to_id_mapping,
    schema_to_pyarrow,
)
from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
from pyiceberg.schema import Schema
from pyiceberg.typedef import Record

from lakestream_iceberg.connect.fork import ProcessPool
from lakestream_iceberg.connect.integers import INT32_MAX, INT64_MAX, parse_int
from lakestream_iceberg.connect.retry import call_with_retry
from lakestream_iceberg.errors import ConfigError, SchemaMismatchError
from lakestream_iceberg.format.batches import has_required, hidden_nulls_filled
from lakestream_iceberg.format.file_settings import parquet_options, statistics_plan
from lakestream_iceberg.format.layout import RANK_COLUMN
from lakestream_iceberg.format.packed import RANK_ROWS_KEY, encode_rank_rows
from lakestream_iceberg.write.host import warn_if_slow_copy

_PRODUCER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_producer_id(producer_id: str) -> str:
    if not isinstance(producer_id, str) or not _PRODUCER_ID.fullmatch(producer_id):
        raise ConfigError(
            f"producer id {producer_id!r} is invalid: use 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it becomes part of data file paths)"
        )
    return producer_id


# Parquet files are written with pyarrow's dictionary encoding (its default: try a dictionary, fall back to plain once
# it outgrows the dictionary page) except where it cannot pay; pyarrow, unlike parquet-java, never checks whether the
# dictionary saves anything. Two kinds of column go without:
# * a binary or string column whose values average DICTIONARY_MAX_AVG_BYTES or more in the file: large values (encoded
#   images, token buffers, serialized tensors) hardly ever repeat, so the dictionary is built, overflows and is thrown
#   away (measured: 0.4 ms per MiB of 64 KiB values, 20% of encoding a 16 MiB batch), and a value that does repeat
#   within a page is still found by the codec;
# * the numbers of a list column (token ids, embeddings, pixel rows): a dictionary only maps numbers to smaller
#   numbers, at the cost of hashing every value. 256 rows of 256-768 int32 token ids (ids below 50,000) and a 2-8 KiB
#   blob, in pyarrow alone: with zstd the dictionary makes the file 3% larger, the encoding 2.9x slower (3.4 against
#   1.15 ms) and the decoding 40 us slower (110 us uncompressed). benchmarks/file_encoding.py measures whole commits
#   and reads.
DICTIONARY_MAX_AVG_BYTES = 1024
# A packed file's ranks are copied into one chunk per column when their chunks average less than this (see _row_groups).
COMBINE_BELOW_CHUNK_BYTES = 64 * 1024
SIZE_SAMPLE_RANKS = 16  # ranks whose sizes estimate a larger step's average chunk size


def _small_chunks(shards: Sequence[pa.Table], chunks: int) -> bool:
    """Whether a step's ``chunks`` chunks per column average fewer than ``COMBINE_BELOW_CHUNK_BYTES``: the sizes of
    at most ``SIZE_SAMPLE_RANKS`` evenly spaced ranks (every rank of a smaller step) stand for all of them.

    A rank's buffer size is asked first (about 1 us; its ``nbytes`` costs 4-25 us on a freshly built table, 4 ms for
    every rank of a 1,024-rank step): it bounds the rank's bytes from above, so a small sum decides. Otherwise the
    sample's exact sizes decide (a slice of a larger table references that table's whole buffers). Only the copies
    made while writing depend on the answer, never the file."""
    n = len(shards)
    sample = shards if n <= SIZE_SAMPLE_RANKS else [shards[(2 * k + 1) * n // (2 * SIZE_SAMPLE_RANKS)]
                                                     for k in range(SIZE_SAMPLE_RANKS)]
    limit = COMBINE_BELOW_CHUNK_BYTES * chunks * len(sample) / n
    if sum(shard.get_total_buffer_size() for shard in sample) < limit:
        return True
    return sum(shard.nbytes for shard in sample) < limit


_BLOB_TYPES = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_string, pa.types.is_large_string)
_LIST_TYPES = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)


def _leaf_columns(schema: pa.Schema, options: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The Parquet paths of ``schema``'s leaf columns as ``use_dictionary`` names them (``tokens.list.element``), from
    an empty file written with the stream's options (pyarrow's own naming), and those of them that are the numbers of
    a top-level list column."""
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, schema=schema, **options) as writer:
        writer.write_table(schema.empty_table())
    parquet = pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema
    leaves = [parquet.column(i).path for i in range(len(parquet))]
    number_lists, start = [], 0
    for field in schema:  # a field's leaves are the next _leaf_count of them, in order (names may hold dots)
        count = _leaf_count(field.type)
        if any(is_(field.type) for is_ in _LIST_TYPES) and _numeric(field.type.value_type):
            number_lists += leaves[start : start + count]
        start += count
    return leaves, number_lists


def _leaf_count(kind: pa.DataType) -> int:
    if pa.types.is_struct(kind):
        return sum(_leaf_count(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_map(kind):
        return _leaf_count(kind.key_type) + _leaf_count(kind.item_type)
    if any(is_(kind) for is_ in _LIST_TYPES):
        return _leaf_count(kind.value_type)
    return 1


def _numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def data_file_path(location: str, *, producer: str, seq: int, token: str, rank: int | None) -> str:
    """Where a producer's writer puts rank ``rank`` of batch ``seq`` (``None``: the packed file of every rank): its own
    folder under the table's ``data/``."""
    suffix = "packed" if rank is None else f"r{rank:05d}"
    return f"{location.rstrip('/')}/data/{producer}/{seq:012d}-{token}-{suffix}.parquet"


@dataclass(frozen=True)
class StagedFile:
    """One rank's written shard (``rank`` None: the packed file of every rank), waiting for the step it will be
    published as.

    ``stats`` are the Iceberg column statistics in :meth:`DataFileStatistics.to_serialized_dict` form (record count,
    per-column sizes and counts, serialized lower/upper bounds, split offsets): what a manifest entry needs, and what a
    staged intent (:mod:`lakestream_iceberg.write.staging`) carries as JSON.
    """

    rank: int | None
    path: str
    size_bytes: int
    stats: dict[str, Any]

    @property
    def record_count(self) -> int:
        return int(self.stats["record_count"])

    def data_file(self, *, step: int, spec_id: int) -> DataFile:
        return DataFile.from_args(
            content=DataFileContent.DATA,
            file_path=self.path,
            file_format=FileFormat.PARQUET,
            partition=Record(step) if self.rank is None else Record(step, self.rank),
            file_size_in_bytes=self.size_bytes,
            sort_order_id=None,
            spec_id=spec_id,
            equality_ids=None,
            key_metadata=None,
            **self.stats,
        )

    def to_json(self) -> dict[str, Any]:
        st = self.stats
        return {
            "rank": self.rank, "path": self.path, "size": self.size_bytes, "records": st["record_count"],
            "column_sizes": st["column_sizes"], "value_counts": st["value_counts"],
            "null_value_counts": st["null_value_counts"], "nan_value_counts": st["nan_value_counts"],
            "lower_bounds": {k: v.hex() for k, v in st["lower_bounds"].items()},
            "upper_bounds": {k: v.hex() for k, v in st["upper_bounds"].items()},
            "split_offsets": st["split_offsets"],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StagedFile:
        """The staged file an intent declares (read back from storage: input). Raises ValueError for a value
        :meth:`to_json` never writes: a count, size or offset that is not an exact integer in ``[0, 2**63)`` (a bool,
        a float, a digit string: Iceberg's manifests hold 64-bit longs), a field id that is not a positive 32-bit
        integer in ASCII digits, or a bound that is not hex."""

        def count(value: Any, what: str) -> int:
            if type(value) is not int or not 0 <= value <= INT64_MAX:
                raise ValueError(f"{what} {value!r} is not an integer in [0, 2**63)")
            return value

        def field_id(key: Any) -> int:
            found = parse_int(key, minimum=1, maximum=INT32_MAX, plus=False)  # "٥" is decimal to str.isdecimal()
            if found is None:
                raise ValueError(f"field id {key!r} is not a positive 32-bit integer in ASCII digits")
            return found

        def mapping(name: str) -> dict[Any, Any]:
            value = raw[name]
            if not isinstance(value, dict):
                raise ValueError(f"{name} {value!r} is not an object")
            return value

        def ints(name: str) -> dict[int, int]:
            return {field_id(k): count(v, name) for k, v in mapping(name).items()}

        def blobs(name: str) -> dict[int, bytes]:
            out = {}
            for k, v in mapping(name).items():
                if not isinstance(v, str):
                    raise ValueError(f"{name} {v!r} is not hex")
                out[field_id(k)] = bytes.fromhex(v)
            return out

        offsets = raw.get("split_offsets")
        if offsets is not None and not isinstance(offsets, list):
            raise ValueError(f"split_offsets {offsets!r} is neither a list nor null")
        stats = {
            "record_count": count(raw["records"], "records"), "column_sizes": ints("column_sizes"),
            "value_counts": ints("value_counts"), "null_value_counts": ints("null_value_counts"),
            "nan_value_counts": ints("nan_value_counts"), "lower_bounds": blobs("lower_bounds"),
            "upper_bounds": blobs("upper_bounds"),
            "split_offsets": None if offsets is None else [count(x, "split_offsets") for x in offsets],
        }
        rank = raw["rank"]
        if rank is not None and (type(rank) is not int or not 0 <= rank <= INT32_MAX):
            raise ValueError(f"rank {rank!r} is neither a rank nor null")
        path = raw["path"]
        if not isinstance(path, str):
            raise ValueError(f"path {path!r} is not a string")
        return cls(rank=rank, path=path, size_bytes=count(raw["size"], "size"), stats=stats)


@dataclass(frozen=True)
class StagedBatch:
    """All ranks' files of one global batch, written and not yet published."""

    producer: str
    seq: int
    files: tuple[StagedFile, ...]
    token: str = ""  # the batch's unique token (also in its data file names)
    written_at: float | None = None  # unix seconds when its writing began (None: unknown, e.g. read from an intent)
    written_mono: float | None = dataclass_field(default=None, compare=False)  # time.monotonic() then, here

    def age_s(self, wall: float, monotonic: float) -> float | None:
        """Seconds since its writing began (None: unknown) at ``wall`` (``time.time()``) and ``monotonic``
        (``time.monotonic()``): the larger of what the two clocks say. The wall clock alone under-counted by as much as
        it stepped back meanwhile (an NTP correction), so a producer holding its batch published files GC may already
        have deleted; the monotonic clock alone stands still while the host is suspended (a VM paused), which the wall
        clock counts once set right."""
        if self.written_at is None:
            return None
        age = wall - self.written_at
        return age if self.written_mono is None else max(age, monotonic - self.written_mono)

    @property
    def rows(self) -> int:
        return sum(f.record_count for f in self.files)

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def data_files(self, *, step: int, spec_id: int) -> list[DataFile]:
        return [f.data_file(step=step, spec_id=spec_id) for f in self.files]


class BatchWriter:
    """Writes shards as Iceberg data files (Parquet with field ids) under ``<location>/data/``: one file per rank with
    one row group, or (``packed_row_group_bytes`` given: the packed layout) one file per batch."""

    def __init__(self, *, io: FileIO, location: str, file_schema: Schema, properties: dict[str, str], retry_s: float,
                 packed_row_group_bytes: int | None = None) -> None:
        self._io = io
        self._packed_bytes = packed_row_group_bytes
        self._location = location.rstrip("/")
        self._schema = file_schema
        self._arrow_schema = schema_to_pyarrow(file_schema, include_field_ids=True)
        self._stats_plan = statistics_plan(file_schema, properties)
        self._id_mapping = parquet_path_to_id_mapping(file_schema)
        self._options = parquet_options(properties, strict=False)
        self._leaves, self._number_lists = _leaf_columns(self._arrow_schema, self._options)
        self._blob_columns = [f.name for f in self._arrow_schema if any(is_(f.type) for is_ in _BLOB_TYPES)]
        self._nested_required = any(has_required(f.type) for f in self._arrow_schema)  # see hidden_nulls_filled
        self._pool = ProcessPool(max_workers=8, name="lakestream-write")
        # A storage outage (S3 restarting, 5xx, connection refused) is retried for this long (the stream's checked
        # lakestream.io.retry-timeout-ms); the path is unique to this batch and an object appears only when its upload
        # completes, so writing it again is safe.
        self._retry_s = retry_s
        warn_if_slow_copy()  # once per process: a host whose memcpy slows pyarrow's Parquet writer (write/host.py)

    def write(self, *, producer: str, seq: int, shards: Sequence[pa.Table], whole: pa.Table | None = None) -> StagedBatch:
        """Write every rank's file; when any rank's write fails, delete what was written and raise.

        ``whole``: the shards already concatenated in rank order (``check_batch`` makes it); the packed layout writes
        from it instead of concatenating them again.

        Raises:
            SchemaMismatchError: pyarrow refused a shard's data (e.g. a null in a non-nullable field); nothing is left
                behind.
            Exception: A storage failure that outlasted ``lakestream.io.retry-timeout-ms``, unchanged (every file of
                the batch was deleted, as far as storage allowed).
        """
        token = uuid.uuid4().hex[:12]
        written_at, written_mono = time.time(), time.monotonic()  # before any file exists (their ages count from here)
        files: list[StagedFile] = []
        failure: Exception | None = None
        if self._packed_bytes is not None:  # one file: written here, no hand-off to a pool thread and back
            paths = [data_file_path(self._location, producer=producer, seq=seq, token=token, rank=None)]
            try:
                files.append(self._write_packed_retrying(paths[0], shards, whole))
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the cleanup
                failure = exc
        else:
            paths = [data_file_path(self._location, producer=producer, seq=seq, token=token, rank=rank)
                     for rank in range(len(shards))]
            futures = []
            for rank, (path, shard) in enumerate(zip(paths, shards)):
                try:
                    futures.append(self._pool.submit(self._write_retrying, path, rank, shard))
                except Exception as exc:  # noqa: BLE001 - e.g. interpreter shutdown: clean up what was submitted
                    failure = exc
                    break
            for future in futures:  # wait for every rank, so that no write is still running when the others are deleted
                try:
                    files.append(future.result())
                except Exception as exc:  # noqa: BLE001 - re-raised below, after the cleanup
                    failure = failure or exc
        if failure is None:
            return StagedBatch(producer=producer, seq=seq, files=tuple(files), token=token, written_at=written_at,
                               written_mono=written_mono)
        for path in paths:  # a failed rank may have left a partial file too
            try:
                self._io.delete(path)
            except Exception:  # noqa: BLE001 - never written, or storage unreachable: GC collects it after the grace period
                pass
        if isinstance(failure, (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)):
            raise SchemaMismatchError(
                f"writing batch seq {seq} of producer {producer!r} failed: pyarrow refused a shard ({failure}); nothing "
                "was published and the files already written were deleted. Fix the data (or the stream's schema)"
            ) from failure
        raise failure

    def _write_retrying(self, path: str, rank: int, shard: pa.Table) -> StagedFile:
        return call_with_retry(lambda: self._write_one(path, rank, shard), what=f"writing {path}", timeout_s=self._retry_s)

    def _write_packed_retrying(self, path: str, shards: Sequence[pa.Table], whole: pa.Table | None) -> StagedFile:
        counts = np.fromiter((shard.num_rows for shard in shards), dtype=np.int64, count=len(shards))
        groups = self._row_groups(shards, counts, whole)  # once: a retry rewrites the same row groups
        return call_with_retry(lambda: self._write_file(path, None, groups, counts), what=f"writing {path}",
                               timeout_s=self._retry_s)

    def _row_groups(self, shards: Sequence[pa.Table], counts: np.ndarray, whole: pa.Table | None) -> list[pa.Table]:
        """The packed file's row groups: consecutive ranks (with their ``_rank`` column) while they fit in
        ``packed_row_group_bytes``; a rank never spans two row groups, and one larger than that is a row group alone.

        The ranks are concatenated and cast once (``whole``, when the caller has them concatenated already), and the
        row groups are slices of that table: the cost per rank is a row count, and a size only when the step is
        larger than one row group, not an Arrow call per column.
        """
        assert self._packed_bytes is not None
        payload = pa.schema([f for f in self._arrow_schema if f.name != RANK_COLUMN])
        rank_field = self._arrow_schema.field(RANK_COLUMN)
        if not counts.any():
            return []
        if whole is not None and whole.num_rows != int(counts.sum()):  # not these shards' concatenation: ignore it
            whole = None
        if whole is None:
            filled = [shard for shard, n in zip(shards, counts.tolist()) if n]
            try:
                whole = pa.concat_tables(filled)
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # shards that differ in nullability or metadata: cast each first
                whole = pa.concat_tables([self._filled(shard).cast(payload) for shard in filled])
        whole = self._filled(whole)
        ranks = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        chunks = max((column.num_chunks for column in whole.columns), default=1)
        if chunks > 1 and _small_chunks(shards, chunks):
            # Small chunks (many tiny ranks): one chunk per column, since casting, sizing and writing a 1,024-chunk
            # table costs per chunk. Large ones are written as they are: copying them costs more than it saves
            # (1 MiB of 8 ranks: 8 producers on 2 cores wrote 20-30% more batches per second without the copy).
            whole = whole.combine_chunks()
        whole = whole.cast(payload).append_column(rank_field, pa.array(ranks, rank_field.type))
        if whole.nbytes <= self._packed_bytes:  # the usual small step: one row group, no size per rank needed
            return [whole]
        bounds: list[tuple[int, int]] = []  # (first row, rows) of each row group
        first = rows = size = 0
        for shard, n in zip(shards, counts.tolist()):
            if not n:
                continue
            nbytes = shard.nbytes
            if rows and size + nbytes > self._packed_bytes:  # would overflow: close the group first
                bounds.append((first, rows))
                first, rows, size = first + rows, 0, 0
            rows += n
            size += nbytes
            if size >= self._packed_bytes:  # full (or one rank as large as a group: alone)
                bounds.append((first, rows))
                first, rows, size = first + rows, 0, 0
        if rows:
            bounds.append((first, rows))
        return [whole.slice(start, n) for start, n in bounds]

    def _write_one(self, path: str, rank: int, shard: pa.Table) -> StagedFile:
        table = self._filled(shard).cast(self._arrow_schema) if shard.num_rows else self._arrow_schema.empty_table()
        return self._write_file(path, rank, [table], None)

    def _filled(self, table: pa.Table) -> pa.Table:
        return hidden_nulls_filled(table) if self._nested_required else table

    def _write_file(self, path: str, rank: int | None, groups: list[pa.Table], rank_rows: np.ndarray | None) -> StagedFile:
        """Write ``groups`` as the row groups of one file (a per-rank file: one group, possibly empty)."""
        output = self._io.new_output(path)
        with output.create(overwrite=True) as stream:
            writer = pq.ParquetWriter(stream, schema=self._arrow_schema, store_decimal_as_integer=True,
                                      use_dictionary=self._dictionary(groups), **self._options)
            for table in groups:
                writer.write_table(table, row_group_size=max(1, table.num_rows))
            if rank_rows is not None:  # the footer's own key-value metadata (not the Arrow schema's: stored once)
                writer.add_key_value_metadata({RANK_ROWS_KEY: encode_rank_rows(rank_rows)})
            writer.close()
            metadata = writer.writer.metadata
            size = stream.tell()
        if metadata.num_rows == 0:  # no column statistics to collect (pyiceberg would warn per column)
            stats = DataFileStatistics(record_count=0, column_sizes={}, value_counts={}, null_value_counts={},
                                       nan_value_counts={}, column_aggregates={}, split_offsets=[])
        else:
            stats = data_file_statistics_from_parquet_metadata(
                parquet_metadata=metadata, stats_columns=self._stats_plan, parquet_column_mapping=self._id_mapping
            )
        return StagedFile(rank=rank, path=path, size_bytes=size, stats=stats.to_serialized_dict())

    def _dictionary(self, groups: list[pa.Table]) -> bool | list[str]:
        """``use_dictionary`` for one file: every leaf column but the numbers of list columns and the binary and string
        columns whose values average ``DICTIONARY_MAX_AVG_BYTES`` or more in it (True: every column, pyarrow's
        default); see ``DICTIONARY_MAX_AVG_BYTES``."""
        plain = set(self._number_lists)
        for name in self._blob_columns:
            # the file's values of the column as one chunked array: one length and one sum however many row groups
            # (a packed file of 8 ranks has 8; two compute calls per row group cost 60 us of a 1 MiB commit)
            column = pa.chunked_array([chunk for t in groups for chunk in t.column(name).chunks],
                                      self._arrow_schema.field(name).type)
            values = len(column) - column.null_count
            if values and (pc.sum(pc.binary_length(column)).as_py() or 0) >= DICTIONARY_MAX_AVG_BYTES * values:
                plain.add(name)
        if not plain:
            return True
        return [path for path in self._leaves if path not in plain]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
