"""Shared fixtures: real SQLite catalogs in temp dirs, and isolation from the developer's own pyiceberg config."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

# Python 3.11 before 3.11.8 can fail ast.parse with "SystemError: AST constructor recursion depth mismatch" (CPython
# gh-106905). pytest rewrites the hypothesis package when it is imported, and hypothesis' plugin imports it at the end of
# the session when no test did: after a Ray test, that failed a passing run (seen once in a loop of the Ray cluster
# test). Imported here, before any test runs.
import hypothesis  # noqa: F401
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.smoke_runs import SmokeRuns, job_of  # noqa: E402
from tests.support import SCHEMA, sqlite_catalog  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _isolated_pyiceberg_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Never read ~/.pyiceberg.yaml or the developer's PYICEBERG_* variables in tests."""
    home = tmp_path_factory.mktemp("pyiceberg-home")
    saved = {k: v for k, v in os.environ.items() if k.startswith("PYICEBERG_")}
    for key in saved:
        del os.environ[key]
    os.environ["PYICEBERG_HOME"] = str(home)
    yield
    os.environ.pop("PYICEBERG_HOME", None)
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="session")
def _relays_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Head relays of the tests (and of the processes they start) meet in a temporary directory, not in the user's
    runtime directory, where their lock files would stay after the run."""
    directory = tmp_path_factory.mktemp("relays")
    directory.chmod(0o700)
    saved = os.environ.get("LAKESTREAM_RELAY_DIR")
    os.environ["LAKESTREAM_RELAY_DIR"] = str(directory)
    yield
    if saved is None:
        os.environ.pop("LAKESTREAM_RELAY_DIR", None)
    else:
        os.environ["LAKESTREAM_RELAY_DIR"] = saved


@pytest.fixture(autouse=True, scope="session")
def smoke_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               _isolated_pyiceberg_config: None, _relays_in_a_temp_dir: None) -> Iterator[SmokeRuns]:
    """The benchmark smoke runs of the selected tests, started in the background at the suite's first test, in the
    environment the isolation fixtures above made (tests/smoke_runs.py)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # under pytest-xdist: this process's name (gw0, gw1, ...)
    shared = None
    if worker is not None:  # the session's processes share the parent of their temp dirs
        shared = tmp_path_factory.getbasetemp().parent / "smoke-runs"
        shared.mkdir(exist_ok=True)
    runs = SmokeRuns(tmp_path_factory.mktemp("smoke-runs"), dict(os.environ), shared=shared,
                     background=worker in (None, "gw0"))
    runs.start(request.session.items)
    yield runs
    interrupted = request.session.exitstatus == pytest.ExitCode.INTERRUPTED or bool(request.session.shouldstop)
    runs.stop(finish_running=shared is not None and not interrupted)


@pytest.fixture
def catalog(tmp_path: Path):
    return sqlite_catalog(str(tmp_path))


@pytest.fixture
def stream(catalog):
    from lakestream_iceberg import Stream

    return Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=4)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``), the tests that must not run beside each other
    stay in one process, in their order: every Ray test (and the Ray benchmark's smoke run), since a second Ray instance
    on the machine would join the first through ``/tmp/ray/ray_current_cluster``; and every Spark test, which share
    one package-scoped JVM."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.nodeid.startswith("tests/integrations/") or (job_of(item) is not None and job_of(item).alone):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif item.nodeid.startswith("tests/interop/"):
            item.add_marker(pytest.mark.xdist_group("spark"))
