"""Disaggregated preprocessing: a trainer with a fixed CPU budget, fed by colocated DataLoader workers or by lakestream
producers on other cores.

The paper's speed-up comes from moving preprocessing off the GPU host, whose CPUs are scarce. Here the trainer process
and its colocated DataLoader workers are pinned with ``os.sched_setaffinity`` to ``k`` cores (``--k``; default 1 of 2
cores, 2 of 16: a GPU host's share); the lakestream producers run on the other ``cores - k`` cores, standing in for
other hosts. Both feeds run the same preprocessing, ``vs_colocated.py``'s (a JPEG decoded, random-resized-cropped and
resized to 3x128x128, a text WordPiece-tokenized), imported from it.

* colocated: ``DataLoader(num_workers=--workers, default k)`` in the trainer's process tree, all on the k cores;
* lakestream: ``--producers-per-core`` (default 2) producer processes per other core, pinned to those cores,
  preprocess and commit each batch as one step while the trainer trains (two per core: while one waits for its commit,
  the catalog's fsync or a group commit, the other preprocesses); the trainer reads the steps with
  ``LakestreamDataset(follow=True)`` on its k cores.

Where lakestream's data lives: its catalog and warehouse stand in for a catalog service and object storage on other
machines, so by default (``--warehouse memory``) they are on tmpfs, and writing a step costs the producers a copy into
memory, not this machine's file system (on some virtual machines a new MiB on disk costs several ms of kernel CPU:
``commit_cpu.py``). The stream is Parquet uncompressed by default (``--codec``): the steps are decoded pixels and token
ids, and decompressing them would cost the trainer's scarce cores; ``--codec zstd`` (Iceberg's default) shows that.

The training step: with ``torch.cuda.is_available()``, a real step of an MLP on the GPU (the batch's images as
floats, 3x128x128 -> 2048 -> 2048 -> 10, SGD), repeated to last the step time asked for; the batch is pinned
(DataLoader ``pin_memory=True``; lakestream: pinned by the dataset's ``transform`` in its prefetch thread) and
copied with ``non_blocking=True``. Without a GPU the step is a sleep, as in ``vs_colocated.py``.

The ratio of preprocessing cost to step time (``--ratios``, preprocessing of one batch on one core / step time) sets
which side bounds the trainer. Where preprocessing dominates, colocated steps/s are at most ``k / prep`` and
lakestream's at most ``(cores - k) / prep``: the upper bound of their ratio is ``(cores - k) / k``. Each feed's
steps/s is reported against its own bound ``min(1 / step, cores_it_has / prep)``.

Run: ``.venv/bin/python benchmarks/disaggregation.py`` (about 2-3 minutes on 2 cores) or ``--smoke`` (seconds).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing.forkserver
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_colocated as colo  # noqa: E402 - the preprocessing, the map dataset and the collate of the colocated baseline
from _common import RESULTS_DIR, Table, machine, percentile, write_json  # noqa: E402

CTX = colo.CTX  # forkserver: see vs_colocated.py (no locks or SQLite connections of the trainer cross into producers)
NAME = colo.NAME
HIDDEN = 2048


# ------------------------------------------------------------------------------------------------ the training step


class Step:
    """One training step of ``seconds``: a sleep, or (GPU) repeated real steps of a small MLP lasting about that."""

    def __init__(self, *, batch: int, gpu: bool) -> None:
        self.gpu = gpu
        self.one_s = 0.0
        if not gpu:
            return
        import torch

        self.torch = torch
        self.device = torch.device("cuda")
        dim = 3 * colo.IMG * colo.IMG
        self.model = torch.nn.Sequential(torch.nn.Linear(dim, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                         torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10)).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        x = torch.zeros(batch, 3, colo.IMG, colo.IMG, dtype=torch.uint8).pin_memory()
        for _ in range(3):
            self._model_step(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            self._model_step(x)
        torch.cuda.synchronize()
        self.one_s = (time.perf_counter() - t) / 10

    def _model_step(self, images: Any) -> None:
        torch = self.torch
        x = images.to(self.device, non_blocking=True).flatten(1).float().div_(255)
        loss = torch.nn.functional.cross_entropy(self.model(x), torch.zeros(x.shape[0], dtype=torch.long, device=self.device))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def reps(self, seconds: float) -> int:
        return max(1, round(seconds / self.one_s)) if self.gpu else 0

    def actual_s(self, seconds: float) -> float:
        """The step time ``seconds`` becomes (GPU: whole model steps)."""
        return self.reps(seconds) * self.one_s if self.gpu else seconds

    def run(self, item: dict[str, Any], seconds: float) -> None:
        if not self.gpu:
            int(item["image"][:, 0, 0, 0].sum())  # the trainer touches the data
            time.sleep(seconds)
            return
        for _ in range(self.reps(seconds)):
            self._model_step(item["image"])
        self.torch.cuda.synchronize()


def pin(item: dict[str, Any]) -> dict[str, Any]:
    """The batch's tensors in page-locked memory (the lakestream feed's ``transform``, run in its prefetch thread)."""
    return {k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in item.items()}


def train(batches: Any, *, steps: int, warmup: int, step: Step, step_s: float) -> dict[str, Any]:
    """``steps`` steps: wait for the batch (data time), then the training step. The first ``warmup`` are excluded."""
    it = iter(batches)
    data_s: list[float] = []
    ends: list[float] = []
    seen: list[int] = []
    cpu0 = time.process_time()
    started = time.monotonic()
    for _ in range(steps):
        t0 = time.monotonic()
        item = next(it)
        data_s.append(time.monotonic() - t0)
        seen.extend(int(i) for i in item["sample_id"])
        step.run(item, step_s)
        ends.append(time.monotonic())
    wall = ends[-1] - ends[warmup - 1]
    steady = data_s[warmup:]
    return {"steps": steps, "steps_per_s": (steps - warmup) / wall, "data_ms_mean": 1000 * sum(steady) / len(steady),
            "data_ms_p99": 1000 * percentile(steady, 99), "stall_fraction": sum(steady) / wall,
            "first_batch_s": ends[0] - started - step_s, "trainer_cpu_ms_per_step": 1000 * (time.process_time() - cpu0) / steps,
            "samples": len(seen), "unique_samples": len(set(seen))}


# ------------------------------------------------------------------------------------------------ feeds


def pinned_producer(cores: list[int], *args: Any) -> None:
    """A lakestream producer (vs_colocated.producer_main) on the producer cores."""
    os.sched_setaffinity(0, cores)
    colo.producer_main(*args)


class Bench:
    def __init__(self, args: argparse.Namespace, step: Step) -> None:
        self.args = args
        self.step = step
        # the warehouse and catalog stand in for object storage and a catalog service on other machines: in memory
        # (tmpfs) by default, so that writing them costs the producers what a copy into memory costs, not this
        # machine's file system (see --warehouse)
        self.tmp = Path(tempfile.mkdtemp(prefix="disaggregation-", dir=args.warehouse_dir))
        self.raw = colo.RawData(args.raw_images, args.raw_texts)
        self.all_cores = sorted(os.sched_getaffinity(0))
        self.trainer_cores = self.all_cores[: args.k]
        self.producer_cores = self.all_cores[args.k:]

    def close(self) -> None:
        os.sched_setaffinity(0, self.all_cores)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def prep_cost(self) -> float:
        """CPU seconds of one batch's preprocessing on one core, measured alone (on a trainer core)."""
        os.sched_setaffinity(0, self.trainer_cores[:1])
        try:
            n = max(8, self.args.batch)
            colo.preprocess(self.raw, 99_999)
            t = time.thread_time()  # CPU, not wall: other work on a shared machine does not inflate it
            for i in range(n):
                colo.preprocess(self.raw, i)
            return (time.thread_time() - t) / n * self.args.batch
        finally:
            os.sched_setaffinity(0, self.all_cores)

    def colocated(self, step_s: float, steps: int) -> dict[str, Any]:
        import torch

        workers = self.args.workers
        os.sched_setaffinity(0, self.trainer_cores)  # the trainer and the workers it forks
        try:
            loader = torch.utils.data.DataLoader(
                colo.MapDataset(self.raw, steps * self.args.batch), batch_size=self.args.batch,
                num_workers=workers, prefetch_factor=2 if workers else None,
                multiprocessing_context="fork" if workers else None, pin_memory=self.step.gpu)
            result = train(loader, steps=steps, warmup=self.args.warmup, step=self.step, step_s=step_s)
            del loader
        finally:
            os.sched_setaffinity(0, self.all_cores)
        return {**result, "feed": "colocated", "workers": workers}

    def lakestream(self, step_s: float, steps: int, label: str) -> dict[str, Any]:
        from lakestream_iceberg import Stream
        from lakestream_iceberg.read.dataset import LakestreamDataset

        root = self.tmp / label
        (root / "warehouse").mkdir(parents=True)
        catalog = colo.sqlite_catalog(str(root))
        Stream.create(catalog, NAME, schema=colo.SCHEMA, world_size=1,
                      properties={"write.parquet.compression-codec": self.args.codec})
        catalog.engine.dispose()
        producers = len(self.producer_cores) * self.args.producers_per_core
        quota = math.ceil(steps / producers)
        out = CTX.Queue()
        procs = [CTX.Process(target=pinned_producer, daemon=True,
                             args=(self.producer_cores, str(root), i, producers, quota, self.args.batch, self.raw, out))
                 for i in range(producers)]
        os.sched_setaffinity(0, self.trainer_cores)
        try:
            for proc in procs:
                proc.start()
            dataset = LakestreamDataset(Stream.open(colo.sqlite_catalog(str(root)), NAME), rank=0, world_size=1,
                                        follow=True, timeout=300.0, prefetch=2, poll_s=0.005, max_poll_s=0.05,
                                        collate=colo.lake_collate, transform=pin if self.step.gpu else None)
            try:
                result = train(dataset, steps=steps, warmup=self.args.warmup, step=self.step, step_s=step_s)
            finally:
                dataset.close()
            reports = [out.get(timeout=120) for _ in procs]
            errors = [r["error"] for r in reports if "error" in r]
            if errors:
                raise RuntimeError(f"producer failed:\n{errors[0]}")
        finally:
            os.sched_setaffinity(0, self.all_cores)
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.join(5)
            shutil.rmtree(root, ignore_errors=True)
        return {**result, "feed": "lakestream", "producers": producers,
                "producer_prep_s_per_batch": sum(r["prep_s"] for r in reports) / max(1, sum(r["batches"] for r in reports))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny settings: runs in seconds, for the test suite")
    ap.add_argument("--k", type=int, default=None, help="trainer cores (default 1 up to 8 cores, else cores // 8)")
    ap.add_argument("--workers", type=int, default=None, help="colocated DataLoader workers (default k)")
    ap.add_argument("--producers-per-core", type=int, default=2,
                    help="lakestream producer processes per producer core (default 2: while one waits for its commit, "
                         "e.g. the catalog's fsync, the other preprocesses; a DataLoader worker never waits on I/O)")
    ap.add_argument("--ratios", default=None,
                    help="preprocessing of a batch on one core / step time (default 0.5,1,2,4, and 2 x (cores - k) where "
                         "that is more: the ratio at which preprocessing bounds the lakestream feed too)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per run (default: 3 s at the faster feed's bound, at least 40, at most 2000)")
    ap.add_argument("--batch", type=int, default=None, help="samples per step (default 32)")
    ap.add_argument("--cpu", action="store_true", help="a sleep for the step even when a GPU is available")
    ap.add_argument("--warehouse", choices=["memory", "disk"], default="memory",
                    help="where lakestream's catalog and warehouse live, standing in for services on other machines: "
                         "tmpfs (/dev/shm, default) or the temporary directory's file system")
    ap.add_argument("--codec", default="uncompressed",
                    help="the stream's Parquet codec (write.parquet.compression-codec). Default uncompressed: the "
                         "batches are decoded pixels and token ids, and every codec costs the trainer's scarce cores "
                         "its decompression (the colocated feed hands its tensors over as they are); zstd, Iceberg's "
                         "default, shows that cost")
    ap.add_argument("--out", default=str(RESULTS_DIR / "disaggregation.json"))
    args = ap.parse_args(argv)
    args.cores = cores
    args.warehouse_dir = None
    if args.warehouse == "memory":
        if not Path("/dev/shm").is_dir():
            ap.error("--warehouse memory needs /dev/shm (tmpfs); use --warehouse disk")
        args.warehouse_dir = "/dev/shm"
    args.k = args.k or (1 if cores <= 8 else cores // 8)
    if not 1 <= args.k < cores:
        ap.error(f"--k must leave at least one of the {cores} cores to the producers")
    args.workers = args.workers if args.workers is not None else args.k
    if args.ratios is None:
        args.ratios = [2.0] if args.smoke else [0.5, 1.0, 2.0, 4.0]  # smoke: one ratio runs every part
        if not args.smoke and 2 * (cores - args.k) > 4:
            args.ratios.append(float(2 * (cores - args.k)))
    else:
        args.ratios = [float(r) for r in args.ratios.split(",")]
    if args.smoke:
        args.steps = args.steps or 10
    args.batch = args.batch or (8 if args.smoke else 32)
    args.warmup = 2 if args.smoke else 5
    args.raw_images, args.raw_texts = (8, 8) if args.smoke else (64, 64)
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    args = parse_args(argv)
    started = time.monotonic()
    CTX.set_forkserver_preload(["__main__", "lakestream_iceberg", "pyiceberg.catalog.sql", "PIL.Image", "vs_colocated"])
    multiprocessing.forkserver.ensure_running()
    gpu = torch.cuda.is_available() and not args.cpu
    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    step = Step(batch=args.batch, gpu=gpu)
    bench = Bench(args, step)
    load_at_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    try:
        prep_s = bench.prep_cost()
        bound = (args.cores - args.k) / args.k
        print(f"disaggregation: {args.cores} cores (trainer and its DataLoader workers on {bench.trainer_cores}, "
              f"producers on {bench.producer_cores}); GPU: {gpu_name}; step: "
              f"{'MLP on the GPU, ' + f'{step.one_s * 1000:.2f} ms per model step' if gpu else 'sleep'}; batch {args.batch}, "
              f"preprocessing {prep_s * 1000:.0f} ms per batch on one core; bound (cores - k) / k = {bound:.2f}"
              f"{' [smoke]' if args.smoke else ''}", flush=True)
        for ratio in args.ratios:
            step_s = step.actual_s(prep_s / ratio)
            colo_bound = min(1 / step_s, args.k / prep_s)
            lake_bound = min(1 / step_s, (args.cores - args.k) / prep_s)
            steps = args.steps or max(40, min(2000, math.ceil(3 * lake_bound)))
            colocated = bench.colocated(step_s, steps)
            lake = bench.lakestream(step_s, steps, f"r{ratio:g}")
            row = {"ratio": ratio, "step_ms": step_s * 1000, "steps": steps, "colocated": colocated, "lakestream": lake,
                   "colocated_bound": colo_bound, "lakestream_bound": lake_bound,
                   "speedup": lake["steps_per_s"] / colocated["steps_per_s"], "speedup_bound": lake_bound / colo_bound}
            rows.append(row)
            print(f"  prep/step {ratio:g} (step {step_s * 1000:.0f} ms): colocated {colocated['steps_per_s']:.2f} steps/s "
                  f"({colocated['steps_per_s'] / colo_bound:.2f} of its bound), lakestream {lake['steps_per_s']:.2f} "
                  f"({lake['steps_per_s'] / lake_bound:.2f}), ratio {row['speedup']:.2f} of {row['speedup_bound']:.2f}",
                  flush=True)
    finally:
        bench.close()
    table = Table(f"trainer steps/s with k={args.k} of {args.cores} cores for the trainer (+ colocated workers), "
                  f"lakestream producers on the other {args.cores - args.k}; GPU: {gpu_name}; batch {args.batch}, "
                  f"first {args.warmup} steps of each run excluded",
                  ["prep/step", "step ms", "colocated steps/s", "of its bound", "lakestream steps/s", "of its bound",
                   "lake/colocated", "bound of ratio", "ratio / bound", "lake data ms p99", "colocated stall",
                   "lake stall"])
    for r in rows:
        c, lk = r["colocated"], r["lakestream"]
        table.add(r["ratio"], r["step_ms"], c["steps_per_s"], c["steps_per_s"] / r["colocated_bound"], lk["steps_per_s"],
                  lk["steps_per_s"] / r["lakestream_bound"], r["speedup"], r["speedup_bound"],
                  r["speedup"] / r["speedup_bound"], lk["data_ms_p99"], c["stall_fraction"], lk["stall_fraction"])
    table.note(f"bound of a feed = min(1 / step, its cores / preprocessing of a batch); where preprocessing dominates the "
               f"ratio's bound is (cores - k) / k = {(args.cores - args.k) / args.k:.2f}. Preprocessing: "
               f"{prep_s * 1000:.0f} ms per batch on one core, measured alone.")
    table.note(f"load average at start {load_at_start[0]:.1f} (this machine may be shared: figures are noisy); "
               f"colocated DataLoader num_workers={args.workers}, {len(bench.producer_cores) * args.producers_per_core} "
               "lakestream producer processes.")
    print()
    print(table)
    print()
    path = write_json(Path(args.out).name, {
        "benchmark": "disaggregation",
        "smoke": args.smoke,
        "wall_s": time.monotonic() - started,
        "loadavg_at_start": load_at_start,
        "config": {k: getattr(args, k) for k in ("cores", "k", "workers", "producers_per_core", "ratios", "batch",
                                                 "warmup", "raw_images", "raw_texts", "warehouse",
                                                 "codec")},
        "trainer_cores": bench.trainer_cores,
        "producer_cores": bench.producer_cores,
        "gpu": gpu_name,
        "step": {"kind": "gpu-mlp" if gpu else "sleep", "model_step_ms": step.one_s * 1000 if gpu else None},
        "prep_ms_per_batch": prep_s * 1000,
        "bound": (args.cores - args.k) / args.k,
        "machine": machine(),
        "rows": rows,
        "tables": [table.to_json()],
        "printed": str(table),
    }, directory=Path(args.out).parent)
    print(f"wrote {path} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
