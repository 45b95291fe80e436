"""TensorCollate's padded and packed layouts against a plain-Python reference, for every padding path of ``_pad``.

``_pad`` has three ways to build a padded array (a view when all rows have one length, a boolean mask for short rows,
one byte copy per row for long rows); all must give the same values, dtypes, shapes and pad placement, whatever the
Arrow layout (nulls, sliced arrays, several chunks, values not starting at offset 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakestream_iceberg.read.tensors import Blobs, StepShard, TensorCollate, _pad

pytest.importorskip("torch")  # the dataset's tests need the torch extra (the core's run without it)
import torch  # noqa: E402

LIST_TYPES = [pa.int8(), pa.int32(), pa.int64(), pa.uint16(), pa.float16(), pa.float32(), pa.float64()]


def lists(rows: list[list | None], kind: pa.DataType, list_size: int = -1) -> pa.Array:
    """``pa.array(rows, pa.list_(kind, list_size))`` built from numpy scalars: pyarrow before 21 turns no Python number
    into a float16 (ArrowTypeError: Expected np.float16 instance)."""
    scalar = pa.array([], kind).to_numpy(zero_copy_only=False).dtype.type
    return pa.array([None if r is None else [scalar(x) for x in r] for r in rows], pa.list_(kind, list_size))


def reference(rows: list[list | bytes | None], pad: int | float, dtype: np.dtype) -> np.ndarray:
    rows = [[] if r is None else list(r) for r in rows]
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), pad, dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def collate(table: pa.Table, **kwargs) -> dict:
    shard = StepShard(step=1, rank=0, world_size=1, table=table, sample_ids=np.arange(table.num_rows, dtype=np.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "non-writable NumPy array" warning would fail here
        return TensorCollate(**kwargs)(shard)


row_lengths = st.one_of(
    st.lists(st.integers(0, 4), max_size=12),  # short rows: the mask path
    st.lists(st.integers(0, 80), min_size=1, max_size=12),  # long rows: the per-row copy path
    st.integers(1, 40).flatmap(lambda n: st.lists(st.just(n), min_size=1, max_size=6)),  # one length: a view
)


@settings(max_examples=200, deadline=None)
@given(
    lengths=row_lengths,
    kind=st.sampled_from(LIST_TYPES),
    pad=st.sampled_from([0, -1, 7]),
    nulls=st.lists(st.booleans(), max_size=12),
    cut=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    chunks=st.integers(1, 3),
)
def test_padded_lists_match_the_reference(lengths, kind, pad, nulls, cut, chunks) -> None:
    if pa.types.is_unsigned_integer(kind) and pad < 0:
        pad = 0
    rng = np.random.default_rng(len(lengths) + 31 * sum(lengths))
    dtype = pa.array([], kind).to_numpy().dtype  # not kind.to_pandas_dtype(): pyarrow < 26 imports pandas there
    rows: list = [rng.integers(0, 100, n).astype(dtype).tolist() for n in lengths]
    rows = [None if i < len(nulls) and nulls[i] else r for i, r in enumerate(rows)]
    array = lists(rows, kind)
    lo, hi = min(cut[0], len(rows)), max(len(rows) - cut[1], min(cut[0], len(rows)))
    array = array.slice(lo, hi - lo)  # the values no longer start at offset 0
    rows = rows[lo:hi]
    step = max(1, -(-len(rows) // chunks))
    parts = [array.slice(i, step) for i in range(0, len(rows), step)] or [array]
    table = pa.table({"t": pa.chunked_array(parts, pa.list_(kind))})

    item = collate(table, pad_value=pad)
    expected = reference(rows, pad, dtype)
    assert item["t"].dtype == torch.from_numpy(expected).dtype
    assert tuple(item["t"].shape) == expected.shape
    assert np.array_equal(item["t"].numpy(), expected)
    assert item["t_lengths"].dtype == torch.int64
    assert item["t_lengths"].tolist() == [0 if r is None else len(r) for r in rows]
    assert item["t"].numpy().flags.writeable

    packed = collate(table, lists="packed")
    offsets = packed["t_offsets"].tolist()
    assert [packed["t"][a:b].tolist() for a, b in zip(offsets, offsets[1:], strict=False)] == [
        [] if r is None else np.asarray(r, dtype).tolist() for r in rows
    ]


@settings(max_examples=100, deadline=None)
@given(lengths=row_lengths, nulls=st.lists(st.booleans(), max_size=12))
def test_padded_blobs_match_the_reference(lengths, nulls) -> None:
    blobs = [None if i < len(nulls) and nulls[i] else bytes((i * 7 + j) % 256 for j in range(n))
             for i, n in enumerate(lengths)]
    table = pa.table({"b": pa.array(blobs, pa.binary())})
    item = collate(table, binary="padded", pad_value=-1)  # blobs pad with 0 whatever pad_value
    assert np.array_equal(item["b"].numpy(), reference(blobs, 0, np.dtype(np.uint8)))
    assert item["b_lengths"].tolist() == [0 if b is None else len(b) for b in blobs]
    listed = collate(table)
    assert [bytes(t.numpy()) for t in listed["b"]] == [b or b"" for b in blobs]
    as_list = collate(table, binary="list")["b"]
    assert isinstance(as_list, list) and [bytes(t.numpy()) for t in as_list] == [b or b"" for b in blobs]


@settings(max_examples=60, deadline=None)
@given(lengths=row_lengths, nulls=st.lists(st.booleans(), max_size=12), cut=st.integers(0, 3))
def test_blobs_behave_as_the_list_of_rows(lengths, nulls, cut) -> None:
    blobs = [None if i < len(nulls) and nulls[i] else bytes((i * 5 + j) % 256 for j in range(n))
             for i, n in enumerate(lengths)]
    array = pa.array(blobs, pa.binary())
    cut = min(cut, len(array))
    expected = [b or b"" for b in blobs[cut:]]
    item = collate(pa.table({"b": array.slice(cut)}))  # values not starting at offset 0
    rows = item["b"]
    assert isinstance(rows, Blobs) and len(rows) == len(expected)
    assert [bytes(t.numpy()) for t in rows] == expected
    assert [bytes(rows[i].numpy()) for i in range(len(expected))] == expected
    assert [bytes(rows[-i - 1].numpy()) for i in range(len(expected))] == expected[::-1]
    assert [bytes(t.numpy()) for t in rows.tolist()] == expected
    assert [bytes(t.numpy()) for t in rows[1:]] == expected[1:]
    assert rows.lengths.tolist() == [len(b) for b in expected] and rows.offsets.tolist()[0] == 0
    assert all(t.dtype == torch.uint8 for t in rows)
    as_floats = rows.to(torch.float32)  # the bytes converted; offsets stay int64 indices (cast, they misplaced rows)
    assert as_floats.offsets.dtype == torch.int64 and as_floats.offsets.tolist() == rows.offsets.tolist()
    assert [t.tolist() for t in as_floats] == [[float(x) for x in b] for b in expected]
    with pytest.raises(IndexError):
        rows[len(expected)]


@pytest.mark.parametrize("pad", [0, -3])
def test_pad_copies_long_rows_into_fresh_memory(pad: int) -> None:
    """The per-row copy path: every value lands at its row's start, the rest of each row holds the pad value, and
    the source is untouched (it may be Arrow's read-only memory)."""
    lengths = [300, 0, 17, 512, 1]
    values = np.arange(sum(lengths), dtype=np.int32)
    values.flags.writeable = False
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = _pad(values, offsets, pad)
    assert out.shape == (5, 512) and out.dtype == np.int32 and out.flags.writeable and out.flags.c_contiguous
    for i, n in enumerate(lengths):
        assert np.array_equal(out[i, :n], values[offsets[i] : offsets[i + 1]])
        assert (out[i, n:] == pad).all()
    assert np.array_equal(values, np.arange(sum(lengths), dtype=np.int32))


NUMERIC_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
                 pa.float16(), pa.float32(), pa.float64(), pa.bool_()]


