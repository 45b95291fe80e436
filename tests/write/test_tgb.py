"""Transactional Global Batches on a real SQLite catalog and local warehouse: write, commit, read, exactly-once."""

from __future__ import annotations

import os
from datetime import timedelta

import pyarrow as pa
import pytest

from lakestream_iceberg import (
    ConfigError,
    LakestreamError,
    NotAStreamError,
    RankError,
    SchemaMismatchError,
    SequenceError,
    ShardCountError,
    StepNotPublishedError,
    Stream,
    StreamExistsError,
)
from tests.support import SCHEMA, batch, digest, shard, sqlite_catalog


@pytest.fixture(params=["per-rank", "packed"])
def stream(catalog, request: pytest.FixtureRequest) -> Stream:
    """Every test here runs on both layouts; packed with tiny row groups, so that ranks share and span row groups."""
    return Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=4,
                         properties={"lakestream.layout": request.param, "lakestream.layout.packed.row-group-bytes": "200"})


def data_files_on_disk(stream: Stream) -> set[str]:
    root = stream.table.metadata.location.removeprefix("file://") + "/data"
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


def test_commit_and_read_back_byte_for_byte(stream: Stream) -> None:
    producer = stream.producer("prep-0")
    assert producer.next_seq == 0
    committed = {}
    for seq in range(6):
        shards = batch("prep-0", seq, 4)
        result = producer.commit(shards)
        assert (result.step, result.seq, result.duplicate, result.attempts) == (seq + 1, seq, False, 1)
        committed[result.step] = shards
    assert stream.head_step() == 6
    assert producer.next_seq == 6
    for step, shards in committed.items():
        for rank in range(4):
            got = stream.read(step, rank=rank)
            assert got.schema.equals(SCHEMA)
            assert digest(got) == digest(shards[rank])


def test_shards_may_differ_in_size_and_be_empty(stream: Stream) -> None:
    shards = [shard("p", 0, 0, rows=0), shard("p", 0, 1, rows=7), shard("p", 0, 2, rows=1), shard("p", 0, 3, rows=0)]
    step = stream.producer("p").commit(shards).step
    assert [stream.read(step, rank=r).num_rows for r in range(4)] == [0, 7, 1, 0]
    assert stream.read(step, rank=1).equals(shards[1])


def test_each_rank_is_one_file_with_one_row_group_or_the_step_one_packed_file(stream: Stream) -> None:
    import pyarrow.parquet as pq

    shards = [shard("p", 0, r, rows=n) for r, n in enumerate([3, 0, 5, 2])]
    stream.producer("p").commit(shards)
    files = stream.locate(1)
    if not stream.config.packed:
        assert [f.partition[1] for f in files] == [0, 1, 2, 3]
        for f in files:
            assert pq.ParquetFile(f.file_path.removeprefix("file://")).num_row_groups == 1
            assert "_step" not in pq.read_schema(f.file_path.removeprefix("file://")).names
        return
    assert len(files) == 1 and len(files[0].partition) == 1 and files[0].file_path.endswith("-packed.parquet")
    parquet = pq.ParquetFile(files[0].file_path.removeprefix("file://"))
    assert parquet.schema_arrow.names == [*SCHEMA.names, "_rank"]  # _rank stored, _step in the partition tuple
    ranks = [parquet.read_row_group(g).column("_rank").to_pylist() for g in range(parquet.num_row_groups)]
    assert sum(ranks, []) == [0] * 3 + [2] * 5 + [3] * 2
    assert parquet.num_row_groups > 1  # 200-byte row groups: the ranks do not fit in one
    assert all(set(a).isdisjoint(b) for a, b in zip(ranks, ranks[1:]))  # a rank never spans two row groups


def test_duplicate_seq_returns_original_and_publishes_nothing(stream: Stream) -> None:
    producer = stream.producer("prep-0")
    first = producer.commit(batch("prep-0", 0, 4))
    producer.commit(batch("prep-0", 1, 4))
    again = producer.commit(batch("prep-0", 0, 4), seq=0)
    assert again.duplicate and (again.step, again.snapshot_id) == (first.step, first.snapshot_id)
    latest = producer.commit(batch("prep-0", 1, 4), seq=1)
    assert latest.duplicate and latest.step == 2
    assert stream.head_step() == 2


def test_a_restarted_producer_object_recovers_next_seq_from_the_table(catalog, stream: Stream) -> None:
    stream.producer("a").commit(batch("a", 0, 4))
    stream.producer("b").commit(batch("b", 0, 4))
    stream.producer("a").commit(batch("a", 1, 4))
    reopened = Stream.open(catalog, "ns.stream")
    assert reopened.producer("a").next_seq == 2
    assert reopened.producer("b").next_seq == 1
    assert reopened.producer("never-seen").next_seq == 0


def test_sequence_gap_is_refused_unless_allowed(stream: Stream) -> None:
    producer = stream.producer("p")
    before = data_files_on_disk(stream)
    with pytest.raises(SequenceError, match="allow_gap"):
        producer.commit(batch("p", 3, 4), seq=3)
    assert stream.head_step() == 0 and data_files_on_disk(stream) == before
    assert producer.commit(batch("p", 3, 4), seq=3, allow_gap=True).step == 1
    assert producer.next_seq == 4
    with pytest.raises(SequenceError):
        producer.commit(batch("p", 0, 4), seq=-1)
    # a skipped seq is never reported as published (no duplicate=True with step None): it says it was skipped
    with pytest.raises(SequenceError, match="seq 1 was never published.*skipped.*Commit seq 4 next"):
        producer.commit(batch("p", 1, 4), seq=1)
    assert stream.head_step() == 1


