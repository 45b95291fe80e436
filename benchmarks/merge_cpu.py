"""CPU of a manifest merge whose manifests another producer wrote: the records kept as read against encoded again.

    .venv/bin/python benchmarks/merge_cpu.py            # ~20 seconds on 2 cores
    .venv/bin/python benchmarks/merge_cpu.py --smoke    # seconds: tests/test_benchmarks_smoke.py

With group commit, whichever producer's commit reaches a merge (``lakestream.manifest.merge-fanout`` manifests of one
level) copies the entries of manifests other producers wrote into one larger manifest, inside its commit. It reads
them back (new ``DataFile`` objects: nothing of them is cached in its process) and writes them as ``EXISTING``.
Variants, alternating round by round, on the same source manifest:

* ``kept as read`` (lakestream): each entry's ``data_file`` record is kept as read and copied into the merged manifest
  (``format/data_file_records.py``);
* ``encoded again``: the same reader and writer with nothing kept: every data file's record, statistics and all, is
  encoded again (what every merge of other producers' manifests did before).

Layouts: ``packed`` (one data file per step) and ``per-rank`` (``--world-size`` files per step), ``--steps`` steps of
one source manifest (a level-0 merge of 16 group commits of 10 batches is 160 steps). Per cell, the median over
``--rounds`` of the merge's CPU (``time.process_time``): reading the source manifest, writing the merged one, and
both. Each round checks that pyiceberg reads the same entries (statistics included) from both variants' manifests.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow as pa  # noqa: E402
from _common import RESULTS_DIR, Run, Table, alternating, bench_parser, fill_defaults, machine  # noqa: E402

VARIANTS = ("kept as read", "encoded again")
LAYOUTS = ("packed", "per-rank")
SCHEMA = pa.schema([("tokens", pa.list_(pa.int32())), ("blob", pa.binary()), ("label", pa.int64())])


def shard(step: int, rank: int, rows: int) -> pa.Table:
    return pa.table({"tokens": [[step, rank, i] for i in range(rows)], "blob": [b"x" * 64] * rows,
                     "label": list(range(rows))}, schema=SCHEMA)


def source_manifest(root: Path, layout: str, *, steps: int, world_size: int) -> tuple[Any, Any, Any, Any]:
    """A stream of ``layout``, and one manifest listing ``steps`` steps' data files as ADDED (as a group commit's)."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.manifest import ManifestEntry, ManifestEntryStatus

    from lakestream_iceberg import Stream

    catalog = SqlCatalog("bench", uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}/wh")
    stream = Stream.create(catalog, f"bench.{layout.replace('-', '_')}", schema=SCHEMA, world_size=world_size,
                           properties={"lakestream.layout": "packed" if layout == "packed" else "per-rank"})
    metadata = stream.table.metadata
    files = []
    for step in range(steps):
        written = stream.writer.write(producer="p", seq=step, shards=[shard(step, r, 4) for r in range(world_size)])
        files += written.data_files(step=step + 1, spec_id=metadata.default_spec_id)
    entries = [ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=7, sequence_number=3,
                                       file_sequence_number=3, data_file=f) for f in files]
    manifest = write(root / f"source-{layout}.avro", stream, entries)
    return stream, manifest, metadata, len(files)


def write(path: Path, stream: Any, entries: list[Any]) -> Any:
    from pyiceberg.io.pyarrow import PyArrowFileIO

    from lakestream_iceberg.format.avro_writers import manifest_writer

    metadata = stream.table.metadata
    with manifest_writer(format_version=2, spec=metadata.spec(), schema=metadata.schema(),
                         output_file=PyArrowFileIO().new_output(str(path)), snapshot_id=9,
                         avro_compression="gzip") as writer:
        for entry in entries:
            writer.add_entry(entry)
    manifest = writer.to_manifest_file()
    manifest.sequence_number = manifest.min_sequence_number = 3
    return manifest


def fields(entry: Any) -> tuple[Any, ...]:
    """An entry as pyiceberg reads it, statistics included."""
    f = entry.data_file
    return (entry.status, entry.snapshot_id, entry.sequence_number, entry.file_sequence_number, f.file_path,
            tuple(f.partition), f.record_count, f.file_size_in_bytes, dict(f.column_sizes or {}),
            dict(f.value_counts or {}), dict(f.null_value_counts or {}), dict(f.lower_bounds or {}),
            dict(f.upper_bounds or {}), f.split_offsets)


