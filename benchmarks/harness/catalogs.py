"""The catalog most benchmarks run on: SQLite embedded, its warehouse a local folder, both in one run folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["sqlite_catalog", "sqlite_props"]


def sqlite_props(root: str | os.PathLike[str]) -> dict[str, str]:
    """Catalog properties (for ``load_catalog``) of ``root/catalog.db`` with the warehouse ``root/warehouse``
    (created)."""
    root = Path(root)
    (root / "warehouse").mkdir(parents=True, exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}", "warehouse": f"file://{root / 'warehouse'}"}


def sqlite_catalog(root: str | os.PathLike[str], *, name: str = "bench") -> Any:
    """A pyiceberg ``SqlCatalog`` on ``sqlite_props(root)``."""
    from pyiceberg.catalog.sql import SqlCatalog

    props = sqlite_props(root)
    del props["type"]
    return SqlCatalog(name, **props)
