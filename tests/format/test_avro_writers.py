"""The cached manifest writers write pyiceberg's header and records (one block instead of one per entry), and pyiceberg
reads them back identically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.io.pyarrow import PyArrowFileIO
from pyiceberg.manifest import ManifestEntry, ManifestEntryStatus, write_manifest, write_manifest_list

from lakestream_iceberg import Stream
from lakestream_iceberg.format import data_file_records
from lakestream_iceberg.format.avro_writers import manifest_list_writer, manifest_writer
from tests.support import SCHEMA, batch, sqlite_catalog


def test_manifest_and_list_bytes_equal_pyicebergs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "urandom", lambda n: b"\x07" * n)
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=3)
    staged = stream.writer.write(producer="p", seq=0, shards=batch("p", 0, 3))
    metadata = stream.table.metadata
    entries = [ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=5, sequence_number=3,
                                       file_sequence_number=3, data_file=f)
               for f in staged.data_files(step=9, spec_id=metadata.default_spec_id)]
    io = PyArrowFileIO()
    written = {}
    for name, make in (("pyiceberg", write_manifest), ("ours", manifest_writer)):
        path = f"{tmp_path}/{name}-m.avro"
        with make(format_version=2, spec=metadata.spec(), schema=metadata.schema(), output_file=io.new_output(path),
                  snapshot_id=5, avro_compression="gzip") as writer:
            for entry in entries:
                writer.add_entry(entry)
        manifest = writer.to_manifest_file()
        manifest.sequence_number = manifest.min_sequence_number = 3
        written[name] = (Path(path).read_bytes(), manifest)
        lpath = f"{tmp_path}/{name}-l.avro"
        with (manifest_list_writer if name == "ours" else write_manifest_list)(
                format_version=2, output_file=io.new_output(lpath), snapshot_id=5, parent_snapshot_id=4,
                sequence_number=3, avro_compression="gzip") as lw:
            lw.add_manifests([written["pyiceberg"][1] if "pyiceberg" in written else manifest])
        written[name + "-list"] = (Path(lpath).read_bytes(), None)
    # the same header (schema, spec, codec, sync marker fixed here) ...
    header_end = written["pyiceberg"][0].index(b"\x07" * 16) + 16
    assert written["ours"][0][:header_end] == written["pyiceberg"][0][:header_end]
    # ... the same records: one block for all of them instead of one per entry
    assert written["ours-list"][0] == written["pyiceberg-list"][0]  # a manifest list is one block either way
    ours, theirs = (written[k][1] for k in ("ours", "pyiceberg"))
    assert [e.data_file for e in ours.fetch_manifest_entry(io)] == [e.data_file for e in theirs.fetch_manifest_entry(io)]
    assert (ours.added_files_count, ours.partitions) == (theirs.added_files_count, theirs.partitions)
    assert len(written["ours"][0]) < len(written["pyiceberg"][0])
    back = written["ours"][1].fetch_manifest_entry(io)
    assert [e.data_file.file_path for e in back] == [f.path for f in staged.files]
    assert [e.data_file.partition[0] for e in back] == [9, 9, 9]


def _two_steps_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Stream, Any, list[Any], PyArrowFileIO]:
    """A stream of world size 3 and the data files of two steps (sync markers fixed: files compare byte for byte)."""
    monkeypatch.setattr(os, "urandom", lambda n: b"\x07" * n)
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=3)
    metadata = stream.table.metadata
    files = [f for seq in range(2) for f in stream.writer.write(producer="p", seq=seq, shards=batch("p", seq, 3))
             .data_files(step=seq + 1, spec_id=metadata.default_spec_id)]
    return stream, metadata, files, PyArrowFileIO()


def test_a_data_file_encoded_once_is_reused_byte_for_byte_by_later_manifests(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge copies entries (same DataFile objects, EXISTING): their cached data_file bytes must be exactly what
    encoding them again gives, and pyiceberg must read the entries back unchanged."""

    stream, metadata, files, io = _two_steps_files(tmp_path, monkeypatch)

    def write(name: str, status: ManifestEntryStatus) -> tuple[bytes, list[ManifestEntry]]:
        path = f"{tmp_path}/{name}.avro"
        with manifest_writer(format_version=2, spec=metadata.spec(), schema=metadata.schema(),
                             output_file=io.new_output(path), snapshot_id=5, avro_compression="gzip") as writer:
            for f in files:
                writer.add_entry(ManifestEntry.from_args(status=status, snapshot_id=5, sequence_number=3,
                                                         file_sequence_number=3, data_file=f))
        manifest = writer.to_manifest_file()
        manifest.sequence_number = manifest.min_sequence_number = 3
        return Path(path).read_bytes(), manifest.fetch_manifest_entry(io, discard_deleted=False)

    first, _ = write("added", ManifestEntryStatus.ADDED)  # encodes and caches every data file
    assert all(id(f) in data_file_records._records for f in files)
    cached, cached_back = write("merged-cached", ManifestEntryStatus.EXISTING)
    data_file_records._records.clear()
    fresh, _ = write("merged-fresh", ManifestEntryStatus.EXISTING)
    assert cached == fresh and cached != first  # the same bytes as encoding anew; only the status differs from first
    assert [e.data_file for e in cached_back] == files
    assert {e.status for e in cached_back} == {ManifestEntryStatus.EXISTING}


