"""What the Spark interop tests share: streams with frequent manifest merges and group commits, and the rows that Spark
and lakestream return, in one comparable shape."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyiceberg.catalog.sql import SqlCatalog

from lakestream_iceberg import CommitResult, Producer, Stream
from lakestream_iceberg.format.lineage import is_lakestream
from lakestream_iceberg.format.summary import StreamState
from lakestream_iceberg.write.planner import STAGING_SCAN_S
from tests.support import SCHEMA

IDENTIFIER = "ns.stream"
WORLD = 2
ROWS = 3  # rows per shard: every (step, rank) holds rows, so a step Spark skips or repeats always shows
PAYLOAD = SCHEMA.names


@dataclass
class Lake:
    """A fresh SQLite catalog with a local warehouse, open in pyiceberg and in Spark under the same name."""

    name: str
    root: Path
    catalog: SqlCatalog
    spark: Any

    def table(self, identifier: str = IDENTIFIER) -> str:
        """Spark's name of a table of this catalog (by default the stream's)."""
        return f"{self.name}.{identifier}"

    def sql(self, query: str) -> list[Any]:
        return self.spark.sql(query).collect()


Key = tuple[int, int]  # (step, rank)
Rows = dict[Key, list[tuple[Any, ...]]]


def shards(producer: str, seq: int, world_size: int = WORLD) -> list[pa.Table]:
    """A global batch whose rows name their producer, seq and rank; ``ROWS`` rows per rank."""
    out = []
    for rank in range(world_size):
        rng = random.Random(f"{producer}/{seq}/{rank}")
        out.append(pa.table({
            "producer": [producer] * ROWS, "seq": [seq] * ROWS, "rank": [rank] * ROWS, "i": list(range(ROWS)),
            "tokens": [[rng.randint(0, 50_000) for _ in range(rng.randint(0, 8))] for _ in range(ROWS)],
            "image": [rng.randbytes(rng.randint(0, 64)) for _ in range(ROWS)],
        }, schema=SCHEMA))
    return out


def create(lake: Lake, *, fanout: int = 2, **properties: str) -> Stream:
    """A stream whose every other commit merges manifests (``merge-fanout`` 2 by default)."""
    props = {"lakestream.manifest.merge-fanout": str(fanout), **properties}
    return Stream.create(lake.catalog, IDENTIFIER, schema=SCHEMA, world_size=WORLD, properties=props)


@dataclass
class Writers:
    """Producers ``a`` and ``b`` taking turns, and ``c``, whose batches only ever reach the table in a group commit."""

    stream: Stream
    producers: dict[str, Producer] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    published: dict[int, tuple[str, int]] = field(default_factory=dict)  # step -> (producer, seq)

    def commit(self, producer: str) -> CommitResult:
        if producer not in self.producers:
            self.producers[producer] = self.stream.producer(producer)
        seq = self.seqs.get(producer, 0)
        result = self.producers[producer].commit(shards(producer, seq), seq=seq)
        assert not result.duplicate and result.step == self.stream.head_step(), result
        self.seqs[producer] = seq + 1
        self.published[result.step] = (producer, seq)
        return result

    def group(self) -> list[int]:
        """One group commit: ``c`` stages its batch, as a producer that lost a swap does, and ``b``'s commit publishes
        both, each as its own snapshot. Returns the two steps (c's, then b's)."""
        assert "a" in self.producers and "b" in self.producers, "group commit starts once a and b both committed"
        seq = self.seqs.get("c", 0)
        staged = self.stream.writer.write(producer="c", seq=seq, shards=shards("c", seq))
        self.stream.staging.stage(branch="main", batch=staged, allow_gap=False)
        time.sleep(STAGING_SCAN_S)  # a producer committing as if alone lists staged batches at most this often
        head = self.stream.head_step()
        result = self.commit("b")
        assert result.step == head + 2, "b's commit did not publish c's staged batch with its own"
        assert StreamState.of(self.stream.refresh().head()).group == 2
        self.seqs["c"] = seq + 1
        self.published[head + 1] = ("c", seq)
        return [head + 1, head + 2]

    def rounds(self, n: int) -> None:
        """``n`` rounds of: a alone, b alone, then a group of c and b (four steps a round)."""
        for _ in range(n):
            self.commit("a")
            self.commit("b")
            self.group()


def norm(value: Any) -> Any:
    """Spark's and Arrow's Python values in one shape (bytearray and bytes, lists and tuples)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return tuple(norm(v) for v in value)
    return value


