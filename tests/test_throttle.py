"""Object storage that throttles and fails, on a real S3 server (moto, SeaweedFS) behind tests/faulty_s3.py.

Real S3 answers ``503 SlowDown`` under load, ``500 InternalError`` now and then, and drops connections. A producer, group
commit, a reader following the stream and GC's sweep ride out transient failures with bounded retries (pyarrow's AWS
SDK retries a request 3 times, lakestream's ``call_with_retry`` and commit loop retry on top) and fail with an error of
the project's tree when they persist (``CommitTimeoutError``, ``ReadError``); the table is checked after each: steps
dense, each batch once, the bytes sent.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from lakestream_iceberg import (
    CommitError,
    CommitOutcomeUnknownError,
    CommitTimeoutError,
    ConfigError,
    ReadError,
    Stream,
)
from tests.backends import fresh_name, moto_service, published, seaweedfs_service
from tests.faulty_s3 import Fault, FaultyS3
from tests.support import SCHEMA, batch, digest, needs_torch

__all__ = ["moto_service", "seaweedfs_service"]  # fixtures used by name

pytestmark = pytest.mark.services

# request targets (path-style, the query kept: pyarrow uploads each file as a multipart upload, POST ?uploads, PUT
# ?partNumber=1&uploadId=, POST ?uploadId= to complete it)
DATA = r"/data/[^_/][^/]*/[^/?]+\.parquet"  # a batch's data file (not a staged intent under data/_staging)
MANIFEST = r"/metadata/[^/?]*-m\d+\.avro"
MANIFEST_LIST = r"/metadata/snap-[^/?]*\.avro"
METADATA_JSON = r"/metadata/[^/?]*\.metadata\.json"
ANY = r"(\?|$)"  # any request on the file
PART = r"\?partNumber="  # the upload of a file's bytes
COMPLETE = r"\?uploadId="  # the request that makes the file appear


class Store:
    """A fresh SQLite catalog whose warehouse lives on a real S3 server reached through a :class:`FaultyS3`."""

    def __init__(self, server: Any, proxy: FaultyS3, root: Path) -> None:
        self.proxy = proxy
        self.props = {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
                      "warehouse": f"s3://{server.bucket}/{fresh_name('wh')}", **server.s3_properties(),
                      "s3.endpoint": proxy.endpoint}  # fmt: skip
        self.catalogs: list[SqlCatalog] = []
        self.ident = f"{fresh_name('ns')}.stream"

    def catalog(self) -> SqlCatalog:
        catalog = SqlCatalog("throttle", **self.props)
        self.catalogs.append(catalog)
        return catalog

    def create(self, world_size: int = 2, **properties: str) -> Stream:
        return Stream.create(self.catalog(), self.ident, schema=SCHEMA, world_size=world_size, properties=properties)

    def open(self) -> Stream:
        return Stream.open(self.catalog(), self.ident)

    def close(self) -> None:
        for catalog in self.catalogs:
            catalog.engine.dispose()


@pytest.fixture(params=["moto"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    server = request.getfixturevalue(f"{request.param}_service")
    port = int(server.s3_endpoint.rsplit(":", 1)[1])
    with FaultyS3(target_port=port) as proxy:
        made = Store(server, proxy, tmp_path)
        try:
            yield made
        finally:
            made.close()


def check_table(stream: Stream, sent: dict[str, int]) -> None:
    """Steps dense from 1, every (producer, seq) sent published once, each rank's bytes what was sent, every data
    file the table references present (read back through a fresh view), and pyiceberg's own scan agreeing."""
    stream.refresh()
    total = sum(sent.values())
    assert stream.head_step() == total
    steps = published(stream)
    assert sorted(steps) == list(range(1, total + 1))
    assert sorted(steps.values()) == sorted((p, s) for p, n in sent.items() for s in range(n))
    for step, (producer, seq) in steps.items():
        want = batch(producer, seq, stream.world_size)
        for rank in range(stream.world_size):
            assert digest(stream.read(step, rank=rank)) == digest(want[rank]), (step, rank)
        for f in stream.locate(step):
            assert stream.table.io.new_input(f.file_path).exists(), f.file_path
    scanned = stream.table.scan().to_arrow()
    assert scanned.num_rows == sum(t.num_rows for p, n in sent.items() for s in range(n) for t in batch(p, s, stream.world_size))


