"""The head relay: one process per host follows a stream's head for every reader of that host.

Without it each trainer rank and each DataLoader worker polls the catalog, holds its own catalog connections and reads
``metadata.json``, the manifest list and a manifest for every step: costs that grow with ranks x workers. With it one
process per host, stream and branch (the *holder*) does all of that once, and the others ask it over a unix socket:

* **Election**: whoever takes the ``flock`` on the relay's lock file (:mod:`.relay_wire` says where) serves; the kernel
  releases it when the holder exits, however it exits, and the next reader that finds the socket dead takes over.
  A holder that stops removes its socket and lock file, so relays of finished runs leave no files behind. A holder
  that was killed (a DataLoader worker terminated when its training process exits, SIGKILL, out of memory) leaves
  both; a new holder removes those of every relay in the directory whose lock nobody holds (:func:`_sweep`), so a
  host that runs a job per new stream does not gather two files per job.
  A forked child closes its copy of the lock (so that its parent's death frees it) and never serves its parent's relay.
* **Following**: the holder keeps its own view of the table at the head (:class:`~.follow.HeadWatcher`): it polls the
  catalog pointer every ``poll_s`` (on PostgreSQL it also listens for commit notifications and then polls only every
  ``max_poll_s`` as a safety net), and reads the new ``metadata.json`` once per head. While the catalog cannot be
  reached it backs off to ``max_poll_s``, as a direct follower does, and warns once per outage (and every
  ``FAILURES_LOGGED``-th failure).
* **Answers**: ``wait`` (block until the head reaches a step, at most ``WAIT_SLICE_S``), ``files`` (a step's data
  files, looked up once and kept for the next clients in a small LRU; looked up on the head that first listed the
  step, not on every newer head, so that clients asking for one step at different heads cost one manifest read, not
  one per head; on the client's own head instead when another engine rolled the branch back between the two),
  ``check`` (poll now, and plan on the head of now: a client found a file gone after a GC). Errors are sent back as
  their class (:func:`.relay_wire.decode_error`): a collected step, a dropped or re-created table raise the same errors
  through the relay as without it.

Memory is bounded: the table view and its manifest cache (bounded as every stream's), ``PLANS_KEPT`` answers of at
most ``PLAN_FILES_KEPT`` data files in all, and one thread per connection, at most ``MAX_CLIENTS``. A holder serves while its own process has a reader following (see
:func:`hold`); when the last one closes it stops, and its clients elect a new holder.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

from pyiceberg.table import Table

from lakestream_iceberg.connect.notify import readable
from lakestream_iceberg.errors import LakestreamError, ReadError
from lakestream_iceberg.format.summary import StreamState, missing_step_error
from lakestream_iceberg.format.table import StreamTable, after_gc
from lakestream_iceberg.read.follow import FAILURES_LOGGED, HeadWatcher
from lakestream_iceberg.read.relay_lock import lock_file, sweep, unlink_quietly
from lakestream_iceberg.read.relay_wire import (
    MAX_REQUEST,
    FrameTooLargeError,
    RelayPaths,
    encode_error,
    encode_files,
    recv_frame,
    send_frame,
)

log = logging.getLogger(__name__)

__all__ = ["HeadRelay", "hold", "held"]

WAIT_SLICE_S = 2.0  # the longest a ``wait`` blocks on the holder: a client asks again (and notices its own stop)
IO_S = 10.0  # a frame that does not arrive or leave within this is a dead peer
PLANS_KEPT = 256
PLAN_FILES_KEPT = 100_000  # data files among the answers kept (about 35 MB); the newest answer is kept whatever its size
MAX_CLIENTS = 4096


class HeadRelay:
    """Serves one stream branch's head and step files to the readers of this host (see the module docstring).

    Made by :func:`hold` in the process that won the election; ``retain``/``release`` count this process's own
    readers, and the last release stops it.
    """

    def __init__(self, stream: StreamTable, *, branch: str, paths: RelayPaths, lock_fd: int, poll_s: float,
                 max_poll_s: float) -> None:
        source = stream.table  # a view of its own: the serving threads never move the caller's table
        table = Table(source.name(), source.metadata, source.metadata_location, source.io, source.catalog)
        self.stream = StreamTable(table, cache=stream.cache)
        self.branch, self.paths, self.pid = branch, paths, os.getpid()
        self._lock_fd, self._poll_s, self._max_poll_s = lock_fd, poll_s, max_poll_s
        self._watcher = HeadWatcher(self.stream, branch=branch)
        self._cond = threading.Condition()
        self._poll_lock = threading.Lock()
        self._plan_lock = threading.Lock()
        self._stop = threading.Event()
        self._head: tuple[int, Any] = self._watcher.head()
        self._fatal: LakestreamError | None = None
        self._failures = 0  # catalog polls failed in a row
        self._plan_base: tuple[int, Any] | None = None  # the head steps are planned on (see _files)
        self._plans: OrderedDict[tuple[int | None, int], dict[str, Any]] = OrderedDict()
        self._plan_files = 0  # data files among self._plans
        self._clients: set[socket.socket] = set()
        self._users = 0
        self.served = 0
        self._poll_once()  # the head of now, not of when the caller's view was read (a worker's: maybe long ago)
        try:
            os.unlink(paths.socket)  # a dead holder's socket
        except FileNotFoundError:
            pass
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(paths.socket))
        self._listener.listen(512)
        self._threads = [threading.Thread(target=self._poll_loop, name="lakestream-relay-poll", daemon=True),
                         threading.Thread(target=self._accept_loop, name="lakestream-relay-accept", daemon=True)]
        for thread in self._threads:
            thread.start()

    # -- lifetime ------------------------------------------------------------------------------------------------------
    def retain(self) -> None:
        with self._cond:
            self._users += 1

    def release(self) -> None:
        with self._cond:
            self._users -= 1
            last = self._users <= 0
        if last:
            self.stop()

    @property
    def alive(self) -> bool:
        return not self._stop.is_set()

    def stop(self) -> None:
        """Stop serving: the socket goes, then the lock (clients then elect a new holder), then this holder's threads.

        The lock is released before the threads are joined: a client that lost its connection elects the next holder
        at once instead of waiting for the old holder's threads to finish their current wait (about 75 ms of a
        holder change in a traced run). Nothing of the old holder answers anyone by then: its socket is unlinked, its
        listener and client connections closed."""
        if self._stop.is_set():
            return
        log.debug("stopping the head relay of %s (branch %s) at %s", self.stream.name, self.branch, self.paths.socket)
        self._stop.set()
        with _HELD_LOCK:
            if _HELD.get(self.paths.key) is self:
                del _HELD[self.paths.key]
        try:
            os.unlink(self.paths.socket)
        except OSError:
            pass
        self._listener.close()
        with self._cond:
            clients = list(self._clients)
            self._cond.notify_all()
        for conn in clients:
            _shutdown(conn)
        unlink_quietly(self.paths.lock)  # while still locked: a stopped relay leaves nothing behind (see relay_lock.lock_file)
        os.close(self._lock_fd)  # releases the flock
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=IO_S)
        self._watcher.close()

    # -- following -----------------------------------------------------------------------------------------------------
    def _poll_once(self) -> bool:
        """Poll the catalog once; False when it could not be reached (logged once per outage, and every
        ``FAILURES_LOGGED``-th failure in a row)."""
        with self._poll_lock:
            try:
                self._watcher.check()
                fatal = None
            except LakestreamError as exc:  # dropped, re-created, malformed: every client gets it
                fatal = exc
            except Exception as exc:  # noqa: BLE001 - the catalog is unreachable for now: clients wait, or time out
                self._failures += 1
                if self._failures == 1 or self._failures % FAILURES_LOGGED == 0:
                    log.warning("relay polling %s failed %d time(s) in a row (%s); retrying, backing off to every "
                                "%gs", self.stream.name, self._failures, type(exc).__name__, self._max_poll_s)
                return False
            if self._failures:
                log.info("relay polling %s works again after %d failure(s)", self.stream.name, self._failures)
                self._failures = 0
            head = self._watcher.head() if fatal is None else self._head
        with self._cond:
            self._fatal, moved = fatal, head[0] != self._head[0]
            self._head = head
            if moved or fatal is not None:
                self._cond.notify_all()
        return True

    def _replan(self) -> None:
        self._poll_once()
        with self._cond:
            self._plan_base = None

    def _poll_loop(self) -> None:
        backoff = self._poll_s
        while not self._stop.is_set():
            if self._poll_once():
                backoff = self._poll_s
                listening = self._watcher.listening  # PostgreSQL: a commit wakes us, polls are a safety net
                sleep = self._max_poll_s if listening else self._poll_s
            else:  # the catalog is unreachable: back off as a direct follower does (HeadWatcher.wait), not poll_s
                backoff = sleep = min(backoff * 2, max(self._max_poll_s, self._poll_s))
            woke = self._watcher.pause(sleep, self._stop)
            if woke is None:
                return

    # -- serving -------------------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        failing = refusing = full = False  # accept() failing, threads not starting, at MAX_CLIENTS: warned once per streak
        while not self._stop.is_set():
            try:
                if not readable(self._listener, 0.2):
                    continue
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._stop.is_set():
                    return  # closed by stop()
                # out of descriptors (EMFILE: many clients, a low ``ulimit -n``) or memory: the connection waits in
                # the backlog; accept again once some are free instead of leaving the relay elected and deaf
                if not failing:
                    log.warning("the head relay of %s cannot accept a connection (%s); retrying", self.stream.name, exc)
                failing = True
                self._stop.wait(0.1)
                continue
            with self._cond:
                if len(self._clients) >= MAX_CLIENTS:
                    conn.close()
                    if not full:  # otherwise only the refused readers' errors would say so, on other processes
                        log.warning("the head relay of %s serves %d clients, its most: refusing new connections until "
                                    "some close (their readers read directly: each polls the catalog itself); run "
                                    "fewer readers on this host, or read with relay=False",
                                    self.stream.name, MAX_CLIENTS)
                    full = True
                    continue
                self._clients.add(conn)
                full = False
            try:
                threading.Thread(target=self._serve, args=(conn,), name="lakestream-relay-client", daemon=True).start()
            except RuntimeError as exc:
                # "can't start new thread": the user's process limit (``ulimit -u`` counts threads) or memory. Raised
                # here, it ended the accept thread: the relay stayed elected and answered no reader of the host again.
                # Refuse this connection (its reader elects, finds the relay held and after CONNECT_S reads directly)
                # and serve the next ones once threads are free again
                with self._cond:
                    self._clients.discard(conn)
                conn.close()
                if not refusing:
                    log.warning("the head relay of %s cannot start a thread for a new client (%s; %d clients served "
                                "now); refusing connections until it can: raise the user's process limit (ulimit -u) "
                                "or run fewer readers on this host", self.stream.name, exc, len(self._clients))
                refusing = True
                self._stop.wait(0.1)
                continue
            failing = refusing = False

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                if not readable(conn, 5.0):  # stop() shuts the connection down, which wakes this at once
                    continue
                request = recv_frame(conn, timeout=IO_S, limit=MAX_REQUEST)
                try:
                    send_frame(conn, self._answer(request), timeout=IO_S)
                except FrameTooLargeError as exc:  # its client would take it for a broken connection and ask again
                    send_frame(conn, encode_error(ReadError(
                        f"the head relay's answer for step {str(request.get('step'))[:40]} of {self.stream.name} is "
                        f"too large to send ({exc}; a step of that many data files): pass relay=False to read it "
                        "directly")), timeout=IO_S)
                self.served += 1
        except (OSError, ValueError):
            pass  # the client went away (or broke the protocol): its connection alone ends
        finally:
            with self._cond:
                self._clients.discard(conn)
            conn.close()

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "wait":
                return self._wait(request)
            if op == "files":
                return self._files(request)
            if op == "check":  # a client found a file gone (GC): plans are made on the head of now from here on
                self._replan()
                return self._state()
            if op == "hello":
                return {"uuid": str(self.stream.table.metadata.table_uuid), "branch": self.branch, "pid": self.pid}
            return {"error": "ReadError", "message": f"unknown relay request {str(op)[:40]!r}"}
        except Exception as exc:  # noqa: BLE001 - sent back as the same class, raised there
            return encode_error(exc)

    def _state(self) -> dict[str, Any]:
        if self._fatal is not None:
            self._poll_once()  # rare: answer with the table's state now (re-created since it was dropped, ...)
        with self._cond:
            if self._fatal is not None:
                return encode_error(self._fatal)
            step, snapshot = self._head
        # failures: the catalog polls failed in a row (a client that times out says the catalog is the cause)
        return {"head": step, "snapshot": None if snapshot is None else snapshot.snapshot_id,
                "failures": self._failures}

    def _wait(self, request: dict[str, Any]) -> dict[str, Any]:
        step, wait_s = request.get("step"), request.get("timeout")
        if type(step) is not int or not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool):
            return {"error": "ReadError", "message": "malformed relay wait request"}
        # compared as given: float() of an integer past a float's range (a wire integer) raised OverflowError, sent
        # back as "the head relay failed (OverflowError: ...)"; a NaN waits 0 s
        end = time.monotonic() + max(0.0, min(wait_s, WAIT_SLICE_S))
        with self._cond:
            while self._head[0] < step and self._fatal is None and not self._stop.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return self._state()

    def _files(self, request: dict[str, Any]) -> dict[str, Any]:
        step, seen = request.get("step"), request.get("snapshot")  # seen: the client's head snapshot (None: unknown)
        if type(step) is not int or not (seen is None or type(seen) is int):
            return {"error": "ReadError", "message": "malformed relay files request"}
        if self._fatal is not None or step > self._head[0]:
            self._poll_once()  # the client heard of a newer head (from this relay's predecessor, or a poll ago)
        with self._cond:
            if self._fatal is not None:
                return encode_error(self._fatal)
            base = self._plan_base
            if base is None or base[0] < step:  # plan on the newest head only for a step the older one lacks
                base = self._plan_base = self._head
            snapshot, reaches = base[1], base[0] >= step
        metadata = self.stream.table.metadata
        # the client's head when the two are of unrelated lineages, or when the client's head lists a step this
        # relay's head does not reach (moved back by another engine, seen by a holder elected since): as a direct read
        own = (_unrelated(metadata, seen, snapshot) if reaches
               else None if seen is None else _snapshots_by_id(metadata).get(seen))
        snapshot = own or snapshot
        key = (None if snapshot is None else snapshot.snapshot_id, step)
        kept = self._kept(key)  # before the lock: an answer kept never waits for another step's lookup (storage)
        if kept is not None:
            return kept
        with self._plan_lock:  # one lookup per step: the clients a head move woke all ask at once
            return self._plan(key, step, snapshot)

    def _kept(self, key: tuple[int | None, int]) -> dict[str, Any] | None:
        with self._cond:
            kept = self._plans.get(key)
            if kept is not None:
                self._plans.move_to_end(key)
            return kept

    def _plan(self, key: tuple[int | None, int], step: int, snapshot: Any) -> dict[str, Any]:
        kept = self._kept(key)  # looked up by a client that held the lock before this one
        if kept is not None:
            return kept
        index = self.stream.index

        def on_head() -> list[Any]:
            nonlocal snapshot
            snapshot = self._head[1]
            return index.files(snapshot, step)

        files = after_gc(lambda: index.files(snapshot, step), refresh=self._replan, again=on_head)
        if not files:
            raise missing_step_error(step, StreamState.of(snapshot), self.branch, self.stream.name)
        answer = {"step": step, "snapshot": snapshot.snapshot_id, "uuid": str(self.stream.table.metadata.table_uuid),
                  "files": encode_files(files)}
        with self._cond:
            self._plans[key] = answer
            self._plan_files += len(files)
            while len(self._plans) > 1 and (len(self._plans) > PLANS_KEPT or self._plan_files > PLAN_FILES_KEPT):
                self._plan_files -= len(self._plans.popitem(last=False)[1]["files"])
        return answer


def _unrelated(metadata: Any, seen: int | None, base: Any) -> Any:
    """The client's head snapshot (id ``seen``) when it and ``base``, the head steps are planned on, are of two
    lineages: the branch was rolled back (another engine's ``rollback_to_snapshot``) between them and a step may have
    been published again since, so the client's step is the one its head lists, as a direct read takes it. None when
    one descends from the other (a step both list is the same on both), or the client's head is no longer kept."""
    if seen is None or base is None or seen == base.snapshot_id:
        return None
    by_id = _snapshots_by_id(metadata)
    own = by_id.get(seen)
    if own is None or _descends(by_id, own, base) or _descends(by_id, base, own):
        return None
    return own


_by_id: tuple[Any, dict[int, Any]] | None = None  # the last table metadata's snapshots by id (it never changes)


def _snapshots_by_id(metadata: Any) -> dict[int, Any]:
    """``metadata``'s snapshots by id, made once per metadata: a files request whose client heard of a newer head than
    the one its step is planned on (most, once the head moves on) would otherwise index every retained snapshot."""
    global _by_id
    kept = _by_id
    if kept is None or kept[0] is not metadata:
        kept = _by_id = (metadata, {s.snapshot_id: s for s in metadata.snapshots})
    return kept[1]


def _descends(by_id: dict[int, Any], snapshot: Any, ancestor: Any) -> bool:
    """Whether ``ancestor`` is on ``snapshot``'s parent links (a sequence number below the ancestor's ends the walk:
    sequence numbers grow along a lineage)."""
    current = snapshot
    for _ in range(len(by_id) + 1):  # parent links that loop (another engine's) end it too
        if current is None or (current.sequence_number or 0) < (ancestor.sequence_number or 0):
            return False
        if current.snapshot_id == ancestor.snapshot_id:
            return True
        current = by_id.get(current.parent_snapshot_id) if current.parent_snapshot_id is not None else None
    return False


_HELD: dict[str, HeadRelay] = {}  # this process's relays, by key
_HELD_LOCK = threading.Lock()


def held(paths: RelayPaths) -> HeadRelay | None:
    """The relay this process serves at ``paths``, if any."""
    with _HELD_LOCK:
        relay = _HELD.get(paths.key)
    return relay if relay is not None and relay.alive and relay.pid == os.getpid() else None


def hold(stream: StreamTable, *, branch: str, paths: RelayPaths, poll_s: float, max_poll_s: float) -> HeadRelay | None:
    """Serve the relay at ``paths`` when no process does (this process wins the ``flock``); None when another holds it.

    Raises:
        OSError: The lock file or socket cannot be made (the caller reads directly).
    """
    relay = held(paths)
    if relay is not None:
        return relay
    fd = lock_file(paths.lock)
    if fd is None:
        return None
    try:
        relay = HeadRelay(stream, branch=branch, paths=paths, lock_fd=fd, poll_s=poll_s, max_poll_s=max_poll_s)
    except BaseException:
        unlink_quietly(paths.lock)
        os.close(fd)
        raise
    with _HELD_LOCK:
        _HELD[paths.key] = relay
    log.debug("serving the head relay of %s (branch %s) at %s", stream.name, branch, paths.socket)
    sweep(paths)
    return relay


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _forget_after_fork() -> None:
    """In a forked child: the parent's relays are not this process's; close their lock and socket copies (a child
    holding the lock's open file would keep the parent's relay elected after the parent died, and one holding its
    clients' connections would keep them open: they would wait out ``IO_S`` and fail instead of electing anew).
    Closed, never shut down: shutting a connection down here would end the parent's."""
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()
    inherited = list(_HELD.values())
    _HELD.clear()
    for relay in inherited:
        closers: list[Callable[[], None]] = [partial(os.close, relay._lock_fd), relay._listener.close]
        closers += [conn.close for conn in list(relay._clients)]
        for close in closers:
            try:
                close()
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
