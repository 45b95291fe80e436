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

import functools
import gc
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["FORK_WAIT_S", "ProcessPool", "fork_safe", "fork_safe_io", "gated", "no_fork_inside", "owns_connections"]

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
# moment copied SQLite's global mutexes locked into the child, by a thread the child does not have: its first SQLite
# call (a DataLoader worker's head watcher's pointer probe) then waited on the allocator's mutex forever. So the child
# releases every one of SQLite's static mutexes that it finds held (no thread of its own can hold one there).
#
# They are not taken in the parent around the fork instead (as C allocators do with pthread_atfork): a fork runs other
# Python at-fork hooks between ours, which may hand the GIL to another thread, and a thread that calls SQLite while
# holding the GIL (sqlite3 binds a parameter, allocating, with the GIL held) then waits for the mutex the forking
# thread holds, which waits for the GIL: the parent deadlocked within a few hundred forks with three such threads.
# What a released mutex guarded in the child is what the parent's thread left mid-way: for the allocator's mutex,
# its statistics counters (the allocation itself is glibc's, which is fork-safe).
# Not covered: mutexes SQLite allocates per database file or connection (the unix VFS's per-file mutex around its
# fcntl locks, a connection's own), which no API reaches. A child whose parent had an ungated thread inside SQLite on
# the same database file at the fork (a user's thread on the catalog file; the collector closing a catalog connection)
# can still hang on its first use of that file: about 1 fork in 20 with two threads querying it in a loop. So
# lakestream's own statements on a catalog database all run inside the gate below (the direct connections', the
# pointer probe's, the swap's transaction, GC's look at iceberg_tables, and every method of the intent and position
# tables, `gated`). pyiceberg's own catalog calls (load_table, create_table, ...) are not gated.
_SQLITE_MUTEXES = (2, 3, 4, 5, 6, 7, 11, 12, 13)  # sqlite3.h STATIC_MAIN, MEM, OPEN, PRNG, LRU, PMEM, VFS1-3
_SQLITE_MUTEX_STATIC_APP3 = 10
_SQLITE_OK, _SQLITE_BUSY = 0, 5
_sqlite_api: Any = None  # (mutex_try, mutex_leave, [mutex pointers]) of the libsqlite3 the sqlite3 module uses; False


def _sqlite_mutexes() -> Any:
    """The libsqlite3 functions and static mutexes, resolved once (in the parent: the child must not load libraries),
    or False where they are out of reach or do not behave as expected here. Nothing here allocates through SQLite or
    waits on its mutexes (another thread may hold them), and every call releases the GIL (ctypes.CDLL)."""
    global _sqlite_api
    if _sqlite_api is None:
        _sqlite_api = False
        try:
            import ctypes

            lib = ctypes.CDLL(sys.modules["_sqlite3"].__file__)  # the extension's symbols: the libsqlite3 it links
            if not lib.sqlite3_threadsafe():
                return _sqlite_api  # no mutexes at all
            lib.sqlite3_mutex_alloc.restype = ctypes.c_void_p
            lib.sqlite3_mutex_alloc.argtypes = [ctypes.c_int]
            lib.sqlite3_mutex_try.argtypes = lib.sqlite3_mutex_leave.argtypes = [ctypes.c_void_p]
            # does trying work here (taken once, then busy)? On STATIC_APP3, which SQLite itself never takes
            probe = lib.sqlite3_mutex_alloc(_SQLITE_MUTEX_STATIC_APP3)
            if not probe or lib.sqlite3_mutex_try(probe) != _SQLITE_OK:
                return _sqlite_api
            again = lib.sqlite3_mutex_try(probe)
            if again == _SQLITE_OK:  # recursive here: a held mutex would not show
                lib.sqlite3_mutex_leave(probe)
            lib.sqlite3_mutex_leave(probe)
            works = again == _SQLITE_BUSY
            if works:
                mutexes = [lib.sqlite3_mutex_alloc(mutex_id) for mutex_id in _SQLITE_MUTEXES]
                _sqlite_api = (lib.sqlite3_mutex_try, lib.sqlite3_mutex_leave, [m for m in mutexes if m])
        except Exception:  # noqa: BLE001 - a libsqlite3 linked in without its symbols: forks go on as before
            log.debug("libsqlite3's mutexes are out of reach: a forked child cannot release them", exc_info=True)
    return _sqlite_api


# Forks of this process between their before and after hooks, and whether the collector was on before the first:
# a fork's state is the process's, not its thread's, as two threads may fork at once (the gate below lets a second one
# through once the first has held it for FORK_WAIT_S). One value per fork let the second, which found the collector
# off (the first had paused it), leave it off for good.
_gc_forks = 0
_gc_restore = False  # enable the collector again when the last fork in flight is done (it was on before them)
_gc_lock = threading.Lock()  # held briefly by the hooks in the parent; a child replaces it