def test_a_skipped_seq_is_refused_after_gc_while_a_lower_seq_of_the_producer_is_live(stream: Stream) -> None:
    """After GC collected steps, a seq missing from the retained lineage may have been published and collected, or
    skipped: it was skipped for certain when a lower seq of the same producer is still live (seqs land in order, GC
    collects only below a step), and only then is the re-commit refused rather than reported as a duplicate."""
    q, p = stream.producer("q"), stream.producer("p")
    q.commit(batch("q", 0, 4))  # step 1
    q.commit(batch("q", 1, 4))  # step 2
    p.commit(batch("p", 0, 4))  # step 3
    p.commit(batch("p", 1, 4))  # step 4
    p.commit(batch("p", 3, 4), seq=3, allow_gap=True)  # step 5: seq 2 skipped
    for seq in range(4, 4 + 8):  # enough later steps that steps 3-5 leave the retained snapshots' summaries
        p.commit(batch("p", seq, 4))
    stream.checkpoint("c", step=3)
    report = stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert report.collected_below == {"main": 3} and stream.state().collected_below == 3
    with pytest.raises(SequenceError, match="seq 2 was never published.*skipped"):
        p.commit(batch("p", 2, 4), seq=2)
    assert p.commit(batch("p", 1, 4), seq=1).duplicate  # a published seq still reads as one
    # q's steps were collected: a re-commit of its published seq 0 is still a duplicate, and nothing is published
    again = q.commit(batch("q", 0, 4), seq=0)
    assert again.duplicate and again.step in (1, None) and stream.head_step() == 13


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (lambda: batch("p", 0, 3), ShardCountError, "world size is 4"),
        (lambda: batch("p", 0, 5), ShardCountError, "exactly one pyarrow Table per"),
        (lambda: shard("p", 0, 0), ShardCountError, "list of 4"),
        (lambda: [shard("p", 0, 0).drop_columns(["image"])] + batch("p", 0, 4)[1:], SchemaMismatchError, "columns"),
        (lambda: [shard("p", 0, 0).cast(SCHEMA.set(1, pa.field("seq", pa.int32())))] + batch("p", 0, 4)[1:], SchemaMismatchError, "cast"),
        (lambda: ["not a table"] * 4, SchemaMismatchError, "expected a pyarrow Table"),
        # the columns' message said which columns were expected, not what to do about the difference
        (lambda: [shard("p", 0, 0).drop_columns(["image"])] + batch("p", 0, 4)[1:], SchemaMismatchError,
         r"lacks column\(s\) \['image'\]"),
        (lambda: [shard("p", 0, 0).append_column("x", pa.array([0] * shard("p", 0, 0).num_rows))] + batch("p", 0, 4)[1:],
         SchemaMismatchError, r"has column\(s\) \['x'\] the stream does not: drop them"),
        (lambda: [shard("p", 0, 0).select(SCHEMA.names[::-1])] + batch("p", 0, 4)[1:], SchemaMismatchError,
         r"in another order: reorder them with table.select\("),
    ],
)
def test_malformed_batches_raise_clear_errors_and_publish_nothing(stream: Stream, bad, error, words) -> None:
    producer = stream.producer("p")
    before = data_files_on_disk(stream)
    with pytest.raises(error, match=words) as info:
        producer.commit(bad())
    assert isinstance(info.value, LakestreamError)
    assert stream.head_step() == 0
    assert data_files_on_disk(stream) == before
    assert producer.next_seq == 0


def test_a_failed_rank_write_deletes_the_other_ranks_files(stream: Stream, monkeypatch: pytest.MonkeyPatch) -> None:
    from lakestream_iceberg.write.writer import BatchWriter

    original = BatchWriter._write_file

    def failing(self: BatchWriter, path: str, rank: int | None, *args):  # type: ignore[no-untyped-def]
        if rank in (2, None):  # rank 2's file, or the packed file
            original(self, path, rank, *args)  # written (as a partial upload might be), then refused
            raise pa.ArrowInvalid("refused by pyarrow")
        return original(self, path, rank, *args)

    producer = stream.producer("p")
    before = data_files_on_disk(stream)
    monkeypatch.setattr(BatchWriter, "_write_file", failing)
    with pytest.raises(SchemaMismatchError, match="deleted"):
        producer.commit(batch("p", 0, 4))
    assert data_files_on_disk(stream) == before and stream.head_step() == 0
    monkeypatch.setattr(BatchWriter, "_write_file", original)
    assert producer.commit(batch("p", 0, 4)).step == 1


def test_reads_outside_the_published_range_or_ranks_are_clear_errors(stream: Stream) -> None:
    stream.producer("p").commit(batch("p", 0, 4))
    with pytest.raises(RankError, match="outside 0..3"):
        stream.read(1, rank=4)
    with pytest.raises(StepNotPublishedError, match="wait_for"):
        stream.read(2, rank=0)


def test_wait_for_returns_once_published_and_times_out_otherwise(stream: Stream) -> None:
    from lakestream_iceberg import ReadTimeoutError

    stream.producer("p").commit(batch("p", 0, 4))
    assert stream.wait_for(1, timeout=1) == 1
    with pytest.raises(ReadTimeoutError, match="not published within"):
        stream.wait_for(2, timeout=0.3)


