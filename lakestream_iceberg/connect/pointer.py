"""Reading a table's metadata pointer without reading its metadata: the cheap "did the head move?" question.

A commit loop, ``head_step()``, ``state()`` and a follow-mode reader all ask whether the table changed many times per
second; when it did not, nothing but the pointer should be read.

* SQL catalogs (SQLite, PostgreSQL): one indexed ``SELECT metadata_location FROM iceberg_tables`` on the catalog's own
  SQLAlchemy engine; the new ``metadata.json`` is read through the table's FileIO only when the pointer moved.
* Any other catalog (REST, Glue, Hive): ``Table.refresh()`` (those catalogs answer with the full metadata anyway).

:func:`read_moved` is the lighter read still for a caller that needs a few fields of the new head (a producer whose
batch another producer's commit carried asks only where it was published): the new ``metadata.json`` as plain JSON,
without building pyiceberg's ``TableMetadata`` from it.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import weakref
from collections.abc import Callable
from typing import Any
from urllib.request import pathname2url

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.io import FileIO
from pyiceberg.table import Table

from lakestream_iceberg.connect.fork import no_fork_inside
from lakestream_iceberg.connect.metadata_read import read_metadata
from lakestream_iceberg.errors import StreamError, StreamNotFoundError

__all__ = ["PointerWatch", "cached_probe", "pointer_probe", "read_moved", "refresh_if_moved", "release_idle_connections"]

_PROBES: dict[int, tuple[weakref.ref[Table], Callable[[], str | None] | None]] = {}  # id(table) -> (table, probe)


def pointer_probe(table: Table) -> Callable[[], str | None] | None:
    """A function returning the table's current metadata location with one SQL query, or None for other catalogs."""
    try:
        from pyiceberg.catalog.sql import IcebergTables, SqlCatalog
        from sqlalchemy import select
    except ImportError:  # pragma: no cover - the sql extra is a core dependency
        return None
    catalog = table.catalog
    if not isinstance(catalog, SqlCatalog):
        return None
    identifier = table.name()
    stmt = select(IcebergTables.metadata_location).where(
        IcebergTables.catalog_name == catalog.name,
        IcebergTables.table_namespace == Catalog.namespace_to_string(identifier[:-1]),
        IcebergTables.table_name == identifier[-1],
    )
    engine = catalog.engine
    reader = _sqlite_reader(engine)
    if reader is not None:  # the same query on a plain sqlite3 connection: a third of SQLAlchemy's cost per call
        params = (catalog.name, Catalog.namespace_to_string(identifier[:-1]), identifier[-1])
        return lambda: reader(_SQLITE_PROBE, params)

    def probe() -> str | None:
        with no_fork_inside(), engine.connect() as conn:
            return conn.execute(stmt).scalar_one_or_none()

    return probe


# pyiceberg's IcebergTables: (catalog_name, table_namespace, table_name) is the primary key
_SQLITE_PROBE = ("SELECT metadata_location FROM iceberg_tables "
                 "WHERE catalog_name = ? AND table_namespace = ? AND table_name = ?")


class _Connection:
    """One thread's probe connection; closed when the thread ends (its thread-local copy is the only strong reference)
    or when the engine is disposed, whichever comes first."""

    __slots__ = ("__weakref__", "conn", "key")

    def __init__(self, key: tuple[int, int], conn: sqlite3.Connection) -> None:
        self.key, self.conn = key, conn


_INHERITED: list[object] = []  # a forked child's copies of its parent's connections: kept, never closed
_getpid = os.getpid  # which process this is (a name of its own, so a test can play a forked child)


def _close(conn: sqlite3.Connection, pid: int) -> None:
    """Close a probe connection, but only in the process that opened it. A forked child keeps its copies (in
    ``_INHERITED``) instead of letting them go: the last reference closes a ``sqlite3`` connection, which runs SQLite
    code on state that may have been copied mid-operation (another thread's query at the fork)."""
    if _getpid() != pid:
        _INHERITED.append(conn)
        return
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - in use by its thread right now: closed with it
        pass


