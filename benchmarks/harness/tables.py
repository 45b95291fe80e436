"""The plain-text result table every benchmark prints, and stores (rows as dicts, and as printed) in its JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Table", "print_tables", "printed"]


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


def printed(tables: Sequence[Table], *, sep: str = "\n\n") -> str:
    """The tables as one text, as they are printed (a result's ``printed`` key)."""
    return sep.join(str(t) for t in tables)


def print_tables(tables: Sequence[Table], *, spaced: bool = True) -> None:
    """Print the tables; ``spaced``: a blank line before the first (after the progress lines) and after each."""
    if spaced:
        print()
    for table in tables:
        print(table)
        if spaced:
            print()
    print(end="", flush=True)
