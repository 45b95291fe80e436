"""Checkpoints as tags, resume, forks, and lifecycle GC on a real SQLite catalog and local warehouse."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyiceberg.table.update import RemoveSnapshotRefUpdate

from lakestream_iceberg import CheckpointError, ConfigError, LifecycleError, StepCollectedError, Stream
from tests.support import SCHEMA, batch, counting_str, digest, sqlite_catalog, until


def files_under(stream: Stream, sub: str = "data") -> set[str]:
    root = stream.table.metadata.location.removeprefix("file://") + "/" + sub
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


def publish(stream: Stream, producer_id: str, count: int, *, branch: str = "main") -> None:
    producer = stream.producer(producer_id, branch=branch)
    for _ in range(count):
        seq = producer.next_seq
        producer.commit(batch(producer_id, seq, stream.world_size), seq=seq)


def test_checkpoint_is_a_tag_listing_its_step(stream: Stream) -> None:
    publish(stream, "p", 5)
    ckpt = stream.checkpoint("ckpt-3", step=3)
    assert (ckpt.name, ckpt.step, ckpt.branch) == ("ckpt-3", 3, "main")
    assert [c.name for c in stream.checkpoints()] == ["ckpt-3"]
    ref = stream.table.metadata.refs["ckpt-3"]
    assert ref.snapshot_ref_type == "tag" and ref.snapshot_id == ckpt.snapshot_id
    # the anchor pins step 3 only, and any Iceberg reader can time-travel to the tag
    pinned = stream.table.scan(snapshot_id=ckpt.snapshot_id).to_arrow()
    assert set(pinned.column("_step").to_pylist()) == {3}
    for bad, words in [("ckpt-3", "already exists"), ("main", "invalid"), ("bad name", "invalid"), ("c2\n", "invalid"),
                       ("c" * 129, "invalid"), ("a/b", "invalid"), ("", "invalid"), ("\u00e9", "invalid")]:
        with pytest.raises(CheckpointError, match=words):
            stream.checkpoint(bad, step=2)
    with pytest.raises(CheckpointError, match="invalid"):
        stream.fork("ckpt-3", branch="exp\n")
    assert set(stream.table.metadata.refs) == {"main", "ckpt-3"}
    with pytest.raises(CheckpointError, match="published steps are 1..5"):
        stream.checkpoint("future", step=6)
    stream.release("ckpt-3")
    assert stream.checkpoints() == []
    with pytest.raises(CheckpointError, match="no checkpoint"):
        stream.release("ckpt-3")


def test_checkpoints_among_many_retained_snapshots_and_tags_are_not_quadratic(tmp_path, monkeypatch) -> None:
    """Listing checkpoints looked each tag's snapshot up with ``metadata.snapshot_by_id`` (a scan of every snapshot),
    and checkpoint() each ancestor while finding the step's snapshot: O(tags x snapshots) for every GC and
    checkpoints(), O(snapshots^2) for every checkpoint, with thousands of each retained."""
    from pyiceberg.table.metadata import TableMetadataCommonFields

    steps = 40
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.many", schema=SCHEMA, world_size=1,
                           properties={"lakestream.snapshots.retain-last": str(10 * steps)})
    publish(stream, "p", steps)
    for step in range(2, steps, 4):
        stream.checkpoint(f"c{step}", step=step)
    scans: list[int] = []
    original = TableMetadataCommonFields.snapshot_by_id
    monkeypatch.setattr(TableMetadataCommonFields, "snapshot_by_id",
                        lambda self, snapshot_id: scans.append(snapshot_id) or original(self, snapshot_id))
    assert len(stream.checkpoints()) == 10
    assert stream.checkpoint("c1", step=1).source_snapshot_id is not None  # the oldest: every ancestor is walked
    assert len(scans) < steps // 2, f"{len(scans)} scans of the snapshot list for 10 tags and {steps} retained snapshots"


def test_gc_among_many_tags_reads_each_manifest_once_and_compares_no_pair_of_tags(tmp_path, monkeypatch) -> None:
    """GC found the released checkpoints with a list's ``in`` (a comparison per pair of tags) and read every retained
    snapshot's manifests again, though snapshots share most of them: each GC cost O(tags^2) comparisons and
    O(snapshots x manifests) manifest reads (800 tags: 0.45 s for a dry run, 4x the tags about 10x the time)."""
    from lakestream_iceberg.format.checkpoints import Checkpoint
    from lakestream_iceberg.format.manifest_cache import ManifestCache

    steps = 40
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.many", schema=SCHEMA, world_size=1,
                           properties={"lakestream.snapshots.retain-last": str(10 * steps)})
    publish(stream, "p", steps)
    for step in range(1, steps + 1):
        stream.checkpoint(f"c{step}", step=step)
    metadata = stream.refresh().table.metadata
    manifests = {m.manifest_path for s in metadata.snapshots for m in stream.cache.manifests(stream.io, s)}
    compared: list[object] = []
    read: list[str] = []
    eq, entries = Checkpoint.__eq__, ManifestCache.entries
    monkeypatch.setattr(Checkpoint, "__eq__", lambda a, b: compared.append(b) or eq(a, b))
    monkeypatch.setattr(ManifestCache, "entries",
                        lambda self, io, m, *a, **k: read.append(m.manifest_path) or entries(self, io, m, *a, **k))
    report = stream.collect_garbage(dry_run=True, keep_last=steps // 2)
    assert len(report.released_checkpoints) == steps // 2
    assert len(compared) < steps, f"{len(compared)} comparisons of checkpoints for {steps} tags"
    # referenced files (known_files) and what a real run keeps (kept_after_dry_run): each manifest once per pass
    assert len(read) <= 2 * len(manifests) + 8, f"{len(read)} manifest reads for {len(manifests)} distinct manifests"
    assert stream.collect_garbage(keep_last=steps // 2, dry_run=False).released_checkpoints == report.released_checkpoints
    assert [c.step for c in stream.refresh().checkpoints()] == list(range(steps // 2 + 1, steps + 1))


# a warehouse given as a plain path (pyiceberg takes it as it is) whose path holds # or ?: GC deleted none of its files
@pytest.mark.parametrize("warehouse", ["file://{}/warehouse", "{}/ware#house?x"])
def test_gc_keeps_everything_without_checkpoints_and_collects_before_the_oldest(tmp_path, warehouse: str) -> None:
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("test", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=warehouse.format(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=4)
    publish(stream, "p", 10)
    idle = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    # no checkpoint: no step is garbage (only manifest lists of snapshots that commits expired in passing may go)
    assert idle.collected_below == {} and "data" not in idle.files_deleted and set(idle.files_deleted) <= {"manifest-list", "manifest"}
    for step in range(1, 11):
        stream.read(step, rank=0)
    stream.checkpoint("c4", step=4)
    stream.checkpoint("c7", step=7)
    before = files_under(stream)
    plan = stream.collect_garbage(grace=timedelta(0), allow_short_grace=True)  # dry run by default
    assert plan.dry_run and files_under(stream) == before
    report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.collected_below == {"main": 4}
    assert report.files_deleted == plan.files_deleted and report.files_deleted["data"] == 3 * 4
    assert len(before) - len(files_under(stream)) == 12
    with pytest.raises(StepCollectedError, match="retained checkpoint"):
        stream.read(3, rank=0)
    for step in range(4, 11):
        assert digest(stream.read(step, rank=2)) == digest(batch("p", step - 1, 4)[2])
    with pytest.raises(CheckpointError, match="collected"):
        stream.checkpoint("late", step=2)
    # keep only the newest checkpoint: c4 is released, steps 4..6 go
    report = stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert report.released_checkpoints == ["c4"] and report.collected_below == {"main": 7}
    assert [c.name for c in stream.checkpoints()] == ["c7"]
    assert sorted(stream.table.scan().to_arrow().column("_step").to_pylist()) == sorted(
        s for s in range(7, 11) for _ in range(sum(t.num_rows for t in batch("p", s - 1, 4)))
    )
    with pytest.raises(LifecycleError):
        stream.collect_garbage(keep_last=0)


def test_orphans_of_a_crashed_producer_wait_for_the_grace_period(stream: Stream) -> None:
    publish(stream, "p", 2)
    staged = stream.writer.write(producer="crashed", seq=0, shards=batch("crashed", 0, 4))  # written, never committed
    assert stream.head_step() == 2
    report = stream.collect_garbage(dry_run=False)  # default grace: one hour
    assert report.files_in_grace >= 4 and all(os.path.exists(f.path.removeprefix("file://")) for f in staged.files)
    report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.files_deleted.get("data") == 4
    assert not any(os.path.exists(f.path.removeprefix("file://")) for f in staged.files)
    assert stream.read(2, rank=1).equals(batch("p", 1, 4)[1])


def test_keep_last_keeps_the_checkpoint_made_last_whatever_its_hosts_clock(stream: Stream, monkeypatch) -> None:
    """keep_last ranked checkpoints by created_at, the clock of the host that made each: a trainer restarted on a host
    whose clock runs 10 minutes behind made its next checkpoint 'older' than the one before, so GC released it (the
    one to resume from) and kept the older one. Commit order (the anchors' sequence numbers) decides now."""
    import time

    from lakestream_iceberg.lifecycle import checkpoint as checkpoint_module

    publish(stream, "p", 6)
    stream.checkpoint("first", step=3)

    class Behind:  # the clock of the host that makes the next checkpoint
        @staticmethod
        def time() -> float:
            return time.time() - 600

    monkeypatch.setattr(checkpoint_module, "time", Behind)
    stream.checkpoint("second", step=5)
    monkeypatch.undo()
    report = stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert report.released_checkpoints == ["first"], report
    assert [c.name for c in stream.checkpoints()] == ["second"] and report.collected_below == {"main": 5}


def test_keep_within_on_a_gc_host_whose_clock_runs_ahead_releases_no_young_checkpoint(stream: Stream,
                                                                                      monkeypatch) -> None:
    """keep_within counted from the GC host's clock: one running 2 days ahead released a checkpoint made a moment ago
    under keep_within=1 day (and collected the steps below the next one). It counts from the earlier of that clock
    and the store's now."""
    import time
    from datetime import datetime

    from lakestream_iceberg.lifecycle import gc

    publish(stream, "p", 6)
    stream.checkpoint("young", step=3)
    stream.checkpoint("newest", step=5)
    ahead = timedelta(days=2)
    real = time.time

    class Ahead(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206 - datetime.now's own signature
            return datetime.now(tz) + ahead

    monkeypatch.setattr(time, "time", lambda: real() + ahead.total_seconds())  # this (GC) host's clocks: 2 days ahead
    monkeypatch.setattr(gc, "datetime", Ahead)
    report = stream.collect_garbage(dry_run=False, keep_last=1, keep_within=timedelta(days=1), grace=timedelta(0),
                                    allow_short_grace=True)
    assert report.released_checkpoints == [] and report.collected_below == {"main": 3}, report
    assert [c.name for c in stream.checkpoints()] == ["young", "newest"]


def test_resume_from_checkpoint_replays_identical_bytes(catalog, stream: Stream) -> None:
    publish(stream, "p", 8)
    uninterrupted = [digest(stream.read(s, rank=1)) for s in range(1, 9)]
    ckpt = stream.checkpoint("after-5", step=5)
    stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    resumed = Stream.open(catalog, "ns.stream")
    start = next(c for c in resumed.checkpoints() if c.name == "after-5").step + 1
    assert [digest(resumed.read(s, rank=1)) for s in range(start, 9)] == uninterrupted[ckpt.step:]


def test_fork_continues_at_checkpoint_plus_one_on_a_branch(stream: Stream) -> None:
    publish(stream, "p", 6)
    stream.checkpoint("c3", step=3)
    stream.fork("c3", branch="retry-lr")
    publish(stream, "q", 2, branch="retry-lr")
    assert stream.head_step(branch="retry-lr") == 5 and stream.head_step() == 6
    assert stream.read(4, rank=0, branch="retry-lr").equals(batch("q", 0, 4)[0])
    assert stream.read(4, rank=0).equals(batch("p", 3, 4)[0])
    assert stream.read(3, rank=0, branch="retry-lr").equals(batch("p", 2, 4)[0])
    with pytest.raises(StepCollectedError):
        stream.read(2, rank=0, branch="retry-lr")
    with pytest.raises(CheckpointError, match="already used"):
        stream.fork("c3", branch="retry-lr")
    # step 6 is main's head, not the fork's: the error names the branch whose steps it lists
    with pytest.raises(CheckpointError, match=r"step 6 of .* \(branch 'retry-lr'\): its published steps are 1\.\.5"):
        stream.checkpoint("c6", step=6, branch="retry-lr")


def test_keep_last_keeps_the_newest_checkpoints_of_each_branch(tmp_path) -> None:
    """keep_last counted checkpoints across branches: a checkpoint taken on a fork released the last checkpoint of the
    run it was forked from, the one its trainer resumes from (and GC then collected nothing on that branch)."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    for seq in range(4):
        producer.commit(batch("p", seq, 2))
    stream.checkpoint("main-2", step=2)
    stream.checkpoint("main-3", step=3)
    stream.fork("main-2", branch="exp")
    assert stream.producer("q", branch="exp").commit(batch("q", 0, 2)).step == 3
    stream.checkpoint("exp-3", step=3, branch="exp")  # the newest checkpoint of the stream
    report = stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert report.released_checkpoints == ["main-2"]
    assert sorted(c.name for c in stream.checkpoints()) == ["exp-3", "main-3"]
    assert stream.state().collected_below == 3  # main: the steps below its retained checkpoint
    assert [digest(stream.read(3, rank=r)) for r in range(2)] == [digest(t) for t in batch("p", 2, 2)]  # main-3's step


def test_keep_last_among_many_forks_groups_the_checkpoints_by_branch_once() -> None:
    """keep_last of each branch scanned every checkpoint once per branch: O(branches x checkpoints) name comparisons
    for every GC (dry runs too) of a stream with thousands of forks, each with its checkpoints."""
    from datetime import datetime, timezone

    from lakestream_iceberg.format.checkpoints import Checkpoint
    from lakestream_iceberg.lifecycle.policy import retained

    compared: list[str] = []

    Name = counting_str(compared)  # a branch name that counts the comparisons made with it

    now = datetime.now(timezone.utc)
    branches = 60
    checkpoints = [Checkpoint(name=f"b{b}-{i}", step=i + 1, snapshot_id=b * 10 + i, source_snapshot_id=None,
                              created_at=now - timedelta(minutes=i), branch=Name(f"b{b}"))
                   for b in range(branches) for i in range(3)]
    kept = retained(checkpoints, keep_last=2, keep_within=None, now=now)
    assert sorted(c.name for c in kept) == sorted(f"b{b}-{i}" for b in range(branches) for i in range(2))
    assert len(compared) <= 2 * len(checkpoints), f"{len(compared)} comparisons for {len(checkpoints)} checkpoints"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["commit", "commit", "commit", "checkpoint", "release", "gc", "resume", "fork"]),
                    min_size=4, max_size=22),
       seed=st.integers(0, 10_000))
def test_randomized_lifecycle_keeps_exactly_what_checkpoints_need(tmp_path_factory, ops, seed) -> None:
    import random

    rng = random.Random(seed)
    root = tmp_path_factory.mktemp("life")
    stream = Stream.create(sqlite_catalog(str(root)), "ns.s", schema=SCHEMA, world_size=2,
                           properties={"lakestream.snapshots.retain-last": "4", "lakestream.manifest.merge-fanout": "3"})
    producer = stream.producer("p")
    expected: dict[int, list[str]] = {}
    n = 0
    forks = 0
    paths: dict[int, list[str]] = {}
    fork_steps: set[int] = set()
    for op in ops:
        head = stream.head_step()
        if op == "commit":
            shards = batch("p", producer.next_seq, 2)
            step = producer.commit(shards).step
            expected[step] = [digest(t) for t in shards]
            paths[step] = [f.file_path.removeprefix("file://") for f in stream.locate(step)]
        elif op == "checkpoint" and head:
            live = [s for s in expected if s >= stream.state().collected_below]
            if live:
                n += 1
                stream.checkpoint(f"c{n}", step=rng.choice(live))
        elif op == "release" and (ckpts := stream.checkpoints()):
            stream.release(rng.choice(ckpts).name)
        elif op == "gc":
            stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True,
                                   keep_last=rng.choice([None, 1, 2]))
        elif op == "resume" and (ckpts := [c for c in stream.checkpoints() if c.branch == "main"]):
            c = rng.choice(ckpts)
            for s in range(c.step, head + 1):
                assert [digest(stream.read(s, rank=r)) for r in range(2)] == expected[s]
        elif op == "fork" and (ckpts := [c for c in stream.checkpoints() if c.branch == "main"]):
            forks += 1
            c = rng.choice(ckpts)
            stream.fork(c, branch=f"b{forks}")
            fork_steps.add(c.step)
            assert [digest(stream.read(c.step, rank=r, branch=f"b{forks}")) for r in range(2)] == expected[c.step]
        # invariant: every step at/after the oldest retained main checkpoint is readable and identical ...
        main_ckpts = [c.step for c in stream.checkpoints() if c.branch == "main"]
        floor = stream.state().collected_below
        for s in range(floor, stream.head_step() + 1):
            assert [digest(stream.read(s, rank=r)) for r in range(2)] == expected[s]
        assert not main_ckpts or floor <= min(main_ckpts)
    # ... and after a final GC, the data files of every older step are gone from storage (except the one step each
    # checkpoint anchor or fork pins)
    stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    floor = stream.state().collected_below
    pinned = {c.step for c in stream.checkpoints()} | fork_steps
    for s in range(1, floor):
        if s not in pinned:
            assert not any(os.path.exists(p) for p in paths[s]), f"step {s}'s files survived GC"
    for s in range(floor, stream.head_step() + 1):
        assert all(os.path.exists(p) for p in paths[s])


@pytest.mark.slow
def test_gc_runs_while_producers_commit_and_consumers_read(tmp_path) -> None:
    import random
    import threading

    root = Path(__file__).resolve().parents[2]
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=2)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.workers", str(tmp_path), "ns.stream", f"w{i}", "40"],
                              cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    guard = {"step": 1, "stop": False}
    failures: list[BaseException] = []

    def consume() -> None:
        reader = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
        rng = random.Random(1)
        while not guard["stop"]:
            head = reader.head_step()
            if head >= guard["step"]:
                step = rng.randint(guard["step"], head)
                try:
                    reader.read(step, rank=rng.randint(0, 1))
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)

    thread = threading.Thread(target=consume)
    thread.start()
    n = 0
    try:
        while any(p.poll() is None for p in procs):
            head = stream.head_step()
            if head > 5:
                n += 1
                stream.checkpoint(f"c{n}", step=head - 2)
                guard["step"] = head - 2
                stream.collect_garbage(dry_run=False, keep_last=2)  # default grace protects in-flight files
    finally:
        guard["stop"] = True
        thread.join()
    for p in procs:
        assert p.wait() == 0, p.stderr.read()[-2000:]
    assert not failures, failures[:3]
    assert n >= 3
    state = stream.state()
    assert state.step == 80 and {k: v.seq for k, v in state.producers.items()} == {"w0": 39, "w1": 39}
    for s in range(state.collected_below, 81):
        files = stream.locate(s)
        producer, name = files[0].file_path.split("/data/")[1].split("/")
        seq = int(name.split("-")[0])
        assert [digest(stream.read(s, rank=r)) for r in range(2)] == [digest(t) for t in batch(producer, seq, 2)]


def test_a_reader_whose_view_predates_gc_still_reads_retained_steps(catalog, stream: Stream) -> None:
    from lakestream_iceberg.format.manifest_cache import ManifestCache

    publish(stream, "p", 12)
    stream.checkpoint("a", step=6)
    stream.checkpoint("b", step=12)
    # another process: its own table view and its own (cold) manifest cache, loaded before the GC below
    reader = Stream(catalog.load_table("ns.stream"), cache=ManifestCache())
    publish(stream, "p", 1)
    stream.checkpoint("c", step=13)
    report = stream.collect_garbage(dry_run=False, keep_last=2)
    assert report.collected_below == {"main": 12} and report.files_deleted.get("manifest-list", 0) > 0
    assert reader.read(12, rank=0).equals(batch("p", 11, 4)[0])
    with pytest.raises(StepCollectedError):
        Stream(catalog.load_table("ns.stream"), cache=ManifestCache()).read(7, rank=0)
    stale = Stream(reader.table, cache=ManifestCache())
    with pytest.raises(StepCollectedError):
        stale.read(7, rank=0)


def test_gc_is_not_stopped_by_another_engines_branch_with_its_own_writes(stream: Stream) -> None:
    """A branch another engine made (an audit branch) and appended to holds no checkpoint: GC collects main and keeps
    every file of that branch, instead of refusing with ForeignSnapshotError for a branch it would not touch."""
    import pyarrow as pa

    publish(stream, "p", 6)
    table = stream.refresh().table
    table.manage_snapshots().create_branch(table.metadata.current_snapshot_id, "audit").commit()
    rows = batch("x", 0, 1)[0]
    rows = rows.append_column("_step", pa.array([3] * rows.num_rows, pa.int64()))
    rows = rows.append_column("_rank", pa.array([0] * rows.num_rows, pa.int32()))
    arrow = table.schema().as_arrow()
    stream.refresh().table.append(rows.select([f.name for f in arrow]).cast(arrow), branch="audit")
    audit = stream.refresh().table.scan(snapshot_id=stream.table.metadata.refs["audit"].snapshot_id).to_arrow()
    publish(stream, "p", 2)
    stream.checkpoint("c5", step=5)
    plan = stream.collect_garbage(grace=timedelta(0), allow_short_grace=True)
    report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert plan.collected_below == report.collected_below == {"main": 5}
    assert stream.state().collected_below == 5
    with pytest.raises(StepCollectedError):
        stream.read(4, rank=0)
    table = stream.refresh().table
    assert table.scan(snapshot_id=table.metadata.refs["audit"].snapshot_id).to_arrow().sort_by("_step").equals(
        audit.sort_by("_step"))


def test_release_and_fork_land_and_return_while_main_holds_another_engines_change(stream: Stream) -> None:
    """Release and fork touch refs only: a data change another engine made on main (to be repaired) neither stops
    them nor makes a landed one raise ForeignSnapshotError (a retry would then find the tag gone, the branch taken)."""
    from tests.support import foreign_delete

    publish(stream, "p", 6)
    stream.checkpoint("c2", step=2)
    stream.checkpoint("c4", step=4)
    foreign_delete(stream)
    stream = stream.refresh()
    stream.release("c2")
    assert stream.fork("c4", branch="clean").step == 4
    assert sorted(stream.refresh().table.metadata.refs) == ["c4", "clean", "main"]
    assert stream.producer("q", branch="clean").commit(batch("q", 0, stream.world_size), seq=0).step == 5



def test_release_and_fork_that_lose_a_race_while_main_holds_another_engines_change_retry_and_land(
        stream: Stream, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release or fork whose swap is lost to another writer plans again on the new head; a data change another engine
    made on main (to be repaired) must not turn that lost race into ForeignSnapshotError."""
    from lakestream_iceberg.write import commit as commit_module
    from tests.support import foreign_delete

    publish(stream, "p", 6)
    for name, step in (("c2", 2), ("c4", 4), ("c5", 5), ("c6", 6)):
        stream.checkpoint(name, step=step)
    foreign_delete(stream)
    stream = stream.refresh()
    other = Stream.open(stream.table.catalog, stream.table.name())  # another process's handle on the same stream
    real_swap, rival, swaps = commit_module.swap, [""], []

    def swap_after_a_rival_commit(table, requirements, updates, **kw):  # type: ignore[no-untyped-def]
        if rival[0]:  # the call's first swap: the rival's release lands first, so this one is lost
            name, rival[0] = rival[0], ""
            other.refresh().release(name)
        swaps.append(kw)
        return real_swap(table, requirements, updates, **kw)

    monkeypatch.setattr(commit_module, "swap", swap_after_a_rival_commit)
    rival[0] = "c5"
    stream.release("c2")
    assert len(swaps) == 3  # the rival's, this call's lost one, this call's landed one
    rival[0] = "c6"
    assert stream.fork("c4", branch="clean").step == 4
    assert len(swaps) == 6
    assert sorted(stream.refresh().table.metadata.refs) == ["c4", "clean", "main"]


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_gc_whose_view_another_gc_collected_meanwhile_finishes(tmp_path, dry_run: bool) -> None:
    """Two GCs at once (a scheduled one and the CLI, or two jobs' own): the second read the head, then the first
    expired snapshots of that head and deleted their manifest lists before the second read them. The second raised
    pyarrow's raw FileNotFoundError; it reads the head again, as reads and commits do, and finishes."""
    catalog = sqlite_catalog(str(tmp_path))
    # no manifest cache: the two GCs share this process, where a cached manifest list would hide its deletion
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2,
                           properties={"lakestream.manifest.cache-bytes": "0"})
    publish(stream, "p", 8)
    stream.checkpoint("a", step=3)
    stream.checkpoint("b", step=6)
    other = Stream.open(catalog, "ns.stream")  # the first GC, another process's view
    first: list[object] = []
    io = stream.table.io
    new_input = io.new_input

    def read_after_the_other_gc(location: str):  # noqa: ANN202 - FileIO's own signature
        if not first and "/snap-" in location:  # this GC reads its first manifest list: the other one runs first
            first.append(other.collect_garbage(dry_run=False, keep_last=1))
        return new_input(location)

    io.new_input = read_after_the_other_gc  # type: ignore[method-assign]
    report = stream.collect_garbage(dry_run=dry_run, keep_last=1)
    assert first and first[0].collected_below == {"main": 6}, "the other GC did not run first"
    assert report.collected_below == {} and report.released_checkpoints == []  # nothing left to do
    assert [c.name for c in stream.checkpoints()] == ["b"]
    for step in range(6, 9):
        for rank in range(2):
            assert digest(stream.read(step, rank=rank)) == digest(batch("p", step - 1, 2)[rank])
    with pytest.raises(StepCollectedError):
        stream.read(5, rank=0)


def test_a_gc_whose_expired_head_another_gc_swept_before_its_own_sweep_finishes(tmp_path) -> None:
    """The same race later in a GC: after its last commit it lists what the new head references; a producer's commit
    (expiring snapshots in passing) and another GC's sweep, in between, deleted manifest lists that head still listed."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=2,
                           properties={"lakestream.manifest.cache-bytes": "0", "lakestream.snapshots.retain-last": "2"})
    publish(stream, "p", 8)
    stream.checkpoint("a", step=3)
    stream.checkpoint("b", step=6)
    catalog = sqlite_catalog(str(tmp_path))  # this GC's own catalog: only its commits pass through the hook below
    gc = Stream.open(catalog, "ns.stream")
    other: list[object] = []
    commit_table = catalog.commit_table

    def then_the_others(table, requirements, updates):  # type: ignore[no-untyped-def]  # noqa: ANN202
        response = commit_table(table, requirements, updates)
        if not other and not any(isinstance(u, RemoveSnapshotRefUpdate) for u in updates):  # GC's second commit landed
            publish(stream, "q", 3)  # each commit expires snapshots beyond the newest 2 in passing
            other.append(stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True))
        return response

    catalog.commit_table = then_the_others  # type: ignore[method-assign]
    report = gc.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert other and report.collected_below == {"main": 6} and report.released_checkpoints == ["a"]
    assert [c.name for c in stream.checkpoints()] == ["b"]
    for step in range(6, 12):
        producer, seq = ("p", step - 1) if step <= 8 else ("q", step - 9)
        assert digest(stream.read(step, rank=1)) == digest(batch(producer, seq, 2)[1])


def test_gc_keeps_the_statistics_files_the_table_metadata_lists(catalog, stream: Stream) -> None:
    """Another engine's table and partition statistics (Spark's compute_table_stats, Trino's ANALYZE: Puffin files under
    metadata/ that metadata.json lists) are referenced by no snapshot's manifests: the sweep took them for orphans and
    deleted them, leaving metadata that names missing files. Iceberg's own orphan removal keeps them; so does GC, and
    only the table statistics of a snapshot GC expires go with it."""
    from pyiceberg.table.statistics import PartitionStatisticsFile, StatisticsFile
    from pyiceberg.table.update import SetPartitionStatisticsUpdate

    publish(stream, "p", 6)
    stream.checkpoint("c4", step=4)
    location = stream.table.metadata.location.removeprefix("file://")

    def puffin(name: str) -> str:
        path = f"{location}/metadata/{name}"
        with open(path, "wb") as f:
            f.write(b"PFA1" + b"\0" * 60)
        os.utime(path, (0, 0))  # long past any grace period
        return f"file://{path}"

    table = catalog.load_table("ns.stream")
    old_id = table.metadata.snapshots[0].snapshot_id  # expired by GC: its statistics go with it
    kept_id = table.metadata.refs["c4"].snapshot_id  # the retained checkpoint's anchor
    paths = {"kept": puffin("kept.stats"), "old": puffin("old.stats"), "partition": puffin("partition.stats")}
    with table.transaction() as tx:
        with tx.update_statistics() as update:
            for snapshot_id, path in [(kept_id, paths["kept"]), (old_id, paths["old"])]:
                update.set_statistics(StatisticsFile(snapshot_id=snapshot_id, statistics_path=path, file_size_in_bytes=64,
                                                     file_footer_size_in_bytes=8, blob_metadata=[]))
        tx._apply((SetPartitionStatisticsUpdate(partition_statistics=PartitionStatisticsFile(
            snapshot_id=kept_id, statistics_path=paths["partition"], file_size_in_bytes=64)),))
    stream = Stream(catalog.load_table("ns.stream"))
    plan = stream.collect_garbage(grace=timedelta(0), allow_short_grace=True)
    report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.collected_below == {"main": 4} and report.files_deleted == plan.files_deleted
    metadata = catalog.load_table("ns.stream").metadata
    listed = [s.statistics_path for s in [*metadata.statistics, *metadata.partition_statistics]]
    assert sorted(listed) == sorted([paths["kept"], paths["partition"]])
    for path in listed:
        assert os.path.exists(path.removeprefix("file://")), f"GC deleted {path}, which the table metadata lists"
    assert not os.path.exists(paths["old"].removeprefix("file://"))  # its snapshot was expired, and it with it


@pytest.mark.parametrize("dry_run", [True, False])
def test_gc_refuses_a_bad_consumer_retention_before_it_commits_or_deletes_anything(catalog, stream: Stream,
                                                                                  dry_run: bool) -> None:
    """lakestream.consumers.retention-ms set out of bounds by another engine (1000: under a minute) was read only when
    GC came to expire consumer positions, after its commits and sweep: GC released checkpoints, collected steps and
    deleted their files, then raised ConfigError, so `lakestream gc` exited 1 as if nothing had happened and its report
    was lost. It is refused before anything is committed or deleted."""
    from lakestream_iceberg import ConfigError

    publish(stream, "p", 6)
    stream.checkpoint("c2", step=2)
    stream.checkpoint("c4", step=4)
    with catalog.load_table("ns.stream").transaction() as tx:
        tx.set_properties({"lakestream.consumers.retention-ms": "1000"})
    stream = Stream(catalog.load_table("ns.stream"))
    before = files_under(stream)
    with pytest.raises(ConfigError, match="lakestream.consumers.retention-ms=1000"):
        stream.collect_garbage(dry_run=dry_run, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    stream = Stream(catalog.load_table("ns.stream"))
    assert [c.name for c in stream.checkpoints()] == ["c2", "c4"] and files_under(stream) == before
    assert digest(stream.read(2, rank=0)) == digest(batch("p", 1, 4)[0])


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_checkpoint_of_a_dropped_branch_collects_nothing_on_a_new_branch_of_its_name(catalog, stream: Stream,
                                                                                      dry_run: bool) -> None:
    """A checkpoint names its branch, not the branch's timeline: after a fork was dropped (pyiceberg's remove_branch,
    Spark's DROP BRANCH) and forked again under its name, GC, retaining every checkpoint, collected the new branch's
    steps below the dropped one's checkpoint: steps 6..11 of a timeline no checkpoint pins were deleted. A checkpoint
    whose step holds other files on its branch than on its anchor is another timeline's: it collects nothing there."""
    publish(stream, "p", 6)
    stream.checkpoint("c5", step=5)
    stream.fork("c5", branch="exp")
    publish(stream, "q", 10, branch="exp")
    stream.checkpoint("e12", step=12, branch="exp")
    catalog.load_table("ns.stream").manage_snapshots().remove_branch("exp").commit()
    stream = Stream(catalog.load_table("ns.stream"))
    stream.fork("c5", branch="exp")
    publish(stream, "r", 10, branch="exp")
    stream.checkpoint("e14", step=14, branch="exp")  # the new timeline's own checkpoint still collects below it
    report = stream.collect_garbage(dry_run=dry_run, grace=timedelta(0), allow_short_grace=True)
    assert report.collected_below == {"main": 5, "exp": 14}
    stream.checkpoint("e14b", step=14, branch="exp")
    stream.release("e14")
    if not dry_run:
        stream = stream.refresh()
    for step in range(6 if dry_run else 14, 16):
        assert digest(stream.read(step, rank=2, branch="exp")) == digest(batch("r", step - 6, 4)[2])
    stream.release("e14b")
    report = stream.collect_garbage(dry_run=dry_run, grace=timedelta(0), allow_short_grace=True)
    assert "exp" not in report.collected_below


