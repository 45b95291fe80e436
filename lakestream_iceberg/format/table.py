"""The handle every part below the facade works on: one stream's Iceberg table, its parsed ``lakestream.*`` config,
its payload schema and the shared manifest caches.

:class:`~lakestream_iceberg.stream.Stream` (the facade) extends it with producers, checkpoints, GC and history; the
write, read and lifecycle packages take a ``StreamTable`` and never import the facade, so each can be used and tested
on its own, and dependencies point one way.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import cached_property
from typing import TypeVar

import pyarrow as pa
from pyiceberg.io import FileIO
from pyiceberg.manifest import DataFile
from pyiceberg.schema import index_by_name
from pyiceberg.serializers import FromInputFile
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot

from lakestream_iceberg.connect.fork import fork_safe_io
from lakestream_iceberg.connect.integers import INT32_MAX, INT32_MIN, parse_int
from lakestream_iceberg.connect.pointer import refresh_if_moved
from lakestream_iceberg.errors import (
    ConfigError,
    CorruptStateError,
    ForeignSnapshotError,
    LakestreamError,
    MissingFileError,
    NotAStreamError,
    SchemaMismatchError,
    StepError,
)
from lakestream_iceberg.format.checkpoints import Checkpoint, list_checkpoints
from lakestream_iceberg.format.checks import MAX_STEP, check_branch, check_int
from lakestream_iceberg.format.index import StepIndex
from lakestream_iceberg.format.layout import (
    LAYOUT_PACKED,
    PROP_LAYOUT,
    PROP_VERSION,
    PROP_WORLD_SIZE,
    RANK_COLUMN,
    StreamConfig,
    check_format_version,
    file_schema,
    layout_of_spec,
)
from lakestream_iceberg.format.lineage import branch_state, is_lakestream
from lakestream_iceberg.format.manifest_cache import ManifestCache, shared_cache
from lakestream_iceberg.format.manifests import ManifestPlanner
from lakestream_iceberg.format.properties import ARROW_SCHEMA, HOW, LAYOUT, PREVIOUS_VERSIONS_MAX, WORLD_SIZE
from lakestream_iceberg.format.summary import StreamState, missing_step_error

PROP_ARROW_SCHEMA = ARROW_SCHEMA.key
MAIN = "main"

__all__ = ["MAIN", "PROP_ARROW_SCHEMA", "StreamTable", "after_gc", "check_fixed", "check_layout", "check_metadata_log_size",
           "decode_schema", "encode_schema", "missing_file_error"]

T = TypeVar("T")


def after_gc(attempt: Callable[[], T], *, refresh: Callable[[], object], again: Callable[[], T] | None = None) -> T:
    """``attempt()``, and once more on the current head when lifecycle GC deleted a file of the view it used.

    A view of the table that predates a GC commit may list a manifest, a manifest list or a data file that GC has
    deleted since (``FileNotFoundError``). Every reader and writer handles that the same way, here: ``refresh()`` the
    view, then run ``again()`` (default: ``attempt`` itself) once. A retained step is then found; a collected one raises
    its ``StepCollectedError`` from the fresh view.

    Raises:
        MissingFileError: The fresh view still lists a file that storage does not have: it was deleted outside
            lakestream (not by GC).
    """
    try:
        return attempt()
    except FileNotFoundError:
        refresh()
    try:
        return (again or attempt)()
    except MissingFileError:
        raise
    except FileNotFoundError as exc:
        raise missing_file_error(exc) from exc


def missing_file_error(exc: FileNotFoundError) -> MissingFileError:
    """The error for a file the current head lists that storage does not have (``exc``: storage's own)."""
    return MissingFileError(
        f"a file that the stream's current head lists is missing from storage ({exc}); lifecycle GC did not delete it "
        "(the head read again still lists it): an orphan-file cleanup that did not exclude the stream's folders, a "
        "bucket lifecycle rule or a manual delete did. Restore it from a backup or the bucket's object versions (docs/"
        "guide/other-engines.md lists what orphan-file tools must exclude); until then the steps and commits that "
        "need it fail"
    )


def check_layout(metadata: TableMetadata, config: StreamConfig, *, stream: str) -> None:
    """Refuse (:class:`ConfigError`) a table whose default partition spec no longer implements the stream's layout.

    Another engine may evolve the spec of a live stream (Spark's ``ALTER TABLE ... ADD PARTITION FIELD``, pyiceberg's
    ``update_spec``): lakestream's files carry ``(_step, _rank)`` (packed: ``(_step,)``) as their partition, and a commit
    writes them with the table's default spec, so it is checked when a stream is opened and before every commit."""
    check_format_version(metadata.properties, stream=stream)  # a newer lakestream_iceberg may upgrade a live stream
    implemented = layout_of_spec(metadata.spec(), metadata.schema())
    if implemented == config.layout:
        if implemented == LAYOUT_PACKED and RANK_COLUMN not in {f.name for f in metadata.schema().fields}:
            raise ConfigError(
                f"stream {stream} has the packed layout, whose data files store each row's rank in the column "
                f"{RANK_COLUMN}, but its table schema no longer has that column: another engine or a person dropped or "
                f"renamed it, and lakestream's files cannot be written without it (nor read by rank by other engines). "
                f"Rename it back (Spark: ALTER TABLE ... RENAME COLUMN NAME TO {RANK_COLUMN}; pyiceberg: "
                f"table.update_schema().rename_column(NAME, {RANK_COLUMN!r}).commit()), or add it again if it was dropped "
                f"(an int column named {RANK_COLUMN})"
            )
        return
    raise ConfigError(
        f"stream {stream} has {PROP_LAYOUT}={config.layout!r} but its partition spec ({metadata.spec()}) implements "
        f"{implemented}: the layout is fixed when a stream is created; set {PROP_LAYOUT} back to {implemented!r} and do "
        "not evolve the partition spec"
        if implemented else
        f"stream {stream} has a partition spec ({metadata.spec()}) that is not a lakestream layout (identity _step, "
        "then identity _rank unless packed): another engine or a person evolved it (e.g. ALTER TABLE ... ADD PARTITION "
        "FIELD, pyiceberg's update_spec) or renamed its _step/_rank columns, and lakestream's files cannot be written "
        "with it. Restore the spec (Spark: ALTER TABLE ... DROP PARTITION FIELD for each field added; pyiceberg: "
        "table.update_spec().remove_field(NAME).commit()) or the column names"
    )


_FIXED = (WORLD_SIZE, LAYOUT, ARROW_SCHEMA)  # the properties a stream's files and readers are laid out by


def check_fixed(properties: Mapping[str, str], opened: Mapping[str, str | None], *, stream: str,
                left: str = "nothing is committed") -> None:
    """Refuse (:class:`ConfigError`) a table whose world size, layout or payload schema another engine changed or
    removed since the stream was opened with ``opened`` (their values then): they are fixed when a stream is created,
    and a producer that went on with the old values while processes opening the stream take the new ones would write
    steps of two shapes into one stream. Checked before every commit, and by a follower whenever the head's metadata
    changes (``left``: what the caller does not do, for the message); a value written differently that reads the same
    (``' 2'``) is no change."""
    for prop in _FIXED:
        raw, was = properties.get(prop.key), opened.get(prop.key)
        if raw == was:
            continue
        try:
            if raw is not None and prop.get({prop.key: raw}) == prop.get({prop.key: was} if was is not None else {}):
                continue
        except ConfigError:
            pass
        back = prop.format(prop.get({prop.key: was} if was is not None else {}))  # type: ignore[arg-type]
        done = "removed it" if raw is None else f"set it to {_short(raw)}"
        raise ConfigError(
            f"stream {stream}: table property {prop.key} was {_short(back)} when the stream was opened, and another "
            f"engine or a person {done}: it is fixed when a stream is created and the published steps are laid out by "
            f"it, so {left}. Set it back (pyiceberg: table.transaction().set_properties("
            f"{{{prop.key!r}: {back!r}}}).commit_transaction(); Spark: ALTER TABLE ... SET TBLPROPERTIES), and open the "
            "stream again in every process that opened it since"
        )


def check_metadata_log_size(properties: Mapping[str, str], *, stream: str) -> None:
    """Refuse (:class:`ConfigError`) a ``write.metadata.previous-versions-max`` that is no integer (written by a tool
    that does not parse it, e.g. an edited metadata.json or a REST catalog's update): every commit parses it when it
    writes the metadata log, pyiceberg's with ``int()`` (each attempt would fail with a ``ValueError``), Spark's and
    Trino's with Java's ``Integer.parseInt``, which also refuses what ``int()`` takes (``" 5"``, ``"5_000"``). Parsed
    as Java parses it (:func:`parse_int`, an int's range); an empty value is the default, below 1 is 1."""
    raw = properties.get(PREVIOUS_VERSIONS_MAX.key)
    if not raw:
        return
    if parse_int(raw, minimum=INT32_MIN, maximum=INT32_MAX) is None:
        raise ConfigError(
            f"stream {stream} has table property {PREVIOUS_VERSIONS_MAX.key}={raw!r}, which is not an integer as "
            "Iceberg reads one (ASCII digits with an optional leading '-' or '+', no spaces or underscores, at most "
            f"{INT32_MAX}): commits that write the table's metadata log fail on it (Spark's and Trino's, and "
            "pyiceberg's where Python's int() refuses it too); nothing is committed. Set it to a number of metadata "
            f"files (Iceberg's default: 100) or remove it; {HOW}"
        )


def _lost_properties_error(table: Table, missing: list[str]) -> CorruptStateError:
    """The error for a stream (it has some of its identity properties, or snapshots lakestream wrote) that lacks
    ``missing``: another engine removed them. Names the values the newest earlier metadata files held (at most 20
    read), every one where they differ (another engine may have changed a value before removing it)."""
    held: dict[str, list[str]] = {key: [] for key in missing}
    for entry in list(reversed(table.metadata.metadata_log))[:20]:
        try:
            earlier = FromInputFile.table_metadata(table.io.new_input(entry.metadata_file))
        except Exception:  # noqa: BLE001 - deleted (delete-after-commit) or unreadable: try an older one
            continue
        if earlier.table_uuid != table.metadata.table_uuid:
            continue
        for key, values in held.items():
            if key in earlier.properties and earlier.properties[key] not in values:
                values.append(earlier.properties[key])
    if all(len(values) == 1 for values in held.values()):
        fix = (f"set it back: pyiceberg: table.transaction().set_properties({ {k: v[0] for k, v in held.items()}!r})"
               ".commit_transaction() (the value in the table's earlier metadata)")
    else:
        seen = "; ".join(f"{k}: {', '.join(map(_short, v)) or 'none left'}" for k, v in held.items())
        fix = (f"set it back to the value the stream was created with (pyiceberg: table.transaction().set_properties("
               f"{{...}}).commit_transaction()); the table's earlier metadata, newest first, held {seen}")
    return CorruptStateError(
        f"stream {'.'.join(table.name())} lacks table property {', '.join(missing)} (it has lakestream's other "
        "properties or snapshots, so it is a stream): another engine or a person removed it, and the stream cannot be "
        f"opened without it; {fix}"
    )


def _short(value: str) -> str:
    return repr(value) if len(value) <= 40 else repr(value[:24] + "...")


def encode_schema(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def decode_schema(text: str) -> pa.Schema:
    """The payload schema stored in the ``lakestream.arrow-schema`` table property.

    Raises:
        CorruptStateError: The property is not a base64 Arrow schema (it was edited by hand or damaged).
    """
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True)))
    except (ValueError, TypeError, pa.ArrowException) as exc:  # binascii.Error is a ValueError
        raise CorruptStateError(
            f"table property {PROP_ARROW_SCHEMA} is not a base64 Arrow schema ({type(exc).__name__}): it was edited by "
            "hand or damaged; set it back to the value lakestream wrote (it is in every earlier metadata.json of the "
            "table)"
        ) from exc


