"""Producer state at scale: idle producers are compacted out of the summary, and exactly-once holds for every id."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.io.pyarrow import PyArrowFileIO

from lakestream_iceberg import ConfigError, CorruptStateError, Stream
from lakestream_iceberg.format import producers
from lakestream_iceberg.format.producers import PRODUCERS_DIR
from lakestream_iceberg.format.summary import KEY_PRODUCERS
from tests.backends import published
from tests.support import SCHEMA, batch, digest, sqlite_catalog
from tests.workers import SMALL_CONSTANTS_ENV

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
# Small compaction constants (the library reads them as module globals of format.producers at call time): the same
# code paths (compaction, merges, lookups in files, returning producers, GC) with ~15x fewer commits than the defaults
# (32/32/8) need. test_compaction_with_the_default_constants runs the real defaults end to end.
ACTIVE_MIN_STEPS, COMPACT_AT, MAX_FILES = 4, 4, 3
CHURN = ACTIVE_MIN_STEPS + COMPACT_AT * (MAX_FILES + 2)  # enough one-shot ids to compact, and to merge the files once


def churn(stream: Stream, ids: range) -> None:
    for i in ids:
        result = stream.producer(f"id-{i}").commit(batch(f"id-{i}", 0, WORLD))
        assert (result.seq, result.duplicate) == (0, False)


def metadata_bytes(stream: Stream) -> int:
    stream.refresh()
    return len(stream.io.new_input(stream.table.metadata_location))


@pytest.fixture
def small_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library compacts with this module's ACTIVE_MIN_STEPS/COMPACT_AT/MAX_FILES, here and in tests.workers."""
    defaults = (producers.ACTIVE_MIN_STEPS, producers.COMPACT_AT, producers.MAX_FILES)
    assert all(small < default for small, default in zip((ACTIVE_MIN_STEPS, COMPACT_AT, MAX_FILES), defaults, strict=True))
    monkeypatch.setattr(producers, "ACTIVE_MIN_STEPS", ACTIVE_MIN_STEPS)
    monkeypatch.setattr(producers, "COMPACT_AT", COMPACT_AT)
    monkeypatch.setattr(producers, "MAX_FILES", MAX_FILES)
    monkeypatch.setenv(SMALL_CONSTANTS_ENV, f"{ACTIVE_MIN_STEPS},{COMPACT_AT},{MAX_FILES}")


@pytest.fixture
def churned(small_constants: None, tmp_path: Path) -> Stream:
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    churn(stream, range(CHURN))
    return stream


def test_the_summary_holds_the_active_producers_and_the_files_every_other_one(churned: Stream) -> None:
    state = churned.state()
    assert state.step == CHURN
    # one-shot ids do not recur: idle after ACTIVE_MIN_STEPS steps, moved out COMPACT_AT at a time
    assert len(state.producers) < ACTIVE_MIN_STEPS + COMPACT_AT
    assert 1 <= len(state.producer_files) <= MAX_FILES
    everyone = state.all_producers(churned.io)
    assert sorted(everyone) == sorted(f"id-{i}" for i in range(CHURN))
    assert all(everyone[f"id-{i}"].seq == 0 and everyone[f"id-{i}"].step == i + 1 for i in range(CHURN))
    for path in state.producer_files:
        assert f"/data/{PRODUCERS_DIR}/" in path and churned.io.new_input(path).exists()
    summary = churned.head().summary.additional_properties
    assert len(json.loads(summary[KEY_PRODUCERS])) == len(state.producers)


def test_metadata_size_does_not_grow_with_the_ids_ever_seen(churned: Stream) -> None:
    before = metadata_bytes(churned)
    churn(churned, range(CHURN, CHURN + 3 * COMPACT_AT))
    after = metadata_bytes(churned)
    assert after < 64 * 1024
    assert after <= before * 1.15, (before, after)


