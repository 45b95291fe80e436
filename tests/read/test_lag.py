"""Consumer positions and ``lakestream lag``: recorded by trainer ranks without a table commit, read back checked; a
killed rank shows as stale, a resumed rank continues, a changed world size leaves the removed ranks gone."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.connect.positions import POSITION_TABLE, PositionStore
from lakestream_iceberg.errors import ConfigError, CorruptStateError
from lakestream_iceberg.read.lag import consumer_lags
from lakestream_iceberg.read.position import Position
from tests.backends import make_backend, postgres_service, seaweedfs_service
from tests.support import SCHEMA, batch, counting_str, sqlite_catalog, until

__all__ = ["postgres_service", "seaweedfs_service"]  # fixtures used by name

torch = pytest.importorskip("torch")

from lakestream_iceberg.read.dataset import LakestreamDataset  # noqa: E402

WORLD = 2
FAST = 0.05  # report_s in tests: the reporter's heartbeat


def publish(stream: Stream, steps: int, producer: str = "prep-0") -> None:
    p = stream.producer(producer)
    start = p.next_seq
    for seq in range(start, start + steps):
        p.commit(batch(producer, seq, stream.world_size), seq=seq)


def lags(stream: Stream, group: str = "run") -> dict[int, object]:
    stream.refresh()
    return {c.rank: c for c in consumer_lags(stream, group=group)}


@pytest.fixture
def stream(tmp_path: Path) -> Stream:
    s = Stream.create(sqlite_catalog(str(tmp_path)), "ns.lag", schema=SCHEMA, world_size=WORLD)
    publish(s, 4)
    return s


def test_a_rank_records_its_position_in_the_catalog_database_without_a_commit(stream: Stream, tmp_path: Path) -> None:
    snapshots = len(stream.refresh().table.metadata.snapshots)
    ds = LakestreamDataset(stream, rank=1, world_size=WORLD, group="run", report_s=FAST)
    assert [item["step"] for item in ds] == [1, 2, 3, 4]
    assert len(stream.refresh().table.metadata.snapshots) == snapshots  # never a commit to the table
    with sqlite3.connect(tmp_path / "catalog.db") as db:
        assert db.execute(f"SELECT grp, rank FROM {POSITION_TABLE}").fetchall() == [("run", 1)]
    row = lags(stream)[1]
    assert (row.status, row.last_step, row.head_step, row.lag_steps, row.lag_s) == ("closed", 4, 4, 0, 0.0)
    assert row.steps == 4 and row.read_bytes > 0 and row.source == "iterator" and row.world_size == WORLD
    assert 0.0 <= row.data_wait_fraction <= 1.0
    publish(stream, 3)  # the rank is behind now: 3 steps, as old as the oldest step it has not read
    row = lags(stream)[1]
    assert (row.lag_steps, row.head_step) == (3, 7) and row.lag_s >= 0.0


def test_a_killed_rank_shows_as_stale(stream: Stream, tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from lakestream_iceberg import Stream
        from lakestream_iceberg.read.dataset import LakestreamDataset
        from tests.support import sqlite_catalog
        stream = Stream.open(sqlite_catalog({str(tmp_path)!r}), "ns.lag")
        ds = LakestreamDataset(stream, rank=0, world_size={WORLD}, follow=True, timeout=120, group="run", report_s={FAST})
        for item in ds:
            print(item["step"], flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        until(lambda: (r := lags(stream).get(0)) is not None and r.last_step == 4 and r.status == "active",
              "the follower's position at the head")
        alive = lags(stream)[0]
        assert alive.lag_steps == 0 and alive.pid == child.pid
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        publish(stream, 2)
        stale = until(lambda: (r := lags(stream)[0]).status == "stale" and r, "the killed rank to show as stale")
        assert (stale.last_step, stale.lag_steps) == (4, 2)  # still lagging: it is a rank of the group's world size
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        child.stdout.close()


def test_a_resumed_rank_continues_from_its_checkpointed_position(stream: Stream) -> None:
    first = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST)
    it = iter(first)
    assert [next(it)["step"] for _ in range(2)] == [1, 2]
    state = first.state_dict()
    it.close()  # the process stops here (no clean end of its steps)
    before = lags(stream)[0]
    assert before.last_step == 2 and before.status != "closed"
    publish(stream, 2)
    resumed = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST)
    resumed.load_state_dict(state)
    assert [item["step"] for item in resumed] == [3, 4, 5, 6]
    after = lags(stream)[0]
    assert (after.last_step, after.lag_steps, after.status, after.steps) == (6, 0, "closed", 4)
    assert after.started_at > before.started_at  # a new incarnation of the same (group, rank) row


def test_a_resumed_rank_at_the_head_does_not_lag_before_its_first_step(stream: Stream) -> None:
    """A rank resumed after step 4 (its earlier incarnation delivered 1..4) and waiting at the head for step 5 is
    caught up: its position is step 4, not "nothing delivered" (a lag of the whole stream)."""
    import threading

    before = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST)
    assert [item["step"] for item in before] == [1, 2, 3, 4]
    state = before.state_dict()
    resumed = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST, follow=True, timeout=120)
    resumed.load_state_dict(state)
    assert resumed.lag() == 0
    it = iter(resumed)
    got: list[int] = []
    waiting = threading.Thread(target=lambda: got.append(next(it)["step"]), daemon=True)
    waiting.start()
    try:
        row = until(lambda: (r := lags(stream)[0]).status == "active" and r, "the resumed rank's first report")
        assert (row.last_step, row.head_step, row.lag_steps, row.lag_s, row.steps) == (4, 4, 0, 0.0, 0)
        assert resumed.lag() == 0
        publish(stream, 1)
        waiting.join(timeout=120)
        assert got == [5]
    finally:
        resumed.close()
        waiting.join(timeout=120)
        it.close()
    from_step = LakestreamDataset(stream, rank=1, world_size=WORLD, group="run", report_s=FAST, start_step=5)
    assert from_step.lag() == 1 and [item["step"] for item in from_step] == [5] and from_step.lag() == 0


def test_a_changed_world_size_shows_the_removed_ranks_as_gone(stream: Stream) -> None:
    for rank in range(4):
        assert [i["step"] for i in LakestreamDataset(stream, rank=rank, world_size=4, group="run", report_s=FAST)]
    assert {r: c.status for r, c in lags(stream).items()} == {0: "closed", 1: "closed", 2: "closed", 3: "closed"}
    publish(stream, 2)
    shrunk = [LakestreamDataset(stream, rank=rank, world_size=2, group="run", report_s=FAST, start_step=5)
              for rank in range(2)]
    for ds in shrunk:
        assert [i["step"] for i in ds] == [5, 6]
    rows = lags(stream)
    assert {r: c.status for r, c in rows.items()} == {0: "closed", 1: "closed", 2: "gone", 3: "gone"}
    assert [rows[r].lag_steps for r in range(4)] == [0, 0, None, None]  # a removed rank is not lagging forever
    assert rows[2].last_step == 4 and rows[2].world_size == 4


def test_positions_outside_a_sql_catalog_are_objects_under_the_table_location(tmp_path: Path) -> None:
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("mem", uri="sqlite:///:memory:", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.lag", schema=SCHEMA, world_size=WORLD)
    publish(stream, 3)
    ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run/a b", report_s=FAST)
    assert [i["step"] for i in ds] == [1, 2, 3]
    store = PositionStore(catalog=catalog, io=stream.io, location=stream.table.metadata.location)
    assert store.kind == "object store"
    objects = list((tmp_path / "warehouse").rglob("r000000.parquet"))
    assert len(objects) == 1 and objects[0].parts[-4:-2] == ("data", "_consumers")
    row = lags(stream, "run/a b")[0]
    assert (row.status, row.last_step, row.lag_steps) == ("closed", 3, 0)
    pq.write_table(pa.table({"position": ['{"v": 1, "rank": true}']}), objects[0])  # read back as input: a damaged
    bad = lags(stream, "run/a b")[0]  # document is shown, not trusted
    assert bad.status == "invalid" and "rank" in bad.error and bad.lag_steps is None
    objects[0].write_bytes(b"not parquet")
    bad = lags(stream, "run/a b")[0]
    assert bad.status == "invalid" and "not a position file" in bad.error
    from datetime import timedelta

    report = stream.collect_garbage(dry_run=True, grace=timedelta(0), allow_short_grace=True)
    assert report.files_deleted.get("consumer-position") is None  # no commit's file: it expires with its group


@pytest.mark.parametrize("group", ["训练" * 50, "run/" * 50], ids=["cjk-100", "slashes-200"])
def test_a_group_name_the_object_store_cannot_hold_is_refused_when_the_dataset_is_made(tmp_path: Path,
                                                                                      group: str) -> None:
    """A group of at most 200 printable characters passed ``check_group``, but outside a SQL catalog its position is
    an object under ``data/_consumers/<URL-quoted group>/``: 100 CJK characters quote to 900 bytes, past a file name's
    255 (and a 200-character one with slashes to 600). Every report failed in the background (a log warning), so the
    rank was never listed, and ``lakestream lag --group`` failed with "cannot list". It must be refused up front."""
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("mem", uri="sqlite:///:memory:", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.lag", schema=SCHEMA, world_size=1)
    publish(stream, 2)
    assert len(group) <= 200 and group.isprintable()
    with pytest.raises(ConfigError, match="group must be"):
        ds = LakestreamDataset(stream, rank=0, world_size=1, group=group, report_s=FAST)
        assert [i["step"] for i in ds] == [1, 2]  # without the check: iterated, but no position was ever recorded
        ds.close()
        rows = consumer_lags(stream.refresh(), group=group)  # without the check: ConfigError "cannot list ..."
        assert [(r.rank, r.status) for r in rows] == [(0, "closed")], "the position was never recorded"
    assert consumer_lags(stream.refresh()) == []
    assert consumer_lags(stream, group=group) == []  # none can be stored under it: no "cannot list" either
    from lakestream_iceberg.read.lag import delete_group

    assert delete_group(stream, group=group) == 0
    ok = "run-" + "训" * 25  # 29 characters, 229 bytes quoted: fits
    assert [i["step"] for i in LakestreamDataset(stream, rank=0, world_size=1, group=ok, report_s=FAST)] == [1, 2]
    assert [(r.group, r.status, r.last_step) for r in consumer_lags(stream.refresh(), group=ok)] == [(ok, "closed", 2)]


def test_path_like_group_names_stay_in_their_own_folder_of_the_object_store(tmp_path: Path) -> None:
    """Groups named ``.`` and ``..`` are folders of their own under ``_consumers``: not the folder itself or ``data/``
    (where the listing read them as another group's, and deleting them deleted every group's positions)."""
    from pyiceberg.catalog.sql import SqlCatalog

    from lakestream_iceberg.read.lag import delete_group

    catalog = SqlCatalog("mem", uri="sqlite:///:memory:", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.lag", schema=SCHEMA, world_size=WORLD)
    publish(stream, 2)
    for rank, group in enumerate(["run", ".", ".."]):
        assert [i["step"] for i in LakestreamDataset(stream, rank=rank, world_size=3, group=group,
                                                     report_s=FAST)] == [1, 2]
    stream.refresh()
    assert [(c.group, c.rank, c.status) for c in consumer_lags(stream)] == [
        (".", 1, "closed"), ("..", 2, "closed"), ("run", 0, "closed")]
    assert [(c.group, c.rank) for c in consumer_lags(stream, group="..")] == [("..", 2)]
    assert delete_group(stream, group="..") == 1
    assert delete_group(stream, group=".") == 1
    assert [(c.group, c.rank) for c in consumer_lags(stream)] == [("run", 0)]
    data = tmp_path / "warehouse" / "ns" / "lag" / "data"
    assert not list(data.glob("r*.parquet")) and not list((data / "_consumers").glob("r*.parquet"))


@pytest.mark.parametrize("body, problem", [
    ("not json", "not JSON"),
    ('{"v": 2}', "newer lakestream release"),
    ("[1]", "version-1"),
    ('{"v": true}', "version-1"),  # True == 1 in Python: not a version-1 document for that
    ('{"v": 1.0}', "version-1"),
])
def test_a_malformed_position_is_refused(body: str, problem: str) -> None:
    with pytest.raises(CorruptStateError, match=problem):
        Position.parse(body, group="g", rank=0)


def test_position_fields_are_checked() -> None:
    good = Position(group="g", rank=1, stream="u", branch="main", world_size=2, last_step=3, steps=3, started_at=1.0,
                    elapsed_s=2.0, wait_s=1.0, read_bytes=10, report_s=5.0, closed=False, host="h", pid=1, workers=0,
                    source="iterator")
    assert Position.parse(good.to_json(), group="g", rank=1) == good
    doc = json.loads(good.to_json())
    for field, value in [("rank", True), ("last_step", -1), ("world_size", 1), ("wait_s", float("nan")),
                         ("closed", "false"), ("source", "x"), ("report_s", 0)]:
        with pytest.raises(CorruptStateError):
            Position.parse(json.dumps({**doc, field: value}).replace("NaN", "1e999"), group="g", rank=1)
    with pytest.raises(CorruptStateError, match="stored under rank 0"):
        Position.parse(good.to_json(), group="g", rank=0)


@pytest.mark.parametrize("field, value", [("started_at", 1e300), ("started_at", -1e12), ("world_size", 2**70),
                                          ("world_size", 2**31), ("last_step", 2**63), ("pid", 2**70),
                                          ("workers", 2**31), ("elapsed_s", 10**400), ("read_bytes", 2**64)],
                         ids=lambda v: str(v)[:24])
def test_a_position_out_of_range_is_invalid_not_a_crash_or_a_misreading(stream: Stream, field: str,
                                                                          value: object) -> None:
    """A stored document whose numbers no listing can hold (a datetime, an int64/int32 column) is shown as invalid:
    neither ``lakestream lag`` nor the consumers view fails, and no other rank of the group is misread because of it."""
    for rank in range(WORLD):
        assert [i["step"] for i in LakestreamDataset(stream, rank=rank, world_size=WORLD, group="run", report_s=FAST)]
    store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)
    body = json.loads(store.rows(group="run")[0].body)
    store.upsert(group="run", rank=0, body=json.dumps({**body, field: value}))
    with pytest.raises(CorruptStateError, match=field):
        Position.parse(json.dumps({**body, field: value}), group="run", rank=0)
    rows = lags(stream)
    assert (rows[0].status, rows[1].status, rows[1].lag_steps) == ("invalid", "closed", 0)  # rank 1 is not "gone"
    from lakestream_iceberg.read.lag import consumers_table

    view = consumers_table(stream)
    assert view.column("status").to_pylist() == ["invalid", "closed"]


def test_a_position_nested_past_the_parsers_stack_is_invalid_not_a_crash(stream: Stream) -> None:
    """A stored document of arrays nested thousands deep (a corrupted or foreign row) made json.loads raise
    RecursionError, which Position.parse let through: ``lakestream lag`` and the consumers view failed for the whole
    stream instead of showing that one rank as invalid (the summary and relay readers catch it)."""
    for rank in range(WORLD):
        assert [i["step"] for i in LakestreamDataset(stream, rank=rank, world_size=WORLD, group="run", report_s=FAST)]
    store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)
    store.upsert(group="run", rank=0, body="[" * 100_000 + "]" * 100_000)
    with pytest.raises(CorruptStateError, match="not JSON"):
        Position.parse("[" * 100_000, group="run", rank=0)
    rows = lags(stream)
    assert (rows[0].status, rows[1].status) == ("invalid", "closed")


@pytest.mark.parametrize("group", ["", "  ", True, 3, "x" * 201, "tab\there"])
def test_a_bad_group_is_a_config_error(stream: Stream, group: object) -> None:
    with pytest.raises(ConfigError, match="group"):
        LakestreamDataset(stream, rank=0, world_size=WORLD, group=group)


def test_report_s_is_checked(stream: Stream) -> None:
    for bad in (True, 0, float("nan"), "5"):
        with pytest.raises(ConfigError, match="report_s"):
            LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=bad)
    # longer than threading can wait: the reporter thread died of OverflowError, and so did the iteration's end
    assert [i["step"] for i in LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=1e10)] == [
        1, 2, 3, 4]
    assert (lags(stream)[0].status, lags(stream)[0].last_step) == ("closed", 4)


def test_with_dataloader_workers_the_training_process_records_what_the_loop_received(stream: Stream) -> None:
    ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert [item["step"] for item in ds.track(loader)] == [1, 2, 3, 4]
    row = lags(stream)[0]
    assert (row.status, row.last_step, row.steps, row.workers, row.source, row.pid) == ("closed", 4, 4, 2, "loader",
                                                                                       os.getpid())
    assert row.read_bytes is None  # the workers read: their bytes are counted in their processes
    with pytest.raises(ConfigError, match="group"):
        LakestreamDataset(stream, rank=0, world_size=WORLD).track(loader)


def test_the_history_has_a_consumers_view(stream: Stream) -> None:
    pytest.importorskip("duckdb")
    assert [i["step"] for i in LakestreamDataset(stream, rank=1, world_size=WORLD, group="run", report_s=FAST)]
    con = stream.history()
    assert con.sql('SELECT "group", rank, status, last_step, lag_steps FROM consumers').fetchall() == [
        ("run", 1, "closed", 4, 0)]


def test_lag_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lakestream_iceberg.tools.cli import main
    from lakestream_iceberg.tools.config import embedded_catalog

    stream = Stream.create(embedded_catalog(tmp_path), "ns.lag", schema=SCHEMA, world_size=WORLD)
    publish(stream, 4)
    for rank in range(WORLD):
        assert [i["step"] for i in LakestreamDataset(stream, rank=rank, world_size=WORLD, group="run", report_s=FAST)]
    publish(stream, 1)
    assert main(["lag", "ns.lag", "--group", "run", "--home", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["groups"] == [{"group": "run", "ranks": {"closed": 2}, "world_size": WORLD, "unreported": 0,
                                 "max_lag_steps": 1}]
    assert [(p["rank"], p["status"], p["last_step"], p["lag_steps"], p["head_step"]) for p in report["positions"]] == [
        (0, "closed", 4, 1, 5), (1, "closed", 4, 1, 5)]
    assert main(["lag", "ns.lag", "--home", str(tmp_path)]) == 0  # every group, as a table for people
    human = capsys.readouterr().out
    assert "group run" in human and "closed" in human
    assert main(["lag", "ns.lag", "--group", "other", "--home", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["positions"] == []
    # a rank of a world size of 3 that never made its dataset (hung, or never started) shows in no row: it is counted
    for rank in (0, 2):
        assert [i["step"] for i in LakestreamDataset(stream, rank=rank, world_size=3, group="wide", report_s=FAST)]
    assert main(["lag", "ns.lag", "--group", "wide", "--home", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"][0]["unreported"] == 1
    assert main(["lag", "ns.lag", "--group", "wide", "--home", str(tmp_path)]) == 0
    assert "2 closed, 1 never reported" in capsys.readouterr().out
    # lakestream status lists the groups of its branch with their largest lag
    assert main(["status", "ns.lag", "--home", str(tmp_path), "--json"]) == 0
    groups = {g["group"]: g for g in json.loads(capsys.readouterr().out)["consumer_groups"]}
    assert (groups["run"]["max_lag_steps"], groups["wide"]["unreported"]) == (1, 1)
    assert main(["status", "ns.lag", "--home", str(tmp_path)]) == 0
    assert "consumer groups" in capsys.readouterr().out


def test_lag_of_more_ranks_than_the_table_shows_lists_those_needing_a_look_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 ranks: the table shows MAX_HUMAN_ROWS of them. By rank it showed ranks 0-49, while the group's line said
    "max lag N steps" of a rank it did not show; the stale ranks, then the most behind, come first now."""
    from lakestream_iceberg.tools.cli import main
    from lakestream_iceberg.tools.config import embedded_catalog
    from lakestream_iceberg.tools.output import MAX_HUMAN_ROWS

    stream = Stream.create(embedded_catalog(tmp_path), "ns.lag", schema=SCHEMA, world_size=WORLD)
    publish(stream, 40)
    ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST, end_step=1)
    list(ds)
    ds.close()
    store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)
    doc = json.loads(store.rows(group="run")[0].body)
    world = MAX_HUMAN_ROWS + 20
    for rank in range(world):  # each one step behind, rank world-2 thirty behind, rank world-1 silent for a day
        last, stale = (10, False) if rank == world - 2 else (39, rank == world - 1)
        body = {**doc, "rank": rank, "world_size": world, "last_step": last, "closed": False,
                "report_s": 86_400.0 if not stale else FAST}
        store.upsert(group="run", rank=rank, body=json.dumps(body))
    time.sleep(4 * FAST)  # the silent rank's age is past 3 of its report intervals
    monkeypatch.setenv("COLUMNS", "160")  # a row on one line
    assert main(["lag", "ns.lag", "--group", "run", "--home", str(tmp_path)]) == 0
    human = capsys.readouterr().out
    ranks = [int(m) for m in re.findall(r"^\S\s+(\d+)\s+\S\s+(?:active|stale)", human, re.MULTILINE)]
    assert ranks[:2] == [world - 1, world - 2] and len(ranks) == MAX_HUMAN_ROWS, ranks
    assert f"{world:,} ranks" in human and "max lag 30 steps" in human


