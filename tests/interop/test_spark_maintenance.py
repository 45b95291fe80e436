"""Iceberg's table maintenance, run by Spark on a live stream (issue #37): producers commit before and after, every
retained step reads as published, a re-commit of a published (producer, seq) is a duplicate at its step, and new
steps stay dense.

* ``expire_snapshots`` and ``remove_orphan_files`` delete files no snapshot needs; lakestream keeps its state in
  snapshot summaries and its checkpoint tags protect their anchors.
* ``rewrite_manifests`` writes a foreign snapshot that changes no data: lakestream finds its state in the nearest
  lakestream ancestor and commits on top of it.
* ``rewrite_position_delete_files`` finds nothing to do on a stream (lakestream writes no delete files);
  ``rewrite_data_files`` changes data and is covered with the other data changes in test_spark_foreign_writes.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from lakestream_iceberg import ForeignSnapshotError
from lakestream_iceberg.format import producers
from tests.interop.checks import (
    IDENTIFIER,
    Lake,
    Writers,
    age_files,
    assert_intact,
    create,
    expected_rows,
    foreign_snapshots,
    incremental,
    snapshot_of_step,
    spark_rows,
)

pytestmark = pytest.mark.spark

DAY_S = 86_400


def call(lake: Lake, procedure: str, **args: str) -> list[Any]:
    """``CALL <catalog>.system.<procedure>(table => 'ns.stream', name => value, ...)``; values are SQL literals."""
    named = ", ".join([f"table => '{IDENTIFIER}'", *(f"{k} => {v}" for k, v in args.items())])
    return lake.sql(f"CALL {lake.name}.system.{procedure}({named})")


def timestamp(when: datetime) -> str:
    """A Spark SQL timestamp literal (the session's time zone is UTC)."""
    return f"TIMESTAMP '{when.astimezone(timezone.utc).strftime('%Y-%m-%d %H:%M:%S.%f')}'"


def snapshot_ids(lake: Lake) -> set[int]:
    return {row.snapshot_id for row in lake.sql(f"SELECT snapshot_id FROM {lake.table()}.snapshots")}


def test_expire_snapshots_keeps_every_step_the_checkpoint_and_exactly_once(lake: Lake) -> None:
    stream = create(lake, **{"lakestream.snapshots.retain-last": "64"})
    writers = Writers(stream)
    writers.rounds(2)  # 8 steps, two of them published by group commits
    checkpoint = stream.checkpoint("ckpt-3", step=3)
    head, parent = snapshot_of_step(stream, 8), snapshot_of_step(stream, 7)
    assert len(snapshot_ids(lake)) == 9  # 8 steps and the checkpoint's anchor
    (row,) = call(lake, "expire_snapshots", older_than=timestamp(datetime.now(timezone.utc) + timedelta(minutes=1)),
                  retain_last="2")
    assert row.deleted_data_files_count == 0  # every step's files are in the head's manifests
    assert row.deleted_manifest_lists_count == 6
    assert snapshot_ids(lake) == {head, parent, checkpoint.snapshot_id}
    assert [(c.name, c.step) for c in stream.checkpoints()] == [("ckpt-3", 3)]
    anchor = spark_rows(lake.sql(f"SELECT * FROM {lake.table()} VERSION AS OF 'ckpt-3'"))
    assert anchor == expected_rows(writers.published, [3])  # the tag's anchor holds its step
    assert_intact(lake, writers, head=8)
    writers.rounds(1)  # steps 10..13 merge over what expiry left
    assert incremental(lake, head, snapshot_of_step(stream, 13)) == expected_rows(writers.published, range(9, 14))


@pytest.fixture
def compacting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Producers idle for 4 steps move to producer-state files under data/_producers/, 4 at a time (the defaults,
    32 and 32, need ~10x the commits; tests/test_producer_state.py does the same)."""
    monkeypatch.setattr(producers, "ACTIVE_MIN_STEPS", 4)
    monkeypatch.setattr(producers, "COMPACT_AT", 4)
    monkeypatch.setattr(producers, "MAX_FILES", 3)


def test_remove_orphan_files_deletes_strays_and_keeps_what_the_stream_needs(lake: Lake, compacting: None) -> None:
    stream = create(lake)
    writers = Writers(stream)
    for i in range(12):  # one-shot producers: idle ones are compacted into producer-state files
        writers.commit(f"id-{i}")
    writers.rounds(2)  # steps 13..20
    state = stream.state()
    assert state.producer_files, "no producer was compacted: the test would not cover producer-state files"
    location = Path(stream.table.metadata.location.removeprefix("file://"))
    strays = [location / "data" / "stray-00000.parquet", location / "metadata" / "stray.avro"]
    for stray in strays:
        stray.write_bytes(b"not referenced by any snapshot")
    assert age_files(location, 2 * DAY_S) > 0  # Spark refuses a cutoff younger than a day
    removed = {row.orphan_file_location for row in call(
        lake, "remove_orphan_files", older_than=timestamp(datetime.now(timezone.utc) - timedelta(days=1)))}
    assert {f"file:{s}" for s in strays} <= {p.replace("file:///", "file:/") for p in removed}
    assert not any(s.exists() for s in strays)
    # data/_producers/ and data/_staging/ are not in Iceberg's metadata, but Spark's action skips folders whose names
    # start with "_" or "." (Iceberg's hidden-path filter): lakestream's producer-state files stay
    assert not {p for p in removed if "/data/_" in p}
    assert all(stream.io.new_input(path).exists() for path in state.producer_files)
    assert any("/metadata/snap-" in p for p in removed)  # the manifest lists of snapshots lakestream expired
    assert_intact(lake, writers, head=20)  # one-shot ids included: their seq 0 is a duplicate at their step


def test_rewrite_manifests_is_a_foreign_snapshot_lakestream_commits_on(lake: Lake) -> None:
    stream = create(lake, **{"lakestream.snapshots.retain-last": "64"})
    writers = Writers(stream)
    writers.rounds(2)
    before = snapshot_of_step(stream, 8)
    (row,) = call(lake, "rewrite_manifests")
    assert row.rewritten_manifests_count >= 2 and row.added_manifests_count >= 1
    (rewrite,) = foreign_snapshots(stream)
    assert stream.refresh().head().summary.operation.value == "replace"
    assert_intact(lake, writers, head=8)  # commits step 9 on top of the rewrite
    assert stream.table.metadata.snapshot_by_id(snapshot_of_step(stream, 9)).parent_snapshot_id == rewrite
    writers.rounds(1)  # steps 10..13 merge Spark's manifests with lakestream's
    after = snapshot_of_step(stream, 13)
    assert incremental(lake, before, after) == expected_rows(writers.published, range(9, 14))
    assert spark_rows(lake.spark.table(lake.table()).collect()) == expected_rows(writers.published)


def test_expire_snapshots_after_rewrite_manifests_keeps_or_rebases_the_stream_state(lake: Lake) -> None:
    """Iceberg's usual maintenance pair on a stream between two producer commits: ``rewrite_manifests`` makes Spark's
    metadata-only snapshot the head, then ``expire_snapshots`` keeps the newest ones. The table's
    ``history.expire.min-snapshots-to-keep`` (Spark's default ``retain_last``) at 2 keeps the lakestream snapshot
    below it, and the stream goes on. Keeping only Spark's snapshot (``retain_last => 1``) expires every snapshot
    that records the stream's state (head step, producer sequences): lakestream then refuses to commit (it could
    republish) or read, naming the snapshot, while Spark still reads every step; ``repair()`` reads the state back
    from the metadata log, re-bases it on Spark's snapshot, and the stream goes on exactly once."""
    stream = create(lake, **{"history.expire.min-snapshots-to-keep": "2"})
    writers = Writers(stream)
    writers.rounds(2)
    later = timestamp(datetime.now(timezone.utc) + timedelta(minutes=10))
    call(lake, "rewrite_manifests")
    (rewrite,) = foreign_snapshots(stream)
    call(lake, "expire_snapshots", older_than=later)
    assert snapshot_ids(lake) == {rewrite, snapshot_of_step(stream, 8)}
    assert_intact(lake, writers, head=8)  # step 9 on top of Spark's snapshot
    writers.rounds(1)  # steps 10..13: manifests enough for another rewrite
    call(lake, "rewrite_manifests")
    (rewrite,) = foreign_snapshots(stream)
    call(lake, "expire_snapshots", older_than=later, retain_last="1")
    assert snapshot_ids(lake) == {rewrite}
    with pytest.raises(ForeignSnapshotError) as refused:
        writers.commit("a")
    assert refused.value.snapshot_id == rewrite and str(rewrite) in str(refused.value)
    with pytest.raises(ForeignSnapshotError):
        stream.head_step()
    assert spark_rows(lake.spark.table(lake.table()).collect()) == expected_rows(writers.published)
    report = stream.repair()
    assert (report.rebased_on, report.rolled_back_to, report.step) == (rewrite, None, 13)
    assert_intact(lake, writers, head=13)


def test_rewrite_position_delete_files_finds_nothing_to_do_on_a_stream(lake: Lake) -> None:
    stream = create(lake)
    writers = Writers(stream)
    writers.rounds(1)
    head = stream.refresh().head().snapshot_id
    (row,) = call(lake, "rewrite_position_delete_files", options="map('rewrite-all', 'true')")
    assert (row.rewritten_delete_files_count, row.added_delete_files_count) == (0, 0)
    assert stream.refresh().head().snapshot_id == head  # no snapshot: lakestream writes no delete files
    assert_intact(lake, writers, head=4)


def test_gc_keeps_the_statistics_file_spark_computed(lake: Lake) -> None:
    """Spark's compute_table_stats writes a Puffin file under metadata/ that metadata.json lists and no manifest does:
    lakestream GC deleted it once past the grace period, leaving Spark's table metadata naming a missing file (the
    statistics of a snapshot that GC or a commit expires go with it)."""
    from lakestream_iceberg import Stream

    stream = create(lake)
    writers = Writers(stream)
    writers.rounds(3)
    [row] = call(lake, "compute_table_stats")
    path = row.statistics_file
    age_files(Path(stream.table.metadata.location.removeprefix("file://")), 2 * DAY_S)
    stream = Stream(stream.table.catalog.load_table(IDENTIFIER))
    stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert [s.statistics_path for s in stream.refresh().table.metadata.statistics] == [path]
    assert stream.io.new_input(path).exists(), f"GC deleted {path}, which the table metadata lists"
    assert lake.sql(f"SELECT count(*) AS n FROM {lake.table()}")[0].n > 0
