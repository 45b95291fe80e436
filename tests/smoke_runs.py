"""The benchmark smoke runs of tests/test_benchmarks_smoke.py, started ahead in the background while the rest of the
suite runs.

Each smoke run is a benchmark script run as a subprocess with ``--smoke``. Most of their time is waiting (service and
broker starts, imports, paced producers): the suite leaves a core mostly idle meanwhile, and run one after the other at
their turn they took about 130 s of its wall time. :class:`SmokeRuns` runs them one at a time in a background thread
from the suite's first test on, in the order of the tests, and a smoke test takes the outcome of its run: waiting for
it when it is running, running it itself when its turn has not come yet (never waiting behind another run, so a test's
timeout only ever covers its own run). A run marked ``alone`` (a benchmark that starts its own Ray instance, which must
not run beside the Ray tests) is always run by its test.

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

    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.directory = directory
        self.env = env
        self.lock = threading.Lock()
        self.state: dict[str, str] = {}  # script -> "pending", "running" or "done"
        self.outcomes: dict[str, Outcome] = {}
        self.done = threading.Condition(self.lock)
        self.processes: list[subprocess.Popen[str]] = []
        self.stopping = False
        self.thread: threading.Thread | None = None

    def start(self, items: list[pytest.Item]) -> None:
        """Start the background runs of the smoke tests among ``items`` that will run."""
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
            self.state[job.script] = "running"
            return True

    def _run(self, job: Job) -> None:
        try:
            outcome = run_script(job, self.directory / f"{Path(job.script).stem}.json", self.env, self.processes,
                                 stopping=lambda: self.stopping)
        except BaseException as exc:
            self._finish(job, Outcome(-1, "", f"{type(exc).__name__}: {exc}", self.directory / "none"))
            if isinstance(exc, Exception):
                return  # reported by the test that asks for it
            raise  # Ctrl-C, or pytest-timeout's signal in the test's thread: pytest's to handle, not a run's outcome
        self._finish(job, outcome)

    def _finish(self, job: Job, outcome: Outcome) -> None:
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
            while self.state.get(job.script) != "done":  # running in the background, under its own hang guard
                self.done.wait()
            return self.outcomes[job.script]

    def stop(self) -> None:
        """Kill what still runs (an interrupted session) and wait for the background thread."""
        with self.lock:
            self.stopping = True
        for proc in list(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.thread is not None:
            self.thread.join(timeout=60)


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
