"""lakestream vs a Kafka-protocol broker (Tansu), same machine, same payloads.

What is measured (see docs/benchmarks.md for the meaning of every number):

1. ingestion MiB/s: P producer processes (P = 1, 4, 8) publish global batches of 1, 16 and 64 MiB (world size W shards)
   as fast as they can for ``--duration`` seconds. Kafka: one transaction per global batch, one message per rank shard
   (partition = rank, key = producer/seq), idempotent + transactional producer. lakestream: ``Producer.commit(shards)``
   on the embedded SQLite catalog and a local warehouse in a temp dir. ``--rounds`` rounds per configuration (default
   2), Kafka first in even rounds and lakestream first in odd ones, each run after ``os.sync()``; a row pools its
   rounds (MiB over seconds) and the JSON keeps each round's ratio: one 4 s pair on a shared machine drifts by 20%.
2. visibility latency p50/p99: 2 paced producers, one consumer that assembles whole global batches (all W shards
   decoded). Latency = the moment the producer starts publishing a batch -> the consumer holds all W shards.
   Kafka consumer: read_committed, fetch.wait.max.ms=10; lakestream consumer: LakestreamDataset(follow=True) polling
   the catalog pointer on its adaptive schedule (read/follow.py ArrivalClock) with poll_s=2 ms, max_poll_s=50 ms: it
   sleeps until shortly before the next step is due, then polls every 2 ms; the catalog queries it made per second are
   reported with the table.
3. message size limit: what the client and the broker do with 128 KiB .. 8 MiB shards (and one 64 MiB message).
4. producer death: kill -9 a producer after it sent half the shards of a batch; is a partial batch visible?

Run: ``.venv/bin/python benchmarks/vs_kafka.py`` (about 4-5 minutes on 2 cores) or ``--smoke`` (seconds).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from _common import (  # noqa: E402
    RESULTS_DIR,
    Run,
    RunFolders,
    StartLine,
    Table,
    alternating,
    batches,
    bench_parser,
    cpu_s,
    dir_bytes,
    file_creation_ms,
    fill_defaults,
    flush_writes,
    guarded,
    int_list,
    kill_all,
    machine,
    percentile,
    ratio_of,
    settle_and_say,
    sleep_until,
    sqlite_catalog,
)
from _kafka import Tansu, admin_config, create_topic, tansu_version  # noqa: E402

MiB = 1 << 20
SAMPLE_BYTES = 64 * 1024
SCHEMA = pa.schema([("sample", pa.binary())])
CTX = mp.get_context("fork")
NAME = "bench.batches"


# ---------------------------------------------------------------------------------------------------- payloads


def make_shards(batch_bytes: int, world_size: int, seed: int) -> list[pa.Table]:
    """One global batch: ``world_size`` shards of incompressible 64 KiB samples, ``batch_bytes`` in total."""
    rng = np.random.default_rng(seed)
    per_shard = batch_bytes // world_size
    rows = max(1, per_shard // SAMPLE_BYTES)
    size = per_shard // rows
    shards = []
    for _ in range(world_size):
        blob = rng.bytes(rows * size)
        shards.append(pa.table({"sample": pa.array([blob[i * size:(i + 1) * size] for i in range(rows)], pa.binary())}))
    return shards


def payload_bytes(shards: list[pa.Table]) -> int:
    return sum(sum(len(v) for v in t.column("sample").to_pylist()) for t in shards)


def to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(value: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(value)).read_all()


# ---------------------------------------------------------------------------------------------------- Kafka side


def client_log() -> logging.Logger:
    """librdkafka's log lines (connection closed by a stopped broker, ...) go to a file, not the console."""
    log = logging.getLogger("vs_kafka.librdkafka")
    if not log.handlers:
        path = os.environ.get("VS_KAFKA_CLIENT_LOG", os.path.join(tempfile.gettempdir(), "vs_kafka-librdkafka.log"))
        log.addHandler(logging.FileHandler(path))
        log.propagate = False
        log.setLevel(logging.INFO)
    return log


def kafka_producer_config(bootstrap: str, *, shard_bytes: int, txn_id: str | None, **extra: Any) -> dict[str, Any]:
    """What a careful Kafka user sets for exactly-once global batches."""
    cfg: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,  # implies acks=all, max.in.flight<=5, retries
        "acks": "all",
        "compression.type": "none",  # the payload is incompressible; lakestream writes it uncompressed too (--lake-codec)
        "linger.ms": 0,
        # The shard must fit one message: raised above librdkafka's 1,000,000-byte default when needed.
        "message.max.bytes": max(1_000_000, shard_bytes + MiB),
        "log.connection.close": False,
        "logger": client_log(),
    }
    if txn_id is not None:
        cfg["transactional.id"] = txn_id
    cfg.update(extra)
    return cfg


def kafka_consumer_config(bootstrap: str, *, group: str, shard_bytes: int, isolation: str = "read_committed") -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": isolation,
        "fetch.wait.max.ms": 10,
        "max.partition.fetch.bytes": max(MiB, shard_bytes + MiB),
        "log.connection.close": False,
        "logger": client_log(),
    }


def _produce(producer: Any, topic: str, value: bytes, key: bytes, partition: int) -> None:
    while True:
        try:
            producer.produce(topic, value=value, key=key, partition=partition)
            return
        except BufferError:  # local queue full: serve delivery reports and retry
            producer.poll(0.01)


