"""Child processes of a benchmark, and what it reads about processes (CPU, RSS, a free port).

Two ways a benchmark talks to its children:

- a queue: every child reports one dict on a shared queue; ``guarded`` runs a child's main and puts
  ``{"error": traceback}`` there if it raises, so the parent fails with the child's traceback instead of waiting;
- a pipe per child (``Children`` in the parent, ``Parent`` in the child): the child says ``ready`` once it has
  imported and opened what it needs, waits for the parent's ``go`` message, then sends ``ok`` with its result, or
  ``error`` with its traceback. A child that dies without a word is a failure too, not a wait forever::

      def worker(conn, n):                    # module level: spawn and forkserver children import it
          with Parent(conn) as parent:
              setup()
              go = parent.ready()
              parent.ok(measure(n))

      children = Children(mp.get_context("spawn"))
      children.start("worker 0", worker, 100)
      try:
          children.wait_ready()
          children.send_all("go")
          results = children.collect()
      finally:
          children.close()
"""

from __future__ import annotations

import os
import resource
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "Children",
    "Parent",
    "StartLine",
    "collect_reports",
    "cpu_s",
    "free_port",
    "guarded",
    "kill_all",
    "live_children_cpu_s",
    "pid_cpu_s",
    "pid_rss_kib",
    "rss_kib",
    "run_together",
]


def cpu_s(*, children: bool = False) -> float:
    """CPU seconds (user + system, all threads) this process used so far; ``children``: plus its reaped children."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    if children:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += kids.ru_utime + kids.ru_stime
    return total


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``(comm)``: state, ppid, ..., utime (12th), stime (13th)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pid_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` used so far; None when it is gone (or no /proc)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (ValueError, IndexError):
        return None


def live_children_cpu_s(parent: int | None = None) -> float:
    """CPU seconds of the live children of ``parent`` (default: this process); their time is in RUSAGE_CHILDREN only
    once they exit and are reaped."""
    parent = os.getpid() if parent is None else parent
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(int(stat.parent.name))
        if fields is not None and len(fields) > 12 and int(fields[1]) == parent:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def pid_rss_kib(pid: int | str = "self") -> int | None:
    """Resident memory of process ``pid`` in KiB (VmRSS); None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_kib() -> int:
    """This process's resident memory in KiB (0 where unknown)."""
    return pid_rss_kib("self") or 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def guarded(main: Callable[..., Any], out: Any, *args: Any) -> None:
    """Run ``main(*args)`` in a child; if it raises, put ``{"error": traceback}`` on the queue ``out``."""
    try:
        main(*args)
    except BaseException:  # noqa: BLE001 - report to the parent, whatever it was
        out.put({"error": traceback.format_exc()})


def kill_all(procs: list[Any], *, join_s: float = 5.0) -> None:
    """SIGKILL every process (a no-op for one that already exited, whichever start method reaped it), then join."""
    started = [proc for proc in procs if proc.pid is not None]
    for proc in started:
        proc.kill()
    for proc in started:
        proc.join(join_s)


class StartLine:
    """Children that report on one queue and start together: each calls ``wait()`` once it has imported and opened
    what it needs (it returns when all are ready), and ``report(result)`` at the end (``guarded`` reports a
    traceback there). Pass it to the children as an argument; the parent ``release``-s them, then ``collect``-s.

        line = StartLine(ctx)
        procs = [ctx.Process(target=guarded, args=(work, line.out, i, line)) for i in range(n)]
        ...; line.release(len(procs)); results = line.collect(len(procs), timeout_s=60)
    """

    def __init__(self, ctx: Any) -> None:
        self.ready = ctx.Semaphore(0)
        self.go = ctx.Event()
        self.out = ctx.Queue()

    def wait(self) -> None:
        self.ready.release()
        self.go.wait()

    def report(self, result: Any) -> None:
        self.out.put(result)

    def wait_ready(self, n: int, *, timeout_s: float = 120.0) -> None:
        """Wait until ``n`` children are ready (each within ``timeout_s``)."""
        for _ in range(n):
            if not self.ready.acquire(timeout=timeout_s):
                raise TimeoutError(f"benchmark processes did not get ready within {timeout_s:.0f} s")

    def release(self, n: int, *, timeout_s: float = 120.0) -> None:
        """Wait until ``n`` children are ready, then start them all."""
        self.wait_ready(n, timeout_s=timeout_s)
        self.go.set()

    def collect(self, n: int, *, timeout_s: float) -> list[Any]:
        return collect_reports(self.out, n, timeout_s=timeout_s)


