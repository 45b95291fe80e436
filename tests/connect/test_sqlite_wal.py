"""SQLite catalogs are put in write-ahead-log mode when a stream is opened on them (connect/sqlite.py)."""

from __future__ import annotations

import logging
import os
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from lakestream_iceberg import Stream
from lakestream_iceberg.connect.catalog_settings import CATALOG_KEYS
from lakestream_iceberg.connect.sqlite import PROP_SQLITE_WAL, prefer_wal
from lakestream_iceberg.errors import ConfigError
from tests.backends import published
from tests.support import SCHEMA, batch

WORLD = 2


def catalog(tmp_path: Path, **props: str) -> SqlCatalog:
    return SqlCatalog("wal", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/wh", **props)


def journal_mode(tmp_path: Path) -> str:
    with closing(sqlite3.connect(tmp_path / "catalog.db")) as conn:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()


def test_a_stream_puts_its_sqlite_catalog_in_wal_mode_and_commits_land_in_it(tmp_path: Path) -> None:
    cat = catalog(tmp_path)
    assert journal_mode(tmp_path) == "delete"  # what pyiceberg leaves
    stream = Stream.create(cat, "ns.s", schema=SCHEMA, world_size=WORLD)
    assert journal_mode(tmp_path) == "wal"
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, WORLD))
    # another process's view (a fresh catalog and connection) sees every commit: WAL readers read the log
    other = Stream.open(catalog(tmp_path), "ns.s")
    assert other.head_step() == 3 and published(other) == {1: ("p", 0), 2: ("p", 1), 3: ("p", 2)}
    assert prefer_wal(cat) is None  # checked once per engine and process


def test_the_catalog_property_false_leaves_the_database_alone(tmp_path: Path) -> None:
    stream = Stream.create(catalog(tmp_path, **{PROP_SQLITE_WAL: "false"}), "ns.s", schema=SCHEMA, world_size=WORLD)
    stream.producer("p").commit(batch("p", 0, WORLD))
    assert journal_mode(tmp_path) == "delete"


@pytest.mark.parametrize("value", ["yes", "1", ""])
def test_a_malformed_property_is_a_config_error_that_names_it(tmp_path: Path, value: str) -> None:
    Stream.create(catalog(tmp_path, **{PROP_SQLITE_WAL: "false"}), "ns.s", schema=SCHEMA, world_size=WORLD)
    with pytest.raises(ConfigError, match=PROP_SQLITE_WAL):
        Stream.open(catalog(tmp_path, **{PROP_SQLITE_WAL: value}), "ns.s")
    assert journal_mode(tmp_path) == "delete"