def kafka_producer_main(spec: dict[str, Any], idx: int, line: StartLine) -> None:
    from confluent_kafka import Producer

    shards = make_shards(spec["batch_bytes"], spec["world_size"], seed=idx)
    nbytes = payload_bytes(shards)
    shard_bytes = spec["batch_bytes"] // spec["world_size"]
    txn = spec.get("transactions", True)
    producer = Producer(kafka_producer_config(spec["bootstrap"], shard_bytes=shard_bytes,
                                              txn_id=f"{spec['run']}-p{idx}" if txn else None))
    if txn:
        producer.init_transactions(30)
    records: list[tuple[Any, float, float]] = []
    cpu0 = cpu_s()
    line.wait()
    for seq in producer_batches(spec, idx):
        t0 = time.monotonic()
        key = f"p{idx}/{seq}".encode()
        if txn:
            producer.begin_transaction()
        for rank, shard in enumerate(shards):
            _produce(producer, spec["topic"], to_ipc(shard), key, rank)
        if txn:
            producer.commit_transaction(60)
        else:
            left = producer.flush(60)
            if left:
                raise RuntimeError(f"{left} messages not delivered")
        records.append((f"p{idx}/{seq}", t0, time.monotonic()))
    line.report({"idx": idx, "records": records, "bytes_per_batch": nbytes, "cpu_s": cpu_s() - cpu0})


