"""pyiceberg's manifest and manifest-list writers, with their per-schema set-up done once per process.

Opening one of pyiceberg's Avro writers builds the file schema, resolves a value writer against it, and converts the
schema to Avro JSON for the header: about two thirds of the time it takes to write a small manifest (8 entries),
and a group commit writes two such files per batch inside its critical section. Everything that set-up computes
depends only on the format version and the partition type, so it is cached here under exactly that key. pyiceberg's
manifest writer also writes (and compresses) one Avro block per entry; here all of a file's records go into one block
when it is closed. And a manifest list repeats its parent's records: each manifest's record is encoded once per
process and reused, so a commit's list costs its new manifests, not the list's length. A manifest's ``data_file``
records are encoded once per DataFile object, or taken as they were read from a manifest of the same schema
(:mod:`lakestream_iceberg.format.data_file_records`): a merge copies them unchanged. Everything else is
pyiceberg's own code: the same encoder, value writers, header layout, block format and codec, so a file holds exactly
the records (and header) pyiceberg would write.

Only format version 2 (what lakestream creates) takes the cached path; other versions use pyiceberg's writers as
they are.
"""

from __future__ import annotations

import io
import json
import os
import threading
from collections import OrderedDict
from typing import Any

from pydantic_core import to_json
from pyiceberg.avro.codecs import AVRO_CODEC_KEY, CODEC_MAPPING_ICEBERG_TO_AVRO
from pyiceberg.avro.encoder import BinaryEncoder
from pyiceberg.avro.file import _SCHEMA_KEY, MAGIC, META_SCHEMA, SYNC_SIZE, AvroFileHeader, AvroOutputFile
from pyiceberg.avro.resolver import construct_writer, resolve_writer
from pyiceberg.avro.writer import Writer
from pyiceberg.io import InputFile, OutputFile, OutputStream
from pyiceberg.manifest import (
    DEFAULT_READ_VERSION,
    MANIFEST_LIST_FILE_SCHEMAS,
    UNASSIGNED_SEQ,
    ManifestFile,
    ManifestListWriter,
    ManifestListWriterV2,
    ManifestWriter,
    ManifestWriterV2,
    PartitionFieldStats,
    PartitionFieldSummary,
    write_manifest,
    write_manifest_list,
)
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import TableProperties
from pyiceberg.typedef import Record
from pyiceberg.types import PrimitiveType, StructType
from pyiceberg.utils.schema_conversion import AvroSchemaConversion

from lakestream_iceberg.format import data_file_records as records
from lakestream_iceberg.format.uploads import Uploads

__all__ = ["FastEncoder", "manifest_list_writer", "manifest_writer"]

_ONE_BYTE_INTS = tuple(bytes([(i << 1) ^ (i >> 63)]) for i in range(0, 64)) + tuple(
    bytes([(i << 1) ^ (i >> 63)]) for i in range(-64, 0))  # zig-zag varints of one byte: 0..63 at [i], -64..-1 at [i]
_BOOLS = (b"\x00", b"\x01")


class FastEncoder(BinaryEncoder):
    """pyiceberg's ``BinaryEncoder`` writing each varint and boolean in one call, with one-byte varints (-64..63, most
    of a manifest's: field ids, union branches, counts) taken from a table. Its ``write_int`` sends every byte of a
    varint to the stream on its own, and a manifest entry holds dozens: about a tenth of a group commit's CPU. The
    bytes are the same (tests/format/test_avro_writers.py compares them over the whole int64 range)."""

    def write_int(self, integer: int) -> None:
        if -64 <= integer < 64:
            self._output_stream.write(_ONE_BYTE_INTS[integer])
            return
        datum = (integer << 1) ^ (integer >> 63)
        out = bytearray()
        while datum & ~0x7F:
            out.append((datum & 0x7F) | 0x80)
            datum >>= 7
        out.append(datum)
        self._output_stream.write(out)  # type: ignore[arg-type]  # every stream takes a bytearray: no copy to bytes

    def write_boolean(self, boolean: bool) -> None:
        self._output_stream.write(_BOOLS[bool(boolean)])


