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

from lakestream_iceberg.errors import ConfigError

__all__ = ["AVRO_CODEC", "HOW", "avro_codec", "parquet_options"]

log = logging.getLogger(__name__)

HOW = ("change it with pyiceberg: table.transaction().set_properties({...}) or .remove_properties(...), then "
       ".commit_transaction()")
_PAGE_ROWS = "max_rows_per_page" in inspect.signature(pq.ParquetWriter.__init__).parameters

# Iceberg's Parquet writer properties (pyiceberg's TableProperties) that apply to lakestream's files. Not applicable:
# write.parquet.row-group-size-bytes and write.parquet.row-group-limit (a per-rank file is one row group; a packed file
# groups ranks by lakestream.layout.packed.row-group-bytes) and the bloom filter options (pyiceberg writes none).
_CODEC = "write.parquet.compression-codec"
_LEVEL = "write.parquet.compression-level"
_INT_OPTIONS = {  # table property -> pyarrow ParquetWriter argument
    _LEVEL: "compression_level",
    "write.parquet.page-size-bytes": "data_page_size",
    "write.parquet.dict-size-bytes": "dictionary_pagesize_limit",
    "write.parquet.page-row-limit": "max_rows_per_page",  # rows per page (pyarrow's write_batch_size is not that)
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
    (pyarrow >= 18); with an older pyarrow it is ignored with a warning.
    """
    raw_codec = properties.get(_CODEC)
    codec = "zstd" if raw_codec is None or not str(raw_codec).strip() else str(raw_codec).strip().lower()
    options: dict[str, Any] = {"compression": "none" if codec == "uncompressed" else codec}
    given = {_CODEC: raw_codec} if raw_codec is not None else {}
    for key, argument in _INT_OPTIONS.items():
        raw = properties.get(key)
        if raw is None or not str(raw).strip():
            continue
        try:
            value = int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"table property {key}={raw!r} is not an integer; {HOW}") from None
        if argument != "compression_level" and value < 1:
            raise ConfigError(f"table property {key}={value} must be >= 1; {HOW}")
        if argument == "max_rows_per_page" and not _PAGE_ROWS:
            log.warning("table property %s is ignored: pyarrow %s cannot limit the rows of a page", key, pa.__version__)
            continue
        options[argument] = value
        given[key] = raw
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


AVRO_CODEC = "write.avro.compression-codec"


def avro_codec(properties: dict[str, str]) -> str:
    """The codec of the manifests, from the table's ``write.avro.compression-codec`` (default gzip; Iceberg's
    ``uncompressed`` is Avro's ``null``), as pyiceberg's Avro writer names it. A codec it does not know, or one whose
    library is not installed (snappy needs ``pyiceberg[snappy]``), is a :class:`ConfigError`: pyiceberg would fail
    every commit with a raw error while writing its manifests."""
    from pyiceberg.avro.codecs import CODEC_MAPPING_ICEBERG_TO_AVRO, KNOWN_CODECS

    raw = properties.get(AVRO_CODEC)
    codec = "gzip" if raw is None or not str(raw).strip() else str(raw).strip().lower()
    codec = "null" if codec == "uncompressed" else codec
    known = KNOWN_CODECS.get(CODEC_MAPPING_ICEBERG_TO_AVRO.get(codec, codec), False)  # type: ignore[call-overload]
    if known is False:
        names = sorted({*CODEC_MAPPING_ICEBERG_TO_AVRO, *KNOWN_CODECS, "uncompressed"} - {"deflate", "zstandard"})
        raise ConfigError(f"table property {AVRO_CODEC}={raw!r} is not a codec pyiceberg writes manifests with; use one "
                          f"of {', '.join(names)} ({HOW})")
    if known is not None:
        try:
            known.compress(b"lakestream")
        except Exception as exc:  # noqa: BLE001 - e.g. ImportError: the codec's library is not installed
            raise ConfigError(f"table property {AVRO_CODEC}={raw!r} cannot be used here: {exc}. Install what it names, "
                              f"or use another codec ({HOW})") from exc
    return codec
