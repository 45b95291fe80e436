"""The read path, in one run: LakestreamDataset vs raw pyarrow, read amplification, metadata bytes, visibility latency.

    .venv/bin/python benchmarks/read_path.py            # ~1-2 minutes on 2 cores; prints tables, writes
                                                        # benchmarks/results/read_path.json

What is measured (SQLite catalog and local warehouse in a temporary directory):

* **Throughput**: one consumer rank (``world_size == producers``) iterating every step, against raw
  ``pyarrow.parquet.read_table`` of the same Parquet files (paths taken from the manifests beforehand; also
  ``ParquetFile.read``, pyarrow's leaner path). The dataset runs with the default collate (token lists padded to
  tensors, blobs as lists of uint8 views), the packed collate (zero-copy token tensors + offsets), and an Arrow
  passthrough collate (the read path alone). Samples/s and MB/s (MB of Parquet on storage), best of alternating
  repeats (wall clock), page cache warm for all; CPU seconds too, since the machine may be shared. Target: >= 0.9x.
* **Read amplification**: bytes fetched through the table's FileIO for data files, divided by the bytes of the rank's
  shard files. Counted by wrapping the pyiceberg FileIO's InputFile/InputStream (``CountingFileIO`` below). Target <= 1.05.
* **Metadata bytes per step per rank**: ``metadata.json`` + manifest lists + manifests fetched through the same FileIO,
  divided by the steps delivered: once for a consumer catching up over a fixed head, once for a follow-mode consumer
  that sees every commit (the realistic tailing case).
* **Visibility latency**: a producer *process* commits steps at random 20-120 ms intervals and logs when each
  ``commit()`` returned; a follow-mode consumer (default settings: through the head relay, which polls every ``poll_s``)
  logs when it has the step's item. p50/p99 of the gap over every step, the first ones included (the consumer starts
  before the producer), and the first step after each of the producer's pauses (``--pauses`` stops of ``--pause-s``
  seconds: a follower that backed off while nothing came would see it late); each step's figure is in the JSON
  (``latencies_ms``, ``after_pause_ms``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, Table, alternating, percentile, timed, write_json  # noqa: E402
from pyiceberg.catalog.sql import SqlCatalog  # noqa: E402
from pyiceberg.io import FileIO, InputFile, InputStream, OutputFile  # noqa: E402

from lakestream_iceberg import Stream  # noqa: E402
from lakestream_iceberg.format.manifest_cache import ManifestCache  # noqa: E402
from lakestream_iceberg.read.dataset import LakestreamDataset, TensorCollate  # noqa: E402

SCHEMA = pa.schema([
    pa.field("tokens", pa.list_(pa.int32())),
    pa.field("image", pa.binary()),
    pa.field("label", pa.int64()),
])
PRODUCERS = 2


# ---------------------------------------------------------------------------------------------- counting FileIO
def kind_of(path: str) -> str:
    if "/data/" in path:
        return "data"
    if path.endswith(".metadata.json"):
        return "metadata.json"
    return "manifest-list" if "/snap-" in path else "manifest"


class CountingStream(InputStream):
    def __init__(self, inner: InputStream, counter: Counter, kind: str) -> None:
        self._inner, self._counter, self._kind = inner, counter, kind

    def read(self, size: int | None = None) -> bytes:
        data = self._inner.read() if size is None or size < 0 else self._inner.read(size)
        self._counter[self._kind] += len(data)
        return data

    def read_buffer(self, nbytes: int | None = None) -> pa.Buffer:  # pyarrow's own streams' (the reader uses it)
        data = self._inner.read_buffer(nbytes)
        self._counter[self._kind] += data.size
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> CountingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CountingInputFile(InputFile):
    def __init__(self, inner: InputFile, counter: Counter) -> None:
        super().__init__(inner.location)
        self._inner, self._counter = inner, counter

    def __len__(self) -> int:
        return len(self._inner)

    def exists(self) -> bool:
        return self._inner.exists()

    def open(self, seekable: bool = True) -> InputStream:
        kind = kind_of(self.location)
        self._counter[f"{kind}:files"] += 1
        return CountingStream(self._inner.open(seekable=seekable), self._counter, kind)


class CountingFileIO(FileIO):
    """Wraps a pyiceberg FileIO and counts the bytes read through it, by kind of file."""

    def __init__(self, inner: FileIO) -> None:
        super().__init__(inner.properties)
        self.inner = inner
        self.counter: Counter = Counter()

    def new_input(self, location: str) -> InputFile:
        return CountingInputFile(self.inner.new_input(location), self.counter)

    def new_output(self, location: str) -> OutputFile:
        return self.inner.new_output(location)

    def delete(self, location: str | InputFile | OutputFile) -> None:
        self.inner.delete(location)


def counted_stream(catalog: SqlCatalog, name: str) -> tuple[Stream, CountingFileIO]:
    """A consumer's own view of the stream: fresh manifest cache, FileIO wrapped before anything is read."""
    table = catalog.load_table(name)
    io = CountingFileIO(table.io)
    table.io = io
    return Stream(table, cache=ManifestCache()), io