@pytest.mark.parametrize("kind", NUMERIC_TYPES, ids=str)
def test_the_numpy_dtype_of_a_column_is_the_one_arrow_converts_to(kind: pa.DataType) -> None:
    from lakestream_iceberg.read.tensors import _numpy_dtype

    assert _numpy_dtype(kind) == pa.array([], kind).to_numpy(zero_copy_only=False).dtype


def test_numbers_and_lists_become_tensors_without_pandas() -> None:
    """pandas is no dependency: ``DataType.to_pandas_dtype()`` of pyarrow 18 to 25 imports it (ModuleNotFoundError without
    it), and the collate asked it for the numpy dtype of every number column and list. Run where pandas cannot be
    imported, whether this environment has it or not."""
    code = f"""
import sys
class NoPandas:  # import pandas raises ModuleNotFoundError from here on, as where it is not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "pandas":
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, NoPandas())
import numpy as np, pyarrow as pa
from lakestream_iceberg.read.tensors import StepShard, TensorCollate
kinds = [{", ".join(f"pa.{k}()" for k in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                          "float16", "float32", "float64", "bool_"))}]
columns = {{}}
for i, kind in enumerate(kinds):
    dtype = pa.array([], kind).to_numpy(zero_copy_only=False).dtype
    columns[f"n{{i}}"] = pa.array(np.array([1, 0, 1], dtype))
    if kind != pa.bool_():
        columns[f"l{{i}}"] = pa.ListArray.from_arrays(pa.array([0, 2, 2, 3], pa.int32()), pa.array(np.array([1, 2, 3], dtype)))
        columns[f"f{{i}}"] = pa.FixedSizeListArray.from_arrays(pa.array(np.array([1, 2, 0, 1, 3, 4], dtype)), 2)
table = pa.table(columns)
item = TensorCollate()(StepShard(step=1, rank=0, world_size=1, table=table, sample_ids=np.arange(3, dtype=np.int64)))
for i, kind in enumerate(kinds):
    dtype = pa.array([], kind).to_numpy(zero_copy_only=False).dtype
    assert item[f"n{{i}}"].numpy().dtype == dtype and item[f"n{{i}}"].tolist() == [1, 0, 1], (kind, item[f"n{{i}}"])
    if kind != pa.bool_():
        assert item[f"l{{i}}"].numpy().dtype == dtype and item[f"l{{i}}"].tolist() == [[1, 2], [0, 0], [3, 0]], kind
        assert item[f"f{{i}}"].numpy().dtype == dtype and item[f"f{{i}}"].tolist() == [[1, 2], [0, 1], [3, 4]], kind
assert "pandas" not in sys.modules
print("ok")
"""
    root = str(Path(__file__).resolve().parents[2])  # this checkout's lakestream_iceberg, not an installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_empty_shard() -> None:
    table = pa.table({"t": pa.array([], pa.list_(pa.int32())), "b": pa.array([], pa.binary())})
    item = collate(table)
    assert tuple(item["t"].shape) == (0, 0) and item["t"].dtype == torch.int32
    # the default binary output is Blobs since issue 42 (was a list: `item["b"] == []`); it is empty all the same
    assert item["t_lengths"].tolist() == [] and len(item["b"]) == 0 and list(item["b"]) == []
    assert collate(table, binary="list")["b"] == []