@pytest.mark.timeout(60)  # a hang guard: the count walked every rank of the world size (minutes at 2**31 - 1)
def test_the_unreported_ranks_of_the_largest_world_size_are_counted_not_walked(stream: Stream) -> None:
    """``lakestream lag`` and ``lakestream status`` counted a group's unreported ranks by walking ``range(world_size)``:
    one rank of a dataset made with ``world_size=2**31 - 1`` (which a dataset accepts, and whose position reads back
    valid) kept both commands busy for minutes (8 s at 10**8). Only the recorded ranks need walking."""
    from lakestream_iceberg.connect.integers import INT32_MAX
    from lakestream_iceberg.tools.commands import status_dict
    from lakestream_iceberg.tools.lag import lag_report

    for rank in (0, INT32_MAX - 1):
        ds = LakestreamDataset(stream, rank=rank, world_size=INT32_MAX, group="huge", report_s=FAST, end_step=1)
        list(ds)
        ds.close()
    groups = lag_report(stream, group=None, stale_after=3.0)["groups"]
    assert groups == [{"group": "huge", "ranks": {"closed": 2}, "world_size": INT32_MAX, "unreported": INT32_MAX - 2,
                       "max_lag_steps": 3}]
    assert [g["unreported"] for g in status_dict(stream, "main")["consumer_groups"]] == [INT32_MAX - 2]


