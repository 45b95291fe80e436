"""Integers written as text (table properties, snapshot summary values, staged intents' fields, file names) are read as
Iceberg's Java engines read them: Python's ``int()`` took ``" 5"``, ``"5 "``, ``"5_000"`` and ``"٥"`` (an
Arabic-Indic five), which Spark and Trino refuse in a property (``Integer.parseInt``), and values past an int's or a
long's range; a value read back from storage was taken for a number nobody wrote."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.table.snapshots import Operation, Snapshot, Summary

from lakestream_iceberg import Stream
from lakestream_iceberg.connect.integers import INT32_MAX, INT64_MAX
from lakestream_iceberg.errors import ConfigError, CorruptStateError
from lakestream_iceberg.format.lineage import changes_data
from lakestream_iceberg.format.manifest_facts import manifest_level
from lakestream_iceberg.format.properties import (
    MIN_SNAPSHOTS_TO_KEEP,
    PARQUET_DICT_SIZE,
    PARQUET_LEVEL,
    PARQUET_PAGE_ROWS,
    PARQUET_PAGE_SIZE,
    PREVIOUS_VERSIONS_MAX,
    PROPERTIES,
    RETAIN_LAST,
    IntProperty,
)
from lakestream_iceberg.format.summary import StreamState
from lakestream_iceberg.read.history_rows import parse_data_path, snapshot_rows
from lakestream_iceberg.write.intent import Intent
from tests.support import SCHEMA, batch, shard, sqlite_catalog

WORLD = 2
INTS = [p for p in PROPERTIES if isinstance(p, IntProperty)]
ARABIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")


def good(prop: IntProperty) -> str:
    return str(prop.default if prop.default is not None else max(prop.minimum or 1, 1))


def python_only(prop: IntProperty) -> list[str]:
    """Spellings of a good value that Python's int() reads and Java's Integer.parseInt refuses."""
    value = good(prop)
    return [f" {value}", f"{value} ", f"{value}\n", f"{value}_0", value.translate(ARABIC)]


@pytest.mark.parametrize("prop", INTS, ids=lambda p: p.key)
def test_an_integer_property_is_read_as_iceberg_reads_it(prop: IntProperty) -> None:
    value = good(prop)
    assert prop.get({prop.key: value}) == int(value)
    assert prop.get({prop.key: "+" + value}) == int(value)  # Java's parseInt takes a leading '+' and zeros
    assert prop.get({prop.key: "00" + value}) == int(value)
    for raw in python_only(prop):
        with pytest.raises(ConfigError, match=re.escape(f"{prop.key}={raw!r} is not an integer")) as err:
            prop.get({prop.key: raw})
        assert "ASCII digits" in str(err.value) and "set_properties" in str(err.value)  # what to set, and how


@pytest.mark.parametrize("prop", [MIN_SNAPSHOTS_TO_KEEP, PREVIOUS_VERSIONS_MAX, PARQUET_LEVEL, PARQUET_PAGE_SIZE,
                                  PARQUET_DICT_SIZE, PARQUET_PAGE_ROWS], ids=lambda p: p.key)
def test_an_iceberg_int_property_is_refused_past_an_int(prop: IntProperty) -> None:
    """Iceberg reads these with Integer.parseInt: 2147483648 failed Spark's writes and was taken by lakestream."""
    assert prop.get({prop.key: str(INT32_MAX)}) == INT32_MAX
    with pytest.raises(ConfigError, match=re.escape(prop.key)):
        prop.get({prop.key: str(INT32_MAX + 1)})


def test_a_long_property_is_refused_past_a_long() -> None:
    assert RETAIN_LAST.get({RETAIN_LAST.key: str(INT64_MAX)}) == INT64_MAX
    with pytest.raises(ConfigError, match=re.escape(RETAIN_LAST.key)):
        RETAIN_LAST.get({RETAIN_LAST.key: str(INT64_MAX + 1)})
    with pytest.raises(ConfigError, match=re.escape(RETAIN_LAST.key)):
        RETAIN_LAST.check(INT64_MAX + 1)  # a Python value that would be written as one


