"""The packed layout (one Parquet file per step, ``_rank`` stored, a row group per few ranks): how a stream gets it, what
other Iceberg readers see, reading any rank or any consumer world size, damaged files, staged intents, history, GC.

Both layouts also run every test of ``test_tgb.py``.
"""

from __future__ import annotations

import copy
import json
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.expressions import EqualTo

from lakestream_iceberg import ConfigError, CorruptStateError, RankError, StepCollectedError, Stream, StreamExistsError
from tests.support import SCHEMA, batch, digest, shard
from tests.test_hardening import file_json, forge_intent, local, published_by

PACKED = {"lakestream.layout": "packed", "lakestream.layout.packed.row-group-bytes": "300"}


def make(catalog: SqlCatalog, name: str = "ns.packed", *, world_size: int = 6, **props: str) -> Stream:
    return Stream.create(catalog, name, schema=SCHEMA, world_size=world_size, properties={**PACKED, **props})


def uneven(producer: str, seq: int, world_size: int) -> list[pa.Table]:
    """Shards of very different sizes, some empty: ranks share row groups and some fill one alone."""
    sizes = [(7 * r + 3 * seq) % 11 if r % 4 else 0 for r in range(world_size)]
    return [shard(producer, seq, r, rows=n) for r, n in enumerate(sizes)]


def data_files(stream: Stream) -> list[Path]:
    root = local(stream.table.metadata.location) / "data"
    return [p for p in root.rglob("*.parquet") if "_staging" not in p.parts and "_producers" not in p.parts]


# -- how a stream gets its layout -------------------------------------------------------------------------------------


def test_layout_is_chosen_by_world_size_unless_set_and_is_fixed_at_creation(catalog: SqlCatalog) -> None:
    small = Stream.create(catalog, "ns.small", schema=SCHEMA, world_size=7)
    large = Stream.create(catalog, "ns.large", schema=SCHEMA, world_size=8)
    forced = Stream.create(catalog, "ns.forced", schema=SCHEMA, world_size=2, properties={"lakestream.layout": "packed"})
    assert (small.config.layout, large.config.layout, forced.config.layout) == ("per-rank", "packed", "packed")
    assert [f.name for f in large.table.metadata.spec().fields] == ["_step"]
    assert [f.name for f in small.table.metadata.spec().fields] == ["_step", "_rank"]
    assert Stream.create(catalog, "ns.large", schema=SCHEMA, world_size=8).config.packed  # idempotent
    with pytest.raises(StreamExistsError, match="layout is fixed"):
        Stream.create(catalog, "ns.large", schema=SCHEMA, world_size=8, properties={"lakestream.layout": "per-rank"})
    with pytest.raises(ConfigError, match="not a layout"):
        Stream.create(catalog, "ns.bad", schema=SCHEMA, world_size=2, properties={"lakestream.layout": "Packed"})
    with pytest.raises(ConfigError, match="row-group-bytes"):
        Stream.create(catalog, "ns.bad", schema=SCHEMA, world_size=2, properties={"lakestream.layout.packed.row-group-bytes": "0"})
    assert not catalog.table_exists("ns.bad")


def test_a_layout_property_changed_by_hand_is_refused_at_open(catalog: SqlCatalog) -> None:
    stream = make(catalog)
    stream.producer("p").commit(batch("p", 0, 6))
    with stream.table.transaction() as tx:
        tx.set_properties({"lakestream.layout": "per-rank"})
    with pytest.raises(ConfigError, match="layout is fixed when a stream is created"):
        Stream.open(catalog, "ns.packed")
    with stream.table.transaction() as tx:
        tx.set_properties({"lakestream.layout": "packed"})
    assert Stream.open(catalog, "ns.packed").read(1, rank=3).num_rows == batch("p", 0, 6)[3].num_rows