def test_the_lag_report_of_many_groups_goes_over_the_positions_once(stream: Stream,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``lag_report`` gathered each group's ranks with a pass over every position of every group: O(groups x
    positions) for ``lakestream lag`` and every ``lakestream status`` of a stream whose runs each recorded a group
    (kept for the 7-day retention): 1,000 groups of 20 ranks added 0.6 s, of 200 ranks a minute."""
    from dataclasses import replace

    import lakestream_iceberg.read.lag as lag_module
    from lakestream_iceberg.tools.lag import lag_report

    ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="g0", report_s=FAST)
    list(ds)
    ds.close()
    store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)
    doc = json.loads(store.rows(group="g0")[0].body)
    groups = 40
    for g in range(groups):
        for rank in range(WORLD):
            store.upsert(group=f"g{g}", rank=rank, body=json.dumps({**doc, "rank": rank}))
    compared: list[str] = []

    Name = counting_str(compared)  # a group name that counts the comparisons made with it

    real = lag_module.consumer_lags
    monkeypatch.setattr(lag_module, "consumer_lags",
                        lambda *a, **k: [replace(row, group=Name(row.group)) for row in real(*a, **k)])
    report = lag_report(stream, group=None, stale_after=3.0)
    assert [(g["group"], g["ranks"], g["unreported"]) for g in report["groups"]] == sorted(
        (f"g{g}", {"closed": WORLD}, 0) for g in range(groups))
    positions = groups * WORLD
    assert len(report["positions"]) == positions
    assert len(compared) <= 2 * positions, f"{len(compared)} comparisons of group names for {positions} positions"


@pytest.mark.services
@pytest.mark.parametrize("kind, kept", [("postgres-seaweedfs", "catalog database"), ("rest-seaweedfs", "object store")])
def test_positions_on_the_real_services(kind: str, kept: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """PostgreSQL keeps the rows (an upsert, ages by its own clock); a REST catalog keeps objects on S3 (SeaweedFS)."""
    backend = make_backend(kind, request, tmp_path)
    try:
        stream = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)
        publish(stream, 2)
        for _ in range(2):  # the second run upserts the same two rows
            for rank in range(WORLD):
                assert [i["step"] for i in LakestreamDataset(stream, rank=rank, world_size=WORLD, group="run",
                                                             report_s=FAST)] == [1, 2]
        store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)
        assert store.kind == kept and [(r.group, r.rank) for r in store.rows()] == [("run", 0), ("run", 1)]
        assert all(0 <= r.age_s < 600 for r in store.rows(group="run"))
        publish(stream, 1)
        rows = lags(stream)
        assert [(rows[r].status, rows[r].last_step, rows[r].lag_steps) for r in range(WORLD)] == [("closed", 2, 1)] * 2
    finally:
        backend.close()


def test_lag_seconds_are_not_dated_by_a_gc_commit(stream: Stream) -> None:
    """GC expires the snapshots that published the steps and commits a ``collect`` snapshot carrying the head step:
    its commit time stood in for the steps' and a rank far behind showed a lag of about 0 s after every GC."""
    import time

    ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST, end_step=2)
    assert [item["step"] for item in ds] == [1, 2]
    published = stream.refresh().table.metadata.snapshot_by_name("main").timestamp_ms / 1000  # step 4's commit
    until(lambda: time.time() > published + 0.05, "the clock to pass step 4's commit")
    stream.checkpoint("c", step=3)
    stream.collect_garbage(dry_run=False, keep_last=1)  # collects steps 1 and 2
    stream.refresh()
    assert all(s.summary.additional_properties.get("lakestream.op") != "append" for s in stream.table.metadata.snapshots)
    now = time.time() + 3600
    row = {c.rank: c for c in consumer_lags(stream, group="run", now=now)}[0]
    assert (row.last_step, row.head_step, row.lag_steps) == (2, 4, 2)
    assert row.lag_s is None or row.lag_s >= now - published  # step 3 was committed before step 4: at least this
    publish(stream, 1)  # a step published after the GC dates the lag again (a lower bound, as documented)
    row = {c.rank: c for c in consumer_lags(stream.refresh(), group="run", now=now)}[0]
    assert row.lag_steps == 3 and row.lag_s is not None and 0 < row.lag_s <= now - published


