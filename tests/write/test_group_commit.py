"""Group commit: staged batches are published by whichever producer commits next, exactly once, one snapshot each."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.manifest import ManifestEntryStatus

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import CommitTimeoutError, ConfigError, SequenceError
from lakestream_iceberg.format.layout import PROP_COMMIT_MAX_ATTEMPTS, PROP_GROUP_COMMIT, PROP_GROUP_STAGING
from lakestream_iceberg.format.summary import StreamState
from lakestream_iceberg.write.dac import CommitPolicy
from lakestream_iceberg.write.intent import STAGING_DIR, Intent
from tests.backends import published
from tests.support import SCHEMA, batch, digest, sqlite_catalog

WORLD = 3


STORAGE = {PROP_GROUP_STAGING: "storage"}  # intents as files: for tests that write, age or delete intent files


def make(tmp_path: Path, **props: str) -> Stream:
    return Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD, properties=props or None)


def both_active(stream: Stream) -> tuple:
    """Two producers that have each committed, so each sees the other in the head's producer table."""
    a, b = stream.producer("a"), stream.producer("b")
    a.commit(batch("a", 0, WORLD))
    b.commit(batch("b", 0, WORLD))
    a.commit(batch("a", 1, WORLD))
    b.commit(batch("b", 1, WORLD))
    return a, b


def stage(stream: Stream, producer: str, seq: int, *, allow_gap: bool = False) -> Intent:
    """What a producer does before it holds: write the batch's files and stage them (then, here, it 'dies')."""
    staged = stream.writer.write(producer=producer, seq=seq, shards=batch(producer, seq, WORLD))
    return stream.staging.stage(branch="main", batch=staged, allow_gap=allow_gap)


def staged_files(stream: Stream) -> list[str]:
    """Every staged intent of the stream (any branch), where it keeps them: files, or rows of the catalog's database."""
    if stream.staging.kind == "catalog":
        return sorted(stream.staging.expire(older_than_s=-1.0, delete=False))
    root = Path(stream.table.metadata.location.removeprefix("file://")) / "data" / STAGING_DIR
    return sorted(f"file://{p}" for p in root.rglob("*") if p.is_file())


def summary_of(stream: Stream, step: int) -> StreamState:
    metadata = stream.refresh().table.metadata
    for snap in metadata.snapshots:
        state = StreamState.parse(snap.summary.additional_properties if snap.summary else None)
        if state.step == step and state.op == "append":
            return state
    raise AssertionError(f"no retained snapshot for step {step}")


def carried_by(stream: Stream, holder, carrier, holder_batch: list, carrier_batch: list, *, carrier_step: int):
    """``holder.commit(holder_batch)`` in a thread, held until ``carrier`` (committing alone) publishes it with its own
    batch; returns the holder's result."""
    from lakestream_iceberg.write.planner import STAGING_SCAN_S

    results: list = []
    thread = threading.Thread(target=lambda: results.append(holder.commit(holder_batch)))
    thread.start()
    deadline = time.monotonic() + 120
    while not staged_files(stream):  # the holder has written and staged its batch
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(STAGING_SCAN_S)  # the carrier, committing alone, lists the staging folder at most this often
    assert carrier.commit(carrier_batch).step == carrier_step
    thread.join(120)
    assert not thread.is_alive()
    (result,) = results
    return result


def test_a_group_commit_caches_only_the_manifests_a_later_commit_reads(tmp_path: Path) -> None:
    """The manifests and lists of the snapshots inside a group are named by those snapshots only (the group's head lists
    one manifest for the whole group), so no later commit merges them: the process-wide manifest cache keeps what the
    head lists. It cached them all, and a few per group pushed the live manifests a merge reads out of its 512."""
    from lakestream_iceberg.format.manifest_cache import DEFAULT_CACHE

    stream = make(tmp_path)
    a, b = both_active(stream)
    for producer in ("c", "d", "e"):  # three staged batches: the next commit publishes a group of four
        stage(stream, producer, 0)
        time.sleep(0.002)  # staged in this order, each seen as staged before the next
    from lakestream_iceberg.write.planner import STAGING_SCAN_S

    time.sleep(STAGING_SCAN_S)  # a producer that believes it is alone lists the staging folder at most this often
    before_entries, before_lists = DEFAULT_CACHE.entries_cached(), set(DEFAULT_CACHE._lists)  # noqa: SLF001
    result = b.commit(batch("b", 2, WORLD))
    assert result.step == 8 and published(stream)[8] == ("b", 2)
    metadata = stream.refresh().table.metadata
    head = metadata.snapshot_by_name("main")
    listed = {m.manifest_path for m in head.manifests(stream.io)}
    new_entries = DEFAULT_CACHE.entries_cached() - before_entries
    new_lists = set(DEFAULT_CACHE._lists) - before_lists  # noqa: SLF001
    assert new_entries and new_entries <= listed
    assert new_lists == {head.manifest_list}
    inner = [s for s in metadata.snapshots if s.snapshot_id != head.snapshot_id
             and StreamState.of(s).step in (5, 6, 7)]
    assert len(inner) == 3 and all(s.manifest_list not in DEFAULT_CACHE._lists for s in inner)  # noqa: SLF001
    for step, producer in ((5, "c"), (6, "d"), (7, "e")):  # every batch still reads back at its own step
        for rank in range(WORLD):
            assert digest(stream.read(step, rank=rank)) == digest(batch(producer, 0, WORLD)[rank])


def test_a_process_forgets_the_intents_that_are_gone(tmp_path: Path) -> None:
    """What a process keeps about other producers' intents (parsed intents, their files' footer checks, rejections)
    goes once the intent is no longer listed: published and removed by another process, or collected."""
    stream = make(tmp_path, **STORAGE)
    _, b = both_active(stream)
    staging = stream.staging
    intents = [stage(stream, producer, 0) for producer in ("c", "d")]
    bad = Path(staging.folder("main").removeprefix("file://")) / "not-an-intent.parquet"
    bad.write_bytes(b"PAR1")
    listed = staging.pending("main", max_age_s=600)
    assert sorted(i.path for i in listed) == sorted(i.path for i in intents)
    assert all(staging.verified(i) for i in listed)
    files = [f.path for i in intents for f in i.batch.files]
    assert all(staging._footers.get(f) is True for f in files)  # noqa: SLF001
    assert {i.path for i in intents} <= set(staging._parsed)  # noqa: SLF001
    assert any(p.endswith("not-an-intent.parquet") for p in staging._rejected)  # noqa: SLF001
    for gone in (*(Path(i.path.removeprefix("file://")) for i in intents), bad):  # another process's doing
        gone.unlink()
    assert staging.pending("main", max_age_s=600) == []
    assert not {i.path for i in intents} & set(staging._parsed)  # noqa: SLF001
    assert not any(f in staging._footers for f in files)  # noqa: SLF001
    assert not staging._rejected  # noqa: SLF001
    assert b.commit(batch("b", 2, WORLD)).step == 5  # and nothing of theirs is published
    # intents this process publishes itself: gone with their footer checks once it removes them
    published_here = [stage(stream, producer, 0) for producer in ("e", "f")]
    from lakestream_iceberg.write.planner import STAGING_SCAN_S

    time.sleep(STAGING_SCAN_S)  # a producer that believes it is alone lists the staging folder at most this often
    assert b.commit(batch("b", 3, WORLD)).step == 8  # a group: e's and f's batches, then b's
    assert {published(stream)[s] for s in (6, 7)} == {("e", 0), ("f", 0)}
    files = [f.path for i in published_here for f in i.batch.files]
    assert not {i.path for i in published_here} & set(staging._parsed)  # noqa: SLF001
    assert not any(f in staging._footers for f in files)  # noqa: SLF001


