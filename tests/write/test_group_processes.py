"""Group commit with real producer processes: a producer SIGKILLed after staging its batch, on every staging kind
and SQL catalog; streams and branches that share the catalog's intent table."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.format.layout import PROP_GROUP_STAGING
from lakestream_iceberg.write.intent import STAGING_DIR, Intent
from tests.backends import Backend, backend_fixture, postgres_service, published, seaweedfs_service
from tests.support import SCHEMA, batch, digest, until

ROOT = Path(__file__).resolve().parent.parent.parent
WORLD = 2

__all__ = ["postgres_service", "seaweedfs_service"]  # fixtures used by name


sql_backend = backend_fixture("sqlite-local", "postgres-seaweedfs", name="sql_backend")


def staged(stream: Stream) -> list[str]:
    """Every staged intent of the stream (any branch), files or rows."""
    if stream.staging.kind == "catalog":
        return sorted(stream.staging.expire(older_than_s=-1.0, delete=False))
    root = f"{stream.table.metadata.location.rstrip('/')}/data/{STAGING_DIR}"
    from lakestream_iceberg.connect.storage import list_files

    try:
        return sorted(p for p, _s, _m in list_files(stream.io, root, purpose="test") if p.endswith(".parquet"))
    except FileNotFoundError:
        return []


def holder(backend: Backend, ident: str, producer: str, seq: int, branch: str = "main") -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.workers_group", "hold", ident, producer, str(seq), branch],
                            cwd=ROOT, env=backend.worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_once_staged(stream: Stream, proc: subprocess.Popen[str], before: int = 0) -> list[str]:
    """Wait until the holder's intent is staged (observed), then SIGKILL it; the staged intents then."""
    def complete(path: str) -> bool:  # a local file system has no atomic PUT: the intent file may be half-written
        if stream.staging.kind == "catalog":
            return True
        try:
            with stream.io.new_input(path).open() as f:
                Intent.from_bytes(path, f.read())
        except Exception:  # noqa: BLE001 - not yet complete
            return False
        return True

    def seen() -> list[str] | None:
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else proc.returncode
        now = staged(stream)
        return now if len(now) > before and all(complete(p) for p in now) else None

    intents = until(seen, "the holder's staged intent", deadline_s=120)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    return intents  # type: ignore[return-value]


def make_stream(backend: Backend, staging: str, table: str = "stream") -> Stream:
    return Stream.create(backend.catalog(), backend.identifier(table), schema=SCHEMA, world_size=WORLD,
                         properties={PROP_GROUP_STAGING: staging})


@pytest.mark.parametrize("staging", ["storage", "catalog"])
def test_a_producer_killed_after_staging_is_published_once_by_the_next_commit(sql_backend: Backend,
                                                                              staging: str) -> None:
    stream = make_stream(sql_backend, staging)
    assert stream.staging.kind == staging
    a, b = stream.producer("a"), stream.producer("b")
    a.commit(batch("a", 0, WORLD))
    b.commit(batch("b", 0, WORLD))
    (intent,) = kill_once_staged(stream, holder(sql_backend, stream.name, "a", 1))
    assert "/a@000000000001-" in intent
    result = b.commit(batch("b", 1, WORLD))  # committing alone: it lists the staged batches and carries a's
    assert (result.step, result.group) == (4, 2)
    assert published(stream) == {1: ("a", 0), 2: ("b", 0), 3: ("a", 1), 4: ("b", 1)}
    assert staged(stream) == []
    for rank in range(WORLD):
        assert digest(stream.read(3, rank=rank)) == digest(batch("a", 1, WORLD)[rank])
    restarted = Stream.open(sql_backend.catalog(), stream.name).producer("a")
    assert restarted.next_seq == 2
    again = restarted.commit(batch("a", 1, WORLD), seq=1)
    assert (again.duplicate, again.step) == (True, 3)
    assert restarted.commit(batch("a", 2, WORLD)).step == 5
    assert published(stream)[5] == ("a", 2) and stream.head_step() == 5