def test_a_database_that_cannot_switch_now_keeps_working_and_switches_later(tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    Stream.create(catalog(tmp_path, **{PROP_SQLITE_WAL: "false"}), "ns.s", schema=SCHEMA, world_size=WORLD)
    holder = sqlite3.connect(tmp_path / "catalog.db", timeout=0.1)
    holder.execute("BEGIN IMMEDIATE")  # another writer's open transaction: the mode cannot change under it
    try:
        with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.connect.sqlite"):
            cat = SqlCatalog("wal", uri=f"sqlite:///{tmp_path}/catalog.db?timeout=0.1", warehouse=f"file://{tmp_path}/wh")
            stream = Stream.open(cat, "ns.s")
        assert "WAL mode" in caplog.text and journal_mode(tmp_path) == "delete"
        assert stream.head_step() == 0  # reading works meanwhile
    finally:
        holder.rollback()
        holder.close()
    Stream.open(cat, "ns.s").producer("p").commit(batch("p", 0, WORLD))  # the next open in this process retries
    assert journal_mode(tmp_path) == "wal"


# ------------------------------------------------------------------ the pointer probe reads SQLite on its own connection
def _fork_probe(conn: object, probe: object, engine: object) -> None:
    from lakestream_iceberg.connect.direct import _BY_ENGINE

    try:
        found = probe()  # type: ignore[operator]
        readers = _BY_ENGINE[engine]
        conn.send(("ok", found, readers is not None and readers.local.held.key[0] == os.getpid()))  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001
        conn.send(("error", repr(exc), False))  # type: ignore[attr-defined]


@pytest.mark.parametrize("wal", ["true", "false"])
def test_the_pointer_probe_sees_every_commit_and_a_recreated_database_through_a_new_catalog(tmp_path: Path,
                                                                                          wal: str) -> None:
    """The probe (one query per "did the head move?") runs on a sqlite3 connection kept per catalog engine, thread and
    process: it must see commits of other connections at once (in either journal mode), a forked child must not read
    through its parent's connection, and a catalog opened on a database replaced since must read the new file."""
    import multiprocessing as mp

    from lakestream_iceberg.connect.pointer import pointer_probe

    stream = Stream.create(catalog(tmp_path, **{PROP_SQLITE_WAL: wal}), "ns.s", schema=SCHEMA, world_size=WORLD)
    probe = pointer_probe(stream.table)
    assert probe is not None and probe() == stream.table.metadata_location
    other = Stream.open(catalog(tmp_path, **{PROP_SQLITE_WAL: wal}), "ns.s")  # another engine commits
    writer = other.producer("p")
    writer.commit(batch("p", 0, WORLD))
    moved = writer._loop.table.metadata_location  # noqa: SLF001 - where its commit left the pointer
    assert probe() == moved != stream.table.metadata_location
    parent, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_fork_probe, args=(child, probe, stream.table.catalog.engine))
    proc.start()
    child.close()  # a child that dies closes the pipe: recv raises instead of waiting forever
    try:
        assert parent.recv() == ("ok", moved, True)  # the child read through a connection of its own
    finally:
        proc.join()
    writer.commit(batch("p", 1, WORLD))
    assert probe() == writer._loop.table.metadata_location != moved  # noqa: SLF001  # the parent's connection still answers, after the child used its own
    # the database file replaced under the same path: a catalog opened now reads the new file, not a kept connection
    (tmp_path / "catalog.db").rename(tmp_path / "old.db")
    for leftover in tmp_path.glob("catalog.db-*"):
        leftover.rename(tmp_path / f"old.db{leftover.name.removeprefix('catalog.db')}")
    fresh = Stream.create(catalog(tmp_path, **{PROP_SQLITE_WAL: wal}), "ns.s", schema=SCHEMA, world_size=WORLD,
                          location=f"file://{tmp_path}/wh2")
    fresh_probe = pointer_probe(fresh.table)
    assert fresh_probe is not None and fresh_probe() == fresh.table.metadata_location


