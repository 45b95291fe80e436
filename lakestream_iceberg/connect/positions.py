"""Where consumer positions are kept: one row per (stream, consumer group, rank), upserted, never a table commit.

A trainer rank that reads a stream records how far it got (see :mod:`lakestream_iceberg.read.consumer`) as one small
JSON document. On a SQL catalog (a SQLite database file or PostgreSQL ``SqlCatalog``) the documents are rows of one
table in the catalog's own database, next to pyiceberg's ``iceberg_tables`` and lakestream's staged intents
(:mod:`lakestream_iceberg.connect.intents`)::

    lakestream_consumer_positions
        location    the stream's table location (which stream)
        grp         the consumer group (a training run's name)
        rank        the consumer rank; (location, grp, rank) is the primary key
        body        the position's JSON document (read back as input: validated by read/consumer.py)
        updated_at  the database's clock when the row was last written, unix seconds

A report is one ``INSERT ... ON CONFLICT DO UPDATE`` (SQLite 3.24+, PostgreSQL), a listing of a group one indexed
``SELECT`` that also returns each row's age by the database's clock. A thousand ranks reporting every 5 s are 200
single-row upserts a second, whatever the step rate, and the table holds one row per rank ever seen. On PostgreSQL each
statement opens a connection and closes it (``NullPool``; about 5 ms a report on a local server, 0.5 ms on a kept
connection): a connection kept idle between reports would be one per rank, thousands of server connections for a large
job, where a rank following through its host's relay keeps none otherwise. With thousands of ranks, put a pooler
(PgBouncer) in front of the database, as for any service with that many clients.

Any other catalog (REST, Glue, Hive, an in-memory SQLite database) keeps one object per rank under the table's location,
``<location>/data/_consumers/<group, URL-quoted>/r<rank:06d>.parquet``, overwritten in place: a one-row Parquet file
whose ``position`` column holds the document; its age is the store's modification time. It lies under ``data/`` and is
Parquet (as staged intents and producer-state files are, beside the producer folders, whose ids never start with
``_``) because stores that serve Iceberg tables, such as S3 table buckets, accept only Parquet and Avro files under a
table's ``data/`` (SeaweedFS's table buckets refuse a ``.json`` object there).

**Retention** (table property ``lakestream.consumers.retention-ms``, default 7 days, as Kafka's
``offsets.retention.minutes``): the positions of a group whose newest report is older than the retention period are
deleted, all of the group's ranks together (:meth:`PositionStore.expire`); a group where any rank reported within the
period keeps every row, its stale and gone ranks included (as Kafka expires only the offsets of a group with no active
member). Ages are the store's clock: the database's for rows, the modification times for objects, against the store's
own clock (a probe object's modification time, or GC's reading of it) where this host's runs ahead. Two callers, neither
on the training loop's path:

* the position reporter of rank 0 (:class:`~lakestream_iceberg.read.consumer.PositionReporter`), from its background
  thread after its first report and then at most once an hour per process and stream: one statement per training run
  and hour (not one per rank: a thousand ranks restarting would otherwise run a thousand), bounded by the stream's rows
  (the primary key's ``location`` prefix). Rows stop accumulating wherever runs keep starting, even where nobody runs GC;
* lifecycle GC (:mod:`lakestream_iceberg.lifecycle.gc`), once per collection, for the streams nobody reads any more.
  Its sweep leaves position objects to this expiry (a stale rank of a live group stays listed, as a row does).

Expiry on a schedule of its own would need a process to own it, which lakestream has nowhere; expiry in the upsert
would cost a statement per report. ``Stream.drop`` removes the dropped stream's rows (:meth:`PositionStore.delete`),
which no later report or GC would reach; ``Stream.delete_consumer_group`` (``lakestream lag --delete``) removes one
group's positions on demand, from either store.

A report racing the expiry of its own group (a run resumed exactly when its group expires, after a silence of the whole
period) keeps its row: the ``DELETE`` also requires each row it removes to be old, which PostgreSQL re-checks on a row
updated meanwhile (SQLite runs the statement alone). An object rewritten between the listing and the deletion may go;
either way the group's ranks write their positions again at their next report.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.parquet as pq

from lakestream_iceberg.connect.direct import sqlite_connections
from lakestream_iceberg.connect.fork import no_fork_inside
from lakestream_iceberg.connect.integers import INT32_MAX
from lakestream_iceberg.connect.sql_tables import CatalogTable, shared_engine
from lakestream_iceberg.connect.storage import list_files, store_now

__all__ = ["POSITIONS_DIR", "POSITION_TABLE", "PositionRow", "PositionStore"]

log = logging.getLogger(__name__)
T = TypeVar("T")

POSITION_TABLE = "lakestream_consumer_positions"
POSITIONS_DIR = "_consumers"  # under the table's data/ folder
_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"  # unix seconds, millisecond resolution
_SQLITE_DDL = (
    f"CREATE TABLE IF NOT EXISTS {POSITION_TABLE} (location TEXT NOT NULL, grp TEXT NOT NULL, rank INTEGER NOT NULL, "
    "body TEXT NOT NULL, updated_at REAL NOT NULL, PRIMARY KEY (location, grp, rank))"
)
_SQLITE_UPSERT = (
    f"INSERT INTO {POSITION_TABLE} (location, grp, rank, body, updated_at) VALUES (?, ?, ?, ?, {_SQLITE_NOW}) "
    "ON CONFLICT (location, grp, rank) DO UPDATE SET body = excluded.body, updated_at = excluded.updated_at"
)
# The rows of this stream whose group has no row younger than the cutoff (args: location, age, location, age).
_SQLITE_EXPIRED = (
    f"location = ? AND updated_at < {_SQLITE_NOW} - ? AND grp NOT IN "
    f"(SELECT grp FROM {POSITION_TABLE} WHERE location = ? AND updated_at >= {_SQLITE_NOW} - ?)"
)
_SUFFIX = ".parquet"
_SCHEMA = pa.schema([("position", pa.string())])


@dataclass(frozen=True)
class PositionRow:
    """One stored position as listed: its key, its JSON document as stored (unchecked), and its age in seconds by the
    store's clock (the database's, or the object store's modification time against this host's clock)."""

    group: str
    rank: int
    body: str
    age_s: float


def _gated_in_database(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` inside the fork gate (connect/fork.py) where the positions are rows of the catalog's database, whose
    statements run on raw ``sqlite3`` connections too: a fork waits for them, so no child inherits a libsqlite3 mutex
    held. Objects are written and listed outside it: a fork never waits on object storage."""

    @functools.wraps(method)
    def run(self: PositionStore, *args: Any, **kwargs: Any) -> T:
        if self._engine is None:
            return method(self, *args, **kwargs)
        with no_fork_inside():
            return method(self, *args, **kwargs)

    return run


