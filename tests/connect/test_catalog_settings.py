"""A catalog setting means the same in ``.pyiceberg.yaml``, as a ``PYICEBERG_CATALOG__<NAME>__<KEY>`` variable and as a
keyword argument of ``lakestream_iceberg.load_catalog`` (connect/catalog_settings.py), on real SQLite and PostgreSQL
catalogs, a PostgreSQL restart included.

pyiceberg reads its configuration once, at import (``pyiceberg.catalog._ENV_CONFIG``): each way of configuring below
sets the file or the variables and then installs a ``Config()`` read from them, as a fresh process would.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyiceberg.catalog
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.utils.config import Config
from sqlalchemy.exc import OperationalError

from catalog import services
from lakestream_iceberg import ConfigError, Stream, load_catalog
from lakestream_iceberg.connect.catalog_settings import catalog_types, engine_options, engine_options_passed, sql_catalog_keys
from lakestream_iceberg.read.stream_ref import StreamRef
from tests.backends import postgres_service
from tests.support import SCHEMA

__all__ = ["postgres_service"]  # fixture used by name

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("yaml", "env", "kwargs")
# every setting pyiceberg 0.12's SqlCatalog reads, each set to a value other than its default where one exists
SETTINGS = {"pool_pre_ping": "true", "echo": "true", "schema_version": "v1", "init_catalog_tables": "true"}


@contextmanager
def configured(way: str, name: str, props: dict[str, str], home: Path) -> Iterator[dict[str, str]]:
    """pyiceberg's configuration holding ``props`` for catalog ``name`` the ``way`` given (the file, or the variables
    ``catalog.services.catalog_env`` exports); yields the keyword arguments to pass (``props`` for ``kwargs``)."""
    home.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYICEBERG_HOME", str(home))
        if way == "yaml":
            lines = ["catalog:", f"  {name}:", *(f"    {k}: {json.dumps(v)}" for k, v in props.items())]
            (home / ".pyiceberg.yaml").write_text("\n".join(lines) + "\n")
        elif way == "env":
            for key, value in services.catalog_env(name, props).items():
                mp.setenv(key, value)
        mp.setattr(pyiceberg.catalog, "_ENV_CONFIG", Config())
        yield props if way == "kwargs" else {}


def load(way: str, name: str, props: dict[str, str], home: Path) -> Any:
    with configured(way, name, props, home) as kwargs:
        return load_catalog(name, **kwargs)


def behaviour(catalog: Any) -> dict[str, Any]:
    """What the settings change: the catalog's properties and its engine."""
    return {"properties": dict(catalog.properties), "pre_ping": catalog.engine.pool._pre_ping,
            "echo": catalog.engine.echo, "schema_version": catalog._schema_version, "pool_size": catalog.engine.pool.size()}  # fmt: skip


# --------------------------------------------------------------------------------------------------- without servers


def test_the_issue_repro_reads_pool_pre_ping_from_the_environment(tmp_path: Path) -> None:
    """pyiceberg read at import, as in a user's process: POOL_PRE_PING=true reaches the engine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYICEBERG_")}
    env.update(PYICEBERG_HOME=str(tmp_path), PYICEBERG_CATALOG__X__TYPE="sql", PYTHONPATH=str(ROOT),
               PYICEBERG_CATALOG__X__URI=f"sqlite:///{tmp_path}/x.db", PYICEBERG_CATALOG__X__POOL_PRE_PING="true")  # fmt: skip
    code = "from lakestream_iceberg import load_catalog; c = load_catalog('x'); print(dict(c.properties), c.engine.pool._pre_ping)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == "True", out.stdout + out.stderr
    assert "'pool_pre_ping': 'true'" in out.stdout and "pool-pre-ping" not in out.stdout


@pytest.fixture
def engine_log_handlers() -> Iterator[None]:
    """``echo`` adds a handler to SQLAlchemy's engine logger for the process: take it off again."""
    logger = logging.getLogger("sqlalchemy.engine.Engine")
    before = list(logger.handlers)
    yield
    for handler in [h for h in logger.handlers if h not in before]:
        logger.removeHandler(handler)


