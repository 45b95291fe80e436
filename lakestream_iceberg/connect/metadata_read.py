"""Reading a moved head's ``metadata.json`` without validating again what the last one already held.

A producer that commits while others do, and a follower of a busy stream, read a new ``metadata.json`` on almost every
commit (:func:`~lakestream_iceberg.connect.pointer.refresh_if_moved`). Consecutive heads share most of it: the
retained snapshots, the schemas, the partition specs and the sort orders; a commit adds a snapshot or a few and
expires as many. pyiceberg validates every one of them again into its models, which is most of the cost of the read
(0.12 of 0.2 ms for 8 snapshots on an idle core, three to four times that on a busy one).

:func:`read_metadata` parses the document as JSON, puts in place of each snapshot, schema, spec and sort order whose
JSON is exactly that of one the last read of the same table validated (same id, equal JSON) the model it gave, and
validates the document with pyiceberg's ``TableMetadataUtil.parse_obj``: the table-level checks run as always, and
the metadata equals pyiceberg's own read of the file. Metadata models are immutable; pyiceberg's own commits share
them between versions in the same way. Anything else (a compressed file, format version 1, a document pyiceberg
refuses) is read by pyiceberg's ``FromInputFile`` as before, which raises what it raised.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from collections import OrderedDict
from typing import Any

from pyiceberg.exceptions import ValidationError
from pyiceberg.io import FileIO
from pyiceberg.serializers import FromInputFile
from pyiceberg.table.metadata import TableMetadata, TableMetadataUtil

from lakestream_iceberg.errors import CorruptStateError

__all__ = ["MALFORMED", "malformed_metadata", "read_metadata", "unparsable"]

# What pyiceberg raises for a metadata.json it cannot parse: not JSON or not table metadata (its ValidationError wraps
# pydantic's), not UTF-8, a compressed file cut short (EOFError) or not gzip: never a transient failure
MALFORMED: tuple[type[BaseException], ...] = (ValidationError, UnicodeDecodeError, json.JSONDecodeError, EOFError,
                                              gzip.BadGzipFile)


def unparsable(exc: BaseException) -> bool:
    """Whether ``exc``, one of :data:`MALFORMED` raised out of a catalog's ``load_table`` or a table's ``refresh``, is a
    metadata file that cannot be parsed: not an HTTP client's own error (requests' ``JSONDecodeError`` is a
    ``json.JSONDecodeError``: pyiceberg's OAuth2 token refresh meeting an HTML page raises it inside any REST call)."""
    return isinstance(exc, MALFORMED) and not any(
        cls.__module__.split(".", 1)[0] in ("requests", "urllib3", "httpx") for cls in type(exc).__mro__)


def malformed_metadata(what: str, exc: BaseException) -> CorruptStateError:
    """The error for a table metadata file that cannot be parsed (``what``: the file, or the table whose current one)."""
    detail = " ".join(str(exc).split())[:300]
    restore = ("Restore it from a backup (or the bucket's object versioning), or point the catalog back at the previous "
               "metadata file (the newest one in the table's metadata/ folder that reads; on a SQL catalog its "
               "iceberg_tables.metadata_location)")
    if isinstance(exc, ValidationError):  # JSON that pyiceberg's model refuses: damage, or a newer engine's metadata
        from pyiceberg import __version__

        return CorruptStateError(
            f"{what} cannot be read by pyiceberg {__version__} ({type(exc).__name__}: {detail}), and nothing can be read "
            "or published through it. If another engine wrote it with an Iceberg feature this pyiceberg does not read "
            "(a newer format version, a type such as variant), the table is not damaged: read it with a pyiceberg that "
            f"reads that feature, or undo the change with that engine. If it was damaged or overwritten: {restore}"
        )
    return CorruptStateError(
        f"{what} cannot be read as Iceberg table metadata ({type(exc).__name__}: {detail}): it was damaged or "
        f"overwritten by a tool that does not write Iceberg metadata, and nothing can be read or published through it. "
        f"{restore}"
    )

# the lists of a metadata document whose entries are kept, with the field that identifies an entry
_KEPT = (("snapshots", "snapshot-id", "snapshots"), ("schemas", "schema-id", "schemas"),
         ("partition-specs", "spec-id", "partition_specs"), ("sort-orders", "order-id", "sort_orders"))
_MAX_TABLES = 32  # tables whose last read is kept, least recently read dropped first
_FORMATS = (2, 3)  # format version 1 is upgraded while validated: read by pyiceberg alone

# table UUID -> {(list, id): (the entry's JSON as validated, its model)}: the entries of the last document read
_held: OrderedDict[str, dict[tuple[str, Any], tuple[Any, Any]]] = OrderedDict()
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A fork made while another thread held the lock would leave it held in the child: the child gets its own."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def read_metadata(io: FileIO, location: str) -> TableMetadata:
    """The table metadata at ``location``, equal to ``FromInputFile.table_metadata(io.new_input(location))``.

    Raises what that raises (``FileNotFoundError`` for a missing file among them), but a file that cannot be parsed:
    :class:`CorruptStateError` naming it.
    """
    try:
        return _read(io, location)
    except MALFORMED as exc:  # not a transient failure: a commit retrying it would wait out its whole budget
        raise malformed_metadata(f"table metadata file {location}, the one the catalog names as current,", exc) from exc


def _read(io: FileIO, location: str) -> TableMetadata:
    if location.endswith(".gz.metadata.json"):
        return FromInputFile.table_metadata(io.new_input(location))
    with io.new_input(location).open() as f:
        raw = f.read()
    try:
        return _parse(raw)
    except Exception:  # noqa: BLE001 - not what lakestream or pyiceberg writes: pyiceberg's read says what is wrong
        return FromInputFile.table_metadata(io.new_input(location))


def _parse(raw: bytes) -> TableMetadata:
    text = raw.decode("utf-8")  # as pyiceberg decodes it
    document = json.loads(text)
    if not isinstance(document, dict) or document.get("format-version") not in _FORMATS:
        return TableMetadataUtil.parse_raw(text)
    uuid = document.get("table-uuid")
    with _lock:
        held = _held.get(uuid) if isinstance(uuid, str) else None
    entries: dict[tuple[str, Any], Any] = {}  # (list, id) -> the entry's JSON in this document
    for key, id_key, _ in _KEPT:
        items = document.get(key)
        if not isinstance(items, list):
            continue
        kept = []
        for item in items:
            ident = item.get(id_key) if isinstance(item, dict) else None
            if type(ident) is int:
                entries[(key, ident)] = item
                known = held.get((key, ident)) if held is not None else None
                if known is not None and known[0] == item:
                    item = known[1]  # the model the same JSON gave: validated already
            kept.append(item)
        document[key] = kept
    metadata = TableMetadataUtil.parse_obj(document)
    if isinstance(uuid, str) and str(metadata.table_uuid) == uuid:
        _hold(uuid, metadata, entries)
    return metadata


def _hold(uuid: str, metadata: TableMetadata, entries: dict[tuple[str, Any], Any]) -> None:
    """Keep this document's entries with the models they gave (only this document's: the next one shares them)."""
    kept: dict[tuple[str, Any], tuple[Any, Any]] = {}
    for key, id_key, attribute in _KEPT:
        for model in getattr(metadata, attribute):
            ident = getattr(model, id_key.replace("-", "_"))
            if (key, ident) in entries:
                kept[(key, ident)] = (entries[(key, ident)], model)
    with _lock:
        _held[uuid] = kept
        _held.move_to_end(uuid)
        while len(_held) > _MAX_TABLES:
            _held.popitem(last=False)
