"""Retention for other engines' streaming readers: what keeping snapshots by age costs a stream committing at R steps/s.

A Spark or Flink streaming reader with a trigger of T seconds resumes at the snapshot it stopped at, so that snapshot
must still be in the table's metadata T seconds (and R x T commits) later. Iceberg's
``history.expire.max-snapshot-age-ms`` (honoured by the expiry every lakestream commit does in passing) keeps every
snapshot of a branch younger than that age, at most ``lakestream.snapshots.retain-max`` (default 2,000) per branch:
metadata.json is bounded by that count.

``--producers`` producer processes (1 and 4 by default) commit paced at ``--rate`` steps/s together for ``--seconds`` on
the embedded SQLite catalog + local warehouse (several producers: group commit),
once with count retention only (``lakestream.snapshots.retain-last`` 8, the default) and once with an age of
``--trigger`` + 5 s, one after the other on fresh streams. Reported per scenario: snapshots kept at the end, the size
of the current metadata.json, and commit latency p50/p99 over the last quarter of the run (steady state).

    python benchmarks/stream_retention.py                     # R = 100 steps/s, T = 10 s, 40 s per scenario
    python benchmarks/stream_retention.py --quick             # R = 50, T = 2, 8 s per scenario

Writes ``benchmarks/results/stream_retention.json``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    Run,
    StartLine,
    Table,
    batches,
    bench_parser,
    int_list,
    percentile,
    preloaded_context,
    run_together,
    sqlite_catalog,
)

from lakestream_iceberg import Stream  # noqa: E402

SCHEMA = pa.schema([("id", pa.int64()), ("tokens", pa.list_(pa.int32()))])
WORLD = 2


def _batch(seq: int) -> list[pa.Table]:
    return [pa.table({"id": [seq * 8 + i for i in range(8)], "tokens": [[rank, i] for i in range(8)]}, schema=SCHEMA)
            for rank in range(WORLD)]


def _produce(root: str, name: str, producer_id: str, rate: float, seconds: float, count: int, line: StartLine) -> None:
    """A producer process: commits paced at ``rate`` for ``seconds`` after every producer is ready (``count`` > 0:
    exactly that many, however late a busy machine lets them run)."""
    stream = Stream.open(sqlite_catalog(root), f"bench.{name}")
    producer = stream.producer(producer_id)
    latencies: list[tuple[float, float]] = []
    line.wait()
    start = time.monotonic()
    for seq in batches(mode="paced", start=start, duration=seconds, count=count, interval=1 / rate):
        began = time.monotonic()
        producer.commit(_batch(seq), seq=seq)
        latencies.append((began - start, time.monotonic() - began))
    line.report((producer_id, len(latencies), latencies))


def run(root: Path, name: str, props: dict[str, str], *, rate: float, seconds: float, producers: int,
        exact: bool = False) -> dict[str, float]:
    stream = Stream.create(sqlite_catalog(root), f"bench.{name}", schema=SCHEMA, world_size=WORLD, properties=props)
    count = max(1, round(rate / producers * seconds)) if exact else 0
    results, _ = run_together(preloaded_context(), _produce,
                              [(str(root), name, f"p{i}", rate / producers, seconds, count) for i in range(producers)],
                              timeout_s=seconds + 300)
    steps = sum(r[1] for r in results)
    # steady state: the last quarter of each producer's commits (at least one), whenever a busy machine let them run
    steady = [lat for r in results for _, lat in r[2][-max(1, len(r[2]) // 4):]]
    metadata = stream.refresh().table.metadata
    head = stream.head_step()
    if head != steps:
        raise SystemExit(f"{steps} commits published {head} steps: not exactly once")
    return {
        "producers": producers,
        "steps": steps,
        "steps_per_s": steps / seconds,
        "snapshots_kept": len(metadata.snapshots),
        "metadata_json_kib": len(stream.io.new_input(stream.table.metadata_location)) / 1024,
        "commit_p50_ms": percentile(steady, 50) * 1000,
        "commit_p99_ms": percentile(steady, 99) * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, whole_doc=True, smoke_help="R = 50, T = 1 s, 2 s per scenario (tests)")
    parser.add_argument("--rate", type=float, default=100.0, help="steps per second (default 100)")
    parser.add_argument("--trigger", type=float, default=10.0, help="the streaming reader's trigger, seconds (default 10)")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each scenario (default 40)")
    parser.add_argument("--producers", default="1,4", help="producer processes per scenario, comma-separated (default 1,4)")
    parser.add_argument("--quick", action="store_true", help="R = 50, T = 2 s, 8 s per scenario")
    args = parser.parse_args(argv)
    if args.quick:
        args.rate, args.trigger, args.seconds = 50.0, 2.0, 8.0
    if args.smoke:
        args.rate, args.trigger, args.seconds, args.producers = 50.0, 1.0, 2.0, "1,2"
    bench = Run("stream_retention", smoke=args.smoke)
    counts = int_list(args.producers)
    # a smoke run keeps by age too, an age no run reaches however busy the machine: it checks that nothing is expired
    age_ms = int((args.trigger + 5) * 1000) if not args.smoke else 600_000
    scenarios = {
        "count": {},
        "age": {"history.expire.max-snapshot-age-ms": str(age_ms)},
    }
    table = Table(f"retention for streaming readers: R = {args.rate:g} steps/s, T = {args.trigger:g} s "
                  f"(age kept: {age_ms / 1000:g} s)",
                  ["retention", "producers", "steps/s", "snapshots kept", "metadata.json KiB", "commit p50 ms",
                   "commit p99 ms"])
    results = {}
    with tempfile.TemporaryDirectory(prefix="lakestream-stream-retention-") as tmp:
        for producers in counts:
            for name, props in scenarios.items():
                found = run(Path(tmp), f"{name}_{producers}", props, rate=args.rate, seconds=args.seconds,
                            producers=producers, exact=args.smoke)
                results[f"{name}/{producers}"] = found
                table.add(name, producers, found["steps_per_s"], found["snapshots_kept"], found["metadata_json_kib"],
                          found["commit_p50_ms"], found["commit_p99_ms"])
    needed = args.rate * args.trigger
    table.note(f"a reader with trigger T needs the last R x T = {needed:,.0f} snapshots; age retention is bounded by "
               "lakestream.snapshots.retain-max (default 2,000); every scenario published each commit exactly once")
    bench.finish([table], {"rate": args.rate, "trigger_s": args.trigger, "seconds": args.seconds, "max_age_ms": age_ms,
                         "results": results, "table": table}, out=args.out, spaced=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