def _sqlite_before_fork() -> None:
    # The collector stays off from here until the child has released the mutexes: the at-fork hooks registered before
    # these (threading's) run first in the child, and a collection there finalized an unreachable SQLite statement of
    # the parent (sqlite3_finalize, sqlite3_free) on the still-held allocator mutex: the child hung all the same.
    global _gc_forks, _gc_restore
    if "_sqlite3" in sys.modules and _sqlite_mutexes():  # else no thread can be inside SQLite (or nothing to do)
        with _gc_lock:
            if not _gc_forks:
                _gc_restore = gc.isenabled()
            _gc_forks += 1
            gc.disable()


def _sqlite_after_fork_in_parent() -> None:
    global _gc_forks, _gc_restore
    with _gc_lock:
        if not _gc_forks:
            return
        _gc_forks -= 1
        if not _gc_forks and _gc_restore:
            _gc_restore = False
            gc.enable()


def _sqlite_after_fork_in_child() -> None:
    global _gc_forks, _gc_restore, _gc_lock
    api = _sqlite_api if "_sqlite3" in sys.modules else None
    if api:
        try_lock, leave, mutexes = api
        for mutex in mutexes:
            # free: taken here just now; busy: held by a thread of the parent that the child does not have (a plain
            # pthread mutex, which any thread may unlock). No logging here: a log handler's stream may be held too.
            try_lock(mutex)
            leave(mutex)
    # the child's one thread: the forks other threads of the parent had in flight are not its own
    _gc_lock = threading.Lock()
    if _gc_forks:
        _gc_forks = 0
        if _gc_restore:
            _gc_restore = False
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_sqlite_before_fork, after_in_parent=_sqlite_after_fork_in_parent,
                        after_in_child=_sqlite_after_fork_in_child)


# -- background calls into a database library, and fork ------------------------------------------------------------
# A thread that runs SQLite (or SQLAlchemy, libpq) while another thread forks leaves that library's locks held in the
# child, which has only the forking thread: the child's first SQLite call then hangs on libsqlite3's allocator mutex.
# Threads that query in the background (a head watcher's pointer probe, a relay's poll, a consumer's position report)
# wrap each call in ``no_fork_inside()``; a fork (a DataLoader starting its workers) waits for the calls in flight,
# at most FORK_WAIT_S, and none starts from the moment it waits until it is done (a thread already inside may nest).
# The forking thread's own calls are not waited for. (SQLite's static mutexes are released in the child anyway, see
# above; the gate still keeps a child from inheriting a database file's own locks, or libpq's, held mid-call.)
FORK_WAIT_S = 10.0
_gate = threading.Condition()
_inside: dict[int, int] = {}  # thread ident -> calls in flight (nested calls count once each)
_gate_owner: int | None = None  # the thread whose fork holds the gate, from its wait's end to its after hook
_forking = 0  # forks waiting for the calls in flight: new calls (but a thread's nested calls) wait for them


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


def gated(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` run inside :func:`no_fork_inside`: for the methods of lakestream's own tables in a catalog's database
    (intents, consumer positions), whose statements run on raw ``sqlite3`` connections as well as SQLAlchemy's."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> T:
        with no_fork_inside():
            return method(*args, **kwargs)

    return run


def _others_inside() -> bool:
    me = threading.get_ident()
    return any(ident != me for ident in _inside)


def _gate_before_fork() -> None:
    # Which thread holds the gate is kept, not only that one does: two threads may fork at once, and the second, let
    # through without the gate when the first held it past FORK_WAIT_S, made the first skip its release (a process-wide
    # flag it cleared): the gate stayed held, and every gated call after it waited for good.
    global _gate_owner, _forking
    if not _gate.acquire(timeout=FORK_WAIT_S):
        return
    _forking += 1
    try:
        if not _gate.wait_for(lambda: not _others_inside(), timeout=FORK_WAIT_S):
            log.warning("forking while a database call of another thread has been in progress for %.0f s",
                        FORK_WAIT_S)
    finally:
        _gate_owner = threading.get_ident()  # held from here until this thread's after hook


def _gate_after_fork_in_parent() -> None:
    global _gate_owner, _forking
    if _gate_owner is not None and _gate_owner == threading.get_ident():
        _gate_owner = None
        _forking -= 1
        _gate.notify_all()  # the calls that waited for the fork
        _gate.release()


def _gate_after_fork_in_child() -> None:
    global _gate, _gate_owner, _forking
    _gate, _gate_owner, _forking = threading.Condition(), None, 0
    _inside.clear()  # the parent's other threads do not exist here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_gate_before_fork, after_in_parent=_gate_after_fork_in_parent,
                        after_in_child=_gate_after_fork_in_child)
