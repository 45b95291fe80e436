"""catalog.services against the real servers (SeaweedFS, PostgreSQL, moto): no mocks.

Service-bound tests carry ``@pytest.mark.services``; deselect them with ``-m "not services"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pyiceberg.catalog import Catalog, load_catalog  # noqa: E402
from pyiceberg.utils.config import Config  # noqa: E402

from catalog import services  # noqa: E402
from lakestream_iceberg.connect.rest_sigv4 import install_rest_sigv4_fix, rest_sigv4_fix_active  # noqa: E402

services_mark = pytest.mark.services
SCHEMA = pa.schema([pa.field("step", pa.int64(), nullable=False), pa.field("shard", pa.string())])
ROWS = pa.table({"step": [1, 2, 3], "shard": ["a", "b", "c"]}, schema=SCHEMA)


# --------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def weed() -> Iterator[services.SeaweedFS]:
    with services.SeaweedFS() as svc:
        yield svc


@pytest.fixture(scope="module")
def pg() -> Iterator[services.Postgres]:
    with services.Postgres() as svc:
        yield svc


@pytest.fixture(scope="module")
def moto() -> Iterator[services.MotoS3]:
    with services.MotoS3() as svc:
        yield svc


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def _roundtrip(catalog: Catalog) -> str:
    """Create a namespace and a table, append ROWS, read them back; returns the table identifier."""
    namespace = _name("ns")
    catalog.create_namespace(namespace)
    identifier = f"{namespace}.{_name('t')}"
    table = catalog.create_table(identifier, schema=SCHEMA)
    table.append(ROWS)
    assert _read(catalog, identifier) == ROWS.to_pylist()
    return identifier


def _read(catalog: Catalog, identifier: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = catalog.load_table(identifier).scan().to_arrow().sort_by("step").to_pylist()
    return rows


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket held by the process group ``pid``."""
    inodes: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or _pgid(int(proc.name)) != pid:
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A = LISTEN
                hex_addr, hex_port = local.split(":")
                addr = socket.inet_ntoa(bytes.fromhex(hex_addr)[::-1]) if width == 8 else hex_addr
                found.append((addr, int(hex_port, 16)))
    return found


def _pgid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[2])


def _group_members(pgid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(int(p.name)) == pgid]


