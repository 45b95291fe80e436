"""Commit scaling of lakestream: history growth, producer contention, and a simulation of the DAC policy.

One command runs all three phases, prints their tables, writes ``benchmarks/results/commit_scaling.json`` and
``benchmarks/results/commit_scaling.png``::

    .venv/bin/python benchmarks/commit_scaling.py            # full run (~15 min on 2 cores)
    .venv/bin/python benchmarks/commit_scaling.py --quick    # a ~3 min smoke run with the same code paths
    .venv/bin/python benchmarks/commit_scaling.py --phases growth --steps 5000

1. **growth**: one producer commits ``--steps`` steps (world size 8, one tiny shard per rank) into a lakestream on a
   SQLite catalog; p50/p99 of ``Producer.commit()`` per ``--window`` steps. Against it, plain pyiceberg
   ``table.append`` on a table of the same schema and partitioning (``_step``, ``_rank`` identity: 8 files per step).
   The plain loop's commit cost grows with every snapshot (about 0.75 ms per snapshot here, so a 2,000-step loop
   takes ~25 min); by default (``--plain-mode sampled``) its history is therefore built by a fast filler that commits
   exactly what ``append`` would (one manifest of 8 files per snapshot, a manifest list carrying every earlier
   manifest, pyiceberg's summary, 20 snapshots per catalog commit) and real ``table.append`` calls are timed at
   ``--plain-points``. ``--plain-mode loop`` times every step of a real append loop instead.
2. **contention**: P producer processes (``multiprocessing`` spawn, started once and reused) commit back to back for
   ``--duration`` seconds on SQLite and on PostgreSQL (``catalog.services.Postgres``); each freezes its set-up
   (``gc.freeze()``, as docs/guide/producers.md advises) before the window. Policies: ``dac`` (lakestream,
   ``Stream.producer`` as shipped: DAC with group commit), ``dac-single`` (the same loop and policy with
   ``lakestream.commit.group.enabled=false``: one batch per compare-and-swap, round-robin pacing), ``fixed``
   (lakestream's loop, one batch per swap, no pacing, constant retry delay) and ``pyiceberg`` (plain ``table.append``
   with pyiceberg's default ``commit.retry.num-retries`` = 4), and ``apart``: every producer alone on a stream of its
   own (on SQLite with a database file of its own), nothing shared, the ceiling the machine's cores set for P
   processes that commit (a shared stream can at best come near it). Per point: aggregate commits/s (published batches),
   failed commits, p50/p99 of the commit call, Jain's index over per-producer commits in the window, swaps per
   commit, batches carried by another producer's group commit, batches per winning swap. ``--repeat N`` measures
   every point N times, interleaved, and judges the targets on the median of each repetition's ratio to its own P=1
   run (the machine's speed drifts by tens of percent between points on a shared host).
3. **simulation**: :mod:`dac_sim` runs the pure ``CommitPolicy`` on a virtual clock for 64..1,024 producers with a
   critical-section distribution fitted (lognormal) to the single-producer attempts measured in phase 2.

Latency is the wall time of one ``commit()``/``append()`` call (data file writes, pacing and retries included).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from _common import RESULTS_DIR, Children, Parent, Table, jain_index, percentile, print_tables, ratio_of, sqlite_props, start_postgres, timed, write_json  # noqa: E402

WORLD_SIZE = 8
ROWS_PER_SHARD = 4
NS = "bench"


# ================================================================================================ catalogs


def load_sql_catalog(props: dict[str, str]) -> Any:
    from pyiceberg.catalog.sql import SqlCatalog

    rest = {k: v for k, v in props.items() if k != "type"}
    return SqlCatalog("bench", **rest)


# ================================================================================================ tables


def payload_schema() -> Any:
    import pyarrow as pa

    return pa.schema([pa.field("x", pa.int64())])


def shards_for(step_hint: int) -> list[Any]:
    import pyarrow as pa

    return [pa.table({"x": pa.array([step_hint * 100 + r * 10 + i for i in range(ROWS_PER_SHARD)], pa.int64())})
            for r in range(WORLD_SIZE)]


def create_stream(catalog: Any, name: str, *, group_commit: bool = True) -> Any:
    from lakestream_iceberg import Stream
    from lakestream_iceberg.format.layout import PROP_GROUP_COMMIT

    return Stream.create(catalog, f"{NS}.{name}", schema=payload_schema(), world_size=WORLD_SIZE,
                         properties={PROP_GROUP_COMMIT: str(group_commit).lower()})


def create_plain_table(catalog: Any, name: str) -> Any:
    """A plain Iceberg table with the same columns and (_step, _rank) identity partitioning as a stream."""
    from pyiceberg.exceptions import NamespaceAlreadyExistsError
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import Schema
    from pyiceberg.transforms import IdentityTransform
    from pyiceberg.types import IntegerType, LongType, NestedField

    with contextlib.suppress(NamespaceAlreadyExistsError):
        catalog.create_namespace(NS)
    schema = Schema(NestedField(1, "x", LongType(), required=False), NestedField(2, "_step", LongType(), required=False),
                    NestedField(3, "_rank", IntegerType(), required=False))
    spec = PartitionSpec(PartitionField(2, 1000, IdentityTransform(), "_step"),
                         PartitionField(3, 1001, IdentityTransform(), "_rank"))
    return catalog.create_table(f"{NS}.{name}", schema=schema, partition_spec=spec)


def plain_frame(step: int) -> Any:
    import pyarrow as pa

    n = WORLD_SIZE * ROWS_PER_SHARD
    return pa.table({
        "x": pa.array(range(step * n, step * n + n), pa.int64()),
        "_step": pa.array([step] * n, pa.int64()),
        "_rank": pa.array([i // ROWS_PER_SHARD for i in range(n)], pa.int32()),
    })


def metadata_size(table: Any) -> int:
    path = table.metadata_location
    try:
        return len(table.io.new_input(path).open().read())
    except Exception:  # noqa: BLE001
        return -1


# ================================================================================================ phase 1: growth


def at_step(latencies: list[float], step: int, half: int = 50) -> float:
    """p50 of the commits of steps ``step-half+1 .. step+half`` (1-based steps; clipped to what exists)."""
    lo = max(0, step - half)
    hi = min(len(latencies), step + half)
    if hi - lo < 5:
        lo, hi = max(0, len(latencies) - 2 * half), len(latencies)
    return percentile(latencies[lo:hi], 50)


def run_lakestream_growth(root: Path, steps: int, window: int, profile_last: int) -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    catalog = load_sql_catalog(sqlite_props(root / "ls"))
    stream = create_stream(catalog, "growth")
    producer = stream.producer("grow-0", seed=1)
    latencies: list[float] = []
    cpu: list[float] = []  # process CPU time of each commit (all threads): robust against other tenants of the machine
    attempts: list[int] = []
    windows: list[dict[str, Any]] = []
    payload = shards_for(0)
    profiler = cProfile.Profile() if profile_last else None
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        c0 = time.process_time()
        result = producer.commit(payload)
        cpu.append(time.process_time() - c0)
        latencies.append(result.latency_s)
        attempts.append(result.attempts)
        if step % window == 0 or step == steps:
            w = latencies[-window:]
            table = producer._loop.table  # noqa: SLF001 - the producer's own view: its metadata is the head
            md = table.metadata
            head = md.snapshot_by_name("main")
            windows.append({
                "steps": f"{step - len(w) + 1}-{step}", "end_step": step, "p50_s": percentile(w, 50),
                "p99_s": percentile(w, 99), "max_s": max(w), "cpu_p50_s": percentile(cpu[-window:], 50),
                "metadata_bytes": metadata_size(table),
                "snapshots": len(md.snapshots), "manifests": len(stream.cache.manifests(stream.io, head)) if head else 0,
            })
            print(f"[growth] lakestream {step:>6}/{steps}: p50 {windows[-1]['p50_s'] * 1000:6.1f} ms  "
                  f"p99 {windows[-1]['p99_s'] * 1000:7.1f} ms  cpu p50 {windows[-1]['cpu_p50_s'] * 1000:6.1f} ms  "
                  f"metadata {windows[-1]['metadata_bytes'] / 1024:6.1f} KiB  "
                  f"({time.monotonic() - t0:5.0f} s)", flush=True)
    slowest = sorted(range(len(latencies)), key=latencies.__getitem__)[-5:]
    if profiler is not None:  # extra commits after the measured ones: profiling overhead stays out of the numbers
        profiler.enable()
        for _ in range(profile_last):
            producer.commit(payload)
        profiler.disable()
    profile_text = None
    if profiler is not None:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(30)
        profile_text = buf.getvalue()
    head = stream.state(refresh=True).step
    return {"latencies_s": latencies, "cpu_s": cpu, "attempts": attempts, "windows": windows, "head_step": head,
            "slowest": [{"step": i + 1, "latency_s": latencies[i]} for i in sorted(slowest)],
            "elapsed_s": time.monotonic() - t0, "profile_last_commits": profile_text}


class PlainFiller:
    """Builds a plain table's history the way ``table.append`` would, without pyiceberg's per-commit overhead.

    Per step: 8 data files (one per (_step, _rank) partition, real Parquet), one manifest of them, a manifest list
    holding every earlier manifest plus the new one (pyiceberg's fast append, no manifest merging), and pyiceberg's
    snapshot summary; ``batch`` snapshots go to the catalog in one ``commit_table`` (AddSnapshot + SetSnapshotRef each,
    so the snapshot log matches too).
    """

    def __init__(self, table: Any) -> None:
        self.table = table

    def fill(self, upto: int, *, first_step: int, batch: int = 20) -> int:
        import uuid

        import pyarrow.parquet as pq
        from pyiceberg.io.pyarrow import parquet_file_to_data_file
        from pyiceberg.manifest import ManifestEntry, ManifestEntryStatus, write_manifest, write_manifest_list
        from pyiceberg.table.refs import SnapshotRefType
        from pyiceberg.table.snapshots import (
            Operation,
            Snapshot,
            SnapshotSummaryCollector,
            Summary,
            update_snapshot_summaries,
        )
        from pyiceberg.table.update import AddSnapshotUpdate, AssertRefSnapshotId, SetSnapshotRefUpdate

        table = self.table
        step = first_step
        while step <= upto:
            table.refresh()
            md = table.metadata
            parent = md.current_snapshot()
            manifests = list(parent.manifests(table.io)) if parent else []
            parent_id = parent.snapshot_id if parent else None
            prev_summary = parent.summary if parent else None
            seq = md.next_sequence_number()
            updates: list[Any] = []
            base_parent = parent_id
            location = md.location.rstrip("/")
            for _ in range(min(batch, upto - step + 1)):
                snapshot_id = random.getrandbits(62)
                frame = plain_frame(step)
                files = []
                for rank in range(WORLD_SIZE):
                    part = frame.slice(rank * ROWS_PER_SHARD, ROWS_PER_SHARD)
                    path = f"{location}/data/_step={step}/_rank={rank}/{uuid.uuid4().hex}.parquet"
                    Path(path.removeprefix("file://")).parent.mkdir(parents=True, exist_ok=True)
                    pq.write_table(part, path.removeprefix("file://"))
                    files.append(parquet_file_to_data_file(table.io, md, path))
                mpath = f"{location}/metadata/{uuid.uuid4()}-m0.avro"
                with write_manifest(format_version=md.format_version, spec=md.spec(), schema=md.schema(),
                                    output_file=table.io.new_output(mpath), snapshot_id=snapshot_id,
                                    avro_compression="deflate") as writer:
                    for f in files:
                        writer.add_entry(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=snapshot_id,
                                                                 sequence_number=None, file_sequence_number=None, data_file=f))
                new_manifest = writer.to_manifest_file()
                manifests = [new_manifest, *manifests]
                lpath = f"{location}/metadata/snap-{snapshot_id}-0-{uuid.uuid4()}.avro"
                with write_manifest_list(format_version=md.format_version, output_file=table.io.new_output(lpath),
                                         snapshot_id=snapshot_id, parent_snapshot_id=parent_id, sequence_number=seq,
                                         avro_compression="deflate") as lw:
                    lw.add_manifests(manifests)
                collector = SnapshotSummaryCollector()
                for f in files:
                    collector.add_file(f, schema=md.schema(), partition_spec=md.spec())
                summary = update_snapshot_summaries(Summary(Operation.APPEND, **collector.build()), previous_summary=prev_summary)
                snap = Snapshot(snapshot_id=snapshot_id, parent_snapshot_id=parent_id, sequence_number=seq,
                                manifest_list=lpath, summary=summary, schema_id=md.current_schema_id,
                                timestamp_ms=int(time.time() * 1000))
                updates += [AddSnapshotUpdate(snapshot=snap),
                            SetSnapshotRefUpdate(ref_name="main", type=SnapshotRefType.BRANCH, snapshot_id=snapshot_id,
                                                 parent_snapshot_id=parent_id)]
                parent_id, prev_summary, seq = snapshot_id, summary, seq + 1
                # the manifest's sequence number is assigned at read time from the list; keep the object for the next list
                new_manifest.sequence_number = seq - 1
                new_manifest.min_sequence_number = seq - 1
                step += 1
            table.catalog.commit_table(table, (AssertRefSnapshotId(ref="main", snapshot_id=base_parent),), tuple(updates))
        table.refresh()
        return step


def run_plain_growth(root: Path, steps: int, mode: str, points: list[int], samples: int, window: int) -> dict[str, Any]:
    catalog = load_sql_catalog(sqlite_props(root / "plain"))
    table = create_plain_table(catalog, "plain_growth")
    t0 = time.monotonic()
    latencies: dict[int, float] = {}  # step -> latency of the real append that created it
    cpu: dict[int, float] = {}
    step = 1
    if mode == "loop":
        for step in range(1, steps + 1):
            latencies[step], cpu[step] = timed(lambda step=step: table.append(plain_frame(step)))
            if step % window == 0:
                w = [latencies[k] for k in range(step - window + 1, step + 1)]
                print(f"[growth] plain append {step:>5}/{steps}: p50 {percentile(w, 50) * 1000:7.1f} ms "
                      f"({time.monotonic() - t0:5.0f} s)", flush=True)
    else:
        filler = PlainFiller(table)
        fill_s = 0.0
        for point in points:
            first_real = max(step, point - samples // 2 + 1)
            if first_real > step:
                f0 = time.monotonic()
                step = filler.fill(first_real - 1, first_step=step)
                fill_s += time.monotonic() - f0
            for _ in range(samples):
                latencies[step], cpu[step] = timed(lambda step=step: table.append(plain_frame(step)))
                step += 1
            lat = [latencies[k] for k in range(first_real, step)]
            print(f"[growth] plain append at {point:>5} snapshots: p50 {percentile(lat, 50) * 1000:7.1f} ms  "
                  f"metadata {metadata_size(table) / 1024:7.1f} KiB  (filler {fill_s:4.0f} s, total "
                  f"{time.monotonic() - t0:4.0f} s)", flush=True)
    table.refresh()
    return {"mode": mode, "latency_by_step_s": latencies, "cpu_by_step_s": cpu, "snapshots": len(table.metadata.snapshots),
            "metadata_bytes": metadata_size(table), "elapsed_s": time.monotonic() - t0}


def plain_point_stats(latencies: dict[int, float], point: int, half: int) -> dict[str, float]:
    vals = [v for k, v in latencies.items() if point - half < k <= point + half]
    return {"p50_s": percentile(vals, 50), "p99_s": percentile(vals, 99), "n": len(vals)}


# ================================================================================================ phase 2: contention


@dataclass
class Task:
    policy: str  # dac | dac-single | fixed | pyiceberg | apart
    catalog: dict[str, str]
    table: str
    producer: str
    start_at: float  # wall clock (time.time()) when committing starts; measuring starts warmup_s later
    warmup_s: float
    duration_s: float
    fixed_delay_s: float
    seed: int


def _recording(policy_cls: type, log: list[tuple[float, float, bool, int]], waits: list[tuple[str, float]]) -> type:
    class Recording(policy_cls):  # type: ignore[misc, valid-type]
        def record_attempt(self, *, started: float, ended: float, won: bool, head_step: int, foreign: int) -> None:
            log.append((started, ended, won, foreign))
            super().record_attempt(started=started, ended=ended, won=won, head_step=head_step, foreign=foreign)

        def pacing_delay(self) -> float:
            d = super().pacing_delay()
            waits.append(("pace", d))
            return d

        def retry_delay(self, attempt: int) -> float:
            d = super().retry_delay(attempt)
            waits.append(("retry", d))
            return d

    return Recording


def _run_task(task: Task) -> dict[str, Any]:
    from dac_sim import FixedBackoffPolicy
    from pyiceberg.exceptions import CommitFailedException

    from lakestream_iceberg import Stream
    from lakestream_iceberg.write.dac import CommitPolicy

    catalog = load_sql_catalog(task.catalog)
    attempt_log: list[tuple[float, float, bool, int]] = []
    waits: list[tuple[str, float]] = []
    records: list[tuple[float, float, bool, int, str]] = []  # (start, end, ok, attempts, error)
    offset = time.time() - time.monotonic()  # monotonic -> wall
    if task.policy == "pyiceberg":
        table = catalog.load_table(f"{NS}.{task.table}")
        calls = [0]
        inner = table._do_commit  # noqa: SLF001 - count pyiceberg's own attempts

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return inner(*args, **kwargs)

        table._do_commit = counting  # noqa: SLF001
        worker_no = int(task.producer.rsplit("-", 1)[1])
        counter = [0]

        def commit_once() -> int:
            counter[0] += 1
            before = calls[0]
            table.append(plain_frame(worker_no * 10_000_000 + counter[0]))
            return calls[0] - before
    else:
        stream = Stream.open(catalog, f"{NS}.{task.table}")
        producer = stream.producer(task.producer, seed=task.seed)
        loop = producer._loop  # noqa: SLF001 - swap in a recording policy; everything else as Stream.producer built it
        base = FixedBackoffPolicy if task.policy == "fixed" else CommitPolicy
        cls = _recording(base, attempt_log, waits)
        kwargs = {"delay_s": task.fixed_delay_s} if task.policy == "fixed" else {}
        loop.policy = cls(clock=time.monotonic, rng=random.Random(task.seed), **kwargs)
        payload = shards_for(task.seed)
        _ = producer.next_seq  # first refresh outside the window

        def commit_once() -> int:
            return producer.commit(payload).attempts

    gc.freeze()  # set up: what it holds stays out of full collections, as docs/guide/producers.md advises
    ready_late = time.time() - task.start_at
    while time.time() < task.start_at:
        time.sleep(min(0.05, max(0.0, task.start_at - time.time())))
    stop = task.start_at + task.warmup_s + task.duration_s
    origin = task.start_at + task.warmup_s  # records are relative to the start of the measured window
    while time.time() < stop:
        s = time.time()
        attempts, ok, err = 0, True, ""
        try:
            attempts = commit_once()
        except CommitFailedException as exc:
            ok, err = False, type(exc).__name__
            attempts = -1
        except Exception as exc:  # noqa: BLE001 - a failed commit is a result, not a crash
            ok, err = False, f"{type(exc).__name__}: {str(exc)[:200]}"
        records.append((s - origin, time.time() - origin, ok, attempts, err))
    rel = origin - offset  # the window's start on the monotonic clock
    return {
        "producer": task.producer, "records": records, "ready_late_s": ready_late,
        "attempt_log": [(a - rel, b - rel, w, f) for a, b, w, f in attempt_log],
        "waits": waits,
    }


def _worker(conn: Any) -> None:
    import logging

    import dac_sim  # noqa: F401
    import pyiceberg.io.pyarrow  # noqa: F401 - import everything before the first task (outside any measurement)
    import sqlalchemy  # noqa: F401

    import lakestream_iceberg  # noqa: F401

    logging.getLogger("pyiceberg").setLevel(logging.ERROR)  # one warning per pyiceberg retry otherwise
    parent = Parent(conn)
    task = parent.ready()  # the first task
    while task is not None:
        with parent:  # a failed task is reported to the parent, and the worker waits for the next one
            parent.ok(_run_task(task))
        task = conn.recv()


class Pool:
    """``size`` spawned worker processes, reused for every contention point."""

    def __init__(self, size: int) -> None:
        self.workers = Children(mp.get_context("spawn"))
        for i in range(size):
            self.workers.start(f"contention worker {i}", _worker)
        self.workers.wait_ready()  # every worker has imported everything before the first point is timed

    def run(self, tasks: list[Task]) -> list[dict[str, Any]]:
        conns = self.workers.conns
        for conn, task in zip(conns, tasks, strict=False):
            conn.send(task)
        return [Children.receive(conn, "ok", "contention worker failed") for conn in conns[: len(tasks)]]

    def close(self) -> None:
        for conn in self.workers.conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        self.workers.close(join_s=10)


def contention_point(pool: Pool, catalog_props: dict[str, str], policy: str, producers: int, duration: float,
                     warmup: float, fixed_delay_s: float, name: str, seed: int) -> dict[str, Any]:
    start_at = time.time() + 2.0 + 0.25 * producers  # every worker is set up (and idle) before this
    if policy == "apart":  # the machine's ceiling: every producer alone on its own stream, nothing shared
        tasks = []
        for i in range(producers):
            props = apart_props(catalog_props, i)
            create_stream(load_sql_catalog(props), f"{name}_p{i}")
            tasks.append(Task(policy, props, f"{name}_p{i}", f"w-{i}", start_at, warmup, duration, fixed_delay_s,
                              seed * 1000 + i))
        return summarize_point(pool.run(tasks), duration, policy, producers)
    catalog = load_sql_catalog(catalog_props)
    if policy == "pyiceberg":
        create_plain_table(catalog, name)
    else:  # "dac" is lakestream as shipped (group commit on); the baselines commit one batch per swap
        create_stream(catalog, name, group_commit=policy == "dac")
    tasks = [Task(policy, catalog_props, name, f"w-{i}", start_at, warmup, duration, fixed_delay_s, seed * 1000 + i)
             for i in range(producers)]
    window = Window(start_at + warmup, duration, catalog if catalog_props["uri"].startswith("postgresql") else None)
    results = pool.run(tasks)
    point = summarize_point(results, duration, policy, producers)
    cpu_s, xacts = window.result()
    point["machine_cpu_ms_per_commit"] = ratio_of(1000 * cpu_s, point["commits"]) if cpu_s is not None else math.nan
    point["catalog_xacts_per_commit"] = ratio_of(xacts, point["commits"]) if xacts is not None else math.nan
    return point


class Window:
    """The machine's CPU (every process, the database server's included: ``/proc/stat``) and, on PostgreSQL, the
    catalog database's transactions (``pg_stat_database``) over a point's measured window, sampled by a thread of the
    parent at the window's start and end (wall clock)."""

    def __init__(self, start: float, duration: float, catalog: Any) -> None:
        self._catalog = catalog
        self._samples: list[tuple[float | None, int | None]] = []
        self._thread = threading.Thread(target=self._run, args=(start, duration), daemon=True)
        self._thread.start()

    def _run(self, start: float, duration: float) -> None:
        for at in (start, start + duration):
            time.sleep(max(0.0, at - time.time()))
            self._samples.append((self._cpu_s(), self._xacts()))

    @staticmethod
    def _cpu_s() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):  # not Linux
            return None
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    def _xacts(self) -> int | None:
        if self._catalog is None:
            return None
        with self._catalog.engine.connect() as conn:
            return int(conn.exec_driver_sql("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                                            "WHERE datname = current_database()").scalar())

    def result(self) -> tuple[float | None, int | None]:
        """(CPU seconds, transactions) over the window; None where not measured."""
        self._thread.join()
        if len(self._samples) != 2:
            return None, None
        (cpu0, x0), (cpu1, x1) = self._samples
        return (cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None,
                x1 - x0 if x0 is not None and x1 is not None else None)


def apart_props(catalog_props: dict[str, str], i: int) -> dict[str, str]:
    """Producer ``i``'s own catalog for the ``apart`` policy: on SQLite a database file and warehouse of its own (one
    SQLite file serialises every writer), on PostgreSQL the same server (its tables' rows are locked apart)."""
    if not catalog_props["uri"].startswith("sqlite"):
        return catalog_props
    root = Path(catalog_props["uri"].removeprefix("sqlite:///")).parent / f"apart-{i}"
    return sqlite_props(root)


def summarize_point(results: list[dict[str, Any]], duration: float, policy: str, producers: int) -> dict[str, Any]:
    in_window = [r for res in results for r in res["records"] if 0 <= r[1] <= duration]
    ok = [r for r in in_window if r[2]]
    failed = [r for r in in_window if not r[2]]
    failed_warmup = sum(1 for res in results for r in res["records"] if r[1] < 0 and not r[2])
    per_producer = [sum(1 for r in res["records"] if r[2] and 0 <= r[1] <= duration) for res in results]
    latencies = [r[1] - r[0] for r in ok]
    attempts_known = [r[3] for r in ok if r[3] >= 0]  # compare-and-swaps the call sent (0: carried by a group commit)
    critical = [b - a for res in results for a, b, w, _ in res["attempt_log"] if 0 <= a and b <= duration]
    won_attempts = sum(1 for res in results for a, b, w, _ in res["attempt_log"] if 0 <= a and b <= duration and w)
    errors: dict[str, int] = {}
    for r in failed:
        errors[r[4].split(":")[0]] = errors.get(r[4].split(":")[0], 0) + 1
    pace = [d for res in results for kind, d in res["waits"] if kind == "pace"]
    return {
        "policy": policy, "producers": producers, "duration_s": duration,
        "commits": len(ok), "commits_per_s": len(ok) / duration, "failed": len(failed), "errors": errors,
        "failed_in_warmup": failed_warmup,
        "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99), "max_s": max(latencies, default=math.nan),
        "jain": jain_index(per_producer), "per_producer": per_producer,
        "attempts_per_commit": statistics.fmean(attempts_known) if attempts_known else math.nan,
        "attempts": len(critical), "won_attempts": won_attempts,
        "carried_frac": sum(1 for r in ok if r[3] == 0) / len(ok) if ok and policy != "pyiceberg" else math.nan,
        "batches_per_swap": ratio_of(len(ok), won_attempts),
        "wasted_frac": 1 - won_attempts / len(critical) if critical else math.nan,
        "critical_p50_s": percentile(critical, 50), "critical_samples": critical[:5000],
        "pacing_mean_s": statistics.fmean(pace) if pace else math.nan,
        "latency_samples": latencies[:5000],
        "ready_late_s": max(res["ready_late_s"] for res in results),
    }


def run_contention(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"points": [], "postgres": None}
    pool = Pool(max(args.producers))
    pg = None
    try:
        for catalog_name in args.catalogs:
            if catalog_name == "postgres" and pg is None:
                # every producer process holds a few connections (its pool, the pointer probe, the commit
                # notifications' listener), and under `apart` each has a catalog of its own: 100 is too few from P=16
                pg, how = start_postgres(max_connections=100 + 10 * max(args.producers))
                out["postgres"] = how
            for policy in args.policies:
                for rep, p in [(r, p) for r in range(args.repeat) for p in args.producers]:  # repetitions interleaved
                    name = f"{catalog_name}_{policy}_{p}" + (f"_r{rep}" if rep else "")
                    if catalog_name == "sqlite":
                        props = sqlite_props(root / "contention" / name)
                    else:
                        uri = pg.create_database(f"b_{policy.replace('-', '_')}_{p}_r{rep}")
                        wh = root / "contention" / name
                        wh.mkdir(parents=True, exist_ok=True)
                        props = {"type": "sql", "uri": uri, "warehouse": f"file://{wh}"}
                    t0 = time.monotonic()
                    point = contention_point(pool, props, policy, p, args.duration, args.warmup, args.fixed_delay_ms / 1000, name,
                                             seed=len(out["points"]) + 1)
                    point["catalog"] = catalog_name
                    point["rep"] = rep
                    out["points"].append(point)
                    print(f"[contention] {catalog_name:8} {policy:9} P={p:<2} #{rep}: {point['commits_per_s']:6.1f} commits/s  "
                          f"failed {point['failed']:3}  p50 {point['p50_s'] * 1000:7.1f} ms  p99 {point['p99_s'] * 1000:8.1f} ms"
                          f"  Jain {point['jain']:.3f}  attempts/commit {point['attempts_per_commit']:.2f}  "
                          f"({time.monotonic() - t0:4.1f} s, ready late {point['ready_late_s']:+.1f} s)", flush=True)
    finally:
        pool.close()
        if pg is not None:
            pg.close()
    return out


# ================================================================================================ phase 3: simulation


def run_simulation(args: argparse.Namespace, contention: dict[str, Any] | None) -> dict[str, Any]:
    from dac_sim import LatencyModel, simulate

    models: dict[str, LatencyModel] = {}
    for point in (contention or {}).get("points", []):
        if point["policy"] == "dac" and point["producers"] == 1 and len(point["critical_samples"]) >= 10:
            lat = point["latency_samples"]
            crit = point["critical_samples"]
            write = max(0.0, percentile(lat, 50) - percentile(crit, 50))
            models[point["catalog"]] = LatencyModel.fit(crit, [write], cas_s=args.sim_cas_ms / 1000,
                                                        source=f"{point['catalog']} P=1 dac attempts (n={len(crit)})")
    if not models:
        models["default"] = LatencyModel(cas_s=args.sim_cas_ms / 1000)
    rows = []
    for name, model in models.items():
        for n in args.sim_producers:
            for strategy in args.sim_strategies:
                t0 = time.monotonic()
                r = simulate(n, strategy, model, duration_s=args.sim_duration, seed=n).row()
                r.update({"model": name, "wall_s": time.monotonic() - t0})
                rows.append(r)
    return {"models": {k: v.__dict__ for k, v in models.items()}, "rows": rows}


# ================================================================================================ report


def report(results: dict[str, Any], args: argparse.Namespace) -> list[Table]:
    tables: list[Table] = []
    growth = results.get("growth")
    if growth:
        ls = growth["lakestream"]
        t = Table(f"1. growth: lakestream, one producer, world size {WORLD_SIZE}, SQLite (latency of Producer.commit)",
                  ["steps", "p50 ms", "p99 ms", "max ms", "cpu p50 ms", "metadata KiB", "snapshots", "manifests"])
        for w in ls["windows"]:
            t.add(w["steps"], w["p50_s"] * 1000, w["p99_s"] * 1000, w["max_s"] * 1000, w["cpu_p50_s"] * 1000,
                  w["metadata_bytes"] / 1024,
                  w["snapshots"], w["manifests"])
        if ls.get("slowest"):
            t.note("slowest commits: " + ", ".join(f"step {x['step']}: {x['latency_s'] * 1000:,.0f} ms" for x in ls["slowest"])
                   + " (manifest merges cascade at multiples of 16, 256, 4,096 steps)")
        tables.append(t)
        plain = growth.get("plain")
        if plain:
            lat = {int(k): v for k, v in plain["latency_by_step_s"].items()}
            t2 = Table(f"1b. growth: plain pyiceberg table.append ({plain['mode']}), same schema/partitioning, SQLite",
                       ["snapshots", "p50 ms", "p99 ms", "cpu p50 ms", "samples"])
            plat_cpu = {int(k): v for k, v in plain["cpu_by_step_s"].items()}
            for point in growth["plain_points"]:
                half = args.plain_samples if plain["mode"] == "sampled" else 50
                st = plain_point_stats(lat, point, half)
                t2.add(point, st["p50_s"] * 1000, st["p99_s"] * 1000, plain_point_stats(plat_cpu, point, half)["p50_s"] * 1000,
                       st["n"])
            tables.append(t2)
        r = growth["ratios"]
        t3 = Table("1c. growth ratios (target: lakestream wall-clock ratio <= 1.25)",
                   ["what", "p50 at start ms", "p50 at end ms", "ratio", "cpu ratio"])
        t3.add(f"lakestream p50@{r['ls_end_step']}/p50@200", r["ls_p50_200"] * 1000, r["ls_p50_end"] * 1000, r["ls_ratio"],
               r["ls_cpu_ratio"])
        if "plain_ratio" in r:
            t3.add(f"plain p50@{r['plain_end_step']}/p50@100", r["plain_p50_100"] * 1000, r["plain_p50_end"] * 1000,
                   r["plain_ratio"], r["plain_cpu_ratio"])
        t3.note("p50@N: median of the 100 commits around step N (steps N-49..N+50; the last 100 at the end)")
        tables.append(t3)
    cont = results.get("contention")
    if cont:
        for catalog_name in args.catalogs:
            pts = [p for p in cont["points"] if p["catalog"] == catalog_name]
            if not pts:
                continue
            t = Table(f"2. contention on {catalog_name}: {args.duration:.0f} s measured per point after {args.warmup:.0f} s "
                      f"warm-up, producers commit back to back ({args.repeat} repetition(s), interleaved)",
                      ["policy", "P", "rep", "commits/s", "vs P=1", "failed", "p50 ms", "p99 ms", "p99/p50", "Jain",
                       "swaps/commit", "wasted", "carried", "batches/swap", "CPU ms/commit", "xacts/commit"])
            single = {(p["policy"], p.get("rep", 0)): p["commits_per_s"] for p in pts if p["producers"] == 1}
            for p in pts:
                base = single.get((p["policy"], p.get("rep", 0)))
                t.add(p["policy"], p["producers"], p.get("rep", 0), p["commits_per_s"],
                      ratio_of(p["commits_per_s"], base),
                      p["failed"], p["p50_s"] * 1000, p["p99_s"] * 1000,
                      ratio_of(p["p99_s"], p["p50_s"]), p["jain"], p["attempts_per_commit"],
                      p["wasted_frac"], p.get("carried_frac", math.nan), p.get("batches_per_swap", math.nan),
                      p.get("machine_cpu_ms_per_commit", math.nan), p.get("catalog_xacts_per_commit", math.nan))
            t.note("commits: published batches (one snapshot each); failed: commit calls that raised (pyiceberg: "
                   "CommitFailedException after 4 retries; lakestream: budget exhausted); swaps/commit: "
                   "compare-and-swaps sent per published batch; wasted: lost swaps / swaps; carried: batches published "
                   "by another producer's group commit (no swap of their own); batches/swap: batches per winning swap "
                   "(lakestream policies only); apart: every producer commits to a stream of its own (on SQLite in a "
                   "database file of its own), nothing shared: the machine's ceiling for P processes committing; CPU "
                   "ms/commit: the whole machine's CPU (every process, the database server's included) in the measured "
                   "window per published batch; xacts/commit: the catalog database's transactions per published batch "
                   "(PostgreSQL: each statement on lakestream's autocommit connection is one)")
            tables.append(t)
        targets = Table("2b. targets at the largest P (with repetitions: the ratio is the median of each repetition's "
                        "ratio to its own P=1 run; failed summed; p99/p50 the worst; Jain the lowest)",
                        ["catalog", "policy", "P", "failed == 0", "agg >= 1.0x P=1", "ratio per repetition",
                         "p99 <= 10x p50", "Jain >= 0.9"])
        top = max(args.producers)
        for catalog_name, policy in [(c, p) for p in args.policies for c in args.catalogs]:
            pts = {(p["policy"], p["producers"], p.get("rep", 0)): p for p in cont["points"] if p["catalog"] == catalog_name}
            pairs = [(pts[(policy, top, r)], pts[(policy, 1, r)]) for r in range(args.repeat)
                     if (policy, top, r) in pts and (policy, 1, r) in pts and pts[(policy, top, r)]["p50_s"] > 0]
            if not pairs:
                continue
            ratios = [p["commits_per_s"] / one["commits_per_s"] for p, one in pairs]
            ratio = statistics.median(ratios)
            failed = sum(p["failed"] for p, _ in pairs)
            tail = max(p["p99_s"] / p["p50_s"] for p, _ in pairs)
            jain = min(p["jain"] for p, _ in pairs)
            targets.add(catalog_name, policy, top, f"{failed} {'ok' if failed == 0 else 'MISS'}",
                        f"{ratio:.2f}x {'ok' if ratio >= 1.0 else 'MISS'}", " / ".join(f"{r:.2f}" for r in ratios),
                        f"{tail:.1f}x {'ok' if tail <= 10 else 'MISS'}", f"{jain:.3f} {'ok' if jain >= 0.9 else 'MISS'}")
        tables.append(targets)
    sim = results.get("simulation")
    if sim:
        for model_name, model in sim["models"].items():
            t = Table(f"3. simulation ({model_name}: critical section lognormal median "
                      f"{model['critical_median_s'] * 1000:.1f} ms sigma {model['critical_sigma']:.2f}, "
                      f"write {model['write_s'] * 1000:.1f} ms, CAS {model['cas_s'] * 1000:.1f} ms; "
                      f"{args.sim_duration:.0f} virtual s)",
                      ["strategy", "P", "commits/s", "failed", "wasted", "carried", "batches/swap", "p50 ms", "p99 ms",
                       "p99/p50", "Jain", "n est"])
            for r in sim["rows"]:
                if r["model"] == model_name:
                    t.add(r["strategy"], r["producers"], r["commits_per_s"], r["failed"], r["wasted_frac"],
                          r.get("carried", math.nan), r.get("batches_per_cas", math.nan), r["p50_s"] * 1000,
                          r["p99_s"] * 1000, r["p99_over_p50"], r["jain"], r["contenders_est_median"])
            t.note(f"fitted from: {model['source']}; each producer on its own CPU, the catalog's swap is the shared resource")
            tables.append(t)
    return tables


def plot(results: dict[str, Any], args: argparse.Namespace, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[plot] matplotlib not installed; no plot", flush=True)
        return None
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    growth = results.get("growth")
    if growth:
        ls = growth["lakestream"]["windows"]
        ax.plot([w["end_step"] for w in ls], [w["p50_s"] * 1000 for w in ls], "o-", label="lakestream p50")
        ax.plot([w["end_step"] for w in ls], [w["p99_s"] * 1000 for w in ls], "o--", label="lakestream p99")
        plain = growth.get("plain")
        if plain:
            lat = {int(k): v for k, v in plain["latency_by_step_s"].items()}
            half = args.plain_samples if plain["mode"] == "sampled" else 50
            pts = growth["plain_points"]
            ax.plot(pts, [plain_point_stats(lat, p, half)["p50_s"] * 1000 for p in pts], "s-", label="pyiceberg append p50")
        ax.set_xlabel("steps (snapshots) committed")
        ax.set_ylabel("commit latency (ms)")
        ax.set_yscale("log")
        ax.set_title("1. growth (one producer, SQLite)")
        ax.legend()
    else:
        ax.axis("off")
        ax.text(0.5, 0.5, "growth phase not run", ha="center", va="center")
    cont = results.get("contention")
    if cont:
        for ax, key, label in ((axes[0][1], "commits_per_s", "aggregate commits/s"), (axes[1][0], "p99_s", "p99 latency (s)")):
            for catalog_name in args.catalogs:
                for policy in args.policies:
                    pts = [p for p in cont["points"] if p["catalog"] == catalog_name and p["policy"] == policy
                           and p.get("rep", 0) == 0]
                    if pts:
                        ax.plot([p["producers"] for p in pts], [p[key] for p in pts], "o-" if catalog_name == "sqlite" else "s--",
                                label=f"{policy} / {catalog_name}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("producer processes")
            ax.set_ylabel(label)
            if key == "p99_s":
                ax.set_yscale("log")
            ax.set_title(f"2. contention: {label}")
            ax.legend(fontsize=7)
    sim = results.get("simulation")
    if sim:
        ax = axes[1][1]
        for model_name in sim["models"]:
            for strategy in args.sim_strategies:
                rows = [r for r in sim["rows"] if r["model"] == model_name and r["strategy"] == strategy]
                ax.plot([r["producers"] for r in rows], [r["commits_per_s"] for r in rows], "o-",
                        label=f"{strategy} / {model_name}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("simulated producers")
        ax.set_ylabel("commits/s")
        ax.set_title("3. simulation of the pure policy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ================================================================================================ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes everywhere (a smoke run, ~3 min)")
    parser.add_argument("--phases", default="growth,contention,simulation")
    parser.add_argument("--steps", type=int, default=20_000, help="lakestream growth steps")
    parser.add_argument("--window", type=int, default=1_000)
    parser.add_argument("--plain-steps", type=int, default=2_000)
    parser.add_argument("--plain-mode", choices=["sampled", "loop"], default="sampled")
    parser.add_argument("--plain-samples", type=int, default=10, help="real appends timed per point (sampled mode)")
    parser.add_argument("--profile-last", type=int, default=200,
                        help="cProfile N extra growth commits after the measured ones (0: off)")
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--catalogs", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--policies", nargs="+", default=["dac", "dac-single", "fixed", "pyiceberg", "apart"],
                        choices=["dac", "dac-single", "fixed", "pyiceberg", "apart"])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured per contention point")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of committing before each measured window")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure every contention point this many times, interleaved (P=1, 2, ..., P=1, 2, ...)")
    parser.add_argument("--fixed-delay-ms", type=float, default=50.0)
    parser.add_argument("--sim-producers", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--sim-strategies", nargs="+", default=["dac", "dac-single", "fixed", "pyiceberg"])
    parser.add_argument("--sim-duration", type=float, default=120.0)
    parser.add_argument("--sim-cas-ms", type=float, default=1.0, help="catalog service time per swap in the model")
    parser.add_argument("--out", default=str(RESULTS_DIR / "commit_scaling.json"))
    parser.add_argument("--workdir", default=None, help="where tables live (default: a temp dir, removed at the end)")
    args = parser.parse_args(argv)
    if args.quick:
        defaults = parser.parse_args([])
        for key, value in {"steps": 1_000, "window": 250, "plain_steps": 300, "plain_samples": 6, "profile_last": 100,
                           "producers": [1, 4, 16], "duration": 5.0, "warmup": 2.0, "sim_producers": [64, 256, 1024],
                           "sim_duration": 40.0}.items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    return args


def plain_points_for(steps: int) -> list[int]:
    pts = [p for p in (100, 200, 500, 1000, 1500, 2000, 3000, 5000) if p < steps]
    return [*pts, steps]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="commit-scaling-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": vars(args)}
    t0 = time.monotonic()
    try:
        if "growth" in phases:
            ls = run_lakestream_growth(root / "growth", args.steps, args.window, args.profile_last)
            points = plain_points_for(args.plain_steps)
            plain = run_plain_growth(root / "growth", args.plain_steps, args.plain_mode, points, args.plain_samples,
                                     args.window if args.plain_mode == "loop" else 100)
            lat = ls["latencies_s"]
            ratios = {"ls_p50_200": at_step(lat, 200), "ls_p50_end": percentile(lat[-100:], 50), "ls_end_step": len(lat)}
            ratios["ls_ratio"] = ratios["ls_p50_end"] / ratios["ls_p50_200"]
            ratios["ls_cpu_ratio"] = percentile(ls["cpu_s"][-100:], 50) / at_step(ls["cpu_s"], 200)
            plat = {int(k): v for k, v in plain["latency_by_step_s"].items()}
            half = args.plain_samples if args.plain_mode == "sampled" else 50
            p100 = plain_point_stats(plat, 100, half)["p50_s"]
            pend = plain_point_stats(plat, points[-1], half)["p50_s"]
            pcpu = {int(k): v for k, v in plain["cpu_by_step_s"].items()}
            c100 = plain_point_stats(pcpu, 100, half)["p50_s"]
            cend = plain_point_stats(pcpu, points[-1], half)["p50_s"]
            ratios.update({"plain_p50_100": p100, "plain_p50_end": pend, "plain_end_step": points[-1],
                           "plain_ratio": ratio_of(pend, p100), "plain_cpu_ratio": ratio_of(cend, c100)})
            results["growth"] = {"lakestream": ls, "plain": plain, "plain_points": points,
                                 "ratios": ratios}
            if ls.get("profile_last_commits"):
                print(f"[growth] cProfile of the last {args.profile_last} lakestream commits (cumulative):")
                print("\n".join(ls["profile_last_commits"].splitlines()[:45]), flush=True)
        if "contention" in phases:
            results["contention"] = run_contention(args, root)
        if "simulation" in phases:
            results["simulation"] = run_simulation(args, results.get("contention"))
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    results["elapsed_s"] = time.monotonic() - t0
    tables = report(results, args)
    print_tables(tables)
    out = Path(args.out)
    path = write_json(out.name, {**results, "tables": tables}, directory=out.parent)
    png = plot(results, args, out.with_suffix(".png"))
    print(f"wrote {path}" + (f" and {png}" if png else "") + f" in {results['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