@pytest.mark.usefixtures("engine_log_handlers")
def test_each_sql_setting_means_the_same_three_ways(tmp_path: Path) -> None:
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh", **SETTINGS}
    seen = {way: behaviour(load(way, "three", props, tmp_path / way)) for way in WAYS}
    assert seen["yaml"] == seen["env"] == seen["kwargs"]
    assert seen["env"]["properties"] == props
    assert seen["env"]["pre_ping"] is True and seen["env"]["echo"] is True and seen["env"]["schema_version"] == "v1"


def test_the_derived_lists_cover_what_pyiceberg_and_sqlalchemy_read() -> None:
    assert sql_catalog_keys() >= {"uri", "echo", "pool_pre_ping", "schema_version", "init_catalog_tables"}
    assert engine_options_passed() == {"echo", "pool_pre_ping"}  # pyiceberg 0.12: create_engine(uri, echo=, pool_pre_ping=)
    assert engine_options() >= {"pool_size", "pool_recycle", "max_overflow", "pool_timeout", "pool_pre_ping", "echo"}


@pytest.mark.parametrize("key", ["pool_size", "pool_recycle", "max_overflow"])
@pytest.mark.parametrize("way", WAYS)
def test_engine_options_pyiceberg_would_ignore_are_refused_every_way(way: str, key: str, tmp_path: Path) -> None:
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", key: "3"}
    with pytest.raises(ConfigError, match=rf"{key} would have no effect: .*remove {key} .*PYICEBERG_CATALOG__SIZED__{key.upper()}"):
        load(way, "sized", props, tmp_path / way)


@contextmanager
def file_and_variables(home: Path, name: str, entry: str, **env: str) -> Iterator[pytest.MonkeyPatch]:
    """Both ways of :func:`configured` at once: ``home/.pyiceberg.yaml`` with catalog ``name`` (``entry``: its lines, indented under it) and the variables
    ``env``, as pyiceberg reads them (its environment configuration made again)."""
    (home / ".pyiceberg.yaml").write_text(f"catalog:\n  {name}:\n    {entry}\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYICEBERG_HOME", str(home))
        for key, value in env.items():
            mp.setenv(key, value)
        mp.setattr(pyiceberg.catalog, "_ENV_CONFIG", Config())
        yield mp


