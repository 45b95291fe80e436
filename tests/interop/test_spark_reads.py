"""Spark reads a lakestream table as the stream published it (issue #37): batch reads, time travel, incremental reads
and structured streaming, across manifest merges (``merge-fanout`` 2: every other commit merges) and group commits.

Iceberg's incremental and streaming scans take a snapshot's new files from the manifests that snapshot added, and only
their ADDED entries: a commit that merges manifests must still mark its own new files ADDED (with its own snapshot id),
and each snapshot of a group its own, or those readers skip the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.interop.checks import (
    PAYLOAD,
    Lake,
    Rows,
    Writers,
    create,
    expected_rows,
    incremental,
    lakestream_rows,
    snapshot_of_step,
    spark_rows,
)

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("layout", ["per-rank", "packed"])
def test_a_spark_batch_read_returns_what_lakestream_reads_for_every_step_and_rank(lake: Lake, layout: str) -> None:
    stream = create(lake, **{"lakestream.layout": layout})
    writers = Writers(stream)
    writers.rounds(2)  # 8 steps: two group commits, a merge every other commit
    assert stream.head_step() == 8
    table = lake.spark.table(lake.table())
    assert table.columns == [*PAYLOAD, "_step", "_rank"]
    got = spark_rows(table.collect())
    assert got == lakestream_rows(stream, range(1, 9))
    assert got == expected_rows(writers.published)


def test_time_travel_to_a_steps_snapshot_returns_every_step_up_to_it(lake: Lake) -> None:
    stream = create(lake, **{"lakestream.snapshots.retain-last": "64"})
    writers = Writers(stream)
    writers.rounds(2)
    for step in range(1, 9):
        snapshot_id = snapshot_of_step(stream, step)
        got = spark_rows(lake.sql(f"SELECT * FROM {lake.table()} VERSION AS OF {snapshot_id}"))
        assert got == expected_rows(writers.published, range(1, step + 1)), f"time travel to step {step}"


def test_an_incremental_read_delivers_every_step_once_across_merges_and_group_commits(lake: Lake) -> None:
    stream = create(lake, **{"lakestream.snapshots.retain-last": "64"})
    writers = Writers(stream)
    writers.rounds(3)  # 12 steps: 3 groups
    ids = {step: snapshot_of_step(stream, step) for step in range(1, 13)}
    for step in range(2, 13):  # each snapshot alone: exactly its own step
        assert incremental(lake, ids[step - 1], ids[step]) == expected_rows(writers.published, [step]), f"step {step}"
    assert incremental(lake, ids[1], ids[12]) == expected_rows(writers.published, range(2, 13))
    assert incremental(lake, ids[5], ids[10]) == expected_rows(writers.published, range(6, 11))  # from inside a group


class Collected:
    """A ``foreachBatch`` sink: every micro-batch's rows, in the order Spark delivered them."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[Any]]] = []

    def __call__(self, frame: Any, batch_id: int) -> None:
        self.batches.append((batch_id, frame.collect()))

    def rows(self) -> Rows:
        """Everything delivered so far; a step delivered twice shows as doubled rows."""
        return spark_rows(row for _, rows in self.batches for row in rows)


def start_query(lake: Lake, sink: Collected, checkpoint: Path, *, available_now: bool = False) -> Any:
    # lifecycle GC commits `delete` snapshots (metadata only: the steps below the oldest checkpoint leave the table);
    # a streaming reader skips them as it would Iceberg's own expiry of old data
    source = lake.spark.readStream.format("iceberg").option("streaming-skip-delete-snapshots", "true")
    writer = source.load(lake.table()).writeStream.foreachBatch(sink)
    writer = writer.option("checkpointLocation", str(checkpoint))
    if available_now:
        writer = writer.trigger(availableNow=True)
    return writer.start()


def test_structured_streaming_delivers_every_step_once_while_producers_commit(lake: Lake, tmp_path: Path) -> None:
    stream = create(lake)
    writers = Writers(stream)
    writers.commit("a")
    writers.commit("b")
    sink = Collected()
    query = start_query(lake, sink, tmp_path / "checkpoint")
    try:
        for _ in range(3):
            query.processAllAvailable()  # returns once every snapshot committed so far is in the sink
            assert sink.rows() == expected_rows(writers.published)
            writers.rounds(1)  # four more steps, a group among them, while the query runs
        query.processAllAvailable()
        assert query.exception() is None
    finally:
        query.stop()
    assert sink.rows() == expected_rows(writers.published) == lakestream_rows(stream, range(1, 15))
    assert len(sink.batches) >= 4  # one micro-batch at least per round: the steps really arrived while it ran


