"""Spark SQL writing to a stream (issue #37).

A foreign snapshot that changes data (``INSERT``, ``DELETE`` of whole files or by position deletes, an overwrite,
``rewrite_data_files``) is refused loudly with a way back: the next commit, ``head_step`` and read raise
``ForeignSnapshotError`` naming the snapshot and ``repair``; ``Stream.repair()`` rolls the branch back to the last
lakestream snapshot, after which every published step reads as before, re-commits are duplicates and new steps stay
dense. Changes that touch no data (a new optional column, table properties, tags and branches) simply work.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import lakestream_iceberg
from lakestream_iceberg import Stream
from tests.interop.checks import (
    IDENTIFIER,
    PAYLOAD,
    Lake,
    Writers,
    assert_intact,
    create,
    expected_rows,
    foreign_snapshots,
    lakestream_rows,
    shards,
    snapshot_of_step,
    spark_rows,
)

pytestmark = pytest.mark.spark


def insert(lake: Lake) -> None:
    lake.sql(f"INSERT INTO {lake.table()} SELECT 'spark', CAST(0 AS BIGINT), 0, 0, array(1, 2), X'00', "
             "CAST(3 AS BIGINT), 0")


def delete_step(lake: Lake) -> None:
    lake.sql(f"DELETE FROM {lake.table()} WHERE _step = 3")  # whole files: a metadata-only delete


def delete_rows_merge_on_read(lake: Lake) -> None:
    """Position delete files. (Their rewrite, ``rewrite_position_delete_files``, fails in Iceberg 1.10.2 on a table
    with a list column, "Invalid partition field parent: list<int>", so it is not run here.)"""
    lake.sql(f"ALTER TABLE {lake.table()} SET TBLPROPERTIES ('write.delete.mode' = 'merge-on-read')")
    lake.sql(f"DELETE FROM {lake.table()} WHERE _step = 3 AND i = 0")
    (row,) = lake.sql(f"SELECT summary FROM {lake.table()}.snapshots ORDER BY committed_at DESC LIMIT 1")
    assert row.summary["added-position-delete-files"] == "2"


def overwrite(lake: Lake) -> None:
    lake.spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    try:
        lake.sql(f"INSERT OVERWRITE {lake.table()} SELECT * FROM {lake.table()} WHERE _step = 2 AND i > 0")
    finally:
        lake.spark.conf.unset("spark.sql.sources.partitionOverwriteMode")


def rewrite_data_files(lake: Lake) -> None:
    (row,) = lake.sql(f"CALL {lake.name}.system.rewrite_data_files(table => '{IDENTIFIER}', "
                      "options => map('rewrite-all', 'true'))")
    assert row.rewritten_data_files_count == 10  # every file of the 5 steps, world size 2


DATA_CHANGES: dict[str, tuple[Callable[[Lake], None], int]] = {  # the change, and how many snapshots it writes
    "insert": (insert, 1),
    "delete-step": (delete_step, 1),
    "delete-rows-merge-on-read": (delete_rows_merge_on_read, 1),
    "overwrite": (overwrite, 1),
    "rewrite-data-files": (rewrite_data_files, 1),
}


@pytest.mark.parametrize("change", list(DATA_CHANGES))
def test_a_foreign_data_change_is_refused_until_repair_rolls_it_back(lake: Lake, change: str) -> None:
    error = lakestream_iceberg.ForeignSnapshotError
    stream = create(lake)
    writers = Writers(stream)
    writers.rounds(1)
    last = writers.commit("a")  # step 5
    published = spark_rows(lake.spark.table(lake.table()).collect())
    assert published == expected_rows(writers.published)
    apply, snapshots = DATA_CHANGES[change]
    apply(lake)
    foreign = foreign_snapshots(stream)
    assert len(foreign) == snapshots
    changed = spark_rows(lake.spark.table(lake.table()).collect())
    if change != "rewrite-data-files":  # a rewrite keeps the rows and changes the files
        assert changed != published
    with pytest.raises(error) as refused:
        writers.commit("a")
    assert refused.value.snapshot_id == foreign[-1]  # the oldest foreign snapshot that changed data
    assert str(foreign[-1]) in str(refused.value) and "repair" in str(refused.value)
    with pytest.raises(error):
        stream.head_step()
    with pytest.raises(error):
        stream.read(1, rank=0)
    with pytest.raises(error):
        Stream.open(lake.catalog, IDENTIFIER).producer("new").commit(shards("new", 0))
    planned = stream.repair(dry_run=True)
    assert (planned.rolled_back_to, list(planned.foreign), planned.step) == (last.snapshot_id, foreign, 5)
    assert foreign_snapshots(stream) == foreign  # a dry run changes nothing
    assert spark_rows(lake.spark.table(lake.table()).collect()) == changed
    report = stream.repair()
    assert (report.rolled_back_to, list(report.foreign), report.step) == (last.snapshot_id, foreign, 5)
    assert stream.refresh().head().snapshot_id == last.snapshot_id
    assert stream.repair().foreign == ()  # nothing left to repair
    again = writers.producers["a"].commit(shards("a", 0), seq=0)  # the refused producer, retrying after the repair
    assert (again.duplicate, again.step) == (True, 1)
    assert_intact(lake, writers, head=5)  # Spark reads what was published again, and step 6 is the next commit
    assert writers.published[6] == ("a", 2)  # the seq refused above, by the same producer object: published once
    again = writers.producers["a"].commit(shards("a", 2), seq=2)
    assert (again.duplicate, again.step) == (True, 6)


def test_a_new_optional_column_added_by_spark_leaves_the_stream_working(lake: Lake) -> None:
    stream = create(lake)
    writers = Writers(stream)
    writers.rounds(1)
    head = stream.refresh().head().snapshot_id
    lake.sql(f"ALTER TABLE {lake.table()} ADD COLUMN note string")
    assert stream.refresh().head().snapshot_id == head  # a schema change is no snapshot
    writers.rounds(1)  # steps 5..8 under the new schema
    assert lakestream_rows(stream, range(1, 9)) == expected_rows(writers.published)  # the payload columns only
    reopened = Stream.open(lake.catalog, IDENTIFIER)
    assert reopened.payload_arrow_schema.names == PAYLOAD and reopened.head_step() == 8
    rows = lake.sql(f"SELECT * FROM {lake.table()}")
    assert rows[0].__fields__ == [*PAYLOAD, "_step", "_rank", "note"]
    assert {row.note for row in rows} == {None}
    assert spark_rows(rows) == expected_rows(writers.published)
    assert_intact(lake, writers, head=8)


def test_table_properties_spark_sets_are_kept_and_lakestream_ones_honoured(lake: Lake) -> None:
    stream = create(lake, **{"lakestream.snapshots.retain-last": "64"})
    writers = Writers(stream)
    writers.rounds(1)
    lake.sql(f"ALTER TABLE {lake.table()} SET TBLPROPERTIES ('team' = 'data-platform', "
             "'lakestream.snapshots.retain-last' = '3')")
    writers.rounds(1)  # the running stream keeps committing
    assert stream.refresh().table.properties["team"] == "data-platform"
    reopened = Stream.open(lake.catalog, IDENTIFIER)
    assert reopened.config.retain_snapshots == 3
    for producer in ("d", "e", "f", "g"):  # commits of a process that opened the stream after the change
        assert reopened.producer(producer).commit(shards(producer, 0)).duplicate is False
    metadata = reopened.refresh().table.metadata
    assert len(metadata.snapshots) == 3  # lakestream expired in passing all but the 3 newest
    assert reopened.table.properties["team"] == "data-platform"  # and kept Spark's property
    assert reopened.head_step() == 12 and lakestream_rows(reopened, range(1, 9)) == expected_rows(writers.published)


def test_tags_and_branches_spark_creates_are_kept_and_readable(lake: Lake) -> None:
    stream = create(lake, **{"lakestream.snapshots.retain-last": "2"})
    writers = Writers(stream)
    writers.rounds(1)
    tagged = snapshot_of_step(stream, 4)
    lake.sql(f"ALTER TABLE {lake.table()} CREATE TAG spark_tag")
    lake.sql(f"ALTER TABLE {lake.table()} CREATE BRANCH spark_branch")
    writers.rounds(2)  # 8 more commits on main, each expiring all but the 2 newest unreferenced snapshots
    refs = stream.refresh().table.metadata.refs
    assert refs["spark_tag"].snapshot_id == refs["spark_branch"].snapshot_id == tagged
    first = expected_rows(writers.published, range(1, 5))
    assert spark_rows(lake.sql(f"SELECT * FROM {lake.table()} VERSION AS OF 'spark_tag'")) == first
    assert spark_rows(lake.sql(f"SELECT * FROM {lake.table()}.branch_spark_branch")) == first
    # Spark's branch is a branch of the stream: lakestream reads it and producers commit on it at step 5
    assert stream.head_step(branch="spark_branch") == 4
    assert lakestream_rows(stream, range(1, 5), branch="spark_branch") == first
    result = stream.producer("d", branch="spark_branch").commit(shards("d", 0))
    assert (result.step, result.duplicate) == (5, False)
    on_branch = spark_rows(lake.sql(f"SELECT * FROM {lake.table()}.branch_spark_branch"))
    assert on_branch == {**first, **expected_rows({5: ("d", 0)})}
    assert_intact(lake, writers, head=12)  # main is untouched


def test_a_payload_column_renamed_by_spark_is_refused_until_it_is_renamed_back(lake: Lake) -> None:
    stream = create(lake)
    writers = Writers(stream)
    writers.rounds(1)
    lake.sql(f"ALTER TABLE {lake.table()} RENAME COLUMN tokens TO token_ids")
    with pytest.raises(lakestream_iceberg.SchemaMismatchError) as refused:
        Stream.open(lake.catalog, IDENTIFIER).producer("d")
    assert "tokens" in str(refused.value)
    lake.sql(f"ALTER TABLE {lake.table()} RENAME COLUMN token_ids TO tokens")
    assert_intact(lake, writers, head=4)


def test_a_snapshot_retention_spark_sets_on_main_is_kept_and_honoured(lake: Lake) -> None:
    """Spark's branch retention lives on the ref: lakestream's commits dropped it and expired down to retain-last."""
    stream = create(lake, **{"lakestream.snapshots.retain-last": "2"})
    writers = Writers(stream)
    writers.rounds(1)
    lake.sql(f"ALTER TABLE {lake.table()} REPLACE BRANCH main WITH SNAPSHOT RETENTION 6 SNAPSHOTS")
    writers.rounds(2)
    (ref,) = lake.sql(f"SELECT min_snapshots_to_keep FROM {lake.table()}.refs WHERE name = 'main'")
    assert ref.min_snapshots_to_keep == 6
    (row,) = lake.sql(f"SELECT count(*) AS n FROM {lake.table()}.history WHERE is_current_ancestor")
    assert row.n >= 6
    assert_intact(lake, writers, head=12)


def test_a_partition_field_spark_adds_is_refused_until_it_is_dropped(lake: Lake) -> None:
    stream = create(lake)
    writers = Writers(stream)
    writers.rounds(1)
    lake.sql(f"ALTER TABLE {lake.table()} ADD PARTITION FIELD bucket(4, i)")
    with pytest.raises(lakestream_iceberg.ConfigError, match="not a lakestream layout"):
        writers.commit("a")
    lake.sql(f"ALTER TABLE {lake.table()} DROP PARTITION FIELD bucket(4, i)")
    assert_intact(lake, writers, head=4)


def test_a_snapshot_spark_cherry_picks_onto_main_is_refused_until_repair_rolls_it_back(lake: Lake) -> None:
    """Spark's ``cherrypick_snapshot`` of a branch's lakestream snapshot onto a main that moved on adds the picked
    snapshot's files in a new snapshot whose summary names it (``source-snapshot-id``) and copies none of its
    ``lakestream.*`` keys (Iceberg 1.10.2): another engine's data change, refused until ``repair`` rolls main back
    with every step intact. (An engine that copied the keys too is refused as well: ``test_interop.py``.)"""
    stream = create(lake)
    writers = Writers(stream)
    writers.rounds(1)  # steps 1-4
    lake.sql(f"ALTER TABLE {lake.table()} CREATE BRANCH side")
    picked = stream.producer("d", branch="side").commit(shards("d", 0))  # step 5 of branch side
    last = writers.commit("a")  # step 5 of main
    lake.sql(f"CALL {lake.name}.system.cherrypick_snapshot('{IDENTIFIER}', {picked.snapshot_id})")
    foreign = foreign_snapshots(stream)
    head = stream.refresh().head()
    assert head.snapshot_id != picked.snapshot_id and head.parent_snapshot_id == last.snapshot_id
    copied = head.summary.additional_properties
    assert copied.get("source-snapshot-id") == str(picked.snapshot_id), copied
    assert not [key for key in copied if key.startswith("lakestream.")], copied
    assert foreign == [head.snapshot_id]
    with pytest.raises(lakestream_iceberg.ForeignSnapshotError, match=str(head.snapshot_id)):
        writers.commit("b")
    with pytest.raises(lakestream_iceberg.ForeignSnapshotError):
        stream.read(5, rank=0)
    report = stream.repair()
    assert (report.rolled_back_to, list(report.foreign), report.step) == (last.snapshot_id, foreign, 5)
    assert_intact(lake, writers, head=5)