def test_proxy_relays_untouched(store: Store) -> None:
    stream = store.create()
    producer = stream.producer("prep-0")
    for seq in range(3):
        producer.commit(batch("prep-0", seq, 2))
    check_table(stream, {"prep-0": 3})
    assert store.proxy.requests("PUT", DATA + PART)  # the traffic went through the proxy
    assert not store.proxy.requests(action="slowdown")


def commit_all(stream: Stream, producer_id: str, n: int) -> None:
    producer = stream.producer(producer_id)
    for seq in range(n):
        producer.commit(batch(producer_id, seq, stream.world_size), seq=seq)


# --------------------------------------------------------------------------------------------------- producers


@pytest.mark.parametrize("action", ["slowdown", "lost"])
def test_every_third_data_file_upload_failing(store: Store, action: str) -> None:
    stream = store.create()
    fault = store.proxy.add(Fault("PUT", DATA + PART, action, every=3))
    commit_all(stream, "prep-0", 5)
    assert fault.fired >= 3
    store.proxy.clear()
    check_table(stream, {"prep-0": 5})


@pytest.mark.parametrize("action", ["internal"])
def test_a_data_file_failing_past_the_sdk_retries(store: Store, action: str) -> None:
    """Four failures in a row: more than pyarrow's 3 attempts, so lakestream's own retry carries it."""
    stream = store.create()
    commit_all(stream, "prep-0", 1)
    fault = store.proxy.add(Fault(None, DATA + ANY, action, times=4))
    commit_all(stream, "prep-0", 3)
    assert fault.fired == 4
    store.proxy.clear()
    check_table(stream, {"prep-0": 3})


@pytest.mark.parametrize("target", [MANIFEST_LIST, METADATA_JSON])
@pytest.mark.parametrize("times", [4])
def test_metadata_uploads_throttled(store: Store, target: str, times: int) -> None:
    stream = store.create()
    commit_all(stream, "prep-0", 1)
    fault = store.proxy.add(Fault(None, target + ANY, "slowdown", times=times))
    commit_all(stream, "prep-0", 3)
    assert fault.fired == times
    store.proxy.clear()
    check_table(stream, {"prep-0": 3})


