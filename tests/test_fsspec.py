"""Streams whose tables read and write through pyiceberg's ``FsspecFileIO`` (s3fs), configured as a user would
(``py-io-impl`` among the catalog's properties), against real S3 servers (moto, SeaweedFS).

Every other end-to-end test goes through ``PyArrowFileIO``, pyiceberg's default. s3fs differs where it matters to a
stream that many processes write at once: it keeps a directory listings cache that never expires, and it raises
botocore's errors where pyarrow raises ``OSError``.
"""

from __future__ import annotations

import datetime

import pytest

from lakestream_iceberg import ConfigError, Stream
from tests.backends import Backend, backend, moto_service, postgres_service, published, seaweedfs_service, spawn_worker
from tests.support import SCHEMA, batch, digest, needs_torch

__all__ = ["backend", "moto_service", "postgres_service", "seaweedfs_service"]  # fixtures used by name

pytestmark = pytest.mark.services

FSSPEC = "pyiceberg.io.fsspec.FsspecFileIO"
WORLD = 2
NO_GRACE = {"grace": datetime.timedelta(0), "allow_short_grace": True}


def fsspec_stream(backend: Backend) -> Stream:
    """The backend's stream opened by a catalog whose tables use FsspecFileIO (as ``py-io-impl`` in
    ``.pyiceberg.yaml`` or ``PYICEBERG_CATALOG__<NAME>__PY_IO_IMPL`` would set it)."""
    catalog = backend.catalog()
    catalog.properties["py-io-impl"] = FSSPEC
    stream = Stream.open(catalog, backend.identifier())
    assert type(stream.io).__name__ == "FsspecFileIO"
    return stream


@pytest.mark.parametrize("backend", ["sqlite-moto"], indirect=True)
def test_gc_leaves_no_listing_behind_that_hides_what_other_clients_write(backend: Backend) -> None:
    """GC lists the table's files with s3fs's ``find``, which fills s3fs's listings cache with every folder under the
    table; ``open`` and ``info`` then answered from it, so the next ``metadata.json`` another process committed read as
    missing (a bare ``FileNotFoundError`` out of ``head_step``: the stream in that process could not refresh again)."""
    writer = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)  # PyArrowFileIO
    producer = writer.producer("a")
    for seq in range(3):
        producer.commit(batch("a", seq, WORLD))
    stream = fsspec_stream(backend)
    stream.collect_garbage(dry_run=False, **NO_GRACE)
    step = producer.commit(batch("a", 3, WORLD)).step  # another client: s3fs's cache of this process never sees it
    assert stream.head_step() == step
    for rank in range(WORLD):
        assert digest(stream.read(step, rank=rank)) == digest(batch("a", 3, WORLD)[rank])


@pytest.mark.parametrize("backend", ["sqlite-moto"], indirect=True)
def test_a_location_that_holds_files_or_lies_in_a_table_is_refused_through_fsspec(backend: Backend) -> None:
    """The check that keeps a new stream out of a folder holding other tables (lifecycle GC deletes every file under a
    stream's location that the stream does not reference) listed through pyarrow only: with FsspecFileIO a stream was
    made at the warehouse's root, and its first GC would have deleted every other table's data and metadata."""
    catalog = backend.catalog()
    catalog.properties["py-io-impl"] = FSSPEC
    stream = Stream.create(catalog, backend.identifier(), schema=SCHEMA, world_size=WORLD)
    stream.producer("a").commit(batch("a", 0, WORLD))
    home = stream.table.metadata.location
    warehouse = backend.properties["warehouse"]
    for location in (warehouse, f"{warehouse}/{backend.namespace}", home + "/data", home + "/sub/folder"):
        with pytest.raises(ConfigError, match="GC"):
            Stream.create(catalog, "other.b", schema=SCHEMA, world_size=WORLD, location=location)
        assert not catalog.table_exists("other.b")
    own = Stream.create(catalog, "other.b", schema=SCHEMA, world_size=WORLD, location=f"{warehouse}/elsewhere/b")
    assert own.table.metadata.location.endswith("/elsewhere/b") and type(own.io).__name__ == "FsspecFileIO"


