"""Direct connections to a SQL catalog's database, outside SQLAlchemy's pool and in autocommit, for lakestream's own
frequent statements (the pointer probe, staged intents, the pointer swap on PostgreSQL, consumer positions on SQLite).

A holding producer asks whether the head moved, and whether its staged batch is still staged, many times per commit;
a follower asks whether the head moved at every poll. Through SQLAlchemy each such statement checks a connection out
of the pool, runs it in a transaction and gives the connection back with a rollback. On PostgreSQL through psycopg2
that is three round trips (``BEGIN``, the statement, ``ROLLBACK``) and about 220 us of client CPU; on a connection in
autocommit it is one round trip and about 50 us (``benchmarks/commit_cpu.py``'s probe columns; ``commit_scaling.py``
on PostgreSQL shows what it changes for group commit). On a SQLite file, plain ``sqlite3`` costs a third of SQLAlchemy's.

* **SQLite** (the standard ``pysqlite`` driver on a plain database file): one ``sqlite3`` connection per thread on the
  file the engine's own connections opened, in autocommit (each query reads the last committed state, in WAL mode
  without blocking the writer).
* **PostgreSQL** through psycopg2: one connection per process, which the engine makes (``engine.raw_connection()``:
  the same URL, ``connect_args`` and pool events as its own), detached from its pool and put in autocommit: every
  statement is a transaction of its own. The process's threads take turns on it (a statement is one round trip); the
  pool then serves pyiceberg's loads and commits only, so a process still holds about as many connections as before:
  count one for this one when sizing ``max_connections`` (a pooler in transaction mode serves it too; it
  delivers no notifications, so holds then poll, see below).
* Anything else (an in-memory database, a URI with options, credentials or another driver) has none: callers keep
  SQLAlchemy's connections.

A connection is opened on the first statement (of the thread, on SQLite) and closed when the engine is disposed
(``catalog.close()``, :func:`~lakestream_iceberg.connect.pointer.release_idle_connections`), when the engine is
garbage-collected (a dropped catalog: nothing here holds its engine), or, on SQLite, when its thread ends; on
PostgreSQL a statement that another thread's dispose cut off runs again on a new one (its rows are fetched while the
connection is held). A forked child never uses nor closes its parent's (closing a PostgreSQL one
would end the parent's session, a SQLite one would run SQLite code on state copied mid-operation): it keeps them and
opens its own. A PostgreSQL connection that fails as a connection (the
server restarted, a proxy closed it while idle) is dropped, and a statement that met it on a connection opened earlier
runs once more on a new one, after the engine is disposed (the pool's idle connections died with it, as SQLAlchemy
assumes on a disconnect); the error of a fresh connection is raised as it is. A statement's own error on a working
connection (``statement_timeout``, a lock timeout, a deadlock: ``OperationalError`` subclasses too) is raised at once,
and the connection kept.

**Commit notifications on PostgreSQL** (:meth:`DirectConnections.listen`): a thread that waits for the head of a table
to move (a producer whose staged batch holds, :mod:`lakestream_iceberg.write.hold`) can ``LISTEN`` on the table's
channel (:mod:`.notify`) on this same connection, and wait on its socket (:meth:`~DirectConnections.wait_notified`)
instead of asking again and again. No connection is added. The process listens only while some thread waits: the
first waiter's ``LISTEN`` and the last one's ``UNLISTEN`` are statements of their own, and notifications that arrive
during any statement are counted per channel as they come, so none is left to pile up in the driver. A connection
opened in place of a dead or disposed one listens again on the channels waited on, and every waiter is told to look
(a notification may have been missed in between).
"""

from __future__ import annotations

import os
import select
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any
from urllib.request import pathname2url

from lakestream_iceberg.connect.fork import no_fork_inside

__all__ = ["DirectConnections", "close_in_owner", "detached_autocommit", "direct_connections", "readable",
           "sqlite_connections"]