class PositionStore:
    """The consumer positions of one stream: a table of the SQL catalog's database, else objects under its location.

    Args:
        catalog: The stream's pyiceberg catalog.
        io: The stream's FileIO (used for the object fallback).
        location: The stream's table location (the key of its rows).
    """

    def __init__(self, *, catalog: Any, io: Any, location: str) -> None:
        self.location = location.rstrip("/")
        self._io = io
        self._engine = _sql_engine(catalog)
        self._sqlite = sqlite_connections(self._engine) if self._engine is not None \
            and self._engine.dialect.name == "sqlite" else None

    @property
    def kind(self) -> str:
        """``"catalog database"`` or ``"object store"``: where the positions are kept."""
        return "object store" if self._engine is None else "catalog database"

    # -- statements ----------------------------------------------------------------------------------------------------
    @_gated_in_database
    def upsert(self, *, group: str, rank: int, body: str) -> None:
        """Write the position of (``group``, ``rank``), replacing the one stored."""
        if self._engine is None:
            with self._io.new_output(self._object_path(group, rank)).create(overwrite=True) as out:
                out.write(_to_parquet(body))
            return
        self._ensure()
        if self._sqlite is not None:
            self._sqlite.connection().execute(_SQLITE_UPSERT, (self.location, group, rank, body))
            return
        if self._engine.dialect.name == "sqlite":  # a database URI with options: SQLAlchemy's own connections
            with self._engine.begin() as conn:
                conn.exec_driver_sql(_SQLITE_UPSERT, (self.location, group, rank, body))
            return
        from sqlalchemy.dialects.postgresql import insert

        t = _TABLE.pg
        stmt = insert(t).values(location=self.location, grp=group, rank=rank, body=body, updated_at=_pg_now())
        stmt = stmt.on_conflict_do_update(index_elements=[t.c.location, t.c.grp, t.c.rank],
                                          set_={"body": stmt.excluded.body, "updated_at": stmt.excluded.updated_at})
        with self._engine.begin() as conn:
            conn.execute(stmt)

    @_gated_in_database
    def rows(self, *, group: str | None = None) -> list[PositionRow]:
        """The stored positions of ``group`` (every group when None), ordered by group and rank. A store that has
        none (no table yet, no objects) returns an empty list and creates nothing."""
        if self._engine is None:
            return self._object_rows(group)
        if self._sqlite is not None:
            conn = self._sqlite.connection()
            if not _TABLE.in_sqlite(conn):
                return []
            where, args = ("location = ?", [self.location]) if group is None else \
                ("location = ? AND grp = ?", [self.location, group])
            found = conn.execute(f"SELECT grp, rank, body, {_SQLITE_NOW} - updated_at FROM {POSITION_TABLE} "
                                 f"WHERE {where} ORDER BY grp, rank", args).fetchall()
        else:
            from sqlalchemy import inspect, select

            if not inspect(self._engine).has_table(POSITION_TABLE):
                return []
            t = _TABLE.pg
            now = _pg_now() if self._engine.dialect.name != "sqlite" else _sqlite_now()
            stmt = select(t.c.grp, t.c.rank, t.c.body, now - t.c.updated_at).where(t.c.location == self.location)
            if group is not None:
                stmt = stmt.where(t.c.grp == group)
            with self._engine.connect() as conn:
                found = conn.execute(stmt.order_by(t.c.grp, t.c.rank)).all()
        return _keyed(self.location, [PositionRow(group=str(g), rank=r, body=str(b), age_s=max(0.0, float(a)))
                                      for g, r, b, a in found])

    @_gated_in_database
    def expire(self, *, older_than_s: float, delete: bool = True, now: float | None = None) -> tuple[int, int]:
        """Delete the positions of every group whose newest report is older than ``older_than_s`` seconds by the
        store's clock, all of a group's ranks together (see the module docstring); ``delete=False`` only counts them.
        Returns how many positions and bytes (0 for rows) went. A store that has none creates nothing.

        ``now``: the store's time now for objects (GC reads it once: ``lifecycle.sweep.gc_now``); None: the earlier of
        this host's clock and the store's (a probe object, only when deleting), so a host whose clock runs ahead never
        expires a group that reported recently. Rows age by the database's clock whatever ``now`` says."""
        if self._engine is None:
            old: dict[str, list[tuple[str, int]]] = {}
            newest: dict[str, float] = {}
            for path, group, _rank, mtime, size in self._object_list(None):
                old.setdefault(group, []).append((path, size))
                newest[group] = max(newest.get(group, mtime), mtime)
            if now is None:
                now = time.time()
                if delete and old:
                    store = store_now(self._io, self.location)
                    now = now if store is None else min(now, store)
            cutoff = now - older_than_s
            doomed = [o for group, objects in old.items() if newest[group] < cutoff for o in objects]
            return self._delete_objects(doomed, delete=delete), sum(size for _, size in doomed)
        if self._sqlite is not None:
            conn = self._sqlite.connection()
            if not _TABLE.in_sqlite(conn):
                return 0, 0
            args = (self.location, older_than_s, self.location, older_than_s)
            if not delete:
                return int(conn.execute(f"SELECT count(*) FROM {POSITION_TABLE} WHERE {_SQLITE_EXPIRED}",
                                        args).fetchone()[0]), 0
            return conn.execute(f"DELETE FROM {POSITION_TABLE} WHERE {_SQLITE_EXPIRED}", args).rowcount, 0
        from sqlalchemy import and_

        t = _TABLE.pg
        cutoff = (_pg_now() if self._engine.dialect.name != "sqlite" else _sqlite_now()) - older_than_s
        recent = _sa_select(t.c.grp).where(t.c.location == self.location, t.c.updated_at >= cutoff)
        return self._sa_delete(and_(t.c.location == self.location, t.c.updated_at < cutoff, t.c.grp.not_in(recent)),
                               delete=delete), 0

    @_gated_in_database
    def delete(self, *, group: str | None = None) -> int:
        """Delete the positions of ``group`` (every group of this stream when None), whatever their age; returns how
        many went."""
        if self._engine is None:
            return self._delete_objects([(path, size) for path, _, _, _, size in self._object_list(group)], delete=True)
        where, args = ("location = ?", (self.location,)) if group is None else \
            ("location = ? AND grp = ?", (self.location, group))
        if self._sqlite is not None:
            conn = self._sqlite.connection()
            if not _TABLE.in_sqlite(conn):
                return 0
            return conn.execute(f"DELETE FROM {POSITION_TABLE} WHERE {where}", args).rowcount  # autocommit
        t = _TABLE.pg
        cond = t.c.location == self.location
        return self._sa_delete(cond if group is None else cond & (t.c.grp == group), delete=True)

    def _sa_delete(self, cond: Any, *, delete: bool) -> int:
        """``DELETE ... WHERE cond`` (or its count) through SQLAlchemy: PostgreSQL, or SQLite with URI options."""
        from sqlalchemy import delete as sa_delete
        from sqlalchemy import func, inspect

        assert self._engine is not None
        if not inspect(self._engine).has_table(POSITION_TABLE):
            return 0
        t = _TABLE.pg
        with self._engine.begin() as conn:
            if not delete:
                return int(conn.execute(_sa_select(func.count()).select_from(t).where(cond)).scalar_one())
            return int(conn.execute(sa_delete(t).where(cond)).rowcount)

    # -- the object fallback ---------------------------------------------------------------------------------------------
    def _object_path(self, group: str, rank: int) -> str:
        return f"{self.location}/data/{POSITIONS_DIR}/{_segment(group)}/r{rank:06d}.parquet"

    def _object_list(self, group: str | None) -> list[tuple[str, str, int, float, int]]:
        """``(path, group, rank, mtime, size)`` of every position object of ``group`` (every group when None)."""
        found: list[tuple[str, str, int, float, int]] = []
        if group is not None and len(_segment(group)) > MAX_SEGMENT_BYTES:
            return found  # no folder can have its name (a dataset refuses to record under it): none stored
        root = f"{self.location}/data/{POSITIONS_DIR}" + ("" if group is None else f"/{_segment(group)}")
        for path, size, mtime in list_files(self._io, root, purpose="the consumer positions"):
            parts = path.rsplit("/", 2)
            name = parts[-1]
            digits = name[1:-len(_SUFFIX)]
            if len(parts) < 3 or not (name.startswith("r") and name.endswith(_SUFFIX) and digits.isascii()
                                      and digits.isdigit()):
                continue  # not a position object (a temporary file of the store, someone else's file: 'r²')
            if group is not None and unquote(parts[-2]) != group:
                continue  # another group's (a store listing a prefix rather than a folder)
            # a time the store does not tell counts as the latest (age 0, never expired), not as 1970
            found.append((path, unquote(parts[-2]), int(name[1:-len(_SUFFIX)]), math.inf if mtime is None else mtime,
                          size))
        return found

    def _object_rows(self, group: str | None) -> list[PositionRow]:
        found = self._object_list(group)
        now = time.time()
        with ThreadPoolExecutor(min(16, max(1, len(found)))) as pool:  # a thousand ranks: a thousand small GETs
            bodies = list(pool.map(self._read_object, [path for path, *_ in found]))
        out = [PositionRow(group=g, rank=r, body=body, age_s=max(0.0, now - mtime))
               for (_, g, r, mtime, _), body in zip(found, bodies, strict=True) if body is not None]
        return _keyed(self.location, sorted(out, key=lambda r: (r.group, r.rank)))

    def _delete_objects(self, objects: list[tuple[str, int]], *, delete: bool) -> int:
        """Delete these position objects (one already gone is not counted); ``delete=False``: count them."""
        if not delete:
            return len(objects)

        def one(path: str) -> bool:
            try:
                self._io.delete(path)
            except FileNotFoundError:
                return False
            return True

        with ThreadPoolExecutor(min(16, max(1, len(objects)))) as pool:
            return sum(pool.map(one, [path for path, _ in objects]))

    def _read_object(self, path: str) -> str | None:
        """A position object's document; None when it was removed since the listing, and for a file that is not a
        position object's Parquet, text that does not parse as a document (it is reported, not trusted)."""
        try:
            with self._io.new_input(path).open() as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            table = pq.read_table(pa.BufferReader(data))
            if table.schema != _SCHEMA or table.num_rows != 1:
                raise ValueError(f"schema {table.schema}, {table.num_rows} rows")
            return str(table.column(0)[0].as_py())
        except (pa.ArrowException, ValueError, OSError) as exc:
            return f"<not a position file: {exc}>"

    # -- internals -----------------------------------------------------------------------------------------------------
    def _ensure(self) -> None:
        """Create the table on first use in this process (``IF NOT EXISTS``: ranks racing to create it all succeed)."""
        assert self._engine is not None
        _TABLE.ensure(self._engine, sqlite=self._sqlite.connection if self._sqlite is not None else None)


