"""Consumer positions do not accumulate: a group silent for ``lakestream.consumers.retention-ms`` expires whole (by GC
and by rank 0's reporter), a group with one recent rank is kept, ``delete_consumer_group`` / ``lakestream lag --delete``
removes a group on demand (refused while a rank is active, unless forced), and ``Stream.drop`` removes its rows.

Each store is real: a SQLite catalog file and PostgreSQL keep rows (made old by writing ``updated_at`` in the past in
the database), an in-memory catalog keeps objects on the local warehouse (made old by their modification time)."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote

import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog

from lakestream_iceberg import Stream
from lakestream_iceberg.connect.positions import POSITION_TABLE, POSITIONS_DIR, PositionStore
from lakestream_iceberg.errors import ConfigError, ConsumerGroupActiveError
from lakestream_iceberg.format.properties import CONSUMERS_RETENTION
from lakestream_iceberg.read import consumer
from lakestream_iceberg.read.position import Position
from tests.backends import fresh_name, postgres_service
from tests.support import SCHEMA, batch, immutable, sqlite_catalog, until

__all__ = ["postgres_service"]  # fixture used by name

WORLD = 2
DAY = 86_400.0
WEEK = 7 * DAY


@dataclass
class Place:
    """A catalog whose positions live in one store, and how to make them old there directly."""

    kind: str
    catalog: Catalog
    age: Callable[[Stream, str, float, int | None], None]  # (stream, group, seconds older, rank or every rank)

    def stream(self, name: str = "ns.ret") -> Stream:
        stream = Stream.create(self.catalog, name, schema=SCHEMA, world_size=WORLD)
        producer = stream.producer("prep-0")
        for seq in range(2):
            producer.commit(batch("prep-0", seq, WORLD), seq=seq)
        return stream


def _sqlite_place(tmp_path: Path) -> Place:
    def age(stream: Stream, group: str, seconds: float, rank: int | None) -> None:
        with sqlite3.connect(tmp_path / "catalog.db") as db:
            db.execute(f"UPDATE {POSITION_TABLE} SET updated_at = updated_at - ? WHERE location = ? AND grp = ?"
                       + ("" if rank is None else " AND rank = ?"),
                       (seconds, stream.table.metadata.location, group, *(() if rank is None else (rank,))))

    return Place("sqlite", sqlite_catalog(str(tmp_path)), age)


def _postgres_place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    pg = request.getfixturevalue("postgres_service")
    database = fresh_name("db")
    pg.create_database(database)
    catalog = SqlCatalog("pg", uri=pg.sqlalchemy_uri(database), warehouse=f"file://{tmp_path}/warehouse")
    request.addfinalizer(catalog.engine.dispose)

    def age(stream: Stream, group: str, seconds: float, rank: int | None) -> None:
        from sqlalchemy import text

        with catalog.engine.begin() as conn:
            conn.execute(text(f"UPDATE {POSITION_TABLE} SET updated_at = updated_at - :s WHERE location = :l AND "
                              "grp = :g" + ("" if rank is None else " AND rank = :r")),
                         {"s": seconds, "l": stream.table.metadata.location, "g": group, "r": rank})

    return Place("postgres", catalog, age)


def _object_place(tmp_path: Path) -> Place:
    catalog = SqlCatalog("mem", uri="sqlite:///:memory:", warehouse=f"file://{tmp_path}/warehouse")

    def age(stream: Stream, group: str, seconds: float, rank: int | None) -> None:
        folder = Path(stream.table.metadata.location.removeprefix("file://")) / "data" / POSITIONS_DIR / quote(group, safe="")
        files = sorted(folder.glob("r*.parquet") if rank is None else [folder / f"r{rank:06d}.parquet"])
        assert files
        for f in files:
            mtime = f.stat().st_mtime - seconds
            os.utime(f, (mtime, mtime))

    return Place("objects", catalog, age)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services), "objects"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "sqlite":
        return _sqlite_place(tmp_path)
    if request.param == "postgres":
        return _postgres_place(request, tmp_path)
    return _object_place(tmp_path)


def store_of(stream: Stream) -> PositionStore:
    return PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)


def record(stream: Stream, group: str, ranks: range = range(WORLD), *, closed: bool = False) -> None:
    """The positions a group's ranks report (as PositionReporter writes them), now."""
    for rank in ranks:
        doc = Position(group=group, rank=rank, stream=str(stream.table.metadata.table_uuid), branch="main",
                       world_size=WORLD, last_step=1, steps=1, started_at=time.time(), elapsed_s=1.0, wait_s=0.1,
                       read_bytes=10, report_s=5.0, closed=closed, host="h", pid=os.getpid(), workers=0,
                       source="iterator")
        store_of(stream).upsert(group=group, rank=rank, body=doc.to_json())