def test_open_refuses_plain_iceberg_tables(catalog) -> None:
    catalog.create_namespace("ns")
    catalog.create_table("ns.plain", schema=SCHEMA)
    with pytest.raises(NotAStreamError, match="Stream.create"):
        Stream.open(catalog, "ns.plain")
    with pytest.raises(NotAStreamError):
        Stream.create(catalog, "ns.plain", schema=SCHEMA, world_size=2)


def test_create_is_idempotent_but_refuses_another_schema_or_world_size(catalog, stream: Stream) -> None:
    assert Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=4).name == "ns.stream"
    with pytest.raises(StreamExistsError, match="world_size=4"):
        Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=2)
    with pytest.raises(StreamExistsError):
        Stream.create(catalog, "ns.stream", schema=SCHEMA.remove(5), world_size=4)


@pytest.mark.parametrize(("kind", "words"), [
    (pa.int64(), "reserved"),  # the column is named _step
    (pa.timestamp("ns"), r"not one Iceberg \(format version 2\) can hold: .*timestamp\[ns\]"),
    (pa.duration("us"), r"can hold: .*duration\[us\]"),
    (pa.null(), "can hold: Null type"),
    (pa.struct([("a", pa.int32()), ("a", pa.string())]), "can hold: .*multiple fields for name x.a"),
])
def test_reserved_column_names_and_types_iceberg_lacks_are_refused(catalog, kind: pa.DataType, words: str) -> None:
    name = "_step" if words == "reserved" else "x"
    with pytest.raises(SchemaMismatchError, match=words):
        Stream.create(catalog, "ns.bad", schema=pa.schema([(name, kind)]), world_size=1)
    assert not catalog.table_exists("ns.bad")


def test_reserved_column_names_are_reserved_in_any_letter_case(catalog) -> None:
    """A payload column _STEP was taken: the history views' `SELECT _step FROM samples` then read it instead of the
    step (DuckDB resolves names in any case), as Trino and Spark (case-insensitive by default) would."""
    for name in ("_STEP", "_Rank"):
        with pytest.raises(SchemaMismatchError, match="reserved"):
            Stream.create(catalog, "ns.bad", schema=pa.schema([(name, pa.int32()), ("x", pa.int32())]), world_size=1)
        assert not catalog.table_exists("ns.bad")


@pytest.mark.parametrize("layout", ["per-rank", "packed"])
def test_uint32_columns_hold_their_whole_range(catalog, layout: str) -> None:
    """pyiceberg types uint32 as Iceberg's signed 32-bit int; the table types it long, so every uint32 is written."""
    kinds = {"x": pa.uint32(), "l": pa.list_(pa.uint32()), "s": pa.struct([("u", pa.uint32())]), "b": pa.uint16()}
    schema = pa.schema(list(kinds.items()))
    stream = Stream.create(catalog, "ns.u32", schema=schema, world_size=1, properties={"lakestream.layout": layout})
    top = 2**32 - 1
    rows = pa.table({"x": pa.array([top, None], pa.uint32()), "l": pa.array([[top, 0], None], kinds["l"]),
                     "s": pa.array([{"u": top}, None], kinds["s"]), "b": pa.array([2**16 - 1, 0], pa.uint16())},
                    schema=schema)
    stream.producer("p").commit([rows])
    assert stream.read(1, rank=0).equals(rows)  # the stream's own types back
    assert stream.refresh().table.scan().to_arrow().column("x").to_pylist() == [top, None]  # as Iceberg reads it