def test_resuming_from_a_checkpoint_its_branch_no_longer_holds_is_refused(catalog, stream: Stream) -> None:
    """from_checkpoint resumes at step + 1 of the checkpoint's branch: after the branch was dropped and forked again
    under its name, or rolled back under the checkpoint by another engine, a trainer resumed from it read another
    timeline's steps (not the ones its model saw before) without a word. It is a CheckpointError saying to fork."""
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg import LakestreamDataset

    publish(stream, "p", 6)
    stream.checkpoint("c5", step=5)
    stream.fork("c5", branch="exp")
    publish(stream, "q", 10, branch="exp")
    stream.checkpoint("e12", step=12, branch="exp")
    assert LakestreamDataset.from_checkpoint(stream, "e12", rank=0, world_size=4).start_step == 13
    catalog.load_table("ns.stream").manage_snapshots().remove_branch("exp").commit()
    stream = Stream(catalog.load_table("ns.stream"))
    stream.fork("c5", branch="exp")
    publish(stream, "r", 10, branch="exp")
    with pytest.raises(CheckpointError, match=r"'e12'.*branch 'exp'.*fork"):
        LakestreamDataset.from_checkpoint(stream, "e12", rank=0, world_size=4)
    # main moved back under a checkpoint by another engine (Spark's rollback_to_snapshot), then published again
    stream.checkpoint("c6", step=6)
    at4 = next(s for s in stream.table.metadata.snapshots
               if s.summary.additional_properties.get("lakestream.step") == "4"
               and s.summary.additional_properties.get("lakestream.op", "append") == "append")
    catalog.load_table("ns.stream").manage_snapshots().rollback_to_snapshot(at4.snapshot_id).commit()
    stream = Stream(catalog.load_table("ns.stream"))
    with pytest.raises(CheckpointError, match=r"'c6'.*past"):
        LakestreamDataset.from_checkpoint(stream, "c6", rank=0, world_size=4)
    publish(stream, "s", 3)
    with pytest.raises(CheckpointError, match=r"'c6'.*branch 'main'.*fork"):
        LakestreamDataset.from_checkpoint(stream, "c6", rank=0, world_size=4)