def _keyed(location: str, rows: list[PositionRow]) -> list[PositionRow]:
    """``rows`` less those whose rank no rank can have (not an int from 0 to ``INT32_MAX``, a world size's bound: an object named
    ``r99999999999.parquet``, a row another program wrote), which are logged: they are no rank's position, and a
    listing (an int32 rank column) cannot hold them."""
    kept: list[PositionRow] = []
    odd: list[PositionRow] = []
    for row in rows:
        (kept if type(row.rank) is int and 0 <= row.rank <= INT32_MAX else odd).append(row)
    if odd:
        log.warning("%d consumer position(s) of %s are stored under a rank no rank can have (group %r rank %r%s) and "
                    "are not listed: another program wrote them; delete them (lakestream lag STREAM --group %r --delete)",
                    len(odd), location, odd[0].group, odd[0].rank, ", ..." if len(odd) > 1 else "", odd[0].group)
    return kept


MAX_SEGMENT_BYTES = 255  # a file system's longest name; read.position.check_group bounds recorded groups to it


def _segment(group: str) -> str:
    """``group`` as one path segment of the object store: URL-quoted, and ``.`` / ``..`` (which a filesystem or a store
    resolves as the folder itself or its parent) with their dots quoted too."""
    quoted = quote(group, safe="")
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