def test_a_dead_producers_staged_batch_is_published_by_the_next_commit_exactly_once(tmp_path: Path) -> None:
    stream = make(tmp_path)
    _, b = both_active(stream)
    intent = stage(stream, "a", 2)
    time.sleep(0.01)
    result = b.commit(batch("b", 2, WORLD))
    assert (result.step, result.seq, result.carried) == (6, 2, False)
    assert published(stream) == {1: ("a", 0), 2: ("b", 0), 3: ("a", 1), 4: ("b", 1), 5: ("a", 2), 6: ("b", 2)}
    for rank in range(WORLD):  # the dead producer's bytes, exactly as it wrote them
        assert digest(stream.read(5, rank=rank)) == digest(batch("a", 2, WORLD)[rank])
    a_state, b_state = summary_of(stream, 5), summary_of(stream, 6)
    assert (a_state.producer, a_state.seq, a_state.committer, a_state.group) == ("a", 2, "b", 2)
    assert (b_state.producer, b_state.seq, b_state.committer, b_state.group) == ("b", 2, None, 2)
    assert not stream.staging.exists(intent.path) and staged_files(stream) == []
    rows = stream.history().sql("SELECT step, producer, committer, group_size FROM batches WHERE step >= 4 ORDER BY step")
    assert rows.fetchall() == [(4, "b", "b", 1), (5, "a", "b", 2), (6, "b", "b", 2)]
    # the restarted producer continues after the batch it staged before dying: nothing lost, nothing twice
    restarted = stream.producer("a")
    assert restarted.next_seq == 3
    again = restarted.commit(batch("a", 2, WORLD), seq=2)
    assert (again.duplicate, again.step) == (True, 5)
    assert stream.head_step() == 6
    # a plain Iceberg scan sees each batch's rows at its own step
    rows = stream.table.scan(selected_fields=("_step", "producer")).to_arrow()
    by_step: dict[int, set[str]] = {}
    for step, producer in zip(rows["_step"].to_pylist(), rows["producer"].to_pylist(), strict=True):
        by_step.setdefault(step, set()).add(producer)
    assert by_step.get(5, {"a"}) == {"a"} and by_step.get(6, {"b"}) == {"b"}


def test_each_batch_of_a_group_is_its_own_snapshot_in_lineage_order(tmp_path: Path) -> None:
    stream = make(tmp_path, **{"lakestream.snapshots.retain-last": "64"})
    _, b = both_active(stream)
    for producer in ("c", "d", "e"):
        stage(stream, producer, 0)
        time.sleep(0.005)
    b.commit(batch("b", 2, WORLD))
    metadata = stream.refresh().table.metadata
    head = metadata.snapshot_by_name("main")
    chain = []
    while head is not None and len(chain) < 4:
        chain.append(head)
        head = metadata.snapshot_by_id(head.parent_snapshot_id) if head.parent_snapshot_id else None
    states = [StreamState.parse(s.summary.additional_properties) for s in reversed(chain)]
    assert [(s.step, s.producer) for s in states] == [(5, "c"), (6, "d"), (7, "e"), (8, "b")]
    assert all(s.group == 4 for s in states)
    # each snapshot sees exactly the steps up to its own: time travel works per step
    for snap, state in zip(reversed(chain), states, strict=True):
        steps = set(stream.table.scan(snapshot_id=snap.snapshot_id, selected_fields=("_step",)).to_arrow()["_step"].to_pylist())
        assert steps == set(range(1, state.step + 1))
        entries = [e for m in snap.manifests(stream.io) for e in m.fetch_manifest_entry(stream.io)
                   if e.status == ManifestEntryStatus.ADDED and e.snapshot_id == snap.snapshot_id]
        assert {e.data_file.partition[0] for e in entries} == {state.step}
    # and every step's producer table carries the batches before it
    assert states[-1].producers["c"].seq == 0 and states[0].producers.get("d") is None
    # the group's head lists one new manifest for the whole group: the earlier batches EXISTING (their own snapshot
    # ids and sequence numbers kept), its own ADDED, so the head's list grows by one manifest per group
    snaps = list(reversed(chain))
    newest = [m for m in snaps[-1].manifests(stream.io) if m.added_snapshot_id == snaps[-1].snapshot_id]
    assert len(newest) == 1
    entries = newest[0].fetch_manifest_entry(stream.io)
    by_step = {}
    for e in entries:
        by_step.setdefault(e.data_file.partition[0], set()).add((e.status, e.snapshot_id, e.sequence_number))
    last = ManifestEntryStatus.ADDED
    assert by_step == {state.step: {(last if snap is snaps[-1] else ManifestEntryStatus.EXISTING, snap.snapshot_id,
                                     snap.sequence_number)} for snap, state in zip(snaps, states, strict=True)}
    assert len(entries) == 4 * WORLD  # one file per rank and step
    parent = metadata.snapshot_by_id(snaps[0].parent_snapshot_id)
    before = {m.manifest_path for m in parent.manifests(stream.io)}
    assert [m.manifest_path for m in snaps[-1].manifests(stream.io) if m.manifest_path not in before] == [newest[0].manifest_path]


