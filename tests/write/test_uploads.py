"""A commit's manifests and manifest lists on object storage are written concurrently, overlapping its metadata.json,
and all before the catalog's update; on a local file system inline. A failed write fails the attempt (retried when
transient) and publishes nothing."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyiceberg.io.pyarrow import PyArrowFile, PyArrowFileIO
from sqlalchemy import event

from lakestream_iceberg import Stream
from lakestream_iceberg.connect import swap as swap_module
from lakestream_iceberg.format import uploads as uploads_module
from lakestream_iceberg.format.manifest_cache import ManifestCache
from lakestream_iceberg.format.manifests import ManifestPlanner
from lakestream_iceberg.format.uploads import Uploads
from tests.backends import Backend, make_backend, moto_service  # noqa: F401 - the fixture, used by name
from tests.support import SCHEMA, batch, digest, sqlite_catalog


class _Refused(PyArrowFile):
    def create(self, overwrite: bool = False):  # type: ignore[no-untyped-def]
        raise ConnectionError("storage unreachable (injected)")


class _RefusingIO(PyArrowFileIO):
    """A real FileIO whose writes to ``*refused*`` paths fail (storage unreachable)."""

    def new_output(self, location: str):  # type: ignore[no-untyped-def]
        if "refused" in location:
            return _Refused(location, location, self.fs_by_scheme("file", None))
        return super().new_output(location)


def test_uploads_wait_for_every_write_and_raise_the_first_failure(tmp_path: Path) -> None:
    uploads = Uploads(_RefusingIO())
    paths = [f"{tmp_path}/f{i}.avro" for i in range(20)]
    for i, path in enumerate(paths):
        uploads.put(path, bytes([i]) * (i + 1))
    assert uploads.pending(paths[0])  # sent and not waited for, finished or not
    uploads.wait()
    assert [Path(p).read_bytes() for p in paths] == [bytes([i]) * (i + 1) for i in range(20)]
    assert not any(uploads.pending(p) for p in paths)

    refused = f"{tmp_path}/refused.avro"
    later = [f"{tmp_path}/g{i}.avro" for i in range(10)]
    uploads.put(refused, b"x")
    for path in later:
        uploads.put(path, b"y")
    while not all(Path(p).exists() for p in later):  # every write ran, the failed one included
        time.sleep(0.01)
    assert uploads.pending(refused)  # failed, but not waited for: a reader must wait() and get the failure
    with pytest.raises(ConnectionError, match="injected"):
        uploads.wait()
    assert all(Path(p).read_bytes() == b"y" for p in later)  # every other write finished before the failure was raised
    assert not Path(refused).exists()
    uploads.wait()  # nothing left to wait for


@pytest.fixture()
def s3(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    backend = make_backend("sqlite-moto", request, tmp_path)
    try:
        yield backend
    finally:
        backend.close()


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record (thread name, location) of every concurrent write, and still write."""
    sent: list[tuple[str, str]] = []
    real = uploads_module._put

    def put(io, location, data):  # type: ignore[no-untyped-def]
        sent.append((threading.current_thread().name, location))
        time.sleep(0.05)  # slower than the planning thread: a commit that did not wait would swap before the files exist
        real(io, location, data)

    monkeypatch.setattr(uploads_module, "_put", put)
    return sent


