"""``docs/configuration.md``, written from the declarations of :mod:`lakestream_iceberg.format.properties`.

Run ``python -m lakestream_iceberg.tools.config_doc > docs/configuration.md`` after changing a declaration;
``tests/format/test_configuration_doc.py`` fails while the page and the declarations disagree.
"""

from __future__ import annotations

import sys

from lakestream_iceberg.connect.integers import INT32_MAX, INT64_MAX
from lakestream_iceberg.format.layout import GRACE_PER_COMMIT_TIMEOUT, PACKED_FROM_WORLD_SIZE
from lakestream_iceberg.format.properties import COMMIT_TIMEOUT, GC_GRACE, PROPERTIES, Change, Property

__all__ = ["main", "render", "row"]

_HEADER = "| Property | Default | Unit | Values | Change on a live stream | Meaning |"
_RULE = "|---|---|---|---|---|---|"

_INTRO = f"""\
# Configuration

A stream is an Iceberg table, and it is configured the Iceberg way: by table properties. lakestream's own are under
`lakestream.` (dashed keys, like Iceberg's `commit.retry.num-retries`); it also honours a few of Iceberg's
(`history.expire.*`, `write.metadata.*`, `write.parquet.*`, `write.avro.*`). Every property it reads is listed
below. The catalog a stream lives in is configured as for pyiceberg (last section).

This page is generated from the declarations in `lakestream_iceberg/format/properties.py` by
`python -m lakestream_iceberg.tools.config_doc > docs/configuration.md`; a test fails when the two disagree.

## Setting a property

- **A new stream**: `Stream.create(catalog, "ns.name", schema=..., world_size=..., properties={{...}})`, values as
  strings (`{{"lakestream.snapshots.retain-last": "64"}}`). A value lakestream cannot use, or a `lakestream.*` key it
  does not know, is a `ConfigError` naming the property, before anything is created.
- **An existing stream**: any Iceberg client, e.g. pyiceberg's `table.transaction().set_properties({{...}})` then
  `.commit_transaction()`, or Spark's `ALTER TABLE ... SET TBLPROPERTIES (...)`. A stream whose property holds a
  value lakestream cannot use is refused with a `ConfigError` naming it. `Stream.create` on a stream that exists
  opens it and changes none of its properties: a value it asks for that no stream can use is a `ConfigError`, and
  one the stream holds another value of is a `StreamExistsError` naming both (pass the stream's values, or change
  them as above).
- **What a stream uses now**: `lakestream status NAMESPACE.NAME` lists every property below with its value.

"Change on a live stream" says when a new value takes effect for producers and readers that have the stream open:

- *{Change.LIVE.value}*: every commit reads it from the table metadata it is planned on, so every
  producer uses the new value from its next commit;
- *{Change.REOPEN.value}*: read by `Stream.open` (and `Stream.create`); a process that has the
  stream open keeps the value it read until it opens the stream again;
- *{Change.FIXED.value}*: part of how the stream is laid out; do not change it.

Integers are written as Iceberg's Java engines (Spark, Trino) read them with `Integer.parseInt` / `Long.parseLong`:
ASCII digits with an optional leading `-` or `+`, no spaces, underscores or other characters (`"5_000"` and `" 5"`,
which Python's `int()` takes, are refused with a `ConfigError` naming the property), at most {INT32_MAX:,} where
Iceberg reads an int (its `write.*` and `history.expire.min-snapshots-to-keep`) and {INT64_MAX:,}
elsewhere. Durations are milliseconds, as in Iceberg's `*-ms` properties. Two rules span properties: the **GC grace rule**,
`{GC_GRACE.key}` >= {GRACE_PER_COMMIT_TIMEOUT} x `{COMMIT_TIMEOUT.key}` (a stream that breaks it is refused:
GC could delete the files of a batch a commit may still publish), and `history.expire.min-snapshots-to-keep` raises
`lakestream.snapshots.retain-last` when larger. `Stream.create` picks the `packed` layout from world size
{PACKED_FROM_WORLD_SIZE} on unless `lakestream.layout` is given.
"""

_ICEBERG_NOTES = """\
Dictionary encoding: pyarrow tries a dictionary for every column and falls back to plain only once the dictionary
outgrows its page; unlike parquet-java it never checks whether the dictionary saves anything. lakestream writes two
kinds of column without one, per data file: the numbers of a list column (token ids, embeddings: a dictionary only
maps numbers to smaller numbers and hashes every value; steps of 256 rows of token ids commit with 0.6-0.8x the
producer CPU without it, and their zstd files are 14% smaller: `benchmarks/file_encoding.py`) and a binary or string
column whose values average 1 KiB or more in the file (images, serialized tensors). Every other column keeps pyarrow's dictionary. Readers see plain Parquet either way.

A data file whose size differs from what its manifest entry records is refused on read (`CorruptStateError`), as every
Iceberg reader finds the footer from that size.

Not read: `commit.retry.*` (lakestream's commit loop owns every retry of its commits and never commits through
pyiceberg's retrying commit; these stay at Iceberg's defaults for other engines' commits),
`write.parquet.row-group-size-bytes` and `write.parquet.row-group-limit` (a per-rank data file is one row group; a
packed one groups ranks by `lakestream.layout.packed.row-group-bytes`) and the bloom filter options (pyiceberg writes
none).
"""