@pytest.mark.parametrize("group", ["", "a\tb", 5, "x" * 201])
def test_the_lag_of_a_group_no_dataset_can_have_is_refused(tmp_path: Path, group: object) -> None:
    """`lakestream lag STREAM --group 'a<TAB>b'` said the group had no recorded positions (a dataset refuses the name,
    so none ever has it) and exited 0; consumer_lags(group=5) returned []."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=1)
    with pytest.raises(ConfigError, match="group must be"):
        consumer_lags(stream, group=group)  # type: ignore[arg-type]
    assert consumer_lags(stream, group="run-1") == []


def test_a_stored_position_under_a_rank_no_rank_can_have_is_skipped_loudly(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Position objects named ``r².parquet`` (``'²'.isdigit()``) or ``r99999999999.parquet``, and a row another program
    wrote with rank ``'abc'`` or ``2**40``: the listing died of ``int('²')``/``int('abc')`` (a raw ValueError from
    ``lakestream lag``), and the consumers view of the history of ArrowInvalid (an int32 rank column). They are no rank's
    position: left out of the listing, with a warning (``r²`` is no position object's name, as a store's temporary
    file is not)."""
    from pyiceberg.catalog.sql import SqlCatalog

    from lakestream_iceberg.read.lag import consumers_table

    catalog = SqlCatalog("mem", uri="sqlite:///:memory:", warehouse=f"file://{tmp_path}/warehouse")
    objects = Stream.create(catalog, "ns.lag", schema=SCHEMA, world_size=WORLD)
    (rows := Stream.create(sqlite_catalog(str(tmp_path)), "ns.lag", schema=SCHEMA, world_size=WORLD))
    for stream in (objects, rows):
        publish(stream, 2)
        assert [i["step"] for i in LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST)]
    position = next((tmp_path / "warehouse").rglob("r000000.parquet"))
    with sqlite3.connect(tmp_path / "catalog.db") as con:
        (location, body), = con.execute(f"SELECT location, body FROM {POSITION_TABLE}").fetchall()
        for rank in ("abc", 2**40):
            con.execute(f"INSERT INTO {POSITION_TABLE} VALUES (?, 'run', ?, ?, 0)", (location, rank, body))
    for stream, odd, warned in [(objects, "r\u00b2.parquet", False), (objects, "r99999999999.parquet", True),
                                (rows, None, True)]:
        if odd is not None:
            (position.parent / odd).write_bytes(position.read_bytes())
        caplog.clear()
        with caplog.at_level("WARNING", logger="lakestream_iceberg.connect.positions"):
            assert [(c.rank, c.status) for c in consumer_lags(stream.refresh())] == [(0, "closed")]
        assert ("no rank can have" in caplog.text) is warned  # 'r²' is not a position object's name: not one
        assert consumers_table(stream).column("rank").to_pylist() == [0]
        if odd is not None:
            (position.parent / odd).unlink()


