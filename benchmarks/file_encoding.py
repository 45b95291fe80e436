"""Data files as lakestream writes them against pyarrow's default encoding (a dictionary for every column): what each
costs the producer that writes a step and the trainer that reads it.

    .venv/bin/python benchmarks/file_encoding.py            # ~30 seconds on 2 cores
    .venv/bin/python benchmarks/file_encoding.py --smoke    # seconds: tests/test_benchmarks_smoke.py

pyarrow tries a dictionary for every column and falls back to plain only once the dictionary outgrows its page; it
never checks whether the dictionary saves anything. lakestream writes the numbers of list columns (token ids) and
binary or string columns averaging 1 KiB or more per value (blobs) without one (docs/configuration.md); every other
column keeps pyarrow's dictionary. Variants, per workload and codec (uncompressed, zstd), alternating round by round:

* ``lakestream``: the writer as it is;
* ``all dictionary``: the same writer with every column dictionary-encoded (pyarrow's default).

Workloads, ``--steps`` (40) steps of ``--batch`` (256) samples, world size 1, SQLite catalog and a local warehouse:

* ``tokens+blob``: ``vs_streaming.py``'s samples (int64 id, 256-768 int32 token ids below 50,000, a 2-8 KiB blob);
* ``tokens``: the same without the blob (a text model's step).

Per cell: the producer's CPU per step (``Producer.commit``, metadata included: what a producer pays), MB on disk,
and the trainer's CPU per sample and samples/s reading every step through ``LakestreamDataset`` (no workers, default
collate, after a first pass that warms the page cache), as medians over ``--rounds`` (after a warm-up write and
read that is not counted).
"""

from __future__ import annotations

import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow as pa  # noqa: E402
from _common import RESULTS_DIR, Run, Table, alternating, bench_parser, cpu_s, fill_defaults, machine  # noqa: E402
from vs_streaming import SCHEMA, arrow_table, make_batches  # noqa: E402

VARIANTS = ("lakestream", "all dictionary")
CODECS = ("uncompressed", "zstd")
WORKLOADS = ("tokens+blob", "tokens")


def steps_of(workload: str, batches: list[dict[str, Any]]) -> tuple[pa.Schema, list[pa.Table]]:
    tables = [arrow_table(b) for b in batches]
    if workload == "tokens":
        tables = [t.drop_columns(["blob"]) for t in tables]
    return (SCHEMA if workload == "tokens+blob" else pa.schema([SCHEMA.field("id"), SCHEMA.field("tokens")])), tables


def measure(catalog: Any, name: str, schema: pa.Schema, tables: list[pa.Table], codec: str, variant: str,
            root: Path) -> dict[str, float]:
    from lakestream_iceberg import Stream
    from lakestream_iceberg.read.dataset import LakestreamDataset
    from lakestream_iceberg.write.writer import BatchWriter

    stream = Stream.create(catalog, name, schema=schema, world_size=1,
                           properties={"write.parquet.compression-codec": codec})
    producer = stream.producer("bench")
    original = BatchWriter._dictionary
    if variant == "all dictionary":
        BatchWriter._dictionary = lambda self, groups: True  # type: ignore[method-assign]
    try:
        cpu0 = cpu_s()
        for table in tables:
            producer.commit([table])
        write_cpu = cpu_s() - cpu0
    finally:
        BatchWriter._dictionary = original  # type: ignore[method-assign]
    disk = sum(f.stat().st_size for f in (root / "wh").rglob("*.parquet") if f"/{name.split('.')[1]}/" in str(f))
    dataset = LakestreamDataset(stream, rank=0, world_size=1)
    for _ in dataset:  # the page cache is warm for both variants
        pass
    cpu0, wall0, samples = cpu_s(), time.perf_counter(), 0
    for item in dataset:
        samples += len(item["id"])
    wall, read_cpu = time.perf_counter() - wall0, cpu_s() - cpu0
    dataset.close()
    producer.close()
    expected = sum(t.num_rows for t in tables)
    assert samples == expected, (samples, expected)
    return {"write_cpu_ms_per_step": 1e3 * write_cpu / len(tables), "mb_on_disk": disk / 1e6,
            "read_cpu_us_per_sample": 1e6 * read_cpu / samples, "read_samples_per_s": samples / wall}


def main() -> None:
    ap = bench_parser(__doc__, out=RESULTS_DIR / "file_encoding.json")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    run = Run("file_encoding", smoke=args.smoke)
    fill_defaults(args, steps=(40, 4), rounds=(5, 1))
    args.batch = 32 if args.smoke else args.batch

    from pyiceberg.catalog.sql import SqlCatalog

    logging.getLogger("lakestream_iceberg").setLevel(logging.ERROR)
    batches = make_batches(args.steps, args.batch)
    tmp = Path(tempfile.mkdtemp(prefix="lakestream-file-encoding-"))
    results: dict[str, list[dict[str, float]]] = {}
    try:
        catalog = SqlCatalog("bench", uri=f"sqlite:///{tmp}/catalog.db", warehouse=f"file://{tmp}/wh")
        catalog.create_namespace("bench")
        schema, tables = steps_of(WORKLOADS[0], batches)
        measure(catalog, "bench.warmup", schema, tables[:2], CODECS[0], VARIANTS[0], tmp)  # imports, first commit
        n = 0
        for i in range(args.rounds):
            for workload in WORKLOADS:
                schema, tables = steps_of(workload, batches)
                for codec in CODECS:
                    for variant in alternating(VARIANTS, i):
                        n += 1
                        key = f"{workload}|{codec}|{variant}"
                        results.setdefault(key, []).append(
                            measure(catalog, f"bench.s{n}", schema, tables, codec, variant, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in results[key])

    fields = ("write_cpu_ms_per_step", "mb_on_disk", "read_cpu_us_per_sample", "read_samples_per_s")
    table = Table(f"{args.steps} steps x {args.batch} samples, world size 1, medians of {args.rounds} rounds",
                  ["workload", "codec", "variant", "producer CPU ms/step", "MB on disk", "reader CPU us/sample",
                   "reader samples/s"])
    ratios = Table("lakestream / all dictionary", ["workload", "codec", "producer CPU", "MB on disk", "reader CPU",
                                                   "reader samples/s"])
    for workload in WORKLOADS:
        for codec in CODECS:
            for variant in VARIANTS:
                table.add(workload, codec, variant, *(med(f"{workload}|{codec}|{variant}", f) for f in fields))
            ratios.add(workload, codec, *(med(f"{workload}|{codec}|lakestream", f)
                                          / med(f"{workload}|{codec}|all dictionary", f) for f in fields))
    table.note("producer CPU = Producer.commit (file writing and the commit's metadata); reader = LakestreamDataset, "
               "no workers, default collate, page cache warm")
    run.finish([table, ratios], {
        "machine": machine(),
        "config": {"steps": args.steps, "batch": args.batch, "rounds": args.rounds},
        "runs": results,
    }, out=args.out, spaced=False, sep="\n")


if __name__ == "__main__":
    main()