def kept(stream: Stream) -> list[tuple[str, int]]:
    return [(r.group, r.rank) for r in store_of(stream).rows()]


def test_gc_expires_a_silent_group_whole_and_keeps_a_group_with_one_recent_rank(place: Place) -> None:
    stream = place.stream()
    for group in ("old", "mixed", "fresh"):
        record(stream, group)
    place.age(stream, "old", WEEK + DAY, None)  # every rank silent for longer than the default 7 days
    place.age(stream, "mixed", WEEK + DAY, 0)  # one rank silent as long, the other reported just now
    planned = stream.collect_garbage(dry_run=True)
    assert planned.files_deleted.get("consumer-position") == 2 and len(kept(stream)) == 6  # a dry run deletes nothing
    report = stream.collect_garbage(dry_run=False)
    assert report.files_deleted.get("consumer-position") == 2
    assert (report.bytes_deleted["consumer-position"] > 0) == (place.kind == "objects")  # rows count no bytes
    assert kept(stream) == [("fresh", 0), ("fresh", 1), ("mixed", 0), ("mixed", 1)]
    again = stream.collect_garbage(dry_run=False)
    assert "consumer-position" not in again.files_deleted


def test_positions_gc_could_not_expire_are_reported_and_fail_the_gc_command(tmp_path: Path) -> None:
    from lakestream_iceberg.tools.commands import UserError, _fail_on_what_gc_left

    place = _object_place(tmp_path)
    stream = place.stream()
    record(stream, "old")
    place.age(stream, "old", WEEK + DAY, None)
    folder = Path(stream.table.metadata.location.removeprefix("file://")) / "data" / POSITIONS_DIR / "old"
    with immutable(str(folder)):  # its files cannot be deleted
        report = stream.collect_garbage(dry_run=False)
    assert len(report.expiry_failed) == 1 and report.expiry_failed[0].startswith("consumer positions: ")
    assert "consumer-position" not in report.files_deleted and report.files_failed == 0
    with pytest.raises(UserError, match="could not expire consumer positions: .* the next gc retries"):
        _fail_on_what_gc_left(report)
    # a dry run expires nothing: what it could not do is count, and it says so
    with pytest.raises(UserError, match=r"^gc --dry-run could not count what it would expire: consumer positions: "):
        _fail_on_what_gc_left(replace(report, dry_run=True))
    again = stream.collect_garbage(dry_run=False)  # the next GC expires them
    assert again.expiry_failed == [] and again.files_deleted.get("consumer-position") == WORLD
    assert kept(stream) == []


def test_the_retention_is_the_table_property(place: Place) -> None:
    stream = place.stream()
    with stream.table.transaction() as tx:
        tx.set_properties({CONSUMERS_RETENTION.key: "120000"})  # 2 min
    stream.refresh()
    record(stream, "two-min")
    record(stream, "one-min")
    place.age(stream, "two-min", 180, None)
    place.age(stream, "one-min", 60, None)
    assert stream.collect_garbage(dry_run=False).files_deleted.get("consumer-position") == 2
    assert kept(stream) == [("one-min", 0), ("one-min", 1)]
    with pytest.raises(ConfigError, match=CONSUMERS_RETENTION.key):
        CONSUMERS_RETENTION.get({CONSUMERS_RETENTION.key: "1000"})  # below the 1 min minimum


def _reporters_stopped() -> bool:
    return not any(t.name == "lakestream-positions" and t.is_alive() for t in threading.enumerate())


def test_a_host_whose_clock_runs_ahead_expires_no_group_that_reported_recently(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Position objects aged by this host's clock against their modification times (the store's clock): GC (or rank 0's
    reporter) on a host whose clock ran ahead by more than the retention expired the positions of a group whose ranks
    had just reported. Objects now age by the store's clock wherever it is earlier."""
    place = _object_place(tmp_path)
    stream = place.stream()
    record(stream, "recent")
    record(stream, "old")
    place.age(stream, "old", WEEK + DAY, None)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + WEEK + DAY)  # this host's clock: 8 days ahead of the store's
    assert store_of(stream).expire(older_than_s=WEEK)[0] == WORLD  # rank 0's reporter on such a host: the old group
    assert kept(stream) == [("recent", 0), ("recent", 1)]
    record(stream, "old")
    place.age(stream, "old", WEEK + DAY, None)
    report = stream.collect_garbage(dry_run=False)  # GC on such a host
    assert report.files_deleted.get("consumer-position") == WORLD, report  # the old group only
    assert kept(stream) == [("recent", 0), ("recent", 1)]


