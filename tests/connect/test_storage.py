"""A file's modification time read through the table's FileIO (connect/storage.py): what the producer's follow rule
reads when the snapshot of the id's last seq has expired."""

from __future__ import annotations

import pytest
from pyiceberg.io import FileIO

from catalog import services
from lakestream_iceberg.connect.storage import modified_at


@pytest.mark.parametrize("kind", ["pyarrow", "fsspec"])
def test_a_store_that_cannot_be_reached_tells_no_modification_time(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With FsspecFileIO, an S3 endpoint that refuses connections made ``modified_at`` raise botocore's
    ``EndpointConnectionError`` (no OSError), out of ``Producer.commit`` when its follow rule read an expired batch's
    data file; an error of the store means "cannot be told" (None), as with PyArrowFileIO."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries: the refusal is the same on the first try
    port = services.free_ports(1)[0]  # nothing listens: every request is refused
    properties = {"s3.endpoint": f"http://127.0.0.1:{port}", "s3.access-key-id": "x",
                  "s3.secret-access-key": "y", "s3.region": "us-east-1"}
    io: FileIO
    if kind == "pyarrow":
        from pyiceberg.io.pyarrow import PyArrowFileIO

        io = PyArrowFileIO(properties)
    else:
        from pyiceberg.io.fsspec import FsspecFileIO

        io = FsspecFileIO(properties)
    assert modified_at(io, "s3://bucket/table/data/p/000000000001-0123456789ab-r00000.parquet") is None


def test_a_local_files_modification_time_is_its_mtime(tmp_path) -> None:
    from pyiceberg.io.fsspec import FsspecFileIO
    from pyiceberg.io.pyarrow import PyArrowFileIO

    path = tmp_path / "f.parquet"
    path.write_bytes(b"x")
    for io in (PyArrowFileIO({}), FsspecFileIO({})):
        assert modified_at(io, str(path)) == pytest.approx(path.stat().st_mtime, abs=1e-3)
        assert modified_at(io, f"file://{path}") == pytest.approx(path.stat().st_mtime, abs=1e-3)
        assert modified_at(io, str(tmp_path / "missing.parquet")) is None


@pytest.mark.parametrize("kind", ["pyarrow", "fsspec"])
def test_a_listing_the_store_refuses_is_a_config_error_naming_it(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With FsspecFileIO, listing a table's files (GC, staged intents, consumer positions) against an endpoint that
    refuses connections raised botocore's ``EndpointConnectionError`` out of the package; as with PyArrowFileIO it is
    a ``ConfigError`` that names the location, what the listing was for and the setting to check."""
    from lakestream_iceberg.connect.storage import list_files
    from lakestream_iceberg.errors import ConfigError

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    port = services.free_ports(1)[0]
    properties = {"s3.endpoint": f"http://127.0.0.1:{port}", "s3.access-key-id": "x",
                  "s3.secret-access-key": "y", "s3.region": "us-east-1"}
    io: FileIO
    if kind == "pyarrow":
        from pyiceberg.io.pyarrow import PyArrowFileIO

        io = PyArrowFileIO({**properties, "s3.connect-timeout": "1", "s3.request-timeout": "1"})
    else:
        from pyiceberg.io.fsspec import FsspecFileIO

        io = FsspecFileIO(properties)
    with pytest.raises(ConfigError, match=r"listing s3://bucket/table for the staged batches: cannot connect to the "
                                          r"S3 endpoint http://127\.0\.0\.1:\d+; check s3\.endpoint"):
        list(list_files(io, "s3://bucket/table", purpose="the staged batches"))


def test_threads_forgetting_the_same_listings_at_once_never_fail() -> None:
    """s3fs is one file system per process for every thread (fsspec caches async file systems without the thread in
    the key), so threads listing one stream (GC, staged batches, consumer positions) drop entries of one listings cache
    at once. ``forget_listings`` popped them through the cache's ``MutableMapping.pop``, a read then a delete: a thread
    whose key another thread deleted in between raised ``KeyError`` out of the listing (GC failed with it)."""
    import sys
    import threading

    import s3fs

    from lakestream_iceberg.connect.storage import forget_listings

    filesystem = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)  # its cache only: no request is made
    errors: list[BaseException] = []
    done = threading.Event()

    def lister() -> None:
        for _ in range(2000):
            if done.is_set():
                return
            for i in range(20):  # what a listing of the table leaves: one entry per folder
                filesystem.dircache[f"bucket/table/data/{i}"] = []
            try:
                forget_listings(filesystem, "s3://bucket/table")
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                done.set()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes: the race shows within milliseconds
    try:
        threads = [threading.Thread(target=lister) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == [], errors[:3]
    assert not any(key.startswith("bucket/table") for key in filesystem.dircache._cache)
