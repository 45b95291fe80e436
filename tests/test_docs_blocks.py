"""Every ```python block of README.md and docs/ runs, and the docs site builds strictly.

A page's blocks run in order, in one namespace, in a fresh temporary directory (they create their own embedded SQLite
catalog there), like a reader pasting them one after another. A block that cannot run alone (several hosts, a Ray
cluster) is preceded by ``<!-- skip-block: REASON -->`` and a visible note (a ``>`` quote) on the page; a marker
without a reason, without a note, or without a block after it fails. A block preceded by
``<!-- services-block: KIND -->`` (a backend of tests/backends.py, e.g. ``postgres-seaweedfs``) runs alone against those
real servers, with the catalog configured as ``prod`` through ``PYICEBERG_CATALOG__PROD__*`` variables.

A ```bash block written as a shell transcript (``$ command`` lines, each followed by the output it shows) runs in its
place among the page's python blocks, as the reader would type it: ``export`` and ``NAME=value`` lines set variables,
every other command is the ``lakestream`` command line, which must succeed (or fail, where the transcript shows its
error) and print first the line the transcript shows first. The stream name ``lakestream demo`` printed stands for
the one the transcript shows, and the page's temporary directory for ``/home/me``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from catalog.services import catalog_env
from tests.backends import BACKENDS, make_backend, moto_service, postgres_service, seaweedfs_service  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(skip|services)-block:(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    source: str
    skip: str | None  # the skip marker's reason, or None
    services: str | None = None  # the services marker's backend kind, or None


def parse(page: Path) -> list[Block]:
    """The page's python blocks, each with the skip reason of the marker right before it (only blank or quoted lines
    may stand between the two)."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i])
        if marker:
            assert pending is None, f"{page.name}:{i + 1}: a skip-block marker before another marker"
            pending = (i + 1, marker.group(1), marker.group(2).strip())
            i += 1
            continue
        fence = FENCE.match(lines[i])
        if fence:
            start = i
            i += 1
            while i < len(lines) and lines[i].rstrip() != "```":
                i += 1
            if fence.group(1) == "python":
                kind, reason = (pending[1], pending[2]) if pending else (None, None)
                blocks.append(Block(page, start + 1, "\n".join(lines[start + 1:i]) + "\n",
                                    reason if kind == "skip" else None, reason if kind == "services" else None))
            else:
                assert pending is None, f"{page.name}:{pending[0]}: the skip-block marker is followed by a {fence.group(1) or 'plain'} block"
            pending = None
        elif pending is not None and lines[i].strip() and not lines[i].startswith(">"):
            raise AssertionError(f"{page.name}:{pending[0]}: a skip-block marker must be followed by its note (> ...) "
                                 f"and a python block, found {lines[i]!r}")
        i += 1
    assert pending is None, f"{page.name}:{pending[0]}: a skip-block marker with no python block after it"
    return blocks


@dataclass(frozen=True)
class Transcript:
    page: Path
    line: int  # 1-based line of the opening fence
    commands: tuple[tuple[str, tuple[str, ...]], ...]  # (command, the output lines shown after it)


def transcripts(page: Path) -> list[Transcript]:
    """The page's ```bash blocks that are shell transcripts (their first line is a ``$ `` command)."""
    lines = page.read_text().splitlines()
    found: list[Transcript] = []
    i = 0
    while i < len(lines):
        if lines[i].rstrip() == "```bash" and i + 1 < len(lines) and lines[i + 1].startswith("$ "):
            start, commands = i, []
            i += 1
            while lines[i].rstrip() != "```":
                if lines[i].startswith("$ "):
                    commands.append((lines[i][2:], []))
                elif lines[i].strip():
                    commands[-1][1].append(lines[i])
                i += 1
            found.append(Transcript(page, start + 1, tuple((c, tuple(out)) for c, out in commands)))
        i += 1
    return found


def run_transcript(transcript: Transcript, cwd: Path, env: dict[str, str], names: dict[str, str]) -> None:
    """Run a transcript's commands in ``cwd`` (see the module docstring); ``env`` and ``names`` carry over."""
    for command, shown in transcript.commands:
        where = f"{rel(transcript.page)}:{transcript.line}: {command!r}"
        for doc_name, name in names.items():
            command = command.replace(doc_name, name)
            shown = tuple(line.replace(doc_name, name) for line in shown)
        words = shlex.split(command, comments=True)
        assignments = words[1:] if words[0] == "export" else words
        if all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word) for word in assignments):
            for word in assignments:
                key, value = word.split("=", 1)
                env[key] = os.path.expandvars(value.replace("$PWD", str(cwd)).replace("$" + key, env.get(key, "")))
            continue
        words = [re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), word) for word in words]
        assert words[0] == "lakestream", f"{where}: a transcript runs only the lakestream command"
        done = subprocess.run([sys.executable, "-m", "lakestream_iceberg", *words[1:]], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=300)
        failed = bool(shown) and shown[0].startswith("lakestream: error:")
        assert (done.returncode != 0) == failed, f"{where} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        printed = (done.stderr if failed else done.stdout).replace(str(cwd), "/home/me").splitlines()
        if shown:
            first = shown[0]
            demo = [re.match(r"lakestream demo: stream (\S+) ", line) for line in (first, printed[0] if printed else "")]
            if demo[0] and demo[1]:  # the stream the demo made stands for the one the page shows from here on
                names[demo[0].group(1)] = demo[1].group(1)
                first = first.replace(demo[0].group(1), demo[1].group(1))
            assert printed and printed[0].rstrip() == first.rstrip(), (
                f"{where} printed first {printed[:1]}, the page shows {first!r}")


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


