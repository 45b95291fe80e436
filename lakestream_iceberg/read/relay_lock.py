"""The lock files that elect a relay's holder (:mod:`.relay`), and the files of holders that were killed.

Whoever takes the ``flock`` on a relay's lock file (:mod:`.relay_wire` says where) serves it. :func:`lock_file` takes
it safely against a holder that unlinks its file while stopping; :func:`sweep` removes the socket and lock file of
every relay in the directory whose lock nobody holds (a holder killed before it could stop left them).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from lakestream_iceberg.read.relay_wire import RelayPaths

__all__ = ["LOCK_TRIES", "lock_file", "sweep", "unlink_quietly"]

log = logging.getLogger("lakestream_iceberg.read.relay")

KEY_LOCK = re.compile(r"[0-9a-f]{32}\.lock")


def sweep(paths: RelayPaths) -> int:
    """Remove the files of the relays in ``paths``' directory that no process serves any more (their holders were
    killed before they could stop), but the one of ``paths``; returns how many relays' files went.

    A relay's files are removed as a stopping holder removes its own: its socket, then its lock file while this process
    holds the lock (:func:`lock_file`, which checks that the path still names the file locked), so a reader electing a
    holder for that relay meanwhile either waits for the lock or locks a new file. A relay whose lock another process
    holds (it serves, or is about to) is left alone. Best effort: nothing here fails the caller."""
    directory = paths.lock.parent
    removed = 0
    try:  # a relay's files only (relay_paths: 32 hex digits), plain files: the folder may be one the user named
        keys = [entry.name[:-5] for entry in os.scandir(directory)
                if KEY_LOCK.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)]
    except OSError:
        return 0
    for key in keys:
        if key == paths.key:
            continue
        other = RelayPaths(directory, key)
        try:
            fd = lock_file(other.lock)
        except OSError:
            continue
        if fd is None:
            continue  # served (or being elected) by another process
        try:
            unlink_quietly(other.socket)
            unlink_quietly(other.lock)  # while still locked, as stop() does
        finally:
            os.close(fd)
        removed += 1
    if removed:
        log.debug("removed the files of %d relay(s) whose holders were gone from %s", removed, directory)
    return removed


LOCK_TRIES = 100


def lock_file(path: Path) -> int | None:
    """A descriptor holding the ``flock`` on the file ``path`` names now, or None while another process holds it.

    A holder unlinks its lock file when it stops, still holding the lock, so that relays of finished runs leave no
    files behind (a killed holder leaves its file, which the next holder takes over). A process that opened the file
    just before that unlink and locked it just after holds a file nobody else can find: it checks that ``path`` still
    names the file it locked, and else tries again with a new one. Two processes therefore never both hold the lock
    that ``path`` names.

    Raises:
        OSError: No ``flock`` here (not a POSIX system), the file cannot be made, or it was replaced ``LOCK_TRIES``
            times in a row (the caller reads directly).
    """
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        raise OSError("no flock on this platform") from None
    for _ in range(LOCK_TRIES):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = os.fstat(fd)
            try:
                named = os.stat(path)
            except FileNotFoundError:
                named = None
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if named is not None and (named.st_dev, named.st_ino) == (locked.st_dev, locked.st_ino):
            return fd
        os.close(fd)  # a stopped holder unlinked this file after we opened it: lock the one there now
    raise OSError(f"the relay lock file {path} was replaced {LOCK_TRIES} times while this process tried to lock it")


def unlink_quietly(path: Path) -> None:
    """Remove ``path``; gone already (or not ours to remove) is no error."""
    try:
        os.unlink(path)
    except OSError:
        pass
