"""How an item crosses from a DataLoader worker process to the training process: in one reused shared-memory segment.

DataLoader pickles each item a worker yields. torch pickles a tensor by copying its storage into fresh shared memory
and sending a file descriptor, which the training process fetches from the worker over a socket, one storage at a time.
For a step of 256 samples whose blobs were 256 tensors, that was 256 round trips per step, and the fresh pages cost a
page fault (and zeroing) on each side for every 4 KiB: ``num_workers=2`` ran about 3x slower than no workers on 2 cores.

:class:`Handoff` marks the dict item the dataset yields inside a worker. When DataLoader pickles it, every CPU tensor in
it (and both tensors of each :class:`~lakestream_iceberg.read.tensors.Blobs`) is copied into one segment of a per-worker
pool of anonymous shared memory (``memfd``); the pickle carries the segment's number and the layout, plus its descriptor
the first time only. The training process maps each segment once and builds the item as a plain ``dict`` of views of it,
but for tensors of at most ``COPIED_BYTES``, which it copies out (a kept ``item["sample_ids"]`` would otherwise hold the
whole segment: a loop keeping each step's ids took a segment per step, shared memory that only grew); when the last of
the views is gone it marks the segment free in the segment's first byte, and the worker writes a later item into it. A
segment the training process still holds is never written: items kept for as long as you like stay intact (the worker
makes another segment). An item no free segment fits gets a larger one, and the free ones it outgrew
give their memory back (items that grow step after step leave only the last sizes' memory taken). When DataLoader lets
go of a worker (its iterator ended, or the loader is gone), the training process unmaps that worker's segments; an item
still held keeps its own until it is dropped. Values of other types are pickled as they are; without workers nothing
changes. Where ``os.memfd_create`` is missing (not Linux) the item is a plain dict and torch's own sharing applies.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np

from lakestream_iceberg.errors import ReadError
from lakestream_iceberg.format.checks import check_int
from lakestream_iceberg.read.tensors import Blobs, require_torch

__all__ = ["Handoff", "advise_workers", "recommended_workers", "supported"]

log = logging.getLogger("lakestream_iceberg.read.dataset")

_ALIGN = 64  # every tensor starts on a 64-byte boundary, as Arrow aligns its buffers
_HEADER = _ALIGN  # byte 0: 1 while the training process holds the segment's item, 0 when free
_MIN_SEGMENT = 1 << 20
COPIED_BYTES = 64 << 10  # a tensor this small arrives as a copy, not a view of the segment (module docstring)


def supported() -> bool:
    """Whether items can be handed over through the segment pool here (Linux: ``os.memfd_create``)."""
    return hasattr(os, "memfd_create")


class _Segment:
    __slots__ = ("fd", "map", "sent", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("lakestream-handoff", getattr(os, "MFD_CLOEXEC", 0))
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.sent = False  # whether the training process got the descriptor already

    def free(self) -> bool:
        return self.map[0] == 0

    def empty(self) -> None:
        """Give the pages past the header back (read as zeros until written again): nobody views a free segment."""
        try:
            self.map.madvise(mmap.MADV_REMOVE, mmap.PAGESIZE, self.size - mmap.PAGESIZE)
        except (AttributeError, OSError):  # no MADV_REMOVE here: the segment keeps its memory, as it did
            pass

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class _Pool:
    """A worker's segments (one pool per process; a forked child starts its own)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.segments: list[_Segment] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[int, _Segment]:
        need = _HEADER + nbytes
        with self.lock:
            fitting = [(s.size, i) for i, s in enumerate(self.segments) if s.free() and s.size >= need]
            if fitting:
                index = min(fitting)[1]
            else:
                for outgrown in self.segments:  # free ones this item outgrew: their memory back, the header page kept
                    if outgrown.size > mmap.PAGESIZE and outgrown.free():
                        outgrown.empty()
                size = max(_MIN_SEGMENT, -(-(need + need // 4) // mmap.PAGESIZE) * mmap.PAGESIZE)
                index = len(self.segments)
                self.segments.append(_Segment(size))
            segment = self.segments[index]
            segment.map[0] = 1
            return index, segment


_pool: _Pool | None = None


def _pool_here() -> _Pool:
    global _pool
    if _pool is None or _pool.pid != os.getpid():
        _pool = _Pool()
    return _pool


class Handoff(dict):  # type: ignore[type-arg]
    """A dict that DataLoader sends to the training process through the worker's segment pool (module docstring)."""

    __slots__ = ("num_workers",)

    def __init__(self, item: dict[str, Any], *, num_workers: int = 1) -> None:
        super().__init__(item)
        self.num_workers = num_workers

    def __copy__(self) -> Handoff:  # DataLoader's default_convert copies a mapping before converting its values
        return Handoff(self, num_workers=self.num_workers)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        torch = require_torch()
        plan: list[tuple[str, str, Any]] = []
        tensors: list[Any] = []
        for key, value in self.items():
            if _shippable(torch, value):
                plan.append((key, "tensor", len(tensors)))
                tensors.append(value)
            elif isinstance(value, Blobs) and _shippable(torch, value.values) and _shippable(torch, value.offsets):
                plan.append((key, "blobs", len(tensors)))
                tensors += [value.values, value.offsets]
            else:
                plan.append((key, "value", value))
        layout, size = [], 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            layout.append((size, nbytes, _numpy_dtype(torch, tensor.dtype), tuple(tensor.shape)))
            size += -(-nbytes // _ALIGN) * _ALIGN
        pool = _pool_here()
        try:
            index, segment = pool.take(size)
        except OSError as exc:  # no segment now (descriptors or shared memory exhausted): raising here, in DataLoader's
            _fell_back(exc)     # queue feeder thread, would drop the item and the training loop would wait forever
            return dict, ({key: _resolved(torch, value) for key, value in self.items()},)  # torch's own sharing
        try:
            _copy_into(torch, segment, tensors, layout)
        except Exception as exc:  # noqa: BLE001 - a tensor the copy cannot take: raised here, in DataLoader's queue
            segment.map[0] = 0  # feeder thread, the item would be lost and the loop would wait for it forever
            _fell_back(exc)
            return dict, ({key: _resolved(torch, value) for key, value in self.items()},)  # torch's own sharing
        fd = None if segment.sent else DupFd(segment.fd)
        segment.sent = True
        return _rebuild, ((pool.pid, index), fd, segment.size, layout, plan, self.num_workers)


def _copy_into(torch: Any, segment: _Segment, tensors: list[Any], layout: list[tuple[int, int, Any, Any]]) -> None:
    """Copy ``tensors`` into ``segment`` at their ``layout`` offsets."""
    target = np.frombuffer(segment.map, dtype=np.uint8)
    for tensor, (start, nbytes, _, _) in zip(tensors, layout, strict=True):
        if nbytes:  # numpy's copy: one memcpy, never torch's intra-op threads
            tensor = _resolved(torch, tensor)  # a lazy view: its values, not its storage's
            flat = tensor.contiguous().reshape(-1)
            # one element under a stride other than 1 (``tokens[:, 0]`` of a one-row shard) counts as contiguous, and
            # view(uint8) refused it: every element of a contiguous tensor is 1 apart
            source = flat.as_strided((flat.numel(),), (1,)).view(torch.uint8).numpy()
            np.copyto(target[_HEADER + start : _HEADER + start + nbytes], source)
    del target  # an exported buffer would keep the mapping from being closed


def _resolved(torch: Any, value: Any) -> Any:
    """``value`` with lazy conjugate and negative views resolved: torch's own pickling of a shared tensor drops them
    (the values arrive conjugated back or negated)."""
    if isinstance(value, Blobs):
        return Blobs._of(_resolved(torch, value.values), _resolved(torch, value.offsets))
    if isinstance(value, torch.Tensor) and (value.is_conj() or value.is_neg()):
        return value.resolve_conj().resolve_neg()
    return value


# why items went through torch's own sharing, and how many (logged the first time in each process): counts, not one
# entry per item, as a worker whose segments cannot be made falls back at every step for as long as it runs
_fallbacks: Counter[str] = Counter()


def _fell_back(exc: Exception) -> None:
    if not _fallbacks:
        if isinstance(exc, OSError):
            log.warning("a DataLoader worker could not make a shared-memory segment for an item (%s: %s); items go "
                        "through torch's own sharing until it can (raise the open-file limit, ulimit -n, or free "
                        "/dev/shm)", type(exc).__name__, exc)
        else:
            log.warning("a DataLoader worker could not copy an item's tensors into its shared-memory segment (%s: %s); "
                        "such items go through torch's own sharing (please report it)", type(exc).__name__, exc)
    _fallbacks[type(exc).__name__] += 1


_numpy_dtypes: dict[Any, Any] = {}  # torch dtype -> the numpy dtype of its .numpy(), or the torch dtype where numpy has none


def _numpy_dtype(torch: Any, dtype: Any) -> Any:
    """The numpy dtype the training process rebuilds a tensor of ``dtype`` through (numpy's views are cheaper to make
    than torch's), or ``dtype`` itself where numpy has no equivalent (``bfloat16``): that one is rebuilt as a torch
    view."""
    known = _numpy_dtypes.get(dtype)
    if known is None:
        try:
            known = torch.empty(0, dtype=dtype).numpy().dtype
        except (TypeError, RuntimeError):
            known = dtype
        _numpy_dtypes[dtype] = known
    return known


def _shippable(torch: Any, value: Any) -> bool:
    # a nested tensor has strided layout but no single shape: torch's own pickling ships it (raising here, in the
    # queue's feeder thread, would drop the item and leave the training loop waiting for it forever)
    return (type(value) is torch.Tensor and value.device.type == "cpu" and value.layout == torch.strided
            and not value.requires_grad and not value.is_quantized and not value.is_nested)


# -- in the training process ---------------------------------------------------------------------------------------
_mapped: dict[tuple[int, int], mmap.mmap] = {}  # (worker pid, segment) -> its mapping, while DataLoader holds the worker
_mapped_lock = threading.RLock()  # a collection inside the lock may end a worker's Process object (_forget)
_owners: dict[int, Any] = {}  # worker pid -> a weak reference to its Process object, whose end drops its mappings


def _finalizer(work: Callable[..., None]) -> Callable[..., None]:
    """``work`` (idempotent) as a finalizer that finishes even when an exception is raised into it: DataLoader's
    SIGCHLD handler raises in the training thread when a worker died, at whatever line it is on, a finalizer's too,
    where it would stop the work half done (a dead worker's segments left mapped) and be lost anyway (an exception in a
    finalizer is only printed). DataLoader raises it again where the loop waits."""
    def run(*args: Any) -> None:
        for _ in range(_FINALIZER_TRIES):
            try:
                work(*args)
                return
            except Exception:  # noqa: BLE001, S112 - see the docstring; the work is done again from the start
                continue
    return run


_FINALIZER_TRIES = 8


def _release_now(segment: mmap.mmap, receiver: int) -> None:
    # only in the process that received the item: a forked child (another DataLoader's worker) that collects the item
    # as garbage inherited from it would free the segment a second time, maybe while it holds a later item
    if os.getpid() == receiver and not segment.closed:
        segment[0] = 0  # the worker may write its next item here


_release = _finalizer(_release_now)


def _mapping(key: tuple[int, int], fd: Any, size: int) -> mmap.mmap:
    with _mapped_lock:
        segment = _mapped.get(key)
        if fd is not None:
            for pid in {pid for pid, _ in list(_mapped)} - {key[0]}:  # workers of earlier loaders: drop theirs
                if not _alive(pid):
                    _forget_now(pid)
            try:  # the descriptor comes from the worker itself, over a socket: a dead worker cannot hand it over
                raw = fd.detach()
            except (OSError, EOFError) as exc:
                raise ReadError(
                    f"DataLoader worker (pid {key[0]}) exited before the training process took the shared memory of "
                    f"its item ({type(exc).__name__}: {exc}): it was killed (out of memory, or a signal). Make a new "
                    "DataLoader to go on (from the dataset's state_dict() or its consumer group's position to resume "
                    "where the loop was)"
                ) from exc
            try:
                segment = _mapped[key] = mmap.mmap(raw, size)
            finally:
                os.close(raw)
            _watch(key[0])
        if segment is None:
            raise RuntimeError(f"DataLoader worker {key[0]} sent an item in its shared-memory segment {key[1]}, which "
                               "this process never received; this is a bug in lakestream_iceberg, please report it")
        return segment


def _watch(pid: int) -> None:
    """Drop worker ``pid``'s mappings once DataLoader lets go of the worker (its ``Process`` object: the loader's
    iterator ended, or the loader is gone, so none of its items can still arrive): the last loader's segments would
    otherwise stay mapped, their memory taken, until another loader's worker sent its first item."""
    for child in multiprocessing.active_children():
        if child.pid == pid:
            watched = _owners.get(pid)
            if watched is None or watched() is not child:  # a first segment, or a later worker with an earlier's pid
                _owners[pid] = weakref.ref(child)
                weakref.finalize(child, _forget, pid, _owners[pid])
            return


def _forget_now(pid: int, owner: Any = None) -> None:
    """Drop the mappings of worker ``pid`` (when ``owner`` is given: if that worker's ``Process`` object is still the
    one watched for ``pid``); views still held keep theirs alive through their arrays."""
    with _mapped_lock:
        if owner is not None and _owners.get(pid) is not owner:
            return
        _owners.pop(pid, None)
        gone = {pid}
        if owner is not None:  # a loader let go of a worker: also the workers that were never watched and are gone
            gone |= {k[0] for k in _mapped if k[0] not in _owners and not _alive(k[0])}  # (one killed just as its
        for key in [k for k in list(_mapped) if k[0] in gone]:                          # first segment arrived)
            _mapped.pop(key, None)


_forget = _finalizer(_forget_now)  # also a finalizer (_watch): a SIGCHLD raised into it must not leave mappings behind


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rebuild(key: tuple[int, int], fd: Any, size: int, layout: list[tuple[int, int, Any, tuple[int, ...]]],
             plan: list[tuple[str, str, Any]], num_workers: int) -> dict[str, Any]:
    """The item in the training process: views of the worker's segment, which is released when they are all gone."""
    torch = require_torch()
    advise_workers(num_workers)
    segment = _mapping(key, fd, size)
    payload = np.frombuffer(segment, dtype=np.uint8, count=size - _HEADER, offset=_HEADER)
    weakref.finalize(payload, _release, segment, os.getpid())
    # numpy views of the payload, each wrapped by torch (3x cheaper than slicing a torch tensor of it); a dtype numpy
    # lacks comes as torch's own and is viewed through torch. Every tensor holds its view, every view the payload: the
    # payload dies, and the segment is released, with the last tensor. A tensor of at most COPIED_BYTES is a copy, so
    # that keeping one does not hold the segment. An empty tensor is made afresh: a view would start where the next
    # tensor does, and torch.save refuses two storages of one address with different dtypes.
    copied = COPIED_BYTES
    tensors = [_empty(torch, dtype, shape) if not nbytes
               else _tensor(torch, payload[start : start + nbytes], dtype, shape, copy=nbytes <= copied)
               for start, nbytes, dtype, shape in layout]
    del payload
    item: dict[str, Any] = {}
    for name, kind, value in plan:
        if kind == "tensor":
            item[name] = tensors[value]
        elif kind == "blobs":
            item[name] = Blobs._of(tensors[value], tensors[value + 1])
        else:
            item[name] = value
    return item


def _tensor(torch: Any, raw: np.ndarray, dtype: Any, shape: tuple[int, ...], *, copy: bool) -> Any:
    """The tensor of ``dtype`` (numpy's, or torch's where numpy has none) and ``shape`` in the bytes ``raw``: a view of
    them, or with ``copy`` in memory of its own."""
    if isinstance(dtype, np.dtype):
        array = raw.view(dtype).reshape(shape)
        return torch.from_numpy(array.copy() if copy else array)
    tensor = torch.from_numpy(raw).view(dtype).view(shape)
    return tensor.clone() if copy else tensor


def _empty(torch: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    """An empty tensor of ``dtype`` (numpy's, or torch's where numpy has none) and ``shape``, in memory of its own."""
    return torch.from_numpy(np.empty(shape, dtype)) if isinstance(dtype, np.dtype) else torch.empty(shape, dtype=dtype)


# -- when workers pay ----------------------------------------------------------------------------------------------
_advised: set[int] = set()  # the worker counts already advised on in this process (once each)


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def recommended_workers(*, cores: int | None = None) -> int:
    """The ``num_workers`` to give ``DataLoader`` for a :class:`LakestreamDataset` on this machine when decoding is the
    work (no heavy Python ``transform``): 0 on fewer than 5 usable cores, else ``min(cores - 2, 8)``.

    Without workers the dataset already decodes in 2 read-ahead threads beside the training loop (Parquet decoding
    runs outside the GIL), using about 1.5 cores; a worker decodes one step at a time, so fewer than 3 workers do not
    beat that, and every worker adds a handover per step (and its CPU: about 1.5x the CPU per sample on 2 cores). Two
    cores stay for the training loop and the receiving of items. A Python ``transform`` runs under the GIL in the
    training process's threads: there, workers pay from 2 free cores on, and measuring your loop decides.

    Args:
        cores: The usable cores to plan for (default: this process's CPU affinity).

    Returns:
        The ``num_workers`` to use.

    Raises:
        ConfigError: ``cores`` is not a positive int.
    """
    cores = _usable_cores() if cores is None else check_int(cores, what="cores", minimum=1)  # numpy ints too
    return 0 if cores < 5 else min(cores - 2, 8)


def advise_workers(num_workers: int, cores: int | None = None) -> bool:
    """Log once per process (the training process, on the first item from its workers) when ``num_workers``
    DataLoader workers leave no core free (docs/guide/training.md, "DataLoader workers"). Returns whether it logged."""
    if num_workers in _advised:
        return False
    cores = _usable_cores() if cores is None else cores
    if num_workers < cores:
        return False
    _advised.add(num_workers)
    log.warning(
        "LakestreamDataset under DataLoader(num_workers=%d) on %d usable CPU cores: with no core left free, workers gain "
        "little or nothing over num_workers=0, where the dataset already reads and decodes ahead in background threads "
        "(prefetch=). Workers pay off when each has a free core (num_workers < cores) and decoding or your transform "
        "dominates (zstd, many columns), and fewer than 3 workers rarely beat the 2 read-ahead threads. Use num_workers=%d "
        "here (lakestream_iceberg.recommended_workers())",
        num_workers, cores, recommended_workers(cores=cores),
    )
    return True
