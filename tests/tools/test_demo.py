"""``lakestream demo``: real producer and rank processes on the embedded catalog, and the exactly-once check itself."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lakestream_iceberg.tools.demo import CHECK_PASSED, DemoResult, _check, make_shard, shard_digest

SCRIPT = shutil.which("lakestream", path=str(Path(sys.executable).parent))


def _command() -> list[str]:
    return [SCRIPT] if SCRIPT else [sys.executable, "-m", "lakestream_iceberg.tools.cli"]


def test_demo_small_run_passes_the_exactly_once_check(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYICEBERG_", "LAKESTREAM_"))}
    env["PYICEBERG_HOME"] = str(tmp_path)
    home = tmp_path / "a home"  # the command the summary suggests next must run as printed: quoted
    proc = subprocess.run([*_command(), "demo", "--home", str(home), "--producers", "2", "--ranks", "2",
                           "--steps-per-producer", "3"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr
    assert f"{CHECK_PASSED}: every rank received every sample exactly once, in step order (6 steps x 2 ranks" in proc.stdout
    for label in ("steps ", "samples ", "MB/s", "p50", "p99"):
        assert label in proc.stdout
    # The host check is reported once, in the summary, and only where the host has the slow copy; the producer
    # processes do not each log it.
    from lakestream_iceberg.write.host import check_copy

    slow = check_copy().slow
    assert ("slow memcpy (glibc bug 30994)" in proc.stdout) == slow, proc.stdout
    assert "bug 30994" not in proc.stderr, proc.stderr
    stream = next(line.split()[3] for line in proc.stdout.splitlines() if line.startswith("lakestream demo: stream "))
    # The stream the demo left behind answers the CLI (in-process: the subprocess path is covered by test_cli).
    from lakestream_iceberg.tools.cli import main

    assert main(["--home", str(home), "sql", stream, "SELECT count(*) AS steps FROM batches", "--json"]) == 0
    suggested = next(line for line in proc.stdout.splitlines() if line.startswith("next: lakestream "))
    assert main(shlex.split(suggested)[2:]) == 0, suggested  # was `--home /tmp/.../a home status ...`


def test_demo_json_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lakestream_iceberg.tools.cli import main

    code = main(["--json", "--home", str(tmp_path), "demo", "--producers", "1", "--ranks", "1", "--steps-per-producer", "2"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["exactly_once"] == "passed" and summary["steps"] == 2 and summary["problems"] == []
    assert summary["commit_latency_p50_ms"] > 0 and summary["bytes_published"] > 0
    assert isinstance(summary["host_copy_slow"], bool)


def test_demo_refuses_more_processes_than_it_starts_before_making_a_stream(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from lakestream_iceberg.tools.cli import main

    code = main(["--home", str(tmp_path), "demo", "--producers", "200", "--ranks", "100"])
    err = capsys.readouterr().err
    assert code != 0 and "more than 256" in err and len(err.strip().splitlines()) == 1, err
    assert not any(tmp_path.rglob("*.metadata.json"))  # nothing was created


def _alive_in_session(sid: int) -> list[int]:
    """The processes of session ``sid`` that still run (zombies left to a non-reaping init are not running)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads sessions from /proc")
@pytest.mark.parametrize("to", ["parent", "group"])
def test_ctrl_c_stops_the_demo_and_its_processes_at_once_without_a_traceback(tmp_path: Path, to: str) -> None:
    """SIGINT to the demo alone (kill -INT) left its workers running and the parent joined each for 30 s (two minutes
    with four workers); Ctrl-C at a terminal (the whole group) made workers still importing print a traceback."""
    import signal

    from pyiceberg.exceptions import NoSuchNamespaceError

    from lakestream_iceberg import Stream
    from lakestream_iceberg.tools.config import embedded_catalog
    from tests.support import until

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYICEBERG_", "LAKESTREAM_"))}
    env["PYICEBERG_HOME"] = str(tmp_path)
    home = tmp_path / "home"
    # a terminal's Ctrl-C reaches a program whose SIGINT is not ignored; a test run started in the background
    # (`pytest &`) hands its children SIGINT ignored, which the demo keeps, as any program does: start it with the default
    default_sigint = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execvp(sys.argv[1], sys.argv[1:])"]
    proc = subprocess.Popen([*default_sigint, *_command(), "demo", "--home", str(home), "--producers", "2", "--ranks", "2",
                             "--steps-per-producer", "100000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        def published() -> bool:
            try:  # the demo makes the catalog, then its namespace, then the stream
                names = embedded_catalog(home).list_tables("demo")
            except NoSuchNamespaceError:
                return False
            return bool(names) and Stream.open(embedded_catalog(home), names[0]).head_step() >= 2
        until(lambda: proc.poll() is not None or published(), "the demo's producers to publish")
        if to == "parent":
            proc.send_signal(signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 130 and err.strip() == "lakestream: interrupted", err
        until(lambda: not _alive_in_session(proc.pid), "the demo's processes to end", deadline_s=10)
    finally:
        for pid in _alive_in_session(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_samples_are_deterministic_and_vary_in_size() -> None:
    a, b = make_shard("prep-0", 3, 1), make_shard("prep-0", 3, 1)
    assert shard_digest(a) == shard_digest(b) and shard_digest(a) != shard_digest(make_shard("prep-0", 3, 0))
    shards = [make_shard("prep-1", s, r) for s in range(10) for r in range(2)]
    assert len({t.num_rows for t in shards}) > 2
    lengths = {len(x) for t in shards for x in t.column("tokens").to_pylist()}
    sizes = {len(x) for t in shards for x in t.column("image").to_pylist()}
    assert len(lengths) > 5 and len(sizes) > 5


def _result() -> DemoResult:
    return DemoResult(stream="s", where="w", producers=2, ranks=2, steps_per_producer=1)


def _committed() -> dict[int, tuple]:
    return {1: ("prep-0", 0, [1, 2], ["a0", "a1"]), 2: ("prep-1", 0, [0, 3], ["b0", "b1"])}


def _reads(rank: int | None = None, got: list[tuple] | None = None) -> dict[int, list[tuple]]:
    """Per rank: (step, rows, digest, duplicates, misrouted) in arrival order; ``rank`` gets ``got`` instead."""
    reads = {0: [(1, 1, "a0", 0, 0), (2, 0, "b0", 0, 0)], 1: [(1, 2, "a1", 0, 0), (2, 3, "b1", 0, 0)]}
    if rank is not None:
        reads[rank] = got or []
    return reads


@pytest.mark.parametrize(
    ("reads", "committed", "problem"),
    [
        (_reads(), _committed(), None),
        (_reads(), {**_committed(), 2: ("prep-0", 0, [0, 3], ["b0", "b1"])}, "(producer, seq)"),
        (_reads(0, [(2, 0, "b0", 0, 0), (1, 1, "a0", 0, 0)]), _committed(), "not 1..2 in order"),
        (_reads(1, [(1, 2, "a1", 0, 0), (2, 3, "XX", 0, 0)]), _committed(), "content differs"),
        (_reads(0, [(1, 1, "a0", 0, 0)]), _committed(), "rank 0 received"),
        (_reads(1, [(1, 2, "a1", 1, 0), (2, 3, "b1", 0, 0)]), _committed(), "duplicate"),
    ],
)
def test_the_check_catches_loss_duplicates_reordering_and_corruption(reads, committed, problem) -> None:
    result = _result()
    _check(result, committed, reads, ["prep-0", "prep-1"])
    if problem is None:
        assert result.passed, result.problems
    else:
        assert not result.passed and any(problem in p for p in result.problems), result.problems


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
