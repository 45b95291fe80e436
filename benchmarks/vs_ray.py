"""Ray Data preprocessing feeding a trainer: write_parquet vs write_iceberg vs the lakestream sink, side by side.

The same preprocessing job (``ray.data.range`` cut into ``--blocks`` blocks of ``--rows-per-block`` rows, a
``map_batches`` that turns each block into token rows with ``--work-ms`` of CPU work per block) and the same trainer
(one process, steps of ``--rows-per-step`` rows, ``--step-ms`` of simulated accelerator time per step: a sleep, so the
trainer takes no CPU from the job) run three ways, one after another on one Ray instance (one ``ray.init()``):

* **(a) parquet**: ``Dataset.write_parquet(dir)``; the trainer starts when the job has finished and reads the files
  (pyarrow) in steps of ``--rows-per-step`` rows;
* **(b) iceberg**: ``Dataset.write_iceberg(table)`` (Ray's own Iceberg sink: one commit when every task finished); the
  trainer starts after that commit and scans the table (pyiceberg) in steps;
* **(c) lakestream**: ``Dataset.write_datasink(LakestreamDatasink(...))``: each write task publishes a step as soon as
  it has formed one; a trainer (``LakestreamDataset`` in follow mode) starts with the job and follows it.

Reported for each: time from the job's start to the trainer's first step and to its last step, and the ratios of
(a) and (b) over (c) (> 1: lakestream is faster). Everything runs locally: ``ray.init(num_cpus=--cpus)`` (logical
CPUs; the trainer runs in this driver process, outside Ray), SQLite catalogs in a temp dir (removed at the end).
``--repeat N`` interleaves N repetitions of (a), (b), (c) and reports the median of each ratio.

Then the same three run on a **multi-node cluster** (``--nodes``, default 3: ``ray.cluster_utils.Cluster``, a head and
``--nodes - 1`` worker raylets on this machine, each with ``--node-cpus`` logical CPUs; the driver and its trainer on
the head), reported in a second table: time to the first and the last step when the write tasks run on several
nodes. ``--nodes 0`` skips it.

Run::

    .venv/bin/python benchmarks/vs_ray.py                       # 300 blocks, a few minutes
    .venv/bin/python benchmarks/vs_ray.py --rows-per-block 64 --rows-per-step 32 --tokens 64 --step-ms 10  # tiny steps
    .venv/bin/python benchmarks/vs_ray.py --repeat 3
    .venv/bin/python benchmarks/vs_ray.py --nodes 4 --node-cpus 1   # the multi-node part on 4 raylets
    .venv/bin/python benchmarks/vs_ray.py --smoke --out /tmp/vs_ray.json   # seconds: tests/test_benchmarks_smoke.py

Writes ``benchmarks/results/vs_ray.json`` (``--out``): the table (also as text under ``printed``), every run's
timings, the machine and the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from _common import RESULTS_DIR, Run, Table, bench_parser, machine, shrink, sqlite_props  # noqa: E402


def payload_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("id", pa.int64()), ("tokens", pa.list_(pa.int32())), ("label", pa.int32())])


def preprocess(batch: Any, work_ms: float, tokens_per_row: int) -> Any:
    """One block -> token rows: deterministic in the block's ids, with ``work_ms`` of CPU work (a tokenizer stand-in)."""
    import numpy as np
    import pyarrow as pa

    ids = batch.column("id").to_numpy()
    rng = np.random.default_rng(int(ids[0]) if len(ids) else 0)
    deadline = time.perf_counter() + work_ms / 1000
    x = rng.random((64, 64))
    while time.perf_counter() < deadline:
        x = np.tanh(x @ x.T / 64)
    tokens = rng.integers(0, 50_000, size=(len(ids), tokens_per_row), dtype=np.int32)
    values = pa.array(tokens.reshape(-1), pa.int32())
    offsets = pa.array(np.arange(0, (len(ids) + 1) * tokens_per_row, tokens_per_row, dtype=np.int32))
    return pa.table({"id": pa.array(ids, pa.int64()), "tokens": pa.ListArray.from_arrays(offsets, values),
                     "label": pa.array((ids % 10).astype(np.int32))}, schema=payload_schema())


