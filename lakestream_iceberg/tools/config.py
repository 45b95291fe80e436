"""Which catalog the ``lakestream`` CLI (and ``make demo``) talks to.

Two ways, and nothing lakestream-specific to learn:

* ``--catalog NAME``: whatever ``lakestream_iceberg.load_catalog(NAME)`` (pyiceberg's ``load_catalog``) returns, so the
  catalog is configured as for pyiceberg: ``~/.pyiceberg.yaml`` (or ``$PYICEBERG_HOME/.pyiceberg.yaml``) and
  ``PYICEBERG_CATALOG__NAME__*`` environment variables (``..._POOL_PRE_PING`` read as ``pool_pre_ping``).
* otherwise the **embedded default**: a SQLite ``SqlCatalog`` at ``<home>/catalog.db`` with its warehouse at
  ``<home>/warehouse``, where ``<home>`` is ``--home DIR``, else ``$LAKESTREAM_HOME``, else ``./.lakestream``.

Example:
    >>> catalog = load(CatalogSpec(home="/tmp/lake"))          # doctest: +SKIP
    >>> stream = open_stream(catalog, "demo.run", spec=CatalogSpec(home="/tmp/lake"))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from lakestream_iceberg.errors import ConfigError, StreamError

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

    from lakestream_iceberg.stream import Stream

__all__ = ["ENV_HOME", "DEFAULT_HOME", "CatalogSpec", "load", "open_stream", "resolve_home"]

ENV_HOME = "LAKESTREAM_HOME"
DEFAULT_HOME = ".lakestream"
EMBEDDED_NAME = "lakestream"


def resolve_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The embedded catalog's directory: ``home``, else ``$LAKESTREAM_HOME``, else ``./.lakestream`` (absolute)."""
    chosen = home if home else os.environ.get(ENV_HOME) or DEFAULT_HOME
    return Path(chosen).expanduser().resolve()


@dataclass(frozen=True)
class CatalogSpec:
    """How to reach a catalog; picklable, so worker processes can load the same catalog themselves.

    Attributes:
        name: A pyiceberg catalog name (``load_catalog(name)``); ``None`` selects the embedded default.
        home: The embedded default's directory (ignored when ``name`` is set); see :func:`resolve_home`.
    """

    name: str | None = None
    home: str | None = None

    def __post_init__(self) -> None:
        # An empty value is what an unset shell variable gives (``--catalog "$CATALOG"``): it must not quietly select
        # the embedded catalog (or the default home) and show another, empty, lake
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ConfigError(f"the catalog name is {self.name!r}: give a pyiceberg catalog name, or none (leave out "
                              "--catalog) for the embedded catalog")
        if self.home is not None and (not isinstance(self.home, str | os.PathLike) or not str(self.home).strip()):
            raise ConfigError(f"the lakestream home is {self.home!r}: give a directory, or none (leave out --home) for "
                              f"${ENV_HOME} or ./{DEFAULT_HOME}")

    def describe(self) -> str:
        return f"catalog {self.name!r}" if self.name else f"the embedded catalog in {resolve_home(self.home)}"

    def cli_args(self) -> str:
        """The options that select this catalog on a ``lakestream`` command line, shell-quoted, with a leading space
        (``""`` for the default): for the commands a message suggests, which must reach the same catalog."""
        if self.name:
            return f" --catalog {shlex.quote(self.name)}"
        return f" --home {shlex.quote(str(self.home))}" if self.home else ""


def embedded_catalog(home: str | os.PathLike[str] | None = None, *, create: bool = True) -> Catalog:
    """The embedded default: SQLite ``SqlCatalog`` at ``<home>/catalog.db``, warehouse ``<home>/warehouse``.

    Args:
        home: See :func:`resolve_home`.
        create: Make the home when it has no catalog yet (``lakestream demo``); else that is a :class:`ConfigError`
            (the commands that look at streams: a misspelt ``--home`` made an empty catalog there).
    """
    from pyiceberg.catalog.sql import SqlCatalog

    root = resolve_home(home)
    if not create and not (root / "catalog.db").is_file():
        raise ConfigError(f"no lakestream home at {root} (it holds no catalog.db): pass --home DIR of an existing home "
                          f"or set {ENV_HOME} (or --catalog NAME for a pyiceberg catalog); `lakestream demo` makes one")
    try:
        (root / "warehouse").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the lakestream home {root}: {exc.strerror}; pass --home DIR or set {ENV_HOME}") from exc
    try:
        # The warehouse a plain path: pyiceberg never decodes a file URI, so as_uri() put the data of a home with a
        # space or a non-ASCII letter into a sibling folder named with %20, and a ? or # cut the path short.
        return SqlCatalog(EMBEDDED_NAME, uri=sqlite_url(root / "catalog.db"), warehouse=str(root / "warehouse"))
    except Exception as exc:  # sqlalchemy's DatabaseError: not a SQLite file, or one pyiceberg cannot set up
        raise ConfigError(
            f"the embedded catalog {root / 'catalog.db'} cannot be opened ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}); it is not a SQLite catalog database: move it aside (the tables' files "
            f"stay in {root / 'warehouse'}), or pass --home DIR / set {ENV_HOME} to another folder"
        ) from exc


def sqlite_url(path: Path) -> str:
    """The SQLAlchemy URL of the SQLite database file ``path``, whatever its path holds (a space, ``?``, ``#``, ``%``).

    SQLAlchemy 2.1 decodes the database part of a URL, so the path goes percent-encoded (a ``?`` or ``#`` in it put the
    database elsewhere). SQLAlchemy 2.0 (the newest for Python 3.10) decodes nothing: the encoded path named a folder
    that does not exist ("unable to open database file"). There the path goes as it is, but for a ``?``, which starts
    the URL's query: that one goes as an SQLite URI filename, which SQLite decodes itself.
    """
    from sqlalchemy.engine import make_url

    if make_url("sqlite:///%41").database == "A":  # SQLAlchemy 2.1 and later
        return "sqlite:///" + quote(str(path))
    if "?" not in str(path):
        return "sqlite:///" + str(path)
    return "sqlite:///file:" + quote(str(path)) + "?uri=true"