@pytest.mark.parametrize("staging", ["storage", "catalog"])
def test_a_producer_restarted_before_its_staged_batch_was_carried_publishes_that_seq_once(sql_backend: Backend,
                                                                                         staging: str) -> None:
    stream = make_stream(sql_backend, staging)
    a, b = stream.producer("a"), stream.producer("b")
    a.commit(batch("a", 0, WORLD))
    b.commit(batch("b", 0, WORLD))
    kill_once_staged(stream, holder(sql_backend, stream.name, "a", 1))
    restarted = Stream.open(sql_backend.catalog(), stream.name).producer("a")
    assert restarted.next_seq == 1  # nobody carried it yet: the restart commits seq 1 itself
    result = restarted.commit(batch("a", 1, WORLD), seq=1)
    assert result.step == 3 and result.seq == 1
    assert staged(stream) == []  # the dead incarnation's intent of the same seq is gone with it
    assert b.commit(batch("b", 1, WORLD)).step == 4
    assert published(stream) == {1: ("a", 0), 2: ("b", 0), 3: ("a", 1), 4: ("b", 1)}


@pytest.mark.parametrize("staging", ["storage", "catalog"])
def test_dead_producers_batches_of_two_streams_and_two_branches_never_cross(sql_backend: Backend, staging: str) -> None:
    """Two streams of one catalog (one intent table on catalog staging) and a fork of one of them: a batch staged by a
    producer killed on one of them is published by the next commit there, and by no commit anywhere else; GC of one
    stream never touches the other's intents."""
    from datetime import timedelta

    x, y = make_stream(sql_backend, staging, "x"), make_stream(sql_backend, staging, "y")
    for stream in (x, y):
        a, b = stream.producer("a"), stream.producer("b")
        a.commit(batch("a", 0, WORLD))
        b.commit(batch("b", 0, WORLD))
    x.checkpoint("c2", step=2)
    x.fork("c2", branch="exp-1")
    fa, fb = x.producer("a", branch="exp-1"), x.producer("b", branch="exp-1")
    # a's next batch is staged and left behind three times: on x main, on x's fork (a fork starts fresh producer
    # sequences: seq 0 there), and on y main
    kill_once_staged(x, holder(sql_backend, x.name, "a", 1, "main"))
    kill_once_staged(x, holder(sql_backend, x.name, "a", 0, "exp-1"), before=1)
    kill_once_staged(y, holder(sql_backend, y.name, "a", 1, "main"))
    assert len(staged(x)) == 2 and len(staged(y)) == 1
    # y's commit carries y's batch only
    r = y.producer("b").commit(batch("b", 1, WORLD))
    assert r.step == 4, r
    assert published(y) == {1: ("a", 0), 2: ("b", 0), 3: ("a", 1), 4: ("b", 1)}
    assert staged(y) == [] and len(staged(x)) == 2
    # x main's commit carries x main's batch only; the fork's is still staged
    assert x.producer("b").commit(batch("b", 1, WORLD)).step == 4
    assert published(x) == {1: ("a", 0), 2: ("b", 0), 3: ("a", 1), 4: ("b", 1)}
    (left,) = staged(x)
    assert "/exp-1/a@000000000000-" in left
    # GC of y (any grace) never removes x's intents
    y.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert staged(x) == [left]
    # the fork's commit carries the fork's batch
    result = fb.commit(batch("b", 7, WORLD))
    assert (result.step, result.seq, result.group) == (4, 0, 2)
    steps = {s: x.locate(s, branch="exp-1")[0].file_path for s in (3, 4)}
    assert "/data/a/000000000000-" in steps[3] and "/data/b/000000000000-" in steps[4]
    for rank in range(WORLD):
        assert digest(x.read(3, rank=rank, branch="exp-1")) == digest(batch("a", 0, WORLD)[rank])
    assert staged(x) == []
    assert fa.next_seq == 1 and x.head_step() == 4 and x.head_step(branch="exp-1") == 4


