"""What a read does with table state it did not expect: data files, manifest entries and arguments are input too.

Every case ends in an error from the project's hierarchy that names what is wrong, never in another rank's rows or in a
bare Arrow / Python error."""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.manifest import ManifestEntry
from pyiceberg.typedef import Record

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import ConfigError, CorruptStateError, LifecycleError, StepError
from lakestream_iceberg.read.follow import consumer_lag
from tests.support import SCHEMA, lakestream_keys, shard, sqlite_catalog

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


def with_entries(stream: Stream, change: Callable[[list[ManifestEntry]], list[ManifestEntry]]) -> Stream:
    """A fresh handle on ``stream`` whose manifests list ``change(entries)``: what a manifest another engine wrote may
    hold. The process-wide manifest cache is where every handle reads entries from, so the handle reads them as if
    they were in the file (the files themselves are immutable and stay as lakestream wrote them)."""
    head = stream.refresh().table.metadata.snapshot_by_name("main")
    for manifest in stream.cache.manifests(stream.io, head):
        entries = [copy.deepcopy(e) for e in stream.cache.entries(stream.io, manifest)]
        stream.cache.remember_entries(manifest.manifest_path, change(entries))
    return Stream.open(stream.table.catalog, "ns.stream")


def _edit(step: int, rank: int, edit: Callable[[ManifestEntry], ManifestEntry | None]) -> Callable:
    def change(entries: list[ManifestEntry]) -> list[ManifestEntry]:
        out = []
        for e in entries:
            if list(e.data_file.partition) == [step, rank]:
                e = edit(e)
            if e is not None:
                out.append(e)
        return out
    return change


def _partition(*values: object) -> Callable[[ManifestEntry], ManifestEntry]:
    def edit(entry: ManifestEntry) -> ManifestEntry:
        entry.data_file[3] = Record(*values)  # DataFile's partition slot
        return entry
    return edit


@pytest.mark.parametrize("damage", ["middle rank missing", "last rank missing", "rank listed twice", "rank is a string",
                                    "rank is null", "step is null"])
def test_a_per_rank_step_whose_rank_files_do_not_match_is_refused_never_read_as_another_rank(
        tmp_path: Path, damage: str) -> None:
    stream = stream_with_steps(tmp_path)
    change = {
        "middle rank missing": _edit(2, 1, lambda e: None),
        "last rank missing": _edit(2, 2, lambda e: None),
        "rank listed twice": _edit(2, 2, _partition(2, 0)),
        "rank is a string": _edit(2, 1, _partition(2, "1")),
        "rank is null": _edit(2, 1, _partition(2, None)),
        "step is null": _edit(2, 1, _partition(None, 1)),
    }[damage]
    damaged = with_entries(stream, change)
    for rank in range(WORLD):
        with pytest.raises(CorruptStateError, match="not one file per rank"):
            damaged.read(2, rank=rank)
    assert damaged.read(1, rank=1).column("rank").to_pylist() == [1] * 5  # the other step still reads


def test_entries_another_engine_added_at_step_0_do_not_stop_commits_or_gc(tmp_path: Path) -> None:
    """No step lookup asks for step 0, so a row appended with pyiceberg's own API at ``_step=0`` is no step's file:
    merges carry it and GC drops it, as before the read checks (found in a review: the check first sat in the manifest
    cache that commits and GC use too)."""
    stream = stream_with_steps(tmp_path, steps=1)
    table = stream.table.catalog.load_table("ns.stream")
    head = table.metadata.snapshot_by_name("main")
    props = lakestream_keys(head)
    rows = shard("x", 0, 0, rows=1)
    table.append(rows.append_column("_step", pa.array([0], pa.int64())).append_column("_rank", pa.array([0], pa.int32())),
                 snapshot_properties=props)
    stream.refresh()
    producer = stream.producer("a")
    for seq in range(1, 40):  # enough commits that the manifests holding the foreign entry are merged
        producer.commit([shard("a", seq, r, rows=2) for r in range(WORLD)])
    assert stream.read(3, rank=1).num_rows == 2
    stream.checkpoint("c", step=30)
    stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert stream.read(35, rank=0).num_rows == 2


def test_a_damaged_or_replaced_data_file_raises_corrupt_state(tmp_path: Path) -> None:
    stream = stream_with_steps(tmp_path)
    files = stream.locate(2)
    size = files[0].file_size_in_bytes
    local(files[0].file_path).write_bytes(b"not parquet at all")
    with pytest.raises(CorruptStateError, match=f"holds 18 bytes, its manifest entry says {size}: it was damaged"):
        stream.read(2, rank=0)
    local(files[0].file_path).write_bytes(b"x" * (size + 100))
    with pytest.raises(CorruptStateError, match=f"holds more than {size} bytes, its manifest entry says {size}"):
        stream.read(2, rank=0)
    local(files[0].file_path).write_bytes(b"x" * size)  # the size the manifest says, but not Parquet
    with pytest.raises(CorruptStateError, match="cannot be read as the stream's data"):
        stream.read(2, rank=0)
    # a valid Parquet file of the right schema and size, but with other rows than the manifest entry declares
    wrong_count = with_entries(stream, _edit(2, 1, _record_count(7)))
    with pytest.raises(CorruptStateError, match="holds 5 rows, its manifest entry says 7"):
        wrong_count.read(2, rank=1)
    assert stream.read(2, rank=2).column("rank").to_pylist() == [2] * 6  # the undamaged rank still reads


def _record_count(value: int) -> Callable[[ManifestEntry], ManifestEntry]:
    def edit(entry: ManifestEntry) -> ManifestEntry:
        entry.data_file[4] = value  # DataFile's record_count slot
        return entry
    return edit


def test_a_damaged_packed_file_raises_corrupt_state(tmp_path: Path) -> None:
    stream = stream_with_steps(tmp_path, **{"lakestream.layout": "packed"})
    [packed] = stream.locate(2)
    local(packed.file_path).write_bytes(b"garbage" * 10)
    with pytest.raises(CorruptStateError, match=f"holds 70 bytes, its manifest entry says {packed.file_size_in_bytes}"):
        stream.read(2, rank=0)
    local(packed.file_path).write_bytes(b"g" * packed.file_size_in_bytes)
    with pytest.raises(CorruptStateError, match="not a Parquet file"):
        stream.read(2, rank=0)


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


def test_a_packed_file_with_damaged_row_data_is_a_corrupt_state_error(tmp_path: Path) -> None:
    """The footer parses (so the rank table checks pass) but the column data does not decode."""
    stream = stream_with_steps(tmp_path, **{"lakestream.layout": "packed"})
    [packed] = stream.locate(2)
    path = local(packed.file_path)
    raw = bytearray(path.read_bytes())
    footer = int.from_bytes(raw[-8:-4], "little")
    for i in range(4, len(raw) - footer - 8):  # scribble over every data page, keep the footer intact
        raw[i] = 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptStateError, match="do not decode"):
        stream.read(2, rank=1)


def test_columns_may_be_any_iterable_of_names_but_not_one_twice(tmp_path: Path) -> None:
    stream = stream_with_steps(tmp_path)
    assert stream.read(1, rank=0, columns=("i", "rank")).column_names == ["i", "rank"]
    assert stream.read(1, rank=0, columns=iter(["rank"])).column_names == ["rank"]
    with pytest.raises(ConfigError, match="more than once"):
        stream.read(1, rank=0, columns=["rank", "rank"])