def test_gc_names_a_few_checkpoints_off_the_timeline_and_counts_the_rest(catalog,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Another engine moved main back under many checkpoints (one every step here; every 100 steps of a long run):
    GC's warning named every one of them in one line. It names a few and counts them all."""
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2,
                           properties={"lakestream.snapshots.retain-last": "100"})  # step 4's snapshot stays
    publish(stream, "p", 4 + 25)
    past = [f"c{step}" for step in range(5, 5 + 25)]
    for name in past:
        stream.checkpoint(name, step=int(name[1:]))
    at4 = next(s for s in stream.table.metadata.snapshots
               if s.summary.additional_properties.get("lakestream.step") == "4"
               and s.summary.additional_properties.get("lakestream.op", "append") == "append")
    catalog.load_table("ns.stream").manage_snapshots().rollback_to_snapshot(at4.snapshot_id).commit()
    stream = Stream(catalog.load_table("ns.stream"))
    with caplog.at_level("WARNING", logger="lakestream_iceberg.lifecycle.gc"):
        stream.collect_garbage(dry_run=True)
    [line] = [r.getMessage() for r in caplog.records if "not on the branch's timeline" in r.getMessage()]
    assert "25 checkpoint(s)" in line and "and 15 more" in line, line
    assert re.findall(r"\bc\d+\b", line) == past[:10], line  # the oldest ten