_INHERITED: list[object] = []  # a forked child's copies of its parent's connections: kept, never closed
_getpid = os.getpid  # which process this is (a name of its own, so a test can play a forked child)


class _Slot:
    """The process-wide connection's holder, in place of a ``threading.local`` (``held``: the connection or None)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: _Held | None = None


class _Held:
    """A connection and the (process, generation) it belongs to. A thread's (SQLite) is closed when the thread ends
    (its thread-local copy is the only strong reference) or when the engine is disposed, whichever comes first."""

    __slots__ = ("__weakref__", "conn", "key")

    def __init__(self, key: tuple[int, int], conn: Any) -> None:
        self.key, self.conn = key, conn


class _Rows:
    """A statement's rows, fetched while its connection was held and no fork could come (a cursor's ``fetchone``,
    ``fetchall`` and ``rowcount``)."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows, self.rowcount = rows, rowcount

    def fetchone(self) -> Any:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[Any]:
        rows, self._rows = self._rows, []
        return rows


def close_in_owner(conn: Any, pid: int | None = None) -> None:
    """Close a database connection, but only in the process that opened it (``pid``; None: this one). A forked child
    keeps its copy instead, never closed: closing or freeing a PostgreSQL one would end the parent's session, a SQLite
    one would run SQLite code on state copied mid-operation."""
    if pid is not None and _getpid() != pid:
        _INHERITED.append(conn)
        return
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - in use by its thread right now, or already broken: closed with it
        pass


