"""The DuckDB history views against a real SQLite catalog: every view, expired snapshots, checkpoints, GC."""

from __future__ import annotations

import re
import sys
from contextlib import nullcontext
from pathlib import Path

import pyarrow as pa
import pytest

from lakestream_iceberg import MissingExtraError, Stream
from lakestream_iceberg.errors import CorruptStateError
from lakestream_iceberg.read.history import VIEWS, history
from lakestream_iceberg.read.history_rows import parse_data_path, step_rows
from tests.support import SCHEMA, batch, lakestream_keys, sqlite_catalog

pytest.importorskip("duckdb")

WORLD = 2
RETAIN = 4  # lakestream.snapshots.retain-last: steps 1..6 of 10 lose their snapshot


def _build(root: Path) -> tuple[Stream, list, dict[int, list[pa.Table]]]:
    stream = Stream.create(sqlite_catalog(str(root)), "ns.hist", schema=SCHEMA, world_size=WORLD,
                           properties={"lakestream.snapshots.retain-last": str(RETAIN)})
    producers = [stream.producer("prep-0"), stream.producer("prep-1")]
    results, shards = [], {}
    for seq in range(5):
        for producer in producers:
            data = batch(producer.producer_id, seq, WORLD)
            result = producer.commit(data, seq=seq)
            results.append(result)
            shards[result.step] = data
    return stream, results, shards


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    stream, results, shards = _build(tmp_path_factory.mktemp("history"))
    stream.checkpoint("ck6", step=6)
    stream.checkpoint("ck8", step=8)
    return stream, results, shards


def _rows(con, sql: str) -> list[dict]:
    rel = con.sql(sql)
    return [dict(zip(rel.columns, r, strict=True)) for r in rel.fetchall()]


def test_every_view_is_registered_and_the_issue_query_works(built) -> None:
    stream, _, _ = built
    con = history(stream)
    names = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    assert set(VIEWS) <= names
    assert sorted(con.sql("SELECT producer, count(*) FROM batches GROUP BY 1 ORDER BY 1").fetchall()) == [
        ("prep-0", 5), ("prep-1", 5)]


def test_batches_cover_every_step_including_expired_snapshots(built) -> None:
    stream, results, shards = built
    rows = _rows(history(stream), "SELECT * FROM batches ORDER BY step")
    assert [r["step"] for r in rows] == list(range(1, 11))
    by_step = {r.step: r for r in results}
    for row in rows:
        result = by_step[row["step"]]
        assert (row["producer"], row["seq"], row["snapshot_id"]) == (result.producer, result.seq, result.snapshot_id)
        assert row["samples_per_rank"] == [t.num_rows for t in shards[row["step"]]]
        assert row["samples"] == sum(row["samples_per_rank"]) and row["ranks"] == WORLD
        assert row["bytes"] == sum(row["bytes_per_rank"]) > 0
        assert row["collected"] is False
    retained = [r for r in rows if r["retained"]]
    expired = [r for r in rows if not r["retained"]]
    assert [r["step"] for r in retained] == list(range(11 - RETAIN, 11))
    assert all(r["committed_at"] is not None and r["attempts"] >= 1 for r in retained)
    # What expiry loses: the snapshot's own facts.
    assert expired and all(r["committed_at"] is None and r["attempts"] is None and r["parent_id"] is None for r in expired)
    assert retained[-1]["parent_id"] == retained[-2]["snapshot_id"]


def test_files_view_parses_producer_and_seq_from_paths(built) -> None:
    stream, results, _ = built
    con = history(stream)
    rows = _rows(con, "SELECT * FROM files ORDER BY step, rank")
    assert len(rows) == 10 * WORLD
    for row in rows:
        assert parse_data_path(row["path"]) == (row["producer"], row["seq"], row["rank"])
    assert con.execute("SELECT sum(records) FROM files").fetchone()[0] == sum(r.rows for r in results)
    assert con.execute("SELECT sum(bytes) FROM files").fetchone()[0] == sum(r.bytes for r in results)


def test_producers_view(built) -> None:
    stream, _, _ = built
    rows = _rows(history(stream), "SELECT * FROM producers ORDER BY producer")
    assert [(r["producer"], r["last_seq"], r["last_step"], r["commits"], r["lag"]) for r in rows] == [
        ("prep-0", 4, 9, 5, 1), ("prep-1", 4, 10, 5, 0)]


