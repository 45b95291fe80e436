"""lakestream's own tables in a SQL catalog's database (staged intents, consumer positions): each created on first use,
once per process and database, by whichever process gets there first (``IF NOT EXISTS`` on SQLite; on PostgreSQL a
racing ``CREATE`` that lost is recognised and ignored)."""

from __future__ import annotations

import os
import sqlite3
import threading
import weakref
from collections.abc import Callable
from typing import Any

from lakestream_iceberg.connect.fork import no_fork_inside
from lakestream_iceberg.connect.storage import norm

__all__ = ["CatalogTable", "file_sqlite", "shared_engine", "tables_under"]

_SQLITE_HAS = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
_tables: weakref.WeakSet[CatalogTable] = weakref.WeakSet()


def file_sqlite(engine: Any) -> bool:
    """Whether ``engine`` is a SQLite database in a file (which other processes can open), not one in memory."""
    database = engine.url.database or ""
    return (engine.dialect.name == "sqlite" and database not in ("", ":memory:") and "mode=memory" not in database
            and not database.startswith("file::memory:"))


def shared_engine(catalog: Any) -> Any:
    """The engine of ``catalog`` when it is a plain pyiceberg ``SqlCatalog`` (not a subclass) whose database every
    process of the stream shares: PostgreSQL, or a SQLite database file. None for any other catalog (REST, Glue, Hive,
    an in-memory SQLite database, other dialects): lakestream keeps no tables of its own there."""
    try:
        from pyiceberg.catalog.sql import SqlCatalog
    except ImportError:  # pragma: no cover - the sql extra is a core dependency
        return None
    if type(catalog) is not SqlCatalog:
        return None
    engine = catalog.engine
    return engine if engine.dialect.name == "postgresql" or file_sqlite(engine) else None



def tables_under(catalog: Any, location: str) -> list[str] | None:
    """The tables whose current ``metadata.json`` lies under ``location`` (its ``metadata/`` folder or a folder inside
    it), read from the ``iceberg_tables`` rows of ``catalog``'s database: ``namespace.name`` for one of ``catalog``
    itself, ``namespace.name (catalog 'other')`` for one of another catalog name in the same database (two catalogs
    of one database given one warehouse have the same default locations). A table renamed keeps its location, so a
    stream created under the old name at the catalog's default location took the renamed table's folder, and each
    one's GC deleted the other's files. None where this cannot be told (no pyiceberg SQL catalog, its database out of
    reach)."""
    try:
        from pyiceberg.catalog.sql import IcebergTables, SqlCatalog
        from sqlalchemy import select
        from sqlalchemy.orm import Session
    except ImportError:  # pragma: no cover - the sql extra is a core dependency
        return None
    if not isinstance(catalog, SqlCatalog):
        return None
    folder = norm(location) + "/"  # file:/x, file:///x and /x name one folder
    try:
        # inside the fork gate, as lakestream's other statements on a catalog database (connect/fork.py): GC runs in a
        # background thread while a DataLoader forks its workers, whose first query of a SQLite catalog then waited
        # for the database file's mutex the query held at the fork
        with no_fork_inside(), Session(catalog.engine) as session:
            rows = session.execute(select(IcebergTables.catalog_name, IcebergTables.table_namespace,
                                          IcebergTables.table_name, IcebergTables.metadata_location).where(
                IcebergTables.metadata_location.contains(folder, autoescape=True))).all()
    except Exception:  # noqa: BLE001 - the database out of reach, no iceberg_tables yet: cannot be told
        return None
    return sorted(f"{namespace}.{name}" + ("" if owner == catalog.name else f" (catalog {owner!r})")
                  for owner, namespace, name, metadata in rows if metadata and norm(metadata).startswith(folder))

class CatalogTable:
    """One of lakestream's tables: its name, its SQLite DDL and, for PostgreSQL, a function building its SQLAlchemy
    ``Table`` (:attr:`pg`, built on first use: SQLAlchemy is imported only where it is needed); :meth:`ensure` creates
    it in an engine's database the first time this process uses that engine."""

    def __init__(self, name: str, *, sqlite_ddl: str, pg_table: Callable[[], Any]) -> None:
        self.name = name
        self._sqlite_ddl = sqlite_ddl
        self._build_pg = pg_table
        self._pg: Any = None
        self._made: weakref.WeakSet[Any] = weakref.WeakSet()  # engines whose database has the table
        self._lock = threading.Lock()
        _tables.add(self)

    @property
    def pg(self) -> Any:
        """The table as a SQLAlchemy ``Table`` (for PostgreSQL statements), built once per process."""
        if self._pg is None:
            self._pg = self._build_pg()
        return self._pg

    def in_sqlite(self, conn: sqlite3.Connection) -> bool:
        """Whether the SQLite database of ``conn`` has the table (a reader that finds none has nothing to read)."""
        return conn.execute(_SQLITE_HAS, (self.name,)).fetchone() is not None

    def ensure(self, engine: Any, *, sqlite: Callable[[], sqlite3.Connection] | None = None) -> None:
        """Create the table in ``engine``'s database unless this process already saw it there; ``sqlite`` gives this
        thread's plain ``sqlite3`` connection where the caller keeps one (else the engine's own connections)."""
        with self._lock:
            if engine in self._made:
                return
        if sqlite is not None:
            conn = sqlite()
            if not self.in_sqlite(conn):  # a reader never writes
                conn.execute(self._sqlite_ddl)
        elif engine.dialect.name == "sqlite":
            with engine.begin() as conn:
                if conn.exec_driver_sql(_SQLITE_HAS, (self.name,)).first() is None:
                    conn.exec_driver_sql(self._sqlite_ddl)
        else:
            from sqlalchemy.exc import IntegrityError, ProgrammingError

            try:
                self.pg.metadata.create_all(engine, checkfirst=True)
            except (IntegrityError, ProgrammingError):  # another process created it between the check and the CREATE
                from sqlalchemy import inspect

                if not inspect(engine).has_table(self.name):
                    raise
        with self._lock:
            self._made.add(engine)


def _reset_locks_after_fork() -> None:
    for table in list(_tables):
        table._lock = threading.Lock()  # another thread of the parent may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_locks_after_fork)
