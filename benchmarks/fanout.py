"""Fan-out: R trainer ranks, each with K DataLoader workers, following one producer, with and without the head relay.

    .venv/bin/python benchmarks/fanout.py                       # R=8,32 K=2, relay on and off; writes
                                                                # benchmarks/results/fanout.json
    .venv/bin/python benchmarks/fanout.py --ranks 32 --hosts 4  # 4 simulated hosts of 8 ranks
    .venv/bin/python benchmarks/fanout.py --smoke --out /tmp/fanout.json    # seconds

Real services: PostgreSQL (catalog, commit notifications) and SeaweedFS S3 (warehouse), started with
``catalog/services.py``. Every rank is a process with a real ``torch.utils.data.DataLoader`` of K forked workers
reading a ``LakestreamDataset(follow=True)``; one producer process commits a step every ``--interval`` seconds
(world size 8; each consumer rank reads its partition of each global batch). Simulated hosts are groups of ranks with
their own relay directory (``LAKESTREAM_RELAY_DIR``) and their own PostgreSQL ``application_name``.

What is counted, by the benchmark itself (nothing in the library counts for it):

* **catalog queries**: a SQLAlchemy ``before_cursor_execute`` listener on every engine of every process, and a count
  of the statements lakestream runs on its direct connections (``connect/direct.py``), outside SQLAlchemy;
* **catalog connections**: ``pg_stat_activity`` rows of the readers' ``application_name``, sampled every 50 ms
  (LISTEN connections included); the maximum over the run, and per host;
* **storage requests and bytes**: the catalog's FileIO is ``fanout.CountingArrowFileIO`` (``py-io-impl``), pyiceberg's
  PyArrow FileIO counting each file opened and each byte read, metadata (``metadata.json``, manifest lists,
  manifests) apart from data;
* **visibility latency**: the producer logs when each ``commit()`` returned, each rank when the step's item reached
  it; every (step, rank), the first steps included, and apart: the first step, and the first step after each pause
  of the producer (``--pause-every N --pause-s S``: the producer stops for S seconds after every N-th commit).

The producer's first commit waits until every reader *follows*, as observed from outside: each host's relay socket has
accepted a connection from every reading process of that host (``/proc/net/unix``) and its holder's ``LISTEN`` is in
``pg_stat_activity`` (without the relay: every reading process's ``LISTEN``). A step committed before a reader exists
is a backlog the reader starts on, not a visibility latency; before this wait the first commit went out after a fixed
``--interval`` and, with many ranks on two cores, could overtake DataLoader workers still starting up.

Per step and per rank is steady state: each reading process's counts between its first and last item, summed over
processes, divided by the (step, rank) items those processes delivered in between (the relay holder's polling and
metadata reads are in its process's counts). ``total`` columns divide whole-run counts (start-up included) by steps x R.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.modules.setdefault("fanout", sys.modules[__name__])  # py-io-impl "fanout.CountingArrowFileIO" is this module

import pyarrow as pa  # noqa: E402
from _common import Table, percentile, write_json  # noqa: E402
from pyiceberg.io import InputFile  # noqa: E402
from pyiceberg.io.pyarrow import PyArrowFileIO  # noqa: E402
from read_path import CountingInputFile  # noqa: E402

COUNTS: Counter = Counter()  # this process's counts
PRODUCERS = 8
NAME = "bench.fanout"


class CountingArrowFileIO(PyArrowFileIO):
    """pyiceberg's PyArrow FileIO, counting files opened and bytes read (installed by this benchmark only)."""

    def new_input(self, location: str) -> InputFile:
        return CountingInputFile(super().new_input(location), COUNTS)


def count_queries() -> None:
    """Count every catalog statement of this process and the processes it forks: SQLAlchemy's, and those lakestream
    runs on its direct connections (the pointer probe, connect/direct.py), which SQLAlchemy does not see."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from lakestream_iceberg.connect.direct import DirectConnections

    def on_execute(*_args: Any, **_kwargs: Any) -> None:
        COUNTS["catalog:queries"] += 1

    event.listen(Engine, "before_cursor_execute", on_execute)
    direct_execute = DirectConnections.execute

    def counted(self: DirectConnections, sql: str, params: Any = (), **options: Any) -> Any:
        COUNTS["catalog:queries"] += 1
        return direct_execute(self, sql, params, **options)

    DirectConnections.execute = counted  # type: ignore[method-assign]


def snapshot() -> dict[str, int]:
    meta = ("metadata.json", "manifest-list", "manifest")
    return {"queries": COUNTS["catalog:queries"], "meta_requests": sum(COUNTS[f"{k}:files"] for k in meta),
            "meta_bytes": sum(COUNTS[k] for k in meta), "data_requests": COUNTS["data:files"], "data_bytes": COUNTS["data"]}


class Recorder:
    """The dataset's ``transform``, run where the item is read (a worker): this process's counts at its first and
    last item, written to ``<out>/<pid>.json``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.first: dict[str, int] | None = None
        self.items = 0

    def __call__(self, item: Any) -> Any:
        now = snapshot()
        self.first = self.first or now
        self.items += 1
        Path(self.out, f"{os.getpid()}.json").write_text(json.dumps({"first": self.first, "last": now, "items": self.items}))
        return item


