"""How the ``lakestream`` command line prints: rich tables for people, JSON (``--json``) for programs."""

from __future__ import annotations

import base64
import dataclasses
import errno
import json
import math
import sys
from collections.abc import Sequence
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

__all__ = ["MAX_HUMAN_ROWS", "Output", "human", "megabytes", "plain", "to_jsonable"]

MAX_HUMAN_ROWS = 50


def to_jsonable(value: Any) -> Any:
    """JSON-ready values: datetimes as ISO 8601, bytes as base64, dataclasses as objects, NaN as null."""
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "value") and type(value).__module__.startswith(("enum", "pyiceberg")):
        return to_jsonable(value.value)
    if hasattr(value, "__dict__"):
        return {k: to_jsonable(v) for k, v in vars(value).items() if not k.startswith("_")}
    return str(value)


class Output:
    """Writes either JSON (one document, or one object per line for ``tail``) or rich tables."""

    def __init__(self, *, as_json: bool) -> None:
        self.json = as_json
        self._console: Any = None

    @property
    def console(self) -> Any:
        if self._console is None:
            self._console = _console()
        return self._console

    def emit_json(self, value: Any, *, compact: bool = False) -> None:
        text = json.dumps(to_jsonable(value), separators=(",", ":") if compact else None, indent=None if compact else 2)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def table(self, rows: Sequence[dict[str, Any]], *, title: str | None = None, columns: Sequence[str] | None = None) -> None:
        from rich.table import Table

        columns = list(columns if columns is not None else (rows[0].keys() if rows else []))
        if not rows and title:
            self.console.print(f"{title}: none")
            return
        table = Table(title=title, title_justify="left", show_lines=False)
        for name in columns:
            table.add_column(str(name), overflow="fold")
        for row in rows[:MAX_HUMAN_ROWS]:
            table.add_row(*(human(row.get(c)) for c in columns))
        self.console.print(table)
        if len(rows) > MAX_HUMAN_ROWS:
            self.console.print(f"... {len(rows) - MAX_HUMAN_ROWS} more rows (use --json for all of them)")

    def fields(self, pairs: Sequence[tuple[str, Any]], *, title: str | None = None) -> None:
        from rich.table import Table

        if title:
            self.console.print(title, style="bold underline")
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")  # a path or a URI without spaces: folded, never cut with an ellipsis
        for key, value in pairs:
            table.add_row(key, human(value))
        self.console.print(table)


def _console() -> Any:
    from rich.console import Console

    class PipeConsole(Console):
        """rich exits 1 without a word when the reader of stdout goes away (``lakestream tail ... | head``); this raises
        BrokenPipeError for the command line's handler, which exits 0 as for JSON output."""

        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, "the reader of standard output went away")

    return PipeConsole(highlight=False, soft_wrap=False)


def human(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="milliseconds")
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value):,} bytes>"
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, list) and len(value) > 16:
        return f"[{', '.join(map(str, value[:16]))}, ... {len(value)} items]"
    return str(value)


def plain(value: Any) -> dict[str, Any]:
    """A dataclass (Checkpoint, GCReport) as a dict of its fields, values kept as they are (for human output)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return {k: v for k, v in vars(value).items() if not k.startswith("_")}


def megabytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f} MB ({n:,} bytes)"