def test_a_compacted_producer_returns_exactly_once(churned: Stream) -> None:
    assert "id-3" not in churned.state().producers  # compacted into a file
    producer = churned.producer("id-3")
    assert producer.next_seq == 1
    again = producer.commit(batch("id-3", 0, WORLD), seq=0)  # a re-commit of its published seq
    assert (again.duplicate, again.step) == (True, 4)
    result = producer.commit(batch("id-3", 1, WORLD))
    assert (result.seq, result.step, result.duplicate) == (1, CHURN + 1, False)
    assert churned.state().producers["id-3"].seq == 1
    assert digest(churned.read(CHURN + 1, rank=1)) == digest(batch("id-3", 1, WORLD)[1])
    fresh = churned.producer("never-seen")
    assert fresh.next_seq == 0


def test_a_returning_producer_after_the_files_were_merged_keeps_its_sequence(churned: Stream) -> None:
    churn(churned, range(CHURN, CHURN + COMPACT_AT * (MAX_FILES + 1)))  # forces at least one more merge
    for pid in ("id-0", f"id-{CHURN // 2}", f"id-{CHURN + 5}"):
        producer = churned.producer(pid)
        assert producer.next_seq == 1, pid
        assert producer.commit(batch(pid, 0, WORLD), seq=0).duplicate
        assert producer.commit(batch(pid, 1, WORLD)).seq == 1


def test_compaction_with_the_default_constants(tmp_path: Path) -> None:
    """The real constants end to end (the other tests shrink them): idle ids leave the summary COMPACT_AT at a time,
    every id's state stays reachable, a compacted id continues exactly once, and metadata does not grow."""
    active_min, compact_at, max_files = producers.ACTIVE_MIN_STEPS, producers.COMPACT_AT, producers.MAX_FILES
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    n = active_min + 2 * compact_at  # two compactions
    churn(stream, range(n))
    state = stream.state()
    assert len(state.producers) < active_min + compact_at
    assert 2 <= len(state.producer_files) <= max_files
    everyone = state.all_producers(stream.io)
    assert sorted(everyone) == sorted(f"id-{i}" for i in range(n))
    assert all(everyone[f"id-{i}"].step == i + 1 for i in range(n))
    before = metadata_bytes(stream)
    churn(stream, range(n, n + 2 * compact_at))
    after = metadata_bytes(stream)
    assert after < 64 * 1024
    assert after <= before * 1.15, (before, after)
    assert "id-3" not in stream.state().producers
    producer = stream.producer("id-3")
    assert producer.next_seq == 1
    assert producer.commit(batch("id-3", 0, WORLD), seq=0).duplicate
    assert producer.commit(batch("id-3", 1, WORLD)).seq == 1


