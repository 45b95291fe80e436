"""Per-step cost: the commit path side by side, a profile of one step, and a world-size sweep.

    .venv/bin/python benchmarks/step_cost.py                     # ~3-5 minutes on 2 cores
    .venv/bin/python benchmarks/step_cost.py --smoke --out /tmp/step_cost.json   # seconds: tests/test_benchmarks_smoke.py

Everything runs on the embedded SQLite catalog with a local warehouse in a temp dir (removed at the end).

* **Commit path** (one producer, world size 2, small shards): ``--commits`` commits per round with lakestream's swap
  from the held metadata (``connect/swap.py``) and with pyiceberg's ``SqlCatalog.commit_table`` (which loads the table
  again, applies the updates to that copy, deep-copies it and writes it), in alternating rounds on fresh streams;
  p50 commit latency and commits/s of each, and their ratio.
* **Profile of one step** (cProfile over the same loop, per mode): where a step's time goes (the swap, writing the
  data files, planning the manifests, the rest); and the same at W=``--profile-world`` (1024) per layout.
* **World-size sweep** (``--worlds``, default 1 8 64 256 1024, per layout: ``per-rank`` and ``packed``; one producer,
  one row per rank): commit p50 and data files (PUTs) per step, and a rank's read p50 (``stream.read(step, rank)``),
  each as a ratio to the per-rank layout at W=1 and to the same layout at W=1. ``--sweep-rounds`` (3) rounds, W by W
  with the layouts side by side, ``os.sync()`` before each point (the writeback of a large point must not land on the
  next one); the p50s pool the rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Run, RunFolders, Table, alternating, bench_parser, flush_writes, percentile, sqlite_catalog  # noqa: E402

import lakestream_iceberg.connect.swap as swap_module  # noqa: E402
from lakestream_iceberg import Stream  # noqa: E402

SCHEMA = pa.schema([("id", pa.int64()), ("payload", pa.binary())])
MODES = ("held", "commit_table")


def shards(world: int, step: int, rows: int, payload: int) -> list[pa.Table]:
    return [pa.table({"id": pa.array([step * 1_000_000 + r * 1000 + i for i in range(rows)], pa.int64()),
                      "payload": pa.array([b"x" * payload] * rows, pa.binary())}, schema=SCHEMA)
            for r in range(world)]


class Mode:
    """Commit with lakestream's swap from held metadata (``held``) or through pyiceberg's ``commit_table``."""

    def __init__(self, mode: str) -> None:
        self.mode, self._saved = mode, swap_module.swaps_from_held

    def __enter__(self) -> None:
        if self.mode == "commit_table":
            swap_module.swaps_from_held = lambda _table: False  # type: ignore[assignment]

    def __exit__(self, *_: object) -> None:
        swap_module.swaps_from_held = self._saved  # type: ignore[assignment]


def commit_loop(root: Path, name: str, *, world: int, commits: int, rows: int, payload: int,
                profile: cProfile.Profile | None = None, layout: str | None = None) -> tuple[list[float], Stream]:
    properties = None if layout is None else {"lakestream.layout": layout}
    stream = Stream.create(sqlite_catalog(root), f"ns.{name}", schema=SCHEMA, world_size=world, properties=properties)
    producer = stream.producer("p")
    producer.commit(shards(world, 0, rows, payload))  # warm-up: caches, first metadata
    latencies = []
    for step in range(1, commits + 1):
        batch = shards(world, step, rows, payload)
        if profile is not None:
            profile.enable()
        began = time.perf_counter()
        producer.commit(batch)
        latencies.append(time.perf_counter() - began)
        if profile is not None:
            profile.disable()
    return latencies, stream


def commit_path(root: Path, args: argparse.Namespace) -> tuple[Table, dict[str, Any]]:
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    for rnd in range(args.rounds):
        for mode in alternating(MODES, rnd):  # alternate the order: drift hits both alike
            with Mode(mode):
                lat, _ = commit_loop(root / f"cp-{mode}-{rnd}", "s", world=2, commits=args.commits, rows=4,
                                     payload=args.payload)
            runs[mode].extend(lat)
    table = Table("commit path: one producer, world size 2, small shards (alternating rounds, fresh streams)",
                  ["commit path", "commits", "p50 ms", "p99 ms", "commits/s", "p50 vs commit_table"])
    p50 = {m: percentile(runs[m], 50) for m in MODES}
    for mode in MODES:
        table.add(mode, len(runs[mode]), p50[mode] * 1000, percentile(runs[mode], 99) * 1000,
                  len(runs[mode]) / sum(runs[mode]), p50[mode] / p50["commit_table"])
    return table, {"latencies_s": runs, "p50_ratio": p50["held"] / p50["commit_table"]}


GROUPS = (  # (label, substrings of "file:function" in the profile: the first group that matches takes the time)
    ("the swap (catalog commit)", ("connect/swap.py:swap", "catalog/sql.py:commit_table")),
    ("checking the batch (schema, nulls)", ("format/layout.py:check_batch",)),
    ("writing the data files", ("write/writer.py:write",)),
    ("planning: manifests, lists, summary", ("write/planner.py:_plan_group",)),
    ("reading the head", ("write/commit.py:refresh",)),
)


def _parts(prof: cProfile.Profile, latencies: list[float]) -> dict[str, float]:
    """Seconds per step in each GROUPS part (cumulative time of the first matching function), and the rest."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(latencies)
    parts: dict[str, float] = {}
    for label, keys in GROUPS:
        parts[label] = max((v[3] for (file, _line, func), v in stats.items()
                            if any(f"{file}:{func}".endswith(k) or f"{file}:{func}".find(k) >= 0 for k in keys)),
                           default=0.0)
    parts["everything else"] = max(0.0, total - sum(parts.values()))
    parts["total"] = total
    return {k: v / len(latencies) for k, v in parts.items()}