def test_the_environment_overrides_the_file_and_arguments_override_both(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/catalog.db"
    with file_and_variables(tmp_path, "mixed", f'type: sql\n    uri: "{uri}"\n    pool_pre_ping: "false"',
                    PYICEBERG_CATALOG__MIXED__POOL_PRE_PING="true"):
        from_env = load_catalog("mixed")
        from_call = load_catalog("mixed", pool_pre_ping="false")
        dashed_call = load_catalog("mixed", **{"pool-pre-ping": "false"})
    assert from_env.engine.pool._pre_ping is True and from_env.properties["pool_pre_ping"] == "true"
    assert from_call.engine.pool._pre_ping is False and dashed_call.engine.pool._pre_ping is False
    assert "pool-pre-ping" not in from_env.properties and "pool-pre-ping" not in dashed_call.properties


def test_both_spellings_as_arguments_must_agree(tmp_path: Path) -> None:
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db"}
    with pytest.raises(ConfigError, match="both pool_pre_ping='true' and pool-pre-ping='false'.*keep only pool_pre_ping"):
        load_catalog("twice", **props, pool_pre_ping="true", **{"pool-pre-ping": "false"})
    assert load_catalog("twice", **props, pool_pre_ping="true", **{"pool-pre-ping": "true"}).engine.pool._pre_ping is True


@pytest.mark.parametrize("way", WAYS)
def test_an_unknown_type_names_the_types_that_exist(way: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"type 'no-such-type' is not a pyiceberg catalog type.*one of rest, .*sql") as info:
        load(way, "odd", {"type": "no-such-type"}, tmp_path / way)
    assert "PYICEBERG_CATALOG__ODD__TYPE" in str(info.value)
    assert set(catalog_types()) >= {"rest", "sql", "glue", "hive", "in-memory"}


def test_a_variable_that_cannot_reach_a_catalog_named_with_an_underscore_is_refused(tmp_path: Path) -> None:
    """pyiceberg reads PYICEBERG_CATALOG__MY_CAT__POOL_PRE_PING as a setting of catalog my-cat: a catalog my_cat of
    the file loaded without it, and nothing said so (lakestream's own hints name that very variable)."""
    uri = f"sqlite:///{tmp_path}/catalog.db"
    with file_and_variables(tmp_path, "my_cat", f'type: sql\n    uri: "{uri}"',
                    PYICEBERG_CATALOG__MY_CAT__POOL_PRE_PING="true") as mp:
        with pytest.raises(ConfigError, match=r"PYICEBERG_CATALOG__MY_CAT__POOL_PRE_PING as settings of catalog 'my-cat'"):
            load_catalog("my_cat")
        assert load_catalog("my-cat", type="sql", uri=uri).engine.pool._pre_ping is True  # the one it configures
        mp.delenv("PYICEBERG_CATALOG__MY_CAT__POOL_PRE_PING")
        mp.setattr(pyiceberg.catalog, "_ENV_CONFIG", Config())
        assert load_catalog("my_cat").engine.pool._pre_ping is False  # the file alone is fine


def test_a_stream_reopened_from_its_address_reads_the_variables_the_same_way(tmp_path: Path) -> None:
    """``StreamRef`` of a catalog built as a class (py-catalog-impl) merges the worker's configuration itself."""
    name = f"ref-{uuid.uuid4().hex[:8]}"
    catalog = SqlCatalog(name, uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/wh")
    catalog.create_namespace("ns")
    ref = StreamRef.of(Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(f"PYICEBERG_CATALOG__{name.upper().replace('-', '_')}__POOL_PRE_PING", "true")
        reopened = ref.catalog()
    assert reopened.engine.pool._pre_ping is True and reopened.properties.get("pool_pre_ping") == "true"
    assert "pool-pre-ping" not in reopened.properties


# --------------------------------------------------------------------------------------------------- PostgreSQL


@pytest.mark.services
def test_postgres_restart_first_query_succeeds_three_ways(postgres_service: services.Postgres, tmp_path: Path) -> None:
    """The catalog ``catalog.services.postgres_seaweedfs`` documents (its ``pool_pre_ping``), on a fresh database,
    configured three ways: after a PostgreSQL restart the first query of each succeeds. A catalog without
    ``pool_pre_ping`` shows what the restart does to a pooled connection."""
    pg = postgres_service
    database = f"db_{uuid.uuid4().hex[:10]}"
    pg.create_database(database)
    props = {"type": "sql", "uri": pg.sqlalchemy_uri(database), "pool_pre_ping": "true", "warehouse": f"file://{tmp_path}/wh"}
    catalogs = {way: load(way, "pg", props, tmp_path / way) for way in WAYS}
    unpinged = load("kwargs", "pg", {**props, "pool_pre_ping": "false"}, tmp_path / "unpinged")
    catalogs["kwargs"].create_namespace("ns")
    every: list[Callable[[], Any]] = [c.list_namespaces for c in (*catalogs.values(), unpinged)]
    try:
        assert [query() for query in every] == [[("ns",)]] * 4  # each pool now holds an open connection
        assert behaviour(catalogs["yaml"]) == behaviour(catalogs["env"]) == behaviour(catalogs["kwargs"])
        assert catalogs["env"].engine.pool._pre_ping is True

        pg.restart()
        assert {way: c.list_namespaces() for way, c in catalogs.items()} == {way: [("ns",)] for way in WAYS}
        with pytest.raises(OperationalError):  # the dead pooled connection, handed out unchecked
            unpinged.list_namespaces()
        assert unpinged.list_namespaces() == [("ns",)]  # the pool dropped it
    finally:
        if not pg.running:  # a failed restart must not leave the shared server down
            pg.start()
        for catalog in (*catalogs.values(), unpinged):
            catalog.engine.dispose()


def test_a_variable_set_after_import_is_not_dropped_for_the_files_catalog(tmp_path: Path) -> None:
    """pyiceberg merges the configuration it read at import: PYICEBERG_CATALOG__LATE__URI set since then (in a notebook,
    a launcher, a test) was dropped without a word and the file's database used. The current settings win; arguments
    still win over them."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".pyiceberg.yaml").write_text(
        f'catalog:\n  late:\n    type: sql\n    uri: "sqlite:///{tmp_path}/file.db"\n    warehouse: "file://{tmp_path}/wh"\n')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYICEBERG_HOME", str(home))
        mp.setattr(pyiceberg.catalog, "_ENV_CONFIG", Config())  # what a process started with this file read at import
        assert str(load_catalog("late").engine.url) == f"sqlite:///{tmp_path}/file.db"
        mp.setenv("PYICEBERG_CATALOG__LATE__URI", f"sqlite:///{tmp_path}/env.db")  # set after import
        catalog = load_catalog("late")
        assert str(catalog.engine.url) == f"sqlite:///{tmp_path}/env.db" and catalog.properties["uri"].endswith("env.db")
        assert str(load_catalog("late", uri=f"sqlite:///{tmp_path}/arg.db").engine.url).endswith("arg.db")
        (home / ".pyiceberg.yaml").write_text("catalog:\n  late: {uri: flow}\n")  # edited since import: not parseable
        with pytest.raises(ConfigError, match=r"\.pyiceberg\.yaml cannot be read"):
            load_catalog("late")


def test_a_variable_unset_after_import_is_not_used(tmp_path: Path) -> None:
    """A PYICEBERG_CATALOG__* variable unset since import (or a key removed from the file) was still merged in by
    pyiceberg from what it read at import: the catalog is loaded with the settings as they are at the call."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYICEBERG_HOME", str(tmp_path))  # no .pyiceberg.yaml there
        mp.setenv("PYICEBERG_CATALOG__GONE__URI", f"sqlite:///{tmp_path}/a.db")
        mp.setenv("PYICEBERG_CATALOG__GONE__WAREHOUSE", f"file://{tmp_path}/old")
        mp.setattr(pyiceberg.catalog, "_ENV_CONFIG", Config())  # what the process read at import
        assert load_catalog("gone").properties["warehouse"] == f"file://{tmp_path}/old"
        mp.delenv("PYICEBERG_CATALOG__GONE__WAREHOUSE")  # unset after import
        catalog = load_catalog("gone")
        assert "warehouse" not in catalog.properties, catalog.properties
        catalog.engine.dispose()


@pytest.mark.parametrize(("name", "props", "match"), [
    ("prod", {}, r"could not load catalog 'prod': URI missing.*PYICEBERG_CATALOG__PROD__URI"),  # the name misspelt
    ("prod", {"type": "sql"}, r"could not load catalog 'prod': URI missing"),
    ("prod", {"uri": "foo://x"}, r"could not load catalog 'prod': Could not infer the catalog type from the uri"),
    ("prod", {"type": "sql", "uri": ""}, r"SQL connection URI is required"),
    ("prod", {"type": "sql", "uri": "nodb://user:pw-s3cret@host/db"}, r"Can't load plugin: sqlalchemy.dialects:nodb"),
    (5, {"type": "sql", "uri": "sqlite://"}, r"a catalog's name is a string.*got int 5"),
    (True, {"type": "sql", "uri": "sqlite://"}, r"a catalog's name is a string.*got bool True"),
])
def test_a_catalog_not_configured_or_set_wrong_is_a_config_error(name: object, props: dict[str, str], match: str,
                                                                  tmp_path: Path) -> None:
    """load_catalog promises a ConfigError when "the catalog is not configured, a setting is wrong": a name with no
    configuration raised pyiceberg's bare ValueError ("URI missing, please provide using --uri"), a uri of no catalog
    type a ValueError, an empty or unknown SQL uri pyiceberg's and SQLAlchemy's own exceptions, a name that is no
    string a TypeError. Only the CLI wrapped them."""
    with configured("kwargs", "prod", props, tmp_path) as kwargs:
        with pytest.raises(ConfigError, match=match) as info:
            load_catalog(name, **kwargs)  # type: ignore[arg-type]
    assert "pw-s3cret" not in str(info.value)


@pytest.mark.parametrize("way", ["yaml", "env"])
@pytest.mark.parametrize("default", [None, "mine"])
def test_no_name_loads_pyiceberg_default_catalog_as_configured_now(way: str, default: str | None, tmp_path: Path) -> None:
    """``load_catalog()`` without a name is pyiceberg's default catalog, as ``pyiceberg.catalog.load_catalog()`` gives
    it: the configuration's ``default-catalog`` (set after import too), else ``default``. It raised a ConfigError
    asking for a name."""
    name = default or "default"
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}
    with configured(way, name, props, tmp_path / "home"), pytest.MonkeyPatch.context() as mp:
        if default is not None and way == "env":
            mp.setenv("PYICEBERG_DEFAULT_CATALOG", default)  # after pyiceberg read its configuration
        elif default is not None:
            with (tmp_path / "home" / ".pyiceberg.yaml").open("a") as file:
                file.write(f"default-catalog: {default}\n")
        catalog = load_catalog()
        assert catalog.name == name and catalog.properties["warehouse"] == f"file://{tmp_path}/wh"
        catalog.engine.dispose()


def test_no_name_and_no_default_catalog_configured_says_where_the_name_came_from(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYICEBERG_HOME", str(tmp_path))  # no .pyiceberg.yaml, no variables for a catalog named default
        for key in [k for k in os.environ if k.startswith("PYICEBERG_CATALOG__") or k == "PYICEBERG_DEFAULT_CATALOG"]:
            mp.delenv(key)
        with pytest.raises(ConfigError, match=r"could not load catalog 'default' \(no name was given: .*default-catalog"):
            load_catalog()
        with pytest.raises(ConfigError, match=r"could not load catalog 'prod': ") as named:
            load_catalog("prod")
        assert "no name was given" not in str(named.value)


def test_a_default_catalog_name_that_is_no_string_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / ".pyiceberg.yaml").write_text("default-catalog:\n  - prod\n")  # a list: pyiceberg's ValueError
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYICEBERG_HOME", str(tmp_path))
        with pytest.raises(ConfigError, match=r"default-catalog .*list \['prod'\]: set it to a catalog's name"):
            load_catalog()


@pytest.mark.parametrize("how", ["load_catalog", "class"])
def test_a_setting_given_as_a_number_reaches_the_process_that_unpickles_the_stream(how: str, tmp_path: Path) -> None:
    """pyiceberg takes ``s3.connect-timeout=5`` and lakestream ``rest.client.socket-timeout-ms=5000`` as numbers (they
    convert with ``float()``), but a pickled stream carried only the string-valued settings: a spawned DataLoader worker
    or a Ray task reopened the catalog without them (default timeouts, without a word). They travel as strings."""
    props: dict[str, Any] = {"uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh",
                             "s3.connect-timeout": 5, "rest.client.socket-timeout-ms": 5000}
    with configured("kwargs", "numbers", {}, tmp_path / "home"):
        catalog = load_catalog("numbers", type="sql", **props) if how == "load_catalog" else SqlCatalog("numbers", **props)
        catalog.create_namespace("ns")
        stream = Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1)
        assert stream.io.properties["s3.connect-timeout"] == 5
        reopened = pickle.loads(pickle.dumps(stream))
        assert reopened.io.properties.get("s3.connect-timeout") == "5"
        assert reopened.table.catalog.properties.get("rest.client.socket-timeout-ms") == "5000"


