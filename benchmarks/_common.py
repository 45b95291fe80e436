"""The benchmark harness's names in one import (the code lives in ``benchmarks/harness/``, one module per concern).

Generic on purpose (no lakestream imports but one guarded, lazy one in machine()): any benchmark under ``benchmarks/``
may use it. A script holds its scenario; what every script needs comes from here:

    from _common import Run, Table, percentile, write_json   # benchmarks/ is on sys.path when run as a script

- statistics (``harness.stats``): ``percentile``, ``median``, ``ratio_of``, ``jain_index``, ``summarize``, ``fmt_ms``;
- tables (``harness.tables``): ``Table``, ``print_tables``, ``printed``;
- results (``harness.results``): ``machine``, ``environment``, ``loadavg``, ``write_json``, ``results_path``
  (``--out``, else ``benchmarks/results/<name>.json`` or ``<name>-<date>.json``), and ``Run``: start time, load,
  timed phases, and ``finish`` (tables printed, JSON written with ``benchmark``, ``smoke``, ``wall_s``,
  ``loadavg_at_start``, the script's keys, ``tables`` and ``printed``);
- file-system hygiene (``harness.files``): ``flush_writes``, ``settle_file_creation``, ``settle_and_say``,
  ``file_creation_ms``, ``RunFolders``, ``dir_bytes``;
- processes (``harness.procs``): ``Children`` and ``Parent`` (a pipe per child: ready, go, ok or the child's
  traceback); ``run_together`` (children started together, one report each on a queue), with its parts
  ``StartLine``, ``collect_reports``, ``guarded`` and ``kill_all``; ``cpu_s``, ``pid_cpu_s``, ``live_children_cpu_s``,
  ``rss_kib``, ``pid_rss_kib``, ``free_port``; ``preloaded_context`` (forkserver children that skip the imports);
- timing (``harness.timing``): ``sleep_until``, ``timed`` (wall and CPU seconds of a call), ``batches`` (a saturated
  or paced producer's batches, each when due);
- latency (``harness.latency``): ``DelayedLine`` (a TCP forwarder that delays what clients send: a store on this host
  answering as one across a network);
- rounds (``harness.rounds``): ``alternating``, ``rotating``, ``interleaved``;
- services (``harness.services``): ``start_postgres`` (the project's PostgreSQL, else ``OwnPostgres`` in a temp dir);
- catalogs (``harness.catalogs``): ``sqlite_catalog`` and ``sqlite_props`` (SQLite and a local warehouse in a folder);
- command line (``harness.cli``): ``bench_parser`` (``--smoke``, ``--out``), ``fill_defaults``, ``shrink``,
  ``int_list``.

Importing it also puts the repository root at the front of ``sys.path``, so that a script measures the
``lakestream_iceberg`` of the checkout it is in (not an installed one) and can import the project's
``catalog.services``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

for _path in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):  # the checkout, then benchmarks/
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from harness.catalogs import sqlite_catalog, sqlite_props  # noqa: E402
from harness.cli import bench_parser, fill_defaults, int_list, shrink  # noqa: E402
from harness.files import (  # noqa: E402
    RunFolders,
    dir_bytes,
    file_creation_ms,
    flush_writes,
    settle_and_say,
    settle_file_creation,
)
from harness.latency import DelayedLine  # noqa: E402
from harness.procs import (  # noqa: E402
    Children,
    Parent,
    StartLine,
    collect_reports,
    cpu_s,
    free_port,
    guarded,
    kill_all,
    live_children_cpu_s,
    pid_cpu_s,
    pid_rss_kib,
    preloaded_context,
    rss_kib,
    run_together,
)
from harness.results import (  # noqa: E402
    BENCH_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    Run,
    environment,
    loadavg,
    machine,
    results_path,
    write_json,
)
from harness.rounds import alternating, interleaved, rotating  # noqa: E402
from harness.services import OwnPostgres, start_postgres  # noqa: E402
from harness.stats import fmt_ms, jain_index, median, percentile, ratio_of, summarize  # noqa: E402
from harness.tables import Table, print_tables, printed  # noqa: E402
from harness.timing import batches, sleep_until, timed  # noqa: E402

# A producer logs the host copy check once per process (lakestream_iceberg/write/host.py); a benchmark starts dozens of
# producer processes, so it records the check once in machine() instead and keeps that warning out of its tables.
logging.getLogger("lakestream_iceberg.write.host").setLevel(logging.ERROR)

__all__ = [
    "BENCH_DIR",
    "REPO_ROOT",
    "RESULTS_DIR",
    "Children",
    "DelayedLine",
    "OwnPostgres",
    "Parent",
    "Run",
    "RunFolders",
    "StartLine",
    "Table",
    "alternating",
    "batches",
    "bench_parser",
    "collect_reports",
    "cpu_s",
    "dir_bytes",
    "environment",
    "file_creation_ms",
    "fill_defaults",
    "flush_writes",
    "fmt_ms",
    "free_port",
    "guarded",
    "int_list",
    "interleaved",
    "jain_index",
    "kill_all",
    "live_children_cpu_s",
    "loadavg",
    "machine",
    "median",
    "percentile",
    "pid_cpu_s",
    "pid_rss_kib",
    "preloaded_context",
    "print_tables",
    "printed",
    "ratio_of",
    "results_path",
    "rotating",
    "rss_kib",
    "run_together",
    "settle_and_say",
    "settle_file_creation",
    "shrink",
    "sleep_until",
    "sqlite_catalog",
    "sqlite_props",
    "start_postgres",
    "summarize",
    "timed",
    "write_json",
]
