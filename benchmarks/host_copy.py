"""How this host copies memory, and what that costs lakestream's commits: glibc's `rep movsb` at short distances.

    .venv/bin/python benchmarks/host_copy.py                      # ~1 minute on 2 cores
    .venv/bin/python benchmarks/host_copy.py --smoke --out /tmp/host_copy.json   # seconds: tests/test_benchmarks_smoke.py

glibc 2.36 (Debian 12) copies blocks of a few KiB up to about the L2 size with `rep movsb` on AMD EPYC, and there that
instruction is about 10x slower when the destination lies a few bytes past the source modulo 4 KiB (glibc bug 30994).
pyarrow's Parquet writer makes exactly such copies: a BYTE_ARRAY value goes 4 bytes after its length, and a data page
of an optional column goes a few bytes after its definition levels. The glibc tunable
``glibc.cpu.x86_rep_movsb_threshold`` (read when a process starts) moves those copies to vector loops.

The script measures the same things in two child processes, alternating, round by round: one with ``GLIBC_TUNABLES``
removed from its environment (``default``) and one with ``glibc.cpu.x86_rep_movsb_threshold=--threshold`` (``tuned``):

* a 64 KiB ``memmove`` at distances 0, 4, 8, 16, 64 and 2,048 bytes past a multiple of 4 KiB (GB/s);
* pyarrow writing 1 MiB of 64 KiB samples in memory (an optional binary column, uncompressed) as 8 row groups (the
  packed layout at W=8: a row group per rank) and as one row group (ms per file);
* one lakestream producer committing 1 MiB global batches, W=8, packed, SQLite catalog + local warehouse in a temp dir
  (CPU ms per commit, MiB/s).

On a host without the pathology (Intel, or a newer glibc) both columns agree; the tunable is ignored where glibc does
not know it. Figures in docs/benchmarks.md ("Performance notes").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Run, Table, alternating, bench_parser, cpu_s, fill_defaults, machine, percentile, sqlite_catalog  # noqa: E402

DISTANCES = (0, 4, 8, 16, 64, 2048)
COPY_BYTES = 64 << 10
SAMPLE_BYTES = 64 << 10
WORLD = 8
BATCH_BYTES = 1 << 20
TUNABLE = "glibc.cpu.x86_rep_movsb_threshold"


# ---------------------------------------------------------------------------------------------------- child: measure


def measure_memmove(repeats: int) -> dict[str, float]:
    """GB/s of a 64 KiB ``memmove`` whose destination is ``d`` bytes past the source modulo 4 KiB."""
    import numpy as np

    memmove = ctypes.memmove
    arena = np.zeros(16 << 20, np.uint8)
    base = (arena.ctypes.data + 4095) & ~4095
    src = base
    out = {}
    for distance in DISTANCES:
        dst = base + (8 << 20) + distance
        memmove(dst, src, COPY_BYTES)
        t0 = time.perf_counter()
        for _ in range(repeats):
            memmove(dst, src, COPY_BYTES)
        out[str(distance)] = COPY_BYTES * repeats / (time.perf_counter() - t0) / 1e9
    return out


def shards() -> list[Any]:
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(0)
    rows = BATCH_BYTES // WORLD // SAMPLE_BYTES
    return [pa.table({"sample": pa.array([rng.bytes(SAMPLE_BYTES) for _ in range(rows)], pa.binary())})
            for _ in range(WORLD)]


def measure_parquet(repeats: int) -> dict[str, float]:
    """ms to write 1 MiB (8 ranks of 64 KiB samples) as one row group per rank, and as one row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ranks = shards()
    whole = pa.concat_tables(ranks)

    def write(groups: list[Any]) -> None:
        writer = pq.ParquetWriter(pa.BufferOutputStream(), schema=whole.schema, compression="none", use_dictionary=False)
        for group in groups:
            writer.write_table(group, row_group_size=group.num_rows)
        writer.close()

    out = {}
    for label, groups in (("row_group_per_rank", ranks), ("one_row_group", [whole])):
        write(groups)
        t0 = time.perf_counter()
        for _ in range(repeats):
            write(groups)
        out[label] = (time.perf_counter() - t0) / repeats * 1000
    return out