def state_read_on_a_fork(stream: Stream) -> dict:
    """Main's steps 1..6, checkpoint c5, fork ``exp`` of it with steps 6..9: the state of a reader of all of those."""
    from lakestream_iceberg import LakestreamDataset

    publish(stream, "p", 6)
    stream.checkpoint("c5", step=5)
    stream.fork("c5", branch="exp")
    publish(stream, "q", 4, branch="exp")  # steps 6..9 of exp
    reader = LakestreamDataset(stream, rank=0, world_size=4, branch="exp", start_step=6)
    assert [item["step"] for item in reader] == [6, 7, 8, 9]
    return reader.state_dict()


def test_a_saved_state_whose_branch_no_longer_holds_its_last_step_is_refused(catalog, stream: Stream) -> None:
    """A state_dict saved on a branch resumed at its next_step on whatever the branch held then: after the branch was
    dropped and forked again under its name, or moved back by another engine and published again, the trainer read
    another timeline's steps after those its model saw, without a word. The state names a data file of the last step
    it delivered; loading it where the branch no longer holds that file is a CheckpointError."""
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg import LakestreamDataset

    saved = state_read_on_a_fork(stream)
    assert saved["next_step"] == 10 and saved["last_file"]
    LakestreamDataset(stream, rank=0, world_size=4, branch="exp").load_state_dict(saved)  # the same timeline: loads
    catalog.load_table("ns.stream").manage_snapshots().remove_branch("exp").commit()
    stream = Stream(catalog.load_table("ns.stream"))
    stream.fork("c5", branch="exp")
    publish(stream, "r", 6, branch="exp")  # steps 6..11 again, other batches
    with pytest.raises(CheckpointError, match=r"step 9 of branch 'exp'.*no longer holds"):
        LakestreamDataset(stream, rank=0, world_size=4, branch="exp").load_state_dict(saved)
    # main moved back under the state's last step by another engine (Spark's rollback_to_snapshot)
    on_main = LakestreamDataset(stream, rank=0, world_size=4, end_step=6)
    assert [item["step"] for item in on_main][-1] == 6
    at_main = on_main.state_dict()
    at4 = next(s for s in stream.table.metadata.snapshots
               if s.summary.additional_properties.get("lakestream.step") == "4"
               and s.summary.additional_properties.get("lakestream.op", "append") == "append")
    catalog.load_table("ns.stream").manage_snapshots().rollback_to_snapshot(at4.snapshot_id).commit()
    stream = Stream(catalog.load_table("ns.stream"))
    with pytest.raises(CheckpointError, match="step 6 of branch 'main'"):  # behind it
        LakestreamDataset(stream, rank=0, world_size=4).load_state_dict(at_main)
    publish(stream, "s", 3)  # and published past it again: steps 5..7, other files
    with pytest.raises(CheckpointError, match="step 6 of branch 'main'"):
        LakestreamDataset(stream, rank=0, world_size=4).load_state_dict(at_main)
    old = {k: v for k, v in at_main.items() if k != "last_file"}  # a state of an earlier release: nothing to compare
    assert LakestreamDataset(stream, rank=0, world_size=4).load_state_dict(old) is None
    with pytest.raises(ConfigError, match="last_file"):
        LakestreamDataset(stream, rank=0, world_size=4).load_state_dict({**at_main, "last_file": 7})


