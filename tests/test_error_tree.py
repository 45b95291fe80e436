"""The error tree is sealed: whatever a caller gets wrong through the public API, and whatever happened to the table
under it (dropped, never created), comes out as a LakestreamError subclass whose message says what to do; nothing of
pyiceberg, pyarrow or SQLAlchemy leaks, and nothing is published on the way."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pyarrow as pa
import pytest

import lakestream_iceberg as ls
from lakestream_iceberg import LakestreamError, Stream
from tests.support import SCHEMA, batch, sqlite_catalog

WORLD = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("error-tree")
    catalog = sqlite_catalog(str(root))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, WORLD), seq=seq)
    stream.checkpoint("ck", step=2)
    gone = Stream.create(catalog, "ns.gone", schema=SCHEMA, world_size=WORLD)
    gone.producer("p").commit(batch("p", 0, WORLD), seq=0)
    gone_producer = gone.producer("q")
    Stream.drop(sqlite_catalog(str(root)), "ns.gone")  # by another process: the handles above are stale
    return {"root": root, "catalog": catalog, "stream": stream, "producer": producer, "gone": gone,
            "gone_producer": gone_producer}


def _wrong_shards() -> list[pa.Table]:
    return [pa.table({"x": [1]})] * WORLD


CASES: list[tuple[str, Callable[[dict[str, Any]], object]]] = [
    ("create: identifier without a namespace", lambda w: Stream.create(w["catalog"], "nodot", schema=SCHEMA, world_size=2)),
    ("create: identifier not a string", lambda w: Stream.create(w["catalog"], 5, schema=SCHEMA, world_size=2)),
    ("create: empty payload schema", lambda w: Stream.create(w["catalog"], "ns.e1", schema=pa.schema([]), world_size=2)),
    ("create: schema not an Arrow schema", lambda w: Stream.create(w["catalog"], "ns.e2", schema={"a": 1}, world_size=2)),
    ("create: world size True", lambda w: Stream.create(w["catalog"], "ns.e3", schema=SCHEMA, world_size=True)),
    ("create: world size 0", lambda w: Stream.create(w["catalog"], "ns.e4", schema=SCHEMA, world_size=0)),
    ("create: world size a string", lambda w: Stream.create(w["catalog"], "ns.e5", schema=SCHEMA, world_size="2")),
    ("create: a reserved column", lambda w: Stream.create(w["catalog"], "ns.e6", schema=pa.schema([("_step", pa.int64())]),
                                                          world_size=2)),
    ("create: property not a string", lambda w: Stream.create(w["catalog"], "ns.e7", schema=SCHEMA, world_size=2,
                                                              properties={"lakestream.snapshots.retain-last": 5})),
    ("create: unknown layout", lambda w: Stream.create(w["catalog"], "ns.e8", schema=SCHEMA, world_size=2,
                                                       properties={"lakestream.layout": "zigzag"})),
    ("create: an existing stream of another world size",
     lambda w: Stream.create(w["catalog"], "ns.stream", schema=SCHEMA, world_size=3)),
    ("open: missing table", lambda w: Stream.open(w["catalog"], "ns.nope")),
    ("open: missing namespace", lambda w: Stream.open(w["catalog"], "nons.nope")),
    ("drop: missing table", lambda w: Stream.drop(w["catalog"], "ns.nope")),
    ("drop: purge not a bool", lambda w: Stream.drop(w["catalog"], "ns.stream", purge="yes")),
    ("producer: empty id", lambda w: w["stream"].producer("")),
    ("producer: id not a string", lambda w: w["stream"].producer(7)),
    ("producer: id with a slash", lambda w: w["stream"].producer("a/b")),
    ("producer: id with a trailing newline", lambda w: w["stream"].producer("p\n")),
    ("producer: a tag as branch", lambda w: w["stream"].producer("p", branch="ck")),
    ("producer: branch not a string", lambda w: w["stream"].producer("p", branch=5)),
    ("commit: too few shards", lambda w: w["producer"].commit([batch("p", 3, WORLD)[0]], seq=3)),
    ("commit: a table, not a list", lambda w: w["producer"].commit(batch("p", 3, WORLD)[0], seq=3)),
    ("commit: wrong columns", lambda w: w["producer"].commit(_wrong_shards(), seq=3)),
    ("commit: seq True", lambda w: w["producer"].commit(batch("p", 3, WORLD), seq=True)),
    ("commit: seq negative", lambda w: w["producer"].commit(batch("p", 3, WORLD), seq=-1)),
    ("commit: seq a string", lambda w: w["producer"].commit(batch("p", 3, WORLD), seq="3")),
    ("commit: a gap", lambda w: w["producer"].commit(batch("p", 9, WORLD), seq=9)),
    ("read: step 0", lambda w: w["stream"].read(0, rank=0)),
    ("read: step True", lambda w: w["stream"].read(True, rank=0)),
    ("read: step not published", lambda w: w["stream"].read(99, rank=0)),
    ("read: rank out of range", lambda w: w["stream"].read(1, rank=WORLD)),
    ("read: rank True", lambda w: w["stream"].read(1, rank=True)),
    ("read: unknown column", lambda w: w["stream"].read(1, rank=0, columns=["nope"])),
    ("read: missing branch", lambda w: w["stream"].read(1, rank=0, branch="nope")),
    ("wait_for: step not an integer", lambda w: w["stream"].wait_for("1", timeout=1)),
    ("wait_for: times out", lambda w: w["stream"].wait_for(99, timeout=0.01)),
    ("checkpoint: bad name", lambda w: w["stream"].checkpoint("a b", step=1)),
    ("checkpoint: step beyond the head", lambda w: w["stream"].checkpoint("ck9", step=99)),
    ("checkpoint: name taken", lambda w: w["stream"].checkpoint("ck", step=1)),
    ("release: unknown checkpoint", lambda w: w["stream"].release("nope")),
    ("fork: unknown checkpoint", lambda w: w["stream"].fork("nope", branch="b")),
    ("gc: keep_last negative", lambda w: w["stream"].collect_garbage(keep_last=-1)),
    ("gc: dry_run not a bool", lambda w: w["stream"].collect_garbage(dry_run="no")),
    ("gc: grace negative", lambda w: w["stream"].collect_garbage(grace=timedelta(seconds=-1))),
    ("gc: grace breaking the rule", lambda w: w["stream"].collect_garbage(dry_run=False, grace=timedelta(0))),
    ("history: missing branch", lambda w: w["stream"].history(branch="nope")),
    ("repair: missing branch", lambda w: w["stream"].repair(branch="nope")),
    ("repair: branch not a string", lambda w: w["stream"].repair(branch=5)),
    ("load_catalog: unknown type", lambda w: ls.load_catalog("x", type="no-such-type")),
    ("TensorCollate: unknown mode", lambda w: ls.TensorCollate(lists="zigzag")),
    ("dataset: rank beyond world size", lambda w: ls.LakestreamDataset(w["stream"], rank=4, world_size=2)),
    ("dataset: start step 0", lambda w: ls.LakestreamDataset(w["stream"], rank=0, world_size=2, start_step=0)),
    ("dataset: bad state", lambda w: ls.LakestreamDataset(w["stream"], rank=0, world_size=2).load_state_dict({"x": 1})),
    ("dropped: head_step", lambda w: w["gone"].head_step()),
    ("dropped: refresh", lambda w: w["gone"].refresh()),
    ("dropped: history", lambda w: w["gone"].history()),
    ("dropped: commit", lambda w: w["gone_producer"].commit(batch("q", 0, WORLD), seq=0)),
    ("dropped: wait_for", lambda w: w["gone"].wait_for(5, timeout=30)),
    ("dropped: checkpoint", lambda w: w["gone"].checkpoint("c", step=1)),
]


@pytest.mark.parametrize(("what", "call"), CASES, ids=[c[0] for c in CASES])
def test_only_lakestream_errors_come_out(world: dict[str, Any], what: str, call: Callable[[dict[str, Any]], object]) -> None:
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the point: whatever it is, it must be one of ours
        call(world)
    error = caught.value
    assert isinstance(error, LakestreamError), f"{what}: {type(error).__module__}.{type(error).__name__}: {error}"
    assert len(str(error)) >= 30, f"{what}: a message that says what to do, got {error!r}"


def test_nothing_was_published_by_the_bad_calls(world: dict[str, Any]) -> None:
    stream = world["stream"]
    assert stream.head_step() == 3
    assert {t.name for t in stream.checkpoints()} == {"ck"}
    assert sorted(stream.refresh().table.catalog.list_tables("ns")) == [("ns", "stream")]


def test_the_command_line_reports_mistakes_as_lakestream_errors() -> None:
    from lakestream_iceberg.tools.commands import UserError

    assert issubclass(UserError, LakestreamError)


def test_the_tree_in_the_docstring_names_every_error_class() -> None:
    import lakestream_iceberg.errors as errors

    names = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert all(f" {n}" in errors.__doc__ for n in names - {"LakestreamError"}), sorted(
        n for n in names if f" {n}" not in errors.__doc__)
    assert all(issubclass(getattr(errors, n), LakestreamError) for n in names)