def test_rank_0_reporter_expires_old_groups_at_most_once_an_hour(place: Place, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    del torch
    from lakestream_iceberg.read.dataset import LakestreamDataset

    def run(rank: int) -> None:
        ds = LakestreamDataset(stream, rank=rank, world_size=WORLD, group="live", report_s=0.05)
        assert [i["step"] for i in ds] == [1, 2]
        until(_reporters_stopped, "the reporter threads to end")

    stream = place.stream()
    record(stream, "old")
    record(stream, "later")
    place.age(stream, "old", WEEK + DAY, None)
    run(1)
    assert ("old", 0) in kept(stream)  # only rank 0 expires: one statement per run, not one per rank
    run(0)
    until(lambda: ("old", 0) not in kept(stream), "rank 0 to expire the old group")
    assert kept(stream) == [("later", 0), ("later", 1), ("live", 0), ("live", 1)]
    place.age(stream, "later", WEEK + DAY, None)
    run(0)
    assert ("later", 0) in kept(stream)  # this process expired this stream less than an hour ago
    monkeypatch.setattr(consumer, "EXPIRY_INTERVAL_S", 0.0)
    run(0)
    until(lambda: ("later", 0) not in kept(stream), "the next expiry once the interval passed")
    assert kept(stream) == [("live", 0), ("live", 1)]


def test_delete_refuses_an_active_group_and_works_with_force(place: Place) -> None:
    stream = place.stream()
    record(stream, "run")
    record(stream, "other")
    with pytest.raises(ConsumerGroupActiveError, match=r"rank\(s\) 0, 1 .*force=True"):
        stream.delete_consumer_group("run")
    assert len(kept(stream)) == 4  # nothing deleted
    assert stream.delete_consumer_group("run", force=True) == 2
    assert kept(stream) == [("other", 0), ("other", 1)]
    assert stream.delete_consumer_group("run") == 0  # nothing left: nothing to refuse


def test_a_stopped_group_is_deleted_without_force(place: Place) -> None:
    stream = place.stream()
    record(stream, "stale")
    record(stream, "closed", closed=True)  # a clean end: no rank is reading, however recent
    place.age(stream, "stale", 60, None)  # silent for 12 report intervals of 5 s: killed, not reading
    assert stream.delete_consumer_group("stale") == 2
    assert stream.delete_consumer_group("closed") == 2
    assert kept(stream) == []
    for bad in ("", True):
        with pytest.raises(ConfigError, match="group"):
            stream.delete_consumer_group(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="force"):
        stream.delete_consumer_group("stale", force="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("place", ["sqlite", pytest.param("postgres", marks=pytest.mark.services)], indirect=True)
def test_drop_removes_the_streams_positions(place: Place) -> None:
    dropped = place.stream("ns.dropped")
    other = place.stream("ns.other")
    record(dropped, "run")
    record(other, "run")
    store = store_of(dropped)
    Stream.drop(place.catalog, "ns.dropped")
    assert store.rows() == [] and kept(other) == [("run", 0), ("run", 1)]
    again = place.stream("ns.dropped")  # a new table at the same location shows no gone ranks of the old one
    assert again.table.metadata.location == store.location and kept(again) == []


def test_lag_delete_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lakestream_iceberg.tools.cli import main
    from lakestream_iceberg.tools.config import embedded_catalog

    stream = Stream.create(embedded_catalog(tmp_path), "ns.lag", schema=SCHEMA, world_size=WORLD)
    record(stream, "run")
    home = ["--home", str(tmp_path)]
    assert main(["lag", "ns.lag", "--group", "run", "--delete", *home]) == 1
    err = capsys.readouterr().err
    assert "still reading" in err and "--force" in err
    assert main(["lag", "ns.lag", "--delete", *home]) == 1 and "--group RUN --delete" in capsys.readouterr().err
    assert main(["lag", "ns.lag", "--group", "run", "--force", *home]) == 1 and "--delete" in capsys.readouterr().err
    assert main(["lag", "ns.lag", "--group", "run", "--delete", "--force", "--json", *home]) == 0
    assert json.loads(capsys.readouterr().out) == {"stream": stream.name, "group": "run", "deleted": 2}
    assert main(["lag", "ns.lag", "--group", "run", "--delete", *home]) == 0
    assert "nothing deleted" in capsys.readouterr().out
