"""A trainer rank's position in a stream, as Kafka consumer groups keep offsets: recorded cheaply, read back checked.

A :class:`~lakestream_iceberg.read.dataset.LakestreamDataset` made with ``group="run-42"`` records, for its (group,
rank), the last step it delivered, how long the training loop waited for data, and how many bytes it fetched. The record
is one upsert into the catalog's database (or one small object per rank elsewhere, see
:mod:`lakestream_iceberg.connect.positions`), made by a background thread every ``report_s`` seconds (default 5; ``world_size / 200`` beyond 1,000 ranks,
see :func:`default_report_s`) and once more when the iteration ends or the dataset is closed: never a commit to the table, and never I/O in the training loop.
``lakestream lag`` (:mod:`lakestream_iceberg.read.lag`) reads the records back. Rank 0's reporter also expires the
positions of groups silent for longer than ``lakestream.consumers.retention-ms``, at most once an hour per process and
stream (see :mod:`lakestream_iceberg.connect.positions`).

**Which process records.** The position is what the training loop received, so it is recorded where the loop runs:

* without DataLoader workers (``num_workers=0``, the default), the dataset's own iterator runs in the training process
  and records each step as it hands it over; the data wait is the time the loop spent inside ``next()``;
* with DataLoader workers, the iterators run in the worker processes, which read ahead of the loop by up to
  ``prefetch_factor * num_workers`` steps and do not know what the loop took. Iterate ``dataset.track(loader)`` instead
  of ``loader``: the training process then records each item as the loop receives it, and the time it waited for it.
  Without ``track`` nothing is recorded (each worker logs once how to turn it on). Bytes fetched are counted where the
  reads happen: with workers, by the workers' ``lakestream_consumer_read_bytes_total`` (export it with
  ``prometheus_client``'s multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``); the position shows none.

The document each rank records is :class:`~lakestream_iceberg.read.position.Position`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lakestream_iceberg.connect.fork import no_fork_inside
from lakestream_iceberg.connect.metrics import catalog_label, consumer_metrics
from lakestream_iceberg.connect.positions import PositionStore
from lakestream_iceberg.format.checks import check_seconds
from lakestream_iceberg.format.properties import CONSUMERS_RETENTION
from lakestream_iceberg.read.follow import HeadWatcher
from lakestream_iceberg.read.position import Position, check_group
from lakestream_iceberg.read.reader import WHOLE_FILE_BYTES

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["DEFAULT_REPORT_S", "EXPIRY_INTERVAL_S", "REPORTS_PER_S", "PositionReporter", "RankPositions",
           "default_report_s", "fetched_bytes", "track"]

log = logging.getLogger(__name__)

DEFAULT_REPORT_S = 5.0
METRICS_S = 5.0  # how often the steps-behind-head gauge is refreshed when positions are written less often
REPORTS_PER_S = 200  # the default report_s keeps a job's ranks under this many position writes a second in all


def default_report_s(world_size: int) -> float:
    """Seconds between a rank's position reports when the dataset names none: ``DEFAULT_REPORT_S`` up to 1,000 ranks,
    then ``world_size / REPORTS_PER_S`` (20,000 ranks: every 100 s), so that a job's positions cost the catalog's
    database (or the object store) at most ``REPORTS_PER_S`` writes a second however many ranks it has."""
    return max(DEFAULT_REPORT_S, world_size / REPORTS_PER_S)
EXPIRY_INTERVAL_S = 3600.0  # rank 0's reporter expires old groups at most this often per process and stream
_expired_at: dict[str, float] = {}  # stream location -> time.monotonic() of this process's last expiry there (two
# reporters of one process racing past the check both expire: harmless, and no lock is held across a fork)


class PositionReporter:
    """Records one rank's position: counters updated by the training loop, one upsert per ``report_s`` by a daemon
    thread, a last one at :meth:`close`. A failed upsert is logged and retried at the next report: positions are
    informative, and never stop training.

    Args:
        store: Where to record.
        group, rank, world_size, branch, stream: The key and the stream (``stream``: its table UUID).
        name, catalog: The stream's name and its catalog's (the metrics' ``stream`` and ``catalog`` labels).
        report_s: Seconds between reports.
        workers, source: How the dataset is read (see the module docstring).
        head: Returns the head step of the branch as this process last saw it (for the steps-behind-head metric), or
            None.
        reads: Whether this process fetches the data (else ``read_bytes`` is None).
        first_step: The step the rank starts at: until it delivers one, its position is the step before (a resumed
            rank's earlier incarnations delivered up to there; a rank started past step 1 does not lag behind the
            steps before its start).
        retention_s: Rank 0 expires the positions of groups silent for longer than this (see
            :meth:`~lakestream_iceberg.connect.positions.PositionStore.expire`), at most once per ``EXPIRY_INTERVAL_S``
            per process and stream; None: never.
    """

    def __init__(self, *, store: PositionStore, group: str, rank: int, world_size: int, branch: str, stream: str,
                 name: str, report_s: float, workers: int, source: str, head: Callable[[], int | None] | None = None,
                 reads: bool = True, retention_s: float | None = None, first_step: int = 1, catalog: str = "") -> None:
        self._store, self._head = store, head
        self._retention_s = retention_s if rank == 0 else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False  # the last position recorded at a close said closed
        self._close_lock = threading.Lock()
        self._failures = 0
        self.pid = os.getpid()
        self._began = time.monotonic()
        self._reads = reads
        self._doc = Position(group=group, rank=rank, stream=stream, branch=branch, world_size=world_size,
                             last_step=None, steps=0, started_at=time.time(), elapsed_s=0.0, wait_s=0.0,
                             read_bytes=0 if reads else None, report_s=report_s, closed=False,
                             host=socket.gethostname(), pid=self.pid, workers=workers, source=source)
        self._wait = 0.0
        self._bytes = 0
        self._steps = 0
        self._last: int | None = first_step - 1 if first_step > 1 else None
        self._metrics = consumer_metrics(stream=name, group=group, rank=rank, catalog=catalog)
        if self._metrics is not None:  # the gauge says what the position says (not a previous iteration's step)
            self._metrics.starts_after(self._last or 0)
        self._thread = threading.Thread(target=self._run, name="lakestream-positions", daemon=True)
        self._thread.start()

    def delivered(self, step: int, *, wait_s: float) -> None:
        """The training loop received ``step`` after waiting ``wait_s`` seconds for it."""
        with self._lock:
            self._last, self._steps, self._wait = step, self._steps + 1, self._wait + max(0.0, wait_s)
        if self._metrics is not None:
            self._metrics.delivered(step=step, wait_s=wait_s)

    def read(self, nbytes: int) -> None:
        """``nbytes`` of data files were fetched (from any thread)."""
        with self._lock:
            self._bytes += nbytes
        if self._metrics is not None:
            self._metrics.read(nbytes)

    def close(self, *, closed: bool = True) -> None:
        """Stop reporting and record the position once more (``closed``: the rank finished or was closed cleanly, so
        ``lakestream lag`` shows it as closed rather than stale). A close with ``closed`` after one without (an iteration
        that a ``break`` ended, then ``dataset.close()``) records the position once more, as closed."""
        with self._close_lock:  # dataset.close() from another thread and the iteration's own end may race here
            if self._stop.is_set():
                if closed and not self._closed and self.pid == os.getpid():
                    self._closed = True
                    self._report(closed=True)
                return
            self._stop.set()
            self._closed = closed
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=min(max(1.0, 2 * self._doc.report_s), threading.TIMEOUT_MAX))
            self._report(closed=closed)
            if self._metrics is not None:  # nothing refreshes the steps-behind gauge from now on
                self._metrics.release()

    def _run(self) -> None:
        self._report(closed=False)  # the rank shows up at once, before its first step
        self._expire()
        report_s = self._doc.report_s
        # the steps-behind gauge every METRICS_S however rarely the position is written (world_size / 200 s past
        # 1,000 ranks); a report_s past what threading can wait (about 292 years) raised OverflowError here
        tick = min(report_s, METRICS_S if self._metrics is not None and self._head is not None else report_s,
                   threading.TIMEOUT_MAX)
        due = time.monotonic() + report_s
        while not self._stop.wait(tick):
            if time.monotonic() >= due:
                due = time.monotonic() + report_s
                self._report(closed=False)
                self._expire()
            else:
                with self._lock:
                    last = self._last
                self._gauge(last)

    def _expire(self) -> None:
        """Rank 0: delete the positions of groups silent for longer than the retention, unless this process did so on
        this stream within ``EXPIRY_INTERVAL_S`` (a dictionary lookup otherwise). Failures are logged: the next
        interval, or GC, retries."""
        if self._retention_s is None:
            return
        now = time.monotonic()
        last = _expired_at.get(self._store.location)
        if last is not None and now - last < EXPIRY_INTERVAL_S:
            return
        _expired_at[self._store.location] = now
        try:
            with no_fork_inside():
                removed, _ = self._store.expire(older_than_s=self._retention_s)
        except Exception as exc:  # noqa: BLE001 - positions are informative; see the class docstring
            log.warning("expiring the consumer positions of old groups on %s failed (the next hour retries): %s",
                        self._store.location, exc)
            return
        if removed:
            log.info("expired %d consumer positions of groups silent for more than %gs on %s", removed,
                     self._retention_s, self._store.location)

    def _report(self, *, closed: bool) -> None:
        with self._lock:
            doc = replace(self._doc, last_step=self._last, steps=self._steps,
                          elapsed_s=round(time.monotonic() - self._began, 3), wait_s=round(self._wait, 3),
                          read_bytes=self._bytes if self._reads else None, closed=closed)
        with no_fork_inside():  # a DataLoader forking its workers waits for a report in a database library
            self._record(doc)

    def _gauge(self, last_step: int | None) -> None:
        """Set the steps-behind-head gauge (before the first step too, as ``lakestream lag``); a failed head read
        leaves it at its last value."""
        if self._metrics is None or self._head is None:
            return
        try:
            head = self._head()
        except Exception as exc:  # noqa: BLE001 - the gauge keeps its last value; the position is still recorded
            log.debug("reading the head for the steps-behind metric failed: %s", exc)
            return
        if head is not None:
            self._metrics.behind(head - (last_step or 0))

    def _record(self, doc: Position) -> None:
        self._gauge(doc.last_step)
        try:
            self._store.upsert(group=doc.group, rank=doc.rank, body=doc.to_json())
            self._failures = 0
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            self._failures += 1
            if self._failures in (1, 10) or self._failures % 100 == 0:
                log.warning("recording the position of group %r rank %d failed %d time(s) in a row: %s",
                            doc.group, doc.rank, self._failures, exc)


def fetched_bytes(files: Sequence[Any], sources: Iterable[tuple[int, int, int]], *, counts: Sequence[int],
                  packed: bool, whole_file_bytes: int) -> int:
    """Bytes of data files a step's read fetched: the whole file of each producer rank read (per-rank layout); for
    the packed layout the file when it is read whole, else its share of the rows read (an estimate: row groups are
    fetched whole). ``sources``: ``(producer rank, start, stop)`` row ranges read."""
    if not packed:
        return sum(int(files[s].file_size_in_bytes) for s in {s for s, start, stop in sources if stop > start})
    size = int(files[0].file_size_in_bytes)
    total = sum(counts)
    if size <= whole_file_bytes or total == 0:
        return size
    return size * sum(stop - start for _, start, stop in sources) // total


def track(loader: Iterable[Any], *, reporter: PositionReporter, first_step: int,
          on_close: Callable[[], None] | None = None) -> Iterator[Any]:
    """``loader``'s items, recording each as delivered (see the module docstring): its step is ``item["step"]`` when
    the item is a dict with an integer step (the default collate's), else counted from ``first_step``. ``on_close``
    runs once the reporter has recorded its last position."""
    step = first_step - 1
    iterator = iter(loader)
    try:
        while True:
            began = time.monotonic()
            try:
                item = next(iterator)
            except StopIteration:
                reporter.close(closed=True)
                return
            found = item.get("step") if isinstance(item, dict) else None
            step = found if isinstance(found, int) and not isinstance(found, bool) else step + 1
            reporter.delivered(step, wait_s=time.monotonic() - began)
            yield item
    finally:
        try:
            reporter.close(closed=False)
        finally:
            if on_close is not None:
                on_close()


class RankPositions:
    """The position recording of one dataset rank (picklable: a reporter stays in the process that started it).

    Args:
        group: The consumer group (checked by :func:`check_group`).
        report_s: Seconds between reports.
        rank, world_size, branch: The dataset's.
        stream: The stream's table UUID.
    """

    def __init__(self, *, group: object, report_s: object, rank: int, world_size: int, branch: str, stream: str) -> None:
        self.group = check_group(group, recording=True)
        self.report_s = float(check_seconds(report_s, what="report_s", minimum=0.05) or 0.0)  # never None here
        self.rank, self.world_size, self.branch, self.stream = rank, world_size, branch, stream
        self.tracked = False  # iterated through track(): the training process records, the iterators do not
        self._reporter: PositionReporter | None = None
        self._metrics: tuple[int, Any] | None = None  # (pid, ConsumerMetrics) where this process has no reporter

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reporter": None, "_metrics": None}

    def _start(self, stream: StreamTable, *, workers: int, source: str, head: Callable[[], int | None],
               reads: bool, first_step: int) -> PositionReporter:
        self.close(closed=False)
        store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)
        self._reporter = PositionReporter(
            store=store, group=self.group, rank=self.rank, world_size=self.world_size, branch=self.branch,
            stream=self.stream, name=stream.name, catalog=catalog_label(stream.table), report_s=self.report_s, workers=workers, source=source, head=head,
            reads=reads, retention_s=_retention_s(stream.table.metadata.properties), first_step=first_step)
        return self._reporter

    def iteration(self, stream: StreamTable, *, in_worker: bool, head: Callable[[], int | None],
                  first_step: int = 1) -> PositionReporter | None:
        """The reporter of a dataset iteration in this process: only where the training loop receives the items.
        ``head``: the iteration's head step as its watcher last saw it (for the steps-behind-head metric);
        ``first_step``: the iteration's first step."""
        if self.tracked:
            return None
        if in_worker:
            if self.group not in _hinted:
                _hinted.add(self.group)
                log.info("group %r: with DataLoader workers, positions are recorded in the training process; iterate "
                         "dataset.track(loader)", self.group)
            return None
        return self._start(stream, workers=0, source="iterator", head=head, reads=True, first_step=first_step)

    def track(self, loader: Any, stream: StreamTable, *, first_step: int,
              head: tuple[Callable[[], int | None], Callable[[], None]] | None = None) -> Iterator[Any]:
        """``loader``'s items, recorded in this (the training) process; see :func:`track`. ``head``: a function
        returning the head step now (for the steps-behind-head metric; this process does not follow the head
        otherwise) and one releasing it when the iteration ends; None: one pointer query per report."""
        self.tracked = True  # before the loader's workers copy the dataset: they leave the recording to this process
        workers = int(getattr(loader, "num_workers", 0) or 0)
        if head is None:
            watcher = HeadWatcher(stream, branch=self.branch, listen=False)

            def read_head() -> int:
                watcher.check()
                return watcher.head()[0]

            head = read_head, watcher.close
        reporter = self._start(stream, workers=workers, source="loader", head=head[0], reads=workers == 0,
                               first_step=first_step)
        return track(loader, reporter=reporter, first_step=first_step, on_close=head[1])

    def read(self, files: Sequence[Any], ranges: Sequence[tuple[int, int, int]], *, counts: Sequence[int],
             packed: bool, name: str, catalog: str = "") -> None:
        """A step's read of ``name`` fetched these row ranges: counted by this process's reporter, or where it has none
        (a DataLoader worker) by its read-bytes metric alone."""
        nbytes = fetched_bytes(files, ranges, counts=counts, packed=packed, whole_file_bytes=WHOLE_FILE_BYTES)
        reporter = self._reporter
        if reporter is not None and reporter.pid == os.getpid():
            reporter.read(nbytes)
            return
        if self._metrics is None or self._metrics[0] != os.getpid():
            self._metrics = (os.getpid(), consumer_metrics(stream=name, group=self.group, rank=self.rank,
                                                               gauges=False, catalog=catalog))
        if self._metrics[1] is not None:
            self._metrics[1].read(nbytes)

    def close(self, *, closed: bool = True) -> None:
        """Stop this process's reporter, recording the position once more."""
        reporter, self._reporter = self._reporter, None
        if reporter is not None and reporter.pid == os.getpid():
            reporter.close(closed=closed)


def _retention_s(properties: Any) -> float:
    """``lakestream.consumers.retention-ms`` of a table with these properties, in seconds."""
    return CONSUMERS_RETENTION.seconds(CONSUMERS_RETENTION.get(properties) or 0)


_hinted: set[str] = set()