def test_outcome_unknown_commit_of_a_compacted_producer_is_reconciled(small_constants: None, tmp_path: Path) -> None:
    from tests.test_processes import FlakyAfterCommit

    catalog = FlakyAfterCommit("flaky", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    churn(stream, range(ACTIVE_MIN_STEPS + COMPACT_AT + 4))
    assert "id-1" not in stream.state().producers
    producer = stream.producer("id-1")
    catalog.fail_after = 1  # the commit lands, then the connection drops: the loop reads the table back
    result = producer.commit(batch("id-1", 1, WORLD))
    assert (result.seq, result.duplicate) == (1, False) and result.step == stream.head_step()
    catalog.fail_before = 1  # the connection drops before the commit is sent: it is sent again, once
    result = producer.commit(batch("id-1", 2, WORLD))
    assert (result.seq, result.duplicate) == (2, False)
    seqs = sorted(seq for p, seq in published(stream).values() if p == "id-1")
    assert seqs == [0, 1, 2]


def test_gc_keeps_the_producer_files_retained_snapshots_list(churned: Stream) -> None:
    churned.checkpoint("c1", step=CHURN)
    plan = churned.collect_garbage(dry_run=True, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    report = churned.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert report.dry_run is False and plan.dry_run is True
    assert report.files_deleted.get("producer-state", 0) >= 1  # merged-away files no retained snapshot lists
    assert plan.files_deleted == report.files_deleted  # the dry run reports what the real run deletes, no more
    state = churned.state()
    for path in state.producer_files:
        assert churned.io.new_input(path).exists()
    producer = churned.producer("id-2")
    assert producer.next_seq == 1
    assert producer.commit(batch("id-2", 0, WORLD), seq=0).duplicate


def test_gc_keeps_the_producer_files_a_pending_rebase_reads_back(churned: Stream) -> None:
    """Spark's rewrite_manifests then expire_snapshots(retain_last => 1) expire every snapshot listing the producer
    files; repair reads the state back from the metadata log, files and all. GC run between them deleted those files,
    so the repaired stream raised FileNotFoundError for every id not active (and the compacted ids' seqs were lost)."""
    from tests.test_interop import commit_replace

    foreign = commit_replace(churned)
    table = churned.refresh().table
    table.maintenance.expire_snapshots().by_ids(
        [s.snapshot_id for s in table.metadata.snapshots if s.snapshot_id != foreign.snapshot_id]).commit()
    plan = churned.collect_garbage(dry_run=True, grace=timedelta(0), allow_short_grace=True)
    report = churned.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert "producer-state" not in plan.files_deleted and "producer-state" not in report.files_deleted
    assert report.files_deleted.get("manifest-list", 0) >= 1  # the rest of the sweep goes on
    assert churned.repair().rebased_on == foreign.snapshot_id
    producers.DEFAULT_FILES._files.clear()  # noqa: SLF001 - read the files back, as a new process would
    again = churned.producer("id-2")
    assert (again.next_seq, again.commit(batch("id-2", 0, WORLD), seq=0).duplicate) == (1, True)
    assert churned.producer("new").commit(batch("new", 0, WORLD)).step == CHURN + 1


def _row(producer: str, seq: object, step: object, snapshot_id: object = 1) -> pa.Table:
    return pa.table({"producer": [producer], "seq": pa.array([seq], pa.int64()), "step": pa.array([step], pa.int64()),
                     "snapshot_id": pa.array([snapshot_id], pa.int64())})


@pytest.mark.parametrize("damage", ["foreign columns", "not parquet", "truncated", "negative seq", "negative step", "null id",
                                    "id twice", "deleted"])
def test_a_corrupt_producer_file_is_a_clear_error(churned: Stream, damage: str) -> None:
    """A producer-state file is input read back from storage: whatever is wrong with it, the answer is a
    CorruptStateError naming the file, and nothing is committed on top of it (a negative seq must not become next_seq).
    Deleted: another tool's orphan-file removal that did not exclude data/_producers/ (a raw FileNotFoundError from
    every producer and the history before)."""
    path = churned.state().producer_files[0]
    local = Path(path.removeprefix("file://"))
    head = churned.head_step()
    if damage == "deleted":
        local.unlink()
    elif damage == "foreign columns":
        pq.write_table(pa.table({"x": [1]}), local)
    elif damage == "not parquet":
        local.write_bytes(b"definitely not parquet")
    elif damage == "truncated":
        local.write_bytes(local.read_bytes()[: len(local.read_bytes()) // 2])
    elif damage == "id twice":  # a later row with a lower seq read as the id's state: seqs 1..5 published again
        pq.write_table(pa.concat_tables([_row("id-0", 5, 3), _row("id-0", 0, 1)]), local)
    else:
        seq, step, snapshot_id = {"negative seq": (-5, 3, 1), "negative step": (0, -3, 1), "null id": (0, 3, None)}[damage]
        pq.write_table(_row("id-0", seq, step, snapshot_id), local)
    from lakestream_iceberg.format.producers import DEFAULT_FILES

    DEFAULT_FILES._files.pop(path, None)  # noqa: SLF001 - forget this process's parsed copy, as a new process would
    with pytest.raises(CorruptStateError, match="producer-state file"):
        churned.producer("id-0").next_seq  # noqa: B018
    with pytest.raises(CorruptStateError, match="producer-state file"):
        churned.producer("id-0").commit(batch("id-0", 1, WORLD))
    with pytest.raises(CorruptStateError, match="producer-state file"):
        churned.producer("fresh").commit(batch("fresh", 0, WORLD))  # a new id: looked up in every file
    with pytest.raises(CorruptStateError, match="producer-state file"):
        churned.history().sql("SELECT count(*) FROM producers").fetchall()
    assert churned.refresh().head_step() == head


def test_a_producer_file_of_a_newer_format_is_refused_not_misread(churned: Stream) -> None:
    """Producer-state files carried no format: a newer release's file (here: the same rows, read differently by it, and
    a column of its own) was read as this release's rows, silently, and a merge rewrote it without that column. Files
    name their format in the footer now (absent: 1), and one this release does not read is refused with the error that
    says to upgrade, by a producer's restart and commit and by the history."""
    path = churned.state().producer_files[0]
    local = Path(path.removeprefix("file://"))
    assert pq.read_metadata(local).metadata[b"lakestream.producer-state-format"] == b"1"
    head = churned.head_step()
    rows = pq.read_table(local)
    newer = rows.append_column("epoch", pa.array([7] * rows.num_rows, pa.int64()))
    pq.write_table(newer.replace_schema_metadata({"lakestream.producer-state-format": "2"}), local)
    from lakestream_iceberg.format.producers import DEFAULT_FILES

    DEFAULT_FILES._files.pop(path, None)  # noqa: SLF001 - forget this process's parsed copy, as a new process would
    refused = pytest.raises(ConfigError, match=r"producer-state file .*producer-state-format='2'.*reads format 1 only.*"
                                               r"Upgrade lakestream_iceberg")
    with refused:
        churned.producer("id-0").next_seq  # noqa: B018
    with refused:
        churned.producer("fresh").commit(batch("fresh", 0, WORLD))  # a new id: looked up in every file
    with refused:
        churned.history().sql("SELECT count(*) FROM producers").fetchall()
    assert churned.refresh().head_step() == head
    pq.write_table(rows.replace_schema_metadata({}), local)  # a file of a release before the format was written: 1
    DEFAULT_FILES._files.pop(path, None)  # noqa: SLF001
    assert churned.producer("id-0").next_seq == 1


def test_a_lone_producer_among_thousands_of_idle_ids_is_alone(churned: Stream) -> None:
    producer = churned.producer("lone")
    for seq in range(3):
        result = producer.commit(batch("lone", seq, WORLD))
        assert not result.carried
    assert producer.policy.contenders == 1.0  # type: ignore[attr-defined]


def test_history_and_status_show_every_producer(churned: Stream) -> None:
    con = churned.history()
    total, active = con.sql("SELECT count(*), sum(active::INT) FROM producers").fetchall()[0]
    assert total == CHURN and active == len(churned.state().producers)
    from lakestream_iceberg.tools.commands import status_dict

    status = status_dict(churned, "main")
    assert len(status["producers"]) == CHURN
    assert sum(p["active"] for p in status["producers"]) == active


@pytest.mark.slow
def test_a_compacted_producer_killed_and_restarted_has_no_gap_and_no_duplicate(churned: Stream, tmp_path: Path) -> None:
    """SIGKILL at random points after observed progress, for a fixed number of rounds, then a clean finish."""
    assert "id-7" not in churned.state().producers
    rng = random.Random(11)
    count = 12  # the worker commits seqs next_seq..count-1 (seq 0 was published during the churn)
    for _round in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "tests.workers", str(tmp_path), "ns.stream", "id-7", str(count)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = 0
        wanted = rng.randint(1, 2)
        assert proc.stdout is not None
        for _line in proc.stdout:  # one line per published batch: kill after observed progress
            seen += 1
            if seen >= wanted:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    final = subprocess.run([sys.executable, "-m", "tests.workers", str(tmp_path), "ns.stream", "id-7", str(count)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    steps = published(churned)
    assert sorted(steps) == list(range(1, churned.head_step() + 1))
    assert sorted(seq for p, seq in steps.values() if p == "id-7") == list(range(count))


def test_a_merge_lets_the_process_forget_the_files_it_replaced(small_constants: None, tmp_path: Path) -> None:
    """A long-lived producer keeps in memory the producer-state files its head lists, not every past base file."""
    from lakestream_iceberg.format.producers import ProducerFiles, ProducerState, compact

    cache = ProducerFiles()
    location = f"file://{tmp_path}/table"
    active: dict[str, ProducerState] = {}
    files: tuple[str, ...] = ()
    merges = 0
    for step in range(1, 400):
        active[f"id-{step}"] = ProducerState(0, step, step, step)  # a one-shot id: not recurring
        before = files
        result = compact(PyArrowFileIO(), location, step=step, active=active, files=files, cache=cache)
        active, files = dict(result.active), result.files
        if len(files) == 1 and len(before) > 1:
            merges += 1
            assert all(cache.merged(PyArrowFileIO(), (f,)) is not None for f in files)
        listed = sum(len(cache.merged(PyArrowFileIO(), (f,))) for f in files)
        assert cache.entries == listed  # nothing but what the current files hold
    assert merges >= 3
    everyone = cache.merged(PyArrowFileIO(), files)
    everyone.update(active)
    assert sorted(everyone) == sorted(f"id-{s}" for s in range(1, 400))


def test_a_process_that_only_reads_keeps_the_files_the_head_lists(small_constants: None, tmp_path: Path) -> None:
    """The merges happen in other processes (another producer's commits): a process that looks producers up in each
    new head keeps about what those heads list, not every base it read on the way. It kept them all before, each base
    larger than the last: about ids^2 / 512 entries with the real constants (76,608 for 6,000 ids)."""
    from lakestream_iceberg.format.producers import ProducerFiles, ProducerState, compact

    io = PyArrowFileIO()
    elsewhere, here = ProducerFiles(), ProducerFiles()  # the committing process's cache, and a reader's
    location = f"file://{tmp_path}/table"
    active: dict[str, ProducerState] = {}
    files: tuple[str, ...] = ()
    bases, ratios = 0, []
    for step in range(1, 600):
        active[f"id-{step}"] = ProducerState(0, step, step, step)
        result = compact(io, location, step=step, active=active, files=files, cache=elsewhere)
        bases += len(result.files) == 1 and len(files) > 1
        active, files = dict(result.active), result.files
        if files:  # the reader asks for an id the head no longer holds as active: a lookup in the listed files
            assert here.lookup(io, files, "id-1") == ProducerState(0, 1, 1)
            assert here.lookup(io, files, "never-seen") is None
            listed = sum(len(elsewhere.load(io, f)) for f in files)
            assert here.entries >= listed  # what the head lists stays cached
            ratios.append(here.entries / listed)
    assert bases >= 40
    # the files of the last 8 lists: with MAX_FILES = 3 they span at most 4 bases (about 2 with the real 8) and their
    # deltas, so about 4x what the head lists, whatever the number of bases; without the fix this grew with them (26x)
    assert max(ratios[len(ratios) // 2:]) < 5, max(ratios)


def test_the_file_cache_keeps_each_tables_files_apart(tmp_path: Path) -> None:
    """A process asking about many tables in turn (a Ray worker writing to several streams) keeps each table's listed
    files: a new file of one table drops only that table's unlisted ones. Across the process, 9 tables of 3 files made
    every round of lookups read all 27 files again."""
    from lakestream_iceberg.format.producers import ProducerFiles, ProducerState, compact

    reads: list[str] = []

    class Counting(PyArrowFileIO):
        def new_input(self, location: str):  # type: ignore[no-untyped-def]
            reads.append(location)
            return super().new_input(location)

    io, writer_cache, cache = Counting(), ProducerFiles(), ProducerFiles()
    heads = []
    for t in range(12):
        active = {f"id-{i}": ProducerState(0, i, i, i) for i in range(1, 200)}  # one-shot ids, long idle
        result = compact(io, f"file://{tmp_path}/t{t}", step=500, active=active, files=(), cache=writer_cache)
        files = result.files
        for step in (700, 900):  # two more compactions: three files listed
            idle = {f"more-{step}-{i}": ProducerState(0, step - 300, step - 300, step - 300) for i in range(40)}
            files = compact(io, f"file://{tmp_path}/t{t}", step=step, active=idle, files=files,
                            cache=writer_cache).files
        assert len(files) == 3
        heads.append(files)
    reads.clear()
    for _ in range(3):  # rounds of lookups across the tables, as a worker's commits would
        for files in heads:
            assert cache.lookup(io, files, "id-7") == ProducerState(0, 7, 7)
            assert cache.lookup(io, files, "nobody") is None
    assert len(reads) == 12 * 3  # each file read once, in the first round
    assert cache.files == 36


def _rotating_pool(steps: int, *, workers: int, rotate: int):
    """(step, producer id, seq) of ``workers`` producers taking turns, each taking a fresh id every ``rotate`` batches
    (an elastic pool whose tasks are rescheduled): every retired id committed ``rotate`` times, so it *recurs*."""
    ids, seqs = [0] * workers, [0] * workers
    for step in range(1, steps + 1):
        w = (step - 1) % workers
        yield step, f"w{w}-{ids[w]}", seqs[w]
        seqs[w] += 1
        if seqs[w] == rotate:
            ids[w], seqs[w] = ids[w] + 1, 0


def test_a_pool_that_retires_its_ids_keeps_a_bounded_summary(tmp_path: Path) -> None:
    """The real constants: 16 producers taking turns, a fresh id every 3 batches. Retired ids recur (3 commits each);
    before, each of them counted as a producer taking turns, lengthened the horizon that kept it, and the summary kept
    every id the pool ever used (160 at step 480, none compacted). Now they leave it and the summary stays bounded."""
    from lakestream_iceberg.format.producers import ProducerFiles, ProducerState, active_horizon, compact

    cache, io = ProducerFiles(), PyArrowFileIO()
    location = f"file://{tmp_path}/table"
    active: dict[str, ProducerState] = {}
    files: tuple[str, ...] = ()
    largest = 0
    last: dict[str, ProducerState] = {}
    for step, pid, seq in _rotating_pool(2_000, workers=16, rotate=3):
        previous = active.get(pid)
        first = step if previous is None else (previous.step if previous.first is None else previous.first)
        active[pid] = last[pid] = ProducerState(seq, step, step, first)
        result = compact(io, location, step=step, active=active, files=files, cache=cache)
        active, files = dict(result.active), result.files
        largest = max(largest, len(active))
    # within the horizon (a floor of ACTIVE_MIN_STEPS steps: at most that many ids) plus the idle ones not yet moved out
    assert largest < producers.ACTIVE_MIN_STEPS + producers.COMPACT_AT + 16, largest
    assert active_horizon(active, 2_000) < 4 * 16
    everyone = cache.merged(io, files)
    everyone.update(active)
    assert len(everyone) == len(last) == 16 * -(-2_000 // 48)
    assert all(everyone[pid].seq == state.seq and everyone[pid].step == state.step for pid, state in last.items())


def test_the_horizon_follows_the_producers_taking_turns_now() -> None:
    """About ACTIVE_ROUNDS rounds of the producers committing now, whatever the ids listed long ago."""
    from lakestream_iceberg.format.producers import ACTIVE_ROUNDS, ProducerState, active_horizon

    taking_turns = {f"p{i}": ProducerState(7, 10_000 - i, 1, 1) for i in range(1_000)}  # each commits once a round
    assert active_horizon(taking_turns, 10_000) == round(ACTIVE_ROUNDS * 1_000)
    long_gone = {f"old{i}": ProducerState(3, 100 + i, 1, 1) for i in range(5_000)}  # recurred, then stopped
    assert active_horizon({**taking_turns, **long_gone}, 10_000) == round(ACTIVE_ROUNDS * 1_000)
    assert active_horizon({f"x{i}": ProducerState(0, i, i, i) for i in range(1, 500)}, 500) == producers.ACTIVE_MIN_STEPS
    assert active_horizon({}, 7) == producers.ACTIVE_MIN_STEPS


def test_a_rotating_pool_end_to_end_stays_exactly_once(small_constants: None, tmp_path: Path) -> None:
    """Real commits of producers taking turns and rotating ids: the summary stays small, every retired id was compacted
    with its sequence, and one that comes back continues exactly once."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    sizes = []
    for step, pid, seq in _rotating_pool(96, workers=4, rotate=3):
        result = stream.producer(pid).commit(batch(pid, seq, WORLD), seq=seq)
        assert (result.step, result.duplicate) == (step, False)
        sizes.append(len(stream.state().producers))
    assert max(sizes[40:]) < ACTIVE_MIN_STEPS + COMPACT_AT + 4 + 4, sizes
    state = stream.state()
    assert state.producer_files and "w0-0" not in state.producers
    everyone = state.all_producers(stream.io)
    assert len(everyone) == 4 * (96 // 12)
    returning = stream.producer("w0-0")
    assert returning.next_seq == 3
    assert returning.commit(batch("w0-0", 2, WORLD), seq=2).duplicate
    assert returning.commit(batch("w0-0", 3, WORLD)).step == 97
    assert sorted(published(stream)) == list(range(1, 98))
