"""A process's memory does not depend on how many steps a stream holds (issue #44).

The cheap regression check counts objects, not bytes or time: the manifest metadata a producer and a follower hold
(pyiceberg ``DataFile`` and ``ManifestEntry`` objects, the encoded records ``format/data_file_records.py`` keeps per live
``DataFile``) after 1,000 steps against after 100. ``benchmarks/memory.py`` measures RSS over 100,000 steps.
"""

from __future__ import annotations

import gc

import pyarrow as pa
from pyiceberg.manifest import DataFile, ManifestEntry, ManifestEntryStatus

from lakestream_iceberg import Stream
from lakestream_iceberg.format import data_file_records
from lakestream_iceberg.format.manifest_cache import ManifestCache, entries_bytes, shared_cache

SCHEMA = pa.schema([("id", pa.int64())])
CACHE_BYTES = 150_000  # about fifty entries of this schema: below what 100 steps at W=2 list


def _held() -> dict[str, int]:
    gc.collect()
    counts = {"DataFile": 0, "ManifestEntry": 0}
    for obj in gc.get_objects():
        name = type(obj).__name__
        if name in counts and isinstance(obj, (DataFile, ManifestEntry)):
            counts[name] += 1
    counts["encoded"] = data_file_records.held()
    return counts


def _step(step: int) -> list[pa.Table]:
    return [pa.table({"id": pa.array([step * 10 + rank], pa.int64())}, schema=SCHEMA) for rank in range(2)]


def test_a_producer_and_a_follower_hold_as_much_after_1000_steps_as_after_100(catalog) -> None:
    stream = Stream.create(catalog, "ns.soak", schema=SCHEMA, world_size=2,
                           properties={"lakestream.manifest.cache-bytes": str(CACHE_BYTES),
                                       "lakestream.commit.group.enabled": "false"})
    follower = Stream.open(catalog, "ns.soak")
    assert stream.cache is follower.cache is shared_cache(CACHE_BYTES)
    producer = stream.producer("p")
    held = {}
    for step in range(1, 1001):
        producer.commit(_step(step))
        if step % 4 == 0:  # a trainer rank reading as the stream grows
            assert follower.read(step, rank=step % 2).column("id").to_pylist() == [step * 10 + step % 2]
        if step in (100, 1000):
            held[step] = _held()
    before, after = held[100], held[1000]
    # before the byte bound, each live step kept its two entries: 200 -> 2,000 DataFiles
    for kind in before:
        assert after[kind] <= before[kind] * 1.5 + 50, (kind, before, after)
    assert stream.cache.bytes_held <= CACHE_BYTES
    # every step is still there, found through manifests the cache no longer holds
    for step in (1, 777, 999):
        assert Stream.open(catalog, "ns.soak").read(step, rank=1).column("id").to_pylist() == [step * 10 + 1]


def test_merges_read_what_the_cache_does_not_hold(catalog) -> None:
    """With nothing cached (``lakestream.manifest.cache-bytes`` 0) every merge reads the manifests it merges back from
    storage, and every step stays readable with its files in rank order."""
    stream = Stream.create(catalog, "ns.uncached", schema=SCHEMA, world_size=2,
                           properties={"lakestream.manifest.cache-bytes": "0", "lakestream.manifest.merge-fanout": "4"})
    producer = stream.producer("p")
    for step in range(1, 101):
        producer.commit(_step(step))
    assert stream.cache.entry_count == 0 and stream.cache.bytes_held == 0
    manifests = stream.refresh().head().manifests(stream.io)
    assert any("-L3-" in m.manifest_path for m in manifests) and len(manifests) <= 3 * 3 + 1
    assert sum(m.added_files_count + m.existing_files_count for m in manifests) == 200
    for step in range(1, 101):
        assert [stream.read(step, rank=r).column("id").to_pylist() for r in (0, 1)] == [[step * 10], [step * 10 + 1]]


def test_the_manifest_cache_is_bounded_in_bytes() -> None:
    """Lists and entries together stay within ``max_bytes`` (an estimate: :func:`entries_bytes`), least recently used
    first; a manifest above a quarter of the bound is not kept; forgetting gives its bytes back."""

    def entries(n: int, tag: str) -> list[ManifestEntry]:
        return [ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=1, sequence_number=1,
                                        file_sequence_number=1,
                                        data_file=DataFile.from_args(file_path=f"{tag}-{i}", column_sizes={1: 10},
                                                                     lower_bounds={1: b"\0" * 8}))
                for i in range(n)]

    one = entries_bytes(entries(100, "x"))
    cache = ManifestCache(max_bytes=5 * one + one // 2)
    for i in range(10):
        cache.remember_entries(f"m{i}", entries(100, f"m{i}"))
        assert cache.bytes_held <= cache.max_bytes
    assert cache.entries_cached() == {f"m{i}" for i in range(5, 10)}
    cache.remember_entries("big", entries(200, "big"))  # over a quarter of the bound: not kept, the others stay
    assert "big" not in cache.entries_cached() and len(cache.entries_cached()) == 5
    cache.forget_entries([f"m{i}" for i in range(5, 10)])
    assert cache.bytes_held == 0 and cache.entry_count == 0
