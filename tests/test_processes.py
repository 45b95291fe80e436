"""Real producer processes: concurrency, SIGKILL and restart, and commits whose outcome is unknown."""

from __future__ import annotations

import json
import queue
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from lakestream_iceberg import Stream
from tests.support import SCHEMA, batch, digest, sqlite_catalog

ROOT = Path(__file__).resolve().parent.parent


def spawn(root: Path, producer: str, count: int, *mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workers", str(root), "ns.stream", producer, str(count), *mode],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def published(stream: Stream) -> dict[int, tuple[str, int]]:
    """step -> (producer, seq), read from the data itself (every row names its producer and seq)."""
    out: dict[int, tuple[str, int]] = {}
    full = stream.table.catalog.load_table(stream.name).scan(selected_fields=("producer", "seq", "_step")).to_arrow()
    for row in full.to_pylist():
        key = (row["producer"], row["seq"])
        assert out.setdefault(row["_step"], key) == key, f"step {row['_step']} mixes batches"
    # steps whose shards were all empty carry no rows: take them from the manifests' file paths
    for step in range(1, stream.head_step() + 1):
        if step not in out:
            path = stream.locate(step)[0].file_path
            producer, name = path.split("/data/")[1].split("/")
            out[step] = (producer, int(name.split("-")[0]))
    return out


@pytest.mark.slow
def test_eight_producer_processes_publish_dense_steps_exactly_once(tmp_path: Path) -> None:
    # 25 batches each (200 steps): eight processes contend from the first batches on; measured on 2 cores, most of
    # their commits are carried by another producer's group commit with no attempt of their own
    per = 25
    total = 8 * per
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=3)
    procs = [spawn(tmp_path, f"prep-{i}", per) for i in range(8)]
    reports = {}
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-3000:]
        reports[f"prep-{i}"] = [json.loads(line) for line in out.splitlines()]
    results = [r for lines in reports.values() for r in lines]
    assert stream.head_step() == total
    # eight producers contend: group commit published batches of producers that made no attempt of their own
    assert len(results) == total and any(r["carried"] and r["attempts"] == 0 for r in results)
    assert not [p for p in Path(tmp_path, "warehouse").rglob("_staging/**/*.parquet")], "staged intents left behind"
    assert stream.staging.kind == "catalog" and stream.staging.expire(older_than_s=-1.0, delete=False) == [], \
        "staged intents left behind in the catalog"
    steps = published(stream)
    assert sorted(steps) == list(range(1, total + 1))
    assert sorted(steps.values()) == sorted((f"prep-{i}", s) for i in range(8) for s in range(per))
    for step in random.Random(0).sample(range(1, total + 1), 40):
        producer, seq = steps[step]
        expected = batch(producer, seq, 3)
        for rank in range(3):
            assert digest(stream.read(step, rank=rank)) == digest(expected[rank])
    for pid, lines in reports.items():  # what each producer was told matches the table
        assert [line["seq"] for line in lines] == list(range(per))
        assert all(steps[line["step"]] == (pid, line["seq"]) for line in lines)
        assert not any(line["dup"] for line in lines)
    per_seq = {p: [s for (q, s) in sorted(steps.values()) if q == p] for p in {p for p, _ in steps.values()}}
    assert all(seqs == list(range(per)) for seqs in per_seq.values())
    # each producer's own seqs appear in increasing step order
    for p in per_seq:
        order = [seq for step, (q, seq) in sorted(steps.items()) if q == p]
        assert order == sorted(order)


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """The process's stdout lines as they are printed (None at EOF), so the test can wait for them with a timeout."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


KILL_ROUNDS = 5


@pytest.mark.slow
def test_producer_killed_at_random_points_and_restarted_has_no_gap_and_no_duplicate(tmp_path: Path) -> None:
    kill_and_restart(tmp_path)


@pytest.mark.slow
def test_producer_killed_with_submitted_batches_in_flight_resumes_with_no_gap_and_no_duplicate(tmp_path: Path) -> None:
    # the victim submits in the background (two batches in flight): a kill loses exactly the batches not yet published,
    # and the next incarnation starts from the table's next seq
    kill_and_restart(tmp_path, "submit")


def kill_and_restart(tmp_path: Path, *mode: str) -> None:
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=2)
    rng = random.Random(7)
    other = spawn(tmp_path, "steady", 40)  # a second producer keeps the table moving
    printed: list[int] = []  # the victim's seqs as its incarnations reported them committed, in order
    kills = 0
    for _ in range(KILL_ROUNDS):
        # each incarnation is killed only after it made observed progress (it printed `want` committed batches), at a
        # random point of its next batch (building, staging or committing it): start-up time, however long on a busy
        # machine, never counts against the kill, and every round moves the victim forward.
        proc = spawn(tmp_path, "victim", 40, *mode)
        lines = lines_of(proc)
        want = rng.randint(1, 3)
        done: list[dict] = []
        while len(done) < want:
            line = lines.get(timeout=300)
            assert line is not None, f"victim exited before its kill ({proc.wait()}): {proc.stderr.read()[-3000:]}"
            done.append(json.loads(line))
        try:  # wait a random fraction of the last batch's duration, or until the next batch is reported: kill then
            line = lines.get(timeout=rng.uniform(0, done[-1]["elapsed_s"]))
            if line is not None:
                done.append(json.loads(line))
        except queue.Empty:
            pass
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()[-3000:]
        kills += 1
        printed += [r["seq"] for r in done]
    proc = spawn(tmp_path, "victim", 40, *mode)  # the last incarnation runs to the end
    lines = lines_of(proc)
    while (line := lines.get(timeout=300)) is not None:
        printed.append(json.loads(line)["seq"])
    assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
    assert other.wait(timeout=300) == 0, other.stderr.read()[-3000:]
    assert kills == KILL_ROUNDS
    # a restarted incarnation resumes after everything an earlier one reported committed, never before it
    assert printed == sorted(set(printed)) and printed[-1] == 39, printed
    steps = published(stream)
    assert sorted(steps) == list(range(1, stream.head_step() + 1))
    victim = sorted(seq for p, seq in steps.values() if p == "victim")
    assert victim == list(range(40)), "victim's seqs must be 0..39 exactly once"
    assert stream.head_step() == 80


class FlakyAfterCommit(SqlCatalog):
    """A real SQLite catalog whose connection 'drops' after the commit landed (or before it is sent)."""

    fail_after: int = 0
    fail_before: int = 0

    def commit_table(self, table, requirements, updates):  # type: ignore[no-untyped-def]
        if self.fail_before:
            self.fail_before -= 1
            raise ConnectionResetError("connection reset by peer (injected, before the commit was sent)")
        response = super().commit_table(table, requirements, updates)
        if self.fail_after:
            self.fail_after -= 1
            raise ConnectionResetError("connection reset by peer (injected, after the commit landed)")
        return response


def test_outcome_unknown_commit_that_landed_is_reconciled_not_duplicated(tmp_path: Path) -> None:
    catalog = FlakyAfterCommit("flaky", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    producer.commit(batch("p", 0, 2))
    catalog.fail_after = 1
    result = producer.commit(batch("p", 1, 2))
    assert (result.step, result.seq, result.duplicate, result.attempts) == (2, 1, False, 2)  # this call published it
    assert stream.head_step() == 2
    assert producer.commit(batch("p", 2, 2)).step == 3
    assert sorted(published(stream).values()) == [("p", 0), ("p", 1), ("p", 2)]


def test_outcome_unknown_commit_that_did_not_land_is_published_once(tmp_path: Path) -> None:
    catalog = FlakyAfterCommit("flaky", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    catalog.fail_before = 2
    result = producer.commit(batch("p", 0, 2))
    assert (result.step, result.duplicate, result.attempts) == (1, False, 3)
    assert stream.head_step() == 1
    assert digest(stream.read(1, rank=1)) == digest(batch("p", 0, 2)[1])


class DownAfterCommit(SqlCatalog):
    """A real SQLite catalog that applies a commit, then stays unreachable (commits and reads of the head) while ``down``."""

    down = False
    fail_after = 0

    def commit_table(self, table, requirements, updates):  # type: ignore[no-untyped-def]
        if self.down:
            raise ConnectionResetError("catalog unreachable (injected)")
        response = super().commit_table(table, requirements, updates)
        if self.fail_after:
            self.fail_after -= 1
            self.down = True
            raise ConnectionResetError("connection reset by peer (injected, after the commit landed)")
        return response


def down_after_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[DownAfterCommit, Stream]:
    """A stream whose catalog goes down once a commit landed (``fail_after``), and whose head reads fail while it is
    down: the commit's outcome cannot be learned (500 ms budget)."""
    import lakestream_iceberg.write.commit as commit_module

    catalog = DownAfterCommit("flaky", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2,
                           properties={"lakestream.commit.timeout-ms": "500"})
    refresh = commit_module.refresh_if_moved

    def unreachable_while_down(table: Any, **kwargs: Any) -> bool:
        if catalog.down:
            raise ConnectionResetError("catalog unreachable (injected)")
        return refresh(table, **kwargs)

    monkeypatch.setattr(commit_module, "refresh_if_moved", unreachable_while_down)
    return catalog, stream