@pytest.mark.services
def test_a_rank_holds_no_idle_database_connection_between_its_position_reports(tmp_path: Path,
                                                                               postgres_service: object) -> None:
    """A follow-mode rank that reads through its host's relay keeps no catalog connection (the holder's are the
    host's); its position reports kept one open, idle between reports, in every rank: thousands of PostgreSQL
    connections (and backends) for one upsert per rank every few seconds. A report opens its connection and closes it."""
    import psycopg2
    from pyiceberg.catalog.sql import SqlCatalog

    from lakestream_iceberg.connect.pointer import release_idle_connections
    from lakestream_iceberg.read.consumer import PositionReporter
    from tests.backends import fresh_name

    database = fresh_name("db")
    uri = postgres_service.create_database(database)  # type: ignore[attr-defined]
    catalog = SqlCatalog("pg", uri=uri, warehouse=f"file://{tmp_path}/warehouse")
    catalog.create_namespace("ns")
    stream = Stream.create(catalog, "ns.lag", schema=SCHEMA, world_size=WORLD)
    publish(stream, 1)
    release_idle_connections(catalog)  # as a relay client does
    probe = psycopg2.connect(uri.replace("postgresql+psycopg2", "postgresql"))
    probe.autocommit = True

    def query(sql: str) -> list[tuple[object, ...]]:
        with probe.cursor() as cur:
            cur.execute(sql, (database,))
            return cur.fetchall()

    store = PositionStore(catalog=catalog, io=stream.io, location=stream.table.metadata.location)
    reporter = PositionReporter(store=store, group="run", rank=0, world_size=WORLD, branch="main",
                                stream=str(stream.table.metadata.table_uuid), name=stream.name, report_s=3600.0,
                                workers=0, source="iterator")
    try:
        until(lambda: store.rows(group="run"), "the rank's first report")
        # the reporter now waits report_s; its connection closes once the report's transaction is over (never, before)
        until(lambda: query("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()")
              == [(0,)], "the report's connection to close", deadline_s=20)
    finally:
        reporter.close()
        probe.close()
        catalog.engine.dispose()


