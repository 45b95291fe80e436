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
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["FORK_WAIT_S", "ProcessPool", "fork_safe", "fork_safe_io", "no_fork_inside", "owns_connections"]

log = logging.getLogger(__name__)

_engines: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # engine -> pid whose connections it pools
_lock = threading.Lock()
_registered = False


def fork_safe(catalog: Any) -> None:
    """Give forked children of this process their own connections of ``catalog`` (a no-op for non-SQL catalogs)."""
    global _registered
    engine = getattr(catalog, "engine", None)
    if engine is None or not hasattr(engine, "dispose"):
        return
    with _lock:
        _engines.setdefault(engine, os.getpid())
        if not _registered:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _registered = True


def owns_connections(catalog: Any) -> bool:
    """Whether ``catalog``'s connection pool holds this process's connections only: :func:`fork_safe` was called on
    it here, or in a parent process and the fork dropped the parent's connections here (False for a fork that
    bypassed ``os.register_at_fork``, and for catalogs without a SQL engine)."""
    engine = getattr(catalog, "engine", None)
    return engine is not None and _engines.get(engine) == os.getpid()


def _after_fork_in_child() -> None:
    # The child runs one thread: a fresh lock (another thread of the parent may have held it at the fork).
    global _lock
    _lock = threading.Lock()
    pid = os.getpid()
    for engine in list(_engines):
        try:
            engine.dispose(close=False)
        except Exception:  # noqa: BLE001 - the next checkout opens a connection either way
            log.debug("could not drop inherited connections of %s after fork", engine, exc_info=True)
        else:
            _engines[engine] = pid


_FILE_IOS: weakref.WeakSet[Any] = weakref.WeakSet()  # FsspecFileIOs whose file systems a forked child must not use


def fork_safe_io(io: Any) -> None:
    """Give forked children of this process file systems of their own for ``io`` (a no-op but for pyiceberg's
    ``FsspecFileIO``).

    ``FsspecFileIO`` keeps its fsspec file systems per thread, and a forked child inherits the forking thread's: an
    s3fs file system refuses to be used in another process ("This class is not fork-safe"), so every read and write of
    a stream a ``multiprocessing`` worker inherited failed (a commit retried that until its budget ran out). In the
    child the FileIO drops them as its own unpickling does, and makes new ones on first use.
    """
    fsspec_io = sys.modules.get("pyiceberg.io.fsspec")  # not imported: no FsspecFileIO exists (and fsspec stays unloaded)
    if fsspec_io is not None and isinstance(io, fsspec_io.FsspecFileIO):
        _FILE_IOS.add(io)


def _new_file_systems_after_fork() -> None:
    for io in list(_FILE_IOS):
        try:
            io.__setstate__(io.__getstate__())  # pyiceberg's own reset of its per-thread file systems
        except Exception:  # noqa: BLE001 - the child then fails on its first use, as it would have
            log.debug("could not drop inherited file systems of %r after fork", io, exc_info=True)


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
    os.register_at_fork(after_in_child=_new_file_systems_after_fork)


# -- any thread inside libsqlite3, and fork ------------------------------------------------------------------------
# The gate below covers lakestream's own background queries only. Other threads enter libsqlite3 too, unannounced:
# the cyclic garbage collector runs in whatever thread allocates (a pool thread, s3fs's event-loop thread) and closes
# the SQLite connections of unreachable catalogs there, with the GIL released; so do a user's threads. A fork at that
# moment copied SQLite's global mutexes locked into the child, whose first SQLite call (a DataLoader worker's head
# watcher's pointer probe) then waited on the allocator's mutex forever. So a fork takes SQLite's own global mutexes
# first, as the C allocators do at a fork (pthread_atfork): no thread is then inside a section they guard, and both
# processes release them after. They are tried, never waited for with the GIL held, all or none at a time (SQLite's
# own order between them is not known here, so waiting on one while holding others could deadlock), until all are
# free or FORK_WAIT_S has passed (then the fork goes ahead, warned about, as before).
_SQLITE_MUTEXES = (2, 4, 11, 12, 13, 6, 7, 5, 3)  # sqlite3.h STATIC_MAIN, OPEN, VFS1-3, LRU, PMEM, PRNG, MEM
_SQLITE_OK, _SQLITE_BUSY = 0, 5
_sqlite_api: Any = None  # (mutex_try, mutex_leave, [mutex pointers]) of the libsqlite3 the sqlite3 module uses; False
_sqlite_held: dict[int, list[int]] = {}  # forking thread -> the mutexes it holds across its fork


