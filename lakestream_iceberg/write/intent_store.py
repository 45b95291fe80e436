"""Where staged intents are kept: files in the table's storage, or rows in a SQL catalog's database.

:class:`~lakestream_iceberg.write.staging.StagingArea` does everything that decides what is published (names, checks,
queue order, ages); a store only keeps intents under their paths (``<location>/data/_staging/<branch>/<name>``):

* :class:`FileIntents` (``storage``): one small Parquet file per intent (:mod:`lakestream_iceberg.write.intent`),
  for any catalog and store;
* :class:`CatalogIntents` (``catalog``): one row per intent in the catalog's database
  (:mod:`lakestream_iceberg.connect.intents`), on SQL catalogs: no PUT, LIST, GET or DELETE per batch.

The table property ``lakestream.commit.group.staging`` chooses (``Stream.create`` resolves ``auto``: the catalog where
it can, storage elsewhere); see docs/concepts.md, "Group commit".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pyiceberg.io import FileIO

from lakestream_iceberg.connect.intents import INTENT_TABLE, IntentTable
from lakestream_iceberg.connect.retry import call_with_retry
from lakestream_iceberg.connect.storage import list_files
from lakestream_iceberg.errors import ConfigError
from lakestream_iceberg.format.layout import PROP_GROUP_STAGING
from lakestream_iceberg.format.properties import STAGING_AUTO, STAGING_CATALOG, STAGING_STORAGE
from lakestream_iceberg.write.intent import PARQUET_MAGIC, Intent

log = logging.getLogger(__name__)

__all__ = ["CatalogIntents", "Entry", "FileIntents", "UnusableIntent", "intent_table", "resolve_staging"]


def resolve_staging(catalog: object, staging: str, *, name: str) -> str:
    """What a new stream stores as ``lakestream.commit.group.staging``: ``auto`` becomes ``catalog`` where the catalog
    has an intent table and lets this user create it (it is created now), else ``storage``.

    Raises:
        ConfigError: ``catalog`` on a catalog without an intent table, or whose database refuses to create it.
    """
    if staging == STAGING_STORAGE:
        return staging
    table = intent_table(catalog, staging, name=name)
    if table is None:
        return STAGING_STORAGE
    if table.create():
        return STAGING_CATALOG
    if staging == STAGING_CATALOG:
        raise ConfigError(
            f"stream {name} has {PROP_GROUP_STAGING}={STAGING_CATALOG!r}, but the catalog's database does not let this "
            f"user create the intent table {INTENT_TABLE}: grant CREATE (once) and INSERT/SELECT/DELETE on it, or set "
            f"{PROP_GROUP_STAGING} to {STAGING_STORAGE!r}"
        )
    log.warning("stream %s stages group-commit intents as files: the catalog's database does not let this user "
                "create %s", name, INTENT_TABLE)
    return STAGING_STORAGE


def intent_table(catalog: object, staging: str, *, name: str) -> IntentTable | None:
    """The catalog's intent table where ``staging`` (``lakestream.commit.group.staging``) puts intents there: always
    for ``catalog``, where the catalog has one for ``auto``, never for ``storage``.

    Raises:
        ConfigError: ``catalog`` staging on a catalog without an intent table (anything but a SQLite-file or
            PostgreSQL ``SqlCatalog``).
    """
    if staging == STAGING_STORAGE:
        return None
    table = IntentTable.of(catalog)
    if table is None and staging == STAGING_CATALOG:
        raise ConfigError(
            f"stream {name} has {PROP_GROUP_STAGING}={STAGING_CATALOG!r}, but its catalog ({type(catalog).__name__}) "
            f"cannot keep staged intents: only a SqlCatalog on a SQLite database file or on PostgreSQL can. Set "
            f"{PROP_GROUP_STAGING} to {STAGING_AUTO!r} or {STAGING_STORAGE!r}"
        )
    return table


@dataclass(frozen=True)
class Entry:
    """A listed intent: its path, its place in the staging order (every producer sees the same order), when the store
    says it was staged (unix seconds, None when unknown) and, where the listing returned it, its document."""

    path: str
    order: tuple[float, str]
    modified: float | None
    body: str | None = None


class UnusableIntent(ValueError):
    """A complete intent that can never be published (foreign or malformed): never read again."""


class FileIntents:
    """Intents as files in the table's storage (``storage`` staging)."""

    kind = "storage"

    def __init__(self, *, io: FileIO, retry_s: float) -> None:
        self._io = io
        self._retry_s = retry_s

    def put(self, intent: Intent) -> None:
        body = intent.to_bytes()

        def write() -> None:
            with self._io.new_output(intent.path).create(overwrite=True) as out:
                out.write(body)

        call_with_retry(write, what=f"staging {intent.path}", timeout_s=self._retry_s)

    def watch(self, path: str) -> Callable[[], bool]:
        try:
            source = self._io.new_input(path)
        except Exception:  # noqa: BLE001 - a path the FileIO cannot resolve now: resolve it at every call
            source = None

        def exists() -> bool:
            try:
                return (source if source is not None else self._io.new_input(path)).exists()
            except Exception:  # storage unreachable: still staged, as far as we know
                return True

        return exists

    def listing(self, folder: str, *, bodies: bool) -> list[Entry]:
        """Every ``.parquet`` file under ``folder`` (a sub-folder's too: the caller rejects what is not an intent
        name), ordered by the store's modification time, then path. Raises when the store cannot be listed."""
        out = [Entry(path=path, order=(mtime or 0.0, path), modified=mtime or None)
               for path, _size, mtime in list_files(self._io, folder, purpose="the staged batches")
               if path.endswith(".parquet")]
        out.sort(key=lambda e: e.order)
        return out

    def load(self, entry: Entry) -> Intent | None:
        """The intent at ``entry``; None when it cannot be read now (deleted since the listing, half-written: a local
        file system has no atomic PUT); :class:`UnusableIntent` when it is complete but not an intent, or half-written
        and unchanged for longer than its writer retries a write (``retry_s``): its writer died while writing it (a
        SIGKILL between creating the file and writing it leaves 0 bytes, or the first 8,192), and nothing ever
        completes it."""
        try:
            with self._io.new_input(entry.path).open() as f:
                raw = f.read()
        except Exception:  # noqa: BLE001 - deleted since the listing (published meanwhile) or unreachable: skip
            return None
        try:
            return Intent.from_bytes(entry.path, raw)
        except Exception as exc:  # noqa: BLE001 - half-written or foreign
            if raw.endswith(PARQUET_MAGIC) and len(raw) > 8:
                raise UnusableIntent(str(exc)) from exc
            if entry.modified is not None and (unchanged := time.time() - entry.modified) > self._retry_s:
                raise UnusableIntent(f"half-written ({len(raw)} bytes) and unchanged for {unchanged:.0f}s: its writer "
                                     "is gone") from exc
            return None

    def delete(self, paths: list[str]) -> None:
        for path in paths:
            try:
                self._io.delete(path)
            except Exception:  # noqa: BLE001 - already deleted by its owner or another committer
                pass

    def expire(self, root: str, *, older_than_s: float, delete: bool) -> list[str]:
        """Nothing: GC's sweep of the table location deletes intent files older than the grace period."""
        return []


