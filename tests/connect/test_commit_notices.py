"""Commit notifications for holding producers on PostgreSQL (connect/notify.py ``CommitNotices``, connect/direct.py):
a hold LISTENs on the process's direct connection while it waits, wakes when a commit lands, and leaves nothing
behind (no channel listened on, no notification piling up in the driver)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.connect.direct import DirectConnections
from lakestream_iceberg.connect.notify import CommitNotices, channel
from tests.backends import postgres_service
from tests.connect.test_direct_postgres import WORLD, backend_pid, pg_catalog, pg_uri, probed, wait_until_gone
from tests.support import batch, shard

__all__ = ["pg_uri", "postgres_service"]

pytestmark = pytest.mark.services

PATIENCE_S = 600.0  # a safety net only: every wait below ends as soon as what it waits for happened


def listened(direct: DirectConnections) -> list[str]:
    """The channels the process's direct connection listens on, as the server says."""
    return sorted(row[0] for row in direct.execute("SELECT pg_listening_channels()").fetchall())


def test_a_waiter_wakes_when_another_process_commits_and_the_last_one_out_unlistens(pg_uri: str,
                                                                                     tmp_path: Path) -> None:
    cat, stream, _probe, direct = probed(pg_uri, tmp_path)
    name = channel(cat.name, ("ns", "s"))
    pid = backend_pid(direct)
    assert direct.listen(name) and direct.listen(name)  # two holding threads: one LISTEN
    assert listened(direct) == [name] and direct.open_connections() == 1 and backend_pid(direct) == pid
    seen, heard = direct.notified(name), direct.heard(name)

    other = pg_catalog(pg_uri, tmp_path)  # another process's commit (its own engine and connections)
    committer = threading.Thread(target=lambda: Stream.open(other, "ns.s").producer("p").commit(batch("p", 0, WORLD)))
    committer.start()
    deadline = time.monotonic() + PATIENCE_S
    while (count := direct.wait_notified(name, seen, 1.0)) == seen:
        assert time.monotonic() < deadline, "no notification"
    committer.join()
    assert count == seen + 1 and direct.heard(name) == heard + 1
    assert direct.wait_notified(name, seen, PATIENCE_S) == count  # an earlier count: answered at once

    direct.unlisten(name)
    assert listened(direct) == [name]  # the other thread still waits
    direct.unlisten(name)
    assert listened(direct) == []


def test_notifications_arriving_during_statements_are_counted_and_not_kept_in_the_driver(pg_uri: str,
                                                                                         tmp_path: Path) -> None:
    """A holder's own statements (probes, intents) read the notifications that came meanwhile: they are counted for
    the waiters, and the driver's list stays empty however many commits land."""
    cat, stream, probe, direct = probed(pg_uri, tmp_path)
    name = channel(cat.name, ("ns", "s"))
    assert direct.listen(name)
    before = direct.heard(name)
    producer = Stream.open(pg_catalog(pg_uri, tmp_path), "ns.s").producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, WORLD))
    deadline = time.monotonic() + PATIENCE_S
    while direct.heard(name) < before + 3:  # each probe takes in what the server sent since
        assert time.monotonic() < deadline, f"{direct.heard(name) - before} of 3 notifications"
        probe()
    assert direct.heard(name) == before + 3
    assert direct.connection().notifies == []
    direct.unlisten(name)


def test_a_connection_replaced_after_the_server_ended_it_listens_again_and_tells_the_waiters_to_look(
        pg_uri: str, tmp_path: Path) -> None:
    cat, stream, probe, direct = probed(pg_uri, tmp_path)
    name = channel(cat.name, ("ns", "s"))
    assert direct.listen(name)
    first, seen = backend_pid(direct), direct.notified(name)
    with cat.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT pg_terminate_backend(%(pid)s)", {"pid": first}).scalar() is True
    wait_until_gone(cat, first)
    # a waiter on the dead connection sees it readable (closed) and returns: nothing to count, no error
    assert direct.wait_notified(name, seen, 0.0) == seen
    assert probe() == stream.table.metadata_location  # the next statement opens a new connection, which listens
    assert backend_pid(direct) != first and listened(direct) == [name]
    assert direct.notified(name) == seen + 1 and direct.heard(name) == 0  # look again; nothing was heard
    direct.unlisten(name)
    assert listened(direct) == []


def test_notices_are_proven_by_a_notification_and_given_up_where_none_ever_arrives(pg_uri: str,
                                                                                    tmp_path: Path) -> None:
    """A pooler in transaction mode accepts LISTEN but delivers nothing: after GIVE_UP holds that saw the head move
    and heard nothing, the process stops listening and holds poll as they did before. A notification proves them."""
    cat, stream, _probe, direct = probed(pg_uri, tmp_path)
    notices = CommitNotices.open(stream.table)
    assert notices is not None and notices.channel == channel(cat.name, ("ns", "s"))
    deaf = CommitNotices(direct, channel(cat.name, ("ns", "no-such-table")))  # LISTEN works, nothing ever comes
    for _ in range(CommitNotices.GIVE_UP - 1):
        assert deaf.start() is not None
        deaf.stop(moved=True)
    assert not deaf.off and listened(direct) == []
    assert deaf.start() is not None
    deaf.stop(moved=False)  # a hold that saw no move tells nothing
    assert not deaf.off
    assert deaf.start() is not None
    deaf.stop(moved=True)
    assert deaf.off and deaf.start() is None and listened(direct) == []

    seen = notices.start()
    assert seen is not None and not notices.proven
    stream.producer("p").commit(batch("p", 0, WORLD))  # this process's own commit notifies its listening connection
    deadline = time.monotonic() + PATIENCE_S
    while notices.wait(seen, 1.0) == seen:
        assert time.monotonic() < deadline, "no notification"
    notices.stop(moved=True)
    assert notices.proven and not notices.off and listened(direct) == []


def test_producers_holding_for_group_commit_on_postgresql_publish_each_batch_once_and_leave_no_listener(
        pg_uri: str, tmp_path: Path) -> None:
    """Threads of one process committing back to back hold for each other's group commits, listening on their shared
    connection: every batch lands once, in dense steps, the holds heard the commits, and no channel stays listened."""
    cat, stream, _probe, direct = probed(pg_uri, tmp_path)
    name = channel(cat.name, ("ns", "s"))
    producers, batches = 4, 6
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            producer = stream.producer(f"p{index}")
            for seq in range(batches):
                producer.commit([shard(f"p{index}", seq, rank, rows=1) for rank in range(WORLD)])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert stream.head_step() == producers * batches
    published = [(row["producer"], row["seq"]) for step in range(1, producers * batches + 1)
                 for row in stream.read(step, rank=0, columns=["producer", "seq"]).to_pylist()]
    assert sorted(published) == sorted((f"p{i}", s) for i in range(producers) for s in range(batches))
    assert listened(direct) == [] and direct.connection().notifies == []
    assert direct.open_connections() == 1
    assert direct.heard(name) > 0  # the holds were woken by commits, not only by their polls