def test_commits_retried_across_a_process_warn_once_and_count_the_rest(store: Store, caplog: pytest.LogCaptureFixture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of 8 commits has its metadata upload throttled past the SDK's retries once: the commit loop backs off and
    publishes it. One WARNING per failure kind and interval in the process, the other attempts at DEBUG."""
    from lakestream_iceberg.connect.log_limit import WarningLimit
    from lakestream_iceberg.write import commit

    monkeypatch.setattr(commit, "_failures", WarningLimit(commit.log, interval_s=3600.0), raising=False)
    stream = store.create()
    commit_all(stream, "prep-0", 1)
    producer = stream.producer("prep-0")
    caplog.set_level(logging.DEBUG, logger="lakestream_iceberg.write.commit")
    for seq in range(1, 9):
        fault = store.proxy.add(Fault(None, METADATA_JSON + ANY, "slowdown", times=4))
        producer.commit(batch("prep-0", seq, stream.world_size), seq=seq)
        assert fault.fired == 4
    failed = [r for r in caplog.records if r.name == "lakestream_iceberg.write.commit" and " fail" in r.message]
    assert len(failed) >= 8, [r.message for r in failed]  # every failed attempt is still logged
    warned = collections.Counter(r.msg for r in failed if r.levelno == logging.WARNING)
    assert warned and max(warned.values()) == 1, warned  # each kind of failure warned of once
    store.proxy.clear()
    check_table(stream, {"prep-0": 9})


@pytest.mark.parametrize("target", [METADATA_JSON])
def test_metadata_upload_completed_but_reply_lost(store: Store, target: str) -> None:
    stream = store.create()
    commit_all(stream, "prep-0", 1)
    fault = store.proxy.add(Fault("POST", target + COMPLETE, "lost", times=1))
    commit_all(stream, "prep-0", 3)
    assert fault.fired == 1
    store.proxy.clear()
    check_table(stream, {"prep-0": 3})


def test_data_upload_completed_but_reply_lost(store: Store) -> None:
    stream = store.create()
    fault = store.proxy.add(Fault("POST", DATA + COMPLETE, "lost", every=2))
    commit_all(stream, "prep-0", 4)
    assert fault.fired >= 2
    store.proxy.clear()
    check_table(stream, {"prep-0": 4})


# --------------------------------------------------------------------------------------------------- readers


def follow(store: Store, steps: int, *, rank: int = 0) -> tuple[list[tuple[int, str]], BaseException | None]:
    """(step, digest of the rank's rows) of each item a follow-mode LakestreamDataset delivers, and its error."""
    from lakestream_iceberg import LakestreamDataset

    dataset = LakestreamDataset(store.open(), rank=rank, world_size=2, follow=True, end_step=steps, timeout=60,
                                collate=lambda shard: shard.table, relay=False)  # fmt: skip
    got: list[tuple[int, str]] = []
    try:
        for step, table in enumerate(dataset, start=1):
            got.append((step, digest(table)))
    except Exception as exc:  # noqa: BLE001 - returned for the test to judge
        return got, exc
    return got, None


@needs_torch
@pytest.mark.parametrize(("every", "times"), [(2, None), (1, 4)], ids=["every-2nd", "4-in-a-row"])
def test_follower_reads_through_throttled_gets(store: Store, every: int, times: int | None) -> None:
    """Four failures in a row outlast pyarrow's 3 attempts: the dataset retries a step's read for
    ``lakestream.io.retry-timeout-ms``, as ``stream.read`` does, rather than ending the epoch with the raw OSError."""
    stream = store.create()
    fault = store.proxy.add(Fault("GET", DATA + ANY, "slowdown", every=every, times=times))
    result: list[Any] = []
    reader = threading.Thread(target=lambda: result.append(follow(store, 4)))
    reader.start()
    commit_all(stream, "prep-0", 4)
    reader.join(600)  # a hang guard only: the reader ends at step 4
    assert not reader.is_alive()
    got, error = result[0]
    assert error is None, repr(error)
    assert got == [(seq + 1, digest(batch("prep-0", seq, 2)[0])) for seq in range(4)]
    assert fault.fired >= 2
    store.proxy.clear()
    check_table(stream, {"prep-0": 4})


def test_reads_retried_across_a_process_warn_once_and_count_the_rest(store: Store, caplog: pytest.LogCaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 throttling a fleet: each of 12 reads outlasts pyarrow's 3 attempts once, and lakestream retries it. That was a
    WARNING per retry (per thread, per process: thousands of lines at 1,000 ranks); now one per failure class and
    interval, the other retries at DEBUG, counted into the next warning."""
    from lakestream_iceberg.connect import retry
    from lakestream_iceberg.connect.log_limit import WarningLimit

    # this process's limit as a fresh one (earlier tests warned already), the whole test inside one interval
    monkeypatch.setattr(retry, "_retries", WarningLimit(retry.log, interval_s=3600.0), raising=False)
    stream = store.create()
    commit_all(stream, "prep-0", 12)
    reader = store.open()
    caplog.set_level(logging.DEBUG, logger="lakestream_iceberg.connect.retry")
    for step in range(1, 13):
        name = reader.locate(step)[1].file_path.rsplit("/", 1)[1]
        fault = store.proxy.add(Fault("GET", re.escape(name) + ANY, "slowdown", times=4))
        assert digest(reader.read(step, rank=1)) == digest(batch("prep-0", step - 1, 2)[1])
        assert fault.fired == 4
    retried = [r for r in caplog.records if r.name == "lakestream_iceberg.connect.retry" and "retrying in" in r.message]
    assert len(retried) >= 12  # every retry is still logged
    assert [r.levelname for r in retried].count("WARNING") == 1, [r.message for r in retried]


# --------------------------------------------------------------------------------------------------- GC


def collect(stream: Stream) -> Any:
    return stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)


def gc_setup(store: Store) -> tuple[Stream, set[str]]:
    """Six steps, a checkpoint at 5: GC collects steps 1..4; returns the data files that must stay."""
    stream = store.create()
    commit_all(stream, "prep-0", 6)
    stream.checkpoint("c5", step=5)
    keep = {f.file_path for step in (5, 6) for f in stream.locate(step)}
    return stream, keep


def data_files(stream: Stream) -> set[str]:
    from lakestream_iceberg.connect.storage import list_files

    return {p for p, _, _ in list_files(stream.table.io, f"{stream.table.location()}/data")}


@pytest.mark.parametrize(("every", "times"), [(1, 4)], ids=["4-in-a-row"])
def test_gc_deletes_throttled(store: Store, every: int, times: int | None) -> None:
    stream, keep = gc_setup(store)
    fault = store.proxy.add(Fault("DELETE", "", "slowdown", every=every, times=times))
    report = collect(stream)
    assert fault.fired >= 1
    store.proxy.clear()
    if report.files_failed:  # left for the next GC, which deletes them
        assert report.first_failure and "SLOW_DOWN" in report.first_failure
        assert collect(stream).files_failed == 0
    assert data_files(stream) == keep
    check_table_from(stream, 5, 6)


@pytest.mark.parametrize("times", [1])
def test_gc_listing_throttled(store: Store, times: int) -> None:
    stream, keep = gc_setup(store)
    fault = store.proxy.add(Fault("GET", r"[?&]list-type=2", "slowdown", times=times))
    collect(stream)
    assert fault.fired == times
    store.proxy.clear()
    collect(stream)
    assert data_files(stream) == keep
    check_table_from(stream, 5, 6)


def check_table_from(stream: Stream, first: int, last: int) -> None:
    stream.refresh()
    assert stream.head_step() == last
    for step in range(first, last + 1):
        for rank in range(stream.world_size):
            assert digest(stream.read(step, rank=rank)) == digest(batch("prep-0", step - 1, 2)[rank])


# --------------------------------------------------------------------------------------------------- persisting


@pytest.mark.parametrize("target", [DATA, METADATA_JSON])
def test_a_persisting_failure_publishes_nothing_and_the_retry_publishes_once(store: Store, target: str) -> None:
    """Storage answering 503 for good: the commit fails within its budgets and publishes nothing; once the store
    recovers, the same seq is published once (an explicit seq, and a seq=None retry through the same producer)."""
    stream = store.create(**{"lakestream.io.retry-timeout-ms": "500", "lakestream.commit.timeout-ms": "1500"})
    commit_all(stream, "prep-0", 1)
    producer = stream.producer("prep-0")
    store.proxy.add(Fault(None, target + ANY, "slowdown"))
    with pytest.raises(CommitError) as failed:  # not the storage's raw OSError
        producer.commit(batch("prep-0", 1, 2), seq=1)
    if target == DATA:  # its files never written: nothing can have been published
        assert isinstance(failed.value, CommitTimeoutError) and "nothing was published" in str(failed.value)
        assert "object store" in failed.value.why and "SLOW_DOWN" in failed.value.why
    else:  # metadata.json written or not: the table cannot be read back to tell
        assert isinstance(failed.value, CommitOutcomeUnknownError), repr(failed.value)
        assert "back from the object store" in str(failed.value) and "same seq" in str(failed.value)
    store.proxy.clear()
    stream.refresh()
    assert stream.head_step() == 1, failed.value
    assert producer.commit(batch("prep-0", 1, 2), seq=1).step == 2
    assert producer.commit(batch("prep-0", 1, 2), seq=1).duplicate
    check_table(stream, {"prep-0": 2})


@needs_torch
def test_a_read_the_store_keeps_refusing_raises_a_read_error_and_reads_once_it_recovers(store: Store) -> None:
    stream = store.create(**{"lakestream.io.retry-timeout-ms": "500"})
    commit_all(stream, "prep-0", 2)
    store.proxy.add(Fault("GET", DATA + ANY, "unavailable"))
    with pytest.raises(ReadError, match="kept failing for lakestream.io.retry-timeout-ms") as failed:
        store.open().read(2, rank=1)
    assert "the step is intact" in str(failed.value) and isinstance(failed.value.__cause__, OSError)
    got, error = follow(store, 2)
    assert isinstance(error, ReadError) and "kept failing" in str(error), repr(error)  # the dataset says the same
    store.proxy.clear()
    assert digest(store.open().read(2, rank=1)) == digest(batch("prep-0", 1, 2)[1])


def test_group_commit_with_throttled_intents(store: Store) -> None:
    """Two producers on one stream (group commit: staged intents) while every 3rd upload is throttled."""
    stream = store.create()
    other = store.open()
    store.proxy.add(Fault("PUT", r"\?partNumber=", "slowdown", every=3))
    errors: list[BaseException] = []

    def run(s: Stream, name: str) -> None:
        try:
            commit_all(s, name, 2)
        except BaseException as exc:  # noqa: BLE001 - judged below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s, n)) for s, n in ((stream, "prep-0"), (other, "prep-1"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)  # a hang guard only: each producer ends after its 2 batches
    assert not any(t.is_alive() for t in threads) and not errors, errors
    store.proxy.clear()
    check_table(stream, {"prep-0": 2, "prep-1": 2})


# a REST catalog's table commit (POST /v1/{prefix}/namespaces/{ns}/tables/{table}); a create POSTs to .../tables
REST_TABLE_COMMIT = r"/namespaces/[^/?]+/tables/[^/?]+$"


@pytest.fixture
def rest_proxy(request: pytest.FixtureRequest) -> Iterator[tuple[FaultyS3, Any, Any]]:
    """SeaweedFS's REST catalog reached through a :class:`FaultyS3`, a stream on it and a producer that published
    seq 0 at step 1: (proxy, backend, producer)."""
    from catalog import services
    from tests.backends import Backend

    weed = request.getfixturevalue("seaweedfs_service")
    with FaultyS3(target_port=weed.ports["iceberg"]) as proxy:
        props = services.rest_seaweedfs(weed)
        props["uri"] = proxy.endpoint
        backend = Backend(kind="rest-seaweedfs", properties=props, namespace=fresh_name("ns"))
        try:
            catalog = backend.catalog()
            catalog.create_namespace_if_not_exists(backend.namespace)
            stream = Stream.create(catalog, backend.identifier(), schema=SCHEMA, world_size=2)
            producer = stream.producer("p")
            producer.commit(batch("p", 0, 2), seq=0)
            yield proxy, backend, producer
        finally:
            backend.close()


@pytest.mark.parametrize(("refusal", "said"), [
    ("rest-forbidden", r"refused this request \(403 Forbidden\): the principal .* permission"),
    ("rest-unauthorized", "rejected the request signature"),  # SeaweedFS's catalog authenticates by SigV4
], ids=["403", "401"])
def test_a_rest_catalog_that_refuses_the_commit_fails_it_at_once_naming_the_setting(
        rest_proxy: tuple[FaultyS3, Any, Any], refusal: str, said: str) -> None:
    """A 403 or 401 answer to the table commit is a refusal, not an unknown outcome: the catalog applied nothing, and
    no retry changes it. The commit loop read the head back and tried again until its budget was spent (5 minutes by
    default), logging a warning per attempt; it is the ConfigError naming the setting, after one attempt, and the
    same seq publishes once when the catalog accepts it."""
    proxy, backend, producer = rest_proxy
    fault = proxy.add(Fault("POST", REST_TABLE_COMMIT, refusal))
    with pytest.raises(ConfigError, match=f"table commit: the REST catalog {said}.*client.secret-access-key"):
        producer.commit(batch("p", 1, 2), seq=1)
    assert fault.fired == (1 if refusal == "rest-forbidden" else 2)  # pyiceberg asks again once after a 401
    proxy.clear()
    assert published(Stream.open(backend.catalog(), backend.identifier())) == {1: ("p", 0)}
    result = producer.commit(batch("p", 1, 2), seq=1)
    assert (result.step, result.duplicate) == (2, False)
    assert published(Stream.open(backend.catalog(), backend.identifier())) == {1: ("p", 0), 2: ("p", 1)}


def test_a_rest_catalog_that_refuses_to_load_the_table_fails_a_commit_and_a_read_at_once(
        rest_proxy: tuple[FaultyS3, Any, Any]) -> None:
    """A 403 to reading the table back (GET .../tables/{table}) is as final as one to the commit: a producer whose commit
    had an unknown outcome (a 500) read the head back until its budget was spent, then blamed the unknown outcome; it is
    the ConfigError, at once, for the producer and for a reader alike."""
    proxy, backend, producer = rest_proxy
    stream = Stream.open(backend.catalog(), backend.identifier())
    proxy.add(Fault("POST", REST_TABLE_COMMIT, "internal", times=1))  # outcome unknown: the head is read back
    loads = proxy.add(Fault("GET", REST_TABLE_COMMIT, "rest-forbidden"))
    with pytest.raises(ConfigError, match=r"refused this request \(403 Forbidden\)"):
        producer.commit(batch("p", 1, 2), seq=1)
    with pytest.raises(ConfigError, match=r"refused this request \(403 Forbidden\)"):
        stream.refresh()
    assert loads.fired <= 2
    proxy.clear()
    assert producer.commit(batch("p", 1, 2), seq=1).step == 2


def test_a_refusal_after_a_commit_that_may_have_landed_tells_a_seq_none_caller_its_seq(
        rest_proxy: tuple[FaultyS3, Any, Any]) -> None:
    """The commit landed but its answer was lost (outcome unknown), and reading the table back was then refused (403):
    the ConfigError ends the call at once. A caller that let the producer number the batch (seq=None) must learn the
    seq to retry it with, as a CommitOutcomeUnknownError tells it: a restarted producer numbers a seq=None retry after
    the table's last seq, which is this very batch's, and publishes it twice."""
    proxy, backend, producer = rest_proxy
    proxy.add(Fault("POST", REST_TABLE_COMMIT, "lost", times=1))  # it landed; the answer never came
    proxy.add(Fault("GET", REST_TABLE_COMMIT, "rest-forbidden"))
    with pytest.raises(ConfigError, match=r"refused this request \(403 Forbidden\)") as raised:
        producer.commit(batch("p", 1, 2))
    told = "\n".join([str(raised.value), *getattr(raised.value, "__notes__", [])])
    assert "seq=1" in told, told
    proxy.clear()
    assert published(Stream.open(backend.catalog(), backend.identifier())) == {1: ("p", 0), 2: ("p", 1)}
    # the retry it was told to make publishes nothing more
    retried = Stream.open(backend.catalog(), backend.identifier()).producer("p")
    assert retried.commit(batch("p", 1, 2), seq=1).duplicate
    retried.close()
