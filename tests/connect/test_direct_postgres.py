"""Direct connections on PostgreSQL catalogs (connect/direct.py): the pointer probe and the staged intents run on one
autocommit connection per thread, outside SQLAlchemy's pool, and see every commit at once."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.errors
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from sqlalchemy import create_engine, event
from sqlalchemy.pool import NullPool

from catalog import services
from lakestream_iceberg import Stream
from lakestream_iceberg.connect.diagnose import transient
from lakestream_iceberg.connect.direct import DirectConnections, direct_connections
from lakestream_iceberg.connect.intents import INTENT_TABLE, IntentTable
from lakestream_iceberg.connect.pointer import pointer_probe, release_idle_connections
from lakestream_iceberg.errors import ProducerConflictError
from tests.backends import fresh_name, postgres_service
from tests.support import SCHEMA, batch

__all__ = ["postgres_service"]

WORLD = 2
pytestmark = pytest.mark.services


@pytest.fixture
def pg_uri(postgres_service: services.Postgres) -> str:
    database = fresh_name("db")
    postgres_service.create_database(database)
    return postgres_service.sqlalchemy_uri(database)


def pg_catalog(uri: str, tmp_path: Path) -> SqlCatalog:
    return SqlCatalog("pg", uri=uri, warehouse=f"file://{tmp_path}/warehouse")


def probed(uri: str, tmp_path: Path) -> tuple[SqlCatalog, Stream, Callable[[], str | None], DirectConnections]:
    """A stream on a fresh PostgreSQL catalog, its pointer probe and the process's direct connections, probed once."""
    cat = pg_catalog(uri, tmp_path)
    stream = Stream.create(cat, "ns.s", schema=SCHEMA, world_size=WORLD)
    probe = pointer_probe(stream.table)
    direct = direct_connections(cat.engine)
    assert probe is not None and direct is not None and direct.dialect == "postgresql"
    assert probe() == stream.table.metadata_location
    return cat, stream, probe, direct


def backend_pid(direct: DirectConnections) -> int:
    return int(direct.connection().info.backend_pid)


def session_state(catalog: SqlCatalog, pid: int) -> str | None:
    """What the server says the session ``pid`` is doing (None when it has no such session)."""
    with catalog.engine.connect() as conn:
        return conn.exec_driver_sql("SELECT state FROM pg_stat_activity WHERE pid = %(pid)s", {"pid": pid}).scalar()


def wait_until_gone(catalog: SqlCatalog, pid: int) -> None:
    """Until the server no longer lists session ``pid`` (a backend exits after its client closed the connection)."""
    deadline = time.monotonic() + 600  # a safety net only: the loop ends as soon as the server drops the session
    while session_state(catalog, pid) is not None:
        assert time.monotonic() < deadline, f"session {pid} still listed"
        time.sleep(0.01)


def test_the_probe_and_the_intents_run_on_one_autocommit_connection_that_sees_other_commits(pg_uri: str,
                                                                                          tmp_path: Path) -> None:
    """Through SQLAlchemy each probe cost BEGIN, the query and ROLLBACK (three round trips); on the direct connection
    it is one statement, and the connection never stays in a transaction (which would pin an old snapshot)."""
    cat, stream, probe, direct = probed(pg_uri, tmp_path)
    checkouts: list[object] = []
    event.listen(cat.engine, "checkout", lambda *_: checkouts.append(1))
    intents = IntentTable.of(cat)
    assert intents is not None
    folder = f"{stream.table.location()}/data/_staging/main"
    intents.insert(f"{folder}/p@000000000001-t.parquet", '{"seq": 1}')  # creates the table: pooled, once
    checkouts.clear()
    intents.insert(f"{folder}/p@000000000001-t.parquet", '{"seq": 1}')  # the same body again: a no-op
    with pytest.raises(ProducerConflictError, match="same producer id"):
        intents.insert(f"{folder}/p@000000000001-t.parquet", '{"seq": 2}')
    intents.insert(f"{folder}/q@000000000001-t.parquet", '{"seq": 1}')
    assert intents.exists(f"{folder}/q@000000000001-t.parquet")
    assert intents.body(f"{folder}/p@000000000001-t.parquet") == '{"seq": 1}'
    rows = intents.listing(folder, bodies=True)
    assert [(r.path.rsplit("/", 1)[1], r.body) for r in rows] == [("p@000000000001-t.parquet", '{"seq": 1}'),
                                                                   ("q@000000000001-t.parquet", '{"seq": 1}')]
    assert rows[0].order < rows[1].order and all(0 <= r.age_s < 3600 for r in rows)
    assert intents.expire(folder, older_than_s=3600, delete=True) == []  # none that old
    intents.delete([r.path for r in rows] + [f"{folder}/gone@000000000009-t.parquet"])  # one statement for all
    assert intents.listing(folder, bodies=False) == []
    assert checkouts == []  # nothing above took a pooled connection
    pid = backend_pid(direct)
    assert session_state(cat, pid) == "idle"  # not "idle in transaction"

    other = pg_catalog(pg_uri, tmp_path)  # another catalog (its own engine) commits
    Stream.open(other, "ns.s").producer("p").commit(batch("p", 0, WORLD))
    now = other.load_table("ns.s").metadata_location
    assert now != stream.table.metadata_location and probe() == now  # seen at once
    assert direct.open_connections() == 1 and backend_pid(direct) == pid


