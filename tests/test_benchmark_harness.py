"""The benchmark harness (benchmarks/harness/, imported by the scripts through benchmarks/_common.py).

The process helpers run real child processes (spawn, as the scripts do); a failing child must surface its traceback
in the parent, and one that dies without a word must fail the run instead of hanging it.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import _kafka  # noqa: E402
from _common import (  # noqa: E402
    Children,
    Parent,
    Run,
    Table,
    alternating,
    batches,
    bench_parser,
    fill_defaults,
    interleaved,
    median,
    ratio_of,
    results_path,
    rotating,
    run_together,
    shrink,
)

# ------------------------------------------------------------------------------------------------ children (spawned)


def _square(n: int, line: Any) -> None:
    line.wait()
    line.report({"n": n, "square": n * n})


def _fail(n: int, line: Any) -> None:
    line.wait()
    raise ValueError(f"child {n} broke")


def _echo(conn: Any, factor: int) -> None:
    with Parent(conn) as parent:
        go = parent.ready({"pid": os.getpid()})
        parent.ok(go * factor)


def _raise_after_ready(conn: Any) -> None:
    with Parent(conn) as parent:
        parent.ready()
        raise KeyError("missing piece")


def _vanish(conn: Any) -> None:
    os._exit(3)  # dies before saying anything


# ------------------------------------------------------------------------------------------------ tests


def test_the_names_scripts_import_today_are_still_exported() -> None:
    """Scripts written against the earlier _common.py and _kafka.py keep working."""
    for name in ("BENCH_DIR", "REPO_ROOT", "RESULTS_DIR", "RunFolders", "Table", "file_creation_ms",
                 "settle_file_creation", "environment", "fmt_ms", "jain_index", "percentile", "summarize", "write_json",
                 "machine"):
        assert hasattr(_common, name), name
    for name in ("tansu_binary", "free_port", "tansu_version", "Tansu", "admin_config", "create_topic"):
        assert hasattr(_kafka, name), name
    assert set(_common.__all__) <= set(dir(_common))
    assert isinstance(_kafka.free_port(), int)


def test_run_together_starts_every_child_and_returns_each_report() -> None:
    reports, wall = run_together(mp.get_context("spawn"), _square, [(n,) for n in range(3)], timeout_s=120)
    assert sorted(r["square"] for r in reports) == [0, 1, 4]
    assert wall >= 0


def test_run_together_raises_the_traceback_of_a_failing_child() -> None:
    with pytest.raises(RuntimeError, match="child 0 broke"):
        run_together(mp.get_context("spawn"), _fail, [(0,)], timeout_s=120)


def test_children_speak_ready_go_ok_and_report_errors_and_silent_deaths() -> None:
    ctx = mp.get_context("spawn")
    children = Children(ctx)
    for factor in (2, 3):
        children.start(f"echo {factor}", _echo, factor)
    try:
        ready = children.wait_ready()
        assert all(isinstance(r["pid"], int) for r in ready)
        children.send_all(7)
        assert children.collect() == [14, 21]
    finally:
        children.close()

    failing = Children(ctx)
    failing.start("breaker", _raise_after_ready)
    try:
        failing.wait_ready()
        failing.send_all("go")
        with pytest.raises(RuntimeError, match=r"(?s)breaker failed.*KeyError: 'missing piece'"):
            failing.collect()
    finally:
        failing.close()

    silent = Children(ctx)
    silent.start("ghost", _vanish)
    try:
        with pytest.raises(RuntimeError, match="ghost failed before the start:\nthe process exited without a word"):
            silent.wait_ready()
    finally:
        silent.close()


def test_rounds_alternate_rotate_and_interleave() -> None:
    assert [alternating(("a", "b"), i) for i in range(4)] == [("a", "b"), ("b", "a")] * 2
    assert [rotating(("a", "b", "c"), i) for i in range(3)] == [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b")]
    assert list(interleaved(2, ("x", "y"))) == [(0, "x"), (0, "y"), (1, "y"), (1, "x")]


def test_paced_batches_are_due_at_their_time_and_saturated_ones_stop_at_the_end() -> None:
    start = time.monotonic()
    seen = []
    for seq in batches(mode="paced", start=start, count=3, interval=0.02, offset=0.5):
        seen.append((seq, time.monotonic() - start))
    assert [s for s, _ in seen] == [0, 1, 2]
    assert all(at >= 0.02 * (seq + 0.5) for seq, at in seen)
    timed_run = list(batches(mode="paced", start=time.monotonic(), duration=0.05, interval=0.02))
    assert timed_run[0] == 0 and len(timed_run) <= 4  # none due after the end (the last one checked before it)
    late = list(batches(mode="saturate", start=time.monotonic() - 10, duration=1.0))
    assert late == [0]  # at least one batch, however late the producer woke up
    with pytest.raises(ValueError, match="saturate"):
        next(batches(mode="burst", start=0.0))


def test_statistics_return_nan_where_undefined() -> None:
    assert math.isnan(median([])) and median([3, 1, 2]) == 2
    assert ratio_of(3, 2) == 1.5 and math.isnan(ratio_of(1, 0)) and math.isnan(ratio_of(None, 1))


def test_run_finish_prints_the_tables_and_writes_the_shared_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = Run("demo", smoke=True)
    with run.phase("first"):
        pass
    table = Table("demo table", ["P", "commits/s"])
    table.add(1, math.nan)
    out = tmp_path / "sub" / "demo.json"
    path = run.finish([table], {"config": {"where": tmp_path}}, out=out)
    assert path == out
    body = json.loads(out.read_text())
    for key in ("environment", "benchmark", "smoke", "wall_s", "loadavg_at_start", "config", "tables", "printed"):
        assert key in body, key
    assert body["benchmark"] == "demo" and body["smoke"] is True and body["config"]["where"] == str(tmp_path)
    assert body["tables"][0]["rows"] == [{"P": 1, "commits/s": None}]  # NaN becomes null
    printed = capsys.readouterr().out
    assert "== demo table ==" in printed and f"wrote {out}" in printed and "(first 0 s)" in printed
    assert body["printed"] == str(table)
    assert results_path(None, "memory", dated=True).name == f"memory-{time.strftime('%Y-%m-%d')}.json"
    assert results_path("x/y.json", "memory") == Path("x/y.json")


def test_smoke_defaults_fill_only_what_the_command_line_left_unset() -> None:
    parser = bench_parser("demo\n\nmore", out="results/demo.json")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(["--smoke", "--steps", "7"])
    fill_defaults(args, rounds=(3, 1))
    shrink(parser, args, {"steps": 5})
    assert (args.rounds, args.steps, args.out) == (1, 7, "results/demo.json")
    args = parser.parse_args([])
    fill_defaults(args, rounds=(3, 1))
    shrink(parser, args, {"steps": 5})
    assert (args.rounds, args.steps) == (3, 5)


def test_make_bench_runs_every_benchmark_script() -> None:
    # README and docs/benchmarks.md say `make bench` runs every benchmark: each script of benchmarks/ is a line of
    # the bench target, except the helpers, the history printer and dac_sim.py (commit_scaling.py's simulation phase)
    makefile = (BENCH.parent / "Makefile").read_text()
    target = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    run = {line.split("benchmarks/", 1)[1].split()[0] for line in target.splitlines() if "benchmarks/" in line}
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")} - {"history.py", "dac_sim.py"}
    assert scripts - run == set(), f"make bench does not run {sorted(scripts - run)}"


def test_the_dated_runs_are_tracked_and_each_names_its_own_date_and_benchmark() -> None:
    # benchmarks/results/YYYY-MM-DD-<benchmark>.json is the history (docs/benchmarks.md); the scripts' latest output
    # beside it, <benchmark>.json, is not tracked
    import subprocess

    import history

    listed = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=BENCH.parent, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    tracked = listed.stdout.split()
    dated = sorted(BENCH.glob(f"results/{history.DATED}"))
    assert dated and {f"benchmarks/results/{p.name}" for p in dated} <= set(tracked)
    assert all(name.rsplit("/", 1)[1][:4].isdigit() for name in tracked), tracked
    by_bench = history.load()
    for path in dated:
        body = json.loads(path.read_text())
        assert path.name == f"{body['date']}-{body['benchmark']}.json", path.name
    assert sum(len(files) for files in by_bench.values()) == len(dated)
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/results/vs_kafka.json"], cwd=BENCH.parent)
    assert ignored.returncode == 0