@pytest.mark.services
def test_manifests_and_lists_on_object_storage_are_written_on_pool_threads_before_the_catalog_update(
        s3: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _spy(monkeypatch)
    stream = Stream.create(s3.catalog(), s3.identifier(), schema=SCHEMA, world_size=2)
    engine = stream.table.catalog.engine  # type: ignore[attr-defined]
    io = stream.table.io
    checked: list[int] = []

    def before_update(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("UPDATE ICEBERG_TABLES"):  # the swap itself
            assert sent and all(io.new_input(location).exists() for _, location in sent)  # every file sent is written
            checked.append(len(sent))

    event.listen(engine, "before_cursor_execute", before_update)
    try:
        producer = stream.producer("p")
        for seq in range(3):
            assert producer.commit(batch("p", seq, 2)).step == seq + 1
    finally:
        event.remove(engine, "before_cursor_execute", before_update)
    assert len(checked) == 3 and all(name.startswith("lakestream-upload") for name, _ in sent)
    lists = {loc for _, loc in sent if "/snap-" in loc}
    head = stream.table.refresh().metadata
    listed = {s.manifest_list for s in head.snapshots}
    assert listed <= lists  # every snapshot's list went through the pool ...
    for snapshot in head.snapshots:  # ... and exists with every manifest it names
        for manifest in snapshot.manifests(io):
            assert io.new_input(manifest.manifest_path).exists()
    reopened = Stream.open(s3.catalog(), s3.identifier())
    for seq in range(3):
        for rank in range(2):
            assert digest(reopened.read(seq + 1, rank=rank)) == digest(batch("p", seq, 2)[rank])


@pytest.mark.services
def test_metadata_json_is_written_while_the_manifests_and_lists_are_in_flight(
        s3: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The swap writes metadata.json before it waits for the plan's manifests and lists, so on object storage their
    writes overlap (one round trip less per commit); the catalog's update still comes after all of them (above)."""
    stream = Stream.create(s3.catalog(), s3.identifier(), schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    producer.commit(batch("p", 0, 2))
    started = threading.Event()
    real_write = swap_module._write_metadata

    def write_metadata(metadata, output_file):  # type: ignore[no-untyped-def]
        started.set()
        real_write(metadata, output_file)

    real_put = uploads_module._put
    overlapped: list[bool] = []

    def put(io, location, data):  # type: ignore[no-untyped-def]
        overlapped.append(started.wait(timeout=60))  # held until metadata.json's write began (or a minute passed)
        real_put(io, location, data)

    monkeypatch.setattr(swap_module, "_write_metadata", write_metadata)
    monkeypatch.setattr(uploads_module, "_put", put)
    assert producer.commit(batch("p", 1, 2)).step == 2
    assert overlapped and all(overlapped)
    assert digest(Stream.open(s3.catalog(), s3.identifier()).read(2, rank=1)) == digest(batch("p", 1, 2)[1])


@pytest.mark.services
def test_a_failed_concurrent_write_fails_only_that_attempt(s3: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest list that cannot be written (storage unreachable for a moment) fails the planning attempt: nothing
    is swapped, the attempt is retried, and the step is published once."""
    stream = Stream.create(s3.catalog(), s3.identifier(), schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    producer.commit(batch("p", 0, 2))
    real = uploads_module._put
    refused: list[str] = []

    def put(io, location, data):  # type: ignore[no-untyped-def]
        if "/snap-" in location and not refused:
            refused.append(location)
            raise ConnectionError("storage unreachable (injected)")
        real(io, location, data)

    monkeypatch.setattr(uploads_module, "_put", put)
    result = producer.commit(batch("p", 1, 2))
    assert refused and result.step == 2 and result.attempts == 2
    head = stream.table.refresh().metadata
    assert refused[0] not in {s.manifest_list for s in head.snapshots}
    assert [int(s.summary["lakestream.step"]) for s in head.snapshots][-2:] == [1, 2]


@pytest.mark.services
def test_a_write_refused_for_good_fails_the_commit_and_publishes_nothing(s3: Backend,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write the store refuses for good (access denied) is not retried: the commit raises it, the catalog was not
    asked, and the same seq commits once the store accepts writes again."""
    stream = Stream.create(s3.catalog(), s3.identifier(), schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    producer.commit(batch("p", 0, 2))
    before = stream.table.refresh().metadata_location
    real = uploads_module._put
    refused: list[str] = []

    def put(io, location, data):  # type: ignore[no-untyped-def]
        if "/snap-" in location:
            refused.append(location)
            raise PermissionError("access denied (injected)")
        real(io, location, data)

    monkeypatch.setattr(uploads_module, "_put", put)
    with pytest.raises(PermissionError, match="injected") as raised:
        producer.commit(batch("p", 1, 2), seq=1)
    assert "_WritesFailed" not in "".join(traceback.format_exception(raised.value))  # the store's error, as it is
    assert len(refused) == 1  # not retried
    assert stream.table.refresh().metadata_location == before  # the catalog was not asked
    monkeypatch.setattr(uploads_module, "_put", real)
    result = producer.commit(batch("p", 1, 2), seq=1)
    assert result.step == 2 and not result.duplicate
    assert digest(Stream.open(s3.catalog(), s3.identifier()).read(2, rank=0)) == digest(batch("p", 1, 2)[0])


@pytest.mark.services
def test_a_merge_reading_back_a_manifest_of_its_own_plan_waits_for_its_write(
        s3: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest this plan wrote, whose entries are not cached (too large for the cache here), is read back by the
    merge that follows: only once its write finished, not as a missing file."""
    stream = Stream.create(s3.catalog(), s3.identifier(), schema=SCHEMA, world_size=2,
                           properties={"lakestream.layout": "per-rank"})
    stream.producer("p").commit(batch("p", 0, 2))
    metadata = stream.table.refresh().metadata
    files = stream.writer.write(producer="q", seq=0, shards=batch("q", 0, 2)).data_files(step=2, spec_id=0)
    _spy(monkeypatch)  # every write now takes 50 ms
    planner = ManifestPlanner(io=stream.io, metadata=metadata, cache=ManifestCache(max_entries=4), fanout=2)
    parent = planner.parent_manifests(metadata.snapshot_by_name("main"))
    with planner.concurrent_writes():
        added = planner.added(snapshot_id=99, sequence_number=metadata.next_sequence_number(), data_files=files)
        (merged,) = planner.merged([added, *parent], snapshot_id=99, sequence_number=metadata.next_sequence_number())
    planner.wait_written()  # what the swap does before anything names these files
    entries = merged.fetch_manifest_entry(stream.io)
    assert sorted(e.data_file.file_path for e in entries) == sorted(
        [f.file_path for f in files] + [e.data_file.file_path for m in parent for e in m.fetch_manifest_entry(stream.io)])


def test_a_local_warehouse_writes_inline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _spy(monkeypatch)
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=2)
    stream.producer("p").commit(batch("p", 0, 2))
    assert sent == []
    assert digest(stream.read(1, rank=0)) == digest(batch("p", 0, 2)[0])



def _fail_after_a_manifest(stream: Stream) -> tuple[ManifestCache, str]:
    """Plan a manifest on ``stream``'s head, then fail the attempt (a parent manifest GC just deleted, say)."""
    stream.producer("p").commit(batch("p", 0, 2))
    metadata = stream.table.refresh().metadata
    files = stream.writer.write(producer="q", seq=0, shards=batch("q", 0, 2)).data_files(step=2, spec_id=0)
    cache = ManifestCache()
    planner = ManifestPlanner(io=stream.io, metadata=metadata, cache=cache, fanout=2)
    with pytest.raises(FileNotFoundError, match="injected"):
        with planner.concurrent_writes():
            added = planner.added(snapshot_id=99, sequence_number=metadata.next_sequence_number(), data_files=files)
            assert added.manifest_path in cache.entries_cached()
            raise FileNotFoundError("a parent manifest is gone (injected)")
    return cache, added.manifest_path


def test_a_failed_plan_on_a_local_disk_forgets_the_manifest_entries_it_cached(tmp_path: Path) -> None:
    """No head will list the manifest of a failed planning attempt: its entries leave the shared cache."""
    cache, path = _fail_after_a_manifest(Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA,
                                                       world_size=2))
    assert path not in cache.entries_cached()


@pytest.mark.services
def test_a_failed_plan_on_object_storage_forgets_the_manifest_entries_it_cached(s3: Backend) -> None:
    cache, path = _fail_after_a_manifest(Stream.create(s3.catalog(), s3.identifier(), schema=SCHEMA, world_size=2))
    assert path not in cache.entries_cached()