def catalog_props(pg_uri: str, weed: Any, app: str) -> dict[str, str]:
    return {"uri": f"{pg_uri}?application_name={app}", "warehouse": f"s3://{weed.bucket}/fanout",
            "py-io-impl": "fanout.CountingArrowFileIO", **weed.s3_properties()}


def open_stream(props: dict[str, str]) -> Any:
    from pyiceberg.catalog.sql import SqlCatalog

    from lakestream_iceberg import Stream

    return Stream.open(SqlCatalog("bench", **props), NAME)


def shards(step: int) -> list[pa.Table]:
    return [pa.table({"x": pa.array([step * 1000 + r * 100 + i for i in range(16)], pa.int64()),
                      "blob": pa.array([bytes([step % 251]) * 256] * 16, pa.binary())}) for r in range(PRODUCERS)]


def producer(props: dict[str, str], steps: int, interval: float, go: Any, log: str, pause_every: int,
             pause_s: float) -> None:
    stream = open_stream(props)
    writer = stream.producer("fanout")
    go.wait()
    with open(log, "w") as f:
        for step in range(1, steps + 1):
            paused = pause_every > 0 and step > 1 and (step - 1) % pause_every == 0
            time.sleep(pause_s if paused else interval)
            result = writer.commit(shards(step))
            f.write(json.dumps({"step": result.step, "t": time.time()}) + "\n")
            f.flush()


def rank(r: int, world: int, workers: int, relay: bool, props: dict[str, str], relay_dir: str, steps: int,
         out: str, ready: Any) -> None:
    from torch.utils.data import DataLoader

    from lakestream_iceberg.read.dataset import LakestreamDataset

    os.environ["LAKESTREAM_RELAY_DIR"] = relay_dir
    ds = LakestreamDataset(open_stream(props), rank=r, world_size=world, follow=True, end_step=steps, timeout=300,
                           relay=relay, transform=Recorder(out), collate=lambda shard: shard.step)
    loader = iter(DataLoader(ds, batch_size=None, num_workers=workers,
                              multiprocessing_context="fork" if workers else None))
    ready.release()
    seen = []
    for step in loader:
        seen.append((step, time.time()))
    Path(out, f"rank{r}.json").write_text(json.dumps({"seen": seen, "own": snapshot()}))


def sample_connections(dsn: str, stop: threading.Event, found: Counter, series: list[dict[str, int]]) -> None:
    import psycopg2

    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        while not stop.wait(0.05):
            cur.execute("SELECT application_name, count(*) FROM pg_stat_activity WHERE application_name LIKE 'reader-%' "
                        "GROUP BY 1")
            now = dict(cur.fetchall())
            series.append(now)
            for app, n in now.items():
                found[app] = max(found[app], n)
            found["all"] = max(found["all"], sum(now.values()))
    conn.close()


def relay_clients(directory: Path) -> int:
    """Connections the relay sockets in ``directory`` accepted and still hold (Linux: ``/proc/net/unix`` lists an
    accepted socket under its listener's path, connected: state 03); -1 where that cannot be read."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return -1
    prefix = str(directory) + "/"
    return sum(1 for line in lines if len(parts := line.split()) >= 8 and parts[5] == "03"
               and parts[7].startswith(prefix) and parts[7].endswith(".sock"))


def wait_following(dsn: str, relay_dirs: list[tuple[Path, int]], listens: int, procs: list[Any],
                   timeout: float = 300.0) -> float:
    """Wait until every reader follows (see the module docstring): ``listens`` readers' ``LISTEN`` connections, and
    each relay directory's socket connected to its number of reading processes. Seconds waited."""
    import psycopg2

    started = time.monotonic()
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            while True:
                cur.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'reader-%' "
                            "AND query LIKE 'LISTEN %'")
                found = cur.fetchone()[0]
                clients = [(relay_clients(d), n) for d, n in relay_dirs]
                if found >= listens and all(c < 0 or c >= n for c, n in clients):
                    return time.monotonic() - started
                dead = [p.exitcode for p in procs if p.exitcode is not None]
                assert not dead, f"a rank exited with {dead} before following"
                assert time.monotonic() - started < timeout, (f"readers not following after {timeout}s: {found} of "
                                                              f"{listens} LISTEN, relay clients {clients}")
                time.sleep(0.01)
    finally:
        conn.close()


