"""Faults on real servers (see tests/backends.py): the catalog database crashes, the S3 server goes away, a producer
dies mid-batch, wrong credentials and unreachable endpoints. After each: nothing lost, nothing duplicated, no secret
printed.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from catalog import services
from lakestream_iceberg import ConfigError, StepNotPublishedError, Stream
from lakestream_iceberg.connect.diagnose import config_errors, explain, load_catalog, redact, transient
from lakestream_iceberg.connect.rest_timeout import install_rest_timeout
from tests.backends import (
    Backend,
    fresh_name,
    make_backend,
    moto_service,
    postgres_service,
    producer_seq,
    published,
    seaweedfs_service,
    spawn_worker,
)
from tests.support import SCHEMA, batch, digest

__all__ = ["moto_service", "postgres_service", "seaweedfs_service"]  # fixtures used by name

pytestmark = pytest.mark.services

SERVICE_SECRET = services.SECRET_KEY  # the real secret of the test servers: must never be printed either
CANARY = "CANARY-lakestream-7f3a9c1e"  # a distinctive wrong secret

# --------------------------------------------------------------------------------------------------- helpers


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def finish(proc: subprocess.Popen[str], timeout: float, stderr: Path | None = None) -> tuple[int, list[dict[str, Any]], str]:
    """Wait for a worker; its return code, its JSON lines and its stderr (read from ``stderr`` when it went to a file)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err = stderr.read_text() if stderr is not None else err
        raise AssertionError(f"worker hung; stderr tail:\n{err[-3000:]}") from None
    err = stderr.read_text() if stderr is not None else err
    return proc.returncode, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def check_exactly_once(stream: Stream, producers: dict[str, int], consumed: list[dict[str, Any]]) -> None:
    """Steps 1..N dense, every (producer, seq) once, and the consumer read exactly what was committed, in order."""
    total = sum(producers.values())
    assert stream.head_step() == total
    steps = published(stream)
    assert sorted(steps) == list(range(1, total + 1))
    assert sorted(steps.values()) == sorted((p, s) for p, n in producers.items() for s in range(n))
    assert [c["step"] for c in consumed] == list(range(1, total + 1))
    for record in consumed:
        producer, seq = steps[record["step"]]
        assert producer_seq(record["path"]) == (producer, seq)
        assert record["digests"] == [digest(s) for s in batch(producer, seq, stream.world_size)]


Result = tuple[int, list[dict[str, Any]], str]


