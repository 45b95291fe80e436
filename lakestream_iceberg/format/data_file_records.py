"""The ``data_file`` records of manifest entries this process has encoded or read, kept per ``DataFile`` object.

A data file's record (path, partition, sizes, column statistics: most of a manifest entry's bytes and of its encoding
time) is written again, unchanged, each time a merge copies its entry into a larger manifest (``EXISTING``, the same
DataFile object); only the entry's status and sequence numbers change. So the writer
(:mod:`lakestream_iceberg.format.avro_writers`) keeps each record it encodes, and the reader
(:mod:`lakestream_iceberg.format.avro_readers`) keeps each record it reads from a manifest whose header holds the
schema this process writes manifests with (:func:`writer_for`): a merge of manifests other producers wrote then copies
their records instead of encoding them again.

The store refers to each DataFile weakly: only an object something else still holds (the manifest cache's entries, a
plan in progress) can be looked up again, so a record goes with its object and the store never keeps a file's
metadata alive (a store that kept the last 65,536 records would hold some 200 MiB in a producer after as many commits).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pyiceberg.avro.writer import Writer

__all__ = ["DATA_FILE_POS", "find", "keep", "register_writer", "writer_for"]

DATA_FILE_POS = 4  # ManifestEntry: status, snapshot_id, sequence_number, file_sequence_number, data_file
_MAX_RECORDS = 65536  # DataFile records (only live objects stay)

_lock = threading.Lock()
# id(DataFile) -> (a weak reference to it, writer, bytes); ids of objects that died since, to drop on the next lookup
_records: OrderedDict[int, tuple[weakref.ref[Any], Writer, bytes]] = OrderedDict()
_dead: list[int] = []
_writers: dict[str, Writer] = {}  # a prepared manifest header's Avro schema JSON -> its writer of data_file records


def register_writer(avro_schema: str, writer: Writer) -> None:
    """``writer`` encodes the ``data_file`` records of this process's manifests whose header holds ``avro_schema``."""
    with _lock:
        _writers[avro_schema] = writer


def writer_for(avro_schema: str) -> Writer | None:
    """The writer this process encodes ``data_file`` records with for manifests whose header holds exactly
    ``avro_schema`` (None when it writes no manifest of that schema): a manifest with that header holds records this
    writer's manifests may hold as they are."""
    with _lock:
        return _writers.get(avro_schema)


def find(writer: Writer, data_file: Any) -> bytes | None:
    """``data_file``'s kept record for ``writer``, or None."""
    key = id(data_file)
    with _lock:
        _forget_dead()
        hit = _records.get(key)
        if hit is not None and hit[0]() is data_file and hit[1] is writer:
            _records.move_to_end(key)
            return hit[2]
    return None


def keep(writer: Writer, data_file: Any, encoded: bytes) -> None:
    """Keep ``encoded`` as ``data_file``'s record for ``writer``, while ``data_file`` lives."""
    key = id(data_file)
    ref = weakref.ref(data_file, _forgetter(key))
    with _lock:
        _forget_dead()
        _records[key] = (ref, writer, encoded)
        while len(_records) > _MAX_RECORDS:
            _records.popitem(last=False)


def held() -> int:
    """The records kept now (of live and not yet dropped objects)."""
    with _lock:
        return len(_records)


def _forget_dead() -> None:
    """Drop the records of DataFile objects that died (called with ``_lock`` held). A weak reference's callback only
    records the id: it may run inside any allocation, even one under ``_lock``; an id reused by a live object since
    keeps its (new) record."""
    while _dead:
        key = _dead.pop()
        hit = _records.get(key)
        if hit is not None and hit[0]() is None:
            del _records[key]


def _forgetter(key: int) -> Callable[[weakref.ref[Any]], None]:
    def forget(_ref: weakref.ref[Any]) -> None:
        _dead.append(key)

    return forget