def merge_once(root: Path, stream: Any, source: Any, variant: str, n: int) -> tuple[dict[str, float], list[Any]]:
    """Read ``source`` as a process that did not write it, and write its entries as EXISTING into a new manifest."""
    from pyiceberg.io.pyarrow import PyArrowFileIO
    from pyiceberg.manifest import ManifestEntry, ManifestEntryStatus

    from lakestream_iceberg.format import avro_readers, data_file_records

    data_file_records._records.clear()  # noqa: SLF001 - nothing of the source's DataFile objects is known here
    kept = data_file_records.writer_for
    if variant == "encoded again":
        data_file_records.writer_for = lambda _schema: None  # type: ignore[assignment]
    try:
        cpu0 = time.process_time()
        entries = avro_readers.read_manifest_entries(PyArrowFileIO(), source)
        cpu1 = time.process_time()
        path = root / f"merged-{n}.avro"
        merged = write(path, stream, [ManifestEntry.from_args(status=ManifestEntryStatus.EXISTING, snapshot_id=e.snapshot_id,
                                                     sequence_number=e.sequence_number,
                                                     file_sequence_number=e.file_sequence_number,
                                                     data_file=e.data_file) for e in entries])
        cpu2 = time.process_time()
    finally:
        data_file_records.writer_for = kept  # type: ignore[assignment]
    read_back = [fields(e) for e in merged.fetch_manifest_entry(PyArrowFileIO(), discard_deleted=False)]  # pyiceberg's
    os.unlink(path)
    return {"read_ms": 1e3 * (cpu1 - cpu0), "write_ms": 1e3 * (cpu2 - cpu1), "merge_ms": 1e3 * (cpu2 - cpu0)}, read_back


def main() -> None:
    ap = bench_parser(__doc__, out=RESULTS_DIR / "merge_cpu.json")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    run = Run("merge_cpu", smoke=args.smoke)
    fill_defaults(args, steps=(160, 8), rounds=(15, 2))
    tmp = Path(tempfile.mkdtemp(prefix="lakestream-merge-cpu-"))
    results: dict[str, list[dict[str, float]]] = {}
    entries: dict[str, int] = {}
    try:
        sources = {}
        for layout in LAYOUTS:
            stream, manifest, _, count = source_manifest(tmp, layout, steps=args.steps, world_size=args.world_size)
            sources[layout] = (stream, manifest)
            entries[layout] = count
            merge_once(tmp, stream, manifest, VARIANTS[0], 0)  # warm-up: imports, reader and writer set-up
        n = 0
        for i in range(args.rounds):
            for layout in LAYOUTS:
                written = {}
                for variant in alternating(VARIANTS, i):
                    n += 1
                    figures, written[variant] = merge_once(tmp, *sources[layout], variant, n)
                    results.setdefault(f"{layout}|{variant}", []).append(figures)
                if written[VARIANTS[0]] != written[VARIANTS[1]]:
                    raise AssertionError(f"{layout}: pyiceberg reads other entries from the two variants' merges")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in results[key])

    table = Table(f"a merge of {args.steps} steps' entries another producer wrote, medians of {args.rounds} rounds",
                  ["layout", "entries", "variant", "read ms", "write ms", "merge ms", "us per entry"])
    ratios = Table("kept as read / encoded again (CPU)", ["layout", "read", "write", "merge"])
    for layout in LAYOUTS:
        for variant in VARIANTS:
            key = f"{layout}|{variant}"
            table.add(layout, entries[layout], variant, med(key, "read_ms"), med(key, "write_ms"),
                      med(key, "merge_ms"), 1e3 * med(key, "merge_ms") / entries[layout])
        ratios.add(layout, *(med(f"{layout}|{VARIANTS[0]}", f) / med(f"{layout}|{VARIANTS[1]}", f)
                             for f in ("read_ms", "write_ms", "merge_ms")))
    table.note("CPU of this process (time.process_time); pyiceberg reads the same entries, statistics included, from "
               "both variants' merged manifests")
    run.finish([table, ratios], {
        "machine": machine(),
        "config": {"steps": args.steps, "world_size": args.world_size, "rounds": args.rounds, "entries": entries},
        "runs": results,
    }, out=args.out, spaced=False, sep="\n")


if __name__ == "__main__":
    main()