def test_the_encoding_cache_does_not_keep_a_data_file_alive(tmp_path: Path) -> None:
    """A DataFile's cached record goes with the object: a long-running producer's cache tracks the files it still
    holds (its manifest cache), not every file it ever wrote (it used to keep the last 65,536 alive)."""
    import gc
    import weakref


    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=3)
    metadata = stream.table.metadata
    io = PyArrowFileIO()

    def write(files: list, name: str) -> None:
        with manifest_writer(format_version=2, spec=metadata.spec(), schema=metadata.schema(),
                             output_file=io.new_output(f"{tmp_path}/{name}.avro"), snapshot_id=5,
                             avro_compression="gzip") as writer:
            for f in files:
                writer.add_entry(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=5,
                                                         sequence_number=3, file_sequence_number=3, data_file=f))

    kept = stream.writer.write(producer="p", seq=0, shards=batch("p", 0, 3)).data_files(step=1, spec_id=0)
    dropped = stream.writer.write(producer="p", seq=1, shards=batch("p", 1, 3)).data_files(step=2, spec_id=0)
    write(kept + dropped, "m1")
    ids, refs = [id(f) for f in dropped], [weakref.ref(f) for f in dropped]
    assert all(i in data_file_records._records for i in ids)
    del dropped
    gc.collect()
    assert all(r() is None for r in refs)  # the cache held none of them
    write(kept, "m2")  # the next lookup drops the dead objects' encodings; the live ones stay and are reused
    assert all(data_file_records._records.get(i, (lambda: None,))[0]() is None for i in ids)
    assert all(data_file_records._records[id(f)][0]() is f for f in kept)


def test_a_manifest_is_written_in_one_piece_and_its_length_needs_no_stat(tmp_path: Path) -> None:
    """The manifest's length comes from what was written, not from a stat of the file (a HEAD request per manifest on
    object storage, inside a commit's critical section); a writer that fails leaves no file behind."""
    from pyiceberg.io.pyarrow import PyArrowFile

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=3)
    metadata = stream.table.metadata
    files = stream.writer.write(producer="p", seq=0, shards=batch("p", 0, 3)).data_files(step=1, spec_id=0)
    io = PyArrowFileIO()
    calls: list[str] = []

    class Watched(PyArrowFile):
        def __len__(self) -> int:
            calls.append("len")
            return super().__len__()

        def create(self, overwrite: bool = False):  # type: ignore[no-untyped-def]
            calls.append("create")
            return super().create(overwrite=overwrite)

    path = f"{tmp_path}/m.avro"
    with manifest_writer(format_version=2, spec=metadata.spec(), schema=metadata.schema(),
                         output_file=Watched(path, path, io.fs_by_scheme("file", None)), snapshot_id=5,
                         avro_compression="gzip") as writer:
        for f in files:
            writer.add_entry(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=5,
                                                     sequence_number=3, file_sequence_number=3, data_file=f))
        assert not Path(path).exists()  # nothing on storage until it is complete
    manifest = writer.to_manifest_file()
    assert calls == ["create"]  # one write, no stat
    assert manifest.manifest_length == Path(path).stat().st_size
    assert [e.data_file.file_path for e in manifest.fetch_manifest_entry(io)] == [f.file_path for f in files]
    failed = f"{tmp_path}/failed.avro"
    with pytest.raises(RuntimeError), manifest_writer(format_version=2, spec=metadata.spec(), schema=metadata.schema(),
                                                      output_file=io.new_output(failed), snapshot_id=5,
                                                      avro_compression="gzip") as writer:
        writer.add_entry(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=5, sequence_number=3,
                                                 file_sequence_number=3, data_file=files[0]))
        raise RuntimeError("the plan failed half-way")
    assert not Path(failed).exists()