@pytest.mark.services
@pytest.mark.parametrize("how", ["load_catalog", "class"])
def test_a_stream_unpickled_where_its_withheld_credentials_are_not_configured_says_so(
        how: str, postgres_service: services.Postgres, tmp_path: Path) -> None:
    """A pickled stream never carries its credentials; a uri with a password is one. Unpickled in a process that has no
    configuration for the catalog (a spawned DataLoader worker of a notebook that passed the uri to load_catalog), a
    catalog built as a class raised pyiceberg's own ``NoSuchPropertyException: SQL connection URI is required``, and one
    from load_catalog said "URI missing" as if it had never been set. Both say which setting the pickle left behind
    and how to get it there, without the password."""
    database = f"db_{uuid.uuid4().hex[:10]}"
    postgres_service.create_database(database)
    uri = postgres_service.sqlalchemy_uri(database).replace("postgres@", "postgres:pw-s3cret@")  # trust auth: ignored
    assert "pw-s3cret@" in uri
    props = {"uri": uri, "warehouse": f"file://{tmp_path}/wh"}
    with configured("kwargs", "withheld", {}, tmp_path / "home"):  # no file, no variables: an unconfigured worker
        catalog = load_catalog("withheld", type="sql", **props) if how == "load_catalog" else SqlCatalog("withheld", **props)
        try:
            catalog.create_namespace("ns")
            payload = pickle.dumps(Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1))
            assert b"pw-s3cret" not in payload
            with pytest.raises(ConfigError, match=r"did not carry uri.*PYICEBERG_CATALOG__WITHHELD__URI.*ship_credentials") as info:
                pickle.loads(payload)
            assert "pw-s3cret" not in str(info.value)
        finally:
            catalog.engine.dispose()