# ---------------------------------------------------------------------------------------------- data
def make_shard(rng: np.random.Generator, rows: int, label0: int) -> pa.Table:
    lengths = rng.integers(128, 1153, rows)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 50_000, offsets[-1], dtype=np.int32)))
    blob_len = rng.integers(512, 1537, rows)
    blob_off = np.concatenate(([0], np.cumsum(blob_len))).astype(np.int32)
    images = pa.BinaryArray.from_buffers(pa.binary(), rows, [None, pa.py_buffer(blob_off.tobytes()),
                                                             pa.py_buffer(rng.bytes(int(blob_off[-1])))])
    return pa.Table.from_arrays([tokens, images, pa.array(np.arange(label0, label0 + rows))], schema=SCHEMA)


def publish(stream: Stream, steps: int, rows: int) -> None:
    rng = np.random.default_rng(7)
    producer = stream.producer("bench")
    for step in range(steps):
        producer.commit([make_shard(rng, rows, (step * PRODUCERS + r) * rows) for r in range(PRODUCERS)])


# ---------------------------------------------------------------------------------------------- measurements
def untimed_setup(prepare: Any) -> Any:
    """A variant whose ``prepare()`` (not timed) returns the function to time."""
    def run() -> tuple[float, float]:
        return timed(prepare())
    return run


def throughput(catalog: SqlCatalog, name: str, steps: int, repeats: int) -> dict[str, Any]:
    probe, _ = counted_stream(catalog, name)
    files = [probe.locate(s)[0] for s in range(1, steps + 1)]
    paths = [f.file_path.removeprefix("file://") for f in files]
    storage_bytes = sum(f.file_size_in_bytes for f in files)
    samples = sum(f.record_count for f in files)
    counters: dict[str, Counter] = {}

    def raw_read_table() -> tuple[float, float]:
        return timed(lambda: sum(pq.read_table(p).num_rows for p in paths))

    def raw_parquet_file() -> tuple[float, float]:
        return timed(lambda: sum(pq.ParquetFile(p).read().num_rows for p in paths))

    def dataset(label: str, collate: Any = None) -> Any:
        def prepare() -> Any:
            stream, io = counted_stream(catalog, name)  # opening the stream is not timed; everything after it is

            def run() -> None:
                ds = LakestreamDataset(stream, rank=0, world_size=PRODUCERS, end_step=steps, collate=collate)
                assert sum(len(item["label"]) for item in ds) == samples
                counters[label] = io.counter
            return run
        return untimed_setup(prepare)

    variants = {
        "raw pyarrow read_table": raw_read_table,
        "raw pyarrow ParquetFile.read": raw_parquet_file,
        "dataset, default collate (padded)": dataset("padded"),
        "dataset, packed collate": dataset("packed", TensorCollate(lists="packed")),
        "dataset, Arrow passthrough": dataset("arrow", arrow_passthrough),
    }
    for fn in variants.values():  # warm the page cache, imports and code paths
        fn()
    walls: dict[str, list[float]] = {k: [] for k in variants}
    cpus: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(repeats):
        for label in alternating(list(variants), i):
            wall, cpu = variants[label]()
            walls[label].append(wall)
            cpus[label].append(cpu)
    # best of the alternating repeats: the machine is shared, and noise only ever adds time
    results = {label: {"wall_s": min(walls[label]), "cpu_s": min(cpus[label]),
                       "samples_per_s": samples / min(walls[label]), "mb_per_s": storage_bytes / min(walls[label]) / 1e6}
               for label in variants}
    base = results["raw pyarrow read_table"]
    for r in results.values():
        r["ratio_wall"] = base["wall_s"] / r["wall_s"]
        r["ratio_cpu"] = base["cpu_s"] / r["cpu_s"]
    counter = counters["padded"]
    meta = sum(counter[k] for k in ("metadata.json", "manifest-list", "manifest"))
    return {
        "steps": steps, "samples": samples, "storage_bytes": storage_bytes, "variants": results,
        "data_bytes_fetched": counter["data"], "read_amplification": counter["data"] / storage_bytes,
        "metadata_bytes": {k: counter[k] for k in ("metadata.json", "manifest-list", "manifest")},
        "metadata_bytes_per_step": meta / steps,
    }


