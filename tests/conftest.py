"""Shared fixtures: real SQLite catalogs in temp dirs, and isolation from the developer's own pyiceberg config."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.smoke_runs import SmokeRuns  # noqa: E402
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
    runs = SmokeRuns(tmp_path_factory.mktemp("smoke-runs"), dict(os.environ))
    runs.start(request.session.items)
    yield runs
    runs.stop()


@pytest.fixture
def catalog(tmp_path: Path):
    return sqlite_catalog(str(tmp_path))


@pytest.fixture
def stream(catalog):
    from lakestream_iceberg import Stream

    return Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=4)
