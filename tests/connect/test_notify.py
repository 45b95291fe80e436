"""Commit notifications on PostgreSQL catalogs (connect/notify.py): followers wake on a commit, not on a poll."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from catalog import services
from lakestream_iceberg import Stream
from lakestream_iceberg.connect.notify import HeadListener, channel, notifies
from lakestream_iceberg.read.follow import HeadWatcher
from tests.backends import fresh_name, postgres_service
from tests.support import SCHEMA, batch, sqlite_catalog

__all__ = ["postgres_service"]

WORLD = 2
NEVER = 3600.0  # a polling interval no test waits out: only a notification can wake the follower in time


@pytest.fixture
def pg_catalog(postgres_service: services.Postgres, tmp_path: Path) -> SqlCatalog:
    database = fresh_name("db")
    postgres_service.create_database(database)
    return SqlCatalog("pg", uri=postgres_service.sqlalchemy_uri(database), warehouse=f"file://{tmp_path}/warehouse")


def follow_in_thread(stream: Stream, step: int) -> tuple[threading.Thread, list[object], HeadWatcher]:
    watcher = HeadWatcher(stream, branch="main")
    got: list[object] = []

    def run() -> None:
        got.append(watcher.wait(step, timeout=None, stop=threading.Event(), poll_s=NEVER, max_poll_s=NEVER))

    thread = threading.Thread(target=run, daemon=True)
    return thread, got, watcher


@pytest.mark.services
def test_a_follower_wakes_on_the_commit_not_on_its_polling_interval(pg_catalog: SqlCatalog) -> None:
    assert notifies(pg_catalog)
    stream = Stream.create(pg_catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    follower = Stream.open(pg_catalog, "ns.stream")
    thread, got, watcher = follow_in_thread(follower, 2)
    thread.start()
    while watcher._listener is None and thread.is_alive():  # noqa: SLF001 - until it LISTENs (observed, not timed)
        time.sleep(0.005)
    producer = stream.producer("p")
    producer.commit(batch("p", 0, WORLD))  # step 1: wakes the follower, which waits on for step 2
    producer.commit(batch("p", 1, WORLD))
    thread.join(timeout=600)  # a safety net only: a follower relying on polling would sleep NEVER seconds
    assert not thread.is_alive(), "the follower was not woken by the commits"
    head, snapshot = got[0]  # type: ignore[misc]
    assert head == 2 and snapshot is not None
    assert watcher.notifications >= 1 and watcher.polls <= 4  # woken by notifications, polled once per wake
    watcher.close()


@pytest.mark.services
def test_wait_for_returns_on_the_notification(pg_catalog: SqlCatalog) -> None:
    stream = Stream.create(pg_catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    out: list[int] = []
    thread = threading.Thread(target=lambda: out.append(Stream.open(pg_catalog, "ns.stream").wait_for(
        1, timeout=NEVER, poll_s=NEVER)), daemon=True)
    thread.start()
    producer, seq = stream.producer("p"), 0
    while thread.is_alive() and seq < 1000:  # its LISTEN may start after a commit: commit until one wakes it
        producer.commit(batch("p", seq, WORLD))
        seq += 1
        thread.join(timeout=0.05)
    thread.join(timeout=600)
    assert not thread.is_alive() and out and 1 <= out[0] <= seq


@pytest.mark.services
def test_a_listener_whose_connection_breaks_falls_back_to_polling(pg_catalog: SqlCatalog) -> None:
    stream = Stream.create(pg_catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    listener = HeadListener.open(stream.table)
    assert listener is not None and listener.alive
    listener._conn.close()  # noqa: SLF001 - as if the server had dropped it
    assert listener.wait(0.01) is False and not listener.alive
    watcher = HeadWatcher(stream, branch="main")
    watcher._listener = listener  # noqa: SLF001 - a dead listener: pause() sleeps instead
    watcher._listen = False  # noqa: SLF001
    stream.producer("p").commit(batch("p", 0, WORLD))
    assert watcher.wait(1, timeout=600, stop=threading.Event(), poll_s=0.01, max_poll_s=0.05)[0] == 1  # type: ignore[index]


def test_sqlite_catalogs_send_no_notifications_and_followers_poll(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    assert not notifies(catalog)
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    assert HeadListener.open(stream.table) is None
    watcher = HeadWatcher(stream, branch="main")
    stream.producer("p").commit(batch("p", 0, WORLD))
    assert watcher.wait(1, timeout=600, stop=threading.Event(), poll_s=0.01, max_poll_s=0.05)[0] == 1  # type: ignore[index]
    assert watcher.notifications == 0


def test_channel_names_are_short_identifiers_distinct_per_table() -> None:
    a = channel("prod", ("ns", "stream"))
    assert a.startswith("lakestream_") and len(a) <= 63 and a.isidentifier()
    assert a != channel("prod", ("ns", "other")) and a != channel("dev", ("ns", "stream"))
    assert len(channel("prod", ("ns", "x" * 500))) == len(a)


@pytest.mark.services
def test_a_forked_childs_copy_of_a_listener_leaves_the_parents_connection_alone(pg_catalog: SqlCatalog) -> None:
    """A process forked while it listens (a DataLoader starting its workers) gets a copy of the listener; closing or
    dropping that copy in the child must not end the parent's connection (freeing a psycopg2 connection sends the
    server a goodbye on the socket both processes share), and the copy must not read the parent's notifications."""
    import gc
    import os

    stream = Stream.create(pg_catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    listener = HeadListener.open(Stream.open(pg_catalog, "ns.stream").table)
    assert listener is not None
    pid = os.fork()
    if pid == 0:  # the child: exits without running the parent's cleanups
        code = 1
        try:
            copy = listener
            code = 2 if copy.alive or copy.wait(0.0) else 0
            copy.close()
            del copy
            gc.collect()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    stream.producer("p").commit(batch("p", 0, WORLD))
    assert listener.wait(600.0), "the parent's listener stopped: the child ended its connection"
    assert listener.alive
    listener.close()
    assert os.waitstatus_to_exitcode(status) == 0, "the child's copy was alive"


@pytest.mark.services
def test_a_listener_on_a_descriptor_past_1024_keeps_listening(postgres_service: services.Postgres,
                                                              tmp_path: Path) -> None:
    """A trainer with many open files or sockets gets descriptors from 1024 up, which select() refuses: the listener
    waits on them all the same (poll), instead of turning itself off at its first idle wait."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        if hard != resource.RLIM_INFINITY and hard < 1200:
            pytest.skip(f"at most {hard} open files here")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        database = fresh_name("db")
        postgres_service.create_database(database)
        catalog = SqlCatalog("pg", uri=postgres_service.sqlalchemy_uri(database),
                             warehouse=f"file://{tmp_path}/warehouse")
        stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
        listener = HeadListener.open(Stream.open(catalog, "ns.stream").table)
        assert listener is not None
        assert listener._conn.fileno() >= 1024  # noqa: SLF001 - the case under test
        assert not listener.wait(0.01) and listener.alive  # nothing committed yet: an idle wait, still listening
        stream.producer("p").commit(batch("p", 0, WORLD))
        assert listener.wait(600.0) and listener.received >= 1
        listener.close()
        catalog.engine.dispose()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
