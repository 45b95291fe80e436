"""Every table property a stream reads, declared once: its key, type, default, unit, bounds, when a change takes
effect, and what it means.

A stream is configured by Iceberg table properties: lakestream's own under ``lakestream.`` (dashed keys, like Iceberg's
``commit.retry.num-retries``) and the Iceberg ones lakestream honours (``history.expire.*``, ``write.metadata.*``,
``write.parquet.*``, ``write.avro.*``). Each is one :class:`Property` in :data:`PROPERTIES`; parsing and checking
(:meth:`Property.get`, :meth:`Property.check`), :class:`~lakestream_iceberg.format.layout.StreamConfig` (one attribute
per declaration with a ``field``), the properties a new stream is created with, ``lakestream status`` and
``docs/configuration.md`` (``python -m lakestream_iceberg.tools.config_doc``) all come from this list.

Durations are stored in milliseconds, as Iceberg's ``*-ms`` properties are; :meth:`DurationProperty.seconds` is the one
place they become seconds, and the code works in seconds (``StreamConfig.commit_timeout_s``, ...).

Example:
    >>> COMMIT_TIMEOUT.get({"lakestream.commit.timeout-ms": "1500"}), COMMIT_TIMEOUT.seconds(1500)
    (1500, 1.5)
    >>> GROUP_COMMIT.get({})
    True
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import ClassVar, Generic, TypeVar

from lakestream_iceberg.connect.integers import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, parse_int
from lakestream_iceberg.errors import ConfigError
from lakestream_iceberg.format.checks import check_int

__all__ = [
    "ARROW_SCHEMA", "AVRO_CODEC", "COMMIT_MAX_ATTEMPTS", "COMMIT_TIMEOUT", "CONFIG_FIELDS", "CONSUMERS_RETENTION",
    "DELETE_AFTER_COMMIT",
    "FORMAT_VERSION", "GC_ENABLED", "GC_GRACE", "GROUP_COMMIT", "GROUP_MAX_BATCHES", "GROUP_STAGING", "HOW", "IO_RETRY_TIMEOUT",
    "LAYOUT", "LAYOUTS", "LAYOUT_PACKED", "LAYOUT_PER_RANK", "MANIFEST_CACHE_BYTES", "MAX_MERGE_ENTRIES",
    "MAX_SNAPSHOT_AGE", "MERGE_FANOUT", "MIN_SNAPSHOTS_TO_KEEP", "PACKED_ROW_GROUP_BYTES", "PARQUET_CODEC",
    "PARQUET_DICT_SIZE", "PARQUET_LEVEL", "PARQUET_PAGE_ROWS", "PARQUET_PAGE_SIZE", "PREVIOUS_VERSIONS_MAX",
    "PROPERTIES", "RETAIN_LAST", "RETAIN_MAX", "STAGINGS", "STAGING_AUTO", "STAGING_CATALOG", "STAGING_STORAGE",
    "WORLD_SIZE", "BoolProperty", "Change", "ChoiceProperty", "DurationProperty", "IntProperty", "Property",
    "TextProperty", "by_key", "check_properties",
]

T = TypeVar("T", int, bool, str)

HOW = ("change it with pyiceberg: table.transaction().set_properties({...}) or .remove_properties(...), then "
       ".commit_transaction(); a new stream takes it in Stream.create(properties={...})")


class Change(Enum):
    """When a changed value takes effect on a stream that producers and readers already have open."""

    LIVE = "yes, from the next commit"
    REOPEN = "yes, when the stream is next opened"
    FIXED = "no, fixed when the stream is created"

    @property
    def short(self) -> str:
        """A few words, for tables."""
        return {Change.LIVE: "next commit", Change.REOPEN: "on reopen", Change.FIXED: "no"}[self]


@dataclass(frozen=True, kw_only=True)
class Property(Generic[T]):
    """One table property.

    Attributes:
        key: The property's name.
        doc: One line: what it means.
        change: When a changed value takes effect (:class:`Change`).
        default: What an absent property means (None: no default, see ``default_text``).
        created: What ``Stream.create`` writes unless the caller gives a value (None: ``default`` for a property with a
            ``field``, nothing for one without).
        default_by: Whose default ``default`` is: ``lakestream``, ``Iceberg`` or ``pyarrow``.
        default_text: The default in words, where ``default`` alone would mislead (None: ``default``).
        field: The :class:`~lakestream_iceberg.format.layout.StreamConfig` attribute that holds the parsed value.
        unit: What the number counts (``ms``, ``bytes``, ...); empty for strings and booleans.
        blank_is_default: A value of only spaces means the default (Iceberg's writer properties), not a bad value.
    """

    kind: ClassVar[str] = ""

    key: str
    doc: str
    change: Change
    default: T | None = None
    created: T | None = None
    default_by: str = "lakestream"
    default_text: str | None = None
    field: str | None = None
    unit: str = ""
    blank_is_default: bool = False

    def parse(self, raw: str) -> T:
        """The value of a property string; :class:`ConfigError` naming the property and the fix."""
        raise NotImplementedError

    def check(self, value: object, *, what: str | None = None) -> T:
        """A Python value given for the property (``StreamConfig(...)``), checked as its type: a bool is no integer."""
        raise NotImplementedError

    def format(self, value: T) -> str:
        """``value`` as the property string."""
        return str(value)

    def get(self, properties: Mapping[str, str]) -> T | None:
        """The property's value in ``properties`` (a table's), or its default when absent."""
        raw = properties.get(self.key)
        if raw is None or self.blank_is_default and not str(raw).strip():
            return self.default
        if not isinstance(raw, str):
            raise self._refuse(raw, "is not a string; table properties are strings")
        return self.parse(raw)

    @property
    def own(self) -> bool:
        """A ``lakestream.*`` property (else one of Iceberg's that lakestream honours)."""
        return self.key.startswith("lakestream.")

    @property
    def initial(self) -> T | None:
        """The value a new stream gets when the caller gives none."""
        return self.created if self.created is not None else self.default

    def bounds(self) -> str:
        """The values it takes, in words (for the docs)."""
        return ""

    def words(self, value: T) -> str:
        """``value`` for people: the property string, with sizes and durations also in their larger units."""
        return self.format(value)

    def absent_words(self) -> str:
        """What an absent property means, in a few words (``lakestream status``)."""
        if self.default is not None:
            return self.words(self.default)
        return self.default_text or "none"

    def default_words(self) -> str:
        """The default for people: what a new stream gets, and what an absent property means where that differs."""
        if self.default_text is not None:
            return self.default_text
        whose = "" if self.default_by == "lakestream" else f", {self.default_by}'s"
        if self.default is None:
            return "none" if self.created is None else self.words(self.created)
        if self.created is not None and self.created != self.default:
            return f"{self.words(self.created)} (absent: {self.words(self.default)}{whose})"
        return self.words(self.default) + (f" ({self.default_by}'s)" if whose else "")

    def _refuse(self, raw: object, why: str) -> ConfigError:
        return ConfigError(f"table property {self.key}={raw!r} {why}; {HOW}")


@dataclass(frozen=True, kw_only=True)
class IntProperty(Property[int]):
    """An integer, within ``minimum`` and ``maximum`` (inclusive; None: a long's bound), written as Iceberg's Java
    engines read one (:func:`~lakestream_iceberg.connect.integers.parse_int`): Spark or Trino would fail on a value
    Python's ``int()`` alone takes (``" 5"``, ``"5_000"``)."""

    kind: ClassVar[str] = "integer"
    minimum: int | None = None
    maximum: int | None = None

    def parse(self, raw: str) -> int:
        value = parse_int(raw)
        if value is None:
            raise self._refuse(raw, f"is not an integer as Iceberg's engines read one: write it in ASCII digits with "
                                    f"an optional leading '-' or '+', no spaces, underscores or other characters, at most "
                                    f"{self.maximum if self.maximum is not None else INT64_MAX} (e.g. "
                                    f"'{self.default if self.default is not None else max(self.minimum or 0, 1)}')")
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"table property {self.key}={value} must be >= {self.minimum}; {HOW}")
        if self.maximum is not None and value > self.maximum:
            raise ConfigError(f"table property {self.key}={value} must be <= {self.maximum}; {HOW}")
        return value

    def check(self, value: object, *, what: str | None = None) -> int:
        return check_int(value, what=what or self.key, minimum=INT64_MIN if self.minimum is None else self.minimum,
                         maximum=INT64_MAX if self.maximum is None else self.maximum)

    def words(self, value: int) -> str:
        if self.unit == "bytes":
            for shift, name in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
                if value >= 1 << shift and value % (1 << shift) == 0:
                    return f"{value:,} ({value >> shift} {name})"
        return f"{value:,}"

    def bounds(self) -> str:
        if self.minimum is None and self.maximum is None:
            return "any integer"
        if self.maximum is None:
            return f">= {self.minimum:,}"
        return f"<= {self.maximum:,}" if self.minimum is None else f"{self.minimum:,} to {self.maximum:,}"