def measure_commits(commits: int) -> dict[str, float]:
    """One producer, 1 MiB global batches, W=8, packed: CPU ms per commit and MiB/s after 10 warm-up commits."""
    from lakestream_iceberg import Stream

    root = Path(tempfile.mkdtemp(prefix="lakestream-host-copy-"))
    try:
        catalog = sqlite_catalog(root)
        batch = shards()
        Stream.create(catalog, "bench.copy", schema=batch[0].schema, world_size=WORLD,
                      properties={"write.parquet.compression-codec": "uncompressed", "lakestream.layout": "packed"})
        producer = Stream.open(catalog, "bench.copy").producer("p0")
        for _ in range(10):
            producer.commit(batch)
        c0, t0 = cpu_s(), time.perf_counter()
        for _ in range(commits):
            producer.commit(batch)
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        return {"cpu_ms_per_commit": cpu / commits * 1000, "mib_s": commits * BATCH_BYTES / (1 << 20) / wall}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def child(args: argparse.Namespace) -> int:
    result = {"memmove_gb_s": measure_memmove(args.copy_repeats), "parquet_ms": measure_parquet(args.write_repeats),
              "commit": measure_commits(args.commits)}
    print(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------------- parent: compare


def variant_env(tuned: bool, threshold: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if tuned:
        env["GLIBC_TUNABLES"] = f"{TUNABLE}={threshold}"
    return env


def run_child(args: argparse.Namespace, tuned: bool) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--commits", str(args.commits),
           "--copy-repeats", str(args.copy_repeats), "--write-repeats", str(args.write_repeats)]
    proc = subprocess.run(cmd, env=variant_env(tuned, args.threshold), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"host_copy child ({'tuned' if tuned else 'default'}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = bench_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds per variant (default 3; --smoke 1)")
    ap.add_argument("--commits", type=int, default=None, help="commits measured per round (default 200; --smoke 5)")
    ap.add_argument("--copy-repeats", type=int, default=None, help="memmoves per distance (default 4000)")
    ap.add_argument("--write-repeats", type=int, default=None, help="Parquet writes per shape (default 300)")
    ap.add_argument("--threshold", type=int, default=16 << 20, help=f"{TUNABLE} of the tuned variant (bytes)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    fill_defaults(args, rounds=(3, 1), commits=(200, 5), copy_repeats=(4000, 50), write_repeats=(300, 5))
    for name in ("rounds", "commits", "copy_repeats", "write_repeats", "threshold"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    run = Run("host_copy", smoke=args.smoke)
    rounds: dict[str, list[dict[str, Any]]] = {"default": [], "tuned": []}
    for i in range(args.rounds):  # alternating order, so that a slow phase of the machine hits both variants
        for name in alternating(("default", "tuned"), i):
            rounds[name].append(run_child(args, tuned=name == "tuned"))

    def pooled(name: str, *path: str) -> float:
        values = []
        for result in rounds[name]:
            value: Any = result
            for key in path:
                value = value[key]
            values.append(float(value))
        return percentile(values, 50)

    table = Table(f"host copies: default glibc vs GLIBC_TUNABLES={TUNABLE}={args.threshold} (median of "
                  f"{args.rounds} alternating rounds)", ["measure", "default", "tuned", "tuned / default"])
    rows = []
    for distance in DISTANCES:
        rows.append((f"memmove 64 KiB, dst - src = {distance} mod 4 KiB (GB/s)", ("memmove_gb_s", str(distance))))
    rows += [("Parquet write 1 MiB, a row group per rank, W=8 (ms)", ("parquet_ms", "row_group_per_rank")),
             ("Parquet write 1 MiB, one row group (ms)", ("parquet_ms", "one_row_group")),
             ("lakestream commit, 1 MiB W=8 packed, CPU (ms)", ("commit", "cpu_ms_per_commit")),
             ("lakestream commit, 1 MiB W=8 packed (MiB/s)", ("commit", "mib_s"))]
    summary = {}
    for label, path in rows:
        default, tuned = pooled("default", *path), pooled("tuned", *path)
        summary[label] = {"default": default, "tuned": tuned, "ratio": tuned / default if default else None}
        table.add(label, round(default, 3), round(tuned, 3), round(tuned / default, 3) if default else "-")
    slow = summary[rows[1][0]]["default"] / summary[rows[0][0]]["default"]
    table.note(f"distance 4 runs at {slow:.2f}x of distance 0 with the default glibc "
               f"({platform.libc_ver()[0]} {platform.libc_ver()[1]}, {machine()['cpu_model']}): "
               f"below about 0.3x this host has the pathology")
    run.finish([table], {
        "machine": machine(),
        "config": {"rounds": args.rounds, "commits": args.commits, "copy_repeats": args.copy_repeats,
                   "write_repeats": args.write_repeats, "tunable": f"{TUNABLE}={args.threshold}"},
        "rounds": rounds, "summary": summary, "distance4_vs_0_default": slow,
    }, out=args.out, spaced=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