@pytest.mark.parametrize(("world_size", "report_s"), [(WORLD, 5.0), (1_000, 5.0), (20_000, 100.0)])
def test_the_default_report_interval_keeps_a_jobs_position_writes_bounded_however_many_ranks(
        stream: Stream, world_size: int, report_s: float) -> None:
    """5 s up to 1,000 ranks, then world_size / 200: 20,000 ranks reporting every 5 s were 4,000 writes a second to the
    catalog's database (a new PostgreSQL connection each) or the object store."""
    ds = LakestreamDataset(stream, rank=world_size - 1, world_size=world_size, group="run", end_step=1)
    list(ds)
    ds.close()
    row = lags(stream)[world_size - 1]
    assert (row.status, row.report_s) == ("closed", report_s)
    explicit = LakestreamDataset(stream, rank=0, world_size=world_size, group="other", report_s=FAST, end_step=1)
    list(explicit)
    explicit.close()
    assert lags(stream, group="other")[0].report_s == FAST  # an explicit report_s is kept


@pytest.mark.parametrize("follow", [False, True])
def test_a_rank_that_breaks_out_of_its_loop_and_closes_the_dataset_shows_as_closed(stream: Stream,
                                                                                   follow: bool) -> None:
    """``ds.close()`` "reports the final position" (docs/guide/monitoring.md) and a rank "closed cleanly" shows as
    ``closed`` (read/lag.py). A loop that stops early (``break``: a step budget, an eval) and then closes the dataset
    showed as ``stale``, the status of "a killed or hung process", forever: the iteration's end recorded the position
    as not closed, and the close recorded nothing more."""
    ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST, follow=follow, timeout=30)
    for item in ds:
        if item["step"] == 2:
            break
    ds.close()
    until(lambda: lags(stream)[0].age_s > 4 * FAST, "the rank's last report to age past the stale limit")
    row = lags(stream)[0]
    assert (row.last_step, row.lag_steps) == (2, 2)
    assert row.status == "closed"


