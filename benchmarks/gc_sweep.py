"""GC's sweep on object storage: deletes side by side on a pool sized by pyiceberg's max-workers against one at a time.

    .venv/bin/python benchmarks/gc_sweep.py           # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/gc_sweep.py --smoke --out /tmp/gc_sweep.json   # seconds

SQLite catalog, warehouse on SeaweedFS's S3, or moto's with ``--store moto`` (started, waited for and stopped by this
script through ``catalog/services.py``). Each run makes a fresh stream (world size ``--world-size``), publishes ``--steps`` steps from
one producer, reads them, checkpoints the last one, and runs ``collect_garbage(dry_run=False)`` in a fresh process:
every step below the checkpoint is collected, so the sweep deletes their data files and the manifests and lists no
retained snapshot needs. The two modes differ only in pyiceberg's ``max-workers`` setting, which sizes the pool the
sweep deletes on:

* ``one at a time``: ``PYICEBERG_MAX_WORKERS=1``;
* ``pool``: the default (``PYICEBERG_MAX_WORKERS`` unset: ``min(32, cores + 4)`` threads);
* ``pool of 16``: ``PYICEBERG_MAX_WORKERS=16``.

SeaweedFS runs on this host and answers a request in about 1-3 ms; an object store in a region answers a DELETE in
10-30 ms (pyarrow's delete is three requests: a HEAD of the file, the DELETE, a check of its folder). SeaweedFS
(``weed mini``) holds some HEADs of a folder whose files are being deleted side by side for about a second; moto and
S3 do not. So each mode runs twice: against SeaweedFS directly, and through a line that delays every request by
``--latency-ms`` (``harness.latency.DelayedLine``; default 20 ms). Only the GC goes through the line; the stream is
published directly.

Per (latency, mode) (``--rounds`` rounds, modes in rotating order): files deleted, GC wall time (its two commits, the
listing and the sweep), files deleted per second, with the ratio to ``one at a time``. Every run checks that the files
left under ``data/`` are exactly the retained step's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow as pa  # noqa: E402
from _common import DelayedLine, Run, Table, bench_parser, median, rotating  # noqa: E402

from catalog import services  # noqa: E402

MODES = {"one at a time": "1", "pool": None, "pool of 16": "16"}  # label -> PYICEBERG_MAX_WORKERS (None: unset)
SCHEMA = pa.schema([("id", pa.int64()), ("payload", pa.binary())])

_GC_CHILD = r"""
import json, sys, time
from datetime import timedelta
from pyiceberg.catalog import load_catalog
from lakestream_iceberg import Stream
from lakestream_iceberg.connect.storage import list_files
from pyiceberg.utils.concurrent import ExecutorFactory

props, name = json.loads(sys.argv[1]), sys.argv[2]
stream = Stream.open(load_catalog("bench", **props), name)
began = time.perf_counter()
report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
wall = time.perf_counter() - began
stream.table.refresh()
left = sorted(p for p, _, _ in list_files(stream.io, stream.table.metadata.location + "/data") if p.endswith(".parquet"))
wanted = sorted(f.file_path for f in stream.index.files(stream.table.current_snapshot(), stream.head_step()))
print(json.dumps({"wall_s": wall, "files": report.total_files, "data_files": report.files_deleted.get("data", 0),
                  "failed": report.files_failed, "workers": ExecutorFactory.get_or_create()._max_workers,
                  "left_is_retained": left == wanted, "collected_below": report.collected_below}))
