"""A griffe extension for the API reference: ``LakestreamDataset`` is built on first access (it subclasses torch's
``IterableDataset``, and torch is optional), so its docstring lives in ``read/dataset.py``'s ``_DOC`` string; the
type-checking stub griffe sees gets that text here."""

from __future__ import annotations

import ast
from typing import Any

import griffe


class LazyDatasetDoc(griffe.Extension):
    """Give ``lakestream_iceberg.read.dataset.LakestreamDataset`` the docstring in ``_DOC``."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "lakestream_iceberg":
            return
        module = pkg["read.dataset"]
        text = ast.literal_eval(str(module["_DOC"].value))
        target = module["LakestreamDataset"]
        target.docstring = griffe.Docstring(text, parent=target, parser=griffe.Parser.google)
