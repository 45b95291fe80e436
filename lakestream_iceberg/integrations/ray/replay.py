"""Whether a replayed shard holds the rows a published step stores: what ``verify_replays="rows"`` compares when a Ray
task's retry (or a re-run under the same run name) finds its seq already published."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["same_rows"]


def same_rows(stored: pa.Table, shard: pa.Table | pa.RecordBatch) -> bool:
    """Whether a replayed shard holds the rows a step stores: column by column, NaN equal to NaN (Arrow's ``equals``
    is IEEE: a float feature holding NaN would make every retry of a deterministic job look like a different one)."""
    if isinstance(shard, pa.RecordBatch):
        shard = pa.Table.from_batches([shard])
    if stored.num_rows != shard.num_rows or stored.num_columns != shard.num_columns:
        return False
    for a, b in zip(stored.columns, shard.columns, strict=True):
        if a.equals(b):
            continue
        if a.type != b.type:
            try:
                b = b.cast(a.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                return False
        if not _same_array(a.combine_chunks(), b.combine_chunks()):  # only when Arrow's equals says they differ
            return False
    return True


def _same_array(a: pa.Array, b: pa.Array) -> bool:
    """``a.equals(b)`` with NaN equal to NaN, in Arrow for floats and lists of floats (embeddings: no Python objects);
    other nested types (maps, structs) compare as Python values."""
    if len(a) != len(b) or a.null_count != b.null_count or not _every(pc.equal(a.is_null(), b.is_null())):
        return False
    if pa.types.is_floating(a.type):
        if a.type == pa.float16():  # no half-float compute kernels: float32 holds every half-float value, NaN too
            a, b = a.cast(pa.float32()), b.cast(pa.float32())
        return _every(pc.or_(pc.equal(a, b), pc.and_(pc.is_nan(a), pc.is_nan(b))))
    if pa.types.is_list(a.type) or pa.types.is_large_list(a.type) or pa.types.is_fixed_size_list(a.type):
        if not _every(pc.equal(pc.list_value_length(a), pc.list_value_length(b))):
            return False
        return _same_array(pc.list_flatten(a), pc.list_flatten(b))
    if a.equals(b):
        return True
    return _same_values(a.to_pylist(), b.to_pylist())


def _every(mask: pa.Array) -> bool:
    """Every value of a boolean array is true; nulls (positions null in both sides) and an empty array count as true."""
    return pc.all(pc.fill_null(mask, True)).as_py() is not False


def _same_values(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)  # NaN == NaN here
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # maps come back as lists of (key, value)
        return type(a) is type(b) and len(a) == len(b) and all(_same_values(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_values(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b