def test_an_outcome_unknown_error_names_the_seq_whose_retry_is_reconciled(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit of a batch the producer numbered (``seq=None``, the README's way) lands, but the catalog stays
    unreachable for the whole commit budget: ``CommitOutcomeUnknownError``, "retry with the same seq". The error did
    not say which seq, and the table numbers a ``seq=None`` retry after the seq that landed, so the natural retry
    published the same batch a second time (steps 2 and 3). The error names the seq (``.seq``), and a retry with it
    is a duplicate; so is a seq=None retry of the same batch through the same producer."""
    from lakestream_iceberg import CommitOutcomeUnknownError

    catalog, stream = down_after_commit(tmp_path, monkeypatch)
    producer = stream.producer("p")
    producer.commit(batch("p", 0, 2))
    catalog.fail_after = 1
    with pytest.raises(CommitOutcomeUnknownError, match=r"producer 'p' seq 1\b.*seq=1") as info:
        producer.commit(batch("p", 1, 2))
    assert info.value.seq == 1
    catalog.down = False
    retry = producer.commit(batch("p", 1, 2), seq=info.value.seq)
    assert retry.duplicate and (retry.step, retry.seq) == (2, 1)
    assert sorted(published(stream).values()) == [("p", 0), ("p", 1)]
    # the natural retry, seq=None through the same producer: its next call takes the same batch for the retry
    catalog.fail_after = 1
    with pytest.raises(CommitOutcomeUnknownError, match=r"seq 2\b"):
        producer.commit(batch("p", 2, 2))
    catalog.down = False
    again = producer.commit(batch("p", 2, 2))
    assert again.duplicate and (again.step, again.seq) == (3, 2)
    assert sorted(published(stream).values()) == [("p", 0), ("p", 1), ("p", 2)]


def test_an_outcome_unknown_error_of_an_explicit_seq_does_not_advise_a_seq_none_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit with an explicit seq lands, then the catalog stays unreachable: ``CommitOutcomeUnknownError``. Its
    message advised a retry "with seq=None through this producer object (its next call takes the same batch for the
    retry)", which holds only for a batch the producer numbered: after an explicit seq the producer keeps no failed
    batch, and a ``seq=None`` retry is numbered after the seq that landed (the batch published twice)."""
    from lakestream_iceberg import CommitOutcomeUnknownError

    catalog, stream = down_after_commit(tmp_path, monkeypatch)
    producer = stream.producer("p")
    producer.commit(batch("p", 0, 2), seq=0)
    catalog.fail_after = 1
    with pytest.raises(CommitOutcomeUnknownError) as info:
        producer.commit(batch("p", 1, 2), seq=1)
    assert info.value.seq == 1
    catalog.down = False
    assert "seq=None through this producer object" not in str(info.value)
    assert "Retry this batch with seq=1; this or another producer object numbers a seq=None batch after" in str(info.value)
    retry = producer.commit(batch("p", 1, 2), seq=info.value.seq)
    assert retry.duplicate and (retry.step, retry.seq) == (2, 1)
    assert sorted(published(stream).values()) == [("p", 0), ("p", 1)]


def test_a_worker_forked_after_the_parent_committed_commits_with_threads_and_connections_of_its_own(
        tmp_path: Path) -> None:
    """A ``fork``ed worker inherits the parent's writer pool without its threads and the catalog's pooled connections:
    its first commit used to wait forever for threads that do not exist in it, and it reused the parent's SQLite
    handle. Now it makes its own pool and its own connections, and the parent keeps working."""
    import multiprocessing

    (tmp_path / "warehouse").mkdir()
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.fork", schema=SCHEMA, world_size=8, properties={"lakestream.layout": "per-rank"})
    stream.producer("parent").commit(batch("parent", 0, 8))  # all 8 threads of the writer pool and a pooled connection
    assert catalog.engine.pool.checkedin() >= 1
    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def child() -> None:
        try:
            fresh = catalog.engine.pool.checkedin() == 0  # the inherited connections were dropped at the fork
            results.put(("ok", fresh, stream.producer("child").commit(batch("child", 0, 8)).step))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put(("error", repr(exc), None))

    proc = context.Process(target=child)
    proc.start()
    status, fresh, step = _child_report(proc, results, "commit")
    assert (status, fresh, step) == ("ok", True, 2)
    assert proc.exitcode == 0
    assert stream.producer("parent").commit(batch("parent", 1, 8)).step == 3  # the parent's connections still work
    assert published(stream) == {1: ("parent", 0), 2: ("child", 0), 3: ("parent", 1)}


def test_a_worker_forked_after_the_parent_submitted_commits_with_a_committer_of_its_own(tmp_path: Path) -> None:
    """A ``fork``ed child inherits a producer whose committer thread ran in the parent: a batch it submitted (or
    committed, which queues behind submitted ones) used to wait forever for a thread that does not exist in it. Now it
    starts a committer of its own, from the table's next seq."""
    import multiprocessing

    (tmp_path / "warehouse").mkdir()
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.fork", schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    assert producer.submit(batch("p", 0, 2)).result(timeout=60).step == 1
    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def child() -> None:
        try:
            submitted = producer.submit(batch("p", 1, 2)).result(timeout=60)
            committed = producer.commit(batch("p", 2, 2))
            results.put(("ok", submitted.seq, committed.seq, producer.close()))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put(("error", repr(exc), None, None))

    proc = context.Process(target=child)
    proc.start()
    report = _child_report(proc, results, "submit")
    assert report == ("ok", 1, 2, 0) and proc.exitcode == 0
    assert producer.close() == 0 and stream.producer("p").next_seq == 3  # the child's batches, each once
    assert published(stream) == {1: ("p", 0), 2: ("p", 1), 3: ("p", 2)}


def _child_report(proc: Any, results: Any, what: str) -> Any:
    """What the forked worker ``proc`` put on ``results``; fails when it died first or never reported (a hang guard
    only: its work takes milliseconds). The worker is joined (killed if it stays)."""
    try:
        for _ in range(300):
            try:
                return results.get(timeout=1)
            except queue.Empty:
                if not proc.is_alive() and results.empty():
                    pytest.fail(f"the forked worker died (exit code {proc.exitcode}) before it reported")
        pytest.fail(f"the forked worker's {what} did not return")
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
