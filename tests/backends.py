"""Catalog x storage backends for the matrix and fault tests, on real servers (no mocks).

Fixtures (import them by name into a test module, e.g. ``from tests.backends import backend, postgres_service``):

* ``seaweedfs_service``, ``postgres_service``, ``moto_service``: session-scoped; each server is started once per pytest
  session, on first use, and stopped (PID checked, temp dir removed) when the session ends, also when tests fail or
  the run is interrupted. The servers live in a process-wide pool with reference counts, so importing these fixtures
  into several test modules (each import makes pytest register its own copy of the fixture) still starts each server
  only once.
* ``backend``: parametrized over :data:`BACKENDS` (``sqlite-local``, ``postgres-seaweedfs``, ``rest-seaweedfs``,
  ``sqlite-moto``); each test gets a fresh catalog: a fresh PostgreSQL database and S3 prefix, a fresh SQLite file
  and S3 prefix, a fresh namespace on the REST catalog, or a fresh temp dir. Only the servers that the selected
  parameters need are started.

Worker processes get the same catalog through :meth:`Backend.worker_env` (JSON in ``LAKESTREAM_TEST_CATALOG``, never on
the command line, where ``ps`` would show the secret) and rebuild it with :func:`catalog_from_env`.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pyiceberg.catalog import Catalog, load_catalog  # noqa: E402

from catalog import services  # noqa: E402
from lakestream_iceberg import Stream  # noqa: E402
from lakestream_iceberg.connect.rest_sigv4 import install_rest_sigv4_fix  # noqa: E402

__all__ = [
    "BACKENDS",
    "ENV_CATALOG",
    "Backend",
    "backend",
    "backend_fixture",
    "catalog_from_env",
    "fresh_name",
    "make_backend",
    "moto_service",
    "postgres_service",
    "producer_seq",
    "published",
    "seaweedfs_service",
    "spawn_worker",
]

BACKENDS = ("sqlite-local", "postgres-seaweedfs", "rest-seaweedfs", "sqlite-moto")
ENV_CATALOG = "LAKESTREAM_TEST_CATALOG"
NEEDS: dict[str, tuple[str, ...]] = {
    "sqlite-local": (),
    "postgres-seaweedfs": ("postgres", "seaweedfs"),
    "rest-seaweedfs": ("seaweedfs",),
    "sqlite-moto": ("moto",),
}


# --------------------------------------------------------------------------------------------------- service pool


class _Pool:
    """Process-wide servers, started on first acquire, stopped when the last holder releases them (or at exit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, services.Service] = {}
        self._holders: dict[str, int] = {}

    def acquire(self, name: str) -> services.Service:
        with self._lock:
            svc = self._live.get(name)
            if svc is None:
                svc = services.SERVICES[name]()
                try:
                    svc.start()
                except BaseException:
                    svc.close()
                    raise
                self._live[name] = svc
            elif not svc.running:  # a fault test crashed it and did not bring it back: recover for the next test
                svc.start()
            self._holders[name] = self._holders.get(name, 0) + 1
            return svc

    def release(self, name: str) -> None:
        with self._lock:
            self._holders[name] -= 1
            if self._holders[name] == 0:
                self._live.pop(name).close()

    def close_all(self) -> None:
        with self._lock:
            for svc in self._live.values():
                try:
                    svc.close()
                except Exception:  # noqa: BLE001 - best effort at interpreter exit
                    pass
            self._live.clear()
            self._holders.clear()


POOL = _Pool()
atexit.register(POOL.close_all)  # a session that dies without running fixture teardown still stops its servers


def _service(name: str) -> Iterator[Any]:
    svc = POOL.acquire(name)
    try:
        yield svc
    finally:
        POOL.release(name)


@pytest.fixture(scope="session")
def seaweedfs_service() -> Iterator[services.SeaweedFS]:
    yield from _service("seaweedfs")


@pytest.fixture(scope="session")
def postgres_service() -> Iterator[services.Postgres]:
    yield from _service("postgres")


@pytest.fixture(scope="session")
def moto_service() -> Iterator[services.MotoS3]:
    yield from _service("moto")


# --------------------------------------------------------------------------------------------------- backends


