"""Reading a table's metadata pointer without reading its metadata: the cheap "did the head move?" question.

A commit loop, ``head_step()``, ``state()`` and a follow-mode reader all ask whether the table changed many times per
second; when it did not, nothing but the pointer should be read.

* SQL catalogs (SQLite, PostgreSQL): one indexed ``SELECT metadata_location FROM iceberg_tables`` on the catalog's own
  SQLAlchemy engine; the new ``metadata.json`` is read through the table's FileIO only when the pointer moved.
* Any other catalog (REST, Glue, Hive): ``Table.refresh()`` (those catalogs answer with the full metadata anyway).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from pyiceberg.catalog import Catalog
from pyiceberg.io import FileIO
from pyiceberg.serializers import FromInputFile
from pyiceberg.table import Table

__all__ = ["pointer_probe", "refresh_if_moved"]

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

    def probe() -> str | None:
        with engine.connect() as conn:
            return conn.execute(stmt).scalar_one_or_none()

    return probe


def refresh_if_moved(table: Table, *, io: FileIO | None = None) -> bool:
    """Bring ``table`` up to date, reading its metadata only when the catalog pointer moved; True when it changed.

    ``io`` reads the new ``metadata.json`` (default: the table's own FileIO).
    A table that no longer exists (dropped, renamed) falls back to ``Table.refresh()``, which raises pyiceberg's error.
    """
    key = id(table)
    cached = _PROBES.get(key)
    if cached is None or cached[0]() is not table:  # pyiceberg tables are not hashable: keyed by id, checked by ref
        cached = (weakref.ref(table, lambda _ref, key=key: _PROBES.pop(key, None)), pointer_probe(table))
        _PROBES[key] = cached
    probe = cached[1]
    before = table.metadata_location
    if probe is None:
        table.refresh()
        return table.metadata_location != before
    location = probe()
    if location is None:
        table.refresh()
        return True
    if location == before:
        return False
    table.metadata = FromInputFile.table_metadata((io or table.io).new_input(location))
    table.metadata_location = location
    return True
