"""Print the dated benchmark runs in ``benchmarks/results/`` as one table per benchmark.

Each file is ``YYYY-MM-DD-<benchmark>.json``: the benchmark, the date, the machine, the command, what the metrics mean
and a list of runs (a label plus named numbers). A new run is added as a new dated file (or a run appended to the
day's file), tracked in git; the scripts' latest output, ``benchmarks/results/<benchmark>.json``, is not.

    python benchmarks/history.py                    # every benchmark
    python benchmarks/history.py --bench vs_kafka   # one benchmark
    python benchmarks/history.py --list             # the benchmarks that have history
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HISTORY = Path(__file__).resolve().parent / "results"
DATED = "[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]-*.json"  # what .gitignore tracks there


def load(folder: Path = HISTORY) -> dict[str, list[dict[str, Any]]]:
    """Every history file, grouped by benchmark, oldest first."""
    by_bench: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob(DATED)):
        body = json.loads(path.read_text())
        for key in ("benchmark", "date", "machine", "command", "runs"):
            if key not in body:
                raise ValueError(f"{path}: missing {key!r}")
        by_bench.setdefault(body["benchmark"], []).append(body)
    for files in by_bench.values():
        files.sort(key=lambda body: body["date"])
    return by_bench


def table(files: list[dict[str, Any]]) -> str:
    """One row per run: date, machine (short), label, then every metric any run of the benchmark has."""
    keys: list[str] = []
    for body in files:
        for run in body["runs"]:
            keys += [k for k in run if k != "label" and k not in keys]
    header = ["date", "machine", "run", *keys]
    rows = [[body["date"], body["machine"].split(",")[0], run["label"], *(_cell(run.get(k)) for k in keys)]
            for body in files for run in body["runs"]]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", help="only this benchmark (e.g. vs_kafka)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks that have history")
    args = parser.parse_args(argv)
    by_bench = load()
    if args.list:
        print("\n".join(sorted(by_bench)))
        return 0
    if args.bench and args.bench not in by_bench:
        print(f"no history for {args.bench!r}; benchmarks with history: {', '.join(sorted(by_bench))}", file=sys.stderr)
        return 2
    for bench in sorted(by_bench):
        if args.bench and bench != args.bench:
            continue
        files = by_bench[bench]
        print(f"== {bench}: {files[-1].get('metrics', '')}")
        print(table(files))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