def test_a_saved_state_loaded_on_a_fork_of_another_timeline_of_its_branch_is_refused(catalog, stream: Stream) -> None:
    """A state of branch ``exp`` loads on a fork of ``exp`` made at or after its last step (everything it delivered is
    shared). Only the fork and the state's branch as it is now were compared: after ``exp`` was dropped and forked
    again under its name, a fork of the new ``exp`` took the state, and the trainer read another timeline's steps
    after those its model saw, without a word. The state's last_file is checked on its own branch there too."""
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg import LakestreamDataset

    saved = state_read_on_a_fork(stream)
    stream.checkpoint("e9", step=9, branch="exp")
    stream.fork("e9", branch="same")  # a fork of the state's own timeline: loads
    LakestreamDataset(stream, rank=0, world_size=4, branch="same").load_state_dict(saved)
    catalog.load_table("ns.stream").manage_snapshots().remove_branch("exp").commit()
    stream = Stream(catalog.load_table("ns.stream"))
    stream.fork("c5", branch="exp")
    publish(stream, "r", 6, branch="exp")  # steps 6..11 again, other batches
    stream.checkpoint("e10", step=10, branch="exp")
    stream.fork("e10", branch="other")
    with pytest.raises(CheckpointError, match=r"step 9 of branch 'exp'.*no longer holds"):
        LakestreamDataset(stream, rank=0, world_size=4, branch="other").load_state_dict(saved)