def test_structured_streaming_continues_across_lifecycle_gc(lake: Lake, tmp_path: Path) -> None:
    """Lifecycle GC between two micro-batches: the steps below the checkpoint leave the table (a ``delete``
    snapshot, which the reader skips), the reader already has them, and the steps after GC arrive once. The
    retention covers the test (docs/interop.md: streaming works with ``streaming-skip-delete-snapshots=true`` and a
    retention that covers the trigger interval)."""
    stream = create(lake, **{"history.expire.max-snapshot-age-ms": "3600000"})
    writers = Writers(stream)
    writers.rounds(1)
    sink = Collected()
    query = start_query(lake, sink, tmp_path / "checkpoint")
    try:
        query.processAllAvailable()
        assert sink.rows() == expected_rows(writers.published)
        stream.checkpoint("ckpt", step=4)
        assert stream.collect_garbage(dry_run=False, keep_last=1).collected_below == {"main": 4}
        writers.rounds(1)  # steps 5..8 after GC
        query.processAllAvailable()
        assert query.exception() is None
    finally:
        query.stop()
    assert sink.rows() == expected_rows(writers.published)
    assert lakestream_rows(stream, range(4, 9)) == expected_rows(writers.published, range(4, 9))


@pytest.mark.parametrize("set_by", ["create", "spark-while-producing"])
def test_a_streaming_reader_resumes_after_more_steps_than_retain_last_within_the_max_snapshot_age(
        lake: Lake, tmp_path: Path, set_by: str) -> None:
    """Iceberg's ``history.expire.max-snapshot-age-ms`` keeps young snapshots although ``retain-last`` is 2: a
    streaming reader whose offset names a snapshot 8 commits old resumes instead of failing with "Cannot load current
    offset at snapshot ..., the snapshot was expired or removed". The property is set when the stream is created, or
    by Spark on a stream whose producers are running (docs/interop.md, "Retention for streaming readers")."""
    age = {"history.expire.max-snapshot-age-ms": "3600000"}
    stream = create(lake, **{"lakestream.snapshots.retain-last": "2", **(age if set_by == "create" else {})})
    writers = Writers(stream)
    writers.commit("a")
    writers.commit("b")
    if set_by == "spark-while-producing":
        lake.sql(f"ALTER TABLE {lake.table()} SET TBLPROPERTIES ('history.expire.max-snapshot-age-ms' = '3600000')")
    first, second = Collected(), Collected()
    query = start_query(lake, first, tmp_path / "checkpoint", available_now=True)
    query.awaitTermination()
    assert query.exception() is None and first.rows() == expected_rows(writers.published, [1, 2])
    offset_snapshot = snapshot_of_step(stream, 2)
    writers.rounds(2)  # 8 more commits: the reader's offset is far outside the 2 newest
    metadata = stream.refresh().table.metadata
    assert metadata.snapshot_by_id(offset_snapshot) is not None, "a snapshot younger than the max age was expired"
    query = start_query(lake, second, tmp_path / "checkpoint", available_now=True)
    query.awaitTermination()
    assert query.exception() is None
    assert second.rows() == expected_rows(writers.published, range(3, 11))


def test_spark_loads_the_table_after_commits_from_a_host_whose_clock_lags_the_last_committers(
        lake: Lake, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint made on a host whose clock runs 5 minutes ahead, then a producer's commit and a release on hosts
    whose clocks are right: their metadata was dated 5 minutes before the checkpoint's, and Spark refused to load the
    table ("Invalid update timestamp ...: before the latest metadata log entry timestamp ...")."""
    import time

    from lakestream_iceberg.format import snapshots
    from lakestream_iceberg.lifecycle import checkpoint

    class Ahead:
        @staticmethod
        def time() -> float:
            return time.time() + 300

    stream = create(lake)
    writers = Writers(stream)
    writers.rounds(1)
    for name, step in (("c1", 1), ("c2", 2)):
        with monkeypatch.context() as patched:
            patched.setattr(snapshots, "time", Ahead)
            patched.setattr(checkpoint, "time", Ahead)
            stream.checkpoint(name, step=step)
        if name == "c1":
            writers.commit("a")  # a snapshot of its own
        else:
            stream.release(name)  # a commit that adds no snapshot
        got = spark_rows(lake.spark.table(lake.table()).collect())
        assert got == lakestream_rows(stream, range(1, stream.head_step() + 1))