def test_stale_foreign_and_broken_intents_are_never_published(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stream = make(tmp_path, **STORAGE)
    a, b = both_active(stream)
    stale = stage(stream, "a", 1)  # seq 1 of "a" is already published
    ahead = stage(stream, "c", 3)  # c never published seq 0..2: a gap it did not allow
    old = stage(stream, "d", 0)  # older than half the GC grace period
    past = time.time() - 7200
    os.utime(old.path.removeprefix("file://"), (past, past))
    folder = Path(stream.staging.folder("main").removeprefix("file://"))
    (folder / "x").mkdir(parents=True)
    (folder / "x@000000000000-half.parquet").write_bytes(b"PAR1\x00\x01")  # half-written: no footer yet
    (folder / "x@000000000000-junk.parquet").write_bytes(b"not an intent at all" + b"PAR1")
    (folder / "x" / "000000000000-nested.parquet").write_bytes(b"PAR1")  # not a name stage() gives
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.write.staging"):
        result = b.commit(batch("b", 2, WORLD))
    assert result.step == 5 and stream.head_step() == 5
    assert published(stream)[5] == ("b", 2)
    assert "ignoring unreadable staged intent" in caplog.text and "junk" in caplog.text
    assert "nested" in caplog.text and "half" not in caplog.text  # a half-written file is retried, not rejected
    assert not Path(stale.path.removeprefix("file://")).exists()  # already published: removed by the committer
    assert Path(ahead.path.removeprefix("file://")).exists() and Path(old.path.removeprefix("file://")).exists()
    # c's seq 0 arrives: both become publishable in order only when they are contiguous
    stage(stream, "c", 0)
    a.commit(batch("a", 2, WORLD))
    assert [v for v in published(stream).values() if v[0] == "c"] == [("c", 0)]


def test_an_intent_naming_files_outside_the_table_or_the_wrong_ranks_is_ignored(tmp_path: Path) -> None:
    stream = make(tmp_path)
    _, b = both_active(stream)
    staged = stream.writer.write(producer="c", seq=0, shards=batch("c", 0, WORLD))
    outside = type(staged)(producer="c", seq=0, token="evil", files=tuple(
        type(f)(rank=f.rank, path=f"file:///etc/passwd-{f.rank}", size_bytes=f.size_bytes, stats=f.stats) for f in staged.files))
    stream.staging.stage(branch="main", batch=outside, allow_gap=False)
    short = type(staged)(producer="d", seq=0, token="short", files=staged.files[:1])
    stream.staging.stage(branch="main", batch=short, allow_gap=False)
    b.commit(batch("b", 2, WORLD))
    assert {v[0] for v in published(stream).values()} == {"a", "b"}


def test_intent_round_trip_keeps_every_statistic(tmp_path: Path) -> None:
    stream = make(tmp_path)
    intent = stage(stream, "a", 0)
    back = Intent.from_bytes(intent.path, intent.to_bytes())
    assert (back.batch.producer, back.batch.seq, back.batch.token, back.allow_gap) == ("a", 0, intent.batch.token, False)
    assert back.batch.data_files(step=7, spec_id=0) == intent.batch.data_files(step=7, spec_id=0)


def test_group_commit_can_be_turned_off(tmp_path: Path) -> None:
    stream = make(tmp_path, **{PROP_GROUP_COMMIT: "false"})
    a, b = both_active(stream)
    assert staged_files(stream) == []
    staged = stream.writer.write(producer="c", seq=0, shards=batch("c", 0, WORLD))
    stream.staging.stage(branch="main", batch=staged, allow_gap=False)
    a.commit(batch("a", 2, WORLD))
    assert {v[0] for v in published(stream).values()} == {"a", "b"}  # nobody publishes staged batches
    with pytest.raises(ConfigError, match="lakestream.commit.group.enabled"):
        Stream.create(sqlite_catalog(str(tmp_path)), "ns.other", schema=SCHEMA, world_size=WORLD,
                      properties={PROP_GROUP_COMMIT: "maybe"})


class Refusing(SqlCatalog):
    """A catalog that always reports a lost compare-and-swap for stream commits after ``refuse`` is set."""

    refuse = False

    def commit_table(self, table, requirements, updates):  # type: ignore[no-untyped-def]
        if self.refuse:
            raise CommitFailedException("injected: the branch moved")
        return super().commit_table(table, requirements, updates)


def test_a_commit_that_gives_up_withdraws_its_staged_batch(tmp_path: Path) -> None:
    catalog = Refusing("r", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD, properties={PROP_COMMIT_MAX_ATTEMPTS: "2"})
    a, _ = both_active(stream)
    catalog.refuse = True
    with pytest.raises(CommitTimeoutError, match="withdrawn"):
        a.commit(batch("a", 2, WORLD))
    assert staged_files(stream) == []
    catalog.refuse = False
    assert a.commit(batch("a", 2, WORLD), seq=2).step == 5


def test_gc_keeps_fresh_intents_and_their_files_and_collects_abandoned_ones(tmp_path: Path) -> None:
    stream = make(tmp_path)
    both_active(stream)
    intent = stage(stream, "c", 0)
    report = stream.collect_garbage(dry_run=False)
    assert "intent" not in report.files_deleted and report.files_in_grace >= 1 + WORLD
    assert stream.staging.exists(intent.path)
    report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.files_deleted.get("intent") == 1 and report.files_deleted.get("data") == WORLD
    assert staged_files(stream) == []


def test_cli_status_counts_staged_batches(tmp_path: Path) -> None:
    from lakestream_iceberg.tools.commands import status_dict

    stream = make(tmp_path)
    both_active(stream)
    assert status_dict(stream, "main")["staged_batches"] == 0
    stage(stream, "c", 0)
    assert status_dict(stream, "main")["staged_batches"] == 1
    assert status_dict(stream, "main")["staging"] == "catalog"  # a SQLite catalog keeps them as rows


@pytest.mark.parametrize("staging", ["storage", "catalog"])
def test_a_commit_still_lands_when_the_staged_intents_cannot_be_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture, staging: str) -> None:
    import sqlite3

    import lakestream_iceberg.connect.intents as intents_module
    import lakestream_iceberg.write.intent_store as store_module

    stream = make(tmp_path, **{PROP_GROUP_STAGING: staging})
    assert stream.staging.kind == staging
    _, b = both_active(stream)
    stage(stream, "c", 0)

    def unreachable(*_args: object, **_kwargs: object) -> object:
        if staging == "catalog":
            raise sqlite3.OperationalError("unable to open database file (injected)")
        raise OSError("AWS Error NETWORK_CONNECTION during ListObjectsV2 operation (injected)")

    if staging == "catalog":
        monkeypatch.setattr(intents_module.IntentTable, "listing", unreachable)
    else:
        monkeypatch.setattr(store_module, "list_files", unreachable)
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.write.staging"):
        result = b.commit(batch("b", 2, WORLD))
    assert result.step == 5 and published(stream)[5] == ("b", 2)  # its own batch; c's waits for a listing that works
    assert "cannot list staged batches" in caplog.text
    monkeypatch.undo()
    b.commit(batch("b", 3, WORLD))
    assert ("c", 0) in published(stream).values()


def test_the_manifest_list_stays_bounded_after_group_commits_end(tmp_path: Path) -> None:
    """A group's manifest holds the whole group, so one level mixes manifest sizes: a level too large to merge whole
    merges its longest run that fits, and the list stays bounded once contention ends (one producer alone)."""
    from lakestream_iceberg.format.manifest_facts import manifest_level

    cap = 64
    stream = make(tmp_path, **{"lakestream.manifest.merge-fanout": "4", "lakestream.manifest.max-merge-entries": str(cap)})
    _, b = both_active(stream)
    seq = 2
    groups = 0
    for round_ in range(12):  # contended: five other producers' staged batches ride in each of b's commits
        for producer in ("c", "d", "e", "f", "g"):
            stage(stream, producer, round_)
            time.sleep(0.002)
        result = b.commit(batch("b", seq, WORLD), seq=seq)
        seq += 1
        groups += summary_of(stream, result.step).group > 1
    assert groups >= 6  # group manifests were written
    for _ in range(300):  # then b alone
        b.commit(batch("b", seq, WORLD), seq=seq)
        seq += 1
    manifests = stream.refresh().head().manifests(stream.io)
    live = sum(m.added_files_count + m.existing_files_count for m in manifests)
    levels = 1 + max(manifest_level(m.manifest_path) for m in manifests)
    assert live == stream.head_step() * WORLD
    # (fanout - 1) per level, plus the manifests too large to merge with a neighbour (one per cap / 2 files at most)
    assert len(manifests) <= 3 * levels + 1 + 2 * live // cap
    assert published(stream)[stream.head_step()] == ("b", seq - 1)


