"""``no_fork_inside``: a fork waits for the database calls other threads have in flight, and a child starts clean."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import pytest

from lakestream_iceberg.connect import fork
from lakestream_iceberg.connect.fork import no_fork_inside
from tests.support import SQLITE_MUTEX_STATIC_MEM, hold_sqlite_mutex

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")


def _fork_and_reap(body: int = 0) -> int:
    """Fork; the child runs one gated call (it must not hang on the parent's state) and exits; returns its status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        with no_fork_inside():
            pass
        os._exit(body)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_fork_waits_for_another_threads_call_in_flight() -> None:
    order: list[str] = []
    entered, forking = threading.Event(), threading.Event()

    def call() -> None:
        with no_fork_inside():
            entered.set()
            forking.wait()
            time.sleep(0.2)  # an ungated fork would finish meanwhile; a gated one cannot finish before "left"
            order.append("left")

    def forker() -> None:
        forking.set()
        assert _fork_and_reap(7) == 7
        order.append("forked")

    caller = threading.Thread(target=call)
    caller.start()
    assert entered.wait(60)
    other = threading.Thread(target=forker)
    other.start()
    caller.join(60)
    other.join(60)
    assert order == ["left", "forked"]
    assert not fork._inside


def test_the_forking_threads_own_call_is_not_waited_for(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(fork, "FORK_WAIT_S", 0.5)
    with caplog.at_level(logging.WARNING, logger=fork.__name__), no_fork_inside(), no_fork_inside():
        assert _fork_and_reap() == 0
    assert not [r for r in caplog.records if "forking while" in r.getMessage()]
    done = threading.Event()

    def other() -> None:
        with no_fork_inside():
            done.set()

    with no_fork_inside():  # the gate is usable again, by this thread and others
        thread = threading.Thread(target=other)
        thread.start()
        assert done.wait(60)
    thread.join(60)
    assert not fork._inside  # every call left


def test_a_call_stuck_longer_than_the_bound_delays_the_fork_once_and_warns(monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(fork, "FORK_WAIT_S", 0.2)
    entered, release = threading.Event(), threading.Event()

    def stuck() -> None:
        with no_fork_inside():
            entered.set()
            release.wait(60)

    thread = threading.Thread(target=stuck)
    thread.start()
    assert entered.wait(60)
    try:
        with caplog.at_level(logging.WARNING, logger=fork.__name__):
            assert _fork_and_reap(3) == 3  # the child is not blocked by the parent's stuck thread
        assert any("forking while" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        thread.join(60)


def test_a_forked_child_owns_the_pools_of_the_catalogs_made_fork_safe(tmp_path) -> None:
    """What a forked DataLoader worker relies on to use its parent's catalog in place (read/follow.py forked_view):
    the fork emptied the pool of a catalog made fork-safe; a catalog never made so still pools the parent's."""
    from pyiceberg.catalog.sql import SqlCatalog

    safe = SqlCatalog("safe", uri=f"sqlite:///{tmp_path}/safe.db", warehouse=f"file://{tmp_path}")
    other = SqlCatalog("other", uri=f"sqlite:///{tmp_path}/other.db", warehouse=f"file://{tmp_path}")
    fork.fork_safe(safe)
    assert fork.owns_connections(safe) and not fork.owns_connections(other)
    assert safe.engine.pool.checkedin() == 1  # the parent's connection, opened when the catalog was made
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = fork.owns_connections(safe) and safe.engine.pool.checkedin() == 0 and not fork.owns_connections(other)
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fork.owns_connections(safe)  # still the parent's own


def test_calls_that_keep_coming_do_not_hold_a_fork_back(caplog: pytest.LogCaptureFixture) -> None:
    """No call starts while a fork waits for the calls in flight: threads that query back to back (a relay serving
    many readers, a holder polling) kept slipping in while it waited, and every fork waited its whole bound
    (FORK_WAIT_S, 10 s), warning, each time a DataLoader started its workers."""
    stop = threading.Event()
    calls = [0, 0, 0]

    def busy(i: int) -> None:
        while not stop.is_set():
            with no_fork_inside():
                calls[i] += 1
                time.sleep(0.001)  # a statement's round trip, inside the gate

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        while not all(calls):  # every thread is calling
            time.sleep(0.001)
        with caplog.at_level(logging.WARNING, logger=fork.__name__):
            for _ in range(3):
                assert _fork_and_reap(5) == 5
        assert not [r for r in caplog.records if "forking while" in r.getMessage()]
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not fork._inside


# -- a thread inside libsqlite3 at the fork, outside any gated call ------------------------------------------------
# The cyclic garbage collector runs in whatever thread allocates: it closed the SQLite connections of unreachable
# catalogs (an earlier test's, a dropped engine's) in a pool thread or s3fs's event-loop thread, inside libsqlite3
# with the GIL released. A DataLoader forking its workers at that moment left SQLite's allocator mutex locked in the
# child, whose first query (its head watcher's pointer probe) waited for it forever.
def _fork_and_reap_within(child, timeout: float) -> int | None:
    """Fork; the child runs ``child()`` and exits 0 (3 if it raised); its exit code, or None (killed) when it took
    longer than ``timeout``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            child()
        except BaseException:  # noqa: BLE001
            os._exit(3)
        os._exit(0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def test_a_child_forked_while_another_thread_is_inside_sqlite_can_use_sqlite(tmp_path) -> None:
    import sqlite3

    def query() -> None:
        with sqlite3.connect(str(tmp_path / "child.db")) as conn:
            conn.execute("SELECT 1").fetchall()

    # held for 5 s at most: a collection in this thread that closes a connection meanwhile waits that long, no longer
    thread, release = hold_sqlite_mutex(SQLITE_MUTEX_STATIC_MEM, 5)
    try:
        assert _fork_and_reap_within(query, timeout=10) == 0  # was None: the child hung on SQLite's allocator mutex
    finally:
        release.set()
        thread.join(60)
    sqlite3.connect(":memory:").close()  # the parent's own mutex is the holder's to release, and it did


def test_forking_while_other_threads_call_sqlite_never_deadlocks_the_parent() -> None:
    """Threads that call SQLite while holding the GIL (sqlite3 binds a parameter, allocating, with the GIL held) and a
    thread that forks again and again. Taking SQLite's mutexes in the parent around the fork (as C allocators do)
    deadlocked it within a few hundred forks: the other at-fork hooks passed the GIL to a binding thread, which then
    waited for the allocator's mutex the forking thread held, and that thread for the GIL."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, sqlite3, threading
        import lakestream_iceberg.connect.fork
        stop = threading.Event()
        def binder():
            conn = sqlite3.connect(":memory:")
            while not stop.is_set():
                conn.execute("SELECT ?", ("x" * 200,)).fetchall()
        threads = [threading.Thread(target=binder, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        for _ in range(300):
            pid = os.fork()
            if pid == 0:
                conn = sqlite3.connect(":memory:")
                conn.execute("SELECT ?", ("y" * 200,)).fetchall()
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        stop.set()
        for t in threads:
            t.join()
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("enabled", [True, False])
def test_a_fork_leaves_the_garbage_collector_as_it_was_in_parent_and_child(enabled: bool) -> None:
    """The collector is off across a fork until the child released SQLite's mutexes (a collection in an earlier
    at-fork hook finalized a statement on the held allocator mutex); then as before, in both processes."""
    import gc
    import sqlite3

    sqlite3.connect(":memory:").close()  # SQLite loaded and initialized here
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        assert _fork_and_reap_within(lambda: None if gc.isenabled() is enabled else 1 / 0, timeout=10) == 0
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_two_threads_forking_at_once_leave_the_collector_and_the_gate_as_they_were() -> None:
    """Two threads fork at once, and the first fork holds the gate past ``FORK_WAIT_S`` (its other at-fork hooks or the
    fork itself were slow: a large process, a busy host), so the second goes ahead without it. The fork state was one
    value for the process: the second fork's hooks overwrote the first's, which then never released the gate (every
    later gated call, a head watcher's probe, a position report, hung for good) and never enabled the collector again
    (the second had found it off: the first had paused it)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import gc, os, sqlite3, threading, time
        sqlite3.connect(":memory:").close()  # SQLite loaded: the fork hooks pause the collector
        def slow():  # another library's before-fork hook, registered first: it runs after lakestream's
            if threading.current_thread().name == "first":
                time.sleep(1.0)
        os.register_at_fork(before=slow)
        from lakestream_iceberg.connect import fork
        fork.FORK_WAIT_S = 0.3
        def forker():
            pid = os.fork()
            if pid == 0:
                os._exit(0 if gc.isenabled() else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, "the child's collector is off"
        first = threading.Thread(target=forker, name="first")
        second = threading.Thread(target=forker, name="second")
        first.start(); time.sleep(0.1); second.start(); first.join(); second.join()
        assert gc.isenabled(), "the collector stayed off"
        done = threading.Event()
        def gated():
            with fork.no_fork_inside():
                done.set()
        threading.Thread(target=gated, daemon=True).start()
        assert done.wait(10), "a gated call waits for a gate nobody releases"
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        assert gc.isenabled() and not fork._forking
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]


class _HeldStatement:
    """Another thread's statement, held open from inside it (:meth:`hold`) until this thread asked for a fork; an
    ungated fork finishes while it is held, a gated one only after it (``order``)."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.entered, self.forking = threading.Event(), threading.Event()

    def hold(self) -> None:
        if self.entered.is_set():
            return
        self.entered.set()
        self.forking.wait(60)
        time.sleep(0.5)  # an ungated fork finishes meanwhile; a gated one cannot finish before "left"
        self.order.append("left")

    def fork_beside(self, target: Callable[[], object]) -> None:
        """Run ``target`` in a thread, fork once its statement is held, and check that the fork waited for it."""
        thread = threading.Thread(target=target)
        thread.start()
        try:
            assert self.entered.wait(60)
            self.forking.set()
            assert _fork_and_reap(7) == 7
            self.order.append("forked")
        finally:
            self.forking.set()
            thread.join(60)
        assert self.order == ["left", "forked"]
        assert not fork._inside


def test_a_fork_waits_for_a_commits_catalog_transaction_in_another_thread(tmp_path) -> None:
    """A producer's compare-and-swap on a SQLite catalog (SQLAlchemy's transaction: the conditional UPDATE of the
    pointer) ran outside the gate. A thread inside it holds the database file's own mutex in libsqlite3 (a per-file
    mutex, not one of the static ones the child releases) around its fcntl locks: a DataLoader forking its workers
    meanwhile left that mutex held in a child, whose first query of the catalog then waited for it forever (1 child
    in 400 with a producer committing in a loop). The fork now waits for the transaction."""
    from sqlalchemy import event

    from lakestream_iceberg import Stream
    from tests.support import SCHEMA, batch, sqlite_catalog

    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.gate", schema=SCHEMA, world_size=2)
    producer = stream.producer("p")
    held = _HeldStatement()

    def inside_the_swap(conn, cursor, statement, *_):  # noqa: ANN001, ANN202 - SQLAlchemy's listener signature
        if statement.lstrip().upper().startswith("UPDATE ICEBERG_TABLES"):
            held.hold()

    event.listen(catalog.engine, "before_cursor_execute", inside_the_swap)
    try:
        held.fork_beside(lambda: producer.commit(batch("p", 0, 2)))
    finally:
        event.remove(catalog.engine, "before_cursor_execute", inside_the_swap)


def test_a_fork_waits_for_a_gcs_look_at_the_catalogs_table_rows_in_another_thread(tmp_path) -> None:
    """GC's sweep (and a create) reads the SQL catalog's ``iceberg_tables`` rows under the stream's folder (the
    shared-location check, :func:`~lakestream_iceberg.connect.sql_tables.tables_under`) on the catalog's own engine,
    outside the gate: a DataLoader forking its workers while a GC thread was inside that query left the database
    file's own libsqlite3 mutex held in the child (as the swap's transaction did). The fork now waits for it."""
    from sqlalchemy import event

    from lakestream_iceberg import Stream
    from tests.support import SCHEMA, sqlite_catalog

    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.gate", schema=SCHEMA, world_size=2)
    held = _HeldStatement()

    def inside_the_look(conn, cursor, statement, *_):  # noqa: ANN001, ANN202 - SQLAlchemy's listener signature
        if "FROM iceberg_tables" in statement and " LIKE " in statement:
            held.hold()

    event.listen(catalog.engine, "before_cursor_execute", inside_the_look)
    try:
        held.fork_beside(lambda: stream.collect_garbage(dry_run=True))
    finally:
        event.remove(catalog.engine, "before_cursor_execute", inside_the_look)


@pytest.mark.parametrize("store", ["intents", "positions"])
def test_a_fork_waits_for_a_statement_on_lakestreams_own_tables_in_another_thread(tmp_path, store: str) -> None:
    """Group commit's staged intents and consumer positions are rows of the SQLite catalog's database, some written on
    the thread's own raw ``sqlite3`` connection (connect/direct.py) outside the gate: a DataLoader forking its workers
    while a thread of the training process (a position report, a GC's expiry) or a producer's committer was inside
    one left the database file's own libsqlite3 mutex held in the child. The fork now waits for the statement."""
    from lakestream_iceberg.connect.direct import direct_connections
    from lakestream_iceberg.connect.intents import IntentTable
    from lakestream_iceberg.connect.positions import PositionStore
    from tests.support import sqlite_catalog

    catalog = sqlite_catalog(str(tmp_path))
    held = _HeldStatement()

    def traced(statement: str) -> None:  # sqlite3 calls it inside the statement, on the statement's thread
        if statement.upper().startswith(("INSERT", "DELETE")):
            held.hold()

    if store == "intents":
        table = IntentTable.of(catalog)
        assert table is not None and table.create()
        staged = [f"file://{tmp_path}/t/data/_staging/main/p/{seq}.json" for seq in (1, 2)]
        for path in staged:
            table.insert(path, "{}")
        call = lambda: table.delete(staged)  # noqa: E731 - GC's expiry, a carrier's clean-up: one transaction
    else:
        positions = PositionStore(catalog=catalog, io=None, location=f"file://{tmp_path}/t")
        assert positions.kind == "catalog database"
        positions.rows()  # the table made, before the traced insert
        positions.upsert(group="g", rank=1, body="{}")
        call = lambda: positions.upsert(group="g", rank=0, body="{}")  # noqa: E731

    def run() -> None:
        direct = direct_connections(catalog.engine)
        assert direct is not None
        direct.connection().set_trace_callback(traced)  # this thread's own connection
        try:
            call()
        finally:
            direct.connection().set_trace_callback(None)

    held.fork_beside(run)
