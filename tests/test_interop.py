"""A stream is a plain Iceberg table in fact: incremental reads see every step, and what other engines commit to it
never makes lakestream republish, skip or mis-read a step (the engine-independent half of the compatibility contract;
the Spark half is in tests/interop/)."""

from __future__ import annotations

import os
import re
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.manifest import ManifestEntryStatus, write_manifest_list
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.snapshots import Operation, Snapshot, Summary
from pyiceberg.table.update import AddSnapshotUpdate, AssertRefSnapshotId, SetSnapshotRefUpdate

from lakestream_iceberg import ForeignSnapshotError, SchemaMismatchError, Stream
from lakestream_iceberg.errors import ConfigError, LifecycleError, SequenceError
from lakestream_iceberg.format.summary import StreamState
from lakestream_iceberg.read.history_rows import utc_from_ms
from tests.support import SCHEMA, batch, digest, foreign_append, foreign_delete, sqlite_catalog

WORLD = 2


def make(tmp_path: Path, world: int = WORLD, **props: str) -> Stream:
    return Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=world,
                         properties={"lakestream.snapshots.retain-last": "500", **props})


def lineage(stream: Stream) -> list[Snapshot]:
    """The main branch's snapshots, oldest first."""
    metadata = stream.refresh().table.metadata
    out, current = [], metadata.snapshot_by_name("main")
    while current is not None:
        out.append(current)
        current = metadata.snapshot_by_id(current.parent_snapshot_id) if current.parent_snapshot_id else None
    return out[::-1]


def incremental_steps(stream: Stream, snapshot: Snapshot) -> list[int]:
    """The ``_step`` of every row an incremental append scan over (parent, snapshot] returns, as Iceberg Java's
    IncrementalAppendScan, Spark's start/end-snapshot-id reads and Spark streaming take them."""
    scan = stream.table.incremental_append_scan(from_snapshot_id_exclusive=snapshot.parent_snapshot_id,
                                                to_snapshot_id_inclusive=snapshot.snapshot_id, selected_fields=("_step",))
    return sorted(scan.to_arrow()["_step"].to_pylist())


def rows_of(stream: Stream, step: int) -> list[str]:
    return [digest(stream.read(step, rank=r)) for r in range(stream.world_size)]


def test_every_step_of_a_merging_stream_is_an_incremental_append(tmp_path: Path) -> None:
    """Each commit whose manifests merge keeps its own files ADDED in the merged manifest: an incremental reader of each
    snapshot gets exactly that step's rows, and the manifests' added counts match the summary's."""
    stream = make(tmp_path, world=1, **{"lakestream.manifest.merge-fanout": "4"})  # merges every 4th commit or more
    producer = stream.producer("p")
    for seq in range(40):
        producer.commit([_rows(seq)], seq=seq)
    snapshots = lineage(stream)
    assert len(snapshots) == 40
    merged = 0
    for snapshot in snapshots:
        step = StreamState.of(snapshot).step
        assert incremental_steps(stream, snapshot) == [step] * 3, f"step {step} is not an incremental append"
        own = [m for m in snapshot.manifests(stream.io) if m.added_snapshot_id == snapshot.snapshot_id]
        added = sum(m.added_files_count or 0 for m in own)
        assert added == int(snapshot.summary["added-data-files"]) == 1
        entries = [e for m in own for e in m.fetch_manifest_entry(stream.io, discard_deleted=False)]
        assert [e.status for e in entries if e.snapshot_id == snapshot.snapshot_id] == [ManifestEntryStatus.ADDED]
        merged += any(e.snapshot_id != snapshot.snapshot_id for e in entries)
    assert merged >= 10  # merges were frequent: the rule was exercised


def _rows(seq: int) -> pa.Table:
    return pa.table({"producer": ["p"] * 3, "seq": [seq] * 3, "rank": [0] * 3, "i": [0, 1, 2],
                     "tokens": [[seq]] * 3, "image": [b"x"] * 3}, schema=SCHEMA)


def test_a_group_commit_is_an_incremental_append_for_every_batch(tmp_path: Path) -> None:
    """Group commits with merges: every snapshot of the lineage is one step as an incremental read sees it."""
    stream = make(tmp_path, **{"lakestream.manifest.merge-fanout": "2"})
    a, b = stream.producer("a"), stream.producer("b")
    for seq in range(3):
        a.commit(batch("a", seq, WORLD), seq=seq)
        b.commit(batch("b", seq, WORLD), seq=seq)
    for round_ in range(6):
        for producer in ("c", "d", "e"):  # staged batches: the next commit carries them, a group of four
            staged = stream.writer.write(producer=producer, seq=round_, shards=batch(producer, round_, WORLD))
            stream.staging.stage(branch="main", batch=staged, allow_gap=False)
            time.sleep(0.002)
        b.commit(batch("b", 3 + round_, WORLD), seq=3 + round_)
    snapshots = lineage(stream)
    groups = [StreamState.of(s).group for s in snapshots]
    assert max(groups) == 4
    total = 0
    for snapshot in snapshots:
        step = StreamState.of(snapshot).step
        expected = sum(t.num_rows for t in (stream.read(step, rank=r) for r in range(WORLD)))
        found = incremental_steps(stream, snapshot)
        assert found == [step] * expected
        total += len(found)
    assert total == len(stream.table.scan(selected_fields=("_step",)).to_arrow())  # each row exactly once


# --------------------------------------------------------------------------------------------------- foreign snapshots


def commit_replace(stream: Stream, timestamp_ms: int | None = None, properties: dict[str, str] | None = None) -> Snapshot:
    """What ``rewrite_manifests`` commits: a ``replace`` snapshot listing the same files (here: the same manifests in a
    new manifest list), no data changed, no ``lakestream.*`` keys (``properties``: summary keys to add, such as the
    head's copied by a tool); dated ``timestamp_ms`` (default: now)."""
    table = stream.refresh().table
    metadata = table.metadata
    head = metadata.current_snapshot()
    assert head is not None
    snapshot_id = metadata.new_snapshot_id()
    sequence_number = metadata.next_sequence_number()
    path = f"{metadata.location}/metadata/snap-{snapshot_id}-1-{uuid.uuid4()}.avro"
    with write_manifest_list(format_version=metadata.format_version, output_file=table.io.new_output(path),
                             snapshot_id=snapshot_id, parent_snapshot_id=head.snapshot_id,
                             sequence_number=sequence_number, avro_compression="deflate") as writer:
        writer.add_manifests(head.manifests(table.io))
    totals = {k: v for k, v in head.summary.additional_properties.items() if k.startswith("total-")}
    snapshot = Snapshot(snapshot_id=snapshot_id, parent_snapshot_id=head.snapshot_id, sequence_number=sequence_number,
                        manifest_list=path, schema_id=metadata.current_schema_id,
                        **({} if timestamp_ms is None else {"timestamp_ms": timestamp_ms}),
                        summary=Summary(Operation.REPLACE, **totals, **{"manifests-created": "0", "manifests-kept": "1",
                                                                      "engine-name": "test"}, **(properties or {})))
    with table.transaction() as tx:
        tx._apply((AddSnapshotUpdate(snapshot=snapshot),
                   SetSnapshotRefUpdate(ref_name="main", type=SnapshotRefType.BRANCH, snapshot_id=snapshot_id)),
                  (AssertRefSnapshotId(ref="main", snapshot_id=head.snapshot_id),))
    return snapshot


def published(stream: Stream, world: int = WORLD) -> tuple[Stream, dict[int, list[str]]]:
    a, b = stream.producer("a"), stream.producer("b")
    for seq in range(4):
        assert a.commit(batch("a", seq, world), seq=seq).step == 2 * seq + 1
        assert b.commit(batch("b", seq, world), seq=seq).step == 2 * seq + 2
    return stream, {step: rows_of(stream, step) for step in range(1, 9)}


def test_a_metadata_only_foreign_snapshot_keeps_exactly_once_and_dense_steps(tmp_path: Path) -> None:
    stream, before = published(make(tmp_path))
    foreign = commit_replace(stream)
    assert "lakestream.step" not in foreign.summary.additional_properties
    assert stream.head_step() == 8  # not 0: the state is the nearest lakestream ancestor's
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before
    # published (producer, seq) pairs are duplicates at their original steps, in a new process's view too
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    a, b = again.producer("a"), again.producer("b")
    first = a.commit(batch("a", 0, WORLD), seq=0)
    assert (first.duplicate, first.step) == (True, 1)
    last = b.commit(batch("b", 3, WORLD), seq=3)
    assert (last.duplicate, last.step) == (True, 8)
    assert a.next_seq == 4
    # new commits land densely on top of the foreign snapshot, and every step still reads what it published
    new = a.commit(batch("a", 4, WORLD), seq=4)
    assert (new.step, new.duplicate) == (9, False)
    metadata = again.refresh().table.metadata
    assert metadata.snapshot_by_id(new.snapshot_id).parent_snapshot_id == foreign.snapshot_id
    assert {step: rows_of(again, step) for step in range(1, 9)} == before
    assert incremental_steps(again, metadata.snapshot_by_id(new.snapshot_id)) == [9] * sum(
        again.read(9, rank=r).num_rows for r in range(WORLD))


@pytest.mark.parametrize("ahead_ms", [int(time.time() * 1000) * 999, 10 * 365 * 86_400_000],
                         ids=["microseconds-as-milliseconds", "ten-years-ahead"])
def test_a_foreign_snapshot_dated_in_the_future_keeps_checkpoints_and_history_working(tmp_path: Path, ahead_ms: int) -> None:
    """Every snapshot after a future-dated one is dated after it (Iceberg timestamps never go back): checkpoints of
    the later steps raised a raw ValueError (year out of range) or were dated in the future, which GC's keep_within
    never released; they carry their creation time, and history shows what no datetime holds as NULL."""
    stream, _ = published(make(tmp_path))
    foreign = commit_replace(stream, timestamp_ms=int(time.time() * 1000) + ahead_ms)
    assert stream.producer("a").commit(batch("a", 4, WORLD), seq=4).step == 9
    before = time.time()
    made = [stream.checkpoint("c8", step=8), stream.checkpoint("c9", step=9)]
    after = time.time()
    assert stream.refresh().table.metadata.snapshot_by_id(made[1].snapshot_id).timestamp_ms > foreign.timestamp_ms
    listed = stream.checkpoints()
    assert [c.name for c in listed] == ["c8", "c9"]
    for checkpoint in (*made, *listed):
        assert before - 1 <= checkpoint.created_at.timestamp() <= after + 1
    assert stream.fork("c9", branch="f").step == 9
    assert stream.producer("a", branch="f").commit(batch("a", 0, WORLD), seq=0).step == 10  # a fork: fresh seqs
    rows = stream.history().sql("SELECT step, committed_at FROM snapshots ORDER BY step NULLS FIRST").fetchall()
    assert [step for step, _ in rows] == [None, *range(1, 10)]
    assert all(at is not None for step, at in rows if step is not None and step <= 8)
    out_of_range = ahead_ms > 9_999 * 365 * 86_400_000
    assert all((at is None) == out_of_range for _, at in rows[:1] + rows[-1:])  # the foreign snapshot and step 9
    report = stream.collect_garbage(dry_run=False, keep_within=timedelta(hours=1), grace=timedelta(0),
                                    allow_short_grace=True)
    assert report.released_checkpoints == [] and report.collected_below == {"main": 8}


def java_refuses(metadata) -> str | None:  # noqa: ANN001 - pyiceberg's TableMetadata
    """Iceberg's Java ``TableMetadata`` checks (which Spark, Trino and Java REST catalogs run on every load and commit):
    last-updated-ms no more than a minute before the last snapshot-log and metadata-log entries."""
    for what, entries in (("snapshot log", metadata.snapshot_log), ("metadata log", metadata.metadata_log)):
        if entries and metadata.last_updated_ms - entries[-1].timestamp_ms < -60_000:
            return f"Invalid update timestamp {metadata.last_updated_ms}: before the last {what} entry " \
                   f"{entries[-1].timestamp_ms}"
    return None


