"""A global batch checked against the stream's payload schema before anything is written, and the nulls Arrow allows
where the schema says "never null" made harmless for the writers.

:func:`check_batch` (and :func:`check_shards`) refuse a malformed batch with a :class:`BatchError` naming the fix:
one pyarrow Table (or RecordBatch) per rank, the payload's columns with its types, no null where a field is required.
A non-nullable field nested under a nullable parent may still hold nulls in the slots where its parent is null (Arrow
allows it, and no reader sees them), which pyarrow's cast and Parquet writer refuse: :func:`hidden_nulls_filled` fills
those slots for the writer, for streams with such fields (:func:`has_required`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lakestream_iceberg.errors import SchemaMismatchError, ShardCountError

__all__ = ["check_batch", "check_shards", "has_required", "hidden_nulls_filled", "map_keys_unmasked"]


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
    nested = [has_required(want.type) for want in expected]  # once per batch, not per rank
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
                raise SchemaMismatchError(_columns_differ(rank, schema.names, expected.names))
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


def _columns_differ(rank: int, names: list[str], expected: list[str]) -> str:
    """The message for a shard whose column names are not the stream's: what differs, and what to do about it."""
    missing = [name for name in expected if name not in names]
    extra = [name for name in names if name not in expected]
    if missing:
        fix = f"lacks column(s) {missing}: add them (nulls where the column is nullable)"
    elif extra:
        fix = f"has column(s) {extra} the stream does not: drop them (table.select(stream.payload_arrow_schema.names))"
    elif len(names) != len(expected):
        repeated = sorted({name for name in names if names.count(name) > 1})
        fix = f"has column(s) {repeated} more than once: keep one of each"
    else:
        fix = "has the stream's columns in another order: reorder them with table.select(stream.payload_arrow_schema.names)"
    return f"shard for rank {rank} {fix}; the stream's columns are {expected} (in that order), the shard's {names}"


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


def has_required(data_type: pa.DataType) -> bool:
    """Whether a type has a non-nullable field anywhere below it."""
    return any(not f.nullable or has_required(f.type) for f in _children(data_type))


def _required_null(array: pa.Array, path: str) -> str | None:
    """The path of a non-nullable nested field holding a null where every parent is non-null (None: there is none).

    ``array`` holds only values whose parents are all non-null: each level keeps its non-null slots before looking at
    their children, so a null under a null (nullable) parent is fine, as Arrow and Parquet define it.
    """
    data_type = array.type
    if not has_required(data_type):
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


def hidden_nulls_filled(table: pa.Table) -> pa.Table:
    """``table`` (a shard that passed :func:`check_batch`) with every null a non-nullable nested field holds under a
    null parent replaced by a value: Arrow allows them (a struct taken with a null index has one under each null
    slot), but pyarrow's cast and Parquet writer refuse a non-nullable field holding nulls anywhere. No reader ever
    sees the values put there (their parent is null). Columns without such a field are returned as they are."""
    return _columns_rebuilt(table, has_required, _filled)


def _columns_rebuilt(table: pa.Table, holds: Callable[[pa.DataType], bool],
                     rebuild: Callable[[pa.Array], pa.Array]) -> pa.Table:
    """``table`` with ``rebuild`` applied to every chunk of the columns whose type ``holds``; a column none of whose
    chunks ``rebuild`` changed (returned as they are) stays the same column."""
    for i, field in enumerate(table.schema):
        if not holds(field.type):
            continue
        column = table.column(i)
        chunks = [rebuild(chunk) for chunk in column.chunks]
        if any(new is not old for new, old in zip(chunks, column.chunks)):
            table = table.set_column(i, field, pa.chunked_array(chunks, field.type))  # a struct's type keeps its field names
    return table


def _filled(array: pa.Array) -> pa.Array:
    """``array`` with its hidden nulls filled (see :func:`hidden_nulls_filled`): a struct or fixed-size list with a
    non-nullable field below it built again (zero-copy), a list or map only when its values change."""
    kind = array.type
    if not has_required(kind):
        return array
    mask = array.is_null() if array.null_count else None
    if pa.types.is_struct(kind):
        fields = _children(kind)
        # built again from its children as this slice holds them (field() honours the slice): pyarrow's cast looks
        # at the whole child, nulls outside the slice too
        children = [_own(_filled(array.field(i)), f) for i, f in enumerate(fields)]
        return pa.StructArray.from_arrays(children, fields=fields, mask=mask)
    if pa.types.is_map(kind):
        keys, items = array.keys, array.items  # whole children: the offsets index them
        new_keys, new_items = _own(_filled(keys), kind.key_field), _own(_filled(items), kind.item_field)
        if _KEYS_BITMAP_ABORTS_CAST:
            new_keys = _without_bitmap(new_keys)
        if new_keys is keys and new_items is items:
            return array
        return pa.MapArray.from_arrays(_offsets(array), new_keys, new_items, type=kind, mask=mask)
    if pa.types.is_fixed_size_list(kind):
        values = array.values.slice(array.offset * kind.list_size, len(array) * kind.list_size)  # this slice's
        return pa.FixedSizeListArray.from_arrays(_own(_filled(values), kind.value_field), type=kind, mask=mask)
    values = array.values  # a list: the whole child, which its offsets index
    new_values = _own(_filled(values), kind.value_field)
    if new_values is values:
        return array
    lists = pa.LargeListArray if pa.types.is_large_list(kind) else pa.ListArray
    return lists.from_arrays(_offsets(array), new_values, type=kind, mask=mask)


