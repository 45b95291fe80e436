"""Group commit's staged intents as rows of the SQL catalog's database (``lakestream.commit.group.staging``).

On a SQLite or PostgreSQL ``SqlCatalog`` (``auto``, the default) a staged batch is one row of
``lakestream_staged_intents`` instead of a file under ``data/_staging/``: no PUT, LIST, GET or DELETE per batch. The
checks a committer makes, the queue order and exactly-once are the same code as for files (``tests/test_hardening.py``
section 4 and ``tests/write/test_group_commit.py`` run with both); these tests cover what is particular to rows.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from datetime import timedelta
from pathlib import Path

import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import NoSuchTableError

from lakestream_iceberg import Stream
from lakestream_iceberg.connect.intents import INTENT_TABLE, IntentTable
from lakestream_iceberg.errors import ConfigError, NotAStreamError, ProducerConflictError
from lakestream_iceberg.format.layout import PROP_GROUP_STAGING
from lakestream_iceberg.write.intent import STAGING_DIR
from tests.backends import make_backend, postgres_service, published, seaweedfs_service
from tests.support import SCHEMA, batch, digest, sqlite_catalog

__all__ = ["postgres_service", "seaweedfs_service"]  # fixtures used by name

WORLD = 3


def make(tmp_path: Path, **props: str) -> Stream:
    return Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD, properties=props or None)


def both_active(stream: Stream) -> tuple:
    a, b = stream.producer("a"), stream.producer("b")
    for seq in range(2):
        a.commit(batch("a", seq, WORLD))
        b.commit(batch("b", seq, WORLD))
    return a, b


def stage(stream: Stream, producer: str, seq: int):  # type: ignore[no-untyped-def]
    staged = stream.writer.write(producer=producer, seq=seq, shards=batch(producer, seq, WORLD))
    return stream.staging.stage(branch="main", batch=staged, allow_gap=False)


def rows(tmp_path: Path) -> list[tuple]:
    """The intent table as another client of the catalog database sees it."""
    with sqlite3.connect(tmp_path / "catalog.db") as conn:
        return conn.execute(f"SELECT id, folder, name, body, staged_at FROM {INTENT_TABLE} ORDER BY id").fetchall()


def staging_folder(stream: Stream) -> Path:
    return Path(stream.table.metadata.location.removeprefix("file://")) / "data" / STAGING_DIR


def test_a_staged_batch_is_a_row_of_the_catalog_database_and_its_group_commit_removes_it(tmp_path: Path) -> None:
    stream = make(tmp_path)
    assert stream.staging.kind == "catalog"
    _, b = both_active(stream)
    before = time.time()
    intent = stage(stream, "c", 0)
    (row,) = rows(tmp_path)
    _id, folder, name, body, staged_at = row
    assert f"{folder}/{name}" == intent.path == f"{stream.staging.folder('main')}/c@{0:012d}-{intent.batch.token}.parquet"
    assert json.loads(body)["producer"] == "c" and json.loads(body)["table_uuid"] == str(stream.table.metadata.table_uuid)
    assert before - 5 < staged_at < time.time() + 5  # the database's clock, unix seconds
    assert stream.staging.exists(intent.path) and not staging_folder(stream).exists()  # no file, no folder
    result = b.commit(batch("b", 2, WORLD))
    assert result.step == 6 and published(stream)[5] == ("c", 0)
    assert rows(tmp_path) == [] and not stream.staging.exists(intent.path)
    for rank in range(WORLD):
        assert digest(stream.read(5, rank=rank)) == digest(batch("c", 0, WORLD)[rank])
    assert not staging_folder(stream).exists()  # group commit never touched storage for its intents


def test_rows_keep_the_staging_order_and_a_retried_insert_is_idempotent(tmp_path: Path) -> None:
    stream = make(tmp_path)
    staging = stream.staging
    first, second, third = stage(stream, "z", 0), stage(stream, "y", 4), stage(stream, "x", 1)  # names descending
    max_age_s = 10**10
    assert staging.ahead("main", first.path, max_age_s=max_age_s) == []
    assert staging.ahead("main", third.path, max_age_s=max_age_s) == [("z", 0), ("y", 4)]  # insertion order
    assert staging.queued("main", second.path, max_age_s=max_age_s) == 1
    table = IntentTable.of(stream.table.catalog)
    assert table is not None
    table.insert(first.path, first.to_json())  # a retry whose first try landed: no second row, no error
    assert len(rows(tmp_path)) == 3
    with pytest.raises(ProducerConflictError, match="another intent is already staged"):
        table.insert(first.path, second.to_json())
    staging.remove([first.path])
    assert staging.ahead("main", first.path, max_age_s=max_age_s) is None
    assert staging.ahead("main", third.path, max_age_s=max_age_s) == [("y", 4)]


def test_a_malformed_row_is_reported_once_and_never_published(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stream = make(tmp_path)
    a, b = both_active(stream)
    table = IntentTable.of(stream.table.catalog)
    assert table is not None
    folder = stream.staging.folder("main")
    table.insert(f"{folder}/x@{0:012d}-junk.parquet", "{not json")
    table.insert(f"{folder}/notes.parquet", "{}")  # not a name stage() gives
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.write.staging"):
        a.commit(batch("a", 2, WORLD))
        b.commit(batch("b", 2, WORLD))
    assert caplog.text.count("ignoring unreadable staged intent") == 1 and "junk" in caplog.text
    assert caplog.text.count("notes.parquet") == 1
    assert {p for p, _ in published(stream).values()} == {"a", "b"}
    assert len(rows(tmp_path)) == 2  # left for GC


def test_a_row_older_than_half_the_grace_period_is_never_published_and_gc_removes_it(tmp_path: Path) -> None:
    stream = make(tmp_path)
    _, b = both_active(stream)
    old = stage(stream, "c", 0)
    grace_s = stream.config.gc_grace_ms / 1000
    with sqlite3.connect(tmp_path / "catalog.db") as conn:  # staged long ago, by the database's clock
        conn.execute(f"UPDATE {INTENT_TABLE} SET staged_at = staged_at - ?", (0.6 * grace_s,))
    b.commit(batch("b", 2, WORLD))
    assert "c" not in {p for p, _ in published(stream).values()}
    report = stream.collect_garbage(dry_run=False)  # older than half the grace period, not yet the grace period
    assert "intent" not in report.files_deleted and stream.staging.exists(old.path)
    dry = stream.collect_garbage(dry_run=True, grace=timedelta(0), allow_short_grace=True)
    assert dry.files_deleted.get("intent") == 1 and stream.staging.exists(old.path)  # a dry run removes nothing
    report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.files_deleted.get("intent") == 1 and report.files_deleted.get("data") == WORLD
    assert rows(tmp_path) == [] and not any(Path(f.path.removeprefix("file://")).exists() for f in old.batch.files)


def test_the_staging_property_is_checked_and_catalog_staging_needs_a_catalog_that_can(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=PROP_GROUP_STAGING):
        make(tmp_path, **{PROP_GROUP_STAGING: "memory"})
    stored = make(tmp_path, **{PROP_GROUP_STAGING: "storage"})
    assert stored.staging.kind == "storage"
    stored.producer("a").commit(batch("a", 0, WORLD))
    intent = stage(stored, "c", 0)
    assert [p.name for p in (staging_folder(stored) / "main").iterdir()] == [f"c@{0:012d}-{intent.batch.token}.parquet"]
    with sqlite3.connect(tmp_path / "catalog.db") as conn:
        assert conn.execute(f"SELECT count(*) FROM sqlite_master WHERE name = '{INTENT_TABLE}'").fetchone() == (0,)
    memory = SqlCatalog("mem", uri="sqlite:///:memory:", warehouse=f"file://{tmp_path}/mem")
    auto = Stream.create(memory, "ns.auto", schema=SCHEMA, world_size=WORLD)
    assert auto.staging.kind == "storage"  # an in-memory database has no intent table: files, as everywhere else
    assert auto.table.metadata.properties[PROP_GROUP_STAGING] == "storage"  # resolved once, for every producer
    with pytest.raises(ConfigError, match="cannot keep staged intents"):
        Stream.create(memory, "ns.forced", schema=SCHEMA, world_size=WORLD, properties={PROP_GROUP_STAGING: "catalog"})
    assert not memory.table_exists("ns.forced")  # refused before anything was created


def test_auto_is_resolved_when_the_stream_is_created_and_a_stream_without_the_property_stages_files(
        tmp_path: Path) -> None:
    """``auto`` is stored as what it resolved to, so every producer (whatever catalog object it opens the table with)
    stages in the same place; a stream created by an earlier release has no property and keeps staging files, which
    is what that release's producers read."""
    stream = make(tmp_path)
    assert stream.table.metadata.properties[PROP_GROUP_STAGING] == "catalog"
    assert [r[0] for r in sqlite3.connect(tmp_path / "catalog.db").execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")].count(INTENT_TABLE) == 1  # created with the stream
    with stream.table.transaction() as tx:
        tx.remove_properties(PROP_GROUP_STAGING)
    legacy = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    assert legacy.config.group_staging == "storage" and legacy.staging.kind == "storage"
    with legacy.table.transaction() as tx:  # switched once every producer runs this release
        tx.set_properties({PROP_GROUP_STAGING: "catalog"})
    assert Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream").staging.kind == "catalog"


def test_intent_rows_are_written_without_a_sync_of_their_own_and_the_swap_keeps_full_sync(tmp_path: Path) -> None:
    """SQLite in WAL mode: the connections that write intents use synchronous=NORMAL (an intent lost to a power cut
    belonged to a producer that never returned), pyiceberg's connections that swap the pointer keep FULL."""
    from lakestream_iceberg.connect.direct import sqlite_connections

    stream = make(tmp_path)
    stage(stream, "c", 0)
    readers = sqlite_connections(stream.table.catalog.engine)
    assert readers is not None
    assert readers.connection().execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL
    with stream.table.catalog.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL


def test_a_catalog_whose_database_uri_has_options_stages_through_sqlalchemy_and_sees_the_same_rows(
        tmp_path: Path) -> None:
    """A SQLite URI with options (``?timeout=...``) is served by SQLAlchemy's connections, not lakestream's own: the
    rows are the same table, so producers of either kind group-commit each other's batches."""
    stream = make(tmp_path)
    a, b = both_active(stream)
    other = SqlCatalog("test", uri=f"sqlite:///{tmp_path}/catalog.db?timeout=5", warehouse=f"file://{tmp_path}/warehouse")
    via_options = Stream.open(other, "ns.stream")
    table = IntentTable.of(other)
    assert table is not None and table._sqlite is None  # noqa: SLF001 - the SQLAlchemy path
    staged = via_options.writer.write(producer="c", seq=0, shards=batch("c", 0, WORLD))
    intent = via_options.staging.stage(branch="main", batch=staged, allow_gap=False)
    assert [f"{r[1]}/{r[2]}" for r in rows(tmp_path)] == [intent.path]
    assert via_options.staging.ahead("main", intent.path, max_age_s=10**10) == []
    b.commit(batch("b", 2, WORLD))  # a producer on lakestream's own connections publishes it
    assert published(stream)[5] == ("c", 0) and rows(tmp_path) == []
    assert not via_options.staging.exists(intent.path)
    own = via_options.writer.write(producer="d", seq=0, shards=batch("d", 0, WORLD))
    via_options.staging.stage(branch="main", batch=own, allow_gap=False)
    assert via_options.staging.expire(older_than_s=-1.0, delete=True) == [f"{stream.staging.folder('main')}/d@{0:012d}-{own.token}.parquet"]
    assert rows(tmp_path) == []
    via_options.staging.stage(branch="main", batch=own, allow_gap=False)
    assert Stream.drop(other, "ns.stream") == 1 and rows(tmp_path) == []  # the drop's DELETE on SQLAlchemy's connection


@pytest.mark.services
def test_postgresql_keeps_intents_as_rows_in_staging_order_by_its_own_clock(request: pytest.FixtureRequest,
                                                                           tmp_path: Path) -> None:
    """The same intent table on the real PostgreSQL catalog (SQLAlchemy Core, ages by ``clock_timestamp()``)."""
    backend = make_backend("postgres-seaweedfs", request, tmp_path)
    try:
        stream = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)
        assert stream.table.metadata.properties[PROP_GROUP_STAGING] == "catalog" and stream.staging.kind == "catalog"
        _, b = both_active(stream)
        later, first = stage(stream, "z", 0), stage(stream, "c", 0)  # names descending: the order is the insertion's
        assert stream.staging.ahead("main", first.path, max_age_s=10**10) == [("z", 0)]
        table = IntentTable.of(stream.table.catalog)
        assert table is not None
        table.insert(first.path, first.to_json())  # a retried insert: no second row
        with pytest.raises(ProducerConflictError, match="another intent is already staged"):
            table.insert(first.path, later.to_json())
        assert [r.path for r in table.listing(stream.staging.folder("main"), bodies=False)] == [later.path, first.path]
        assert all(0 <= r.age_s < 600 for r in table.listing(stream.staging.folder("main"), bodies=True))
        b.commit(batch("b", 2, WORLD))  # publishes both, oldest first, then b's own
        assert [published(stream)[s] for s in (5, 6, 7)] == [("z", 0), ("c", 0), ("b", 2)]
        assert table.listing(stream.staging.folder("main"), bodies=False) == []
        for rank in range(WORLD):
            assert digest(stream.read(6, rank=rank)) == digest(batch("c", 0, WORLD)[rank])
        left = stage(stream, "d", 0)
        assert stream.collect_garbage(dry_run=False).files_deleted.get("intent") is None  # within the grace period
        report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
        assert report.files_deleted.get("intent") == 1 and not stream.staging.exists(left.path)
        dropped = [stage(stream, "e", 0).path, stage(stream, "f", 0).path]
        assert Stream.drop(backend.catalog(), backend.identifier()) == 2  # the rows go with the table
        assert not any(table.exists(path) for path in dropped)
        assert table.listing(stream.staging.folder("main"), bodies=False) == []
        with pytest.raises(NoSuchTableError):
            Stream.open(backend.catalog(), backend.identifier())
    finally:
        backend.close()


