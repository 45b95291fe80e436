"""The follow-mode poll schedule (ArrivalClock) on synthetic arrival times, and HeadWatcher feeding it real commits.

The schedule is a pure function of the arrivals and the clock, so it is tested with made-up times: nothing here sleeps
or measures time.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from lakestream_iceberg import Stream
from lakestream_iceberg.read.follow import ArrivalClock, HeadWatcher
from tests.support import SCHEMA, batch, sqlite_catalog

POLL, MAX = 0.002, 0.5


def clock_with(*polls: float) -> ArrivalClock:
    """A clock whose arrivals were found by polls at these times, each right after a poll 1 ms earlier."""
    clock = ArrivalClock()
    for t in polls:
        clock.note(t - 0.001, t)
    return clock


def test_arrivals_are_dated_between_the_two_polls() -> None:
    clock = ArrivalClock()
    clock.note(None, 1.0)  # no earlier poll: the poll's own time
    clock.note(1.2, 1.4)
    clock.note(1.5, 1.5)
    assert list(clock._arrivals) == pytest.approx([1.0, 1.3, 1.5])


def test_too_little_history_backs_off() -> None:
    assert ArrivalClock().delay(0.0, poll_s=POLL, max_poll_s=MAX) is None
    assert clock_with(1.0, 1.05).delay(1.06, poll_s=POLL, max_poll_s=MAX) is None


def test_steady_arrivals_sleep_until_just_before_the_next_one_is_due() -> None:
    clock = clock_with(1.0, 1.05, 1.10, 1.15)  # every 50 ms; last arrival dated 1.1495
    last = 1.1495
    # right after an arrival: sleep until 10% of the shortest interval (5 ms) before the next is due
    assert clock.delay(last + 0.001, poll_s=POLL, max_poll_s=MAX) == pytest.approx(0.050 - 0.005 - 0.001)
    # never longer than max_poll_s, never shorter than poll_s
    assert clock.delay(last + 0.001, poll_s=POLL, max_poll_s=0.01) == pytest.approx(0.01)
    assert clock.delay(last + 0.044, poll_s=POLL, max_poll_s=MAX) == pytest.approx(POLL)
    # due or overdue, but not idle: poll every poll_s, no backoff
    assert clock.delay(last + 0.060, poll_s=POLL, max_poll_s=MAX) == pytest.approx(POLL)
    assert clock.delay(last + 0.199, poll_s=POLL, max_poll_s=MAX) == pytest.approx(POLL)
    # no step for more than 4 typical intervals: idle, the caller backs off
    assert clock.delay(last + 0.201, poll_s=POLL, max_poll_s=MAX) is None


def test_the_shortest_recent_interval_bounds_the_sleep() -> None:
    """Irregular producers: the wake-up follows the shortest interval, so an early commit is not slept through."""
    clock = clock_with(1.0, 1.02, 1.14, 1.20, 1.32)  # intervals 20, 120, 60, 120 ms
    last = 1.3195
    assert clock.delay(last, poll_s=POLL, max_poll_s=MAX) == pytest.approx(0.020 - POLL)
    # a slow poll_s (the dataset's default 20 ms) is the floor, and the margin is at least one poll
    assert clock.delay(last, poll_s=0.02, max_poll_s=MAX) == pytest.approx(0.02)


def test_old_arrivals_fall_out_of_the_window() -> None:
    clock = clock_with(*[1.0 + 0.5 * i for i in range(5)], *[3.5 + 0.05 * i for i in range(1, 10)])
    assert len(clock._arrivals) == ArrivalClock.ARRIVALS_KEPT
    last = 3.5 + 0.45 - 0.0005
    assert clock.delay(last + 0.001, poll_s=POLL, max_poll_s=MAX) == pytest.approx(0.050 - 0.005 - 0.001)


def test_head_watcher_notes_each_new_head_once(tmp_path: Path) -> None:
    (tmp_path / "wh").mkdir()
    catalog = SqlCatalog("lakestream_follow_test", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}/wh")
    stream = Stream.create(catalog, "ns.s", schema=pa.schema([("x", pa.int64())]), world_size=1)
    producer = stream.producer("p")
    producer.commit([pa.table({"x": [0]})])
    reader = Stream.open(catalog, "ns.s")
    watcher = HeadWatcher(reader, branch="main")
    watcher.check()  # the head found at start is not an arrival: nobody knows when it landed
    assert len(watcher.clock._arrivals) == 0
    for i in range(1, 4):
        producer.commit([pa.table({"x": [i]})])
        assert watcher.check() and watcher.head()[0] == i + 1
        assert not watcher.check()  # unchanged pointer: no arrival
        assert len(watcher.clock._arrivals) == i
    assert watcher.clock.delay(watcher.clock._arrivals[-1], poll_s=POLL, max_poll_s=MAX) is not None
    # wait() returns at once for a published step, and keeps working on the clock's schedule
    assert watcher.wait(4, timeout=60, stop=threading.Event(), poll_s=POLL, max_poll_s=MAX)[0] == 4  # type: ignore[index]
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(
        watcher.wait(5, timeout=600, stop=threading.Event(), poll_s=POLL, max_poll_s=MAX)))
    thread.start()
    producer.commit([pa.table({"x": [4]})])
    thread.join(600)
    assert done and done[0][0] == 5  # type: ignore[index]


def test_a_reader_whose_pointed_metadata_file_was_deleted_reads_the_newer_one(tmp_path: Path) -> None:
    """A reader reads the catalog pointer, then falls more than write.metadata.previous-versions-max commits behind
    before it reads the file: that file was deleted. The pointer has moved on, so it reads the one named now."""
    from lakestream_iceberg.connect.pointer import cached_probe, read_pointed

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.gone", schema=SCHEMA, world_size=2,
                           properties={"write.metadata.previous-versions-max": "1"})
    producer = stream.producer("p")
    producer.commit(batch("p", 0, 2), seq=0)
    probe = cached_probe(stream.refresh().table)
    assert probe is not None
    pointed = probe()
    for seq in range(1, 4):  # the pointed file leaves the metadata log and is deleted
        producer.commit(batch("p", seq, 2), seq=seq)
    assert not Path(pointed.removeprefix("file://")).exists()
    location, metadata = read_pointed(stream.io, pointed, probe)
    assert location == probe() != pointed
    assert metadata.current_snapshot().summary["lakestream.step"] == "4"
    Path(location.removeprefix("file://")).unlink()  # a file missing while the pointer names it is a real loss
    with pytest.raises(FileNotFoundError):
        read_pointed(stream.io, location, probe)


def test_a_head_rolled_back_under_a_follower_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another engine rolls main back from step 4 to step 2 while a follower watches: the follower has delivered the
    old steps 3-4 and will not deliver the steps published again under those numbers. That went without a word."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.back", schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    for seq in range(4):
        producer.commit(batch("p", seq, 2), seq=seq)
    step_2 = next(s.snapshot_id for s in stream.refresh().table.metadata.snapshots
                  if s.summary is not None and s.summary.additional_properties.get("lakestream.step") == "2")
    watcher = HeadWatcher(Stream.open(stream.table.catalog, "ns.back"), branch="main")
    watcher.check()
    stream.table.manage_snapshots().rollback_to_snapshot(step_2).commit()
    with caplog.at_level("WARNING", logger="lakestream_iceberg.read.follow"):
        assert watcher.check() and watcher.head()[0] == 2
        assert not watcher.check()  # once per move back
    assert [r.getMessage() for r in caplog.records if "moved back" in r.getMessage()] == [
        "the head of ns.back (branch 'main') moved back from step 4 to step 2: steps 3-4 a reader of it may have "
        "delivered are no longer on the branch, and a follower does not deliver the steps published again under those "
        "numbers. Restart the readers from step 3 (start_step=) or an earlier checkpoint"]
    again = Stream.open(stream.table.catalog, "ns.back").producer("q")
    again.commit(batch("q", 0, 2), seq=0)
    assert watcher.check() and watcher.head()[0] == 3 and len(watcher.clock._arrivals) == 1  # a step arrived


def forked_stream(tmp_path: Path) -> Stream:
    """Stream ns.drop with 2 steps on main and fork "f" from checkpoint c1 (step 1), holding its own step 2."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.drop", schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    for seq in range(2):
        producer.commit(batch("p", seq, 2), seq=seq)
    stream.checkpoint("c1", step=1)
    stream.fork("c1", branch="f")
    stream.producer("q", branch="f").commit(batch("q", 0, 2), seq=0)
    return stream


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_a_followed_branch_another_engine_drops_ends_the_follow_with_a_read_error(tmp_path: Path, relay: bool) -> None:
    """A fork dropped by another engine (Spark's ALTER TABLE ... DROP BRANCH) under a follow-mode dataset: its head
    read as step 0 ("moved back") and the follower waited for a step that can never come, up to its timeout (forever
    with timeout=None). It ends with a ReadError naming the branch; a branch replaced by a tag of its name too."""
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg import LakestreamDataset, ReadError

    stream = forked_stream(tmp_path)
    items = iter(LakestreamDataset(stream, rank=0, world_size=2, follow=True, branch="f", timeout=None, relay=relay,
                                   start_step=2))
    assert next(items)["step"] == 2  # the fork's step 2: followed from here
    stream.refresh().table.manage_snapshots().remove_branch("f").commit()
    with pytest.raises(ReadError, match="branch 'f' of ns.drop no longer exists"):
        next(items)
    stream.fork("c1", branch="g")
    watcher = HeadWatcher(Stream.open(stream.table.catalog, "ns.drop"), branch="g")
    watcher.check()
    anchor = stream.refresh().table.metadata.refs["g"].snapshot_id
    stream.table.manage_snapshots().remove_branch("g").create_tag(anchor, "g").commit()
    with pytest.raises(ReadError, match="branch 'g' of ns.drop is a tag now"):
        watcher.check()
    with pytest.raises(ReadError, match="is a checkpoint's tag, not a branch"):
        stream.wait_for(5, branch="c1", timeout=600)  # a tag is never followed as a branch