@pytest.mark.parametrize("column", [
    pa.array([1.5, None], pa.float32()),
    pa.array([[2], [1, None]], pa.list_(pa.int32())),
    pa.array([[1, 2], None], pa.list_(pa.int64(), 2)),  # a null fixed-size list came out as a Python list
    pa.array([[3, 4], [1, None]], pa.list_(pa.float32(), 2)),  # a null element came out as its raw slot: 0.0
    pa.array([[1, 2], [3, 4], [5, None]], pa.list_(pa.int16(), 2)).slice(1),
], ids=["number", "list element", "fixed-size row", "fixed-size element", "fixed-size sliced"])
def test_a_null_no_tensor_can_hold_is_a_read_error(column: pa.Array) -> None:
    from lakestream_iceberg.errors import ReadError

    with pytest.raises(ReadError, match="'c' holds|'c' has"):
        collate(pa.table({"c": column}))
    assert collate(pa.table({"c": column.slice(0, 1)}))["c"].shape[0] == 1  # the rows before the null convert


@pytest.mark.parametrize("long_rows", [False, True])
def test_a_pad_value_the_column_cannot_hold_is_a_config_error(long_rows: bool) -> None:
    from lakestream_iceberg.errors import ConfigError

    n = 40 if long_rows else 2
    table = pa.table({"t": pa.array([list(range(n)), [1]], pa.list_(pa.uint8()))})
    with pytest.raises(ConfigError, match="pad_value"):
        collate(table, pad_value=-1)
    for bad in (float("nan"), float("inf"), 2**70):  # cast to an integer column, NaN and inf padded with INT_MIN (a
        with pytest.raises(ConfigError, match="pad_value"):  # warning only); 2**70 raised a raw TypeError
            collate(table, pad_value=bad)
    for bad in (True, None, "0"):  # pads that are no number: at construction, not at the first padded step
        with pytest.raises(ConfigError, match="pad_value"):
            TensorCollate(pad_value=bad)  # type: ignore[arg-type]
    floats = pa.table({"t": pa.array([list(range(n)), [1]], pa.list_(pa.int32()))})
    assert collate(floats, pad_value=2.7)["t"][1, 1:].tolist() == [2] * (n - 1)  # cast like np.full: truncated


@pytest.mark.parametrize(("kind", "pad"), [(pa.uint8(), 300.0), (pa.uint8(), -1.0), (pa.int8(), 1e30),
                                         (pa.uint8(), np.int64(-1)), (pa.int32(), np.int64(2**40)),
                                         (pa.int64(), np.uint64(2**64 - 1)), (pa.int8(), np.float32(1000)),
                                         (pa.float16(), 1e10)])
