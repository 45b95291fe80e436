"""Commit notifications: a follower learns of a new head at once instead of at its next poll.

What each catalog gets:

* **PostgreSQL** (a ``SqlCatalog`` on psycopg2): every commit lakestream swaps itself (:mod:`.swap`) runs
  ``pg_notify(<channel>, <new metadata location>)`` in the transaction of its conditional ``UPDATE``. PostgreSQL
  delivers a notification only when that transaction commits, so a notification always means "the head moved". A
  follower (:class:`HeadListener`) holds one extra connection that ``LISTEN``\\ s on the table's channel and wakes as
  soon as one arrives. Commits made by other tools (pyiceberg's own ``commit_table``, Spark) send none: followers
  keep polling, at their backed-off interval, as a safety net. A producer whose staged batch holds for a group commit
  (:class:`CommitNotices`) listens on the process's direct connection (:mod:`.direct`, no connection added) for as
  long as it holds, and reads the pointer when a notification comes instead of at every poll.
* **SQLite and every other catalog** (REST, Glue, Hive): no notifications; followers poll with exponential backoff
  (on SQL catalogs a poll reads only the table pointer, see :mod:`.pointer`).

The channel is ``lakestream_`` followed by 24 hex digits of a hash of the catalog name and the table identifier (a
PostgreSQL identifier is at most 63 bytes; table names may be longer and hold any character).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import weakref
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from lakestream_iceberg.connect.direct import close_in_owner, detached_autocommit, direct_connections, readable

log = logging.getLogger(__name__)

__all__ = ["CommitNotices", "HeadListener", "channel", "notifies", "readable"]


def channel(catalog_name: str, identifier: tuple[str, ...]) -> str:
    """The notification channel of a table."""
    key = "\0".join([catalog_name, Catalog.namespace_to_string(identifier[:-1]), identifier[-1]])
    return "lakestream_" + hashlib.sha256(key.encode()).hexdigest()[:24]


def notifies(catalog: Any) -> bool:
    """Whether commits to this catalog send notifications (a SQL catalog on PostgreSQL through psycopg2)."""
    engine = getattr(catalog, "engine", None)
    dialect = getattr(engine, "dialect", None)
    return dialect is not None and dialect.name == "postgresql" and dialect.driver == "psycopg2"


class HeadListener:
    """Wakes a follower when a commit to one table lands (PostgreSQL catalogs); :meth:`open` returns None elsewhere.

    One dedicated connection per listener (taken out of the catalog engine's pool, closed by :meth:`close` or when the
    listener is garbage-collected). A broken connection turns the listener off; the follower's polling carries on.
    A forked child's copy of a listener is off: it never reads nor closes the parent's connection (closing it there
    would end the parent's session, and reading it would take the parent's notifications).
    """

    def __init__(self, connection: Any, name: str) -> None:
        self._conn = connection
        self._name = name
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.received = 0
        self._finalizer = weakref.finalize(self, close_in_owner, connection, self._pid)

    @classmethod
    def open(cls, table: Table) -> HeadListener | None:
        """A listener on ``table``'s channel, or None when its catalog sends no notifications or LISTEN failed."""
        catalog = table.catalog
        if not notifies(catalog):
            return None
        name = channel(catalog.name, table.name())
        try:
            connection = detached_autocommit(catalog.engine)  # type: ignore[attr-defined]  # no LISTEN back in the pool
            with connection.cursor() as cursor:
                cursor.execute(f'LISTEN "{name}"')
        except Exception as exc:  # noqa: BLE001 - no notifications: the follower polls
            log.warning("cannot LISTEN for commits to %s (%s); polling instead", ".".join(table.name()),
                        type(exc).__name__)
            return None
        return cls(connection, name)

    @property
    def alive(self) -> bool:
        return self._conn is not None and self._pid == os.getpid()

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a commit notification; True when one (or more) arrived."""
        if self._pid != os.getpid():  # a forked child's copy: off (see the class docstring); its lock may be held
            return False
        with self._lock:
            conn = self._conn
            if conn is None:
                return False
            try:
                if self._drain(conn):
                    return True
                return readable(conn, timeout) and self._drain(conn)
            except Exception as exc:  # noqa: BLE001 - the connection broke: stop listening, polling carries on
                log.warning("commit notifications for channel %s stopped (%s); polling instead", self._name,
                            type(exc).__name__)
                self._conn = None
                close_in_owner(conn)
                return False

    def _drain(self, conn: Any) -> bool:
        conn.poll()
        got = len(conn.notifies)
        conn.notifies.clear()
        self.received += got
        return got > 0

    def close(self) -> None:
        if self._pid == os.getpid():  # a forked child's copy may hold a lock a parent's thread held at the fork
            with self._lock:
                self._conn = None
        self._finalizer()


class CommitNotices:
    """Commit notifications for a producer's holds on one table, on the process's direct connection (PostgreSQL).

    :meth:`open` returns None where the catalog sends none or has no direct connection. A hold calls :meth:`start`
    (``LISTEN``, shared by the holds of the process's threads), waits with :meth:`wait` and ends with :meth:`stop`.
    Notifications are *proven* once one arrived during a hold: from then on a hold reads the pointer when one comes
    (and every :attr:`fallback` as a safety net for commits that send none) instead of at every poll. Until then holds
    poll as they would without notifications, only waking early when one comes. Where ``LISTEN`` is accepted but no
    notification ever arrives (a pooler in transaction mode serves the connection, or the table's commits come from
    a catalog whose commit sends none) the process stops listening after :attr:`GIVE_UP` holds that saw the head move
    and heard nothing.
    """

    GIVE_UP = 8

    def __init__(self, direct: Any, name: str) -> None:
        self._direct = direct
        self.channel = name
        self.proven = False
        self.off = False
        self._silent = 0  # holds in a row that saw the head move and heard nothing, before any notification
        self._heard_at_start = 0

    @classmethod
    def open(cls, table: Table) -> CommitNotices | None:
        """The notifications of ``table``'s commits, or None where its catalog sends none."""
        catalog = table.catalog
        if not notifies(catalog):
            return None
        direct = direct_connections(catalog.engine)  # type: ignore[attr-defined]
        if direct is None:
            return None
        return cls(direct, channel(catalog.name, table.name()))

    def start(self) -> int | None:
        """Listen for the length of a hold: the count of notifications so far (compare with :meth:`wait`'s), or None
        when this hold polls instead (given up on, or ``LISTEN`` failed)."""
        if self.off or not self._direct.listen(self.channel):
            return None
        self._heard_at_start = int(self._direct.heard(self.channel))
        return int(self._direct.notified(self.channel))

    def wait(self, seen: int, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for a notification after count ``seen``; returns the count now (it also
        moves when the connection was replaced: anything may have been missed, so look)."""
        return int(self._direct.wait_notified(self.channel, seen, timeout))

    def stop(self, *, moved: bool) -> None:
        """End a hold's listening (``moved``: whether it saw the head move)."""
        heard = int(self._direct.heard(self.channel)) != self._heard_at_start
        self._direct.unlisten(self.channel)
        if heard:
            self.proven, self._silent = True, 0
        elif moved and not self.proven:
            self._silent += 1
            if self._silent >= self.GIVE_UP:
                self.off = True
                log.info("no commit notifications arrive on channel %s (a pooler in transaction mode, or commits that "
                         "send none): holds poll the catalog pointer instead", self.channel)

