"""Which failures count as transient (connect/diagnose.py), on the errors real clients raise against a real HTTP
server that answers with the status under test: pyiceberg's REST client and pyarrow's S3 filesystem."""

from __future__ import annotations

import http.server
import re
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pyarrow import fs
from pyiceberg.catalog.rest import RestCatalog
from sqlalchemy import create_engine, text

from lakestream_iceberg.connect.diagnose import transient


class _Answer(http.server.BaseHTTPRequestHandler):
    """Answers every request with the server's status and no body."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_HEAD = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def answering(status: int) -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    server.status = status  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _raised(fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - what the client raised is the subject
        return exc
    raise AssertionError("the request succeeded")


@pytest.mark.parametrize(("status", "expected"), [(429, True), (408, True), (503, True), (500, True), (502, True),
                                                  (400, False), (401, False), (403, False), (404, False)])
def test_a_rest_catalog_status_is_transient_when_a_retry_can_succeed(status: int, expected: bool) -> None:
    with answering(status) as port:
        exc = _raised(lambda: RestCatalog("throttled", uri=f"http://127.0.0.1:{port}"))
    assert transient(exc) is expected, (status, type(exc).__name__, exc)


@pytest.mark.parametrize(("status", "sigv4", "said", "settings"), [
    (403, False, r"refused this request \(403 Forbidden\): the principal", "credential and token"),
    (403, True, r"refused this request \(403 Forbidden\): the principal", "client.secret-access-key"),
    (401, False, "refused the credentials", "credential and token"),
    (401, True, "rejected the request signature", "client.secret-access-key"),
])
def test_a_rest_catalog_refusal_names_what_to_check(status: int, sigv4: bool, said: str, settings: str) -> None:
    """A 403 is a principal the catalog knows and does not let do this (a grant to ask for, or other credentials), a
    401 credentials it does not accept (with SigV4: the signature)."""
    from lakestream_iceberg.connect.diagnose import explain

    props = {"type": "rest", "uri": "http://127.0.0.1:1", **({"rest.sigv4-enabled": "true"} if sigv4 else {})}
    with answering(status) as port:
        exc = _raised(lambda: RestCatalog("refusing", uri=f"http://127.0.0.1:{port}"))
    error = explain(exc, props, catalog="refusing")
    assert error is not None and re.search(f"{said}.*{re.escape(settings)}", str(error)), error


@pytest.mark.parametrize(("status", "expected"), [(429, True), (503, True), (500, True), (403, False)])
def test_an_s3_status_is_transient_when_a_retry_can_succeed(status: int, expected: bool) -> None:
    with answering(status) as port:
        s3 = fs.S3FileSystem(endpoint_override=f"http://127.0.0.1:{port}", access_key="a", secret_key="b",
                             region="us-east-1", retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=1))
        exc = _raised(lambda: s3.get_file_info("bucket/key"))
    assert "AWS Error" in str(exc)
    assert transient(exc) is expected, (status, exc)


@pytest.mark.parametrize(("status", "expected"), [(429, True), (503, True), (500, True), (403, False), (404, False)])
def test_an_s3_status_through_s3fs_is_transient_when_a_retry_can_succeed(status: int, expected: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """pyiceberg's FsspecFileIO: s3fs raises a bodyless answer (a HEAD's, every one of this server's) as botocore's
    "An error occurred (503) when calling ..." under an OSError; 503 and 500 were no transient failure there (no retry
    of lakestream's), while pyarrow's text for the same answer was."""
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries: the answer is the same on every try
    with answering(status) as port:
        s3 = s3fs.S3FileSystem(key="a", secret="b", client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}",
                                                                   "region_name": "us-east-1"},
                               skip_instance_cache=True)
        exc = _raised(lambda: s3.info("bucket/key"))
    assert f"({status})" in str(exc.__cause__ or exc), (status, exc)
    assert transient(exc) is expected, (status, type(exc).__name__, exc)


def test_a_sqlite_error_a_retry_cannot_change_is_permanent_a_locked_database_transient(tmp_path: Path) -> None:
    """SQLite raises OperationalError for a locked database and for a read-only one, a missing table or bad SQL alike."""
    path = tmp_path / "catalog.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
    writable = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.05})
    read_only = create_engine(f"sqlite:///file:{path}?mode=ro&uri=true")

    def insert(engine: Any, table: str = "t") -> None:
        with engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {table} VALUES (1)"))

    permanent = [_raised(lambda: insert(read_only)), _raised(lambda: insert(writable, "missing")),
                 _raised(lambda: writable.connect().execute(text("SELEC 1")))]
    assert [type(exc).__name__ for exc in permanent] == ["OperationalError"] * 3
    assert [transient(exc) for exc in permanent] == [False] * 3, permanent
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the database
        locked = _raised(lambda: insert(writable))
    finally:
        holder.close()
    assert "database is locked" in str(locked) and transient(locked)
    writable.dispose()
    read_only.dispose()


def test_no_free_pooled_connection_in_time_is_transient(tmp_path: Path) -> None:
    """SQLAlchemy's pool raises its TimeoutError when every connection stays checked out past pool_timeout (the
    process's other threads hold them): a connection is free again once they finish."""
    engine = create_engine(f"sqlite:///{tmp_path}/catalog.db", pool_size=1, max_overflow=0, pool_timeout=0.05)
    held = engine.connect()
    try:
        exhausted = _raised(engine.connect)
    finally:
        held.close()
        engine.dispose()
    assert type(exhausted).__name__ == "TimeoutError" and "QueuePool limit" in str(exhausted)
    assert transient(exhausted)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for ``localhost`` signed by itself (no client trusts it), and its key."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1)).sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_an_s3_endpoint_whose_tls_certificate_is_refused_is_permanent(tmp_path: Path) -> None:
    """pyarrow reports a refused certificate as a NETWORK_CONNECTION error (curlCode 60), as it does a refused
    connection; the same certificate meets every retry."""
    import ssl

    pytest.importorskip("cryptography")  # installed with moto (the tests' S3 server); only to make the certificate
    cert, key = _self_signed(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    server.status = 200  # type: ignore[attr-defined]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        s3 = fs.S3FileSystem(endpoint_override=f"https://127.0.0.1:{server.server_port}", access_key="a",
                             secret_key="b", region="us-east-1",
                             retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=1))
        exc = _raised(lambda: s3.get_file_info("bucket/key"))
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert "NETWORK_CONNECTION" in str(exc) and "curlCode: 60" in str(exc), exc
    assert not transient(exc)