def run_together(ctx: Any, target: Callable[..., None], arguments: list[tuple[Any, ...]], *, timeout_s: float,
                 ready_timeout_s: float = 120.0) -> tuple[list[Any], float]:
    """Start ``target(*args, line)`` in a child for each ``args`` of ``arguments`` (``guarded``: a traceback is raised
    here), release them together once all are ready, and return their reports with the seconds from the release to
    the last report. The children are killed on every path (a no-op for those that exited)."""
    line = StartLine(ctx)
    procs = [ctx.Process(target=guarded, args=(target, line.out, *args, line)) for args in arguments]
    try:
        for proc in procs:
            proc.start()
        line.release(len(procs), timeout_s=ready_timeout_s)
        began = time.perf_counter()
        reports = line.collect(len(procs), timeout_s=timeout_s)
        wall = time.perf_counter() - began
        for proc in procs:
            proc.join()
        return reports, wall
    finally:
        kill_all(procs)


def collect_reports(out: Any, n: int, *, timeout_s: float, what: str = "a benchmark process") -> list[Any]:
    """``n`` reports from the queue ``out`` within ``timeout_s`` in all (in the order they came); a child's
    ``{"error": traceback}`` is raised here."""
    reports = []
    deadline = time.monotonic() + timeout_s
    while len(reports) < n:
        report = out.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(report, dict) and "error" in report:
            raise RuntimeError(f"{what} failed:\n{report['error']}")
        reports.append(report)
    return reports


class Parent:
    """A child's end of its pipe: ``ready()`` (returns the parent's go message), ``ok(result)``; leaving the ``with``
    block on an exception sends ``error`` with the traceback (and swallows it: the parent raises it)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def ready(self, body: Any = None) -> Any:
        self.conn.send(("ready", body))
        return self.conn.recv()

    def ok(self, result: Any) -> None:
        self.conn.send(("ok", result))

    def __enter__(self) -> Parent:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if kind is None or not issubclass(kind, Exception):
            return False
        self.conn.send(("error", "".join(traceback.format_exception(kind, exc, tb))))
        return True


class Children:
    """Child processes with a pipe each, the parent's side of the protocol above."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.labels: list[str] = []
        self.conns: list[Any] = []
        self.procs: list[Any] = []

    def start(self, label: str, target: Callable[..., None], *args: Any) -> None:
        """Start ``target(conn, *args)`` as a daemon child."""
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=target, args=(child, *args), daemon=True)
        proc.start()
        child.close()  # a child that dies without a word is then an EOFError here, not a wait forever
        self.labels.append(label)
        self.conns.append(parent)
        self.procs.append(proc)

    @staticmethod
    def receive(conn: Any, expected: str, failure: str) -> Any:
        """The body of the child's next message, which must have the status ``expected``."""
        try:
            status, body = conn.recv()
        except EOFError:
            status, body = "error", "the process exited without a word"
        if status != expected:
            raise RuntimeError(f"{failure}:\n{body}")
        return body

    def wait_ready(self, what: str = "") -> list[Any]:
        """Every child's ready message (each has imported and opened what it needs)."""
        return [self.receive(conn, "ready", f"{what}{label} failed before the start")
                for label, conn in zip(self.labels, self.conns)]

    def send_all(self, message: Any) -> None:
        for conn in self.conns:
            conn.send(message)

    def collect(self, what: str = "") -> list[Any]:
        """Every child's result, in the order they were started."""
        return [self.receive(conn, "ok", f"{what}{label} failed") for label, conn in zip(self.labels, self.conns)]

    def close(self, *, join_s: float = 30.0) -> None:
        """Join every child, terminating one still alive after ``join_s``."""
        for proc in self.procs:
            proc.join(timeout=join_s)
            if proc.is_alive():
                proc.terminate()