_CATALOG = """\
## Catalog settings

A catalog is whatever pyiceberg's `load_catalog(name)` returns, and `lakestream_iceberg.load_catalog(name, **properties)`
is that function with clearer errors, so a catalog is configured exactly as for pyiceberg:

- `.pyiceberg.yaml` in `$PYICEBERG_HOME`, else in the home directory, under `catalog:` then the catalog's name;
- environment variables `PYICEBERG_CATALOG__<NAME>__<KEY>`, which override the file: `__` in the key stands for `.`
  and `_` for `-`, so `PYICEBERG_CATALOG__PROD__S3__ACCESS_KEY_ID` is `s3.access-key-id` of catalog `prod`;
- keyword arguments, which override both (an empty one, `None` or `''`, leaves the configured setting in effect).

Without a name, `load_catalog()` loads pyiceberg's default catalog: the one `default-catalog` names (in the file, or
`PYICEBERG_DEFAULT_CATALOG`), else the catalog called `default`.

pyiceberg reads `PYICEBERG_CATALOG__PROD__POOL_PRE_PING` as `pool-pre-ping`, while its SQL catalog reads only
`pool_pre_ping`; lakestream maps the dashed spelling of every underscore key the SQL catalog reads back to its name,
so a setting means the same in the file, the environment and the arguments. A setting that would have no effect
(a SQLAlchemy engine option such as `pool_size`, which pyiceberg's SQL catalog does not pass on) and a `type` that
names no catalog type are a `ConfigError` (`lakestream_iceberg/connect/catalog_settings.py`), and so is a FileIO
property spelt with other separators, which pyiceberg drops (`s3-secret-access-key`, what
`PYICEBERG_CATALOG__PROD__S3_SECRET_ACCESS_KEY` sets). pyiceberg reads every
`_` of a variable's catalog name as `-` too: `PYICEBERG_CATALOG__MY_CAT__URI` configures catalog `my-cat`, never
`my_cat`, so `load_catalog("my_cat")` refuses such variables with a `ConfigError` rather than ignore them; name the
catalog `my-cat`.

Catalog properties lakestream reads: `lakestream.sqlite.wal` (SQLite catalogs: `true`, the default, puts the
database in write-ahead-log mode; `false` leaves it as it is), and for REST catalogs
`rest.client.connection-timeout-ms` (default 10 s) and `rest.client.socket-timeout-ms` (default 60 s), the request
timeouts pyiceberg 0.12 does not set. Any other catalog property under `lakestream.` (a misspelling, or a table
property set on the catalog, which configures no stream) is a `ConfigError` when a stream is created or opened.

The `lakestream` command line takes `--catalog NAME` (loaded as above) or, without it, uses an embedded SQLite
catalog at `<home>/catalog.db` with its warehouse at `<home>/warehouse`, where `<home>` is `--home DIR`, else
`$LAKESTREAM_HOME`, else `./.lakestream`. `lakestream demo` makes the home; the other commands refuse a home that
holds no catalog yet (a misspelt `--home`).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else "-"


def row(prop: Property[int] | Property[bool] | Property[str]) -> str:
    """One property's line of the page's tables."""
    return (f"| `{prop.key}` | {_cell(prop.default_words())} | {_cell(prop.unit)} | {_cell(prop.bounds())} "
            f"| {prop.change.value} | {_cell(prop.doc)} |")


def render() -> str:
    """The whole page."""
    own = [row(p) for p in PROPERTIES if p.own]
    iceberg = [row(p) for p in PROPERTIES if not p.own]
    parts = [
        _INTRO,
        "## lakestream properties\n",
        "\n".join([_HEADER, _RULE, *own]) + "\n",
        "## Iceberg properties lakestream reads\n",
        "The default is Iceberg's (or pyarrow's, where Iceberg leaves it to the writer) unless it says otherwise; "
        "where lakestream sets\na property when it creates a stream, the default names that value and what an absent "
        "property means.\n",
        "\n".join([_HEADER, _RULE, *iceberg]) + "\n",
        _ICEBERG_NOTES,
        _CATALOG,
    ]
    return "\n".join(parts)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