def test_a_float_or_numpy_pad_value_the_column_cannot_hold_is_a_config_error(kind: pa.DataType, pad: object) -> None:
    """Only Python ints were checked: a float or numpy pad out of the column's range wrapped silently (300.0 padded a
    uint8 column with 44, np.int64(-1) with 255, np.int64(2**40) an int32 column with 0), 1e30 padded with INT_MIN
    and 1e10 a float16 column with infinity (a RuntimeWarning at most)."""
    from lakestream_iceberg.errors import ConfigError

    table = pa.table({"t": lists([[1, 2, 3], [1]], kind)})
    with pytest.raises(ConfigError, match="pad_value"):
        collate(table, pad_value=pad)
    assert collate(table, pad_value=np.int8(7))["t"][1].tolist() == [1, 7, 7]  # a pad that fits, numpy or not
    if pa.types.is_integer(kind):
        assert collate(table, pad_value=5.9)["t"][1].tolist() == [1, 5, 5]  # truncated toward zero, as np.full does


@pytest.mark.parametrize(("columns", "lists"), [
    ({"step": pa.array([5, 6], pa.int64())}, "padded"),
    ({"sample_ids": pa.array([5, 6], pa.int64())}, "padded"),
    ({"tokens": pa.array([[1], [2, 3]]), "tokens_lengths": pa.array([9, 9])}, "padded"),
    ({"tokens_lengths": pa.array([9, 9]), "tokens": pa.array([[1], [2, 3]])}, "padded"),
    ({"tokens": pa.array([[1], [2, 3]]), "tokens_offsets": pa.array([9, 9])}, "packed"),
])
def test_a_column_whose_item_key_the_collate_makes_too_is_refused(columns: dict, lists: str) -> None:
    """Item keys were one dict: a payload column named step replaced the step number (the position tracking then
    counted steps instead), one named sample_ids the ids, and tokens_lengths beside a list column tokens the lengths
    (or the other way round, by column order): silently."""
    from lakestream_iceberg.errors import ConfigError

    with pytest.raises(ConfigError, match="rename the column"):
        collate(pa.table(columns), lists=lists)
    assert collate(pa.table({"tokens": pa.array([[1], [2, 3]]), "tokens_len": pa.array([9, 9])}))["tokens_len"].tolist() == [9, 9]


def test_padded_memory_outlives_the_table_and_later_steps() -> None:
    """The padded tensor owns its memory (Arrow's pool): dropping the shard's table and padding more steps, which
    reuse freed pool memory, leaves earlier tensors intact."""
    import gc

    rows = [list(range(i, i + 20 + 3 * i)) for i in range(30)]
    item = collate(pa.table({"t": pa.array(rows, pa.list_(pa.int64()))}), pad_value=-5)
    expected = reference(rows, -5, np.dtype(np.int64))
    for k in range(20):  # each table and tensor is freed by reference counting as soon as it is dropped
        other = collate(pa.table({"t": pa.array([[k] * (25 + k), [k]] * 15, pa.list_(pa.int64()))}), pad_value=9)
        del other
    gc.collect()
    assert np.array_equal(item["t"].numpy(), expected)
    view = item["t"][:, :5]  # a view: holds the storage, hence the pool buffer
    del item
    gc.collect()
    for k in range(5):
        collate(pa.table({"t": pa.array([[k] * (25 + k), [k]] * 15, pa.list_(pa.int64()))}), pad_value=9)
    assert np.array_equal(view.numpy(), expected[:, :5])


@pytest.mark.parametrize(("values", "offsets", "match"), [
    ([1, 2], [0, 2], "torch tensors"),  # AttributeError: 'list' object has no attribute 'dim'
    (np.zeros(2, np.uint8), np.array([0, 2]), "torch tensors"),
    (torch.zeros(2, dtype=torch.uint8), torch.tensor([0.0, 2.0]), "integers"),
    (torch.zeros(2, dtype=torch.uint8), torch.tensor([0, 5]), "at most len"),  # row 0 was cut to 2 bytes
    (torch.zeros(2, dtype=torch.uint8), torch.tensor([2, 0]), "rise"),  # row 0 was empty
    (torch.zeros(2, dtype=torch.uint8), torch.tensor([-1, 2]), "rise"),
])
def test_blobs_made_by_hand_refuse_what_is_no_rows(values: object, offsets: object, match: str) -> None:
    from lakestream_iceberg.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        Blobs(values=values, offsets=offsets)
    ok = Blobs(values=torch.arange(3, dtype=torch.uint8), offsets=torch.tensor([0, 1, 1, 3]))
    assert [row.tolist() for row in ok] == [[0], [], [1, 2]]