class _SqliteReaders:
    """The ``sqlite3`` connections that answer one engine's probes: one per thread and process, opened on first use on
    the file the engine's own connections opened, closed when their thread ends or the engine is disposed
    (``catalog.close()``). A process whose threads come and go (a pool that replaces its workers) keeps one open
    connection per live thread, not one per thread it ever ran."""

    def __init__(self, path: str) -> None:
        self.uri = f"file:{pathname2url(path)}?mode=rw"  # never creates a database: a missing file is an error
        self.local = threading.local()
        self.generation = 0  # bumped by dispose(): every thread opens a new connection at its next query
        self.opened: weakref.WeakSet[_Connection] = weakref.WeakSet()  # the live threads' connections, for dispose()
        self.lock = threading.Lock()

    def read(self, sql: str, params: tuple[str, ...]) -> str | None:
        with no_fork_inside():  # probes run in background threads too (watchers, relays)
            row = self.connection().execute(sql, params).fetchone()
        return row[0] if row is not None else None

    def connection(self) -> sqlite3.Connection:
        """This thread's connection (autocommit), opened on first use in this thread and process."""
        key = (_getpid(), self.generation)
        held: _Connection | None = getattr(self.local, "held", None)
        if held is None or held.key != key:  # first use in this thread, a forked child, or disposed since
            if held is not None and held.key[0] != key[0]:
                _INHERITED.append(held)  # the parent's: dropping the last reference would close it here
            # sqlite3's default busy timeout, as SQLAlchemy's pysqlite dialect; check_same_thread off only so that
            # dispose() and the finalizer may close it from another thread (each is used by the thread that opened it)
            conn = sqlite3.connect(self.uri, uri=True, timeout=5.0, isolation_level=None, check_same_thread=False)
            # These connections write nothing but staged intents (connect/intents.py), which need no sync of their
            # own; in WAL mode NORMAL keeps the database consistent through a crash (the swap keeps FULL)
            if str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
                conn.execute("PRAGMA synchronous=NORMAL")
            held = _Connection(key, conn)
            weakref.finalize(held, _close, conn, key[0])
            with self.lock:
                self.opened.add(held)
            self.local.held = held
        return held.conn

    def open_connections(self) -> int:
        """How many probe connections this process holds open now."""
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
            _close(held.conn, pid)


_READERS: weakref.WeakKeyDictionary[Any, _SqliteReaders | None] = weakref.WeakKeyDictionary()  # engine -> readers
_READERS_LOCK = threading.Lock()


def _sqlite_reader(engine: Any) -> Callable[[str, tuple[str, ...]], str | None] | None:
    """:func:`sqlite_connections`' one-value query function (None where there are none)."""
    readers = sqlite_connections(engine)
    return readers.read if readers is not None else None


def sqlite_connections(engine: Any) -> _SqliteReaders | None:
    """For an SQLAlchemy engine of the standard ``pysqlite`` driver on a plain SQLite database file: ``sqlite3``
    connections of this thread and process (autocommit: each query reads the last committed state, in WAL mode without
    blocking the writer), for the pointer probe and the staged intents (:mod:`lakestream_iceberg.connect.intents`).
    None for anything else (an in-memory database, a URI with options, another driver such as SQLCipher,
    credentials), which keeps SQLAlchemy's connections.

    The file is the one the engine's own connections opened (SQLAlchemy makes a relative path absolute when the engine
    is made; the working directory may have changed since), asked once per engine. A catalog opened again (a new
    engine) never reads through an older catalog's connection, and a forked child opens its own (a SQLite connection
    must not cross a fork)."""
    url = engine.url
    database = url.database or ""
    if engine.dialect.name != "sqlite" or getattr(engine.dialect, "driver", None) != "pysqlite" or url.query \
            or url.username or url.password or url.host or url.port or database in ("", ":memory:") \
            or database.startswith("file:"):
        return None
    with _READERS_LOCK:
        if engine in _READERS:
            return _READERS[engine]
    with engine.connect() as conn:  # outside the lock: the engine's own connection, maybe a busy database
        rows = conn.exec_driver_sql("PRAGMA database_list").fetchall()
    path = next((row[2] for row in rows if row[1] == "main"), "")
    made = _SqliteReaders(path) if path else None
    with _READERS_LOCK:
        readers = _READERS.setdefault(engine, made)  # a thread that got here first wins
    if readers is made and made is not None:
        from sqlalchemy import event

        event.listen(engine, "engine_disposed", made.dispose)
    return readers


