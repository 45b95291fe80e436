"""What a head relay and its clients say to each other, and where they meet (:mod:`lakestream_iceberg.read.relay`).

* **Where**: a per-user runtime directory (``$LAKESTREAM_RELAY_DIR``, else ``$XDG_RUNTIME_DIR/lakestream``, else
  ``/dev/shm/lakestream-<uid>``, else ``<tempdir>/lakestream-<uid>``), made ``0700`` and used only when this user owns
  it and nobody else may enter it. One relay per stream, branch and table UUID: ``<key>.lock`` (the ``flock`` that
  elects the holder) and ``<key>.sock`` (its unix socket), ``key`` a hash of the wire protocol, the
  ``lakestream.format-version`` values this release reads, the catalog's name and non-secret properties, the table
  identifier, its UUID and the branch. Two releases that read different format versions (a host upgraded one process
  at a time) therefore never share a relay: a holder of a newer release, which reads a stream it upgraded, answered an
  older release's readers with steps they misread, and they never saw the version (only a holder checks it).
* **What**: frames of a 4-byte big-endian length and a JSON object, at most ``MAX_FRAME`` bytes (a client's requests:
  ``MAX_REQUEST``); every socket operation has a deadline. Errors travel as their class name and message and are raised again on the client as the
  same :mod:`lakestream_iceberg.errors` class (a few built-in ``OSError`` subclasses too); anything else arrives as a
  :class:`~lakestream_iceberg.errors.ReadError` naming the original class.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
from pyiceberg.typedef import Record

from lakestream_iceberg import errors
from lakestream_iceberg.errors import LakestreamError, ReadError
from lakestream_iceberg.format import properties as props

__all__ = ["MAX_FRAME", "MAX_REQUEST", "FrameTooLargeError", "RelayPaths", "decode_error", "decode_files", "encode_error", "encode_files", "recv_frame",
           "relay_dir", "relay_paths", "send_frame"]

PROTOCOL = 1
MAX_FRAME = 64 * 1024 * 1024  # a step of 100,000 per-rank files is ~10 MB of JSON
MAX_REQUEST = 64 * 1024  # what a relay reads from a client: its requests are a few dozen bytes
_HEADER = struct.Struct(">I")
_BUILTIN_ERRORS: dict[str, type[Exception]] = {"FileNotFoundError": FileNotFoundError, "TimeoutError": TimeoutError,
                                               "PermissionError": PermissionError}
log = logging.getLogger(__name__)
_SOCKET_NAME_MAX = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


class RelayPaths:
    """The lock file and socket of one relay."""

    __slots__ = ("key", "lock", "socket")

    def __init__(self, directory: Path, key: str) -> None:
        self.key = key
        self.lock = directory / f"{key}.lock"
        self.socket = directory / f"{key}.sock"


def relay_dir() -> Path | None:
    """The first usable per-user runtime directory (see the module docstring), or None when there is none."""
    if not hasattr(os, "getuid") or not hasattr(socket, "AF_UNIX"):
        return None  # not a POSIX system: readers read directly
    uid = os.getuid()
    chosen = os.environ.get("LAKESTREAM_RELAY_DIR")
    if chosen:
        candidates = [Path(chosen)]
    else:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        candidates = [Path(runtime) / "lakestream"] if runtime else []
        candidates += [Path("/dev/shm") / f"lakestream-{uid}", Path(tempfile.gettempdir()) / f"lakestream-{uid}"]
    for directory in candidates:
        problem = _unusable(directory, uid)
        if problem is None:
            return directory
        if chosen and chosen not in _warned:  # the variable was set: say why it is not used (once per process)
            _warned.add(chosen)
            log.warning("LAKESTREAM_RELAY_DIR=%s is not used: %s; followers read the catalog directly (one poll each) "
                        "until it names an absolute folder of this user's that only this user may enter (mode 0700)",
                        chosen, problem)
    return None


_warned: set[str] = set()


def _unusable(directory: Path, uid: int) -> str | None:
    """Why ``directory`` cannot be the relay directory (None: it can)."""
    if not directory.is_absolute():
        return "it is a relative path (each process would resolve it from its own working directory)"
    try:
        try:
            directory.mkdir(mode=0o700, parents=False)
        except FileExistsError:  # a folder already (checked below), or a file
            pass
        info = directory.lstat()
    except OSError as exc:
        return f"it cannot be made ({exc.strerror or exc})"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder (a file, or a link)"
    if info.st_uid != uid or info.st_mode & 0o077:  # their socket could answer in the relay's name
        return f"it belongs to another user or others may enter it (mode {stat.S_IMODE(info.st_mode):o})"
    if len(os.fsencode(directory)) + 38 > _SOCKET_NAME_MAX:  # a socket's path is bytes: "é" takes two
        return f"its path is too long for a unix socket ({_SOCKET_NAME_MAX - 38} bytes at most)"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "this user may not write in it"
    return None


def relay_paths(*, catalog_name: str, catalog_properties: Sequence[tuple[str, str]], identifier: str,
                table_uuid: str, branch: str) -> RelayPaths | None:
    """Where the relay of this stream and branch meets its clients (None: no usable directory, read directly)."""
    directory = relay_dir()
    if directory is None:
        return None
    # the format versions read at call time (props.FORMAT_VERSION, as check_format_version reads it): see the docstring
    ident = json.dumps([PROTOCOL, list(props.FORMAT_VERSION.choices), catalog_name, sorted(catalog_properties),
                        identifier, table_uuid, branch])
    return RelayPaths(directory, hashlib.sha256(ident.encode()).hexdigest()[:32])


# -- frames ------------------------------------------------------------------------------------------------------------
def send_frame(sock: socket.socket, message: dict[str, Any], *, timeout: float) -> None:
    """Send one JSON object; ``socket.timeout`` when it does not leave within ``timeout`` seconds.

    Raises:
        FrameTooLargeError: It encodes to more than ``MAX_FRAME`` bytes (nothing was sent: the connection is usable).
    """
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:  # the peer would refuse it as a broken connection (see recv_frame)
        raise FrameTooLargeError(f"{len(body)} bytes exceed the {MAX_FRAME} of a relay frame")
    sock.settimeout(timeout)
    sock.sendall(_HEADER.pack(len(body)) + body)


class FrameTooLargeError(ReadError):
    """A message larger than a relay frame carries (:func:`send_frame` sent nothing of it)."""


def recv_frame(sock: socket.socket, *, timeout: float, limit: int | None = None) -> dict[str, Any]:
    """Receive one JSON object of at most ``limit`` bytes (None: ``MAX_FRAME``) within ``timeout`` seconds.

    A relay reads its clients' requests with ``limit=MAX_REQUEST``: with ``MAX_FRAME`` a client declaring 64 MB (a
    broken one, or one speaking another protocol) held up to 64 MB of the holder's memory per connection, at most
    ``MAX_CLIENTS`` connections.

    Raises:
        socket.timeout: Nothing complete arrived in time.
        ConnectionError: The other side closed the connection (or sent something that is not a frame).
    """
    deadline = time.monotonic() + timeout
    (size,) = _HEADER.unpack(_read(sock, _HEADER.size, deadline))
    limit = MAX_FRAME if limit is None else limit
    if size > limit:
        raise ConnectionError(f"relay frame of {size} bytes exceeds {limit}")
    try:
        message = json.loads(_read(sock, size, deadline))
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise ConnectionError(f"relay frame is not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise ConnectionError("relay frame is not a JSON object")
    return message


def _read(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks, left = [], size
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(remaining)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionResetError("the relay connection was closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- payloads ----------------------------------------------------------------------------------------------------------
def encode_error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)}


def decode_error(reply: dict[str, Any]) -> Exception:
    """The exception a relay reply carries, as the class the relay raised where it is known."""
    name, message = str(reply.get("error")), str(reply.get("message", ""))
    found = getattr(errors, name, None)
    if isinstance(found, type) and issubclass(found, LakestreamError):
        return found(message)
    if name in _BUILTIN_ERRORS:
        return _BUILTIN_ERRORS[name](message)
    return ReadError(f"the head relay failed ({name}: {message})")


def encode_files(files: Sequence[DataFile]) -> list[list[Any]]:
    """A step's data files as what a reader needs: path, rows, bytes, partition."""
    return [[f.file_path, int(f.record_count), int(f.file_size_in_bytes), [int(f.partition[i]) for i in range(len(f.partition))]] for f in files]


def decode_files(raw: object) -> list[DataFile]:
    """The data files of a relay reply (checked: it is input).

    Raises:
        ReadError: Not a list of ``[path, rows, bytes, partition]``.
    """
    if not isinstance(raw, list):
        raise ReadError("the head relay answered a step's files with something that is not a list")
    files = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and _count(item[1])
                and _count(item[2]) and isinstance(item[3], list) and all(type(v) is int for v in item[3])):
            raise ReadError(f"the head relay answered a malformed data file entry {str(item)[:200]}")
        files.append(DataFile.from_args(content=DataFileContent.DATA, file_path=item[0], file_format=FileFormat.PARQUET,
                                        partition=Record(*item[3]), record_count=item[1], file_size_in_bytes=item[2]))
    return files


def _count(value: object) -> bool:
    return type(value) is int and value >= 0