def killed_where_it_stops(code: str, *args: str) -> None:
    """Run ``code`` in a child process and SIGKILL it at the point where it prints ``stopped`` and waits (an observed
    point, never a timed window)."""
    child = subprocess.Popen([sys.executable, "-c", code, *args], cwd=Path(__file__).resolve().parents[2],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line == "stopped\n", line + child.stderr.read()[-2000:]
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()


GC_CHILD = r"""
import sys
from datetime import timedelta

from pyiceberg.io.pyarrow import PyArrowFileIO

from lakestream_iceberg import Stream
from lakestream_iceberg.lifecycle import gc
from tests.support import sqlite_catalog

root, point = sys.argv[1], sys.argv[2]


def stop() -> None:  # the parent sees the line and SIGKILLs this process at that point
    print("stopped", flush=True)
    sys.stdin.readline()


if point == "between-commits":
    plan_expire = gc.plan_expire
    gc.plan_expire = lambda *a, **k: stop() or plan_expire(*a, **k)
else:
    delete, deleted = PyArrowFileIO.delete, []
    PyArrowFileIO.delete = lambda self, path: (deleted.append(path), len(deleted) == 3 and stop(), delete(self, path))[2]
stream = Stream.open(sqlite_catalog(root), "ns.stream")
stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
print("finished", flush=True)
"""


@pytest.mark.parametrize("point", ["between-commits", "mid-sweep"])
def test_a_gc_killed_midway_then_run_again_loses_nothing_and_leaves_no_file_behind(tmp_path, point: str) -> None:
    from lakestream_iceberg.lifecycle.sweep import norm, referenced_files

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=2)
    publish(stream, "p", 10)
    for step in (3, 6, 8):
        stream.checkpoint(f"c{step}", step=step)
    killed_where_it_stops(GC_CHILD, str(tmp_path), point)
    stream.refresh()
    again = stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert [c.name for c in stream.refresh().checkpoints()] == ["c8"]
    assert again.collected_below in ({}, {"main": 8})
    assert stream.state().collected_below == 8
    assert [digest(stream.read(s, rank=r)) for s in range(8, 11) for r in range(2)] == \
           [digest(t) for seq in range(7, 10) for t in batch("p", seq, 2)]
    metadata = stream.table.metadata
    location = metadata.location.removeprefix("file://")
    on_disk = {norm(os.path.join(d, f)) for d, _, fs in os.walk(location) for f in fs}
    assert on_disk - referenced_files(stream.io, metadata, stream.table.metadata_location, stream) == set()
    assert stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True).total_files == 0
    stream.fork("c8", branch="after")  # the retained checkpoint still forks and resumes
    assert digest(stream.read(8, rank=0, branch="after")) == digest(batch("p", 7, 2)[0])


def test_gc_planning_among_many_released_tags_tests_no_ref_against_the_list_of_released_ones(tmp_path, monkeypatch) -> None:
    """GC's first commit counted what its second would expire by testing every ref against the list of released tags:
    O(tags x released) comparisons while planning on the head it swaps (4,000 tags: 0.1 s, 20,000: seconds)."""
    from lakestream_iceberg.lifecycle import gc

    compared: list[int] = []

    class Names(list):  # the released tags' names, counting the comparisons a membership test makes
        def __contains__(self, item: object) -> bool:
            compared.append(len(self))
            return super().__contains__(item)

    class Report(gc.GCReport):
        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, Names(value) if name == "released_checkpoints" else value)

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.many", schema=SCHEMA, world_size=1,
                           properties={"lakestream.snapshots.retain-last": "100"})
    publish(stream, "p", 30)
    for step in range(1, 31):
        stream.checkpoint(f"c{step}", step=step)
    monkeypatch.setattr(gc, "GCReport", Report)
    report = stream.collect_garbage(dry_run=True, keep_last=2)
    assert len(report.released_checkpoints) == 28 and report.snapshots_expired > 0
    assert sum(compared) < 30, f"{sum(compared)} comparisons of names for 30 tags"


@pytest.mark.parametrize("call", ["follow", "replay"])
def test_a_producer_whose_head_gc_swept_while_it_read_a_batchs_data_file_gets_no_raw_file_error(
        tmp_path, monkeypatch, call: str) -> None:
    """Once the snapshot that published the id's last seq has expired, a producer tells whose batch it was by its data
    file, listed by the head it read; a GC that collected meanwhile and swept that head's manifests made the call raise
    a bare FileNotFoundError. It is read again on the current head, as every read after GC is."""
    from lakestream_iceberg import ProducerConflictError
    from lakestream_iceberg.write.head import ProducerHead

    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=1,
                           properties={"lakestream.snapshots.retain-last": "2"})
    first = Stream.open(catalog, "ns.stream").producer("p")
    first.commit(batch("p", 0, 1))  # step 1; `first` was made before `twin`
    twin = Stream.open(catalog, "ns.stream").producer("p")
    twin.commit(batch("p", 1, 1))  # step 2: seq 1, by a live writer made after `first`
    publish(stream, "x", 4)  # steps 3-6: the snapshot of step 2 expires
    stream.checkpoint("c4", step=4)
    gc_stream = Stream.open(catalog, "ns.stream")
    checked = ProducerHead.check_follows if call == "follow" else ProducerHead.check_replay

    def gc_first(self: ProducerHead, *args, **kwargs):  # GC collects and sweeps right after the producer read the head
        if not gc_stream.state().collected_below > 1:
            gc_stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
        return checked(self, *args, **kwargs)

    monkeypatch.setattr(ProducerHead, "check_follows" if call == "follow" else "check_replay", gc_first)
    first._loop.mark_stale()  # noqa: SLF001 - as a failed call leaves it: the next call reads the head first
    if call == "follow":  # `first` numbers after the id's last seq, the twin's: another live writer's, or unknown now
        try:
            result = first.commit(batch("p", 2, 1))
        except ProducerConflictError:
            pass
        else:
            assert result.seq == 2 and not result.duplicate
    else:  # `first` replays seq 1: the twin's batch, or unknown now
        try:
            result = first.commit(batch("p", 1, 1), seq=1)
        except ProducerConflictError:
            pass
        else:
            assert result.duplicate
    assert gc_stream.state().collected_below == 4


OP_CHILD = r"""
import sys

from lakestream_iceberg import Stream
from lakestream_iceberg.connect import swap
from tests.support import sqlite_catalog

root, op = sys.argv[1], sys.argv[2]
write = swap._write_metadata


def stop(*args) -> None:  # every file of the commit written, the catalog's pointer not moved: SIGKILLed here
    write(*args)
    print("stopped", flush=True)
    sys.stdin.readline()


swap._write_metadata = stop
stream = Stream.open(sqlite_catalog(root), "ns.stream")
{"checkpoint": lambda: stream.checkpoint("c5", step=5), "fork": lambda: stream.fork("c3", branch="exp"),
 "release": lambda: stream.release("c3"), "repair": lambda: stream.repair()}[op]()
"""


@pytest.mark.parametrize("op", ["checkpoint", "fork", "release", "repair"])
def test_a_lifecycle_command_killed_before_its_swap_changed_nothing_and_gc_removes_what_it_wrote(tmp_path, op: str) -> None:
    from lakestream_iceberg.lifecycle.sweep import norm, referenced_files
    from tests.support import foreign_append

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=2)
    publish(stream, "p", 6)
    stream.checkpoint("c3", step=3)
    if op == "repair":
        foreign_append(stream)
    before = stream.refresh().table.metadata_location
    killed_where_it_stops(OP_CHILD, str(tmp_path), op)
    assert stream.refresh().table.metadata_location == before  # nothing half done
    assert [c.name for c in stream.checkpoints()] == ["c3"]
    {"checkpoint": lambda: stream.checkpoint("c5", step=5), "fork": lambda: stream.fork("c3", branch="exp"),
     "release": lambda: stream.release("c3"), "repair": lambda: stream.repair()}[op]()  # the same command again lands
    report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.files_deleted.get("metadata", 0) >= 1  # the killed command's metadata.json: no orphan is left
    metadata = stream.refresh().table.metadata
    location = metadata.location.removeprefix("file://")
    on_disk = {norm(os.path.join(d, f)) for d, _, fs in os.walk(location) for f in fs}
    assert on_disk - referenced_files(stream.io, metadata, stream.table.metadata_location, stream) == set()
    assert digest(stream.read(6, rank=1)) == digest(batch("p", 5, 2)[1])


