"""A commit whose reply is lost on the wire, against the real catalogs (PostgreSQL, SeaweedFS's Iceberg REST catalog).

A :class:`~tests.lossy_line.LossyLine` stands between the catalog client and the server. Armed, it either forwards the
commit (PostgreSQL: lakestream's conditional pointer ``UPDATE``; REST: ``POST .../tables/<t>``) and drops the
connection once the server answered, before the answer reaches the client (``reply``: the commit landed, the client
cannot know), or drops it before forwarding (``request``: nothing landed, the client cannot know either). Each commit
kind (a producer's direct commit, a staged group commit, ``submit()``, GC's two commits, a checkpoint, a fork, a
release, a repair) must then either succeed exactly once or raise a :class:`LakestreamError` saying the outcome is
unknown; and after a restart of the same producer id no batch is lost or published twice, steps stay dense, every
referenced file exists and GC leaves no orphan behind.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest

from catalog import services
from lakestream_iceberg import Stream
from lakestream_iceberg.connect.storage import list_files
from lakestream_iceberg.errors import LakestreamError
from lakestream_iceberg.lifecycle.sweep import norm, referenced_files
from tests.backends import Backend, fresh_name, postgres_service, published, seaweedfs_service  # noqa: F401
from tests.lossy_line import POINTER_UPDATE, REST_COMMIT, LossyLine
from tests.support import SCHEMA, batch, digest, foreign_append, until
from tests.test_crash_points import missing_files

pytestmark = pytest.mark.services

WORLD = 2
LOSSES = ("reply", "request")


class Wire:
    """A backend whose catalog client talks to the server through a :class:`LossyLine`."""

    def __init__(self, backend: Backend, line: LossyLine, pattern) -> None:
        self.backend, self.line, self.pattern = backend, line, pattern

    def stream(self) -> Stream:
        return Stream.open(self.backend.catalog(), self.backend.identifier())

    def create(self) -> Stream:
        catalog = self.backend.catalog()
        catalog.create_namespace_if_not_exists(self.backend.namespace)
        return Stream.create(catalog, self.backend.identifier(), schema=SCHEMA, world_size=WORLD)

    def lose(self, what: str, *, skip: int = 0) -> None:
        self.line.arm(self.pattern, lose=what, skip=skip)

    def fired(self) -> bool:
        return self.line.fired.is_set()


@pytest.fixture(params=["postgres", "rest"])
def wire(request: pytest.FixtureRequest) -> Iterator[Wire]:
    yield from _wire(request, request.param)


@pytest.fixture
def pg_wire(request: pytest.FixtureRequest) -> Iterator[Wire]:
    """PostgreSQL only: staged intents are rows of its database there (files on the REST catalog's storage)."""
    yield from _wire(request, "postgres")


@pytest.fixture
def rest_wire(request: pytest.FixtureRequest) -> Iterator[Wire]:
    from lakestream_iceberg.connect.rest_timeout import install_rest_timeout

    install_rest_timeout()  # as lakestream's load_catalog does for a REST catalog: pyiceberg's requests never time out
    yield from _wire(request, "rest", **{"rest.client.socket-timeout-ms": "1500"})


def _wire(request: pytest.FixtureRequest, kind: str, **extra: str) -> Iterator[Wire]:
    weed: services.SeaweedFS = request.getfixturevalue("seaweedfs_service")
    ns = fresh_name("ns")
    if kind == "postgres":
        pg: services.Postgres = request.getfixturevalue("postgres_service")
        db = fresh_name("db")
        pg.create_database(db)
        with LossyLine(target_port=pg.port) as line:
            props = services.postgres_seaweedfs(pg, weed, database=db, prefix=db)
            props["uri"] = props["uri"].replace(f":{pg.port}/", f":{line.port}/")
            backend = Backend(kind="postgres-seaweedfs", properties=props, namespace=ns, database=db)
            try:
                yield Wire(backend, line, POINTER_UPDATE)
            finally:
                backend.close()
    else:
        with LossyLine(target_port=weed.ports["iceberg"]) as line:
            props = services.rest_seaweedfs(weed)
            props["uri"] = f"http://127.0.0.1:{line.port}"
            props.update(extra)
            backend = Backend(kind="rest-seaweedfs", properties=props, namespace=ns)
            try:
                yield Wire(backend, line, REST_COMMIT)
            finally:
                backend.close()


def outcome_of(call) -> object:
    """The call's result, or the LakestreamError it raised (which must say the outcome is unknown)."""
    try:
        return call()
    except LakestreamError as exc:
        assert "may or may not" in str(exc) or "unknown" in str(exc).lower(), exc
        return exc


def publish(stream: Stream, producer_id: str, upto: int) -> None:
    producer = stream.producer(producer_id)
    for seq in range(producer.next_seq, upto):
        producer.commit(batch(producer_id, seq, WORLD), seq=seq)


def orphans(stream: Stream) -> list[str]:
    """Files under the table's location that nothing references, after a GC with no grace period."""
    stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    metadata = stream.refresh().table.metadata
    keep = referenced_files(stream.io, metadata, stream.table.metadata_location, stream)
    return sorted(p for p, _, _ in list_files(stream.io, metadata.location) if norm(p) not in keep)


def check(stream: Stream, expected: dict[str, int]) -> None:
    """Dense steps, every batch of ``expected`` ({producer: count}) exactly once, byte for byte; no missing file."""
    stream.refresh()
    steps = published(stream)
    assert sorted(steps) == list(range(1, len(steps) + 1)), steps
    assert sorted(steps.values()) == sorted((p, s) for p, n in expected.items() for s in range(n)), steps
    assert missing_files(stream) == []
    for step, (producer, seq) in steps.items():
        want = batch(producer, seq, WORLD)
        assert [digest(stream.read(step, rank=r)) for r in range(WORLD)] == [digest(t) for t in want], step


@pytest.mark.parametrize(("numbered", "lose"), [("explicit", "reply"), ("seq=None", "reply"), ("explicit", "request")])
def test_a_direct_commit_whose_exchange_is_lost_publishes_once(wire: Wire, lose: str, numbered: str) -> None:
    stream = wire.create()
    publish(stream, "p", 2)
    producer = stream.producer("p")
    wire.lose(lose)
    got = outcome_of(lambda: producer.commit(batch("p", 2, WORLD), seq=2 if numbered == "explicit" else None))
    assert wire.fired()
    if numbered == "seq=None":  # the same producer object goes on numbering: the next batch is seq 3, at step 4
        nxt = producer.commit(batch("p", 3, WORLD))
        assert (nxt.seq, nxt.step, nxt.duplicate) == (3, 4, False)
    if not isinstance(got, Exception):
        # published by this very call, whose reply was lost: not a duplicate
        assert (got.step, got.seq, got.duplicate) == (3, 2, False)
    again = wire.stream()  # a restart of the same producer id
    publish(again, "p", 4)
    check(again, {"p": 4})
    assert orphans(again) == []


@pytest.mark.parametrize("lose", ["reply"])
def test_a_submitted_batch_whose_exchange_is_lost_publishes_once(wire: Wire, lose: str) -> None:
    stream = wire.create()
    publish(stream, "p", 1)
    producer = stream.producer("p")
    wire.lose(lose, skip=1)  # the second submitted batch's swap
    futures = [producer.submit(batch("p", seq, WORLD)) for seq in range(1, 4)]
    results = [outcome_of(f.result) if not f.exception() or isinstance(f.exception(), LakestreamError) else f.result()
               for f in futures]
    assert wire.fired()
    producer.close() if not any(isinstance(r, Exception) for r in results) else None
    again = wire.stream()
    publish(again, "p", 5)
    check(again, {"p": 5})
    assert orphans(again) == []


@pytest.mark.parametrize("lose", ["reply"])
def test_a_group_commit_whose_exchange_is_lost_publishes_every_staged_batch_once(wire: Wire, lose: str,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    stream = wire.create()
    publish(stream, "a", 1)
    publish(stream, "b", 1)
    a, b = stream.producer("a"), stream.producer("b")
    a.next_seq, b.next_seq  # noqa: B018 - each reads the head once
    monkeypatch.setattr(b, "_contended", lambda: True)  # b stages its batch and holds: only a carry or its own turn ends it
    monkeypatch.setattr(b._loop.policy, "hold_delay", lambda **_kw: 2.0)  # noqa: SLF001
    monkeypatch.setattr(a, "_contended", lambda: True)  # a stages its own and commits the group at once
    monkeypatch.setattr(a._loop.policy, "hold_delay", lambda **_kw: 0.0)  # noqa: SLF001
    b_result: list[object] = []
    t = threading.Thread(target=lambda: b_result.append(outcome_of(lambda: b.commit(batch("b", 1, WORLD), seq=1))))
    t.start()
    until(lambda: stream.staging.pending("main", max_age_s=3600), "b's batch staged", deadline_s=10)
    wire.lose(lose)
    got = outcome_of(lambda: a.commit(batch("a", 1, WORLD), seq=1))
    t.join(30)
    assert wire.fired() and not t.is_alive()
    assert [r.seq for r in (got, *b_result) if not isinstance(r, Exception)] in ([1, 1], [1], [])
    monkeypatch.undo()
    again = wire.stream()
    publish(again, "a", 3)
    publish(again, "b", 3)
    check(again, {"a": 3, "b": 3})
    assert orphans(again) == []


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("lose", ["reply"])
def test_gc_whose_commit_exchange_is_lost_collects_once(wire: Wire, lose: str, which: int) -> None:
    stream = wire.create()
    publish(stream, "p", 4)
    stream.checkpoint("c2", step=2)
    stream.checkpoint("c3", step=3)
    args = {"keep_last": 1, "grace": timedelta(0), "allow_short_grace": True}
    planned = stream.collect_garbage(dry_run=True, **args)
    wire.lose(lose, skip=which)  # GC's first commit (release + collect), or its second (expiry)
    got = outcome_of(lambda: stream.collect_garbage(dry_run=False, **args))
    assert wire.fired()
    if not isinstance(got, Exception):  # what it did, reported: not what a re-plan on its own commit found left
        assert (got.released_checkpoints, got.collected_below, got.snapshots_expired) == \
               (["c2"], {"main": 3}, planned.snapshots_expired)
    again = wire.stream()
    assert [c.name for c in again.checkpoints()] == ["c3"] or isinstance(got, Exception)
    publish(again, "p", 6)
    steps = published_live(again)
    assert steps == {s: ("p", s - 1) for s in range(again.state().collected_below or 1, 7)}
    assert missing_files(again) == []
    assert orphans(again) == []


def published_live(stream: Stream) -> dict[int, tuple[str, int]]:
    from tests.backends import producer_seq

    out = {}
    for step in range(stream.state().collected_below or 1, stream.head_step() + 1):
        keys = {producer_seq(f.file_path) for f in stream.locate(step)}
        assert len(keys) == 1
        out[step] = keys.pop()
    return out


@pytest.mark.parametrize("op", ["checkpoint", "fork"])
@pytest.mark.parametrize("lose", ["reply"])
def test_a_lifecycle_command_whose_exchange_is_lost_is_done_once(wire: Wire, lose: str, op: str) -> None:
    stream = wire.create()
    publish(stream, "p", 4)
    stream.checkpoint("c3", step=3)
    before = len(stream.refresh().table.metadata.snapshots)
    wire.lose(lose)
    if op == "checkpoint":
        got = outcome_of(lambda: stream.checkpoint("c4", step=4))
    elif op == "release":
        got = outcome_of(lambda: stream.release("c3"))
    else:
        got = outcome_of(lambda: stream.fork("c3", branch="exp"))
    assert wire.fired()
    again = wire.stream()
    names = sorted(c.name for c in again.checkpoints())
    if op == "checkpoint":
        assert names == (["c3", "c4"] if not isinstance(got, Exception) else names)
        assert len(again.table.metadata.snapshots) <= before + 1
        assert isinstance(got, Exception) or again.checkpoints()[-1].snapshot_id == got.snapshot_id
    elif op == "release":
        assert names == [] or isinstance(got, Exception)
    else:
        if not isinstance(got, Exception):
            assert again.table.metadata.refs["exp"].snapshot_id == got.snapshot_id
            again.producer("q", branch="exp").commit(batch("q", 0, WORLD))
            assert again.head_step(branch="exp") == 4
    publish(again, "p", 6)
    check(again, {"p": 6})
    assert orphans(again) == []


@pytest.mark.parametrize("lose", ["reply"])
def test_a_repair_whose_exchange_is_lost_rolls_back_once(wire: Wire, lose: str) -> None:
    stream = wire.create()
    publish(stream, "p", 3)
    foreign_append(stream)
    wire.lose(lose)
    got = outcome_of(lambda: stream.repair())
    assert wire.fired()
    if not isinstance(got, Exception):  # the rollback it made, reported: not "nothing to repair"
        assert (len(got.foreign), got.step, got.rolled_back_to is not None) == (1, 3, True), got
        assert got.changes and got.changes[0].startswith("append"), got
    again = wire.stream()
    publish(again, "p", 5)
    check(again, {"p": 5})


@pytest.mark.parametrize("statement", [rb"INSERT INTO lakestream_staged_intents"])
@pytest.mark.parametrize("lose", ["reply"])
def test_a_staged_intent_whose_statement_exchange_is_lost_is_staged_and_removed_once(
        pg_wire: Wire, lose: str, statement: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL's intent table: the INSERT that stages a batch, or the DELETE that removes it once published, whose
    reply (or request) is lost on the direct connection."""
    import re

    wire = pg_wire
    stream = wire.create()
    publish(stream, "p", 1)
    producer = stream.producer("p")
    producer.next_seq  # noqa: B018 - the head read once
    monkeypatch.setattr(producer, "_contended", lambda: True)  # stages its batch, then commits the group at once
    monkeypatch.setattr(producer._loop.policy, "hold_delay", lambda **_kw: 0.0)  # noqa: SLF001
    wire.line.arm(re.compile(statement), lose=lose)
    got = outcome_of(lambda: producer.commit(batch("p", 1, WORLD), seq=1))
    assert wire.fired()
    assert isinstance(got, Exception) or (got.step, got.seq) == (2, 1)
    monkeypatch.undo()
    again = wire.stream()
    assert again.staging.pending("main", max_age_s=3600) == []  # no intent left behind
    publish(again, "p", 3)
    check(again, {"p": 3})
    assert orphans(again) == []


def test_a_rest_commit_that_times_out_after_the_server_applied_it_publishes_once(rest_wire: Wire) -> None:
    """The REST catalog applies the commit and its answer never comes: the client's read times out
    (``rest.client.socket-timeout-ms``), an unknown outcome, reconciled from the table."""
    stream = rest_wire.create()
    publish(stream, "p", 1)
    producer = stream.producer("p")
    rest_wire.line.arm(REST_COMMIT, lose="silence")
    got = outcome_of(lambda: producer.commit(batch("p", 1, WORLD), seq=1))
    assert rest_wire.fired()
    assert isinstance(got, Exception) or (got.step, got.seq) == (2, 1)
    stream.checkpoint("c2", step=2)
    rest_wire.line.arm(REST_COMMIT, lose="silence")
    made = outcome_of(lambda: stream.checkpoint("c1", step=1))
    assert isinstance(made, Exception) or made.step == 1
    again = rest_wire.stream()
    assert sorted(c.name for c in again.checkpoints()) == ["c1", "c2"]
    publish(again, "p", 3)
    check(again, {"p": 3})
