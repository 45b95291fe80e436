"""Helpers shared by the benchmarks: statistics, result tables, JSON results, environment info.

Generic on purpose (no lakestream imports but one guarded, lazy one in machine()): any benchmark under ``benchmarks/`` may use it.

    from _common import percentile, jain_index, Table, write_json   # benchmarks/ is on sys.path when run as a script
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A producer logs the host copy check once per process (lakestream_iceberg/write/host.py); a benchmark starts dozens of
# producer processes, so it records the check once in machine() instead and keeps that warning out of its tables.
logging.getLogger("lakestream_iceberg.write.host").setLevel(logging.ERROR)

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

__all__ = [
    "BENCH_DIR",
    "REPO_ROOT",
    "RESULTS_DIR",
    "RunFolders",
    "Table",
    "file_creation_ms",
    "settle_file_creation",
    "environment",
    "fmt_ms",
    "jain_index",
    "percentile",
    "summarize",
    "write_json",
]


# ------------------------------------------------------------------------------------------------ statistics


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics (numpy's default).

    Returns NaN for an empty input.

    >>> percentile([1, 2, 3, 4], 50)
    2.5
    >>> percentile([5.0], 99)
    5.0
    """
    data = sorted(float(v) for v in values)
    if not data:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)``: 1.0 when all equal, ``1/n`` when one gets everything.

    An all-zero input is perfectly fair (1.0); an empty one is NaN.

    >>> jain_index([3, 3, 3])
    1.0
    >>> round(jain_index([1, 0, 0, 0]), 2)
    0.25
    """
    xs = [float(v) for v in values]
    if not xs:
        return math.nan
    sq = sum(x * x for x in xs)
    if sq == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sq)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """count, mean, p50, p90, p99, max of a sample (NaN where undefined)."""
    n = len(values)
    return {
        "count": n,
        "mean": (sum(values) / n) if n else math.nan,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if n else math.nan,
    }


def fmt_ms(seconds: float, digits: int = 1) -> str:
    """Seconds as a millisecond string ('-' for NaN/None)."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    return f"{seconds * 1000:.{digits}f}"


# ------------------------------------------------------------------------------------------------ tables


@dataclass
class Table:
    """A plain-text result table: add rows, then ``str()`` or ``print()`` it (also exported as dicts to JSON).

    >>> t = Table("demo", ["P", "commits/s"])
    >>> t.add(1, 52.25)
    >>> print(t)  # doctest: +NORMALIZE_WHITESPACE
    == demo ==
    P  commits/s
    -  ---------
    1  52.25
    """

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"table {self.title!r} has {len(self.columns)} columns, got {len(values)} values")
        self.rows.append(list(values))

    def note(self, text: str) -> None:
        self.notes.append(text)

    @staticmethod
    def _cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            if math.isnan(value):
                return "-"
            if value == 0:
                return "0"
            if abs(value) >= 1000:
                return f"{value:,.0f}"
            if abs(value) >= 100:
                return f"{value:.1f}"
            return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"
        return str(value)

    def __str__(self) -> str:
        cells = [[self._cell(v) for v in row] for row in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]
        lines = [f"== {self.title} =="]
        lines.append("  ".join(c.ljust(w) for c, w in zip(self.columns, widths, strict=False)).rstrip())
        lines.append("  ".join("-" * w for w in widths))
        for row in cells:
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)).rstrip())
        lines.extend(f"  {n}" for n in self.notes)
        return "\n".join(lines)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=False)) for row in self.rows]

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns, "rows": self.as_dicts(), "notes": self.notes}


# ------------------------------------------------------------------------------------------------ results