def job(args: argparse.Namespace) -> Any:
    import ray

    return ray.data.range(args.blocks * args.rows_per_block, override_num_blocks=args.blocks).map_batches(
        preprocess, fn_kwargs={"work_ms": args.work_ms, "tokens_per_row": args.tokens}, batch_format="pyarrow", batch_size=None)


class Trainer:
    """Counts steps and stamps the first and the last; each step 'trains' for ``step_ms`` (a sleep)."""

    def __init__(self, t0: float, step_ms: float) -> None:
        self.t0, self.step_s = t0, step_ms / 1000
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.steps = 0
        self.rows = 0

    def step(self, rows: int) -> None:
        if self.first_s is None:
            self.first_s = time.monotonic() - self.t0
        time.sleep(self.step_s)
        self.steps += 1
        self.rows += rows
        self.last_s = time.monotonic() - self.t0


def in_steps(batches: Iterable[Any], rows_per_step: int) -> Iterator[int]:
    """Re-cut record batches into steps of ``rows_per_step`` rows (the last may be smaller); yields each step's size."""
    held = 0
    for batch in batches:
        held += batch.num_rows
        while held >= rows_per_step:
            held -= rows_per_step
            yield rows_per_step
    if held:
        yield held


def run_parquet(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    import pyarrow.dataset as pads

    out = root / f"parquet-{time.monotonic_ns()}"
    ds = job(args)
    t0 = time.monotonic()
    ds.write_parquet(str(out))
    job_s = time.monotonic() - t0
    trainer = Trainer(t0, args.step_ms)
    files = sorted(str(p) for p in out.rglob("*.parquet"))
    for rows in in_steps(pads.dataset(files, format="parquet").to_batches(batch_size=args.rows_per_step), args.rows_per_step):
        trainer.step(rows)
    return result("parquet", job_s, trainer, files=len(files))


def run_iceberg(root: Path, args: argparse.Namespace, props: dict[str, str]) -> dict[str, Any]:
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog("bench", **props)
    name = f"bench.plain_{time.monotonic_ns()}"
    try:
        catalog.create_namespace("bench")
    except Exception:  # exists
        pass
    catalog.create_table(name, schema=payload_schema())
    ds = job(args)
    t0 = time.monotonic()
    ds.write_iceberg(name, catalog_kwargs={"name": "bench", **props})
    job_s = time.monotonic() - t0
    trainer = Trainer(t0, args.step_ms)
    table = catalog.load_table(name)
    for rows in in_steps(table.scan().to_arrow_batch_reader(), args.rows_per_step):
        trainer.step(rows)
    return result("iceberg", job_s, trainer, snapshots=len(table.metadata.snapshots))


def run_lakestream(root: Path, args: argparse.Namespace, props: dict[str, str]) -> dict[str, Any]:
    from lakestream_iceberg import LakestreamDataset, Stream, load_catalog
    from lakestream_iceberg.integrations.ray import LakestreamDatasink

    catalog = load_catalog("bench", **props)
    name = f"bench.stream_{time.monotonic_ns()}"
    stream = Stream.create(catalog, name, schema=payload_schema(), world_size=1)
    steps = args.blocks * args.rows_per_block // args.rows_per_step
    sink = LakestreamDatasink(catalog=catalog, stream=name, run_name="prep", rows_per_step=args.rows_per_step)
    follower = LakestreamDataset(stream, rank=0, world_size=1, follow=True, end_step=steps, timeout=600,
                                 collate=lambda shard: shard.table.num_rows)
    ds = job(args)
    t0 = time.monotonic()
    trainer = Trainer(t0, args.step_ms)
    errors: list[BaseException] = []

    def train() -> None:
        try:
            for rows in follower:
                trainer.step(rows)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    ds.write_datasink(sink)
    job_s = time.monotonic() - t0
    thread.join(600)
    if errors or thread.is_alive():
        raise RuntimeError(f"the following trainer failed: {errors or 'still running after 600 s'}")
    report = sink.report
    assert report is not None
    commits = sum(t.published + t.duplicates for t in report.tasks)
    return result("lakestream", job_s, trainer, published=report.published, duplicates=report.duplicates,
                  head_step=stream.refresh().head_step(), write_tasks=len(report.tasks),
                  commit_s_in_tasks=sum(t.commit_s for t in report.tasks),
                  commit_ms_mean=1000 * sum(t.commit_s for t in report.tasks) / max(1, commits))


def result(name: str, job_s: float, trainer: Trainer, **extra: Any) -> dict[str, Any]:
    return {"variant": name, "job_s": job_s, "first_step_s": trainer.first_s, "last_step_s": trainer.last_s,
            "steps": trainer.steps, "rows": trainer.rows, **extra}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser(__doc__, out=RESULTS_DIR / "vs_ray.json", whole_doc=True,
                          smoke_help="tiny sizes, seconds: what tests/test_benchmarks_smoke.py runs")
    parser.add_argument("--blocks", type=int, default=300, help="blocks (and write tasks) of the preprocessing job")
    parser.add_argument("--rows-per-block", type=int, default=128)
    parser.add_argument("--rows-per-step", type=int, default=128, help="rows per trainer step (divides rows-per-block)")
    parser.add_argument("--tokens", type=int, default=256, help="int32 tokens per row (128 x 256: 128 KiB of tokens a step)")
    parser.add_argument("--work-ms", type=float, default=40.0, help="CPU work of the preprocessing, per block")
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated accelerator time per trainer step (sleep)")
    parser.add_argument("--cpus", type=int, default=2, help="ray.init(num_cpus=...): logical CPUs of the job")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved repetitions; ratios are medians")
    parser.add_argument("--nodes", type=int, default=3, help="raylets of the multi-node run (head included); 0: skip it")
    parser.add_argument("--node-cpus", type=int, default=1, help="logical CPUs of each node of the multi-node run")
    args = parser.parse_args(argv)
    if args.smoke:
        shrink(parser, args, {"blocks": 8, "rows_per_block": 16, "rows_per_step": 8, "tokens": 16, "work_ms": 5.0,
                              "step_ms": 2.0})
    if min(args.blocks, args.rows_per_block, args.rows_per_step, args.tokens, args.repeat, args.cpus, args.node_cpus) < 1:
        parser.error("--blocks, --rows-per-block, --rows-per-step, --tokens, --repeat, --cpus and --node-cpus must be >= 1")
    if args.nodes == 1 or args.nodes < 0:
        parser.error("--nodes must be 0 (no multi-node run) or at least 2")
    if args.rows_per_block % args.rows_per_step:
        parser.error("--rows-per-step must divide --rows-per-block (every write task then forms whole steps)")
    return args


def run_all(root: Path, args: argparse.Namespace, props: dict[str, str], runs: list[dict[str, Any]], *,
            cluster: str) -> None:
    """(a), (b), (c), ``--repeat`` times interleaved, on the Ray cluster this process is connected to."""
    import logging

    from ray.data import DataContext

    logging.getLogger("ray").setLevel(logging.WARNING)  # again: joining a cluster configures Ray's loggers anew
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    DataContext.get_current().enable_progress_bars = False
    job(args).materialize()  # warm the workers (imports) so that no variant pays for them
    for repetition in range(args.repeat):
        for name, run in (("parquet", lambda: run_parquet(root, args)), ("iceberg", lambda: run_iceberg(root, args, props)),
                          ("lakestream", lambda: run_lakestream(root, args, props))):
            outcome = run()
            outcome["repetition"], outcome["cluster"] = repetition, cluster
            runs.append(outcome)
            print(f"  {name:10s} job {outcome['job_s']:.2f} s, first step {outcome['first_step_s']:.2f} s, "
                  f"last step {outcome['last_step_s']:.2f} s ({outcome['steps']} steps) [{cluster}]", flush=True)


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace, steps: int, cluster: str) -> tuple[Table, dict[str, Any]]:
    table = Table(f"Ray Data job -> trainer ({args.blocks} blocks, {steps} steps of {args.rows_per_step} rows), {cluster}",
                  ["variant", "job s", "first step s", "last step s", "first step: x / lakestream", "last step: x / lakestream"])
    ratios: dict[str, dict[str, float]] = {}
    lake_runs = [r for r in runs if r["variant"] == "lakestream"]
    for name in ("parquet", "iceberg", "lakestream"):
        mine = [r for r in runs if r["variant"] == name]
        first = [r["first_step_s"] / lake["first_step_s"] for r, lake in zip(mine, lake_runs)]
        last = [r["last_step_s"] / lake["last_step_s"] for r, lake in zip(mine, lake_runs)]
        ratios[name] = {"first_step": statistics.median(first), "last_step": statistics.median(last)}
        table.add(name, statistics.median(r["job_s"] for r in mine), statistics.median(r["first_step_s"] for r in mine),
                  statistics.median(r["last_step_s"] for r in mine), f"{ratios[name]['first_step']:.2f}x",
                  f"{ratios[name]['last_step']:.2f}x")
    table.note("times from the job's start; ratios > 1: lakestream's trainer gets there sooner (medians over repetitions)")
    table.note("(a) and (b) start the trainer once the job (and, for iceberg, its single commit) is done; (c) follows it")
    table.note(f"(c): {statistics.median(r['commit_ms_mean'] for r in lake_runs):.0f} ms per step committed inside the "
               f"write tasks (mean), {statistics.median(r['commit_s_in_tasks'] for r in lake_runs):.1f} s of task time "
               f"in all, over {lake_runs[0]['write_tasks']} write tasks")
    return table, ratios


