"""The streams a Ray worker process writes to: each opened once per process and kept open across its write tasks (a Ray
worker runs many; one catalog engine each), the least recently used few only."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

from lakestream_iceberg.connect.diagnose import transient
from lakestream_iceberg.errors import StreamError
from lakestream_iceberg.read.stream_ref import StreamRef
from lakestream_iceberg.stream import Stream

__all__ = ["MAX_OPEN_STREAMS", "open_stream"]

log = logging.getLogger(__name__)


_streams: OrderedDict[tuple[int, StreamRef], Stream] = OrderedDict()  # least recently used first
_schema_ids: dict[tuple[int, StreamRef], int] = {}  # the table schema each cached stream was opened with
_streams_lock = threading.Lock()
MAX_OPEN_STREAMS = 8  # per worker process: a worker that wrote to more streams closes the least recently used


def _release(stream: Stream) -> None:
    """Close a stream this module opened: its threads, and its catalog (the catalog's connections)."""
    for close in (stream.close, stream.table.catalog.close):
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - best effort: an unreachable catalog has nothing left to close
            log.debug("closing a cached stream failed (%s)", exc)


def _cache(key: tuple[int, StreamRef], stream: Stream) -> list[Stream]:
    """Keep ``stream`` (with ``_streams_lock`` held); returns the streams to release: the least recently used beyond
    ``MAX_OPEN_STREAMS``, and forgets (never closes) those a forked worker inherited from its parent."""
    pid = key[0]
    for other in [k for k in _streams if k[0] != pid]:
        del _streams[other]  # the parent's: its connections must not be touched from here
    _streams[key] = stream
    _streams.move_to_end(key)
    _schema_ids[key] = stream.table.metadata.current_schema_id
    evicted = []
    while len(_streams) > MAX_OPEN_STREAMS:
        evicted.append(_streams.popitem(last=False)[1])
    for gone in [k for k in _schema_ids if k not in _streams]:
        del _schema_ids[gone]
    return evicted


def open_stream(ref: StreamRef) -> Stream:
    """The stream, opened once per worker process (a Ray worker runs many write tasks; one catalog engine each).

    A cached stream is refreshed first (one catalog pointer query on SQL catalogs): when the name now holds another
    table (dropped and created again, e.g. between two jobs of one Ray session), it is opened again instead of
    publishing with the old table's world size, schema and producer state. So it is when another engine changed the
    table's schema since: a stream's writer checks the schema once, when it is made, and a cached one published
    after a payload column was renamed or dropped, which a stream opened afresh refuses (``SchemaMismatchError``)."""
    key = (os.getpid(), ref)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is not None:
            _streams.move_to_end(key)
    if stream is not None:
        try:
            stream.refresh()
            if stream.table.metadata.current_schema_id == _schema_ids.get(key, stream.table.metadata.current_schema_id):
                return stream
            raise StreamError("the table's schema changed since the stream was opened")  # its writer's is stale
        except StreamError:  # another table under this name now: forget (and close) the old one's handle
            with _streams_lock:
                if _streams.get(key) is stream:
                    del _streams[key]
                    _schema_ids.pop(key, None)
            _release(stream)
        except Exception as exc:  # noqa: BLE001 - the catalog is busy or down for now: the commit's refresh retries
            if not transient(exc):
                raise
            return stream
    evicted: list[Stream] = []
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = Stream.open(ref.catalog(), ref.identifier)
            evicted = _cache(key, stream)
    for old in evicted:  # outside the lock. A Ray worker runs one write task at a time, so nothing commits through it
        _release(old)    # now; had it been, SQLAlchemy leaves a checked-out connection to its holder, and a stream
    return stream        # stays usable after close() (its next use starts its threads and connections again)