def test_commits_from_a_host_whose_clock_lags_the_last_committers_leave_metadata_java_engines_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot was dated no earlier than its parent on the branch, and a commit adding none was dated by this host's
    clock: after a checkpoint made on a host whose clock runs 5 minutes ahead (the table's last update then), the next
    producer commit and the next release dated the table 5 minutes back, and Java engines refused the metadata
    ("Invalid update timestamp ...: before the latest metadata log entry"). The table's dates never go back now."""
    from lakestream_iceberg.format import snapshots
    from lakestream_iceberg.lifecycle import checkpoint

    class Ahead:  # the clock of the host that makes the checkpoints
        @staticmethod
        def time() -> float:
            return time.time() + 300

    stream, _ = published(make(tmp_path))
    for name, step in (("c7", 7), ("c8", 8)):
        with monkeypatch.context() as patched:
            patched.setattr(snapshots, "time", Ahead)
            patched.setattr(checkpoint, "time", Ahead)
            stream.checkpoint(name, step=step)
        if name == "c7":
            assert stream.producer("a").commit(batch("a", 4, WORLD), seq=4).step == 9  # a snapshot of its own
        else:
            stream.release(name)  # a commit that adds no snapshot
        metadata = stream.refresh().table.metadata
        assert java_refuses(metadata) is None, java_refuses(metadata)


def test_a_restarted_producer_replays_its_published_seqs_after_a_commit_from_a_host_whose_clock_runs_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted producer tells its dead incarnation's batches (a replay: duplicate=True) from a live twin's by when
    each was sent, which for a batch committed directly was its snapshot's timestamp. A table's dates never go back,
    so after a checkpoint made on a host whose clock runs 5 minutes ahead every commit for 5 minutes was dated after
    it: the restart's replay of the seq committed meanwhile raised ProducerConflictError ("another live process is
    using producer id"). Direct commits record when the call began (``lakestream.sent-at-ms``) by their own clock."""
    from lakestream_iceberg.format import snapshots
    from lakestream_iceberg.lifecycle import checkpoint

    class Ahead:  # the clock of the host that makes the checkpoint
        @staticmethod
        def time() -> float:
            return time.time() + 300

    stream, _ = published(make(tmp_path))
    with monkeypatch.context() as patched:
        patched.setattr(snapshots, "time", Ahead)
        patched.setattr(checkpoint, "time", Ahead)
        stream.checkpoint("c8", step=8)
    dead = stream.producer("a")
    sent = dead.commit(batch("a", 4, WORLD), seq=4)  # its process dies here
    assert stream.refresh().table.metadata.snapshot_by_id(sent.snapshot_id).timestamp_ms > time.time() * 1000 + 60_000
    restarted = Stream.open(stream.table.catalog, "ns.stream").producer("a")
    replay = restarted.commit(batch("a", 4, WORLD), seq=4)
    assert (replay.duplicate, replay.step) == (True, sent.step)


def test_a_foreign_snapshot_with_copied_lakestream_keys_is_never_taken_for_the_step_it_copied(tmp_path: Path) -> None:
    """A metadata-only snapshot of another engine that copied the head's ``lakestream.*`` keys (naming the head in
    ``lakestream.snapshot-id``) is not lakestream's (lineage.is_lakestream): commits go on over it. The history joined
    it to the step it copied (``batches`` showed its id and time for step 8, ``lakestream tail`` too, ``snapshots`` an
    ``append`` of step 8 twice) and the lag dated step 8 at its time, an hour late: a rank behind step 8 showed lag_s 0."""
    from lakestream_iceberg.connect.positions import PositionStore
    from lakestream_iceberg.read.history_rows import step_rows
    from lakestream_iceberg.read.lag import consumer_lags
    from lakestream_iceberg.read.position import Position

    stream, _ = published(make(tmp_path))
    head = stream.table.metadata.snapshot_by_name("main")
    copied = {k: v for k, v in head.summary.additional_properties.items() if k.startswith("lakestream.")}
    assert copied["lakestream.snapshot-id"] == str(head.snapshot_id)
    foreign = commit_replace(stream, timestamp_ms=head.timestamp_ms + 3_600_000, properties=copied)
    assert stream.refresh().head_step() == 8
    con = stream.history()
    assert con.sql("SELECT snapshot_id, committed_at FROM batches WHERE step = 8").fetchall() == [
        (head.snapshot_id, utc_from_ms(head.timestamp_ms))]
    rows = con.sql("SELECT op, step, producer, seq, committer FROM snapshots WHERE snapshot_id = "
                   f"{foreign.snapshot_id}").fetchall()
    assert rows == [(None, None, None, None, None)]
    assert con.sql("SELECT count(*) FROM snapshots WHERE step = 8").fetchall() == [(1,)]
    assert [r["snapshot_id"] for r in step_rows(stream, [8], branch="main")] == [head.snapshot_id]
    uuid_ = str(stream.table.metadata.table_uuid)
    position = Position(group="run", rank=0, stream=uuid_, branch="main", world_size=1, last_step=7, steps=7,
                        started_at=head.timestamp_ms / 1000 - 60, elapsed_s=60.0, wait_s=1.0, read_bytes=0,
                        report_s=5.0, closed=True, host="h", pid=1, workers=0, source="iterator")
    PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location).upsert(
        group="run", rank=0, body=position.to_json())
    (lag,) = consumer_lags(stream, group="run", now=head.timestamp_ms / 1000 + 10)
    assert (lag.lag_steps, lag.lag_s) == (1, pytest.approx(10.0))
    assert stream.producer("a").commit(batch("a", 4, WORLD), seq=4).step == 9  # commits go on over it


def test_a_follower_reads_through_a_metadata_only_foreign_snapshot(tmp_path: Path) -> None:
    stream, before = published(make(tmp_path))
    commit_replace(stream)
    stream.producer("a").commit(batch("a", 4, WORLD), seq=4)
    from lakestream_iceberg.read.follow import HeadWatcher

    watcher = HeadWatcher(stream, branch="main")
    try:
        watcher.check()
        assert watcher.head()[0] == 9
    finally:
        watcher.close()
    assert stream.wait_for(9, timeout=60) == 9


@pytest.mark.parametrize("write", [foreign_append, foreign_delete], ids=["append", "delete"])
def test_a_foreign_data_change_is_refused_loudly_and_repair_brings_the_stream_back(tmp_path: Path, write) -> None:
    stream, before = published(make(tmp_path))
    base = stream.refresh().table.metadata.current_snapshot()
    write(stream)
    foreign = stream.refresh().table.metadata.current_snapshot()
    assert foreign.snapshot_id != base.snapshot_id
    producer = stream.producer("a")
    # the next commit and the next read refuse it, naming the snapshot and the way back; nothing is published
    with pytest.raises(ForeignSnapshotError, match=rf"snapshot {foreign.snapshot_id} .*stream.repair\(\)") as err:
        producer.commit(batch("a", 0, WORLD), seq=0)
    assert err.value.snapshot_id == foreign.snapshot_id
    with pytest.raises(ForeignSnapshotError):
        producer.commit(batch("a", 4, WORLD), seq=4)
    with pytest.raises(ForeignSnapshotError):
        stream.read(1, rank=0)
    with pytest.raises(ForeignSnapshotError):
        stream.head_step()
    assert stream.refresh().table.metadata.current_snapshot().snapshot_id == foreign.snapshot_id  # nothing published
    # a dry run says what it would do and changes nothing
    plan = stream.repair(dry_run=True)
    assert (plan.rolled_back_to, plan.foreign, plan.step, plan.repaired) == (base.snapshot_id, (foreign.snapshot_id,), 8,
                                                                             False)
    assert stream.refresh().table.metadata.current_snapshot().snapshot_id == foreign.snapshot_id
    report = stream.repair()
    assert (report.rolled_back_to, report.foreign, report.step, report.repaired) == (base.snapshot_id,
                                                                                     (foreign.snapshot_id,), 8, True)
    assert stream.head_step() == 8
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before
    assert (producer.commit(batch("a", 0, WORLD), seq=0).duplicate, producer.commit(batch("a", 3, WORLD), seq=3).step) == (True, 7)
    assert producer.commit(batch("a", 4, WORLD), seq=4).step == 9
    assert stream.repair().foreign == ()  # nothing left to repair


def test_a_foreign_append_before_the_first_step_is_repaired_back_to_an_empty_stream(tmp_path: Path) -> None:
    """Another engine writes main's first snapshot (an append) before any step is published: nothing lakestream wrote
    is below it, and nothing was expired either. Repair removed nothing and refused for good ("expired"); now it
    removes main's ref (the state of a new stream), and the first step is then step 1."""
    stream = make(tmp_path)
    foreign_append(stream)
    foreign = stream.refresh().table.metadata.current_snapshot()
    assert foreign is not None and foreign.parent_snapshot_id is None
    producer = stream.producer("a")
    with pytest.raises(ForeignSnapshotError):
        producer.commit(batch("a", 0, WORLD), seq=0)
    plan = stream.repair(dry_run=True)
    assert (plan.foreign, plan.rolled_back_to, plan.step, plan.repaired) == ((foreign.snapshot_id,), None, 0, False)
    assert stream.refresh().table.metadata.current_snapshot().snapshot_id == foreign.snapshot_id
    report = stream.repair()
    assert (report.foreign, report.rolled_back_to, report.step, report.repaired) == ((foreign.snapshot_id,), None, 0,
                                                                                     True)
    assert stream.refresh().table.metadata.current_snapshot() is None and "main" not in stream.table.metadata.refs
    assert stream.repair().foreign == ()  # nothing left to repair
    # again, after GC expired the first foreign snapshot: the second one is main's root too (sequence number 2)
    stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert [s.snapshot_id for s in stream.refresh().table.metadata.snapshots] == []
    foreign_append(stream)
    with pytest.raises(ForeignSnapshotError):
        producer.commit(batch("a", 0, WORLD), seq=0)
    assert stream.repair().cleared and stream.refresh().table.metadata.current_snapshot() is None
    assert producer.commit(batch("a", 0, WORLD), seq=0).step == 1
    assert stream.producer("b").commit(batch("b", 0, WORLD)).step == 2
    assert stream.head_step() == 2
    assert digest(stream.read(1, rank=1)) == digest(batch("a", 0, WORLD)[1])


def _refused_not_cleared(stream: Stream, foreign: int) -> None:
    """Repair refuses (dry run and real), and main still points at the foreign head: nothing was cleared."""
    with pytest.raises(ForeignSnapshotError, match="cannot be repaired automatically"):
        stream.repair(dry_run=True)
    with pytest.raises(ForeignSnapshotError, match="cannot be repaired automatically"):
        stream.repair()
    assert stream.refresh().table.metadata.refs["main"].snapshot_id == foreign


def test_a_foreign_append_whose_parent_pyicebergs_expiry_removed_is_refused_not_cleared(tmp_path: Path) -> None:
    """The other root a foreign data change can be: its parent (main's published steps) expired by pyiceberg, which
    clears the parent id. Its summary counts the steps' files, so repair refuses instead of emptying main."""
    stream, _ = published(make(tmp_path))
    foreign_append(stream)
    table = stream.refresh().table
    foreign = table.metadata.current_snapshot()
    table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in table.metadata.snapshots
                                                 if s.snapshot_id != foreign.snapshot_id]).commit()
    assert stream.refresh().table.metadata.current_snapshot().parent_snapshot_id is None
    _refused_not_cleared(stream, foreign.snapshot_id)