class DirectConnections:
    """The direct connections of one engine (see the module docstring).

    Attributes:
        dialect: ``"sqlite"`` or ``"postgresql"``: statements use ``?`` placeholders either way (:meth:`execute`
            gives PostgreSQL its ``%s``).
    """

    def __init__(self, dialect: str, opener: Callable[[], Any], *, per_thread: bool,
                 broken: tuple[type[BaseException], ...] = (), on_dead: Callable[[], None] | None = None) -> None:
        self.dialect = dialect
        self._open = opener
        self._broken = broken  # the driver's errors that may mean a dead connection (PostgreSQL), dropped on sight
        self._on_dead = on_dead  # called when a connection used before died, ahead of the statement's second run
        # per thread (SQLite), or one per process that the threads take turns on (PostgreSQL: under this lock)
        self._turns: threading.Lock | None = None if per_thread else threading.Lock()
        self.local: Any = threading.local() if per_thread else _Slot()
        self.generation = 0  # bumped by dispose(): a new connection at the next statement
        self.opened: weakref.WeakSet[_Held] = weakref.WeakSet()  # the open connections, for dispose()
        self.lock = threading.Lock()
        # PostgreSQL notifications (see the module docstring): the channels LISTENed on now and their waiters, and the
        # notifications counted per channel (bumped too when a new connection listens again: anything may have moved)
        self._waiters: dict[str, int] = {}
        self._notified: dict[str, int] = {}
        self._heard: dict[str, int] = {}  # the notifications themselves (without those bumps)
        self._listen_lock = threading.Lock()  # orders LISTEN and UNLISTEN with the counts of waiters

    def connection(self) -> Any:
        """The connection (autocommit) of this thread (SQLite) or process (PostgreSQL), opened on first use."""
        if self._turns is None:
            return self._held()[0].conn
        with self._turns:
            return self._held()[0].conn

    def execute(self, sql: str, params: Sequence[Any] = (), *, again: bool = True) -> Any:
        """Run one statement (``?`` placeholders; no literal ``?`` or ``%`` in its text) on :meth:`connection`; returns
        its rows, fetched before it returns (``fetchone``, ``fetchall``, ``rowcount``). On PostgreSQL a connection
        error drops the connection, and the statement runs once more on a new one when the failed connection was not
        new or was closed by a dispose in another thread, and ``again`` (see the module docstring); a statement whose
        outcome must be known (the pointer swap) passes ``again=False`` and gets the error."""
        if self._turns is None:
            with no_fork_inside():  # statements run in background threads too (watchers, relays, committers): sqlite3
                cursor = self._held()[0].conn.execute(sql, params)  # steps the statement again as its rows are fetched
                return _Rows(cursor.fetchall() if cursor.description is not None else [], cursor.rowcount)
        sql = sql.replace("?", "%s")
        with no_fork_inside(), self._turns:
            while True:
                held, fresh = self._held()
                try:
                    cursor = held.conn.cursor()
                    if fresh and self._waiters:  # the channels waited on: LISTEN again on the new connection
                        self._listen_again(cursor)
                    cursor.execute(sql, params)
                    if held.conn.notifies:  # arrived during the statement: counted now, none left in the driver
                        self._count(held.conn)
                    # fetched here: a dispose in another thread closes the connection, and its cursors, at any time
                    return _Rows(cursor.fetchall() if cursor.description is not None else [], cursor.rowcount)
                except self._broken:
                    if not getattr(held.conn, "closed", True):  # the statement's error (statement_timeout, a lock
                        raise  # or deadlock timeout) on a working connection: kept, and the statement not run again
                    self._drop(held)
                    if not again:
                        raise
                    if held.key[1] != self.generation:  # closed by a dispose (catalog.close()) since it was opened
                        continue
                    if fresh:
                        raise
                    if self._on_dead is not None:
                        self._on_dead()

    def listen(self, channel: str) -> bool:
        """Start waiting for notifications on ``channel`` (PostgreSQL): the first waiter of the process runs ``LISTEN``.
        Every ``listen`` that returned True needs its :meth:`unlisten`. False (nothing to undo) where this connection
        takes no notifications (SQLite) or ``LISTEN`` failed: the caller polls."""
        if self._turns is None:
            return False
        with self._listen_lock:
            first = not self._waiters.get(channel)
            # counted first: a connection replaced while LISTEN runs (a dispose in another thread) listens again on it
            self._waiters[channel] = self._waiters.get(channel, 0) + 1
            if first:
                try:
                    self.execute(f'LISTEN "{channel}"')
                except Exception:  # noqa: BLE001 - e.g. the database unreachable right now: the caller polls
                    self._waiters.pop(channel, None)
                    return False
            return True

    def unlisten(self, channel: str) -> None:
        """Stop waiting on ``channel``: the last waiter of the process runs ``UNLISTEN`` (a failure is left to the next
        statement: a dead connection is dropped with its ``LISTEN``; on a live one only its notifications are counted)."""
        with self._listen_lock:
            left = self._waiters.get(channel, 0) - 1
            if left > 0:
                self._waiters[channel] = left
                return
            self._waiters.pop(channel, None)
            try:
                self.execute(f'UNLISTEN "{channel}"')
            except Exception:  # noqa: BLE001 - see the docstring
                pass

    def notified(self, channel: str) -> int:
        """How many times this process was told to look at ``channel`` (compare with an earlier count): each
        notification, and each new connection that listens again (one may have been missed in between)."""
        return self._notified.get(channel, 0)

    def heard(self, channel: str) -> int:
        """How many notifications this process has received on ``channel``."""
        return self._heard.get(channel, 0)

    def wait_notified(self, channel: str, seen: int, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the count of ``channel``'s notifications to pass ``seen``; returns the
        count. Returns at once when it already has; after the timeout otherwise, or early when the connection has
        something to read that is not a notification (another thread's statement). Where no connection of this
        process is open, or it fails, it sleeps the timeout: the caller's next statement reopens it."""
        if (count := self._notified.get(channel, 0)) != seen:
            return count
        held: _Held | None = getattr(self.local, "held", None)
        if self._turns is None or held is None or held.key != (_getpid(), self.generation):
            time.sleep(max(0.0, timeout))
            return self._notified.get(channel, 0)
        conn = held.conn
        try:
            if readable(conn, timeout):
                with no_fork_inside(), self._turns:
                    if self.local.held is held:  # not replaced while this thread waited
                        conn.poll()
                        self._count(conn)
        except Exception:  # noqa: BLE001 - closed by a dispose meanwhile, or dead: the next statement reopens it
            time.sleep(max(0.0, timeout))
        return self._notified.get(channel, 0)

    def _count(self, conn: Any) -> None:
        """Count (and drop from the driver) the notifications the connection received; under ``_turns``."""
        for notice in conn.notifies:
            self._notified[notice.channel] = self._notified.get(notice.channel, 0) + 1
            self._heard[notice.channel] = self._heard.get(notice.channel, 0) + 1
        conn.notifies.clear()

    def _listen_again(self, cursor: Any) -> None:
        """On a new connection: ``LISTEN`` on every channel waited on, and tell their waiters to look (notifications
        sent while no connection listened are lost)."""
        for channel in list(self._waiters):
            cursor.execute(f'LISTEN "{channel}"')
            self._notified[channel] = self._notified.get(channel, 0) + 1

    def read(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row of a query, or None when it returns no row."""
        row = self.execute(sql, params).fetchone()
        return row[0] if row is not None else None

    def _held(self) -> tuple[_Held, bool]:
        key = (_getpid(), self.generation)
        held: _Held | None = getattr(self.local, "held", None)
        if held is not None and held.key == key:
            return held, False
        if held is not None and held.key[0] != key[0]:
            _INHERITED.append(held)  # the parent's: dropping the last reference would close it here
        held = _Held(key, self._open())
        weakref.finalize(held, close_in_owner, held.conn, key[0])
        with self.lock:
            self.opened.add(held)
        self.local.held = held
        return held, True

    def _drop(self, held: _Held) -> None:
        with self.lock:
            self.opened.discard(held)
        if getattr(self.local, "held", None) is held:
            self.local.held = None
        close_in_owner(held.conn, held.key[0])

    def open_connections(self) -> int:
        """How many direct connections this process holds open now."""
        pid = _getpid()
        with self.lock:
            return sum(1 for held in list(self.opened) if held.key[0] == pid)

    def dispose(self, *_args: Any) -> None:
        """Close this process's connections (SQLAlchemy's ``engine_disposed`` event); a child's dispose after a
        fork (``close=False``) leaves its parent's connections alone, as SQLAlchemy does."""
        pid = _getpid()
        with self.lock:
            mine = [held for held in list(self.opened) if held.key[0] == pid]
            for held in mine:
                self.opened.discard(held)
            self.generation += 1
        for held in mine:
            close_in_owner(held.conn, pid)


_BY_ENGINE: weakref.WeakKeyDictionary[Any, DirectConnections | None] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def sqlite_connections(engine: Any) -> DirectConnections | None:
    """:func:`direct_connections` of an engine on a SQLite database file (None for anything else)."""
    if engine.dialect.name != "sqlite":
        return None
    return direct_connections(engine)


def direct_connections(engine: Any) -> DirectConnections | None:
    """The direct connections of an SQLAlchemy engine (see the module docstring), made once per engine; None where it
    has none. A catalog opened again (a new engine) never runs statements on an older catalog's connections."""
    with _LOCK:
        if engine in _BY_ENGINE:
            return _BY_ENGINE[engine]
    made = _make(engine)  # outside the lock: SQLite asks the engine's own connection, maybe of a busy database
    with _LOCK:
        direct = _BY_ENGINE.setdefault(engine, made)  # a thread that got here first wins
    if direct is made and made is not None:
        from sqlalchemy import event

        event.listen(engine, "engine_disposed", made.dispose)
    return direct


def _make(engine: Any) -> DirectConnections | None:
    dialect = engine.dialect.name
    driver = getattr(engine.dialect, "driver", None)
    if dialect == "postgresql" and driver == "psycopg2":
        return _postgres(engine)
    if dialect != "sqlite" or driver != "pysqlite":
        return None
    url = engine.url
    database = url.database or ""
    # A file URI without options (uri=true alone) names a file as a path does: tools/config.sqlite_url makes one on
    # SQLAlchemy 2.0 for a home whose path holds a ?. Any other option (mode=, cache=, timeout=, ...) keeps
    # SQLAlchemy's connections, which apply it.
    plain_uri = database.startswith("file:") and dict(url.query) == {"uri": "true"}
    if (url.query and not plain_uri) or url.username or url.password or url.host or url.port \
            or database in ("", ":memory:") or (database.startswith("file:") and not plain_uri):
        return None
    with engine.connect() as conn:  # the file the engine's own connections opened (a relative path made absolute)
        rows = conn.exec_driver_sql("PRAGMA database_list").fetchall()
    path = next((row[2] for row in rows if row[1] == "main"), "")
    if not path:
        return None
    uri = f"file:{pathname2url(path)}?mode=rw"  # never creates a database: a missing file is an error

    def open_sqlite() -> sqlite3.Connection:
        # sqlite3's default busy timeout, as SQLAlchemy's pysqlite dialect; check_same_thread off only so that
        # dispose() and the finalizer may close it from another thread (each is used by the thread that opened it)
        conn = sqlite3.connect(uri, uri=True, timeout=5.0, isolation_level=None, check_same_thread=False)
        # These connections write nothing but staged intents and consumer positions, which need no sync of their own;
        # in WAL mode NORMAL keeps the database consistent through a crash (the pointer swap keeps FULL)
        if str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
            conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    return DirectConnections("sqlite", open_sqlite, per_thread=True)


def _postgres(engine: Any) -> DirectConnections:
    import psycopg2

    # A connection that died after it worked (a server restart, a failover) leaves the pool's idle connections dead
    # too: the engine is disposed, as SQLAlchemy invalidates its pool on a disconnect, so that the second run (and
    # pyiceberg's next statement) gets a new connection instead of a dead pooled one.
    # The engine is held weakly: these connections are the value of _BY_ENGINE, whose key is the engine, and a value
    # that held its key would keep every engine (its pool and this connection) open for the life of the process. Once
    # the engine is freed, so are these: each connection's finalizer closes it (a forked child's copy is kept).
    ref = weakref.ref(engine)

    def opener() -> Any:
        made = ref()
        if made is None:  # pragma: no cover - a caller holds the engine (its catalog) while it runs a statement
            raise psycopg2.InterfaceError("the catalog's engine was freed")
        return detached_autocommit(made)

    def on_dead() -> None:
        made = ref()
        if made is not None:
            made.dispose()

    return DirectConnections("postgresql", opener, per_thread=False,
                             broken=(psycopg2.OperationalError, psycopg2.InterfaceError), on_dead=on_dead)


def detached_autocommit(engine: Any) -> Any:
    """A DBAPI connection the engine makes (its URL, ``connect_args`` and connect events), detached from its pool (ours
    until closed: the pool neither reuses nor resets it) and in autocommit."""
    proxied = engine.raw_connection()
    proxied.detach()
    conn = proxied.dbapi_connection
    conn.autocommit = True
    return conn


def readable(conn: Any, timeout: float) -> bool:
    """Whether ``conn`` (a socket, a database connection: anything with ``fileno()``) has something to read, or was
    closed, within ``timeout`` seconds: ``poll()``, which takes any descriptor (``select()`` refuses those from 1024 up,
    which a process with many open files or sockets hands out, e.g. a relay holder serving hundreds of readers)."""
    timeout = max(0.0, timeout)
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    ready, _, _ = select.select([conn], [], [], timeout)  # pragma: no cover - Windows: no poll()
    return bool(ready)


def _reset_lock_after_fork() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # another thread of the parent may have held a lock at the fork
    for direct in list(_BY_ENGINE.values()):
        if direct is not None:
            direct.lock = threading.Lock()
            direct._listen_lock = threading.Lock()
            direct._waiters = {}  # the parent's waiters: this process listens on its own connection, when it waits
            if direct._turns is not None:
                direct._turns = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)
