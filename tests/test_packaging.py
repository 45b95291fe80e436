"""The declared dependencies are the ones the code imports: a core install (``pip install lakestream-iceberg``, no
extra) imports the package, and every module that needs more fails only for want of an extra it names.

The test venv has every extra and the dev tools installed, so a module that imports an undeclared package works here
and fails on a user's core install (the core imported numpy without declaring it). Each check runs in a subprocess
whose imports are limited to the standard library and the distributions a set of requirements pulls in (from the
pyproject.toml's requirements and, transitively, the installed metadata of theirs).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("packaging")
pytest.importorskip("tomllib")  # Python 3.11+ (make test's)

_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

_CHECK = textwrap.dedent(r'''
    import importlib, importlib.abc, importlib.metadata as md, json, pkgutil, sys
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def closure(project, extras):
        """The distributions (canonical names) lakestream-iceberg with ``extras`` pulls in: its requirements as
        pyproject.toml declares them (not an editable install's metadata, which lags behind an edit), theirs as
        installed."""
        lines = list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]
        seen, todo = set(), [(Requirement(line).name, set(Requirement(line).extras)) for line in lines]
        while todo:
            name, wanted = todo.pop()
            key = (canonicalize_name(name), frozenset(wanted))
            if key in seen:
                continue
            seen.add(key)
            try:
                requires = md.distribution(name).requires or []
            except md.PackageNotFoundError:
                continue  # an optional dependency of a dependency that is not installed: nothing to follow
            for line in requires:
                req = Requirement(line)
                if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (wanted or {""})):
                    todo.append((req.name, set(req.extras)))
        return {name for name, _ in seen}

    import tomllib
    with open(sys.argv[2], "rb") as f:
        project = tomllib.load(f)["project"]
    extras = json.loads(sys.argv[1])
    allowed = closure(project, extras)
    owners = md.packages_distributions()

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            top = fullname.partition(".")[0]
            if top in sys.stdlib_module_names or top == "lakestream_iceberg":
                return None
            dists = {canonicalize_name(d) for d in owners.get(top, ())}
            if dists and not dists & allowed:
                raise ModuleNotFoundError(f"No module named {top!r} (blocked: distribution {sorted(dists)} is not "
                                          f"a dependency of lakestream-iceberg{extras or ''})", name=top)
            return None

    sys.meta_path.insert(0, Block())
''')

_IMPORT_ALL = textwrap.dedent(r'''
    import lakestream_iceberg
    failed = {}
    for info in pkgutil.walk_packages(lakestream_iceberg.__path__, "lakestream_iceberg."):
        if info.name.endswith(".__main__"):  # runs the CLI
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as exc:  # the missing module's name (an ImportError of the package's own, which says what to
            cause = exc                 # install, names it in its cause)
            while getattr(cause, "name", None) is None and (cause.__cause__ or cause.__context__) is not None:
                cause = cause.__cause__ or cause.__context__
            failed[info.name] = getattr(cause, "name", None) or str(exc)
    print(json.dumps({"failed": failed, "allowed": sorted(allowed)}))
''')


# What a user's program does with the core and the torch and duckdb extras: every import these calls make at run time
# (pyarrow imports pandas inside some of its methods, for one) must come from a declared dependency.
_USE = textwrap.dedent(r'''
    import tempfile, warnings
    from datetime import timedelta
    import numpy as np, pyarrow as pa
    from lakestream_iceberg import LakestreamDataset, Stream, TensorCollate, load_catalog
    home = tempfile.mkdtemp()
    catalog = load_catalog("use", type="sql", uri=f"sqlite:///{home}/catalog.db", warehouse=f"file://{home}")
    kinds = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
             pa.float16(), pa.float32(), pa.float64()]
    fields = [("b", pa.bool_()), ("s", pa.string()), ("bin", pa.binary()), ("ts", pa.timestamp("us"))]
    for i, kind in enumerate(kinds):
        fields += [(f"n{i}", kind), (f"l{i}", pa.list_(kind)), (f"f{i}", pa.list_(kind, 2))]
    schema = pa.schema(fields)

    def shard(rows):
        cols = {"b": [True] * rows, "s": ["x"] * rows, "bin": [b"ab"] * rows,
                "ts": pa.array([0] * rows, pa.timestamp("us"))}
        for i, kind in enumerate(kinds):
            dtype = pa.array([], kind).to_numpy(zero_copy_only=False).dtype
            offsets = pa.array(np.arange(rows + 1) * 2, pa.int32())
            cols[f"n{i}"] = pa.array(np.ones(rows, dtype))
            cols[f"l{i}"] = pa.ListArray.from_arrays(offsets, pa.array(np.ones(2 * rows, dtype)))
            cols[f"f{i}"] = pa.FixedSizeListArray.from_arrays(pa.array(np.ones(2 * rows, dtype)), 2)
        return pa.table(cols, schema=schema)

    stream = Stream.create(catalog, "use.stream", schema=schema, world_size=2)
    producer = stream.producer("p")
    for seq in range(4):
        producer.commit([shard(3), shard(2)])
    assert stream.read(1, rank=1).num_rows == 2
    items = list(LakestreamDataset(stream, rank=0, world_size=2))
    assert [item["step"] for item in items] == [1, 2, 3, 4] and tuple(items[0]["n9"].shape) == (3,)
    packed = LakestreamDataset(stream, rank=1, world_size=2, collate=TensorCollate(lists="packed", binary="packed"))
    assert len(list(packed)) == 4
    stream.checkpoint("c3", step=3)
    assert stream.history().sql("SELECT count(*) FROM batches").fetchall() == [(4,)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = stream.collect_garbage(dry_run=False, grace=timedelta(0), allow_short_grace=True)
    assert report.collected_below == {"main": 3}, report
    assert stream.table.scan().to_arrow().num_rows == 10
    print(json.dumps({"failed": {}, "allowed": sorted(allowed)}))
''')


def _run(extras: list[str], body: str | None = None) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", _CHECK + (_IMPORT_ALL if body is None else body), json.dumps(extras),
                           str(_PYPROJECT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _extras_of(distribution_names: set[str]) -> set[str]:
    """The top-level modules the distributions provide (what a module failing for want of them names)."""
    import importlib.metadata as md

    from packaging.utils import canonicalize_name

    return {top for top, dists in md.packages_distributions().items()
            if any(canonicalize_name(d) in distribution_names for d in dists)}


def test_a_core_install_imports_every_module_that_needs_no_extra() -> None:
    core = _run([])
    failed = core["failed"]
    assert isinstance(failed, dict)
    optional = {"torch", "duckdb", "ray", "prometheus_client", "psycopg2", "s3fs", "boto3", "botocore", "matplotlib",
                "nbclient", "nbformat", "ipykernel"}
    # what core modules may need: only packages that one of the package's own extras declares (the dev tools do not
    # count: a user never installs them)
    with_extras = set(_run(["torch", "duckdb", "s3", "postgres", "notebook", "metrics", "ray"])["allowed"])  # type: ignore[arg-type]
    provided = _extras_of(with_extras)
    undeclared = {module: missing for module, missing in failed.items() if missing not in provided}
    assert not undeclared, f"modules that import a package no extra declares: {undeclared}"
    # the facade, the stream API and the CLI need nothing beyond the core
    for module in ("lakestream_iceberg", "lakestream_iceberg.stream", "lakestream_iceberg.tools.cli",
                   "lakestream_iceberg.write.writer", "lakestream_iceberg.read.reader"):
        assert module not in failed, f"{module} needs {failed.get(module)} on a core install"
    assert set(failed.values()) <= optional, failed


def test_a_program_using_the_core_with_the_torch_and_duckdb_extras_imports_only_what_they_declare() -> None:
    """pyarrow before 26 imports pandas inside ``DataType.to_pandas_dtype()``: the collate, which asked it for every
    number column's numpy dtype, failed where pandas (no dependency) was not installed. The import check above cannot
    see an import made at run time: this runs a producer, a reader, the torch dataset, a checkpoint, the history and
    GC with the imports of every distribution they do not declare refused."""
    pytest.importorskip("torch")
    pytest.importorskip("duckdb")
    _run(["torch", "duckdb"], body=_USE)