def _sqlite_mutexes() -> Any:
    global _sqlite_api
    if _sqlite_api is None:
        _sqlite_api = False
        try:
            import ctypes

            lib = ctypes.CDLL(sys.modules["_sqlite3"].__file__)  # resolves in the libsqlite3 the extension links
            if not lib.sqlite3_threadsafe():
                return _sqlite_api  # no mutexes at all (and no threads may share SQLite): nothing to take
            lib.sqlite3_mutex_alloc.restype = ctypes.c_void_p
            lib.sqlite3_mutex_alloc.argtypes = [ctypes.c_int]
            lib.sqlite3_mutex_try.argtypes = lib.sqlite3_mutex_leave.argtypes = [ctypes.c_void_p]
            lib.sqlite3_mutex_free.argtypes = [ctypes.c_void_p]
            probe = lib.sqlite3_mutex_alloc(0)  # SQLITE_MUTEX_FAST: does trying work here (taken once, then busy)?
            if not probe:
                return _sqlite_api
            works = lib.sqlite3_mutex_try(probe) == _SQLITE_OK and lib.sqlite3_mutex_try(probe) == _SQLITE_BUSY
            lib.sqlite3_mutex_leave(probe)
            lib.sqlite3_mutex_free(probe)
            mutexes = [lib.sqlite3_mutex_alloc(mutex_id) for mutex_id in _SQLITE_MUTEXES]
            if works:
                _sqlite_api = (lib.sqlite3_mutex_try, lib.sqlite3_mutex_leave, [m for m in mutexes if m])
        except Exception:  # noqa: BLE001 - a libsqlite3 linked in without its symbols: forks go on as before
            log.debug("libsqlite3's mutexes are out of reach: a fork does not wait for threads inside it",
                      exc_info=True)
    return _sqlite_api


def _sqlite_before_fork() -> None:
    if "_sqlite3" not in sys.modules:  # SQLite never loaded through Python here: no thread can be inside it
        return
    api = _sqlite_mutexes()
    if not api:
        return
    try_lock, leave, mutexes = api
    deadline = time.monotonic() + FORK_WAIT_S
    pause = 0.0001
    while True:
        held: list[int] = []
        for mutex in mutexes:
            if try_lock(mutex) != _SQLITE_OK:  # another thread is inside: let go of all, and try again
                for taken in reversed(held):
                    leave(taken)
                break
            held.append(mutex)
        else:
            _sqlite_held[threading.get_ident()] = held
            return
        if time.monotonic() >= deadline:
            log.warning("forking while another thread has been inside libsqlite3 for %.0f s: SQLite in the child "
                        "may hang", FORK_WAIT_S)
            return
        time.sleep(pause)  # the GIL released: a thread inside SQLite that needs it to get out can
        pause = min(pause * 2, 0.01)


def _sqlite_after_fork_in_parent() -> None:
    for mutex in reversed(_sqlite_held.pop(threading.get_ident(), [])):
        _sqlite_api[1](mutex)


def _sqlite_after_fork_in_child() -> None:
    # the forking thread is this process's one thread, and holds its copies (the same thread id, as pthread_self)
    held = _sqlite_held.pop(threading.get_ident(), [])
    _sqlite_held.clear()
    for mutex in reversed(held):
        _sqlite_api[1](mutex)


if hasattr(os, "register_at_fork"):  # before the gate's: before-fork hooks run last registered first
    os.register_at_fork(before=_sqlite_before_fork, after_in_parent=_sqlite_after_fork_in_parent,
                        after_in_child=_sqlite_after_fork_in_child)


# -- background calls into a database library, and fork ------------------------------------------------------------
# A thread that runs SQLite (or SQLAlchemy, libpq) while another thread forks leaves that library's locks held in the
# child, which has only the forking thread: the child's first SQLite call then hangs on libsqlite3's allocator mutex.
# Threads that query in the background (a head watcher's pointer probe, a relay's poll, a consumer's position report)
# wrap each call in ``no_fork_inside()``; a fork (a DataLoader starting its workers) waits for the calls in flight,
# at most FORK_WAIT_S, and none starts from the moment it waits until it is done (a thread already inside may nest).
# The forking thread's own calls are not waited for.
FORK_WAIT_S = 10.0
_gate = threading.Condition()
_inside: dict[int, int] = {}  # thread ident -> calls in flight (nested calls count once each)
_gate_held = False
_forking = False  # a fork waits for the calls in flight: new ones (but a thread's nested calls) wait for it


@contextmanager
def no_fork_inside() -> Iterator[None]:
    """Run the block with no ``os.fork`` of this process in the middle of it (see the note above)."""
    me = threading.get_ident()
    with _gate:
        while _forking and me not in _inside:  # calls that kept coming would hold a waiting fork back to its bound
            _gate.wait()
        _inside[me] = _inside.get(me, 0) + 1
    try:
        yield
    finally:
        with _gate:
            left = _inside.get(me, 1) - 1
            if left:
                _inside[me] = left
            else:
                _inside.pop(me, None)
            _gate.notify_all()


def _others_inside() -> bool:
    me = threading.get_ident()
    return any(ident != me for ident in _inside)


def _gate_before_fork() -> None:
    global _gate_held, _forking
    _gate_held = _gate.acquire(timeout=FORK_WAIT_S)
    if not _gate_held:
        return
    _forking = True
    if not _gate.wait_for(lambda: not _others_inside(), timeout=FORK_WAIT_S):
        log.warning("forking while a database call of another thread has been in progress for %.0f s", FORK_WAIT_S)


def _gate_after_fork_in_parent() -> None:
    global _forking
    if _gate_held:
        _forking = False
        _gate.notify_all()  # the calls that waited for the fork
        _gate.release()


def _gate_after_fork_in_child() -> None:
    global _gate, _gate_held, _forking
    _gate, _gate_held, _forking = threading.Condition(), False, False
    _inside.clear()  # the parent's other threads do not exist here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_gate_before_fork, after_in_parent=_gate_after_fork_in_parent,
                        after_in_child=_gate_after_fork_in_child)
