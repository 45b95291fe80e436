"""Producer churn: does producer state scale with many distinct producer ids?

Every snapshot of a stream carries the table of every producer id that ever published (``lakestream.producers``), and
the commit policy reads that table to count the producers it shares the catalog with. This benchmark measures what
happens when ids keep coming: elastic preprocessing fleets, restarted workers that take new ids, per-job ids.
Everything runs on the embedded SQLite catalog with a local warehouse in a temp dir (removed at the end), world size 8,
one row per rank shard; every row names its producer and seq, so exactly-once is checked from the data itself.

Scenarios (``--scenarios A,B,C``; each a section of the printed table; every ratio is computed within one run):

* **A. churn**: ``--ids`` distinct producer ids (default 20,000) commit one batch each, one after another, in this
  process (``stream.producer(id).commit(batch)``). Reported: p50 commit latency of the first and of the last
  ``--window`` ids and their ratio (target <= 1.25x), p50 of the ``--window`` ids ending at each of ``--points``, and the
  size of the current metadata.json there (target <= 64 KiB). ``--max-seconds`` stops the loop early (the report says
  how far it got): on code whose commit cost grows with every id, 20,000 ids take hours.
* **B. lone producer after churn** (needs A's stream; selecting B alone runs A's churn first): after A, one new
  producer id commits alone for ``--lone-seconds`` or ``--lone-commits``, whichever comes first (at least one commit);
  its commits/s are compared with the same loop on a fresh stream, in ``--lone-rounds`` alternating rounds each, every
  round after ``os.sync()`` (target >= 0.9x).
* **C. rotating pool**: ``--pool`` producer processes (multiprocessing forkserver or spawn, ``--start-method``; all
  released together after a start barrier)
  each commit ``--pool-batches`` batches, taking a fresh producer id every ``--rotate`` batches. Reported: failed
  commits (target 0), total commits/s vs one producer process alone (one id, ``--alone-batches`` batches, on a fresh
  stream, in the same run; target >= 1.0x), and a read-back of each pool's table: head step == total batches, steps
  dense, every (producer, seq) exactly once with all its rank rows. ``--pool-rounds`` rounds of each (default 2),
  alternating (alone, pool, pool, alone), each on a fresh stream after ``os.sync()``; the ratio pools the rounds.

Run::

    .venv/bin/python benchmarks/producer_churn.py                         # all of it (hours on code that slows per id)
    .venv/bin/python benchmarks/producer_churn.py --max-seconds 240       # stop A after 4 minutes
    .venv/bin/python benchmarks/producer_churn.py --scenarios C --pool 16 --pool-batches 30
    .venv/bin/python benchmarks/producer_churn.py --smoke --out /tmp/churn.json   # seconds: tests/test_benchmarks_smoke.py

Writes ``benchmarks/results/producer_churn.json`` (``--out``): every table (also as text under ``printed``), the raw
latencies, the targets with met / not met, the machine and the load average. Only the public API of
``lakestream_iceberg`` is used.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from _common import (  # noqa: E402
    RESULTS_DIR,
    Children,
    Parent,
    Run,
    Table,
    bench_parser,
    file_creation_ms,
    flush_writes,
    interleaved,
    machine,
    percentile,
    ratio_of,
    settle_and_say,
    shrink,
    sqlite_props,
)

WORLD_SIZE = 8
NS = "bench"
PROP_GROUP_COMMIT = "lakestream.commit.group.enabled"  # a table property of the public contract (docs/configuration.md)

TARGET_A_RATIO = 1.25  # p50 of the last ids / p50 of the first ids
TARGET_A_METADATA_KIB = 64.0
TARGET_B_RATIO = 0.9  # lone commits/s after churn / on a fresh stream
TARGET_C_FAILED = 0
TARGET_C_RATIO = 1.0  # pool commits/s / one producer alone


# ================================================================================================ shared


def open_catalog(props: dict[str, str]) -> Any:
    from lakestream_iceberg import load_catalog

    return load_catalog("bench", **props)


def payload_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("producer", pa.string()), ("seq", pa.int64()), ("rank", pa.int32())])


def batch(producer: str, seq: int, rows: int = 1) -> list[Any]:
    """One global batch: one shard per rank, every row naming its producer, seq and rank."""
    import pyarrow as pa

    schema = payload_schema()
    return [pa.table({"producer": [producer] * rows, "seq": [seq] * rows, "rank": [rank] * rows}, schema=schema)
            for rank in range(WORLD_SIZE)]


STAGING = "auto"  # lakestream.commit.group.staging of every stream (--staging)


def create_stream(catalog: Any, name: str) -> Any:
    from lakestream_iceberg import Stream

    return Stream.create(catalog, f"{NS}.{name}", schema=payload_schema(), world_size=WORLD_SIZE,
                         properties={PROP_GROUP_COMMIT: "true", "lakestream.commit.group.staging": STAGING})


def metadata_bytes(stream: Any) -> int:
    """Size of the stream's current metadata.json (refreshes the stream's view)."""
    stream.refresh()
    location = stream.table.metadata_location
    try:
        return len(stream.io.new_input(location))
    except Exception:  # noqa: BLE001 - a FileIO without a cheap length: read it
        with stream.io.new_input(location).open() as f:
            return len(f.read())


def p50(values: list[float]) -> float:
    return percentile(values, 50)


def met(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "NOT MET")


def read_back(stream: Any) -> dict[str, Any]:
    """Check the table from its data: dense steps, one (producer, seq) per step with all its rank rows, each once."""
    stream.refresh()
    head = stream.head_step()
    rows = stream.table.scan(selected_fields=("producer", "seq", "rank", "_step")).to_arrow().to_pylist()
    by_step: dict[int, set[tuple[str, int]]] = {}
    ranks: dict[int, list[int]] = {}
    for row in rows:
        by_step.setdefault(row["_step"], set()).add((row["producer"], row["seq"]))
        ranks.setdefault(row["_step"], []).append(row["rank"])
    mixed = sorted(s for s, keys in by_step.items() if len(keys) != 1)
    incomplete = sorted(s for s, r in ranks.items() if sorted(r) != list(range(WORLD_SIZE)))
    missing_steps = [s for s in range(1, head + 1) if s not in by_step]
    extra_steps = sorted(s for s in by_step if not 1 <= s <= head)
    seen: dict[tuple[str, int], list[int]] = {}
    for step, keys in by_step.items():
        for key in keys:
            seen.setdefault(key, []).append(step)
    duplicates = {f"{p}/{s}": steps for (p, s), steps in seen.items() if len(steps) > 1}
    return {"head_step": head, "steps_with_rows": len(by_step), "pairs": sorted(seen), "mixed_steps": mixed[:20],
            "incomplete_steps": incomplete[:20], "missing_steps": missing_steps[:20], "missing_steps_count": len(missing_steps),
            "extra_steps": extra_steps[:20], "duplicates": dict(list(duplicates.items())[:20]),
            "duplicates_count": len(duplicates)}


# ================================================================================================ A. churn


def run_churn(root: Path, args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    import cProfile
    import io
    import pstats

    catalog = open_catalog(sqlite_props(root / "churn"))
    stream = create_stream(catalog, "churn")
    points = sorted({p for p in args.points if p <= args.ids} | {args.ids})
    wall: list[float] = []  # Producer.commit() wall time
    cpu: list[float] = []  # process CPU time of the commit (robust against other tenants of the machine)
    total: list[float] = []  # stream.producer(id) + commit: what a brand-new producer pays
    attempts: list[int] = []
    carried = 0
    windows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    last_print = t0
    stopped_early = False

    def window_at(n: int) -> dict[str, Any]:
        lo = max(0, n - args.window)
        return {"ids": n, "from_id": lo + 1, "p50_s": p50(wall[lo:n]), "p99_s": percentile(wall[lo:n], 99),
                "cpu_p50_s": p50(cpu[lo:n]), "total_p50_s": p50(total[lo:n]), "metadata_bytes": metadata_bytes(stream),
                "producers_in_head": len(stream.state(refresh=False).producers), "elapsed_s": time.monotonic() - t0}

    for i in range(args.ids):
        if args.max_seconds is not None and time.monotonic() - t0 >= args.max_seconds:
            stopped_early = True
            break
        pid = f"churn-{i:06d}"
        shards = batch(pid, 0)
        s0 = time.perf_counter()
        producer = stream.producer(pid)
        s1, c1 = time.perf_counter(), time.process_time()
        result = producer.commit(shards, seq=0)
        s2, c2 = time.perf_counter(), time.process_time()
        wall.append(s2 - s1)
        cpu.append(c2 - c1)
        total.append(s2 - s0)
        attempts.append(result.attempts)
        carried += int(result.carried)
        n = i + 1
        if n in points:
            windows.append(window_at(n))
            w = windows[-1]
            print(f"[A] {n:>6} ids: p50 {w['p50_s'] * 1000:8.1f} ms  cpu p50 {w['cpu_p50_s'] * 1000:7.1f} ms  "
                  f"metadata {w['metadata_bytes'] / 1024:8.1f} KiB  ({w['elapsed_s']:5.0f} s)", flush=True)
        elif time.monotonic() - last_print >= args.progress_s:
            print(f"[A] {n:>6} ids: last commit {wall[-1] * 1000:8.1f} ms, p50 of the last 50 "
                  f"{p50(wall[-50:]) * 1000:8.1f} ms  ({time.monotonic() - t0:5.0f} s)", flush=True)
        if time.monotonic() - last_print >= args.progress_s:
            last_print = time.monotonic()
    reached = len(wall)
    if reached and (not windows or windows[-1]["ids"] != reached):
        windows.append(window_at(reached))
        w = windows[-1]
        print(f"[A] {reached:>6} ids (stopped by --max-seconds): p50 {w['p50_s'] * 1000:8.1f} ms  "
              f"metadata {w['metadata_bytes'] / 1024:8.1f} KiB  ({w['elapsed_s']:5.0f} s)", flush=True)
    elapsed = time.monotonic() - t0
    profile_text = None
    if args.profile and reached:  # extra ids after the measured ones: profiling overhead stays out of the numbers
        profiler = cProfile.Profile()
        for k in range(args.profile):
            pid = f"profiled-{k:04d}"
            producer = stream.producer(pid)
            shards = batch(pid, 0)
            profiler.enable()
            producer.commit(shards, seq=0)
            profiler.disable()
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf)
        buf.write(f"cProfile of {args.profile} commit(s) of new ids after {reached} ids, sorted by cumulative time\n")
        stats.sort_stats("cumulative").print_stats(30)
        buf.write("\nsorted by own time\n")
        stats.sort_stats("tottime").print_stats(20)
        profile_text = buf.getvalue()
    first = wall[: args.window]
    last = wall[-args.window:]
    out = {
        "ids_requested": args.ids, "ids_reached": reached, "stopped_early": stopped_early, "elapsed_s": elapsed,
        "window": args.window, "windows": windows,
        "p50_first_s": p50(first), "p50_last_s": p50(last),
        "cpu_p50_first_s": p50(cpu[: args.window]), "cpu_p50_last_s": p50(cpu[-args.window:]),
        "ratio": p50(last) / p50(first) if first else math.nan,
        "cpu_ratio": p50(cpu[-args.window:]) / p50(cpu[: args.window]) if first else math.nan,
        "metadata_bytes_end": windows[-1]["metadata_bytes"] if windows else math.nan,
        "carried": carried, "attempts_total": sum(attempts),
        "latencies_s": wall, "cpu_s": cpu, "total_s": total,
        "profile": profile_text,
    }
    return stream, out


# ================================================================================================ B. lone producer


def lone_run(stream: Any, producer_id: str, args: argparse.Namespace) -> dict[str, Any]:
    """One producer id commits alone until ``--lone-commits`` or ``--lone-seconds`` (checked after each commit: at least
    one commit, however slow a busy machine makes the first read of the table)."""
    producer = stream.producer(producer_id)
    lat: list[float] = []
    t0 = time.perf_counter()
    seq = producer.next_seq
    while len(lat) < args.lone_commits and (not lat or time.perf_counter() - t0 < args.lone_seconds):
        s = time.perf_counter()
        producer.commit(batch(producer_id, seq), seq=seq)
        lat.append(time.perf_counter() - s)
        seq += 1
    elapsed = time.perf_counter() - t0
    return {"producer": producer_id, "commits": len(lat), "elapsed_s": elapsed,
            "commits_per_s": len(lat) / elapsed if elapsed > 0 else math.nan,
            "first_commit_s": lat[0] if lat else math.nan, "p50_s": p50(lat), "p50_after_first_s": p50(lat[1:]),
            "max_s": max(lat, default=math.nan), "latencies_s": lat}


def _merge_lone(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one stream as one run: commits/s over all of them, latencies pooled (round by round)."""
    lat = [x for r in runs for x in r["latencies_s"]]
    elapsed = sum(r["elapsed_s"] for r in runs)
    firsts = [r["first_commit_s"] for r in runs]
    return {"producer": runs[0]["producer"], "commits": len(lat), "elapsed_s": elapsed,
            "commits_per_s": len(lat) / elapsed if elapsed > 0 else math.nan, "first_commit_s": max(firsts),
            "p50_s": p50(lat), "p50_after_first_s": p50([x for r in runs for x in r["latencies_s"][1:]]),
            "max_s": max(lat, default=math.nan), "latencies_s": lat, "rounds": len(runs),
            "round_commits_per_s": [r["commits_per_s"] for r in runs]}


