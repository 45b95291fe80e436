"""The cached manifest readers return exactly the records pyiceberg's own readers return, for every schema they meet."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyiceberg.io.pyarrow import PyArrowFileIO
from pyiceberg.manifest import ManifestEntry, ManifestEntryStatus, write_manifest, write_manifest_list
from pyiceberg.partitioning import PartitionSpec

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import CorruptStateError
from lakestream_iceberg.format import avro_readers
from lakestream_iceberg.format.avro_readers import read_manifest_entries, read_manifest_list
from tests.support import SCHEMA, batch, sqlite_catalog


def _fields(entry: ManifestEntry) -> tuple:
    f = entry.data_file
    return (entry.status, entry.snapshot_id, entry.sequence_number, entry.file_sequence_number, f.file_path,
            f.file_format, tuple(f.partition), f.record_count, f.file_size_in_bytes, dict(f.column_sizes or {}),
            dict(f.value_counts or {}), dict(f.null_value_counts or {}), dict(f.lower_bounds or {}),
            dict(f.upper_bounds or {}), f.split_offsets, f.spec_id)


@pytest.mark.parametrize("codec", ["null", "deflate", "zstd"])
def test_entries_and_lists_equal_pyicebergs_for_every_status_codec_and_partition_type(tmp_path: Path, codec: str) -> None:
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=3)
    metadata = stream.table.metadata
    files = stream.writer.write(producer="p", seq=0, shards=batch("p", 0, 3)).data_files(
        step=4, spec_id=metadata.default_spec_id)
    io = PyArrowFileIO()
    manifests = []
    # the stream's own partition type (_step) and an unpartitioned spec: two header schemas, read alternately
    for n, spec in enumerate((metadata.spec(), PartitionSpec())):
        path = f"{tmp_path}/m{n}-{codec}.avro"
        with write_manifest(format_version=2, spec=spec, schema=metadata.schema(), output_file=io.new_output(path),
                            snapshot_id=11, avro_compression=codec) as writer:
            for status, f in zip((ManifestEntryStatus.ADDED, ManifestEntryStatus.EXISTING, ManifestEntryStatus.DELETED),
                                 files, strict=True):
                writer.add_entry(ManifestEntry.from_args(status=status, snapshot_id=None if status.value == 1 else 7,
                                                         sequence_number=None if status.value == 1 else 2,
                                                         file_sequence_number=None if status.value == 1 else 2,
                                                         data_file=f))
        manifest = writer.to_manifest_file()
        manifest.sequence_number = manifest.min_sequence_number = 3  # what a commit assigns: ADDED inherits it
        manifests.append(manifest)
    list_path = f"{tmp_path}/list-{codec}.avro"
    with write_manifest_list(format_version=2, output_file=io.new_output(list_path), snapshot_id=11,
                             parent_snapshot_id=10, sequence_number=3, avro_compression=codec) as lw:
        lw.add_manifests(manifests)
    for _ in range(2):  # the second round reads with the cached reader trees
        for manifest in manifests:
            ours, theirs = read_manifest_entries(io, manifest), manifest.fetch_manifest_entry(io, discard_deleted=True)
            assert [_fields(e) for e in ours] == [_fields(e) for e in theirs]
            assert [e.status for e in ours] == [ManifestEntryStatus.ADDED, ManifestEntryStatus.EXISTING]
            assert ours[0].sequence_number == 3 and ours[1].sequence_number == 2  # inherited only by ADDED
        listed = read_manifest_list(io, list_path)
        assert listed == list(pyiceberg_list(io, list_path))
        assert [(m.manifest_path, m.added_files_count, m.existing_files_count, m.deleted_files_count, m.partitions)
                for m in listed] == [(m.manifest_path, m.added_files_count, m.existing_files_count,
                                      m.deleted_files_count, m.partitions) for m in pyiceberg_list(io, list_path)]
    kinds = {kind for kind, _ in avro_readers._RESOLVED}  # noqa: SLF001 - one reader per (kind, header schema)
    assert kinds == {"entries", "list"}
    assert sum(1 for kind, _ in avro_readers._RESOLVED if kind == "entries") >= 2  # noqa: SLF001


def pyiceberg_list(io: PyArrowFileIO, path: str) -> list:
    from pyiceberg.manifest import read_manifest_list as theirs

    return list(theirs(io.new_input(path)))


def test_a_file_without_a_schema_in_its_header_is_refused(tmp_path: Path) -> None:
    from pyiceberg.manifest import ManifestFile

    path = tmp_path / "not-avro.avro"
    path.write_bytes(b"Obj\x01\x00\x00" + b"\x00" * 16)  # an Avro header with an empty meta map
    with pytest.raises(CorruptStateError, match="No schema found"):
        read_manifest_entries(PyArrowFileIO(), ManifestFile.from_args(manifest_path=str(path)))


def test_a_manifest_cut_short_is_refused_not_read_as_fewer_entries(tmp_path: Path) -> None:
    """A manifest shorter than its manifest list records: cut after the header, Avro's block loop reads no entries at
    all (the steps it lists would look collected, and the next merge would drop them from the table); cut at a block
    boundary of pyiceberg's one-block-per-entry manifests, it reads fewer."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=3)
    metadata = stream.table.metadata
    files = stream.writer.write(producer="p", seq=0, shards=batch("p", 0, 3)).data_files(
        step=4, spec_id=metadata.default_spec_id)
    io = PyArrowFileIO()
    planner = stream.manifest_planner(metadata)
    lakestreams = planner.added(snapshot_id=11, sequence_number=3, data_files=files)  # one block
    theirs = f"{tmp_path}/theirs.avro"
    with write_manifest(format_version=2, spec=metadata.spec(), schema=metadata.schema(),
                        output_file=io.new_output(theirs), snapshot_id=11, avro_compression="null") as writer:
        for f in files:  # one block per entry
            writer.add_entry(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=11,
                                                     sequence_number=3, file_sequence_number=3, data_file=f))
    pyicebergs = writer.to_manifest_file()
    for manifest in (lakestreams, pyicebergs):
        path = Path(manifest.manifest_path.removeprefix("file:"))
        whole = path.read_bytes()
        sync = whole[-16:]
        header_end = whole.index(sync) + 16
        last_block = whole.rindex(sync, 0, len(whole) - 16) + 16
        for cut in (header_end, last_block):
            path.write_bytes(whole[:cut])
            with pytest.raises(CorruptStateError, match=f"holds {cut} bytes but its manifest list records {len(whole)}"):
                read_manifest_entries(io, manifest)
        path.write_bytes(whole)
        assert len(read_manifest_entries(io, manifest)) == 3