@pytest.mark.parametrize("mode", ["before", "after", "after-down"])
@pytest.mark.parametrize("staging", ["storage", "catalog"])
def test_a_holder_whose_carrier_swap_fails_gets_a_clear_outcome(tmp_path: Path, staging: str, mode: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Producer a holds its staged batch; b (committing alone) plans a group commit carrying it, and b's swap fails:
    before it was sent (b retries), or after it landed (b's connection drops; in ``after-down`` b's catalog then stays
    unreachable until b gives up with CommitOutcomeUnknownError). a's call returns its batch published exactly once,
    carried by b's swap, and no intent is left behind."""
    import threading
    import time

    from pyiceberg.catalog.sql import SqlCatalog

    import lakestream_iceberg.write.commit as commit_module
    from lakestream_iceberg import CommitOutcomeUnknownError
    from lakestream_iceberg.write.dac import CommitPolicy
    from lakestream_iceberg.write.planner import STAGING_SCAN_S

    uri, warehouse = f"sqlite:///{tmp_path}/catalog.db", f"file://{tmp_path}/warehouse"
    healthy, flaky = SqlCatalog("test", uri=uri, warehouse=warehouse), SqlCatalog("test", uri=uri, warehouse=warehouse)
    stream = Stream.create(healthy, "ns.stream", schema=SCHEMA, world_size=WORLD,
                           properties={PROP_GROUP_STAGING: staging, "lakestream.commit.timeout-ms": "3000"})
    a = stream.producer("a")
    b = Stream.open(flaky, "ns.stream").producer("b")
    a.commit(batch("a", 0, WORLD))
    b.commit(batch("b", 0, WORLD))
    state = {"fail": None, "down": False}
    swap, refresh = commit_module.swap, commit_module.refresh_if_moved

    def flaky_swap(table, requirements, updates, **kwargs):  # type: ignore[no-untyped-def]
        if table.catalog is not flaky:
            return swap(table, requirements, updates, **kwargs)
        if state["down"]:
            raise ConnectionResetError("catalog unreachable (injected)")
        mode, state["fail"] = state["fail"], None
        if mode == "before":
            raise ConnectionResetError("connection reset (injected, before the commit was sent)")
        response = swap(table, requirements, updates, **kwargs)
        if mode is not None:
            state["down"] = mode == "after-down"
            raise ConnectionResetError("connection reset (injected, after the commit landed)")
        return response

    def unreachable_while_down(table, **kwargs):  # type: ignore[no-untyped-def]
        if table.catalog is flaky and state["down"]:
            raise ConnectionResetError("catalog unreachable (injected)")
        return refresh(table, **kwargs)

    monkeypatch.setattr(commit_module, "swap", flaky_swap)
    monkeypatch.setattr(commit_module, "refresh_if_moved", unreachable_while_down)
    monkeypatch.setattr(a, "_contended", lambda: True)  # a stages and holds (only b's commit ends its hold) ...
    monkeypatch.setattr(a._loop.policy, "hold_delay", lambda **_kw: 600.0)  # noqa: SLF001
    monkeypatch.setattr(CommitPolicy, "idle_after_s", 600.0)
    monkeypatch.setattr(CommitPolicy, "leads_queue", False)  # a lone staged batch would lead the queue: commit at once
    monkeypatch.setattr(b, "_contended", lambda: False)  # ... b commits alone, listing the staged batches
    results: list = []

    def commit_a() -> None:
        try:
            results.append(a.commit(batch("a", 1, WORLD)))
        except Exception as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    thread = threading.Thread(target=commit_a, daemon=True)
    thread.start()
    until(lambda: staged(stream) or not thread.is_alive(), "a's staged intent")
    time.sleep(STAGING_SCAN_S)  # b, committing alone, lists the staging folder at most this often
    state["fail"] = mode
    if mode == "after-down":
        with pytest.raises(CommitOutcomeUnknownError):
            b.commit(batch("b", 1, WORLD))
    else:
        assert b.commit(batch("b", 1, WORLD)).group == 2
    thread.join(120)
    assert not thread.is_alive()
    (result,) = results
    steps = published(stream)
    assert sorted(steps.values()) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert steps[result.step] == ("a", 1) and result.seq == 1 and not result.duplicate and result.carried
    assert staged(stream) == []
