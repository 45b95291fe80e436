"""The TGB semantics on every catalog x storage combination, against real servers (see tests/backends.py).

Backends: SQLite + local warehouse, PostgreSQL + SeaweedFS S3, REST (SeaweedFS) + SeaweedFS S3, SQLite + moto S3.
Each test gets a fresh catalog (database / S3 prefix / namespace). Deselect with ``-m "not services"``.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lakestream_iceberg import SequenceError, Stream
from tests.backends import (
    BACKENDS,
    Backend,
    backend,
    moto_service,
    postgres_service,
    published,
    seaweedfs_service,
    spawn_worker,
)
from tests.support import SCHEMA, batch, digest, shard

__all__ = ["backend", "moto_service", "postgres_service", "seaweedfs_service"]  # fixtures used by name

pytestmark = pytest.mark.services

WORLD = 3


def create(backend: Backend, world_size: int = WORLD) -> Stream:
    return Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=world_size)


def test_commit_and_read_back_byte_for_byte_in_dense_step_order(backend: Backend) -> None:
    stream = create(backend)
    producers = {pid: stream.producer(pid) for pid in ("prep-a", "prep-b")}
    committed: dict[int, tuple[str, int]] = {}
    for i in range(6):  # interleaved producers: steps are dense and follow commit order
        pid = ("prep-a", "prep-b")[i % 2]
        seq = i // 2
        result = producers[pid].commit(batch(pid, seq, WORLD))
        assert (result.step, result.seq, result.duplicate) == (i + 1, seq, False)
        committed[result.step] = (pid, seq)
    # a reader with its own catalog connection sees the same steps, byte for byte
    reader = Stream.open(backend.catalog(), backend.identifier())
    assert reader.head_step() == 6
    assert published(reader) == committed
    for step, (pid, seq) in committed.items():
        expected = batch(pid, seq, WORLD)
        for rank in range(WORLD):
            got = reader.read(step, rank=rank)
            assert got.schema.equals(SCHEMA)
            assert digest(got) == digest(expected[rank]), (backend.kind, step, rank)
    assert reader.state().producers["prep-a"].seq == 2 and reader.state().producers["prep-b"].seq == 2


def test_duplicate_commit_is_published_exactly_once(backend: Backend) -> None:
    stream = create(backend)
    first = stream.producer("p").commit(batch("p", 0, WORLD))
    stream.producer("p").commit(batch("p", 1, WORLD))
    # a restarted producer (new catalog connection) re-sends seq 0 and 1: nothing new is published
    again = Stream.open(backend.catalog(), backend.identifier()).producer("p")
    assert again.next_seq == 2
    dup = again.commit(batch("p", 0, WORLD), seq=0)
    assert (dup.duplicate, dup.step, dup.snapshot_id) == (True, first.step, first.snapshot_id)
    assert again.commit(batch("p", 1, WORLD), seq=1).duplicate
    with pytest.raises(SequenceError):
        again.commit(batch("p", 5, WORLD), seq=5)
    assert stream.head_step() == 2
    assert published(stream) == {1: ("p", 0), 2: ("p", 1)}
    assert again.commit(batch("p", 2, WORLD)).step == 3


def test_targeted_read_opens_only_that_ranks_file(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = create(backend)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, WORLD))
    reader = Stream.open(backend.catalog(), backend.identifier())
    files = reader.locate(2)  # warms the manifest cache; the read below touches data files only
    assert [f.partition[1] for f in files] == list(range(WORLD))
    opened: list[str] = []
    io = reader.io
    original = io.new_input

    def spy(location: str):  # type: ignore[no-untyped-def]
        opened.append(location)
        return original(location)

    monkeypatch.setattr(io, "new_input", spy)
    got = reader.read(2, rank=1)
    assert opened == [files[1].file_path]
    assert digest(got) == digest(batch("p", 1, WORLD)[1])
    # the file is exactly that rank's shard, one row group, payload columns only
    with original(files[1].file_path).open() as handle:
        parquet = pq.ParquetFile(handle)
        assert parquet.num_row_groups == 1
        assert parquet.read().cast(SCHEMA).equals(batch("p", 1, WORLD)[1])
    assert files[1].record_count == batch("p", 1, WORLD)[1].num_rows


def test_packed_layout_reads_each_rank_from_its_row_groups_with_range_reads(backend: Backend,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One file per step on object storage too; a rank reads its rows through a seekable stream (footer + its row
    groups), not the whole file, and plain scans see ``_rank`` from the file."""
    world = 5

    def big(seq: int) -> list[pa.Table]:  # ~100 KiB of incompressible bytes per rank: the file is read by ranges
        rng = np.random.default_rng(seq)
        shards = [shard("p", seq, r, rows=4) for r in range(world)]
        images = [pa.array([rng.bytes(25_000) for _ in range(4)], pa.binary()) for _ in range(world)]
        return [s.set_column(s.schema.get_field_index("image"), "image", im) for s, im in zip(shards, images)]

    stream = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=world,
                           properties={"lakestream.layout": "packed", "lakestream.layout.packed.row-group-bytes": "1"})
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(big(seq))
    reader = Stream.open(backend.catalog(), backend.identifier())
    for rank in range(world):
        assert digest(reader.read(2, rank=rank)) == digest(big(1)[rank]), (backend.kind, rank)
    (data_file,) = reader.locate(2)
    fetched: list[int] = []
    original = reader.io.new_input

    class CountingStream:  # what the reader's Parquet decoder pulls from storage
        def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
            self._inner = inner

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            attr = getattr(self._inner, name)
            if name not in ("read", "read_at", "read_buffer", "readinto"):
                return attr

            def counted(*args):  # type: ignore[no-untyped-def]
                out = attr(*args)
                fetched.append(out if name == "readinto" else len(out))
                return out
            return counted

    class CountingInput:
        def __init__(self, location: str) -> None:
            self._input = original(location)

        def open(self, seekable: bool = True):  # type: ignore[no-untyped-def]
            return CountingStream(self._input.open(seekable=seekable))

    monkeypatch.setattr(reader.io, "new_input", CountingInput)
    assert digest(reader.read(2, rank=3)) == digest(big(1)[3])
    # the footer (pyarrow reads the last 64 KiB for it) and rank 3's row group: not the other ranks' 400 KiB
    assert 100_000 < sum(fetched) < data_file.file_size_in_bytes / 2, (backend.kind, fetched, data_file.file_size_in_bytes)
    monkeypatch.undo()
    full = backend.catalog().load_table(backend.identifier()).scan().to_arrow()
    assert full.num_rows == 3 * world * 4
    assert all((r["_step"], r["_rank"]) == (r["seq"] + 1, r["rank"]) for r in full.select(["_step", "_rank", "seq", "rank"]).to_pylist())