def test_a_connection_the_server_ended_is_replaced_on_the_next_statement(pg_uri: str, tmp_path: Path) -> None:
    """A server restart, or a proxy closing an idle connection: the statement that meets the dead connection runs again
    on a new one, and the caller sees its answer, not the driver's error."""
    cat, stream, probe, direct = probed(pg_uri, tmp_path)
    first = backend_pid(direct)
    with cat.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT pg_terminate_backend(%(pid)s)", {"pid": first}).scalar() is True
    wait_until_gone(cat, first)
    assert probe() == stream.table.metadata_location
    assert backend_pid(direct) != first and direct.open_connections() == 1
    stream.producer("p").commit(batch("p", 0, WORLD))  # group commit stages and polls on the new one
    assert stream.head_step() == 1 and probe() == cat.load_table("ns.s").metadata_location


def test_the_threads_of_a_process_share_one_connection_which_a_disposed_engine_closes(pg_uri: str,
                                                                                     tmp_path: Path) -> None:
    """One connection per process, whatever its threads (a relay holder, prefetch threads, a committer): a thousand
    ranks or producers must not multiply the server's connections by their threads."""
    cat, stream, probe, direct = probed(pg_uri, tmp_path)
    mine = backend_pid(direct)
    answers: list[str | None] = []
    threads = [threading.Thread(target=lambda: answers.extend(probe() for _ in range(50))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [stream.table.metadata_location] * 400
    assert direct.open_connections() == 1 and backend_pid(direct) == mine
    cat.engine.dispose()  # catalog.close(), release_idle_connections()
    assert direct.open_connections() == 0
    wait_until_gone(cat, mine)
    assert probe() == stream.table.metadata_location  # and the next statement opens a new one
    assert direct.open_connections() == 1


def test_a_catalog_dropped_after_its_streams_were_used_frees_its_engine_and_its_connections(pg_uri: str,
                                                                                         tmp_path: Path) -> None:
    """A process that loads a catalog per task (an unpickled stream, a Ray task, a retry loop) and drops it must not keep
    its connections: the direct connections' registry is keyed weakly by engine, and its value held the engine
    strongly (the opener's closure, ``on_dead=engine.dispose``), so no engine a stream had probed on was ever freed,
    and each kept its pooled connection and its direct one open until the server ran out of ``max_connections``."""
    import gc
    import weakref

    cat = pg_catalog(pg_uri, tmp_path)
    Stream.create(cat, "ns.s", schema=SCHEMA, world_size=WORLD).producer("p").commit(batch("p", 0, WORLD))
    database = pg_uri.rsplit("/", 1)[1]

    def sessions() -> int:  # this database's sessions, less the counting one
        with cat.engine.connect() as conn:
            return int(conn.exec_driver_sql("SELECT count(*) FROM pg_stat_activity WHERE datname = %(db)s "
                                            "AND pid <> pg_backend_pid()", {"db": database}).scalar())

    before = sessions()
    engines = []
    for _ in range(12):
        other = pg_catalog(pg_uri, tmp_path)
        stream = Stream.open(other, "ns.s")
        assert stream.head_step() == 1 and pointer_probe(stream.table)() == stream.table.metadata_location
        assert direct_connections(other.engine).open_connections() == 1  # the probe ran on the direct connection
        engines.append(weakref.ref(other.engine))
        del other, stream
        gc.collect()
    assert [e for e in engines if e() is not None] == []
    deadline = time.monotonic() + 600  # a safety net only: a closed client's backend exits at once
    while sessions() > before:
        assert time.monotonic() < deadline, f"{sessions() - before} sessions of dropped catalogs still open"
        time.sleep(0.01)


def _child_probe(probe: Any, direct: DirectConnections, conn: Any) -> None:
    conn.send((probe(), backend_pid(direct)))  # forked: both came with the parent's memory, not pickled


def test_a_forked_child_opens_its_own_connection_and_leaves_its_parents_working(pg_uri: str, tmp_path: Path) -> None:
    cat, stream, probe, direct = probed(pg_uri, tmp_path)
    parent = backend_pid(direct)
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_probe, args=(probe, direct, send))
    child.start()
    found, childs = receive.recv()
    child.join()
    assert child.exitcode == 0
    assert found == stream.table.metadata_location and childs != parent
    assert probe() == stream.table.metadata_location and backend_pid(direct) == parent  # the parent's still works
    assert session_state(cat, parent) == "idle"


def _notifications(conn: Any, *, until: int) -> list[str]:
    """The payloads on ``conn`` once at least ``until`` arrived (waiting on its socket; a safety net only)."""
    from lakestream_iceberg.connect.notify import readable

    deadline = time.monotonic() + 600
    conn.poll()
    while len(conn.notifies) < until:
        assert time.monotonic() < deadline, f"{len(conn.notifies)} of {until} notifications"
        readable(conn, 1.0)
        conn.poll()
    got = [n.payload for n in conn.notifies]
    conn.notifies.clear()
    return got


def test_the_swap_is_one_statement_that_changes_and_notifies_only_when_it_wins(pg_uri: str, tmp_path: Path) -> None:
    """The conditional UPDATE and its pg_notify run as one statement on the direct connection: a swap from stale
    metadata changes nothing and notifies nobody, a won swap moves the pointer and sends exactly its location."""
    from pyiceberg.exceptions import CommitFailedException
    from pyiceberg.table.update import SetPropertiesUpdate

    from lakestream_iceberg.connect.notify import channel
    from lakestream_iceberg.connect.swap import swap, swaps_from_held

    cat = pg_catalog(pg_uri, tmp_path)
    stream = Stream.create(cat, "ns.s", schema=SCHEMA, world_size=WORLD)
    assert swaps_from_held(stream.table)
    raw = cat.engine.raw_connection()
    raw.detach()
    listen = raw.dbapi_connection
    listen.autocommit = True
    listen.cursor().execute(f'LISTEN "{channel(cat.name, ("ns", "s"))}"')
    stale = cat.load_table("ns.s")
    stream.producer("p").commit(batch("p", 0, WORLD))
    assert _notifications(listen, until=1) == [cat.load_table("ns.s").metadata_location]
    checkouts: list[object] = []
    event.listen(cat.engine, "checkout", lambda *_: checkouts.append(1))
    with pytest.raises(CommitFailedException, match="updated by another process"):
        swap(stale, (), (SetPropertiesUpdate(updates={"lost": "yes"}),))
    after = cat.load_table("ns.s")
    assert "lost" not in after.properties and after.metadata_location != stale.metadata_location
    checkouts.clear()
    won = swap(after, (), (SetPropertiesUpdate(updates={"won": "yes"}),))
    assert checkouts == []  # the swap itself took no pooled connection
    assert cat.load_table("ns.s").properties["won"] == "yes"
    assert cat.load_table("ns.s").metadata_location == won.metadata_location
    assert _notifications(listen, until=1) == [won.metadata_location]  # the lost swap sent none
    listen.close()


def test_a_statement_the_server_cancels_keeps_the_connection_and_stays_retryable(pg_uri: str, tmp_path: Path) -> None:
    """``statement_timeout`` in the catalog's connection options: a lakestream statement that waits past it (a lock held
    by another session) is cancelled by the server, an ``OperationalError`` subclass. The connection is fine: it must
    not be closed and the statement must not run (and wait) a second time; the error stays one that ``transient``
    retries, as SQLAlchemy's ``OperationalError`` around it was."""
    cat = SqlCatalog("pg", uri=f"{pg_uri}?options=-c%20statement_timeout%3D300",
                     warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(cat, "ns.s", schema=SCHEMA, world_size=WORLD)
    intents = IntentTable.of(cat)
    direct = direct_connections(cat.engine)
    assert intents is not None and direct is not None and intents.create()
    path = f"{stream.table.location()}/data/_staging/main/p@000000000001-t.parquet"
    assert not intents.exists(path)
    first = backend_pid(direct)
    opened: list[object] = []
    with cat.engine.connect() as locker, locker.begin():
        locker.exec_driver_sql("SET LOCAL statement_timeout = 0")
        locker.exec_driver_sql(f"LOCK TABLE {INTENT_TABLE} IN ACCESS EXCLUSIVE MODE")
        event.listen(cat.engine, "connect", lambda *_: opened.append(1))
        with pytest.raises(psycopg2.errors.QueryCanceled) as cancelled:
            intents.exists(path)
    assert transient(cancelled.value)
    assert opened == [] and direct.open_connections() == 1 and backend_pid(direct) == first
    assert session_state(cat, first) == "idle"
    assert not intents.exists(path)


def _terminate_all(uri: str, database: str) -> None:
    """Every session of ``database`` ended by the server, as a restart would (from a session of another database)."""
    admin = create_engine(uri.rsplit("/", 1)[0] + "/postgres", poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %(db)s",
                                 {"db": database})
            while conn.exec_driver_sql("SELECT count(*) FROM pg_stat_activity WHERE datname = %(db)s",
                                       {"db": database}).scalar():
                time.sleep(0.01)
    finally:
        admin.dispose()


def test_after_a_server_restart_the_statement_runs_again_on_a_new_connection_not_on_an_idle_pooled_one(
        pg_uri: str, tmp_path: Path) -> None:
    """A restart ends the direct connection and the pool's idle ones alike: the statement that meets the dead
    connection must run again on a connection that works, not on one of the pool's dead ones."""
    cat, stream, probe, direct = probed(pg_uri, tmp_path)
    first = backend_pid(direct)
    with cat.engine.connect() as a, cat.engine.connect() as b:  # the pool keeps two idle connections
        a.exec_driver_sql("SELECT 1")
        b.exec_driver_sql("SELECT 1")
    _terminate_all(pg_uri, pg_uri.rsplit("/", 1)[1])
    assert probe() == stream.table.metadata_location
    assert backend_pid(direct) != first and direct.open_connections() == 1
    assert stream.table.refresh().metadata_location == stream.table.metadata_location  # the pool recovers too


def test_threads_probing_and_staging_while_another_thread_disposes_the_engine_get_their_answers(
        pg_uri: str, tmp_path: Path) -> None:
    """``release_idle_connections`` or ``catalog.close()`` in one thread closes the process's connection while other
    threads run statements on it: each statement runs again on a new connection (as through SQLAlchemy, where a dispose
    never failed a statement in progress), and none reads its rows from a cursor the dispose closed."""
    cat = pg_catalog(pg_uri, tmp_path)
    stream = Stream.create(cat, "ns.s", schema=SCHEMA, world_size=WORLD)
    probe = pointer_probe(stream.table)
    intents = IntentTable.of(cat)
    assert probe is not None and intents is not None and intents.create()
    folder = f"{stream.table.location()}/data/_staging/main"
    failures: list[BaseException] = []
    wrong: list[object] = []
    done = threading.Event()
    disposals = [0]

    def work(n: int) -> None:
        try:
            for i in range(40):
                if probe() != stream.table.metadata_location:
                    wrong.append("probe")
                path = f"{folder}/p{n}@{i:012d}-t.parquet"
                intents.insert(path, '{"seq": 1}')
                if not intents.exists(path) or intents.body(path) != '{"seq": 1}':
                    wrong.append(path)
                intents.delete([path])
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    def dispose() -> None:
        while not done.is_set():
            release_idle_connections(cat)
            disposals[0] += 1

    disposer = threading.Thread(target=dispose)
    disposer.start()
    workers = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    done.set()
    disposer.join()
    assert failures == [] and wrong == [] and disposals[0] > 0
    assert intents.listing(folder, bodies=False) == []