class StreamTable:
    """One stream's table as the parts below the facade see it.

    Args:
        table: The pyiceberg table (any catalog); its metadata is refreshed in place.
        cache: Manifest caches (default: the process-wide one bounded at the stream's
            ``lakestream.manifest.cache-bytes``, shared by every stream of the process with the same bound).

    Raises:
        NotAStreamError: ``table`` is a plain Iceberg table without the ``lakestream.*`` properties.
        ConfigError: ``table`` is no pyiceberg ``Table``, or ``cache`` no ``ManifestCache``.
    """

    def __init__(self, table: Table, *, cache: ManifestCache | None = None) -> None:
        if not isinstance(table, Table):
            raise ConfigError(f"a stream is made of a pyiceberg Table, got {type(table).__name__} {table!r}"[:200]
                              + "; open one with Stream.open(catalog, 'namespace.name')")
        if cache is not None and not isinstance(cache, ManifestCache):
            raise ConfigError(f"cache must be a ManifestCache (or None for the process-wide one), got "
                              f"{type(cache).__name__}")
        props = table.metadata.properties
        missing = [key for key in (PROP_VERSION, PROP_WORLD_SIZE, PROP_ARROW_SCHEMA) if key not in props]
        if missing and (len(missing) < 3 or any(is_lakestream(s) for s in table.metadata.snapshots)):
            raise _lost_properties_error(table, missing)
        if missing:
            raise NotAStreamError(
                f"table {'.'.join(table.name())} is a plain Iceberg table, not a lakestream stream (no "
                f"{PROP_VERSION}/{PROP_WORLD_SIZE} properties); create one with Stream.create()"
            )
        self.table = table
        fork_safe_io(table.io)  # FsspecFileIO: a forked child makes file systems of its own (connect/fork.py)
        self.config = StreamConfig.from_properties(props, stream=".".join(table.name()))
        check_layout(table.metadata, self.config, stream=".".join(table.name()))
        self.cache = cache or shared_cache(self.config.manifest_cache_bytes)
        self.payload_arrow_schema: pa.Schema = decode_schema(props[PROP_ARROW_SCHEMA])
        self.fixed = {prop.key: props.get(prop.key) for prop in _FIXED}  # as opened (see check_fixed)
        self._payload_checked: int | None = None  # the table schema id the payload was last checked against
        # the field id of each column and nested field (by its dotted name) the stream's data files are written with
        # (set when its writer is made)
        self.written_ids: dict[str, int] | None = None

    @property
    def name(self) -> str:
        return ".".join(self.table.name())

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def io(self) -> FileIO:
        return self.table.io

    @cached_property
    def index(self) -> StepIndex:
        return StepIndex(io=self.io, cache=self.cache)

    def manifest_planner(self, metadata: TableMetadata, *, publishing: bool = False) -> ManifestPlanner:
        """A planner for one new snapshot's manifests, configured from the stream's properties.

        ``publishing``: the snapshot publishes data files this stream's producers wrote (a producer's commit), which
        the table's payload schema must still describe; a checkpoint, GC or repair writes none, and is not refused for
        a payload column another engine dropped or added again (readers go on reading the published steps).

        Raises:
            ConfigError: Another engine evolved the partition spec since the stream was opened (see
                :func:`check_layout`): the new snapshot's files would be written with a spec they do not fit.
            SchemaMismatchError: ``publishing``, and another engine dropped, renamed or retyped a payload column (see
                :func:`~lakestream_iceberg.format.layout.file_schema`).
        """
        check_layout(metadata, self.config, stream=self.name)
        check_fixed(metadata.properties, self.fixed, stream=self.name)
        check_metadata_log_size(metadata.properties, stream=self.name)
        if publishing and metadata.current_schema_id != self._payload_checked:
            # a payload column another engine dropped, renamed or retyped: what making a producer refuses, refused
            # here too for producers (and streams) made before the change, whose writer kept the schema of then
            now = file_schema(metadata.schema(), self.config.layout, self.payload_arrow_schema, stream=self.name)
            written = self.written_ids
            moved = sorted(name for name, field_id in index_by_name(now).items()
                           if written is not None and name in written and written[name] != field_id)
            if moved:  # dropped and added again under the same name: Iceberg readers would read these files' values
                raise SchemaMismatchError(  # as nulls of the new column (they match columns by field id)
                    f"the table schema of {self.name} has other columns named {moved} than this stream's producers "
                    "write (other field ids: dropped and added again by another engine); nothing is committed. Open "
                    "the stream again (Stream.open) and make its producers from it to write the new columns"
                )
            self._payload_checked = metadata.current_schema_id
        return ManifestPlanner(io=self.io, metadata=metadata, cache=self.cache, fanout=self.config.merge_fanout,
                               max_merge_entries=self.config.max_merge_entries)

    def refresh(self) -> StreamTable:
        """Bring the table metadata up to date; on SQL catalogs it is read only when the catalog pointer moved.

        Raises:
            ConfigError: The stream's ``lakestream.format-version`` is one this release does not read (a newer
                lakestream_iceberg upgraded it since it was opened): what the refreshed view lists would be misread.
                Checked on every call, not only when the metadata moved: the refused view keeps the new metadata.
        """
        refresh_if_moved(self.table)
        check_format_version(self.table.metadata.properties, stream=self.name)
        return self

    def head(self, *, branch: str = MAIN) -> Snapshot | None:
        return self.table.metadata.snapshot_by_name(branch)

    def state(self, *, branch: str = MAIN, refresh: bool = True) -> StreamState:
        """The lakestream state (head step, producers) of a branch's head snapshot."""
        if refresh:
            self.refresh()
        state = self.branch_state(branch=branch)  # shared per process, read-only producers: the caller gets its own dict
        return replace(state, producers=dict(state.producers))

    def branch_state(self, *, branch: str = MAIN, metadata: TableMetadata | None = None) -> StreamState:
        """The state of a branch in the current view (or ``metadata``), found under snapshots of other engines that
        change no data (:mod:`lakestream_iceberg.format.lineage`); read-only, no I/O.

        Raises:
            ForeignSnapshotError: Another engine changed the branch's data; ``Stream.repair()`` brings it back.
        """
        if not isinstance(branch, str):  # pyiceberg reads None as main and any other non-name as no branch: step 0
            raise ConfigError(f"branch must be a branch name of {self.name} (a string such as 'main'), got "
                              f"{type(branch).__name__} {branch!r}")
        metadata = metadata if metadata is not None else self.table.metadata
        return branch_state(metadata, metadata.snapshot_by_name(branch), stream=self.name, branch=branch)

    def require_branch(self, branch: object, *, doing: str, error: type[LakestreamError] = ConfigError) -> str:
        """``branch`` when it is a branch of the stream, else ``error`` (``doing`` starts its message). A name the
        current view does not show as a branch is looked up again on a refreshed view first: another process may have
        forked it since this view was read."""
        try:
            return check_branch(self.table.metadata, branch, stream=self.name, doing=doing, error=error)
        except LakestreamError:
            if not isinstance(branch, str):
                raise
            self.refresh()
            return check_branch(self.table.metadata, branch, stream=self.name, doing=doing, error=error)

    def head_step(self, *, branch: str = MAIN) -> int:
        """The newest published step of ``branch`` (0 when nothing is published).

        Raises:
            ConfigError: The stream has no branch or checkpoint of that name (a typo read as a branch with no step).
        """
        self.refresh()
        state = self.branch_state(branch=branch)
        self.require_ref(branch, doing="no head step of")
        return state.step

    def require_ref(self, branch: object, *, doing: str) -> None:
        """Refuse a ``branch`` the table has no ref of (``main`` always is one): pyiceberg reads it as a branch with
        no snapshot, so a misspelt name read as an empty branch, and waiting on it waited out any timeout. A
        checkpoint's tag is left to the caller (reading at a tag reads what it pins)."""
        if isinstance(branch, str) and branch != MAIN and branch not in self.table.metadata.refs:
            self.require_branch(branch, doing=doing)

    def checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint of the stream (all branches), oldest step first."""
        self.refresh()
        return list_checkpoints(self.table.metadata)

    def locate(self, step: int, *, branch: str = MAIN) -> list[DataFile]:
        """The data files of ``step`` (one per rank, ordered by rank; packed layout: one).

        A view that predates a GC commit may list manifests GC already deleted; the lookup then refreshes and retries
        on the current head, so a retained step is always found and a collected one raises ``StepCollectedError``;
        ``step`` must be an integer >= 1 (``StepError``).
        """
        step = check_int(step, what="step", error=StepError, minimum=1, maximum=MAX_STEP, hint="steps start at 1")
        try:
            self.branch_state(branch=branch)  # refuses a head whose data another engine changed...
        except ForeignSnapshotError:
            self.refresh()  # ...unless the view is older than a repair
            self.branch_state(branch=branch)
        files = after_gc(lambda: self.index.files(self.head(branch=branch), step), refresh=self.refresh)
        if not files:
            state = self.state(branch=branch, refresh=True)
            files = self.index.files(self.head(branch=branch), step)
            if not files:
                self.require_ref(branch, doing="cannot read")
                raise missing_step_error(step, state, branch, self.name)
        return files