@dataclass(frozen=True, kw_only=True)
class DurationProperty(IntProperty):
    """A duration in milliseconds (Iceberg's ``*-ms`` convention); the code reads it in seconds (:meth:`seconds`)."""

    kind: ClassVar[str] = "duration"
    unit: str = "ms"

    @staticmethod
    def seconds(milliseconds: int) -> float:
        """The one conversion of a duration property to seconds."""
        return milliseconds / 1000

    def timedelta(self, milliseconds: int) -> timedelta:
        return timedelta(seconds=self.seconds(milliseconds))

    def words(self, value: int) -> str:
        seconds = self.seconds(value)
        for size, name in ((3600, "h"), (60, "min"), (1, "s")):
            if seconds >= size and seconds % size == 0:
                return f"{value:,} ({seconds / size:g} {name})"
        return f"{value:,}"


@dataclass(frozen=True, kw_only=True)
class BoolProperty(Property[bool]):
    """``true`` or ``false`` (any case)."""

    kind: ClassVar[str] = "boolean"

    def parse(self, raw: str) -> bool:
        value = raw.strip().lower()
        if value not in ("true", "false"):
            raise self._refuse(raw, "is not a boolean; set it to 'true' or 'false'")
        return value == "true"

    def check(self, value: object, *, what: str | None = None) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{what or self.key} must be a bool, got {value!r}")
        return value

    def format(self, value: bool) -> str:
        return "true" if value else "false"

    def bounds(self) -> str:
        return "true, false"