@pytest.mark.parametrize("codec", ["gzip", "uncompressed"])
def test_a_damaged_manifest_or_manifest_list_is_a_corrupt_state_error_naming_it(tmp_path: Path, codec: str) -> None:
    """Bytes that do not decode (a wrong sync marker, a block of garbage) raised whatever pyiceberg's decoder or codec
    raised (ValueError, EOFError, SystemError, zlib.error, ...) out of every read and commit."""
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=2,
                           properties={"write.avro.compression-codec": codec})
    producer = stream.producer("p")
    for seq in range(2):
        producer.commit(batch("p", seq, 2), seq=seq)
    io = stream.io
    listed = stream.refresh().head().manifest_list
    (manifest, *_) = read_manifest_list(io, listed)
    for path, read in ((manifest.manifest_path, lambda: read_manifest_entries(io, manifest)),
                       (listed, lambda: read_manifest_list(io, listed))):
        file = Path(path.removeprefix("file:"))
        whole = file.read_bytes()
        header_end = whole.index(whole[-16:]) + 16
        damaged = (whole[:-1] + bytes([whole[-1] ^ 1]),  # the block's sync marker
                   whole[:header_end] + b"\x02\x7f" + b"\xff" * (len(whole) - header_end - 2))  # a block of garbage
        for data in damaged:
            file.write_bytes(data)
            with pytest.raises(CorruptStateError, match=f"{path} cannot be read as an Iceberg manifest"):
                read()
        file.write_bytes(whole)
        read()