def run_through_fault(
    backend: Backend, tmp_path: Path, *, fault: Callable[[], None], repair: Callable[[], None], hit: tuple[str, ...],
    consumers: tuple[str, ...], per_producer: int = 10, gate_seq: int = 2,
) -> tuple[dict[str, int], dict[str, Result], dict[str, Result]]:
    """Two producer processes and the given consumer processes run through a fault, by observed progress only.

    Every producer commits seqs ``0..gate_seq-1`` and waits at a first gate until every worker is up; the gate opens,
    and ``fault`` breaks the service once a commit landed after it (the producers are committing: a commit may be in
    flight). A second gate before each producer's last seq keeps them from finishing before the fault: if both reach
    it without having met the fault, it opens and their last commits meet it. ``repair`` runs only once a producer's
    stderr shows one of ``hit``, however fast or slow the machine.
    """
    ident = backend.identifier()
    stream = Stream.create(backend.catalog(), ident, schema=SCHEMA, world_size=2)
    producers = {f"prep-{i}": per_producer for i in range(2)}
    ready = tmp_path / "ready"
    ready.mkdir()
    start, end = tmp_path / "gate-start", tmp_path / "gate-end"
    gates = f"{gate_seq}:{start},{per_producer - 1}:{end}"
    logs = {name: tmp_path / f"{name}.stderr" for name in [*producers, *consumers]}  # files: no pipe fills up
    procs: dict[str, subprocess.Popen[str]] = {}
    readers: dict[str, subprocess.Popen[str]] = {}

    def alive() -> None:
        for name, proc in [*procs.items(), *readers.items()]:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited early ({proc.returncode}): {finish(proc, 30, logs.get(name))[2][-3000:]}")

    def at(gate: Path) -> bool:
        return all(Path(f"{gate}.{p}").exists() for p in procs)

    def met() -> bool:
        alive()
        if any(mark in logs[p].read_text() for p in procs for mark in hit):
            return True
        if at(end):  # both finished every commit but the last before the fault landed: the last ones will meet it
            end.touch()
        return False

    try:
        for p, n in producers.items():
            with logs[p].open("w") as log:  # the child keeps its own descriptor
                procs[p] = spawn_worker(backend, "commit", ident, p, str(n), stderr=log, LAKESTREAM_TEST_PAUSE_S="0.05",
                                        LAKESTREAM_TEST_READY_FILE=str(ready / p), LAKESTREAM_TEST_GATE=gates)
        for c in consumers:
            with logs[c].open("w") as log:
                readers[c] = spawn_worker(backend, c, ident, str(sum(producers.values())), stderr=log,
                                          LAKESTREAM_TEST_READY_FILE=str(ready / c))
        wait_until(lambda: (alive(), all((ready / n).exists() for n in [*procs, *readers]) and at(start))[1], 240,
                   "every worker to start and every producer to reach the first gate")
        assert stream.head_step() == len(producers) * gate_seq
        start.touch()
        wait_until(lambda: (alive(), stream.head_step() > len(producers) * gate_seq)[1], 240,
                   "a commit after the first gate")
        try:
            fault()
            wait_until(met, 240, f"a producer's commit to meet the fault (its stderr to show one of {hit})")
        finally:
            repair()
        end.touch()
        results = {p: finish(proc, 240, logs[p]) for p, proc in procs.items()}
        if any(rc != 0 for rc, _, _ in results.values()):  # the consumers would wait for steps that never come
            for proc in readers.values():
                proc.kill()
        consumed = {c: finish(proc, 240, logs[c]) for c, proc in readers.items()}
    finally:
        for proc in [*procs.values(), *readers.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, (_, _, err) in {**results, **consumed}.items():
        assert SERVICE_SECRET not in err, f"{name} printed the S3 secret"
    for p, (rc, lines, err) in results.items():
        assert rc == 0, f"{p} failed:\n{err[-3000:]}"
        assert [line["seq"] for line in lines] == list(range(producers[p]))
    return producers, results, consumed


def durable_commits(pg: services.Postgres, database: str) -> None:
    """Make commits to ``database`` survive a server crash, as they do in production.

    The test server runs with ``synchronous_commit=off`` (catalog/services.py, for speed): a commit is acknowledged
    before its WAL leaves PostgreSQL's shared memory, so SIGKILL loses the last acknowledged commits. A producer was
    then told "published as step k" while the catalog forgot step k (seen: it published seq 0 twice, at two steps).
    """
    import psycopg2  # type: ignore[import-untyped,unused-ignore]
    from psycopg2 import sql  # type: ignore[import-untyped,unused-ignore]

    conn = psycopg2.connect(host=pg.host, port=pg.port, user=pg.user, dbname="postgres", connect_timeout=5)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(sql.SQL("ALTER DATABASE {} SET synchronous_commit = on").format(sql.Identifier(database)))
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------------- (a) catalog DB


def test_postgres_crash_and_restart_while_producers_commit_and_consumers_read(
    request: pytest.FixtureRequest, tmp_path: Path, postgres_service: services.Postgres
) -> None:
    backend = make_backend("postgres-seaweedfs", request, tmp_path)
    assert backend.database is not None
    durable_commits(postgres_service, backend.database)

    try:
        # SIGKILL: connections drop mid-transaction; the next start runs crash recovery
        producers, results, consumed = run_through_fault(
            backend, tmp_path, fault=postgres_service.kill, repair=postgres_service.start,
            hit=("unreachable", "reconciling"), consumers=("follow", "consume"))
        assert any("unreachable" in err or "reconciling" in err for _, _, err in results.values()), "the crash hit no commit"
        rc, lines, err = consumed["follow"]
        assert rc == 0, f"follow-mode consumer failed:\n{err[-3000:]}"
        check_exactly_once(Stream.open(backend.catalog(), backend.identifier()), producers, lines)
        rc, lines, err = consumed["consume"]
        assert rc == 0, f"wait_for consumer failed:\n{err[-3000:]}"
        check_exactly_once(Stream.open(backend.catalog(), backend.identifier()), producers, lines)
    finally:
        backend.close()
        if not postgres_service.running:  # a failed test must not leave the shared server down
            postgres_service.start()


# --------------------------------------------------------------------------------------------------- (b) S3 outage


@pytest.fixture
def own_seaweedfs() -> Iterator[services.SeaweedFS]:
    """A SeaweedFS of this test's own, free to be stopped and restarted."""
    with services.SeaweedFS() as svc:
        yield svc


def test_s3_server_stopped_and_restarted_while_producers_commit_and_consumers_read(
    tmp_path: Path, postgres_service: services.Postgres, own_seaweedfs: services.SeaweedFS
) -> None:
    db = fresh_name("outage")
    postgres_service.create_database(db)
    props = services.postgres_seaweedfs(postgres_service, own_seaweedfs, database=db, prefix=db)
    backend = Backend(kind="postgres-seaweedfs", properties=props, namespace="outage")

    try:
        # every S3 request fails (connection refused) until a producer retried
        producers, results, consumed = run_through_fault(
            backend, tmp_path, fault=own_seaweedfs.stop, repair=own_seaweedfs.start, hit=("retrying",),
            consumers=("follow", "consume"))
        assert any("retrying" in err for _, _, err in results.values()), "the outage hit no producer"
        for name, (rc, lines, err) in consumed.items():
            assert rc == 0, f"{name} consumer failed:\n{err[-3000:]}"
            check_exactly_once(Stream.open(backend.catalog(), backend.identifier()), producers, lines)
    finally:
        backend.close()


# --------------------------------------------------------------------------------------------------- (c) dies mid-batch


@pytest.mark.parametrize("kind", ["postgres-seaweedfs", "rest-seaweedfs", "sqlite-moto"])
def test_producer_dying_between_writing_and_committing_leaves_only_orphans(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    backend = make_backend(kind, request, tmp_path)
    try:
        world = 3
        stream = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=world)
        steady = stream.producer("steady")
        steady.commit(batch("steady", 0, world))
        rc, lines, err = finish(spawn_worker(backend, "stage-and-die", backend.identifier(), "victim", "0"), 120)
        assert rc == 1, err[-2000:]
        staged = lines[0]["paths"]
        assert len(staged) == world and all(stream.io.new_input(p).exists() for p in staged)
        # nothing of the batch is visible: not as a step, not in a scan, not in the producer table
        reader = Stream.open(backend.catalog(), backend.identifier())
        assert reader.head_step() == 1
        with pytest.raises(StepNotPublishedError):
            reader.read(2, rank=0)
        assert "victim" not in reader.state().producers
        scanned = reader.table.scan(selected_fields=("producer",)).to_arrow().column("producer").to_pylist()
        assert "victim" not in scanned
        steady.commit(batch("steady", 1, world))
        assert published(reader) == {1: ("steady", 0), 2: ("steady", 1)}
        # GC reports them as orphans: young ones wait out the grace period, old enough ones are collected
        report = reader.collect_garbage(dry_run=True)
        assert report.files_in_grace == world and report.files_deleted.get("data", 0) == 0, report
        report = reader.collect_garbage(dry_run=True, grace=timedelta(0), allow_short_grace=True)
        assert report.files_deleted.get("data") == world, report
        assert all(reader.io.new_input(p).exists() for p in staged)  # a dry run deletes nothing
        reader.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
        assert not any(reader.io.new_input(p).exists() for p in staged)
        # the restarted victim publishes its seq 0 once, with new files; the committed steps are untouched
        result = Stream.open(backend.catalog(), backend.identifier()).producer("victim").commit(batch("victim", 0, world))
        assert (result.step, result.seq, result.duplicate) == (3, 0, False)
        assert published(reader) == {1: ("steady", 0), 2: ("steady", 1), 3: ("victim", 0)}
        for step, (p, seq) in published(reader).items():
            assert [digest(reader.read(step, rank=r)) for r in range(world)] == [digest(s) for s in batch(p, seq, world)]
    finally:
        backend.close()


# --------------------------------------------------------------------------------------------------- (d) bad settings


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections (kernel backlog) and never answers: a hung server, or a black hole."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()  # resets the connections still waiting in the backlog: hung clients error out


def closed_port() -> int:
    return services.free_ports(1)[0]


# name -> (backend kind, what to do, settings overridden (given the silent port), the setting the error must name)
PG, REST = "postgres-seaweedfs", "rest-seaweedfs"
S3_SECRET, CLIENT_SECRET = "s3.secret-access-key", "client.secret-access-key"
CASES: dict[str, tuple[str, str, Callable[[int], dict[str, str]], str]] = {
    "s3-wrong-secret-create": (PG, "create", lambda _: {S3_SECRET: CANARY}, S3_SECRET),
    "s3-wrong-secret-open": (PG, "open", lambda _: {S3_SECRET: CANARY}, S3_SECRET),
    "s3-closed-port-create": (PG, "create", lambda _: {"s3.endpoint": f"http://127.0.0.1:{closed_port()}"}, "s3.endpoint"),
    "s3-silent-endpoint-create": (PG, "create", lambda port: {
        "s3.endpoint": f"http://127.0.0.1:{port}", "s3.connect-timeout": "1", "s3.request-timeout": "1"}, "s3.endpoint"),
    "sql-closed-port-load": (PG, "load", lambda _: {
        "uri": f"postgresql+psycopg2://postgres:{CANARY}@127.0.0.1:{closed_port()}/x"}, "uri"),
    "sql-silent-load": (PG, "load", lambda port: {
        "uri": f"postgresql+psycopg2://postgres:{CANARY}@127.0.0.1:{port}/x?connect_timeout=2"}, "uri"),
    "rest-wrong-secret-create": (REST, "create", lambda _: {CLIENT_SECRET: CANARY}, CLIENT_SECRET),
    "rest-wrong-secret-open": (REST, "open", lambda _: {CLIENT_SECRET: CANARY}, CLIENT_SECRET),
    "rest-wrong-s3-secret-commit": (REST, "commit", lambda _: {S3_SECRET: CANARY}, S3_SECRET),
    "rest-closed-port-load": (REST, "load", lambda _: {"uri": f"http://127.0.0.1:{closed_port()}"}, "uri"),
    "rest-silent-load": (REST, "load", lambda port: {
        "uri": f"http://127.0.0.1:{port}", "rest.client.connection-timeout-ms": "2000",
        "rest.client.socket-timeout-ms": "2000", "rest.sigv4.max-retries": "1"}, "uri"),
}  # fmt: skip
BOUND_S = 30.0  # the promise: a bad setting is reported within this time
HANG_CHECK_S = {"rest-silent-load": 20.0}  # its timeouts (2 s, 1 retry) bound it to 8 s at worst; saves 25 s


def _attempt(fn: Callable[[], object], limit: float) -> tuple[BaseException | None, float]:
    """Run ``fn`` in a thread for at most ``limit`` seconds: (what it raised, elapsed); a hang raises TimeoutError."""
    box: dict[str, BaseException | None] = {}
    started = time.monotonic()

    def run() -> None:
        try:
            fn()
            box["error"] = None
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise TimeoutError(f"still blocked after {limit:.0f}s")
    return box["error"], time.monotonic() - started


def _case_params() -> list[Any]:
    params = []
    for name, (_, what, _, _) in CASES.items():
        params.append(pytest.param(name, "diagnose", id=f"{name}-diagnose"))
        if what != "load" and "silent" not in name:  # the package itself must raise the ConfigError
            params.append(
                pytest.param(
                    name,
                    "package",
                    id=f"{name}-package",
                )
            )
    return params


@pytest.mark.parametrize(("case", "via"), _case_params())
def test_bad_setting_is_named_within_bounded_time_and_no_secret_is_printed(
    case: str, via: str, request: pytest.FixtureRequest, tmp_path: Path, silent_port: int,
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    kind, what, overrides, setting = CASES[case]
    good = make_backend(kind, request, tmp_path)
    if what in ("open", "commit"):  # the stream exists; only the client's settings are wrong
        Stream.create(good.catalog(), good.identifier(), schema=SCHEMA, world_size=2)
    bad = {**good.properties, **overrides(silent_port)}
    name = f"bad-{uuid.uuid4().hex[:6]}" if what == "load" else good.name

    if kind == REST:
        install_rest_timeout()

    def call() -> None:
        if what == "load":
            load_catalog(name, **bad)
            return
        from pyiceberg.catalog import load_catalog as plain_load

        with config_errors(bad, action=f"{what} {good.identifier()}", catalog=name) if via == "diagnose" else _nothing():
            catalog = plain_load(name, **bad)
            if what == "create":
                Stream.create(catalog, fresh_name("ns") + ".s", schema=SCHEMA, world_size=2)
            elif what == "open":
                Stream.open(catalog, good.identifier())
            else:
                Stream.open(catalog, good.identifier()).producer("p").commit(batch("p", 0, 2))

    caplog.set_level(logging.DEBUG)
    try:
        error, elapsed = _attempt(call, HANG_CHECK_S.get(case, BOUND_S + 15))
    finally:
        good.close()
    assert isinstance(error, ConfigError), f"expected a ConfigError, got {type(error).__name__}: {redact(str(error), bad)}"
    assert elapsed < BOUND_S, f"took {elapsed:.1f}s"
    text = str(error)
    assert setting in text, text
    printed = "".join(traceback.format_exception(error)) + repr(error) + caplog.text + "".join(capfd.readouterr())
    for secret in (CANARY, SERVICE_SECRET):
        assert secret not in printed, f"{secret!r} was printed"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_normal_run_logs_no_secret(request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                     capfd: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG)  # botocore, urllib3, pyiceberg, sqlalchemy: everything
    for kind in ("postgres-seaweedfs", "rest-seaweedfs"):
        backend = make_backend(kind, request, tmp_path / kind)
        try:
            stream = Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=2)
            stream.producer("p").commit(batch("p", 0, 2))
            assert digest(stream.read(1, rank=1)) == digest(batch("p", 0, 2)[1])
            stream.collect_garbage(dry_run=True)
        finally:
            backend.close()
    assert caplog.records, "no log records captured"
    printed = caplog.text + "".join(capfd.readouterr())
    assert SERVICE_SECRET not in printed


def test_diagnose_classifies_without_servers() -> None:
    """explain()/transient() on the exact error texts observed from pyarrow 26, psycopg2 and pyiceberg 0.12."""
    refused = OSError("When initiating multiple part upload for key 'k' in bucket 'b': AWS Error NETWORK_CONNECTION during "
                      "CreateMultipartUpload operation: curlCode: 7, Could not connect to server")  # fmt: skip
    denied = OSError("When getting information for key 'k' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject "
                     "operation: No response body.")  # fmt: skip
    signature = OSError("AWS Error SIGNATURE_DOES_NOT_MATCH during CreateMultipartUpload operation: The request signature")
    unavailable = OSError("AWS Error SERVICE_UNAVAILABLE during PutObject operation: HTTP status 503")
    assert transient(refused) and transient(unavailable)
    assert not transient(denied) and not transient(signature)
    assert not transient(FileNotFoundError("gone")) and not transient(ValueError("x"))
    props = {"s3.endpoint": "http://127.0.0.1:9", "s3.secret-access-key": CANARY,
             "uri": f"postgresql+psycopg2://u:{CANARY}@h:5432/db"}  # fmt: skip
    assert "s3.endpoint" in str(explain(refused, props))
    assert "s3.secret-access-key" in str(explain(denied, props))
    assert "s3.secret-access-key" in str(explain(signature, props, catalog="prod"))
    assert "PYICEBERG_CATALOG__PROD__S3__SECRET_ACCESS_KEY" in str(explain(signature, props, catalog="prod"))
    assert explain(ValueError("not a connection problem"), props) is None
    leaky = OSError(f"AWS Error ACCESS_DENIED for secret {CANARY} at {props['uri']}")
    assert CANARY not in str(explain(leaky, props))
    assert redact(f"x {CANARY} postgresql://u:pw1234@h/db", props) == "x **** postgresql://u:****@h/db"


def test_a_wrong_storage_secret_met_by_a_commit_names_the_catalogs_own_variable(request: pytest.FixtureRequest,
                                                                                tmp_path: Path) -> None:
    """Open works (a REST catalog serves the metadata), the commit's data write meets the wrong S3 secret: the
    ConfigError named ``PYICEBERG_CATALOG__<NAME>__S3__SECRET_ACCESS_KEY`` literally, though the stream knows its
    catalog's name (Stream.create/open and load_catalog name it)."""
    good = make_backend(REST, request, tmp_path)
    try:
        Stream.create(good.catalog(), good.identifier(), schema=SCHEMA, world_size=2)
        from pyiceberg.catalog import load_catalog as plain_load

        stream = Stream.open(plain_load(good.name, **{**good.properties, S3_SECRET: CANARY}), good.identifier())
        with pytest.raises(ConfigError, match=S3_SECRET) as info:
            stream.producer("p").commit(batch("p", 0, 2))
    finally:
        good.close()
    text = str(info.value)
    assert "PYICEBERG_CATALOG__REST_SEAWEEDFS__S3__SECRET_ACCESS_KEY" in text and "<NAME>" not in text, text
    assert CANARY not in text


def test_a_key_id_without_its_secret_is_a_config_error_naming_both(moto_service: services.MotoS3, tmp_path: Path) -> None:
    """A catalog whose ``s3.secret-access-key`` is empty (an unset shell variable behind
    ``PYICEBERG_CATALOG__<NAME>__S3__SECRET_ACCESS_KEY``) while ``s3.access-key-id`` is set: pyarrow refuses with a
    ``ValueError`` before any request, which came out of Stream.open as it was. And lakestream's load_catalog refuses a
    key pyiceberg would drop for its spelling (``s3-secret-access-key``), naming the right one."""
    from pyiceberg.catalog.sql import SqlCatalog

    props = {"uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"s3://{moto_service.bucket}/{tmp_path.name}",
             **moto_service.s3_properties()}
    catalog = SqlCatalog("halfkey", **props)
    catalog.create_namespace("ns")
    Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1)
    half = SqlCatalog("halfkey", **{**props, S3_SECRET: ""})
    with pytest.raises(ConfigError, match=r"s3.access-key-id and s3.secret-access-key go together.*"
                                          r"PYICEBERG_CATALOG__HALFKEY__S3__SECRET_ACCESS_KEY"):
        Stream.open(half, "ns.s")
    typo = {k: v for k, v in props.items() if k != S3_SECRET} | {"s3-secret-access-key": moto_service.secret_key}
    with pytest.raises(ConfigError, match=r"s3-secret-access-key is not a setting pyiceberg reads.*did you mean "
                                          r"s3.secret-access-key") as info:
        load_catalog("halfkey", type="sql", **typo)
    assert moto_service.secret_key not in str(info.value)
