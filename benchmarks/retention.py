"""Retention benchmark: storage, file count and metadata size over 20,000 steps, with and without lifecycle GC.

Two streams in one embedded SQLite catalog + local warehouse (a temp dir), fed in lockstep by one producer each
(world_size 4, small shards). Both take a checkpoint every ``--every`` steps (``stream.checkpoint(f"ckpt-{step}",
step=step)``); the GC stream then runs ``collect_garbage(dry_run=False, keep_last=2, grace=timedelta(0),
allow_short_grace=True)`` (no commit is in flight then), the no-GC stream never releases a checkpoint nor collects.
Every ``--every`` steps both table locations are walked: bytes and file counts of data files, manifests, manifest lists and metadata.json files, the size of the current
metadata.json and the commit-latency p50 of the window.

At the end the GC stream is checked: 50 random steps >= the oldest retained checkpoint's step read back identical
(all ranks), 50 random older steps raise ``StepCollectedError``, and the data files on disk are exactly the retained
steps' files.

    python benchmarks/retention.py            # 20,000 steps
    python benchmarks/retention.py --quick    # 2,000 steps

Writes ``benchmarks/results/retention.json`` and ``benchmarks/results/retention.png``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow as pa  # noqa: E402
from _common import RESULTS_DIR as RESULTS  # noqa: E402
from _common import median, sqlite_catalog, write_json  # noqa: E402
from pyiceberg.catalog.sql import SqlCatalog  # noqa: E402

from lakestream_iceberg import Stream  # noqa: E402
from lakestream_iceberg.errors import StepCollectedError  # noqa: E402

WORLD_SIZE = 4
ROWS_PER_RANK = 4
TOKENS = 16
KINDS = ("data", "manifest", "manifest-list", "metadata.json", "other")
SCHEMA = pa.schema([("tokens", pa.list_(pa.int32())), ("sample_id", pa.int64())])


def shards_for(step: int) -> list[pa.Table]:
    """Deterministic shards of one step (so any read can be checked byte for byte against a regeneration)."""
    out = []
    for rank in range(WORLD_SIZE):
        base = (step * WORLD_SIZE + rank) * ROWS_PER_RANK
        ids = list(range(base, base + ROWS_PER_RANK))
        tokens = [[(i * 31 + t) % 50_000 for t in range(TOKENS)] for i in ids]
        out.append(pa.table({"tokens": pa.array(tokens, pa.list_(pa.int32())), "sample_id": pa.array(ids, pa.int64())}))
    return out


def local_path(location: str) -> str:
    parsed = urlparse(location)
    return parsed.path if parsed.scheme else location


def kind_of(path: str) -> str:
    name = os.path.basename(path)
    if name.endswith(".parquet"):
        return "data"
    if name.endswith(".metadata.json"):
        return "metadata.json"
    if name.startswith("snap-") and name.endswith(".avro"):
        return "manifest-list"
    if name.endswith(".avro"):
        return "manifest"
    return "other"


def walk(location: str) -> dict[str, dict[str, int]]:
    files = {k: 0 for k in KINDS}
    size = {k: 0 for k in KINDS}
    for root, _dirs, names in os.walk(local_path(location)):
        for name in names:
            kind = kind_of(name)
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            files[kind] += 1
            size[kind] += st.st_size
    return {"files": files, "bytes": size}


def p50(values: list[float]) -> float | None:
    return median(values) if values else None


class Run:
    """One stream and its producer, sampled every window."""

    def __init__(self, catalog: SqlCatalog, name: str, *, gc: bool) -> None:
        self.name = name
        self.gc = gc
        self.stream = Stream.create(catalog, f"bench.{name}", schema=SCHEMA, world_size=WORLD_SIZE)
        self.producer = self.stream.producer(f"prep-{name}")
        self.latencies: list[float] = []
        self.control_s: list[float] = []  # checkpoint (+ GC) time of each window
        self.samples: list[dict] = []
        self.gc_reports: list[dict] = []

    def commit(self, step: int) -> None:
        result = self.producer.commit(shards_for(step))
        if result.step != step:
            raise RuntimeError(f"{self.name}: expected step {step}, got {result.step}")
        self.latencies.append(result.latency_s)

    def window_end(self, step: int, keep_last: int) -> None:
        peak = walk(self.stream.table.metadata.location) if self.gc else None  # the sawtooth's top, before GC
        started = time.monotonic()
        self.stream.checkpoint(f"ckpt-{step}", step=step)
        gc_s = None
        if self.gc:
            t0 = time.monotonic()
            report = self.stream.collect_garbage(dry_run=False, keep_last=keep_last, grace=timedelta(0),
                                                 allow_short_grace=True)  # quiescent: commits run in lockstep
            gc_s = time.monotonic() - t0
            self.gc_reports.append({"step": step, "seconds": gc_s, "collected_below": report.collected_below,
                                    "released": report.released_checkpoints, "snapshots_expired": report.snapshots_expired,
                                    "files_deleted": report.files_deleted, "bytes_deleted": report.bytes_deleted,
                                    "files_in_grace": report.files_in_grace})
        control = time.monotonic() - started
        self.stream.refresh()
        md = self.stream.table.metadata
        usage = walk(md.location)
        self.samples.append({
            "step": step,
            "bytes": usage["bytes"], "files": usage["files"],
            "total_bytes": sum(usage["bytes"].values()), "total_files": sum(usage["files"].values()),
            "pre_gc_total_bytes": sum((peak or usage)["bytes"].values()),
            "pre_gc_total_files": sum((peak or usage)["files"].values()),
            "metadata_json_bytes": os.path.getsize(local_path(self.stream.table.metadata_location)),
            "snapshots": len(md.snapshots), "refs": len(md.refs), "metadata_log": len(md.metadata_log),
            "commit_p50_ms": 1000 * p50(self.latencies), "commit_p99_ms": 1000 * sorted(self.latencies)[int(0.99 * (len(self.latencies) - 1))],
            "checkpoint_gc_s": control, "gc_s": gc_s,
        })
        self.latencies = []


def verify(run: Run, head: int, rng: random.Random) -> dict:
    """Steps >= the oldest retained checkpoint read back identical; older ones raise StepCollectedError."""
    stream = run.stream
    checkpoints = stream.checkpoints()
    oldest = min(c.step for c in checkpoints)
    live = sorted(rng.sample(range(oldest, head + 1), min(50, head - oldest + 1)))
    bad_reads = []
    for step in live:
        expected = shards_for(step)
        for rank in range(WORLD_SIZE):
            try:
                got = stream.read(step, rank=rank)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                bad_reads.append(f"{step}/{rank}: {type(exc).__name__}: {exc}")
                continue
            if not got.equals(expected[rank]):
                bad_reads.append(f"{step}/{rank}: content differs")
    old = sorted(rng.sample(range(1, oldest), min(50, oldest - 1))) if oldest > 1 else []
    not_collected = []
    for step in old:
        try:
            stream.read(step, rank=rng.randrange(WORLD_SIZE))
            not_collected.append(f"{step}: readable")
        except StepCollectedError:
            pass
        except Exception as exc:  # noqa: BLE001
            not_collected.append(f"{step}: {type(exc).__name__}")
    # Physically: the data files on disk are exactly those of the retained steps.
    on_disk = walk(stream.table.metadata.location)["files"]["data"]
    expected_files = (head - oldest + 1) * WORLD_SIZE
    return {
        "checkpoints": [c.name for c in checkpoints], "oldest_retained_step": oldest, "head_step": head,
        "live_steps_sampled": len(live), "live_failures": bad_reads,
        "old_steps_sampled": len(old), "old_failures": not_collected,
        "data_files_on_disk": on_disk, "data_files_expected": expected_files,
        "ok": not bad_reads and not not_collected and on_disk == expected_files,
    }


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def print_table(runs: list[Run]) -> None:
    header = (f"{'run':5} {'step':>6} {'MiB':>8} {'files':>6} {'data':>6} {'mfst':>5} {'mlist':>5} {'meta':>5} "
              f"{'preGC MiB':>9} {'preGC files':>11} {'data MiB':>8} {'mfst KiB':>8} {'mjson KiB':>9} {'cur.mj KiB':>10} {'snaps':>5} {'p50 ms':>7} {'p99 ms':>7} {'ckpt+gc s':>9}")
    print(header)
    print("-" * len(header))
    for run in runs:
        n = len(run.samples)
        picks = sorted({i for i in range(n) if n <= 12 or i % max(1, n // 10) == max(1, n // 10) - 1} | {0, n - 1})
        for i in picks:
            s = run.samples[i]
            f, b = s["files"], s["bytes"]
            print(f"{run.name:5} {s['step']:>6} {mib(s['total_bytes'])} {s['total_files']:>6} {f['data']:>6} {f['manifest']:>5} "
                  f"{f['manifest-list']:>5} {f['metadata.json']:>5} {mib(s['pre_gc_total_bytes']):>9} {s['pre_gc_total_files']:>11} {mib(b['data'])} "
                  f"{(b['manifest'] + b['manifest-list']) / 1024:>8.1f} {b['metadata.json'] / 1024:>9.1f} "
                  f"{s['metadata_json_bytes'] / 1024:>10.1f} {s['snapshots']:>5} {s['commit_p50_ms']:>7.1f} "
                  f"{s['commit_p99_ms']:>7.1f} {s['checkpoint_gc_s']:>9.2f}")
        print()


def boundedness(run: Run, steps: int) -> dict:
    """Ratios at the end vs at ~10% of the run (2k of 20k), plus the max over the second half vs the first half."""
    samples = run.samples
    ref = min(samples, key=lambda s: abs(s["step"] - max(steps // 10, samples[0]["step"])))
    last = samples[-1]
    half = [s for s in samples if s["step"] > steps // 2]
    first = [s for s in samples if s["step"] <= steps // 2]
    out = {"ref_step": ref["step"], "end_step": last["step"]}
    for key in ("total_bytes", "total_files", "pre_gc_total_bytes", "pre_gc_total_files", "metadata_json_bytes"):
        out[f"{key}_end_over_ref"] = last[key] / ref[key] if ref[key] else None
        if half and first:
            out[f"{key}_max2nd_over_max1st"] = max(s[key] for s in half) / max(s[key] for s in first)
    return out


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [
        ("storage (MiB)", lambda s: s["total_bytes"] / 2**20, lambda s: s["pre_gc_total_bytes"] / 2**20),
        ("files under table location", lambda s: s["total_files"], lambda s: s["pre_gc_total_files"]),
        ("current metadata.json (KiB)", lambda s: s["metadata_json_bytes"] / 1024, None),
        ("commit latency p50 (ms)", lambda s: s["commit_p50_ms"], None),
    ]
    for ax, (title, fn, pre) in zip(axes.flat, panels):
        for run in runs:
            xs = [s["step"] for s in run.samples]
            line, = ax.plot(xs, [fn(s) for s in run.samples], marker=".",
                            label=f"{run.name} ({'keep_last=2' if run.gc else 'no GC'}){', after GC' if run.gc and pre else ''}")
            if run.gc and pre is not None:
                ax.plot(xs, [pre(s) for s in run.samples], ls="--", color=line.get_color(), label=f"{run.name}, before GC")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"lakestream retention: world_size {WORLD_SIZE}, checkpoint every {runs[0].samples[0]['step']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="2,000 steps")
    parser.add_argument("--every", type=int, default=500, help="checkpoint / sample interval")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    steps = 2_000 if args.quick else args.steps
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="lakestream-retention-") as tmp:
        catalog = sqlite_catalog(tmp)
        runs = [Run(catalog, "gc", gc=True), Run(catalog, "nogc", gc=False)]
        started = time.monotonic()
        for step in range(1, steps + 1):
            for run in runs:  # interleaved: both runs see the same machine load
                run.commit(step)
            if step % args.every == 0:
                for run in runs:
                    run.window_end(step, args.keep_last)
                gc, nogc = runs[0].samples[-1], runs[1].samples[-1]
                print(f"[{time.monotonic() - started:7.1f}s] step {step}: gc {mib(gc['total_bytes'])} MiB {gc['total_files']} files"
                      f" p50 {gc['commit_p50_ms']:.1f} ms (ckpt+gc {gc['checkpoint_gc_s']:.2f}s) | nogc {mib(nogc['total_bytes'])} MiB"
                      f" {nogc['total_files']} files p50 {nogc['commit_p50_ms']:.1f} ms", file=sys.stderr, flush=True)
        elapsed = time.monotonic() - started
        check = verify(runs[0], steps, rng)

    print(f"\nretention: {steps} steps, world_size {WORLD_SIZE}, {ROWS_PER_RANK} rows x {TOKENS} tokens per rank, "
          f"checkpoint every {args.every}, GC keep_last={args.keep_last} grace=0; {elapsed:.0f}s for both runs\n")
    print_table(runs)
    bounds = {run.name: boundedness(run, steps) for run in runs}
    for name, b in bounds.items():
        extra = ""
        if "total_bytes_max2nd_over_max1st" in b:
            extra = (f"; max 2nd half / max 1st half: bytes {b['total_bytes_max2nd_over_max1st']:.2f}x, "
                     f"files {b['total_files_max2nd_over_max1st']:.2f}x, metadata.json {b['metadata_json_bytes_max2nd_over_max1st']:.2f}x")
        print(f"bounded [{name}]: step {b['end_step']} / step {b['ref_step']}: bytes {b['total_bytes_end_over_ref']:.2f}x "
              f"(before GC {b['pre_gc_total_bytes_end_over_ref']:.2f}x), "
              f"files {b['total_files_end_over_ref']:.2f}x, metadata.json {b['metadata_json_bytes_end_over_ref']:.2f}x{extra}")
    gc_times = [r["seconds"] for r in runs[0].gc_reports]
    if gc_times:
        print(f"collect_garbage: {len(gc_times)} runs, p50 {statistics.median(gc_times):.2f}s, max {max(gc_times):.2f}s")
    print(f"verify [gc]: {'OK' if check['ok'] else 'FAIL'}: checkpoints {check['checkpoints']}, oldest retained step "
          f"{check['oldest_retained_step']}, head {check['head_step']}; {check['live_steps_sampled']} sampled steps >= "
          f"{check['oldest_retained_step']} read identical on all ranks ({len(check['live_failures'])} failures), "
          f"{check['old_steps_sampled']} sampled older steps raised StepCollectedError ({len(check['old_failures'])} did not); "
          f"data files on disk {check['data_files_on_disk']} (expected {check['data_files_expected']})")
    for line in check["live_failures"][:5] + check["old_failures"][:5]:
        print(f"  {line}")

    result = {
        "benchmark": "retention", "steps": steps, "world_size": WORLD_SIZE, "rows_per_rank": ROWS_PER_RANK,
        "tokens_per_row": TOKENS, "checkpoint_every": args.every, "keep_last": args.keep_last, "elapsed_s": elapsed,
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "runs": {run.name: {"gc": run.gc, "samples": run.samples, "gc_reports": run.gc_reports} for run in runs},
        "bounded": bounds, "verify": check,
    }
    path = write_json("retention", result, directory=args.out)
    plot(runs, args.out / "retention.png")
    print(f"wrote {path} and {args.out / 'retention.png'}")
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