def run_lone(root: Path, churned: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Alternating rounds (after churn, fresh, fresh, after churn, ...), each after ``os.sync()``: the churn leaves
    minutes of dirty pages behind, and whichever run came first would pay for their writeback (file creation and
    SQLite commits measured 10-20x slower in that state on this machine)."""
    fresh_stream = create_stream(open_catalog(sqlite_props(root / "lone-fresh")), "fresh")
    runs: dict[str, list[dict[str, Any]]] = {"after": [], "fresh": []}
    for i, (_round, which) in enumerate(interleaved(args.lone_rounds, ("after", "fresh"))):
        flush_writes()
        stream, pid = (churned, "lone-after-churn") if which == "after" else (fresh_stream, "lone-fresh")
        runs[which].append(lone_run(stream, f"{pid}-{i}", args))
    after, fresh = _merge_lone(runs["after"]), _merge_lone(runs["fresh"])
    print(f"[B] lone producer after churn: {after['commits']} commits in {after['elapsed_s']:.1f} s = "
          f"{after['commits_per_s']:.1f} commits/s (rounds {', '.join(f'{x:.0f}' for x in after['round_commits_per_s'])})",
          flush=True)
    print(f"[B] lone producer on a fresh stream: {fresh['commits']} commits in {fresh['elapsed_s']:.1f} s = "
          f"{fresh['commits_per_s']:.1f} commits/s (rounds {', '.join(f'{x:.0f}' for x in fresh['round_commits_per_s'])})",
          flush=True)
    ratio = ratio_of(after["commits_per_s"], fresh["commits_per_s"])
    return {"after_churn": after, "fresh": fresh, "ratio": ratio,
            "metadata_bytes_after_churn": metadata_bytes(churned), "producers_in_head": len(churned.state().producers)}


# ================================================================================================ C. rotating pool


def _pool_worker(conn: Any, props: dict[str, str], table: str, worker: int, batches: int, rotate: int,
                 retries: int, profile_dir: str | None = None) -> None:
    """One producer process: ``batches`` commits, a fresh producer id every ``rotate`` batches (0: never).

    ``profile_dir``: cProfile the commits (after the start barrier) and dump ``<label>-<worker>.prof`` there."""
    profiler = None
    with Parent(conn) as parent:
        import logging

        import pyarrow  # noqa: F401 - import everything before the start barrier

        from lakestream_iceberg import Stream

        logging.getLogger("pyiceberg").setLevel(logging.ERROR)
        stream = Stream.open(open_catalog(props), table)
        start_at = parent.ready()
        while time.time() < start_at:
            time.sleep(min(0.02, max(0.0, start_at - time.time())))
        records: list[dict[str, Any]] = []
        cpu0 = time.process_time()
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        producer, pid, seq, id_no = None, "", 0, 0
        for b in range(batches):
            if producer is None or (rotate and b % rotate == 0):
                pid = f"pool-{worker:02d}-{id_no:04d}"
                id_no += 1
                producer, seq = stream.producer(pid), 0
            shards = batch(pid, seq)
            done = False
            for _ in range(retries + 1):
                s = time.time()
                try:
                    r = producer.commit(shards, seq=seq)
                    records.append({"producer": pid, "seq": seq, "start": s, "end": time.time(), "ok": True,
                                    "step": r.step, "attempts": r.attempts, "carried": r.carried,
                                    "duplicate": r.duplicate, "error": ""})
                    done = True
                    break
                except Exception as exc:  # noqa: BLE001 - a failed commit is a result, not a crash
                    records.append({"producer": pid, "seq": seq, "start": s, "end": time.time(), "ok": False,
                                    "step": None, "attempts": -1, "carried": False, "duplicate": False,
                                    "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            if done:
                seq += 1
            else:  # this (producer, seq) may still land (a staged batch); a fresh id avoids a gap either way
                producer = None
        cpu = time.process_time() - cpu0
        if profiler is not None and profile_dir:
            profiler.disable()
            profiler.dump_stats(str(Path(profile_dir) / f"{table.split('.')[-1]}-{worker:02d}.prof"))
        parent.ok((records, cpu))


def process_context(method: str) -> Any:
    """``forkserver`` (default): a fresh server process imports lakestream once and every producer process forks from
    it (nothing inherited from this process, like spawn, but no 16 x import cost on 2 cores); or plain ``spawn``."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["__main__", "pyarrow", "pyiceberg.catalog.sql", "lakestream_iceberg"])
    return ctx


def pool_run(props: dict[str, str], table: str, processes: int, batches: int, rotate: int, retries: int,
             label: str, start_method: str, profile_dir: str | None = None) -> dict[str, Any]:
    children = Children(process_context(start_method))
    t_spawn = time.monotonic()
    for w in range(processes):
        children.start(f"{label} worker {w}", _pool_worker, props, table, w, batches, rotate, retries, profile_dir)
    try:
        children.wait_ready()  # every process has imported everything and opened the stream before the start
        ready_s = time.monotonic() - t_spawn
        start_at = time.time() + 0.5
        children.send_all(start_at)
        results = children.collect()
    finally:
        children.close()
    records: list[dict[str, Any]] = [r for body in results for r in body[0]]
    cpu_s = sum(body[1] for body in results)
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    end = max((r["end"] for r in records), default=start_at)
    elapsed = end - start_at
    lat = [r["end"] - r["start"] for r in ok]
    errors: dict[str, int] = {}
    for r in failed:
        key = r["error"].split(":")[0]
        errors[key] = errors.get(key, 0) + 1
    return {"label": label, "processes": processes, "batches_per_process": batches, "rotate": rotate,
            "commits": len(ok), "failed": len(failed), "errors": errors, "elapsed_s": elapsed,
            "commits_per_s": len(ok) / elapsed if elapsed > 0 else math.nan, "p50_s": p50(lat),
            "p99_s": percentile(lat, 99), "carried": sum(1 for r in ok if r["carried"]),
            "duplicates_reported": sum(1 for r in ok if r["duplicate"]),
            "ids": len({r["producer"] for r in records}), "spawn_ready_s": ready_s, "cpu_s": cpu_s, "records": records}


def _pool_round(root: Path, args: argparse.Namespace, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One rotating-pool run on a fresh stream, and the read-back check of that stream."""
    props = sqlite_props(root / f"pool-{i}")
    stream = create_stream(open_catalog(props), "pool")
    pool = pool_run(props, f"{NS}.pool", args.pool, args.pool_batches, args.rotate, args.retries, "pool",
                    args.start_method, args.profile_dir)
    print(f"[C] {args.pool} processes, a new id every {args.rotate} batches: {pool['commits']} commits, "
          f"{pool['failed']} failed, {pool['elapsed_s']:.1f} s = {pool['commits_per_s']:.1f} commits/s "
          f"(p50 {pool['p50_s'] * 1000:.0f} ms, p99 {pool['p99_s'] * 1000:.0f} ms; spawn+import {pool['spawn_ready_s']:.1f} s; "
          f"worker CPU {pool['cpu_s']:.1f} s = {pool['cpu_s'] / max(pool['elapsed_s'], 1e-9):.2f} cores)",
          flush=True)
    check = read_back(stream)
    expected = {(r["producer"], r["seq"]) for r in pool["records"] if r["ok"]}
    attempted = {(r["producer"], r["seq"]) for r in pool["records"]}
    found = set(check.pop("pairs"))
    total = args.pool * args.pool_batches
    check.update({
        "total_batches": total, "expected_pairs": len(expected),
        "missing_pairs": sorted(f"{p}/{s}" for p, s in expected - found)[:20],
        "missing_pairs_count": len(expected - found),
        "unexpected_pairs": sorted(f"{p}/{s}" for p, s in found - attempted)[:20],
        "unresolved_landed": len((found & attempted) - expected),  # failed for the caller, yet published (once)
    })
    check["exactly_once"] = (check["duplicates_count"] == 0 and not check["missing_pairs_count"] and not check["mixed_steps"]
                             and not check["incomplete_steps"] and not check["unexpected_pairs"])
    check["dense"] = check["missing_steps_count"] == 0 and not check["extra_steps"] and check["steps_with_rows"] == check["head_step"]
    print(f"[C] read back: head step {check['head_step']} (total batches {total}), dense {check['dense']}, "
          f"exactly once {check['exactly_once']}", flush=True)
    return pool, check


def _alone_round(root: Path, args: argparse.Namespace, i: int) -> dict[str, Any]:
    props = sqlite_props(root / f"pool-alone-{i}")
    create_stream(open_catalog(props), "alone")
    alone = pool_run(props, f"{NS}.alone", 1, args.alone_batches, 0, args.retries, "alone", args.start_method,
                     args.profile_dir)
    print(f"[C] one producer alone: {alone['commits']} commits in {alone['elapsed_s']:.1f} s = "
          f"{alone['commits_per_s']:.1f} commits/s (worker CPU {alone['cpu_s']:.1f} s)", flush=True)
    return alone


def _merge_pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one kind as one run: commits/s over all of them (commits / summed elapsed), latencies pooled."""
    records = [r for run in runs for r in run["records"]]
    lat = [r["end"] - r["start"] for r in records if r["ok"]]
    elapsed = sum(run["elapsed_s"] for run in runs)
    commits = sum(run["commits"] for run in runs)
    errors: dict[str, int] = {}
    for run in runs:
        for key, n in run["errors"].items():
            errors[key] = errors.get(key, 0) + n
    merged = dict(runs[0])
    merged.update({"commits": commits, "failed": sum(run["failed"] for run in runs), "errors": errors,
                   "elapsed_s": elapsed, "commits_per_s": commits / elapsed if elapsed > 0 else math.nan,
                   "p50_s": p50(lat), "p99_s": percentile(lat, 99), "carried": sum(run["carried"] for run in runs),
                   "duplicates_reported": sum(run["duplicates_reported"] for run in runs),
                   "ids": sum(run["ids"] for run in runs), "cpu_s": sum(run["cpu_s"] for run in runs),
                   "records": records, "rounds": len(runs),
                   "round_commits_per_s": [run["commits_per_s"] for run in runs]})
    return merged


def _merge_checks(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """The read-back checks of every pool round: counts summed, lists joined, flags true only when true for all."""
    out = dict(checks[0])
    for key in ("head_step", "total_batches", "steps_with_rows", "missing_steps_count", "duplicates_count",
                "missing_pairs_count", "expected_pairs", "unresolved_landed"):
        out[key] = sum(c[key] for c in checks)
    for key in ("mixed_steps", "incomplete_steps", "missing_steps", "extra_steps", "missing_pairs", "unexpected_pairs"):
        out[key] = [x for c in checks for x in c[key]][:20]
    out["duplicates"] = {k: v for c in checks for k, v in c["duplicates"].items()}
    out["exactly_once"] = all(c["exactly_once"] for c in checks)
    out["dense"] = all(c["dense"] for c in checks)
    out["rounds"] = len(checks)
    return out


def run_pool(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Alternating rounds (alone, pool, pool, alone, ...), each on a fresh stream and after ``os.sync()``: one run of
    each kind measured the machine's drift as much as the code (one producer alone swung 95-205 commits/s between
    runs of the same code on this machine)."""
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    alone_runs: list[dict[str, Any]] = []
    pool_runs: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for i, (_round, which) in enumerate(interleaved(args.pool_rounds, ("alone", "pool"))):
        flush_writes()
        create_ms = file_creation_ms(root / "probe")  # what creating a file cost just before this round
        if which == "alone":
            alone_runs.append(dict(_alone_round(root, args, i), create_ms_before=create_ms))
        else:
            pool, check = _pool_round(root, args, i)
            pool_runs.append(dict(pool, create_ms_before=create_ms))
            checks.append(check)
    alone, pool = _merge_pool_runs(alone_runs), _merge_pool_runs(pool_runs)
    rounds = [ratio_of(p["commits_per_s"], a["commits_per_s"])
              for p, a in zip(pool_runs, alone_runs, strict=True)]
    return {"alone": alone, "pool": pool, "ratio": ratio_of(pool["commits_per_s"], alone["commits_per_s"]), "round_ratios": rounds, "check": _merge_checks(checks),
            "create_ms_before": {"alone": [r["create_ms_before"] for r in alone_runs],
                                 "pool": [r["create_ms_before"] for r in pool_runs]}}


# ================================================================================================ report


def report(results: dict[str, Any], args: argparse.Namespace) -> tuple[list[Table], list[dict[str, Any]]]:
    tables: list[Table] = []
    targets: list[dict[str, Any]] = []

    def target(scenario: str, figure: str, value: Any, goal: str, ok: bool | None) -> None:
        targets.append({"scenario": scenario, "figure": figure, "value": value, "target": goal, "met": ok})

    a = results.get("A")
    if a:
        t = Table(f"A. churn: distinct producer ids commit one batch each, one after another (world size {WORLD_SIZE}, "
                  f"1 row/shard, SQLite); p50 over the {a['window']} ids ending at each point",
                  ["ids", "p50 commit ms", "p99 commit ms", "cpu p50 ms", "producer()+commit p50 ms", "metadata.json KiB",
                   f"<= {TARGET_A_METADATA_KIB:.0f} KiB", "producers in head", "elapsed s"])
        for w in a["windows"]:
            kib = w["metadata_bytes"] / 1024
            t.add(w["ids"], w["p50_s"] * 1000, w["p99_s"] * 1000, w["cpu_p50_s"] * 1000, w["total_p50_s"] * 1000, kib,
                  met(kib <= TARGET_A_METADATA_KIB), w["producers_in_head"], w["elapsed_s"])
        if a["stopped_early"]:
            t.note(f"stopped by --max-seconds {args.max_seconds:g} after {a['ids_reached']:,} of {a['ids_requested']:,} ids "
                   f"({a['elapsed_s']:.0f} s)")
        t.note(f"first {a['window']} ids: p50 {a['p50_first_s'] * 1000:.1f} ms; last {a['window']} ids "
               f"(ids {max(1, a['ids_reached'] - a['window'] + 1):,}..{a['ids_reached']:,}): p50 {a['p50_last_s'] * 1000:.1f} ms; "
               f"ratio {a['ratio']:.2f}x (cpu {a['cpu_ratio']:.2f}x), target <= {TARGET_A_RATIO}x: {met(a['ratio'] <= TARGET_A_RATIO)}")
        t.note(f"batches carried by another commit: {a['carried']}; compare-and-swaps sent: {a['attempts_total']:,}")
        tables.append(t)
        target("A", f"p50 commit, last {a['window']} ids / first {a['window']} (at {a['ids_reached']:,} ids)",
               f"{a['ratio']:.2f}x", f"<= {TARGET_A_RATIO}x", a["ratio"] <= TARGET_A_RATIO)
        kib = a["metadata_bytes_end"] / 1024
        target("A", f"metadata.json at {a['ids_reached']:,} ids", f"{kib:,.1f} KiB", f"<= {TARGET_A_METADATA_KIB:.0f} KiB",
               kib <= TARGET_A_METADATA_KIB)
        target("A", "ids reached", f"{a['ids_reached']:,} of {a['ids_requested']:,}", "all", not a["stopped_early"])
    b = results.get("B")
    if b:
        t = Table(f"B. one producer alone after the churn vs on a fresh stream (until {args.lone_commits} commits or "
                  f"{args.lone_seconds:g} s)",
                  ["stream", "commits", "seconds", "commits/s", "first commit ms", "p50 ms", "p50 after first ms", "max ms",
                   "ratio", f">= {TARGET_B_RATIO}x"])
        after, fresh = b["after_churn"], b["fresh"]
        t.add(f"after churn ({b['producers_in_head']:,} ids in head, metadata {b['metadata_bytes_after_churn'] / 1024:,.1f} KiB)",
              after["commits"], after["elapsed_s"], after["commits_per_s"], after["first_commit_s"] * 1000,
              after["p50_s"] * 1000, after["p50_after_first_s"] * 1000, after["max_s"] * 1000, b["ratio"],
              met(b["ratio"] >= TARGET_B_RATIO))
        t.add("fresh stream", fresh["commits"], fresh["elapsed_s"], fresh["commits_per_s"], fresh["first_commit_s"] * 1000,
              fresh["p50_s"] * 1000, fresh["p50_after_first_s"] * 1000, fresh["max_s"] * 1000, 1.0, "-")
        t.note(f"each round is a new producer id committing back to back in this process; {args.lone_rounds} rounds per "
               "stream, alternating (after, fresh, fresh, after, ...), each after os.sync(); ratio = commits/s after "
               "churn / fresh over all rounds")
        tables.append(t)
        target("B", "lone commits/s after churn / fresh stream", f"{b['ratio']:.2f}x", f">= {TARGET_B_RATIO}x",
               b["ratio"] >= TARGET_B_RATIO)
    c = results.get("C")
    if c:
        alone, pool, check = c["alone"], c["pool"], c["check"]
        t = Table(f"C. rotating pool: {pool['processes']} processes x {pool['batches_per_process']} batches, a new producer "
                  f"id every {pool['rotate']} batches, vs one producer process alone",
                  ["run", "processes", "ids", "commits", "failed", "seconds", "commits/s", "p50 ms", "p99 ms", "carried",
                   "ratio", f">= {TARGET_C_RATIO}x"])
        t.add("alone (one id)", 1, alone["ids"], alone["commits"], alone["failed"], alone["elapsed_s"], alone["commits_per_s"],
              alone["p50_s"] * 1000, alone["p99_s"] * 1000, alone["carried"], 1.0, "-")
        t.add("rotating pool", pool["processes"], pool["ids"], pool["commits"], pool["failed"], pool["elapsed_s"],
              pool["commits_per_s"], pool["p50_s"] * 1000, pool["p99_s"] * 1000, pool["carried"], c["ratio"],
              met(c["ratio"] >= TARGET_C_RATIO))
        if pool["errors"]:
            t.note("errors: " + ", ".join(f"{k} x{v}" for k, v in pool["errors"].items()))
        t.note(f"read back: head step {check['head_step']} (total batches {check['total_batches']}); dense steps: "
               f"{check['dense']} (missing {check['missing_steps_count']}); every (producer, seq) exactly once: "
               f"{check['exactly_once']} (duplicates {check['duplicates_count']}, missing {check['missing_pairs_count']}, "
               f"steps mixing batches {len(check['mixed_steps'])}, steps without all {WORLD_SIZE} ranks "
               f"{len(check['incomplete_steps'])})")
        t.note("commits/s: published batches / (last commit returned - start barrier); spawn and imports are before the barrier")
        t.note(f"{pool.get('rounds', 1)} rounds of each, alternating (alone, pool, pool, alone, ...), each on a fresh stream "
               "after os.sync(); the rows pool their rounds; per round: alone "
               + ", ".join(f"{x:.0f}" for x in alone.get("round_commits_per_s", [alone["commits_per_s"]]))
               + " commits/s, pool " + ", ".join(f"{x:.0f}" for x in pool.get("round_commits_per_s", [pool["commits_per_s"]]))
               + " commits/s, pool/alone " + ", ".join(f"{x:.2f}x" for x in c.get("round_ratios", [c["ratio"]])))
        if c.get("create_ms_before"):
            t.note("CPU ms to create an empty file just before each round (calm: about 0.05; see benchmarks/_common.py): "
                   "alone " + ", ".join(f"{x:.2f}" for x in c["create_ms_before"]["alone"]) + "; pool "
                   + ", ".join(f"{x:.2f}" for x in c["create_ms_before"]["pool"]))
        tables.append(t)
        target("C", "failed commits", pool["failed"], f"== {TARGET_C_FAILED}", pool["failed"] == TARGET_C_FAILED)
        target("C", f"pool commits/s / one producer alone ({pool['processes']} processes)", f"{c['ratio']:.2f}x",
               f">= {TARGET_C_RATIO}x", c["ratio"] >= TARGET_C_RATIO)
        target("C", "head step == total batches", f"{check['head_step']} / {check['total_batches']}", "equal",
               check["head_step"] == check["total_batches"] and check["dense"])
        target("C", "every (producer, seq) exactly once", f"{check['duplicates_count']} dup, {check['missing_pairs_count']} missing",
               "0 / 0", check["exactly_once"])
    if targets:
        t = Table("targets", ["scenario", "figure", "value", "target", "met"])
        for row in targets:
            t.add(row["scenario"], row["figure"], row["value"], row["target"], met(row["met"]))
        tables.append(t)
    return tables, targets


# ================================================================================================ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser(__doc__, out=RESULTS_DIR / "producer_churn.json", whole_doc=True,
                          smoke_help="tiny sizes, seconds: what tests/test_benchmarks_smoke.py runs")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (2,000 ids, 8 x 12 pool batches), a few minutes")
    parser.add_argument("--scenarios", default="A,B,C", help="comma-separated subset of A,B,C (B runs A's churn first)")
    parser.add_argument("--ids", type=int, default=20_000, help="A: distinct producer ids, one batch each")
    parser.add_argument("--window", type=int, default=200, help="A: ids per p50 (first, last, and ending at each point)")
    parser.add_argument("--points", default="200,500,1000,2000,5000,10000,20000", help="A: id counts to report at")
    parser.add_argument("--max-seconds", type=float, default=None, help="A: stop the churn after this many seconds")
    parser.add_argument("--progress-s", type=float, default=15.0, help="A: print progress this often")
    parser.add_argument("--profile", type=int, default=0, help="A: cProfile N commits of new ids after the measured ones")
    parser.add_argument("--lone-commits", type=int, default=1000,
                        help="B: stop the lone producer after this many commits (or --lone-seconds)")
    parser.add_argument("--lone-seconds", type=float, default=5.0, help="B: ... or after this many seconds")
    parser.add_argument("--lone-rounds", type=int, default=2, help="B: rounds per stream, alternating")
    parser.add_argument("--pool", type=int, default=16, help="C: producer processes")
    parser.add_argument("--pool-batches", type=int, default=30, help="C: batches per process")
    parser.add_argument("--rotate", type=int, default=3, help="C: a fresh producer id every N batches")
    parser.add_argument("--alone-batches", type=int, default=200,
                        help="C: batches of the lone producer process (the baseline: 200 take 1.5-2.5 s here)")
    parser.add_argument("--start-method", choices=["forkserver", "spawn"], default="forkserver",
                        help="C: how producer processes start (forkserver: one import, then a fork per process)")
    parser.add_argument("--profile-dir", default=None,
                        help="C: cProfile every worker's commits, one <table>-<worker>.prof per process in this folder")
    parser.add_argument("--retries", type=int, default=2, help="C: re-commits of the same seq after a failed commit")
    parser.add_argument("--staging", choices=("auto", "catalog", "storage"), default="auto",
                        help="lakestream.commit.group.staging of every stream (auto: intents as rows of the SQLite catalog)")
    parser.add_argument("--pool-rounds", type=int, default=2,
                        help="C: rounds of the pool and of the lone producer, alternating, each on a fresh stream")
    parser.add_argument("--workdir", default=None, help="where tables live (default: a temp dir, removed at the end)")
    parser.add_argument("--settle-max-s", type=float, default=None,
                        help="at most this long, before the first run, wait for file creation to be calm after deletions "
                             "made before the benchmark (default 420; --smoke 0: measure only; see benchmarks/_common.py)")
    args = parser.parse_args(argv)
    small: dict[str, Any] = {}
    if args.quick:
        small = {"ids": 2_000, "pool": 8, "pool_batches": 12, "alone_batches": 30, "lone_commits": 100, "lone_seconds": 3.0,
                 "pool_rounds": 1}
    if args.smoke:
        small = {"ids": 30, "window": 10, "points": "10,30", "pool": 2, "pool_batches": 4, "rotate": 2, "alone_batches": 4,
                 "lone_commits": 10, "lone_seconds": 1.0, "progress_s": 5.0, "pool_rounds": 1}
    shrink(parser, args, small)
    args.scenarios = [s.strip().upper() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(args.scenarios) - {"A", "B", "C"}
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from A, B, C")
    args.points = [int(p) for p in str(args.points).split(",") if p.strip()]
    if args.settle_max_s is None:
        args.settle_max_s = 0.0 if args.smoke else 420.0
    if args.ids < 1 or args.window < 1 or args.pool < 1 or args.pool_batches < 1 or args.rotate < 0 or args.pool_rounds < 1:
        parser.error("--ids, --window, --pool, --pool-batches and --pool-rounds must be >= 1, --rotate >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    import logging

    import pyarrow
    import pyiceberg

    logging.getLogger("pyiceberg").setLevel(logging.ERROR)
    args = parse_args(argv)
    global STAGING
    STAGING = args.staging
    run = Run("producer_churn", smoke=args.smoke)
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="producer-churn-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    print(f"producer_churn: scenarios {','.join(args.scenarios)}, ids {args.ids:,}"
          f"{f' (at most {args.max_seconds:g} s)' if args.max_seconds is not None else ''}, pool {args.pool} x "
          f"{args.pool_batches} (new id every {args.rotate}), staging {args.staging}{' [smoke]' if args.smoke else ''}",
          flush=True)
    try:
        results["file_system_at_start"] = settle_and_say(root / "probe", max_wait_s=args.settle_max_s)
        churned = None
        if "A" in args.scenarios or "B" in args.scenarios:
            with run.phase("A"):
                churned, results["A"] = run_churn(root, args)
            if results["A"].get("profile"):
                print("\n".join(results["A"]["profile"].splitlines()[:80]), flush=True)
        if "B" in args.scenarios:
            with run.phase("B"):
                results["B"] = run_lone(root, churned, args)
        if "C" in args.scenarios:
            with run.phase("C"):
                results["C"] = run_pool(root, args)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    tables, targets = report(results, args)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "workdir")}
    run.finish(tables, {
        "phase_s": run.phases,
        "config": {**config, "world_size": WORLD_SIZE, "rows_per_shard": 1,
                   "catalog": "sqlite (embedded) + local warehouse in a temp dir"},
        "versions": {"pyiceberg": pyiceberg.__version__, "pyarrow": pyarrow.__version__},
        "machine": machine(),
        "scenarios": results,
        "targets": targets,
    }, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