def test_closing_a_stream_stops_its_writer_and_footer_threads_and_it_stays_usable(tmp_path: Path) -> None:
    import threading

    def started(since: set[threading.Thread]) -> dict[str, list[threading.Thread]]:
        return {prefix: [t for t in threading.enumerate() if t.name.startswith(prefix) and t not in since]
                for prefix in ("lakestream-write", "lakestream-footer")}

    before = set(threading.enumerate())  # other streams of this process may have threads of their own
    with make(tmp_path) as stream:
        _, b = both_active(stream)
        stage(stream, "a", 2)  # three files: b's commit checks their footers on its pool
        assert b.commit(batch("b", 2, WORLD)).step == 6
        threads = started(before)
        assert threads["lakestream-write"] and threads["lakestream-footer"]
        stream.close()
        assert not any(t.is_alive() for group in threads.values() for t in group)
        stream.close()  # idempotent
        stage(stream, "a", 3)  # closed is not finished: both pools start again on use
        assert b.commit(batch("b", 3, WORLD)).step == 8
        again = started(before)
        assert again["lakestream-write"] and again["lakestream-footer"]
    assert not any(t.is_alive() for group in again.values() for t in group)  # the with block closed it
    assert published(stream)[7] == ("a", 3) and stream.read(8, rank=2).equals(batch("b", 3, WORLD)[2])


def test_a_task_submitted_while_the_stream_closes_runs_once_on_a_fresh_pool() -> None:
    """close() may land between taking a pool and submitting to it (another thread commits meanwhile): the task goes
    to the next pool instead of failing with "cannot schedule new futures after shutdown", and runs exactly once."""
    from lakestream_iceberg.connect.fork import ProcessPool

    pool = ProcessPool(max_workers=2, name="lakestream-test")
    taken = pool.get
    closed: list[object] = []

    def get_then_closed():  # the window: the caller holds a pool that close() shuts down before it submits
        executor = taken()
        if not closed:
            closed.append(executor)
            pool.shutdown(wait=True)
        return executor

    pool.get = get_then_closed  # type: ignore[method-assign]
    runs: list[int] = []
    assert pool.submit(lambda x: runs.append(x) or x * 2, 21).result() == 42
    assert runs == [21] and len(closed) == 1
    assert taken() is not closed[0]  # the task ran on a fresh pool
    pool.shutdown(wait=True)