def test_waiting_for_a_step_a_checkpoint_tag_already_holds_returns_it(tmp_path: Path) -> None:
    """A checkpoint's tag reads as what it pins (head_step, read): wait_for of a step it holds returned at once, until
    the dropped-branch check raised 'is a tag now ... another engine replaced it' for a tag that never was a branch.
    A step past the tag is still refused, as a tag, not as a replaced branch."""
    from lakestream_iceberg import ReadError

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.tag", schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, 2), seq=seq)
    stream.checkpoint("c2", step=2)
    assert stream.head_step(branch="c2") == 2
    assert stream.wait_for(2, branch="c2", timeout=600) == 2
    with pytest.raises(ReadError, match="'c2' of ns.tag is a checkpoint's tag, not a branch: it pins step 2"):
        stream.wait_for(3, branch="c2", timeout=600)


def test_the_lag_on_a_branch_the_stream_does_not_have_is_refused(tmp_path: Path) -> None:
    """consumer_lag(stream, step, branch="typo") read the missing branch as an empty one and answered 0 (caught up),
    where head_step() and wait_for() refuse a branch the stream does not have."""
    from lakestream_iceberg.errors import ConfigError
    from lakestream_iceberg.read.follow import consumer_lag

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.lag", schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, 2), seq=seq)
    assert consumer_lag(stream, 1) == 2
    with pytest.raises(ConfigError, match="'mian'"):
        consumer_lag(stream, 1, branch="mian")


