"""pyiceberg's manifest and manifest-list readers, with their per-schema set-up done once per process.

Opening an Avro file in pyiceberg (``AvroFile.__enter__``) builds a reader for the file header, converts the Avro
schema in that header to an Iceberg schema and resolves a value reader of that schema against the read schema: about
three quarters of the time it takes to read a small manifest (8 entries). A group commit reads the manifests other
producers' commits wrote whenever it merges them, and a reader opens one manifest list and one manifest per step, so
this set-up is paid many times per second. It depends only on the schema text in the header and on what is read, so
it is cached here under exactly that key (the text, compared in full, not a hash). Everything else is pyiceberg's own
code: the same header reader, decoder, value readers, block format, codecs and sequence-number inheritance, so the
records read are exactly those pyiceberg's ``ManifestFile.fetch_manifest_entry`` and ``read_manifest_list`` return.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum

from pyiceberg.avro.decoder import new_decoder
from pyiceberg.avro.file import _SCHEMA_KEY, META_SCHEMA, AvroFile, AvroFileHeader
from pyiceberg.avro.reader import Reader
from pyiceberg.avro.resolver import construct_reader, resolve_reader
from pyiceberg.io import FileIO, InputFile
from pyiceberg.manifest import (
    DEFAULT_READ_VERSION,
    MANIFEST_ENTRY_SCHEMAS,
    MANIFEST_LIST_FILE_SCHEMAS,
    DataFile,
    DataFileContent,
    FileFormat,
    ManifestContent,
    ManifestEntry,
    ManifestEntryStatus,
    ManifestFile,
    PartitionFieldSummary,
    _inherit_from_manifest,
)
from pyiceberg.schema import Schema
from pyiceberg.typedef import StructProtocol

__all__ = ["read_manifest_entries", "read_manifest_list"]

_MAX_SCHEMAS = 64  # distinct (kind, header schema) pairs kept: one per partition type and writer in practice

_HEADER_READER = construct_reader(META_SCHEMA, {-1: AvroFileHeader})
_LOCK = threading.Lock()
_RESOLVED: OrderedDict[tuple[str, str], tuple[Schema, Reader]] = OrderedDict()


class _Kind:
    """What is read from a file: the read schema and the record and enum types pyiceberg reads it with."""

    def __init__(self, name: str, read_schema: Schema, read_types: dict[int, Callable[..., StructProtocol]],
                 read_enums: dict[int, Callable[..., Enum]]) -> None:
        self.name = name
        self.read_schema = read_schema
        self.read_types = read_types
        self.read_enums = read_enums


# the arguments pyiceberg's own ManifestFile.fetch_manifest_entry and read_manifest_list pass to AvroFile
_ENTRIES = _Kind("entries", MANIFEST_ENTRY_SCHEMAS[DEFAULT_READ_VERSION], {-1: ManifestEntry, 2: DataFile},
                 {0: ManifestEntryStatus, 101: FileFormat, 134: DataFileContent})
_LIST = _Kind("list", MANIFEST_LIST_FILE_SCHEMAS[DEFAULT_READ_VERSION], {-1: ManifestFile, 508: PartitionFieldSummary},
              {517: ManifestContent})


def _open(input_file: InputFile, kind: _Kind) -> AvroFile:
    """An ``AvroFile`` positioned after its header, as ``AvroFile.__enter__`` leaves it, with a cached reader tree."""
    avro: AvroFile = AvroFile(input_file, kind.read_schema, kind.read_types, kind.read_enums)
    with input_file.open() as f:
        avro.decoder = new_decoder(f.read())
    avro.header = _HEADER_READER.read(avro.decoder)
    text = avro.header.meta.get(_SCHEMA_KEY)
    if text is None:
        raise ValueError(f"No schema found in Avro file headers: {input_file.location}")
    key = (kind.name, text)
    with _LOCK:
        resolved = _RESOLVED.get(key)
        if resolved is not None:
            _RESOLVED.move_to_end(key)
    if resolved is None:
        schema = avro.header.get_schema()
        resolved = (schema, resolve_reader(schema, kind.read_schema, kind.read_types, kind.read_enums))
        with _LOCK:
            _RESOLVED[key] = resolved
            while len(_RESOLVED) > _MAX_SCHEMAS:
                _RESOLVED.popitem(last=False)
    avro.schema, avro.reader = resolved
    return avro


def read_manifest_entries(io: FileIO, manifest: ManifestFile) -> list[ManifestEntry]:
    """The live (not DELETED) entries of ``manifest``, as ``manifest.fetch_manifest_entry(io, discard_deleted=True)``."""
    return [
        _inherit_from_manifest(entry, manifest)
        for entry in _open(io.new_input(manifest.manifest_path), _ENTRIES)
        if entry.status != ManifestEntryStatus.DELETED
    ]


def read_manifest_list(io: FileIO, path: str) -> list[ManifestFile]:
    """The manifests a manifest list names, as ``Snapshot.manifests(io)`` reads them."""
    return list(_open(io.new_input(path), _LIST))