def test_create_racing_another_process_creating_the_namespace_opens_the_stream(tmp_path) -> None:
    """Another process creates the namespace between the SQL catalog's existence check and its insert (two trainers
    starting at once): the insert's IntegrityError escaped create() raw; the namespace is there, so the stream is made."""
    from pyiceberg.catalog.sql import SqlCatalog

    other = sqlite_catalog(str(tmp_path))

    class Racing(SqlCatalog):
        def namespace_exists(self, namespace) -> bool:  # type: ignore[no-untyped-def]
            found = super().namespace_exists(namespace)
            if not found and not other.namespace_exists(namespace):
                other.create_namespace(namespace)  # the other process wins the insert right after this check
            return found

    racing = Racing("test", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(racing, "ns.stream", schema=SCHEMA, world_size=2)
    assert Stream.create(other, "ns.stream", schema=SCHEMA, world_size=2).table.metadata.table_uuid == \
        stream.table.metadata.table_uuid




@pytest.mark.parametrize("layout", ["per-rank", "packed"])
@pytest.mark.parametrize(("settings", "codec"), [
    ({"write.parquet.compression-codec": "uncompressed"}, "UNCOMPRESSED"),  # Iceberg's name, not pyarrow's "none"
    ({"write.parquet.compression-codec": "gzip", "write.parquet.compression-level": "9"}, "GZIP"),
    ({}, "ZSTD"),
])
def test_icebergs_parquet_writer_properties_are_honoured(catalog, layout: str, settings: dict[str, str],
                                                         codec: str) -> None:
    import pyarrow.parquet as pq

    stream = Stream.create(catalog, "ns.codec", schema=SCHEMA, world_size=2,
                           properties={"lakestream.layout": layout, **settings})
    stream.producer("p").commit(batch("p", 0, 2))
    written = [path for path in data_files_on_disk(stream) if path.endswith(".parquet")]
    assert len(written) == (1 if layout == "packed" else 2)
    for path in written:
        metadata = pq.read_metadata(path)
        assert {metadata.row_group(0).column(i).compression for i in range(metadata.num_columns)} == {codec}
    assert stream.read(1, rank=1).equals(shard("p", 0, 1))


def _snappy_manifests_available() -> bool:
    from pyiceberg.avro.codecs import KNOWN_CODECS

    try:
        KNOWN_CODECS["snappy"].compress(b"x")  # type: ignore[union-attr]
    except ImportError:
        return False
    return True


REFUSED = [
    ({"write.parquet.compression-codec": "lzma"}, "write.parquet.compression-codec='lzma'"),
    ({"write.parquet.compression-codec": "gzip", "write.parquet.compression-level": "100"}, "compression-level='100'"),
    ({"write.parquet.page-size-bytes": "big"}, "write.parquet.page-size-bytes='big' is not an integer"),
    ({"write.parquet.page-size-bytes": str(2**70)}, "page-size-bytes='1180591620717411303424'"),
    ({"write.parquet.dict-size-bytes": "0"}, "write.parquet.dict-size-bytes=0 must be >= 1"),
    ({"write.avro.compression-codec": "lzma"}, "write.avro.compression-codec='lzma'"),
    ({"write.metadata.metrics.default": "bogus"}, "write.metadata.metrics.default='bogus'"),
    ({"write.metadata.metrics.column.image": "truncate(0)"}, "write.metadata.metrics.column.image='truncate\\(0\\)'"),
]
if not _snappy_manifests_available():  # pyiceberg's snappy codec needs python-snappy (pyiceberg[snappy])
    REFUSED.append(({"write.avro.compression-codec": "snappy"}, "pyiceberg\\[snappy\\]"))


@pytest.mark.parametrize(("settings", "words"), REFUSED)
def test_file_settings_pyarrow_or_pyiceberg_refuse_are_config_errors(catalog, settings: dict[str, str],
                                                                     words: str) -> None:
    """Refused at creation, before the table exists; and set on an existing stream (by any Iceberg client), refused
    when a producer is made, before it writes anything, instead of failing every commit with a raw library error."""
    from lakestream_iceberg import ConfigError

    with pytest.raises(ConfigError, match=words):
        Stream.create(catalog, "ns.refused", schema=SCHEMA, world_size=2, properties=settings)
    assert not catalog.table_exists("ns.refused")
    stream = Stream.create(catalog, "ns.changed", schema=SCHEMA, world_size=2)
    stream.table.transaction().set_properties(settings).commit_transaction()
    reopened = Stream.open(catalog, "ns.changed")
    with pytest.raises(ConfigError, match=words):
        reopened.producer("p")
    assert not data_files_on_disk(reopened)


@pytest.mark.parametrize("codec", ["snappy", "uncompressed"])
def test_a_level_for_a_codec_without_levels_is_refused_at_creation_and_ignored_on_an_existing_table(
        catalog, codec: str, caplog: pytest.LogCaptureFixture) -> None:
    from lakestream_iceberg import ConfigError

    settings = {"write.parquet.compression-codec": codec, "write.parquet.compression-level": "3"}
    with pytest.raises(ConfigError, match=f"codec '{codec}' takes no level"):
        Stream.create(catalog, "ns.refused", schema=SCHEMA, world_size=2, properties=settings)
    stream = Stream.create(catalog, "ns.changed", schema=SCHEMA, world_size=2)
    stream.table.transaction().set_properties(settings).commit_transaction()  # another Iceberg client set it
    reopened = Stream.open(catalog, "ns.changed")
    with caplog.at_level("WARNING", logger="lakestream_iceberg"):
        assert reopened.producer("p").commit(batch("p", 0, 2)).step == 1
    assert "takes no level" in caplog.text
    assert reopened.read(1, rank=0).equals(shard("p", 0, 0))


def test_page_row_limit_and_uncompressed_manifests_are_honoured(catalog, caplog) -> None:
    """write.parquet.page-row-limit needs pyarrow's max_rows_per_page (pyarrow >= 23); an older pyarrow ignores it with
    a warning and writes the same file (this test asserted the smaller pages whatever the pyarrow)."""
    import inspect

    import pyarrow.parquet as pq

    page_rows = "max_rows_per_page" in inspect.signature(pq.ParquetWriter.__init__).parameters
    sizes = {}
    for name, settings in (("plain", {}), ("paged", {"write.parquet.page-row-limit": "1",
                                                     "write.avro.compression-codec": "uncompressed"})):
        stream = Stream.create(catalog, f"ns.{name}", schema=SCHEMA, world_size=2,
                               properties={"lakestream.layout": "packed", **settings})
        shards = [shard("p", 0, r, rows=5) for r in range(2)]
        stream.producer("p").commit(shards)
        (path,) = [p for p in data_files_on_disk(stream) if p.endswith(".parquet")]
        sizes[name] = os.path.getsize(path)
        assert stream.read(1, rank=1).equals(shards[1])
        metadata_dir = stream.table.metadata.location.removeprefix("file://") + "/metadata"
        manifests = [f for f in os.listdir(metadata_dir) if f.endswith(".avro")]
        assert manifests
        for manifest in manifests:
            with open(os.path.join(metadata_dir, manifest), "rb") as f:
                header = f.read(4096)
            assert (b"avro.codec\x08null" in header) == (name == "paged")  # uncompressed is Avro's null codec
    if page_rows:
        assert sizes["paged"] > sizes["plain"]  # 10 one-row pages per column instead of one page
        assert "page-row-limit is ignored" not in caplog.text
    else:
        assert sizes["paged"] == sizes["plain"] and "write.parquet.page-row-limit is ignored" in caplog.text


def test_closing_the_writer_stops_its_threads_and_a_later_commit_makes_new_ones(catalog) -> None:
    import threading

    stream = Stream.create(catalog, "ns.closing", schema=SCHEMA, world_size=4, properties={"lakestream.layout": "per-rank"})
    producer = stream.producer("p")
    before = set(threading.enumerate())  # other streams' writers of this process may have threads of their own
    producer.commit(batch("p", 0, 4))
    mine = [t for t in threading.enumerate() if t.name.startswith("lakestream-write") and t not in before]
    assert mine
    stream.writer.close()
    assert not any(t.is_alive() for t in mine)
    assert producer.commit(batch("p", 1, 4)).step == 2
    assert stream.read(2, rank=3).equals(shard("p", 1, 3))


@pytest.mark.parametrize("layout", ["per-rank", "packed"])
def test_large_binary_values_are_written_without_a_dictionary_and_small_ones_keep_it(catalog, layout: str) -> None:
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.int64()), ("image", pa.binary()), ("label", pa.string())])
    stream = Stream.create(catalog, "ns.blobs", schema=schema, world_size=2, properties={"lakestream.layout": layout})
    shards = [pa.table({"id": [r * 10 + i for i in range(6)],
                        "image": [bytes([r, i]) * 1024 for i in range(6)],  # 2 KiB each: no dictionary
                        "label": ["cat", "dog", "cat", None, "dog", "cat"]}, schema=schema) for r in range(2)]
    stream.producer("p").commit(shards)
    for path in (p for p in data_files_on_disk(stream) if p.endswith(".parquet")):
        metadata = pq.read_metadata(path)
        chunks = {metadata.schema.column(i).name: metadata.row_group(0).column(i) for i in range(metadata.num_columns)}
        assert not chunks["image"].has_dictionary_page
        assert chunks["label"].has_dictionary_page and chunks["id"].has_dictionary_page
    assert stream.read(1, rank=1).equals(shards[1])