def arrow_passthrough(shard: Any) -> dict[str, Any]:
    return {"step": shard.step, "label": shard.table.column("label")}


PRODUCER_SCRIPT = textwrap.dedent("""
    import json, random, sys, time
    sys.path.insert(0, {bench!r})
    import numpy as np
    from pyiceberg.catalog.sql import SqlCatalog
    from lakestream_iceberg import Stream
    from read_path import make_shard, PRODUCERS
    catalog = SqlCatalog("bench", uri={uri!r}, warehouse={wh!r})
    stream = Stream.open(catalog, {name!r})
    producer = stream.producer("live")
    rng, jitter = np.random.default_rng(11), random.Random(11)
    shards = [[make_shard(rng, {rows}, 0) for _ in range(PRODUCERS)] for _ in range(4)]
    with open({log!r}, "w") as log:
        for i in range({steps}):
            time.sleep({pause_s} if i in {pauses!r} else jitter.uniform(0.02, 0.12))
            result = producer.commit(shards[i % 4])
            log.write(json.dumps({{"step": result.step, "t": time.time()}}) + "\\n")
            log.flush()
""")


def visibility(catalog: SqlCatalog, tmp: Path, steps: int, rows: int, *, pauses: int = 2,
               pause_s: float = 2.0) -> dict[str, Any]:
    """The follow run: a producer process commits ``steps`` steps at 20-120 ms intervals, and stops for ``pause_s``
    seconds ``pauses`` times (evenly spread): the first step after a pause is where a follower that backs off when
    nothing arrives would be late. Every step's visibility latency counts, the first ones included."""
    name = "bench.live"
    stream = Stream.create(catalog, name, schema=SCHEMA, world_size=PRODUCERS)
    publish(stream, 1, rows)  # step 1 exists before the consumer starts
    consumer, io = counted_stream(catalog, name)
    log = tmp / "commits.jsonl"
    paused_at = sorted({steps * (k + 1) // (pauses + 1) for k in range(pauses)}) if pauses else []
    script = PRODUCER_SCRIPT.format(bench=str(Path(__file__).resolve().parent), uri=catalog.properties["uri"],
                                    wh=catalog.properties["warehouse"], name=name, rows=rows, steps=steps, log=str(log),
                                    pauses=paused_at, pause_s=pause_s)
    ds = LakestreamDataset(consumer, rank=0, world_size=PRODUCERS, start_step=2, end_step=steps + 1, follow=True,
                           timeout=60)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT)
    seen: dict[int, float] = {}
    try:
        for item in ds:
            seen[item["step"]] = time.time()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    committed = {r["step"]: r["t"] for r in records}
    lat = [max(0.0, seen[s] - committed[s]) for s in sorted(committed)]
    after_pause = [max(0.0, seen[records[i]["step"]] - records[i]["t"]) for i in paused_at]
    counter = io.counter
    meta = {k: counter[k] for k in ("metadata.json", "manifest-list", "manifest")}
    return {
        "steps": steps, "latencies_ms": [round(x * 1000, 2) for x in lat], "p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
        "max_ms": max(lat) * 1000, "pause_s": pause_s, "paused_before_commit": paused_at,
        "after_pause_ms": [round(x * 1000, 2) for x in after_pause], "metadata_bytes": meta, "metadata_bytes_per_step": sum(meta.values()) / steps,
        "metadata_reads_per_step": {k: counter[f"{k}:files"] / steps for k in meta},
        "read_amplification": counter["data"] / sum(f.file_size_in_bytes for s in committed for f in [consumer.locate(s)[0]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="steps for the throughput part")
    parser.add_argument("--rows", type=int, default=256, help="samples per rank per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--live-steps", type=int, default=80, help="steps committed by the live producer")
    parser.add_argument("--pauses", type=int, default=2, help="times the live producer stops committing for a while")
    parser.add_argument("--pause-s", type=float, default=2.0, help="seconds of each of those pauses")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="lakestream-read-path-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "wh").mkdir()
        catalog = SqlCatalog("bench", uri=f"sqlite:///{tmp}/catalog.db", warehouse=f"file://{tmp}/wh")
        started = time.perf_counter()
        stream = Stream.create(catalog, "bench.batches", schema=SCHEMA, world_size=PRODUCERS)
        publish(stream, args.steps, args.rows)
        setup_s = time.perf_counter() - started
        tp = throughput(catalog, "bench.batches", args.steps, args.repeats)
        vis = visibility(catalog, tmp, args.live_steps, 32, pauses=args.pauses, pause_s=args.pause_s)

    table = Table("read path: one consumer rank, world size 2 (SQLite catalog, local warehouse)",
                  ["measure", "value", "vs raw read_table (wall / CPU)", "target"])
    for label, r in tp["variants"].items():
        table.add(f"{label}: samples/s", r["samples_per_s"], f"{r['ratio_wall']:.2f}x / {r['ratio_cpu']:.2f}x",
                  ">= 0.9x" if label.startswith("dataset") else "")
    for label, r in tp["variants"].items():
        table.add(f"{label}: MB/s", r["mb_per_s"], "", "")
    table.add("read amplification (catch-up)", tp["read_amplification"], "", "<= 1.05")
    table.add("read amplification (follow)", vis["read_amplification"], "", "<= 1.05")
    table.add("metadata B/step/rank (catch-up)", tp["metadata_bytes_per_step"], "", "")
    table.add("metadata B/step/rank (follow)", vis["metadata_bytes_per_step"], "", "")
    table.add("visibility latency p50 ms", vis["p50_ms"], "", "")
    table.add("visibility latency p99 ms", vis["p99_ms"], "", "<= 50")
    table.add("visibility latency max ms", vis["max_ms"], "", "")
    table.add("first step after a pause, ms", "/".join(f"{x:.1f}" for x in vis["after_pause_ms"]) or "-", "", "<= 50")
    table.note(f"{tp['steps']} steps x {args.rows} samples/rank, {tp['storage_bytes'] / 1e6:.1f} MB of rank-0 Parquet; "
               f"best of {args.repeats} alternating runs (wall clock; CPU = process time, all threads); "
               f"setup {setup_s:.1f}s")
    table.note(f"follow: {vis['steps']} commits at 20-120 ms intervals by a producer process, stopping for "
               f"{vis['pause_s']:g} s before commits {vis['paused_before_commit']}; every commit's latency counts (no "
               "warm-up excluded)")
    table.note(f"metadata bytes by kind "
               f"{vis['metadata_bytes']}, reads/step {vis['metadata_reads_per_step']}")
    print(table)
    path = write_json("read_path", {"table": table, "throughput": tp, "visibility": vis, "args": vars(args)})
    print(f"wrote {path.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
