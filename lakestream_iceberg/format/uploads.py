"""Concurrent writes of one commit's metadata files.

A group commit of k batches writes, inside its critical section, k manifest lists and k manifests (one per snapshot
inside the group, one for the whole group) before its ``metadata.json``. Written one after another, each pays a full
round trip: a PUT on object storage (tens of milliseconds each), a file creation on a local file system (0.1-1.5 ms
on a busy disk). None of them is visible to anyone before the swap names them, and none depends on another's
existence, only on its bytes, which are encoded in memory first (see :mod:`lakestream_iceberg.format.avro_writers`).
So they are sent concurrently, and the commit waits for all of them before the catalog's update names them: the swap
writes ``metadata.json`` meanwhile (:meth:`~lakestream_iceberg.format.manifests.ManifestPlanner.wait_written`, called
through ``Plan.ready``), so that write overlaps theirs.

Only the writes move to other threads: encoding stays in the planning thread, in order, so the files are byte for
byte what sequential writes produce.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from pyiceberg.io import FileIO

from lakestream_iceberg.connect.fork import ProcessPool

__all__ = ["Uploads"]

# Enough for a large group commit's lists and manifests to be in flight together; each thread spends its time waiting
# on storage, not on the CPU.
_POOL = ProcessPool(max_workers=8, name="lakestream-upload")


def _put(io: FileIO, location: str, data: bytes) -> None:
    # the output file is made on the thread that writes it: an fsspec file system (and its client) belongs to the
    # thread that made it (pyiceberg keeps one per thread)
    with io.new_output(location).create(overwrite=True) as stream:
        stream.write(data)


class Uploads:
    """The files one plan has sent through ``io`` and not yet waited for (:meth:`put`); :meth:`wait` for all of them."""

    def __init__(self, io: FileIO) -> None:
        self._io = io
        self._lock = threading.Lock()
        self._futures: list[tuple[str, Future[None]]] = []

    def put(self, location: str, data: bytes) -> None:
        """Write ``data`` to ``location`` (replacing it) on a pool thread."""
        future = _POOL.submit(_put, self._io, location, data)
        with self._lock:
            self._futures.append((location, future))

    def pending(self, location: str) -> bool:
        """Whether a write of ``location`` was sent and not yet waited for: before reading it back, :meth:`wait` (which
        raises the write's own failure, where a read would only find no file)."""
        with self._lock:
            return any(path == location for path, _ in self._futures)

    def wait(self) -> None:
        """Return once every write sent so far finished; raise the first failure (after all of them finished, so
        that no write is still running when the caller cleans up)."""
        with self._lock:
            futures, self._futures = self._futures, []
        failure: BaseException | None = None
        for _, future in futures:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once every write finished
                failure = failure or exc
        if failure is not None:
            raise failure