@pytest.mark.parametrize("layout", ["per-rank", "packed"])
def test_number_lists_and_large_values_of_a_nested_schema_are_written_without_a_dictionary(catalog, layout: str) -> None:
    """Token ids (and any list of numbers) gain nothing from a dictionary and cost a hash per value; a nested schema
    (its leaf columns are named by path: ``tokens.list.element``) gets the same rules as a flat one."""
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.int64()), ("tokens", pa.list_(pa.int32())), ("image", pa.binary()),
                        ("tags", pa.list_(pa.string())), ("meta", pa.struct([("label", pa.string())]))])
    stream = Stream.create(catalog, "ns.nested", schema=schema, world_size=2, properties={"lakestream.layout": layout})
    shards = [pa.table({"id": [r * 10 + i for i in range(6)],
                        "tokens": [[i, 7, 7, r] * 8 for i in range(6)],
                        "image": [bytes([r, i]) * 1024 for i in range(6)],  # 2 KiB each: no dictionary
                        "tags": [["a", "b"], [], None, ["a"], ["b", "b"], ["a"]],
                        "meta": [{"label": "cat"}, {"label": "dog"}, None, {"label": "cat"}, {"label": None},
                                 {"label": "cat"}]}, schema=schema) for r in range(2)]
    stream.producer("p").commit(shards)
    for path in (p for p in data_files_on_disk(stream) if p.endswith(".parquet")):
        metadata = pq.read_metadata(path)
        chunks = {metadata.schema.column(i).path: metadata.row_group(0).column(i) for i in range(metadata.num_columns)}
        assert set(chunks) >= {"id", "tokens.list.element", "image", "tags.list.element", "meta.label"}
        assert not chunks["tokens.list.element"].has_dictionary_page
        assert not chunks["image"].has_dictionary_page
        for kept in ("id", "tags.list.element", "meta.label"):
            assert chunks[kept].has_dictionary_page, kept
    for rank in range(2):
        assert stream.read(1, rank=rank).equals(shards[rank])


def test_plain_iceberg_scan_sees_every_sample_with_step_and_rank(stream: Stream) -> None:
    producer = stream.producer("p")
    expected = 0
    for seq in range(3):
        shards = batch("p", seq, 4)
        expected += sum(s.num_rows for s in shards)
        producer.commit(shards)
    table = stream.table.catalog.load_table("ns.stream")  # a plain pyiceberg user
    full = table.scan().to_arrow()
    assert full.num_rows == expected
    rows = full.select(["seq", "rank", "_step", "_rank"]).to_pylist()
    assert all(r["_step"] == r["seq"] + 1 and r["_rank"] == r["rank"] for r in rows)
    # Iceberg's own commit retries stay at their defaults (other engines' commits on the stream retry); lakestream's
    # commits never go through pyiceberg's retrying commit_transaction
    assert "commit.retry.num-retries" not in table.properties


