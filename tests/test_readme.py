"""The README's runnable example runs as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_model_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    block = re.search(r"```python\n(import os\nimport pyarrow as pa.*?)```", README.read_text(), re.S)
    assert block, "the model example disappeared from README.md"
    script = tmp_path / "example.py"
    script.write_text(block.group(1))
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(str(script))
    assert namespace["result"].step == 1 and namespace["rank1"].num_rows == 2
    assert namespace["everything"].num_rows == 3