def test_checkpoints_view_says_what_each_pins(built) -> None:
    stream, _, _ = built
    con = history(stream)
    rows = _rows(con, "SELECT * FROM checkpoints ORDER BY step")
    assert [(r["name"], r["step"], r["branch"]) for r in rows] == [("ck6", 6, "main"), ("ck8", 8, "main")]
    ck6, ck8 = rows
    assert (ck6["pinned_steps"], ck6["pinned_files"]) == (5, 5 * WORLD)  # resuming after 6 needs 6..10
    assert (ck8["pinned_steps"], ck8["pinned_files"]) == (3, 3 * WORLD)
    assert ck6["exclusive_steps"] == 2 and ck8["exclusive_steps"] == 0  # releasing ck6 frees steps 6 and 7 only
    step_bytes = dict(con.execute("SELECT step, bytes FROM batches").fetchall())
    assert ck6["pinned_bytes"] == sum(step_bytes[s] for s in range(6, 11))
    assert ck6["exclusive_bytes"] == step_bytes[6] + step_bytes[7]
    assert all(r["created_at"] is not None and r["snapshot_id"] for r in rows)


def test_snapshots_view_holds_retained_snapshots_only(built) -> None:
    stream, _, _ = built
    rows = _rows(history(stream), "SELECT * FROM snapshots ORDER BY step")
    assert [r["step"] for r in rows] == list(range(11 - RETAIN, 11))
    assert {r["op"] for r in rows} == {"append"} and all('"lakestream.producers"' in r["summary"] for r in rows)


def test_samples_view_reads_the_committed_rows(built) -> None:
    stream, _, shards = built
    con = history(stream, samples_steps=(2, 3))
    got = con.sql("SELECT * FROM samples ORDER BY _step, _rank, producer, i").to_arrow_table()
    for step in (2, 3):
        for rank in range(WORLD):
            part = got.filter(pa.compute.and_(pa.compute.equal(got["_step"], step), pa.compute.equal(got["_rank"], rank)))
            assert part.drop_columns(["_step", "_rank"]).to_pylist() == shards[step][rank].to_pylist()
    head_only = history(stream)
    assert {r[0] for r in head_only.execute("SELECT DISTINCT _step FROM samples").fetchall()} <= {10}
    assert head_only.execute("SELECT count(*) FROM samples").fetchone()[0] == sum(t.num_rows for t in shards[10])


def test_step_rows_for_tail(built) -> None:
    stream, results, _ = built
    rows = step_rows(stream, [5, 10], branch="main")
    assert [(r["step"], r["producer"]) for r in rows] == [(5, results[4].producer), (10, results[9].producer)]
    assert rows[1]["retained"] and rows[1]["attempts"] >= 1


def test_history_after_gc_keeps_what_the_table_still_knows(tmp_path: Path) -> None:
    stream, results, _ = _build(tmp_path)
    stream.checkpoint("ck6", step=6)
    stream.collect_garbage(dry_run=False)
    con = history(stream, samples_steps=(1, 10))
    steps = [r[0] for r in con.execute("SELECT step FROM batches WHERE NOT collected ORDER BY step").fetchall()]
    assert steps == list(range(6, 11))
    assert {r[0] for r in con.execute("SELECT DISTINCT _step FROM samples").fetchall()} <= set(range(6, 11))
    assert con.execute("SELECT count(*) FROM files WHERE step < 6").fetchone()[0] == 0
    assert con.execute("SELECT sum(commits), max(last_seq) FROM producers").fetchone() == (5, 4)


def test_empty_stream_has_typed_empty_views(tmp_path: Path) -> None:
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.empty", schema=SCHEMA, world_size=WORLD)
    con = history(stream)
    for view in VIEWS:
        assert con.execute(f"SELECT count(*) FROM {view}").fetchone()[0] == 0
    assert "_step" in con.sql("SELECT * FROM samples").columns


def test_missing_duckdb_names_the_extra(built, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "duckdb", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'lakestream-iceberg\[duckdb\]'"):
        history(built[0])


def test_history_of_many_retained_snapshots_is_not_quadratic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """snapshot_rows looked each retained snapshot up with ``metadata.snapshot_by_id``, a scan of every snapshot: with
    retain-last in the thousands ``lakestream sql`` and each round of ``lakestream tail`` cost O(snapshots^2)."""
    from pyiceberg.table.metadata import TableMetadataCommonFields

    steps = 40
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.many", schema=SCHEMA, world_size=1,
                           properties={"lakestream.snapshots.retain-last": str(10 * steps)})
    producer = stream.producer("p")
    for seq in range(steps):
        producer.commit(batch("p", seq, 1), seq=seq)
    scans = []
    original = TableMetadataCommonFields.snapshot_by_id
    monkeypatch.setattr(TableMetadataCommonFields, "snapshot_by_id",
                        lambda self, snapshot_id: scans.append(snapshot_id) or original(self, snapshot_id))
    rows = history(stream, samples=False).execute("SELECT count(*), count(committed_at) FROM batches").fetchone()
    assert rows == (steps, steps)
    assert len(step_rows(stream, [steps], branch="main")) == 1
    assert len(scans) < steps // 4, f"{len(scans)} scans of the snapshot list for {steps} retained snapshots"


