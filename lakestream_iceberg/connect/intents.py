"""Staged intents as rows of the catalog's own database: group commit's queue on SQL catalogs (SQLite, PostgreSQL).

With storage staging every carried batch costs the object store a PUT (its intent), a LIST per holding producer per
move of the head, a GET per committer and a DELETE, and a local file system an inode created and freed. On a SQL
catalog the same intents are rows of one table in the catalog's database, next to pyiceberg's ``iceberg_tables``::

    lakestream_staged_intents
        id         integer primary key (never reused): the staging order every producer reads
        folder     the intent's storage folder, <table location>/data/_staging/<branch, URL-quoted>
        name       <producer>@<seq:012d>-<token>.parquet, as in storage; (folder, name) is unique
        body       the intent's JSON document (the same document an intent file carries)
        staged_at  the database's clock when the row was inserted, unix seconds

An intent keeps the path it would have in storage (``folder/name``), so everything above this module (the checks a
committer makes, the queue order, exactly-once) is the same code for both. Staging is one ``INSERT``, holding one
indexed ``SELECT`` per move of the head, a committer's listing one ``SELECT`` that returns the bodies too, removal one
``DELETE``. Ages come from the database's clock (``staged_at`` and "now" in the same query), as a file's age comes from
the store's clock.

Statements run on the database's direct connection (:mod:`lakestream_iceberg.connect.direct`: in autocommit, one per
thread on SQLite and per process on PostgreSQL, a round trip per statement), or through SQLAlchemy where it has none (a
SQLite URI with options, a PostgreSQL driver other than psycopg2). SQLite: in WAL mode with ``synchronous=NORMAL``: an
intent needs no sync of its own. A machine that loses power may lose the rows of its last moments, and with them
nothing that was published (the producers that staged them were on that machine and never returned from ``commit()``;
their restarts commit those seqs again). The pointer swap keeps pyiceberg's connections and SQLite's
``synchronous=FULL``.
A catalog on an in-memory SQLite database has none (its producers share one process: storage staging).
Other dialects have no intent table (storage staging).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from lakestream_iceberg.connect.direct import direct_connections
from lakestream_iceberg.connect.fork import gated
from lakestream_iceberg.connect.sql_tables import CatalogTable, shared_engine
from lakestream_iceberg.errors import ProducerConflictError

__all__ = ["INTENT_TABLE", "IntentRow", "IntentTable"]

INTENT_TABLE = "lakestream_staged_intents"
_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"  # unix seconds, millisecond resolution
_SQLITE_DDL = (
    f"CREATE TABLE IF NOT EXISTS {INTENT_TABLE} (id INTEGER PRIMARY KEY AUTOINCREMENT, folder TEXT NOT NULL, "
    "name TEXT NOT NULL, body TEXT NOT NULL, staged_at REAL NOT NULL, UNIQUE (folder, name))"
)
_PG_NOW = "extract(epoch from clock_timestamp())"  # unix seconds, microsecond resolution
_SQLITE_REMOVE_UNDER = f"DELETE FROM {INTENT_TABLE} WHERE substr(folder, 1, ?) = ?"  # (prefix length, prefix)
_DELETE_CHUNK = 500  # (folder, name) pairs per PostgreSQL DELETE


@dataclass(frozen=True)
class IntentRow:
    """One staged intent as listed: its storage-like path, its place in the staging order, its age by the database's
    clock, and its JSON document (None when listed without bodies)."""

    path: str
    order: int
    age_s: float
    body: str | None


class IntentTable:
    """The staged intents of one SQL catalog's database (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._direct = direct_connections(engine)
        self._sqlite = self._direct if self._direct is not None and self._direct.dialect == "sqlite" else None
        self._now_sql = _SQLITE_NOW if engine.dialect.name == "sqlite" else _PG_NOW
        self._rows: Any = None  # the SQLAlchemy Table (without direct connections: PostgreSQL drivers other than
        # psycopg2, SQLite URIs with options), made in _ensure

    @staticmethod
    def of(catalog: Any) -> IntentTable | None:
        """The intent table of ``catalog``'s database: a plain pyiceberg ``SqlCatalog`` on a SQLite database file or on
        PostgreSQL; None for any other catalog (REST, Glue, Hive, an in-memory SQLite database, other dialects)."""
        engine = shared_engine(catalog)  # statements on its direct connections where it has them (connect/direct.py)
        return None if engine is None else IntentTable(engine)

    # -- statements -----------------------------------------------------------------------------------------------------
    @gated  # a fork waits for it (connect/fork.py): a child inherits no libsqlite3 mutex this thread holds
    def insert(self, path: str, body: str) -> None:
        """Stage ``body`` under ``path`` (``folder/name``). Inserting the same path again with the same body is a no-op
        (a retried insert whose first try landed); another body under the same path raises
        :class:`~lakestream_iceberg.errors.ProducerConflictError`."""
        folder, name = _split(path)
        self._ensure()
        try:
            if self._direct is not None:
                try:
                    self._direct.execute(
                        f"INSERT INTO {INTENT_TABLE} (folder, name, body, staged_at) VALUES (?, ?, ?, {self._now_sql})",
                        (folder, name, body))
                except _unique_violations() as exc:
                    raise sqlite3.IntegrityError(str(exc)) from exc
                return
            from sqlalchemy.exc import IntegrityError

            try:
                with self._engine.begin() as conn:
                    conn.execute(self._rows.insert().values(folder=folder, name=name, body=body, staged_at=self._now()))
            except IntegrityError as exc:
                raise sqlite3.IntegrityError(str(exc)) from exc
        except sqlite3.IntegrityError:
            if self.body(path) != body:
                raise ProducerConflictError(
                    f"another intent is already staged under {path}: two live writers use the same producer id, seq and "
                    "data-file token. Give every live producer its own id"
                ) from None

    @gated
    def body(self, path: str) -> str | None:
        folder, name = _split(path)
        self._ensure()
        if self._direct is not None:
            return self._direct.read(f"SELECT body FROM {INTENT_TABLE} WHERE folder = ? AND name = ?", (folder, name))
        from sqlalchemy import select

        t = self._rows
        with self._engine.connect() as conn:
            return conn.execute(select(t.c.body).where(t.c.folder == folder, t.c.name == name)).scalar_one_or_none()

    @gated
    def exists(self, path: str) -> bool:
        folder, name = _split(path)
        self._ensure()
        if self._direct is not None:
            return self._direct.execute(f"SELECT 1 FROM {INTENT_TABLE} WHERE folder = ? AND name = ?",
                                        (folder, name)).fetchone() is not None
        from sqlalchemy import select

        t = self._rows
        with self._engine.connect() as conn:
            return conn.execute(select(t.c.id).where(t.c.folder == folder, t.c.name == name)).first() is not None

    @gated
    def listing(self, folder: str, *, bodies: bool) -> list[IntentRow]:
        """The intents staged under ``folder``, in staging order (with their bodies when ``bodies``)."""
        self._ensure()
        if self._direct is not None:
            rows = self._direct.execute(
                f"SELECT id, name, {self._now_sql} - staged_at, {'body' if bodies else 'NULL'} FROM {INTENT_TABLE} "
                "WHERE folder = ? ORDER BY id", (folder,)).fetchall()
        else:
            from sqlalchemy import null, select

            t = self._rows
            stmt = select(t.c.id, t.c.name, self._now() - t.c.staged_at, t.c.body if bodies else null()) \
                .where(t.c.folder == folder).order_by(t.c.id)
            with self._engine.connect() as conn:
                rows = conn.execute(stmt).all()
        return [IntentRow(path=f"{folder}/{name}", order=int(i), age_s=max(0.0, float(age)), body=body)
                for i, name, age, body in rows]

    @gated
    def delete(self, paths: list[str]) -> None:
        """Remove intents (one already gone is no error)."""
        if not paths:
            return
        self._ensure()
        keys = [_split(p) for p in paths]
        if self._sqlite is not None:
            conn = self._sqlite_conn()
            if len(keys) == 1:
                conn.execute(f"DELETE FROM {INTENT_TABLE} WHERE folder = ? AND name = ?", keys[0])
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(f"DELETE FROM {INTENT_TABLE} WHERE folder = ? AND name = ?", keys)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # a failed COMMIT (busy, I/O) leaves it open, holding the write lock
                    conn.execute("ROLLBACK")
                raise
            return
        if self._direct is not None and len(keys) <= _DELETE_CHUNK:  # one statement: all of them or none
            pairs = ", ".join(["(?, ?)"] * len(keys))
            self._direct.execute(f"DELETE FROM {INTENT_TABLE} WHERE (folder, name) IN ({pairs})",
                                 [part for key in keys for part in key])
            return
        from sqlalchemy import and_, delete, or_

        t = self._rows
        with self._engine.begin() as conn:
            for i in range(0, len(keys), _DELETE_CHUNK):  # bounded statements, whatever a GC finds
                chunk = keys[i:i + _DELETE_CHUNK]
                conn.execute(delete(t).where(or_(*[and_(t.c.folder == f, t.c.name == n) for f, n in chunk])))

    @gated
    def expire(self, root: str, *, older_than_s: float, delete: bool = True) -> list[str]:
        """Every intent under ``root`` (a table's staging root, any branch) staged more than ``older_than_s`` ago by
        the database's clock, removed unless ``delete`` is false; returns their paths."""
        self._ensure()
        prefix = root.rstrip("/") + "/"
        if self._direct is not None:
            rows = self._direct.execute(
                f"SELECT folder, name FROM {INTENT_TABLE} WHERE substr(folder, 1, ?) = ? AND {self._now_sql} - staged_at > ?",
                (len(prefix), prefix, older_than_s)).fetchall()
        else:
            from sqlalchemy import func, select

            t = self._rows
            with self._engine.connect() as conn:
                rows = conn.execute(select(t.c.folder, t.c.name).where(
                    func.substr(t.c.folder, 1, len(prefix)) == prefix, self._now() - t.c.staged_at > older_than_s)).all()
        paths = [f"{folder}/{name}" for folder, name in rows]
        if delete:
            self.delete(paths)
        return paths

    @gated
    def remove_under(self, root: str) -> int:
        """Remove every intent under ``root`` (a dropped table's staging root, any branch, any age) in one ``DELETE``;
        returns how many rows it removed. A database without the intent table has none: nothing is created."""
        prefix = root.rstrip("/") + "/"
        if self._sqlite is not None:
            conn = self._sqlite_conn()
            if not _TABLE.in_sqlite(conn):
                return 0
            return conn.execute(_SQLITE_REMOVE_UNDER, (len(prefix), prefix)).rowcount  # autocommit: one statement
        from sqlalchemy import delete, func, inspect

        if not inspect(self._engine).has_table(INTENT_TABLE):
            return 0
        if self._engine.dialect.name == "sqlite":  # a database URI with options: SQLAlchemy's own connections
            with self._engine.begin() as conn:
                return conn.exec_driver_sql(_SQLITE_REMOVE_UNDER, (len(prefix), prefix)).rowcount
        t = _TABLE.pg
        with self._engine.begin() as conn:
            return conn.execute(delete(t).where(func.substr(t.c.folder, 1, len(prefix)) == prefix)).rowcount

    @gated
    def create(self) -> bool:
        """Create the table now if it does not exist; False (nothing created) when the database refuses it for lack of
        permission (a read-only database file, a PostgreSQL role without ``CREATE`` on the schema). Other failures
        raise."""
        try:
            self._ensure()
        except Exception as exc:  # noqa: BLE001 - classified below
            if _refused(exc):
                return False
            raise
        return True

    # -- internals ----------------------------------------------------------------------------------------------------
    def _sqlite_conn(self) -> sqlite3.Connection:
        assert self._sqlite is not None
        return self._sqlite.connection()

    def _now(self) -> Any:
        """The database's clock in unix seconds, as an SQL expression."""
        if self._engine.dialect.name == "sqlite":
            from sqlalchemy import literal_column

            return literal_column(_SQLITE_NOW)
        return _pg_now()

    def _ensure(self) -> None:
        """Create the table on first use in this process (``IF NOT EXISTS``: producers racing to create it all
        succeed). SQLite connections of this module sync the write-ahead log only at checkpoints (see the module
        docstring)."""
        if self._sqlite is None and self._rows is None:
            self._rows = _TABLE.pg
        _TABLE.ensure(self._engine, sqlite=self._sqlite_conn if self._sqlite is not None else None)


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` says the database does not let this user create or write the table."""
    text = str(exc).lower()
    return any(k in text for k in ("permission denied", "readonly database", "read-only", "insufficient privilege",
                                   "must be owner", "not authorized"))


def _unique_violations() -> tuple[type[BaseException], ...]:
    """The driver errors of an ``INSERT`` whose key is taken (sqlite3's and, where installed, psycopg2's)."""
    try:
        import psycopg2
    except ImportError:
        return (sqlite3.IntegrityError,)
    return (sqlite3.IntegrityError, psycopg2.IntegrityError)


def _split(path: str) -> tuple[str, str]:
    folder, _, name = path.rpartition("/")
    return folder, name


def _build_pg_table() -> Any:
    """The table as a SQLAlchemy ``Table`` (see ``CatalogTable.pg``)."""
    from sqlalchemy import BigInteger, Column, Float, MetaData, Table, Text, UniqueConstraint

    return Table(
        INTENT_TABLE, MetaData(),
        Column("id", BigInteger, primary_key=True, autoincrement=True),
        Column("folder", Text, nullable=False), Column("name", Text, nullable=False),
        Column("body", Text, nullable=False), Column("staged_at", Float, nullable=False),
        UniqueConstraint("folder", "name"),
    )


def _pg_now() -> Any:
    from sqlalchemy import func

    return func.extract("epoch", func.clock_timestamp())


_TABLE = CatalogTable(INTENT_TABLE, sqlite_ddl=_SQLITE_DDL, pg_table=_build_pg_table)