@dataclass(frozen=True, kw_only=True)
class ChoiceProperty(Property[str]):
    """One of ``choices`` (exact spelling); ``noun`` names what a choice is in messages (``a layout``)."""

    kind: ClassVar[str] = "choice"
    choices: tuple[str, ...] = ()
    noun: str = "a valid value"

    def parse(self, raw: str) -> str:
        if raw not in self.choices:
            raise self._refuse(raw, f"is not {self.noun}: use one of {', '.join(self.choices)}")
        return raw

    def check(self, value: object, *, what: str | None = None) -> str:
        if value not in self.choices:
            raise ConfigError(f"{what or self.key} must be one of {', '.join(map(repr, self.choices))}, got {value!r}")
        return str(value)

    def bounds(self) -> str:
        return ", ".join(self.choices)


@dataclass(frozen=True, kw_only=True)
class TextProperty(Property[str]):
    """A string; ``lower`` reads it stripped and lower-cased (codec names). ``values`` describes what it takes; the
    code that uses it checks it (a codec: by a trial write)."""

    kind: ClassVar[str] = "string"
    lower: bool = False
    values: str = ""

    def parse(self, raw: str) -> str:
        return raw.strip().lower() if self.lower else raw

    def check(self, value: object, *, what: str | None = None) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{what or self.key} must be a string, got {value!r}")
        return self.parse(value)

    def bounds(self) -> str:
        return self.values


LAYOUT_PER_RANK, LAYOUT_PACKED = "per-rank", "packed"
LAYOUTS = (LAYOUT_PER_RANK, LAYOUT_PACKED)
# Where group commit's staged intents are kept (write/intent_store.py): "catalog" (rows of a SQL catalog's database),
# "storage" (files under the table's data/_staging/), "auto" (the catalog where it has an intent table, else storage)
STAGING_AUTO, STAGING_CATALOG, STAGING_STORAGE = "auto", "catalog", "storage"
STAGINGS = (STAGING_AUTO, STAGING_CATALOG, STAGING_STORAGE)