@pytest.mark.parametrize("status", [503, 429])
def test_load_catalog_of_a_rest_catalog_busy_for_a_moment_stays_transient(status: int) -> None:
    """lakestream_iceberg.load_catalog wraps what pyiceberg raises for a catalog "not configured or set wrong" in a
    ConfigError; a REST catalog answering 503 / 429 to its config request is configured right and only busy: the error
    must stay one a retry can fix (transient), not advice to configure the catalog in .pyiceberg.yaml."""
    from lakestream_iceberg.connect.diagnose import load_catalog

    with answering(status) as port:
        exc = _raised(lambda: load_catalog("busy", type="rest", uri=f"http://127.0.0.1:{port}"))
    assert transient(exc), (type(exc).__name__, exc)
    assert "configure it in .pyiceberg.yaml" not in str(exc), exc


def test_load_catalog_of_a_sqlite_catalog_locked_for_a_moment_stays_transient(tmp_path: Path) -> None:
    """The same for a SQL catalog whose database another process holds locked while it loads (pyiceberg reads its
    tables' schema at load): "database is locked" is transient, not a setting to fix."""
    from lakestream_iceberg.connect.diagnose import load_catalog

    path = tmp_path / "catalog.db"
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("CREATE TABLE other (a)")
        holder.execute("BEGIN EXCLUSIVE")
        exc = _raised(lambda: load_catalog("locked", type="sql", uri=f"sqlite:///{path}",
                                           warehouse=f"file://{tmp_path}/warehouse"))
    finally:
        holder.close()
    assert transient(exc), (type(exc).__name__, exc)