def test_a_foreign_append_on_a_table_another_engine_emptied_is_refused_not_cleared(tmp_path: Path) -> None:
    """A published stream with a checkpoint: another engine deletes every row (its snapshot holds no data file), then
    appends, and pyiceberg's expiry removes what no ref holds. The append is a root whose totals count only its own
    files, as before a first step, but steps were published (the checkpoint's snapshot is lakestream's): clearing main
    would restart the stream at step 1 under a checkpoint of step 8, so repair refuses."""
    stream, _ = published(make(tmp_path))
    stream.checkpoint("ck", step=8)
    stream.refresh().table.delete("_step >= 0")
    foreign_append(stream)
    table = stream.refresh().table
    foreign = table.metadata.current_snapshot()
    held = {r.snapshot_id for r in table.metadata.refs.values()}
    table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in table.metadata.snapshots
                                                 if s.snapshot_id not in held]).commit()
    assert stream.refresh().table.metadata.current_snapshot().parent_snapshot_id is None
    _refused_not_cleared(stream, foreign.snapshot_id)


def test_a_foreign_append_on_a_table_emptied_and_expired_to_its_head_is_refused_not_cleared(tmp_path: Path) -> None:
    """As above without a checkpoint: pyiceberg's expiry left no snapshot but the foreign append's, so the table's
    snapshots say nothing of the steps. The earlier metadata files (its metadata log) still list them: refused."""
    stream, _ = published(make(tmp_path))
    stream.refresh().table.delete("_step >= 0")
    foreign_append(stream)
    table = stream.refresh().table
    foreign = table.metadata.current_snapshot()
    table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in table.metadata.snapshots
                                                 if s.snapshot_id != foreign.snapshot_id]).commit()
    assert [s.snapshot_id for s in stream.refresh().table.metadata.snapshots] == [foreign.snapshot_id]
    _refused_not_cleared(stream, foreign.snapshot_id)


def test_repair_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    stream, _ = published(make(tmp_path))
    with pytest.raises(LifecycleError, match="no branch 'nope'"):
        stream.repair(branch="nope")
    with pytest.raises(LifecycleError, match="dry_run"):
        stream.repair(dry_run="yes")  # type: ignore[arg-type]
    assert stream.repair().rolled_back_to is None


def test_lakestream_repair_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lakestream_iceberg.tools.cli import main
    from lakestream_iceberg.tools.config import embedded_catalog

    stream = Stream.create(embedded_catalog(tmp_path), "ns.cli", schema=SCHEMA, world_size=WORLD)
    _, before = published(stream)
    base = stream.refresh().table.metadata.current_snapshot().snapshot_id
    foreign_delete(stream)
    foreign = stream.refresh().table.metadata.current_snapshot().snapshot_id

    def cli(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["--home", str(tmp_path), *args])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return code, out, err

    code, _, err = cli("status", "ns.cli")
    assert code == 1 and str(foreign) in err and "lakestream repair" in err
    code, out, _ = cli("repair", "ns.cli", "--dry-run", "--json")
    assert code == 0 and json.loads(out) == {"branch": "main", "foreign": [foreign], "rolled_back_to": base, "step": 8,
                                             "dry_run": True, "rebased_on": None,
                                             "changes": ["overwrite: deleted-data-files=2, deleted-records=6"],
                                             "cleared": False}
    code, out, _ = cli("repair", "ns.cli")
    assert code == 0 and str(base) in out
    code, out, _ = cli("status", "ns.cli", "--json")
    assert code == 0 and json.loads(out)["head_step"] == 8
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before
    code, out, _ = cli("repair", "ns.cli")
    assert code == 0 and "nothing to repair" in out


def test_a_branch_forked_by_another_process_is_found(tmp_path: Path) -> None:
    stream, _ = published(make(tmp_path))
    other = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    other.fork(other.checkpoint("at5", step=5), branch="lr")
    producer = stream.producer("a", branch="lr")  # this view predates the fork: it looks again before refusing
    assert producer.commit(batch("a", 0, WORLD), seq=0).step == 6
    assert stream.history(branch="lr").sql("SELECT max(step) FROM batches").fetchall() == [(6,)]
    with pytest.raises(ConfigError, match="no branch 'nope'"):
        stream.producer("a", branch="nope")


def metadata_files(stream: Stream) -> set[str]:
    root = Path(stream.table.metadata.location.removeprefix("file://")) / "metadata"
    return {f"file://{p}" for p in root.glob("*.metadata.json")}


def test_old_metadata_files_are_deleted_only_as_the_table_properties_say(tmp_path: Path) -> None:
    stream = make(tmp_path)
    with stream.table.transaction() as tx:  # as a user (or Spark's ALTER TABLE) would set it
        tx.set_properties({"write.metadata.delete-after-commit.enabled": "false"})
    producer = stream.producer("a")
    before = metadata_files(stream)
    for seq in range(20):
        producer.commit(batch("a", seq, WORLD), seq=seq)
    kept = metadata_files(stream.refresh())
    assert before < kept and len(kept - before) == 20  # every commit's metadata.json is still there
    metadata = stream.table.metadata
    aged_out = kept - {e.metadata_file for e in metadata.metadata_log} - {stream.table.metadata_location}
    assert len(metadata.metadata_log) == 16 and len(aged_out) >= 4  # the log is bounded, the files were kept

    with stream.table.transaction() as tx:
        tx.set_properties({"write.metadata.delete-after-commit.enabled": "true", "write.metadata.previous-versions-max": "3"})
    producer = stream.producer("a")
    for seq in range(20, 30):
        producer.commit(batch("a", seq, WORLD), seq=seq)
    metadata = stream.refresh().table.metadata
    log_files = {e.metadata_file for e in metadata.metadata_log}
    assert len(log_files) == 3
    # each file that left the log while deletion was on is gone; those that left it while it was off stay, as with
    # Iceberg's own writers
    assert metadata_files(stream) == log_files | {stream.table.metadata_location} | aged_out


def _add_extra(update) -> None:  # type: ignore[no-untyped-def]
    from pyiceberg.types import LongType

    update.add_column("extra", LongType())


def _move_columns(update) -> None:  # type: ignore[no-untyped-def]
    update.move_first("image")  # Iceberg readers match columns by field id: the files' column order is free
    update.move_after("producer", "tokens")


@pytest.mark.parametrize("layout", ["per-rank", "packed"])
@pytest.mark.parametrize("change", [_add_extra, _move_columns], ids=["add", "move"])
def test_an_added_optional_column_or_moved_columns_keep_producers_writing_and_readers_see_nulls(
        tmp_path: Path, change, layout: str) -> None:  # type: ignore[no-untyped-def]
    stream, before = published(make(tmp_path, **{"lakestream.layout": layout}))
    with stream.table.update_schema() as update:  # a legal Iceberg change by another engine
        change(update)
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    producer = again.producer("a")
    assert producer.commit(batch("a", 3, WORLD), seq=3).duplicate  # state intact
    assert producer.commit(batch("a", 4, WORLD), seq=4).step == 9
    assert stream.producer("b").commit(batch("b", 4, WORLD), seq=4).step == 10  # a producer made before the change
    assert {step: rows_of(again, step) for step in range(1, 9)} == before
    assert again.read(9, rank=1).equals(batch("a", 4, WORLD)[1])  # the stream's payload, as committed
    rows = again.refresh().table.scan(row_filter="_step >= 9").to_arrow()
    order = [("producer", "ascending"), ("rank", "ascending"), ("i", "ascending")]
    committed = pa.concat_tables([*batch("a", 4, WORLD), *batch("b", 4, WORLD)]).sort_by(order)
    assert rows.num_rows > 0 and rows.select(SCHEMA.names).cast(SCHEMA).sort_by(order).equals(committed)  # as Iceberg reads
    if "extra" in rows.column_names:
        assert rows["extra"].null_count == rows.num_rows


@pytest.mark.parametrize(("change", "says"), [
    (lambda u: u.delete_column("i"), "no longer has the payload column 'i'"),
    (lambda u: u.rename_column("tokens", "ids"), "no longer has the payload column 'tokens'"),
    (lambda u: u.add_column("needed", __import__("pyiceberg.types").types.LongType(), required=True),
     r"gained required column\(s\) \['needed'\]"),
    (lambda u: u.update_column("i", required=True), r"made payload field 'i' required.*allows nulls"),
], ids=["drop", "rename", "required", "made-required"])
def test_an_incompatible_schema_change_is_refused_with_what_changed(tmp_path: Path, change, says: str) -> None:
    """Refused for a stream opened after the change, and for a producer (and a stream) made before it, whose writer
    kept the schema of then: it went on publishing files with the dropped or renamed column's data in them."""

    stream, before = published(make(tmp_path))
    running = stream.producer("a")
    running.commit(batch("a", 4, WORLD), seq=4)  # its writer is made: the schema of now
    with stream.table.update_schema(allow_incompatible_changes=True) as update:
        change(update)
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    with pytest.raises(SchemaMismatchError, match=says):
        again.producer("b").commit(batch("b", 0, WORLD), seq=0)
    for commit in (lambda: running.commit(batch("a", 5, WORLD), seq=5),
                   lambda: stream.producer("c").commit(batch("c", 0, WORLD), seq=0)):
        with pytest.raises(SchemaMismatchError, match=says):
            commit()
    assert again.head_step() == 9  # nothing published since
    assert {step: rows_of(again, step) for step in range(1, 9)} == before


NESTED = pa.schema([("id", pa.int64()), ("meta", pa.struct([("a", pa.int32()), ("b", pa.string())]))])


def nested_shard(seq: int) -> pa.Table:
    return pa.table({"id": [seq * 10 + k for k in range(3)],
                     "meta": [{"a": seq * 10 + k, "b": f"s{seq}-{k}"} for k in range(3)]}, schema=NESTED)


