"""The SQL catalog's compare-and-swap from held metadata (connect/swap.py): the same table pyiceberg would write."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table
from pyiceberg.table.update import AssertRefSnapshotId, SetPropertiesUpdate, update_table_metadata
from sqlalchemy import text

from catalog import services
from lakestream_iceberg import CommitError, CommitTimeoutError, Stream
from lakestream_iceberg.connect.swap import _updated, swap, swaps_from_held
from tests.backends import fresh_name, postgres_service
from tests.support import SCHEMA, batch, digest, sqlite_catalog

__all__ = ["postgres_service"]

WORLD = 2


def fresh_view(stream: Stream) -> Table:
    return stream.table.catalog.load_table(stream.table.name())


def test_a_plain_sql_catalog_swaps_from_held_metadata_others_keep_commit_table(tmp_path: Path) -> None:
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    assert swaps_from_held(stream.table)

    class Custom(SqlCatalog):
        pass

    custom = Custom("test", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    assert not swaps_from_held(custom.load_table("ns.stream"))  # a subclass may have its own commit protocol
    wrapped = sqlite_catalog(str(tmp_path))
    calls: list[int] = []
    original = wrapped.commit_table

    def counting(*args: object) -> object:
        calls.append(1)
        return original(*args)  # type: ignore[arg-type]

    wrapped.commit_table = counting  # type: ignore[method-assign]
    table = wrapped.load_table("ns.stream")
    assert not swaps_from_held(table)
    swap(table, (), (SetPropertiesUpdate(updates={"x": "1"}),))
    assert calls == [1]


def test_commits_leave_the_metadata_pyiceberg_reads_back_and_the_rows_a_scan_returns(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    producer = stream.producer("p")
    for seq in range(12):  # past retain-last (8): snapshots are expired by the same swaps
        producer.commit(batch("p", seq, WORLD))
    held = producer._loop.table  # noqa: SLF001 - the producer's own view, built by swap() alone
    loaded = catalog.load_table("ns.stream")
    assert loaded.metadata_location == held.metadata_location
    assert loaded.metadata == held.metadata
    # pyiceberg's file naming and metadata log: one version per commit, the previous locations logged
    version = int(Path(loaded.metadata_location).name.split("-", 1)[0])
    assert version >= 12
    logged = [entry.metadata_file for entry in loaded.metadata.metadata_log]
    assert logged and int(Path(logged[-1]).name.split("-", 1)[0]) == version - 1
    rows = loaded.scan().to_arrow()
    assert rows.num_rows == sum(t.num_rows for seq in range(12) for t in batch("p", seq, WORLD))  # every step's rows
    assert digest(stream.read(12, rank=1)) == digest(batch("p", 11, WORLD)[1])


def test_a_swap_on_stale_metadata_is_lost_and_changes_nothing(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    stale = fresh_view(stream)
    stream.producer("p").commit(batch("p", 0, WORLD))
    before = fresh_view(stream).metadata_location
    with pytest.raises(CommitFailedException):
        swap(stale, (), (SetPropertiesUpdate(updates={"x": "1"}),))
    after = fresh_view(stream)
    assert after.metadata_location == before and "x" not in after.metadata.properties
    with pytest.raises(CommitFailedException):  # a requirement checked against the held metadata
        swap(fresh_view(stream), (AssertRefSnapshotId(ref="main", snapshot_id=1),), (SetPropertiesUpdate(updates={"x": "1"}),))


def test_the_update_is_pyicebergs_update_table_metadata(tmp_path: Path) -> None:
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    stream.producer("p").commit(batch("p", 0, WORLD))
    table = fresh_view(stream)
    updates = (SetPropertiesUpdate(updates={"a": "b"}),)
    ours = _updated(table.metadata, updates, table.metadata_location)
    theirs = update_table_metadata(table.metadata, updates, metadata_location=table.metadata_location)
    drop = {"last_updated_ms"}
    assert ours.model_dump(exclude=drop) == theirs.model_dump(exclude=drop)


def test_pyarrow_schema_round_trip_unchanged_by_swapped_commits(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    stream.producer("p").commit(batch("p", 0, WORLD))
    reopened = Stream.open(catalog, "ns.stream")
    assert reopened.payload_arrow_schema.equals(SCHEMA) and reopened.head_step() == 1
    assert isinstance(reopened.read(1, rank=0), pa.Table)


def test_an_empty_commit_writes_nothing_and_checks_its_requirements_on_the_current_table(tmp_path: Path) -> None:
    """As pyiceberg: no updates, no new metadata.json; but requirements hold only if the held metadata is current."""
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    stream.producer("p").commit(batch("p", 0, WORLD))
    current = fresh_view(stream)
    metadata_dir = Path(current.metadata_location.removeprefix("file://")).parent
    before = sorted(metadata_dir.glob("*.metadata.json"))
    response = swap(current, (), ())
    assert response.metadata_location == current.metadata_location and sorted(metadata_dir.glob("*.metadata.json")) == before
    stale = fresh_view(stream)
    stream.producer("q").commit(batch("q", 0, WORLD))
    with pytest.raises(CommitFailedException):
        swap(stale, (), ())


@pytest.mark.parametrize("codec", ["none", "gzip"])
def test_the_metadata_file_is_byte_for_byte_what_pyiceberg_writes(tmp_path: Path, codec: str) -> None:
    """swap() writes metadata.json itself (pyiceberg's config read once per process, not per commit): the bytes must be
    the ones pyiceberg's ToOutputFile writes, for a plain and a gzip location, and a file that exists is never
    overwritten."""
    from pyiceberg.serializers import FromInputFile, ToOutputFile

    from lakestream_iceberg.connect.swap import _write_metadata

    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD,
                           properties={"write.metadata.compression-codec": codec})
    producer = stream.producer("p")
    producer.commit(batch("p", 0, WORLD))
    metadata = fresh_view(stream).metadata
    suffix = ".gz.metadata.json" if codec == "gzip" else ".metadata.json"
    ours, theirs = tmp_path / f"ours{suffix}", tmp_path / f"theirs{suffix}"
    _write_metadata(metadata, stream.table.io.new_output(f"file://{ours}"))
    ToOutputFile.table_metadata(metadata, stream.table.io.new_output(f"file://{theirs}"))
    assert ours.read_bytes() == theirs.read_bytes()
    assert FromInputFile.table_metadata(stream.table.io.new_input(f"file://{ours}")) == metadata
    with pytest.raises(FileExistsError):
        _write_metadata(metadata, stream.table.io.new_output(f"file://{ours}"))
    assert ours.read_bytes() == theirs.read_bytes()
    # and what a swapped commit wrote is what pyiceberg reads back
    producer.commit(batch("p", 1, WORLD))
    assert catalog.load_table("ns.stream").metadata == producer._loop.table.metadata  # noqa: SLF001


def test_a_catalog_that_refuses_the_update_for_good_fails_the_commit_at_once_naming_why(tmp_path: Path) -> None:
    """A read-only catalog database refuses the swap's UPDATE: nothing landed and no retry changes it, so the commit
    fails with that reason after one attempt (the loop used to re-read and retry it 1000 times, then report
    contention)."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    stream.producer("p").commit(batch("p", 0, WORLD))
    before = fresh_view(stream).metadata_location
    read_only = SqlCatalog("test", uri=f"sqlite:///file:{tmp_path}/catalog.db?mode=ro&uri=true",
                           warehouse=f"file://{tmp_path}/warehouse")
    producer = Stream.open(read_only, "ns.stream").producer("q")
    with pytest.raises(CommitError) as caught:
        producer.commit(batch("q", 0, WORLD))
    assert not isinstance(caught.value, CommitTimeoutError)
    assert "readonly database" in str(caught.value) and "nothing was published" in str(caught.value)
    assert fresh_view(stream).metadata_location == before
    assert stream.producer("q").commit(batch("q", 0, WORLD)).seq == 0  # the same batch, through a writable catalog


@pytest.mark.services
def test_a_postgresql_role_without_update_on_the_catalog_fails_the_commit_at_once_naming_why(
        postgres_service: services.Postgres, tmp_path: Path) -> None:
    """PostgreSQL refuses the swap's UPDATE to a role that may only read the catalog (InsufficientPrivilege): nothing
    landed and no retry changes it, so the commit fails with that reason instead of retrying until its budget."""
    database = fresh_name("db")
    postgres_service.create_database(database)
    owner = SqlCatalog("pg", uri=postgres_service.sqlalchemy_uri(database), warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(owner, "ns.stream", schema=SCHEMA, world_size=WORLD)
    role = fresh_name("reader")
    with owner.engine.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{role}" LOGIN'))
        conn.execute(text(f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{role}"'))
    uri = postgres_service.sqlalchemy_uri(database).replace("://postgres@", f"://{role}@", 1)
    assert role in uri
    reader = SqlCatalog("pg", uri=uri, warehouse=f"file://{tmp_path}/warehouse", init_catalog_tables="false")
    try:
        with pytest.raises(CommitError) as caught:
            Stream.open(reader, "ns.stream").producer("p").commit(batch("p", 0, WORLD))
        assert not isinstance(caught.value, CommitTimeoutError)
        assert "permission denied" in str(caught.value) and "nothing was published" in str(caught.value)
        assert stream.head_step() == 0
    finally:
        reader.engine.dispose()
        owner.engine.dispose()


@pytest.mark.services
def test_a_postgresql_server_refusing_writes_as_a_standby_does_is_transient_and_a_missing_privilege_is_not(
        postgres_service: services.Postgres) -> None:
    """During a failover a pooled connection can reach the old primary, now a standby, which refuses every write with
    'cannot execute UPDATE in a read-only transaction' until the connection is replaced: a commit retries that (as a
    transient failure), where a role without the privilege ('permission denied') fails at once."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DBAPIError

    from lakestream_iceberg.connect.diagnose import transient

    database = fresh_name("db")
    postgres_service.create_database(database)
    engine = create_engine(postgres_service.sqlalchemy_uri(database))
    role = fresh_name("reader")
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE pointer (location text)"))
            conn.execute(text(f'CREATE ROLE "{role}" LOGIN'))
            conn.execute(text(f'GRANT SELECT ON pointer TO "{role}"'))
        with pytest.raises(DBAPIError) as standby, engine.begin() as conn:
            conn.execute(text("SET TRANSACTION READ ONLY"))  # what a standby imposes on every transaction
            conn.execute(text("UPDATE pointer SET location = 'x'"))
        assert "read-only transaction" in str(standby.value) and transient(standby.value)
        with pytest.raises(DBAPIError) as denied, engine.begin() as conn:
            conn.execute(text(f'SET ROLE "{role}"'))
            conn.execute(text("UPDATE pointer SET location = 'x'"))
        assert "permission denied" in str(denied.value) and not transient(denied.value)
    finally:
        engine.dispose()


def test_releasing_and_expiring_thousands_of_tags_is_one_pass_with_pyicebergs_result(tmp_path: Path, monkeypatch) -> None:
    """GC's first commit removes every released tag (one RemoveSnapshotRefUpdate each) and expires snapshots: applied
    with pyiceberg's handlers, each removal copied the refs and scanned the snapshots, and the expiry tested every
    snapshot against the list of ids: 2,000 released tags took a second between reading the head and swapping it
    (4,000: three), so a GC lost every swap to a producer committing meanwhile (5 minutes of retries at 2,000)."""
    from pyiceberg.table.metadata import TableMetadataCommonFields, TableMetadataV2
    from pyiceberg.table.refs import SnapshotRefType
    from pyiceberg.table.update import AddSnapshotUpdate, AssertTableUUID, RemoveSnapshotRefUpdate, RemoveSnapshotsUpdate

    from lakestream_iceberg.format.snapshots import set_ref

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=1)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, 1), seq=seq)
    anchor_id = stream.checkpoint("c", step=2).snapshot_id
    metadata = stream.refresh().table.metadata
    anchor = metadata.snapshot_by_id(anchor_id)
    assert anchor is not None
    tags, next_id, sequence = 300, max(s.snapshot_id for s in metadata.snapshots) + 1, metadata.last_sequence_number
    added: list = []
    for i in range(tags):  # copies of the anchor, each tagged: as many checkpoints
        copy = anchor.model_copy(update={"snapshot_id": next_id + i, "sequence_number": sequence + 1 + i})
        added += [AddSnapshotUpdate(snapshot=copy), set_ref(f"t{i}", SnapshotRefType.TAG, next_id + i)]
    stream.table.catalog.commit_table(stream.table, (AssertTableUUID(uuid=metadata.table_uuid),), tuple(added))
    table = fresh_view(stream)
    main_head = table.metadata.refs["main"].snapshot_id
    parent = table.metadata.snapshot_by_id(main_head).parent_snapshot_id  # expired: the head's parent link is cut
    updates = (*(RemoveSnapshotRefUpdate(ref_name=f"t{i}") for i in range(0, tags, 2)), RemoveSnapshotRefUpdate(ref_name="x"),
               RemoveSnapshotsUpdate(snapshot_ids=[next_id + i for i in range(0, tags, 2)] + [next_id + 1, parent]))
    theirs = update_table_metadata(table.metadata, updates, metadata_location=table.metadata_location)
    copies: list[int] = []
    scans: list[int] = []
    model_copy, by_id = TableMetadataV2.model_copy, TableMetadataCommonFields.snapshot_by_id
    monkeypatch.setattr(TableMetadataV2, "model_copy", lambda self, **k: copies.append(1) or model_copy(self, **k))
    monkeypatch.setattr(TableMetadataCommonFields, "snapshot_by_id", lambda self, i: scans.append(i) or by_id(self, i))
    ours = _updated(table.metadata, updates, table.metadata_location)
    drop = {"last_updated_ms"}
    assert ours.model_dump(exclude=drop) == theirs.model_dump(exclude=drop)
    assert "t1" not in ours.refs and "t3" in ours.refs and "t2" not in ours.refs and len(ours.refs) == tags // 2 + 1
    assert len(copies) <= 6 and not scans, f"{len(copies)} copies of the metadata, {len(scans)} scans for {tags} tags"
    with pytest.raises(ValueError, match="does not exist"):
        _updated(table.metadata, (RemoveSnapshotsUpdate(snapshot_ids=[-5]),), table.metadata_location)