LIVE, REOPEN, FIXED = Change.LIVE, Change.REOPEN, Change.FIXED

# -- the stream's shape: fixed when it is created ---------------------------------------------------------------------
FORMAT_VERSION = ChoiceProperty(
    key="lakestream.format-version", created="1", change=FIXED, choices=("1",), noun="a format version this release reads",
    doc="The version of lakestream's table layout; Stream.create writes it and a table without it is no stream. A "
        "version this release does not read (a newer release made or upgraded the stream) is refused when the "
        "stream is opened and whenever the table is read again (a commit, a follower's poll, a read of a new step, a "
        "producer's next seq, GC): upgrade lakestream_iceberg (docs/guide/hosts.md, \"Upgrading\").")
WORLD_SIZE = IntProperty(
    key="lakestream.world-size", field="world_size", minimum=1, maximum=INT32_MAX, unit="ranks", change=FIXED,
    default_text="none: Stream.create(world_size=...) sets it", doc="Ranks (shards) in every global batch.")
ARROW_SCHEMA = TextProperty(
    key="lakestream.arrow-schema", change=FIXED, values="a base64 Arrow IPC schema",
    default_text="none: Stream.create(schema=...) sets it",
    doc="The payload schema of a sample; producers write exactly these columns.")
LAYOUT = ChoiceProperty(
    key="lakestream.layout", field="layout", default=LAYOUT_PER_RANK, choices=LAYOUTS, noun="a layout", change=FIXED,
    default_text="packed from world size 8 on, else per-rank (absent: per-rank)",
    doc="per-rank: one data file per rank and step, a rank reads exactly its bytes; packed: one data file per step.")
PACKED_ROW_GROUP_BYTES = IntProperty(
    key="lakestream.layout.packed.row-group-bytes", field="packed_row_group_bytes", default=256 << 10, minimum=1,
    unit="bytes", change=REOPEN,
    doc="Packed layout: consecutive ranks share a row group of up to this many bytes (a larger rank is one alone).")

# -- retention: what every commit keeps in table metadata, read from the metadata each commit plans on ---------------
RETAIN_LAST = IntProperty(
    key="lakestream.snapshots.retain-last", field="retain_snapshots", default=8, minimum=2, unit="snapshots",
    change=LIVE, doc="Snapshots of each branch every commit keeps; older untagged ones are expired in the same commit.")
RETAIN_MAX = IntProperty(
    key="lakestream.snapshots.retain-max", field="retain_max", default=2_000, minimum=2, unit="snapshots",
    change=LIVE, doc="The most snapshots per branch that history.expire.max-snapshot-age-ms keeps (bounds metadata).")
MAX_SNAPSHOT_AGE = DurationProperty(
    key="history.expire.max-snapshot-age-ms", field="retain_max_age_ms", default=0, minimum=0, change=LIVE,
    default_text="0: off (Iceberg's 5 days are not applied by lakestream's commits)",
    doc="Snapshots younger than this are kept too (up to retain-max), for other engines' streaming readers.")
MIN_SNAPSHOTS_TO_KEEP = IntProperty(
    key="history.expire.min-snapshots-to-keep", default=1, created=2, default_by="Iceberg", minimum=1, maximum=INT32_MAX,
    unit="snapshots", change=LIVE,
    doc="Raises (never lowers) retain-last; 2 keeps a lakestream snapshot under Spark's expire_snapshots.")

# -- manifests ------------------------------------------------------------------------------------------------------
MERGE_FANOUT = IntProperty(
    key="lakestream.manifest.merge-fanout", field="merge_fanout", default=16, minimum=2, unit="manifests",
    change=REOPEN, doc="Manifests of one level merged into one of the next level (bounds the manifest list).")
MAX_MERGE_ENTRIES = IntProperty(
    key="lakestream.manifest.max-merge-entries", field="max_merge_entries", default=4096, minimum=1, unit="entries",
    change=REOPEN, doc="No merge rewrites more manifest entries than this (bounds the slowest commit).")