@pytest.mark.parametrize(("change", "says"), [
    (lambda u: u.delete_column(("meta", "b")), "no longer has the payload field 'meta.b'"),
    (lambda u: u.rename_column(("meta", "b"), "c"), "no longer has the payload field 'meta.b'"),
    (lambda u: u.add_column(("meta", "c"), __import__("pyiceberg.types").types.StringType(), required=True),
     r"gained required field\(s\) \['meta.c'\]"),
    (lambda u: u.update_column(("meta", "a"), required=True), r"made payload field 'meta.a' required.*allows nulls"),
], ids=["drop", "rename", "required", "made-required"])
def test_an_incompatible_change_inside_a_struct_column_is_refused_with_what_changed(tmp_path: Path, change,
                                                                                    says: str) -> None:
    """Another engine changes a field inside a struct payload column. Only the top-level columns were checked, and
    pyarrow casts a struct by field name: a producer made after a nested field was dropped or renamed published
    steps without its values (read back as nulls where values were written), one made before went on writing it, and
    a required field added or made required was written missing or with nulls. Refused, running producers too."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.nested", schema=NESTED, world_size=1)
    running = stream.producer("a")
    assert running.commit([nested_shard(0)], seq=0).step == 1
    with stream.table.update_schema(allow_incompatible_changes=True) as update:
        change(update)
    for commit in (lambda: running.commit([nested_shard(1)], seq=1),
                   lambda: Stream.open(sqlite_catalog(str(tmp_path)), "ns.nested").producer("b").commit(
                       [nested_shard(1)], seq=0)):
        with pytest.raises(SchemaMismatchError, match=says):
            commit()
    assert stream.head_step() == 1
    assert stream.read(1, rank=0).equals(nested_shard(0))


def test_a_struct_field_dropped_and_added_again_is_refused_to_producers_made_before(tmp_path: Path) -> None:
    """A nested field dropped and added again is another field (a new field id): a producer made before wrote the old
    one, whose values Iceberg readers return as nulls. Refused; a producer made after writes the new field."""
    from pyiceberg.types import StringType

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.nested", schema=NESTED, world_size=1)
    running = stream.producer("a")
    assert running.commit([nested_shard(0)], seq=0).step == 1
    with stream.table.update_schema(allow_incompatible_changes=True) as update:
        update.delete_column(("meta", "b"))
    with stream.refresh().table.update_schema() as update:
        update.add_column(("meta", "b"), StringType())
    with pytest.raises(SchemaMismatchError, match=r"other columns named \['meta.b'\].*Open the stream again"):
        running.commit([nested_shard(1)], seq=1)
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.nested")
    assert again.producer("a").commit([nested_shard(1)], seq=1).step == 2
    rows = again.refresh().table.scan(row_filter="_step == 2").to_arrow()
    assert [m["b"] for m in rows["meta"].to_pylist()] == ["s1-0", "s1-1", "s1-2"]
    assert again.read(2, rank=0).equals(nested_shard(1))


def test_a_payload_column_dropped_and_added_again_is_refused_to_producers_made_before(tmp_path: Path) -> None:
    """Dropped and added again under its name and type, a column is another one (a new field id): a producer made
    before writes the old one, whose values Iceberg readers returned as nulls of the new column. It is refused; a
    producer made after commits, and Iceberg reads its rows as committed."""
    stream, before = published(make(tmp_path))
    running = stream.producer("a")
    running.commit(batch("a", 4, WORLD), seq=4)
    kind = stream.table.schema().find_field("i").field_type
    with stream.table.update_schema(allow_incompatible_changes=True) as update:
        update.delete_column("i")
    with stream.refresh().table.update_schema() as update:
        update.add_column("i", kind)
    with pytest.raises(SchemaMismatchError, match=r"other columns named \['i'\].*Open the stream again"):
        running.commit(batch("a", 5, WORLD), seq=5)
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    assert again.producer("a").commit(batch("a", 5, WORLD), seq=5).step == 10
    rows = again.refresh().table.scan(row_filter="_step == 10").to_arrow()
    assert rows.num_rows > 0 and rows["i"].null_count == 0
    assert sorted(rows["i"].to_pylist()) == sorted(v for t in batch("a", 5, WORLD) for v in t["i"].to_pylist())


@pytest.mark.parametrize("again", [False, True], ids=["dropped", "dropped-and-added-again"])
def test_checkpoints_and_gc_go_on_after_a_payload_column_is_dropped(tmp_path: Path, again: bool) -> None:
    """A checkpoint (a trainer's) and GC write no data files: a payload column another engine dropped (or dropped and
    added again) refuses the producers, whose files would lose its values, but not them. The payload check of
    producers' commits ran in every commit's manifest planner, so a stream that had produced, or one opened before
    the change, refused to checkpoint or collect its old steps until the column came back."""
    stream, before = published(make(tmp_path))
    running = stream.producer("a")
    running.commit(batch("a", 4, WORLD), seq=4)  # its writer is made: the schema of then
    reader = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")  # opened before the change, never produced
    kind = stream.table.schema().find_field("i").field_type
    with stream.table.update_schema(allow_incompatible_changes=True) as update:
        update.delete_column("i")
    if again:
        with stream.refresh().table.update_schema() as update:
            update.add_column("i", kind)
    with pytest.raises(SchemaMismatchError):
        running.commit(batch("a", 5, WORLD), seq=5)
    for each in (stream, reader):
        assert each.checkpoint(f"cp-{id(each)}", step=8).step == 8
    report = stream.collect_garbage(dry_run=False, keep_last=2, grace=timedelta(0), allow_short_grace=True)
    assert report.collected_below == {"main": 8}
    assert reader.collect_garbage(dry_run=False, keep_last=2, grace=timedelta(0), allow_short_grace=True).dry_run is False
    assert stream.head_step() == 9
    assert {step: rows_of(stream, step) for step in (8,)} == {8: before[8]}


def test_a_partition_spec_evolved_under_running_producers_is_refused_until_restored(tmp_path: Path) -> None:
    """Another engine adds a partition field while producers run (Spark's ALTER TABLE ... ADD PARTITION FIELD): a
    running producer, checkpoint and GC are refused with a ConfigError that says how to restore the spec, nothing is
    published with files that do not fit the new spec, and once the field is removed again they go on."""
    from pyiceberg.transforms import BucketTransform

    stream, before = published(make(tmp_path))
    producer = stream.producer("a")
    with stream.refresh().table.update_spec() as update:
        update.add_field("i", BucketTransform(4), "i_bucket")
    for commit in (lambda: producer.commit(batch("a", 4, WORLD), seq=4),
                   lambda: stream.checkpoint("c6", step=6),
                   lambda: stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)):
        with pytest.raises(ConfigError, match="not a lakestream layout.*Restore the spec"):
            commit()
    assert stream.head_step() == 8
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before
    with stream.refresh().table.update_spec() as update:
        update.remove_field("i_bucket")
    assert producer.commit(batch("a", 4, WORLD), seq=4).step == 9
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before


def test_a_stream_of_a_newer_format_version_is_refused_not_misread(tmp_path: Path) -> None:
    """A stream whose lakestream.format-version this release does not read (a newer lakestream_iceberg made or upgraded
    it) opened, read and took commits as if it were version 1. Opening it, the next commit of a producer opened before
    the upgrade, and a follower of it are refused with a ConfigError that says to upgrade; nothing is published."""
    stream, before = published(make(tmp_path))
    running = stream.producer("a")
    follower = Stream.open(stream.table.catalog, stream.name)
    assert follower.wait_for(8, timeout=30) == 8
    stream.table.catalog.load_table(stream.name).transaction().set_properties(
        {"lakestream.format-version": "2"}).commit_transaction()
    refused = pytest.raises(ConfigError, match=r"lakestream.format-version='2'.*reads format version 1 only.*Upgrade")
    with refused:
        Stream.open(stream.table.catalog, stream.name)
    with refused:  # a producer running when the stream was upgraded: its next commit
        running.commit(batch("a", 4, WORLD), seq=4)
    with refused:  # a follower running then: when it next reads the head
        follower.wait_for(9, timeout=30)
    assert StreamState.of(stream.table.catalog.load_table(stream.name).current_snapshot()).step == 8
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before


def test_a_newer_format_version_stays_refused_on_every_read_path(tmp_path: Path) -> None:
    """A stream opened before a newer lakestream_iceberg upgraded it (lakestream.format-version 2) read on silently:
    stream.read of a step the refresh brought in, state(), head_step(), checkpoints() and a restarted producer's
    next_seq refreshed without checking the version, and a follower refused once read on when retried (the refused view
    kept the new metadata, and only a change was checked). Each is refused with the ConfigError that says to upgrade."""
    stream, _ = published(make(tmp_path))
    old = Stream.open(stream.table.catalog, stream.name)
    follower = Stream.open(stream.table.catalog, stream.name)
    assert old.head_step() == follower.wait_for(8, timeout=30) == 8
    stream.producer("a").commit(batch("a", 4, WORLD), seq=4)  # step 9, then the upgrade: one refresh sees both
    stream.table.catalog.load_table(stream.name).transaction().set_properties(
        {"lakestream.format-version": "2"}).commit_transaction()
    refused = pytest.raises(ConfigError, match=r"lakestream.format-version='2'.*reads format version 1 only.*Upgrade")
    for read in (lambda: old.read(9, rank=0), old.state, old.head_step, old.checkpoints,
                 lambda: old.producer("a").next_seq):
        with refused:
            read()
    for _ in range(2):  # refused again when retried
        with refused:
            follower.wait_for(9, timeout=30)


def branch_snapshots(stream: Stream) -> int:
    return len(lineage(stream))


@pytest.mark.parametrize(("props", "kept"), [
    ({}, 2),  # lakestream.snapshots.retain-last only
    ({"history.expire.max-snapshot-age-ms": "3600000"}, 21),  # every snapshot younger than an hour (21 commits)
    ({"history.expire.max-snapshot-age-ms": "3600000", "lakestream.snapshots.retain-max": "10"}, 10),  # the bound
    ({"history.expire.min-snapshots-to-keep": "5"}, 5),  # Iceberg's count raises lakestream's
], ids=["count", "age", "age-bounded", "iceberg-count"])
def test_snapshots_are_kept_by_age_for_streaming_readers_within_a_bound(tmp_path: Path, props: dict, kept: int) -> None:
    stream = make(tmp_path, **{"lakestream.snapshots.retain-last": "2", **props})
    producer = stream.producer("a")
    for seq in range(21):
        producer.commit(batch("a", seq, WORLD), seq=seq)
    assert branch_snapshots(stream) == kept
    assert len(stream.table.metadata.snapshots) <= kept + 1  # + the one a commit expires in passing next time
    assert {step: rows_of(stream, step) for step in (1, 21)} == {s: [digest(t) for t in batch("a", s - 1, WORLD)]
                                                                 for s in (1, 21)}


@pytest.mark.parametrize(("ref_retention", "kept"), [
    ({"min_snapshots_to_keep": 5}, 5),
    ({"max_snapshot_age_ms": 3_600_000}, 21),
], ids=["count", "age"])
def test_a_branchs_own_snapshot_retention_set_by_another_engine_is_kept_and_honoured(
        tmp_path: Path, ref_retention: dict, kept: int) -> None:
    """Spark's ALTER TABLE ... CREATE BRANCH ... WITH SNAPSHOT RETENTION (or REPLACE BRANCH main, Java's
    manageSnapshots().setMinSnapshotsToKeep) puts the retention on the branch ref itself: every lakestream commit
    replaced the ref without it and expired down to lakestream.snapshots.retain-last, so a streaming reader relying
    on it lost its snapshots. The ref keeps its retention through commits, GC and repair, and expiry honours it."""
    stream = make(tmp_path, **{"lakestream.snapshots.retain-last": "2"})
    producer = stream.producer("a")
    producer.commit(batch("a", 0, WORLD), seq=0)
    foreign_append(stream)  # (pyiceberg's own commits drop a ref's retention: it is set after this one)
    table = stream.refresh().table
    head = table.metadata.snapshot_by_name("main")
    assert head is not None
    retention = {"max_ref_age_ms": None, "max_snapshot_age_ms": None, "min_snapshots_to_keep": None, **ref_retention}
    with table.transaction() as tx:
        tx._apply((SetSnapshotRefUpdate(ref_name="main", type=SnapshotRefType.BRANCH, snapshot_id=head.snapshot_id,
                                        **retention),),
                  (AssertRefSnapshotId(ref="main", snapshot_id=head.snapshot_id),))
    stream.repair()
    for seq in range(1, 21):
        producer.commit(batch("a", seq, WORLD), seq=seq)
    stream.checkpoint("c1", step=1)
    stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(hours=1))
    ref = stream.refresh().table.metadata.refs["main"]
    assert {k: getattr(ref, k) for k in retention} == retention
    assert branch_snapshots(stream) == kept
    assert {step: rows_of(stream, step) for step in (1, 21)} == {s: [digest(t) for t in batch("a", s - 1, WORLD)]
                                                                 for s in (1, 21)}


@pytest.mark.parametrize("foreign", [1, 2], ids=["within-the-window", "filling-the-window"])
def test_a_commit_on_another_branch_keeps_the_snapshot_holding_this_branchs_state(tmp_path: Path, foreign: int) -> None:
    """A commit on a fork expired main's lakestream snapshot under rewrite_manifests snapshots (retain-last 2, the
    setting for Spark's expiry), and main refused every commit and read until a repair: a commit kept retain-last
    minus its own snapshots on every branch, not only its own; and however many foreign snapshots stack up on a head,
    the lakestream snapshot under them holds the branch's state, so lakestream's own expiry keeps it and them."""
    stream, before = published(make(tmp_path, **{"lakestream.snapshots.retain-last": "2"}))
    stream.checkpoint("c", step=8)
    stream.fork("c", branch="f")
    base = stream.refresh().head().snapshot_id
    foreigns = [commit_replace(stream).snapshot_id for _ in range(foreign)]
    fork = stream.producer("x", branch="f")
    for seq in range(2):
        assert fork.commit(batch("x", seq, WORLD)).step == 9 + seq
    assert [s.snapshot_id for s in lineage(stream)][-foreign - 1:] == [base, *foreigns]
    assert stream.head_step() == 8
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before
    new = stream.producer("a").commit(batch("a", 4, WORLD), seq=4)
    assert (new.step, stream.refresh().table.metadata.snapshot_by_id(new.snapshot_id).parent_snapshot_id) == \
        (9, foreigns[-1])


def test_an_age_retention_that_ended_lets_the_next_commit_expire(tmp_path: Path) -> None:
    stream = make(tmp_path, **{"lakestream.snapshots.retain-last": "2", "history.expire.max-snapshot-age-ms": "1"})
    producer = stream.producer("a")
    for seq in range(6):
        producer.commit(batch("a", seq, WORLD), seq=seq)
        time.sleep(0.002)  # older than 1 ms by the next commit: an age of 1 ms keeps nothing beyond the count
    assert branch_snapshots(stream) == 2


def test_a_missing_or_dropped_stream_is_a_stream_not_found_error(tmp_path: Path) -> None:
    from pyiceberg.exceptions import NoSuchTableError

    from lakestream_iceberg import StreamNotFoundError

    catalog = sqlite_catalog(str(tmp_path))
    with pytest.raises(StreamNotFoundError, match="no stream ns.nope") as err:
        Stream.open(catalog, "ns.nope")
    assert isinstance(err.value, NoSuchTableError)  # code written against pyiceberg still catches it
    with pytest.raises(StreamNotFoundError):
        Stream.open(catalog, "nonamespace.nope")
    with pytest.raises(StreamNotFoundError):
        Stream.drop(catalog, "ns.nope")
    stream, _ = published(make(tmp_path))
    Stream.drop(sqlite_catalog(str(tmp_path)), "ns.stream")  # by another process
    for call in (stream.head_step, stream.refresh, lambda: stream.history()):
        with pytest.raises(StreamNotFoundError, match="no longer exists"):
            call()


def test_lifecycle_gc_refuses_a_table_whose_gc_another_engine_disabled(tmp_path: Path) -> None:
    """Iceberg's gc.enabled=false says the table's files may be shared with other tables (Spark's snapshot and migrate
    procedures set it, and Spark's expire_snapshots and remove_orphan_files refuse such a table): lakestream gc deleted
    the collected steps' files all the same. It refuses with what to do, commits and deletes nothing; a dry run still
    reports, and with gc.enabled=true again it collects."""
    stream, before = published(make(tmp_path))
    stream.checkpoint("c6", step=6)
    with stream.table.transaction() as tx:
        tx.set_properties({"gc.enabled": "false"})
    files = {p for p in (tmp_path / "warehouse").rglob("*") if p.is_file()}
    head = stream.refresh().head().snapshot_id
    gc = dict(keep_last=1, grace=timedelta(0), allow_short_grace=True)
    with pytest.raises(LifecycleError, match="gc.enabled=false.*Nothing was committed or deleted"):
        stream.collect_garbage(dry_run=False, **gc)
    assert {p for p in (tmp_path / "warehouse").rglob("*") if p.is_file()} == files
    assert stream.refresh().head().snapshot_id == head
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before
    assert stream.collect_garbage(dry_run=True, **gc).collected_below == {"main": 6}
    with stream.table.transaction() as tx:
        tx.set_properties({"gc.enabled": "true"})
    report = stream.collect_garbage(dry_run=False, **gc)
    assert report.collected_below == {"main": 6} and report.files_deleted.get("data", 0) > 0


def test_a_purge_of_a_table_whose_gc_another_engine_disabled_is_refused(tmp_path: Path) -> None:
    """Stream.drop(purge=True) deleted every file of a table marked gc.enabled=false (its files may be shared with
    other tables), where Iceberg's own purge refuses: it is a LifecycleError and nothing is dropped or deleted."""
    stream, before = published(make(tmp_path))
    with stream.table.transaction() as tx:
        tx.set_properties({"gc.enabled": "false"})
    files = {p for p in (tmp_path / "warehouse").rglob("*") if p.is_file()}
    catalog = stream.table.catalog
    with pytest.raises(LifecycleError, match="gc.enabled=false.*Nothing was dropped"):
        Stream.drop(catalog, stream.name, purge=True)
    assert {p for p in (tmp_path / "warehouse").rglob("*") if p.is_file()} == files
    assert {step: rows_of(Stream.open(catalog, stream.name), step) for step in range(1, 9)} == before
    Stream.drop(catalog, stream.name)  # without purge: the catalog entry goes, every file stays
    assert not catalog.table_exists(stream.name) and files <= {p for p in (tmp_path / "warehouse").rglob("*")}


def test_gc_of_a_stream_opened_before_the_grace_period_was_raised_keeps_what_a_commit_may_still_publish(
        tmp_path: Path) -> None:
    """Another engine raises lakestream.commit.timeout-ms and lakestream.gc.grace-period-ms together (the grace rule:
    grace >= 2 x timeout). A producer opened since may take up to the new timeout to publish files it wrote, and group
    commit publishes batches staged up to half the new grace ago; a long-lived stream that runs GC (opened before)
    swept unreferenced files with the grace of then, deleting the files of a batch a commit may still publish."""
    stream, _ = published(make(tmp_path))
    hour_ms = 3_600_000
    stream.table.catalog.load_table(stream.name).transaction().set_properties({
        "lakestream.commit.timeout-ms": str(4 * hour_ms), "lakestream.gc.grace-period-ms": str(8 * hour_ms),
    }).commit_transaction()
    late = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")  # a producer process started after the change
    in_flight = late.writer.write(producer="late", seq=0, shards=batch("late", 0, WORLD))  # its commit not landed yet
    two_hours_ago = time.time() - 2 * 3600
    for f in in_flight.files:
        os.utime(f.path.removeprefix("file://"), (two_hours_ago, two_hours_ago))
    report = stream.collect_garbage(dry_run=False)  # the grace of now: 8 h, not the 1 h the stream was opened with
    assert report.files_in_grace >= WORLD
    assert all(os.path.exists(f.path.removeprefix("file://")) for f in in_flight.files)
    assert stream.head_step() == 8


def test_a_producer_opened_before_the_grace_period_was_lowered_publishes_no_batch_older_than_half_of_it(
        tmp_path: Path) -> None:
    """Another engine lowers lakestream.gc.grace-period-ms (and the commit timeout with it). GC opened since deletes
    unreferenced files older than the new grace period; a producer opened before went on carrying other producers'
    staged batches up to half the old grace period old into its group commits, whose files that GC may delete between
    the producer's footer check and its swap. It now keeps to half the grace period of the head it plans on."""
    import dataclasses

    hour_ms = 3_600_000
    stream, _ = published(make(tmp_path, **{"lakestream.commit.timeout-ms": str(4 * hour_ms),
                                            "lakestream.gc.grace-period-ms": str(8 * hour_ms)}))
    running = stream.producer("a")
    stream.table.catalog.load_table(stream.name).transaction().set_properties({
        "lakestream.commit.timeout-ms": str(hour_ms // 4), "lakestream.gc.grace-period-ms": str(hour_ms),
    }).commit_transaction()
    two_hours_ago = time.time() - 2 * 3600
    dead = stream.writer.write(producer="dead", seq=0, shards=batch("dead", 0, WORLD))
    for f in dead.files:
        os.utime(f.path.removeprefix("file://"), (two_hours_ago, two_hours_ago))
    stream.staging.stage(branch="main", batch=dataclasses.replace(dead, written_at=two_hours_ago), allow_gap=False)
    result = running.commit(batch("a", 4, WORLD), seq=4)  # alone, it lists the staged batches of others
    assert result.step == 9
    assert "dead" not in stream.state().producers  # older than half of the grace of now: never published
    assert stream.head_step() == 9


def test_lifecycle_gc_keeps_the_snapshots_age_retention_keeps(tmp_path: Path) -> None:
    """A streaming reader of another engine stopped at a snapshot from before a GC still finds it: GC collects the
    steps below the checkpoint from the head, and expires only what age retention lets go."""
    from lakestream_iceberg import StepCollectedError

    stream, before = published(make(tmp_path, **{"lakestream.snapshots.retain-last": "2",
                                                  "history.expire.max-snapshot-age-ms": "3600000"}))
    ids = [s.snapshot_id for s in lineage(stream)]
    stream.checkpoint("ck", step=5)
    assert stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0),
                                  allow_short_grace=True).collected_below == {"main": 5}
    metadata = stream.refresh().table.metadata
    assert {s.snapshot_id for s in metadata.snapshots} >= set(ids)  # every snapshot younger than the age is kept
    with pytest.raises(StepCollectedError):
        stream.read(4, rank=0)
    assert {step: rows_of(stream, step) for step in range(5, 9)} == {s: before[s] for s in range(5, 9)}
    old = metadata.snapshot_by_id(ids[1])  # step 2's snapshot: its table state still reads, its files were kept
    assert sorted(set(stream.table.scan(snapshot_id=old.snapshot_id, selected_fields=("_step",)).to_arrow()["_step"]
                      .to_pylist())) == [1, 2]


