"""Creating a stream's table, and checking a ``Stream.create`` call against a stream that exists already.

:func:`create_table` makes the Iceberg table of a new stream: the payload schema converted to Iceberg's (refused with
a :class:`~lakestream_iceberg.errors.SchemaMismatchError` where Iceberg cannot hold it), the layout's partition spec,
and the table properties (lakestream's defaults, the caller's, the payload's Arrow schema), each checked before
anything is made; the namespace is created when missing (and dropped again, while empty, when the table cannot be
created), and group commit's staging resolved where it can live.
:func:`check_existing` refuses a call that asks an existing stream for another world size, schema, layout or property
value: ``Stream.create`` opens such a stream as it is and never changes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import (
    BadRequestError,
    NamespaceAlreadyExistsError,
    NoSuchNamespaceError,
    TableAlreadyExistsError,
)
from pyiceberg.io.pyarrow import UnsupportedPyArrowTypeException
from pyiceberg.schema import Schema, assign_fresh_schema_ids
from pyiceberg.table import Table

from lakestream_iceberg.connect.catalog_settings import env_name
from lakestream_iceberg.connect.diagnose import explain, redact, transient
from lakestream_iceberg.connect.integers import INT32_MAX, parse_int
from lakestream_iceberg.connect.sql_tables import tables_under
from lakestream_iceberg.connect.sqlite import prefer_wal
from lakestream_iceberg.connect.storage import list_folder
from lakestream_iceberg.errors import ConfigError, SchemaMismatchError, StreamExistsError
from lakestream_iceberg.format.file_settings import avro_codec, parquet_options, statistics_plan
from lakestream_iceberg.format.layout import (
    LAYOUT_PACKED,
    LAYOUT_PER_RANK,
    PACKED_FROM_WORLD_SIZE,
    PROP_GROUP_STAGING,
    PROP_LAYOUT,
    StreamConfig,
    partition_spec,
)
from lakestream_iceberg.format.manifests import WRITABLE_FORMAT_VERSIONS
from lakestream_iceberg.format.properties import STAGING_AUTO, WORLD_SIZE, by_key, check_properties
from lakestream_iceberg.format.table import PROP_ARROW_SCHEMA, StreamTable, encode_schema
from lakestream_iceberg.write.intent_store import resolve_staging

__all__ = ["check_existing", "check_property_strings", "create_table", "drop_namespace_if_empty"]

log = logging.getLogger(__name__)


def check_property_strings(properties: object) -> None:
    """Refuse ``properties`` that are no dict of strings to strings (None: none given)."""
    if properties is not None and (not isinstance(properties, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in properties.items())):
        raise ConfigError(f"properties must be a dict of strings to strings (table properties, e.g. "
                          f"{{'lakestream.snapshots.retain-last': '64'}}), got {properties!r}")


def create_table(catalog: Catalog, identifier: str | tuple[str, ...], *, schema: pa.Schema, arrow: pa.Schema,
                 world_size: int, location: str | None, properties: dict[str, str] | None) -> Table:
    """The new stream's table (``arrow``: ``schema`` as the table holds it, with the layout's columns).

    Raises:
        TableAlreadyExistsError: Another process created a table of that name meanwhile (pyiceberg's).
        SchemaMismatchError: Iceberg (format version 2) cannot hold a payload column.
        ConfigError: A property holds a value the stream cannot use, says another world size or schema than the
            arguments, or the location (or the catalog's warehouse) is no folder the catalog's FileIO can write.
    """
    try:
        iceberg_schema = assign_fresh_schema_ids(Catalog._convert_schema_if_needed(arrow))  # noqa: SLF001
    except (UnsupportedPyArrowTypeException, ValueError) as exc:  # e.g. timestamp[ns], pa.null(), duration
        raise SchemaMismatchError(
            f"the payload schema is not one Iceberg (format version 2) can hold: {exc}. Cast that column to a "
            "type it can (timestamps in us, int64 for durations, a concrete type for null) or rename the field "
            "(struct fields a and a, a column 'a.b' beside a struct a's field b) before creating the stream"
        ) from exc
    layout = LAYOUT_PACKED if world_size >= PACKED_FROM_WORLD_SIZE else LAYOUT_PER_RANK
    props = StreamConfig(world_size=world_size, layout=layout).to_properties()
    # the newest version pyiceberg writes, asked for explicitly: a REST catalog may default to one it does not (3)
    props["format-version"] = str(WRITABLE_FORMAT_VERSIONS[-1])
    if properties is not None:
        _check_given_shape(properties, world_size=world_size, schema=schema)
        _check_format_version(properties)
        props.update(properties)
    props[PROP_ARROW_SCHEMA] = encode_schema(schema)
    check_properties(props)  # validate the caller's overrides before creating anything
    config = StreamConfig.from_properties(props)
    parquet_options(props, strict=True)  # and the data and manifest file settings (write.parquet.*, write.avro.*)
    avro_codec(props)
    statistics_plan(iceberg_schema, props)  # and the column statistics' metrics modes
    prefer_wal(catalog)  # before the intent table is made: its connections sync less only in WAL mode
    name = identifier if isinstance(identifier, str) else ".".join(identifier)
    props[PROP_GROUP_STAGING] = resolve_staging(catalog, config.group_staging, name=name)
    namespace = Catalog.namespace_from(identifier)

    def make() -> Table:
        if location is None:  # the catalog's default place, which may lie inside a stream given a namespace's folder
            default = _default_location(catalog, namespace, identifier)
            if default is not None:
                refuse_occupied_location(catalog, default, name=name, default=True)
        return _create(catalog, identifier, name=name, schema=iceberg_schema, layout=config.layout, location=location,
                       properties=props)

    if location is not None:
        refuse_occupied_location(catalog, location, name=name)
    try:
        return _in_namespace(catalog, namespace, make)
    except NoSuchNamespaceError:  # another create made the namespace, failed and dropped it again between this call's
        return _in_namespace(catalog, namespace, make)  # check and its table: make it once more


def _default_location(catalog: Catalog, namespace: tuple[str, ...], identifier: str | tuple[str, ...]) -> str | None:
    """Where ``catalog`` puts a table created without a location, where this process can tell: a catalog that keeps its
    tables' locations itself (pyiceberg's SQL, Glue, Hive, DynamoDB catalogs: ``warehouse/namespace/name``, or under
    the namespace's ``location``); None for a REST catalog, whose server chooses, or when it cannot be told."""
    from pyiceberg.catalog import MetastoreCatalog

    if not isinstance(catalog, MetastoreCatalog) or not namespace:
        return None
    try:
        return catalog._resolve_table_location(  # noqa: SLF001 - the location create_table gives the table
            None, Catalog.namespace_to_string(namespace), Catalog.table_name_from(identifier))
    except Exception:  # noqa: BLE001 - no warehouse set, a namespace not readable now: the create says which
        return None


def refuse_occupied_location(catalog: Catalog, location: str, *, name: str, default: bool = False) -> None:
    """Refuse (:class:`ConfigError`) a location given to a new stream that holds anything but a table's ``data`` and
    ``metadata`` folders, or lies inside another table's folder: lifecycle GC deletes every file under a stream's
    location that its own snapshots do not reference, so a stream made at the warehouse's root (or a namespace's
    folder) deleted every table's data and metadata below it at its first GC, and one inside another table's folder had
    its files deleted by that table's GC. A location holding only ``data`` and ``metadata`` is taken: a dropped stream's
    (its files stay unless purged), which the new stream's GC then removes; a live table's there (one renamed keeps
    its location) is refused where the catalog's rows tell it (a pyiceberg SQL catalog: :func:`tables_under`).
    Best effort: storage a FileIO lists (pyarrow's, fsspec's); a location that cannot be listed is left to the create.
    ``default``: ``location`` is the catalog's default place for the table (no ``location=`` given), which lies inside
    another table's folder where a stream was given a namespace's folder while it was empty."""
    from pyiceberg.io import load_file_io

    try:
        io = load_file_io(dict(catalog.properties), location)
    except (OSError, ValueError):  # no FileIO for the scheme: the create says which
        return
    held = list_folder(io, location)
    if held is None:
        return
    scheme, found, path = location.partition("://")
    if not found:
        scheme, path = "", location
    path = path.rstrip("/")
    table_above = None
    while path.strip("/").count("/") > (0 if scheme in ("file", "") else 1):  # up to the root or the bucket
        path = path.rsplit("/", 1)[0]
        parent = f"{scheme}://{path}" if found else path
        if any(name.endswith(".metadata.json") for name in list_folder(io, f"{parent}/metadata") or ()):
            table_above = parent
            break
    # a table's own folders (a dropped table's, whose location a new stream may take over) are data/ and metadata/
    foreign = sorted(name for name in held if name not in ("data", "metadata"))
    where = f"at {location}" + (" (the catalog's default location for it)" if default else "")
    outside = "pass location= a folder" if default else "give the stream a folder"
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ConfigError(
            f"cannot create stream {name} {where}: the location holds {shown}, and lifecycle GC deletes every "
            "file under a stream's location that the stream does not reference (other tables' data and metadata "
            f"too); {outside} of its own that is empty or does not exist yet"
            + ("" if default else ", or leave location out"))
    # a live table's folder (taken for a dropped one's before); the very table this create makes, made by another
    # process since this one looked (Stream.create at every producer's start), is left to the create: it opens it
    live = [t for t in tables_under(catalog, location) or () if t != name] if held else None
    if live:
        raise ConfigError(
            f"cannot create stream {name} {where}: the location holds the files of {', '.join(live[:5])}, "
            f"{'a table' if len(live) == 1 else 'tables'} of this catalog (a table renamed keeps its location), and "
            f"each stream's lifecycle GC deletes every file under its location that it does not reference; {outside} "
            "of its own that is empty or does not exist yet" + ("" if default else ", or leave location out"))
    if table_above is not None:
        raise ConfigError(
            f"cannot create stream {name} {where}: it lies inside the folder of another table ({table_above} "
            "holds table metadata), whose lifecycle GC (or another engine's orphan-file removal) would delete the "
            f"stream's files; {outside} outside every table's location" + ("" if default else ", or leave location out"))


def _in_namespace(catalog: Catalog, namespace: tuple[str, ...], make: Callable[[], Table]) -> Table:
    """``make()``'s table in ``namespace``, created first when missing, and dropped again (while empty) when this call
    created it and ``make`` failed."""
    created = bool(namespace) and _create_namespace(catalog, namespace)
    try:
        return make()
    except TableAlreadyExistsError:
        raise  # another process's table: the namespace is no longer this call's to remove
    except Exception:
        if created:
            drop_namespace_if_empty(catalog, namespace)
        raise


def _create_namespace(catalog: Catalog, namespace: tuple[str, ...]) -> bool:
    """Create ``namespace`` unless it exists; whether this call created it."""
    try:
        catalog.create_namespace(namespace)
    except NamespaceAlreadyExistsError:
        return False
    except Exception:  # another process created it between the catalog's check and its insert: a SQL
        if not catalog.namespace_exists(namespace):  # catalog raises the database's integrity error
            raise
        return False
    return True


def drop_namespace_if_empty(catalog: Catalog, namespace: tuple[str, ...]) -> None:
    """Remove a namespace ``Stream.create`` made for a table it then failed to create, so that a refused create leaves
    nothing behind. Never one that holds a table: pyiceberg's SQL catalog and REST catalogs refuse to drop a namespace
    that is not empty (``NamespaceNotEmptyError``), which covers another process's table created meanwhile (on a SQL
    catalog one created between its check and its delete keeps its row: a namespace is also every table's). That
    refusal, or any other failure to drop, leaves the namespace as it is: the create's own error is what the caller
    needs."""
    try:
        catalog.drop_namespace(namespace)
    except Exception as exc:  # noqa: BLE001 - not empty (a table created meanwhile), gone already, or unreachable
        log.debug("left namespace %s in place after a failed create: %s", ".".join(namespace), exc)


def _create(catalog: Catalog, identifier: str | tuple[str, ...], *, name: str, schema: Schema, layout: str,
            location: str | None, properties: dict[str, str]) -> Table:
    try:
        return catalog.create_table(identifier, schema=schema, partition_spec=partition_spec(schema, layout),
                                    location=location, properties=properties)
    except BadRequestError as exc:  # a REST catalog refused it (a location outside its warehouse, a property)
        raise ConfigError(f"cannot create stream {name}: the catalog {catalog.name!r} refused the table: "
                          f"{redact(' '.join(str(exc).split())[:300], catalog.properties)}; change what it names (a "
                          "location= inside the catalog's warehouse, or leave location= out) and create it again"
                          ) from None
    except (OSError, ValueError) as exc:  # a file where the folder goes, a scheme no FileIO reads
        if transient(exc) or explain(exc, catalog.properties) is not None:
            raise  # a storage outage or credentials: config_errors explains those
        where = (f"at location {location!r}" if location is not None else
                 f"in catalog {catalog.name!r}'s warehouse {catalog.properties.get('warehouse')!r}")
        fix = ("give a folder (or a prefix) of a storage the catalog's FileIO reaches (s3://bucket/path, "
               "file:///path)" if location is not None else
               f"set warehouse (in .pyiceberg.yaml or {env_name(catalog.name, 'warehouse')}) to a folder (or a "
               "prefix) of a storage the catalog's FileIO reaches, or pass location=")
        error = ConfigError(f"cannot create stream {name} {where}: "
                            f"{redact(' '.join(str(exc).split())[:300], catalog.properties)}; {fix}")
        error.original = exc  # type: ignore[attr-defined]  # not chained: its text is unredacted
        raise error from None


def check_existing(existing: StreamTable, identifier: object, *, schema: pa.Schema, world_size: int,
                   properties: dict[str, str] | None) -> None:
    """Refuse a ``Stream.create`` of ``existing`` that asks for another world size, schema, layout or property value.

    Raises:
        StreamExistsError: Naming what differs (the stream is opened as it is, never changed).
        ConfigError: A property given holds a value no stream can use, or is a ``lakestream.*`` key lakestream does
            not read.
    """
    if existing.world_size != world_size or not existing.payload_arrow_schema.equals(schema):
        raise StreamExistsError(
            f"stream {identifier} already exists with world_size={existing.world_size} and schema "
            f"{existing.payload_arrow_schema}; open it with Stream.open() or create a stream under another name"
        )
    asked = (properties or {}).get(PROP_LAYOUT)
    if asked is not None and asked != existing.config.layout:
        raise StreamExistsError(
            f"stream {identifier} already exists with {PROP_LAYOUT}={existing.config.layout!r}, not {asked!r}: the "
            "layout is fixed when a stream is created; open it with Stream.open() or create a stream under another name"
        )
    if properties is not None:
        _check_format_version(properties)
    differing = _not_applied(properties or {}, existing.table.metadata.properties,
                             format_version=existing.table.metadata.format_version)
    if differing:  # returning the stream as it is ignored them without a word
        raise StreamExistsError(
            f"stream {identifier} already exists with {', '.join(differing)}: Stream.create sets properties only "
            "when it creates the stream. Change them with pyiceberg (table.transaction().set_properties({...})"
            ".commit_transaction(); docs/configuration.md says which take effect on a stream in use), or pass the "
            "stream's values, or create a stream under another name"
        )


def _check_given_shape(properties: dict[str, str], *, world_size: int, schema: pa.Schema) -> None:
    """Refuse ``properties`` that say another world size or schema than the arguments: the property won over the
    argument (a stream of world size 3 made by ``world_size=1``)."""
    given = properties.get(WORLD_SIZE.key)
    if given is not None and WORLD_SIZE.parse(given) != world_size:
        raise ConfigError(f"properties set {WORLD_SIZE.key}={given!r} but world_size={world_size}: pass the world size "
                          f"as world_size= only (leave {WORLD_SIZE.key} out of properties)")
    if PROP_ARROW_SCHEMA in properties and properties[PROP_ARROW_SCHEMA] != encode_schema(schema):
        raise ConfigError(f"properties set {PROP_ARROW_SCHEMA}, which is not the schema= given: pass the schema as "
                          f"schema= only (leave {PROP_ARROW_SCHEMA} out of properties)")


def _check_format_version(properties: dict[str, str]) -> None:
    """Refuse an Iceberg ``format-version`` pyiceberg cannot write manifests and snapshots of (pyiceberg raised its own
    ValidationError for ``9``, and ``x`` was reported as a warehouse that cannot be written)."""
    if "format-version" not in properties:
        return
    given = properties["format-version"]
    if parse_int(given, minimum=0, maximum=INT32_MAX) not in WRITABLE_FORMAT_VERSIONS:
        versions = " or ".join(str(v) for v in WRITABLE_FORMAT_VERSIONS)
        raise ConfigError(f"table property format-version={given!r}: a stream is created at Iceberg format version "
                          f"{versions} (the versions pyiceberg writes); set one of those, or leave format-version out "
                          f"for {WRITABLE_FORMAT_VERSIONS[-1]}")


def _not_applied(given: dict[str, str], current: dict[str, str], *, format_version: int) -> list[str]:
    """``key=current (not given)`` for each property of ``given`` the existing stream does not have (a lakestream or
    Iceberg property it reads: by value, its default standing for an absent one; ``format-version`` against the
    table's ``format_version``, which pyiceberg keeps apart from the properties)."""
    check_properties(given)
    differing = []
    for key, value in given.items():
        prop = by_key(key)
        if key == PROP_GROUP_STAGING and value == STAGING_AUTO:
            continue  # Stream.create stored what "auto" resolved to
        if key == "format-version":
            if parse_int(value, minimum=0, maximum=INT32_MAX) != format_version:
                differing.append(f"{key}={format_version} (not {value!r})")
            continue
        same = prop.get({key: value}) == prop.get(current) if prop is not None else current.get(key) == value
        if not same:
            differing.append(f"{key}={current.get(key)!r} (not {value!r})")
    return differing
