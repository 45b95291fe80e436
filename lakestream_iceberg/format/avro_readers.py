"""pyiceberg's manifest and manifest-list readers, with their per-schema set-up done once per process.

Opening an Avro file in pyiceberg (``AvroFile.__enter__``) builds a reader for the file header, converts the Avro
schema in that header to an Iceberg schema and resolves a value reader of that schema against the read schema: about
three quarters of the time it takes to read a small manifest (8 entries). A group commit reads the manifests other
producers' commits wrote whenever it merges them, and a reader opens one manifest list and one manifest per step, so
this set-up is paid many times per second. It depends only on the schema text in the header and on what is read, so
it is cached here under exactly that key (the text, compared in full, not a hash). Everything else is pyiceberg's own
code: the same header reader, decoder, value readers, block format, codecs and sequence-number inheritance, so the
records read are exactly those pyiceberg's ``ManifestFile.fetch_manifest_entry`` and ``read_manifest_list`` return.
Where a manifest's ``data_file`` records are kept for the writer (:func:`read_manifest_entries`), ``AvroFile``'s loop
over blocks is repeated here, to see where each record lies in its block.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from enum import Enum
from typing import cast

from pyiceberg.avro.decoder import BinaryDecoder, new_decoder
from pyiceberg.avro.file import _SCHEMA_KEY, META_SCHEMA, SYNC_SIZE, AvroFile, AvroFileHeader
from pyiceberg.avro.reader import Reader, StructReader
from pyiceberg.avro.resolver import construct_reader, resolve_reader
from pyiceberg.avro.writer import Writer
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

from lakestream_iceberg.errors import CorruptStateError
from lakestream_iceberg.format import data_file_records as records

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


def _open(input_file: InputFile, kind: _Kind, *, length: int | None = None) -> AvroFile:
    """An ``AvroFile`` positioned after its header, as ``AvroFile.__enter__`` leaves it, with a cached reader tree.

    ``length``: the file's length as recorded where it is named (a manifest's in its manifest list). A file shorter
    than that was cut short (a write interrupted, damaged storage): Avro's block loop would read it as fewer entries,
    none at all when the cut falls after the header, so it is refused instead."""
    avro: AvroFile = AvroFile(input_file, kind.read_schema, kind.read_types, kind.read_enums)
    with input_file.open() as f:
        data = f.read()
    if length is not None and len(data) < length:
        raise CorruptStateError(
            f"manifest {input_file.location} holds {len(data)} bytes but its manifest list records {length}: the file "
            "was cut short (an interrupted write or damaged storage), and reading it would drop the data files it "
            "lists from the table. Restore the file from a backup, or roll the branch back to a snapshot that does "
            "not list it"
        )
    avro.decoder = new_decoder(data)
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
    """The live (not DELETED) entries of ``manifest``, as ``manifest.fetch_manifest_entry(io, discard_deleted=True)``.

    When this process writes manifests whose header holds the same schema (lakestream's and pyiceberg's writers do, for
    one partition type), each entry's ``data_file`` record is also handed, as read, to the writer
    (:mod:`lakestream_iceberg.format.data_file_records`): a merge copying these entries into a larger manifest
    then writes those bytes instead of encoding the file's statistics again. Another writer's schema (Java's, another
    partition type) reads as it is.
    """
    with _decoding(manifest.manifest_path, "manifest"):
        avro = _open(io.new_input(manifest.manifest_path), _ENTRIES, length=manifest.manifest_length)
        writer = records.writer_for(avro.header.meta[_SCHEMA_KEY])
        if writer is None:
            return [_inherit_from_manifest(entry, manifest) for entry in avro
                    if entry.status != ManifestEntryStatus.DELETED]
        return [_inherit_from_manifest(entry, manifest) for entry in _read_keeping(avro, writer)
                if entry.status != ManifestEntryStatus.DELETED]


def _read_keeping(avro: AvroFile, writer: Writer) -> list[ManifestEntry]:
    """Every entry of ``avro`` (positioned after its header), block by block as ``AvroFile`` reads them, each entry's
    ``data_file`` record bytes kept for ``writer``."""
    reader = _spanning(avro.reader)
    codec = avro.header.compression_codec()
    decoder, sync = avro.decoder, avro.header.sync
    entries: list[ManifestEntry] = []
    spans: list[tuple[int, int]] = []
    _SPANS.out = spans
    try:
        first = True
        while True:
            try:  # AvroFile._read_block: the end of the file ends the entries
                if not first and (marker := decoder.read(SYNC_SIZE)) != sync:
                    raise ValueError(f"Expected sync bytes {sync!r}, but got {marker!r}")
                first = False
                count = decoder.read_int()
                content = decoder.read_bytes()
            except EOFError:
                break
            if codec:
                content = codec.decompress(content)
            block = new_decoder(content)
            for _ in range(count):
                entry = cast(ManifestEntry, reader.read(block))
                start, end = spans.pop()
                if entry.data_file is not None:
                    records.keep(writer, entry.data_file, content[start:end])
                entries.append(entry)
    finally:
        _SPANS.out = None
    return entries


class _Spans(threading.local):
    out: list[tuple[int, int]] | None = None


_SPANS = _Spans()


class _Span(Reader):
    """Reads a value with ``inner`` and records where its bytes lie in the block (see :func:`_read_keeping`)."""

    __slots__ = ("inner",)

    def __init__(self, inner: Reader) -> None:
        self.inner = inner

    def read(self, decoder: BinaryDecoder) -> object:
        start = decoder.tell()
        value = self.inner.read(decoder)
        spans = _SPANS.out
        if spans is not None:
            spans.append((start, decoder.tell()))
        return value

    def skip(self, decoder: BinaryDecoder) -> None:
        self.inner.skip(decoder)


_spanning_readers: dict[int, tuple[Reader, StructReader]] = {}  # id(entry reader) -> (it, its spanning twin)


def _spanning(reader: Reader) -> StructReader:
    """The entry reader ``reader`` with its ``data_file`` field read through :class:`_Span` (made once per reader)."""
    with _LOCK:
        hit = _spanning_readers.get(id(reader))
        if hit is not None and hit[0] is reader:
            return hit[1]
    if not isinstance(reader, StructReader):
        raise ValueError(f"a manifest entry is read by a struct reader, not {reader!r}")
    fields = tuple((pos, _Span(field) if pos == records.DATA_FILE_POS else field) for pos, field in reader.field_readers)
    if sum(pos == records.DATA_FILE_POS for pos, _ in fields) != 1:
        raise ValueError("a manifest entry reader without exactly one data_file field")
    spanning = StructReader(fields, reader.create_struct, reader.struct)
    with _LOCK:
        if len(_spanning_readers) >= _MAX_SCHEMAS:
            _spanning_readers.clear()
        _spanning_readers[id(reader)] = (reader, spanning)
    return spanning



def read_manifest_list(io: FileIO, path: str) -> list[ManifestFile]:
    """The manifests a manifest list names, as ``Snapshot.manifests(io)`` reads them."""
    with _decoding(path, "manifest list"):
        return list(_open(io.new_input(path), _LIST))


# What pyiceberg's header reader, decoder, value readers and codecs raise on bytes that are no Avro file of the kind
# read (a damaged file): a short read, a bad sync marker or varint, an undecodable string or block
_DECODE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, EOFError, SystemError, OverflowError, IndexError, KeyError, MemoryError, zlib.error)
with contextlib.suppress(ImportError):  # pyiceberg's zstd codec (an optional extra)
    import zstandard

    _DECODE_ERRORS += (zstandard.ZstdError,)


@contextlib.contextmanager
def _decoding(location: str, what: str) -> Iterator[None]:
    """Within: a failure to decode ``location`` is a :class:`CorruptStateError` naming it (a missing file, or any
    other storage error, is raised as it is)."""
    try:
        yield
    except CorruptStateError:
        raise
    except _DECODE_ERRORS as exc:
        raise CorruptStateError(
            f"{what} {location} cannot be read as an Iceberg {what} ({type(exc).__name__}: {str(exc)[:200]}): it was "
            "damaged in storage or written by a faulty tool. Restore it from a backup, or roll the branch back to a "
            "snapshot that does not list it"
        ) from exc
