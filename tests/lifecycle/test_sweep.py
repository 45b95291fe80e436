"""The sweep's deletes: run in parallel on pyiceberg's pool, and a delete that fails stops no other."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from pyiceberg.io.pyarrow import PyArrowFileIO

from lakestream_iceberg import Stream
from lakestream_iceberg.connect.storage import CLOCK_PROBE_PREFIX
from lakestream_iceberg.tools.config import embedded_catalog
from tests.support import SCHEMA, batch, digest, immutable, sqlite_catalog

WORLD = 2


def _published(stream: Stream, count: int) -> None:
    producer = stream.producer("p")
    for seq in range(count):
        producer.commit(batch("p", seq, WORLD), seq=seq)
    for step in range(1, count + 1):
        stream.read(step, rank=0)


def _step_files(stream: Stream, *steps: int) -> set[str]:
    stream.table.refresh()
    return {f.file_path.removeprefix("file://") for step in steps
            for f in stream.index.files(stream.table.current_snapshot(), step)}


def _data_files(stream: Stream) -> set[str]:
    root = stream.table.metadata.location.removeprefix("file://") + "/data"
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".parquet")}


def test_the_sweep_runs_its_deletes_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One delete at a time made a GC of 100,000 objects 100,000 round trips in a row. Here the first two deletes
    each wait for the other: done one after the other, the first would wait alone and the barrier break."""
    stream = Stream.create(embedded_catalog(tmp_path), "ns.par", schema=SCHEMA, world_size=WORLD)
    _published(stream, 6)
    stream.checkpoint("c5", step=5)
    barrier, calls, lock = threading.Barrier(2, timeout=120), [0], threading.Lock()
    threads: set[int] = set()
    real = PyArrowFileIO.delete

    def delete(self: PyArrowFileIO, location: object) -> None:
        if CLOCK_PROBE_PREFIX in str(location):  # GC's probe of the store's clock, deleted before the sweep
            return real(self, location)
        with lock:
            calls[0] += 1
            first_two = calls[0] <= 2
            threads.add(threading.get_ident())
        if first_two:
            barrier.wait()  # BrokenBarrierError: counted as failed deletes if the deletes run one at a time
        real(self, location)

    monkeypatch.setattr(PyArrowFileIO, "delete", delete)
    report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.files_deleted["data"] == 4 * WORLD and report.files_failed == 0 and report.first_failure is None
    assert len(threads) >= 2 and threading.get_ident() not in threads
    for step in range(5, 7):
        assert digest(stream.read(step, rank=1)) == digest(batch("p", step - 1, WORLD)[1])


def test_a_delete_that_fails_stops_no_other_and_the_next_gc_deletes_its_file(tmp_path: Path) -> None:
    stream = Stream.create(embedded_catalog(tmp_path), "ns.fail", schema=SCHEMA, world_size=WORLD)
    _published(stream, 6)
    before = _data_files(stream)
    stream.checkpoint("c5", step=5)
    plan = stream.collect_garbage(grace=timedelta(0), allow_short_grace=True)
    assert plan.files_deleted["data"] == 4 * WORLD
    kept = _step_files(stream, 5, 6)
    collected = sorted(before - kept)
    assert len(collected) == 4 * WORLD
    stuck = collected[3]
    with immutable(stuck):
        report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
        assert report.files_failed == 1 and stuck in (report.first_failure or "")
        assert report.files_deleted["data"] == 4 * WORLD - 1  # every other file went
        assert _data_files(stream) == kept | {stuck}
        assert report.collected_below == {"main": 5}  # the commits stand
    again = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert again.files_deleted.get("data") == 1 and again.files_failed == 0
    assert _data_files(stream) == kept
    for step in (5, 6):
        assert digest(stream.read(step, rank=0)) == digest(batch("p", step - 1, WORLD)[0])


def test_the_gc_command_prints_its_report_and_fails_when_a_delete_failed(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from lakestream_iceberg.tools.cli import main

    stream = Stream.create(embedded_catalog(tmp_path), "ns.cli", schema=SCHEMA, world_size=WORLD)
    _published(stream, 4)
    stream.checkpoint("c3", step=3)
    kept = _step_files(stream, 3, 4)
    stuck = sorted(_data_files(stream) - kept)[0]
    with immutable(stuck):
        capsys.readouterr()
        code = main(["--home", str(tmp_path), "gc", "ns.cli", "--json"])
        out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err
    report = json.loads(out)
    assert report["files_failed"] == 1 and report["files_deleted"]["data"] == 2 * WORLD - 1
    line = err.strip()
    assert line.startswith("lakestream: error: 1 unreferenced files could not be deleted") and stuck in line
    assert "the next gc deletes them" in line
    assert main(["--home", str(tmp_path), "gc", "ns.cli"]) == 0  # younger than the grace period: it waits
    assert stuck in _data_files(stream)
    assert stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True).files_deleted["data"] == 1
    assert _data_files(stream) == kept


def test_a_delete_that_raises_no_oserror_is_counted_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """FsspecFileIO's delete against a store it cannot reach raises botocore's ``EndpointConnectionError``, no
    OSError: it ended the sweep (and the GC, after its commits landed) with a traceback, the batch's other deletes
    cancelled, instead of being counted as a failed delete that the report names and the next GC retries."""
    from pyiceberg.io.fsspec import FsspecFileIO

    from catalog import services
    from lakestream_iceberg.lifecycle.sweep import _Deletes

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    port = services.free_ports(1)[0]  # nothing listens: every request is refused
    io = FsspecFileIO({"s3.endpoint": f"http://127.0.0.1:{port}", "s3.access-key-id": "x",
                       "s3.secret-access-key": "y", "s3.region": "us-east-1"})
    deletes = _Deletes(io)
    paths = [f"s3://bucket/table/data/p/00000000000{i}-0123456789ab-r00000.parquet" for i in range(3)]
    for path in paths:
        deletes.add(path, "data", 10)
    deletes.flush()
    assert deletes.failed == 3 and dict(deletes.counts) == {}
    assert deletes.first_failure is not None and deletes.first_failure.startswith(paths[0])
    assert "EndpointConnectionError" in deletes.first_failure


