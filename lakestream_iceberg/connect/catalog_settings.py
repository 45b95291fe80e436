"""One meaning for a catalog setting, whichever way it was set: ``.pyiceberg.yaml``, ``PYICEBERG_CATALOG__<NAME>__<KEY>``
environment variables, or keyword arguments.

pyiceberg reads an environment variable's key with every ``_`` turned into ``-`` (``__`` into ``.``), so
``PYICEBERG_CATALOG__PROD__POOL_PRE_PING=true`` reaches ``SqlCatalog`` as ``pool-pre-ping``, while ``SqlCatalog`` reads
only ``pool_pre_ping``: on its own, pyiceberg drops the setting without a word. :func:`resolve` (called by
:func:`lakestream_iceberg.load_catalog`) maps the dashed spelling of every underscore key a SQL catalog reads back to
its name, and refuses with a :class:`ConfigError` what would still have no effect:

* the settings ``SqlCatalog`` reads (:func:`sql_catalog_keys`: ``pool_pre_ping``, ``echo``, ``schema_version``,
  ``init_catalog_tables`` in pyiceberg 0.12), read from its source, so a pyiceberg that reads more is followed;
* SQLAlchemy ``create_engine`` options (:func:`engine_options`, from its signature) that ``SqlCatalog`` does not pass on
  to its engine (:func:`engine_options_passed`: ``echo`` and ``pool_pre_ping`` in pyiceberg 0.12): ``pool_size``,
  ``pool_recycle``, ``max_overflow``, ... in any spelling raise a ``ConfigError`` instead of being ignored;
* a ``type`` that names no pyiceberg catalog type.

Values keep the strings they were given: ``SqlCatalog`` converts them itself (``strtobool("true")``), so a mapped
``pool-pre-ping: "true"`` does exactly what ``pool_pre_ping="true"`` does.

Example:
    >>> props, dashed = resolve("prod", {"type": "sql", "uri": "sqlite://", "pool-pre-ping": "true"}, {})
    >>> props["pool_pre_ping"], sorted(dashed)
    ('true', ['pool-pre-ping'])
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from lakestream_iceberg.errors import ConfigError

__all__ = ["CATALOG_KEYS", "catalog_types", "check_catalog_keys", "check_env_reaches", "misspelt_keys", "engine_options", "engine_options_passed", "env_name", "resolve",
           "sql_catalog_keys"]

# what pyiceberg 0.12's SqlCatalog reads and passes on, and SQLAlchemy 2.0's create_engine keywords: used only where
# the sources or signatures cannot be read (a zipped install, Python 3.10 without typing.get_overloads)
_SQL_CATALOG_KEYS = frozenset({"uri", "echo", "pool_pre_ping", "schema_version", "init_catalog_tables"})
_ENGINE_OPTIONS_PASSED = frozenset({"echo", "pool_pre_ping"})
_ENGINE_OPTIONS = frozenset({
    "connect_args", "convert_unicode", "creator", "echo", "echo_pool", "enable_from_linting", "execution_options",
    "future", "hide_parameters", "implicit_returning", "insertmanyvalues_page_size", "isolation_level",
    "json_deserializer", "json_serializer", "label_length", "logging_name", "max_identifier_length", "max_overflow",
    "module", "paramstyle", "pool", "poolclass", "pool_logging_name", "pool_pre_ping", "pool_size", "pool_recycle",
    "pool_reset_on_return", "pool_timeout", "pool_use_lifo", "plugins", "query_cache_size", "use_insertmanyvalues",
})  # fmt: skip


# the catalog properties lakestream itself reads under lakestream. (connect/sqlite.py's PROP_SQLITE_WAL)
CATALOG_KEYS = ("lakestream.sqlite.wal",)


def check_catalog_keys(name: str, properties: Mapping[str, Any], *,
                       table_property: Callable[[str], bool] = lambda key: False) -> None:
    """Refuse a catalog property under ``lakestream.`` that lakestream does not read: a misspelt
    ``lakestream.sqlite.wal`` was ignored without a word (and the database switched to WAL after all), and a table
    property set on the catalog (``lakestream.snapshots.retain-last``) configures no stream.

    Raises:
        ConfigError: Such a key, with the nearest catalog property, or where a table property belongs (``table_property``
            tells a table property's key).
    """
    import difflib

    for key in properties:
        if not isinstance(key, str) or not key.lower().startswith("lakestream.") or key in CATALOG_KEYS:
            continue
        if table_property(key):
            hint = (f"; {key} is a table property: set it with Stream.create(..., properties={{{key!r}: ...}}) or on the "
                    "table (docs/configuration.md)")
        else:
            near = difflib.get_close_matches(key.lower(), CATALOG_KEYS, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else f"; the catalog properties lakestream reads: {', '.join(CATALOG_KEYS)}"
        raise ConfigError(f"catalog {name!r}: catalog property {key} is not one lakestream reads{hint} (fix it in "
                          f".pyiceberg.yaml, {env_name(name, key)} or the load_catalog() argument)")


@functools.cache
def _io_keys() -> dict[str, str]:
    """The FileIO properties pyiceberg reads (``s3.secret-access-key``, ...), by their spelling with every ``.`` and
    ``_`` made ``-``."""
    try:
        import pyiceberg.io as io
    except ImportError:  # pragma: no cover - pyiceberg is a dependency
        return {}
    keys = {value for name, value in vars(io).items() if name.isupper() and isinstance(value, str)
            and re.fullmatch(r"[a-z0-9]+(?:\.[a-z0-9_-]+)+", value) and not value.startswith("pyiceberg.")}
    return {re.sub(r"[._]", "-", key): key for key in keys}


def misspelt_keys(properties: Mapping[str, Any]) -> dict[str, str]:
    """The properties that spell a FileIO property pyiceberg reads with other separators, which pyiceberg ignores:
    ``s3-secret-access-key`` (``PYICEBERG_CATALOG__<NAME>__S3_SECRET_ACCESS_KEY``, one ``_`` short), ``s3.secret_access_key``
    -> the property meant, where the properly spelt one is not set too."""
    known = _io_keys()
    found = {}
    for key in properties:
        if not isinstance(key, str):
            continue
        meant = known.get(re.sub(r"[._]", "-", key.lower()))
        if meant is not None and meant != key and not properties.get(meant):
            found[key] = meant
    return found


def check_spelling(name: str, properties: Mapping[str, Any]) -> None:
    """Raise a :class:`ConfigError` for a property :func:`misspelt_keys` finds (pyiceberg would drop it without a word)."""
    found = misspelt_keys(properties)
    if found:
        key, meant = sorted(found.items())[0]
        where = (".pyiceberg.yaml or the load_catalog() argument (no variable can: pyiceberg reads each _ of one as -)"
                 if "_" in meant else f".pyiceberg.yaml, {env_name(name, meant)} (each . of the key as __, each - as _) "
                 "or the load_catalog() argument")
        raise ConfigError(f"catalog {name!r}: {key} is not a setting pyiceberg reads (it is dropped); did you mean "
                          f"{meant}? Set {meant} in {where}")


def env_name(catalog: str | None, key: str) -> str:
    """The environment variable pyiceberg reads as ``key`` of ``catalog``: ``s3.access-key-id`` ->
    ``PYICEBERG_CATALOG__<NAME>__S3__ACCESS_KEY_ID`` (for ``pool_pre_ping`` it reads ``pool-pre-ping``, which
    :func:`resolve` maps back)."""
    name = (catalog or "<NAME>").upper().replace("-", "_")
    return f"PYICEBERG_CATALOG__{name}__" + key.replace(".", "__").replace("-", "_").upper()


def check_env_reaches(name: str, environ: Mapping[str, str]) -> None:
    """Refuse ``PYICEBERG_CATALOG__<NAME>__*`` variables that cannot reach the catalog ``name``: pyiceberg reads every
    ``_`` of a variable as ``-``, so ``PYICEBERG_CATALOG__MY_CAT__URI`` configures ``my-cat``, never ``my_cat``.

    Raises:
        ConfigError: ``name`` holds an ``_`` and such variables are set (they would be dropped without a word).
    """
    if "_" not in name:
        return
    prefix = f"PYICEBERG_CATALOG__{name.upper()}__"
    lost = sorted(key for key in environ if key.upper().startswith(prefix))
    if lost:
        dashed = name.replace("_", "-")
        raise ConfigError(
            f"catalog {name!r}: pyiceberg reads {', '.join(lost)} as settings of catalog {dashed!r} (it turns each _ "
            f"of a variable name into -), so they never reach {name!r}; name the catalog {dashed!r} (in .pyiceberg.yaml "
            f"too), or put these settings in .pyiceberg.yaml under catalog: {name}:"
        )


@functools.cache
def _sql_source() -> str | None:
    try:
        from pyiceberg.catalog import sql

        return inspect.getsource(sql)
    except (ImportError, OSError, TypeError):  # SQLAlchemy not installed, or no source file to read
        return None


@functools.cache
def sql_catalog_keys() -> frozenset[str]:
    """The properties pyiceberg's ``SqlCatalog`` reads by name (``self.properties.get("...")`` in its source), plus
    ``uri``."""
    source = _sql_source()
    found = set(re.findall(r"properties\.get\(\s*\"([A-Za-z0-9_.-]+)\"", source or ""))
    return frozenset(found | {"uri"}) if found else _SQL_CATALOG_KEYS


@functools.cache
def engine_options_passed() -> frozenset[str]:
    """The keywords ``SqlCatalog`` passes to ``create_engine`` (``create_engine(uri, echo=..., pool_pre_ping=...)``)."""
    calls = re.findall(r"create_engine\(([^)]*)\)", _sql_source() or "")
    passed = {name for call in calls for name in re.findall(r"(\w+)\s*=", call)}
    return frozenset(passed) if passed else _ENGINE_OPTIONS_PASSED


@functools.cache
def engine_options() -> frozenset[str]:
    """Every keyword SQLAlchemy's ``create_engine`` documents in its signature (``pool_size``, ``pool_recycle``, ...)."""
    import typing

    try:
        from sqlalchemy import create_engine
    except ImportError:
        return _ENGINE_OPTIONS
    overloads: list[Callable[..., Any]] = getattr(typing, "get_overloads", lambda _: [])(create_engine)
    names = {p.name for fn in overloads for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
    return frozenset(names) if names else _ENGINE_OPTIONS


def catalog_types() -> list[str]:
    """The values pyiceberg accepts as a catalog's ``type``."""
    from pyiceberg.catalog import CatalogType

    return [kind.value for kind in CatalogType]


def _catalog_type(name: str, conf: Mapping[str, Any]) -> str | None:
    """The catalog type pyiceberg will build (``type``, else the uri's scheme), ``None`` when it cannot tell."""
    kind = conf.get("type")
    if isinstance(kind, str) and kind:
        if kind.lower() not in catalog_types():
            raise ConfigError(
                f"catalog {name!r}: type {kind!r} is not a pyiceberg catalog type; set type (in .pyiceberg.yaml, "
                f"{env_name(name, 'type')} or type=) to one of {', '.join(catalog_types())}, or name a class with "
                "py-catalog-impl instead"
            )
        return kind.lower()
    uri = conf.get("uri")
    if isinstance(uri, str) and uri.startswith(("sqlite", "postgresql")) and not conf.get("py-catalog-impl"):
        return "sql"
    return None


@functools.cache
def _aliases() -> dict[str, str]:
    """The dashed spelling of every underscore key a SQL catalog or its engine reads -> that key."""
    return {key.replace("_", "-"): key for key in sql_catalog_keys() | engine_options() if "_" in key}


def _undashed(props: Mapping[str, Any], name: str, *, where: str, dashed_wins: bool) -> dict[str, Any]:
    """``props`` with the dashed spelling of each underscore key a SQL catalog reads renamed to that key.

    Both spellings with different values: in pyiceberg's configuration the dashed one came from the environment, which
    overrides the file (``dashed_wins``); among keyword arguments it is a mistake.
    """
    aliases = _aliases()
    out = {k: v for k, v in props.items() if k not in aliases}
    for key, value in props.items():
        proper = aliases.get(key)
        if proper is None:
            continue
        if proper in props and props[proper] != value and not dashed_wins:
            raise ConfigError(
                f"catalog {name!r}: {where} set both {proper}={props[proper]!r} and {key}={value!r}, the same "
                f"setting; keep only {proper}"
            )
        if proper not in props or dashed_wins:
            out[proper] = value
    return out


def resolve(name: str, configured: Mapping[str, Any], given: Mapping[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The keyword arguments to hand pyiceberg's ``load_catalog`` so that each setting means the same in every form,
    and the dashed keys pyiceberg will still merge in from its own configuration (to drop from the catalog's
    properties once it is built).

    Args:
        name: The catalog name.
        configured: What pyiceberg's configuration holds for it (``.pyiceberg.yaml`` merged with ``PYICEBERG_*``).
        given: The keyword arguments of the call.

    Raises:
        ConfigError: ``type`` names no catalog type; a SQL catalog is given a ``create_engine`` option that pyiceberg
            does not pass on; a keyword argument is given in both spellings with different values.
    """
    conf = {**configured, **{k: v for k, v in given.items() if v}}  # pyiceberg's merge: a non-empty argument wins
    if _catalog_type(name, conf) != "sql":
        return dict(given), set()
    from_config = _undashed(configured, name, where="the configuration", dashed_wins=True)
    from_call = _undashed(given, name, where="the keyword arguments", dashed_wins=False)
    # what pyiceberg would not see under the right name: the renamed settings (and a file's value an environment
    # variable overrides); the call's own arguments still win over them
    renamed = {key: value for key, value in from_config.items() if key not in configured or configured[key] != value}
    merged = {**from_config, **{k: v for k, v in from_call.items() if v}}
    ignored = sorted(set(merged) & (engine_options() - engine_options_passed() - sql_catalog_keys()))
    if ignored:
        settings = ", ".join(ignored)
        envs = ", ".join(env_name(name, key) for key in ignored)
        passed = " and ".join(sorted(engine_options_passed()))
        raise ConfigError(
            f"catalog {name!r}: {settings} would have no effect: pyiceberg's SqlCatalog passes only {passed} to "
            f"SQLAlchemy's create_engine; remove {settings} from the catalog's settings (.pyiceberg.yaml, {envs}, "
            "or the keyword arguments)"
        )
    dashed = {key for key in configured if key in _aliases()}
    # an empty argument (None, "") is no setting (pyiceberg's merge keeps the configured value): it must not replace a
    # renamed one, which pyiceberg no longer sees under its own name
    return {**renamed, **{k: v for k, v in from_call.items() if v or k not in renamed}}, dashed
