"""Soak: a producer's and a follower's memory (RSS) as the live steps grow, without GC and with periodic GC.

    .venv/bin/python benchmarks/memory.py                                   # 100,000 steps per run: hours on 2 cores
    .venv/bin/python benchmarks/memory.py --steps 20000 --configs single --modes nogc    # ~2-4 minutes
    .venv/bin/python benchmarks/memory.py --smoke --out /tmp/memory.json   # seconds: tests/test_benchmarks_smoke.py

Each run is a fresh stream on the embedded SQLite catalog with a local warehouse in a temp dir (removed at the end),
small shards (``--rows`` rows of ``--payload`` bytes per rank), every process started by this script
(multiprocessing, ``forkserver``):

* **configs** (``--configs``): ``single`` (one producer, world size 2, per-rank layout), ``group`` (``--group-producers``
  producers, default 4, committing concurrently with group commit, world size 2) and ``packed`` (one producer, the
  packed layout at world size ``--packed-world``, default 256).
* **modes** (``--modes``): ``nogc`` (every step stays live: the table holds ``--steps`` steps at the end) and ``gc``
  (producer 0 takes a checkpoint and runs ``collect_garbage(keep_last=1)`` every ``--gc-every`` steps, default 2,000).
* **processes**: the producers, and one follower that reads rank 0 of every step as it is published
  (``Stream.wait_for`` then ``Stream.read``; in ``gc`` mode a step collected before it got there is skipped).

Each process samples its own RSS (``VmRSS``) ``--samples`` times (default 50) at evenly spaced steps (its own commits'
steps; the follower's reads). Printed: RSS at every tenth of the run, the slope in KiB per 1,000 steps (least squares
over the samples after the first tenth, the warm-up), the growth after the warm-up, and that growth projected to
100,000 steps from the slope; the target (issue #44) is under 20 MiB per 100,000 live steps after the warm-up. With
group commit the table shows producer 0 (the others are alike; every producer's samples are in the JSON).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Children, Parent, Run, Table, bench_parser, percentile, rss_kib, sqlite_catalog  # noqa: E402

SCHEMA = pa.schema([("id", pa.int64()), ("payload", pa.binary())])
CONFIGS = ("single", "group", "packed")
MODES = ("nogc", "gc")
TARGET_MIB_PER_100K = 20.0


def _marks(total: int, samples: int) -> set[int]:
    """``samples`` evenly spaced points in 1..total (always the last)."""
    return {max(1, round(total * (i + 1) / samples)) for i in range(samples)}


def _producer(conn: Any, root: str, name: str, producer_id: str, commits: int, world: int, rows: int, payload: int,
              samples: int, gc_every: int) -> None:
    with Parent(conn) as parent:
        from lakestream_iceberg import Stream

        stream = Stream.open(sqlite_catalog(root), name)
        producer = stream.producer(producer_id)
        data = pa.array([b"x" * payload] * rows, pa.binary())
        marks = _marks(commits, samples)
        parent.ready()
        out: list[tuple[int, int]] = []
        latencies: list[float] = []
        next_gc = gc_every
        began = time.monotonic()
        for i in range(1, commits + 1):
            base = (hash(producer_id) % 1000) * 10**12 + i * 10**6
            shards = [pa.table({"id": pa.array(range(base + r * rows, base + (r + 1) * rows), pa.int64()),
                                "payload": data}, schema=SCHEMA) for r in range(world)]
            at = time.perf_counter()
            step = producer.commit(shards).step
            latencies.append(time.perf_counter() - at)
            if gc_every and step >= next_gc:
                stream.checkpoint(f"c{step}", step=step)
                stream.collect_garbage(dry_run=False, keep_last=1)
                next_gc = (step // gc_every + 1) * gc_every
            if i in marks:
                out.append((step, rss_kib()))
        tenth = max(1, len(latencies) // 10)  # commit p50 per tenth of this producer's commits: a bounded cache
        p50s = [percentile(latencies[i * tenth:(i + 1) * tenth], 50) for i in range(10)]  # must not slow them
        parent.ok({"samples": out, "seconds": time.monotonic() - began, "commit_p50_s_by_tenth": p50s})


def _follower(conn: Any, root: str, name: str, steps: int, samples: int) -> None:
    with Parent(conn) as parent:
        from lakestream_iceberg import Stream
        from lakestream_iceberg.errors import StepCollectedError

        stream = Stream.open(sqlite_catalog(root), name)
        marks = sorted(_marks(steps, samples))
        parent.ready()
        out: list[tuple[int, int]] = []
        skipped = 0
        step = 1
        began = time.monotonic()
        vanished = 0
        while step <= steps:
            try:
                stream.wait_for(step, timeout=600, poll_s=0.005)
            except FileNotFoundError:  # the metadata.json the pointer named was already deleted (a follower that lost
                vanished += 1  # the CPU for 16 commits; see the report of issue #44): look again
                continue
            try:
                stream.read(step, rank=0)
            except StepCollectedError:  # gc mode: collected before this follower got there
                head = stream.head_step()
                skipped += head - step
                step = head
                continue
            while marks and step >= marks[0]:
                marks.pop(0)
                out.append((step, rss_kib()))
            step += 1
        parent.ok({"samples": out, "skipped": skipped, "metadata_vanished": vanished, "seconds": time.monotonic() - began})


def one_run(root: Path, config: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from lakestream_iceberg import Stream

    world = args.packed_world if config == "packed" else 2
    producers = args.group_producers if config == "group" else 1
    props = {"lakestream.layout": "packed" if config == "packed" else "per-rank",
             "lakestream.commit.group.enabled": "true" if config == "group" else "false"}
    if args.cache_bytes is not None:
        props["lakestream.manifest.cache-bytes"] = str(args.cache_bytes)
    root.mkdir(parents=True)
    name = "ns.soak"
    Stream.create(sqlite_catalog(root), name, schema=SCHEMA, world_size=world, properties=props)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["pyarrow", "pyiceberg.catalog.sql", "lakestream_iceberg"])
    per_producer = [args.steps // producers + (1 if i < args.steps % producers else 0) for i in range(producers)]
    roles: list[tuple[str, Any, tuple[Any, ...]]] = [
        (f"producer {i}", _producer, (str(root), name, f"p{i}", per_producer[i], world, args.rows, args.payload,
                                      args.samples, args.gc_every if mode == "gc" and i == 0 else 0))
        for i in range(producers)]
    roles.append(("follower", _follower, (str(root), name, args.steps, args.samples)))
    children = Children(ctx)
    for label, target, targs in roles:
        children.start(label, target, *targs)
    began = time.monotonic()
    try:
        children.wait_ready(f"{config}/{mode} ")
        children.send_all("go")
        results = dict(zip(children.labels, children.collect(f"{config}/{mode} ")))
    finally:
        children.close(join_s=60)
    return {"config": config, "mode": mode, "world_size": world, "producers": producers, "steps": args.steps,
            "seconds": time.monotonic() - began, "processes": results}


def analyse(samples: list[tuple[int, int]], steps: int) -> dict[str, Any]:
    """RSS at each tenth of the run (MiB), the slope after the warm-up (the first tenth) in KiB per 1,000 steps, the
    growth after the warm-up, and that slope projected to 100,000 steps (MiB)."""
    tenths = []
    for i in range(1, 11):
        at = steps * i / 10
        before = [kib for step, kib in samples if step <= at]
        tenths.append(before[-1] / 1024 if before else None)
    after = [(s, k) for s, k in samples if s >= steps / 10]
    slope = 0.0
    if len(after) >= 2:
        mean_s = sum(s for s, _ in after) / len(after)
        mean_k = sum(k for _, k in after) / len(after)
        var = sum((s - mean_s) ** 2 for s, _ in after)
        slope = sum((s - mean_s) * (k - mean_k) for s, k in after) / var * 1000 if var else 0.0
    growth = (after[-1][1] - after[0][1]) / 1024 if len(after) >= 2 else 0.0
    projected = slope * 100 / 1024
    return {"rss_mib_at_tenths": tenths, "slope_kib_per_1000_steps": slope, "growth_after_warmup_mib": growth,
            "mib_per_100k_steps": projected, "target_met": projected < TARGET_MIB_PER_100K}


def main() -> None:
    parser = bench_parser(__doc__, smoke_help="seconds, for tests")
    parser.add_argument("--steps", type=int, default=100_000, help="steps (snapshots) per run, all producers together")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--gc-every", type=int, default=2000, help="gc mode: checkpoint and GC every this many steps")
    parser.add_argument("--group-producers", type=int, default=4)
    parser.add_argument("--packed-world", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4, help="rows per rank per step (packed: 1)")
    parser.add_argument("--payload", type=int, default=64, help="bytes per row")
    parser.add_argument("--samples", type=int, default=50, help="RSS samples per process")
    parser.add_argument("--cache-bytes", type=int, default=None, help="lakestream.manifest.cache-bytes (default: "
                        "the stream's default)")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    for value, allowed in ((configs, CONFIGS), (modes, MODES)):
        if not value or any(v not in allowed for v in value):
            parser.error(f"{value} must be a comma-separated subset of {', '.join(allowed)}")
    if args.smoke:
        args.steps, args.gc_every, args.packed_world, args.samples = 200, 50, 16, 10
    run = Run("memory", smoke=args.smoke)
    root = Path(tempfile.mkdtemp(prefix="lakestream-memory-"))
    runs: list[dict[str, Any]] = []
    table = Table(f"RSS as the live steps grow ({args.steps:,} steps per run; MiB at each tenth of the run)",
                  ["config", "mode", "process", *[f"{i}0%" for i in range(1, 11)], "KiB/1k steps",
                   "growth after 10% MiB", "MiB/100k steps", f"< {TARGET_MIB_PER_100K:.0f} MiB/100k"])
    p50_table = Table("producer 0's commit p50 (ms) in each tenth of its commits", ["config", "mode",
                      *[f"{i}0%" for i in range(1, 11)], "last / first tenth"])
    try:
        for config in configs:
            for mode in modes:
                one = one_run(root / f"{config}-{mode}", config, mode, args)
                for body in one["processes"].values():
                    body["analysis"] = analyse(body["samples"], args.steps)
                for label in ("producer 0", "follower"):
                    a = one["processes"][label]["analysis"]
                    table.add(config, mode, label, *a["rss_mib_at_tenths"], a["slope_kib_per_1000_steps"],
                              a["growth_after_warmup_mib"], a["mib_per_100k_steps"], "yes" if a["target_met"] else "NO")
                p50s = one["processes"]["producer 0"]["commit_p50_s_by_tenth"]
                p50_table.add(config, mode, *[p * 1000 for p in p50s], p50s[-1] / p50s[0])
                runs.append(one)
                print(f"{config}/{mode}: {args.steps:,} steps in {one['seconds']:.0f} s", flush=True)
                print("\n".join(str(table).splitlines()[-2:]), flush=True)  # its two rows, as soon as they exist
                write(run, args, runs, [table, p50_table], partial=True)
                shutil.rmtree(root / f"{config}-{mode}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table.note("single: 1 producer, W=2 per-rank; group: "
               f"{args.group_producers} producers with group commit, W=2 (producer 0 shown); packed: 1 producer, "
               f"packed layout, W={args.packed_world}; follower: reads rank 0 of every step as it is published")
    table.note(f"nogc: every step stays live; gc: checkpoint + collect_garbage(keep_last=1) every {args.gc_every:,} "
               "steps in producer 0; slope: least squares after the first tenth (warm-up); MiB/100k: the slope x 100")
    p50_table.note("the follower and the other producers run on the same cores: compare tenths, not runs")
    run.finish([table, p50_table], payload(run, args, runs, partial=False), out=args.out, dated=True, spaced=False)


def payload(run: Run, args: argparse.Namespace, runs: list[dict[str, Any]], *, partial: bool) -> dict[str, Any]:
    return {"partial": partial, "config": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs,
            "seconds": run.elapsed_s}


def write(run: Run, args: argparse.Namespace, runs: list[dict[str, Any]], tables: list[Table], *, partial: bool) -> Path:
    """The JSON of the runs so far (after each run: a long soak that stops early keeps what it measured)."""
    return run.write({**payload(run, args, runs, partial=partial), "tables": [t.to_json() for t in tables],
                      "printed": "\n\n".join(str(t) for t in tables)}, out=args.out, dated=True)


if __name__ == "__main__":
    main()