def profile_step(root: Path, args: argparse.Namespace) -> tuple[Table, dict[str, Any]]:
    table = Table("profile of one step (cProfile, cumulative ms per step; world size 2, small shards)",
                  ["part", *MODES])
    out: dict[str, Any] = {}
    for mode in MODES:
        prof = cProfile.Profile()
        with Mode(mode):
            lat, _ = commit_loop(root / f"prof-{mode}", "s", world=2, commits=args.commits, rows=4,
                                 payload=args.payload, profile=prof)
        out[mode] = _parts(prof, lat)
    for label in [g[0] for g in GROUPS] + ["everything else", "total"]:
        table.add(label, *(out[m][label] * 1000 for m in MODES))
    table.note("one commit = one step; 'the swap' is pyiceberg's commit_table (reload, deep copy, write, UPDATE) or "
               "lakestream's swap from held metadata (write, UPDATE)")
    return table, out


def profile_world(root: Path, args: argparse.Namespace) -> tuple[Table, dict[str, Any]]:
    """The same profile at a large world size, per layout: where a step's time goes when it has W ranks."""
    world = args.profile_world
    table = Table(f"profile of one step at W={world} (cProfile, cumulative ms per step; one row per rank)",
                  ["part", *args.layouts])
    out: dict[str, Any] = {}
    for layout in args.layouts:
        prof = cProfile.Profile()
        lat, _ = commit_loop(root / f"profw-{layout}", "s", world=world, commits=args.profile_commits, rows=1,
                             payload=64, profile=prof, layout=layout)
        out[layout] = _parts(prof, lat)
    for label in [g[0] for g in GROUPS] + ["everything else", "total"]:
        table.add(label, *(out[layout][label] * 1000 for layout in args.layouts))
    table.note("per-rank: W Parquet files and W manifest entries per step; packed: one file, one entry")
    return table, out


def world_sweep(root: Path, args: argparse.Namespace) -> tuple[Table, dict[str, Any], int]:
    lats: dict[tuple[str, int], list[float]] = {}
    reads: dict[tuple[str, int], list[float]] = {}
    files: dict[tuple[str, int], int] = {}
    # ``--sweep-rounds`` rounds, W by W with the layouts side by side (their order alternating by round), each point on
    # a fresh stream after everything is on disk (the writeback of a large point, per-rank W=1024 writes ~60,000 files,
    # must not land on the next one); p50s pool the rounds. Points' folders are kept until the sweep ends
    # (_common.RunFolders): deleting 60,000 files made creating a file 10-20x dearer for minutes on this project's
    # machine (docs/benchmarks.md, "Performance notes"), and the point after it paid: packed W=1,024 measured 12.7-21.3 ms per commit
    # right after per-rank W=1,024's folder was deleted, 9.2-11.6 ms alone.
    runs = RunFolders()
    try:
        _sweep_rounds(root, args, runs, lats, reads, files)
    finally:
        runs.close()
    rows = {key: {"commits": len(lats[key]), "rounds": args.sweep_rounds, "commit_p50_s": percentile(lats[key], 50), "files_per_step": files[key],
                  "read_p50_s": percentile(reads[key], 50), "reads": len(reads[key])} for key in lats}
    table, as_json = _sweep_table(args, rows, runs.deleted_early)
    return table, as_json, runs.deleted_early


