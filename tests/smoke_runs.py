"""The benchmark smoke runs of tests/test_benchmarks_smoke.py, started ahead in the background while the rest of the
suite runs.

Each smoke run is a benchmark script run as a subprocess with ``--smoke``. Most of their time is waiting (service and
broker starts, imports, paced producers): the suite leaves a core mostly idle meanwhile, and run one after the other at
their turn they took about 130 s of its wall time. :class:`SmokeRuns` runs them one at a time in a background thread
from the suite's first test on, in the order of the tests, and a smoke test takes the outcome of its run: waiting for
it when it is running, running it itself when its turn has not come yet (never waiting behind another run, so a test's
timeout only ever covers its own run). A run marked ``alone`` (a benchmark that starts its own Ray instance, which must
not run beside the Ray tests) is always run by its test.

Under pytest-xdist (``make test`` runs the suite in 2 processes) every process collects every test but runs only those
it is sent, so one process (``gw0``) runs the smoke runs ahead in its background thread, and the turns and outcomes are
files in a directory the session's processes share: a run is claimed by creating its claim file (whoever creates it
first runs it: the background thread, or the smoke test of either process whose turn came first), and a test whose run
another process claimed waits for that run's outcome file (or fails at once if that process is gone without one).

Only the runs of tests that will run are started: those selected (``-k``, ``-m``) and not skipped by a ``skipif``
whose condition is true. Every run gets the environment the suite had when the first test started (after the
isolation fixtures of conftest.py), never a test's monkeypatched one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
MARKER = "smoke_run"


@dataclass(frozen=True)
class Job:
    script: str
    timeout: float
    alone: bool = False


@dataclass
class Outcome:
    returncode: int | None  # None: stopped by its hang guard
    stdout: str
    stderr: str
    out: Path


def job_of(item: pytest.Item) -> Job | None:
    """The smoke run ``item`` asks for (its ``smoke_run`` marker), or None."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    (script,) = marker.args
    return Job(script=script, timeout=float(marker.kwargs["timeout"]), alone=bool(marker.kwargs.get("alone", False)))


def _skipped(item: pytest.Item) -> bool:
    if item.get_closest_marker("skip") is not None:
        return True
    return any(bool(m.args[0]) if m.args else bool(m.kwargs.get("condition", True)) for m in item.iter_markers("skipif"))