MANIFEST_CACHE_BYTES = IntProperty(
    key="lakestream.manifest.cache-bytes", field="manifest_cache_bytes", default=64 << 20, minimum=0, unit="bytes",
    change=REOPEN, doc="Bound of the process-wide cache of manifests (an estimate of the Python objects); 0 keeps none.")

# -- commits ------------------------------------------------------------------------------------------------------------
COMMIT_TIMEOUT = DurationProperty(
    key="lakestream.commit.timeout-ms", field="commit_timeout_ms", default=300_000, minimum=1, change=REOPEN,
    doc="Wall-clock budget of one commit() call, retries included; at most half of lakestream.gc.grace-period-ms.")
COMMIT_MAX_ATTEMPTS = IntProperty(
    key="lakestream.commit.max-attempts", field="commit_max_attempts", default=1_000, minimum=1, unit="attempts",
    change=REOPEN, doc="Attempt budget of one commit() call.")
GROUP_COMMIT = BoolProperty(
    key="lakestream.commit.group.enabled", field="group_commit", default=True, change=REOPEN,
    doc="Group commit: a producer that is not alone stages its batch and one swap publishes every staged batch.")
GROUP_MAX_BATCHES = IntProperty(
    key="lakestream.commit.group.max-batches", field="group_max_batches", default=32, minimum=1, unit="batches",
    change=REOPEN, doc="The most batches one group commit publishes (bounds one commit's critical section).")
GROUP_STAGING = ChoiceProperty(
    key="lakestream.commit.group.staging", field="group_staging", default=STAGING_STORAGE, created=STAGING_AUTO,
    choices=STAGINGS, noun="a staging place", change=REOPEN,
    default_text="auto, stored as what it resolves to (absent: storage)",
    doc="Where staged batches wait: catalog (rows of a SQL catalog's database) or storage (files under data/_staging/); "
        "change it only while no producer runs.")

# -- lifecycle and I/O ------------------------------------------------------------------------------------------------
GC_GRACE = DurationProperty(
    key="lakestream.gc.grace-period-ms", field="gc_grace_ms", default=3_600_000, minimum=0, change=REOPEN,
    doc="GC never deletes an unreferenced file younger than this; at least 2 x lakestream.commit.timeout-ms.")
GC_ENABLED = BoolProperty(
    key="gc.enabled", default=True, default_by="Iceberg", change=LIVE,
    doc="false (Iceberg: the files may be shared with other tables): lakestream gc refuses to run, as Spark's "
        "expire_snapshots and remove_orphan_files do (dry runs still report), and Stream.drop(purge=True) refuses.")
CONSUMERS_RETENTION = DurationProperty(
    key="lakestream.consumers.retention-ms", default=604_800_000, minimum=60_000, change=REOPEN,
    doc="A consumer group's recorded positions are deleted once none of its ranks has reported for this long.")
IO_RETRY_TIMEOUT = DurationProperty(
    key="lakestream.io.retry-timeout-ms", field="io_retry_timeout_ms", default=120_000, minimum=0, change=REOPEN,
    doc="How long data-file writes and reads retry a transient storage failure before the error propagates.")

# -- Iceberg's metadata and file settings -------------------------------------------------------------------------------
PREVIOUS_VERSIONS_MAX = IntProperty(
    key="write.metadata.previous-versions-max", default=100, created=16, default_by="Iceberg", minimum=1, maximum=INT32_MAX,
    unit="files", change=LIVE, doc="Old metadata.json files listed in the metadata log.")
DELETE_AFTER_COMMIT = BoolProperty(
    key="write.metadata.delete-after-commit.enabled", default=False, created=True, default_by="Iceberg",
    change=LIVE, doc="Delete the metadata.json files that drop out of the metadata log.")
PARQUET_CODEC = TextProperty(
    key="write.parquet.compression-codec", default="zstd", default_by="Iceberg", lower=True, blank_is_default=True,
    values="uncompressed, snappy, gzip, brotli, lz4, zstd", change=REOPEN,
    doc="Compression of the data files (checked by a trial write when a producer starts).")