def test_a_producer_refused_by_a_foreign_change_commits_again_after_the_repair(tmp_path: Path) -> None:
    stream, _ = published(make(tmp_path))
    producer = stream.producer("a")
    assert producer.commit(batch("a", 4, WORLD), seq=4).step == 9  # its view is fresh: it just committed
    foreign_delete(Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream"))  # another engine, meanwhile
    with pytest.raises(ForeignSnapshotError):
        producer.commit(batch("a", 5, WORLD), seq=5)
    Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream").repair()  # by another process
    assert producer.commit(batch("a", 5, WORLD), seq=5).step == 10  # the same producer object goes on


def test_a_retention_set_on_a_live_stream_applies_from_the_next_commit(tmp_path: Path) -> None:
    stream = make(tmp_path, **{"lakestream.snapshots.retain-last": "2"})
    producer = stream.producer("a")
    for seq in range(5):
        producer.commit(batch("a", seq, WORLD), seq=seq)
    assert branch_snapshots(stream) == 2
    other = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    with other.table.transaction() as tx:  # as Spark's ALTER TABLE ... SET TBLPROPERTIES would, producers running
        tx.set_properties({"history.expire.max-snapshot-age-ms": "3600000"})
    for seq in range(5, 15):
        producer.commit(batch("a", seq, WORLD), seq=seq)
    assert branch_snapshots(stream) == 12  # the 2 kept before, and every one since


def test_a_state_expired_under_a_metadata_only_snapshot_is_refused_then_rebased_from_the_metadata_log(
        tmp_path: Path) -> None:
    """``rewrite_manifests`` then an expiry that keeps only the newest snapshot (Spark's usual maintenance pair with
    retain_last 1): no snapshot of the table records the stream's state any more. Commits and reads refuse; repair
    reads the state back from the metadata log and re-bases it on the foreign head, and the stream goes on exactly
    once."""
    stream, before = published(make(tmp_path))
    foreign = commit_replace(stream)
    table = stream.refresh().table
    others = [s.snapshot_id for s in table.metadata.snapshots if s.snapshot_id != foreign.snapshot_id]
    table.maintenance.expire_snapshots().by_ids(others).commit()
    assert [s.snapshot_id for s in stream.refresh().table.metadata.snapshots] == [foreign.snapshot_id]
    producer = stream.producer("a")
    with pytest.raises(ForeignSnapshotError, match=r"stream.repair\(\)") as err:
        producer.commit(batch("a", 4, WORLD), seq=4)
    assert err.value.snapshot_id == foreign.snapshot_id
    with pytest.raises(ForeignSnapshotError):
        stream.head_step()
    plan = stream.repair(dry_run=True)
    assert (plan.rebased_on, plan.rolled_back_to, plan.step, plan.repaired) == (foreign.snapshot_id, None, 8, False)
    report = stream.repair()
    assert (report.rebased_on, report.foreign, report.step, report.repaired) == (foreign.snapshot_id,
                                                                                 (foreign.snapshot_id,), 8, True)
    assert stream.head_step() == 8
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream").producer("b")
    assert (again.commit(batch("b", 2, WORLD), seq=2).duplicate, again.commit(batch("b", 3, WORLD), seq=3).step) == \
        (True, 8)
    assert producer.commit(batch("a", 4, WORLD), seq=4).step == 9
    assert again.commit(batch("b", 4, WORLD), seq=4).step == 10
    assert stream.repair().foreign == ()


def test_a_rollback_by_another_engine_unpublishes_the_later_steps_as_a_fork_would(tmp_path: Path) -> None:
    stream, before = published(make(tmp_path))
    stream.checkpoint("c7", step=7)
    at5 = lineage(stream)[4]
    stream.table.manage_snapshots().rollback_to_snapshot(at5.snapshot_id).commit()  # pyiceberg, Spark's CALL rollback
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    assert again.head_step() == 5
    # c7 is past the head now: GC collected below it, marking steps 1..6 collected before 6 was published again
    assert again.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True).collected_below == {}
    a, b = again.producer("a"), again.producer("b")
    assert (a.commit(batch("a", 2, WORLD), seq=2).duplicate, a.next_seq) == (True, 3)  # step 5 is still published
    republished = b.commit(batch("b", 2, WORLD), seq=2)  # step 6 left the branch: b's seq 2 is published again
    assert (republished.duplicate, republished.step) == (False, 6)
    assert again.checkpoint("c6", step=6).step == 6
    assert {step: rows_of(again, step) for step in range(1, 7)} == {step: before[step] for step in range(1, 7)}