def join_all(named: list[tuple[str, Any]], *, timeout: float) -> None:
    """Wait for every process to exit 0. The first one that fails fails the run at once, by name (its traceback is
    the last one printed): a producer that died must not leave the ranks waiting out their read timeout first."""
    deadline = time.monotonic() + timeout
    while True:
        failed = [(name, p.exitcode) for name, p in named if p.exitcode not in (None, 0)]
        assert not failed, f"{failed[0][0]} exited with {failed[0][1]}"
        running = [p.sentinel for _, p in named if p.exitcode is None]
        if not running:
            return
        assert time.monotonic() < deadline, f"{len(running)} process(es) still running after {timeout:.0f}s"
        mp.connection.wait(running, timeout=1.0)


def run(pg: Any, weed: Any, root: Path, *, world: int, workers: int, hosts: int, relay: bool, steps: int,
        interval: float, pause_every: int = 0, pause_s: float = 0.0) -> dict[str, Any]:
    from pyiceberg.catalog.sql import SqlCatalog

    from lakestream_iceberg import Stream

    db = f"fanout_{world}_{hosts}_{int(relay)}_{int(time.time() * 1000) % 10**8}"
    pg.create_database(db)
    pg_uri = pg.sqlalchemy_uri(db)
    setup = SqlCatalog("bench", **catalog_props(pg_uri, weed, "setup"))
    setup.create_namespace_if_not_exists("bench")
    Stream.create(setup, NAME, schema=shards(1)[0].schema, world_size=PRODUCERS)
    setup.engine.dispose()
    out = root / f"out-{db}"
    out.mkdir()
    ctx = mp.get_context("fork")
    go, ready = ctx.Event(), ctx.Semaphore(0)
    log = str(out / "commits.jsonl")
    per_host = -(-world // hosts)
    procs = []
    readers: Counter = Counter()  # reading processes per relay directory
    for r in range(world):
        host = r // per_host
        relay_dir = root / f"{db[-8:]}h{host}"  # short: a unix socket path holds ~100 bytes
        relay_dir.mkdir(mode=0o700, exist_ok=True)
        readers[relay_dir] += max(1, workers)
        procs.append(ctx.Process(target=rank, args=(r, world, workers, relay, catalog_props(pg_uri, weed, f"reader-h{host}"),
                                                    str(relay_dir), steps, str(out), ready)))
    prod = ctx.Process(target=producer, args=(catalog_props(pg_uri, weed, "producer"), steps, interval, go, log,
                                              pause_every, pause_s))
    found: Counter = Counter()
    series: list[dict[str, int]] = []
    stop = threading.Event()
    dsn = pg_uri.replace("postgresql+psycopg2", "postgresql")
    sampler = threading.Thread(target=sample_connections, args=(dsn, stop, found, series))
    started = time.monotonic()
    sampler.start()
    prod.start()
    for p in procs:
        p.start()
    for _ in procs:
        assert ready.acquire(timeout=600), "a rank did not start"
    waited = wait_following(dsn, list(readers.items()) if relay else [], len(readers) if relay else world * max(1, workers),
                            procs)
    go.set()
    try:
        join_all([("the producer", prod), *((f"rank {r}", p) for r, p in enumerate(procs))], timeout=900)
    finally:
        stop.set()
        sampler.join()
        for p in procs + [prod]:
            p.kill()
    wall = time.monotonic() - started
    committed = {r["step"]: r["t"] for r in map(json.loads, Path(log).read_text().splitlines())}
    lat, in_order, by_step = [], True, {}
    for r in range(world):
        seen = json.loads((out / f"rank{r}.json").read_text())["seen"]
        in_order &= [s for s, _ in seen] == list(range(1, steps + 1))
        lat += [max(0.0, t - committed[s]) for s, t in seen]
        for s, t in seen:
            by_step[s] = max(by_step.get(s, 0.0), t - committed[s])
    resumed = [s for s in by_step if pause_every > 0 and s > 1 and (s - 1) % pause_every == 0]
    steady: Counter = Counter()
    total: Counter = Counter()
    items = 0
    for path in out.glob("*.json"):
        doc = json.loads(path.read_text())
        if "first" in doc:
            steady.update({k: doc["last"][k] - doc["first"][k] for k in doc["last"]})
            total.update(doc["last"])
            items += doc["items"] - 1
        else:
            total.update(doc["own"])
    steady_per = {k: steady[k] / max(1, items) for k in ("queries", "meta_requests", "meta_bytes", "data_requests",
                                                          "data_bytes")}
    total_per = {k: total[k] / (steps * world) for k in steady_per}
    shutil.rmtree(out, ignore_errors=True)
    pg.drop_database(db)
    return {"ranks": world, "workers": workers, "hosts": hosts, "relay": relay, "steps": steps, "in_order": in_order,
            "steady_per_step_rank": steady_per, "total_per_step_rank": total_per,
            "connections_max": found["all"], "connections_per_host_max": max((v for k, v in found.items() if k != "all"),
                                                                              default=0),
            "connections_steady_median": percentile([sum(s.values()) for s in series[len(series) // 3:]], 50),
            "latency_p50_ms": percentile(lat, 50) * 1000, "latency_p99_ms": percentile(lat, 99) * 1000,
            "latency_max_ms": max(lat) * 1000, "first_step_ms": by_step[1] * 1000,
            "after_pause_ms": [by_step[s] * 1000 for s in sorted(resumed)], "pause_every": pause_every, "pause_s": pause_s,
            "slowest_steps_ms": sorted(((round(v * 1000, 1), s) for s, v in by_step.items()), reverse=True)[:5],
            "waited_for_readers_s": waited, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="8,32", help="comma-separated R values")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (K)")
    parser.add_argument("--hosts", default="1", help="comma-separated numbers of simulated hosts")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between the producer's commits")
    parser.add_argument("--modes", default="relay,direct")
    parser.add_argument("--pause-every", type=int, default=0, help="the producer pauses after every N-th commit")
    parser.add_argument("--pause-s", type=float, default=5.0, help="for this many seconds")
    parser.add_argument("--name", default="fanout", help="results file: benchmarks/results/<name>.json")
    parser.add_argument("--out", default=None, help="write the JSON here instead")
    parser.add_argument("--smoke", action="store_true", help="R=2, K=1, 6 steps, for tests")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.workers, args.steps, args.interval = "2", 1, 6, 0.1
    from catalog.services import Postgres, SeaweedFS

    count_queries()
    root = Path(tempfile.mkdtemp(prefix="lakestream-fanout-"))
    pg = Postgres(settings={"max_connections": "2000"})
    weed = SeaweedFS(root / "seaweedfs")
    results = []
    scratch = [str(root)]  # what the run writes outside --out: all deleted at its end
    try:
        pg.start()
        scratch.append(str(pg.data_dir))
        weed.start()
        for world in [int(x) for x in args.ranks.split(",")]:
            for hosts in [int(x) for x in args.hosts.split(",")]:
                for mode in args.modes.split(","):
                    result = run(pg, weed, root, world=world, workers=args.workers, hosts=hosts, relay=mode == "relay",
                                 steps=args.steps, interval=args.interval, pause_every=args.pause_every,
                                 pause_s=args.pause_s)
                    results.append(result)
                    print(f"  R={world} K={args.workers} H={hosts} {mode}: {result['wall_s']:.0f}s", flush=True)
    finally:
        weed.stop()
        pg.close()  # stop() alone left PostgreSQL's data dir (~55 MB) in the temp dir after every run
        shutil.rmtree(root, ignore_errors=True)
    table = Table(f"fan-out: R ranks x K={args.workers} DataLoader workers following one producer (PostgreSQL + "
                  "SeaweedFS S3); per step per rank, steady state (total = start-up included)",
                  ["R", "hosts", "mode", "catalog queries", "(total)", "metadata requests", "(total)", "metadata bytes",
                   "(total)", "catalog conns max", "per host max", "steady median", "visible p50 ms", "p99 ms",
                   "max ms", "first step ms", "after pauses max ms", "in order"])
    for r in results:
        s, t = r["steady_per_step_rank"], r["total_per_step_rank"]
        table.add(r["ranks"], r["hosts"], "relay" if r["relay"] else "direct", s["queries"], t["queries"],
                  s["meta_requests"], t["meta_requests"], s["meta_bytes"], t["meta_bytes"], r["connections_max"],
                  r["connections_per_host_max"], r["connections_steady_median"], r["latency_p50_ms"],
                  r["latency_p99_ms"], r["latency_max_ms"], r["first_step_ms"], max(r["after_pause_ms"], default="-"),
                  "yes" if r["in_order"] else "NO")
    table.note(f"{args.steps} steps, one commit every {args.interval}s, producer world size {PRODUCERS}; targets per step "
               "per rank: <= 1 catalog query, <= 1.1 metadata requests, <= 2 KiB metadata; <= 2 connections per host")
    table.note(f"{os.cpu_count()} cores, shared with other work while measured: latencies are noisy")
    print(table)
    if args.out or not args.smoke:
        kwargs = {"directory": Path(args.out).parent} if args.out else {}
        path = write_json(Path(args.out).name if args.out else args.name, {"table": table, "runs": results,
                                                                            "args": vars(args), "scratch_dirs": scratch},
                          **kwargs)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
