"""Where and how a result was measured, the JSON of a run, and ``Run``: the start and end every script shares.

A run's JSON goes to ``benchmarks/results/<name>.json`` (or where ``--out`` says); ``dated=True`` makes the name
``<name>-YYYY-MM-DD.json``, for series kept side by side. Every file carries ``environment()``; NaN becomes null.

    run = Run("vs_kafka", smoke=args.smoke)
    with run.phase("ingestion"):
        ...
    run.finish([table], {"config": ...}, out=args.out)   # prints the tables, writes the JSON, says where
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .tables import Table, print_tables, printed

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

__all__ = ["BENCH_DIR", "REPO_ROOT", "RESULTS_DIR", "Run", "environment", "loadavg", "machine", "results_path",
           "write_json"]


def loadavg() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages, None where the platform has none."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def environment(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Where and how a result was measured (host, CPUs, load, Python and key package versions)."""
    versions: dict[str, str] = {}
    for name in ("pyiceberg", "pyarrow", "sqlalchemy", "psycopg2", "numpy"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = str(getattr(module, "__version__", "?"))
    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_at_write": loadavg(),
        "argv": sys.argv,
        "versions": versions,
    }
    env.update(extra or {})
    return env


def machine() -> dict[str, Any]:
    """CPU model, core count, memory and date of this machine, for result tables."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    libc, libc_version = platform.libc_ver()
    # glibc and its tunables are recorded because they move the figures on some CPUs: glibc 2.36 (Debian 12) copies
    # with `rep movsb` on AMD EPYC, which is about 10x slower when destination - source is a few bytes past a multiple
    # of 4 KiB, as in pyarrow's Parquet page assembly (glibc bug 30994; benchmarks/README.md, host_copy.py)
    try:  # lakestream's own check of that pathology (write/host.py), when the package is importable
        from lakestream_iceberg.write.host import check_copy

        slow: bool | None = check_copy().slow
    except ImportError:
        slow = None
    return {"nproc": os.cpu_count(), "cpu_model": model, "mem_mib": mem, "date": time.strftime("%Y-%m-%d"),
            "libc": f"{libc} {libc_version}".strip(), "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "host_copy_slow": slow}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Table):
        return value.to_json()
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return _jsonable(value.__dict__)
    return value


def write_json(name: str, payload: Mapping[str, Any], *, directory: Path | None = None) -> Path:
    """Write ``payload`` (plus ``environment()``) to ``benchmarks/results/<name>.json``; NaN becomes null."""
    out_dir = directory or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (name if name.endswith(".json") else f"{name}.json")
    body = {"environment": environment(), **payload}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(body), indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def results_path(out: str | os.PathLike[str] | None, name: str, *, dated: bool = False) -> Path:
    """Where a run's JSON goes: ``out`` when given, else ``benchmarks/results/<name>.json`` (``<name>-<date>.json``
    when ``dated``)."""
    if out is not None:
        return Path(out)
    stem = f"{name}-{time.strftime('%Y-%m-%d')}" if dated else name
    return RESULTS_DIR / f"{stem}.json"


class Run:
    """One run of a benchmark script: when it started, the load then, how long each phase took, and its end.

    ``finish`` prints the tables, writes the JSON (``benchmark``, ``smoke``, ``wall_s``, ``loadavg_at_start``, the
    script's own keys, ``tables`` and ``printed``) and says where it went."""

    def __init__(self, benchmark: str, *, smoke: bool = False) -> None:
        self.benchmark = benchmark
        self.smoke = smoke
        self.started = time.monotonic()
        self.loadavg_at_start = loadavg()
        self.phases: dict[str, float] = {}

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the run into ``phases`` (also when it raises)."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = time.monotonic() - began

    def phases_text(self) -> str:
        return ", ".join(f"{k} {v:.0f} s" for k, v in self.phases.items())

    def header(self) -> dict[str, Any]:
        """The keys every result starts with."""
        return {"benchmark": self.benchmark, "smoke": self.smoke, "wall_s": self.elapsed_s,
                "loadavg_at_start": self.loadavg_at_start}

    def write(self, payload: Mapping[str, Any], *, out: str | os.PathLike[str] | None = None, dated: bool = False,
              name: str | None = None) -> Path:
        """Write the header and ``payload`` to ``results_path(out, name or the benchmark's name, dated=dated)``."""
        path = results_path(out, name or self.benchmark, dated=dated)
        return write_json(path.name, {**self.header(), **payload}, directory=path.parent)

    def finish(self, tables: Sequence[Table], payload: Mapping[str, Any], *, out: str | os.PathLike[str] | None = None,
               dated: bool = False, spaced: bool = True, sep: str = "\n\n", show: bool = True) -> Path:
        """Print ``tables`` (unless ``show`` is false: printed already), write the JSON with them under ``tables``
        and ``printed`` (joined by ``sep``), and print where it went and how long the run took."""
        if show:
            print_tables(tables, spaced=spaced)
        path = self.write({**payload, "tables": [t.to_json() for t in tables], "printed": printed(tables, sep=sep)},
                          out=out, dated=dated)
        took = f" ({self.phases_text()})" if self.phases else ""
        print(f"wrote {path} in {self.elapsed_s:.0f} s{took}", flush=True)
        return path
