"""Reading one rank's shard of one step: a targeted read of exactly one data file, never a table scan."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.io import FileIO
from pyiceberg.manifest import DataFile


def read_file(io: FileIO, data_file: DataFile, schema: pa.Schema, columns: list[str] | None = None) -> pa.Table:
    """Fetch one data file in a single read and decode it to ``schema`` (the stream's payload schema).

    Decodes with ``ParquetFile.read`` (no dataset/filesystem layer: ~15% less CPU per file than ``read_table``) and
    hands Arrow a buffer Arrow owns: Arrow's decode threads may drop their last reference to the file buffer after
    ``read`` returned, and when that buffer wraps a Python ``bytes`` object the drop needs the GIL, which aborts the
    process if it happens during interpreter shutdown (apache/arrow#34314).
    """
    with io.new_input(data_file.file_path).open(seekable=False) as stream:
        read_buffer = getattr(stream, "read_buffer", None)  # pyarrow streams (PyArrowFileIO): zero-copy
        buffer = read_buffer() if callable(read_buffer) else _arrow_owned(stream.read())
    table = pq.ParquetFile(pa.BufferReader(buffer)).read(columns=columns, use_threads=True)
    target = schema if columns is None else pa.schema([schema.field(c) for c in columns])
    return target.empty_table() if table.num_rows == 0 else table.cast(target)


def _arrow_owned(data: bytes) -> pa.Buffer:
    """A copy of ``data`` in memory Arrow owns (one memcpy; only for FileIOs whose streams return Python bytes)."""
    buffer = pa.allocate_buffer(len(data))
    if data:
        np.frombuffer(buffer, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
    return buffer
