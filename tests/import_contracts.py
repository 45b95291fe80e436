"""A custom import-linter contract: nothing outside a module imports a name of it that starts with ``_``.

Registered in pyproject.toml (``contract_types``) and checked by ``lint-imports`` in ``make test``. A private name is
that module's business: another module that needs it asks for a public name (listed in the module's ``__all__``).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class PrivateNamesContract(Contract):
    """``root``: the package whose modules are checked (every import of a ``_name`` from it by another module)."""

    root = fields.StringField()

    def check(self, graph, verbose: bool) -> ContractCheck:  # noqa: ANN001 - import-linter's ImportGraph
        found: list[str] = []
        for module in sorted(graph.modules):
            if module != self.root and not module.startswith(f"{self.root}."):
                continue
            spec = importlib.util.find_spec(module)
            if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
                continue
            tree = ast.parse(Path(spec.origin).read_text(), filename=spec.origin)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                    continue
                if node.module == module or not (node.module == self.root or node.module.startswith(f"{self.root}.")):
                    continue
                found += [f"{module}:{node.lineno} imports {alias.name} from {node.module}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for line in check.metadata["found"]:
            output.print_error(line, bold=False)
            output.new_line()
