"""How an iteration in a DataLoader worker notices that its DataLoader shuts the workers down, or that its training
process is gone.

DataLoader stops a worker by setting an event the worker checks between items and then sending it ``None``; it waits
5 s for each worker (``torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL``) and then terminates it. A follow-mode
iteration waits inside the item for a step not yet published, so the worker never reached that check: every loop that
broke out early, or failed, stood still 5 s per worker while DataLoader shut down (10 s with 2 workers), wherever the
garbage collector happened to collect the iterator. And a worker whose training process died without shutting it down
followed the stream until its ``timeout``, forever without one.

:func:`stop_on_shutdown` watches, while one iteration runs in a worker, DataLoader's event (torch's ``_worker_loop``
argument ``done_event``, taken from the worker process's arguments) and the training process, and sets the iteration's ``stop`` when
either says so. The iteration's wait then ends within its slice (at most 0.5 s, see
:mod:`lakestream_iceberg.read.follow`) and the worker exits by itself. Where the event cannot be found (a torch that
renamed it), nothing changes.

The watching thread only *reads* the event, every ``POLL_S``, and stops before the iteration returns: a process that
waits on a ``multiprocessing.Event`` counts as one of its sleepers, and one that exits while counted (a worker ends
when its iteration does) would make DataLoader's ``set()`` wait for it forever.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
import sys
import threading
from typing import Any

__all__ = ["ShutdownWatch", "stop_on_shutdown"]

log = logging.getLogger("lakestream_iceberg.read.dataset")

POLL_S = 0.1  # how often the watching thread reads DataLoader's event and checks the training process


class ShutdownWatch:
    """Sets ``stop`` once ``done`` is set or the process ``parent`` is no longer this process's parent; :meth:`close`
    ends the watching (the iteration it watched returns)."""

    def __init__(self, done: Any, stop: threading.Event, *, parent: int | None = None) -> None:
        self._done = done
        self._stop = stop
        self._parent = os.getppid() if parent is None else parent
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lakestream-worker-exit", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._ended.wait(POLL_S):
            try:
                shutting_down = bool(self._done.is_set()) or os.getppid() != self._parent
            except Exception:  # noqa: BLE001 - the event broke with the training process: stop just the same
                shutting_down = True
            if shutting_down:
                self._stop.set()
                return

    def close(self) -> None:
        """Stop watching, and return once the watching thread has (it never touches the event afterwards)."""
        self._ended.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def stop_on_shutdown(stop: threading.Event) -> ShutdownWatch | None:
    """In a DataLoader worker, a :class:`ShutdownWatch` that sets ``stop`` once the DataLoader shuts its workers down
    or the training process is gone; None elsewhere. Call from the iteration's code (which torch's worker loop runs),
    and :meth:`ShutdownWatch.close` it before the iteration returns.

    With ``persistent_workers=True`` the first worker logs a warning once: DataLoader restarts persistent workers for
    the next ``iter(loader)`` only between items (no shutdown, no event), so after a ``break`` a follow-mode worker's
    wait for a step not yet published holds the next iteration until that step is published or ``timeout`` passes."""
    arguments = _worker_arguments()
    done = arguments.get("done_event")
    if arguments.get("persistent_workers") is True and arguments.get("worker_id") == 0 and not _warned:
        _warned.append(True)
        log.warning("LakestreamDataset(follow=True) under DataLoader(persistent_workers=True): after a loop breaks out "
                    "early, DataLoader restarts its persistent workers only once each has delivered the step it waits "
                    "for, so the next iter(loader) waits until that step is published (or the dataset's timeout). "
                    "Leave persistent_workers off in follow mode: one long iteration gains nothing from it")
    return ShutdownWatch(done, stop) if callable(getattr(done, "is_set", None)) else None


_warned: list[bool] = []  # whether this process warned of persistent workers in follow mode


# the modules whose ``_worker_loop`` runs a DataLoader worker: torch's, and torchdata's StatefulDataLoader's (a copy of
# torch's loop with the same arguments, and the loader docs/guide/training.md names for resuming with workers)
_WORKER_MODULES = ("torch.utils.data._utils.worker", "torchdata.stateful_dataloader.worker")


def _worker_arguments() -> dict[str, Any]:
    """The arguments of torch's ``_worker_loop`` that this process runs (``done_event``, ``persistent_workers``,
    ``worker_id``, ...), or ``{}`` (not a DataLoader worker, or a torch whose worker loop changed). torchdata's
    ``StatefulDataLoader`` runs a worker loop of its own with the same arguments: its workers are recognised too.

    Read from the worker process's own target and arguments (``multiprocessing.current_process()``), with fork, spawn
    and forkserver alike. Not from the worker loop's frame: on Python before 3.13 reading a frame's ``f_locals`` keeps a
    copy of its locals on the frame, which would keep the previous epoch's iteration alive into the next one."""
    process: Any = multiprocessing.current_process()
    target = getattr(process, "_target", None)
    loops = [getattr(sys.modules.get(name), "_worker_loop", None) for name in _WORKER_MODULES]
    if target is None or not any(target is loop for loop in loops):
        return {}
    try:
        return dict(inspect.signature(target).bind(*process._args, **process._kwargs).arguments)
    except (TypeError, ValueError, AttributeError):
        return {}


def batched_by_default_collate(*, caller: Any = None) -> bool:
    """Whether the DataLoader iterating the dataset batches its items with torch's ``default_collate``
    (``batch_size`` not None, no ``collate_fn`` of the user's): in a worker from the worker loop's arguments, in the
    training process from the fetcher whose ``__init__`` is ``caller`` (the frame that called ``iter(dataset)``; its
    locals are read only when it is that fetcher's, which returns at once). False wherever neither tells."""
    collate = sys.modules.get("torch.utils.data._utils.collate")
    default = getattr(collate, "default_collate", None)
    if default is None:
        return False
    arguments = _worker_arguments()
    if arguments:
        return bool(arguments.get("auto_collation")) and arguments.get("collate_fn") is default
    fetcher_class = getattr(sys.modules.get("torch.utils.data._utils.fetch"), "_IterableDatasetFetcher", None)
    init = getattr(getattr(fetcher_class, "__init__", None), "__code__", None)
    if caller is None or init is None or caller.f_code is not init:
        return False
    fetcher = caller.f_locals.get("self")
    return bool(getattr(fetcher, "auto_collation", False)) and getattr(fetcher, "collate_fn", None) is default
