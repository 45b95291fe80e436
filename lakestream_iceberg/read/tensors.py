"""Turning one consumer rank's Arrow rows of a step into torch tensors (the default ``collate`` of the dataset).

Token lists become a right-padded 2-D tensor plus ``<col>_lengths`` (or, packed, a flat tensor plus ``<col>_offsets``),
binary blobs become :class:`Blobs` (one flat uint8 tensor plus offsets, indexed and iterated like a list of uint8
tensors), numbers and fixed-size lists become tensors sharing the decoded
Arrow memory: no copy where Arrow's buffers allow it. torch is imported on first use only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lakestream_iceberg.errors import ConfigError, MissingExtraError, ReadError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["Blobs", "StepShard", "TensorCollate", "require_torch"]

TORCH_EXTRA = "pip install 'lakestream-iceberg[torch]'"


def require_torch(feature: str = "LakestreamDataset") -> Any:
    """Import torch, or raise :class:`MissingExtraError` naming the extra to install."""
    try:
        import torch
    except ImportError as exc:
        raise MissingExtraError(f"{feature} needs PyTorch, which is not installed; install it with {TORCH_EXTRA}") from exc
    return torch


@dataclass(frozen=True)
class StepShard:
    """What ``collate`` receives: one consumer rank's rows of one step."""

    step: int
    rank: int
    world_size: int
    table: pa.Table
    sample_ids: np.ndarray  # int64, one per row


def _numpy_dtype(kind: pa.DataType) -> np.dtype:
    """numpy's dtype for an Arrow integer, floating point or boolean type, without pandas: before pyarrow 26,
    ``DataType.to_pandas_dtype()`` imports pandas and raises ``ModuleNotFoundError`` where it is not installed."""
    if pa.types.is_boolean(kind):
        return np.dtype(np.bool_)
    code = "f" if pa.types.is_floating(kind) else "u" if pa.types.is_unsigned_integer(kind) else "i"
    return np.dtype(f"{code}{kind.byte_width}")


def _view(array: pa.Array, start: int = 0, stop: int | None = None, *, writeable: bool = True) -> np.ndarray:
    """Elements ``[start, stop)`` of a null-free primitive array as numpy, zero-copy when Arrow's buffer is mutable
    (or when ``writeable=False``: the caller copies anyway, e.g. into a padded array)."""
    stop = len(array) if stop is None else stop
    dtype = _numpy_dtype(array.type)
    if pa.types.is_boolean(array.type):
        return array.slice(start, stop - start).to_numpy(zero_copy_only=False)
    if stop <= start:
        return np.empty(0, dtype=dtype)
    out = np.frombuffer(array.buffers()[1], dtype=dtype, count=stop - start, offset=(array.offset + start) * dtype.itemsize)
    return out if out.flags.writeable or not writeable else out.copy()  # torch warns on read-only memory


def _offsets(array: pa.Array) -> np.ndarray:
    """The ``len + 1`` offsets of a list or binary array (absolute into its values), as int64."""
    large = pa.types.is_large_list(array.type) or pa.types.is_large_binary(array.type)
    dtype = np.dtype(np.int64 if large else np.int32)
    raw = np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array) + 1, offset=array.offset * dtype.itemsize)
    return raw.astype(np.int64)


def _pad(values: np.ndarray, offsets: np.ndarray, pad_value: int | float) -> np.ndarray:
    """Rows ``values[offsets[i]:offsets[i+1]]`` right-padded to the longest (offsets relative to ``values``)."""
    lengths = np.diff(offsets)
    n = len(lengths)
    width = int(lengths.max()) if n else 0
    if n and (lengths == width).all():
        return values.reshape(n, width)  # all the same length: a view, no copy
    out = _pool_array((n, width), values.dtype)
    np.copyto(out, pad_value, casting="unsafe")  # exactly what np.full does with the pad value (casts, errors, warnings)
    if len(values) >= 16 * n:  # long rows (token sequences): one memcpy per row beats a mask over n * width
        _copy_rows(out, values, offsets)
    else:
        out[np.arange(width) < lengths[:, None]] = values
    return out