def main(argv: list[str] | None = None) -> int:
    import logging

    import ray

    args = parse_args(argv)
    logging.getLogger("pyiceberg").setLevel(logging.ERROR)
    logging.getLogger("ray").setLevel(logging.WARNING)  # one INFO line per job and commit phase otherwise
    run = Run("vs_ray", smoke=args.smoke)
    root = Path(tempfile.mkdtemp(prefix="vs-ray-"))
    props = sqlite_props(root)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    repo = str(BENCH_DIR.parent)  # Ray workers import this checkout's lakestream_iceberg and this script's functions
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, str(BENCH_DIR), os.environ.get("PYTHONPATH")) if p)
    print(f"vs_ray: {args.blocks} blocks x {args.rows_per_block} rows of {args.tokens} tokens, steps of {args.rows_per_step} rows, "
          f"{args.work_ms:g} ms/block, {args.step_ms:g} ms/step, {args.cpus} logical CPUs, repeat {args.repeat}"
          f"{' [smoke]' if args.smoke else ''}", flush=True)
    runs: list[dict[str, Any]] = []
    # address="local": a new instance, even while another process on this machine runs a Ray cluster
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        run_all(root, args, props, runs, cluster="1 node")
    finally:
        ray.shutdown()
    if args.nodes:
        from ray.cluster_utils import Cluster

        print(f"  on {args.nodes} nodes ({args.node_cpus} logical CPUs each):", flush=True)
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": args.node_cpus, "include_dashboard": False})
        ray._common.utils.reset_ray_address()  # so that no other ray.init() on this machine joins this cluster
        try:
            for _ in range(args.nodes - 1):
                nodes.add_node(num_cpus=args.node_cpus)
            nodes.wait_for_nodes(timeout=300)
            ray.init(address=nodes.address, configure_logging=False, log_to_driver=False)
            run_all(root, args, props, runs, cluster=f"{args.nodes} nodes")
        finally:
            ray.shutdown()
            nodes.shutdown()
    shutil.rmtree(root, ignore_errors=True)

    steps = args.blocks * args.rows_per_block // args.rows_per_step
    tables: list[Table] = []
    ratios: dict[str, dict[str, Any]] = {}
    for cluster in dict.fromkeys(r["cluster"] for r in runs):
        table, ratios[cluster] = summarize([r for r in runs if r["cluster"] == cluster], args, steps, cluster)
        tables.append(table)
    bad = [r for r in runs if r["steps"] != steps or (r["variant"] == "lakestream" and (r["head_step"] != steps or r["duplicates"]))]
    if bad:
        tables[-1].note(f"UNEXPECTED step counts: {bad}")
    run.finish(tables, {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "versions": {"ray": ray.__version__},
        "machine": machine(),
        "runs": runs,
        "ratios": ratios["1 node"],  # the single-node run's
        "ratios_by_cluster": ratios,
    }, out=args.out)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