@pytest.mark.parametrize(("follow", "relay"), [(False, False), (True, False), (True, True)],
                         ids=["read", "follow-direct", "follow-relay"])
def test_an_iteration_starting_after_its_branch_was_dropped_raises_the_read_error(tmp_path: Path, follow: bool,
                                                                                  relay: bool,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset made on a fork that another engine drops before the dataset's (next) iteration starts: the
    iteration's fresh head watcher had never seen the branch, read the missing ref as an unborn branch at step 0, and
    the iteration delivered nothing without a word (follow=False: an empty epoch; lag() said 0) or waited out its
    timeout for a step that cannot come (follow=True; forever with timeout=None), where a drop seen while following
    raises ReadError."""
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg import LakestreamDataset, ReadError

    directory = tmp_path / "relay"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("LAKESTREAM_RELAY_DIR", str(directory))
    stream = forked_stream(tmp_path)
    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=follow, branch="f", start_step=2, timeout=20,
                           relay=relay)
    if not follow:
        assert [item["step"] for item in ds] == [2]  # an epoch before the drop
    other = Stream.open(stream.table.catalog, "ns.drop")  # another engine, another process
    other.table.manage_snapshots().remove_branch("f").commit()
    with pytest.raises(ReadError, match="branch 'f' of ns.drop no longer exists"):
        list(ds)
    with pytest.raises(ReadError, match="branch 'f' of ns.drop no longer exists"):
        ds.lag()


def test_a_follower_that_saw_a_foreign_first_snapshot_follows_on_after_repair_clears_main(tmp_path: Path) -> None:
    """Another engine appended before the first step; a follower polling meanwhile was refused (ForeignSnapshotError),
    then repair removed main's ref (the stream as created). The follower's next poll took main's missing ref for a drop
    ("another engine or a person dropped it"), for good, though the next commit publishes step 1 on it."""
    from lakestream_iceberg import ForeignSnapshotError
    from tests.support import foreign_append

    catalog = sqlite_catalog(tmp_path)
    stream = Stream.create(catalog, "ns.clear", schema=SCHEMA, world_size=2)
    watcher = HeadWatcher(Stream.open(catalog, "ns.clear"), branch="main")
    assert watcher.head()[0] == 0
    foreign_append(stream)
    with pytest.raises(ForeignSnapshotError):
        watcher.check()
    assert stream.repair().cleared
    watcher.check()
    assert watcher.head()[0] == 0
    stream.producer("p").commit(batch("p", 0, 2), seq=0)
    assert watcher.latest()[0] == 1


def test_a_followed_main_removed_after_its_steps_is_still_a_drop(tmp_path: Path) -> None:
    """The converse: main's ref removed (pyiceberg's remove_branch) under a follower that saw steps on it."""
    from lakestream_iceberg import ReadError

    catalog = sqlite_catalog(tmp_path)
    stream = Stream.create(catalog, "ns.clear", schema=SCHEMA, world_size=2)
    stream.producer("p").commit(batch("p", 0, 2), seq=0)
    watcher = HeadWatcher(Stream.open(catalog, "ns.clear"), branch="main")
    assert watcher.latest()[0] == 1
    stream.refresh().table.manage_snapshots().remove_branch("main").commit()
    with pytest.raises(ReadError, match="branch 'main' of ns.clear no longer exists"):
        watcher.check()


def test_a_dataset_made_on_a_foreign_first_snapshot_reads_step_1_after_repair_clears_main(tmp_path: Path) -> None:
    """The dataset's side of the above: made while main held only another engine's first snapshot, it recorded main as
    an existing branch, and every iteration after repair's clear ended with "branch 'main' ... no longer exists"."""
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg import ForeignSnapshotError, LakestreamDataset
    from tests.support import foreign_append

    catalog = sqlite_catalog(tmp_path)
    stream = Stream.create(catalog, "ns.clear", schema=SCHEMA, world_size=2)
    foreign_append(stream)
    dataset = LakestreamDataset(Stream.open(catalog, "ns.clear"), rank=0, world_size=2, follow=True, relay=False,
                                timeout=30)
    with pytest.raises(ForeignSnapshotError):
        next(iter(dataset))
    assert stream.repair().cleared
    assert dataset.lag() == 0  # no step yet, as a stream just created
    stream.producer("p").commit(batch("p", 0, 2), seq=0)
    assert next(iter(dataset))["step"] == 1
