"""A follow-mode reader's side of the head relay (:mod:`lakestream_iceberg.read.relay`): :class:`RelayWatcher`.

It answers what :func:`~lakestream_iceberg.read.follow.pump_steps` asks of a head watcher (``check``, ``head``,
``wait``, ``close``) and, per step, the step's data files (``files``), by asking the host's relay instead of the
catalog and the table's metadata files. The reader then reads only its own data through its own FileIO.

Two connections per reader: one for the blocking ``wait``\\ s, one for the prefetch threads' ``files`` (each behind its
own lock, so a wait never holds up a prefetch). A connection that breaks (the holder exited) is opened again, which
elects a new holder, maybe this process.

The relay is an optimisation: every reader can read the head and a step's files itself. When the relay fails (a holder
that does not answer within ``IO_S`` beyond the asked wait, stopped or stuck in a slow lookup; ``ATTEMPTS`` connections
broken in a row; no holder within ``CONNECT_S``; this process unable to serve it, its folder gone or not writable; a
relay at its socket that serves another table or branch), the reader logs one warning naming the cause and the socket
and goes on reading directly, as ``relay=False`` reads, from the step it was at (:meth:`RelayWatcher._go_direct`). It
stays direct for the rest of that iteration (its watcher's life); the next iteration tries the relay again. Errors of
the stream itself (a collected step, a dropped table, a changed world size) are not relay failures: they are raised as
a direct read raises them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot

from lakestream_iceberg.connect.pointer import refresh_if_moved, release_idle_connections
from lakestream_iceberg.errors import ReadError, ReadTimeoutError
from lakestream_iceberg.format.summary import StreamState, missing_step_error
from lakestream_iceberg.format.table import StreamTable
from lakestream_iceberg.read.follow import HeadWatcher
from lakestream_iceberg.read.relay import IO_S, HeadRelay, hold
from lakestream_iceberg.read.relay_wire import RelayPaths, decode_error, decode_files, recv_frame, relay_paths, send_frame
from lakestream_iceberg.read.stream_ref import StreamRef

log = logging.getLogger(__name__)

__all__ = ["RelayUnavailableError", "RelayWatcher", "follower", "head_reader"]

CONNECT_S = 10.0  # how long a reader waits for some process to serve the relay (a holder starting up)
WAIT_SLICE_S = 0.5  # a wait asks again this often, so that a stop is noticed
ATTEMPTS = 4  # connections broken in a row (holders exiting one after the other) before giving up


class RelayUnavailableError(ReadError):
    """The head relay cannot be used now (it does not answer, breaks every connection, cannot be served from here, or
    serves another table): a reader that may read directly does (:class:`RelayWatcher`), else this is raised.

    Never sent over the wire (:func:`~lakestream_iceberg.read.relay_wire.decode_error` knows only
    :mod:`lakestream_iceberg.errors`' classes), so a relay cannot make a reader take its own errors for one."""

    def __init__(self, cause: str, *, hint: str = "pass relay=False to read without it") -> None:
        super().__init__(f"{cause}; {hint}" if hint else cause)
        self.cause = cause


class _Channel:
    __slots__ = ("holder", "lock", "pid", "sock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.pid = 0  # the process that opened the connection (a forked child opens its own)
        self.holder: object = None  # the pid of the process serving the relay, as its hello said

    def drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None


class RelayWatcher:
    """Follows a stream branch's head through the host's relay (serving it when no other process does).

    Args:
        stream: The stream (its FileIO reads the data; its catalog is used only while this process holds the relay, or
            once this reader reads directly).
        paths: Where the relay lives (:func:`~lakestream_iceberg.read.relay_wire.relay_paths`).
        branch: The branch to follow.
        poll_s, max_poll_s: The holder's poll interval, and its safety-net interval when commit notifications wake it.
        elect: Serve the relay from this process when no process does; False: only ever a client (a connection that
            finds nobody serving raises ``RelayUnavailableError`` at once).
        fallback: When the relay fails after this watcher was made, log one warning and read directly (the catalog and
            the table's metadata, as a ``relay=False`` reader: :class:`~lakestream_iceberg.read.follow.HeadWatcher`)
            for the rest of this watcher's life; False: raise ``RelayUnavailableError``.
        existed: As :class:`~lakestream_iceberg.read.follow.HeadWatcher`'s, for the direct reads after a fallback.

    Raises:
        OSError: The relay's socket cannot be reached (read directly instead).
        RelayUnavailableError: No relay answered within ``CONNECT_S`` seconds (at once without ``elect``), this process
            cannot make the relay's lock file or socket, or the relay there serves another table or branch (read
            directly instead).
    """

    def __init__(self, stream: StreamTable, *, paths: RelayPaths, branch: str, poll_s: float, max_poll_s: float,
                 elect: bool = True, fallback: bool = False, existed: bool = False) -> None:
        self._stream, self._paths, self._branch, self._elect = stream, paths, branch, elect
        self._poll_s, self._max_poll_s = poll_s, max_poll_s
        self._fallback, self._existed = fallback, existed
        self._uuid = str(stream.table.metadata.table_uuid)
        self._head: tuple[int, int | None] = (0, None)
        self._failures = 0  # the holder's catalog polls failed in a row, as it last said
        self._wait_channel, self._files_channel = _Channel(), _Channel()
        self._holding: HeadRelay | None = None
        self._hold_lock = threading.Lock()
        self._direct: HeadWatcher | None = None  # set once the relay failed: this reader reads directly from then on
        self._direct_lock = threading.Lock()
        self._lookup: StreamTable | None = None  # a view of its own for the prefetch threads' snapshot lookups
        self._lookup_lock = threading.Lock()
        self.requests = 0
        with self._wait_channel.lock:
            self._connect(self._wait_channel)

    @property
    def holding(self) -> bool:
        """Whether this process serves the relay now."""
        return self._holding is not None and self._holding.alive

    @property
    def direct(self) -> bool:
        """Whether this reader reads directly now, the relay having failed (see :meth:`_go_direct`)."""
        return self._direct is not None

    # -- the HeadWatcher interface -------------------------------------------------------------------------------------
    def check(self) -> bool:
        """Have the relay poll now; True when the head moved since this reader last heard."""
        direct = self._direct
        if direct is None:
            before = self._head
            try:
                self._note(self._request(self._wait_channel, {"op": "check"}, wait_s=0.0))
                return self._head != before
            except RelayUnavailableError as exc:
                direct = self._go_direct(exc)
        return direct.check()

    def head(self) -> tuple[int, Any]:
        """The head step and the id of its snapshot, as last heard (no I/O). Once reading directly: the head step and
        snapshot of this reader's view, or the relay's last head while the view is older (the head never goes back
        when a reader changes how it asks, only when the branch does)."""
        direct = self._direct
        if direct is not None:
            now = direct.head()
            if now[0] >= self._head[0]:
                return now
        return self._head

    def latest(self) -> tuple[int, Any]:
        """The head step and snapshot id as the relay last polled them: one local request, which neither waits nor
        makes the relay poll (its own loop keeps the head current)."""
        direct = self._direct
        if direct is None:
            try:
                self._note(self._request(self._wait_channel, {"op": "wait", "step": 0, "timeout": 0}, wait_s=0.0))
                return self._head
            except RelayUnavailableError as exc:
                direct = self._go_direct(exc)
        direct.check()
        return self.head()

    def wait(self, step: int, *, timeout: float | None, stop: threading.Event, poll_s: float = 0.02,
             max_poll_s: float = 0.5) -> tuple[int, Any] | None:
        """Block until ``step`` is published (the relay wakes this reader); None when ``stop`` was set. ``timeout``
        runs from the start, and again from each step published meanwhile (as :meth:`HeadWatcher.wait`).

        Raises:
            ReadTimeoutError: ``timeout`` seconds passed first (``None`` waits forever).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = self._head[0]
        while not stop.is_set() and self._direct is None:
            if timeout is not None and self._head[0] > seen:  # a step published meanwhile: as HeadWatcher.wait
                seen, deadline = self._head[0], time.monotonic() + timeout
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                if self._failures:
                    raise ReadTimeoutError(
                        f"step {step} of {self._stream.name} (branch {self._branch!r}) was not seen within {timeout}s "
                        f"(head step is {self._head[0]}): the head relay's holder (pid {self._wait_channel.holder}) "
                        f"cannot reach the catalog ({self._failures} polls failed in a row; its log says why)"
                    )
                raise ReadTimeoutError(
                    f"step {step} of {self._stream.name} (branch {self._branch!r}) was not published within {timeout}s "
                    f"(head step is {self._head[0]}); are the producers running? Raise the dataset's timeout= to wait "
                    "longer"
                )
            slice_s = WAIT_SLICE_S if remaining is None else min(WAIT_SLICE_S, remaining)
            try:
                self._note(self._request(self._wait_channel, {"op": "wait", "step": step, "timeout": slice_s},
                                         wait_s=slice_s))
            except RelayUnavailableError as exc:
                self._go_direct(exc, step=step)
                break
            if self._head[0] >= step:
                return self._head
        direct = self._direct
        if stop.is_set() or direct is None:
            return None
        # the rest of this wait directly: what is left of its timeout (restarted by a step published meanwhile there)
        if self.head()[0] >= step:
            return self.head()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        waited = direct.wait(step, timeout=left, stop=stop, poll_s=poll_s, max_poll_s=max_poll_s)
        return None if waited is None else self.head()

    def files(self, snapshot: object, step: int) -> list[DataFile]:
        """The data files of ``step`` on the relay's head (``snapshot``: the id of this reader's head, as last heard; the
        relay's head is as new or newer, and a step's files are the same on every head of one lineage; when another
        engine rolled the branch back between the two, the relay plans on this reader's head, as a direct read does).
        Once reading directly, looked up on ``snapshot`` as a direct read does (a snapshot, or the id of one).

        Raises:
            StepCollectedError, StepNotPublishedError, StreamError, ...: what a direct lookup raises, forwarded.
        """
        if self._direct is None:
            seen = snapshot if type(snapshot) is int else None
            try:
                reply = self._request(self._files_channel, {"op": "files", "step": step, "snapshot": seen}, wait_s=0.0)
                if reply.get("step") != step or reply.get("uuid") != self._uuid:  # never used: read directly
                    raise RelayUnavailableError(
                        f"the head relay at {self._paths.socket} answered step {str(reply.get('step'))[:40]!r} of table "
                        f"{str(reply.get('uuid'))[:40]!r} when asked for step {step} of {self._uuid}", hint="")
                return decode_files(reply.get("files"))
            except RelayUnavailableError as exc:
                self._go_direct(exc, step=step)
        return self._direct_files(snapshot, step)

    def close(self) -> None:
        """Close the connections; stop serving when this was the process's last reader of the relay."""
        for channel in (self._wait_channel, self._files_channel):
            with channel.lock:
                channel.drop()
        with self._hold_lock:
            holding, self._holding = self._holding, None
        if holding is not None and holding.pid == os.getpid():
            holding.release()
        with self._direct_lock:
            direct = self._direct
        if direct is not None:
            direct.close()

    # -- reading directly ----------------------------------------------------------------------------------------------
    def _go_direct(self, exc: RelayUnavailableError, *, step: int | None = None) -> HeadWatcher:
        """Read directly from now on, the relay having failed with ``exc`` (raised instead without ``fallback``).

        Once per watcher (the first thread to find the relay failed warns; the others, a prefetch thread and the
        waiting one, follow). The relay is not asked again during this watcher's life, an iteration: a relay that
        failed once (a stopped holder, a full or foreign socket) would likely fail again and cost each reader another
        ``IO_S`` or ``CONNECT_S``. The next iteration (a new watcher) tries it again. While this process serves the
        relay it goes on serving the host's other readers until this reader closes."""
        if not self._fallback:
            raise exc
        with self._direct_lock:
            if self._direct is None:
                log.warning("the head relay of %s (branch %r) at %s failed%s: %s. This reader goes on reading directly "
                            "from the catalog and the table's metadata (as relay=False does) for the rest of this "
                            "iteration, from the step it was at; the next iteration tries the relay again",
                            self._stream.name, self._branch, self._paths.socket,
                            "" if step is None else f" (at step {step})", exc.cause)
                self._direct = HeadWatcher(self._stream, branch=self._branch, existed=self._existed)
            return self._direct

    def _direct_files(self, snapshot: object, step: int) -> list[DataFile]:
        """``step``'s data files on ``snapshot`` (a snapshot; or the id of one, or None, heard from the relay), looked
        up from this process as a ``relay=False`` reader does (the follower's files function)."""
        found_snapshot = snapshot if isinstance(snapshot, Snapshot) else self._snapshot(snapshot)
        found = self._stream.index.files(found_snapshot, step)
        if not found:
            raise missing_step_error(step, StreamState.of(found_snapshot), self._branch, self._stream.name)
        return found

    def _snapshot(self, snapshot_id: object) -> Snapshot | None:
        """The snapshot of ``snapshot_id``, a head heard from the relay (None: the head of now).

        Looked up in the reader's view, else in a view of this watcher's own brought up to date (a prefetch thread
        never moves the reader's view: the waiting thread does). A snapshot the table no longer lists (expired by GC
        since the relay named it) raises ``FileNotFoundError``, as a direct read of an expired head's manifest list
        does: the follower then reads the step again on the head of now (:func:`~lakestream_iceberg.format.table.after_gc`).
        """
        if type(snapshot_id) is int:
            found = self._stream.table.metadata.snapshot_by_id(snapshot_id)
            if found is not None:
                return found
        with self._lookup_lock:
            if self._lookup is None:
                table = self._stream.table
                self._lookup = StreamTable(Table(table.name(), table.metadata, table.metadata_location, table.io,
                                                 table.catalog))
            refresh_if_moved(self._lookup.table)
            metadata = self._lookup.table.metadata
        if type(snapshot_id) is not int:
            return metadata.snapshot_by_name(self._branch)
        found = metadata.snapshot_by_id(snapshot_id)
        if found is None:
            raise FileNotFoundError(f"snapshot {snapshot_id} of {self._stream.name}, the head the relay named, is no "
                                    "longer in the table's metadata (expired)")
        return found

    # -- connections ---------------------------------------------------------------------------------------------------
    def _note(self, reply: dict[str, Any]) -> None:
        head, snapshot = reply.get("head"), reply.get("snapshot")
        if type(head) is not int or not (snapshot is None or type(snapshot) is int):
            raise ReadError(f"the head relay answered a malformed head {str(reply)[:200]}")
        if head >= self._head[0]:
            self._head = (head, snapshot)
        failures = reply.get("failures")
        self._failures = failures if type(failures) is int else 0

    def _request(self, channel: _Channel, message: dict[str, Any], *, wait_s: float) -> dict[str, Any]:
        with channel.lock:
            for _ in range(ATTEMPTS):
                if channel.sock is None or channel.pid != os.getpid():
                    self._connect(channel)
                assert channel.sock is not None
                try:
                    send_frame(channel.sock, message, timeout=IO_S)
                    reply = recv_frame(channel.sock, timeout=wait_s + IO_S)
                except TimeoutError:
                    channel.drop()
                    raise RelayUnavailableError(
                        f"the head relay of {self._stream.name} at {self._paths.socket} did not answer within "
                        f"{wait_s + IO_S:g}s (is its holder, pid {channel.holder}, stopped?)"
                    ) from None
                except OSError:  # the holder exited: connect again, which elects a new one
                    channel.drop()
                    continue
                self.requests += 1
                if "error" in reply:
                    raise decode_error(reply)
                return reply
        raise RelayUnavailableError(f"the head relay of {self._stream.name} at {self._paths.socket} closed {ATTEMPTS} "
                                    "connections in a row")

    def _connect(self, channel: _Channel) -> None:
        """Open ``channel`` to the relay, serving it from this process when no process does."""
        channel.drop()
        deadline, delay = time.monotonic() + CONNECT_S, 0.001
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(IO_S)
                sock.connect(str(self._paths.socket))
                send_frame(sock, {"op": "hello"}, timeout=IO_S)
                hello = recv_frame(sock, timeout=IO_S)
            except (FileNotFoundError, ConnectionError, BlockingIOError):
                sock.close()  # nobody serves it (or its holder just exited): elect; BlockingIOError: its queue of
                # connections not yet accepted is full (a unix socket refuses at once): wait for a place, as here
            except TimeoutError:  # a holder that accepts (the kernel queues the connection) but never answers
                sock.close()
                raise RelayUnavailableError(f"the head relay of {self._stream.name} at {self._paths.socket} did not "
                                            f"answer within {IO_S:g}s (is its holder stopped?)") from None
            except OSError as exc:  # a socket this process may not use (another user's file, too long a path...)
                sock.close()
                raise RelayUnavailableError(f"the head relay of {self._stream.name} at {self._paths.socket} cannot be "
                                            f"reached ({type(exc).__name__}: {exc.strerror or exc})") from exc
            except BaseException:
                sock.close()
                raise
            else:
                if hello.get("uuid") != self._uuid or hello.get("branch") != self._branch:
                    # not this stream's relay (another program, or another build, answering at its socket): its answers
                    # are never used; a reader reads directly, as it always can
                    sock.close()
                    raise RelayUnavailableError(
                        f"the head relay at {self._paths.socket} serves table {str(hello.get('uuid'))[:40]!r} branch "
                        f"{str(hello.get('branch'))[:200]!r}, not {self._uuid} branch {self._branch!r}", hint="")
                channel.sock, channel.pid = sock, os.getpid()
                channel.holder = hello.get("pid") if type(hello.get("pid")) is int else "unknown"
                return
            if not self._elect:
                raise RelayUnavailableError(f"no process serves the head relay of {self._stream.name} at "
                                            f"{self._paths.socket}", hint="")
            try:
                relay = hold(self._stream, branch=self._branch, paths=self._paths, poll_s=self._poll_s,
                             max_poll_s=self._max_poll_s)
            except OSError as exc:  # its folder removed (systemd removes $XDG_RUNTIME_DIR at logout), not writable...
                raise RelayUnavailableError(
                    f"this process cannot serve the head relay of {self._stream.name} at {self._paths.socket} "
                    f"({type(exc).__name__}: {exc.strerror or exc})",
                    hint="pass relay=False to read without it, or set LAKESTREAM_RELAY_DIR to a folder that stays",
                ) from exc
            if relay is not None and relay is not self._holding:  # a relay this reader already serves from refused
                self._adopt(relay)                                  # it (at MAX_CLIENTS): wait, up to the deadline
                continue
            if time.monotonic() > deadline:
                raise RelayUnavailableError(f"no process served the head relay of {self._stream.name} at "
                                            f"{self._paths.socket} within {CONNECT_S:g}s (or its holder has all the "
                                            "clients it takes)")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _adopt(self, relay: HeadRelay) -> None:
        with self._hold_lock:
            if self._holding is relay:
                return
            relay.retain()
            old, self._holding = self._holding, relay
        if old is not None and old.pid == os.getpid():
            old.release()


def head_reader(stream: StreamTable, *, ref: StreamRef, branch: str, relay: bool, poll_s: float,
                max_poll_s: float) -> tuple[Callable[[], int], Callable[[], None]]:
    """A function returning the branch's head step now, and one releasing what it holds: for a process that reads no
    steps itself but reports how far behind the head it is (the training process of a DataLoader with workers).

    Through the host's relay when ``relay`` (one local request, as every reader of the host: a thousand ranks add no
    catalog or storage request per report), as a client only: the training process never serves the relay, which
    would put the host's catalog polls and every worker's step plans on the training loop's interpreter; it connects at
    its first call (none where the metric is not exported). Else, and while no other process serves the relay (before
    the workers start), one pointer query per call and the table's ``metadata.json`` when the head moved (a REST
    catalog: one ``loadTable``).
    """
    paths = None
    if relay:
        paths = relay_paths(catalog_name=ref.catalog_name, catalog_properties=ref.catalog_properties,
                            identifier=ref.identifier, table_uuid=str(stream.table.metadata.table_uuid), branch=branch)
    reader = _HeadReader(stream, paths=paths, branch=branch, poll_s=poll_s, max_poll_s=max_poll_s)
    return reader.head, reader.close


class _HeadReader:
    """:func:`head_reader`'s state: a relay client and a direct watcher, each made on first use."""

    def __init__(self, stream: StreamTable, *, paths: RelayPaths | None, branch: str, poll_s: float,
                 max_poll_s: float) -> None:
        self._stream, self._paths, self._branch = stream, paths, branch
        self._poll_s, self._max_poll_s = poll_s, max_poll_s
        self._lock = threading.Lock()  # the reporter's thread and its last report at close may ask at once
        self._client: RelayWatcher | None = None
        self._direct: HeadWatcher | None = None
        self._closed = False

    def head(self) -> int:
        with self._lock:
            if self._closed:
                raise ReadError(f"the head reader of {self._stream.name} was closed")
            if self._paths is not None:
                try:
                    if self._client is None:
                        self._client = RelayWatcher(self._stream, paths=self._paths, branch=self._branch,
                                                    poll_s=self._poll_s, max_poll_s=self._max_poll_s, elect=False)
                    return self._client.latest()[0]
                except (OSError, ReadError) as exc:  # nobody serves it (yet, or any more): read directly this time
                    log.debug("head relay unusable for the steps-behind metric (%s); reading directly", exc)
                    if self._client is not None:
                        self._client.close()
                        self._client = None
            if self._direct is None:  # a view of its own: the reading thread's watcher refreshes the stream's in place
                table = self._stream.table  # (two threads writing one view's metadata and location could leave a mix)
                own = StreamTable(Table(table.name(), table.metadata, table.metadata_location, table.io, table.catalog))
                self._direct = HeadWatcher(own, branch=self._branch, listen=False)
            self._direct.check()
            return self._direct.head()[0]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, direct, self._client, self._direct = self._client, self._direct, None, None
        if client is not None:
            client.close()
        if direct is not None:
            direct.close()


def follower(stream: StreamTable, *, ref: StreamRef, branch: str, relay: bool, poll_s: float,
             max_poll_s: float, existed: bool = False) -> tuple[RelayWatcher | HeadWatcher,
                                                                 Callable[[Any, int], list[DataFile]]]:
    """A head watcher for :func:`~lakestream_iceberg.read.follow.pump_steps` and the function giving a step's files:
    through the host's relay when ``relay`` and a private runtime directory is usable, else directly (the catalog and
    the table's manifests, from this process). A relay that cannot be used when the watcher is made is warned about and
    not used; one that fails later makes the watcher read directly from there on (:class:`RelayWatcher`'s ``fallback``).

    A reader that is a relay client keeps no idle catalog connection (PostgreSQL): it needs none to follow (it opens
    them again if it has to read directly).
    """
    if relay:
        paths = relay_paths(catalog_name=ref.catalog_name, catalog_properties=ref.catalog_properties,
                            identifier=ref.identifier, table_uuid=str(stream.table.metadata.table_uuid), branch=branch)
        if paths is None:
            if not os.environ.get("LAKESTREAM_RELAY_DIR"):  # a set one that cannot be used: relay_dir() said why
                log.warning("no private runtime directory for the head relay ($XDG_RUNTIME_DIR, /dev/shm, %s); every "
                            "reader polls the catalog itself. Set LAKESTREAM_RELAY_DIR to a directory only you can "
                            "enter", os.environ.get("TMPDIR", "/tmp"))
        else:
            try:
                watcher = RelayWatcher(stream, paths=paths, branch=branch, poll_s=poll_s, max_poll_s=max_poll_s,
                                       fallback=True, existed=existed)
            except (OSError, ReadError) as exc:
                log.warning("the head relay at %s is unusable (%s: %s); reading directly", paths.socket,
                            type(exc).__name__, exc)
            else:
                if not watcher.holding:
                    release_idle_connections(stream.table.catalog)
                return watcher, watcher.files
    direct = HeadWatcher(stream, branch=branch, existed=existed)

    def files(snapshot: Any, step: int) -> list[DataFile]:
        found = stream.index.files(snapshot, step)
        if not found:
            raise missing_step_error(step, StreamState.of(snapshot), branch, stream.name)
        return found

    return direct, files