def test_a_rank_past_a_head_another_engine_moved_back_is_not_shown_caught_up(stream: Stream) -> None:
    """Another engine rolls main back from step 4 to step 2 (Iceberg's rollback_to_snapshot) after a rank delivered
    steps 1-4. ``lag_steps`` (head step minus the last step delivered) was clamped to 0 and ``lag_s`` 0.0: the rank
    showed as caught up, where a follower of the branch is warned that steps it delivered left it (HeadWatcher). It is
    the negative lag (kafka-consumer-groups shows one after a truncation), no lag_s, and ``error`` says the branch
    moved back."""
    two = next(s for s in stream.refresh().table.snapshots() if (s.summary or {}).get("lakestream.step") == "2")
    assert [i["step"] for i in LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=FAST)] == [
        1, 2, 3, 4]
    assert (lags(stream)[0].lag_steps, lags(stream)[0].lag_s) == (0, 0.0)
    stream.refresh().table.manage_snapshots().rollback_to_snapshot(two.snapshot_id).commit()
    row = lags(stream)[0]
    assert (row.status, row.last_step, row.head_step) == ("closed", 4, 2)
    assert row.lag_steps == -2 and row.lag_s is None
    assert row.error is not None and "moved back" in row.error


def test_the_lag_table_for_people_says_why_a_rank_is_invalid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lakestream lag` (no --json) showed a damaged position as status ``invalid`` and nothing else: the reason
    (``error``: which field, or that the record is not JSON) was only in the JSON output."""
    from lakestream_iceberg.tools.cli import main
    from lakestream_iceberg.tools.config import embedded_catalog

    stream = Stream.create(embedded_catalog(tmp_path), "ns.lag", schema=SCHEMA, world_size=WORLD)
    publish(stream, 2)
    for rank in range(WORLD):
        assert [i["step"] for i in LakestreamDataset(stream, rank=rank, world_size=WORLD, group="run", report_s=FAST)]
    store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)
    store.upsert(group="run", rank=1, body="{not json")
    assert main(["lag", "ns.lag", "--group", "run", "--home", str(tmp_path)]) == 0
    human = " ".join(capsys.readouterr().out.split())
    assert "invalid" in human and "not JSON" in human, human


def test_a_position_listing_that_fails_names_what_it_listed_for(tmp_path: Path) -> None:
    """Outside a SQL catalog, a store that cannot list the positions' folder made `lakestream lag` fail with "cannot
    list ... for garbage collection", a command the operator never ran."""
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("mem", uri="sqlite:///:memory:", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.lag", schema=SCHEMA, world_size=1)
    publish(stream, 1)
    (tmp_path / "warehouse" / "ns" / "lag" / "data" / "_consumers").write_text("a file, not a folder")
    with pytest.raises(ConfigError, match="cannot list .*_consumers for the consumer positions") as caught:
        consumer_lags(stream.refresh())
    assert "garbage collection" not in str(caught.value)


def test_a_rank_of_a_branch_since_dropped_says_why_it_has_no_lag(stream: Stream) -> None:
    """A rank that read a fork, which was then dropped (``remove_branch``): its row had no head and no lag, and nothing
    said why (``error`` None)."""
    stream.checkpoint("c2", step=2)
    stream.fork("c2", branch="exp")
    stream.producer("q", branch="exp").commit(batch("q", 0, WORLD), seq=0)
    assert [i["step"] for i in LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", branch="exp",
                                                 start_step=2, report_s=FAST)] == [2, 3]
    assert lags(stream)[0].lag_steps == 0 and lags(stream)[0].error is None
    stream.refresh().table.manage_snapshots().remove_branch("exp").commit()
    row = lags(stream)[0]
    assert (row.status, row.head_step, row.lag_steps) == ("closed", None, None)
    assert row.error is not None and "'exp' is no branch" in row.error
