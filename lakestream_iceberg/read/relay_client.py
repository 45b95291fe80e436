"""A follow-mode reader's side of the head relay (:mod:`lakestream_iceberg.read.relay`): :class:`RelayWatcher`.

It answers what :func:`~lakestream_iceberg.read.follow.pump_steps` asks of a head watcher (``check``, ``head``,
``wait``, ``close``) and, per step, the step's data files (``files``), by asking the host's relay instead of the
catalog and the table's metadata files. The reader then reads only its own data through its own FileIO.

Two connections per reader: one for the blocking ``wait``\\ s, one for the prefetch threads' ``files`` (each behind its
own lock, so a wait never holds up a prefetch). A connection that breaks (the holder exited) is opened again, which
elects a new holder, maybe this process; a relay that does not answer within ``IO_S`` beyond the asked wait raises a
:class:`~lakestream_iceberg.errors.ReadError` naming the holder's pid rather than hanging.
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

from lakestream_iceberg.connect.pointer import release_idle_connections
from lakestream_iceberg.errors import ReadError, ReadTimeoutError
from lakestream_iceberg.format.summary import StreamState, missing_step_error
from lakestream_iceberg.format.table import StreamTable
from lakestream_iceberg.read.follow import HeadWatcher
from lakestream_iceberg.read.relay import IO_S, HeadRelay, hold
from lakestream_iceberg.read.relay_wire import RelayPaths, decode_error, decode_files, recv_frame, relay_paths, send_frame
from lakestream_iceberg.read.stream_ref import StreamRef

log = logging.getLogger(__name__)

__all__ = ["RelayWatcher", "follower", "head_reader"]

CONNECT_S = 10.0  # how long a reader waits for some process to serve the relay (a holder starting up)
WAIT_SLICE_S = 0.5  # a wait asks again this often, so that a stop is noticed
ATTEMPTS = 4  # connections broken in a row (holders exiting one after the other) before giving up


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
        stream: The stream (its FileIO reads the data; its catalog is used only while this process holds the relay).
        paths: Where the relay lives (:func:`~lakestream_iceberg.read.relay_wire.relay_paths`).
        branch: The branch to follow.
        poll_s, max_poll_s: The holder's poll interval, and its safety-net interval when commit notifications wake it.
        elect: Serve the relay from this process when no process does; False: only ever a client (a connection that
            finds nobody serving raises ``ReadError`` at once).

    Raises:
        OSError: The relay's socket cannot be reached (read directly instead).
        ReadError: No relay answered within ``CONNECT_S`` seconds (at once without ``elect``), or this process cannot
            make the relay's lock file or socket (read directly instead).
    """

    def __init__(self, stream: StreamTable, *, paths: RelayPaths, branch: str, poll_s: float, max_poll_s: float,
                 elect: bool = True) -> None:
        self._stream, self._paths, self._branch, self._elect = stream, paths, branch, elect
        self._poll_s, self._max_poll_s = poll_s, max_poll_s
        self._uuid = str(stream.table.metadata.table_uuid)
        self._head: tuple[int, int | None] = (0, None)
        self._failures = 0  # the holder's catalog polls failed in a row, as it last said
        self._wait_channel, self._files_channel = _Channel(), _Channel()
        self._holding: HeadRelay | None = None
        self._hold_lock = threading.Lock()
        self.requests = 0
        with self._wait_channel.lock:
            self._connect(self._wait_channel)

    @property
    def holding(self) -> bool:
        """Whether this process serves the relay now."""
        return self._holding is not None and self._holding.alive

    # -- the HeadWatcher interface -------------------------------------------------------------------------------------
    def check(self) -> bool:
        """Have the relay poll now; True when the head moved since this reader last heard."""
        before = self._head
        self._note(self._request(self._wait_channel, {"op": "check"}, wait_s=0.0))
        return self._head != before

    def head(self) -> tuple[int, int | None]:
        """The head step and the id of its snapshot, as last heard (no I/O)."""
        return self._head

    def latest(self) -> tuple[int, int | None]:
        """The head step and snapshot id as the relay last polled them: one local request, which neither waits nor
        makes the relay poll (its own loop keeps the head current)."""
        self._note(self._request(self._wait_channel, {"op": "wait", "step": 0, "timeout": 0}, wait_s=0.0))
        return self._head

    def wait(self, step: int, *, timeout: float | None, stop: threading.Event, poll_s: float = 0.02,
             max_poll_s: float = 0.5) -> tuple[int, int | None] | None:
        """Block until ``step`` is published (the relay wakes this reader); None when ``stop`` was set. ``timeout``
        runs from the start, and again from each step published meanwhile (as :meth:`HeadWatcher.wait`).

        Raises:
            ReadTimeoutError: ``timeout`` seconds passed first (``None`` waits forever).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = self._head[0]
        while not stop.is_set():
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
            self._note(self._request(self._wait_channel, {"op": "wait", "step": step, "timeout": slice_s}, wait_s=slice_s))
            if self._head[0] >= step:
                return self._head
        return None

    def files(self, snapshot: object, step: int) -> list[DataFile]:
        """The data files of ``step`` on the relay's head (``snapshot``: the id of this reader's head, as last heard; the
        relay's head is as new or newer, and a step's files are the same on every head of one lineage; when another
        engine rolled the branch back between the two, the relay plans on this reader's head, as a direct read does).

        Raises:
            StepCollectedError, StepNotPublishedError, StreamError, ...: what a direct lookup raises, forwarded.
        """
        seen = snapshot if type(snapshot) is int else None
        reply = self._request(self._files_channel, {"op": "files", "step": step, "snapshot": seen}, wait_s=0.0)
        if reply.get("step") != step or reply.get("uuid") != self._uuid:
            raise ReadError(f"the head relay answered step {reply.get('step')!r} of table {reply.get('uuid')!r} when "
                            f"asked for step {step} of {self._uuid}")
        return decode_files(reply.get("files"))

    def close(self) -> None:
        """Close the connections; stop serving when this was the process's last reader of the relay."""
        for channel in (self._wait_channel, self._files_channel):
            with channel.lock:
                channel.drop()
        with self._hold_lock:
            holding, self._holding = self._holding, None
        if holding is not None and holding.pid == os.getpid():
            holding.release()

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
                    raise ReadError(
                        f"the head relay of {self._stream.name} at {self._paths.socket} did not answer within "
                        f"{wait_s + IO_S:.0f}s (is its holder, pid {channel.holder}, stopped?); pass relay=False to "
                        "read without it"
                    ) from None
                except OSError:  # the holder exited: connect again, which elects a new one
                    channel.drop()
                    continue
                self.requests += 1
                if "error" in reply:
                    raise decode_error(reply)
                return reply
        raise ReadError(f"the head relay of {self._stream.name} at {self._paths.socket} closed {ATTEMPTS} connections "
                        "in a row; pass relay=False to read without it")

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
                raise ReadError(f"the head relay of {self._stream.name} at {self._paths.socket} did not answer within "
                                f"{IO_S:.0f}s (is its holder stopped?); pass relay=False to read without it") from None
            except BaseException:
                sock.close()
                raise
            else:
                if hello.get("uuid") != self._uuid or hello.get("branch") != self._branch:
                    sock.close()
                    raise ReadError(f"the head relay at {self._paths.socket} serves table {hello.get('uuid')!r} branch "
                                    f"{hello.get('branch')!r}, not {self._uuid} branch {self._branch!r}")
                channel.sock, channel.pid = sock, os.getpid()
                channel.holder = hello.get("pid") if type(hello.get("pid")) is int else "unknown"
                return
            if not self._elect:
                raise ReadError(f"no process serves the head relay of {self._stream.name} at {self._paths.socket}")
            try:
                relay = hold(self._stream, branch=self._branch, paths=self._paths, poll_s=self._poll_s,
                             max_poll_s=self._max_poll_s)
            except OSError as exc:  # its folder removed (systemd removes $XDG_RUNTIME_DIR at logout), not writable...
                raise ReadError(f"this process cannot serve the head relay of {self._stream.name} at "
                                f"{self._paths.socket} ({type(exc).__name__}: {exc.strerror or exc}); pass relay=False "
                                "to read without it, or set LAKESTREAM_RELAY_DIR to a folder that stays") from exc
            if relay is not None and relay is not self._holding:  # a relay this reader already serves from refused
                self._adopt(relay)                                  # it (at MAX_CLIENTS): wait, up to the deadline
                continue
            if time.monotonic() > deadline:
                raise ReadError(f"no process served the head relay of {self._stream.name} at {self._paths.socket} "
                                f"within {CONNECT_S:.0f}s (or its holder has all the clients it takes); pass "
                                "relay=False to read without it")
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
    the table's manifests, from this process).

    A reader that is a relay client keeps no idle catalog connection (PostgreSQL): it needs none to follow.
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
                watcher = RelayWatcher(stream, paths=paths, branch=branch, poll_s=poll_s, max_poll_s=max_poll_s)
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