@pytest.mark.parametrize("impl", ["pyarrow", "fsspec"])
def test_gc_collects_a_plain_path_warehouses_files_through_either_file_io(tmp_path, impl: str) -> None:
    """A warehouse given as a plain path (no ``file://``): s3fs's ``find`` lists it without a scheme, and the listing
    named its files ``:///...``, none of them under the stream's location: GC through FsspecFileIO deleted nothing,
    ever (files_deleted empty, the collected steps' files kept forever)."""
    from pyiceberg.catalog.sql import SqlCatalog

    extra = {"py-io-impl": FSSPEC} if impl == "fsspec" else {}
    catalog = SqlCatalog("plain", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"{tmp_path}/warehouse", **extra)
    stream = Stream.create(catalog, "ns.plain", schema=SCHEMA, world_size=WORLD)
    assert stream.table.metadata.location.startswith("/")
    producer = stream.producer("a")
    for seq in range(4):
        producer.commit(batch("a", seq, WORLD))
    stream.checkpoint("c3", step=3)
    report = stream.collect_garbage(dry_run=False, **NO_GRACE)
    assert report.files_deleted.get("data") == 2 * WORLD and report.files_failed == 0
    for step in (3, 4):
        assert digest(stream.read(step, rank=0)) == digest(batch("a", step - 1, WORLD)[0])
    catalog.engine.dispose()


@pytest.mark.parametrize("backend", ["rest-seaweedfs"], indirect=True)
def test_a_refused_secret_is_a_config_error_naming_the_setting_through_fsspec(backend: Backend) -> None:
    """s3fs turns the 403 of a HEAD (no body, so no AWS error code) into a bare ``PermissionError: Forbidden``, which
    ``stream.read`` let out as it was; through PyArrowFileIO the same refusal is a ``ConfigError`` naming the keys."""
    writer = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)
    writer.producer("a").commit(batch("a", 0, WORLD))
    backend.properties["s3.secret-access-key"] = "not-the-secret"
    stream = fsspec_stream(backend)
    with pytest.raises(ConfigError, match=r"refused the credentials.*s3\.secret-access-key") as raised:
        stream.read(1, rank=0)
    assert "not-the-secret" not in str(raised.value)
    # GC's commit writes manifests first: the refusal was a bare PermissionError out of collect_garbage (an OSError
    # through PyArrowFileIO), though its commit loop leaves naming the setting to its caller
    for call in (lambda: stream.collect_garbage(dry_run=False, **NO_GRACE), lambda: stream.checkpoint("c1", step=1)):
        with pytest.raises(ConfigError, match=r"s3\.secret-access-key"):
            call()


@pytest.mark.parametrize("backend", ["sqlite-moto"], indirect=True)
def test_a_forked_worker_commits_and_reads_through_file_systems_of_its_own(backend: Backend) -> None:
    """A ``multiprocessing`` worker forked after the parent used the stream inherits FsspecFileIO's per-thread s3fs
    file system, which refuses another process ("This class is not fork-safe"): the child's commit retried that for
    its whole budget and failed with ``CommitTimeoutError``. PyArrowFileIO's worked."""
    catalog = backend.catalog()
    catalog.properties["py-io-impl"] = FSSPEC
    stream = Stream.create(catalog, backend.identifier(), schema=SCHEMA, world_size=WORLD)
    stream.producer("parent").commit(batch("parent", 0, WORLD))
    assert stream.read(1, rank=0).num_rows == batch("parent", 0, WORLD)[0].num_rows
    _forked_child_commits_and_reads(stream)


@pytest.mark.parametrize("backend", ["sqlite-moto"], indirect=True)
def test_gc_through_s3fs_says_it_cannot_tell_a_refused_delete(backend: Backend,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """s3fs drops the per-object errors of S3's multi-object delete: a delete the store refuses (a bucket policy, Object
    Lock) is counted as done and the file stays, silently. GC through FsspecFileIO now says so, once per stream and
    process, and names the way out; through PyArrowFileIO, which reports each failure, it says nothing."""
    import logging

    writer = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)
    producer = writer.producer("a")
    for seq in range(3):
        producer.commit(batch("a", seq, WORLD))
    writer.checkpoint("c2", step=2)
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.lifecycle.sweep"):
        writer.collect_garbage(dry_run=False, **NO_GRACE)
        assert "FsspecFileIO" not in caplog.text
        stream = fsspec_stream(backend)
        report = stream.collect_garbage(dry_run=False, **NO_GRACE)
        assert report.files_failed == 0
        # GC's own warning: connect.storage's about s3fs's timeouts also names FsspecFileIO, once per process, so it
        # shows here only where no earlier test of this process reached S3 through s3fs
        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if r.name == "lakestream_iceberg.lifecycle.sweep" and "FsspecFileIO" in r.getMessage()]

        assert len(warned()) == 1 and "PyArrowFileIO" in warned()[0] and backend.identifier() in warned()[0]
        stream.collect_garbage(dry_run=False, **NO_GRACE)
        assert len(warned()) == 1  # once per stream