# -- writing and reading ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 6, 64])
def test_a_step_is_one_data_file_and_every_rank_reads_back_exactly_its_rows(catalog: SqlCatalog, world_size: int) -> None:
    stream = make(catalog, world_size=world_size)
    producer = stream.producer("p")
    sent = {}
    for seq in range(3):
        shards = uneven("p", seq, world_size)
        sent[producer.commit(shards).step] = shards
        assert len(data_files(stream)) == seq + 1  # one PUT per step, whatever the world size
    for step, shards in sent.items():
        for rank in range(world_size):
            got = stream.read(step, rank=rank)
            assert got.schema.equals(SCHEMA) and digest(got) == digest(shards[rank]), (step, rank)
        assert stream.read(step, rank=world_size - 1, columns=["seq", "i"]).column_names == ["seq", "i"]
        with stream.step_files(step) as files:
            assert files.counts == [s.num_rows for s in shards]


def test_an_all_empty_batch_is_a_file_without_row_groups(catalog: SqlCatalog) -> None:
    stream = make(catalog)
    step = stream.producer("p").commit([SCHEMA.empty_table()] * 6).step
    (path,) = data_files(stream)
    assert pq.ParquetFile(path).num_row_groups == 0
    assert all(stream.read(step, rank=r).num_rows == 0 for r in range(6))


def test_a_large_rank_gets_a_row_group_of_its_own_and_small_ones_share(catalog: SqlCatalog) -> None:
    sizes = [1, 1, 40, 1, 1, 1]
    shards = [shard("p", 0, r, rows=n) for r, n in enumerate(sizes)]
    big = shards[2].nbytes  # a row group closes once it holds this many bytes: the 1-row ranks share, rank 2 fills one
    assert big > 4 * max(s.nbytes for s in shards if s.num_rows == 1)
    stream = make(catalog, **{"lakestream.layout.packed.row-group-bytes": str(big)})
    stream.producer("p").commit(shards)
    (path,) = data_files(stream)
    parquet = pq.ParquetFile(path)
    groups = [sorted(set(parquet.read_row_group(g, columns=["_rank"]).column(0).to_pylist()))
              for g in range(parquet.num_row_groups)]
    assert [2] in groups and any(len(g) > 1 for g in groups)
    assert sorted(sum(groups, [])) == list(range(6))


def test_plain_iceberg_readers_see_step_and_rank_and_a_rank_filter_is_exact(catalog: SqlCatalog) -> None:
    stream = make(catalog)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(uneven("p", seq, 6))
    table = catalog.load_table("ns.packed")  # a plain pyiceberg user
    full = table.scan().to_arrow()
    assert full.num_rows == sum(s.num_rows for seq in range(3) for s in uneven("p", seq, 6))
    assert all(r["_step"] == r["seq"] + 1 and r["_rank"] == r["rank"] for r in full.select(["seq", "rank", "_step", "_rank"]).to_pylist())
    # _rank is a column now, not a partition: a filter on it must not prune files by partition, and must be exact
    ranks = table.scan(row_filter=EqualTo("_rank", 5)).to_arrow()
    assert ranks.num_rows == sum(uneven("p", seq, 6)[5].num_rows for seq in range(3)) > 0
    assert set(ranks.column("_rank").to_pylist()) == {5}


def test_duckdb_reads_the_files_pyiceberg_plans_as_the_same_rows(catalog: SqlCatalog) -> None:
    """Another engine on the same files: DuckDB's own Parquet reader, over the data files a pyiceberg scan plans (the
    packed files with their ``_rank`` column and several ranks per row group), returns exactly pyiceberg's rows."""
    duckdb = pytest.importorskip("duckdb")
    stream = make(catalog, "ns.duck")
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(uneven("p", seq, 6))
    table = catalog.load_table("ns.duck")
    paths = sorted(str(local(task.file.file_path)) for task in table.scan().plan_files())
    assert len(paths) == 3  # one file per step
    columns = [*SCHEMA.names, "_rank"]
    theirs = duckdb.sql(f"SELECT {', '.join(columns)} FROM read_parquet({paths!r})").fetchall()
    ours = table.scan().to_arrow().select(columns)

    expected = sorted((tuple(r.values()) for r in ours.to_pylist()), key=repr)
    assert len(theirs) == len(expected) > 0
    assert sorted(theirs, key=repr) == expected