def _pins_by_brute_force(stream: Stream) -> list[tuple]:
    """What each checkpoint pins, file by file (the definition in checkpoint_rows' docstring, and its former code)."""
    from lakestream_iceberg.format.checkpoints import list_checkpoints
    from lakestream_iceberg.format.manifest_facts import stream_entry
    from lakestream_iceberg.read.history_rows import live_entries

    metadata = stream.table.metadata
    checkpoints = list_checkpoints(metadata)
    out = []
    for ckpt in checkpoints:
        files = [e.data_file for e in live_entries(stream, branch=ckpt.branch)] if ckpt.branch in metadata.refs else []
        anchor = [f for f in stream.index.all_files(metadata.snapshot_by_id(ckpt.snapshot_id)) if stream_entry(f)]
        live = {f.file_path for f in files}
        pinned = [f for f in files if int(f.partition[0]) >= ckpt.step] + [f for f in anchor if f.file_path not in live]
        same = [c.step for c in checkpoints if c.branch == ckpt.branch]
        newer = [s for s in same if s > ckpt.step]
        exclusive = [] if ckpt.step != min(same) or not newer or same.count(min(same)) > 1 else [
            f for f in pinned if int(f.partition[0]) < min(newer)]
        out.append((ckpt.name, len({int(f.partition[0]) for f in pinned}), len(pinned),
                    sum(f.file_size_in_bytes for f in pinned), len({int(f.partition[0]) for f in exclusive}),
                    sum(f.file_size_in_bytes for f in exclusive)))
    return out