def environment(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Where and how a result was measured (host, CPUs, load, Python and key package versions)."""
    versions: dict[str, str] = {}
    for name in ("pyiceberg", "pyarrow", "sqlalchemy", "psycopg2", "numpy"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = str(getattr(module, "__version__", "?"))
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_at_write": load,
        "argv": sys.argv,
        "versions": versions,
    }
    env.update(extra or {})
    return env


def _jsonable(value: Any) -> Any:
    if isinstance(value, Table):
        return value.to_json()
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
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


# ------------------------------------------------------------------------------------------------ file system hygiene
#
# Deleting thousands of small files makes creating files slow for the next minutes on some local file systems, and a
# benchmark that deletes one run's folder before the next run charges that to whichever system creates files. ext4
# without a journal (this project's VMs) skips, when it allocates an inode, every free inode freed less than 60 s ago,
# or 6 minutes while its inode table block is dirty (``recently_deleted`` in fs/ext4/ialloc.c; ``perf`` shows about
# three quarters of a file creation's CPU there). Measured on such a VM: creating an empty file costs 0.02-0.06 ms of
# CPU when calm and 0.4-1.3 ms after a run folder of a few thousand files was deleted; 8 lakestream producers publishing
# 1 MiB batches (about 4 new files per batch) published 54 MiB/s right after 10,000 files were deleted, 145 on a calm
# file system. A Kafka broker with in-memory storage creates no files. So the benchmarks that compare keep every run's
# folder until they end (``RunFolders``) and wait, once at the start, until creating a file costs what it costs on a
# calm file system (``settle_file_creation``).


def file_creation_ms(directory: Path, *, files: int = 100) -> float:
    """CPU milliseconds to create one empty file in ``directory``: the mean of ``files`` creations. The files are kept
    (deleting them is what slows the next ones); they go with ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    start = time.process_time()
    for i in range(files):
        fd = os.open(directory / f"probe-{os.getpid()}-{time.time_ns()}-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
    return (time.process_time() - start) / files * 1000


def settle_file_creation(directory: Path, *, calm_ms: float = 0.15, max_wait_s: float = 420.0,
                         poll_s: float = 10.0) -> dict[str, Any]:
    """Wait until creating a file in ``directory`` costs at most ``calm_ms`` of CPU (see above), or ``max_wait_s``
    passed (0: measure once, do not wait). Returns what it saw: the first and last cost, the seconds waited, and
    whether it settled; a benchmark records it next to its figures."""
    first = last = file_creation_ms(directory)
    start = time.monotonic()
    waited = 0.0  # seconds spent waiting after the first probe (none when it was calm, or max_wait_s is 0)
    while last > calm_ms and time.monotonic() - start < max_wait_s:
        time.sleep(poll_s)
        last = file_creation_ms(directory)
        waited = time.monotonic() - start
    return {"create_ms_first": round(first, 4), "create_ms": round(last, 4), "waited_s": round(waited, 1),
            "settled": last <= calm_ms, "calm_ms": calm_ms}


class RunFolders:
    """Folders of finished runs, deleted when the benchmark ends (``close``) instead of between the runs it measures
    (see above). When the disk would go below ``min_free_bytes``, the oldest are deleted at once and counted in
    ``deleted_early`` (a benchmark reports it: the runs after it may have paid for the deletion)."""

    def __init__(self, *, min_free_bytes: int = 8 << 30, delete_at_once: bool = False) -> None:
        self._kept: list[Path] = []
        self._min_free = min_free_bytes
        self._at_once = delete_at_once
        self.deleted_early = 0

    def retire(self, path: Path) -> None:
        if self._at_once:
            shutil.rmtree(path, ignore_errors=True)
            return
        self._kept.append(path)
        while self._kept and shutil.disk_usage(path.parent).free < self._min_free:
            shutil.rmtree(self._kept.pop(0), ignore_errors=True)
            self.deleted_early += 1

    def close(self) -> None:
        while self._kept:
            shutil.rmtree(self._kept.pop(0), ignore_errors=True)


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
    # of 4 KiB, as in pyarrow's Parquet page assembly (glibc bug 30994; benchmarks/README.md, fifteenth session)
    try:  # lakestream's own check of that pathology (write/host.py), when the package is importable
        from lakestream_iceberg.write.host import check_copy

        slow: bool | None = check_copy().slow
    except ImportError:
        slow = None
    return {"nproc": os.cpu_count(), "cpu_model": model, "mem_mib": mem, "date": time.strftime("%Y-%m-%d"),
            "libc": f"{libc} {libc_version}".strip(), "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "host_copy_slow": slow}

