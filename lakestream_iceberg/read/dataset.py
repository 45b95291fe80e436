"""The torch reader: a stream's steps as a ``torch.utils.data.IterableDataset``, in step order, resumable and elastic.

Each item is this consumer rank's shard of one step, built by ``collate`` (default :class:`TensorCollate`)::

    {"step": 7, "sample_ids": int64[n], "tokens": int32[n, L], "tokens_lengths": int64[n], "image": Blobs}

(``Blobs``: one uint8 tensor plus offsets; ``item["image"][i]`` and iteration give each sample's uint8 tensor.)

Use ``DataLoader(dataset, batch_size=None)``: an item already is a batch, and the dataset reads and decodes ahead in
background threads. Add ``num_workers=k`` only with a free core per worker and decoding or ``transform`` dominating
(docs/guide/training.md); an item then leaves its worker in one shared-memory segment
(:mod:`lakestream_iceberg.read.handoff`), and the training process logs once when ``k`` leaves no core free. Worker ``w`` of ``k`` takes
the steps ``start + w, start + w + k, ...``, which is exactly the order in which DataLoader interleaves its workers, so
steps come out in order, each once, with fork and spawn alike (a spawned worker reopens the stream from the catalog's
name and non-secret properties, and takes the credentials from its own pyiceberg configuration, see
:class:`lakestream_iceberg.read.stream_ref.StreamRef`).

**Torch is optional.** ``LakestreamDataset`` must subclass ``IterableDataset`` (DataLoader checks ``isinstance``), so the
class is built on first access through the module's ``__getattr__``: importing this module (or lakestream_iceberg)
never imports torch, and a missing torch raises :class:`MissingExtraError` naming the extra. The class is cached, so
``pickle`` finds it by name, as spawned workers need.

**Sample ids** are ``step * 2**32 + i`` where ``i`` is the sample's row in the global batch (the producer ranks'
shards concatenated in rank order): stable whatever the consumer world size.

**Elastic world size.** A consumer world size ``W`` equal to the producers' ``P`` reads shard ``r`` only. Otherwise every
global batch is partitioned deterministically, each sample to exactly one consumer rank, reading only the files needed:
``P = m*W``: rank ``r`` gets producer files ``[r*m, (r+1)*m)`` whole; ``W = m*P``: file ``r // m`` split in ``m`` row
ranges, the ``(r % m)``-th one; any other ``W``: the rows ``[r*n//W, (r+1)*n//W)`` of the concatenated batch of ``n``
rows. A Parquet shard is one row group, so a consumer holding part of a file still fetches all of it.

**Resume.** ``state_dict()`` is a plain dict ``{"next_step": s, "worker_id": w, "num_workers": k, "stream": uuid,
"branch": b, "last_file": path, "version": 1}``: the next step this instance (or this DataLoader worker) will deliver,
and of which stream (its table UUID) and branch; loading it into a dataset of another stream or branch is refused, and
so is loading it where the state's branch (on its own or under a fork of it) no longer holds ``last_file`` (a data file
of the last step delivered) at that step, or a state of a version this release does not read (a newer release saved
it: :mod:`lakestream_iceberg.read.resume`). It follows torchdata's ``StatefulDataLoader`` protocol (state taken in each worker
after each item, loaded in each worker before ``iter``); a state saved without workers (``k == 1``) can be loaded
under any number of workers. A loaded state resumes the next iteration only, with workers too (a
plain DataLoader's workers of later epochs start at ``start_step``).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lakestream_iceberg.connect.fork import fork_safe
from lakestream_iceberg.connect.integers import INT32_MAX
from lakestream_iceberg.connect.metrics import catalog_label
from lakestream_iceberg.connect.pointer import release_idle_connections
from lakestream_iceberg.connect.retry import read_with_retry
from lakestream_iceberg.errors import CheckpointError, ConfigError, RankError, StreamError
from lakestream_iceberg.format.checks import MAX_STEP, check_bool, check_int, check_seconds
from lakestream_iceberg.format.lineage import is_lakestream
from lakestream_iceberg.read.consumer import RankPositions, default_report_s
from lakestream_iceberg.read.follow import HeadWatcher, pump_steps
from lakestream_iceberg.read.handoff import Handoff, supported
from lakestream_iceberg.read.reader import StepFiles, check_columns
from lakestream_iceberg.read.relay_client import follower, head_reader
from lakestream_iceberg.read.resume import STATE_VERSION, LoadedState, check_resumable, delivered_on_both, still_holds
from lakestream_iceberg.read.stream_ref import StreamRef, forked_view
from lakestream_iceberg.read.tensors import Blobs, StepShard, TensorCollate, require_torch
from lakestream_iceberg.read.worker_exit import batched_by_default_collate, stop_on_shutdown

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["Blobs", "LakestreamDataset", "Segment", "StepShard", "TensorCollate", "partition", "require_torch"]

ID_SHIFT = 32
_frozen_in: int | None = None  # the process whose inherited objects _freeze_inherited froze


# -- which rows each consumer rank gets ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of producer rank ``source``'s file, whose first row is global row ``offset``."""

    source: int
    start: int
    stop: int
    offset: int


