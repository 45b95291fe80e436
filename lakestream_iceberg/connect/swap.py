"""The catalog's compare-and-swap, from the metadata the committer already holds.

pyiceberg's ``SqlCatalog.commit_table`` loads the table again (a query, a read and a parse of ``metadata.json``),
applies the updates to that copy, deep-copies the result, writes it and swaps the pointer with a conditional
``UPDATE ... WHERE metadata_location = <the location it loaded>``. A lakestream commit is always planned on metadata it
holds (its requirements name that metadata's branch head), so the reload only re-reads what the committer has. On a
SQL catalog :func:`swap` therefore applies the updates to the held metadata, writes the new ``metadata.json`` and runs
the same conditional ``UPDATE`` with the *held* location: if any other commit landed since that metadata was read, no
row matches and the swap is lost (``CommitFailedException``), exactly as with pyiceberg. The metadata it writes is the
one pyiceberg would write (the same update functions, a run of tag removals and a snapshot expiry applied in one
pass each with the same checks and result; the same metadata log, the same file naming), so pyiceberg,
DuckDB and Java Iceberg read it identically. On PostgreSQL the same transaction notifies followers
(:mod:`.notify`).

Every other catalog (REST, Glue, Hive), a subclass of ``SqlCatalog`` and a catalog whose ``commit_table`` was replaced
on the instance keep ``catalog.commit_table``: their commit protocol (a REST server's own checks, a subclass's
override) is theirs to run.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from pyiceberg.catalog import Catalog, MetastoreCatalog
from pyiceberg.io import OutputFile
from pyiceberg.serializers import Compressor
from pyiceberg.table import CommitTableResponse, Table
from pyiceberg.table.locations import load_location_provider
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH
from pyiceberg.table.update import (
    RemoveSnapshotRefUpdate,
    RemoveSnapshotsUpdate,
    RemoveStatisticsUpdate,
    TableRequirement,
    TableUpdate,
    update_table_metadata,
)

from lakestream_iceberg.connect.diagnose import explain, transient
from lakestream_iceberg.connect.direct import direct_connections
from lakestream_iceberg.connect.fork import no_fork_inside
from lakestream_iceberg.connect.notify import channel, notifies
from lakestream_iceberg.connect.pointer import pointer_probe
from lakestream_iceberg.connect.secrets import redact
from lakestream_iceberg.errors import CommitError

if TYPE_CHECKING:
    from sqlalchemy.sql.dml import Update

__all__ = ["swap", "swaps_from_held"]

try:  # pyiceberg 0.12: the pieces of update_table_metadata, without its final deep copy of the whole metadata
    from pyiceberg.table.update import _apply_table_update, _TableMetadataUpdateContext, _update_table_metadata_log
except ImportError:  # pragma: no cover - another pyiceberg: the public function (same result, plus a deep copy)
    _apply_table_update = None  # type: ignore[assignment]


def swaps_from_held(table: Table) -> bool:
    """Whether :func:`swap` commits ``table`` itself (a plain ``SqlCatalog``) rather than through ``commit_table``."""
    try:
        from pyiceberg.catalog.sql import SqlCatalog
    except ImportError:  # pragma: no cover - the sql extra is a core dependency
        return False
    catalog = table.catalog
    return (type(catalog) is SqlCatalog and "commit_table" not in vars(catalog)
            and bool(catalog.engine.dialect.supports_sane_rowcount))


def swap(table: Table, requirements: tuple[TableRequirement, ...],
         updates: tuple[TableUpdate, ...], *, ready: Callable[[], None] | None = None) -> CommitTableResponse:
    """Commit ``updates`` to ``table`` if its held metadata is still the catalog's current one.

    ``ready``: called before the catalog is asked to change anything, and after the new ``metadata.json`` is written
    where this function writes it (SQL catalogs), so that its write overlaps the writes ``ready`` waits for (the
    commit's manifests and lists on object storage); an exception from it propagates and nothing is committed.

    Raises:
        CommitFailedException: A requirement does not hold, or another commit landed since ``table.metadata`` was read.
        Exception: The catalog or the store failed (outcome unknown when it happened during the ``UPDATE``).
    """
    if not swaps_from_held(table):
        if ready is not None:
            ready()
        from pyiceberg.exceptions import AuthorizationExpiredError, ForbiddenError, UnauthorizedError

        try:
            return table.catalog.commit_table(table, requirements, updates)
        except (ForbiddenError, UnauthorizedError, AuthorizationExpiredError) as exc:
            # a REST catalog refused the commit (403; or 401 / 419 again after pyiceberg refreshed its token and asked
            # once more): it applied nothing, and asking again until the budget is spent only hammers it
            _raise_if_permanent(exc, table, "the catalog's table commit", table.catalog.properties)
            raise
    from pyiceberg.exceptions import CommitFailedException
    from sqlalchemy import text

    base, base_location = table.metadata, table.metadata_location
    for requirement in requirements:
        requirement.validate(base)
    metadata = _updated(base, updates, base_location)
    if metadata is base:  # nothing to change (as pyiceberg: no new metadata), but the requirements held on the current
        if ready is not None:
            ready()
        probe = pointer_probe(table)  # table only if what we hold is still current
        if probe is None or probe() != base_location:
            raise CommitFailedException(f"Table has been updated by another process: {'.'.join(table.name())}")
        return CommitTableResponse(metadata=base, metadata_location=base_location)
    version = MetastoreCatalog._parse_metadata_version(base_location) + 1  # noqa: SLF001 - pyiceberg's own naming
    location = load_location_provider(metadata.location, metadata.properties).new_table_metadata_file_location(version)
    _write_metadata(metadata, table.io.new_output(location))
    if ready is not None:
        ready()  # every file the new metadata names exists before the pointer names it
    catalog = table.catalog
    identifier = table.name()
    params = {"p_catalog": catalog.name, "p_namespace": Catalog.namespace_to_string(identifier[:-1]),
              "p_table": identifier[-1], "p_base": base_location, "p_location": location}
    direct = direct_connections(catalog.engine)  # type: ignore[attr-defined]
    if direct is not None and direct.dialect == "postgresql" and notifies(catalog):
        # One statement in autocommit on the process's direct connection (connect/direct.py): the conditional UPDATE
        # and, for the row it changed, pg_notify, in one transaction and one round trip (SQLAlchemy's transaction
        # took five: BEGIN, UPDATE, the notification, COMMIT and the pool's reset). Never run again on its own after
        # a connection error: whether it landed is then unknown, and the caller reads the head back.
        try:
            swapped = bool(direct.execute(_PG_SWAP, (location, base_location, params["p_catalog"], params["p_namespace"],
                                                     params["p_table"], base_location, channel(catalog.name, identifier),
                                                     location), again=False).fetchall())
        except Exception as exc:
            _raise_if_permanent(exc, table, "updating the catalog's table pointer", catalog.properties)
            raise
        if not swapped:
            raise CommitFailedException(f"Table has been updated by another process: {'.'.join(identifier)}")
        return CommitTableResponse(metadata=metadata, metadata_location=location)
    # One transaction on a Core connection (the statement pyiceberg's commit_table runs, without the ORM session's
    # per-call evaluation of the WHERE clause against loaded objects: we load none). Leaving the block commits it;
    # an exception rolls it back. Inside the fork gate (connect/fork.py), as the process's other database calls: on
    # SQLite a thread in this transaction holds the database file's own mutex in libsqlite3 around its locks, which a
    # child forked meanwhile (a DataLoader's worker) inherited held, and its first query of the catalog waited forever.
    with no_fork_inside(), catalog.engine.begin() as conn:  # type: ignore[attr-defined]
        try:
            swapped = conn.execute(_swap_statement(), params).rowcount >= 1
            if swapped and notifies(catalog):  # delivered when (and only if) this transaction commits: connect/notify.py
                conn.execute(text("SELECT pg_notify(:channel, :location)"),
                             {"channel": channel(catalog.name, identifier), "location": location})
        except Exception as exc:  # a statement failed: the transaction is rolled back, nothing landed
            _raise_if_permanent(exc, table, "updating the catalog's table pointer", catalog.properties)
            raise
        if not swapped:
            raise CommitFailedException(f"Table has been updated by another process: {'.'.join(identifier)}")
    return CommitTableResponse(metadata=metadata, metadata_location=location)


def _remove_refs(metadata: TableMetadata, removals: tuple[RemoveSnapshotRefUpdate, ...],
                 context: _TableMetadataUpdateContext) -> TableMetadata:
    """pyiceberg's handler of each ``RemoveSnapshotRefUpdate`` of ``removals`` in turn (the same checks, result and
    recorded updates), in one pass: it copies the refs and scans the snapshots once per ref, so a GC releasing
    thousands of tags spent seconds between reading the head and swapping it, and lost every swap to busy producers."""
    ids = {s.snapshot_id for s in metadata.snapshots}
    refs = dict(metadata.refs)
    current = metadata.current_snapshot_id
    for update in removals:
        ref = refs.get(update.ref_name)
        if ref is None:
            continue
        if ref.snapshot_id not in ids:
            raise ValueError(f"Cannot remove {update.ref_name} ref with unknown snapshot {ref.snapshot_id}")
        del refs[update.ref_name]
        current = None if update.ref_name == MAIN_BRANCH else current
        context.add_update(update)
    if len(refs) == len(metadata.refs):
        return metadata
    return metadata.model_copy(update={"refs": refs, "current_snapshot_id": current})


def _remove_snapshots(metadata: TableMetadata, update: RemoveSnapshotsUpdate,
                      context: _TableMetadataUpdateContext) -> TableMetadata:
    """pyiceberg's handler of ``RemoveSnapshotsUpdate`` (the same checks, result and recorded updates), with the ids in
    a set: it tests each snapshot against the list of ids, O(snapshots x expired) for a GC expiring thousands."""
    removed = set(update.snapshot_ids)
    known = {s.snapshot_id for s in metadata.snapshots}
    for snapshot_id in update.snapshot_ids:
        if snapshot_id not in known:
            raise ValueError(f"Snapshot with snapshot id {snapshot_id} does not exist")
    snapshots = [s.model_copy(update={"parent_snapshot_id": None}) if s.parent_snapshot_id in removed else s
                 for s in metadata.snapshots if s.snapshot_id not in removed]
    snapshot_log = [e for e in metadata.snapshot_log if e.snapshot_id not in removed]
    statistics = [s.snapshot_id for s in metadata.statistics if s.snapshot_id in removed]
    updated = _remove_refs(metadata, tuple(RemoveSnapshotRefUpdate(ref_name=name) for name, ref in metadata.refs.items()
                                           if ref.snapshot_id in removed), context)
    for snapshot_id in statistics:
        updated = _apply_table_update(RemoveStatisticsUpdate(snapshot_id=snapshot_id), updated, context)
    context.add_update(update)
    return updated.model_copy(update={"snapshots": snapshots, "snapshot_log": snapshot_log})


def _raise_if_permanent(exc: Exception, table: Table, what: str, properties: Mapping[str, Any]) -> None:
    """Raise a lakestream error for a statement of the swap's transaction (or a REST catalog's commit) that failed in a
    way no retry can change (a read-only database, a role without the privilege, a refused principal): nothing landed, and the commit loop would otherwise read the
    head back and try again until its budget ran out. Transient failures return (the caller re-raises them)."""
    if transient(exc):
        return
    error = explain(exc, properties, action=f"committing to {'.'.join(table.name())}: {what}", catalog=table.catalog.name)
    if error is not None:
        raise error from None  # explain() keeps the original (its text unredacted) as error.original, unchained
    detail = redact(" ".join(f"{type(exc).__name__}: {exc}".split()), properties)[:400]
    refused = CommitError(
        f"committing to {'.'.join(table.name())}: {what} failed ({detail}); nothing was published and retrying cannot "
        "change this. Check that this process may write the catalog (a read-only database file or role, missing "
        "privileges), then commit the same batch again (same seq)"
    )
    refused.original = exc  # type: ignore[attr-defined]  # as explain() keeps it: not chained (its text is unredacted)
    raise refused from None


def _write_metadata(metadata: TableMetadata, output_file: OutputFile) -> None:
    """What pyiceberg's ``ToOutputFile.table_metadata`` writes (the same JSON, codec and no-overwrite check), with its
    ``legacy-current-snapshot-id`` setting read once per process instead of loading pyiceberg's config on every commit."""
    with output_file.create(overwrite=False) as output_stream:
        json_bytes = metadata.model_dump_json(exclude_none=not _legacy_current_snapshot_id()).encode("utf-8")
        output_stream.write(Compressor.get_compressor(output_file.location).bytes_compressor()(json_bytes))


