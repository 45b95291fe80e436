"""A commit's metadata writes on object storage: concurrent and overlapping metadata.json (lakestream's default),
concurrent but waited for by the plan, and one after another.

    .venv/bin/python benchmarks/commit_writes.py           # about 2 minutes on 2 cores
    .venv/bin/python benchmarks/commit_writes.py --smoke --out /tmp/commit_writes.json   # seconds

SQLite catalog, warehouse on SeaweedFS's S3 (started, waited for and stopped by this script through
``catalog/services.py``). P producer processes (``--producers``, default 1 and 4) publish 1 MiB global batches (world
size 8, 64 KiB incompressible samples, as ``vs_kafka.py``) as fast as they can for ``--duration`` seconds. Each row
runs ``--rounds`` rounds of the three modes, in rotating order, each on a fresh table:

* ``overlapped``: the code as it is. Inside ``ManifestPlanner.concurrent_writes`` a plan's manifests and manifest
  lists (two per batch of a group commit) are sent on a thread pool (``format/uploads.py``); the swap writes
  ``metadata.json`` while they are in flight and waits for all of them before the catalog's update;
* ``waited``: the same, but the plan waits for its files before it returns, so ``metadata.json`` is written after
  them (what the code did before the overlap);
* ``sequential``: the same code with ``concurrent_writes`` a no-op, so every file is written inline, one after
  another (what the code did before that, and still does on a local file system).

Per mode: batches/s (rounds pooled), commit p50, and the planning p50 (``BatchPlanner._plan_group``: in ``overlapped``
the wait for the files is in the swap, not in the plan), with ratios to ``sequential`` and to ``waited``.
Every run also checks that the published steps are dense and each producer's seqs were published exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from _common import (  # noqa: E402
    Run,
    StartLine,
    Table,
    bench_parser,
    int_list,
    percentile,
    preloaded_context,
    rotating,
    run_together,
)

from catalog import services  # noqa: E402

MiB = 1 << 20
SCHEMA = pa.schema([("sample", pa.binary())])
MODES = ("overlapped", "waited", "sequential")


def make_shards(world: int, seed: int) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    per_rank = MiB // world // (64 * 1024)
    return [pa.table({"sample": pa.array([rng.bytes(64 * 1024) for _ in range(per_rank)], pa.binary())}, schema=SCHEMA)
            for _ in range(world)]


def producer_main(props: dict[str, str], table: str, mode: str, idx: int, duration: float, world: int,
                  line: StartLine) -> None:
    from pyiceberg.catalog import load_catalog

    from lakestream_iceberg import Stream
    from lakestream_iceberg.format.manifests import ManifestPlanner
    from lakestream_iceberg.write import planner as planner_module

    if mode == "sequential":
        @contextlib.contextmanager
        def inline(self: ManifestPlanner) -> Iterator[None]:
            yield

        ManifestPlanner.concurrent_writes = inline  # type: ignore[method-assign]
    elif mode == "waited":
        sending = ManifestPlanner.concurrent_writes

        @contextlib.contextmanager
        def waited(self: ManifestPlanner) -> Iterator[None]:
            with sending(self):
                yield
            self.wait_written()

        ManifestPlanner.concurrent_writes = waited  # type: ignore[method-assign]
    plans: list[float] = []
    plan_group = planner_module.BatchPlanner._plan_group

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return plan_group(self, *args, **kwargs)
        finally:
            plans.append(time.perf_counter() - began)

    planner_module.BatchPlanner._plan_group = timed  # type: ignore[method-assign]
    shards = make_shards(world, idx)
    producer = Stream.open(load_catalog("bench", **props), table).producer(f"p{idx}")
    line.wait()
    latencies: list[float] = []
    end = time.monotonic() + duration
    while not latencies or time.monotonic() < end:
        began = time.perf_counter()
        producer.commit(shards)
        latencies.append(time.perf_counter() - began)
    line.report({"idx": idx, "latencies": latencies, "plans": plans, "seconds": duration})


def run(props: dict[str, str], table: str, mode: str, producers: int, args: argparse.Namespace) -> dict[str, Any]:
    from pyiceberg.catalog import load_catalog

    from lakestream_iceberg import Stream

    stream = Stream.create(load_catalog("bench", **props), table, schema=SCHEMA, world_size=args.world_size,
                           properties={"write.parquet.compression-codec": "uncompressed"})
    ctx = preloaded_context("catalog.services")
    results, wall = run_together(ctx, producer_main, [(props, table, mode, i, args.duration, args.world_size)
                                                      for i in range(producers)],
                                 timeout_s=args.duration + 300, ready_timeout_s=300)
    batches = sum(len(r["latencies"]) for r in results)
    state = stream.state(refresh=True)
    seqs = {f"p{r['idx']}": len(r["latencies"]) for r in results}
    exactly_once = state.step == batches and all(
        state.producers[p].seq == n - 1 for p, n in seqs.items())
    return {"mode": mode, "producers": producers, "batches": batches, "seconds": wall,
            "latencies": [x for r in results for x in r["latencies"]],
            "plans": [x for r in results for x in r["plans"]], "head_step": state.step, "exactly_once": exactly_once}


def main() -> None:
    parser = bench_parser(__doc__.split("\n\n")[0], smoke_help="seconds, for tests")
    parser.add_argument("--producers", default="1,4")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=8)
    args = parser.parse_args()
    if args.smoke:
        args.producers, args.duration, args.rounds = "2", 0.25, 1  # a few commits per run, group commit: the code ran
    counts = int_list(args.producers)
    root = Path(tempfile.mkdtemp(prefix="commit_writes-"))
    runs: list[dict[str, Any]] = []
    try:
        with services.SeaweedFS(root / "seaweedfs") as weed:
            bench = Run("commit_writes", smoke=args.smoke)
            props = {"type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"s3://{weed.bucket}/bench",
                     **weed.s3_properties()}
            from pyiceberg.catalog import load_catalog

            load_catalog("bench", **props).create_namespace_if_not_exists("bench")
            for producers in counts:
                for rnd in range(args.rounds):
                    for mode in rotating(MODES, rnd):
                        result = run(props, f"bench.p{producers}_{rnd}_{mode}", mode, producers, args)
                        runs.append(result)
                        print(f"  P={producers} round {rnd} {mode:10s}: {result['batches'] / result['seconds']:6.1f} "
                              f"batches/s, plan p50 {percentile(result['plans'], 50) * 1000:.1f} ms", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = Table("commit writes on S3 (SeaweedFS), 1 MiB batches, W=8; overlapped, waited and sequential metadata "
                  "writes (rounds pooled)",
                  ["P", "mode", "batches", "batches/s", "commit p50 ms", "plan p50 ms", "plan p99 ms",
                   "batches/s vs sequential", "commit p50 vs sequential", "batches/s vs waited", "commit p50 vs waited",
                   "exactly once"])
    rows: list[dict[str, Any]] = []
    for producers in counts:
        pooled = {}
        for mode in MODES:
            mine = [r for r in runs if r["producers"] == producers and r["mode"] == mode]
            pooled[mode] = {
                "batches": sum(r["batches"] for r in mine),
                "rate": sum(r["batches"] for r in mine) / sum(r["seconds"] for r in mine),
                "commit_p50": percentile([x for r in mine for x in r["latencies"]], 50),
                "plan_p50": percentile([x for r in mine for x in r["plans"]], 50),
                "plan_p99": percentile([x for r in mine for x in r["plans"]], 99),
                "exactly_once": all(r["exactly_once"] for r in mine),
            }
        for mode in MODES:
            p, s, w = pooled[mode], pooled["sequential"], pooled["waited"]
            table.add(producers, mode, p["batches"], p["rate"], p["commit_p50"] * 1000, p["plan_p50"] * 1000,
                      p["plan_p99"] * 1000, p["rate"] / s["rate"], p["commit_p50"] / s["commit_p50"],
                      p["rate"] / w["rate"], p["commit_p50"] / w["commit_p50"], "yes" if p["exactly_once"] else "NO")
            rows.append({"producers": producers, "mode": mode, **pooled[mode]})
    table.note(f"{args.rounds} rounds per row, modes in rotating order, {args.duration:.0f} s per run, each on a "
               "fresh table; plan = BatchPlanner._plan_group (manifests, lists, summaries; in 'waited' and 'sequential' "
               "also the writes of its files), the swap not included")
    bench.finish([table], {
        "rows": rows, "table": table.as_dicts(),
        "runs": [{k: v for k, v in r.items() if k not in ("latencies", "plans")} for r in runs],
        "seconds": bench.elapsed_s}, out=args.out, spaced=False)


if __name__ == "__main__":
    main()