_lock = threading.Lock()
_prepared: dict[tuple[Any, ...], tuple[Schema, Writer, str]] = {}  # key -> (file schema, value writer, Avro JSON)
_META_WRITER = construct_writer(META_SCHEMA)
_MAX_LIST_RECORDS = 4096  # manifest-list records: a head lists a few dozen manifests, the rest were merged away
_encoded_lists: OrderedDict[tuple[str, int | None, int | None], bytes] = OrderedDict()  # manifest list records
# A manifest's header (schema and spec JSON, codec) is the same for every manifest of a table: encoded once, then only
# its sync marker differs. A manifest list's header names its snapshot: never kept.
_MAX_HEADERS = 64
_encoded_headers: OrderedDict[tuple[tuple[str, str], ...], bytes] = OrderedDict()
_MAX_SPECS = 32
# (id(spec), id(schema)) -> (spec, schema, partition type, its str, the manifest header's schema and spec JSON); the
# objects are kept, so an id is never another object's while its entry lives
_specs: OrderedDict[tuple[int, int], tuple[PartitionSpec, Schema, StructType, str, str, str]] = OrderedDict()


def _spec_facts(spec: PartitionSpec, schema: Schema) -> tuple[StructType, str, str, str]:
    """What every manifest writer of one partition spec and schema computes again: the partition type (pyiceberg
    builds it field by field, twice per manifest) and the header's schema and spec JSON. A table's metadata object
    hands out the same spec and schema objects to every commit planned on it."""
    key = (id(spec), id(schema))
    with _lock:
        hit = _specs.get(key)
        if hit is not None and hit[0] is spec and hit[1] is schema:
            _specs.move_to_end(key)
            return hit[2:]
    partition_type = spec.partition_type(schema)
    facts = (partition_type, str(partition_type), schema.model_dump_json(), to_json(spec.fields).decode("utf-8"))
    with _lock:
        _specs[key] = (spec, schema, *facts)
        while len(_specs) > _MAX_SPECS:
            _specs.popitem(last=False)
    return facts


def _prepare(key: tuple[Any, ...], file_schema: Schema, record_schema: Schema, schema_name: str) -> tuple[Schema, Writer, str]:
    with _lock:
        hit = _prepared.get(key)
    if hit is None:
        writer = resolve_writer(record_schema=record_schema, file_schema=file_schema)
        avro_json = json.dumps(AvroSchemaConversion().iceberg_to_avro(file_schema, schema_name=schema_name))
        hit = (file_schema, writer, avro_json)
        with _lock:
            hit = _prepared.setdefault(key, hit)  # a racing thread's, if it was first: one writer object per key
        if key[0] == "manifest":
            records.register_writer(hit[2], dict(hit[1].field_writers)[records.DATA_FILE_POS])  # type: ignore[attr-defined]
    return hit


class _Written(OutputFile):
    """A file this process just wrote, whose length it knows: pyiceberg's manifest writer asks ``len()`` of the file it
    wrote for the manifest's ``manifest_length``, which costs a stat (a HEAD request on object storage, inside a
    commit's critical section) per manifest. Everything else is the written file's."""

    def __init__(self, output_file: OutputFile, length: int) -> None:
        super().__init__(output_file.location)
        self._file = output_file
        self._length = length

    def __len__(self) -> int:
        return self._length

    def exists(self) -> bool:
        return self._file.exists()

    def to_input_file(self) -> InputFile:
        return self._file.to_input_file()

    def create(self, overwrite: bool = False) -> OutputStream:
        return self._file.create(overwrite=overwrite)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