@needs_torch
@pytest.mark.parametrize("backend", ["rest-seaweedfs"], indirect=True)
def test_a_stream_runs_end_to_end_through_fsspec(backend: Backend) -> None:
    """Everything a run does, with ``py-io-impl`` set as a user sets it, on the catalog where the most goes through the
    FileIO (REST: staged intents and consumer positions are objects): producer processes, a follow-mode dataset with
    forked DataLoader workers through the host relay, reporting positions, a checkpoint, a fork, GC and history."""
    from torch.utils.data import DataLoader

    from lakestream_iceberg import LakestreamDataset
    from lakestream_iceberg.read.lag import consumer_lags

    backend.properties["py-io-impl"] = FSSPEC  # the producer processes load the catalog with it too
    stream = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)
    assert type(stream.io).__name__ == "FsspecFileIO" and stream.staging.kind == "storage"
    procs = [spawn_worker(backend, "commit", backend.identifier(), f"prep-{i}", "3") for i in range(2)]
    dataset = LakestreamDataset(stream, rank=1, world_size=WORLD, follow=True, end_step=6, timeout=120, relay=True,
                                group="run")
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120)
    items = {item["step"]: item for item in dataset.track(loader)}
    for proc in procs:
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    steps = published(stream)
    assert sorted(items) == sorted(steps) == list(range(1, 7))
    for step, (pid, seq) in steps.items():
        assert digest(stream.read(step, rank=0)) == digest(batch(pid, seq, WORLD)[0])
    dataset.close()
    assert {lag.rank: lag.last_step for lag in consumer_lags(stream.refresh(), group="run")} == {1: 6}
    stream.checkpoint("c4", step=4)
    stream.fork("c4", branch="retry")
    report = stream.collect_garbage(dry_run=False, **NO_GRACE)
    assert report.files_deleted.get("data") == 3 * WORLD and report.files_failed == 0
    assert stream.staging.expire(older_than_s=-1.0, delete=False) == []  # no staged intent left behind
    assert stream.history().sql("select count(*) from batches").fetchall() == [(3,)]
    assert digest(stream.read(6, rank=1)) == digest(batch(*steps[6], WORLD)[1])