def fresh_name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@dataclass
class Backend:
    """One catalog + storage combination with a fresh namespace (and database / prefix) for one test."""

    kind: str
    properties: dict[str, str]
    namespace: str
    database: str | None = None  # the fresh PostgreSQL database, if any
    catalogs: list[Catalog] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The pyiceberg catalog name (also the SQL catalogs' ``catalog_name`` column)."""
        return self.kind

    def catalog(self) -> Catalog:
        """A new catalog object (its own connections / HTTP session), as another process or thread would have."""
        if self.properties.get("type") == "rest":
            install_rest_sigv4_fix()
        catalog = load_catalog(self.name, **self.properties)
        self.catalogs.append(catalog)
        return catalog

    def identifier(self, table: str = "stream") -> str:
        return f"{self.namespace}.{table}"

    def worker_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env[ENV_CATALOG] = json.dumps({"name": self.name, "properties": self.properties})
        env.update(extra)
        return env

    def close(self) -> None:
        for catalog in self.catalogs:
            engine = getattr(catalog, "engine", None)
            if engine is not None:
                engine.dispose()
        self.catalogs.clear()


def make_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A fresh :class:`Backend` of ``kind``; the servers it needs come from the session fixtures."""
    ns = fresh_name("ns")
    if kind == "sqlite-local":
        props = services.sqlite_local(tmp_path / "sqlite-local")
    elif kind == "postgres-seaweedfs":
        pg: services.Postgres = request.getfixturevalue("postgres_service")
        weed: services.SeaweedFS = request.getfixturevalue("seaweedfs_service")
        db = fresh_name("db")
        pg.create_database(db)
        props = services.postgres_seaweedfs(pg, weed, database=db, prefix=db)
        return Backend(kind=kind, properties=props, namespace=ns, database=db)
    elif kind == "rest-seaweedfs":
        weed = request.getfixturevalue("seaweedfs_service")
        props = services.rest_seaweedfs(weed)
    elif kind == "sqlite-moto":
        moto: services.MotoS3 = request.getfixturevalue("moto_service")
        props = services.sqlite_moto(moto, tmp_path / "sqlite-moto" / "catalog.db", prefix=fresh_name("wh"))
    else:  # pragma: no cover - a typo in a test
        raise ValueError(f"unknown backend {kind!r}; choose from {BACKENDS}")
    return Backend(kind=kind, properties=props, namespace=ns)


def backend_fixture(*kinds: str, name: str = "backend") -> Any:
    """A fixture named ``name`` giving a fresh :class:`Backend` of each of ``kinds`` in turn, closed after the test."""

    @pytest.fixture(params=list(kinds), name=name)
    def made_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
        made = make_backend(request.param, request, tmp_path)
        try:
            yield made
        finally:
            made.close()

    return made_backend


backend = backend_fixture(*BACKENDS)


# --------------------------------------------------------------------------------------------------- checks


def producer_seq(path: str) -> tuple[str, int]:
    """(producer, seq) from a data file path ``<location>/data/<producer>/<seq:012d>-<token>-r<rank:05d>.parquet``."""
    producer, name = path.split("/data/", 1)[1].split("/")
    return producer, int(name.split("-", 1)[0])


def published(stream: Stream) -> dict[int, tuple[str, int]]:
    """step -> (producer, seq) of every published step, from the manifests' file paths; one batch per step."""
    out: dict[int, tuple[str, int]] = {}
    for step in range(1, stream.head_step() + 1):
        keys = {producer_seq(f.file_path) for f in stream.locate(step)}
        assert len(keys) == 1, f"step {step} mixes batches: {keys}"
        out[step] = keys.pop()
    return out


# --------------------------------------------------------------------------------------------------- worker side


def catalog_from_env() -> Catalog:
    """In a worker process: the catalog the parent described in ``LAKESTREAM_TEST_CATALOG``."""
    spec = json.loads(os.environ[ENV_CATALOG])
    if spec["properties"].get("type") == "rest":
        install_rest_sigv4_fix()
    return load_catalog(spec["name"], **spec["properties"])


def spawn_worker(backend: Backend, *args: str, stderr: IO[str] | None = None, **env: str) -> subprocess.Popen[str]:
    """``python -m tests.workers_matrix ARGS...`` with the backend's catalog in its environment.

    ``stderr``: an open file for the worker's stderr (the parent can watch it while the worker runs); default a pipe.
    """
    cmd: Sequence[str] = [sys.executable, "-m", "tests.workers_matrix", *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=backend.worker_env(**env), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr is None else stderr, text=True,
    )
