"""Across ``os.fork``: a forked child process gets database connections and thread pools of its own.

pyiceberg's ``SqlCatalog`` keeps a SQLAlchemy connection pool. A worker process forked from a process that already
used the catalog (a ``multiprocessing`` pool with the ``fork`` start method, the default on Linux before Python 3.14)
inherits the pooled connections: one PostgreSQL socket then carries two processes' statements interleaved, and one
SQLite handle is used by two processes, which SQLite forbids ("do not open a database connection, then fork, then use
it in the child"). SQLAlchemy's remedy is ``engine.dispose(close=False)`` in the child: it forgets the inherited
connections without closing them (closing would end the parent's sessions) and opens new ones on demand.
:func:`fork_safe` registers that, once per process, for the engine of every SQL catalog a stream is opened on.
:class:`ProcessPool` is the same for thread pools (the data writer's, the staged-batch footer check's).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["ProcessPool", "fork_safe"]

log = logging.getLogger(__name__)

_engines: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def fork_safe(catalog: Any) -> None:
    """Give forked children of this process their own connections of ``catalog`` (a no-op for non-SQL catalogs)."""
    global _registered
    engine = getattr(catalog, "engine", None)
    if engine is None or not hasattr(engine, "dispose"):
        return
    with _lock:
        _engines.add(engine)
        if not _registered:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _registered = True


def _after_fork_in_child() -> None:
    # The child runs one thread: a fresh lock (another thread of the parent may have held it at the fork).
    global _lock
    _lock = threading.Lock()
    for engine in list(_engines):
        try:
            engine.dispose(close=False)
        except Exception:  # noqa: BLE001 - the next checkout opens a connection either way
            log.debug("could not drop inherited connections of %s after fork", engine, exc_info=True)


class ProcessPool:
    """A thread pool made on first use in each process.

    A process forked from one whose pool had started its threads inherits the pool but none of its threads: work
    submitted to it would wait forever (a worker process forked after the parent committed once would hang on its
    first commit). Here a forked child starts with no pool and a fresh lock (reset at the fork, when the child runs
    one thread: another thread of the parent may have held the lock), and makes its own pool on first use; the
    inherited one is dropped, never shut down (its threads belong to the parent). The pid kept with the pool is the
    fallback for a fork that bypassed ``os.register_at_fork``.
    """

    def __init__(self, *, max_workers: int, name: str) -> None:
        self._max_workers = max_workers
        self._name = name
        self._lock = threading.Lock()
        self._state: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool), read and replaced as one value
        _POOLS.add(self)

    def get(self) -> ThreadPoolExecutor:
        pid = os.getpid()
        state = self._state
        if state is not None and state[0] == pid:
            return state[1]
        with self._lock:
            state = self._state
            if state is None or state[0] != pid:
                state = self._state = (pid, ThreadPoolExecutor(max_workers=self._max_workers,
                                                               thread_name_prefix=self._name))
            return state[1]

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``get().submit(fn, *args)``; when ``shutdown`` (``Stream.close``) came between the two, the task goes to the
        fresh pool instead (it was not submitted, so it runs once either way)."""
        for _ in range(3):
            pool = self.get()
            try:
                return pool.submit(fn, *args)
            except RuntimeError:  # "cannot schedule new futures after shutdown"
                state = self._state
                if state is not None and state[1] is pool:  # still the current pool: interpreter shutdown, not close()
                    raise
        return self.get().submit(fn, *args)

    def shutdown(self, *, wait: bool = True) -> None:
        """Stop this process's threads (a pool inherited from another process is left alone)."""
        with self._lock:
            state, self._state = self._state, None
        if state is not None and state[0] == os.getpid():
            state[1].shutdown(wait=wait)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._state = None


_POOLS: weakref.WeakSet[ProcessPool] = weakref.WeakSet()


def _reset_pools_after_fork() -> None:
    for pool in list(_POOLS):
        pool._after_fork_in_child()  # noqa: SLF001 - the module's own at-fork hook


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pools_after_fork)
