"""The light read of a branch head (write/peek.py): one read of the catalog pointer per light read."""

from __future__ import annotations

from pathlib import Path

import pytest

import lakestream_iceberg.connect.pointer as pointer
import lakestream_iceberg.write.peek as peek
from lakestream_iceberg import Stream
from lakestream_iceberg.write.peek import HeadPeek
from tests.support import SCHEMA, batch, sqlite_catalog

WORLD = 2


def test_a_light_read_reads_the_catalog_pointer_once_whether_or_not_the_head_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holding producer reads the head lightly on every move of the pointer; each read of the pointer is a catalog
    query (a busy core pays about 75 us for one), so the pointer it compared with the last light read is the one it
    reads the new head from."""
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    producer = stream.producer("p0")
    producer.commit(batch("p0", 0, WORLD))
    view = catalog.load_table("ns.stream")  # a holder's view: older than the head once the producer commits again
    reads: list[str | None] = []
    real = pointer.cached_probe

    def counting(table):  # type: ignore[no-untyped-def]
        probe = real(table)
        if probe is None:
            return None

        def read() -> str | None:
            reads.append(location := probe())
            return location
        return read

    monkeypatch.setattr(pointer, "cached_probe", counting)
    monkeypatch.setattr(peek, "cached_probe", counting)
    light = HeadPeek(table=view, branch="main")
    per_read = []
    for seq in (1, 2):
        producer.commit(batch("p0", seq, WORLD))  # the head moves
        before = len(reads)
        found = light.read()
        per_read.append(len(reads) - before)
        assert found is not None and found.state.step == seq + 1
        before = len(reads)
        assert light.read() is found  # not moved: the kept light read
        per_read.append(len(reads) - before)
    assert per_read == [1, 1, 1, 1]


def test_a_light_read_names_the_head_snapshot_as_a_full_read_does(tmp_path: Path) -> None:
    """Its snapshot id and sequence number: a producer whose first read of the table was a light one tells from them
    whether a later head still descends from it (a rollback by another engine)."""
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    producer = stream.producer("p0")
    producer.commit(batch("p0", 0, WORLD))
    view = catalog.load_table("ns.stream")
    light = HeadPeek(table=view, branch="main")
    for seq in (1, 2):  # the pointer has not moved since the view was loaded, then it has
        found = light.read()
        head = stream.refresh().table.metadata.snapshot_by_name("main")
        assert found is not None and head is not None and found.head == (head.snapshot_id, head.sequence_number)
        producer.commit(batch("p0", seq, WORLD))