# the catalogs load() made inside closing_catalogs(), per thread (a context variable: each thread starts without
# one), so that commands run at once by threads of one process (main()) close each their own
_opened: contextvars.ContextVar[list[Catalog] | None] = contextvars.ContextVar("lakestream_cli_catalogs", default=None)


@contextlib.contextmanager
def closing_catalogs() -> Iterator[None]:
    """Close every catalog :func:`load` makes inside the block (in this thread) when it ends (a CLI command's): their
    connections (SQLAlchemy's pool, lakestream's direct ones) would otherwise be left for the interpreter's exit to
    collect, which Python 3.13 reports as unclosed databases."""
    made: list[Catalog] = []
    token = _opened.set(made)
    try:
        yield
    finally:
        _opened.reset(token)
        for catalog in made:
            with contextlib.suppress(Exception):  # a catalog that cannot close (a broken connection) is left as it is
                catalog.close()


def load(spec: CatalogSpec, *, create: bool = True) -> Catalog:
    """Load the catalog ``spec`` names (closed at the end of an enclosing :func:`closing_catalogs`).

    Args:
        spec: The catalog.
        create: For the embedded catalog: make its home when missing (else a :class:`ConfigError`).

    Raises:
        ConfigError: The named catalog is not configured or could not be initialised (the message names the setting),
            or the embedded one has no home and ``create`` is false.
    """
    catalog = _load(spec, create=create)
    opened = _opened.get()
    if opened is not None:
        opened.append(catalog)
    return catalog


def _load(spec: CatalogSpec, *, create: bool) -> Catalog:
    if not spec.name:
        return embedded_catalog(spec.home, create=create)
    from lakestream_iceberg.connect.diagnose import PASS_SETTINGS, load_catalog
    from lakestream_iceberg.connect.secrets import redact

    try:
        return load_catalog(spec.name)
    except ConfigError as exc:
        if str(exc).endswith(PASS_SETTINGS):  # a catalog not configured or set wrong: the command line passes none
            error = ConfigError(str(exc).removesuffix(PASS_SETTINGS) + ", or drop --catalog to use the embedded default")
            error.original = getattr(exc, "original", None)  # type: ignore[attr-defined]
            raise error from None
        raise
    except Exception as exc:  # pyiceberg raises ValueError, driver and HTTP errors alike
        env = "PYICEBERG_CATALOG__" + spec.name.upper().replace("-", "_") + "__URI"
        from pyiceberg.utils.config import Config

        try:  # its secrets, and a uri's password, are redacted
            configured = Config().get_catalog_config(spec.name) or {}
        except Exception:  # noqa: BLE001 - a malformed configuration (catalog: not a mapping) is what exc says
            configured = {}
        detail = redact(" ".join(str(exc).split()), configured) or type(exc).__name__
        error = ConfigError(
            f"could not load catalog {spec.name!r}: {detail} (configure it in .pyiceberg.yaml under catalog: "
            f"{spec.name}: or with {env} and friends, or drop --catalog to use the embedded default)"
        )
        error.original = exc  # type: ignore[attr-defined]  # not chained: its text is unredacted
        raise error from None


def open_stream(catalog: Catalog, identifier: str, *, spec: CatalogSpec | None = None) -> Stream:
    """Open a stream, turning pyiceberg's lookup failures into one clear :class:`StreamError`."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    from lakestream_iceberg.format.checks import check_identifier
    from lakestream_iceberg.stream import Stream

    where = spec.describe() if spec else "the catalog"
    if identifier.strip() and "." not in identifier:
        raise StreamError(f"stream name {identifier!r} needs a namespace: write it as NAMESPACE.NAME (e.g. demo.{identifier})")
    check_identifier(identifier)  # an empty part ('.x', 'x.', ''): the ConfigError that says so
    try:
        return Stream.open(catalog, identifier)
    except (NoSuchTableError, NoSuchNamespaceError):
        known = _known_tables(catalog)
        # the demo makes its stream in the catalog it is given: a plain `lakestream demo` in the embedded default
        demo = f"lakestream{spec.cli_args() if spec else ''} demo"
        hint = f"; tables there: {', '.join(known)}" if known else f"; it has no tables yet (try `{demo}`)"
        raise StreamError(f"no stream {identifier!r} in {where}{hint}") from None


def _known_tables(catalog: Catalog, limit: int = 12, max_namespaces: int = 100) -> list[str]:
    """Up to ``limit`` table names, nested namespaces' included (``list_namespaces()`` gives the top level only),
    looking into at most ``max_namespaces`` namespaces."""
    names: list[str] = []
    pending: list[tuple[str, ...]] = [()]
    seen: set[tuple[str, ...]] = set()
    try:
        while pending and len(seen) < max_namespaces:
            parent = pending.pop(0)
            for namespace in catalog.list_namespaces(parent):
                namespace = tuple(namespace)
                if namespace in seen or len(namespace) <= len(parent):  # a catalog that lists more than the children
                    continue
                seen.add(namespace)
                pending.append(namespace)
                names += [".".join(ident) for ident in catalog.list_tables(namespace)]
                if len(names) > limit:
                    return [*names[:limit], "..."]
    except Exception:  # listing is a courtesy in an error message; never mask the real error
        return names
    return names
