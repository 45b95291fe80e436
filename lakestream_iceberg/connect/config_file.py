"""The ``.pyiceberg.yaml`` pyiceberg reads at import, checked before pyiceberg reads it.

pyiceberg parses its configuration file when ``pyiceberg.manifest`` is first imported, and a file it cannot parse (a
YAML syntax error, flow-style mappings that strictyaml refuses, bytes that are not UTF-8) raises strictyaml's
exception out of that import: a traceback of dozens of lines from inside the YAML parser, before any of this package's
code runs. :func:`check_config_file` reads the same file the same way first (pyiceberg's search order:
``$PYICEBERG_HOME``, the home directory, the working directory; the first file holding any setting wins) and raises a
:class:`~lakestream_iceberg.errors.ConfigError` naming the file, the line and what to do. The ``lakestream`` command
line prints that one line and exits with status 1, as for its other errors, instead of a traceback.
"""

from __future__ import annotations

import os
import sys

from lakestream_iceberg.errors import ConfigError

__all__ = ["check_config_file"]

_FILE = ".pyiceberg.yaml"
_CLI = (os.sep + "lakestream", os.path.join("lakestream_iceberg", "__main__.py"))  # argv[0] of the command line


def check_config_file() -> None:
    """Raise ConfigError when the ``.pyiceberg.yaml`` pyiceberg would read cannot be parsed (in the ``lakestream``
    command line: print it and exit 1)."""
    try:
        _check()
    except ConfigError as exc:
        if sys.argv and sys.argv[0].endswith(_CLI):
            print(f"lakestream: error: {exc}", file=sys.stderr)  # as the command line's other errors
            raise SystemExit(1) from None
        raise


def _check() -> None:
    import strictyaml  # pyiceberg's own parser (a dependency of pyiceberg)
    from strictyaml.ruamel.error import YAMLError  # strictyaml's refusals and the parser's errors alike

    for directory in (os.environ.get("PYICEBERG_HOME"), os.path.expanduser("~"), os.getcwd()):
        path = os.path.join(directory, _FILE) if directory else None
        if path is None or not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                data = strictyaml.load(f.read()).data
            if isinstance(data, dict):
                _check_environment(path, data)
                return  # pyiceberg takes the first file that holds settings
        except (UnicodeDecodeError, YAMLError) as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
            raise ConfigError(
                f"{path} cannot be read as pyiceberg's configuration ({where}{problem}): pyiceberg reads it whenever it "
                "is imported. Fix the "
                "file (block-style YAML, UTF-8: flow-style mappings such as {uri: ...} are refused), or move it away "
                "and configure the catalog with PYICEBERG_CATALOG__<NAME>__<KEY> environment variables"
            ) from None
        except OSError as exc:
            raise ConfigError(f"{path} cannot be read ({exc.strerror or exc}): pyiceberg reads it whenever it is "
                              "imported; fix its permissions or move it away") from None
        # pyiceberg's import lowercases the keys of what it parsed: an AttributeError ("'str' object has no attribute
        # 'items'") for an empty file, one of comments only, or a list or a text at the top
        text = data if isinstance(data, str) else None  # strictyaml gives a file of no mapping or list as its text
        lines = [] if text is None else [line.strip() for line in text.splitlines()]
        if text is not None and all(not line or line.startswith("#") or line in ("---", "...") for line in lines):
            shown = "no settings (it is empty or holds comments only)"
        else:
            shown = f"a {'text' if text is not None else type(data).__name__} where a mapping of settings belongs"
        raise ConfigError(
            f"{path} holds {shown}: pyiceberg reads it whenever it is imported and fails on it. Write its settings as "
            "block-style YAML (catalog:, then each catalog's name and settings indented below), or delete it"
        )
    _check_environment(None, {})


def _check_environment(path: str | None, data: dict) -> None:
    """Raise ConfigError where pyiceberg's import would fail merging the ``PYICEBERG_*`` environment variables into the
    file's settings: a variable that sets a key inside one the file (or another variable) holds as a text or a list
    (``catalog: prod: oops`` with ``PYICEBERG_CATALOG__PROD__URI`` set) made it raise a bare ``ValueError``."""
    config = _lowercased(data)  # as pyiceberg merges: the file's keys lowercased, then each variable in turn
    for variable, value in os.environ.items():
        lowered = variable.lower()
        if not lowered.startswith("pyiceberg_"):
            continue
        parts = [part.replace("__", ".").replace("_", "-") for part in lowered[len("pyiceberg_"):].split("__", maxsplit=2)]
        node = config
        for depth, part in enumerate(parts):
            if depth == len(parts) - 1:
                node[part] = value
                break
            inner = node.setdefault(part, {})
            if not isinstance(inner, dict):
                key = ": ".join(parts[:depth + 1])
                where = f"{path} holds" if path is not None else "the environment sets"
                raise ConfigError(
                    f"{where} {key}: as a {'text' if isinstance(inner, str) else type(inner).__name__}, and the "
                    f"environment variable {variable} sets a setting inside it: pyiceberg merges PYICEBERG_* variables "
                    "into the file's settings whenever it is imported and fails on it. Write "
                    f"{key}: as a mapping of settings (block-style YAML, each setting indented below it), or unset "
                    f"{variable}"
                )
            node = inner


def _lowercased(data: dict) -> dict:
    return {str(k).lower(): _lowercased(v) if isinstance(v, dict) else v for k, v in data.items()}