def test_a_producer_live_across_a_rollback_continues_from_the_rolled_back_state(tmp_path: Path) -> None:
    """A producer object that published before another engine rolled the branch back: its next call read its own
    last commit as the head. ``commit(seq=None)`` numbered after a seq that left the branch and raised SequenceError
    once; a submit queue numbered after its last submitted batch and stopped the producer; an explicit seq that left
    the branch was answered ``duplicate=True`` with a step no longer on the branch (its batch dropped without a word).
    Now the table numbers them: seqs after the rollback point are published again, once, and an explicit seq past the
    id's next one is a gap."""
    stream = make(tmp_path)
    a, b, c = stream.producer("a"), stream.producer("b"), stream.producer("c")
    for seq in range(4):
        assert (a.commit(batch("a", seq, WORLD)).step, b.commit(batch("b", seq, WORLD)).step) == (3 * seq + 1,
                                                                                                  3 * seq + 2)
        assert c.submit(batch("c", seq, WORLD)).result().step == 3 * seq + 3
    at5 = lineage(stream)[4]  # a's seq 1 and b's seq 1 published, c's seq 1 not yet
    stream.table.manage_snapshots().rollback_to_snapshot(at5.snapshot_id).commit()  # pyiceberg, Spark's CALL rollback
    assert stream.head_step() == 5  # (read by another view: a's own still shows its last commit as the head)
    again = a.commit(batch("a", 2, WORLD))  # numbered by the table: seq 2 is published again
    assert (again.seq, again.step, again.duplicate) == (2, 6, False)
    submitted = [c.submit(batch("c", seq, WORLD)) for seq in (1, 2)]  # its queue numbered seqs 4 and 5 next
    assert [(f.result().seq, f.result().step) for f in submitted] == [(1, 7), (2, 8)]
    with pytest.raises(SequenceError, match=r"'b' on branch 'main' would skip from seq 2 to 3"):
        b.commit(batch("b", 3, WORLD), seq=3)  # answered before the rollback; the branch no longer holds it
    assert b.commit(batch("b", 1, WORLD), seq=1).duplicate  # still on the branch: a replay
    assert (b.commit(batch("b", 2, WORLD), seq=2).step, b.commit(batch("b", 3, WORLD)).step) == (9, 10)
    expected = {1: ("a", 0), 2: ("b", 0), 3: ("c", 0), 4: ("a", 1), 5: ("b", 1), 6: ("a", 2), 7: ("c", 1),
                8: ("c", 2), 9: ("b", 2), 10: ("b", 3)}
    assert {step: rows_of(stream, step) for step in expected} == \
        {step: [digest(t) for t in batch(p, seq, WORLD)] for step, (p, seq) in expected.items()}
    c.close()


def rollback_to(stream: Stream, producer: str, seq: int) -> None:
    """Roll the branch back to the snapshot that published ``producer``'s ``seq``, as pyiceberg and Spark's CALL do."""
    at = next(s for s in lineage(stream) if s.summary is not None and
              s.summary.additional_properties.get("lakestream.producer") == producer and
              s.summary.additional_properties.get("lakestream.seq") == str(seq))
    stream.table.manage_snapshots().rollback_to_snapshot(at.snapshot_id).commit()


@pytest.mark.parametrize("then", ["next_seq", "explicit", "allow_gap"])
def test_a_submit_queue_live_across_a_rollback_numbers_from_the_rolled_back_head(tmp_path: Path, then: str) -> None:
    """A submit queue's batches numbered by the producer (``seq=None``) after another engine rolled the branch back:
    after ``next_seq`` was read (the head read since the rollback refused the queue's seq as a gap before anything was
    written, which stopped the producer); after an explicit seq read from the rolled-back head (the queue's next batch
    took that seq again and failed with ProducerConflictError, "another writer"); with ``allow_gap=True`` (the batch
    skipped the seqs that left the branch). They follow on from the rolled-back head, as ``commit(seq=None)`` does."""
    stream = make(tmp_path)
    a = stream.producer("a", max_in_flight=3)
    for seq in range(5):
        a.submit(batch("a", seq, WORLD))
    a.flush()
    rollback_to(stream, "a", 1)  # seqs 2..4 leave the branch
    if then == "next_seq":
        assert a.next_seq == 2
    futures = [a.submit(batch("a", 2, WORLD), allow_gap=then == "allow_gap")]
    if then == "explicit":
        assert futures[0].result().seq == 2 and a.next_seq == 3
        futures.append(a.submit(batch("a", 3, WORLD), seq=3))
    futures += [a.submit(batch("a", seq, WORLD)) for seq in range(len(futures) + 2, 6)]
    assert [(f.result().seq, f.result().step, f.result().duplicate) for f in futures] == \
        [(seq, seq + 1, False) for seq in range(2, 6)]
    assert a.close() == 0
    assert {step: rows_of(stream, step) for step in range(1, 7)} == \
        {seq + 1: [digest(t) for t in batch("a", seq, WORLD)] for seq in range(6)}


@pytest.mark.parametrize("then", ["commit", "submit", "replay"])
def test_a_producers_own_steps_that_come_back_after_a_rollback_are_its_own(tmp_path: Path, then: str) -> None:
    """A rollback undone by another engine (the branch set back to the old head, Spark's fast_forward or
    set_current_snapshot) while a producer object is live: its own batches that left the branch are back. The producer
    took them for another live writer's (ProducerConflictError, the batch not published). They are its own: a replay of
    one is a duplicate, and its next batch follows on after them."""
    stream = make(tmp_path)
    a = stream.producer("a")
    for seq in range(4):
        if then == "submit":
            a.submit(batch("a", seq, WORLD))
        else:
            a.commit(batch("a", seq, WORLD))
    a.flush()
    old = lineage(stream)[-1].snapshot_id
    rollback_to(stream, "a", 1)
    assert a.next_seq == 2  # the producer reads the rolled-back head
    stream.refresh().table.manage_snapshots().set_current_snapshot(snapshot_id=old).commit()  # and it is undone
    if then == "replay":
        again = a.commit(batch("a", 2, WORLD), seq=2)
        assert (again.seq, again.step, again.duplicate) == (2, 3, True)
    if then == "submit":
        results = [f.result() for f in [a.submit(batch("a", seq, WORLD)) for seq in (4, 5)]]
    else:
        results = [a.commit(batch("a", seq, WORLD)) for seq in (4, 5)]
    assert [(r.seq, r.step, r.duplicate) for r in results] == [(4, 5, False), (5, 6, False)]
    assert a.close() == 0
    assert {step: rows_of(stream, step) for step in range(1, 7)} == \
        {seq + 1: [digest(t) for t in batch("a", seq, WORLD)] for seq in range(6)}


def upgrade_to_v3(tmp_path: Path, stream: Stream) -> None:
    """What Spark's ``ALTER TABLE ... SET TBLPROPERTIES ('format-version'='3')`` commits (pyiceberg cannot upgrade past
    2): the same metadata as format version 3, with the row lineage counter v3 adds, swapped in the SQLite catalog."""
    import json
    import sqlite3

    old = stream.refresh().table.metadata_location
    metadata = json.loads(Path(old.removeprefix("file://")).read_text())
    metadata.update({"format-version": 3, "next-row-id": 0})
    new = old.replace(".metadata.json", "-v3.metadata.json")
    Path(new.removeprefix("file://")).write_text(json.dumps(metadata))
    with sqlite3.connect(tmp_path / "catalog.db") as db:
        db.execute("UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ?", (new, old))


def test_a_table_another_engine_upgraded_past_format_version_2_is_read_and_refuses_commits_with_a_config_error(
        tmp_path: Path) -> None:
    stream, before = published(make(tmp_path))
    stream.checkpoint("c4", step=4)
    upgrade_to_v3(tmp_path, stream)
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    assert again.table.metadata.format_version == 3
    assert {step: rows_of(again, step) for step in range(1, 9)} == before  # reads go on
    for commit in (lambda: again.producer("a").commit(batch("a", 4, WORLD), seq=4),
                   lambda: again.checkpoint("c6", step=6),
                   lambda: again.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)):
        with pytest.raises(ConfigError, match="format version 3.*cannot commit"):
            commit()
    assert again.head_step() == 8


def looping_snapshots(stream: Stream, *, lakestream_on_top: bool = False) -> tuple[int, int, int]:
    """Point main at two snapshots another engine wrote with each other's id as parent (and, with
    ``lakestream_on_top``, a snapshot carrying the old head's lakestream summary above them); returns the old head's id
    and the two looping ids."""
    table = stream.refresh().table
    metadata = table.metadata
    head = metadata.current_snapshot()
    assert head is not None
    first, second, top = metadata.new_snapshot_id(), metadata.new_snapshot_id(), metadata.new_snapshot_id()
    totals = {k: v for k, v in head.summary.additional_properties.items() if k.startswith("total-")}
    made = [(first, second, Summary(Operation.REPLACE, **totals)), (second, first, Summary(Operation.REPLACE, **totals))]
    if lakestream_on_top:
        made.append((top, second, Summary(head.summary.operation, **{**head.summary.additional_properties,
                                                                     "lakestream.snapshot-id": str(top)})))
    updates = []
    for n, (snapshot_id, parent_id, summary) in enumerate(made):
        path = f"{metadata.location}/metadata/snap-{snapshot_id}-1-{uuid.uuid4()}.avro"
        with write_manifest_list(format_version=2, output_file=table.io.new_output(path), snapshot_id=snapshot_id,
                                 parent_snapshot_id=parent_id, sequence_number=metadata.next_sequence_number() + n,
                                 avro_compression="deflate") as writer:
            writer.add_manifests(head.manifests(table.io))
        updates.append(AddSnapshotUpdate(snapshot=Snapshot(
            snapshot_id=snapshot_id, parent_snapshot_id=parent_id, sequence_number=metadata.next_sequence_number() + n,
            manifest_list=path, schema_id=metadata.current_schema_id, summary=summary)))
    with table.transaction() as tx:
        tx._apply((*updates, SetSnapshotRefUpdate(ref_name="main", type=SnapshotRefType.BRANCH,
                                                  snapshot_id=made[-1][0])),
                  (AssertRefSnapshotId(ref="main", snapshot_id=head.snapshot_id),))
    return head.snapshot_id, first, second


@pytest.mark.timeout(60)
def test_foreign_snapshots_whose_parent_links_loop_are_refused_not_walked_forever(tmp_path: Path) -> None:
    """Two snapshots another engine wrote with each other's id as parent: the walk down to the nearest lakestream
    snapshot never ended (a hang, its list of foreign snapshots growing); it is a CorruptStateError naming them."""
    from lakestream_iceberg.errors import CorruptStateError

    stream, _ = published(make(tmp_path))
    head, first, second = looping_snapshots(stream)
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    with pytest.raises(CorruptStateError, match=f"lineage loops.*{second}, {first} lead back to snapshot {second}"):
        again.head_step()
    with pytest.raises(CorruptStateError, match="lineage loops"):
        again.producer("a").commit(batch("a", 4, WORLD), seq=4)
    again.table.manage_snapshots().set_current_snapshot(head).commit()  # the fix it names
    assert again.head_step() == 8