# pyarrow before 26 (the last release for Python 3.10 is 25) aborts the process, a failed C++ check and not an exception
# ("Map array keys array should have no nulls"), casting a map array whose keys carry a validity bitmap, as take() and
# filter() make them, to another key type: the writer casts string keys to Iceberg's large_string. A map's keys hold no
# null (check_batch refuses them), so the bitmap says nothing: the keys are built again without it.
_KEYS_BITMAP_ABORTS_CAST = int(pa.__version__.split(".")[0]) < 26


def map_keys_unmasked(table: pa.Table) -> pa.Table:
    """``table`` with the keys of every map in it, at any depth (in lists, structs, other maps' items), rebuilt without
    a validity bitmap, zero-copy; columns holding no map, and maps whose keys have none, are returned as they are.

    For a table that is about to be cast to a schema with other map types, before anything checked it: pyarrow before
    26 aborts the process casting a map whose keys carry a bitmap (as take() and filter() make them, and so Ray's
    blocks) to another key type. Unlike :func:`hidden_nulls_filled` it changes no value, so it may run before the
    checks: keys that hold a null (an invalid map) keep their bitmap."""
    return _columns_rebuilt(table, _holds_map, _keys_unmasked)


def _holds_map(data_type: pa.DataType) -> bool:
    return pa.types.is_map(data_type) or any(_holds_map(f.type) for f in _children(data_type))


def _keys_unmasked(array: pa.Array) -> pa.Array:
    """``array`` with every map's keys below it without a validity bitmap (see :func:`map_keys_unmasked`); rebuilt
    only where something changes, as :func:`_filled` rebuilds a nested array."""
    kind = array.type
    if not _holds_map(kind):
        return array
    mask = array.is_null() if array.null_count else None
    if pa.types.is_struct(kind):
        fields = _children(kind)
        children = [array.field(i) for i in range(len(fields))]  # field() honours the slice
        new = [_keys_unmasked(child) for child in children]
        if all(n is c for n, c in zip(new, children, strict=True)):
            return array
        return pa.StructArray.from_arrays(new, fields=fields, mask=mask)
    if pa.types.is_map(kind):
        keys, items = array.keys, array.items  # whole children: the offsets index them
        new_keys, new_items = _without_bitmap(_keys_unmasked(keys)), _keys_unmasked(items)
        if new_keys is keys and new_items is items:
            return array
        return pa.MapArray.from_arrays(_offsets(array), new_keys, new_items, type=kind, mask=mask)
    if pa.types.is_fixed_size_list(kind):
        values = array.values.slice(array.offset * kind.list_size, len(array) * kind.list_size)  # this slice's
        new_values = _keys_unmasked(values)
        if new_values is values:
            return array
        return pa.FixedSizeListArray.from_arrays(new_values, type=kind, mask=mask)
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return array  # a dictionary or extension type holding maps: as it is
    values = array.values  # a list: the whole child, which its offsets index
    new_values = _keys_unmasked(values)
    if new_values is values:
        return array
    lists = pa.LargeListArray if pa.types.is_large_list(kind) else pa.ListArray
    return lists.from_arrays(_offsets(array), new_values, type=kind, mask=mask)


def _without_bitmap(array: pa.Array) -> pa.Array:
    """``array`` (without nulls) with no validity bitmap, zero-copy; as it is when it has none, or children."""
    kind = array.type
    if array.buffers()[0] is None or array.null_count or kind.num_fields or pa.types.is_dictionary(kind) \
            or isinstance(kind, pa.ExtensionType):
        return array
    return pa.Array.from_buffers(kind, len(array), [None, *array.buffers()[1:]], null_count=0, offset=array.offset)


def _offsets(array: pa.Array) -> pa.Array:
    """A list or map array's offsets, as from_arrays takes them with a mask (not a slice of a longer buffer)."""
    offsets = array.offsets
    return pa.array(offsets.to_numpy()) if offsets.offset else offsets


def _own(array: pa.Array, field: pa.Field) -> pa.Array:
    """``array``, the values of ``field``, with no null when the field is non-nullable: each null slot (hidden under a
    null parent: check_batch refused any other) takes the first valid value, or a zero value when none is valid."""
    if field.nullable or not array.null_count:
        return array
    valid = array.is_valid()
    first = pc.index(valid, True).as_py()
    if first < 0:
        return _zeros(array.type, len(array))
    return array.take(pc.if_else(valid, pa.array(np.arange(len(array), dtype=np.int64)), first))


def _zeros(kind: pa.DataType, n: int) -> pa.Array:
    """``n`` non-null values of ``kind`` (zeros, empty strings and lists; nested: non-nullable fields filled)."""
    if isinstance(kind, pa.ExtensionType):
        return pa.ExtensionArray.from_storage(kind, _zeros(kind.storage_type, n))
    if pa.types.is_struct(kind):
        fields = _children(kind)
        return pa.StructArray.from_arrays([_zeros(f.type, n) for f in fields], fields=fields)
    if pa.types.is_fixed_size_list(kind):
        return pa.FixedSizeListArray.from_arrays(_zeros(kind.value_type, n * kind.list_size), type=kind)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        return pa.array([[]] * n, kind)
    if pa.types.is_fixed_size_binary(kind):
        return pa.array([b"\0" * kind.byte_width] * n, kind)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return pa.array([""] * n, kind)
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind):
        return pa.array([b""] * n, kind)
    if pa.types.is_boolean(kind):
        return pa.array([False] * n, kind)
    if pa.types.is_float16(kind):
        return pa.array(np.zeros(n, np.float16))
    if pa.types.is_temporal(kind):  # dates, times, timestamps, durations: the zero of their integers
        return pa.array(np.zeros(n, np.int64 if kind.bit_width == 64 else np.int32)).view(kind)
    return pa.array(np.zeros(n, np.int8)).cast(kind)  # numbers, decimals
