"""The options every benchmark script has, and smoke-sized defaults.

    parser = bench_parser(__doc__)                       # --smoke and --out
    args = parser.parse_args(argv)
    fill_defaults(args, duration=(4.0, 0.5), rounds=(2, 1))   # left unset: (full run, --smoke)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["bench_parser", "fill_defaults", "int_list", "shrink"]


def bench_parser(doc: str | None, *, out: str | Path | None = None, whole_doc: bool = False,
                 smoke_help: str = "tiny settings: runs in seconds, for the test suite") -> argparse.ArgumentParser:
    """A parser with ``--smoke`` and ``--out`` (default ``out``; None: ``benchmarks/results/<name>.json``).
    ``whole_doc``: the script's docstring as the description (else its first line)."""
    if whole_doc:
        parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--out", default=None if out is None else str(out),
                        help="write the JSON here (default: benchmarks/results/)" if out is None else None)
    return parser


def int_list(text: str | None) -> list[int]:
    """``"1,4,8"`` as ``[1, 4, 8]`` (empty items skipped)."""
    return [int(part) for part in str(text or "").split(",") if part.strip()]


def fill_defaults(args: argparse.Namespace, **defaults: tuple[Any, Any]) -> None:
    """For each option left unset (None): its full-run value, or its smoke value under ``--smoke``."""
    for name, (full, smoke) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)


def shrink(parser: argparse.ArgumentParser, args: argparse.Namespace, small: dict[str, Any]) -> None:
    """Replace every option still at its default by its value in ``small`` (``--smoke``/``--quick`` sizes); an option
    given on the command line wins."""
    defaults = parser.parse_args([])
    for name, value in small.items():
        if getattr(args, name) == getattr(defaults, name):
            setattr(args, name, value)