@pytest.mark.timeout(60)
def test_consumer_lag_stops_at_a_loop_below_a_lakestream_head(tmp_path: Path) -> None:
    """A snapshot with a lakestream summary above two looping foreign ones: the head step reads fine, but dating the
    steps for lag_s walked the loop forever (lakestream lag and the consumers view hung)."""
    pytest.importorskip("torch")
    from lakestream_iceberg.read.dataset import LakestreamDataset
    from lakestream_iceberg.read.lag import consumer_lags

    stream, _ = published(make(tmp_path))
    assert [i["step"] for i in LakestreamDataset(stream, rank=0, world_size=1, group="g", report_s=0.05)][-1] == 8
    looping_snapshots(stream, lakestream_on_top=True)
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    assert again.head_step() == 8
    assert [(c.status, c.lag_steps, c.lag_s) for c in consumer_lags(again)] == [("closed", 0, 0.0)]


@pytest.mark.timeout(60)
def test_a_running_producer_stops_at_a_loop_below_a_lakestream_head(tmp_path: Path) -> None:
    """The same head under a producer that committed before it: its next commit asks whether the branch left the head
    it last saw (another engine's rollback) and walked the parent links down to a snapshot older than that one, which
    a loop of newer snapshots never reaches (a hang; its stack: ProducerHead.left). As for the lag, the walk stops at
    the loop: whether the branch left that head cannot be told there, and the producer commits on the readable head
    as a producer opened afresh does."""
    stream, _ = published(make(tmp_path))
    producer = stream.producer("a")
    assert producer.commit(batch("a", 4, WORLD), seq=4).step == 9  # it saw the head it published
    looping_snapshots(stream, lakestream_on_top=True)  # the loop's top carries that head's state
    assert producer.commit(batch("a", 5, WORLD), seq=5).step == 10
    assert Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream").producer("a").next_seq == 6


def cherry_pick(stream: Stream, source: Snapshot) -> Snapshot:
    """A cherry-pick by a tool that copies the picked snapshot's summary (``lakestream.*`` keys included): a new
    snapshot on the head that adds the picked snapshot's files and names it in ``source-snapshot-id``, as Iceberg
    Java's cherry-pick does (which copies no ``lakestream.*`` keys: ``interop/test_spark_foreign_writes.py``)."""
    table = stream.refresh().table
    metadata = table.metadata
    head = metadata.current_snapshot()
    assert head is not None
    snapshot_id, sequence_number = metadata.new_snapshot_id(), metadata.next_sequence_number()
    path = f"{metadata.location}/metadata/snap-{snapshot_id}-1-{uuid.uuid4()}.avro"
    with write_manifest_list(format_version=metadata.format_version, output_file=table.io.new_output(path),
                             snapshot_id=snapshot_id, parent_snapshot_id=head.snapshot_id,
                             sequence_number=sequence_number, avro_compression="deflate") as writer:
        writer.add_manifests(head.manifests(table.io))
    summary = {**source.summary.additional_properties, "source-snapshot-id": str(source.snapshot_id),
               "engine-name": "spark"}
    snapshot = Snapshot(snapshot_id=snapshot_id, parent_snapshot_id=head.snapshot_id, sequence_number=sequence_number,
                        manifest_list=path, schema_id=metadata.current_schema_id,
                        summary=Summary(Operation.APPEND, **summary))
    with table.transaction() as tx:
        tx._apply((AddSnapshotUpdate(snapshot=snapshot),
                   SetSnapshotRefUpdate(ref_name="main", type=SnapshotRefType.BRANCH, snapshot_id=snapshot_id)),
                  (AssertRefSnapshotId(ref="main", snapshot_id=head.snapshot_id),))
    return snapshot


def test_a_cherry_picked_snapshot_whose_summary_copies_lakestreams_keys_is_foreign_not_the_streams_state(
        tmp_path: Path) -> None:
    """A cherry-pick whose summary copies the picked snapshot's, lakestream.* keys included, was read as lakestream's
    own: its old state made producers publish their published seqs again at steps already published."""
    stream, before = published(make(tmp_path))
    base = stream.refresh().table.metadata.current_snapshot()
    picked = cherry_pick(stream, lineage(stream)[2])  # step 3's snapshot: producer a at seq 1, b at seq 0
    producer = stream.producer("a")
    with pytest.raises(ForeignSnapshotError, match=rf"snapshot {picked.snapshot_id} .*stream.repair\(\)"):
        producer.commit(batch("a", 2, WORLD), seq=2)
    with pytest.raises(ForeignSnapshotError):
        stream.read(8, rank=0)
    assert stream.refresh().table.metadata.current_snapshot().snapshot_id == picked.snapshot_id  # nothing published
    report = stream.repair()
    assert (report.rolled_back_to, report.foreign, report.step) == (base.snapshot_id, (picked.snapshot_id,), 8)
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before
    assert (producer.commit(batch("a", 2, WORLD), seq=2).duplicate, producer.commit(batch("a", 4, WORLD), seq=4).step) \
        == (True, 9)


OTHER_SCHEMA = pa.schema([("x", pa.int64())])


@pytest.mark.parametrize(("key", "value", "says"), [
    ("lakestream.world-size", "4", r"lakestream.world-size was '2' .*set it to '4'.*\{'lakestream.world-size': '2'\}"),
    ("lakestream.world-size", None, r"lakestream.world-size was '2' .*removed it.*\{'lakestream.world-size': '2'\}"),
    ("lakestream.layout", "packed", r"lakestream.layout was 'per-rank' .*set it to 'packed'.*\{'lakestream.layout': "
                                    "'per-rank'}"),
    ("lakestream.arrow-schema", "other", r"lakestream.arrow-schema was '.{24}\.\.\.' .*\{'lakestream.arrow-schema': "),
], ids=["world-size", "world-size-removed", "layout", "arrow-schema"])
def test_a_fixed_property_another_engine_changed_under_running_producers_is_refused_until_set_back(
        tmp_path: Path, key: str, value: str | None, says: str) -> None:
    """The world size, layout and payload schema are fixed when a stream is created: a running producer went on with
    the values it opened the stream with while a process opening it afterwards took the new ones (two world sizes
    writing one stream). The next commit of a running producer is refused, naming the value to set back, and so is a
    follower opened before: it refused the steps producers opened since wrote as damaged files ("roll the stream back
    to a checkpoint"), or read them as another shape."""
    from lakestream_iceberg.format.table import encode_schema

    stream, before = published(make(tmp_path))
    producer = stream.producer("a")
    follower = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    assert follower.wait_for(8, timeout=30) == 8
    head = stream.refresh().table.metadata.current_snapshot()
    table = sqlite_catalog(str(tmp_path)).load_table("ns.stream")  # another engine, producers running
    with table.transaction() as tx:
        if value is None:
            tx.remove_properties(key)
        else:
            tx.set_properties({key: encode_schema(OTHER_SCHEMA) if value == "other" else value})
    with pytest.raises(ConfigError, match=says):
        producer.commit(batch("a", 4, WORLD), seq=4)
    with pytest.raises(ConfigError, match=says) as refused:
        follower.wait_for(9, timeout=30)
    assert "a follower opened before reads no further step" in str(refused.value)
    assert stream.refresh().table.metadata.current_snapshot().snapshot_id == head.snapshot_id  # nothing published
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before  # readers read on
    with table.transaction() as tx:  # as the message says
        tx.set_properties({key: {"lakestream.world-size": "2", "lakestream.layout": "per-rank"}.get(key) or
                           encode_schema(SCHEMA)})
    assert producer.commit(batch("a", 4, WORLD), seq=4).step == 9
    assert follower.wait_for(9, timeout=30) == 9


@pytest.mark.parametrize("key", ["lakestream.world-size", "lakestream.arrow-schema", "lakestream.format-version"])
def test_a_stream_whose_identity_property_another_engine_removed_is_not_called_a_plain_table(
        tmp_path: Path, key: str) -> None:
    """Opening it said 'a plain Iceberg table, not a lakestream stream; create one with Stream.create()': the stream
    and its steps are there, and the fix is to set the property back, to the value its earlier metadata held."""
    from lakestream_iceberg.errors import CorruptStateError

    stream, _ = published(make(tmp_path))
    was = stream.refresh().table.metadata.properties[key]
    with stream.table.transaction() as tx:
        tx.remove_properties(key)
    with pytest.raises(CorruptStateError, match=rf"lacks table property {key} .*removed.*\{{'{key}': '{was[:8]}"):
        Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")


def set_unparsed(tmp_path: Path, stream: Stream, properties: dict[str, str]) -> None:
    """A table property set by a tool that does not parse it, with a value pyiceberg refuses to commit: the same
    metadata with the properties set, swapped in the SQLite catalog."""
    import json
    import sqlite3

    old = stream.refresh().table.metadata_location
    metadata = json.loads(Path(old.removeprefix("file://")).read_text())
    metadata["properties"].update(properties)
    new = old.replace(".metadata.json", "-spark.metadata.json")
    Path(new.removeprefix("file://")).write_text(json.dumps(metadata))
    with sqlite3.connect(tmp_path / "catalog.db") as db:
        db.execute("UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ?", (new, old))


@pytest.mark.parametrize("value", ["5 files", " 5", "5_0", "٥", "2147483648"])
def test_a_metadata_log_size_that_is_no_integer_is_refused_naming_the_property(tmp_path: Path, value: str) -> None:
    """pyiceberg parses write.metadata.previous-versions-max when it writes a commit's metadata: a value that is no
    integer (written by a tool that does not parse it) failed every commit five times over, then said 'This is a bug ... please report it'.
    One that Python's int() reads and Java's Integer.parseInt refuses (" 5", "5_0", "٥", past an int) was committed
    with, and Spark's and Trino's commits failed on it."""
    stream, before = published(make(tmp_path))
    producer = stream.producer("a")
    head = stream.refresh().table.metadata.current_snapshot()
    set_unparsed(tmp_path, stream, {"write.metadata.previous-versions-max": value})
    for commit in (lambda: producer.commit(batch("a", 4, WORLD), seq=4), lambda: stream.checkpoint("c6", step=6)):
        with pytest.raises(ConfigError, match=re.escape(f"write.metadata.previous-versions-max={value!r}, which is not an integer")):
            commit()
    assert stream.refresh().table.metadata.current_snapshot().snapshot_id == head.snapshot_id  # nothing published
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before  # readers read on
    with stream.table.transaction() as tx:
        tx.set_properties({"write.metadata.previous-versions-max": "5"})
    assert producer.commit(batch("a", 4, WORLD), seq=4).step == 9


def test_a_tag_another_engine_made_is_named_as_such_when_forked_or_released(tmp_path: Path) -> None:
    """A tag pyiceberg or Spark made on a stream (with its own retention) is kept and read, but it is no checkpoint:
    forking or releasing it said 'no checkpoint named ...; list them with stream.checkpoints()', which does not list
    it, as if the name were mistyped."""
    from lakestream_iceberg.errors import CheckpointError

    stream, _ = published(make(tmp_path))
    at5 = lineage(stream)[4]
    stream.table.manage_snapshots().create_tag(at5.snapshot_id, "t5", max_ref_age_ms=86_400_000).commit()
    assert stream.refresh().checkpoints() == []
    with pytest.raises(CheckpointError, match=r"'t5' is a tag .*not a lakestream checkpoint.*stream.checkpoint\('NAME', "
                                              r"step=5\).*fork"):
        stream.fork("t5", branch="f5")
    with pytest.raises(CheckpointError, match=r"'t5' is a tag .*not a lakestream checkpoint.*remove_tag\('t5'\)"):
        stream.release("t5")
    assert stream.checkpoint("c5", step=5).step == 5
    assert stream.fork("c5", branch="f5").step == 5


@pytest.mark.parametrize(("retain", "on"), [("500", "main"), ("2", "main"), ("500", "fork")],
                         ids=["step-snapshot-retained", "step-snapshot-expired", "a-forks-checkpoint"])