@functools.cache
def _legacy_current_snapshot_id() -> bool:
    """pyiceberg's ``legacy-current-snapshot-id`` (``~/.pyiceberg.yaml`` or ``PYICEBERG_LEGACY_CURRENT_SNAPSHOT_ID``),
    read at the first commit of a process: a change made later in the same process is not seen."""
    from pyiceberg.utils.config import Config

    return bool(Config().get_bool("legacy-current-snapshot-id"))


# pyiceberg's conditional update (see _swap_statement) and the notification of the row it changed, in one statement
_PG_SWAP = (
    "WITH swapped AS (UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? "
    "WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? AND metadata_location = ? RETURNING 1) "
    "SELECT pg_notify(?, ?) FROM swapped"
)


@functools.cache
def _swap_statement() -> Update:
    """``UPDATE iceberg_tables SET metadata_location, previous_metadata_location WHERE <the table> AND
    metadata_location = <the held location>``: pyiceberg's own conditional update, built once (bound parameters), so
    SQLAlchemy compiles it once per dialect instead of once per commit."""
    from pyiceberg.catalog.sql import IcebergTables
    from sqlalchemy import Table, bindparam, update

    # declared a FromClause by SQLAlchemy's DeclarativeBase stubs; a declarative class's __table__ is a Table
    table = cast(Table, IcebergTables.__table__)
    columns = table.c
    return (
        update(table)
        .where(
            columns.catalog_name == bindparam("p_catalog"),
            columns.table_namespace == bindparam("p_namespace"),
            columns.table_name == bindparam("p_table"),
            columns.metadata_location == bindparam("p_base"),
        )
        .values(metadata_location=bindparam("p_location"), previous_metadata_location=bindparam("p_base"))
    )


