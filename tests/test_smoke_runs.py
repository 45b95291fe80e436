"""tests/smoke_runs.py, the background runner of the benchmark smoke runs: each run happens once, in the background or
by its own test when its turn has not come, and a failed or hanging run fails its own test with what it printed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.smoke_runs import Job, SmokeRuns, result

pytestmark = pytest.mark.timeout(120)


def _script(tmp_path: Path, name: str, body: str) -> str:
    """A stand-in benchmark: ``--smoke --out PATH`` as the real ones take; ``body`` runs first, with ``out`` set."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""\
        import json, os, sys, time
        out = sys.argv[sys.argv.index("--out") + 1]
        {body}
        with open(out, "w") as f:
            json.dump({{"pid": os.getpid(), "smoke": "--smoke" in sys.argv, "env": os.environ.get("SMOKE_RUNS_MARK")}}, f)
        """))
    return str(path)  # an absolute path: BENCH / it is it


def test_each_run_happens_once_whether_the_background_or_its_test_gets_to_it_first(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    first = Job(script=_script(tmp_path, "first.py", f"""
        while not os.path.exists({str(gate)!r}):  # held until the test has claimed the second run
            time.sleep(0.01)"""), timeout=100)
    second = Job(script=_script(tmp_path, "second.py", "pass"), timeout=100)
    runs = SmokeRuns(tmp_path, {**os.environ, "SMOKE_RUNS_MARK": "suite"})
    try:
        with runs.lock:  # what start() does with the selected tests' jobs
            runs.state = {first.script: "pending", second.script: "pending"}
        runs.thread = threading.Thread(target=runs._background, args=([first, second],), daemon=True)
        runs.thread.start()
        with runs.done:
            while runs.state[first.script] != "running":
                runs.done.wait(0.01)
        # the background is busy with the first run: the second's test runs it itself instead of waiting behind it
        claimed = threading.Thread(target=lambda: runs.outcome(second))
        claimed.start()
        with runs.done:
            while runs.state[second.script] != "done":
                runs.done.wait(0.01)
        gate.write_text("go")
        claimed.join()
        got_first, got_second = result(runs, first), result(runs, second)
        runs.thread.join()
    finally:
        runs.stop()
    assert got_first["smoke"] is True and got_first["env"] == "suite"  # the environment the runner was given
    assert got_second["pid"] != got_first["pid"]
    assert result(runs, second) == got_second  # taken again, never run again


def test_a_failed_run_fails_its_test_with_what_it_printed(tmp_path: Path) -> None:
    job = Job(script=_script(tmp_path, "broken.py", "print('half way'); sys.exit('the benchmark broke')"), timeout=100)
    runs = SmokeRuns(tmp_path, dict(os.environ))
    with pytest.raises(AssertionError, match=r"(?s)broken.py --smoke failed \(1\).*half way.*the benchmark broke"):
        result(runs, job)


def test_a_hanging_run_is_stopped_by_its_guard_and_its_process_group_is_gone(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    job = Job(script=_script(tmp_path, "hang.py", f"""
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        while True:
            time.sleep(1)"""), timeout=3)
    runs = SmokeRuns(tmp_path, dict(os.environ))
    with pytest.raises(pytest.fail.Exception, match=r"hang.py --smoke did not finish in 3 s"):
        result(runs, job)
    assert not runs.processes
    for pid in (int(p) for p in pids.read_text().split()) if pids.exists() else ():  # killed before it wrote: none
        deadline = time.monotonic() + 60  # SIGKILLed: exiting (its pipes closed first), however slowly
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _running(pid)  # the benchmark and what it started: not left running


def test_an_interrupted_test_stops_the_run_it_ran_itself_and_the_interruption_reaches_pytest(tmp_path: Path) -> None:
    """A smoke test runs its own run (its turn had not come) and is interrupted there: Ctrl-C, or pytest-timeout's
    signal. The interruption reaches pytest (it was taken for the run's failed outcome: the test failed with
    "failed (-1)" and a Ctrl-C did not stop the session), and the benchmark's process group is stopped (it kept running
    in its own session, its hang guard gone, after pytest ended)."""
    pids = tmp_path / "pids"
    job = Job(script=_script(tmp_path, "long.py", f"""
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        open({str(pids)!r} + ".part", "w").write(f"{{os.getpid()}} {{child.pid}}")
        os.rename({str(pids)!r} + ".part", {str(pids)!r})
        while True:
            time.sleep(1)"""), timeout=100)
    runs = SmokeRuns(tmp_path, dict(os.environ))

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    def once_started() -> None:  # the benchmark and its child run: interrupt the test's thread as Ctrl-C would
        while not pids.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    interrupter = threading.Thread(target=once_started, daemon=True)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            runs.outcome(job)
        interrupter.join()
        assert not runs.processes
        started = [int(p) for p in pids.read_text().split()]
        for pid in started:
            deadline = time.monotonic() + 60  # SIGKILLed: exiting, however slowly
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert not [pid for pid in started if _running(pid)]  # the benchmark and what it started: not left running
    finally:
        signal.signal(signal.SIGUSR1, previous)
        runs.stop()
        for pid in (int(p) for p in pids.read_text().split()) if pids.exists() else ():  # left by a failing run
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_run_whose_turn_was_taken_before_the_session_stopped_is_stopped_once_it_starts(tmp_path: Path) -> None:
    """The background thread took a run's turn, and the session stopped (its end, ``-x``, Ctrl-C) before the benchmark
    was started: started after the stop had killed what was running, the benchmark is killed at once. It ran to its
    hang guard while the session waited for the background thread (60 s) and then ended without it, leaving it
    running in its own session."""
    job = Job(script=_script(tmp_path, "late.py", """
        while True:
            time.sleep(1)"""), timeout=20)
    runs = SmokeRuns(tmp_path, dict(os.environ))
    assert runs._claim(job)  # the background thread's turn for it ...
    runs.stop()  # ... and the session stops before it starts the benchmark
    runs._run(job)  # the background thread goes on
    outcome = runs.outcomes[job.script]
    assert outcome.returncode == -signal.SIGKILL and not runs.processes


def test_processes_sharing_a_directory_run_each_run_once_and_take_each_others_outcomes(tmp_path: Path) -> None:
    """Under pytest-xdist: one process runs ahead in the background, a test of the other takes that run's outcome
    (waiting while it runs, even when the first process's session ends meanwhile), and a run the other process's test
    got to first is its own, which the background skips."""
    shared, gate = tmp_path / "shared", tmp_path / "gate"
    shared.mkdir()
    ahead = Job(script=_script(tmp_path, "ahead.py", f"""
        while not os.path.exists({str(gate)!r}):  # held until the other process waits for it
            time.sleep(0.01)"""), timeout=100)
    taken = Job(script=_script(tmp_path, "taken.py", "pass"), timeout=100)
    first = SmokeRuns(tmp_path / "gw0", dict(os.environ), shared=shared)
    second = SmokeRuns(tmp_path / "gw1", dict(os.environ), shared=shared, background=False)
    for runs in (first, second):
        runs.directory.mkdir()
    got_taken = result(second, taken)  # its turn came in the second process first
    first.thread = threading.Thread(target=first._background, args=([taken, ahead],), daemon=True)
    first.thread.start()
    waiting: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: waiting.update(got=result(second, ahead)), daemon=True)
    try:
        with first.done:
            while first.state.get(ahead.script) != "running":
                first.done.wait(0.01)
        waiter.start()
        while second.state.get(ahead.script) != "elsewhere":  # the other's test saw the claim: it waits for the outcome
            time.sleep(0.01)
        stopping = threading.Thread(target=lambda: first.stop(finish_running=True), daemon=True)
        stopping.start()  # the first process's session ends: its run in progress goes on for the other's test
        while not first.stopping:
            time.sleep(0.01)
        gate.write_text("go")
        stopping.join()
        waiter.join()
    finally:
        first.stop()
    assert waiting["got"] == json.loads((first.directory / "ahead.json").read_text())  # the first process's run
    assert first.state[taken.script] == "elsewhere" and taken.script not in first.outcomes  # never run twice
    assert got_taken["pid"] != waiting["got"]["pid"]  # type: ignore[index]


def test_a_run_whose_process_exited_without_its_outcome_fails_the_test_waiting_for_it(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    job = Job(script=_script(tmp_path, "orphan.py", "pass"), timeout=100)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pytest process that claimed the run, then died (killed, out of memory)
    (shared / "orphan.claim").write_text(str(gone.pid))
    runs = SmokeRuns(tmp_path, dict(os.environ), shared=shared, background=False)
    with pytest.raises(AssertionError, match=rf"(?s)orphan.py --smoke failed \(-1\).*process {gone.pid} that ran it exited"):
        result(runs, job)
    assert not (tmp_path / "orphan.json").exists()  # not run here either


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to an init that does not reap is not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