def pickled_with_a_key_pair(tmp_path: Path, name: str) -> bytes:
    """A pickled stream of catalog ``name`` whose process had the key pair producer-key / producer-secret."""
    with configured("env", name, {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db",
                                  "warehouse": f"file://{tmp_path}/wh", "s3.access-key-id": "producer-key",
                                  "s3.secret-access-key": "producer-secret"}, tmp_path / "home"):
        catalog = load_catalog(name)
        catalog.create_namespace("ns")
        return pickle.dumps(Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1))


def test_a_worker_with_its_own_key_pair_uses_its_own_key_id_with_its_own_secret(tmp_path: Path) -> None:
    """The pickle withholds ``s3.secret-access-key`` but carried ``s3.access-key-id`` (not a secret), and carried
    settings win over the unpickling process's configuration: a worker host configured with its own key pair (the
    read-only keys docs/guide/hosts.md recommends for trainers) reopened the stream with the parent's key id and its own
    secret, a pair that exists nowhere (SeaweedFS: SignatureDoesNotMatch / ACCESS_DENIED on open), though
    ``load_catalog`` in that worker works. A key id travels only where the worker configures none."""
    name = "pair"
    payload = pickled_with_a_key_pair(tmp_path, name)
    with configured("env", name, {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db",
                                  "s3.access-key-id": "trainer-key", "s3.secret-access-key": "trainer-secret"},
                    tmp_path / "worker"):
        props = pickle.loads(payload).io.properties
        assert (props["s3.access-key-id"], props["s3.secret-access-key"]) == ("trainer-key", "trainer-secret")
    with configured("env", name, {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db",
                                  "s3.secret-access-key": "producer-secret"}, tmp_path / "secret-only"):
        props = pickle.loads(payload).io.properties  # no key id configured here: the carried one is the only one
        assert (props["s3.access-key-id"], props["s3.secret-access-key"]) == ("producer-key", "producer-secret")