def test_commit_cost_state_stays_bounded(catalog) -> None:
    stream = Stream.create(catalog, "ns.small", schema=SCHEMA, world_size=2,
                           properties={"lakestream.snapshots.retain-last": "5", "lakestream.manifest.merge-fanout": "4"})
    producer = stream.producer("p")
    for seq in range(40):
        producer.commit(batch("p", seq, 2))
    stream.refresh()
    assert len(stream.table.metadata.snapshots) <= 5
    manifests = stream.head().manifests(stream.io)
    assert len(manifests) <= 3 * 3 + 1  # (fanout - 1) per level, 3 levels for 40 steps
    for step in (1, 17, 40):  # expired snapshots' steps are still found through the head's manifests
        assert stream.read(step, rank=1).equals(shard("p", step - 1, 1))


def test_merges_drop_the_manifests_they_replace_from_the_cache_and_keep_the_live_ones(catalog) -> None:
    from lakestream_iceberg.format.manifest_cache import ManifestCache

    cache = ManifestCache(max_files=512)
    created = Stream.create(catalog, "ns.cached", schema=SCHEMA, world_size=2,
                            properties={"lakestream.manifest.merge-fanout": "4"})
    stream = Stream(created.table, cache=cache)
    producer = stream.producer("p")
    for seq in range(70):  # levels 0..2 merge: 64 steps make one level-3 manifest
        producer.commit(batch("p", seq, 2))
    live = {m.manifest_path for m in stream.refresh().head().manifests(stream.io)}
    assert any("-L3-" in path for path in live)
    # the next, larger merge reads the live manifests' entries from memory; merged-away ones are not kept
    assert cache.entries_cached() == live



def test_a_manifest_too_large_to_merge_again_is_not_cached_by_its_writer(catalog) -> None:
    """A manifest holding more than ``max-merge-entries`` files (a step of a wide per-rank stream, a large group) is
    never merged again, so no commit reads it back: its writer does not keep its entries; the others it keeps."""
    from lakestream_iceberg.format.manifest_cache import ManifestCache

    world = 20
    cache = ManifestCache(max_files=512)
    created = Stream.create(catalog, "ns.capped", schema=SCHEMA, world_size=world,
                            properties={"lakestream.layout": "per-rank", "lakestream.manifest.merge-fanout": "4",
                                        "lakestream.manifest.max-merge-entries": "16"})
    stream = Stream(created.table, cache=cache)
    producer = stream.producer("p")
    for seq in range(6):
        producer.commit(batch("p", seq, world))
    manifests = stream.refresh().head().manifests(stream.io)
    assert len(manifests) == 6 and all(m.added_files_count + m.existing_files_count == world for m in manifests)
    assert not cache.entries_cached() & {m.manifest_path for m in manifests}  # none merged, none kept
    assert stream.read(3, rank=7).equals(shard("p", 2, 7))  # a reader reads (and caches) the one it needs


def test_a_lost_swap_keeps_the_manifests_it_would_have_merged_cached(catalog, monkeypatch) -> None:
    """A merge whose swap is lost must not drop the parent's manifests from the cache: the re-plan merges the same
    manifests again and would read each of them back from storage inside its critical section."""
    import lakestream_iceberg.write.commit as commit_module
    from lakestream_iceberg.format.manifest_cache import ManifestCache

    class CountingCache(ManifestCache):
        def __init__(self) -> None:
            super().__init__(max_files=512)
            self.read_back: list[str] = []

        def entries(self, io, manifest):  # type: ignore[no-untyped-def]
            if manifest.manifest_path not in self.entries_cached():
                self.read_back.append(manifest.manifest_path)
            return super().entries(io, manifest)

    cache = CountingCache()
    created = Stream.create(catalog, "ns.lostmerge", schema=SCHEMA, world_size=2,
                            properties={"lakestream.manifest.merge-fanout": "4"})
    stream = Stream(created.table, cache=cache)
    producer = stream.producer("p")
    for seq in range(3):  # three level-0 manifests: the next commit merges them with its own
        producer.commit(batch("p", seq, 2))
    parent = {m.manifest_path for m in stream.refresh().head().manifests(stream.io)}
    assert len(parent) == 3 and parent <= cache.entries_cached()

    real_swap = commit_module.swap
    raced: list[int] = []

    def swap_after_a_foreign_commit(table, requirements, updates, **kw):  # type: ignore[no-untyped-def]
        if not raced:  # the first swap of the merging commit: a checkpoint moves the pointer first, so it is lost
            raced.append(1)
            stream.checkpoint("race", step=1)
        return real_swap(table, requirements, updates, **kw)

    monkeypatch.setattr(commit_module, "swap", swap_after_a_foreign_commit)
    result = producer.commit(batch("p", 3, 2))
    assert result.step == 4 and result.attempts == 2  # the first swap was lost to the checkpoint
    assert cache.read_back == []  # the re-plan found the parent's manifests in memory
    live = {m.manifest_path for m in stream.refresh().head().manifests(stream.io)}
    assert not live & parent  # merged: the parent's level-0 manifests are no longer listed
    tag = {m.manifest_path for m in stream.table.metadata.snapshot_by_name("race").manifests(stream.io)}
    # landed: the merged-away manifests and those the lost plan wrote are forgotten; the live ones and the
    # checkpoint's own manifest stay
    assert cache.entries_cached() == live | (tag - parent)
    assert stream.read(4, rank=1).equals(shard("p", 3, 1))