def test_main_set_to_a_checkpoints_tag_by_another_engine_is_refused_and_repaired_not_read_as_a_fork(
        tmp_path: Path, retain: str, on: str) -> None:
    """Another engine rolled main back to a checkpoint by its tag (Spark's set_current_snapshot(ref => 'c4'), pyiceberg's
    set_current_snapshot(ref_name='c4')): main's head became the checkpoint's anchor, which holds step 4 alone and no
    producer sequences, and lakestream read it as a fork: steps 1-3 left main ('collected by lifecycle GC'), and
    producers published their published seqs again (producer a's seq 0 at step 5). It is refused, and repair() rolls
    main back to the snapshot that published step 4 (or, when that one was expired or is a fork's, where main was
    before)."""
    stream, before = published(make(tmp_path, **{"lakestream.snapshots.retain-last": retain}))
    producer = stream.producer("a")
    at4 = {StreamState.of(s).step: s.snapshot_id for s in lineage(stream)}.get(4)
    moved_from = stream.refresh().head().snapshot_id
    if on == "fork":  # a fork from step 2 whose step 4 is its own
        stream.fork(stream.checkpoint("c2", step=2), branch="f")
        for seq in range(2):
            stream.producer("x", branch="f").commit(batch("x", seq, WORLD))
    checkpoint = stream.checkpoint("c4", step=4, branch="main" if on == "main" else "f")
    stream.table.manage_snapshots().set_current_snapshot(ref_name="c4").commit()  # another engine
    refused = pytest.raises(ForeignSnapshotError, match=r"anchor of checkpoint 'c4' \(step 4\).*stream.repair\(\)")
    with refused as err:
        producer.commit(batch("a", 0, WORLD))  # seq 0 was published at step 1
    assert err.value.snapshot_id == checkpoint.snapshot_id
    with refused:
        stream.read(1, rank=0)
    with refused:
        stream.head_step()
    assert stream.refresh().head().snapshot_id == checkpoint.snapshot_id  # nothing published
    report = stream.repair()
    if (retain, on) == ("500", "main"):
        assert (report.rolled_back_to, report.step) == (at4, 4)
        assert {step: rows_of(stream, step) for step in range(1, 5)} == {s: before[s] for s in range(1, 5)}
        assert (producer.commit(batch("a", 0, WORLD), seq=0).duplicate, producer.commit(batch("a", 2, WORLD)).step) == \
            (True, 5)  # a's seqs 0 and 1 (steps 1, 3) stay published; seq 2 left main with the rollback
    else:
        assert (report.rolled_back_to, report.step) == (moved_from, 8)
        assert {step: rows_of(stream, step) for step in range(1, 9)} == before
        assert producer.commit(batch("a", 0, WORLD), seq=0).duplicate
        assert producer.commit(batch("a", 4, WORLD)).step == 9
    assert report.foreign == (checkpoint.snapshot_id,)
    assert "c4" in [c.name for c in stream.checkpoints()]


@pytest.mark.parametrize("change", ["rename", "drop"])
def test_a_packed_streams_rank_column_dropped_or_renamed_by_another_engine_is_refused_until_restored(
        tmp_path: Path, change: str) -> None:
    """_rank is a stored column of the packed layout, not a partition field, so Iceberg lets another engine drop or
    rename it: a producer opened before went on committing files with a _rank column the table no longer had, and a
    producer made after it failed with a raw KeyError: '_rank'. Both are a ConfigError saying how to restore it, and
    after the restore producers commit and every step reads as published. A _rank added again is another column (a new
    field id): a producer made before writes the old one, which Iceberg readers read as nulls, so it is refused and
    one made after the restore commits."""
    from pyiceberg.types import IntegerType

    stream, before = published(make(tmp_path, **{"lakestream.layout": "packed"}))
    running = stream.producer("a")
    head = stream.refresh().head().snapshot_id
    with sqlite_catalog(str(tmp_path)).load_table("ns.stream").update_schema(allow_incompatible_changes=True) as update:
        update.rename_column("_rank", "rank_id") if change == "rename" else update.delete_column("_rank")
    refused = pytest.raises(ConfigError, match=r"packed layout.*no longer has that column.*Rename it back")
    with refused:
        running.commit(batch("a", 4, WORLD), seq=4)
    with refused:
        Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream").producer("b").commit(batch("b", 4, WORLD), seq=4)
    assert stream.refresh().head().snapshot_id == head  # nothing published
    with sqlite_catalog(str(tmp_path)).load_table("ns.stream").update_schema() as update:  # as the message says
        update.rename_column("rank_id", "_rank") if change == "rename" else update.add_column("_rank", IntegerType())
    if change == "drop":  # added again: another column (a new field id), which the running producer's files do not
        with pytest.raises(SchemaMismatchError, match=r"other columns named \['_rank'\].*Open the stream again"):
            running.commit(batch("a", 4, WORLD), seq=4)  # fill: Iceberg readers saw its files' _rank as nulls
        running = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream").producer("a")
    assert running.commit(batch("a", 4, WORLD), seq=4).step == 9
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    assert again.producer("b").commit(batch("b", 4, WORLD), seq=4).step == 10
    assert {step: rows_of(again, step) for step in range(1, 9)} == before
    assert all(again.read(10, rank=r).equals(t) for r, t in enumerate(batch("b", 4, WORLD)))
    ranks = again.refresh().table.scan(row_filter="_step >= 9").to_arrow()["_rank"]  # as other engines read it
    assert len(ranks) > 0 and ranks.null_count == 0


def test_main_fast_forwarded_to_a_fork_is_refused_and_repaired_back_to_its_own_head(tmp_path: Path) -> None:
    """Promoting a fork to main (Spark's fast_forward('main', 'lr'), which Iceberg allows because the fork's anchor has
    main's step-8 snapshot as its parent). The anchor holds step 8 alone and the fork's producer sequences start
    afresh: read as main's state, main would lose steps 1-7 (and GC their files) and producer a would publish its seq 0
    again. Every snapshot of a fork names the anchor its timeline starts at, so main on one is refused, and repair()
    rolls main back to its own head; the fork stays a branch of its own."""
    stream, before = published(make(tmp_path))
    stream.fork(stream.checkpoint("c8", step=8), branch="lr")
    for seq in range(2):
        stream.producer("x", branch="lr").commit(batch("x", seq, WORLD))
    metadata = stream.refresh().table.metadata
    lr, anchor, moved_from = (metadata.snapshot_by_name(name) for name in ("lr", "c8", "main"))
    assert lr is not None and anchor is not None and moved_from is not None
    assert lr.summary["lakestream.timeline"] == anchor.summary["lakestream.timeline"] == str(anchor.snapshot_id)
    assert "lakestream.timeline" not in moved_from.summary.additional_properties
    stream.table.manage_snapshots().set_current_snapshot(lr.snapshot_id).commit()  # what fast_forward commits
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    refused = pytest.raises(ForeignSnapshotError, match=r"committed on a fork whose timeline starts at checkpoint 'c8' "
                                                        r"\(step 8\).*Run stream.repair\(\)")
    with refused:
        again.producer("a").commit(batch("a", 0, WORLD), seq=0)
    with refused:
        again.read(1, rank=0)
    report = again.repair()
    assert report.rolled_back_to == moved_from.snapshot_id and report.step == 8
    assert {step: rows_of(again, step) for step in range(1, 9)} == before
    assert again.producer("a").commit(batch("a", 0, WORLD), seq=0).duplicate
    assert all(again.read(9, rank=r, branch="lr").equals(t) for r, t in enumerate(batch("x", 0, WORLD)))


def test_a_forks_gc_snapshots_carry_its_timeline_and_mains_never_do(tmp_path: Path) -> None:
    """Lifecycle GC's collect snapshot on a fork keeps naming the fork's anchor (main set to it is refused too); main's
    own collect snapshot names none."""
    stream, _ = published(make(tmp_path))
    anchor = stream.fork(stream.checkpoint("c6", step=6), branch="lr").snapshot_id
    for seq in range(2):
        stream.producer("x", branch="lr").commit(batch("x", seq, WORLD))
    stream.release("c6")
    stream.checkpoint("m8", step=8)
    stream.checkpoint("l8", step=8, branch="lr")
    report = stream.collect_garbage(dry_run=False, keep_last=2, grace=timedelta(0), allow_short_grace=True)
    assert report.collected_below == {"main": 8, "lr": 8}
    metadata = stream.refresh().table.metadata
    lr, main = metadata.snapshot_by_name("lr"), metadata.snapshot_by_name("main")
    assert lr is not None and main is not None
    assert lr.summary["lakestream.op"] == main.summary["lakestream.op"] == "collect"
    assert lr.summary["lakestream.timeline"] == str(anchor)
    assert "lakestream.timeline" not in main.summary.additional_properties
    stream.table.manage_snapshots().set_current_snapshot(lr.snapshot_id).commit()
    with pytest.raises(ForeignSnapshotError, match="committed on a fork whose timeline starts at the checkpoint anchor"):
        Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream").head_step()
    assert Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream").repair().rolled_back_to == main.snapshot_id


def test_a_foreign_append_that_copied_lakestreams_summary_keys_is_foreign(tmp_path: Path) -> None:
    """A tool that appends with the head's snapshot properties copied (pyiceberg's append(..., snapshot_properties=...),
    Spark's snapshot-property.* options), lakestream.* keys included. Read as lakestream's own snapshot, producers
    would go on committing on top of it, the step it wrote into would fail to read, and repair() would find nothing.
    The copy names the head's snapshot id in lakestream.snapshot-id, not the append's: it is foreign data, refused
    until repair() rolls it back, as a cherry-pick that copied the keys is."""
    stream, before = published(make(tmp_path))
    base = stream.refresh().head()
    assert base is not None
    keys = {k: v for k, v in base.summary.additional_properties.items() if k.startswith("lakestream.")}
    table = stream.table
    rows = batch("x", 0, 1)[0]
    rows = rows.append_column("_step", pa.array([3] * rows.num_rows, pa.int64()))
    rows = rows.append_column("_rank", pa.array([0] * rows.num_rows, pa.int32()))
    table.append(rows.select([f.name for f in table.schema().as_arrow()]).cast(table.schema().as_arrow()),
                 snapshot_properties=keys)
    with pytest.raises(ForeignSnapshotError):
        stream.producer("a").commit(batch("a", 4, WORLD), seq=4)
    assert stream.repair().rolled_back_to == base.snapshot_id
    assert {step: rows_of(stream, step) for step in range(1, 9)} == before


@pytest.mark.parametrize("moved", ["fast_forward", "tag"])
def test_main_moved_onto_a_fork_then_appended_to_by_another_engine_is_repaired_in_one_call(
        tmp_path: Path, moved: str) -> None:
    """Main moved onto a fork's timeline (fast_forward to the fork, or set to a checkpoint's tag), then another engine
    appended rows on main. repair() rolls back the append, and main must then be back on its own line, not left on
    the fork's snapshot (still refused, a second repair() needed) while the report says it was repaired."""
    stream, before = published(make(tmp_path))
    stream.fork(stream.checkpoint("c8", step=8), branch="lr")
    for seq in range(2):
        stream.producer("x", branch="lr").commit(batch("x", seq, WORLD))
    metadata = stream.refresh().table.metadata
    moved_from = metadata.snapshot_by_name("main")
    target = metadata.snapshot_by_name("lr" if moved == "fast_forward" else "c8")
    assert moved_from is not None and target is not None
    stream.table.manage_snapshots().set_current_snapshot(target.snapshot_id).commit()  # another engine
    foreign_append(stream)  # another engine again, on main
    again = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    with pytest.raises(ForeignSnapshotError):
        again.head_step()
    report = again.repair()
    assert report.repaired
    assert again.head_step() == 8  # main readable again after the one repair the message asks for
    assert report.rolled_back_to == moved_from.snapshot_id
    assert {step: rows_of(again, step) for step in range(1, 9)} == before
    assert again.producer("a").commit(batch("a", 0, WORLD), seq=0).duplicate