@pytest.mark.parametrize("backend", ["sqlite-moto"], indirect=True)
def test_a_rank_of_a_packed_step_fetches_its_own_rows_only_through_s3fs(backend: Backend,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """pyiceberg's FsspecFileIO opens a file with fsspec's read-ahead cache of s3fs's 50 MiB block: a rank reading its
    row groups of a packed step fetched from their offset to the end of the file (a rank of 8 of a 96 MiB step: 60 MiB,
    5 times its share, and 5 times the CPU of the same read through PyArrowFileIO). s3fs logs every range it fetches."""
    import logging
    import os

    import pyarrow as pa

    schema = pa.schema([("blob", pa.binary())])
    world, share = 8, 1 << 20
    writer = Stream.create(backend.catalog(), backend.identifier(), schema=schema, world_size=world)
    assert writer.config.layout == "packed"
    shards = [pa.table({"blob": [os.urandom(share // 8) for _ in range(8)]}, schema=schema) for _ in range(world)]
    writer.producer("a").commit(shards)
    path = writer.locate(1)[0].file_path
    stream = fsspec_stream(backend)
    with caplog.at_level(logging.DEBUG, logger="s3fs"):
        assert stream.read(1, rank=3).equals(shards[3])
    key = path.split("://", 1)[1]
    fetched = [record.args for record in caplog.records
               if record.name == "s3fs" and record.msg.startswith("Fetch: ") and f"{record.args[0]}/{record.args[1]}" == key]
    assert fetched, "s3fs logged no fetch of the step's file"
    total = sum(int(end) - int(start) for _bucket, _key, start, end in fetched)
    assert total < 2 * share, f"fetched {total} bytes of a {share}-byte share ({len(fetched)} ranges)"


@pytest.mark.parametrize("backend", ["sqlite-moto"], indirect=True)
def test_a_stream_through_s3fs_without_request_timeouts_says_so(backend: Backend, caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``s3.connect-timeout`` and ``s3.request-timeout``, s3fs waits botocore's 60 s per attempt and retries
    each request 5 times on top of botocore's attempts: one read of an endpoint that stopped answering took 410 s
    (PyArrowFileIO: 10 s), past every budget of lakestream's, and nothing said why. Opening such a stream warns, once
    per process, naming both settings; with them set it says nothing."""
    import logging

    from lakestream_iceberg.connect import storage

    Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)
    monkeypatch.setattr(storage, "_warned_bounds", False)
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.connect.storage"):
        backend.properties.update({"s3.connect-timeout": "1", "s3.request-timeout": "3"})
        fsspec_stream(backend)
        assert "s3.request-timeout" not in caplog.text
        for key in ("s3.connect-timeout", "s3.request-timeout"):
            del backend.properties[key]
        fsspec_stream(backend)
        fsspec_stream(backend)
    warned = [r.getMessage() for r in caplog.records if "s3.request-timeout" in r.getMessage()]
    assert len(warned) == 1 and "s3.connect-timeout and s3.request-timeout" in warned[0]


@pytest.mark.parametrize("backend", ["rest-seaweedfs"], indirect=True)
def test_a_forked_worker_commits_and_reads_after_the_parent_refreshed_through_a_rest_catalog(backend: Backend) -> None:
    """A REST catalog's table is refreshed with pyiceberg's ``Table.refresh()``, which replaces the table's FileIO with
    the one the catalog loaded just then: a stream refreshed after it was opened (every head read, ``stream.refresh()``)
    read and wrote through an FsspecFileIO that no fork hook knew, and a child forked after the parent used it
    inherited its s3fs file system ("This class is not fork-safe")."""
    backend.properties["py-io-impl"] = FSSPEC
    stream = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)
    opened_with = stream.io
    stream.producer("parent").commit(batch("parent", 0, WORLD))
    stream.refresh()
    assert type(stream.io).__name__ == "FsspecFileIO" and stream.io is not opened_with  # pyiceberg's Table.refresh()
    assert stream.read(1, rank=0).num_rows == batch("parent", 0, WORLD)[0].num_rows  # the new FileIO's s3fs, used
    _forked_child_commits_and_reads(stream)


def _forked_child_commits_and_reads(stream: Stream) -> None:
    """A forked child of this process commits to ``stream`` and reads step 1 back; the parent commits again after."""
    import multiprocessing

    from tests.test_processes import _child_report

    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def child() -> None:
        try:
            step = stream.producer("child").commit(batch("child", 0, WORLD)).step
            results.put(("ok", step, digest(stream.read(1, rank=1))))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put(("error", repr(exc)[:2000], None))

    proc = context.Process(target=child)
    proc.start()
    assert _child_report(proc, results, "commit") == ("ok", 2, digest(batch("parent", 0, WORLD)[1]))
    assert stream.producer("parent").commit(batch("parent", 1, WORLD)).step == 3  # the parent's still work


@pytest.mark.parametrize("backend", ["sqlite-moto", "rest-seaweedfs"], indirect=True)
def test_gc_reads_the_stores_clock_through_either_file_io(backend: Backend) -> None:
    """GC ages files by the store's clock (a probe object's modification time): the probe must be an object such stores
    take (SeaweedFS's table buckets refused one without an Avro or Parquet name, and GC fell back to its own clock),
    read back through PyArrowFileIO and FsspecFileIO alike, and leave nothing behind."""
    import time

    from lakestream_iceberg.connect.storage import CLOCK_PROBE_PREFIX, list_files, store_now

    stream = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)
    for each in (stream, fsspec_stream(backend)):
        location = each.table.metadata.location
        now = store_now(each.io, location)
        assert now is not None and abs(now - time.time()) < 5, type(each.io).__name__  # one host: the same clock
        assert not [p for p, _, _ in list_files(each.io, location) if CLOCK_PROBE_PREFIX in p]