def test_keep_last_with_a_dropped_branch_and_a_tag_another_engine_replaced(catalog, stream: Stream) -> None:
    """keep_last counts each branch's lakestream checkpoints: those of a branch another engine dropped stay a group of
    their own (GC collects nothing there), and a checkpoint's tag another engine moved to another snapshot is no
    checkpoint any more (its snapshot is kept as any other engine's tag)."""
    publish(stream, "p", 8)
    for step in (2, 4, 6):
        stream.checkpoint(f"m{step}", step=step)
    stream.fork("m2", branch="exp")
    publish(stream, "q", 4, branch="exp")
    for step in (4, 5):
        stream.checkpoint(f"e{step}", step=step, branch="exp")
    table = stream.refresh().table
    head = table.metadata.refs["main"].snapshot_id
    table.manage_snapshots().remove_branch("exp").remove_tag("m6").create_tag(head, "m6").commit()
    report = stream.refresh().collect_garbage(dry_run=False, keep_last=1)
    assert sorted(report.released_checkpoints) == ["e4", "m2"]
    assert report.collected_below == {"main": 4}
    assert sorted(c.name for c in stream.refresh().checkpoints()) == ["e5", "m4"]
    assert stream.table.metadata.refs["m6"].snapshot_id == head  # another engine's tag and its snapshot stay
    assert [digest(stream.read(s, rank=0)) for s in range(4, 9)] == [digest(batch("p", s - 1, 2)[0]) for s in range(4, 9)]
    assert set(stream.table.scan(snapshot_id=head).to_arrow().column("_step").to_pylist()) == set(range(1, 9))


@pytest.mark.parametrize("commit", ["first", "second"])
def test_a_gc_that_gives_up_to_contention_says_what_it_did_and_to_run_it_again(tmp_path, monkeypatch, commit: str) -> None:
    """The commit loop's budget message spoke of a batch: "nothing was published. Retry the same call (same seq)",
    also when GC's second commit gave up after its first had released checkpoints and collected steps."""
    from lakestream_iceberg import CommitTimeoutError
    from lakestream_iceberg.lifecycle import gc

    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=1,
                           properties={"lakestream.commit.max-attempts": "1"})
    publish(stream, "p", 4)
    stream.checkpoint("c2", step=2)
    stream.checkpoint("c3", step=3)
    producer = Stream.open(catalog, "ns.stream").producer("q")
    planned = gc.plan_collect if commit == "first" else gc.plan_expire

    def after_another_commit(*args, **kwargs):  # a producer's commit lands between GC's plan and its swap
        producer.commit(batch("q", producer.next_seq, 1))
        return planned(*args, **kwargs)

    monkeypatch.setattr(gc, "plan_collect" if commit == "first" else "plan_expire", after_another_commit)
    with pytest.raises(CommitTimeoutError) as raised:
        stream.collect_garbage(dry_run=False, keep_last=1)
    message = str(raised.value)
    assert "seq" not in message and "Run GC again" in message
    assert ("nothing was released" in message) == (commit == "first")
    assert [c.name for c in stream.refresh().checkpoints()] == (["c2", "c3"] if commit == "first" else ["c3"])
    monkeypatch.undo()
    stream.collect_garbage(dry_run=False, keep_last=1)  # run again: it lands
    assert [c.name for c in stream.refresh().checkpoints()] == ["c3"] and stream.state().collected_below == 3


@pytest.mark.slow
def test_gc_lands_while_a_producer_keeps_committing_on_a_stream_of_hundreds_of_steps(tmp_path) -> None:
    """A long training run: a producer commits back to back while a scheduled GC collects below the newest checkpoint.
    GC's first commit asserts every branch head and is planned again after each lost race; it rewrote every manifest
    holding a collected step each time (80-100 ms at 800 steps of world size 2) while the producer commits every
    15-20 ms: it lost every race and gave up with CommitTimeoutError, every time it was run (with a 20 s budget here,
    and with the default 5 minutes at 2,000 steps): a busy stream's storage was never reclaimed. Its attempts now keep
    the manifests they wrote, and a later attempt plans in about a producer's commit time."""
    root = Path(__file__).resolve().parents[2]
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2)
    publish(stream, "pre", 800)
    log = tmp_path / "w.jsonl"  # a pipe left unread would stop the producer once full
    producer = subprocess.Popen([sys.executable, "-m", "tests.workers", str(tmp_path), "ns.stream", "w", "1000000"],
                                cwd=root, stdout=log.open("w"), stderr=subprocess.DEVNULL)
    try:
        until(lambda: log.stat().st_size > 0, "the producer's first commit")
        latest = stream.checkpoint("latest", step=stream.head_step() - 1)
        report = stream.collect_garbage(dry_run=False, keep_last=1)  # gave up after the commit timeout before
        assert report.collected_below == {"main": latest.step}
        head = stream.refresh().head_step()
        assert head > latest.step and stream.state().collected_below == latest.step
    finally:
        producer.kill()
        producer.wait()
    with pytest.raises(StepCollectedError):
        stream.read(latest.step - 1, rank=0)
    seqs = {}  # step -> the producer's seq, as it printed them (its last line may be cut short by the kill)
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            seqs[json.loads(line)["step"]] = json.loads(line)["seq"]
    for step in range(latest.step, head + 1):  # through the manifests an earlier attempt wrote, as the landed one lists
        shards = [stream.read(step, rank=rank) for rank in (0, 1)]
        if step <= 800 or step in seqs:
            expected = batch("pre", step - 1, 2) if step <= 800 else batch("w", seqs[step], 2)
            assert [digest(t) for t in shards] == [digest(t) for t in expected]
    final = stream.refresh().head_step()  # pyiceberg's own scan plans the files of the steps kept, and only those
    kept = {f.file_path for step in range(latest.step, final + 1) for f in stream.locate(step)
            if f.record_count}  # pyiceberg's scan skips a file of no rows (an empty shard), as Iceberg's does
    assert {task.file.file_path for task in stream.table.scan().plan_files()} == kept and len(kept) > final - latest.step


def test_dropping_with_purge_after_gc_warns_of_no_file_gc_already_deleted(catalog, stream: Stream, caplog) -> None:
    """pyiceberg's purge_table walks every manifest entry, the DELETED ones of GC's collect snapshots too, and logs
    "Failed to delete data file ..." (a WARNING) for each file GC already removed: Stream.drop(purge=True) of a stream
    GC had collected printed one failure per collected file (W per step: thousands after a long run), though every
    file of the stream was gone. A file GC deleted is no failure; a file that could not be deleted still is."""
    import logging

    publish(stream, "p", 6)
    stream.checkpoint("c5", step=5)
    report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.files_deleted["data"] == 4 * 4
    location = stream.table.metadata.location.removeprefix("file://")
    with caplog.at_level(logging.WARNING):
        Stream.drop(catalog, "ns.stream", purge=True)
    failures = [r.getMessage() for r in caplog.records if "Failed to delete" in r.getMessage()]
    assert failures == [], f"{len(failures)} warnings, e.g. {failures[:2]}"
    left = {os.path.join(d, f) for d, _, fs in os.walk(location) for f in fs}
    assert not {f for f in left if f.endswith(".parquet") and "/_producers/" not in f}, left


class DropsReplyOfCommit:
    """A mixin for a real SQLite catalog whose connection 'drops' after the next ``drop`` commits landed: the caller
    sees an error whose outcome it cannot know (as a REST timeout or a PostgreSQL connection reset after COMMIT)."""

    drop = 0

    def commit_table(self, table, requirements, updates):  # type: ignore[no-untyped-def]
        response = super().commit_table(table, requirements, updates)  # type: ignore[misc]
        if self.drop:
            self.drop -= 1
            raise ConnectionResetError("connection reset by peer (injected, after the commit landed)")
        return response