ALL = {rel(page): parse(page) for page in PAGES}
RUNNABLE = [name for name, blocks in ALL.items() if any(b.skip is None and b.services is None for b in blocks)]
TRANSCRIPTS = {rel(page): transcripts(page) for page in PAGES if transcripts(page)}
SERVICE_BLOCKS = [b for blocks in ALL.values() for b in blocks if b.services is not None]


def test_markers_have_reasons_and_visible_notes() -> None:
    skipped = [b for blocks in ALL.values() for b in blocks if b.skip is not None]
    for block in skipped:
        where = f"{rel(block.page)}:{block.line}"
        assert len(block.skip) >= 10, f"{where}: a skip-block marker needs a reason, got {block.skip!r}"
        before = block.page.read_text().splitlines()[: block.line - 1]
        marker_at = max(i for i, line in enumerate(before) if MARKER.match(line))
        assert any(line.startswith(">") for line in before[marker_at:]), f"{where}: no visible note (> ...) for the reader"
    ran = sum(1 for blocks in ALL.values() for b in blocks if b.skip is None and b.services is None)
    for block in SERVICE_BLOCKS:
        assert block.services in BACKENDS, f"{rel(block.page)}:{block.line}: no backend {block.services!r} ({BACKENDS})"
    print(f"\ndocs python blocks: {ran} run alone, {len(SERVICE_BLOCKS)} against services, {len(skipped)} skipped: "
          + "; ".join(f"{rel(b.page)}:{b.line} ({b.skip})" for b in skipped))
    assert ran >= 20, f"only {ran} runnable python blocks found in README.md and docs/"


def test_transcripts_are_on_pages_that_run() -> None:
    assert set(TRANSCRIPTS) <= set(RUNNABLE), f"transcripts on pages whose blocks do not run: {set(TRANSCRIPTS) - set(RUNNABLE)}"
    assert {"docs/guide/history.md", "docs/guide/monitoring.md"} <= set(TRANSCRIPTS), sorted(TRANSCRIPTS)


def _for_want_of_torch(exc: BaseException | None) -> bool:
    """Whether a block failed because torch is not installed (LakestreamDataset's MissingExtraError from it)."""
    if importlib.util.find_spec("torch") is not None:
        return False
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "torch":
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    names: dict[str, str] = {}
    items = sorted([*ALL[page], *TRANSCRIPTS.get(page, [])], key=lambda item: item.line)
    try:
        for block in items:
            if isinstance(block, Transcript):
                run_transcript(block, tmp_path, env, names)
                continue
            if block.skip is not None or block.services is not None:
                continue
            code = compile(block.source, f"{page}:{block.line}", "exec")
            try:
                exec(code, namespace)
            except Exception as exc:
                if _for_want_of_torch(exc):  # the core's pages run without the extra (Python 3.10 has no torch)
                    pytest.skip(f"the python block at {page}:{block.line} needs torch (the torch extra)")
                raise AssertionError(f"the python block at {page}:{block.line} failed: {exc!r}") from exc
    finally:
        for value in namespace.values():
            if type(value).__name__ == "Stream" and hasattr(value, "close"):
                value.close()