def test_checkpoints_view_of_many_tags_is_not_quadratic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoints view went over every live file of the branch and every file of the anchor for each checkpoint:
    O(tags x steps), with a checkpoint every 10 of 1,000 steps 0.1 s for every history, and 100x that at 10x both.
    Same figures (collected steps still pinned by an anchor, two tags at one step, a fork's own), each file seen a
    bounded number of times."""
    from pyiceberg.manifest import DataFile

    from lakestream_iceberg.read.history_rows import checkpoint_rows

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.pins", schema=SCHEMA, world_size=WORLD)
    producer = stream.producer("p")
    for seq in range(40):
        producer.commit(batch("p", seq, WORLD), seq=seq)
    stream.checkpoint("old", step=3)
    stream.collect_garbage(dry_run=False, allow_short_grace=True, grace=__import__("datetime").timedelta(0))
    for step in range(5, 41, 2):
        stream.checkpoint(f"c{step}", step=step)
    stream.checkpoint("twin", step=5)
    stream.fork("c21", branch="exp")
    stream.producer("q", branch="exp").commit(batch("q", 0, WORLD), seq=0)
    stream.refresh()
    stream.checkpoint("exp-22", step=22, branch="exp")
    stream.refresh().table.manage_snapshots().remove_branch("exp").commit()  # another tool: its tag stays, all outside
    stream.refresh()
    expected = _pins_by_brute_force(stream)
    reads = [0]
    partition = DataFile.partition
    monkeypatch.setattr(DataFile, "partition", property(lambda f: reads.__setitem__(0, reads[0] + 1) or partition.fget(f)))
    rows = checkpoint_rows(stream)
    assert [(r["name"], r["pinned_steps"], r["pinned_files"], r["pinned_bytes"], r["exclusive_steps"],
             r["exclusive_bytes"]) for r in rows] == expected
    assert {r[0]: r[1:5] for r in expected}["exp-22"][0::3] == (1, 0)  # only its anchor: step 22 of a dropped branch
    assert {r[0]: r[1:5] for r in expected}["old"][0::3] == (38, 2)  # releasing it frees steps 3 and 4
    files = 2 * 41 * WORLD  # two branches' live files, at most
    assert reads[0] < 6 * files, f"{reads[0]} reads of a file's step for {len(rows)} checkpoints and {files} files"


def test_step_rows_of_collected_steps_cost_no_catalog_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``lakestream tail --from-step 1`` on a stream whose old steps GC collected looked each collected step up with
    ``locate``, which reloads the table from the catalog before it calls a step missing: one round trip per collected
    step (thousands after a long run, each a metadata.json read). Steps below the head's collected_below have no files
    whatever a reload shows."""
    from lakestream_iceberg.format.table import StreamTable

    stream, results, _ = _build(tmp_path)
    stream.checkpoint("ck6", step=6)
    stream.collect_garbage(dry_run=False)
    stream.refresh()
    reloads: list[int] = []
    refresh = StreamTable.refresh
    monkeypatch.setattr(StreamTable, "refresh", lambda self, *a, **k: reloads.append(1) or refresh(self, *a, **k))
    rows = step_rows(stream, range(1, 11), branch="main")
    assert [(r["step"], r["producer"]) for r in rows] == [(s, results[s - 1].producer) for s in range(6, 11)]
    assert reloads == []


@pytest.mark.parametrize(("key", "value", "column"), [
    ("lakestream.attempts", "99999999999", "attempts"), ("lakestream.group", "99999999999", "group_size"),
    ("lakestream.seq", "9999999999999999999", "seq"),
])
def test_a_summary_number_its_column_cannot_hold_shows_as_null(tmp_path: Path, key: str, value: str, column: str) -> None:
    """A retained snapshot whose summary holds a number past its view column's type (int32 attempts and group_size,
    int64 seq) made history raise pyarrow's ArrowInvalid; it is NULL. (Below the head: a head's seq past a long is
    no value lakestream writes, and reading the head's state refuses it.)"""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.huge", schema=SCHEMA, world_size=1)
    producer = stream.producer("p")
    producer.commit(batch("p", 0, 1), seq=0)
    table = stream.refresh().table
    props = lakestream_keys(table.current_snapshot())
    table.append(table.schema().as_arrow().empty_table(), snapshot_properties={**props, key: value})  # another tool
    with pytest.raises(CorruptStateError, match=re.escape(f"{key}={value!r}")) if key == "lakestream.seq" else nullcontext():
        stream.refresh().head_step()
    table.append(table.schema().as_arrow().empty_table(), snapshot_properties=props)  # and again, with the head's
    producer.commit(batch("p", 1, 1), seq=1)
    rows = history(stream, samples=False).execute(f"SELECT step, {column} FROM snapshots ORDER BY snapshot_id").fetchall()
    assert len(rows) == 4 and (1, None) in rows


def test_a_forks_first_step_joins_its_retained_snapshot_on_the_source_branch(tmp_path: Path) -> None:
    """A fork's lineage starts at its checkpoint anchor, so its first step (published on main, that snapshot still
    retained) showed as expired in the fork's ``batches``: retained false, committed_at and attempts NULL."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.fork", schema=SCHEMA, world_size=WORLD)
    main = stream.producer("p")
    results = [main.commit(batch("p", seq, WORLD), seq=seq) for seq in range(4)]
    stream.checkpoint("c3", step=3)
    stream.fork("c3", branch="exp")
    stream.producer("q", branch="exp").commit(batch("q", 0, WORLD), seq=0)
    rows = _rows(history(stream, branch="exp", samples=False),
                 "SELECT step, snapshot_id, producer, retained, committed_at IS NOT NULL AS dated, attempts FROM batches "
                 "ORDER BY step")
    assert [(r["step"], r["producer"], r["retained"], r["dated"], r["attempts"]) for r in rows] == [
        (3, "p", True, True, 1), (4, "q", True, True, 1)]
    assert rows[0]["snapshot_id"] == results[2].snapshot_id


def test_history_of_a_stream_with_half_float_columns_shows_them_as_floats(tmp_path: Path) -> None:
    """A stream holds float16 columns (Iceberg stores them as floats), but DuckDB cannot register an Arrow half-float:
    history() raised duckdb's NotImplementedException ("Unsupported Internal Arrow Type e") for every view, and
    `lakestream sql` queries of samples failed with it."""
    import numpy as np

    schema = pa.schema([("h", pa.float16()), ("hs", pa.list_(pa.float16())),
                        ("st", pa.struct([("v", pa.list_(pa.float16(), 2))]))])
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.half", schema=schema, world_size=1)
    halves = np.array([1.5, np.nan, -2.0], np.float16)
    shard = pa.table({"h": pa.array(halves), "hs": [[halves[0]], [], [halves[2], halves[0]]],
                      "st": [{"v": [halves[0], halves[2]]}, None, {"v": [halves[2], halves[2]]}]}, schema=schema)
    if int(pa.__version__.split(".")[0]) < 25:  # pyarrow before 25 writes no null struct row holding a fixed-size list
        from lakestream_iceberg import SchemaMismatchError

        with pytest.raises(SchemaMismatchError, match="non-zero length null components"):
            stream.producer("p").commit([shard])
        pytest.skip(f"pyarrow {pa.__version__} cannot write the null struct row of this shard (pyarrow >= 25 can)")
    stream.producer("p").commit([shard])
    con = history(stream)
    assert con.sql("SELECT count(*) FROM batches").fetchall() == [(1,)]
    rows = con.sql("SELECT h, hs, st, _step FROM samples ORDER BY _rank").fetchall()
    assert [r[0] for r in rows][0::2] == [1.5, -2.0] and rows[1][0] != rows[1][0]  # NaN stays NaN
    assert [r[1] for r in rows] == [[1.5], [], [-2.0, 1.5]]
    assert rows[0][2] == {"v": (1.5, -2.0)} and rows[1][2] is None and rows[0][3] == 1