def test_dropping_a_stream_removes_its_staged_intents_and_leaves_other_streams_alone(tmp_path: Path) -> None:
    """GC expires a stream's intent rows while the stream exists; once its table is dropped nothing would: Stream.drop
    removes them with the catalog entry, and only its own (another stream's location shares the prefix)."""
    catalog = sqlite_catalog(str(tmp_path))
    gone = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    kept = Stream.create(catalog, "ns.stream2", schema=SCHEMA, world_size=WORLD)  # location .../stream2: same prefix
    assert kept.staging.root.startswith(gone.staging.root.removesuffix(f"/data/{STAGING_DIR}"))
    both_active(gone)
    gone.fork(gone.checkpoint("c", step=2), branch="b")
    staged = [stage(gone, "c", 0), stage(gone, "d", 0)]
    on_branch = gone.staging.stage(branch="b", batch=gone.writer.write(producer="e", seq=0, shards=batch("e", 0, WORLD)),
                                   allow_gap=False)
    other = stage(kept, "c", 0)
    assert len(rows(tmp_path)) == 4
    assert Stream.drop(catalog, "ns.stream") == 3  # every branch's
    assert [f"{r[1]}/{r[2]}" for r in rows(tmp_path)] == [other.path]
    assert not any(kept.staging.exists(i.path) for i in (*staged, on_branch))
    with pytest.raises(NoSuchTableError):
        Stream.open(catalog, "ns.stream")
    with pytest.raises(NoSuchTableError):  # a second drop: nothing left to drop, the other stream untouched
        Stream.drop(catalog, "ns.stream")
    assert kept.staging.exists(other.path)
    kept.producer("z").commit(batch("z", 0, WORLD))  # publishes the staged batch with its own
    assert rows(tmp_path) == [] and published(kept)[1] == ("c", 0)