def test_a_lost_swap_whose_winner_merged_the_same_manifests_forgets_them(catalog, monkeypatch) -> None:
    """Another process (its own cache) merged the same level-0 manifests first: the loser's re-plan will never read
    them again, so its cache does not keep them."""
    import lakestream_iceberg.write.commit as commit_module
    from lakestream_iceberg.format.manifest_cache import ManifestCache

    mine, theirs = ManifestCache(max_files=512), ManifestCache(max_files=512)
    created = Stream.create(catalog, "ns.lostmerge2", schema=SCHEMA, world_size=2,
                            properties={"lakestream.manifest.merge-fanout": "4"})
    stream = Stream(created.table, cache=mine)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, 2))
    parent = {m.manifest_path for m in stream.refresh().head().manifests(stream.io)}
    assert len(parent) == 3 and parent <= mine.entries_cached()
    other = Stream(Stream.open(catalog, "ns.lostmerge2").table, cache=theirs).producer("q")

    real_swap = commit_module.swap
    raced: list[int] = []

    def swap_after_the_other_merged(table, requirements, updates, **kw):  # type: ignore[no-untyped-def]
        if not raced:
            raced.append(1)
            other.commit(batch("q", 0, 2))  # merges the same three manifests with its own, and lands first
        return real_swap(table, requirements, updates, **kw)

    monkeypatch.setattr(commit_module, "swap", swap_after_the_other_merged)
    result = producer.commit(batch("p", 3, 2))
    assert result.step == 5 and result.attempts >= 2
    assert not parent & mine.entries_cached()  # merged away by the winner: forgotten by the loser too
    assert stream.read(4, rank=0).equals(shard("q", 0, 0)) and stream.read(5, rank=0).equals(shard("p", 3, 0))

def test_wait_for_polls_the_pointer_and_reloads_only_when_it_moved(stream: Stream) -> None:
    from lakestream_iceberg import ReadTimeoutError

    stream.producer("p").commit(batch("p", 0, 4))
    stream.wait_for(1, timeout=1)
    before = stream.table.metadata
    with pytest.raises(ReadTimeoutError):
        stream.wait_for(2, timeout=0.3, poll_s=0.02)
    assert stream.table.metadata is before  # several polls, no metadata reload: nothing changed
    stream.producer("q").commit(batch("q", 0, 4))
    assert stream.wait_for(2, timeout=1) == 2 and stream.table.metadata is not before


def test_state_hands_the_caller_its_own_producer_table(stream: Stream) -> None:
    import pickle

    stream.producer("p").commit(batch("p", 0, 4))
    state = stream.state()
    assert type(state.producers) is dict and pickle.loads(pickle.dumps(state)) == state
    state.producers.clear()  # the caller's copy: the parsed state shared in this process is untouched
    assert set(stream.state().producers) == {"p"} and stream.head_step() == 1


def test_a_wide_batch_is_checked_as_a_whole_and_a_bad_rank_is_still_named() -> None:
    """check_shards takes a batch of one schema in a few Arrow calls whatever the world size, and falls back to the
    per-rank checks for anything else: the error still names the rank, and what those checks accept stays accepted."""
    from lakestream_iceberg.format.batches import check_shards

    inner = pa.struct([pa.field("a", pa.int64(), nullable=False), pa.field("b", pa.string())])
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("meta", inner), pa.field("x", pa.float32())])
    world = 1024

    def rank_table(rank: int, *, id_: int | None = 0, a: int | None = 1) -> pa.Table:
        return pa.table({"id": pa.array([id_], pa.int64()), "meta": pa.array([{"a": a, "b": None}], type=inner),
                         "x": pa.array([float(rank)], pa.float32())}, schema=schema)

    good = [rank_table(r) for r in range(world)]
    assert all(a is b for a, b in zip(check_shards(good, world_size=world, expected=schema), good))
    with pytest.raises(SchemaMismatchError, match=r"rank 700: column 'id' is required but has nulls"):
        check_shards([*good[:700], rank_table(700, id_=None), *good[701:]], world_size=world, expected=schema)
    with pytest.raises(SchemaMismatchError, match=r"rank 900: nested field 'meta.a' is required"):
        check_shards([*good[:900], rank_table(900, a=None), *good[901:]], world_size=world, expected=schema)
    with pytest.raises(SchemaMismatchError, match=r"rank 5: column 'x' is double"):
        check_shards([*good[:5], good[5].cast(schema.set(2, pa.field("x", pa.float64()))), *good[6:]],
                     world_size=world, expected=schema)
    # accepted by the per-rank checks, so still accepted: a nullable copy of the schema, a RecordBatch, other metadata
    relaxed = good[3].cast(pa.schema([f.with_nullable(True) for f in schema]))
    batch_shard = good[4].to_batches()[0]
    tagged = good[6].replace_schema_metadata({"origin": "rank 6"})
    mixed = [*good[:3], relaxed, batch_shard, good[5], tagged, *good[7:]]
    out = check_shards(mixed, world_size=world, expected=schema)
    assert len(out) == world and all(isinstance(t, pa.Table) for t in out) and out[4].equals(good[4])


_INNER = pa.struct([pa.field("a", pa.int64(), nullable=False), pa.field("t", pa.timestamp("us"), nullable=False),
                    pa.field("q", pa.struct([pa.field("z", pa.string(), nullable=False)]), nullable=False)])
_HIDDEN = pa.schema([pa.field("meta", _INNER), pa.field("items", pa.list_(_INNER)), pa.field("m", pa.map_(pa.string(), _INNER))])