class _PreparedAvroOutputFile(AvroOutputFile[Any]):
    """:class:`AvroOutputFile` with a prepared value writer and header schema (see the module docstring)."""

    def __init__(self, *, output_file: OutputFile, prepared: tuple[Schema, Writer, str], schema_name: str,
                 metadata: dict[str, str], uploads: Uploads | None = None) -> None:
        self.output_file = output_file
        self._uploads = uploads
        self.file_schema, self.writer, self._avro_json = prepared
        self.schema_name = schema_name
        self.sync_bytes = os.urandom(SYNC_SIZE)
        self.metadata = metadata

    def write_block(self, objects: list[Any]) -> None:
        """Encode the records; they are written as one block when the file is closed (pyiceberg's manifest writer
        writes, and compresses, one block per entry)."""
        for obj in objects:
            self.add_encoded(self.encode(obj))

    def encode(self, obj: Any) -> bytes:
        """One record's Avro encoding (what a block's content concatenates)."""
        buffer = io.BytesIO()
        self.writer.write(FastEncoder(output_stream=buffer), obj)
        return buffer.getvalue()

    def add_encoded(self, record: bytes) -> None:
        self._records.append(record)

    def __enter__(self) -> _PreparedAvroOutputFile:
        """Encode into memory: the file is written in one call when it is closed (pyiceberg's writer sends every
        varint of the header to the output stream on its own), and only if nothing failed (no header-only file left
        behind)."""
        self._records: list[bytes] = []
        self._buffer = io.BytesIO()
        self.output_stream = self._buffer  # type: ignore[assignment]  # tell(): bytes encoded so far
        self.encoder = FastEncoder(self._buffer)
        self._write_header()
        return self

    def __exit__(self, exctype: Any, excinst: Any, exctb: Any) -> None:
        records, self._records = self._records, []
        if exctype is not None:
            return
        if records:  # AvroOutputFile.write_block, for records encoded beforehand
            content = b"".join(records)
            self.encoder.write_int(len(records))
            if codec := self.compression_codec():
                content, length = codec.compress(content)
                self.encoder.write_int(length)
            else:
                self.encoder.write_int(len(content))
            self.encoder.write(content)
            self.encoder.write(self.sync_bytes)
        data = self._buffer.getvalue()
        if self._uploads is not None:  # written on a pool thread; the commit waits for it before its swap
            self._uploads.put(self.output_file.location, data)
        else:
            with self.output_file.create(overwrite=True) as stream:
                stream.write(data)
        self.output_file = _Written(self.output_file, len(data))

    def _write_header(self) -> None:  # AvroOutputFile._write_header, with the schema JSON computed once
        codec_name = self.metadata.get(AVRO_CODEC_KEY, TableProperties.WRITE_AVRO_COMPRESSION_DEFAULT)
        codec_name = CODEC_MAPPING_ICEBERG_TO_AVRO.get(codec_name, codec_name)
        meta = {**self.metadata, _SCHEMA_KEY: self._avro_json, AVRO_CODEC_KEY: codec_name}
        # a manifest list's header names its snapshot: only manifests' headers repeat, and only they are kept
        key = tuple(meta.items()) if "snapshot-id" not in meta else None
        encoded = None
        if key is not None:
            with _lock:
                encoded = _encoded_headers.get(key)
                if encoded is not None:
                    _encoded_headers.move_to_end(key)
        if encoded is None:  # everything the header holds but its sync marker, which is written last
            buffer = io.BytesIO()
            _META_WRITER.write(FastEncoder(buffer), AvroFileHeader(MAGIC, meta, bytes(SYNC_SIZE)))
            encoded = buffer.getvalue()[:-SYNC_SIZE]
            if key is not None:
                with _lock:
                    _encoded_headers[key] = encoded
                    while len(_encoded_headers) > _MAX_HEADERS:
                        _encoded_headers.popitem(last=False)
        self.encoder.write(encoded)
        self.encoder.write(self.sync_bytes)


