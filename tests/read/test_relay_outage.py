"""The head relay while the catalog is unreachable (a real PostgreSQL refusing connections)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import ReadTimeoutError
from lakestream_iceberg.read.relay_client import RelayWatcher, follower
from lakestream_iceberg.read.stream_ref import StreamRef
from tests.backends import fresh_name, postgres_service
from tests.read.test_dataset import SCHEMA, shard
from tests.read.test_relay import relay_dir  # autouse: a relay directory of its own

__all__ = ["postgres_service", "relay_dir"]


class Outage:
    """A PostgreSQL catalog database holding stream ns.s at step 1; ``start`` makes it refuse connections (its sessions
    ended), ``end`` lets them in again."""

    def __init__(self, tmp_path: Path, postgres_service: object) -> None:
        import psycopg2
        from pyiceberg.catalog.sql import SqlCatalog

        self.database = fresh_name("db")
        self.uri = postgres_service.create_database(self.database)  # type: ignore[attr-defined]
        self.warehouse = f"file://{tmp_path}/warehouse"
        self.catalog = SqlCatalog("pg", uri=self.uri, warehouse=self.warehouse)
        self.catalog.create_namespace("ns")
        self.stream = Stream.create(self.catalog, "ns.s", schema=SCHEMA, world_size=2)
        self.stream.producer("p").commit([shard(1, r) for r in range(2)])
        server = self.uri.replace("postgresql+psycopg2", "postgresql").rsplit("/", 1)[0]
        self.admin = psycopg2.connect(server + "/postgres")
        self.admin.autocommit = True

    def _run(self, sql: str) -> None:
        with self.admin.cursor() as cur:
            cur.execute(sql)

    def start(self) -> None:
        self._run(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS false')
        self._run(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{self.database}'")

    def end(self) -> None:
        self._run(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS true')

    def commit_step_2(self) -> None:
        """Step 2, committed through a catalog of its own (once the outage ended)."""
        from pyiceberg.catalog.sql import SqlCatalog

        other = SqlCatalog("pg", uri=self.uri, warehouse=self.warehouse)
        Stream.open(other, "ns.s").producer("p").commit([shard(2, r) for r in range(2)])
        other.engine.dispose()

    def close(self) -> None:
        self.end()
        self.admin.close()
        self.catalog.engine.dispose()


@pytest.mark.services
def test_a_holder_backs_off_while_the_catalog_is_unreachable(tmp_path: Path, postgres_service: object,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The catalog's database refuses connections (an outage, a failover). A direct follower backs off to
    ``max_poll_s`` (HeadWatcher.wait); the host's relay holder kept polling every ``poll_s`` (20 ms) and logged a
    warning at each failure: about 27 warnings a second per host, and every host's holder hammering the database with
    connection attempts while it comes back. It backs off the same way and says so once, and sees the next step once
    the database is back."""
    outage = Outage(tmp_path, postgres_service)
    catalog, stream = outage.catalog, outage.stream

    watcher, _ = follower(Stream.open(catalog, "ns.s"), ref=StreamRef.of(stream), branch="main", relay=True,
                          poll_s=0.02, max_poll_s=0.5)
    assert isinstance(watcher, RelayWatcher) and watcher.holding
    try:
        watcher.wait(1, timeout=30, stop=threading.Event())
        time.sleep(0.5)  # the holder's LISTEN connection is open
        outage.start()
        with caplog.at_level(logging.WARNING, logger="lakestream_iceberg"):
            caplog.clear()
            time.sleep(3.0)
            failed = [r for r in caplog.records if "failed" in r.getMessage()]
        # 3 s of outage: a direct follower (HeadWatcher.wait) backs off to max_poll_s and warns about 6 times
        assert len(failed) <= 12, f"{len(failed)} warnings in 3 s: {failed[0].getMessage() if failed else ''}"
        # a reader of the host that times out meanwhile names the cause, not "are the producers running?"
        with pytest.raises(ReadTimeoutError, match=r"holder \(pid \d+\) cannot reach the catalog"):
            watcher.wait(2, timeout=1.0, stop=threading.Event())
        outage.end()
        outage.commit_step_2()
        assert watcher.wait(2, timeout=30, stop=threading.Event())[0] == 2  # the holder polls again once it is back
    finally:
        watcher.close()
        outage.close()


@pytest.mark.services
def test_a_direct_follower_warns_once_while_the_catalog_is_unreachable(tmp_path: Path, postgres_service: object,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Without the relay, every rank's follower warned at each failed poll (about twice a second per rank, and a rank
    whose steps came steadily polled every poll_s): a thousand ranks logged thousands of lines a second through an
    outage. It warns at the first failure (and every FAILURES_LOGGED-th), backs off, and sees the next step once the
    database is back."""
    from lakestream_iceberg.read.follow import HeadWatcher

    outage = Outage(tmp_path, postgres_service)
    catalog = outage.catalog

    watcher = HeadWatcher(Stream.open(catalog, "ns.s"), branch="main", listen=False)
    try:
        assert watcher.wait(1, timeout=30, stop=threading.Event(), poll_s=0.02, max_poll_s=0.2)[0] == 1
        outage.start()
        with caplog.at_level(logging.INFO, logger="lakestream_iceberg"):
            caplog.clear()
            with pytest.raises(ReadTimeoutError):
                watcher.wait(2, timeout=3.0, stop=threading.Event(), poll_s=0.02, max_poll_s=0.2)
            failed = [r for r in caplog.records if "failed" in r.getMessage()]
            assert len(failed) == 1 and failed[0].levelno == logging.WARNING, [r.getMessage() for r in failed]
            outage.end()
            outage.commit_step_2()
            assert watcher.wait(2, timeout=30, stop=threading.Event(), poll_s=0.02, max_poll_s=0.2)[0] == 2
            assert any("works again" in r.getMessage() for r in caplog.records)
    finally:
        watcher.close()
        outage.close()