PARQUET_LEVEL = IntProperty(
    key="write.parquet.compression-level", default_by="pyarrow", default_text="the codec's", blank_is_default=True,
    minimum=INT32_MIN, maximum=INT32_MAX,
    change=REOPEN, doc="Compression level of the data files; only for codecs that have levels.")
PARQUET_PAGE_SIZE = IntProperty(
    key="write.parquet.page-size-bytes", default_by="pyarrow", default_text="pyarrow's (1 MiB)", minimum=1,
    maximum=INT32_MAX, unit="bytes", blank_is_default=True, change=REOPEN,
    doc="Target size of a data page in the data files.")
PARQUET_DICT_SIZE = IntProperty(
    key="write.parquet.dict-size-bytes", default_by="pyarrow", default_text="pyarrow's (1 MiB)", minimum=1,
    maximum=INT32_MAX, unit="bytes", blank_is_default=True, change=REOPEN,
    doc="Size of a column's dictionary page before the writer falls back to plain encoding.")
PARQUET_PAGE_ROWS = IntProperty(
    key="write.parquet.page-row-limit", default_by="pyarrow", default_text="pyarrow's", minimum=1, maximum=INT32_MAX,
    unit="rows", blank_is_default=True, change=REOPEN,
    doc="The most rows in a data page (needs pyarrow >= 23; ignored before).")
AVRO_CODEC = TextProperty(
    key="write.avro.compression-codec", default="gzip", default_by="Iceberg", lower=True, blank_is_default=True,
    values="uncompressed, gzip, zstd, snappy (pyiceberg[snappy])", change=LIVE,
    doc="Compression of the manifests and manifest lists.")

PROPERTIES: tuple[Property[int] | Property[bool] | Property[str], ...] = (
    FORMAT_VERSION, WORLD_SIZE, ARROW_SCHEMA, LAYOUT, PACKED_ROW_GROUP_BYTES,
    RETAIN_LAST, RETAIN_MAX, MAX_SNAPSHOT_AGE, MIN_SNAPSHOTS_TO_KEEP,
    MERGE_FANOUT, MAX_MERGE_ENTRIES, MANIFEST_CACHE_BYTES,
    COMMIT_TIMEOUT, COMMIT_MAX_ATTEMPTS, GROUP_COMMIT, GROUP_MAX_BATCHES, GROUP_STAGING,
    GC_GRACE, GC_ENABLED, CONSUMERS_RETENTION, IO_RETRY_TIMEOUT,
    PREVIOUS_VERSIONS_MAX, DELETE_AFTER_COMMIT,
    PARQUET_CODEC, PARQUET_LEVEL, PARQUET_PAGE_SIZE, PARQUET_DICT_SIZE, PARQUET_PAGE_ROWS, AVRO_CODEC,
)  # fmt: skip
"""Every table property a stream reads, in the order the docs list them."""

CONFIG_FIELDS: dict[str, Property[int] | Property[bool] | Property[str]] = {p.field: p for p in PROPERTIES if p.field}
"""StreamConfig attribute -> its declaration."""

_BY_KEY = {p.key: p for p in PROPERTIES}


def check_properties(properties: Mapping[str, str]) -> None:
    """Parse every declared property in ``properties`` (a new stream's), and refuse a ``lakestream.*`` key that is not
    declared (a typo would otherwise be ignored without a word).

    Raises:
        ConfigError: The first bad value, or an unknown ``lakestream.*`` key (with the nearest known ones).
    """
    for key in properties:
        if key.startswith("lakestream.") and key not in _BY_KEY:
            near = difflib.get_close_matches(key, [p.key for p in PROPERTIES if p.own], n=2)
            raise ConfigError(f"table property {key} is not a lakestream property"
                              + (f"; did you mean {' or '.join(near)}?" if near else "")
                              + " (docs/configuration.md lists them all)")
    for prop in PROPERTIES:
        prop.get(properties)


def by_key(key: str) -> Property[int] | Property[bool] | Property[str] | None:
    """The declaration of a property key (None: not one lakestream reads)."""
    return _BY_KEY.get(key)


if len(_BY_KEY) != len(PROPERTIES) or len(CONFIG_FIELDS) != sum(1 for p in PROPERTIES if p.field):
    raise AssertionError("a table property or StreamConfig field is declared twice")