def kafka_consumer_main(spec: dict[str, Any], line: StartLine, stop: Any) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    world = spec["world_size"]
    consumer = Consumer(kafka_consumer_config(spec["bootstrap"], group=f"{spec['run']}-c",
                                              shard_bytes=spec["batch_bytes"] // world))
    consumer.assign([TopicPartition(spec["topic"], r, OFFSET_BEGINNING) for r in range(world)])
    groups: dict[str, dict[int, pa.Table]] = {}
    seen: dict[str, float] = {}
    cpu0 = cpu_s()
    line.wait()
    expected = spec["expected"]
    try:
        while len(seen) < expected and not stop.is_set():
            for msg in consumer.consume(num_messages=64, timeout=0.01):
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(str(msg.error()))
                    continue
                key = msg.key().decode()
                group = groups.setdefault(key, {})
                group[msg.partition()] = from_ipc(msg.value())
                if len(group) == world:
                    batch = pa.concat_tables([group[r] for r in range(world)])
                    assert batch.num_rows > 0
                    seen[key] = time.monotonic()
                    del groups[key]
    finally:
        consumer.close()
    line.report({"consumer": True, "seen": seen, "partial": {k: len(v) for k, v in groups.items()}, "cpu_s": cpu_s() - cpu0})


# ---------------------------------------------------------------------------------------------------- lakestream side


def lake_producer_main(spec: dict[str, Any], idx: int, line: StartLine) -> None:
    from lakestream_iceberg import Stream

    shards = make_shards(spec["batch_bytes"], spec["world_size"], seed=idx)
    nbytes = payload_bytes(shards)
    stream = Stream.open(sqlite_catalog(spec["root"]), NAME)
    producer = stream.producer(f"p{idx}")
    records: list[tuple[Any, float, float]] = []
    attempts = 0
    cpu0 = cpu_s()
    line.wait()
    for _seq in producer_batches(spec, idx):
        t0 = time.monotonic()
        result = producer.commit(shards)
        records.append((result.step, t0, time.monotonic()))
        attempts += result.attempts
    line.report({"idx": idx, "records": records, "bytes_per_batch": nbytes, "attempts": attempts, "cpu_s": cpu_s() - cpu0})


def _table_rows(shard: Any) -> Any:
    return shard.table


def lake_consumer_main(spec: dict[str, Any], line: StartLine, stop: Any) -> None:
    from lakestream_iceberg import Stream
    from lakestream_iceberg.read import follow
    from lakestream_iceberg.read.dataset import LakestreamDataset

    polls = [0]  # catalog pointer queries (HeadWatcher.check), counted in this consumer process only
    check = follow.HeadWatcher.check

    def counted_check(watcher: Any) -> bool:
        polls[0] += 1
        return check(watcher)

    follow.HeadWatcher.check = counted_check  # type: ignore[method-assign]
    stream = Stream.open(sqlite_catalog(spec["root"]), NAME)
    dataset = LakestreamDataset(stream, rank=0, world_size=1, follow=True, timeout=spec["consumer_timeout"],
                                poll_s=0.005, max_poll_s=0.05, prefetch=1, collate=_table_rows)
    seen: dict[int, float] = {}
    cpu0 = cpu_s()
    line.wait()
    t_go, polls[0] = time.monotonic(), 0
    try:
        for table in dataset:
            assert table.num_rows > 0
            seen[dataset.last_step] = time.monotonic()
            if len(seen) >= spec["expected"] or stop.is_set():
                break
    finally:
        dataset.close()
    active_s = max(seen.values(), default=t_go) - t_go
    line.report({"consumer": True, "seen": seen, "partial": {}, "cpu_s": cpu_s() - cpu0,
             "catalog_polls": polls[0], "catalog_polls_per_s": polls[0] / active_s if active_s > 0 else math.nan})


# ---------------------------------------------------------------------------------------------------- orchestration


def producer_batches(spec: dict[str, Any], idx: int) -> Any:
    """Producer ``idx``'s batches from the common start: saturated for ``duration`` s, or ``batches`` paced ones (the
    producers spread over each interval)."""
    return batches(mode="paced" if spec["mode"] != "saturate" else "saturate", start=float(spec["_go_time"].value),
                   duration=spec.get("duration", 0.0), count=spec.get("batches", 0), interval=spec.get("interval", 0.0),
                   offset=idx / max(1, spec["producers"]))


def run_processes(spec: dict[str, Any], producer_main: Any, consumer_main: Any | None, timeout_s: float) -> dict[str, Any]:
    """Start P producers (and a consumer), release them together, collect their reports.

    Everything the previous run wrote is flushed to disk first (``os.sync()``, as the other benchmarks do before each
    point): otherwise the kernel writes back one system's files while the next one runs, and charges it for them."""
    flush_writes()
    n = spec["producers"] + (1 if consumer_main else 0)
    line, stop = StartLine(CTX), CTX.Event()
    spec = dict(spec, _go_time=CTX.Value("d", 0.0))
    procs = [CTX.Process(target=guarded, args=(producer_main, line.out, spec, i, line), daemon=True)
             for i in range(spec["producers"])]
    if consumer_main:
        procs.append(CTX.Process(target=guarded, args=(consumer_main, line.out, spec, line, stop), daemon=True))
    try:
        for proc in procs:
            proc.start()
        line.wait_ready(n)
        spec["_go_time"].value = time.monotonic() + 0.05
        line.go.set()
        reports: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        producers_done = 0
        while len(reports) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"run {spec['run']} did not finish within {timeout_s:.0f}s")
            try:
                report = line.out.get(timeout=min(remaining, 1.0))
            except Exception:  # noqa: BLE001 - queue.Empty
                drained = time.monotonic() > spec.get("_drain_until", math.inf)
                if consumer_main and producers_done == spec["producers"] and drained:
                    stop.set()
                continue
            if "error" in report:
                raise RuntimeError(f"worker of run {spec['run']} failed:\n{report['error']}")
            reports.append(report)
            if not report.get("consumer"):
                producers_done += 1
                if producers_done == spec["producers"]:
                    spec["_drain_until"] = time.monotonic() + spec.get("drain_s", 15.0)
        for proc in procs:
            proc.join(10)
        t_go = spec["_go_time"].value
        return {"reports": reports, "t_go": t_go}
    finally:
        kill_all(procs)


def summarize_ingestion(result: dict[str, Any]) -> dict[str, Any]:
    producers = [r for r in result["reports"] if not r.get("consumer")]
    batches = sum(len(r["records"]) for r in producers)
    total = sum(len(r["records"]) * r["bytes_per_batch"] for r in producers)
    last = max((rec[2] for r in producers for rec in r["records"]), default=result["t_go"])
    elapsed = max(1e-9, last - result["t_go"])
    commit_s = [rec[2] - rec[1] for r in producers for rec in r["records"]]
    cpu = sum(r["cpu_s"] for r in producers) + result.get("broker_cpu_s", 0.0)
    return {
        "cpu_s": cpu,
        "cpu_s_per_gib": cpu / (total / (1 << 30)) if total else math.nan,
        "batches": batches,
        "mib": total / MiB,
        "elapsed_s": elapsed,
        "mib_s": total / MiB / elapsed,
        "publish_p50_ms": percentile(commit_s, 50) * 1000,
        "publish_p99_ms": percentile(commit_s, 99) * 1000,
        "attempts_per_commit": (sum(r.get("attempts", 0) for r in producers) / batches)
        if batches and "attempts" in producers[0] else None,
    }


def pool_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's ingestion rounds of one configuration as one figure: MiB over seconds and CPU over GiB pooled,
    the publish percentiles as the rounds' median, attempts per commit weighted by the rounds' batches."""
    if len(rounds) == 1:
        return rounds[0]
    mib, elapsed, cpu, batches = (sum(r[k] for r in rounds) for k in ("mib", "elapsed_s", "cpu_s", "batches"))
    attempts = [r["attempts_per_commit"] for r in rounds]
    return {
        "cpu_s": cpu,
        "cpu_s_per_gib": cpu / (mib / 1024) if mib else math.nan,
        "batches": batches,
        "mib": mib,
        "elapsed_s": elapsed,
        "mib_s": mib / elapsed if elapsed else math.nan,
        "publish_p50_ms": statistics.median(r["publish_p50_ms"] for r in rounds),
        "publish_p99_ms": statistics.median(r["publish_p99_ms"] for r in rounds),
        "attempts_per_commit": None if None in attempts else
        sum(a * r["batches"] for a, r in zip(attempts, rounds)) / batches if batches else None,
        "rounds": len(rounds),
    }


def summarize_latency(result: dict[str, Any], key_of: Any) -> dict[str, Any]:
    producers = [r for r in result["reports"] if not r.get("consumer")]
    consumer = next(r for r in result["reports"] if r.get("consumer"))
    seen = consumer["seen"]
    e2e, after_ack, publish = [], [], []
    missing = 0
    warmup = 1  # each producer's first batch (cold caches, first connections) is left out, on both systems
    for r in producers:
        for rec in r["records"][warmup:]:
            publish.append(rec[2] - rec[1])
            key = key_of(rec[0])
            if key not in seen:
                missing += 1
                continue
            e2e.append(seen[key] - rec[1])
            after_ack.append(seen[key] - rec[2])
    total = sum(len(r["records"]) * r["bytes_per_batch"] for r in producers)
    cpu = sum(r["cpu_s"] for r in result["reports"]) + result.get("broker_cpu_s", 0.0)
    return {
        "cpu_s_per_gib": cpu / (total / (1 << 30)) if total else math.nan,
        "n": len(e2e),
        "missing": missing,
        "partial_groups_left": len(consumer["partial"]),
        "p50_ms": percentile(e2e, 50) * 1000,
        "p99_ms": percentile(e2e, 99) * 1000,
        "max_ms": (max(e2e) * 1000) if e2e else math.nan,
        "after_ack_p50_ms": percentile(after_ack, 50) * 1000,
        "after_ack_p99_ms": percentile(after_ack, 99) * 1000,
        "publish_p50_ms": percentile(publish, 50) * 1000,
        "publish_p99_ms": percentile(publish, 99) * 1000,
        "warmup_batches_excluded": warmup,
        "catalog_polls_per_s": consumer.get("catalog_polls_per_s"),  # lakestream only
    }


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="vs_kafka-"))
        (self.tmp / "logs").mkdir()
        os.environ.setdefault("VS_KAFKA_CLIENT_LOG", str(self.tmp / "logs" / "librdkafka.log"))
        self.run_no = 0
        # lakestream's run folders stay until the end: deleting one (thousands of files) slows the file creations of
        # the runs after it on some file systems (see benchmarks/_common.py), and only lakestream creates files
        self.runs = RunFolders(delete_at_once=args.delete_runs_at_once)
        self.settle: dict[str, Any] = {}

    def settle_file_system(self) -> None:
        """Once, before the first run: wait until creating a file costs what it costs on a calm file system (the
        test suite or a benchmark run just before may have deleted thousands of files)."""
        self.settle = settle_and_say(self.tmp / "probe", max_wait_s=self.args.settle_max_s, indent="  ")

    def create_ms(self) -> float:
        return file_creation_ms(self.tmp / "probe")

    def close(self) -> None:
        self.runs.close()
        if not self.args.keep_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def next_run(self, label: str) -> str:
        self.run_no += 1
        return f"r{self.run_no}-{label}"

    # -- one run per system ---------------------------------------------------------------------------------------
    def kafka_run(self, *, mode: str, producers: int, batch_bytes: int, consumer: bool,
                  **kw: Any) -> tuple[dict[str, Any], float]:
        run = self.next_run("kafka")
        with Tansu(self.tmp / "logs") as broker:
            topic = f"batches-{run}"
            create_topic(broker.bootstrap, topic, self.args.world_size)
            spec = dict(run=run, mode=mode, producers=producers, batch_bytes=batch_bytes, world_size=self.args.world_size,
                        bootstrap=broker.bootstrap, topic=topic, **kw)
            cpu0 = broker.cpu_s()
            result = run_processes(spec, kafka_producer_main, kafka_consumer_main if consumer else None,
                                   timeout_s=self.args.run_timeout)
            result["broker_cpu_s"] = broker.cpu_s() - cpu0
            rss = broker.rss_mb() or math.nan
        return result, rss

    def lake_run(self, *, mode: str, producers: int, batch_bytes: int, consumer: bool,
                 **kw: Any) -> tuple[dict[str, Any], float]:
        from lakestream_iceberg import Stream

        run = self.next_run("lake")
        root = self.tmp / run
        (root / "warehouse").mkdir(parents=True)
        catalog = sqlite_catalog(str(root))
        properties = {"write.parquet.compression-codec": self.args.lake_codec}
        if self.args.layout != "auto":
            properties["lakestream.layout"] = self.args.layout
        properties["lakestream.commit.group.staging"] = self.args.staging
        Stream.create(catalog, NAME, schema=SCHEMA, world_size=self.args.world_size, properties=properties)
        catalog.engine.dispose()  # no pooled SQLite connection crosses the fork
        try:
            spec = dict(run=run, mode=mode, producers=producers, batch_bytes=batch_bytes, world_size=self.args.world_size,
                        root=str(root), consumer_timeout=self.args.run_timeout, **kw)
            result = run_processes(spec, lake_producer_main, lake_consumer_main if consumer else None,
                                   timeout_s=self.args.run_timeout)
            disk = dir_bytes(root) / MiB
        finally:
            self.runs.retire(root)
        return result, disk

    # -- 1. ingestion ------------------------------------------------------------------------------------------------
    def ingestion(self) -> tuple[Table, list[dict[str, Any]]]:
        table = Table(f"ingestion, MiB/s (W={self.args.world_size} shards/batch, lakestream layout {self.args.layout}, "
                      f"staging {self.args.staging}, "
                      f"Parquet {self.args.lake_codec} vs Kafka compression.type=none, "
                      f"{self.args.duration:g} s per run, saturated, no consumer; ratio > 1: lakestream faster)",
                      ["batch MiB", "P", "kafka MiB/s", "lakestream MiB/s", "ratio", "kafka publish p50 ms",
                       "lake commit p50 ms", "lake CAS attempts/commit", "kafka CPU s/GiB", "lake CPU s/GiB"])
        rows = []
        for size in self.args.sizes:
            for p in self.args.producers:
                kw = dict(mode="saturate", producers=p, batch_bytes=size * MiB, consumer=False, duration=self.args.duration)
                k_rounds, l_rounds = [], []
                for rnd in range(self.args.rounds):  # alternating order: whatever drifts hits both systems alike
                    for system in alternating(("kafka", "lake"), rnd):
                        create_ms = self.create_ms()  # what creating a file cost just before this run
                        if system == "kafka":
                            k_res, rss = self.kafka_run(**kw)
                            k_rounds.append(dict(summarize_ingestion(k_res), create_ms_before=create_ms))
                        else:
                            l_res, disk = self.lake_run(**kw)
                            l_rounds.append(dict(summarize_ingestion(l_res), create_ms_before=create_ms))
                k, lk = pool_rounds(k_rounds), pool_rounds(l_rounds)
                ratio = ratio_of(lk["mib_s"], k["mib_s"])
                per_round = [ratio_of(lr["mib_s"], kr["mib_s"]) for kr, lr in zip(k_rounds, l_rounds)]
                table.add(size, p, k["mib_s"], lk["mib_s"], ratio, k["publish_p50_ms"], lk["publish_p50_ms"],
                          lk["attempts_per_commit"], k["cpu_s_per_gib"], lk["cpu_s_per_gib"])
                rows.append({"batch_mib": size, "producers": p, "kafka": k, "lakestream": lk, "ratio_mib_s": ratio,
                             "ratio_per_round": per_round, "kafka_rounds": k_rounds, "lakestream_rounds": l_rounds,
                             "kafka_broker_rss_mib": rss, "lakestream_disk_mib": disk})
                rounds = ", ".join(f"{r:.2f}" for r in per_round)
                print(f"  ingestion {size:>3} MiB P={p}: kafka {k['mib_s']:7.1f} MiB/s  lakestream {lk['mib_s']:7.1f} MiB/s "
                      f"(ratio per round: {rounds})", flush=True)
        if self.args.rounds > 1:
            table.note(f"{self.args.rounds} rounds per row in alternating order (kafka then lakestream, then the other way "
                       "round), each system's rounds pooled (MiB / seconds, CPU / GiB; p50 and attempts: the rounds' "
                       "median and mean); every run starts after os.sync()")
        kept = "kept until the end" if not self.args.delete_runs_at_once else "deleted after each run (--delete-runs-at-once)"
        probes = "; ".join(f"{row['batch_mib']} MiB P={row['producers']}: kafka "
                           + "/".join(f"{r['create_ms_before']:.2f}" for r in row["kafka_rounds"]) + ", lakestream "
                           + "/".join(f"{r['create_ms_before']:.2f}" for r in row["lakestream_rounds"]) for row in rows)
        table.note(f"lakestream run folders {kept} (deleted early for disk space: {self.runs.deleted_early}); CPU ms to "
                   f"create an empty file just before each run (calm: about 0.05): {probes}")
        return table, rows

    # -- 2. latency ---------------------------------------------------------------------------------------------------
    def latency(self) -> tuple[Table, list[dict[str, Any]]]:
        p = self.args.latency_producers
        table = Table(f"visibility latency, ms (publish start -> consumer holds all W shards; {p} paced producers; "
                      "ratio < 1: lakestream faster)",
                      ["batch MiB", "interval s", "n", "kafka p50", "kafka p99", "lake p50", "lake p99", "ratio p50",
                       "ratio p99", "kafka publish p50", "lake commit p50", "kafka CPU s/GiB", "lake CPU s/GiB"])
        rows = []
        for size in self.args.sizes:
            interval, batches = self.args.pacing[size]
            kw = dict(mode="paced", producers=p, batch_bytes=size * MiB, consumer=True, interval=interval,
                      batches=batches, expected=p * batches, drain_s=15.0)
            k_res, _ = self.kafka_run(**kw)
            l_res, _ = self.lake_run(**kw)
            k = summarize_latency(k_res, key_of=lambda key: key)
            lk = summarize_latency(l_res, key_of=lambda step: step)
            r50 = lk["p50_ms"] / k["p50_ms"] if k["p50_ms"] else math.nan
            r99 = lk["p99_ms"] / k["p99_ms"] if k["p99_ms"] else math.nan
            table.add(size, interval, min(k["n"], lk["n"]), k["p50_ms"], k["p99_ms"], lk["p50_ms"], lk["p99_ms"], r50, r99,
                      k["publish_p50_ms"], lk["publish_p50_ms"], k["cpu_s_per_gib"], lk["cpu_s_per_gib"])
            rows.append({"batch_mib": size, "producers": p, "interval_s": interval, "batches_per_producer": batches,
                         "kafka": k, "lakestream": lk, "ratio_p50": r50, "ratio_p99": r99})
            print(f"  latency {size:>3} MiB: kafka p50 {k['p50_ms']:.1f} ms, lakestream p50 {lk['p50_ms']:.1f} ms "
                  f"(after commit returned: p50 {lk['after_ack_p50_ms']:.1f} ms, p99 {lk['after_ack_p99_ms']:.1f} ms; "
                  f"{lk['catalog_polls_per_s']:.0f} catalog polls/s)", flush=True)
            table.note(f"{size} MiB: lakestream consumer made {lk['catalog_polls_per_s']:.0f} catalog pointer queries/s; "
                       f"lake visibility after commit() returned p50 {lk['after_ack_p50_ms']:.1f} ms, "
                       f"p99 {lk['after_ack_p99_ms']:.1f} ms")
        return table, rows

    # -- 3. message size limit -------------------------------------------------------------------------------------
    def message_limits(self) -> tuple[Table, dict[str, Any]]:
        from confluent_kafka import KafkaException, Producer

        table = Table("message size limit (one rank shard = one Kafka message)",
                      ["batch MiB", "shard MiB", "default client (message.max.bytes=1e6)",
                       "raised client, topic max.message.bytes=1048588",
                       "lakestream"])
        out: dict[str, Any] = {"rows": []}
        world = self.args.world_size
        with Tansu(self.tmp / "logs") as broker:
            from confluent_kafka.admin import AdminClient, NewTopic

            admin = AdminClient(admin_config(broker.bootstrap))
            for f in admin.create_topics([NewTopic("limits", num_partitions=1, replication_factor=1,
                                                   config={"max.message.bytes": "1048588"})]).values():
                f.result(10)

            def send(cfg: dict[str, Any], nbytes: int) -> str:
                producer = Producer(cfg)
                result: list[str] = []
                try:
                    producer.produce("limits", value=b"\0" * nbytes,
                                     on_delivery=lambda e, m: result.append("ok" if e is None else e.name()))
                except KafkaException as exc:
                    return f"rejected at produce(): {exc.args[0].name()}"
                producer.flush(60)
                del producer
                return f"delivered: {result[0]}" if result and result[0] == "ok" else f"failed: {result}"

            for size in self.args.sizes:
                shard = size * MiB // world
                default = send({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True,
                                "logger": client_log()}, shard)
                raised = send(kafka_producer_config(broker.bootstrap, shard_bytes=shard, txn_id=None), shard)
                table.add(size, shard / MiB, default, raised, "no per-message limit (one Parquet file per shard)")
                out["rows"].append({"batch_mib": size, "shard_mib": shard / MiB, "default_client": default,
                                    "raised_client": raised})
            whole = max(self.args.sizes) * MiB
            out["one_message_whole_batch"] = {
                "bytes": whole,
                "result": send(kafka_producer_config(broker.bootstrap, shard_bytes=whole, txn_id=None), whole),
            }
            gc.collect()
        table.note("librdkafka's default message.max.bytes is 1,000,000 bytes: shards above it fail in produce() with "
                   "MSG_SIZE_TOO_LARGE; the benchmark raises it to shard size + 1 MiB.")
        table.note("Apache Kafka's broker default (message.max.bytes 1,048,588) would reject them too unless the topic's "
                   "max.message.bytes is raised; Tansu 0.6 enforces no limit and ignores the topic's max.message.bytes "
                   f"(one {max(self.args.sizes)} MiB message: {out['one_message_whole_batch']['result']}).")
        return table, out

    # -- 4. producer death ---------------------------------------------------------------------------------------
    def kafka_death(self) -> dict[str, Any]:
        from confluent_kafka import Producer

        world = self.args.world_size
        shard_bytes = self.args.death_mib * MiB // world
        values = [to_ipc(s) for s in make_shards(self.args.death_mib * MiB, world, seed=99)]
        timeout_ms = self.args.txn_timeout_ms
        idle = self.args.observe_idle_s
        out: dict[str, Any] = {"transaction_timeout_ms": timeout_ms}

        def victim(bs: str, txn_id: str | None, pipe: Any) -> None:
            """Publish one complete batch (transactional case), then half of the next one; report; wait to be killed."""
            extra = {"transaction.timeout.ms": timeout_ms} if txn_id else {}
            producer = Producer(kafka_producer_config(bs, shard_bytes=shard_bytes, txn_id=txn_id, **extra))
            name = txn_id or "plain"
            if txn_id:
                producer.init_transactions(30)
                producer.begin_transaction()
                for rank in range(world):
                    _produce(producer, "death", values[rank], f"{name}/0".encode(), rank)
                producer.commit_transaction(30)
                producer.begin_transaction()
            for rank in range(world // 2):
                _produce(producer, "death", values[rank], f"{name}/1".encode(), rank)
            producer.flush(30)
            pipe.send("half sent")
            time.sleep(600)

        def kill_after_half(bs: str, txn_id: str | None) -> None:
            parent, child = CTX.Pipe()
            proc = CTX.Process(target=victim, args=(bs, txn_id, child), daemon=True)
            proc.start()
            try:
                if not parent.poll(60):
                    raise TimeoutError("the victim producer did not send its half batch within 60 s")
                parent.recv()
                proc.kill()  # it waits to be killed (sleeps), so it is alive
            finally:
                kill_all([proc])

        # (a) a transactional producer dies with an open transaction holding half the shards of batch victim/1, while a
        #     healthy transactional producer keeps publishing complete batches on the same partitions.
        with Tansu(self.tmp / "logs") as broker:
            bs = broker.bootstrap
            create_topic(bs, "death", world)
            kill_after_half(bs, "victim")
            t_kill = time.monotonic()
            healthy = Producer(kafka_producer_config(bs, shard_bytes=shard_bytes, txn_id="healthy"))
            healthy.init_transactions(30)
            for seq in range(3):
                healthy.begin_transaction()
                for rank in range(world):
                    _produce(healthy, "death", values[rank], f"healthy/{seq}".encode(), rank)
                healthy.commit_transaction(30)
            out["txn_right_after_kill"] = observe_kafka(bs, "death", world, "read_committed", shard_bytes, idle)
            out["txn_right_after_kill_read_uncommitted"] = observe_kafka(bs, "death", world, "read_uncommitted",
                                                                         shard_bytes, idle)
            sleep_until(t_kill + timeout_ms / 1000 + 2 * idle)
            out["txn_after_timeout"] = observe_kafka(bs, "death", world, "read_committed", shard_bytes, idle)
            out["txn_after_timeout"]["seconds_after_kill"] = time.monotonic() - t_kill
            # The operator restarts the producer with the same transactional.id: init_transactions fences the dead
            # instance and aborts its open transaction.
            restarted = Producer(kafka_producer_config(bs, shard_bytes=shard_bytes, txn_id="victim"))
            restarted.init_transactions(30)
            out["txn_after_restart"] = observe_kafka(bs, "death", world, "read_committed", shard_bytes, idle)
            del healthy, restarted
            gc.collect()
        # (b) an idempotent producer without transactions (a fresh broker)
        with Tansu(self.tmp / "logs") as broker:
            create_topic(broker.bootstrap, "death", world)
            kill_after_half(broker.bootstrap, None)
            out["idempotent_only"] = observe_kafka(broker.bootstrap, "death", world, "read_committed", shard_bytes, idle)
        return out

    def lake_death(self) -> dict[str, Any]:
        from lakestream_iceberg import Stream

        world = self.args.world_size
        shards = make_shards(self.args.death_mib * MiB, world, seed=99)
        rows = [t.num_rows for t in shards]
        root = self.tmp / "lake-death"
        (root / "warehouse").mkdir(parents=True)
        catalog = sqlite_catalog(str(root))
        stream = Stream.create(catalog, NAME, schema=SCHEMA, world_size=world)
        catalog.engine.dispose()
        out: dict[str, Any] = {}

        def half_victim(pipe: Any) -> None:
            s = Stream.open(sqlite_catalog(str(root)), NAME)
            s.producer("victim").commit(shards)  # seq 0: a complete batch
            # commit() writes every shard's file first and publishes them in one snapshot last; die after half the files.
            s.writer.write(producer="victim", seq=1, shards=shards[: world // 2])
            pipe.send("half written")
            time.sleep(600)

        def loop_victim(pipe: Any) -> None:
            s = Stream.open(sqlite_catalog(str(root)), NAME)
            producer = s.producer("looper")
            pipe.send("started")
            while True:
                producer.commit(shards)

        def start_and_kill(target: Any, delay: float = 0.0) -> None:
            parent, child = CTX.Pipe()
            proc = CTX.Process(target=target, args=(child,), daemon=True)
            proc.start()
            try:
                if not parent.poll(60):
                    raise TimeoutError("victim did not report")
                parent.recv()
                time.sleep(delay)
                proc.kill()  # the looper never exits on its own
            finally:
                kill_all([proc])

        try:
            start_and_kill(half_victim)
            healthy = stream.producer("healthy")
            for _ in range(3):
                healthy.commit(shards)
            out["after_kill"] = observe_lake(stream, world, rows)
            out["orphan_files_of_victim"] = len(list((root / "warehouse").rglob("data/victim/000000000001-*.parquet")))
            restarted = stream.producer("victim")
            out["restart_next_seq"] = restarted.next_seq
            result = restarted.commit(shards)
            out["restart_committed"] = {"seq": result.seq, "step": result.step, "duplicate": result.duplicate}
            # A producer killed at a random moment inside its commit loop (writing files, or inside the CAS).
            kills = []
            rng = random.Random(7)
            for _ in range(self.args.random_kills):
                start_and_kill(loop_victim, delay=rng.uniform(0.1, 0.6))
                looper = stream.producer("looper")
                seq = looper.next_seq
                again = looper.commit(shards, seq=seq)
                kills.append({"next_seq_after_restart": seq, "duplicate": again.duplicate})
            out["random_kills"] = kills
            out["after_random_kills"] = observe_lake(stream, world, rows)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return out


def observe_kafka(bootstrap: str, topic: str, world: int, isolation: str, shard_bytes: int,
                  idle_s: float = 1.0, hard_s: float = 60.0) -> dict[str, Any]:
    """Read the whole topic with a fresh consumer; which batches are complete, which are partial.

    It reads until every partition reported its end (``enable.partition.eof``: the high watermark, or the last stable
    offset under ``read_committed``) with nothing received since, then ``idle_s`` more: never for a fixed window from
    the consumer's creation, which a slow machine could spend before the first fetch (a new consumer's first message
    takes about 0.5 s even on idle cores). ``hard_s`` bounds a broker that never reports the end."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    config = kafka_consumer_config(bootstrap, group=f"observe-{time.monotonic_ns()}", shard_bytes=shard_bytes,
                                   isolation=isolation)
    consumer = Consumer({**config, "enable.partition.eof": True})
    consumer.assign([TopicPartition(topic, r, OFFSET_BEGINNING) for r in range(world)])
    groups: dict[str, set[int]] = {}
    at_end: set[int] = set()
    ended_at: float | None = None  # when the last partition reached its end
    hard = time.monotonic() + hard_s
    try:
        while time.monotonic() < hard and (ended_at is None or time.monotonic() < ended_at + idle_s):
            for msg in consumer.consume(num_messages=64, timeout=0.1):
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(str(msg.error()))
                    at_end.add(msg.partition())
                    if len(at_end) == world and ended_at is None:
                        ended_at = time.monotonic()
                    continue
                groups.setdefault(msg.key().decode(), set()).add(msg.partition())
                at_end.discard(msg.partition())
                ended_at = None
    finally:
        consumer.close()
    complete = sorted(k for k, v in groups.items() if len(v) == world)
    partial = {k: sorted(v) for k, v in sorted(groups.items()) if len(v) < world}
    return {"isolation": isolation, "complete": complete, "partial": partial, "partial_visible": bool(partial)}