@pytest.mark.parametrize("way", ["yaml", "env"])
@pytest.mark.parametrize("value", [None, ""])
def test_an_empty_argument_leaves_the_configured_setting_in_effect_every_way(way: str, value: str | None,
                                                                            tmp_path: Path) -> None:
    """pyiceberg's merge: an empty argument (None, "") is no setting, and the configured value stays (``uri=None``
    loads the configured uri). ``pool_pre_ping=None`` did that for the file's ``pool_pre_ping``, but against
    ``PYICEBERG_CATALOG__<NAME>__POOL_PRE_PING`` it replaced the setting and failed: "'NoneType' object has no
    attribute 'lower'"."""
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "pool_pre_ping": "true"}
    with configured(way, "empty", props, tmp_path / way):
        catalog = load_catalog("empty", pool_pre_ping=value, uri=value)  # type: ignore[arg-type]
    assert catalog.engine.pool._pre_ping is True
    catalog.engine.dispose()


def test_a_worker_with_its_own_client_key_pair_uses_it_whole(tmp_path: Path) -> None:
    """A worker's own key pair was recognised under the withheld secret's own prefix only. pyiceberg documents
    ``client.access-key-id`` / ``client.secret-access-key`` as the AWS key pair for the catalog and S3 FileIO alike
    (PyArrowFileIO takes ``s3.*`` first, then ``client.*``). A worker host configured with its own ``client.*`` pair
    still got the parent's carried ``s3.access-key-id`` paired with its own ``client.secret-access-key``: a pair that
    exists nowhere (access denied on the first read)."""
    from pyiceberg.io import AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, S3_ACCESS_KEY_ID, S3_SECRET_ACCESS_KEY
    from pyiceberg.utils.properties import get_first_property_value

    name = "cpair"
    payload = pickled_with_a_key_pair(tmp_path, name)
    with configured("env", name, {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db",
                                  "client.access-key-id": "trainer-key", "client.secret-access-key": "trainer-secret"},
                    tmp_path / "worker"):
        props = pickle.loads(payload).io.properties
        used = (get_first_property_value(props, S3_ACCESS_KEY_ID, AWS_ACCESS_KEY_ID),
                get_first_property_value(props, S3_SECRET_ACCESS_KEY, AWS_SECRET_ACCESS_KEY))  # as PyArrowFileIO picks
        assert used == ("trainer-key", "trainer-secret")