def _updated(base: TableMetadata, updates: tuple[TableUpdate, ...], base_location: str) -> TableMetadata:
    """``update_table_metadata(base, updates, metadata_location=base_location)`` without copying what it shares:
    pyiceberg's metadata models are immutable, so the new metadata may share the held one's snapshots and schemas."""
    if _apply_table_update is None:  # pragma: no cover
        return update_table_metadata(base_metadata=base, updates=updates, metadata_location=base_location)
    context = _TableMetadataUpdateContext()
    metadata = base
    at = 0
    while at < len(updates):
        item = updates[at]
        if isinstance(item, RemoveSnapshotRefUpdate):  # a run of them (GC's release of thousands of tags): one pass
            end = next((i for i in range(at, len(updates)) if not isinstance(updates[i], RemoveSnapshotRefUpdate)),
                       len(updates))
            metadata = _remove_refs(metadata, cast(tuple[RemoveSnapshotRefUpdate, ...], updates[at:end]), context)
            at = end
            continue
        if isinstance(item, RemoveSnapshotsUpdate):
            metadata = _remove_snapshots(metadata, item, context)
        else:
            metadata = _apply_table_update(item, metadata, context)
        at += 1
    if not context.has_changes():
        return base
    metadata = _update_table_metadata_log(metadata, base_location, base.last_updated_ms)
    if base.last_updated_ms == metadata.last_updated_ms:
        # never back (SnapshotBuilder's timestamps neither): Java engines refuse a last-updated-ms more than a minute
        # before the metadata log's last entry, and this host's clock may lag the one that made the last commit
        metadata = metadata.model_copy(update={"last_updated_ms": max(int(time.time() * 1000), base.last_updated_ms)})
    metadata.spec().check_compatible(metadata.schema())
    metadata.sort_order().check_compatible(metadata.schema())
    return metadata
