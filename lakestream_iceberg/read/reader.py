"""Reading one rank's shard of one step: a targeted read of that rank's data file (per-rank layout) or of the row
groups of the step's packed file that hold its rows (packed layout), never a table scan."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.io import FileIO
from pyiceberg.manifest import DataFile

from lakestream_iceberg.connect.storage import open_ranged
from lakestream_iceberg.errors import ConfigError, CorruptStateError, RankError
from lakestream_iceberg.format.layout import RANK_COLUMN
from lakestream_iceberg.format.packed import PackedFooter, corrupt_packed


def read_file(io: FileIO, data_file: DataFile, schema: pa.Schema, columns: list[str] | None = None, *,
              threads: bool = True) -> pa.Table:
    """Fetch one data file in a single read and decode it to ``schema`` (the stream's payload schema); ``threads=False``
    decodes in the calling thread only, never on Arrow's thread pool (see :data:`DECODE_THREADS_BYTES`).

    Decodes with ``ParquetFile.read`` (no dataset/filesystem layer: ~15% less CPU per file than ``read_table``) and
    hands Arrow a buffer Arrow owns: Arrow's decode threads may drop their last reference to the file buffer after
    ``read`` returned, and when that buffer wraps a Python ``bytes`` object the drop needs the GIL, which aborts the
    process if it happens during interpreter shutdown (apache/arrow#34314).

    Raises:
        CorruptStateError: The file is not a Parquet file of the stream's schema, or holds another number of rows than
            the manifest says (it was damaged or replaced after it was published).
    """
    buffer = fetch(io, data_file.file_path, size=data_file.file_size_in_bytes)
    target = schema if columns is None else pa.schema([schema.field(c) for c in columns])
    try:  # the bytes are in memory: any error from here on is the file's, not the storage's
        table = pq.ParquetFile(pa.BufferReader(buffer)).read(columns=columns, use_threads=threads and buffer.size > DECODE_THREADS_BYTES)
        if table.num_rows != data_file.record_count:
            raise ValueError(f"it holds {table.num_rows} rows, its manifest entry says {data_file.record_count}")
        return target.empty_table() if table.num_rows == 0 else table.cast(target)
    except (MemoryError, pa.ArrowNotImplementedError):
        raise  # out of memory, or a codec this pyarrow lacks: the reader's problem, not the file's
    except (pa.ArrowException, OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptStateError(
            f"data file {data_file.file_path} cannot be read as the stream's data ({type(exc).__name__}: {exc}): it was "
            "damaged or replaced after it was published; roll the stream back to a checkpoint before its step, or "
            "restore the file from a backup"
        ) from exc


def fetch(io: FileIO, path: str, *, size: int | None = None) -> pa.Buffer:
    """A whole file in one read, in a buffer Arrow owns.

    ``size``: the file's size as its manifest entry records it. A pyarrow stream (``PyArrowFileIO``) then reads it in
    one call into one buffer; without it, pyarrow reads a stream it cannot seek in 16 KiB pieces and joins them (about
    2.4x the CPU for a 1.3 MB file). A file of another size than its manifest entry says was damaged or replaced (every
    Iceberg reader seeks to the footer from that size), and is refused.

    Raises:
        CorruptStateError: The file's size is not ``size``.
    """
    with io.new_input(path).open(seekable=False) as stream:
        read_buffer = getattr(stream, "read_buffer", None)  # pyarrow streams (PyArrowFileIO): zero-copy
        if not callable(read_buffer):
            buffer = _arrow_owned(stream.read())
        elif size is None:
            buffer = read_buffer()
        else:  # one byte more than the manifest says: a longer file shows, at the cost of an empty read at its end
            buffer = read_buffer(int(size) + 1)
    if size is not None and buffer.size != size:
        raise CorruptStateError(
            f"data file {path} holds {'more than ' if buffer.size > size else ''}{min(buffer.size, int(size))} bytes, "
            f"its manifest entry says {size}: it was damaged or replaced after it was published; roll the stream back "
            "to a checkpoint before its step, or restore the file from a backup"
        )
    return buffer


def _arrow_owned(data: bytes) -> pa.Buffer:
    """A copy of ``data`` in memory Arrow owns (one memcpy; only for FileIOs whose streams return Python bytes)."""
    buffer = pa.allocate_buffer(len(data))
    if data:
        np.frombuffer(buffer, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
    return buffer


# Arrow decodes the columns of a read on its thread pool only when there is this much to decode: handing a small read
# to the pool costs more than decoding it in the calling thread (a 10 KiB row group: 0.26 ms with threads, 0.14 without).
# Where the processes already decode in parallel (DataLoader workers: ``decode_threads=False``) the pool is never used:
# it adds threads to cores the workers keep busy, and costs CPU (a 1.7 MB zstd step: 1.3 ms of CPU with it, 1.1 without).
DECODE_THREADS_BYTES = 1024 * 1024

# A packed file this small is read whole, in one request: Parquet readers fetch the last 64 KiB speculatively for the
# footer, so range reads of a small file cost two round trips for little saved.
WHOLE_FILE_BYTES = 256 * 1024


class StepFiles:
    """One step's data files as a reader sees them: the rows of each stream rank, and reads of any rank's rows.

    Per-rank layout: rank ``r``'s rows are file ``r`` (a read fetches the whole file, one GET); the step must list one
    file per rank, each with its rank's partition value, or nothing is read. Packed layout: one file;
    making a ``StepFiles`` opens it and reads its footer (the rank table, :mod:`lakestream_iceberg.format.packed`), and a
    read fetches only the row groups holding the rows asked for (range reads, coalesced), checking their ``_rank``
    values. A packed file of at most ``WHOLE_FILE_BYTES`` is fetched whole in one read instead. ``decode_threads=False``:
    decode in the calling thread only (``read_file``). Not thread-safe: one reader per ``StepFiles``.
    Close it (or use it as a context manager) to release the packed file.

    Raises:
        CorruptStateError: A packed file's footer or rows do not match the stream (it was damaged, or not written by
            lakestream), or a step lists other than one packed file.
    """

    def __init__(self, io: FileIO, files: Sequence[DataFile], *, world_size: int, packed: bool, schema: pa.Schema,
                 decode_threads: bool = True) -> None:
        self._io = io
        self._threads = decode_threads
        self._files = list(files)
        self._schema = schema
        self._packed_file: pq.ParquetFile | None = None
        self._stream: Any = None
        self.footer: PackedFooter | None = None
        self._whole = False  # the packed file is in memory (fetched whole)
        if not packed:
            self.counts = _rank_counts(self._files, world_size)
            return
        if len(self._files) != 1:
            raise CorruptStateError(
                f"a step of a packed stream lists {len(self._files)} data files, not one: the table was written by "
                "something other than lakestream; roll the stream back to a checkpoint before that step"
            )
        data_file = self._files[0]
        whole = self._whole = data_file.file_size_in_bytes <= WHOLE_FILE_BYTES  # one GET, not footer + row groups
        if whole:
            self._stream = pa.BufferReader(fetch(io, data_file.file_path, size=data_file.file_size_in_bytes))
        else:
            self._stream = open_ranged(io, data_file.file_path)  # through s3fs too: reads fetch their ranges only
        try:
            # pre_buffer: the column chunks of the row groups read are fetched in coalesced ranges (storage, not memory)
            try:
                self._packed_file = pq.ParquetFile(self._stream, pre_buffer=not whole)
            except (pa.ArrowInvalid, ValueError) as exc:  # not Parquet at all (an I/O failure is an OSError)
                raise corrupt_packed(data_file.file_path, f"it is not a Parquet file ({exc})") from exc
            self.footer = PackedFooter.of(self._packed_file.metadata, path=data_file.file_path, world_size=world_size,
                                          record_count=int(data_file.record_count))
        except BaseException:
            self.close()
            raise
        self.counts = self.footer.counts

    def __enter__(self) -> StepFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def read(self, rank: int, start: int = 0, stop: int | None = None, columns: list[str] | None = None) -> pa.Table:
        """Rows ``start:stop`` of stream rank ``rank`` (all of them by default), decoded to the payload schema.

        Raises:
            RankError: ``rank`` is not a rank of the step, or ``start:stop`` is not within its rows.
        """
        if stop is None:  # a bad rank is refused by read_ranges, not indexed here (-1 would be the last rank)
            stop = self.counts[rank] if _index(rank) and 0 <= rank < len(self.counts) else 0
        return self.read_ranges([(rank, start, stop)], columns)

    def read_ranges(self, ranges: Sequence[tuple[int, int, int]], columns: list[str] | None = None) -> pa.Table:
        """The rows ``(rank, start, stop)`` of each range, concatenated in order (a packed file: one read of the
        row groups spanning them when they are consecutive in the file).

        Raises:
            RankError: A rank outside the step's ranks, or a row range outside that rank's rows.
        """
        for rank, start, stop in ranges:
            if not (_index(rank) and 0 <= rank < len(self.counts)):
                raise RankError(f"rank {rank!r} is outside 0..{len(self.counts) - 1}")
            if not (_index(start) and _index(stop) and 0 <= start <= stop <= self.counts[rank]):
                raise RankError(f"rows {start!r}:{stop!r} of rank {rank} are outside its {self.counts[rank]} rows")
        target = self._schema if columns is None else pa.schema([self._schema.field(c) for c in columns])
        if self.footer is None:
            tables = []
            for rank, start, stop in ranges:
                table = read_file(self._io, self._files[rank], self._schema, columns, threads=self._threads)
                tables.append(table if (start, stop) == (0, table.num_rows) else table.slice(start, stop - start))
            return _concat(tables, target)
        tables, run = [], None  # run: consecutive file rows [first, last) and the ranks they hold
        for rank, start, stop in ranges:
            first, last = self.footer.row_range(rank, start, stop)
            if last <= first:
                continue
            if run is not None and run[1] == first:
                run = (run[0], last, [*run[2], (rank, last - first)])
            else:
                if run is not None:
                    tables.append(self._read_rows(*run, columns, target))
                run = (first, last, [(rank, last - first)])
        if run is not None:
            tables.append(self._read_rows(*run, columns, target))
        return _concat(tables, target)

    def _read_rows(self, first: int, last: int, ranks: list[tuple[int, int]], columns: list[str] | None,
                   target: pa.Schema) -> pa.Table:
        assert self.footer is not None and self._packed_file is not None
        groups = self.footer.groups(first, last)
        wanted = None if columns is None else [*columns, RANK_COLUMN]
        metadata = self._packed_file.metadata
        size = sum(metadata.row_group(g).total_byte_size for g in groups)  # uncompressed: what decoding costs
        try:
            table = self._packed_file.read_row_groups(groups, columns=wanted,
                                                     use_threads=self._threads and size > DECODE_THREADS_BYTES)
        except (MemoryError, pa.ArrowNotImplementedError):
            raise
        except (pa.ArrowInvalid, ValueError) as exc:
            raise corrupt_packed(self.footer.path, f"has row groups that do not decode ({exc})") from exc
        except OSError as exc:
            if not self._whole:  # ranged reads: an I/O failure is the storage's, retried by the caller
                raise
            raise corrupt_packed(self.footer.path, f"has row groups that do not decode ({exc})") from exc
        base = self.footer.group_starts[groups[0]]
        if (first - base, last - first) != (0, table.num_rows):
            table = table.slice(first - base, last - first)
        stored = table.column(RANK_COLUMN).to_numpy(zero_copy_only=False)
        expected = np.repeat([r for r, _ in ranks], [n for _, n in ranks])
        if table.num_rows != last - first or not np.array_equal(stored, expected):
            raise corrupt_packed(self.footer.path, f"rows {first}..{last} do not hold the ranks its footer declares")
        return table.drop_columns([RANK_COLUMN]).cast(target)


def check_columns(columns: object, schema: pa.Schema, *, stream: str) -> list[str] | None:
    """``columns`` as a list of payload column names (None: all of them).

    Raises:
        ConfigError: Not an iterable of names, a name that is not a payload column, or a name given twice.
    """
    if columns is None:
        return None
    if isinstance(columns, (str, bytes)) or not isinstance(columns, Iterable):
        raise ConfigError(f"columns must be a list of column names of stream {stream}, not {columns!r}")
    names = list(columns)
    if not all(isinstance(c, str) for c in names):
        raise ConfigError(f"columns must be a list of column names of stream {stream}, not {columns!r}")
    unknown = sorted(set(names) - set(schema.names))
    if unknown:
        raise ConfigError(f"columns {unknown} are not in stream {stream} ({schema.names})")
    if len(set(names)) != len(names):
        raise ConfigError(f"columns {names} name a column more than once")
    return [str(c) for c in names]


def _rank_counts(files: Sequence[DataFile], world_size: int) -> list[int]:
    """The row count of each rank of a per-rank step. The step index hands the files ordered by their ``_rank``
    partition, checked to be ``0..n-1`` each once (:mod:`lakestream_iceberg.format.index`); here ``n`` must be the
    world size: a step missing its last ranks' files must not read as a smaller step."""
    counts = [f.record_count for f in files]
    if len(files) != world_size or not all(type(c) is int and c >= 0 for c in counts):
        raise CorruptStateError(
            f"a step of a per-rank stream of world size {world_size} lists {len(files)} data files with row counts "
            f"{counts[:8]}{'...' if len(counts) > 8 else ''}, not one file per rank 0..{world_size - 1}: the table was "
            "changed by something other than lakestream; roll the stream back to a checkpoint before that step"
        )
    return counts


def _index(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _concat(tables: list[pa.Table], target: pa.Schema) -> pa.Table:
    if not tables:
        return target.empty_table()
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)
