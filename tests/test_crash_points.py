"""Writers SIGKILLed at chosen points (tests/workers_crash.py), then restarted: what the table promises still holds.

Each case kills a real writer process (a producer committing directly or through group commit or submit(), a GC, a
checkpoint, a release) at one point of its work, restarts the same producer id or runs the same command again, and
then checks the table from pyiceberg: steps dense along the lineage, every batch published exactly once with the bytes
its producer sent, every file the metadata references present, a GC afterwards leaves a readable table, and a
checkpoint made before the kill still resumes at its step.

The points here are those no other kill test covers (tests/test_processes.py, tests/lifecycle/, tests/write/): a
submitted batch killed after its swap, a staged one mid-intent and before its intent's removal, the new metadata
written but the pointer not moved, a producer-state compaction, a checkpoint or fork after its swap, and a carrier of a
dead producer's batch. Killing at any other point is a matter of adding a ``module:attr:N:before|after`` spec.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import pytest

from lakestream_iceberg import Stream
from tests.backends import Backend, backend_fixture, published
from tests.support import SCHEMA, batch, digest

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
COUNT = 4  # the victim's batches
CRASH_ENV = "LAKESTREAM_TEST_CRASH_AT"

crash_backend = backend_fixture("sqlite-local", name="crash_backend")


def run(backend: Backend, *args: str, crash: str | None = None) -> subprocess.CompletedProcess[str]:
    env = backend.worker_env(**({CRASH_ENV: crash} if crash else {}))
    return subprocess.run([sys.executable, "-m", "tests.workers_crash", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def killed(backend: Backend, *args: str, crash: str) -> None:
    done = run(backend, *args, crash=crash)
    assert done.returncode == -signal.SIGKILL, f"{crash} was never reached (rc {done.returncode}): {done.stderr[-3000:]}"


def ok(backend: Backend, *args: str) -> list[dict]:
    done = run(backend, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def publish(stream: Stream, producer_id: str, count: int) -> None:
    producer = stream.producer(producer_id)
    for seq in range(producer.next_seq, count):
        producer.commit(batch(producer_id, seq, WORLD), seq=seq)


def physical(location: str, path: str) -> str:
    scheme = urlparse(location).scheme
    return path if urlparse(path).scheme else (f"{scheme}://{path}" if scheme not in ("", "file") else f"/{path}")


def missing_files(stream: Stream) -> list[str]:
    """Every file the current metadata references (metadata log, manifest lists, manifests, data, producer-state
    files, over every retained snapshot) that does not exist."""
    metadata = stream.refresh().table.metadata
    out = []
    paths: set[str] = {stream.table.metadata_location}
    for snapshot in metadata.snapshots:
        paths.add(snapshot.manifest_list)
        from lakestream_iceberg.format.summary import StreamState

        paths.update(StreamState.of(snapshot).producer_files)
        for manifest in snapshot.manifests(stream.io):
            paths.add(manifest.manifest_path)
            paths.update(e.data_file.file_path for e in manifest.fetch_manifest_entry(stream.io, discard_deleted=True))
    for path in sorted(paths):
        if not stream.io.new_input(path).exists():
            out.append(path)
    return out


def check(stream: Stream, expected: dict[str, int], *, checkpoint: tuple[str, int] | None = None) -> None:
    stream.refresh()
    steps = published(stream)
    assert sorted(steps) == list(range(1, len(steps) + 1))
    assert sorted(steps.values()) == sorted((p, s) for p, n in expected.items() for s in range(n)), steps
    assert missing_files(stream) == []
    for step, (producer, seq) in steps.items():
        want = batch(producer, seq, WORLD)
        assert [digest(stream.read(step, rank=r)) for r in range(WORLD)] == [digest(t) for t in want], step
    rows = stream.table.catalog.load_table(stream.name).scan().to_arrow()  # every data file of the head, read
    assert rows.num_rows == sum(t.num_rows for p, n in expected.items() for s in range(n) for t in batch(p, s, WORLD))
    if checkpoint is not None:
        name, step = checkpoint
        assert [c.step for c in stream.checkpoints() if c.name == name] == [step]
    stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert missing_files(stream) == []
    for step in range(stream.state().collected_below or 1, stream.head_step() + 1):
        producer, seq = steps[step]
        assert digest(stream.read(step, rank=0)) == digest(batch(producer, seq, WORLD)[0])
    if checkpoint is not None:
        name, step = checkpoint
        branch = f"resume-{name}"
        stream.fork(name, branch=branch)
        producer, seq = steps[step]
        assert digest(stream.read(step, rank=1, branch=branch)) == digest(batch(producer, seq, WORLD)[1])
        stream.producer("after-fork", branch=branch).commit(batch("after-fork", 0, WORLD))
        assert stream.head_step(branch=branch) == step + 1


COMMIT = "lakestream_iceberg.write.commit"
PRODUCER_POINTS = {
    "after-data-upload": "lakestream_iceberg.write.writer:BatchWriter.write:2:after",
    "before-swap": f"{COMMIT}:swap:2:before",
    "metadata-written-before-pointer": "lakestream_iceberg.connect.swap:_write_metadata:2:after",
    "after-swap-before-return": f"{COMMIT}:swap:2:after",
    "after-adopt": f"{COMMIT}:CommitLoop.adopt:2:after",
    "first-commit-after-swap": f"{COMMIT}:swap:1:after",
}
STAGED_POINTS = {
    "mid-intent-write": "lakestream_iceberg.write.staging:StagingArea.stage:2:before",
    "after-intent-write": "lakestream_iceberg.write.staging:StagingArea.stage:2:after",
    "after-swap-before-intent-removal": "lakestream_iceberg.write.staging:StagingArea.remove:2:before",
    "before-swap": f"{COMMIT}:swap:2:before",
    "after-swap-before-return": f"{COMMIT}:swap:2:after",
}


@pytest.mark.parametrize(("mode", "point"), [("commit", "metadata-written-before-pointer"),
                                             ("submit", "after-swap-before-return"), ("staged", "mid-intent-write"),
                                             ("staged", "after-swap-before-intent-removal")])
def test_a_producer_killed_at_a_point_and_restarted_publishes_every_batch_once(crash_backend: Backend, point: str,
                                                                              mode: str) -> None:
    spec = (STAGED_POINTS if mode == "staged" else PRODUCER_POINTS)[point]
    stream = Stream.create(crash_backend.catalog(), crash_backend.identifier(), schema=SCHEMA, world_size=WORLD)
    publish(stream, "base", 2)
    stream.checkpoint("c2", step=2)
    extra = [] if mode == "commit" else [mode]
    killed(crash_backend, "produce", crash_backend.identifier(), "victim", str(COUNT), *extra, crash=spec)
    ok(crash_backend, "produce", crash_backend.identifier(), "victim", str(COUNT), *extra)
    check(stream, {"base": 2, "victim": COUNT}, checkpoint=("c2", 2))


OPS = {
    "checkpoint": ("checkpoint", "c5", "5"),
    "release": ("release", "c3"),
    "fork": ("fork", "c3", "exp"),
    "repair": ("repair",),
}


@pytest.mark.parametrize(("op", "when"), [("checkpoint", "after"), ("fork", "after")])
def test_a_lifecycle_command_killed_around_its_swap_left_all_or_nothing(crash_backend: Backend, op: str,
                                                                        when: str) -> None:
    """Killed before its swap the command did nothing and runs again; killed after it, the command is done (a second
    call is refused as it would be after a normal return: checkpoints and branches are named once)."""
    stream = Stream.create(crash_backend.catalog(), crash_backend.identifier(), schema=SCHEMA, world_size=WORLD)
    publish(stream, "p", 6)
    stream.checkpoint("c3", step=3)
    if op == "repair":
        from tests.support import foreign_append

        foreign_append(stream)
    command = OPS[op]
    killed(crash_backend, command[0], crash_backend.identifier(), *command[1:], crash=f"{COMMIT}:swap:1:{when}")
    if when == "before" or op == "repair":  # a repair run again finds nothing left to repair
        ok(crash_backend, command[0], crash_backend.identifier(), *command[1:])
    else:
        again = run(crash_backend, command[0], crash_backend.identifier(), *command[1:])
        assert again.returncode == 1 and "CheckpointError" in again.stderr
    stream.refresh()
    names = {"checkpoint": ["c3", "c5"], "release": [], "fork": ["c3"], "repair": ["c3"]}[op]
    assert [c.name for c in stream.checkpoints()] == names
    if op == "fork":
        assert stream.head_step(branch="exp") == 3
        stream.producer("q", branch="exp").commit(batch("q", 0, WORLD))
        assert stream.head_step(branch="exp") == 4
    check(stream, {"p": 6}, checkpoint=("c5", 5) if op == "checkpoint" else None)

@pytest.mark.parametrize("point", ["after-compacting-swap"])
def test_a_producer_killed_while_compacting_producer_state_and_restarted_keeps_every_id_exactly_once(
        crash_backend: Backend, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    from lakestream_iceberg.format import producers
    from tests.workers import SMALL_CONSTANTS_ENV

    for name, value in (("ACTIVE_MIN_STEPS", 4), ("COMPACT_AT", 4), ("MAX_FILES", 2)):
        monkeypatch.setattr(producers, name, value)
    monkeypatch.setenv(SMALL_CONSTANTS_ENV, "4,4,2")
    stream = Stream.create(crash_backend.catalog(), crash_backend.identifier(), schema=SCHEMA, world_size=WORLD)
    for i in range(10):  # one-shot ids: idle after 4 steps, compacted 4 at a time into producer-state files
        stream.producer(f"id-{i}").commit(batch(f"id-{i}", 0, WORLD), seq=0)
    stream.checkpoint("c2", step=2)
    write = "lakestream_iceberg.format.producers:_write:1:after"
    spec = write if point == "producer-state-file-written" else f"{COMMIT}:swap:2:after"
    killed(crash_backend, "produce", crash_backend.identifier(), "victim", "8",
           crash=spec)
    assert stream.refresh().state().producer_files, "no compaction happened"
    ok(crash_backend, "produce", crash_backend.identifier(), "victim", "8")
    for i in range(10):  # every compacted id comes back at seq 1, and its seq 0 is a duplicate
        assert stream.producer(f"id-{i}").commit(batch(f"id-{i}", 0, WORLD), seq=0).duplicate
        assert stream.producer(f"id-{i}").next_seq == 1
    check(stream, {**{f"id-{i}": 1 for i in range(10)}, "victim": 8}, checkpoint=("c2", 2))


@pytest.mark.parametrize(("staging", "when"), [("catalog", "before")])
def test_a_carrier_killed_after_publishing_a_dead_producers_staged_batch_leaves_it_published_once(
        crash_backend: Backend, staging: str, when: str) -> None:
    """Producer a dies with its batch staged; b's commit carries it and b is killed right after that swap, before it
    removed the intents it published (``before``) or right after (``after``). Restarted, both go on exactly once."""
    from tests.write.test_group_processes import holder, kill_once_staged, make_stream, staged

    stream = make_stream(crash_backend, staging)
    ident = stream.name
    stream.producer("a").commit(batch("a", 0, WORLD), seq=0)
    stream.producer("b").commit(batch("b", 0, WORLD), seq=0)
    stream.checkpoint("c2", step=2)
    (intent,) = kill_once_staged(stream, holder(crash_backend, ident, "a", 1))
    assert "/a@000000000001-" in intent
    killed(crash_backend, "produce", ident, "b", "2",
           crash=f"lakestream_iceberg.write.staging:StagingArea.remove:1:{when}")
    assert published(stream.refresh()) == {1: ("a", 0), 2: ("b", 0), 3: ("a", 1), 4: ("b", 1)}
    ok(crash_backend, "produce", ident, "a", "3")  # the restart of a: seq 1 was carried, it goes on at 2
    ok(crash_backend, "produce", ident, "b", "3")
    left = staged(stream)  # an intent of a published batch may be left for GC; never published again
    check(stream, {"a": 3, "b": 3}, checkpoint=("c2", 2))
    assert staged(stream) == [], left