STAGE_RETRY_S = 2.0  # how long staging an intent in the catalog retries before the producer commits directly


class CatalogIntents:
    """Intents as rows of the SQL catalog's database (``catalog`` staging)."""

    kind = "catalog"

    def __init__(self, *, table: IntentTable, retry_s: float) -> None:
        self._table = table
        self._retry_s = retry_s

    def put(self, intent: Intent) -> None:
        """Insert the intent; a database that stays unreachable for ``STAGE_RETRY_S`` raises (the producer then commits
        its batch directly: its commit has its own handling of a catalog outage)."""
        body = intent.to_json()
        call_with_retry(lambda: self._table.insert(intent.path, body), what=f"staging {intent.path} in the catalog",
                        timeout_s=min(self._retry_s, STAGE_RETRY_S))

    def watch(self, path: str) -> Callable[[], bool]:
        def exists() -> bool:
            try:
                return self._table.exists(path)
            except Exception:  # noqa: BLE001 - the database unreachable: still staged, as far as we know
                return True

        return exists

    def listing(self, folder: str, *, bodies: bool) -> list[Entry]:
        now = time.time()
        return [Entry(path=row.path, order=(float(row.order), row.path), modified=now - row.age_s, body=row.body)
                for row in self._table.listing(folder, bodies=bodies)]

    def load(self, entry: Entry) -> Intent | None:
        body = entry.body if entry.body is not None else self._table.body(entry.path)
        if body is None:
            return None  # removed since the listing
        try:
            return Intent.from_json(entry.path, body)
        except Exception as exc:  # noqa: BLE001 - a row is complete once listed: never read it again
            raise UnusableIntent(str(exc)) from exc

    def delete(self, paths: list[str]) -> None:
        try:
            self._table.delete(paths)
        except Exception as exc:  # noqa: BLE001 - the database unreachable: GC removes them once old
            log.warning("cannot remove %d staged intents from the catalog (%s); GC removes them once old", len(paths),
                        type(exc).__name__)

    def expire(self, root: str, *, older_than_s: float, delete: bool) -> list[str]:
        return self._table.expire(root, older_than_s=older_than_s, delete=delete)
