"""What a read does with table state it did not expect: data files, manifest entries and arguments are input too.

Every case ends in an error from the project's hierarchy that names what is wrong, never in another rank's rows or in a
bare Arrow / Python error."""

from __future__ import annotations

import copy
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.typedef import Record

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import ConfigError, CorruptStateError, LifecycleError, StepError
from lakestream_iceberg.format.manifests import checked_entries
from lakestream_iceberg.read.follow import consumer_lag
from lakestream_iceberg.read.reader import StepFiles
from tests.support import SCHEMA, shard, sqlite_catalog

WORLD = 3


def stream_with_steps(tmp_path: Path, steps: int = 2, **props: str) -> Stream:
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD,
                           properties=props or None)
    producer = stream.producer("a")
    for seq in range(steps):
        producer.commit([shard("a", seq, r, rows=4 + r) for r in range(WORLD)])
    return stream


def local(path: str) -> Path:
    return Path(path.removeprefix("file://"))


def test_a_per_rank_step_missing_or_reordering_a_rank_file_is_refused_not_read_as_another_rank(tmp_path: Path) -> None:
    stream = stream_with_steps(tmp_path)
    files = stream.locate(2)
    with StepFiles(stream.io, files, world_size=WORLD, packed=False, schema=SCHEMA) as good:
        assert good.read(1).column("rank").to_pylist() == [1] * 5
    for wrong in ([files[0], files[2]], [files[1], files[0], files[2]], [files[0], files[1], files[1]], files + files[:1]):
        with pytest.raises(CorruptStateError, match="not one file per rank"):
            StepFiles(stream.io, wrong, world_size=WORLD, packed=False, schema=SCHEMA)


def test_a_damaged_or_replaced_data_file_raises_corrupt_state(tmp_path: Path) -> None:
    stream = stream_with_steps(tmp_path)
    files = stream.locate(2)
    local(files[0].file_path).write_bytes(b"not parquet at all")
    with pytest.raises(CorruptStateError, match="cannot be read as the stream's data"):
        stream.read(2, rank=0)
    # a valid Parquet file of the right schema, but with other rows than the manifest entry declares
    pq.write_table(shard("a", 1, 1, rows=2).append_column("_step", pa.array([2, 2], pa.int64())), local(files[1].file_path))
    with pytest.raises(CorruptStateError, match="holds 2 rows, its manifest entry says 5"):
        stream.read(2, rank=1)
    assert stream.read(2, rank=2).column("rank").to_pylist() == [2] * 6  # the undamaged rank still reads


def test_a_damaged_packed_file_raises_corrupt_state(tmp_path: Path) -> None:
    stream = stream_with_steps(tmp_path, **{"lakestream.layout": "packed"})
    [packed] = stream.locate(2)
    local(packed.file_path).write_bytes(b"garbage" * 10)
    with pytest.raises(CorruptStateError, match="not a Parquet file"):
        stream.read(2, rank=0)


@pytest.mark.parametrize("partition", [(None, 0), (2, None), ("2", 0), (0, 0), (2, -1), (True, 0), (2, 0, 1)])
def test_a_manifest_entry_with_a_foreign_partition_is_refused(tmp_path: Path, partition: tuple) -> None:
    stream = stream_with_steps(tmp_path, steps=1)
    head = stream.refresh().table.metadata.snapshot_by_name("main")
    [manifest] = stream.cache.manifests(stream.io, head)
    entries = stream.cache.entries(stream.io, manifest)
    assert checked_entries("m", entries) == entries
    bad = copy.deepcopy(entries[0])
    bad.data_file[3] = Record(*partition)  # what a manifest written by another engine may hold
    assert bad.data_file.partition == Record(*partition)
    with pytest.raises(CorruptStateError, match="not \\(_step >= 1, _rank >= 0\\)"):
        checked_entries("m", [entries[1], bad])


def test_read_arguments_are_checked_before_anything_is_read(tmp_path: Path) -> None:
    stream = stream_with_steps(tmp_path)
    for step in (True, "1", 0, 1.0):
        with pytest.raises(StepError):
            stream.locate(step)  # type: ignore[arg-type]
    for lag in (True, -1, "2"):
        with pytest.raises(StepError):
            consumer_lag(stream, lag)  # type: ignore[arg-type]
    assert consumer_lag(stream, 1) == 1
    for columns in (["nope"], "rank", [1]):
        with pytest.raises(ConfigError):
            stream.read(1, rank=0, columns=columns)  # type: ignore[arg-type]
    assert stream.read(1, rank=0, columns=["rank"]).column_names == ["rank"]


def test_collect_garbage_refuses_a_flag_that_is_not_a_bool_and_deletes_nothing(tmp_path: Path) -> None:
    stream = stream_with_steps(tmp_path, steps=3)
    before = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    for flags in ({"dry_run": None}, {"dry_run": 0}, {"dry_run": "no"}, {"allow_short_grace": 1}):
        with pytest.raises(LifecycleError, match="must be True or False"):
            stream.collect_garbage(keep_last=1, **flags)  # type: ignore[arg-type]
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == before
    assert stream.read(1, rank=0).num_rows == 4
