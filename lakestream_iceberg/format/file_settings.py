"""The data and manifest file settings of a stream's table: pyiceberg's own writer properties (``write.parquet.*``,
``write.avro.compression-codec``), mapped to what pyarrow's Parquet writer and pyiceberg's Avro writer take, and checked
by them (a trial write or compression in memory), so that a setting they refuse is a :class:`ConfigError` before
anything is written instead of a raw library error in every commit."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.schema import Schema

from lakestream_iceberg.errors import ConfigError
from lakestream_iceberg.format.properties import (
    AVRO_CODEC,
    HOW,
    PARQUET_CODEC,
    PARQUET_DICT_SIZE,
    PARQUET_LEVEL,
    PARQUET_PAGE_ROWS,
    PARQUET_PAGE_SIZE,
)

__all__ = ["avro_codec", "parquet_options", "statistics_plan"]

log = logging.getLogger(__name__)

_PAGE_ROWS = "max_rows_per_page" in inspect.signature(pq.ParquetWriter.__init__).parameters

# Iceberg's Parquet writer properties (pyiceberg's TableProperties) that apply to lakestream's files, declared in
# format/properties.py. Not applicable: write.parquet.row-group-size-bytes and write.parquet.row-group-limit (a
# per-rank file is one row group; a packed file groups ranks by lakestream.layout.packed.row-group-bytes) and the
# bloom filter options (pyiceberg writes none).
_CODEC, _LEVEL = PARQUET_CODEC.key, PARQUET_LEVEL.key
_INT_OPTIONS = {  # declaration -> pyarrow ParquetWriter argument
    PARQUET_LEVEL: "compression_level",
    PARQUET_PAGE_SIZE: "data_page_size",
    PARQUET_DICT_SIZE: "dictionary_pagesize_limit",
    PARQUET_PAGE_ROWS: "max_rows_per_page",  # rows per page (pyarrow's write_batch_size is not that)
}
_LEVELLESS = frozenset({"none", "snappy"})  # codecs that take no level


def parquet_options(properties: Mapping[str, str], *, strict: bool = True) -> dict[str, Any]:
    """The ``pq.ParquetWriter`` arguments for a table's ``write.parquet.*`` properties, checked by pyarrow itself (a
    trial write in memory): a codec, level or size it refuses is a :class:`ConfigError` before any data is written,
    not a failure of every commit.

    The codec defaults to zstd (pyiceberg's default) and accepts Iceberg's ``uncompressed``; an unset property keeps
    pyarrow's default. A level given with a codec that takes none (uncompressed, snappy) is refused when ``strict``
    (a stream being created) and otherwise ignored with a warning, as Iceberg's writers ignore it: a table another
    client configured keeps working. ``write.parquet.page-row-limit`` needs pyarrow's ``max_rows_per_page``
    (pyarrow >= 23); with an older pyarrow it is ignored with a warning.
    """
    codec = PARQUET_CODEC.get(properties) or "zstd"
    options: dict[str, Any] = {"compression": "none" if codec == "uncompressed" else codec}
    given = {_CODEC: properties[_CODEC]} if _CODEC in properties else {}
    for prop, argument in _INT_OPTIONS.items():
        value = prop.get(properties)
        if value is None:
            continue
        if argument == "max_rows_per_page" and not _PAGE_ROWS:
            log.warning("table property %s is ignored: pyarrow %s cannot limit the rows of a page", prop.key, pa.__version__)
            continue
        options[argument] = value
        given[prop.key] = properties[prop.key]
    if "compression_level" in options and options["compression"] in _LEVELLESS:
        if strict:
            raise ConfigError(f"table property {_LEVEL}={given[_LEVEL]!r} is given, but codec {codec!r} takes no level; "
                              f"remove it or pick a codec that has levels (gzip, zstd, brotli, lz4); {HOW}")
        log.warning("table property %s=%r is ignored: codec %r takes no level", _LEVEL, given[_LEVEL], codec)
        del options["compression_level"]
        del given[_LEVEL]
    try:  # pyarrow is the judge (some codecs refuse a level only when they compress): one tiny file in memory
        probe = pa.table({"x": pa.array(range(64), pa.int64())})
        with pq.ParquetWriter(pa.BufferOutputStream(), schema=probe.schema, **options) as writer:
            writer.write_table(probe)
    except (pa.ArrowException, OSError, ValueError, TypeError, OverflowError) as exc:
        settings = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ConfigError(
            f"pyarrow cannot write Parquet with the table's settings {settings} ({exc}). Use a codec pyarrow supports "
            f"(uncompressed, snappy, gzip, brotli, lz4, zstd), a level that codec accepts and sizes it can hold; {HOW}"
        ) from exc
    return options


def avro_codec(properties: Mapping[str, str]) -> str:
    """The codec of the manifests, from the table's ``write.avro.compression-codec`` (default gzip; Iceberg's
    ``uncompressed`` is Avro's ``null``), as pyiceberg's Avro writer names it. A codec it does not know, or one whose
    library is not installed (snappy needs ``pyiceberg[snappy]``), is a :class:`ConfigError`: pyiceberg would fail
    every commit with a raw error while writing its manifests."""
    from pyiceberg.avro.codecs import CODEC_MAPPING_ICEBERG_TO_AVRO, KNOWN_CODECS

    raw = properties.get(AVRO_CODEC.key)
    codec = AVRO_CODEC.get(properties) or "gzip"
    codec = "null" if codec == "uncompressed" else codec
    known = KNOWN_CODECS.get(CODEC_MAPPING_ICEBERG_TO_AVRO.get(codec, codec), False)  # type: ignore[call-overload]
    if known is False:
        names = sorted({*CODEC_MAPPING_ICEBERG_TO_AVRO, *KNOWN_CODECS, "uncompressed"} - {"deflate", "zstandard"})
        raise ConfigError(f"table property {AVRO_CODEC.key}={raw!r} is not a codec pyiceberg writes manifests with; use one "
                          f"of {', '.join(names)} ({HOW})")
    if known is not None:
        try:
            known.compress(b"lakestream")
        except Exception as exc:  # noqa: BLE001 - e.g. ImportError: the codec's library is not installed
            raise ConfigError(f"table property {AVRO_CODEC.key}={raw!r} cannot be used here: {exc}. Install what it names, "
                              f"or use another codec ({HOW})") from exc
    return codec


_METRICS_DEFAULT = "write.metadata.metrics.default"
_METRICS_COLUMN = "write.metadata.metrics.column."


def statistics_plan(schema: Schema, properties: Mapping[str, str]) -> dict[int, Any]:
    """The column statistics a data file of ``schema`` records in its manifest entry (pyiceberg's plan, from the
    table's ``write.metadata.metrics.default`` and ``write.metadata.metrics.column.<name>``, as pyiceberg's own writer
    reads them). A metrics mode pyiceberg does not know (not none, counts, full or truncate(N) with N >= 1) is a
    :class:`ConfigError` naming the property, not pyiceberg's raw ValueError from every producer."""
    from pyiceberg.io.pyarrow import compute_statistics_plan, match_metrics_mode

    try:
        return compute_statistics_plan(schema, dict(properties))
    except ValueError as exc:
        bad = []
        for key, value in properties.items():
            if key == _METRICS_DEFAULT or key.startswith(_METRICS_COLUMN):
                try:
                    match_metrics_mode(value)
                except ValueError:
                    bad.append(f"{key}={value!r}")
        raise ConfigError(
            f"table propert{'ies' if len(bad) > 1 else 'y'} {', '.join(bad) or _METRICS_DEFAULT} "
            f"cannot be used: {exc}. A metrics mode is none, counts, full or truncate(N) with N >= 1; {HOW}"
        ) from exc