def test_cached_headers_partition_types_and_list_records_write_what_pyiceberg_writes(tmp_path: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The header, partition type and spec JSON computed once per spec and schema, and list records of manifests whose
    sequence numbers are assigned taken as they are: every later manifest and list is still pyiceberg's, byte for byte
    (headers; records of lists) and field for field (manifest files), with assigned and unassigned sequence numbers,
    another spec object and another codec."""
    from lakestream_iceberg.format import avro_writers

    monkeypatch.setattr(os, "urandom", lambda n: b"\x07" * n)
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=3)
    metadata = stream.table.metadata
    io = PyArrowFileIO()
    specs = [metadata.spec(), metadata.spec(), metadata.spec().model_copy()]  # the same object twice, then another
    for round_, (spec, codec) in enumerate(zip(specs, ("gzip", "gzip", "null"))):
        files = stream.writer.write(producer="p", seq=round_, shards=batch("p", round_, 3)).data_files(
            step=round_ + 1, spec_id=0)
        written: dict[str, Any] = {}
        for name, make in (("pyiceberg", write_manifest), ("ours", manifest_writer)):
            path = f"{tmp_path}/{name}-{round_}.avro"
            with make(format_version=2, spec=spec, schema=metadata.schema(), output_file=io.new_output(path),
                      snapshot_id=7 + round_, avro_compression=codec) as writer:
                for f in files:
                    writer.add_entry(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=7 + round_,
                                                             sequence_number=None, file_sequence_number=None,
                                                             data_file=f))
            written[name] = (Path(path).read_bytes(), writer.to_manifest_file())
        mine, theirs = written["ours"][1], written["pyiceberg"][1]
        header_end = written["pyiceberg"][0].index(b"\x07" * 16) + 16
        assert written["ours"][0][:header_end] == written["pyiceberg"][0][:header_end]
        assert mine.partitions == theirs.partitions and mine.partitions[0].lower_bound is not None
        assert (mine.sequence_number, mine.min_sequence_number, mine.added_files_count, mine.added_rows_count) == \
            (theirs.sequence_number, theirs.min_sequence_number, theirs.added_files_count, theirs.added_rows_count)
        assert [e.data_file for e in mine.fetch_manifest_entry(io)] == [e.data_file for e in theirs.fetch_manifest_entry(io)]
        # a list naming a manifest with unassigned sequence numbers (assigned by the list) and assigned ones
        assigned = avro_writers.ManifestFile.from_args(**{k: getattr(theirs, k) for k in (
            "manifest_path", "manifest_length", "partition_spec_id", "content", "added_snapshot_id", "added_files_count",
            "existing_files_count", "deleted_files_count", "added_rows_count", "existing_rows_count",
            "deleted_rows_count", "partitions", "key_metadata")}, sequence_number=2, min_sequence_number=1)
        lists = []
        for name, make_list in (("pyiceberg", write_manifest_list), ("ours", manifest_list_writer)):
            lpath = f"{tmp_path}/{name}-{round_}-l.avro"
            with make_list(format_version=2, output_file=io.new_output(lpath), snapshot_id=7 + round_,
                           parent_snapshot_id=6, sequence_number=4, avro_compression=codec) as lw:
                lw.add_manifests([theirs, assigned])
            lists.append(Path(lpath).read_bytes())
        assert lists[0] == lists[1]
    assert len(avro_writers._specs) >= 2  # one per spec object


def test_fast_encoder_writes_pyicebergs_bytes_over_the_int64_range() -> None:
    import io
    import random

    from pyiceberg.avro.encoder import BinaryEncoder

    from lakestream_iceberg.format.avro_writers import FastEncoder

    rng = random.Random(7)
    edges = [0, 1, -1, 63, 64, -64, -65, 127, 128, 8191, 8192, -8192, -8193, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)]
    values = edges + [rng.randint(-(2**63), 2**63 - 1) >> rng.randint(0, 62) for _ in range(20_000)]
    theirs, ours = io.BytesIO(), io.BytesIO()
    slow, fast = BinaryEncoder(theirs), FastEncoder(ours)
    for value in values:
        slow.write_int(value)
        fast.write_int(value)
    for flag in (True, False, 0, 1, 2):
        slow.write_boolean(flag)  # type: ignore[arg-type]
        fast.write_boolean(flag)  # type: ignore[arg-type]
    assert ours.getvalue() == theirs.getvalue()
    assert len(ours.getvalue()) > len(values)  # the values were not all one-byte varints


def test_entries_read_back_hand_their_data_file_bytes_to_the_merge_that_copies_them(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge in another process reads manifests it did not write: the DataFile objects are new, so they used to be
    encoded again (statistics and all). Read back from a manifest whose header holds this process's writer schema,
    each data_file record is kept as read; the merged manifest then holds the same bytes as encoding them anew, with
    no data_file encoded, and pyiceberg reads every field back. Another schema (another partition type) reads as
    pyiceberg reads it, with nothing kept."""
    from pyiceberg.avro.writer import StructWriter
    from pyiceberg.manifest import DataFile, write_manifest
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.transforms import IdentityTransform
    from pyiceberg.typedef import Record

    from lakestream_iceberg.format import avro_writers
    from lakestream_iceberg.format.avro_readers import read_manifest_entries

    stream, metadata, files, io = _two_steps_files(tmp_path, monkeypatch)

    def write(name: str, entries: list[ManifestEntry], *, ours: bool = True,
              spec: PartitionSpec | None = None) -> tuple[str, Any]:
        path = f"{tmp_path}/{name}.avro"
        make = manifest_writer if ours else write_manifest
        with make(format_version=2, spec=spec or metadata.spec(), schema=metadata.schema(),  # type: ignore[operator]
                  output_file=io.new_output(path), snapshot_id=5, avro_compression="deflate") as writer:
            for entry in entries:
                writer.add_entry(entry)
        manifest = writer.to_manifest_file()
        manifest.sequence_number = manifest.min_sequence_number = 3
        return path, manifest

    statuses = [ManifestEntryStatus.ADDED, ManifestEntryStatus.EXISTING, ManifestEntryStatus.DELETED] * 2
    originals = [ManifestEntry.from_args(status=s, snapshot_id=5, sequence_number=3, file_sequence_number=3,
                                         data_file=f) for s, f in zip(statuses, files, strict=True)]
    write("prepare", originals[:1])  # this process now writes manifests of the stream's partition type
    _, source = write("by-pyiceberg", originals, ours=False)  # same header schema, written by pyiceberg
    data_file_records._records.clear()  # noqa: SLF001 - as in a process that never saw these DataFile objects
    read = read_manifest_entries(io, source)
    assert [e.data_file.file_path for e in read] == [f.file_path for s, f in zip(statuses, files) if s.value != 2]
    header = avro_writers._prepared[("manifest", 2, str(metadata.spec().partition_type(metadata.schema())))][2]  # noqa: SLF001
    writer = data_file_records.writer_for(header)
    assert writer is not None
    for entry in read:  # kept as read: exactly what encoding the decoded DataFile gives
        kept = data_file_records._records[id(entry.data_file)][2]  # noqa: SLF001
        buffer = io_bytes()
        writer.write(avro_writers.FastEncoder(buffer), entry.data_file)
        assert kept == buffer.getvalue()

    encoded: list[object] = []
    struct_write = StructWriter.write

    def counting(self: StructWriter, encoder: object, value: object) -> None:
        if isinstance(value, DataFile):
            encoded.append(value)
        struct_write(self, encoder, value)

    monkeypatch.setattr(StructWriter, "write", counting)
    existing = [ManifestEntry.from_args(status=ManifestEntryStatus.EXISTING, snapshot_id=e.snapshot_id,
                                        sequence_number=e.sequence_number, file_sequence_number=e.file_sequence_number,
                                        data_file=e.data_file) for e in read]
    merged_path, merged = write("merged", existing)
    assert not encoded  # every data_file record copied as read
    monkeypatch.setattr(StructWriter, "write", struct_write)
    data_file_records._records.clear()  # noqa: SLF001
    fresh_path, _ = write("merged-fresh", existing)
    assert Path(merged_path).read_bytes() == Path(fresh_path).read_bytes()
    back = merged.fetch_manifest_entry(io, discard_deleted=False)
    assert [_fields(e) for e in back] == [(ManifestEntryStatus.EXISTING, *_fields(e)[1:]) for e in read]

    # another partition type: no writer of this process wrote its schema; read as pyiceberg reads it, nothing kept
    other = PartitionSpec(PartitionField(source_id=metadata.schema().find_field("seq").field_id, field_id=1999,
                                         transform=IdentityTransform(), name="seq_only"), spec_id=7)
    foreign = [ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=5, sequence_number=3,
                                       file_sequence_number=3, data_file=DataFile.from_args(
                                           content=f.content, file_path=f.file_path, file_format=f.file_format,
                                           partition=Record(1), record_count=f.record_count,
                                           file_size_in_bytes=f.file_size_in_bytes)) for f in files[:2]]
    _, foreign_manifest = write("other-spec", foreign, ours=False, spec=other)
    data_file_records._records.clear()  # noqa: SLF001
    read_other = read_manifest_entries(io, foreign_manifest)
    assert [_fields(e) for e in read_other] == [_fields(e) for e in foreign_manifest.fetch_manifest_entry(io)]
    assert not data_file_records._records  # noqa: SLF001


def io_bytes() -> Any:
    import io as stdio

    return stdio.BytesIO()


def _fields(entry: ManifestEntry) -> tuple:
    f = entry.data_file
    return (entry.status, entry.snapshot_id, entry.sequence_number, entry.file_sequence_number, f.file_path,
            f.file_format, tuple(f.partition), f.record_count, f.file_size_in_bytes, dict(f.column_sizes or {}),
            dict(f.value_counts or {}), dict(f.null_value_counts or {}), dict(f.lower_bounds or {}),
            dict(f.upper_bounds or {}), f.split_offsets)