def _hidden_null_rows(how: str) -> pa.Table:
    one = {"a": 1, "t": 0, "q": {"z": "x"}}
    good = pa.table({"meta": pa.array([one], _INNER), "items": pa.array([[one, None]], _HIDDEN.field("items").type),
                     "m": pa.array([[("k", one)]], _HIDDEN.field("m").type)}, schema=_HIDDEN)
    if how == "masked":  # a null struct whose required child holds a null in its slot, built by hand
        meta = pa.StructArray.from_arrays([pa.array([None, 2], pa.int64()), pa.array([0, 0], pa.timestamp("us")),
                                           pa.array([{"z": "y"}] * 2, _INNER.field("q").type)],
                                          fields=list(_INNER), mask=pa.array([True, False]))
        return good.take([0, 0]).set_column(0, _HIDDEN.field("meta"), meta).slice(1)
    nulls = pa.array({"take": [0, None, 0], "all-null": [None, None], "sliced": [None, 0, None, 0]}[how], pa.int32())
    taken = good.take(nulls)  # take's null slots hold nulls in every child, required ones too
    return taken.slice(1, 2) if how == "sliced" else taken


@pytest.mark.parametrize("layout", ["per-rank", "packed"])
@pytest.mark.parametrize("how", ["take", "all-null", "sliced", "masked"])
def test_nulls_of_required_nested_fields_under_null_parents_are_written(catalog, layout: str, how: str) -> None:
    """Arrow allows a non-nullable nested field to hold nulls under a null parent (check_batch accepts them); pyarrow's
    cast and Parquet writer refuse them, so the writer fills those slots (no reader sees them) instead of failing."""
    rows = _hidden_null_rows(how)
    stream = Stream.create(catalog, "ns.hidden", schema=_HIDDEN, world_size=2, properties={"lakestream.layout": layout})
    stream.producer("p").commit([rows, _hidden_null_rows("take")])
    assert stream.read(1, rank=0).to_pylist() == rows.to_pylist()
    assert stream.read(1, rank=1).to_pylist() == _hidden_null_rows("take").to_pylist()


_MAPS = pa.schema([pa.field("m", pa.map_(pa.string(), pa.int64())), pa.field("lm", pa.list_(pa.map_(pa.string(), pa.int64())))])


@pytest.mark.parametrize("layout", ["per-rank", "packed"])
@pytest.mark.parametrize("how", ["take", "filter"])
def test_maps_of_a_shard_made_by_take_or_filter_are_written(catalog, layout: str, how: str) -> None:
    """pyarrow 25, the last for Python 3.10, aborted the producer's process (a failed C++ check: "Map array keys array
    should have no nulls") when the writer cast the string keys of a map that take() or filter() made to Iceberg's
    large_string: their keys carry a validity bitmap. Such maps are written and read back as they were."""
    whole = pa.table({"m": [[("a", 1)], None, [("b", 2), ("c", 3)], []],
                      "lm": [[[("a", 1)]], [None, [("d", 4)]], None, [[]]]}, schema=_MAPS)
    rows = whole.take([2, 0, 1, 3]) if how == "take" else whole.filter(pa.array([True, False, True, True]))
    stream = Stream.create(catalog, "ns.maps", schema=_MAPS, world_size=2, properties={"lakestream.layout": layout})
    stream.producer("p").commit([rows, rows.slice(1)])
    assert stream.read(1, rank=0).to_pylist() == rows.to_pylist()
    assert stream.read(1, rank=1).to_pylist() == rows.slice(1).to_pylist()


def test_the_manifest_cache_is_bounded_in_entries_too() -> None:
    """A manifest holds up to thousands of entries (each with its file's statistics): 512 manifests could hold two
    million. The cache also bounds the entries held, all manifests together, least recently used first; one manifest
    larger than a quarter of that bound is not kept (it would push out every live one)."""
    from pyiceberg.manifest import DataFile, ManifestEntry, ManifestEntryStatus

    from lakestream_iceberg.format.manifest_cache import ManifestCache

    def entries(n: int) -> list[ManifestEntry]:
        return [ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=1, sequence_number=1,
                                        file_sequence_number=1, data_file=DataFile.from_args(file_path=f"f{i}"))
                for i in range(n)]

    cache = ManifestCache(max_files=512, max_entries=1_000)
    for i in range(10):
        cache.remember_entries(f"m{i}", entries(200))
        assert cache.entry_count <= 1_000
    assert cache.entries_cached() == {f"m{i}" for i in range(5, 10)} and cache.entry_count == 1_000
    cache.remember_entries("big", entries(251))  # over a quarter of the bound: not kept, the live ones stay
    assert "big" not in cache.entries_cached() and cache.entry_count == 1_000
    cache.forget_entries([f"m{i}" for i in range(5, 10)])
    assert cache.entry_count == 0 and not cache.entries_cached()
    cache.remember_entries("m", entries(10))
    cache.remember_entries("m", entries(20))  # the same path again: counted once
    assert cache.entry_count == 20


def test_a_producer_handed_to_another_process_is_refused_with_what_to_send_instead(stream: Stream) -> None:
    # Pickling a producer (multiprocessing args, a Ray task) failed with "cannot pickle '_thread.lock' object".
    import pickle

    producer = stream.producer("p")
    with pytest.raises(ConfigError, match=r"stream.producer\('p'\)") as refused:
        pickle.dumps(producer)
    assert "the stream pickles" in str(refused.value)
    again = pickle.loads(pickle.dumps(stream))  # what the message says to send instead
    assert again.producer("p").commit(batch("p", 0, 4)).step == 1