def _reset_lock_after_fork() -> None:
    global _READERS_LOCK
    _READERS_LOCK = threading.Lock()  # another thread of the parent may have held a lock at the fork
    for readers in list(_READERS.values()):
        if readers is not None:
            readers.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


def release_idle_connections(catalog: Catalog) -> bool:
    """Close the idle pooled connections of a SQL catalog on a database server (PostgreSQL, MySQL): a process that
    follows a stream through another process's relay holds none open for nothing. The pool opens one again when the
    catalog is used. SQLite (a file, no server connection) and other catalogs are left alone; True when released."""
    engine = getattr(catalog, "engine", None)
    dialect = getattr(engine, "dialect", None)
    if dialect is None or dialect.name == "sqlite":
        return False
    try:
        engine.dispose(close=True)  # type: ignore[union-attr]  # checked-out connections close when given back
    except Exception:  # noqa: BLE001 - a pool that cannot be disposed keeps its connections: a cost, not an error
        return False
    return True


def cached_probe(table: Table) -> Callable[[], str | None] | None:
    """:func:`pointer_probe` of ``table``, made once per table object (None for catalogs without one)."""
    key = id(table)
    cached = _PROBES.get(key)
    if cached is None or cached[0]() is not table:  # pyiceberg tables are not hashable: keyed by id, checked by ref
        def forget(_ref: weakref.ref[Table], key: int = key) -> None:
            _PROBES.pop(key, None)

        cached = (weakref.ref(table, forget), pointer_probe(table))
        _PROBES[key] = cached
    return cached[1]


class PointerWatch:
    """How long a table's catalog pointer has stayed where it is, as seen from the first read (``probe``: see
    :func:`cached_probe`; probed at most every ``every_s``), and whether it moved since the last look. A failing or
    missing probe never reports idleness nor a move."""

    def __init__(self, probe: Callable[[], str | None] | None, now: float, *, every_s: float) -> None:
        self._probe = probe
        self._every_s = every_s
        self._location: str | None = None
        self._since = now
        self._read = False
        self._probed = -math.inf
        self._moved = False  # moved (or first read) since moved() last answered

    def _look(self, now: float) -> None:
        if self._probe is None or (self._read and now - self._probed < self._every_s):
            return
        self._probed = now
        try:
            location = self._probe()
        except Exception:  # noqa: BLE001 - an unreachable catalog is not an idle one: keep holding
            self._read = False
            return
        if not self._read or location != self._location:
            self._location, self._since, self._read, self._moved = location, now, True, True

    def idle_for(self, now: float) -> float:
        """Seconds the pointer has stayed where it is (0 when it cannot be read)."""
        self._look(now)
        return now - self._since if self._read else 0.0

    @property
    def readable(self) -> bool:
        """Whether the last probe read the pointer (False before the first one and after a failed one)."""
        return self._read

    def moved(self, now: float) -> bool:
        """Whether the pointer moved since the last call (the first successful read counts as a move)."""
        self._look(now)
        moved, self._moved = self._moved, False
        return moved