@pytest.mark.services
def test_a_catalog_outage_in_a_worker_with_its_own_key_pair_is_not_called_a_missing_credential(tmp_path: Path) -> None:
    """review3: StreamRef.catalog() turns any construction failure into a ConfigError "the pickled stream did not carry
    X" when a withheld setting is not configured here, even a transient one. A worker with its own key pair (no session
    token: long-lived keys) reopening a stream whose parent used temporary credentials (key id, secret, session token)
    needs no ``s3.session-token``, yet a catalog database that refuses connections for the moment is reported as a
    missing session token to configure, and no longer counts as transient."""
    from lakestream_iceberg.connect.diagnose import transient

    ref = StreamRef("outage", (("type", "sql"), ("uri", f"postgresql+psycopg2://postgres@127.0.0.1:{_closed_port()}/x"),
                               ("s3.access-key-id", "producer-key")), "ns.s",
                    (("s3.secret-access-key", "producer-secret"), ("s3.session-token", "producer-token")))
    with configured("env", "outage", {"s3.access-key-id": "trainer-key", "s3.secret-access-key": "trainer-secret"},
                    tmp_path / "worker"):
        with pytest.raises(Exception) as here:  # the process that holds the secrets: the outage as such
            ref.catalog()
        unpickled = pickle.loads(pickle.dumps(ref))
        with pytest.raises(Exception) as info:
            unpickled.catalog()
        assert "s3.session-token" not in str(info.value)
        assert type(info.value) is type(here.value) and transient(info.value) == transient(here.value)


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
