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