@pytest.mark.parametrize("consumers", [1, 4, 6, 12])
def test_the_dataset_gives_every_consumer_world_size_the_same_rows_as_the_per_rank_layout(
        catalog: SqlCatalog, consumers: int) -> None:
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg.read.dataset import LakestreamDataset

    packed = make(catalog)
    per_rank = Stream.create(catalog, "ns.per_rank", schema=SCHEMA, world_size=6, properties={"lakestream.layout": "per-rank"})
    for stream in (packed, per_rank):
        producer = stream.producer("p")
        for seq in range(3):
            producer.commit(uneven("p", seq, 6))

    def arrow(shard: Any) -> tuple[int, list[int], list[tuple[int, int]]]:
        t = shard.table
        return shard.step, shard.sample_ids.tolist(), list(zip(t.column("rank").to_pylist(), t.column("i").to_pylist()))

    for rank in range(consumers):
        got = [list(LakestreamDataset(s, rank=rank, world_size=consumers, collate=arrow, end_step=3)) for s in (packed, per_rank)]
        assert got[0] == got[1] and len(got[0]) == 3, rank


# -- damaged files are errors, never wrong rows -----------------------------------------------------------------------


def rewrite(path: Path, *, rank_rows: bytes | None = None, ranks: list[int] | None = None, drop_table: bool = False,
            drop_rank_column: bool = False) -> None:
    """Rewrite a packed file in place with another (or no) rank table, other ``_rank`` values or no ``_rank`` column
    (same row groups)."""
    parquet = pq.ParquetFile(path)
    table = parquet.read()
    metadata = dict(parquet.metadata.metadata or {})
    metadata.pop(b"ARROW:schema", None)
    if ranks is not None:
        table = table.set_column(table.schema.get_field_index("_rank"), table.schema.field("_rank"), pa.array(ranks, pa.int32()))
    if drop_rank_column:
        table = table.drop_columns(["_rank"])
    if rank_rows is not None:
        metadata[b"lakestream.rank-rows"] = rank_rows
    if drop_table:
        del metadata[b"lakestream.rank-rows"]
    schema = table.schema.with_metadata(metadata)
    sizes = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
    with pq.ParquetWriter(path, schema.with_metadata(metadata)) as writer:
        offset = 0
        for n in sizes:
            writer.write_table(table.slice(offset, n), row_group_size=n)
            offset += n


def sized_to_its_file(stream: Stream) -> None:
    """Make the manifest entries say the size each data file has now, as if the rewritten file had been published: a
    file of another size than its entry says is refused before its footer is read (tests/read/test_read_checks.py),
    and these cases are about what the footer and rows say. The process-wide manifest cache is where every handle
    reads entries from; the manifest files themselves stay as lakestream wrote them."""
    head = stream.refresh().table.metadata.snapshot_by_name("main")
    for manifest in stream.cache.manifests(stream.io, head):
        entries = [copy.deepcopy(e) for e in stream.cache.entries(stream.io, manifest)]
        for entry in entries:
            entry.data_file[5] = local(entry.data_file.file_path).stat().st_size  # DataFile's file_size_in_bytes slot
        stream.cache.remember_entries(manifest.manifest_path, entries)


BIG = 999_999_999_999_999_999