# --------------------------------------------------------------------------------------------------- no services


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = services.free_ports(5)
    assert len(set(ports)) == 5
    (admin,) = services.free_ports(1, offset=10000)
    for port in (*ports, admin, admin + 10000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_catalog_env_round_trips_through_pyiceberg_config(monkeypatch: pytest.MonkeyPatch) -> None:
    props = {"type": "rest", "uri": "http://127.0.0.1:1", "rest.sigv4-enabled": "true", "s3.access-key-id": "k"}
    for key, value in services.catalog_env("rest-seaweedfs", props).items():
        monkeypatch.setenv(key, value)
    assert "PYICEBERG_CATALOG__REST_SEAWEEDFS__REST__SIGV4_ENABLED" in services.catalog_env("rest-seaweedfs", props)
    assert Config().get_catalog_config("rest-seaweedfs") == props


def test_missing_postgres_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("glob.glob", lambda pattern: [])
    svc = services.Postgres()
    try:
        with pytest.raises(RuntimeError, match="apt-get install -y postgresql"):
            svc.start()
    finally:
        svc.close()


def test_sqlite_local_roundtrip(tmp_path: Path) -> None:
    props = services.sqlite_local(tmp_path / "wh")
    assert props["uri"].startswith("sqlite:///") and props["warehouse"].startswith("file://")
    _roundtrip(load_catalog("sqlite-local", **props))


def test_rest_fix_is_idempotent() -> None:
    from pyiceberg.catalog.rest import RestCatalog

    install_rest_sigv4_fix()
    patched = RestCatalog._init_sigv4
    install_rest_sigv4_fix()
    assert RestCatalog._init_sigv4 is patched
    assert rest_sigv4_fix_active()  # pyiceberg 0.12.0 needs it; drop this line once a release sends the header


def test_load_catalog_installs_the_rest_fixes_only_where_a_rest_catalog_can_come_out(tmp_path: Path) -> None:
    from lakestream_iceberg.connect.diagnose import _may_be_rest

    assert not _may_be_rest("probe", {"type": "sql", "uri": "sqlite:///x.db"})
    assert not _may_be_rest("probe", {"uri": "postgresql+psycopg2://u@h/db"})
    assert _may_be_rest("probe", {"type": "REST", "uri": "sqlite:///x.db"})  # the type wins, as in pyiceberg
    assert _may_be_rest("probe", {"uri": "http://127.0.0.1:1/iceberg"})
    assert _may_be_rest("probe", {})  # in doubt (e.g. nothing known of the name): install them
    # a SQL catalog does not pay for botocore (the SigV4 fix imports it): ~0.3 s at every worker's start
    code = ("import sys; from lakestream_iceberg import load_catalog; "
            f"load_catalog('probe', type='sql', uri='sqlite:///{tmp_path}/c.db', warehouse='file://{tmp_path}/wh'); "
            "print('botocore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("PYICEBERG_CATALOG__PROBE")})
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------------- services


@services_mark
@pytest.mark.parametrize("fixture", ["weed", "pg", "moto"])
def test_binds_only_loopback(fixture: str, request: pytest.FixtureRequest) -> None:
    svc: services.Service = request.getfixturevalue(fixture)
    assert svc.pid is not None
    listening = _listening(svc.pid)
    assert {port for _, port in listening} >= set(svc.ports.values())
    assert {addr for addr, _ in listening} == {"127.0.0.1"}, listening


@services_mark
def test_postgres_seaweedfs_roundtrip(pg: services.Postgres, weed: services.SeaweedFS) -> None:
    pg.create_database(db := _name("db"))
    _roundtrip(load_catalog("pg", **services.postgres_seaweedfs(pg, weed, database=db, prefix=db)))


@services_mark
def test_rest_seaweedfs_roundtrip(weed: services.SeaweedFS) -> None:
    install_rest_sigv4_fix()
    _roundtrip(load_catalog("rest", **services.rest_seaweedfs(weed)))


@services_mark
def test_sqlite_moto_roundtrip(moto: services.MotoS3, tmp_path: Path) -> None:
    _roundtrip(load_catalog("moto", **services.sqlite_moto(moto, tmp_path / "catalog.db")))


@services_mark
def test_rest_create_namespace_is_forbidden_without_fix(weed: services.SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> None:
    from pyiceberg.catalog.rest import RestCatalog
    from pyiceberg.exceptions import ForbiddenError

    unpatched = getattr(RestCatalog._init_sigv4, "__wrapped__", RestCatalog._init_sigv4)
    monkeypatch.setattr(RestCatalog, "_init_sigv4", unpatched)
    catalog = load_catalog("rest-unpatched", **services.rest_seaweedfs(weed))
    catalog.list_namespaces()  # GETs carry the empty-body hash and pass
    with pytest.raises(ForbiddenError, match="signature"):
        catalog.create_namespace(_name("ns"))


@services_mark
def test_restart_and_crash_keep_the_data(pg: services.Postgres, weed: services.SeaweedFS) -> None:
    install_rest_sigv4_fix()
    pg.create_database(db := _name("db"))
    sql_catalog = load_catalog("pg", **services.postgres_seaweedfs(pg, weed, database=db, prefix=db))
    rest_catalog = load_catalog("rest", **services.rest_seaweedfs(weed))
    sql_table, rest_table = _roundtrip(sql_catalog), _roundtrip(rest_catalog)
    ports = (dict(pg.ports), dict(weed.ports))

    pg.restart()
    weed.restart()
    assert (pg.ports, weed.ports) == ports
    # the same catalog objects keep working: pool_pre_ping replaces the dead pooled connections
    assert _read(sql_catalog, sql_table) == ROWS.to_pylist()
    assert _read(rest_catalog, rest_table) == ROWS.to_pylist()

    pg.kill()  # SIGKILL, no clean shutdown: the next start runs crash recovery
    weed.kill()
    pg.start()
    weed.start()
    sql_catalog.load_table(sql_table).append(ROWS)
    assert len(_read(sql_catalog, sql_table)) == 2 * ROWS.num_rows
    assert _read(rest_catalog, rest_table) == ROWS.to_pylist()


@services_mark
def test_moto_restart_comes_back_empty_with_its_bucket(moto: services.MotoS3) -> None:
    client = services._boto3_s3(moto.s3_endpoint, moto.access_key, moto.secret_key, moto.region)
    client.put_object(Bucket=moto.bucket, Key="probe", Body=b"x")
    port = moto.ports["s3"]
    moto.restart()
    assert moto.ports["s3"] == port and not moto.persistent
    assert client.list_objects_v2(Bucket=moto.bucket).get("KeyCount") == 0


@services_mark
def test_create_database_rejects_odd_names(pg: services.Postgres) -> None:
    with pytest.raises(ValueError, match="must match"):
        pg.create_database('x"; DROP DATABASE postgres; --')


@services_mark
def test_failed_start_raises_with_log_tail() -> None:
    svc = services.Postgres(settings={"no_such_setting": "1"})
    try:
        with pytest.raises(RuntimeError, match="no_such_setting"):
            svc.start()
        assert svc.pid is None
    finally:
        svc.close()


@services_mark
@pytest.mark.parametrize("cls", [services.SeaweedFS, services.Postgres, services.MotoS3], ids=lambda c: c.name)
def test_stop_leaves_no_process(cls: type[services.Service]) -> None:
    svc = cls()
    svc.start()
    pid, ports, data_dir = svc.pid, list(svc.ports.values()), svc.data_dir
    assert pid is not None and data_dir is not None
    if isinstance(svc, services.Postgres):  # an open client must not hold up shutdown
        conn = svc._connect()
    svc.close()
    assert not services.pid_alive(pid)
    assert _group_members(pid) == []
    assert not data_dir.exists()
    for port in ports:  # free again (SO_REUSEADDR, as servers bind: TIME_WAIT leftovers are fine)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    if isinstance(svc, services.Postgres):
        conn.close()


@services_mark
def test_cli_up_status_down(tmp_path: Path) -> None:
    state = tmp_path / "services.json"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "catalog.services", *args, "--only", "moto", "--state", str(state)]
        return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True)

    up = cli("up")
    exports = dict(line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines() if line.startswith("export "))
    assert exports["PYICEBERG_CATALOG__SQLITE_MOTO__TYPE"] == "sql"
    recorded = json.loads(state.read_text())["moto"]
    try:
        assert services.pid_alive(recorded["pid"], recorded["start_ticks"])
        assert "moto" in cli("status").stdout and "running" in cli("status").stdout
        catalog_env = {k: v for k, v in exports.items() if k.startswith("PYICEBERG_CATALOG__SQLITE_MOTO__")}
        with pytest.MonkeyPatch.context() as mp:  # pyiceberg reads PYICEBERG_* once, at import: re-read here
            for key, value in catalog_env.items():
                mp.setenv(key, value)
            props: dict[str, Any] | None = Config().get_catalog_config("sqlite-moto")
        assert props is not None
        _roundtrip(load_catalog("sqlite-moto", **props))
    finally:
        cli("down")
    assert not services.pid_alive(recorded["pid"])
    assert not Path(recorded["data_dir"]).exists()
    assert not state.exists()


@services_mark
def test_example_yaml_configs_match_the_property_functions(
    pg: services.Postgres, weed: services.SeaweedFS, moto: services.MotoS3, tmp_path: Path
) -> None:
    import strictyaml  # pyiceberg's own YAML reader

    assert moto.data_dir is not None
    placeholders = {
        "<WAREHOUSE_DIR>": str((tmp_path / "wh").resolve()),
        "<PG_PORT>": str(pg.port),
        "<S3_PORT>": str(weed.ports["s3"]),
        "<REST_PORT>": str(weed.ports["iceberg"]),
        "<MOTO_PORT>": str(moto.ports["s3"]),
        "<MOTO_DIR>": str(moto.data_dir),
    }
    expected = {
        "sqlite-local": services.sqlite_local(tmp_path / "wh"),
        "postgres-seaweedfs": services.postgres_seaweedfs(pg, weed, database="lakestream"),
        "rest-seaweedfs": services.rest_seaweedfs(weed),
        "sqlite-moto": services.sqlite_moto(moto, moto.data_dir / "catalog.db"),
    }
    for name, props in expected.items():
        text = (REPO_ROOT / "catalog" / f"{name}.pyiceberg.yaml").read_text()
        for placeholder, value in placeholders.items():
            text = text.replace(placeholder, value)
        assert strictyaml.load(text).data == {"catalog": {name: props}}, name
        documented = dict(
            line.strip("# ").split("=", 1) for line in text.splitlines() if line.startswith("#   PYICEBERG_CATALOG__")
        )
        assert documented == services.catalog_env(name, props), name


@services_mark
def test_exported_variables_load_the_catalog_the_arguments_load(
    pg: services.Postgres, weed: services.SeaweedFS, moto: services.MotoS3, tmp_path: Path
) -> None:
    """What ``catalog_env`` exports (and ``up`` prints) means what the property functions' keyword arguments mean to
    ``lakestream_iceberg.load_catalog``: ``pool_pre_ping`` too, which pyiceberg reads as ``pool-pre-ping``."""
    import pyiceberg.catalog

    from lakestream_iceberg import load_catalog as lakestream_load

    assert moto.data_dir is not None
    pg.create_database(db := _name("db"))
    catalogs = {
        "sqlite-local": services.sqlite_local(tmp_path / "wh"),
        "postgres-seaweedfs": services.postgres_seaweedfs(pg, weed, database=db, prefix=db),
        "rest-seaweedfs": services.rest_seaweedfs(weed),
        "sqlite-moto": services.sqlite_moto(moto, tmp_path / "moto" / "catalog.db"),
    }
    for name, props in catalogs.items():
        given = lakestream_load(name, **props)
        with pytest.MonkeyPatch.context() as mp:  # pyiceberg reads PYICEBERG_* once, at import: read them again here
            for key, value in services.catalog_env(name, props).items():
                mp.setenv(key, value)
            mp.setattr(pyiceberg.catalog, "_ENV_CONFIG", Config())
            exported = lakestream_load(name)
        assert dict(exported.properties) == dict(given.properties), name
        if hasattr(given, "engine"):
            assert exported.engine.pool._pre_ping == given.engine.pool._pre_ping == ("pool_pre_ping" in props), name
            given.engine.dispose()
            exported.engine.dispose()


@services_mark
def test_seaweedfs_writes_its_logs_in_its_own_folder(weed: services.SeaweedFS) -> None:
    """weed's glog files go to the server's data folder (removed with it), not to the shared temp folder where every
    start of every run would leave a dozen of them."""
    assert weed.data_dir is not None
    logs = weed.data_dir / "logs"
    assert any(path.name.startswith("weed.") for path in logs.iterdir())