@pytest.mark.parametrize("op", ["checkpoint", "release", "fork"])
def test_a_lifecycle_command_whose_commit_landed_but_whose_reply_was_lost_succeeds_once(tmp_path, op: str) -> None:
    """The commit loop reads the head back after an unknown outcome and plans again: the planners of checkpoint,
    release and fork took their own landed commit for someone else's (a checkpoint or branch of that name already
    exists, no checkpoint of that name to release) and the call failed though it had done what it was asked."""
    from pyiceberg.catalog.sql import SqlCatalog

    class Flaky(DropsReplyOfCommit, SqlCatalog):
        pass

    catalog = Flaky("flaky", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2)
    publish(stream, "p", 6)
    stream.checkpoint("c3", step=3)
    before = len(stream.refresh().table.metadata.snapshots)
    catalog.drop = 1
    if op == "checkpoint":
        made = stream.checkpoint("c5", step=5)
        assert [(c.name, c.step, c.snapshot_id) for c in stream.refresh().checkpoints()] == \
               [("c3", 3, stream.checkpoints()[0].snapshot_id), ("c5", 5, made.snapshot_id)]
        assert len(stream.table.metadata.snapshots) == before + 1  # one anchor: the commit landed once
    elif op == "release":
        stream.release("c3")
        assert stream.refresh().checkpoints() == []
    else:
        forked = stream.fork("c3", branch="exp")
        assert forked.name == "c3" and stream.refresh().table.metadata.refs["exp"].snapshot_id == forked.snapshot_id
        publish(stream, "q", 1, branch="exp")
        assert stream.head_step(branch="exp") == 4
    assert catalog.drop == 0


class RacesCommit:
    """A mixin for a real SQLite catalog that runs ``before`` (once) just before the next commit: another process's
    commit landing between this one's planning and its compare-and-swap, which this one then loses (a definite
    failure, not an unknown outcome)."""

    before = None

    def commit_table(self, table, requirements, updates):  # type: ignore[no-untyped-def]
        before, self.before = self.before, None
        if before is not None:
            before()
        return super().commit_table(table, requirements, updates)  # type: ignore[misc]


@pytest.mark.parametrize("op", ["release", "fork"])
def test_a_lifecycle_command_that_lost_its_swap_to_another_process_doing_the_same_fails_as_before(tmp_path,
                                                                                                   op: str) -> None:
    """Recognising one's own landed commit after an unknown outcome must not turn a lost compare-and-swap into
    success: another process released the checkpoint (or made the branch, and published on it) first, and this call
    said it had done it, where it said 'no checkpoint' / 'already used' before (and does when run after the other)."""
    from pyiceberg.catalog.sql import SqlCatalog

    class Racing(RacesCommit, SqlCatalog):
        pass

    catalog = Racing("racing", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2)
    publish(stream, "p", 4)
    stream.checkpoint("c3", step=3)
    other = Stream.open(catalog, "ns.stream")
    if op == "release":
        catalog.before = lambda: other.release("c3")
        with pytest.raises(CheckpointError, match="no checkpoint named 'c3'"):
            stream.release("c3")
    else:
        def fork_and_publish() -> None:
            other.fork("c3", branch="exp")
            publish(other, "q", 1, branch="exp")

        catalog.before = fork_and_publish
        with pytest.raises(CheckpointError, match="already used"):
            stream.fork("c3", branch="exp")
        assert stream.refresh().head_step(branch="exp") == 4  # the other process's branch, untouched
    assert catalog.before is None


@pytest.mark.parametrize("how", ["rollback", "rebase"])
def test_a_repair_whose_commit_landed_but_whose_reply_was_lost_reports_what_it_did(tmp_path, how: str) -> None:
    """After an unknown outcome the loop reads the head back and repair plans again: on the repaired branch it found
    nothing to repair and reported that (no foreign snapshot, nothing rolled back or re-based), though the call had
    just rolled a foreign change back (or re-based the state) itself."""
    from pyiceberg.catalog.sql import SqlCatalog

    from tests.support import foreign_append
    from tests.test_interop import commit_replace

    class Flaky(DropsReplyOfCommit, SqlCatalog):
        pass

    catalog = Flaky("flaky", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2)
    publish(stream, "p", 4)
    if how == "rollback":
        foreign_append(stream)
    else:  # rewrite_manifests, then an expiry of every snapshot below it: the state is read back from the log
        foreign = commit_replace(stream)
        table = stream.refresh().table
        table.maintenance.expire_snapshots().by_ids(
            [s.snapshot_id for s in table.metadata.snapshots if s.snapshot_id != foreign.snapshot_id]).commit()
    planned = stream.repair(dry_run=True)
    assert planned.foreign
    catalog.drop = 1
    report = stream.repair()
    assert catalog.drop == 0
    assert (report.foreign, report.rolled_back_to, report.rebased_on, report.step, report.changes, report.dry_run) == \
           (planned.foreign, planned.rolled_back_to, planned.rebased_on, 4, planned.changes, False)
    assert stream.repair().foreign == ()
    publish(stream, "p", 1)
    assert stream.head_step() == 5


def test_a_clear_whose_reply_was_lost_reports_it_after_a_producer_published_step_1_meanwhile(tmp_path) -> None:
    """Repair removed main's ref under a foreign append written before the first step, and the reply was lost; before
    the loop read the head back, a producer published step 1. Repair planned again on that step, found nothing to
    repair and reported so (cleared False, no foreign snapshot), though the call had just cleared main itself."""
    from pyiceberg.catalog.sql import SqlCatalog

    from tests.support import foreign_append

    class Flaky(DropsReplyOfCommit, SqlCatalog):
        meanwhile = None

        def commit_table(self, table, requirements, updates):  # type: ignore[no-untyped-def]
            dropping = self.drop
            try:
                return super().commit_table(table, requirements, updates)
            finally:
                if dropping and self.meanwhile is not None:
                    run, self.meanwhile = self.meanwhile, None
                    run()

    catalog = Flaky("flaky", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2)
    foreign_append(stream)
    planned = stream.repair(dry_run=True)
    assert planned.cleared and planned.foreign
    other = Stream.open(catalog, "ns.stream")
    catalog.drop, catalog.meanwhile = 1, lambda: publish(other, "q", 1)
    report = stream.repair()
    assert catalog.drop == 0 and catalog.meanwhile is None
    assert stream.refresh().head_step() == 1
    assert (report.foreign, report.cleared, report.repaired, report.step) == (planned.foreign, True, True, 0)


@pytest.mark.parametrize("lost", ["first", "second"])
def test_gc_whose_commit_landed_but_whose_reply_was_lost_reports_what_it_did(tmp_path, lost: str) -> None:
    """GC's first commit (release + collect) re-planned on the head it had just changed found nothing to release or
    collect, committed again and reported that (released_checkpoints=[], collected_below={}); its second commit
    (expiry) found nothing to expire and reported 0 expired for the snapshots it had just expired."""
    from pyiceberg.catalog.sql import SqlCatalog

    class Flaky(DropsReplyOfCommit, SqlCatalog):
        skip = 0

        def commit_table(self, table, requirements, updates):  # type: ignore[no-untyped-def]
            if self.skip:
                self.skip -= 1
                return SqlCatalog.commit_table(self, table, requirements, updates)
            return super().commit_table(table, requirements, updates)

    catalog = Flaky("flaky", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2)
    publish(stream, "p", 4)
    stream.checkpoint("c2", step=2)
    stream.checkpoint("c3", step=3)
    args = {"keep_last": 1, "grace": timedelta(0), "allow_short_grace": True}
    planned = stream.collect_garbage(dry_run=True, **args)
    assert (planned.released_checkpoints, planned.collected_below) == (["c2"], {"main": 3})
    commits = len(stream.refresh().table.metadata.metadata_log)
    catalog.drop, catalog.skip = 1, (0 if lost == "first" else 1)
    report = stream.collect_garbage(dry_run=False, **args)
    assert catalog.drop == 0
    assert (report.released_checkpoints, report.collected_below, report.snapshots_expired) == \
           (["c2"], {"main": 3}, planned.snapshots_expired)
    assert len(stream.refresh().table.metadata.metadata_log) == commits + 2  # its two commits, each landed once
    assert [c.name for c in stream.checkpoints()] == ["c3"]
    publish(stream, "p", 1)
    assert stream.head_step() == 5