def test_drop_checks_its_arguments_and_refuses_a_plain_table_before_dropping_anything(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    intent = stage(stream, "c", 0)
    for purge in ("yes", 1, None):
        with pytest.raises(ConfigError, match="purge must be True or False"):
            Stream.drop(catalog, "ns.stream", purge=purge)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Stream.drop(catalog, "stream")
    plain = catalog.create_table("ns.plain", schema=stream.table.schema())
    with pytest.raises(NotAStreamError):
        Stream.drop(catalog, "ns.plain")
    assert catalog.load_table("ns.plain").metadata_location == plain.metadata_location
    assert stream.staging.exists(intent.path) and len(rows(tmp_path)) == 1


def test_drop_with_purge_deletes_the_files_the_table_references(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    stream.producer("a").commit(batch("a", 0, WORLD))
    files = [Path(t.file.file_path.removeprefix("file://")) for t in catalog.load_table("ns.stream").scan().plan_files()]
    assert files and all(f.exists() for f in files)
    metadata = Path(catalog.load_table("ns.stream").metadata_location.removeprefix("file://"))
    stage(stream, "c", 0)
    assert Stream.drop(catalog, "ns.stream", purge=True) == 1
    assert not any(f.exists() for f in files) and not metadata.exists()
    assert rows(tmp_path) == []


def test_drop_on_storage_staging_removes_no_rows_and_creates_no_intent_table(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD, properties={PROP_GROUP_STAGING: "storage"})
    assert Stream.drop(catalog, "ns.stream") == 0
    with sqlite3.connect(tmp_path / "catalog.db") as conn:
        assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (INTENT_TABLE,)).fetchone() is None


def test_a_read_only_client_lists_staged_intents_without_writing(tmp_path: Path) -> None:
    """A trainer or ``lakestream status`` may open the catalog database read-only: reading the intent table (the
    staged-batch count) must not try to create it."""
    from lakestream_iceberg.tools.commands import status_dict

    stream = make(tmp_path)
    stage(stream, "c", 0)
    reader = SqlCatalog("test", uri=f"sqlite:///file:{tmp_path}/catalog.db?mode=ro&uri=true",
                        warehouse=f"file://{tmp_path}/warehouse")
    seen = Stream.open(reader, "ns.stream")
    assert seen.staging.kind == "catalog"
    assert status_dict(seen, "main")["staged_batches"] == 1
    with pytest.raises(Exception, match="readonly"):  # the connection really is read-only
        with reader.engine.begin() as conn:
            conn.exec_driver_sql(f"DELETE FROM {INTENT_TABLE}")
    assert len(rows(tmp_path)) == 1


def test_a_batch_that_cannot_be_staged_is_committed_directly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The catalog's database unreachable when a producer stages: staging is an optimisation, so the producer commits
    its batch itself (its commit handles the outage the way every commit does) instead of failing the call."""
    stream = make(tmp_path)
    a, _ = both_active(stream)
    monkeypatch.setattr(type(a), "_stages", lambda self: True)  # as under contention: every commit stages first
    calls: list[str] = []

    def unreachable(self: IntentTable, path: str, body: str) -> None:
        calls.append(path)
        raise sqlite3.OperationalError("unable to open database file (injected)")

    monkeypatch.setattr(IntentTable, "insert", unreachable)
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.write.producer"):
        result = a.commit(batch("a", 2, WORLD))
    assert calls and "committing it directly" in caplog.text and "OperationalError" in caplog.text
    assert (result.step, result.carried, result.duplicate) == (5, False, False)
    assert published(stream)[5] == ("a", 2) and rows(tmp_path) == []

    def refused(self: IntentTable, path: str, body: str) -> None:
        raise ProducerConflictError("injected: not an outage")

    monkeypatch.setattr(IntentTable, "insert", refused)
    with pytest.raises(ProducerConflictError, match="not an outage"):  # anything but an outage is the caller's to see
        a.commit(batch("a", 3, WORLD))
    assert stream.head_step() == 5