def _open_files_of(path: Path) -> int:
    """How many file descriptors of this process are open on ``path``."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve())) if fds.is_dir() else -1


def test_a_thread_that_ends_closes_its_probe_connection(tmp_path: Path) -> None:
    """A process whose threads come and go (a pool replacing its workers, a data loader's threads) keeps one probe
    connection per live thread: 64 threads that each probed the head once left 64 connections (128 descriptors)
    open, and a long-running process ran out of file descriptors."""
    import gc
    import threading

    from lakestream_iceberg.connect.direct import _BY_ENGINE
    from lakestream_iceberg.connect.pointer import pointer_probe

    stream = Stream.create(catalog(tmp_path), "ns.s", schema=SCHEMA, world_size=WORLD)
    probe = pointer_probe(stream.table)  # what head_step(), commit loops and followers ask
    assert probe is not None and probe() == stream.table.metadata_location
    readers = _BY_ENGINE[stream.table.catalog.engine]
    assert readers is not None and readers.open_connections() == 1
    before = _open_files_of(tmp_path / "catalog.db")
    gate, release = threading.Barrier(9, timeout=120), threading.Event()  # a failed assertion must not hang it
    answers: list[str | None] = []

    def ask() -> None:
        answers.append(probe())
        gate.wait()  # eight threads alive together, each holding its own connection ...
        release.wait(120)  # ... until the main thread has counted them

    for _ in range(8):
        threads = [threading.Thread(target=ask, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        gate.wait()
        assert readers.open_connections() == 9
        release.set()
        for t in threads:
            t.join()
        release.clear()
    gc.collect()
    assert answers == [stream.table.metadata_location] * 64
    assert readers.open_connections() == 1  # this thread's
    if before >= 0:  # SQLite keeps a closed connection's descriptor while the process holds locks on the file (WAL
        # mode: the other connections' shared locks) and reuses it for the next connection: bounded by the 8 threads
        # alive at once, not by the 64 that ran
        assert _open_files_of(tmp_path / "catalog.db") <= before + 8
    stream.table.catalog.engine.dispose()  # dispose() closes the rest
    assert readers.open_connections() == 0
    assert probe() == stream.table.metadata_location  # and the next probe opens a new one
    assert readers.open_connections() == 1


def test_a_forked_child_keeps_its_parents_probe_connections_open(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child never closes the copies of its parent's connections (the last reference closes a sqlite3
    connection, which runs SQLite code on state that may have been copied mid-operation): it keeps them, and opens
    its own. Here the child is this process seen under another pid."""
    from lakestream_iceberg.connect import direct, pointer

    stream = Stream.create(catalog(tmp_path), "ns.s", schema=SCHEMA, world_size=WORLD)
    probe = pointer.pointer_probe(stream.table)
    assert probe is not None and probe() == stream.table.metadata_location
    readers = direct._BY_ENGINE[stream.table.catalog.engine]
    parents = readers.local.held
    real = os.getpid()
    monkeypatch.setattr(direct, "_getpid", lambda: real + 1)  # "the child"
    assert probe() == stream.table.metadata_location
    assert readers.local.held is not parents and readers.local.held.key[0] == real + 1
    assert any(kept is parents for kept in direct._INHERITED)
    direct.close_in_owner(parents.conn, real)  # a finalizer of the parent's connection running in the child
    assert parents.conn.execute("SELECT 1").fetchone() == (1,)  # still open: kept, not closed
    monkeypatch.setattr(direct, "_getpid", lambda: real)
    direct._INHERITED[:] = [k for k in direct._INHERITED if k is not parents and k is not parents.conn]


def test_a_database_named_by_a_uri_with_options_or_another_driver_keeps_sqlalchemys_connections(tmp_path: Path) -> None:
    from sqlalchemy import create_engine

    from lakestream_iceberg.connect.direct import direct_connections

    plain = catalog(tmp_path)
    assert direct_connections(plain.engine) is not None
    with_options = SqlCatalog("wal", uri=f"sqlite:///{tmp_path}/catalog.db?timeout=30", warehouse=f"file://{tmp_path}/wh")
    assert direct_connections(with_options.engine) is None
    # SQLCipher's dialect is "sqlite" too, but plain sqlite3 cannot read its encrypted file (sqlite3 stands in for its
    # driver module here: only the URL and the dialect matter)
    assert direct_connections(create_engine(f"sqlite+pysqlcipher://:secret@/{tmp_path}/enc.db", module=sqlite3)) is None


@pytest.mark.parametrize("folder", ["plain", "with space"])
def test_a_database_named_by_a_file_uri_without_options_gets_the_direct_connections(tmp_path: Path, folder: str) -> None:
    """``sqlite:///file:<path>?uri=true`` (how the embedded catalog names a home whose path holds a ? on SQLAlchemy
    2.0) is a plain database file: it kept SQLAlchemy's pooled connections for the pointer probe and staged intents.
    The direct connections open the file the catalog opened and see its commits."""
    from urllib.parse import quote

    from lakestream_iceberg.connect.direct import direct_connections

    (tmp_path / folder).mkdir()
    path = tmp_path / folder / "catalog.db"
    cat = SqlCatalog("wal", uri=f"sqlite:///file:{quote(str(path))}?uri=true", warehouse=f"file://{tmp_path}/wh")
    assert direct_connections(cat.engine) is not None
    stream = Stream.create(cat, "ns.s", schema=SCHEMA, world_size=1)
    stream.producer("p").commit(batch("p", 0, 1), seq=0)
    assert path.is_file() and sorted(p.name for p in tmp_path.iterdir()) == sorted([folder, "wh"])
    assert published(stream) == {1: ("p", 0)} and stream.head_step() == 1
    read_only = SqlCatalog("wal", uri=f"sqlite:///file:{quote(str(path))}?mode=ro&uri=true", warehouse=f"file://{tmp_path}/wh")
    assert direct_connections(read_only.engine) is None  # an option: SQLAlchemy's connections apply it


def test_a_relative_database_path_is_read_where_the_catalog_opened_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLAlchemy makes ``sqlite:///catalog.db`` absolute when the engine is made: a probe from a thread that starts
    after the working directory changed read (and created) another, empty catalog.db there, and every commit then
    waited out its timeout."""
    import threading

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    cat = SqlCatalog("wal", uri="sqlite:///catalog.db", warehouse=f"file://{tmp_path}/wh")
    stream = Stream.create(cat, "ns.s", schema=SCHEMA, world_size=WORLD)
    producer = stream.producer("p")
    assert producer.commit(batch("p", 0, WORLD)).step == 1
    monkeypatch.chdir(tmp_path / "b")
    results: list = []
    thread = threading.Thread(target=lambda: results.append(stream.producer("p").commit(batch("p", 1, WORLD)).step))
    thread.start()
    thread.join(120)
    assert results == [2] and not (tmp_path / "b" / "catalog.db").exists()


def test_closing_the_catalog_closes_the_probe_connections_of_this_process(tmp_path: Path) -> None:
    """pyiceberg's ``catalog.close()`` releases the database files (SQLAlchemy disposes its engine): so do the probe's
    connections, and a probe after that opens a new one."""
    from lakestream_iceberg.connect.pointer import pointer_probe

    def open_files() -> list[str]:
        found = []
        for fd in Path("/proc/self/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(str(tmp_path / "catalog.db")):
                found.append(target)
        return found

    cat = catalog(tmp_path)
    stream = Stream.create(cat, "ns.s", schema=SCHEMA, world_size=WORLD)
    probe = pointer_probe(stream.table)
    assert probe is not None and probe() == stream.table.metadata_location
    assert open_files()
    cat.close()
    assert open_files() == []
    assert probe() == stream.table.metadata_location  # still answers, on a connection opened again


@pytest.mark.parametrize("typo", ["lakestream.sqlite-wal", "lakestream.sqlite.wall", "lakestream.sqlite_wal"])
def test_a_misspelt_lakestream_catalog_property_is_a_config_error_not_ignored(tmp_path: Path, typo: str) -> None:
    """A misspelt ``lakestream.sqlite.wal: "false"`` (the catalog property that leaves the database's journal alone) was
    ignored without a word and the database switched to WAL anyway, a change of the file that persists. Table properties
    refuse an unknown ``lakestream.*`` key (docs/configuration.md); a catalog property does too, naming the right one."""
    with pytest.raises(ConfigError, match=rf"{typo}.*did you mean {PROP_SQLITE_WAL}"):
        Stream.create(catalog(tmp_path, **{typo: "false"}), "ns.s", schema=SCHEMA, world_size=WORLD)
    assert journal_mode(tmp_path) == "delete"


def test_a_table_property_set_on_the_catalog_is_a_config_error_saying_where_it_belongs(tmp_path: Path) -> None:
    """``lakestream.snapshots.retain-last`` in ``.pyiceberg.yaml``'s catalog section configures no stream: said so."""
    assert PROP_SQLITE_WAL in CATALOG_KEYS
    with pytest.raises(ConfigError, match=r"lakestream.snapshots.retain-last is a table property.*Stream.create"):
        Stream.create(catalog(tmp_path, **{"lakestream.snapshots.retain-last": "64"}), "ns.s", schema=SCHEMA, world_size=1)