@pytest.mark.services
@pytest.mark.parametrize("block", SERVICE_BLOCKS, ids=lambda b: f"{rel(b.page)}:{b.line}")
def test_service_blocks_run(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A fresh process per block, as on another host: pyiceberg reads its environment once, when imported."""
    backend = make_backend(block.services, request, tmp_path)
    try:
        env = {**backend.worker_env(), **catalog_env("prod", backend.properties), "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", block.source], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
    finally:
        backend.close()
    assert done.returncode == 0, (f"the python block at {rel(block.page)}:{block.line} failed on {block.services}:\n"
                                  f"{done.stdout}\n{done.stderr}")


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 260, f"README.md has {lines} lines; the user guide belongs in docs/"


def test_architecture_describes_every_module() -> None:
    # README points contributors to docs/ARCHITECTURE.md for "every module": each module of each wing has its line
    # (``* `name.py`: ...``) and its place in the tree at the top
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    tree = text.split("```")[1]
    described = set(re.findall(r"^\* `([a-z_0-9]+\.py)`", text, re.M))
    package = ROOT / "lakestream_iceberg"
    modules = {p.name for wing in package.iterdir() if wing.is_dir() and wing.name != "integrations"
               for p in wing.glob("*.py") if p.name != "__init__.py"}
    assert modules - described == set(), f"ARCHITECTURE.md describes no {sorted(modules - described)}"
    listed = set(re.findall(r"([a-z_0-9]+\.py)", tree))
    everywhere = modules | {p.name for p in (package / "integrations" / "ray").glob("*.py") if p.name != "__init__.py"}
    assert everywhere - listed == set(), f"ARCHITECTURE.md's tree lacks {sorted(everywhere - listed)}"


def test_architecture_public_api_table_names_every_export() -> None:
    import lakestream_iceberg

    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("## Public API", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    named = set(re.findall(r"`([A-Za-z_]+)`", table))
    assert set(lakestream_iceberg.__all__) - named == set(), sorted(set(lakestream_iceberg.__all__) - named)


def test_docs_site_builds_strictly(tmp_path: Path) -> None:
    import importlib.util

    assert importlib.util.find_spec("mkdocstrings") is not None, "the docs extra is missing: pip install -e '.[docs]'"
    command = [sys.executable, "-m", "mkdocs"]
    started = time.monotonic()
    done = subprocess.run([*command, "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "site" / "api" / "index.html").exists()
    print(f"\nmkdocs build --strict: {time.monotonic() - started:.1f} s")
    shutil.rmtree(tmp_path / "site", ignore_errors=True)


def _anchors(page: Path) -> set[str]:
    """GitHub's (and mkdocs') anchors of a page's headings."""
    found = set()
    for line in page.read_text().splitlines():
        heading = re.match(r"^#+\s+(.*)", line)
        if heading:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("source", ["README.md", "benchmarks/README.md"])
def test_links_outside_the_site_resolve(source: str) -> None:
    """mkdocs checks the links of docs/; these two pages live outside it."""
    page = ROOT / source
    for link in re.finditer(r"\]\(([^)#\s:]+)(#[^)]+)?\)", page.read_text()):
        target = (page.parent / link.group(1)).resolve()
        assert target.exists(), f"{source}: the link to {link.group(1)} points at nothing"
        if link.group(2):
            assert link.group(2)[1:] in _anchors(target), f"{source}: no heading {link.group(2)} in {link.group(1)}"


def _documented(doc: str, section: str) -> set[str]:
    """The names a Google-style docstring section (``Args:``, ``Attributes:``) describes (``a, b: ...`` counts both)."""
    found = re.search(rf"^{section}:\n(.*?)(?=^\S|\Z)", doc + "\n", re.S | re.M)
    body = [line for line in (found.group(1).splitlines() if found else []) if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in body), default=0)
    return {name.strip().lstrip("*") for line in body if len(line) - len(line.lstrip()) == indent
            for name in line.split(":", 1)[0].split(",")}


def test_every_public_name_documents_its_parameters_and_fields() -> None:
    """The API reference (docs/api.md) shows each public name's signature from the code and its parameters (or a
    result's fields) from the docstring: every one is described there, and nothing the code does not take."""
    import dataclasses
    import inspect

    import lakestream_iceberg
    from lakestream_iceberg.read.dataset import _DOC, _DatasetCore

    problems = []

    def check(name: str, takes: set[str], doc: str, section: str) -> None:
        described = _documented(inspect.cleandoc(doc), section)
        if takes != described:
            problems.append(f"{name}: not described {sorted(takes - described)}, not taken {sorted(described - takes)}")

    def params(function: object) -> set[str]:
        return {p for p in inspect.signature(function).parameters if p not in ("self", "cls")}  # type: ignore[arg-type]

    for name in lakestream_iceberg.__all__:
        obj = getattr(lakestream_iceberg, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            continue
        if dataclasses.is_dataclass(obj):
            check(name, {f.name for f in dataclasses.fields(obj)}, obj.__doc__ or "", "Attributes")
        elif inspect.isclass(obj):
            if "Args:" in (obj.__doc__ or ""):
                check(name, params(obj), obj.__doc__ or "", "Args")
        else:
            check(name, params(obj), obj.__doc__ or "", "Args")
        own = [k for k in obj.__mro__ if k.__module__.startswith("lakestream_iceberg")] if inspect.isclass(obj) else []
        for method_name, method in {m: f for k in reversed(own) for m, f in vars(k).items()}.items():
            if not method_name.startswith("_") and inspect.isfunction(getattr(method, "__func__", method)) \
                    and "Args:" in (method.__doc__ or ""):
                check(f"{name}.{method_name}", params(getattr(obj, method_name)), method.__doc__ or "", "Args")
    check("LakestreamDataset", params(_DatasetCore.__init__), _DOC, "Args")
    assert not problems, problems