"""


def publish(props: dict[str, str], name: str, *, steps: int, world: int) -> None:
    from pyiceberg.catalog import load_catalog

    from lakestream_iceberg import Stream

    stream = Stream.create(load_catalog("bench", **props), name, schema=SCHEMA, world_size=world)
    producer = stream.producer("prep-0")
    for seq in range(steps):
        producer.commit([pa.table({"id": [seq * world + rank], "payload": [os.urandom(256)]}, schema=SCHEMA)
                         for rank in range(world)], seq=seq)
    for step in range(1, steps + 1):
        stream.read(step, rank=0)
    stream.checkpoint("last", step=steps)


def gc_in_a_fresh_process(props: dict[str, str], name: str, mode: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYICEBERG_MAX_WORKERS"}
    if MODES[mode] is not None:
        env["PYICEBERG_MAX_WORKERS"] = str(MODES[mode])
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _GC_CHILD, json.dumps(props), name], env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the GC process failed:\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = bench_parser(__doc__.split("\n\n")[0], smoke_help="seconds, for tests")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--store", choices=("seaweedfs", "moto"), default="seaweedfs")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.world_size, args.rounds, args.latency_ms = 6, 2, 1, 5.0
    latencies = (0.0, args.latency_ms)
    root = Path(tempfile.mkdtemp(prefix="gc_sweep-"))
    runs: list[dict[str, Any]] = []
    try:
        with (services.MotoS3(root / "moto") if args.store == "moto" else services.SeaweedFS(root / "seaweedfs")) as weed:
            bench = Run("gc_sweep", smoke=args.smoke)
            props = {"type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"s3://{weed.bucket}/bench",
                     **weed.s3_properties()}
            from pyiceberg.catalog import load_catalog

            load_catalog("bench", **props).create_namespace_if_not_exists("bench")
            port = int(weed.s3_endpoint.rsplit(":", 1)[1])
            for latency in latencies:
                with DelayedLine(target_port=port, delay_s=latency / 1000) as line:
                    far = {**props, "s3.endpoint": f"http://127.0.0.1:{line.port}"} if latency else props
                    for rnd in range(args.rounds):
                        for mode in rotating(tuple(MODES), rnd):
                            name = f"bench.l{int(latency)}_r{rnd}_{mode.replace(' ', '_')}"
                            publish(props, name, steps=args.steps, world=args.world_size)
                            result = {"latency_ms": latency, "round": rnd, "mode": mode,
                                      **gc_in_a_fresh_process(far, name, mode)}
                            runs.append(result)
                            print(f"  +{latency:3.0f} ms round {rnd} {mode:14s}: {result['files']:5d} files in "
                                  f"{result['wall_s']:6.2f} s ({result['workers']} workers)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = Table(f"GC on S3 ({'moto' if args.store == 'moto' else 'SeaweedFS'}): {args.steps} steps x W={args.world_size} collected, one producer; the sweep's "
                  "deletes on a pool of pyiceberg's max-workers against one at a time (rates: median of rounds)",
                  ["added latency ms", "mode", "workers", "files deleted", "GC s", "files/s",
                   "files/s vs one at a time", "left = retained", "failed deletes"])
    rows: list[dict[str, Any]] = []
    for latency in latencies:
        rates = {m: median(r["files"] / r["wall_s"] for r in runs if r["mode"] == m and r["latency_ms"] == latency)
                 for m in MODES}
        for mode in MODES:
            mine = [r for r in runs if r["mode"] == mode and r["latency_ms"] == latency]
            row = {"latency_ms": latency, "mode": mode, "workers": mine[0]["workers"],
                   "files": median(r["files"] for r in mine), "gc_s": median(r["wall_s"] for r in mine),
                   "files_per_s": rates[mode], "ratio_to_one_at_a_time": rates[mode] / rates["one at a time"],
                   "left_is_retained": all(r["left_is_retained"] for r in mine),
                   "failed": sum(r["failed"] for r in mine)}
            rows.append(row)
            table.add(latency, mode, row["workers"], row["files"], row["gc_s"], row["files_per_s"],
                      row["ratio_to_one_at_a_time"], "yes" if row["left_is_retained"] else "NO", row["failed"])
    table.note(f"{args.rounds} rounds, modes in rotating order, each on a fresh stream; GC s is collect_garbage's wall time "
               "in a fresh process (two commits, the listing, the sweep); 'one at a time' is PYICEBERG_MAX_WORKERS=1; the added "
               "latency delays every request the GC sends (harness.latency.DelayedLine)")
    bench.finish([table], {"rows": rows, "runs": runs, "table": table.as_dicts(), "seconds": bench.elapsed_s,
                           "config": {"steps": args.steps, "world_size": args.world_size, "rounds": args.rounds,
                                      "latency_ms": args.latency_ms, "store": args.store}},
                 out=args.out, spaced=False)


if __name__ == "__main__":
    main()