def _pool_array(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised, writable, C-contiguous array in memory from Arrow's memory pool (64-byte aligned).

    Arrow's allocator (mimalloc or jemalloc) keeps freed pages for the next allocation, where glibc hands a padded
    tensor's megabyte back to the kernel when it is freed and takes fresh, zero-filled pages again for the next step
    (about 100 page faults a step for 256 x 1152 int32, against about 15 from the pool). The memory is released when
    the last tensor or array viewing it goes; it counts in ``pyarrow.total_allocated_bytes()``.
    """
    nbytes = shape[0] * shape[1] * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(pa.allocate_buffer(nbytes), dtype=dtype).reshape(shape)


def _copy_rows(out: np.ndarray, values: np.ndarray, offsets: np.ndarray) -> None:
    """``out[i, :len_i] = values[offsets[i]:offsets[i+1]]`` for every row, as byte-slice assignments of memoryviews.

    Same bytes as numpy row assignment, at about half the cost per row (no index parsing, no temporary views), and
    without dropping the GIL: numpy releases and retakes it around every copy of more than 500 elements, and each of
    those is a chance to hand it to a waiting thread (another prefetch thread, the training loop) mid-step.
    """
    item = values.dtype.itemsize
    # numpy's stubs give ndarray its __buffer__ on Python 3.12+ only (mypy checks 3.11): an ndarray is a Buffer
    source = memoryview(cast("Buffer", np.ascontiguousarray(values).view(np.uint8)))
    target = memoryview(cast("Buffer", out.reshape(-1).view(np.uint8)))  # fresh from _pool_array: C-contiguous, a view
    bounds = (offsets * item).tolist()
    row = out.shape[1] * item
    start = 0
    for lo, hi in zip(bounds, bounds[1:]):
        target[start : start + hi - lo] = source[lo:hi]
        start += row


class Blobs:
    """A binary column's rows as one flat uint8 tensor plus offsets, used like a list of uint8 tensors.

    ``blobs[i]`` is row ``i`` (``values[offsets[i]:offsets[i+1]]``, a view), ``len(blobs)`` the number of rows, and
    iterating gives the rows in order, so code written for a list of tensors keeps working. It is two tensors
    whatever the number of rows: a DataLoader worker hands it to the training process as one buffer, where a list
    holds one tensor (and one shared-memory handle) per sample. ``tolist()`` gives the list.

    Args:
        values: Every row's bytes, concatenated (uint8, 1-D).
        offsets: ``len(rows) + 1`` int64 offsets into ``values``; row ``i`` is ``values[offsets[i]:offsets[i+1]]``.

    Raises:
        ConfigError: ``values`` or ``offsets`` is not a 1-D torch tensor, ``offsets`` not integers, or (on the CPU)
            not rising from >= 0 to at most ``len(values)``.

    Example:
        >>> item = next(iter(LakestreamDataset(stream)))                  # doctest: +SKIP
        >>> [bytes(b.numpy()) for b in item["image"]]                    # doctest: +SKIP
        >>> item["image"].values, item["image"].offsets                  # doctest: +SKIP
    """

    __slots__ = ("offsets", "values")

    def __init__(self, *, values: Any, offsets: Any) -> None:
        for name, tensor in (("values", values), ("offsets", offsets)):
            if not callable(getattr(tensor, "dim", None)) or not hasattr(tensor, "dtype"):
                raise ConfigError(f"Blobs takes torch tensors, got {name} of type {type(tensor).__name__}; convert it "
                                  "with torch.as_tensor(...)")
        if values.dim() != 1 or offsets.dim() != 1 or len(offsets) < 1:
            raise ConfigError(f"Blobs takes a 1-D values tensor and 1-D offsets of n + 1 entries, got shapes "
                              f"{tuple(values.shape)} and {tuple(offsets.shape)}")
        if offsets.dtype.is_floating_point or offsets.dtype.is_complex or str(offsets.dtype) == "torch.bool":
            raise ConfigError(f"Blobs offsets must be integers (int64), got {offsets.dtype}")
        if offsets.device.type == "cpu":  # rows past the values were cut short, decreasing offsets gave empty rows
            if int(offsets[0]) < 0 or int(offsets[-1]) > len(values) or bool((offsets[1:] < offsets[:-1]).any()):
                raise ConfigError(f"Blobs offsets must rise from >= 0 to at most len(values) ({len(values)}), got "
                                  f"{offsets[:8].tolist()}{' ...' if len(offsets) > 8 else ''}")
        self.values, self.offsets = values, offsets  # uint8 [total]; int64 [n + 1], offsets[0] == 0

    @classmethod
    def _of(cls, values: Any, offsets: Any) -> Blobs:
        """A ``Blobs`` of tensors valid by construction (the collate's, from a decoded Arrow array; one made from
        another ``Blobs``; one rebuilt from a DataLoader worker's), without the checks: they cost about 10 us a step
        in the worker and the training process each (two tensor reductions read back to Python), 15-20% of the
        training process's work per item under ``num_workers=2``."""
        blobs = cls.__new__(cls)
        blobs.values, blobs.offsets = values, offsets
        return blobs

    @property
    def lengths(self) -> Any:
        """int64 ``[n]``: each row's length in bytes."""
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self.tolist()[index]
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"Blobs index {index} out of range for {n} rows")
        lo, hi = self.offsets[i : i + 2].tolist()
        return self.values[lo:hi]

    def __iter__(self) -> Iterator[Any]:
        bounds = self.offsets.tolist()
        values = self.values
        return (values[lo:hi] for lo, hi in zip(bounds, bounds[1:]))

    def tolist(self) -> list[Any]:
        """The rows as a list of uint8 tensors (views of ``values``), what ``binary="list"`` gives.

        Returns:
            One uint8 tensor per row.
        """
        return list(self)

    def pin_memory(self) -> Blobs:
        """Both tensors in pinned memory (``DataLoader(pin_memory=True)`` calls this).

        Returns:
            A new ``Blobs`` of pinned tensors.
        """
        return Blobs._of(self.values.pin_memory(), self.offsets.pin_memory())

    def to(self, *args: Any, **kwargs: Any) -> Blobs:
        """``Tensor.to`` on ``values``; ``offsets`` move to the same device and stay int64 (e.g.
        ``blobs.to("cuda", non_blocking=True)``; ``blobs.to(torch.float32)`` converts the bytes only).

        Args:
            *args: ``Tensor.to``'s positional arguments (a device, a dtype).
            **kwargs: ``Tensor.to``'s keyword arguments (``non_blocking=True``, ...).

        Returns:
            A new ``Blobs`` of the moved tensors.
        """
        values = self.values.to(*args, **kwargs)  # a dtype applies to the bytes: offsets cast to it would misplace rows
        offsets = self.offsets.to(values.device, non_blocking=bool(kwargs.get("non_blocking", False)),
                                  copy=bool(kwargs.get("copy", False)))
        if self.offsets.device.type != "cpu" and offsets.device.type == "cpu":  # offsets made off the CPU: never checked
            return Blobs(values=values, offsets=offsets)
        return Blobs._of(values, offsets)

    def __repr__(self) -> str:
        return f"Blobs({len(self)} rows, {self.values.numel()} bytes)"


class TensorCollate:
    """The default ``collate``: Arrow columns to tensors.

    * numeric and bool columns -> 1-D tensors (zero-copy views of the decoded Parquet buffers);
    * fixed-size lists of numbers -> 2-D tensors (zero-copy);
    * lists of numbers (token ids): ``lists="padded"`` -> ``col`` ``[n, max_len]`` right-padded with ``pad_value`` plus
      ``col_lengths`` (int64 ``[n]``); ``lists="packed"`` -> ``col`` flat (zero-copy) plus ``col_offsets`` (int64
      ``[n + 1]``, row ``i`` is ``col[offsets[i]:offsets[i+1]]``) and ``col_lengths``;
    * binary -> uint8: ``binary="blobs"`` (the default) -> :class:`Blobs`, list-like (``len``, ``blobs[i]``,
      iteration give uint8 tensors) but two tensors whatever the row count, so DataLoader workers hand it over
      cheaply; ``"list"`` -> a Python list of ``n`` tensors, each a view of one buffer
      (``blobs.tolist()`` gives the same); ``"padded"`` (with zeros) and ``"packed"`` as for lists;
    * strings and anything else -> Python lists.

    A null list or blob counts as empty; a null number (in a column, a list or a fixed-size list) or a null
    fixed-size list raises :class:`ReadError` (fill it upstream or pass your own ``collate``).

    Args:
        lists: ``"padded"`` or ``"packed"``: how list columns become tensors.
        binary: ``"blobs"``, ``"list"``, ``"padded"`` or ``"packed"``: how binary columns become tensors.
        pad_value: The value padded list columns are filled with.

    Raises:
        ConfigError: ``lists`` or ``binary`` is not one of its values, or ``pad_value`` not an int or float; when
            called: ``pad_value`` does not fit a padded column, or a column would make a key the item already has
            (a column named ``step`` or ``sample_ids``, or ``tokens_lengths`` beside a list column ``tokens``).

    Example:
        >>> LakestreamDataset(stream, collate=TensorCollate(lists="packed"))   # doctest: +SKIP
    """

    def __init__(self, *, lists: str = "padded", binary: str = "blobs", pad_value: int | float = 0) -> None:
        if lists not in ("padded", "packed"):
            raise ConfigError(f"lists={lists!r}: use 'padded' or 'packed'")
        if binary not in ("blobs", "list", "padded", "packed"):
            raise ConfigError(f"binary={binary!r}: use 'blobs', 'list', 'padded' or 'packed'")
        if isinstance(pad_value, (bool, np.bool_)) or not isinstance(pad_value, (int, float, np.integer, np.floating)):
            raise ConfigError(f"pad_value={pad_value!r}: use an int or a float")
        self.lists, self.binary, self.pad_value = lists, binary, pad_value

    def __call__(self, shard: StepShard) -> dict[str, Any]:
        torch = require_torch("TensorCollate")
        item: dict[str, Any] = {"step": shard.step, "sample_ids": torch.from_numpy(shard.sample_ids)}
        made_by = {"step": "the step number", "sample_ids": "the samples' ids"}
        for name, column in zip(shard.table.column_names, shard.table.columns, strict=True):
            array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            converted = self._convert(torch, name, array)
            for key in converted:  # a payload column named step, sample_ids or tokens_lengths silently replaced the
                if key in made_by:  # collate's key (or was replaced by it)
                    raise ConfigError(
                        f"TensorCollate cannot make item[{key!r}] of column {name!r}: the item's {key!r} is "
                        f"{made_by[key]}; rename the column, leave it out with columns=, or pass your own collate=")
                made_by[key] = f"column {name!r}" if key == name else f"the {key[len(name) + 1:]} of column {name!r}"
            item.update(converted)
        return item

    def _convert(self, torch: Any, name: str, array: pa.Array) -> dict[str, Any]:
        kind = array.type
        if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
            if array.null_count:
                raise ReadError(f"column {name!r} has {array.null_count} nulls, which a tensor cannot hold; fill them "
                                "before committing or pass collate= to handle them")
            return {name: torch.from_numpy(_view(array))}
        if pa.types.is_fixed_size_list(kind) and _numeric(kind.value_type):
            start, stop = array.offset * kind.list_size, (array.offset + len(array)) * kind.list_size
            nulls = array.null_count or (array.values.null_count and array.values.slice(start, stop - start).null_count)
            if nulls:  # a null row or element: no tensor holds it (its raw slot read as a number, often 0)
                raise ReadError(f"column {name!r} holds null rows or elements of its fixed-size lists, which a tensor "
                                "cannot hold; fill them before committing or pass collate= to handle them")
            values = _view(array.values, start, stop)
            return {name: torch.from_numpy(values.reshape(len(array), kind.list_size))}
        is_list = (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _numeric(kind.value_type)
        is_blob = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
        if not (is_list or is_blob):
            return {name: array.to_pylist()}
        if array.null_count:
            array = pc.fill_null(array, pa.scalar([] if is_list else b"", kind))
        offsets = _offsets(array)
        lengths = np.diff(offsets)
        lo, hi = int(offsets[0]) if len(offsets) else 0, int(offsets[-1]) if len(offsets) else 0
        if is_list:
            if array.values.null_count and pc.sum(array.flatten().is_null()).as_py():
                raise ReadError(f"column {name!r} holds null list elements; fill them or pass collate= to handle them")
            mode = self.lists
            values = _view(array.values, lo, hi, writeable=mode != "padded")  # padding copies the values anyway
        else:
            data = array.buffers()[2]
            mode = self.binary
            values = np.frombuffer(data, dtype=np.uint8, count=hi - lo, offset=lo) if hi > lo else np.empty(0, np.uint8)
            values = values if values.flags.writeable or mode == "padded" else values.copy()
        if mode == "blobs":
            return {name: Blobs._of(torch.from_numpy(values), torch.from_numpy(offsets - lo))}
        if mode == "list":
            return {name: list(torch.split(torch.from_numpy(values), lengths.tolist()))}
        if mode == "packed":
            return {name: torch.from_numpy(values), f"{name}_offsets": torch.from_numpy(offsets - lo), f"{name}_lengths": torch.from_numpy(lengths)}
        pad = self.pad_value if is_list else 0
        try:
            _check_pad(pad, values.dtype)
            padded = _pad(values, offsets - lo, pad)
        except OverflowError:
            raise ConfigError(f"pad_value={pad!r} does not fit column {name!r} ({kind}); choose another pad_value") from None
        if not padded.flags.writeable:  # rows of one length: a view of read-only Arrow memory, which torch must not get
            padded = padded.copy()
        return {name: torch.from_numpy(padded), f"{name}_lengths": torch.from_numpy(lengths)}


def _check_pad(pad: float, dtype: np.dtype) -> None:
    """Raise OverflowError when ``pad`` cast to ``dtype`` is not ``pad`` (a float truncated toward zero aside, as
    np.full does): the unsafe cast wraps a numpy integer or a float out of range (-1 pads a uint8 column with 255, 300.0
    with 44), pads NaN, infinity and huge floats with INT_MIN, and a float too big for a float column with infinity."""
    if dtype.kind in "iu":
        if not math.isfinite(pad):
            raise OverflowError
        info = np.iinfo(dtype)
        whole = int(pad) if isinstance(pad, (int, np.integer)) else math.trunc(float(pad))  # numpy has no __trunc__
        if not int(info.min) <= whole <= int(info.max):
            raise OverflowError
    elif dtype.kind == "f" and math.isfinite(pad) and abs(float(pad)) > float(np.finfo(dtype).max):
        raise OverflowError


def _numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