def _sql_engine(catalog: Any) -> Any:
    """The engine of a plain pyiceberg ``SqlCatalog`` on a SQLite database file or PostgreSQL (unpooled); None
    otherwise."""
    engine = shared_engine(catalog)
    return _unpooled(engine) if engine is not None and engine.dialect.name == "postgresql" else engine


_UNPOOLED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_UNPOOLED_LOCK = threading.Lock()


def _unpooled(engine: Any) -> Any:
    """An engine on the database of a server catalog's ``engine`` whose connections close when a statement's
    transaction ends (``NullPool``): a rank reports every few seconds, and one idle connection kept per rank between
    reports is thousands of server connections (and PostgreSQL backends) for a job of thousands of ranks, where a
    relay client keeps none otherwise (:func:`~lakestream_iceberg.connect.pointer.release_idle_connections`). One per
    catalog engine."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    with _UNPOOLED_LOCK:
        made = _UNPOOLED.get(engine)
        if made is None:
            made = _UNPOOLED[engine] = create_engine(engine.url, poolclass=NullPool)
        return made


def _build_pg_table() -> Any:
    """The table as a SQLAlchemy ``Table`` (see ``CatalogTable.pg``)."""
    from sqlalchemy import Column, Float, Integer, MetaData, Table, Text

    return Table(
        POSITION_TABLE, MetaData(),
        Column("location", Text, primary_key=True), Column("grp", Text, primary_key=True),
        Column("rank", Integer, primary_key=True, autoincrement=False),
        Column("body", Text, nullable=False), Column("updated_at", Float, nullable=False),
    )


def _sa_select(*columns: Any) -> Any:
    from sqlalchemy import select

    return select(*columns)


def _pg_now() -> Any:
    from sqlalchemy import func

    return func.extract("epoch", func.clock_timestamp())


def _sqlite_now() -> Any:
    from sqlalchemy import literal_column

    return literal_column(_SQLITE_NOW)


def _to_parquet(body: str) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"position": [body]}, schema=_SCHEMA), sink, compression="none")
    return sink.getvalue().to_pybytes()


_TABLE = CatalogTable(POSITION_TABLE, sqlite_ddl=_SQLITE_DDL, pg_table=_build_pg_table)