def _sweep_rounds(root: Path, args: argparse.Namespace, runs: RunFolders, lats: dict[tuple[str, int], list[float]],
                  reads: dict[tuple[str, int], list[float]], files: dict[tuple[str, int], int]) -> None:
    for rnd in range(args.sweep_rounds):
        for world in args.worlds:
            for layout in alternating(args.layouts, rnd):
                commits = max(3, min(args.sweep_commits, args.sweep_budget // world))
                where = root / f"{layout}-w{world}-r{rnd}"
                flush_writes()
                lat, stream = commit_loop(where, "s", world=world, commits=commits, rows=1, payload=64, layout=layout)
                stream.refresh()
                files[(layout, world)] = len(stream.index.files(stream.table.current_snapshot(), commits))
                ranks = sorted({0, world // 2, world - 1})
                for step in range(1, commits + 1):
                    for rank in ranks:  # a fresh read each time: a trainer rank reads each step once (footer included)
                        began = time.perf_counter()
                        stream.read(step, rank=rank)
                        reads.setdefault((layout, world), []).append(time.perf_counter() - began)
                lats.setdefault((layout, world), []).extend(lat)
                stream.table.catalog.engine.dispose()
                runs.retire(where)


def _sweep_table(args: argparse.Namespace, rows: dict[tuple[str, int], dict[str, Any]],
                 deleted_early: int) -> tuple[Table, dict[str, Any]]:
    base = rows[(args.layouts[0], args.worlds[0])]
    table = Table(f"world-size sweep: one producer, one row per rank (x base: ratios to {args.layouts[0]} "
                  f"W={args.worlds[0]}; x W={args.worlds[0]}: to the same layout at W={args.worlds[0]})",
                  ["layout", "W", "commits", "commit p50 ms", "commit x base", f"commit x W={args.worlds[0]}",
                   "data files (PUTs) / step", "rank read p50 ms", "read x base", f"read x W={args.worlds[0]}"])
    for (layout, world), r in sorted(rows.items(), key=lambda kv: (args.layouts.index(kv[0][0]), kv[0][1])):
        own = rows[(layout, args.worlds[0])]
        table.add(layout, world, r["commits"], r["commit_p50_s"] * 1000, r["commit_p50_s"] / base["commit_p50_s"],
                  r["commit_p50_s"] / own["commit_p50_s"], r["files_per_step"], r["read_p50_s"] * 1000,
                  r["read_p50_s"] / base["read_p50_s"], r["read_p50_s"] / own["read_p50_s"])
    table.note("commit = write the step's data files + plan + swap; a read opens the step fresh (packed: its footer); "
               f"{args.sweep_rounds} rounds, W by W with the layouts side by side, os.sync() before each point; p50s pool "
               f"the rounds; points' folders kept until the sweep ends (deleted early for disk space: {deleted_early})")
    return table, {f"{layout}/{world}": v for (layout, world), v in rows.items()}


def main() -> None:
    parser = bench_parser(__doc__, smoke_help="seconds, for tests")
    parser.add_argument("--commits", type=int, default=150, help="commits per round of the commit-path comparison")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--payload", type=int, default=256, help="bytes per row in the commit-path runs")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--layouts", nargs="+", default=["per-rank", "packed"], choices=["per-rank", "packed"])
    parser.add_argument("--sweep-commits", type=int, default=40)
    parser.add_argument("--sweep-rounds", type=int, default=3, help="rounds of the world-size sweep (p50s pool them)")
    parser.add_argument("--profile-world", type=int, default=1024, help="W of the per-layout profile")
    parser.add_argument("--profile-commits", type=int, default=8)
    parser.add_argument("--sweep-budget", type=int, default=20_000, help="at most this many rank files per W")
    args = parser.parse_args()
    if args.sweep_rounds < 1:
        parser.error("--sweep-rounds must be >= 1")
    if args.smoke:
        args.commits, args.rounds, args.worlds, args.sweep_commits, args.sweep_rounds = 6, 2, [1, 8], 3, 1
        args.profile_world, args.profile_commits = 8, 3
    run = Run("step_cost", smoke=args.smoke)
    root = Path(tempfile.mkdtemp(prefix="lakestream-step-cost-"))
    try:
        commit_table, commit_json = commit_path(root, args)
        print(commit_table, flush=True)
        prof_table, prof_json = profile_step(root, args)
        print(prof_table, flush=True)
        world_table, world_json = profile_world(root, args)
        print(world_table, flush=True)
        sweep_table, sweep_json, sweep_deleted_early = world_sweep(root, args)
        print(sweep_table, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    run.finish([commit_table, prof_table, world_table, sweep_table], {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "commit_path": commit_json, "profile": prof_json, "profile_world": world_json, "world_sweep": sweep_json,
        "world_sweep_folders_deleted_early": sweep_deleted_early, "seconds": run.elapsed_s}, out=args.out, show=False)


if __name__ == "__main__":
    main()
