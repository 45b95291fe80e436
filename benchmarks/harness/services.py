"""A PostgreSQL for a benchmark: the project's own (``catalog/services.py``), else one in a temp dir.

The project's services (SeaweedFS, PostgreSQL, moto) are context managers already: a benchmark starts one for its run
with ``with services.SeaweedFS(root / "seaweedfs") as weed:`` and it is stopped on every path. ``start_postgres``
falls back to ``OwnPostgres`` where ``catalog.services.Postgres`` is unusable.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .procs import free_port

__all__ = ["OwnPostgres", "start_postgres"]


class OwnPostgres:
    """Fallback when ``catalog.services`` is unusable: PostgreSQL in a temp dir as user postgres, 127.0.0.1 only."""

    def __init__(self, *, max_connections: int = 100) -> None:
        self.max_connections = max_connections
        self.dir = Path(tempfile.mkdtemp(prefix="bench-pg-"))
        self.port = free_port()
        self.pid: int | None = None
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        if not bins:
            raise RuntimeError("PostgreSQL is not installed (apt-get install -y postgresql)")
        self.bin = bins[-1]

    def _as_pg(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)

    def start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        data = self.dir / "data"
        self._as_pg([str(self.bin / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
        self._as_pg([str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(self.dir / "server.log"), "-w", "-o",
                     f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                     f"-c max_connections={self.max_connections}", "start"])
        self.pid = int((data / "postmaster.pid").read_text().split()[0])

    def sqlalchemy_uri(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        conn.close()
        return self.sqlalchemy_uri(name)

    def close(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 2)  # SIGINT: fast shutdown, by PID
            for _ in range(200):
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            self.pid = None
        shutil.rmtree(self.dir, ignore_errors=True)


def start_postgres(*, max_connections: int = 100) -> tuple[Any, str]:
    """A running PostgreSQL taking ``max_connections`` clients: catalog.services.Postgres if it works, else
    ``OwnPostgres``. Returns (server, how); the caller closes it."""
    try:
        from catalog.services import Postgres

        pg = Postgres(settings={"max_connections": str(max_connections)})
        pg.start()
        return pg, "catalog.services.Postgres"
    except Exception as exc:  # noqa: BLE001 - any failure: fall back
        print(f"[postgres] catalog.services.Postgres unusable ({type(exc).__name__}: {exc}); starting our own", flush=True)
        own = OwnPostgres(max_connections=max_connections)
        own.start()
        return own, "own initdb/pg_ctl"