def partition(counts: Sequence[int], rank: int, world_size: int) -> list[Segment]:
    """The rows of one global batch (``counts[p]`` rows in producer rank ``p``'s file) that consumer ``rank`` gets.

    Deterministic, and over ``rank in range(world_size)`` a partition of all rows (see the module docstring).
    """
    producers = len(counts)
    offsets = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).tolist()
    if world_size == producers or producers % world_size == 0:
        per = producers // world_size
        return [Segment(p, 0, counts[p], offsets[p]) for p in range(rank * per, (rank + 1) * per)]
    if world_size % producers == 0:
        parts = world_size // producers
        source, part, n = rank // parts, rank % parts, counts[rank // parts]
        return [Segment(source, part * n // parts, (part + 1) * n // parts, offsets[source])]
    total = offsets[-1]
    lo, hi = rank * total // world_size, (rank + 1) * total // world_size
    return [
        Segment(p, max(lo, offsets[p]) - offsets[p], min(hi, offsets[p + 1]) - offsets[p], offsets[p])
        for p in range(producers)
        if max(lo, offsets[p]) < min(hi, offsets[p + 1])
    ]


# -- the dataset ---------------------------------------------------------------------------------------------------
def check_stream(stream: object) -> StreamTable:
    """``stream`` when it is a stream (``Stream.open``'s), else a :class:`ConfigError` (an AttributeError before)."""
    from lakestream_iceberg.format.table import StreamTable

    if not isinstance(stream, StreamTable):
        raise ConfigError(f"stream must be a lakestream Stream (Stream.open(catalog, 'namespace.name')), got "
                          f"{type(stream).__name__} {stream!r}"[:300])
    return stream


def _default_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        torch = require_torch()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            found = (torch.distributed.get_rank(), torch.distributed.get_world_size())
        else:
            try:
                found = (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
            except ValueError:
                raise ConfigError("environment variables RANK and WORLD_SIZE must be integers when set") from None
        rank = found[0] if rank is None else rank
        world_size = found[1] if world_size is None else world_size
    # bounded as a stream's: a consumer position of a rank past an Iceberg int is dropped from `lakestream lag` and the
    # consumers view as one "another program wrote", and a world size past a long was listed as NULL
    world_size = check_int(world_size, what="world_size", minimum=1, maximum=INT32_MAX, hint="ranks are Iceberg ints")
    rank = check_int(rank, what="rank", error=RankError)
    if not 0 <= rank < world_size:
        raise RankError(f"rank {rank!r} is outside 0..{world_size - 1} (consumer world size {world_size})")
    return rank, world_size


class _DatasetCore:
    """Everything of ``LakestreamDataset`` but the torch base class (see the module docstring)."""

    _branch_existed = False  # the branch was a branch when the dataset was made (a dataset pickled before: unknown)

    def __init__(
        self,
        stream: StreamTable,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        start_step: int = 1,
        end_step: int | None = None,
        follow: bool = False,
        branch: str = "main",
        timeout: float | None = 300.0,
        columns: list[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        collate: Callable[[StepShard], Any] | None = None,
        prefetch: int | None = None,
        poll_s: float = 0.02,
        max_poll_s: float | None = None,
        ship_credentials: bool = False,
        group: str | None = None,
        report_s: float | None = None,
        relay: bool | None = None,
    ) -> None:
        check_stream(stream)
        start_step = check_int(start_step, what="start_step", minimum=1, maximum=MAX_STEP, hint="steps start at 1")
        follow = check_bool(follow, what="follow")
        ship_credentials = check_bool(ship_credentials, what="ship_credentials")  # "false" must not ship secrets
        relay = follow if relay is None else check_bool(relay, what="relay")
        timeout = check_seconds(timeout, what="timeout", allow_none=True)
        poll_s = check_seconds(poll_s, what="poll_s", minimum=1e-3)
        max_poll_s = max(0.5, poll_s) if max_poll_s is None else check_seconds(max_poll_s, what="max_poll_s",
                                                                                minimum=poll_s)
        stream.refresh()  # a branch forked since the stream was opened is a branch
        branch = stream.require_branch(branch, doing="cannot read")
        ref = stream.table.metadata.refs.get(branch)  # a branch gone from here on was dropped (main may be unborn)
        # main holding only another engine's snapshots written before the first step is not yet born: repair removes
        # its ref (lifecycle/repair.py), and it is born with step 1 (every lakestream snapshot comes from main's steps)
        self._branch_existed = ref is not None and ref.snapshot_ref_type == "branch" and (
            branch != "main" or any(is_lakestream(s) for s in stream.table.metadata.snapshots))
        if end_step is not None:
            end_step = check_int(end_step, what="end_step", minimum=0, hint="or None")
        if prefetch is not None:
            prefetch = check_int(prefetch, what="prefetch", minimum=0, hint="or None")
        columns = check_columns(columns, stream.payload_arrow_schema, stream=stream.name)
        for name, function in (("transform", transform), ("collate", collate)):
            if function is not None and not callable(function):  # a TypeError at the first item, in a worker
                raise ConfigError(f"{name} must be a function (or None), got {type(function).__name__} {function!r}"[:300])
        self.rank, self.world_size = _default_rank_world(rank, world_size)
        self.start_step, self.end_step, self.follow, self.branch = start_step, end_step, follow, branch
        self.timeout, self.columns, self.transform, self.prefetch = timeout, columns, transform, prefetch
        self.collate = collate or TensorCollate()
        self.poll_s, self.max_poll_s, self.relay = poll_s, max_poll_s, relay
        self._ref = StreamRef.of(stream, include_secrets=ship_credentials)  # forked workers get them anyway
        fork_safe(stream.table.catalog)  # forked workers start with none of its connections (they use it in place)
        self._stream: StreamTable | None = stream
        self._pid = os.getpid()
        self._schema = stream.payload_arrow_schema
        self._init_runtime()
        self._end = end_step if follow else self._resolve_end(stream)
        self._position: dict[str, Any] = {"next_step": start_step, "worker_id": 0, "num_workers": 1}
        self._identity = {"stream": str(stream.table.metadata.table_uuid), "branch": branch}
        self._loaded = LoadedState(self._identity)  # a loaded state_dict until an iteration applies it (read/resume.py)
        self.last_step: int | None = None  # the last step this instance delivered
        if relay and follow:  # its readers follow through the host's relay: no idle catalog connection kept for them
            release_idle_connections(stream.table.catalog)
        if report_s is None:
            report_s = default_report_s(self.world_size)
        self._positions = None if group is None else RankPositions(  # read/consumer.py
            group=group, report_s=report_s, rank=self.rank, world_size=self.world_size, branch=branch,
            stream=self._identity["stream"])

    @classmethod
    def from_checkpoint(cls, stream: StreamTable, name: str, **kwargs: Any) -> Any:
        """A dataset starting right after checkpoint ``name`` (``checkpoint.step + 1``) on the checkpoint's branch.

        Other arguments are the constructor's (an explicit ``branch=`` wins).

        Example:
            >>> ds = LakestreamDataset.from_checkpoint(stream, "step-1000", follow=True)   # doctest: +SKIP

        Raises:
            CheckpointError: No retained checkpoint has that name, or its branch is no longer on its timeline (moved back
                under it, or dropped and made again under its name): fork from it instead.
            ConfigError: ``start_step`` is given: the checkpoint decides it.
        """
        if "start_step" in kwargs:
            raise ConfigError(f"from_checkpoint starts right after checkpoint {name!r}, so it takes no start_step; to "
                              "start at another step, use LakestreamDataset(stream, start_step=..., branch=...)")
        found = {c.name: c for c in check_stream(stream).checkpoints()}
        if name not in found:
            raise CheckpointError(f"no checkpoint {name!r} on {stream.name}; retained checkpoints: {sorted(found)}")
        checkpoint = found[name]
        branch = kwargs.setdefault("branch", getattr(checkpoint, "branch", "main"))
        if isinstance(branch, str):  # the constructor says what else a branch must be
            check_resumable(check_stream(stream), checkpoint, branch=branch)
        return cls(stream, start_step=checkpoint.step + 1, **kwargs)

    # -- pickling (spawned DataLoader workers) --------------------------------------------------------------------------
    def _init_runtime(self) -> None:
        self._stop = threading.Event()
        self._closers: list[Callable[[], None]] = []

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_stream", "_stop", "_closers"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stream = None
        self._init_runtime()

    def _stream_here(self) -> StreamTable:
        """The stream in this process: in a forked one a view of the parent's (SQL catalogs: no catalog round trip,
        and no connection until one is needed, see :func:`~lakestream_iceberg.read.follow.forked_view`), else reopened
        from the catalog (spawned processes; forked ones on other catalogs, whose HTTP sessions are the parent's)."""
        if self._stream is None or self._pid != os.getpid():
            view = None if self._stream is None else forked_view(self._stream)
            stream = view or self._ref.open()
            if str(stream.table.metadata.table_uuid) != self._identity["stream"]:
                raise StreamError(
                    f"table {stream.name} was dropped and created again since this dataset was made (table UUID "
                    f"{self._identity['stream']}, now {stream.table.metadata.table_uuid}): its schema, world size and "
                    "positions belong to the old table. Make the dataset again on the new stream"
                )
            self._stream, self._pid = stream, os.getpid()
            if self.relay and self.follow:  # the relay answers this process: no idle catalog connection kept for it
                release_idle_connections(stream.table.catalog)
        return self._stream

    def _resolve_end(self, stream: StreamTable) -> int:
        watcher = HeadWatcher(stream, branch=self.branch, existed=self._branch_existed)
        watcher.check()
        head = watcher.head()[0]
        return head if self.end_step is None else min(self.end_step, head)

    # -- resume ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The next step to deliver, and the stream (its table UUID) and branch it is a step of, as a plain dict (see
        the module docstring)."""
        return {**(self._loaded.pending() or self._position), **self._identity, "version": STATE_VERSION}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the next iteration at ``state["next_step"]`` (a ``state_dict()`` of this or another instance).

        Raises:
            ConfigError: Not such a state, or one of another stream or branch (a state without ``stream`` /
                ``branch``, from an earlier release, is taken as this dataset's).
            CheckpointError: The state's branch no longer holds the last step the state delivered as it was read
                (dropped and made again under its name, or moved back by another engine and published again), loaded
                on that branch or on a fork of it.
        """
        self._loaded.load(state, forked_after=lambda source, next_step, num_workers: delivered_on_both(
            self._stream_here(), branch=self.branch, source=source, next_step=next_step, num_workers=num_workers),
            holds=lambda branch, step, path: still_holds(self._stream_here(), branch=branch, step=step, path=path),
            in_worker=require_torch().utils.data.get_worker_info() is not None)

    # -- lag, shutdown ---------------------------------------------------------------------------------------------------
    def lag(self) -> int:
        """Head step minus the last step this instance delivered (before the first item: the step before the one it
        starts at, ``start_step`` or a loaded state's)."""
        watcher = HeadWatcher(self._stream_here(), branch=self.branch, existed=self._branch_existed)
        watcher.check()
        state = self._loaded.pending()
        if state is None and self.last_step is not None:
            delivered = self.last_step
        else:  # a loaded state, or nothing delivered yet: the step before the next one
            state = state or self._position
            delivered = state["next_step"] - state["num_workers"]
        return max(0, watcher.head()[0] - delivered)

    def close(self) -> None:
        """Stop iterations in progress (a waiting follow-mode iteration ends) and their prefetch threads."""
        self._stop.set()
        for closer in list(self._closers):
            closer()
        if self._positions is not None:
            self._positions.close()

    def track(self, loader: Any) -> Iterator[Any]:
        """``loader``'s items (a DataLoader over this dataset), this rank's position recorded in the training process
        as the loop receives each one: the way to record positions with DataLoader workers (read/consumer.py).

        Example:
            >>> for item in ds.track(DataLoader(ds, batch_size=None, num_workers=2)):   # doctest: +SKIP
            ...     train(item)
        """
        if self._positions is None:
            raise ConfigError("track() records a consumer position: make the dataset with group='<run name>'")
        stream = self._stream_here()
        head = head_reader(stream, ref=self._ref, branch=self.branch, relay=self.relay and self.follow,
                           poll_s=self.poll_s, max_poll_s=self.max_poll_s)  # a follower's head through the host relay
        return self._positions.track(loader, stream, first_step=(self._loaded.pending() or self._position)["next_step"],
                                     head=head)

    # -- iteration ---------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        torch = require_torch()
        info = torch.utils.data.get_worker_info()
        worker_id, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        if batched_by_default_collate(caller=sys._getframe(1)):
            # DataLoader's default batch_size=1 (or any N) stacks N steps: every tensor got a leading dimension of N,
            # "step" a tensor, and Blobs raised a TypeError naming no fix; N > 1 with workers merged steps w, w + k, ...
            raise ConfigError(
                "LakestreamDataset items are batches already (this rank's shard of one step): iterate it with "
                "DataLoader(dataset, batch_size=None). DataLoader's batch_size (1 unless given) makes torch's "
                "default_collate stack that many steps into one item; to combine steps on purpose, pass a collate_fn")
        if info is not None:
            _freeze_inherited()
        stream = self._stream_here()
        if info is None and not self.follow:
            self._end = self._resolve_end(stream)  # workers keep the end fixed in the main process: they agree
        return self._iterate(stream, worker_id, num_workers, in_worker=info is not None)

    def _iterate(self, stream: StreamTable, worker_id: int, num_workers: int, *, in_worker: bool = False) -> Iterator[Any]:
        # the loaded state goes to this iteration when it is made (iter()), not at its first item: an iterator dropped
        # unstarted (StatefulDataLoader's, resuming a state saved at the end of an epoch) left it to the next one,
        # whose epoch then started past the last step and delivered nothing
        first = self._loaded.first(worker_id, num_workers, start_step=self.start_step, in_worker=in_worker)
        self._position = {"next_step": first, "worker_id": worker_id, "num_workers": num_workers}
        return self._steps(stream, worker_id, num_workers, first, in_worker=in_worker)

    def _steps(self, stream: StreamTable, worker_id: int, num_workers: int, first: int, *,
               in_worker: bool = False) -> Iterator[Any]:
        handoff = in_worker and supported()
        self._stop.clear()
        io = stream.io
        watcher, files_of = follower(stream, ref=self._ref, branch=self.branch, relay=self.relay and self.follow,
                                     poll_s=self.poll_s, max_poll_s=self.max_poll_s,
                                     existed=self._branch_existed)
        planned: dict[int, str] = {}  # step -> a data file of it, as planned: a saved state names its timeline by it

        retry_s = stream.config.io_retry_timeout_s

        def load(snapshot: Any, step: int) -> Any:
            # a storage failure past pyarrow's own attempts (S3 throttling a manifest's GET): retried as stream.read
            # retries, for lakestream.io.retry-timeout-ms, rather than ending the iteration
            files = read_with_retry(lambda: files_of(snapshot, step), timeout_s=retry_s,
                                    what=f"looking up step {step} of {stream.name}", properties=io.properties)
            if files:
                planned[step] = files[0].file_path
            return self._load(stream, io, files, step, handoff=handoff, in_worker=in_worker)

        release_head: Callable[[], None] | None = None
        if self._positions is None:
            report = None
        else:
            # the steps-behind gauge's head (read only where prometheus_client is installed, every METRICS_S): a
            # follower's watcher polls only once the rank has read ahead up to the head it last saw, so a rank falling
            # behind would show its lag shrinking while it grew; ask for the head of now, through the host's relay (one
            # local request) or with one pointer query. Without follow the iteration ends at the head it saw.
            head: Callable[[], int | None] = lambda: watcher.head()[0]  # noqa: E731
            if self.follow and not in_worker:
                head, release_head = head_reader(stream, ref=self._ref, branch=self.branch, relay=self.relay,
                                                 poll_s=self.poll_s, max_poll_s=self.max_poll_s)
            report = self._positions.iteration(stream, in_worker=in_worker, head=head, first_step=first)
            if report is None and release_head is not None:
                release_head()
                release_head = None
        steps = pump_steps(
            watcher,
            load,
            first=first, stride=num_workers, end=self._end, follow=self.follow, prefetch=self._prefetch(in_worker),
            timeout=self.timeout, poll_s=self.poll_s, max_poll_s=self.max_poll_s, stop=self._stop, closers=self._closers,
        )
        # in a worker, a follow-mode wait ends when DataLoader shuts its workers down (read/worker_exit.py)
        watch = stop_on_shutdown(self._stop) if in_worker and self.follow else None
        finished = False
        try:
            with closing(steps):
                began = time.monotonic()  # the loop waits for data from its next() to the yield
                try:
                    for step, item in steps:
                        self._position = {"next_step": step + num_workers, "worker_id": worker_id,
                                          "num_workers": num_workers, "last_file": planned.pop(step, None)}
                        self.last_step = step
                        if report is not None:
                            report.delivered(step, wait_s=time.monotonic() - began)
                        yield item
                        began = time.monotonic()
                except _CallerError as wrapped:  # collate's or transform's own error, as they raised it
                    raise wrapped.error from wrapped.error.__cause__
            finished = not self._stop.is_set()
        finally:
            if watch is not None:
                watch.close()
            try:
                if report is not None:
                    report.close(closed=finished)
            finally:
                if release_head is not None:
                    release_head()

    def _prefetch(self, in_worker: bool) -> int:
        """Read-ahead threads: ``prefetch``, else 2 in the training process and 1 in a DataLoader worker, where the
        workers decode in parallel: one thread lets a worker fetch and decode its next step while DataLoader hands
        the last one over (with none, a worker's core idles while it waits on storage or the handover)."""
        if self.prefetch is not None:
            return int(self.prefetch)
        return 1 if in_worker else 2

    def _load(self, stream: StreamTable, io: Any, files: Any, step: int, *, handoff: bool = False,
              in_worker: bool = False) -> Any:
        def read() -> tuple[Any, list[Any], list[int]]:
            with StepFiles(io, files, world_size=stream.world_size, packed=stream.config.packed, schema=self._schema,
                           decode_threads=not in_worker) as data:  # workers decode in parallel already: no Arrow pool
                segments = [seg for seg in partition(data.counts, self.rank, self.world_size) if seg.stop > seg.start]
                ranges = [(seg.source, seg.start, seg.stop) for seg in segments]
                return data.read_ranges(ranges, self.columns), segments, data.counts

        # a transient storage failure past pyarrow's own 3 attempts (S3 answering 503 SlowDown a while) is retried with
        # bounded backoff for lakestream.io.retry-timeout-ms, as stream.read does; a missing file (FileNotFoundError:
        # GC collected it) is not transient and goes to pump_steps, which reads the step again on the current head
        table, segments, counts = read_with_retry(read, what=f"reading step {step} rank {self.rank} of {stream.name}",
                                                  timeout_s=stream.config.io_retry_timeout_s, properties=io.properties)
        if self._positions is not None:
            ranges = [(seg.source, seg.start, seg.stop) for seg in segments]
            self._positions.read(files, ranges, counts=counts, packed=stream.config.packed, name=stream.name,
                                 catalog=catalog_label(stream.table))
        ids = [np.arange(seg.offset + seg.start, seg.offset + seg.stop, dtype=np.int64) for seg in segments]
        sample_ids = (ids[0] if len(ids) == 1 else np.concatenate(ids) if ids else np.empty(0, np.int64)) + (step << ID_SHIFT)
        try:
            item = self.collate(StepShard(step=step, rank=self.rank, world_size=self.world_size, table=table,
                                          sample_ids=sample_ids))
            item = item if self.transform is None else self.transform(item)
        except FileNotFoundError as exc:  # the user's own file (a vocabulary, an image by path): no stream file that
            raise _CallerError(exc) from exc  # GC deleted, which pump_steps would read again and report as missing
        # in a DataLoader worker, a dict item crosses to the training process as one shared-memory buffer (handoff.py)
        return Handoff(item, num_workers=self._position["num_workers"]) if handoff and type(item) is dict else item


class _CallerError(Exception):
    """A ``FileNotFoundError`` that ``collate`` or ``transform`` raised, carried through :func:`pump_steps` (which reads a
    step again on a ``FileNotFoundError``, taking it for a stream file that lifecycle GC deleted) to the iteration, which
    raises ``error`` itself."""

    def __init__(self, error: FileNotFoundError) -> None:
        super().__init__(str(error))
        self.error = error


def _freeze_inherited() -> None:
    """In a DataLoader worker, once: move every object it started with out of the garbage collector's sight
    (``gc.freeze()``).

    A worker starts with the training process's whole heap (forked: torch, the model, every module; spawned: its own
    imports), a few hundred thousand objects or millions. Left in the collector's sight, the first full collection in
    the worker walks all of them, and in a forked one also writes into every page it walks, copying the pages it shared
    with its parent: 0.2-0.3 s with torch and pyiceberg imported (more with a model), during which the worker's
    threads stand still: its reads, and the head relay when the worker serves it (every reader of the host then waits).
    Measured on PostgreSQL with commit notifications (benchmarks/fanout.py, 1 rank, 1 worker): that one collection,
    around the 64th step, was the slowest step of every run (210-300 ms, the others under 50 ms). Frozen, a collection
    walks only what the worker made itself. Nothing is kept that was not already there: a forked worker's frozen
    objects are its parent's, in pages it shares with the parent; only cyclic garbage among them is no longer freed.
    """
    global _frozen_in
    if _frozen_in != os.getpid():
        _frozen_in = os.getpid()
        gc.freeze()


_lock = threading.Lock()
_dataset_class: type | None = None


def _build_class() -> type:
    global _dataset_class
    with _lock:
        if _dataset_class is None:
            torch = require_torch()

            class LakestreamDataset(_DatasetCore, torch.utils.data.IterableDataset):  # type: ignore[misc,name-defined]
                __doc__ = _DOC

            LakestreamDataset.__module__ = __name__
            LakestreamDataset.__qualname__ = "LakestreamDataset"  # pickle finds it through __getattr__
            _dataset_class = LakestreamDataset
    return _dataset_class


def __getattr__(name: str) -> Any:
    if name == "LakestreamDataset":
        return _build_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_DOC = """A stream as a torch ``IterableDataset``: this rank's shard of each step, in step order.

    Args:
        stream: The stream to read (any catalog; reopened by name in DataLoader worker processes).
        rank, world_size: This consumer's rank and world size; default to torch.distributed's when initialised, else
            the ``RANK``/``WORLD_SIZE`` environment variables, else 0/1. May differ from the producers' (elastic).
        start_step: First step to deliver.
        end_step: Last step to deliver (inclusive). With ``follow=False`` iteration ends at ``min(end_step, head)``,
            the head being read when iteration starts (without workers) or when the dataset was built (the end every
            DataLoader worker uses, so they agree).
        follow: Wait for steps not yet published: iteration goes on until ``end_step`` (without it, for good), each
            wait bounded by ``timeout``.
        branch: The branch to read.
        timeout: Seconds a follow-mode iteration waits for its next step with no step published before raising
            ``ReadTimeoutError`` (default 300: producers paused for longer end the loop; None: forever); a DataLoader
            worker's next step is ``num_workers`` ahead.
        columns: Payload columns to deliver (default: all).
        transform: ``item -> item``, applied after ``collate``, in a prefetch thread.
        collate: ``StepShard -> item``; default :class:`TensorCollate` (padding and packing documented there).
        prefetch: Steps read ahead in background threads (0: read in the iterating thread). Default: 2 without
            DataLoader workers, 1 in each worker (which decodes without Arrow's thread pool: the workers are the
            parallelism).
        poll_s, max_poll_s: Follow-mode polling backoff bounds (seconds; max_poll_s defaults to max(0.5, poll_s)).
            With the relay, its holder polls every ``poll_s`` (every ``max_poll_s`` where commit notifications wake it).
        group: Record this rank's position under this consumer group (a training run's name) for ``lakestream lag``:
            one upsert every ``report_s`` seconds, never a table commit; with DataLoader workers iterate
            ``dataset.track(loader)`` (:mod:`lakestream_iceberg.read.consumer`). None (default): nothing is recorded.
            A printable string of at most 200 characters, and at most 255 bytes URL-quoted (it names a folder).
        report_s: Seconds between position reports. Default: 5, or ``world_size / 200`` beyond 1,000 ranks (20,000
            ranks: 100), so that a job's ranks make at most 200 position writes a second in all.
        relay: Follow through the host's head relay (:mod:`lakestream_iceberg.read.relay`): one process per host
            polls the catalog and reads the table's metadata for every rank and DataLoader worker of that host, the
            others ask it over a unix socket. Default: on in follow mode; ``False`` polls the catalog from every reader.
            Where no private runtime directory is usable, readers read directly.
        ship_credentials: Put the catalog's credentials (``s3.secret-access-key``, ...) into the dataset's pickle, in
            clear text. Off by default: forked DataLoader workers inherit them, and spawned workers (or any process
            that unpickles the dataset) resolve them from their own ``.pyiceberg.yaml`` / ``PYICEBERG_CATALOG__<NAME>__*``
            environment for the same catalog name. **Warning:** anything that sees the pickle then sees the secrets.

    Raises:
        ConfigError: An argument of the wrong type or range, ``columns`` naming a column the stream does not have,
            or ``branch`` not a branch of the stream.
        RankError: ``rank`` outside ``0..world_size-1``.
        MissingExtraError: torch is not installed (``pip install 'lakestream-iceberg[torch]'``).

    Example:
        >>> ds = LakestreamDataset(stream, follow=True, timeout=600)                   # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=None)   # workers: docs/guide/training.md  # doctest: +SKIP
        >>> for item in loader:                                                        # doctest: +SKIP
        ...     train(item["tokens"], item["tokens_lengths"])
        >>> ds.state_dict()        # with num_workers=0; else use torchdata's StatefulDataLoader   # doctest: +SKIP
        {'next_step': 43, 'worker_id': 0, 'num_workers': 1, 'stream': '<the table UUID>', 'branch': 'main'}
    """

if TYPE_CHECKING:
    from torch.utils.data import IterableDataset

    class LakestreamDataset(_DatasetCore, IterableDataset):  # noqa: D101
        ...
