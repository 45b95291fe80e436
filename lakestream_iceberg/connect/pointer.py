"""Reading a table's metadata pointer without reading its metadata: the cheap "did the head move?" question.

A commit loop, ``head_step()``, ``state()`` and a follow-mode reader all ask whether the table changed many times per
second; when it did not, nothing but the pointer should be read.

* SQL catalogs (SQLite, PostgreSQL): one indexed ``SELECT metadata_location FROM iceberg_tables``, on the direct
  connection to the catalog's database (:mod:`.direct`: the thread's on SQLite, the process's on PostgreSQL) where it
  has one, else on the catalog's own SQLAlchemy engine; the new ``metadata.json`` is read through the table's FileIO
  only when the pointer moved.
* Any other catalog (REST, Glue, Hive): ``Table.refresh()`` (those catalogs answer with the full metadata anyway).

:func:`read_moved` is the lighter read still for a caller that needs a few fields of the new head (a producer whose
batch another producer's commit carried asks only where it was published): the new ``metadata.json`` as plain JSON,
without building pyiceberg's ``TableMetadata`` from it.
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Callable
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import AuthorizationExpiredError, ForbiddenError, NoSuchTableError, UnauthorizedError
from pyiceberg.io import FileIO
from pyiceberg.table import Table

from lakestream_iceberg.connect.diagnose import explain
from lakestream_iceberg.connect.direct import direct_connections
from lakestream_iceberg.connect.fork import fork_safe_io, no_fork_inside
from lakestream_iceberg.connect.metadata_read import MALFORMED, malformed_metadata, read_metadata, unparsable
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
    params = (catalog.name, Catalog.namespace_to_string(identifier[:-1]), identifier[-1])
    engine = catalog.engine
    direct = direct_connections(engine)
    if direct is not None:  # the same query on the autocommit connection of connect/direct.py
        return lambda: direct.read(_PROBE_SQL, params)
    stmt = select(IcebergTables.metadata_location).where(
        IcebergTables.catalog_name == params[0], IcebergTables.table_namespace == params[1],
        IcebergTables.table_name == params[2],
    )

    def probe() -> str | None:
        with no_fork_inside(), engine.connect() as conn:
            return conn.execute(stmt).scalar_one_or_none()

    return probe


# pyiceberg's IcebergTables: (catalog_name, table_namespace, table_name) is the primary key
_PROBE_SQL = ("SELECT metadata_location FROM iceberg_tables "
              "WHERE catalog_name = ? AND table_namespace = ? AND table_name = ?")


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
    :func:`cached_probe`; probed at most every ``every_s``, which may be changed, and at the next look after
    :meth:`due`), and whether it moved since the last look. A failing or missing probe never reports idleness nor a
    move."""

    def __init__(self, probe: Callable[[], str | None] | None, now: float, *, every_s: float) -> None:
        self._probe = probe
        self.every_s = every_s
        self._location: str | None = None
        self._since = now
        self._read = False
        self._probed = -math.inf
        self._moved = False  # moved (or first read) since moved() last answered
        self._moves = 0

    def _look(self, now: float) -> None:
        if self._probe is None or (self._read and now - self._probed < self.every_s):
            return
        self._probed = now
        try:
            location = self._probe()
        except Exception:  # noqa: BLE001 - an unreachable catalog is not an idle one: keep holding
            self._read = False
            return
        if not self._read or location != self._location:
            if self._location is not None and location != self._location:
                self._moves += 1
            self._location, self._since, self._read, self._moved = location, now, True, True

    def due(self) -> None:
        """Probe at the next look, however recent the last probe (a commit notification came)."""
        self._probed = -math.inf

    @property
    def moves(self) -> int:
        """How many moves the probes saw (the first read not counted)."""
        return self._moves

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
    """``Table.refresh()``, which also replaces the table's FileIO with the one the catalog loaded it with: that one's
    file systems are made anew in a forked child too (:func:`~lakestream_iceberg.connect.fork.fork_safe_io`)."""
    try:
        table.refresh()
        fork_safe_io(table.io)
    except MALFORMED as exc:  # the catalog's new metadata file cannot be parsed: no retry reads it
        if not unparsable(exc):  # an HTTP client's JSONDecodeError (a REST token refresh): not a metadata file
            raise
        raise malformed_metadata(f"the current metadata file of table {'.'.join(table.name())}", exc) from exc
    except (ForbiddenError, UnauthorizedError, AuthorizationExpiredError) as exc:
        # a REST catalog refused to load the table (403; or 401 / 419 again after pyiceberg renewed its token and asked
        # once more): no retry changes that, and a caller retrying reads until its budget is spent
        error = explain(exc, table.catalog.properties, action=f"reading table {'.'.join(table.name())}",
                        catalog=table.catalog.name)
        if error is None:
            raise
        raise error from None  # explain() keeps the original (its text unredacted) as error.original, unchained
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
