"""``lakestream``: the command line for streams (status, SQL over their history, checkpoints, GC, live tail, the demo).

Catalog: ``--catalog NAME`` loads a pyiceberg catalog (``.pyiceberg.yaml``, ``PYICEBERG_CATALOG__NAME__*``); without it the
embedded default under ``--home DIR`` / ``$LAKESTREAM_HOME`` / ``./.lakestream`` (see :mod:`lakestream_iceberg.tools.config`).
Every command prints tables for people and JSON with ``--json`` (before or after the command). Mistakes (unknown
stream, bad SQL, a refused operation) print one ``lakestream: error: ...`` line to stderr and exit 1.

Example:
    $ lakestream demo
    $ lakestream status demo.run_20261129_210727_ab12
    $ lakestream sql demo.run_20261129_210727_ab12 "SELECT producer, count(*) FROM batches GROUP BY 1" --json
    $ lakestream tail demo.run_20261129_210727_ab12 --max-steps 10
    $ lakestream lag demo.run_20261129_210727_ab12 --group run-42 --json
    $ lakestream lag demo.run_20261129_210727_ab12 --group run-41 --delete   # its recorded positions
    $ lakestream host --strict          # a preflight check of the producer host's memcpy (glibc bug 30994)
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta

from lakestream_iceberg.errors import LakestreamError
from lakestream_iceberg.format.checks import MAX_STEP
from lakestream_iceberg.tools.commands import (
    EXIT_ERROR,
    UserError,
    cmd_checkpoint,
    cmd_checkpoints,
    cmd_demo,
    cmd_gc,
    cmd_host,
    cmd_lag,
    cmd_repair,
    cmd_sql,
    cmd_status,
    cmd_tail,
    storage_error,
)
from lakestream_iceberg.tools.config import ENV_HOME, closing_catalogs
from lakestream_iceberg.tools.output import Output

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # Accepted before and after the command; SUPPRESS keeps a later position from resetting an earlier one.
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable JSON output")
    common.add_argument("--catalog", metavar="NAME", default=argparse.SUPPRESS,
                        help="pyiceberg catalog name (.pyiceberg.yaml / PYICEBERG_CATALOG__NAME__*); default: embedded")
    common.add_argument("--home", metavar="DIR", default=argparse.SUPPRESS,
                        help=f"embedded catalog directory (default ${ENV_HOME} or ./.lakestream)")

    parser = argparse.ArgumentParser(
        prog="lakestream", parents=[common],
        description="Streams of transactional global batches on Apache Iceberg: inspect, query, checkpoint, collect.",
        epilog="Example: lakestream sql demo.run_x \"SELECT producer, count(*) FROM batches GROUP BY 1\" --json",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Callable[[argparse.Namespace, Output], int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    def with_stream(p: argparse.ArgumentParser, *, branch: bool = True, default: str | None = "main",
                    branch_help: str = "branch (default main)") -> argparse.ArgumentParser:
        p.add_argument("stream", metavar="STREAM", help="NAMESPACE.NAME")
        if branch:
            p.add_argument("--branch", default=default, help=branch_help)
        return p

    p = add("demo", cmd_demo, "run producer and trainer-rank processes on a fresh stream and check exactly-once delivery")
    p.add_argument("--producers", type=int, default=3, help="producer processes (default 3)")
    p.add_argument("--ranks", type=int, default=2, help="trainer-rank processes = world size (default 2)")
    p.add_argument("--steps-per-producer", type=int, default=20, help="batches each producer publishes (default 20)")

    with_stream(add("status", cmd_status, "head step, producers, consumer groups, steps past the newest checkpoint, "
                    "checkpoints, metadata and storage size"))

    p = with_stream(add("sql", cmd_sql, "run DuckDB SQL over the stream's history views"))
    p.add_argument("query", metavar="SQL",
                   help="views: batches, files, producers, checkpoints, snapshots, consumers, samples")
    p.add_argument("--steps", metavar="FIRST:LAST", help="step range loaded into the samples view (default: head step)")

    p = with_stream(add("checkpoint", cmd_checkpoint, "pin a step as a named checkpoint"))
    p.add_argument("name", metavar="NAME")
    p.add_argument("--step", type=int, help="step to pin (default: the head step)")

    with_stream(add("checkpoints", cmd_checkpoints, "list checkpoints"), default=None,
                branch_help="only this branch's (default: every branch's)")

    # GC is table-wide: every branch's steps below its oldest retained checkpoint (a --branch would be ignored)
    p = with_stream(add("gc", cmd_gc, "collect, on every branch, the steps and files no retained checkpoint needs"),
                    branch=False)
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted, delete nothing")
    p.add_argument("--keep-last", type=_at_least(1), metavar="K",
                   help="retain the newest K checkpoints of each branch and release the others (steps below the "
                        "oldest retained one are collected)")
    p.add_argument("--keep-within", type=_duration, metavar="AGE",
                   help="retain the checkpoints younger than AGE (e.g. 7d, 12h, 30m, 90s) and release the older ones; "
                        "with --keep-last, a checkpoint either keeps is retained")

    p = with_stream(add("repair", cmd_repair, "roll a branch back to its last lakestream snapshot after another engine "
                                              "changed its data"))
    p.add_argument("--dry-run", action="store_true", help="report what would be rolled back, change nothing")

    p = with_stream(add("tail", cmd_tail, "follow new steps live"))
    p.add_argument("--from-step", type=_at_least(1, maximum=MAX_STEP), metavar="S",
                   help="start at step S (default: the next new step)")
    p.add_argument("--max-steps", type=_at_least(1), metavar="N", help="stop after N steps")
    p.add_argument("--timeout", type=_seconds(0.0), metavar="SECONDS",
                   help="stop after this long (exit 1 if the catalog could not be polled by then)")
    p.add_argument("--poll", type=_seconds(0.001), default=0.05, metavar="SECONDS",
                   help="first poll interval (default 0.05)")

    p = add("lag", cmd_lag, "each trainer rank's recorded position, lag and data wait, and the ranks that stopped reporting")
    p.add_argument("stream", metavar="STREAM", help="NAMESPACE.NAME")
    p.add_argument("--group", metavar="RUN", help="consumer group (the dataset's group=); default: every group")
    p.add_argument("--stale-after", type=_seconds(0.001, unit="report intervals"), default=3.0, metavar="N",
                   help="a rank silent for N report intervals is stale (default 3)")
    p.add_argument("--delete", action="store_true",
                   help="delete the group's recorded positions (refused while a rank of it is active)")
    p.add_argument("--force", action="store_true", help="with --delete: delete even while a rank is active")

    p = add("host", cmd_host, "check whether this host's memcpy slows Parquet writing (glibc bug 30994 on AMD) and what to set")
    p.add_argument("--strict", action="store_true", help="exit 1 when the host has the slow copy (for preflight checks)")
    return parser


def _at_least(minimum: int, *, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        if maximum is not None and value > maximum:  # a step past an Iceberg long is never published: no waiting for it
            raise argparse.ArgumentTypeError(f"{value} is above {maximum}, the largest step a stream can hold")
        return value
    return parse


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _duration(text: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``90s``, ``2w`` (a positive whole number and one unit)."""
    found = re.fullmatch(r"([0-9]{1,30})([smhdw])", text.strip())
    if found is None or int(found[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age: a positive whole number and a unit, s, m, h, d or w "
                                         "(7d, 12h, 30m)")
    try:
        return timedelta(seconds=int(found[1]) * _UNITS[found[2]])
    except OverflowError:  # past what a timedelta holds (argparse shows only ArgumentTypeError, TypeError, ValueError)
        raise argparse.ArgumentTypeError(f"{text!r} is too long an age: at most {timedelta.max.days} days") from None


def _seconds(minimum: float, *, unit: str = "seconds") -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {unit}") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of {unit} >= {minimum:g}")
        return value
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lakestream`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    for name, default in (("json", False), ("catalog", None), ("home", None)):
        if not hasattr(args, name):
            setattr(args, name, default)
    out = Output(as_json=args.json)
    try:
        with closing_catalogs():
            return int(args.func(args, out))
    except (UserError, LakestreamError) as exc:
        sys.stdout.flush()
        print(f"lakestream: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return exc.code if isinstance(exc, UserError) else EXIT_ERROR
    except KeyboardInterrupt:
        print("lakestream: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `lakestream tail ... | head`
        _quiet_stdout()
        return 0
    except OSError as exc:  # the storage's: a file missing, an endpoint unreachable, credentials refused
        sys.stdout.flush()
        print(f"lakestream: error: {' '.join(storage_error(exc, args.catalog).split())}", file=sys.stderr)
        return EXIT_ERROR


def _quiet_stdout() -> None:
    """Point stdout at /dev/null once its reader went away, so the interpreter's last flush of what is still buffered
    does not print an ignored BrokenPipeError."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (a test's capture): nothing is flushed to a closed pipe
        pass


if __name__ == "__main__":
    sys.exit(main())