def spark_rows(rows: Iterable[Any]) -> Rows:
    """Spark rows (with ``_step`` and ``_rank``) as (step, rank) -> payload tuples, sorted."""
    out: Rows = {}
    for row in rows:
        d = row.asDict()
        out.setdefault((d["_step"], d["_rank"]), []).append(tuple(norm(d[c]) for c in PAYLOAD))
    for key in out:
        out[key].sort()
    return out


def lakestream_rows(stream: Stream, steps: Iterable[int], *, branch: str = "main") -> Rows:
    """What lakestream's reader returns for every rank of ``steps`` (of ``branch``), in the same shape."""
    out: Rows = {}
    for step in steps:
        for rank in range(stream.world_size):
            table = stream.read(step, rank=rank, branch=branch)
            assert table.schema.equals(SCHEMA), table.schema
            out[(step, rank)] = sorted(tuple(norm(r[c]) for c in PAYLOAD) for r in table.to_pylist())
    return out


def expected_rows(published: dict[int, tuple[str, int]], steps: Iterable[int] | None = None) -> Rows:
    """The rows each (step, rank) must hold: the batch its producer committed."""
    out: Rows = {}
    for step in published if steps is None else steps:
        producer, seq = published[step]
        for rank, table in enumerate(shards(producer, seq)):
            out[(step, rank)] = sorted(tuple(norm(r[c]) for c in PAYLOAD) for r in table.to_pylist())
    return out


def incremental(lake: Lake, start: int, end: int) -> Rows:
    """Iceberg's incremental append read: the files of the snapshots after ``start`` up to ``end``."""
    reader = lake.spark.read.format("iceberg").option("start-snapshot-id", str(start)).option("end-snapshot-id", str(end))
    return spark_rows(reader.load(lake.table()).collect())


def snapshot_of_step(stream: Stream, step: int) -> int:
    """The id of the snapshot that published ``step`` on main (found along the head's ancestry)."""
    metadata = stream.refresh().table.metadata
    snap = metadata.snapshot_by_name("main")
    while snap is not None:
        state = StreamState.of(snap)
        if state.step == step and state.op == "append":
            return snap.snapshot_id
        snap = metadata.snapshot_by_id(snap.parent_snapshot_id) if snap.parent_snapshot_id is not None else None
    raise AssertionError(f"no retained snapshot published step {step}")


def age_files(root: Path, seconds: float) -> int:
    """Make every file under ``root`` look ``seconds`` old (remove_orphan_files only deletes files past its cutoff)."""
    past = time.time() - seconds
    count = 0
    for folder, _, names in os.walk(root):
        for name in names:
            os.utime(os.path.join(folder, name), (past, past))
            count += 1
    return count


def foreign_snapshots(stream: Stream, branch: str = "main") -> list[int]:
    """The snapshots above the branch's newest lakestream snapshot (another engine's), newest first."""
    metadata = stream.refresh().table.metadata
    snap = metadata.snapshot_by_name(branch)
    out = []
    while snap is not None and not is_lakestream(snap):
        out.append(snap.snapshot_id)
        snap = metadata.snapshot_by_id(snap.parent_snapshot_id) if snap.parent_snapshot_id is not None else None
    return out


def assert_intact(lake: Lake, writers: Writers, *, head: int) -> None:
    """The stream after another engine touched it: ``head`` steps, each reading (in lakestream and in Spark) as its
    producer published it; a re-commit of every published (producer, seq) is a duplicate at its step; the next commit
    is step ``head + 1``."""
    stream = writers.stream
    assert stream.head_step() == head
    assert sorted(writers.published) == list(range(1, head + 1))
    expected = expected_rows(writers.published)
    assert lakestream_rows(stream, range(1, head + 1)) == expected
    assert spark_rows(lake.spark.table(lake.table()).collect()) == expected
    # c's batches reached the table through b's group commits, staged by this test in c's name: a producer of c made
    # now is their writer's restart (one made before them, still live, would be another live writer of c, refused)
    restart = stream.producer("c")
    for step, (producer, seq) in sorted(writers.published.items()):
        again = (restart if producer == "c" else writers.producers[producer]).commit(shards(producer, seq), seq=seq)
        assert (again.duplicate, again.step) == (True, step), (producer, seq, again)
    assert stream.head_step() == head
    assert writers.commit("a").step == head + 1
