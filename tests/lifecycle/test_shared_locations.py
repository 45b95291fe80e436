"""Streams and other tables of one catalog whose locations meet: a table renamed keeps its folder, and a table given
another's folder (by pyiceberg, another engine) shares it. A stream's GC deletes every file under its location that
it does not reference, so a stream must neither be created in a live table's folder nor sweep one it shares."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import ConfigError
from tests.backends import Backend, backend_fixture, moto_service, postgres_service, seaweedfs_service  # noqa: F401 - fixtures
from tests.support import SCHEMA, batch

WORLD = 2


backend = backend_fixture("sqlite-local", "postgres-seaweedfs", "sqlite-moto")


def _publish(stream: Stream, producer: str, steps: int) -> None:
    writer = stream.producer(producer)
    for seq in range(steps):
        writer.commit(batch(producer, seq, WORLD), seq=seq)


def test_a_stream_is_not_created_in_the_folder_of_a_table_renamed_away_from_its_name(backend: Backend) -> None:
    """pyiceberg's rename keeps a table's location: ``ns.a`` renamed to ``ns.b`` still lives at ``<warehouse>/ns/a``,
    and a new ``ns.a`` was created at that same default location (a folder holding only data/ and metadata/ was taken
    for a dropped stream's). Each stream's GC then deleted every file of the other, metadata included: ``ns.b`` could
    not even be opened. The catalog's rows tell a live table's folder from a dropped one's: the create is refused."""
    catalog = backend.catalog()
    old, new = backend.identifier("a"), backend.identifier("b")
    first = Stream.create(catalog, old, schema=SCHEMA, world_size=WORLD)
    _publish(first, "p", 2)
    location = first.table.metadata.location
    catalog.rename_table(old, new)
    for where in (None, location):
        with pytest.raises(ConfigError, match=f"holds the files of {new}.*renamed"):
            Stream.create(catalog, old, schema=SCHEMA, world_size=WORLD, location=where)
        assert not catalog.table_exists(old)
    renamed = Stream.open(backend.catalog(), new)
    assert renamed.table.metadata.location == location and renamed.head_step() == 2
    assert renamed.read(2, rank=1).equals(batch("p", 1, WORLD)[1])
    Stream.drop(catalog, new)  # a dropped stream's folder is taken over, as before
    again = Stream.create(catalog, old, schema=SCHEMA, world_size=WORLD)
    assert again.table.metadata.location == location and again.head_step() == 0


def test_gc_deletes_nothing_in_a_folder_another_live_table_shares(backend: Backend,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Another table given the stream's own folder (pyiceberg's create_table, another engine, or a stream created in a
    renamed table's folder before the create refused it): its data and metadata lie beside the stream's, and the
    stream's first GC past the grace period deleted all of them. GC deletes nothing there now and says why."""
    catalog = backend.catalog()
    stream = Stream.create(catalog, backend.identifier("s"), schema=SCHEMA, world_size=WORLD)
    _publish(stream, "p", 2)
    plain = catalog.create_table(backend.identifier("plain"), schema=SCHEMA, location=stream.table.metadata.location)
    rows = batch("x", 0, 1)[0]
    for _ in range(2):
        plain.append(rows)
    files = [task.file.file_path for task in plain.scan().plan_files()]
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.lifecycle.sweep"):
        report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.files_deleted == {} and report.files_failed == 0, report
    assert f"{backend.identifier('plain')} of this catalog" in caplog.text
    assert report.sweep_refused is not None and backend.identifier("plain") in report.sweep_refused
    assert all(plain.io.new_input(path).exists() for path in files)
    assert backend.catalog().load_table(backend.identifier("plain")).scan().to_arrow().num_rows == 2 * rows.num_rows
    assert stream.read(2, rank=0).equals(batch("p", 1, WORLD)[0])


def test_a_stream_is_not_created_in_the_folder_of_another_catalogs_table_of_one_database(backend: Backend) -> None:
    """Two catalog names in one database ("prod" and "dev" of one PostgreSQL) given one warehouse have the same default
    locations: ``ns.s`` of the second was created in the folder of ``ns.s`` of the first, and each one's GC deleted the
    other's files. The database's rows of every catalog name are looked at."""
    first = backend.catalog()
    stream = Stream.create(first, backend.identifier("s"), schema=SCHEMA, world_size=WORLD)
    _publish(stream, "p", 1)
    from pyiceberg.catalog import load_catalog

    second = load_catalog("other", **backend.properties)
    backend.catalogs.append(second)
    with pytest.raises(ConfigError, match=f"holds the files of {backend.identifier('s')} \\(catalog '{backend.name}'\\)"):
        Stream.create(second, backend.identifier("s"), schema=SCHEMA, world_size=WORLD)
    assert not second.table_exists(backend.identifier("s"))
    assert Stream.open(backend.catalog(), backend.identifier("s")).read(1, rank=0).equals(batch("p", 0, WORLD)[0])


@pytest.mark.parametrize("given", [False, True])
def test_a_create_racing_another_process_creating_the_same_stream_opens_it(backend: Backend, given: bool) -> None:
    """Many producers call Stream.create at start: one that finds no table, then meets the table another process made
    right after that look, opens it (the folder it holds is that very table's, not another live table's)."""
    from pyiceberg.exceptions import NoSuchTableError

    other, racing = backend.catalog(), backend.catalog()
    name = backend.identifier("s")
    location = f"{backend.properties['warehouse'].rstrip('/')}/given/{backend.namespace}" if given else None
    made: list[Stream] = []
    look = racing.load_table

    def load_table(identifier):  # type: ignore[no-untyped-def]
        try:
            return look(identifier)
        except NoSuchTableError:
            if not made:  # the other process creates the stream right after this look
                made.append(Stream.create(other, name, schema=SCHEMA, world_size=WORLD, location=location))
            raise

    racing.load_table = load_table  # type: ignore[method-assign]
    stream = Stream.create(racing, name, schema=SCHEMA, world_size=WORLD, location=location)
    assert made and stream.table.metadata.table_uuid == made[0].table.metadata.table_uuid


@pytest.mark.parametrize("inner_at", ["namespace default", "inside the stream"])
def test_gc_deletes_no_file_of_another_table_whose_folder_lies_inside_the_streams(
        backend: Backend, inner_at: str, caplog: pytest.LogCaptureFixture) -> None:
    """Another engine's table made inside a stream's folder (at the catalog's default location of a namespace whose
    folder, empty then, the stream was given as ``location=``; or at a folder given inside the stream's): the stream's
    first GC past the grace period deleted every file of that table, data, manifests and metadata alike, none of which
    the stream references. The sweep leaves another table's folder alone now, and still deletes the stream's own."""
    catalog = backend.catalog()
    warehouse = backend.properties["warehouse"].rstrip("/")
    if inner_at == "namespace default":  # the namespace's folder, empty when given; the plain table then goes inside
        outer = Stream.create(catalog, backend.identifier("outer"), schema=SCHEMA, world_size=WORLD,
                              location=f"{warehouse}/{backend.namespace}")
        plain = catalog.create_table(backend.identifier("plain"), schema=SCHEMA)
    else:
        outer = Stream.create(catalog, backend.identifier("outer"), schema=SCHEMA, world_size=WORLD)
        plain = catalog.create_table(backend.identifier("plain"), schema=SCHEMA,
                                     location=outer.table.metadata.location + "/sub/plain")
    assert plain.metadata.location.startswith(outer.table.metadata.location + "/")
    rows = batch("x", 0, 1)[0]
    for _ in range(3):
        plain.append(rows)
    _publish(outer, "p", 2)
    kept = [task.file.file_path for task in plain.scan().plan_files()]
    kept += [plain.metadata_location, *(entry.metadata_file for entry in plain.metadata.metadata_log)]
    orphan = outer.table.metadata.location + "/data/p/orphan.parquet"
    with outer.io.new_output(orphan).create() as f:
        f.write(b"nobody references this")  # the stream's own unreferenced file: still swept
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.lifecycle.sweep"):
        report = outer.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert [path for path in kept if not plain.io.new_input(path).exists()] == [], report
    assert not outer.io.new_input(orphan).exists() and report.files_deleted.get("data") == 1, report
    assert "another table's folder" in caplog.text
    assert backend.catalog().load_table(backend.identifier("plain")).scan().to_arrow().num_rows == 3 * rows.num_rows
    assert outer.read(2, rank=0).equals(batch("p", 1, WORLD)[0])