GC_ON_THE_POOL = """
import sys
from datetime import timedelta
from pathlib import Path
sys.path.insert(0, {root!r})
from pyiceberg.utils.concurrent import ExecutorFactory
from lakestream_iceberg import Stream
from lakestream_iceberg.tools.config import embedded_catalog
from tests.support import SCHEMA, batch
stream = Stream.create(embedded_catalog(Path({tmp!r})), "ns.pool", schema=SCHEMA, world_size=2)
producer = stream.producer("p")
for seq in range(4):
    producer.commit(batch("p", seq, 2), seq=seq)
stream.checkpoint("c3", step=3)
gc = lambda: stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
try:
    report = ExecutorFactory.get_or_create().submit(gc).result(timeout=90)
except TimeoutError:
    print("stuck", flush=True)
    import os
    os._exit(3)  # the pool's thread never returns: no normal exit
print(report.files_deleted["data"], report.files_failed, flush=True)
"""


def test_a_gc_run_on_pyicebergs_pool_does_not_wait_on_that_pool_forever(tmp_path: Path) -> None:
    """An application that runs GC on pyiceberg's shared pool (maintenance of many streams fanned out with
    ``ExecutorFactory.get_or_create().map``, or ``max-workers`` 1): each GC's deletes queued behind the GCs holding
    every worker, which waited for them; it never returned (it did before deletes ran on the pool)."""
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", GC_ON_THE_POOL.format(root=root, tmp=str(tmp_path))], cwd=root,
                          env={**os.environ, "PYICEBERG_MAX_WORKERS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["4", "0"], (done.returncode, done.stdout, done.stderr[-2000:])


def test_a_gc_host_whose_clock_runs_ahead_keeps_the_files_a_producer_just_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The sweep aged files by this host's clock against the store's modification times: a GC host 2 h ahead (NTP
    broken, a VM resumed with a wrong clock) saw the files a producer wrote a moment ago as older than the default
    grace period (1 h) and deleted them while the producer was about to publish them. It ages them by the store's clock
    now (a probe object's modification time) wherever that is earlier, and says that the clocks disagree."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.clock", schema=SCHEMA, world_size=WORLD)
    _published(stream, 1)
    staged = stream.writer.write(producer="late", seq=0, shards=batch("late", 0, WORLD))  # its commit is in flight
    written = {f.path.removeprefix("file://") for f in staged.files}
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 2 * 3600)  # this (GC) host's clock: 2 h ahead of the store's
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.lifecycle.sweep"):
        report = stream.collect_garbage(dry_run=False)  # the default grace period: 1 h
    assert all(os.path.exists(p) for p in written), report
    assert report.files_in_grace >= WORLD and "data" not in report.files_deleted
    assert "off the store's" in caplog.text
    metadata = stream.table.metadata.location.removeprefix("file://") + "/metadata"
    assert not [n for n in os.listdir(metadata) if "clock" in n]  # the probe object is gone
    monkeypatch.setattr(time, "time", real)
    assert stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True).files_deleted["data"] \
        == WORLD  # aged by the store's clock, they still go once old enough


@pytest.mark.parametrize("key", ["last_modified", None], ids=["adlfs", "no-time"])
def test_gc_keeps_young_files_where_the_file_system_names_their_times_as_adlfs_does(tmp_path: Path,
                                                                                    key: str | None) -> None:
    """adlfs (``abfs://``: pyiceberg's default FileIO for Azure is FsspecFileIO) names a file's modification time
    ``last_modified``; the listing read only ``LastModified`` (s3fs) and ``mtime`` (local, gcsfs) and took every file
    there as written in 1970: GC deleted the files of commits in flight and fresh staged intents at once, whatever the
    grace period, and the consumer positions of live groups at every GC. No Azure store here: the stand-in is fsspec's
    local file system with its times under adlfs's key (adlfs/spec.py: FORWARDED_BLOB_PROPERTIES), or with none (a
    file whose time is not told is young: it may be a commit's in flight)."""
    from datetime import datetime, timezone

    from fsspec.implementations.local import LocalFileSystem

    class AdlfsTimes(LocalFileSystem):
        def info(self, path, **kwargs):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN003, ANN202
            out = super().info(path, **kwargs)
            mtime = out.pop("mtime")
            if key is not None:
                out[key] = datetime.fromtimestamp(mtime, tz=timezone.utc)
            return out

    catalog = sqlite_catalog(str(tmp_path))
    catalog.properties["py-io-impl"] = "pyiceberg.io.fsspec.FsspecFileIO"
    stream = Stream.create(catalog, "ns.adl", schema=SCHEMA, world_size=WORLD)
    _published(stream, 1)
    stream.io._scheme_to_fs["file"] = lambda *_: AdlfsTimes(auto_mkdir=True)  # type: ignore[attr-defined]
    stream.io._thread_locals = threading.local()  # type: ignore[attr-defined]  # its per-thread cache of file systems
    staged = stream.writer.write(producer="late", seq=0, shards=batch("late", 0, WORLD))  # its commit is in flight
    report = stream.collect_garbage(dry_run=False)  # the default grace period: 1 h
    assert all(os.path.exists(f.path.removeprefix("file://")) for f in staged.files), report
    assert report.files_in_grace >= WORLD and "data" not in report.files_deleted