def test_a_carried_batch_is_answered_from_a_light_read_of_the_head_and_the_next_commit_continues(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer whose staged batch another producer's commit published learns its step from the head's summaries
    read as plain JSON (no full metadata read), and its next commit still plans on a full read and continues the seq."""

    stream = make(tmp_path)
    a, b = both_active(stream)
    monkeypatch.setattr(a, "_contended", lambda: True)  # a stages and holds; b commits alone and carries it
    monkeypatch.setattr(a._loop.policy, "hold_delay", lambda **_kw: 600.0)  # noqa: SLF001 - only a carry ends the hold
    monkeypatch.setattr(CommitPolicy, "idle_after_s", 600.0)  # not a head that stays put while the test sets up
    monkeypatch.setattr(CommitPolicy, "leads_queue", False)  # nor a batch that leads the queue: it is the only one
    refreshes = a._loop._refreshes  # noqa: SLF001 - full reads of the head so far
    result = carried_by(stream, a, b, batch("a", 2, WORLD), batch("b", 2, WORLD), carrier_step=6)
    assert (result.step, result.seq, result.carried, result.duplicate, result.attempts) == (5, 2, True, False, 0)
    assert published(stream)[5] == ("a", 2)
    assert result.snapshot_id == next(s.snapshot_id for s in stream.refresh().table.metadata.snapshots
                                      if StreamState.of(s).step == 5)
    assert a._loop._refreshes == refreshes and a._loop.peeked  # noqa: SLF001 - answered without a full read
    # the next commit: seq 3 (not a gap), planned on a full read of the head, published after b's step
    monkeypatch.undo()
    after = a.commit(batch("a", 3, WORLD))
    assert (after.step, after.seq, after.duplicate) == (7, 3, False) and not a._loop.peeked  # noqa: SLF001
    assert published(stream) == {1: ("a", 0), 2: ("b", 0), 3: ("a", 1), 4: ("b", 1), 5: ("a", 2), 6: ("b", 2),
                                 7: ("a", 3)}


def test_a_light_read_that_cannot_confirm_the_batch_falls_back_to_the_full_read(tmp_path: Path) -> None:
    """CommitLoop.peek reads the head's summaries and checks them as a full read does: a malformed lakestream value is
    the same CorruptStateError, a snapshot the metadata does not list is None, and a head it cannot answer for (the
    branch is not a branch or names no snapshot id, a snapshot id that is no integer or appears twice) is None, so the caller reads the head
    fully."""
    from lakestream_iceberg.errors import CorruptStateError

    stream = make(tmp_path)
    a, b = both_active(stream)
    loop = a._loop  # noqa: SLF001
    loop.mark_stale()
    peek = loop.peek()
    assert peek is not None and peek.state.step == 4 and peek.state.producers["b"].seq == 1
    assert peek.states(peek.state.producers["a"].snapshot_id).producer == "a"  # a snapshot the head's metadata lists
    assert peek.states(12345) is None and peek.states(True) is None  # type: ignore[arg-type]
    # a summary value lakestream never writes is refused by the light read too
    metadata_path = Path(stream.refresh().table.metadata_location.removeprefix("file://"))
    text = metadata_path.read_text()
    document = json.loads(text)
    head_id = document["refs"]["main"]["snapshot-id"]
    head = next(s for s in document["snapshots"] if s["snapshot-id"] == head_id)
    head["summary"]["lakestream.step"] = "four"
    first_id = document["snapshots"][0]["snapshot-id"]

    def rewrite(content: str) -> None:
        """Rewrite the head's metadata file in place (a committed one never changes: light reads are kept per file)."""
        metadata_path.write_text(content)
        loop._peek.forget()  # noqa: SLF001

    rewrite(json.dumps(document))
    loop.mark_stale()
    loop.table.metadata_location = "elsewhere"  # the pointer 'moved' for this loop: it reads the file lightly
    with pytest.raises(CorruptStateError, match="lakestream.step"):
        loop.peek()
    head["summary"]["lakestream.step"] = "4"
    document["refs"]["main"]["type"] = "tag"  # main is no branch: not answerable lightly
    rewrite(json.dumps(document))
    assert loop.peek() is None
    document["refs"]["main"]["type"] = "branch"
    for odd in ([1, 2], None, True):  # an id no writer gives (unhashable, missing, a bool): not answerable lightly
        document["snapshots"][0]["snapshot-id"] = odd
        rewrite(json.dumps(document))
        assert loop.peek() is None
    document["snapshots"][0]["snapshot-id"] = head_id  # the same id twice: which one a reader takes is ambiguous
    rewrite(json.dumps(document))
    assert loop.peek() is None
    document["snapshots"][0]["snapshot-id"] = first_id
    for odd in ([head_id], {"id": head_id}, None):  # a branch naming no snapshot id (unhashable, missing)
        document["refs"]["main"]["snapshot-id"] = odd
        rewrite(json.dumps(document))
        assert loop.peek() is None
    document["refs"]["main"]["snapshot-id"] = head_id
    rewrite(text)
    assert loop.peek() is not None and loop.peek().state.step == 4


def test_a_batch_refused_while_planning_is_withdrawn_and_never_published_later(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged batch whose commit is refused at planning (here: the branch was rolled back behind the producer, so
    its explicit seq would leave a gap) is withdrawn with the error: no later group commit publishes the batch the caller was
    told failed, and the producer's real next batch is not reported as a duplicate of it."""
    from lakestream_iceberg.errors import SequenceError

    stream = make(tmp_path)
    a, _ = both_active(stream)  # a: seq 0 at step 1, seq 1 at step 3
    table = stream.refresh().table
    step2 = next(s.snapshot_id for s in table.metadata.snapshots if StreamState.of(s).step == 2)
    table.manage_snapshots().rollback_to_snapshot(step2).commit()  # an operator rolls main back: a's seq 1 is gone
    monkeypatch.setattr(a, "_contended", lambda: True)  # a stages its batch (group commit), then plans at once
    monkeypatch.setattr(a._loop.policy, "hold_delay", lambda **_kw: 0.0)  # noqa: SLF001
    with pytest.raises(SequenceError, match="would skip from seq 1 to 2"):
        a.commit(batch("a", 2, WORLD), seq=2)  # a's view still ends at its own seq 1: seq 2, refused at planning
    assert staged_files(stream) == []  # withdrawn with the error
    monkeypatch.undo()
    # b's seq 1, published at the rolled-back step 4, is open again; its intent (removed by the commit that published
    # it) is not offered again from this process's last listing of the staging folder
    assert a.commit(batch("a", 1, WORLD), seq=1).step == 3
    assert stream.producer("c").commit(batch("c", 0, WORLD)).step == 4  # would have carried an orphaned seq 2
    again = a.commit(batch("a", 2, WORLD), seq=2)
    assert (again.step, again.duplicate) == (5, False)
    assert published(stream) == {1: ("a", 0), 2: ("b", 0), 3: ("a", 1), 4: ("c", 0), 5: ("a", 2)}


def test_a_fresh_intent_of_a_batch_whose_files_are_old_is_never_published(tmp_path: Path) -> None:
    """GC deletes unreferenced files older than the grace period: what counts is the age of the batch's data files, not
    of its intent (an owner that held its batch alone for a while stages it late)."""
    stream = make(tmp_path, **STORAGE)
    _, b = both_active(stream)
    grace_s = stream.config.gc_grace_ms / 1000
    written = stream.writer.write(producer="c", seq=0, shards=batch("c", 0, WORLD))
    late = stream.staging.stage(branch="main", batch=replace(written, written_at=time.time() - 0.6 * grace_s),
                                allow_gap=False)
    assert late.files_age_s >= 0.6 * grace_s  # the intent itself is brand new
    reread = Intent.from_bytes(late.path, Path(late.path.removeprefix("file://")).read_bytes())
    assert reread.files_age_s == late.files_age_s
    fresh = stream.writer.write(producer="d", seq=0, shards=batch("d", 0, WORLD))
    stream.staging.stage(branch="main", batch=fresh, allow_gap=False)
    b.commit(batch("b", 2, WORLD))
    b.commit(batch("b", 3, WORLD))
    owners = [v[0] for v in published(stream).values()]
    assert "c" not in owners and owners.count("d") == 1
    assert Path(late.path.removeprefix("file://")).exists()  # left to GC, never published


def test_a_wall_clock_stepped_back_never_makes_a_batch_look_younger_than_its_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's age counted by the wall clock alone: one that stepped back while the producer held its batch (an NTP
    correction) made files as old as 0.6 x the grace period look new, so the producer published them itself, or staged
    them for another to publish, although GC, ageing them by the store's clock, may already have deleted them. The
    monotonic clock counts the time the wall clock lost. Injected: the writer's clocks when the batch was written,
    its monotonic clock 0.6 x grace behind the one the commit reads, its wall clock where the commit's stands now."""
    from lakestream_iceberg.write import writer

    stream = make(tmp_path, **STORAGE)
    _, b = both_active(stream)
    grace_s = stream.config.gc_grace_ms / 1000

    class WroteLongAgo:  # this host's clocks as the writer read them: monotonic 0.6 x grace ago, wall "now" (stepped back)
        time, sleep = staticmethod(time.time), staticmethod(time.sleep)

        @staticmethod
        def monotonic() -> float:
            return time.monotonic() - 0.6 * grace_s

    monkeypatch.setattr(writer, "time", WroteLongAgo)
    written = stream.writer.write(producer="c", seq=0, shards=batch("c", 0, WORLD))
    late = stream.staging.stage(branch="main", batch=written, allow_gap=False)
    assert late.files_age_s >= 0.6 * grace_s
    with pytest.raises(CommitTimeoutError, match="half of"):  # its own commit refuses it too (the retry writes again)
        stream.producer("e").commit(batch("e", 0, WORLD), seq=0)
    monkeypatch.setattr(writer, "time", time)
    b.commit(batch("b", 2, WORLD))
    b.commit(batch("b", 3, WORLD))
    owners = [v[0] for v in published(stream).values()]
    assert "c" not in owners and "e" not in owners


def test_a_wall_clock_stepped_back_does_not_freeze_the_listing_of_staged_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer committing alone lists the staging folder at most every so often and answers from its last listing
    in between, timed by the wall clock: one stepped back by an hour (an NTP correction) kept answering from that
    listing for the hour, so batches staged meanwhile were neither seen nor carried, and the listing's intents were
    offered without their ages being checked again."""
    from lakestream_iceberg.write import staging

    stream = make(tmp_path, **STORAGE)
    max_age_s = stream.config.staged_max_age_s
    assert stream.staging.pending("main", max_age_s=max_age_s, every_s=1e-6) == []  # listed (nothing), cached

    class SteppedBack:  # this host's clocks once its wall clock stepped back an hour
        monotonic, sleep = staticmethod(time.monotonic), staticmethod(time.sleep)

        @staticmethod
        def time() -> float:
            return time.time() - 3600

    monkeypatch.setattr(staging, "time", SteppedBack)
    staged = stage(stream, "c", 0)
    found = stream.staging.pending("main", max_age_s=max_age_s, every_s=1e-6)
    assert [i.path for i in found] == [staged.path]


@pytest.mark.parametrize("staged_at", [float("nan"), float("inf"), 1e17])
def test_an_intent_declaring_an_impossible_staging_time_is_never_carried_and_commits_go_on(tmp_path: Path,
                                                                                             staged_at: float) -> None:
    """A carried batch's summary records its staging time in ms (``lakestream.staged-at-ms``): an intent declaring NaN
    or infinity crashed every commit that carried it, and one far in the future committed a summary no producer could
    read back (the stream stopped until a rollback)."""
    stream = make(tmp_path, **STORAGE)
    a, b = both_active(stream)
    written = stream.writer.write(producer="c", seq=0, shards=batch("c", 0, WORLD))
    path = f"{stream.staging.folder('main')}/c@{0:012d}-{written.token}.parquet"
    bad = Intent(path=path, branch="main", batch=written, allow_gap=False, staged_at=staged_at,
                 table_uuid=str(stream.table.metadata.table_uuid))
    Path(path.removeprefix("file://")).write_bytes(bad.to_bytes())
    stage(stream, "d", 0)
    b.commit(batch("b", 2, WORLD))
    a.commit(batch("a", 2, WORLD))
    b.commit(batch("b", 3, WORLD))
    owners = [v[0] for v in published(stream).values()]
    assert "c" not in owners and owners.count("d") == 1
    assert stream.refresh().head_step() == 8  # the head's summary reads back


@pytest.mark.parametrize(("field", "value"), [
    ("column_sizes", 2**70), ("value_counts", -1), ("null_value_counts", True), ("nan_value_counts", 1.5),
    ("records", "12"), ("size", 2**63), ("split_offsets", [4, 2**64]), ("column_sizes", {"0": 5}),
    ("lower_bounds", {"1": 7}), ("rank", True), ("path", 7),
])
def test_an_intent_declaring_statistics_no_manifest_holds_is_never_carried(tmp_path: Path, field: str,
                                                                           value: object) -> None:
    """An intent's file statistics go into the manifests as Iceberg 64-bit longs (field ids 32-bit): a count beyond
    them, a negative one, a bool, a float or a digit string is not what lakestream writes. Such an intent is
    unreadable: never carried, and the commits go on."""
    stream = make(tmp_path, **STORAGE)
    a, b = both_active(stream)
    written = stream.writer.write(producer="c", seq=0, shards=batch("c", 0, WORLD))
    path = f"{stream.staging.folder('main')}/c@{0:012d}-{written.token}.parquet"
    good = Intent(path=path, branch="main", batch=written, allow_gap=False, staged_at=time.time(),
                  table_uuid=str(stream.table.metadata.table_uuid))
    body = json.loads(good.to_json())
    body["files"][0][field] = value
    text = json.dumps(body)
    with pytest.raises(ValueError):
        Intent.from_json(path, text)
    sink = io.BytesIO()  # an intent file as lakestream writes one, with that document: what another writer could leave
    with pq.ParquetWriter(sink, pa.schema([("intent", pa.string())]), compression="none") as writer:
        writer.write_table(pa.table({"intent": [text]}))
        writer.add_key_value_metadata({"lakestream.intent": text})
    Path(path.removeprefix("file://")).write_bytes(sink.getvalue())
    stage(stream, "d", 0)
    b.commit(batch("b", 2, WORLD))
    a.commit(batch("a", 2, WORLD))
    owners = [v[0] for v in published(stream).values()]
    assert "c" not in owners and owners.count("d") == 1


@pytest.mark.parametrize("age", [-1, True, "3", float("nan"), 1e400])
def test_an_intent_declaring_a_malformed_files_age_is_unreadable(age: object) -> None:
    body = {"format": 3, "table_uuid": "u", "branch": "main", "producer": "p", "seq": 0, "token": "t",
            "allow_gap": False, "staged_at": 1.0, "files_age_s": age, "files": []}
    with pytest.raises(ValueError, match="files_age_s"):
        Intent.from_json("x", json.dumps(body))


def test_an_intent_carries_its_json_in_the_footer_and_one_without_it_is_still_published(tmp_path: Path) -> None:
    """Committers read an intent from its footer's key-value metadata (11 us, not 160 us to decode the row); an intent
    an earlier release wrote (the row only, format 2) is still read and published."""
    stream = make(tmp_path, **STORAGE)
    _, b = both_active(stream)
    staged = stage(stream, "c", 0)
    raw = Path(staged.path.removeprefix("file://")).read_bytes()
    footer = pq.read_metadata(pa.BufferReader(raw)).metadata[b"lakestream.intent"].decode()
    row = pq.read_table(pa.BufferReader(raw)).column("intent")[0].as_py()
    assert footer == row and json.loads(footer)["format"] == 3
    written = stream.writer.write(producer="d", seq=0, shards=batch("d", 0, WORLD))
    body = json.loads(Intent(path="x", branch="main", batch=written, allow_gap=False, staged_at=time.time(),
                             table_uuid=str(stream.table.metadata.table_uuid)).to_json())
    body["format"] = 2
    del body["files_age_s"]
    sink = io.BytesIO()
    pq.write_table(pa.table({"intent": [json.dumps(body)]}), sink, compression="none")  # what format 2 wrote
    older = Path(stream.staging.folder("main").removeprefix("file://")) / f"d@{0:012d}-{written.token}.parquet"
    older.write_bytes(sink.getvalue())
    b.commit(batch("b", 2, WORLD))
    owners = [v[0] for v in published(stream).values()]
    assert owners.count("c") == 1 and owners.count("d") == 1


def test_a_new_producer_whose_batch_is_carried_reads_the_head_only_lightly(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer made from a view older than the head (the stream's, as every fresh id of an elastic pool is) learns
    its next seq from a light read of the head, stages, and is answered from a light read when another producer's
    commit carries its batch: no full read of the metadata at all, and the seq is the head's, not the old view's."""

    stream = make(tmp_path)  # its view: the empty table; a and b then publish steps 1-4, c's seq 0 step 5
    a, b = both_active(stream)
    assert Stream.open(stream.table.catalog, "ns.stream").producer("c").commit(batch("c", 0, WORLD)).step == 5
    c = stream.producer("c")
    assert StreamState.of(c._loop.table.metadata.current_snapshot()).step == 0  # noqa: SLF001 - the old view
    monkeypatch.setattr(c, "_contended", lambda: True)
    monkeypatch.setattr(c._loop.policy, "hold_delay", lambda **_kw: 600.0)  # noqa: SLF001 - only a carry ends the hold
    monkeypatch.setattr(CommitPolicy, "idle_after_s", 600.0)  # not a head that stays put while the test sets up
    monkeypatch.setattr(CommitPolicy, "leads_queue", False)  # nor a batch that leads the queue: it is the only one
    result = carried_by(stream, c, b, batch("c", 1, WORLD), batch("b", 2, WORLD), carrier_step=7)  # c's seq: the head's
    assert (result.step, result.seq, result.carried, result.duplicate) == (6, 1, True, False)
    assert c._loop._refreshes == 0  # noqa: SLF001 - the head was never read fully
    assert published(stream)[5] == ("c", 0) and published(stream)[6] == ("c", 1)


def test_a_producer_carried_after_its_own_commit_reads_the_head_only_lightly(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Group commit's usual turn: a producer leads one commit, and others commit on top of it before its next batch,
    which another producer's commit carries. It opens that batch's seq on the view its own commit left and is answered
    from a light read of the head: no full read of the metadata (several times the CPU of a light one) in the call."""
    stream = make(tmp_path)
    a, b = both_active(stream)  # a and b publish steps 1-4
    c = stream.producer("c")
    assert c.commit(batch("c", 0, WORLD)).step == 5  # its own commit: its view is the head
    assert b.commit(batch("b", 2, WORLD)).step == 6  # and no longer
    refreshes = c._loop._refreshes  # noqa: SLF001 - full reads of the head so far
    monkeypatch.setattr(c, "_contended", lambda: True)
    monkeypatch.setattr(c._loop.policy, "hold_delay", lambda **_kw: 600.0)  # noqa: SLF001 - only a carry ends the hold
    monkeypatch.setattr(CommitPolicy, "idle_after_s", 600.0)
    monkeypatch.setattr(CommitPolicy, "leads_queue", False)
    result = carried_by(stream, c, b, batch("c", 1, WORLD), batch("b", 3, WORLD), carrier_step=8)
    assert (result.step, result.seq, result.carried, result.duplicate) == (7, 1, True, False)
    assert c._loop._refreshes == refreshes  # noqa: SLF001 - no full read of the head in the call


@pytest.mark.parametrize("contended", [False, True])
def test_a_new_producer_with_an_old_view_still_finds_duplicates_and_gaps_before_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, contended: bool) -> None:
    """Whatever read of the head a new producer starts from, a re-commit of a seq published after its view was taken
    is answered as a duplicate of the original step before anything is written, and a seq past the head's next one is
    refused: the light read decides only when the head shows the seq as the id's next one."""
    stream = make(tmp_path)
    first = Stream.open(stream.table.catalog, "ns.stream").producer("d").commit(batch("d", 0, WORLD))
    assert first.step == 1 and not first.carried
    data = Path(stream.table.metadata.location.removeprefix("file://")) / "data" / "d"
    files = sorted(data.iterdir())
    again = stream.producer("d")  # the stream's view predates step 1
    monkeypatch.setattr(again, "_contended", lambda: contended)
    result = again.commit(batch("d", 0, WORLD), seq=0)
    assert (result.duplicate, result.step, result.attempts) == (True, 1, 0)
    with pytest.raises(SequenceError, match="would skip from seq 1 to 3"):
        stream.producer("d").commit(batch("d", 3, WORLD), seq=3)
    assert sorted(data.iterdir()) == files and not staged_files(stream)  # nothing written, nothing staged


def test_a_holder_whose_batch_nobody_carries_commits_it_once_the_head_stays_put(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer that holds its staged batch for a turn that never comes (the producers ahead of it finished) commits
    it itself once the head has not moved for three group commits, not after its slots (here 600 s)."""
    stream = make(tmp_path)
    a, _b = both_active(stream)
    monkeypatch.setattr(a, "_contended", lambda: True)
    monkeypatch.setattr(a._loop.policy, "hold_delay", lambda **_kw: 600.0)  # noqa: SLF001
    monkeypatch.setattr(CommitPolicy, "leads_queue", False)  # the idle head ends the hold, not the queue
    results: list = []
    thread = threading.Thread(target=lambda: results.append(a.commit(batch("a", 2, WORLD))), daemon=True)
    thread.start()
    thread.join(120)  # a broken idle check holds for 600 s
    assert not thread.is_alive()
    (result,) = results
    assert (result.step, result.seq, result.carried, result.duplicate) == (5, 2, False, False)
    assert published(stream)[5] == ("a", 2) and not staged_files(stream)


def _holding(a, monkeypatch: pytest.MonkeyPatch) -> list:
    """Make ``a`` stage and hold its next batch for as long as only the queue rule can end the hold (slots and idle
    head: 600 s); returns the list its loop appends each place check's verdict to."""
    from lakestream_iceberg.write.commit import CommitLoop

    monkeypatch.setattr(a, "_contended", lambda: True)
    monkeypatch.setattr(a._loop.policy, "hold_delay", lambda **_kw: 600.0)  # noqa: SLF001
    monkeypatch.setattr(CommitPolicy, "idle_after_s", 600.0)
    verdicts: list = []
    hold = a._loop._hold  # noqa: SLF001
    place = hold._place  # noqa: SLF001

    def recorded(carry):  # type: ignore[no-untyped-def]
        verdicts.append(place(carry))
        return verdicts[-1]

    monkeypatch.setattr(hold, "_place", recorded)
    assert isinstance(a._loop, CommitLoop)  # noqa: SLF001
    return verdicts


def _committing(a, verdicts: list) -> tuple[threading.Thread, list]:  # type: ignore[no-untyped-def]
    """Start ``a.commit`` of its seq-2 batch in a thread, and return once it staged the batch and looked at its place
    in the queue (a first verdict); the thread, and the list its result goes to."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(a.commit(batch("a", 2, WORLD))), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not verdicts:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.005)
    return thread, results


def test_a_held_batch_commits_itself_once_it_leads_the_queue_of_staged_batches(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch staged behind another one that nobody has published holds (that batch's owner, or the commit already in
    flight, goes first); when the head moves and nothing is staged before it any more, it commits at once, not after
    its slots or an idle head."""
    stream = make(tmp_path)
    a, _b = both_active(stream)
    ahead = stage(stream, "x", 0)  # staged first; its owner holds it too (here: died)
    verdicts = _holding(a, monkeypatch)
    thread, results = _committing(a, verdicts)
    assert verdicts == [None] and thread.is_alive() and stream.head_step() == 4  # behind x's batch: holding
    stream.staging.remove([ahead.path])  # x's batch withdrawn (its commit gave up) ...
    other = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    other.table.transaction().set_properties({"touched": "1"}).commit_transaction()  # ... and the head moves
    thread.join(120)
    assert not thread.is_alive()
    (result,) = results
    assert (result.step, result.seq, result.carried, result.duplicate) == (5, 2, False, False)
    assert verdicts[-1] is False and published(stream)[5] == ("a", 2) and not staged_files(stream)


@pytest.mark.parametrize("seq", [0, 5], ids=["published", "gap"])
def test_an_intent_left_behind_for_a_published_batch_does_not_hold_the_queue(tmp_path: Path, seq: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An intent staged before this batch whose seq the head shows published (its committer has not removed it yet,
    or died right after the swap) is not a batch to wait for: the light read of the head shows it, and the batch
    behind it leads the queue and commits at once (removing the leftover). Nor is a gap (allow_gap) whose owner died:
    only the owner's own commit publishes it, so it stays staged, unpublished, and held every hold until it aged out."""
    stream = make(tmp_path)
    a, _b = both_active(stream)
    x = stream.producer("x")
    x.commit(batch("x", 0, WORLD))  # step 5
    leftover = stage(stream, "x", seq, allow_gap=seq > 1)  # x's seq 0 again, staged after it was published, or a gap
    verdicts = _holding(a, monkeypatch)
    results: list = []
    thread = threading.Thread(target=lambda: results.append(a.commit(batch("a", 2, WORLD))), daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    (result,) = results
    assert (result.step, result.seq, result.carried) == (6, 2, False) and verdicts == [False]
    steps = published(stream)
    assert stream.head_step() == 6 and (steps[5], steps[6]) == (("x", 0), ("a", 2))
    assert list(steps.values()).count(("x", 0)) == 1 and ("x", 5) not in steps.values()  # the leftover stays unpublished
    assert staged_files(stream) == ([leftover.path] if seq else [])  # a gap is not the committer's to remove


def test_staging_lists_the_batches_staged_before_one_in_the_order_every_producer_sees(tmp_path: Path) -> None:
    """StagingArea.ahead: (producer, seq) of the intents staged before one (store time, then name), without reading
    them; files that are not intents do not count; None once the intent is gone."""
    stream = make(tmp_path, **STORAGE)
    first = stage(stream, "x", 0)
    second = stage(stream, "y", 4)
    third = stage(stream, "z", 1)
    folder = Path(first.path.removeprefix("file://")).parent
    (folder / "notes.parquet").write_bytes(b"PAR1")  # not an intent's name: never published, never waited for
    for i, intent in enumerate((first, second, third)):  # distinct, increasing store times
        os.utime(intent.path.removeprefix("file://"), ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    staging = stream.staging
    max_age_s = 10**10
    assert staging.ahead("main", first.path, max_age_s=max_age_s) == []
    assert staging.ahead("main", second.path, max_age_s=max_age_s) == [("x", 0)]
    assert sorted(staging.ahead("main", third.path, max_age_s=max_age_s)) == [("x", 0), ("y", 4)]
    assert staging.queued("main", third.path, max_age_s=max_age_s) == 2
    os.utime(second.path.removeprefix("file://"), ns=(10**18, 10**18))  # the same store time as x: by name then
    assert staging.ahead("main", second.path, max_age_s=max_age_s) == [("x", 0)]
    assert staging.ahead("main", first.path, max_age_s=max_age_s) == []
    staging.remove([first.path])
    assert staging.ahead("main", first.path, max_age_s=max_age_s) is None
    assert staging.ahead("main", third.path, max_age_s=max_age_s) == [("y", 4)]


def test_a_result_says_how_many_batches_the_commit_that_published_it_published(tmp_path: Path, monkeypatch) -> None:
    """CommitResult.group: 1 for a lone commit; the group's size for the committer of a group, for a batch another
    producer's commit carried, and for a duplicate of a seq a group published."""
    from lakestream_iceberg.write.planner import STAGING_SCAN_S

    stream = make(tmp_path)
    a, b = both_active(stream)
    assert a.commit(batch("a", 2, WORLD)).group == 1  # a thinks itself alone (no staged batch to carry)
    for producer in ("c", "d"):  # two staged batches: b's next commit publishes a group of three
        stage(stream, producer, 0)
        time.sleep(0.002)
    time.sleep(STAGING_SCAN_S)  # a producer that believes it is alone lists the staging folder at most this often
    grouped = b.commit(batch("b", 2, WORLD))
    assert (grouped.step, grouped.group, grouped.carried) == (8, 3, False)
    assert summary_of(stream, 8).group == 3
    again = stream.producer("b").commit(batch("b", 2, WORLD), seq=2)
    assert (again.duplicate, again.step, again.group) == (True, 8, 3)
    monkeypatch.setattr(a, "_contended", lambda: True)  # a stages and holds; b commits alone and carries it
    monkeypatch.setattr(a._loop.policy, "hold_delay", lambda **_kw: 600.0)  # noqa: SLF001 - only a carry ends the hold
    monkeypatch.setattr(CommitPolicy, "idle_after_s", 600.0)  # not a head that stays put while the test sets up
    monkeypatch.setattr(CommitPolicy, "leads_queue", False)  # nor a batch that leads the queue: it is the only one
    carried = carried_by(stream, a, b, batch("a", 3, WORLD), batch("b", 3, WORLD), carrier_step=10)
    assert (carried.step, carried.carried, carried.group) == (9, True, 2) and summary_of(stream, 9).group == 2


class Gated(SqlCatalog):
    """A catalog whose stream commits wait, once ``gate`` is set, for ``gate`` to call them through: a committer that has
    planned (its staged batches read) but not swapped yet."""

    gate = None

    def commit_table(self, table, requirements, updates):  # type: ignore[no-untyped-def]
        if self.gate is not None:
            self.gate()
        return super().commit_table(table, requirements, updates)


def test_a_commit_timeout_does_not_mean_unpublished_when_a_group_commit_had_read_the_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CommitTimeoutError`` withdraws the caller's staged batch, but a group commit of another producer that read the
    intent before the withdrawal still publishes it after the error was raised (Producer.commit's docstring says so).
    The error class and the producers guide must not promise "the batch was NOT published": the caller may only retry
    with the same seq (a duplicate then), never treat the batch as dropped."""
    props = {PROP_COMMIT_MAX_ATTEMPTS: "2"}
    root = str(tmp_path)
    gated_a = Gated("test", uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}/warehouse")
    gated_b = Gated("test", uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}/warehouse")
    stream = Stream.create(gated_a, "ns.stream", schema=SCHEMA, world_size=WORLD, properties=props)
    a, _ = both_active(stream)
    b = Stream.open(gated_b, "ns.stream").producer("b")
    monkeypatch.setattr(a, "_contended", lambda: True)  # a stages its batch ...
    monkeypatch.setattr(b, "_contended", lambda: False)  # ... b commits alone, listing the staged batches
    b_planned, a_gave_up = threading.Event(), threading.Event()

    def refuse_once_b_planned() -> None:  # A's own swaps: lost, once B is about to publish A's staged batch
        assert b_planned.wait(60)
        raise CommitFailedException("injected: the branch moved")

    def hold_until_a_gave_up() -> None:  # B has planned on the staged batches; its swap waits for A's error
        b_planned.set()
        assert a_gave_up.wait(60)

    gated_a.gate, gated_b.gate = refuse_once_b_planned, hold_until_a_gave_up
    errors: list = []

    def commit_a() -> None:
        try:
            a.commit(batch("a", 2, WORLD))
        except CommitTimeoutError as exc:
            errors.append(exc)
        finally:
            a_gave_up.set()

    thread_a = threading.Thread(target=commit_a, daemon=True)
    thread_a.start()
    deadline = time.monotonic() + 60
    while not staged_files(stream):  # A has written and staged its batch
        assert thread_a.is_alive() and time.monotonic() < deadline
        time.sleep(0.005)
    from lakestream_iceberg.write.planner import STAGING_SCAN_S

    time.sleep(STAGING_SCAN_S)
    result_b = b.commit(batch("b", 2, WORLD))
    thread_a.join(60)
    assert len(errors) == 1 and "withdrawn" in str(errors[0])  # A was told its commit gave up ...
    gated_a.gate = gated_b.gate = None
    assert ("a", 2) in published(stream).values()  # ... yet its batch is published
    assert result_b.group >= 2
    assert a.commit(batch("a", 2, WORLD), seq=2).duplicate  # a retry with the same seq is the safe answer


@pytest.mark.parametrize("broken", ["malformed-row", "truncated-file"])
def test_an_intent_that_can_never_be_published_does_not_hold_the_queue(tmp_path: Path, broken: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An intent staged before this batch that no commit can ever publish: a complete one that is not an intent (a
    malformed row), or an intent file its producer was SIGKILLed while writing (a local file system has no atomic PUT:
    the kill leaves 0 or 8,192 bytes of it) and that has stayed half-written for longer than a write takes. No commit
    carries it, so nothing removes it before GC; waiting for it held every batch staged behind it, at every hold, for
    half the grace period (30 minutes by default) instead of leading the queue once the head moved."""
    stream = make(tmp_path, **({} if broken == "malformed-row" else STORAGE))
    a, b = both_active(stream)
    folder = stream.staging.folder("main")
    if broken == "malformed-row":
        from lakestream_iceberg.connect.intents import IntentTable

        table = IntentTable.of(stream.table.catalog)
        assert table is not None
        table.insert(f"{folder}/x@{0:012d}-junk.parquet", "{not json")
    else:
        whole = stage(Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream"), "x", 0)  # another process's
        path = Path(whole.path.removeprefix("file://"))
        path.write_bytes(path.read_bytes()[:8192] if path.stat().st_size > 8192 else b"")  # the kill's leftover
        past = time.time() - 600  # unchanged for 10 minutes: its writer is gone (it retries a write for 2)
        os.utime(path, (past, past))
    assert b.commit(batch("b", 2, WORLD)).step == 5  # a commit reads it: never publishable, and it stays staged
    assert len(staged_files(stream)) == 1
    verdicts = _holding(a, monkeypatch)
    thread, results = _committing(a, verdicts)
    for _ in range(20):  # the head moves (a's own commit may land first: it has read the broken intent meanwhile)
        try:
            other = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
            other.table.transaction().set_properties({"touched": "1"}).commit_transaction()
            break
        except CommitFailedException:
            continue
    thread.join(60)  # holding behind the broken intent: 600 s
    assert not thread.is_alive(), f"still holding behind an intent nobody can publish: {verdicts}"
    (result,) = results
    assert (result.step, result.seq, result.carried) == (6, 2, False) and verdicts[-1] is False
    assert published(stream)[6] == ("a", 2)