class _ManifestAvroOutputFile(_PreparedAvroOutputFile):
    """Manifest entries whose ``data_file`` record is encoded once per DataFile object and process, or copied as it was
    read (:mod:`lakestream_iceberg.format.data_file_records`): a merge rewrites only each entry's status and sequence
    numbers."""

    def encode(self, obj: Any) -> bytes:
        buffer = io.BytesIO()
        encoder = FastEncoder(output_stream=buffer)
        for pos, field_writer in self.writer.field_writers:  # type: ignore[attr-defined]
            value = obj[pos] if pos is not None else None
            if pos == records.DATA_FILE_POS and value is not None:
                encoder.write(_encoded_data_file(field_writer, value))
            else:
                field_writer.write(encoder, value)
        return buffer.getvalue()


def _encoded_data_file(writer: Writer, data_file: Any) -> bytes:
    """``data_file``'s record for ``writer``: kept from an earlier encoding or from the manifest it was read from
    (:mod:`lakestream_iceberg.format.data_file_records`), else encoded now and kept."""
    encoded = records.find(writer, data_file)
    if encoded is None:
        buffer = io.BytesIO()
        writer.write(FastEncoder(output_stream=buffer), data_file)
        encoded = buffer.getvalue()
        records.keep(writer, data_file, encoded)
    return encoded


class _ManifestWriter(ManifestWriterV2):
    def __init__(self, spec: PartitionSpec, schema: Schema, output_file: OutputFile, snapshot_id: int,
                 avro_compression: Any, uploads: Uploads | None) -> None:
        super().__init__(spec, schema, output_file, snapshot_id, avro_compression)
        self._uploads = uploads

    @property
    def _meta(self) -> dict[str, str]:  # ManifestWriter._meta, with the schema and spec JSON computed once
        _, _, schema_json, spec_json = _spec_facts(self._spec, self._schema)
        return {
            "schema": schema_json,
            "partition-spec": spec_json,
            "partition-spec-id": str(self._spec.spec_id),
            "format-version": str(self.version),
            AVRO_CODEC_KEY: self._compression,
            "content": "data",  # ManifestWriterV2._meta
        }

    def new_writer(self) -> AvroOutputFile[Any]:
        _, type_name, _, _ = _spec_facts(self._spec, self._schema)
        key = ("manifest", self.version, type_name)
        with _lock:
            hit = _prepared.get(key)
        if hit is None:
            hit = _prepare(key, self._with_partition(self.version), self._with_partition(DEFAULT_READ_VERSION),
                           "manifest_entry")
        return _ManifestAvroOutputFile(output_file=self._output_file, prepared=hit, schema_name="manifest_entry",
                                       metadata=self._meta, uploads=self._uploads)

    def to_manifest_file(self) -> ManifestFile:
        """pyiceberg's ``to_manifest_file`` with the partition type computed once per spec and schema (see
        :func:`_spec_facts`) for the partition summaries."""
        self.closed = True
        min_sequence_number = self._min_sequence_number if self._min_sequence_number is not None else UNASSIGNED_SEQ
        return ManifestFile.from_args(
            manifest_path=self._output_file.location,
            manifest_length=len(self._writer.output_file),
            partition_spec_id=self._spec.spec_id,
            content=self.content(),
            sequence_number=UNASSIGNED_SEQ,
            min_sequence_number=min_sequence_number,
            added_snapshot_id=self._snapshot_id,
            added_files_count=self._added_files,
            existing_files_count=self._existing_files,
            deleted_files_count=self._deleted_files,
            added_rows_count=self._added_rows,
            existing_rows_count=self._existing_rows,
            deleted_rows_count=self._deleted_rows,
            partitions=_partition_summaries(_spec_facts(self._spec, self._schema)[0], self._partitions),
            key_metadata=None,
        )


def _partition_summaries(partition_type: StructType, partitions: list[Record]) -> list[PartitionFieldSummary]:
    """pyiceberg's ``construct_partition_summaries``, given the partition type."""
    types: list[PrimitiveType] = []
    for field in partition_type.fields:  # always primitive: partition transforms produce primitive types
        if not isinstance(field.field_type, PrimitiveType):
            raise ValueError(f"Expected a primitive type for the partition field, got {field.field_type}")
        types.append(field.field_type)
    field_stats = [PartitionFieldStats(field_type) for field_type in types]
    for partition_keys in partitions:
        for i in range(len(types)):
            field_stats[i].update(partition_keys[i])
    return [field.to_summary() for field in field_stats]