def observe_lake(stream: Any, world: int, rows: list[int]) -> dict[str, Any]:
    """Every published step: all W shards present with the right row counts? which (producer, seq) published it?"""
    head = stream.head_step()
    steps = []
    bad = []
    for step in range(1, head + 1):
        files = stream.locate(step)
        producer, name = files[0].file_path.rsplit("/data/", 1)[1].split("/")[:2]
        producer_seq = f"{producer}/{int(name.split('-')[0])}"
        with stream.step_files(step) as located:  # per rank: its file's rows; packed: the step file's rank table
            ok = len(located.counts) == world and located.counts == rows
        for rank in range(world):
            ok = ok and stream.read(step, rank=rank).num_rows == rows[rank]
        steps.append(producer_seq)
        if not ok:
            bad.append(step)
    dup = len(steps) - len(set(steps))
    return {"head_step": head, "published": steps, "incomplete_steps": bad, "duplicates": dup,
            "partial_visible": bool(bad)}


# ---------------------------------------------------------------------------------------------------- main


def death_table(kafka: dict[str, Any], lake: dict[str, Any], world: int) -> Table:
    table = Table(f"producer killed (kill -9) after sending {world // 2} of {world} shards of a batch; "
                  "a healthy producer then publishes 3 complete batches",
                  ["system / reader", "partial batch visible?", "healthy batches visible", "complete batches",
                   "partial groups (key: ranks)"])

    def row(label: str, obs: dict[str, Any]) -> None:
        partial = "; ".join(f"{k}: {v}" for k, v in obs["partial"].items()) or "-"
        healthy = sum(1 for k in obs["complete"] if k.startswith("healthy/"))
        table.add(label, "YES" if obs["partial_visible"] else "no", f"{healthy}/3" if "txn" in label else "-",
                  len(obs["complete"]), partial)

    row("kafka txn, read_committed, right after kill", kafka["txn_right_after_kill"])
    row("kafka txn, read_uncommitted, right after kill", kafka["txn_right_after_kill_read_uncommitted"])
    row(f"kafka txn, read_committed, {kafka['txn_after_timeout']['seconds_after_kill']:.0f} s after kill "
        f"(transaction.timeout.ms={kafka['transaction_timeout_ms']})", kafka["txn_after_timeout"])
    row("kafka txn, read_committed, after restart (same transactional.id)", kafka["txn_after_restart"])
    row("kafka idempotent only (no transactions)", kafka["idempotent_only"])
    for label, key in (("lakestream, after kill + 3 healthy commits", "after_kill"),
                       ("lakestream, after random kills mid-commit", "after_random_kills")):
        obs = lake[key]
        healthy = sum(1 for p in obs["published"] if p.startswith("healthy/"))
        table.add(label, "YES" if obs["partial_visible"] else "no", f"{healthy}/3",
                  obs["head_step"] - len(obs["incomplete_steps"]),
                  f"incomplete steps: {obs['incomplete_steps'] or 'none'}, duplicates: {obs['duplicates']}")
    table.note("kafka rows: each batch is keyed producer/seq; 'complete' = all W shards of the key were delivered.")
    table.note(f"lakestream: {lake['orphan_files_of_victim']} files of the killed batch stay on disk, referenced by no snapshot "
               f"(lifecycle GC removes them); the restarted producer resumed at seq {lake['restart_next_seq']} and published "
               f"it once (duplicate={lake['restart_committed']['duplicate']}); after each of {len(lake['random_kills'])} "
               "random-time kills the restarted producer re-committed its next seq without a duplicate.")
    return table