@pytest.mark.parametrize("raw", [" 64", "6_4", "٦٤"])
def test_a_stream_is_neither_created_nor_opened_with_a_property_spark_cannot_read(tmp_path: Path, raw: str) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    key = RETAIN_LAST.key
    with pytest.raises(ConfigError, match=re.escape(f"{key}={raw!r}")):
        Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD, properties={key: raw})
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    with stream.table.transaction() as tx:  # another engine (pyiceberg here) stores it as it is
        tx.set_properties({key: raw})
    with pytest.raises(ConfigError, match=re.escape(f"{key}={raw!r}")):
        Stream.open(catalog, "ns.stream")


@pytest.mark.parametrize("raw", [" 5", "5 ", "5_0", "٥", "+5", str(INT64_MAX + 1), "9" * 19])
def test_a_summary_value_lakestream_never_writes_is_corrupt_state(raw: str) -> None:
    """The 19-digit values past a long were read as steps; the others were refused already, and still are."""
    summary = {"lakestream.step": raw, "lakestream.producers": "{}"}
    with pytest.raises(CorruptStateError, match=re.escape(f"lakestream.step={raw!r}")):
        StreamState.parse(summary, snapshot_id=7)
    summary = {"lakestream.step": "4", "lakestream.producers": "{}", "lakestream.seq": raw}
    with pytest.raises(CorruptStateError, match=re.escape(f"lakestream.seq={raw!r}")):
        StreamState.parse(summary, snapshot_id=7)
    assert StreamState.parse({"lakestream.step": str(INT64_MAX), "lakestream.producers": "{}"}).step == INT64_MAX


