"""CPU of one lone commit, by phase: where a producer's CPU goes when it commits a batch.

    .venv/bin/python benchmarks/commit_cpu.py                   # ~30 s on 2 cores
    .venv/bin/python benchmarks/commit_cpu.py --smoke --out /tmp/commit_cpu.json

One producer commits ``--commits`` batches of ``--batch-bytes`` (1 MiB) cut into ``--world-size`` (8) shards of 64 KiB
samples back to back, on the embedded SQLite catalog with a local warehouse, after ``--warmup`` commits. Per commit:
the process's CPU (user and system, from ``getrusage``) and the calling thread's CPU in each phase of
``Producer.commit`` (``time.thread_time`` around ``BatchWriter.write``, ``BatchPlanner.plan``, the catalog swap,
``CommitLoop.refresh`` and ``CommitLoop.adopt``; ``other`` is the rest: checks, head, bookkeeping), and commits/s.
A local warehouse on a disk and one on tmpfs (``/dev/shm``, when there is one) run in alternating rounds: the
system time of writing the data file into the page cache depends on the file system and the machine's load, the
rest does not.

Each warehouse also runs ``cold`` (unless ``--evict-mib 0``): before every commit the producer sweeps ``--evict-mib``
(16) MiB of float32 arrays through the CPU as preprocessing does (numpy, outside the measurement), so the commit finds
its code and data out of the caches, as it does in a producer that prepares every batch (``busy_producers.py``); the
CPU is then counted around each commit only.

``--catalogs sqlite,postgres`` (the default) adds two rows on a PostgreSQL catalog (the project's server, a database
per round; the warehouse on tmpfs where there is one), alternating with the others: ``postgres direct``, as shipped
(the pointer probe, the staged intents and the swap on the process's autocommit connection, ``connect/direct.py``),
and ``postgres pooled``, the same statements through SQLAlchemy's pool (``BEGIN``, the statement, ``COMMIT`` or
``ROLLBACK``), as before the direct connection. ``process`` CPU does not count the database server's. After its
commits, each round also times ``2 x --commits`` pointer probes (``probe_cpu_us``, ``probe_wall_us``: one "did the
head move?", which a holding producer and a follower ask many times per step).
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Run, Table, bench_parser, sqlite_catalog, start_postgres  # noqa: E402

import lakestream_iceberg.write.commit as commit_module  # noqa: E402
from lakestream_iceberg import Stream  # noqa: E402
from lakestream_iceberg.connect.pointer import pointer_probe  # noqa: E402
from lakestream_iceberg.write.planner import BatchPlanner  # noqa: E402
from lakestream_iceberg.write.writer import BatchWriter  # noqa: E402

SCHEMA = pa.schema([("x", pa.binary())])
SAMPLE_BYTES = 64 * 1024
PHASES = ("write", "plan", "swap", "refresh", "adopt")


class PhaseClock:
    """Thread CPU seconds spent in each wrapped callable, summed while :meth:`counting`."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._on = False

    def wrap(self, owner: Any, name: str, phase: str) -> Callable[[], None]:
        """Wrap ``owner.name``; returns the undo."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._on:
                return original(*args, **kwargs)
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.thread_time() - start

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._on = True
        try:
            yield
        finally:
            self._on = False


def batches(batch_bytes: int, world_size: int, count: int) -> list[list[pa.Table]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        data = rng.integers(0, 256, batch_bytes, dtype=np.uint8).tobytes()
        per = batch_bytes // world_size
        out.append([pa.table({"x": pa.array([data[base + i: base + i + SAMPLE_BYTES]
                                              for i in range(0, per - SAMPLE_BYTES + 1, SAMPLE_BYTES)], pa.binary())})
                    for base in range(0, per * world_size, per)])
    return out


class Sweep:
    """What a preprocessing producer does to the caches between two commits: ``mib`` MiB of float32 arrays read and
    written by numpy (two passes)."""

    def __init__(self, mib: int) -> None:
        self.a = np.ones(mib * (1 << 20) // 8, np.float32)  # two arrays of mib / 2 each
        self.b = np.empty_like(self.a)

    def __call__(self) -> None:
        for _ in range(2):
            np.multiply(self.a, np.float32(0.5), out=self.b)
            np.add(self.b, np.float32(0.5), out=self.a)  # stays 1.0: no overflow however many sweeps


@contextlib.contextmanager
def pooled_statements() -> Iterator[None]:
    """lakestream's own statements through SQLAlchemy's pool, as before ``connect/direct.py``: every module that asks
    for the direct connections is told there are none (what a PostgreSQL driver other than psycopg2 gets)."""
    import lakestream_iceberg.connect.intents as intents
    import lakestream_iceberg.connect.pointer as pointer
    import lakestream_iceberg.connect.swap as swap

    modules = (intents, pointer, swap)
    originals = [module.direct_connections for module in modules]
    for module in modules:
        module.direct_connections = lambda engine: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            module.direct_connections = original  # type: ignore[attr-defined]


def one_round(root: Path, *, pool: list[list[pa.Table]], commits: int, warmup: int, world_size: int,
              clock: PhaseClock, sweep: Sweep | None = None, catalog_uri: str | None = None) -> dict[str, float]:
    if catalog_uri is None:
        catalog = sqlite_catalog(root)
    else:
        from pyiceberg.catalog.sql import SqlCatalog

        catalog = SqlCatalog("bench", uri=catalog_uri, warehouse=f"file://{root}/warehouse")
        catalog.create_namespace("bench")
    Stream.create(catalog, "bench.commit_cpu", schema=SCHEMA, world_size=world_size,
                  properties={"write.parquet.compression-codec": "uncompressed"})
    stream = Stream.open(catalog, "bench.commit_cpu")
    producer = stream.producer("p0")
    try:
        for i in range(warmup):
            producer.commit(pool[i % len(pool)])
        user = system = thread = wall = 0.0
        with clock.counting():
            for i in range(commits):
                if sweep is not None:
                    sweep()  # not counted: only the commit that follows it is
                before, w0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.thread_time()
                producer.commit(pool[i % len(pool)])
                thread += time.thread_time() - t0
                wall += time.perf_counter() - w0
                after = resource.getrusage(resource.RUSAGE_SELF)
                user += after.ru_utime - before.ru_utime
                system += after.ru_stime - before.ru_stime
        probe = pointer_probe(stream.table)  # what a holding producer and a follower ask many times per step
        assert probe is not None
        probes = max(20, commits * 2)
        w0, t0 = time.perf_counter(), time.thread_time()
        for _ in range(probes):
            probe()
        probe_wall, probe_cpu = time.perf_counter() - w0, time.thread_time() - t0
    finally:
        producer.close()
        catalog.engine.dispose()
    per = 1000.0 / commits
    row = {"user_ms": user * per, "sys_ms": system * per, **{f"{phase}_ms": clock.seconds[phase] * per for phase in PHASES},
           "probe_cpu_us": probe_cpu * 1e6 / probes, "probe_wall_us": probe_wall * 1e6 / probes}
    row["cpu_ms"] = row["user_ms"] + row["sys_ms"]
    row["other_ms"] = thread * per - sum(row[f"{phase}_ms"] for phase in PHASES)
    row["commits_per_s"] = commits / wall
    return row


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--commits", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-bytes", type=int, default=1 << 20)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--disk-dir", default=None, help="parent of the disk warehouse (default: the temp dir)")
    parser.add_argument("--evict-mib", type=int, default=16,
                        help="MiB swept through the caches before each commit of the 'cold' rows (0: no cold rows)")
    parser.add_argument("--catalogs", default="sqlite,postgres",
                        help="sqlite, and postgres for the 'postgres direct' and 'postgres pooled' rows")
    args = parser.parse_args(argv)
    if args.smoke:
        args.commits, args.warmup, args.rounds = 5, 2, 1
    run = Run("commit_cpu", smoke=args.smoke)
    places = {"disk": args.disk_dir or tempfile.gettempdir()}
    if Path("/dev/shm").is_dir():
        places["tmpfs"] = "/dev/shm"
    pool = batches(args.batch_bytes, args.world_size, 4)
    clock = PhaseClock()
    undo = [clock.wrap(BatchWriter, "write", "write"), clock.wrap(BatchPlanner, "plan", "plan"),
            clock.wrap(commit_module, "swap", "swap"), clock.wrap(commit_module.CommitLoop, "refresh", "refresh"),
            clock.wrap(commit_module.CommitLoop, "adopt", "adopt")]
    sweep = Sweep(args.evict_mib) if args.evict_mib > 0 else None
    kinds = [(place, parent, None) for place, parent in places.items()]
    kinds += [(f"{place} cold", parent, sweep) for place, parent in places.items() if sweep is not None]
    catalogs = {c.strip() for c in args.catalogs.split(",") if c.strip()}
    if catalogs - {"sqlite", "postgres"} or "sqlite" not in catalogs:
        parser.error(f"--catalogs {args.catalogs!r}: sqlite, optionally with postgres")
    server = None
    if "postgres" in catalogs:
        kinds += [("postgres direct", places.get("tmpfs", places["disk"]), None),
                  ("postgres pooled", places.get("tmpfs", places["disk"]), None)]
        server, _how = start_postgres()
    rows: dict[str, list[dict[str, float]]] = {kind: [] for kind, _, _ in kinds}
    try:
        with run.phase("rounds"):
            for n in range(args.rounds):
                for kind, parent, evict in kinds:  # alternating: all see the same stretch of machine load
                    uri = None if not kind.startswith("postgres") else \
                        server.create_database(f"commit_cpu_{n}_{kind.split()[1]}")  # type: ignore[union-attr]
                    with tempfile.TemporaryDirectory(dir=parent, prefix="commit_cpu-") as root, \
                            (pooled_statements() if kind == "postgres pooled" else contextlib.nullcontext()):
                        rows[kind].append(one_round(Path(root), pool=pool, commits=args.commits, warmup=args.warmup,
                                                    world_size=args.world_size, clock=clock, sweep=evict,
                                                    catalog_uri=uri))
    finally:
        for step in undo:
            step()
        if server is not None:
            server.close()  # stopped, and its data dir removed
    keys = ["cpu_ms", "user_ms", "sys_ms", *(f"{phase}_ms" for phase in PHASES), "other_ms", "commits_per_s",
            "probe_cpu_us", "probe_wall_us"]
    table = Table(f"CPU ms per lone commit ({args.batch_bytes // 1024} KiB, {args.world_size} shards, medians of "
                  f"{args.rounds} rounds of {args.commits})", ["warehouse", *[k.removesuffix("_ms") for k in keys]])
    medians = {place: {k: statistics.median(r[k] for r in found) for k in keys} for place, found in rows.items()}
    for place, m in medians.items():
        table.add(place, *[round(m[k], 2) for k in keys])
    if sweep is not None:
        table.note(f"cold = {args.evict_mib} MiB swept through the caches by numpy before each commit, as a producer's "
                   "preprocessing does (not counted)")
    table.note("phases are the committing thread's CPU; cpu = user + sys of the whole process; loadavg at start: "
               + " ".join(f"{x:.2f}" for x in run.loadavg_at_start))
    run.finish([table], {"config": vars(args), "medians": medians, "rounds": rows}, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