class _ManifestListWriter(ManifestListWriterV2):
    """A manifest list whose records are encoded once per manifest and process: a snapshot's manifest list repeats
    its parent's manifests, and a manifest's list record (path, length, counts, partition summary, sequence numbers)
    never changes once assigned, so writing a list costs its new manifests, not its length."""

    def __init__(self, output_file: OutputFile, snapshot_id: int, parent_snapshot_id: int | None, sequence_number: int,
                 compression: Any, uploads: Uploads | None) -> None:
        super().__init__(output_file, snapshot_id, parent_snapshot_id, sequence_number, compression)
        self._uploads = uploads

    def add_manifests(self, manifest_files: list[ManifestFile]) -> ManifestListWriter:
        writer = self._writer
        assert isinstance(writer, _PreparedAvroOutputFile)
        for manifest in manifest_files:
            # prepare_manifest copies the record to assign this list's sequence number where it is unassigned; a
            # manifest with both assigned is recorded as it is
            assigned = UNASSIGNED_SEQ not in (manifest.sequence_number, manifest.min_sequence_number)
            prepared = manifest if assigned else self.prepare_manifest(manifest)
            key = (prepared.manifest_path, prepared.sequence_number, prepared.min_sequence_number)
            with _lock:
                record = _encoded_lists.get(key)
                if record is not None:
                    _encoded_lists.move_to_end(key)
            if record is None:
                record = writer.encode(prepared)
                with _lock:
                    _encoded_lists[key] = record
                    while len(_encoded_lists) > _MAX_LIST_RECORDS:
                        _encoded_lists.popitem(last=False)
            writer.add_encoded(record)
        return self

    def __enter__(self) -> ManifestListWriter:
        key = ("manifest-list", self._format_version)
        prepared = _prepare(key, MANIFEST_LIST_FILE_SCHEMAS[self._format_version],
                            MANIFEST_LIST_FILE_SCHEMAS[DEFAULT_READ_VERSION], "manifest_file")
        self._writer = _PreparedAvroOutputFile(output_file=self._output_file, prepared=prepared,
                                               schema_name="manifest_file", metadata=self._meta, uploads=self._uploads)
        self._writer.__enter__()
        return self


def manifest_writer(*, format_version: int, spec: PartitionSpec, schema: Schema, output_file: OutputFile,
                    snapshot_id: int, avro_compression: Any, uploads: Uploads | None = None) -> ManifestWriter:
    """Like :func:`pyiceberg.manifest.write_manifest`; with ``uploads``, the file is written by :meth:`Uploads.put`
    (format version 2)."""
    if format_version != 2:
        return write_manifest(format_version=format_version, spec=spec, schema=schema,  # type: ignore[arg-type]
                              output_file=output_file, snapshot_id=snapshot_id, avro_compression=avro_compression)
    return _ManifestWriter(spec, schema, output_file, snapshot_id, avro_compression, uploads)


def manifest_list_writer(*, format_version: int, output_file: OutputFile, snapshot_id: int,
                         parent_snapshot_id: int | None, sequence_number: int, avro_compression: Any,
                         uploads: Uploads | None = None) -> ManifestListWriter:
    """Like :func:`pyiceberg.manifest.write_manifest_list`; with ``uploads``, the file is written by
    :meth:`Uploads.put` (format version 2)."""
    if format_version != 2:
        return write_manifest_list(format_version=format_version, output_file=output_file,  # type: ignore[arg-type]
                                   snapshot_id=snapshot_id, parent_snapshot_id=parent_snapshot_id,
                                   sequence_number=sequence_number, avro_compression=avro_compression)
    return _ManifestListWriter(output_file, snapshot_id, parent_snapshot_id, sequence_number, avro_compression, uploads)