def broker_capabilities(death: dict[str, Any], limits: dict[str, Any]) -> dict[str, Any]:
    """What Tansu did with each exactly-once feature a careful Kafka user relies on (measured above, not assumed)."""
    caps: dict[str, Any] = {
        "idempotent_producer": "accepted (InitProducerId succeeds; enable.idempotence=true works)",
        "max_message_bytes_enforced":
            not str(limits.get("one_message_whole_batch", {}).get("result", "")).startswith("delivered"),
    }
    if not death:
        return caps
    healthy = [f"healthy/{i}" for i in range(3)]
    caps.update({
        "transactions_api": "init/begin/commit_transaction succeed; aborts are acknowledged",
        "read_committed_hides_open_transaction": "victim/1" not in death["txn_right_after_kill"]["partial"],
        "read_committed_blocks_other_producers_behind_open_transaction":
            not all(h in death["txn_right_after_kill"]["complete"] for h in healthy),
        "transaction_timeout_aborts_dead_producer": all(h in death["txn_after_timeout"]["complete"] for h in healthy)
            and "victim/1" not in death["txn_after_timeout"]["partial"],
        "read_committed_hides_aborted_transaction": "victim/1" not in death["txn_after_restart"]["partial"],
    })
    return caps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = bench_parser(__doc__, out=RESULTS_DIR / "vs_kafka.json")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--layout", choices=("auto", "per-rank", "packed"), default="auto",
                    help="lakestream.layout of the stream (auto: the default for the world size)")
    ap.add_argument("--staging", choices=("auto", "catalog", "storage"), default="auto",
                    help="lakestream.commit.group.staging of the stream (auto: intents as rows of the SQLite catalog)")
    ap.add_argument("--lake-codec", default="uncompressed",
                    help="write.parquet.compression-codec of the stream (default uncompressed, as the Kafka producer's "
                         "compression.type=none: the payload is incompressible; zstd is lakestream's default codec)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per saturated ingestion run (default 4)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="ingestion rounds per configuration, in alternating order (default 2; --smoke 1)")
    ap.add_argument("--sizes", default=None, help="global batch sizes in MiB (default 1,16,64)")
    ap.add_argument("--producers", default=None, help="producer process counts (default 1,4,8)")
    ap.add_argument("--latency-producers", type=int, default=2)
    ap.add_argument("--txn-timeout-ms", type=int, default=5000)
    ap.add_argument("--keep-tmp", action="store_true")
    ap.add_argument("--settle-max-s", type=float, default=None,
                    help="at most this long, before the first run, wait for file creation to be calm after deletions "
                         "made before the benchmark (default 420; --smoke 0: measure only)")
    ap.add_argument("--delete-runs-at-once", action="store_true",
                    help="delete each lakestream run's folder right after the run, as before 2026-12-03 (the runs after "
                         "it then pay for the deletion on some file systems; see benchmarks/_common.py)")
    ap.add_argument("--only", default="ingestion,latency,death", help="parts to run (message limits always run)")
    args = ap.parse_args(argv)
    args.only = set(args.only.split(","))
    smoke = args.smoke
    fill_defaults(args, duration=(4.0, 0.5), rounds=(2, 1), sizes=("1,16,64", "1"), producers=("1,4,8", "1,2"),
                  settle_max_s=(420.0, 0.0))
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    args.sizes, args.producers = int_list(args.sizes), int_list(args.producers)
    # (interval between a producer's batches, batches per producer) for the paced latency runs. 1 MiB: 150 batches per
    # producer, so that its p99 is taken over about 300 batches (the 3rd slowest); with 40 (until 2026-12-03) it was
    # the 2nd slowest of 78, a single stall of the machine decided it
    args.pacing = {s: ((0.1, 6) if smoke else (0.1, 150)) if s <= 1 else (0.4, 15) if s <= 16 else (1.2, 6) for s in args.sizes}
    args.death_mib = 1
    args.random_kills = 1 if smoke else 3
    args.run_timeout = 120.0
    args.observe_idle_s = 0.5 if smoke else 1.0
    if smoke:
        args.txn_timeout_ms = min(args.txn_timeout_ms, 1000)
    return args


def main(argv: list[str] | None = None) -> int:
    import confluent_kafka
    import pyiceberg

    args = parse_args(argv)
    run = Run("vs_kafka", smoke=args.smoke)
    bench = Bench(args)
    try:
        bench.settle_file_system()
        print(f"vs_kafka: tansu {tansu_version()}, confluent-kafka {confluent_kafka.version()[0]} "
              f"(librdkafka {confluent_kafka.libversion()[0]}), W={args.world_size}, sizes {args.sizes} MiB, "
              f"P {args.producers}{' [smoke]' if args.smoke else ''}", flush=True)
        with run.phase("ingestion"):
            ingest_table, ingest_rows = bench.ingestion() if "ingestion" in args.only else (Table("ingestion (skipped)", ["-"]), [])
        with run.phase("latency"):
            latency_table, latency_rows = bench.latency() if "latency" in args.only else (Table("latency (skipped)", ["-"]), [])
        with run.phase("message_limits"):
            limit_table, limits = bench.message_limits()
        kafka_death: dict[str, Any] = {}
        lake_death: dict[str, Any] = {}
        dtable = Table("producer death (skipped)", ["-"])
        if "death" in args.only:
            with run.phase("kafka_death"):
                kafka_death = bench.kafka_death()
            with run.phase("lake_death"):
                lake_death = bench.lake_death()
            dtable = death_table(kafka_death, lake_death, args.world_size)
    finally:
        bench.close()
    run.finish([ingest_table, latency_table, limit_table, dtable], {
        "phase_s": run.phases,
        "file_system_at_start": bench.settle,
        "config": {"lake_codec": args.lake_codec, "staging": args.staging, "world_size": args.world_size, "sizes_mib": args.sizes, "producers": args.producers,
                   "duration_s": args.duration, "rounds": args.rounds, "latency_producers": args.latency_producers,
                   "pacing": {str(k): {"interval_s": v[0], "batches_per_producer": v[1]} for k, v in args.pacing.items()},
                   "sample_bytes": SAMPLE_BYTES, "kafka_acks": "all", "kafka_isolation": "read_committed",
                   "lakestream_catalog": "sqlite (embedded) + local warehouse in a temp dir"},
        "versions": {"tansu": tansu_version(), "confluent_kafka": confluent_kafka.version()[0],
                     "librdkafka": confluent_kafka.libversion()[0], "pyiceberg": pyiceberg.__version__,
                     "pyarrow": pa.__version__},
        "machine": machine(),
        "broker_capabilities": broker_capabilities(kafka_death, limits),
        "ingestion": ingest_rows,
        "latency": latency_rows,
        "message_size_limit": limits,
        "producer_death": {"kafka": kafka_death, "lakestream": lake_death},
    }, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