DEFECTS = {  # a damaged rank table (or rows) of a packed file holding 6 ranks x 3 rows, and what the error says
    "too-few-ranks": (dict(rank_rows=b"3,3,3,3,6"), "for 5 ranks"),
    "counts-do-not-add-up": (dict(rank_rows=b"3,3,3,3,3,4"), "declares 19 rows"),
    "not-a-number": (dict(rank_rows=b"3,3,3,x,3,3"), "malformed"),
    "empty": (dict(rank_rows=b""), "malformed"),
    "empty-field": (dict(rank_rows=b"3,3,,3,3,3,3"), "malformed"),
    "leading-comma": (dict(rank_rows=b",3,3,3,3,3,3"), "malformed"),
    "trailing-comma": (dict(rank_rows=b"3,3,3,3,3,3,"), "malformed"),
    "negative": (dict(rank_rows=b"3,3,-3,9,3,3"), "malformed"),
    "spaces": (dict(rank_rows=b"3, 3,3,3,3,3"), "malformed"),
    "overflows-int64": (dict(rank_rows=b"3,3,3,%d,3,3" % (BIG * 10**6)), "for one rank"),
    "missing": (dict(drop_table=True), "has no lakestream.rank-rows"),
    # a count larger than the file (with enough ranks such counts could wrap an int64 sum around to the right total)
    "huge-count": (dict(rank_rows=b"3,3,3,%d,3,3" % BIG), "for one rank"),
    "no-rank-column": (dict(drop_rank_column=True), "has no _rank column"),
    # the rank table is right, but rank 1's rows hold rank 2's
    "rows-swapped": (dict(ranks=[0] * 3 + [2] * 3 + [1] * 3 + [3] * 3 + [4] * 3 + [5] * 3), "do not hold the ranks"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_a_damaged_packed_file_raises_corrupt_state_never_returns_other_rows(catalog: SqlCatalog, defect: str) -> None:
    stream = make(catalog)
    stream.producer("p").commit([shard("p", 0, r, rows=3) for r in range(6)])
    (path,) = data_files(stream)
    change, says = DEFECTS[defect]
    rewrite(path, **change)
    sized_to_its_file(stream)
    reopened = Stream.open(catalog, "ns.packed")
    with pytest.raises(CorruptStateError, match="roll the stream back") as caught:
        for rank in range(6):
            reopened.read(1, rank=rank)
    assert says in str(caught.value)
    with pytest.raises(CorruptStateError):  # history's samples view reads packed files through the same checks
        reopened.history(samples_steps=(1, 1)).sql("SELECT count(*) FROM samples").fetchall()


def test_row_ranges_outside_a_rank_are_refused(catalog: SqlCatalog) -> None:
    stream = make(catalog)
    stream.producer("p").commit([shard("p", 0, r, rows=3) for r in range(6)])
    with stream.step_files(1) as files:
        assert files.read(2, 1, 3).num_rows == 2
        for bad in [(6, 0, 1), (-1, 0, 1), (2, 0, 4), (2, 2, 1), (True, 0, 1)]:
            with pytest.raises(RankError):
                files.read_ranges([bad])
        for rank in (6, -1, True):
            with pytest.raises(RankError):
                files.read(rank)


# -- staged intents (group commit) ------------------------------------------------------------------------------------


def staged_copy(stream: Stream, step: int, *, producer: str, seq: int, token: str) -> list[dict[str, Any]]:
    """Copy a published step's packed file to where ``producer``'s writer would put batch ``seq``; its intent entry."""
    (data_file,) = stream.locate(step)
    dest = f"{stream.table.metadata.location.rstrip('/')}/data/{producer}/{seq:012d}-{token}-packed.parquet"
    local(dest).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(local(data_file.file_path), local(dest))
    return [{**file_json(data_file, rank=0, path=dest), "rank": None}]


def two_active(stream: Stream) -> Any:
    a, b = stream.producer("a"), stream.producer("b")
    for seq in range(2):
        a.commit(batch("a", seq, 6))
        b.commit(batch("b", seq, 6))
    return a


def test_a_staged_packed_batch_is_published_by_another_producers_commit(catalog: SqlCatalog) -> None:
    stream = make(catalog)
    a = two_active(stream)
    forge_intent(stream, producer="c", seq=0, files=staged_copy(stream, 1, producer="c", seq=0, token="packedgood1"),
                 token="packedgood1")
    a.commit(batch("a", 2, 6))
    (published,) = published_by(stream, "c")
    step = int(published["lakestream.step"])
    assert [digest(stream.read(step, rank=r)) for r in range(6)] == [digest(s) for s in batch("a", 0, 6)]


@pytest.mark.parametrize("defect", ["per-rank-entry", *sorted(set(DEFECTS) - {"rows-swapped"})])
def test_a_staged_packed_batch_that_does_not_fit_the_layout_is_never_published(catalog: SqlCatalog, defect: str) -> None:
    stream = make(catalog)
    a = two_active(stream)
    files = staged_copy(stream, 1, producer="c", seq=0, token="packedbad01")
    if defect == "per-rank-entry":
        files = [{**files[0], "rank": 0}]
    else:
        rows = pq.ParquetFile(local(files[0]["path"])).metadata.num_rows
        change = dict(DEFECTS[defect][0])
        if defect == "huge-count":
            change["rank_rows"] = b"%d,0,0,%d,0,0" % (rows, BIG)
        rewrite(local(files[0]["path"]), **change)
        files[0]["size"] = local(files[0]["path"]).stat().st_size
    forge_intent(stream, producer="c", seq=0, files=files, token="packedbad01")
    a.commit(batch("a", 2, 6))
    assert published_by(stream, "c") == []


# -- history and lifecycle --------------------------------------------------------------------------------------------


def test_history_shows_one_file_per_step_with_every_rank_and_the_samples(catalog: SqlCatalog) -> None:
    stream = make(catalog)
    producer = stream.producer("p")
    for seq in range(2):
        producer.commit(uneven("p", seq, 6))
    history = stream.history(samples_steps=(1, 2))
    assert history.sql("SELECT step, rank, producer, seq FROM files ORDER BY step").fetchall() == [(1, None, "p", 0), (2, None, "p", 1)]
    rows = history.sql("SELECT step, ranks, samples, samples_per_rank FROM batches ORDER BY step").fetchall()
    assert rows == [(s + 1, 6, sum(t.num_rows for t in uneven("p", s, 6)), None) for s in range(2)]
    got = history.sql("SELECT _step, _rank, count(*) FROM samples GROUP BY ALL ORDER BY ALL").fetchall()
    want = [(s + 1, r, t.num_rows) for s in range(2) for r, t in enumerate(uneven("p", s, 6)) if t.num_rows]
    assert got == want


def test_gc_collects_packed_steps_below_the_oldest_checkpoint(catalog: SqlCatalog) -> None:
    stream = make(catalog)
    producer = stream.producer("p")
    for seq in range(6):
        producer.commit(batch("p", seq, 6))
    stream.checkpoint("c4", step=4)
    stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert len(data_files(stream)) == 3  # steps 4, 5, 6
    with pytest.raises(StepCollectedError):
        stream.read(2, rank=1)
    assert digest(stream.read(5, rank=1)) == digest(batch("p", 4, 6)[1])
    assert np.array_equal(sorted(stream.table.scan().to_arrow().column("_step").unique().to_pylist()), [4, 5, 6])


def test_packed_rank_rows_entry_is_written_once_per_rank(catalog: SqlCatalog) -> None:
    stream = make(catalog, world_size=64)
    stream.producer("p").commit([shard("p", 0, r, rows=r % 3) for r in range(64)])
    (path,) = data_files(stream)
    raw = pq.ParquetFile(path).metadata.metadata[b"lakestream.rank-rows"]
    assert json.loads(f"[{raw.decode()}]") == [r % 3 for r in range(64)]


def test_a_batch_checked_as_a_whole_and_one_checked_rank_by_rank_are_written_alike(catalog: SqlCatalog) -> None:
    """The packed writer starts from the concatenation the batch check made (shards that concatenate: one schema, other
    metadata allowed), or concatenates the ranks itself (a RecordBatch; a field declared non-nullable, which Arrow
    does not concatenate with the nullable one): the same rows and ranks either way."""
    from lakestream_iceberg.format.batches import check_batch

    stream = make(catalog, world_size=4)
    expected = stream.payload_arrow_schema
    plain = batch("p", 0, 4)
    checked, whole = check_batch(plain, world_size=4, expected=expected)
    assert whole is not None and whole.num_rows == sum(s.num_rows for s in plain)
    tagged = batch("p", 1, 4)
    tagged[3] = tagged[3].replace_schema_metadata({"origin": "elsewhere"})
    assert check_batch(tagged, world_size=4, expected=expected)[1] is not None  # metadata: still one concatenation
    record = batch("p", 2, 4)
    record[1] = record[1].to_batches()[0]
    strict = batch("p", 3, 4)
    strict[2] = strict[2].cast(pa.schema([f.with_nullable(False) for f in strict[2].schema]))
    for shards in (record, strict):
        assert check_batch(shards, world_size=4, expected=expected)[1] is None  # the per-rank path
    producer = stream.producer("p")
    for step, shards in enumerate((plain, tagged, record, strict), start=1):
        assert producer.commit(shards).step == step
        assert list(stream.step_files(step).counts) == [len(s) for s in batch("p", step - 1, 4)]  # the rank table
        for rank in range(4):
            assert digest(stream.read(step, rank=rank)) == digest(batch("p", step - 1, 4)[rank])


def test_large_ranks_are_written_from_their_own_buffers_and_tiny_ones_as_one_chunk(catalog: SqlCatalog) -> None:
    """Copying a step's ranks into one chunk per column pays only for many tiny ranks (per-chunk costs); large ranks
    are written from the shards' own buffers, and every rank still reads back exactly its rows."""
    from lakestream_iceberg.write.writer import COMBINE_BELOW_CHUNK_BYTES

    stream = make(catalog, world_size=4, **{"lakestream.layout.packed.row-group-bytes": str(1 << 20)})
    writer = stream.producer("p")._writer
    value = COMBINE_BELOW_CHUNK_BYTES // 4
    large = [shard("p", 0, r, rows=6).set_column(5, "image", pa.array([bytes([r]) * value] * 6, pa.binary()))
             for r in range(4)]
    counts = np.array([6] * 4)
    (group,) = writer._row_groups(large, counts, pa.concat_tables(large))
    images = group.column("image")
    assert images.num_chunks == 4  # one chunk per rank: not copied
    for r in range(4):
        assert images.chunk(r).buffers()[2].address == large[r].column("image").chunk(0).buffers()[2].address
    assert group.column("_rank").to_pylist() == [r for r in range(4) for _ in range(6)]
    tiny = [shard("p", 1, r, rows=1) for r in range(4)]
    (group,) = writer._row_groups(tiny, np.array([1] * 4), pa.concat_tables(tiny))
    assert {column.num_chunks for column in group.columns} == {1}
    # more ranks than the size sample: large ones are still written from their own buffers
    from lakestream_iceberg.write.writer import SIZE_SAMPLE_RANKS

    wide = [large[r % 4] for r in range(SIZE_SAMPLE_RANKS * 2 + 3)]
    groups = writer._row_groups(wide, np.array([6] * len(wide)), pa.concat_tables(wide))
    assert len(groups) > 1 and sum(group.column("image").num_chunks for group in groups) == len(wide)
    assert pa.concat_tables(groups).column("_rank").to_pylist() == [r for r in range(len(wide)) for _ in range(6)]

    # small slices of large tables: a slice's buffer size counts the table's whole buffers, so the exact sizes of the
    # sample decide (small: one chunk), with few ranks and with more than the sample
    def big(seed: int) -> pa.Table:
        base = pa.concat_tables([shard("p", 2, 0, rows=1)] * 200).combine_chunks()
        return base.set_column(5, "image", pa.array([bytes([seed % 256]) * 1024] * 200, pa.binary()))

    base = big(0)
    for slices in ([base.slice(r, 1) for r in range(SIZE_SAMPLE_RANKS * 4 + 1)],
                   [big(r).slice(10 * r, 10) for r in range(4)],
                   [big(r).slice(r, 1) for r in range(SIZE_SAMPLE_RANKS * 4 + 1)]):
        counts = np.array([len(s) for s in slices])
        (group,) = writer._row_groups(slices, counts, None)
        assert {column.num_chunks for column in group.columns} == {1}
        assert group.column("image").to_pylist() == pa.concat_tables(slices).column("image").to_pylist()
        assert group.column("_rank").to_pylist() == np.repeat(np.arange(len(slices)), counts).tolist()
    producer = stream.producer("p")
    for step, shards in enumerate((large, tiny), start=1):
        assert producer.commit(shards).step == step
        for rank in range(4):
            assert stream.read(step, rank=rank).equals(shards[rank])
