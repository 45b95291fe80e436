"""``make demo`` / ``lakestream demo``: producer processes publish, trainer-rank processes consume, and we check it.

Several producer processes publish synthetic multimodal samples (token sequences of random length and image-like byte
blobs of random size, all deterministic from ``(producer, seq, rank)``) into a fresh stream of the embedded catalog
(``./.lakestream/`` unless ``--home``/``$LAKESTREAM_HOME``/``--catalog`` say otherwise). Several trainer-rank processes read
their shard of every step in order (``stream.wait_for`` + ``stream.read``) and report a content digest per step. The
summary compares what the consumers saw with what the producers committed: every rank must receive every sample
exactly once, in step order, or the demo exits non-zero.

Example:
    $ lakestream demo --producers 3 --ranks 2 --steps-per-producer 20
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import random
import secrets
import signal
import sys
import threading
import time
import traceback
from array import array
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa

from lakestream_iceberg.tools.config import CatalogSpec, load
from lakestream_iceberg.write import host

__all__ = ["SCHEMA", "DemoResult", "make_shard", "run_demo", "shard_digest"]

MAX_PROCESSES = 256  # producer plus rank processes one demo starts at most

SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),  # "<producer>/<seq>/<rank>/<i>": unique, names its origin
    pa.field("source", pa.string()),                     # where the sample came from (provenance), e.g. a document URI
    pa.field("tokens", pa.list_(pa.int32())),             # a token sequence of random length
    pa.field("image", pa.binary()),                       # an image-like blob (height x width x 3 bytes)
    pa.field("height", pa.int32()),
    pa.field("width", pa.int32()),
])
CHECK_PASSED = "exactly-once check: PASSED"
CHECK_FAILED = "exactly-once check: FAILED"


def make_shard(producer: str, seq: int, rank: int, *, max_samples: int = 8) -> pa.Table:
    """Rank ``rank``'s samples of batch ``seq`` of ``producer``: deterministic, of varying count and size (0 allowed)."""
    rng = random.Random(f"{producer}/{seq}/{rank}")
    n = rng.randint(0, max_samples)
    ids, sources, tokens, images, heights, widths = [], [], [], [], [], []
    for i in range(n):
        length = rng.randint(8, 1024)
        height, width = rng.randint(8, 96), rng.randint(8, 96)
        ids.append(f"{producer}/{seq}/{rank}/{i}")
        sources.append(f"synthetic://{producer}/corpus-{rng.randrange(16):02d}/doc-{rng.randrange(100_000):05d}")
        tokens.append(array("H", rng.randbytes(2 * length)).tolist())
        images.append(rng.randbytes(height * width * 3))
        heights.append(height)
        widths.append(width)
    return pa.table({"sample_id": ids, "source": sources, "tokens": tokens, "image": images, "height": heights,
                     "width": widths}, schema=SCHEMA)


def shard_digest(table: pa.Table) -> str:
    """A content digest of a shard, row by row in order (independent of Arrow chunking or buffer layout)."""
    h = hashlib.sha256()
    h.update(str(table.num_rows).encode())
    columns = {name: table.column(name).to_pylist() for name in ("sample_id", "source", "tokens", "image")}
    for sample_id, source, tokens, image in zip(*columns.values(), strict=True):
        h.update(b"\x00" + sample_id.encode() + b"\x00" + (source or "").encode() + b"\x00")
        h.update(array("i", tokens or []).tobytes())
        h.update(b"\x00" + (image or b""))
    return h.hexdigest()