def intent_body(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    written = stream.writer.write(producer="c", seq=0, shards=batch("c", 0, WORLD))
    path = f"{stream.staging.folder('main')}/c@{0:012d}-{written.token}.parquet"
    intent = Intent(path=path, branch="main", batch=written, allow_gap=False, staged_at=time.time(),
                    table_uuid=str(stream.table.metadata.table_uuid))
    stream.close()
    return path, json.loads(intent.to_json())


def test_a_staged_intent_field_is_read_as_lakestream_writes_it(tmp_path: Path) -> None:
    """A column statistic keyed "٥" (str.isdecimal() is true for it) was read as field 5's; a seq past a long was taken
    and published into a summary no engine reads back."""
    path, body = intent_body(tmp_path)
    assert Intent.from_json(path, json.dumps(body)).batch.seq == 0
    sizes = body["files"][0]["column_sizes"]
    for key in ("٥", "+5", " 5", "5_0"):
        changed = json.loads(json.dumps(body))
        changed["files"][0]["column_sizes"] = {key: 1, **sizes}
        with pytest.raises(ValueError, match="field id"):
            Intent.from_json(path, json.dumps(changed))
    changed = json.loads(json.dumps(body))
    changed["seq"] = INT64_MAX + 1
    with pytest.raises(ValueError, match="seq"):
        Intent.from_json(path, json.dumps(changed))


def test_names_with_other_digits_are_not_lakestream_names() -> None:
    """Python's \\d took "٥" for a seq, a rank or a manifest's merge level in a file name."""
    assert parse_data_path("s3://b/t/data/p/000000000005-tok-r00001.parquet") == ("p", 5, 1)
    assert parse_data_path("s3://b/t/data/p/٥-tok-r00001.parquet") is None
    assert parse_data_path("s3://b/t/data/p/5-tok-r١.parquet") is None
    assert parse_data_path(f"s3://b/t/data/p/5-tok-r{INT32_MAX + 1}.parquet") is None  # no rank: a rank is an int
    assert manifest_level("s3://b/t/metadata/x-L3-m0.avro") == 3
    assert manifest_level("s3://b/t/metadata/x-L٣-m0.avro") == 0


def foreign(**counts: str) -> Snapshot:
    return Snapshot(snapshot_id=9, parent_snapshot_id=8, sequence_number=9, timestamp_ms=1, manifest_list="m",
                    summary=Summary(Operation.OVERWRITE, **counts))


def test_a_foreign_count_no_engine_reads_is_a_change() -> None:
    """A foreign snapshot that records "added-data-files": " 0" was taken for one that changes no data (its steps read
    through it); "00" is Java's zero too."""
    assert not changes_data(foreign(**{"added-data-files": "0", "deleted-data-files": "00"}))
    assert changes_data(foreign(**{"added-data-files": " 0"}))
    assert changes_data(foreign(**{"added-data-files": "0", "deleted-records": "0_0"}))


def test_history_shows_no_number_for_a_summary_value_no_engine_reads(tmp_path: Path) -> None:
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    stream.producer("p").commit(batch("p", 0, WORLD), seq=0)
    table = stream.refresh().table
    table.manage_snapshots().create_branch(table.metadata.current_snapshot().snapshot_id, "b").commit()
    rows = shard("p", 1, 0, rows=1)
    rows = rows.append_column("_step", pa.array([2], pa.int64())).append_column("_rank", pa.array([0], pa.int32()))
    table.append(rows, branch="b", snapshot_properties={"lakestream.step": "٥", "lakestream.seq": " 3"})
    rows = snapshot_rows(stream.refresh(), branch="b")
    assert [(r["step"], r["seq"]) for r in rows] == [(1, 0), (None, None)]


@pytest.mark.parametrize("total", [" 5", "5_0", "٥"])
def test_a_parent_total_no_engine_reads_is_not_carried(tmp_path: Path, total: str) -> None:
    """pyiceberg's summary update reads a foreign parent's totals with int(): " 5" was carried on as 5 (and so on
    in every later snapshot); such a total is dropped, as one that is no integer at all was already."""
    from lakestream_iceberg.format.snapshots import SnapshotBuilder

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    builder = SnapshotBuilder(stream.table.metadata)
    parent = Snapshot(snapshot_id=9, sequence_number=1, timestamp_ms=1, manifest_list="m",
                      summary=Summary(Operation.APPEND, **{"total-records": total, "total-data-files": "2"}))
    snapshot_id, sequence_number = builder.next_ids()
    made = builder.snapshot(snapshot_id=snapshot_id, sequence_number=sequence_number, parent=parent, manifest_list="n",
                            operation=Operation.APPEND, properties={})
    assert made.summary is not None
    assert not [k for k in made.summary.additional_properties if k.startswith("total-")]
    ok = Snapshot(snapshot_id=9, sequence_number=1, timestamp_ms=1, manifest_list="m",
                  summary=Summary(Operation.APPEND, **{"total-records": "5", "total-data-files": "2"}))
    snapshot_id, sequence_number = builder.next_ids()
    made = builder.snapshot(snapshot_id=snapshot_id, sequence_number=sequence_number, parent=ok, manifest_list="n",
                            operation=Operation.APPEND, properties={})
    assert made.summary is not None and made.summary.additional_properties["total-records"] == "5"


def edit_head_summary(tmp_path: Path, stream: Stream, values: dict[str, str]) -> None:
    """The head snapshot's summary as another tool could leave it: the same metadata with ``values`` in the head's
    summary, swapped in the SQLite catalog."""
    import sqlite3

    old = stream.refresh().table.metadata_location
    metadata = json.loads(Path(old.removeprefix("file://")).read_text())
    for snapshot in metadata["snapshots"]:
        if snapshot["snapshot-id"] == metadata["current-snapshot-id"]:
            snapshot["summary"].update(values)
    new = old.replace(".metadata.json", "-edited.metadata.json")
    Path(new.removeprefix("file://")).write_text(json.dumps(metadata))
    with sqlite3.connect(tmp_path / "catalog.db") as db:
        db.execute("UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ?", (new, old))


def test_status_shows_no_total_for_one_no_engine_reads(tmp_path: Path) -> None:
    """``lakestream status`` showed a head's "total-records": " 40" as 40 records (Spark's Long.parseLong refuses it)."""
    from lakestream_iceberg.tools.commands import status_dict

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD)
    stream.producer("p").commit(batch("p", 0, WORLD), seq=0)
    records = status_dict(stream, "main")["storage"]["records"]
    assert isinstance(records, int) and records > 0
    edit_head_summary(tmp_path, stream, {"total-records": f" {records}", "total-data-files": "٢"})
    storage = status_dict(stream, "main")["storage"]
    assert (storage["records"], storage["data_files"]) == (None, None) and storage["bytes"] is not None
