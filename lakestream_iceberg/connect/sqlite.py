"""SQLite catalogs in write-ahead-log mode.

pyiceberg's ``SqlCatalog`` leaves an SQLite database in SQLite's default rollback-journal mode: every committed
transaction creates a journal file next to the database, syncs it and the database, and deletes it again, and a reader
holding the database (another producer's pointer probe, a consumer's follow poll) makes the writer wait. In
write-ahead-log mode a commit appends to ``<database>-wal`` and syncs that one file, and readers never block the writer
nor the writer the readers. Each lakestream step is one such transaction, so the journal mode is a large share of a
small step's cost on a local disk.

Durability is unchanged: SQLite keeps ``synchronous=FULL`` (its default), so a transaction the catalog reported
committed survives a crash. The conditional ``UPDATE`` that is the compare-and-swap is atomic in either mode.

:func:`prefer_wal` switches a stream's SQLite catalog database to WAL the first time a process opens a stream on it.
The mode is a property of the database file (it persists, and every connection of every process then uses it). Set
the catalog property ``lakestream.sqlite.wal`` to ``false`` to leave the database as it is, e.g. where the database
is opened read-only or by a tool that expects a rollback journal. In WAL mode a copy of the database alone misses
committed transactions that are still in ``<database>-wal``: back up with ``sqlite3 catalog.db ".backup copy.db"``.
A process that opens a WAL database needs write access to its folder (SQLite's ``-shm`` file), readers included:
where some process may only read the catalog file, set the property to ``false`` everywhere.
Other catalogs (PostgreSQL, REST, ...) are not touched.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from lakestream_iceberg.connect.sql_tables import file_sqlite
from lakestream_iceberg.errors import ConfigError

__all__ = ["PROP_SQLITE_WAL", "prefer_wal"]

log = logging.getLogger(__name__)

PROP_SQLITE_WAL = "lakestream.sqlite.wal"  # a catalog property: "true" (default) or "false"

_lock = threading.Lock()
_done: weakref.WeakSet[Any] = weakref.WeakSet()  # engines whose database this process already checked
_warned: weakref.WeakSet[Any] = weakref.WeakSet()  # engines that could not switch (warned once; retried at each open)


def wal_wanted(properties: dict[str, str]) -> bool:
    """The catalog property ``lakestream.sqlite.wal`` (default true).

    Raises:
        ConfigError: It is set to something other than ``true`` or ``false``.
    """
    raw = properties.get(PROP_SQLITE_WAL, "true")
    if not isinstance(raw, str) or raw.strip().lower() not in ("true", "false"):
        raise ConfigError(f"catalog property {PROP_SQLITE_WAL}={raw!r} must be 'true' or 'false'")
    return raw.strip().lower() == "true"


def prefer_wal(catalog: Any) -> str | None:
    """Put a ``SqlCatalog``'s SQLite database in WAL mode unless ``lakestream.sqlite.wal`` is false; return the
    journal mode found or set (None when the catalog is not a file-backed SQLite catalog, or was checked already).

    Best effort: a database that cannot switch now (another connection holds a transaction, a read-only file) keeps
    its mode, with a warning, and the next stream opened in this process tries again.
    """
    try:
        from pyiceberg.catalog.sql import SqlCatalog
    except ImportError:  # pragma: no cover - the sql extra is a core dependency
        return None
    if not isinstance(catalog, SqlCatalog):
        return None
    engine = catalog.engine
    if not file_sqlite(engine):
        return None
    with _lock:
        if engine in _done:
            return None
    if not wal_wanted(dict(catalog.properties)):
        with _lock:
            _done.add(engine)
        return None
    try:
        with engine.connect() as conn:
            mode = str(conn.exec_driver_sql("PRAGMA journal_mode").scalar()).lower()
            if mode != "wal":
                mode = str(conn.exec_driver_sql("PRAGMA journal_mode=WAL").scalar()).lower()
    except Exception as exc:  # noqa: BLE001 - locked now, read-only: the catalog works as it is
        with _lock:
            warned = engine in _warned
            _warned.add(engine)
        (log.debug if warned else log.warning)(
            "could not put SQLite catalog %s in WAL mode (%s: %s); it keeps its journal mode. Set catalog property "
            "%s=false to stop trying", engine.url.database, type(exc).__name__, exc, PROP_SQLITE_WAL)
        return None
    if mode != "wal":
        log.warning("SQLite catalog %s stays in journal mode %r (WAL refused)", engine.url.database, mode)
    with _lock:
        _done.add(engine)
    return mode