def run_script(job: Job, out: Path, env: dict[str, str], started: list[subprocess.Popen[str]],
               stopping: Callable[[], bool] = lambda: False) -> Outcome:
    """Run ``job``'s benchmark with ``--smoke`` in its own process group. On its hang guard the benchmark gets SIGABRT
    first (faulthandler prints where every thread was, so a hang can be told from a slow machine), then the group is
    killed. Interrupted (Ctrl-C, or pytest-timeout's signal in the test's thread), the group is killed too: in its own
    session it gets no Ctrl-C, and nothing else would stop it. So is one started once ``stopping()`` (the session
    stopped after this run's turn was taken: what it killed did not include this one)."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", str(BENCH / job.script), "--smoke", "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    started.append(proc)
    if stopping():
        _kill_group(proc)
    try:
        try:
            stdout, stderr = proc.communicate(timeout=job.timeout)
            return Outcome(proc.returncode, stdout, stderr, out)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            _kill_group(proc)
            stdout, stderr = proc.communicate(timeout=30)
            return Outcome(None, stdout, stderr, out)
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        started.remove(proc)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is empty once everything in it exited
        os.killpg(proc.pid, signal.SIGKILL)


class SmokeRuns:
    """The smoke runs of one pytest session (module docstring)."""

    def __init__(self, directory: Path, env: dict[str, str], *, shared: Path | None = None,
                 background: bool = True) -> None:
        self.directory = directory
        self.env = env
        self.shared = shared  # the claim and outcome files of the session's pytest-xdist processes, or None
        self.background = background  # whether start() runs the smoke runs ahead here
        self.lock = threading.Lock()
        self.state: dict[str, str] = {}  # script -> "pending", "running", "done" or "elsewhere" (another process's)
        self.outcomes: dict[str, Outcome] = {}
        self.done = threading.Condition(self.lock)
        self.processes: list[subprocess.Popen[str]] = []
        self.stopping = False  # no other run starts
        self.killing = False  # and what runs is killed
        self.thread: threading.Thread | None = None

    def start(self, items: list[pytest.Item]) -> None:
        """Start the background runs of the smoke tests among ``items`` that will run."""
        if not self.background:
            return
        jobs = [job for item in items if (job := job_of(item)) is not None and not job.alone and not _skipped(item)]
        if not jobs:
            return
        with self.lock:
            for job in jobs:
                self.state.setdefault(job.script, "pending")
        self.thread = threading.Thread(target=self._background, args=(jobs,), name="smoke-runs", daemon=True)
        self.thread.start()

    def _claim(self, job: Job) -> bool:
        with self.lock:
            if self.stopping or self.state.get(job.script, "pending") != "pending":
                return False
            if self.shared is not None:
                try:
                    fd = os.open(self._file(job, "claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:  # another process's
                    self.state[job.script] = "elsewhere"
                    return False
                with os.fdopen(fd, "w") as claim:
                    claim.write(str(os.getpid()))
            self.state[job.script] = "running"
            return True

    def _file(self, job: Job, kind: str) -> Path:
        assert self.shared is not None
        return self.shared / f"{Path(job.script).stem}.{kind}"

    def _run(self, job: Job) -> None:
        try:
            outcome = run_script(job, self.directory / f"{Path(job.script).stem}.json", self.env, self.processes,
                                 stopping=lambda: self.killing)
        except BaseException as exc:
            self._finish(job, Outcome(-1, "", f"{type(exc).__name__}: {exc}", self.directory / "none"))
            if isinstance(exc, Exception):
                return  # reported by the test that asks for it
            raise  # Ctrl-C, or pytest-timeout's signal in the test's thread: pytest's to handle, not a run's outcome
        self._finish(job, outcome)

    def _finish(self, job: Job, outcome: Outcome) -> None:
        if self.shared is not None:  # for a test of another process: written whole, then renamed into place
            part = self._file(job, "outcome.part")
            part.write_text(json.dumps({"returncode": outcome.returncode, "stdout": outcome.stdout,
                                        "stderr": outcome.stderr, "out": str(outcome.out)}))
            os.replace(part, self._file(job, "outcome"))
        with self.done:
            self.outcomes[job.script] = outcome
            self.state[job.script] = "done"
            self.done.notify_all()

    def _background(self, jobs: list[Job]) -> None:
        for job in jobs:
            if self._claim(job):
                self._run(job)

    def outcome(self, job: Job) -> Outcome:
        """The outcome of ``job``: taken, waited for while the background runs it, or run here when not begun."""
        if self._claim(job):
            self._run(job)
        with self.done:
            while self.state.get(job.script) not in ("done", "elsewhere"):  # running in the background, under its
                self.done.wait()                                             # own hang guard
            if self.state[job.script] == "done":
                return self.outcomes[job.script]
        return self._outcome_elsewhere(job)

    def _outcome_elsewhere(self, job: Job) -> Outcome:
        """The outcome of the run another pytest-xdist process claimed: waited for while that process lives (the run
        is under its own hang guard there)."""
        outcome, claim = self._file(job, "outcome"), self._file(job, "claim")
        while not outcome.exists():
            owner = int(claim.read_text() or 0)  # empty for a moment, between its creation and its write
            if owner and not Path(f"/proc/{owner}").exists() and not outcome.exists():  # that process is gone
                return Outcome(-1, "", f"the pytest process {owner} that ran it exited without its outcome",
                               self.directory / "none")
            time.sleep(0.1)
        data = json.loads(outcome.read_text())
        return Outcome(data["returncode"], data["stdout"], data["stderr"], Path(data["out"]))

    def stop(self, *, finish_running: bool = False) -> None:
        """Start no other run; kill what still runs (an interrupted session) and wait for the background thread.

        With ``finish_running`` (the normal end of a pytest-xdist process, whose background run a test of another
        process may be waiting for), the run in progress is left to end, under its own hang guard."""
        with self.lock:
            self.stopping, self.killing = True, not finish_running
        if not finish_running:
            for proc in list(self.processes):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        if self.thread is not None:
            self.thread.join(timeout=None if finish_running else 60)


def result(runs: SmokeRuns, job: Job) -> dict[str, Any]:
    """The JSON the smoke run of ``job`` wrote, or the test fails with what the benchmark printed."""
    outcome = runs.outcome(job)
    if outcome.returncode is None:
        pytest.fail(f"{job.script} --smoke did not finish in {job.timeout:.0f} s:\n{outcome.stdout[-3000:]}\n"
                    f"{outcome.stderr[-6000:]}")
    assert outcome.returncode == 0, \
        f"{job.script} --smoke failed ({outcome.returncode}):\n{outcome.stdout[-3000:]}\n{outcome.stderr[-3000:]}"
    assert outcome.out.exists(), f"{job.script} wrote no JSON; stdout:\n{outcome.stdout[-2000:]}"
    data: dict[str, Any] = json.loads(outcome.out.read_text())
    return data
