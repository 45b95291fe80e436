"""docs/configuration.md is the declarations of format/properties.py: a property declared without its line on the
page, a line left for a property no longer declared, or any other drift fails here. Regenerate the page with
``python -m lakestream_iceberg.tools.config_doc > docs/configuration.md``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from lakestream_iceberg.format.properties import PROPERTIES
from lakestream_iceberg.tools.config_doc import render, row

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "regenerate it: python -m lakestream_iceberg.tools.config_doc > docs/configuration.md"


def documented() -> dict[str, str]:
    """The property lines of the page, by property."""
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    return {m.group(1): line for line in lines if (m := re.match(r"\| `([a-z][\w.-]+)` \|", line))}


def test_every_declared_property_has_its_line_and_no_other_is_listed() -> None:
    lines = documented()
    declared = [p.key for p in PROPERTIES]
    missing = [key for key in declared if key not in lines]
    assert not missing, f"docs/configuration.md lacks {missing}; {REGENERATE}"
    extra = [key for key in lines if key not in declared]
    assert not extra, f"docs/configuration.md lists {extra}, which no declaration has; {REGENERATE}"
    stale = [p.key for p in PROPERTIES if lines[p.key] != row(p)]
    assert not stale, f"the lines of {stale} in docs/configuration.md differ from their declarations; {REGENERATE}"


def test_the_page_is_what_the_generator_writes() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), REGENERATE


def test_the_generator_runs_as_a_module() -> None:
    out = subprocess.run([sys.executable, "-m", "lakestream_iceberg.tools.config_doc"], capture_output=True, text=True,
                         check=True, timeout=120, cwd=PAGE.parent.parent).stdout
    assert out == render()