# -- worker processes (spawned: module-level functions, arguments picklable) -------------------------------------------
def _finish(out: Any) -> None:
    """Flush this worker's reports, then leave without interpreter teardown.

    The parent already has everything it needs; skipping finalisation (as multiprocessing's forked children do) avoids
    a rare native abort ("terminate called without an active exception") seen while a reader process tears down its
    native thread pools at exit, which would otherwise turn a finished worker into a failed one.
    """
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _producer_main(spec: CatalogSpec, name: str, producer_id: str, steps: int, out: Any) -> None:
    logging.getLogger(host.__name__).setLevel(logging.ERROR)  # the parent reports the host check once, in the summary
    try:
        from lakestream_iceberg.stream import Stream

        stream = Stream.open(load(spec), name)
        producer = stream.producer(producer_id)
        seq = producer.next_seq
        for _ in range(steps):
            shards = [make_shard(producer_id, seq, rank) for rank in range(stream.world_size)]
            result = producer.commit(shards, seq=seq)
            out.put(("commit", producer_id, seq, result.step, result.attempts, result.latency_s, result.bytes,
                     [s.num_rows for s in shards], [shard_digest(s) for s in shards], result.duplicate))
            seq += 1
        out.put(("done", producer_id))
    except BaseException as exc:  # report, then fail the process: the parent turns it into one clear line
        out.put(("error", producer_id, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
    _finish(out)


def _consumer_main(spec: CatalogSpec, name: str, rank: int, total_steps: int, timeout_s: float, out: Any) -> None:
    who = f"rank-{rank}"
    try:
        from lakestream_iceberg.stream import Stream

        stream = Stream.open(load(spec), name)
        seen: set[str] = set()
        step = 1
        while step <= total_steps:
            head = stream.wait_for(step, timeout=timeout_s)
            while step <= min(head, total_steps):
                shard = stream.read(step, rank=rank)
                ids = shard.column("sample_id").to_pylist()
                duplicates = sum(1 for i in ids if i in seen)
                misrouted = sum(1 for i in ids if int(i.split("/")[2]) != rank)
                seen.update(ids)
                out.put(("read", who, rank, step, shard.num_rows, shard.nbytes, shard_digest(shard), duplicates, misrouted))
                step += 1
        out.put(("done", who))
    except BaseException as exc:
        out.put(("error", who, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
    _finish(out)


# -- the run ------------------------------------------------------------------------------------------------------------
@dataclass
class DemoResult:
    """What the demo measured and checked (``as_dict()`` is the ``--json`` output)."""

    stream: str
    where: str
    producers: int
    ranks: int
    steps_per_producer: int
    steps: int = 0
    samples: int = 0
    bytes_published: int = 0
    bytes_consumed: int = 0
    elapsed_s: float = 0.0
    window_s: float = 0.0  # from the first commit's start to the last read: the data plane's busy time
    latencies_s: list[float] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    host_copy_slow: bool = False  # this host's memcpy has glibc bug 30994 (write/host.py): producers pay more CPU

    @property
    def passed(self) -> bool:
        return not self.problems

    def percentile(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream, "catalog": self.where, "producers": self.producers, "ranks": self.ranks,
            "steps_per_producer": self.steps_per_producer, "steps": self.steps, "samples": self.samples,
            "bytes_published": self.bytes_published, "bytes_consumed": self.bytes_consumed,
            "elapsed_s": round(self.elapsed_s, 3), "window_s": round(self.window_s, 3),
            "mb_per_s": round(self.bytes_published / 1e6 / self.window_s, 3) if self.window_s else None,
            "commit_latency_p50_ms": round(self.percentile(50) * 1000, 1),
            "commit_latency_p99_ms": round(self.percentile(99) * 1000, 1),
            "attempts_max": max(self.attempts, default=0),
            "exactly_once": "passed" if self.passed else "failed", "problems": self.problems,
            "host_copy_slow": self.host_copy_slow,
        }


def _check(result: DemoResult, committed: dict[int, tuple], reads: dict[int, list[tuple]], producer_ids: list[str]) -> None:
    """Every step 1..N committed once by a distinct (producer, seq); every rank saw each step in order, byte-exact."""
    problems = result.problems
    total = result.producers * result.steps_per_producer
    if sorted(committed) != list(range(1, total + 1)):
        problems.append(f"committed steps are not exactly 1..{total}: got {len(committed)} distinct steps")
    pairs = sorted((c[0], c[1]) for c in committed.values())
    expected_pairs = sorted((p, s) for p in producer_ids for s in range(result.steps_per_producer))
    if pairs != expected_pairs:
        problems.append("the (producer, seq) pairs committed differ from those produced (a duplicate or a loss)")
    for rank in range(result.ranks):
        got = reads.get(rank, [])
        steps = [r[0] for r in got]
        if steps != list(range(1, total + 1)):
            problems.append(f"rank {rank} received steps {steps[:5]}... ({len(steps)} reads), not 1..{total} in order")
            continue
        for step, rows, digest, duplicates, misrouted in got:
            c = committed.get(step)
            if c is None or c[3][rank] != digest or c[2][rank] != rows:
                problems.append(f"rank {rank} step {step}: content differs from what producer "
                                f"{c[0] if c else '?'} committed")
            if duplicates or misrouted:
                problems.append(f"rank {rank} step {step}: {duplicates} duplicate and {misrouted} misrouted samples")
    del problems[20:]


def run_demo(
    *,
    producers: int = 3,
    ranks: int = 2,
    steps_per_producer: int = 20,
    spec: CatalogSpec | None = None,
    stream_name: str | None = None,
    progress: bool | None = None,
    timeout_s: float = 300.0,
) -> DemoResult:
    """Run the demo end to end and return what it measured and checked (never raises for a failed check).

    Args:
        producers: Producer processes; each publishes ``steps_per_producer`` global batches.
        ranks: Trainer-rank processes (the stream's world size).
        steps_per_producer: Batches per producer.
        spec: The catalog; default the embedded one (``./.lakestream`` / ``$LAKESTREAM_HOME``).
        stream_name: Default a fresh ``demo.run_<time>_<random>``.
        progress: Show progress bars (``None``: when stderr is a terminal).
        timeout_s: Give up (and report failure) after this long.
    """
    from tqdm.auto import tqdm

    from lakestream_iceberg.stream import Stream

    spec = spec or CatalogSpec()
    from lakestream_iceberg.errors import ConfigError

    if min(producers, ranks, steps_per_producer) < 1:
        raise ConfigError("--producers, --ranks and --steps-per-producer must each be at least 1")
    if producers + ranks > MAX_PROCESSES:  # each is a process with pyarrow and pyiceberg loaded (~150 MB)
        raise ConfigError(f"the demo runs one process per producer and per rank: --producers {producers} + --ranks "
                          f"{ranks} is more than {MAX_PROCESSES}; run a larger job with your own processes "
                          "(docs/guide/producers.md)")
    name = stream_name or f"demo.run_{datetime.now():%Y%m%d_%H%M%S}_{secrets.token_hex(2)}"
    stream = Stream.create(load(spec), name, schema=SCHEMA, world_size=ranks)
    result = DemoResult(stream=name, where=spec.describe(), producers=producers, ranks=ranks,
                        steps_per_producer=steps_per_producer, host_copy_slow=host.check_copy().slow)
    total = producers * steps_per_producer
    producer_ids = [f"prep-{i}" for i in range(producers)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = {f"rank-{r}": ctx.Process(target=_consumer_main, args=(spec, name, r, total, timeout_s, out),
                                      name=f"lakestream-demo-rank-{r}") for r in range(ranks)}
    procs.update({pid: ctx.Process(target=_producer_main, args=(spec, name, pid, steps_per_producer, out),
                                   name=f"lakestream-demo-{pid}") for pid in producer_ids})
    disable = None if progress is None else not progress
    bars = [tqdm(total=total, desc="published ", unit="step", position=0, disable=disable, leave=True)]
    bars += [tqdm(total=total, desc=f"rank {r} read", unit="step", position=r + 1, disable=disable, leave=True)
             for r in range(ranks)]
    committed: dict[int, tuple] = {}
    reads: dict[int, list[tuple]] = {r: [] for r in range(ranks)}
    done: set[str] = set()
    started = time.monotonic()
    first_commit = last_event = None
    # Ctrl-C is the parent's to handle: children started with SIGINT ignored (the disposition outlives spawn's exec)
    # print no KeyboardInterrupt traceback of their own, and the parent stops them at once instead of waiting for them
    ignore = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore else None
    try:
        for proc in procs.values():
            proc.start()
    finally:
        if ignore:
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    finished = False  # the loop ran to its end: the workers are given time to exit on their own
    try:
        while len(done) < len(procs):
            if time.monotonic() - started > timeout_s:
                result.problems.append(f"gave up after {timeout_s:.0f}s: {sorted(set(procs) - done)} did not finish")
                break
            try:
                msg = out.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [w for w, p in procs.items() if w not in done and p.exitcode not in (None, 0)]
                if dead:
                    result.problems.append(f"{', '.join(dead)} exited without finishing")
                    break
                continue
            kind, who = msg[0], msg[1]
            if kind == "commit":
                _, pid, seq, step, attempts, latency, nbytes, rows, digests, duplicate = msg
                if step in committed or duplicate:
                    result.problems.append(f"step {step} published twice ({committed.get(step, ('?',))[0]} and {pid})")
                committed[step] = (pid, seq, rows, digests)
                now = time.monotonic()
                first_commit = min(first_commit or now, now - latency)
                last_event = now
                result.latencies_s.append(latency)
                result.attempts.append(attempts)
                result.bytes_published += nbytes
                result.samples += sum(rows)
                bars[0].update(1)
            elif kind == "read":
                _, _, rank, step, rows, nbytes, digest, duplicates, misrouted = msg
                reads[rank].append((step, rows, digest, duplicates, misrouted))
                last_event = time.monotonic()
                result.bytes_consumed += nbytes
                bars[rank + 1].update(1)
            elif kind == "done":
                done.add(who)
            elif kind == "error":
                result.problems.append(f"{who} failed: {msg[2]}")
                done.add(who)
                break
        finished = True
    finally:
        result.elapsed_s = time.monotonic() - started
        if first_commit is not None and last_event is not None:
            result.window_s = last_event - first_commit
        for bar in bars:
            bar.close()
        for proc in procs.values():
            proc.join(timeout=30 if finished and not result.problems else 0)  # interrupted: stop them now
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
        out.close()
    result.steps = len(committed)
    crashed = [f"{w} (exit code {p.exitcode})" for w, p in procs.items() if p.exitcode not in (0, None)]
    if crashed and not result.problems:
        result.problems.append(f"worker processes exited abnormally: {', '.join(crashed)}")
    if not result.problems:
        _check(result, committed, reads, producer_ids)
    if not result.problems:
        head = stream.head_step()
        if head != total:
            result.problems.append(f"the table's head step is {head}, expected {total}")
    return result


def format_summary(result: DemoResult, *, hint_args: str = "") -> str:
    d = result.as_dict()
    lines = [
        f"lakestream demo: stream {result.stream} in {result.where}",
        f"  producers x steps  {result.producers} x {result.steps_per_producer}, ranks {result.ranks}",
        f"  steps              {result.steps}",
        f"  samples            {result.samples:,}",
        f"  data               {result.bytes_published / 1e6:.1f} MB published and {result.bytes_consumed / 1e6:.1f} MB "
        f"read in {result.window_s:.1f} s: {d['mb_per_s']} MB/s end to end ({result.elapsed_s:.1f} s with process start-up)",
        f"  commit latency     p50 {d['commit_latency_p50_ms']} ms, p99 {d['commit_latency_p99_ms']} ms "
        f"(compare-and-swap attempts: max {d['attempts_max']})",
    ]
    if result.host_copy_slow:
        lines.append(f"  host               slow memcpy (glibc bug 30994): Parquet writing costs up to a third more CPU; "
                     f"set {host.TUNABLES_ADVICE} for producers (`lakestream host`)")
    total = result.producers * result.steps_per_producer
    if result.passed:
        lines.append(f"{CHECK_PASSED}: every rank received every sample exactly once, in step order "
                     f"({total} steps x {result.ranks} ranks, {result.samples:,} samples, content digests match)")
        lines.append(f"next: lakestream{hint_args} status {result.stream}")
        lines.append(f'      lakestream{hint_args} sql {result.stream} "SELECT producer, count(*) AS steps, '
                     'sum(samples) AS samples FROM batches GROUP BY 1 ORDER BY 1"')
    else:
        lines.append(f"{CHECK_FAILED}: " + "; ".join(result.problems))
    return "\n".join(lines)