def test_plain_iceberg_scan_sees_step_and_rank(backend: Backend) -> None:
    stream = create(backend)
    for seq in range(4):
        stream.producer("p").commit(batch("p", seq, WORLD))
    table = backend.catalog().load_table(backend.identifier())
    full = table.scan().to_arrow()
    assert {"_step", "_rank", *SCHEMA.names} == set(full.column_names)
    rows = full.select(["_step", "_rank", "producer", "seq", "rank", "i"]).to_pylist()
    for row in rows:  # step s holds seq s-1; the partition columns agree with the payload
        assert (row["_step"], row["_rank"], row["producer"]) == (row["seq"] + 1, row["rank"], "p")
    expected = pa.concat_tables([batch("p", seq, WORLD)[r] for seq in range(4) for r in range(WORLD)])
    assert len(rows) == expected.num_rows
    got = full.select(SCHEMA.names).sort_by([("seq", "ascending"), ("rank", "ascending"), ("i", "ascending")])
    assert got.cast(SCHEMA).combine_chunks().equals(expected.combine_chunks())
    only_step_3 = table.scan(row_filter="_step == 3").to_arrow()
    assert set(only_step_3.column("_step").to_pylist()) <= {3}
    assert only_step_3.num_rows == sum(s.num_rows for s in batch("p", 2, WORLD))


# sqlite-local: tests/test_processes.py::test_eight_producer_processes_publish_dense_steps_exactly_once makes every
# assertion below on it with 8 producer processes of 25 batches (this test, 3 of 8, would repeat a subset of it)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "sqlite-local"], indirect=True)
def test_concurrent_producer_processes_publish_dense_steps_exactly_once(backend: Backend) -> None:
    world, procs_n, count = 2, 3, 8
    stream = create(backend, world_size=world)
    procs = [spawn_worker(backend, "commit", backend.identifier(), f"prep-{i}", str(count)) for i in range(procs_n)]
    reports = {}
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        reports[f"prep-{i}"] = [json.loads(line) for line in out.splitlines()]
    total = procs_n * count
    assert stream.head_step() == total
    steps = published(stream)
    assert sorted(steps) == list(range(1, total + 1))
    assert sorted(steps.values()) == sorted((f"prep-{i}", s) for i in range(procs_n) for s in range(count))
    # staged intents: rows of the catalog's database on SQL catalogs, files elsewhere; none left behind either way
    assert stream.staging.kind == ("storage" if backend.kind.startswith("rest") else "catalog")
    assert stream.staging.expire(older_than_s=-1.0, delete=False) == []
    for pid, lines in reports.items():  # what each producer was told matches the table
        assert [line["seq"] for line in lines] == list(range(count))
        assert all(steps[line["step"]] == (pid, line["seq"]) for line in lines)
        assert not any(line["dup"] for line in lines)
    # each producer's seqs are published in order; a sample of steps reads back byte for byte
    for pid in reports:
        order = [seq for _, (p, seq) in sorted(steps.items()) if p == pid]
        assert order == sorted(order)
    for step in (1, total // 2, total):
        pid, seq = steps[step]
        for rank in range(world):
            assert digest(stream.read(step, rank=rank)) == digest(batch(pid, seq, world)[rank])
    scanned = stream.table.catalog.load_table(backend.identifier()).scan(selected_fields=("producer", "seq", "_step")).to_arrow()
    for row in scanned.to_pylist():
        assert steps[row["_step"]] == (row["producer"], row["seq"])


def test_a_data_files_modification_time_is_read_from_the_store(backend: Backend) -> None:
    """A producer tells a batch whose snapshot expired by its data file's modification time (the follow rule of two
    live producers of one id): read through the table's FileIO from every store, None for a file that is not there."""
    from lakestream_iceberg.connect.storage import modified_at

    stream = create(backend)
    before = time.time()
    step = stream.producer("p").commit(batch("p", 0, WORLD)).step
    after = time.time()
    path = stream.locate(step)[0].file_path
    written = modified_at(stream.io, path)
    assert written is not None and int(before) - 1 <= written <= after + 1  # S3 keeps whole seconds
    assert modified_at(stream.io, path.replace(".parquet", "-missing.parquet")) is None