def read_moved(table: Table, *, location: str | None = None) -> tuple[str, dict[str, Any] | None] | None:
    """The table's current metadata location, with its ``metadata.json`` as plain JSON when it is not ``table``'s own.

    ``location``: the catalog pointer as the caller has just read it with the table's probe (not read again).

    Returns ``(location, None)`` when the pointer did not move (``table.metadata`` is current), and None when this
    cannot be answered lightly: a catalog without a pointer probe, a table the catalog no longer has, a compressed
    ``metadata.json``, a file that is not a JSON object, or one of another table (dropped and created again under this
    name: :func:`refresh_if_moved` refuses it). ``table`` itself is left as it is. The JSON is unchecked:
    the caller validates every field it uses.
    """
    if location is None:
        probe = cached_probe(table)
        if probe is None:
            return None
        location = probe()
        if location is None:
            return None
    if location == table.metadata_location:
        return location, None
    if not location.endswith(".metadata.json") or location.endswith(".gz.metadata.json"):
        return None
    with table.io.new_input(location).open() as f:
        raw = f.read()
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON (or nested past the parser's stack): the full read reports it
        return None
    if not isinstance(document, dict) or document.get("table-uuid") != str(table.metadata.table_uuid):
        return None  # not an object, or another table under this name: the full read reports it
    return location, document


def refresh_if_moved(table: Table, *, io: FileIO | None = None) -> bool:
    """Bring ``table`` up to date, reading its metadata only when the catalog pointer moved; True when it changed.

    ``io`` reads the new ``metadata.json`` (default: the table's own FileIO).
    A table that no longer exists (dropped, renamed) falls back to ``Table.refresh()``.

    Raises:
        StreamNotFoundError: No table has the name any more (dropped or renamed).
        StreamError: The name now holds another table (a different table UUID: dropped and created again);
            ``table`` keeps its metadata.
    """
    probe = cached_probe(table)
    before, held = table.metadata_location, table.metadata
    if probe is None:
        _reload(table)
        _same_table(table, held, before)
        return table.metadata_location != before
    location = probe()
    if location is None:
        _reload(table)
        _same_table(table, held, before)
        return True
    if location == before:
        return False
    location, metadata = read_pointed(io or table.io, location, probe)
    if metadata.table_uuid != held.table_uuid:
        raise _recreated(table, held, metadata)
    table.metadata = metadata
    table.metadata_location = location
    return True


def read_pointed(io: FileIO, location: str, probe: Callable[[], str | None], *, tries: int = 16) -> tuple[str, Any]:
    """The metadata at ``location``, which the catalog pointer named; when that file is gone, the metadata the pointer
    names now (and its location).

    A reader that falls behind by ``write.metadata.previous-versions-max`` commits between reading the pointer and
    the file finds the file deleted (``write.metadata.delete-after-commit.enabled``): the pointer has moved on since,
    so it is read again. A file missing while the pointer still names it is a real loss: ``FileNotFoundError``.
    """
    for _ in range(tries):
        try:
            return location, read_metadata(io, location)
        except FileNotFoundError:
            now = probe()
            if now is None or now == location:
                raise
            location = now
    return location, read_metadata(io, location)


def _reload(table: Table) -> None:
    try:
        table.refresh()
    except NoSuchTableError as exc:
        if isinstance(exc, StreamNotFoundError):
            raise
        raise StreamNotFoundError(
            f"table {'.'.join(table.name())} no longer exists (dropped or renamed, by another process too): stop using "
            "this stream; create it again with Stream.create() if it is to go on"
        ) from exc


def _same_table(table: Table, held: Any, before: str) -> None:
    """Undo a refresh that found another table under the same name (dropped and created again), and refuse it."""
    if table.metadata.table_uuid != held.table_uuid:
        found = table.metadata
        table.metadata, table.metadata_location = held, before
        raise _recreated(table, held, found)


def _recreated(table: Table, held: Any, found: Any) -> StreamError:
    return StreamError(
        f"table {'.'.join(table.name())} was dropped and created again since it was opened (table UUID {held.table_uuid}, "
        f"now {found.table_uuid}): this handle's world size, schema and producer state belong to the old table, so "
        "nothing is read or published through it. Open the stream again (Stream.open) to use the new table"
    )
