"""The files side of lifecycle GC: which files the table's metadata references, and the sweep that deletes the others
under the table's location (see :mod:`lakestream_iceberg.lifecycle.gc` for what is retained and why).

A file that some snapshot references was committed; one that no metadata ever referenced (a crashed producer's
staged shards, a lost compare-and-swap's manifests) may belong to a commit still in flight, so the sweep deletes it only
once it is older than the grace period. Paths compare without their scheme (:func:`norm`).

Ages are the store's clock (:func:`gc_now`): a file's age is its modification time (the store's clock) subtracted from
the earlier of this host's clock and the store's, read once when GC begins, before it reads the head whose files it
keeps. This host's clock alone let a GC host whose clock runs ahead by more than half the grace period less the commit
timeout (25 min with the defaults; nothing at all with the commit timeout at half the grace period) delete the files of
a batch that a producer was publishing; and a "now" read after the head let a commit that landed between the two
lose its files to the same arithmetic.

Deletes run side by side on a thread pool of the sweep's own, sized as pyiceberg sizes its pool (``max-workers`` in
its configuration, ``PYICEBERG_MAX_WORKERS``), a bounded batch at a time: on an object store each delete is a round
trip, and one at a time a GC of 100,000 files took as many round trips in a row. A pool of its own, not pyiceberg's
shared one: a GC that an application runs on that pool (one per stream, fanned out) would wait for deletes queued
behind the very workers that wait. A delete that fails (a bucket policy that refuses deletes, a file made immutable, a
store out of reach) does not stop the others: the sweep counts it (:attr:`Swept.files_failed`), logs one warning
naming the first failure, and the file stays unreferenced for the next GC to delete (once older than the grace
period: no snapshot lists it any more).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyiceberg.io import FileIO
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.utils.concurrent import ExecutorFactory

from lakestream_iceberg.connect.positions import POSITIONS_DIR
from lakestream_iceberg.connect.sql_tables import tables_under
from lakestream_iceberg.connect.storage import (
    CLOCK_PROBE_PREFIX,
    list_files,
    norm,
    store_now,
    unreported_delete_failures,
)
from lakestream_iceberg.format.manifest_facts import entry_step, step_bounds
from lakestream_iceberg.format.producers import PRODUCERS_DIR
from lakestream_iceberg.format.summary import StreamState
from lakestream_iceberg.write.intent import STAGING_DIR

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["Swept", "gc_now", "kept_after_dry_run", "known_files", "norm", "referenced_files", "sweep"]

log = logging.getLogger(__name__)

CLOCK_SKEW_WARN_S = 60.0  # this host's clock and the store's further apart than this: GC says so
DELETE_BATCH = 1_000  # deletes handed to the pool at a time: bounds the futures held, keeps every worker busy


@dataclass(frozen=True, kw_only=True)
class Swept:
    """What a sweep deleted (or, in a dry run, would delete), by kind of file, and the unreferenced files it left to age."""

    files_deleted: dict[str, int]
    bytes_deleted: dict[str, int]
    files_in_grace: int
    files_failed: int = 0
    first_failure: str | None = None
    refused: str | None = None  # why the sweep deleted no file at all (another table keeps metadata in the folder)


def referenced_files(io: FileIO, metadata: TableMetadata, metadata_location: str, stream: StreamTable,
                     skip: frozenset[int] = frozenset()) -> set[str]:
    """Every file (normalised, see :func:`norm`) that the metadata log or a snapshot not in ``skip`` references, and the
    statistics files that the metadata lists (Puffin files of another engine: Spark's compute_table_stats, Trino's
    ANALYZE): no manifest lists them, and Iceberg's orphan removal keeps them. Expiring a snapshot (``skip``: a dry run's
    expiry) drops its table statistics from the metadata; pyiceberg leaves its partition statistics listed."""
    out = {metadata_location, *(e.metadata_file for e in metadata.metadata_log)}
    out.update(s.statistics_path for s in metadata.statistics if s.snapshot_id not in skip)
    out.update(s.statistics_path for s in metadata.partition_statistics)
    seen: set[str] = set()  # retained snapshots share most manifests: each is read once, not once per snapshot
    for snapshot in metadata.snapshots:
        if snapshot.snapshot_id in skip:
            continue
        out.add(snapshot.manifest_list)
        out.update(StreamState.of(snapshot).producer_files)  # producer-state files (format/producers.py)
        for manifest in stream.cache.manifests(io, snapshot):
            if manifest.manifest_path in seen:
                continue
            seen.add(manifest.manifest_path)
            out.add(manifest.manifest_path)
            out.update(e.data_file.file_path for e in stream.cache.entries(io, manifest))
    return {norm(p) for p in out if p}


def kept_after_dry_run(stream: StreamTable, metadata: TableMetadata, metadata_location: str,
                       collected: Mapping[str, tuple[Snapshot, int]], expired: set[int]) -> set[str]:
    """What a real run would leave referenced: retained snapshots, plus the collected heads' surviving steps."""
    keep = referenced_files(stream.io, metadata, metadata_location, stream, skip=frozenset(expired))
    for head, cutoff in collected.values():
        keep.update(norm(p) for p in StreamState.of(head).producer_files)  # the collecting snapshot lists them too
        for manifest in stream.cache.manifests(stream.io, head):
            bounds = step_bounds(manifest)
            whole = bounds is not None and bounds[0] >= cutoff  # a real run keeps it as it is, every entry with it
            if whole:
                keep.add(norm(manifest.manifest_path))
            keep.update(norm(e.data_file.file_path) for e in stream.cache.entries(stream.io, manifest)
                        if whole or (entry_step(e.data_file) or 0) >= cutoff)
    return keep


def _kind(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    if f"/data/{STAGING_DIR}/" in path:
        return "intent"
    if f"/data/{PRODUCERS_DIR}/" in path:
        return "producer-state"
    if "/data/" in path and name.endswith(".parquet"):
        return "data"
    if name.startswith(CLOCK_PROBE_PREFIX):  # a probe of the store's clock whose delete failed (gc_now)
        return "other"
    if name.endswith(".metadata.json"):
        return "metadata"
    if name.startswith("snap-") and name.endswith(".avro"):
        return "manifest-list"
    if name.endswith(".avro"):
        return "manifest"
    return "other"


def gc_now(stream: StreamTable, location: str, *, probe: bool) -> float:
    """The "now" that GC ages files and consumer positions by (unix seconds): the earlier of this host's clock and the
    store's (:func:`~lakestream_iceberg.connect.storage.store_now`, one probe object written and deleted under
    ``location``), so that neither a GC host whose clock runs ahead nor a store whose clock lags makes a young file
    look old. ``probe=False`` (a dry run, which writes nothing), or a store that cannot tell its clock: this host's,
    with a warning in the second case. Clocks further apart than :data:`CLOCK_SKEW_WARN_S` are logged."""
    local = time.time()
    if not probe:
        return local
    store = store_now(stream.io, location)
    if store is None:
        log.warning("GC of %s cannot tell the store's clock (a probe object under %s/metadata/ could not be written or "
                    "reports no modification time): it ages files by this host's clock, which must not run ahead of "
                    "the store's (docs/guide/retention.md)", stream.name, location.rstrip("/"))
        return local
    if abs(local - store) > CLOCK_SKEW_WARN_S:
        log.warning("GC of %s: this host's clock is %+.0fs off the store's; it ages files by the earlier of the two. "
                    "Producers whose clocks lag the store's by more than half the grace period less the commit timeout "
                    "may publish files GC already deleted: check the hosts' time synchronisation "
                    "(docs/guide/retention.md)", stream.name, local - store)
    return min(local, store)


def sweep(stream: StreamTable, *, location: str, keep: set[str], known: set[str], grace_s: float, delete: bool,
          now: float, keep_producer_state: bool = False) -> Swept:
    """Delete unreferenced files under the table location (``delete=False``: count them only); files no metadata ever
    referenced (``known``) need to be older than ``grace_s`` at ``now`` first (:func:`gc_now`, read before the head
    whose files are ``keep``: a commit landing after that read publishes files younger than the grace period then).
    ``keep_producer_state``: delete no producer-state file (a branch awaits a repair that re-bases on old ones)."""
    location = location.rstrip("/") + "/"
    root = norm(location) + "/"
    cutoff = now - grace_s
    sharing = [t for t in tables_under(stream.table.catalog, f"{location}metadata") or () if t != stream.name]
    if sharing:  # a table renamed keeps its location: a stream created under the old name then took its folder
        refused = (f"GC of {stream.name} deletes no file: {', '.join(sharing)} of this catalog "
                   f"keep{'s its' if len(sharing) == 1 else ' their'} metadata in the stream's own folder {location}, "
                   "and no file there can be told to be the stream's alone; move one of them (create it again "
                   "elsewhere, with location=) before GC deletes files")
        log.warning("%s", refused)
        return Swept(files_deleted={}, bytes_deleted={}, files_in_grace=0, refused=refused)
    if delete:
        _warn_unreported_delete_failures(stream, location)
    with _Deletes(stream.io) as deletes:
        in_grace = _walk(stream, location=location, root=root, keep=keep, known=known, cutoff=cutoff, delete=delete,
                         keep_producer_state=keep_producer_state, deletes=deletes)
    if deletes.failed:
        log.warning("GC of %s could not delete %d unreferenced files (the first: %s); they stay unreferenced and the "
                    "next GC deletes them once it may", stream.name, deletes.failed, deletes.first_failure)
    return Swept(files_deleted=dict(deletes.counts), bytes_deleted=dict(deletes.sizes), files_in_grace=in_grace,
                 files_failed=deletes.failed, first_failure=deletes.first_failure)


_warned_unreported: set[str] = set()  # the streams whose GC said so in this process


def _warn_unreported_delete_failures(stream: StreamTable, location: str) -> None:
    """Say, once per stream and process, that this GC cannot tell a delete the store refused (s3fs through
    ``FsspecFileIO``): the report then counts such a file deleted while it stays."""
    if stream.name in _warned_unreported or not unreported_delete_failures(stream.io, location):
        return
    _warned_unreported.add(stream.name)
    log.warning("GC of %s deletes through pyiceberg's FsspecFileIO, whose s3fs ignores the errors of S3's multi-object "
                "delete: a file the store refuses to delete (a bucket policy without s3:DeleteObject, Object Lock) "
                "stays while files_deleted counts it; run GC through PyArrowFileIO (no py-io-impl) where deletes may "
                "be refused, to have each failure reported (docs/guide/hosts.md)", stream.name)


def _walk(stream: StreamTable, *, location: str, root: str, keep: set[str], known: set[str], cutoff: float,
          delete: bool, keep_producer_state: bool, deletes: _Deletes) -> int:
    """Hand every unreferenced file under ``location`` to ``deletes`` (to delete, or to count); return how many were
    left for being younger than the grace period."""
    in_grace = 0
    # the unreferenced files only (what a GC deletes, not every file of a long run), and the folders of other tables
    # inside the location, which may be listed after their files: nothing is deleted before the whole listing is read
    unreferenced: list[tuple[str, int, float | None, str]] = []
    tables: set[str] = set()
    for path, size, mtime in list_files(stream.io, location):
        key = norm(path)
        folder = _table_folder(root, key)
        if folder is not None:
            tables.add(folder)
        if key in keep or not key.startswith(root) or f"/data/{POSITIONS_DIR}/" in path:
            continue  # position objects expire a group at a time (GC's consumer retention), not a file at a time
        unreferenced.append((path, size, mtime, key))
    nested = [f for f in sorted(tables) if not any(f.startswith(f"{outer}/") for outer in tables)]
    if nested:
        log.warning("GC of %s leaves every file under %s: %s inside its location (%s), and the stream's GC deletes "
                    "nothing of another table's; give each table a folder outside every other table's location",
                    stream.name, ", ".join(f"{location}{folder}/" for folder in nested),
                    "another table's folder lies" if len(nested) == 1 else "other tables' folders lie",
                    location.rstrip("/"))
    for path, size, mtime, key in unreferenced:
        if nested and any(key.startswith(f"{root}{folder}/") for folder in nested):
            continue  # another table's file (a table made at a location inside this one's)
        if keep_producer_state and f"/data/{PRODUCERS_DIR}/" in path:
            continue
        if key not in known and (mtime is None or mtime > cutoff):  # no time told: it may be a commit's in flight
            in_grace += 1
            continue
        if delete:
            deletes.add(path, _kind(path), size)
        else:
            deletes.count(_kind(path), size)
    deletes.flush()
    return in_grace


def _table_folder(root: str, key: str) -> str | None:
    """The folder (relative to ``root``) of another table inside a stream's location that ``key`` (a normalised path)
    shows: a ``metadata/*.metadata.json`` below the stream's own ``metadata/`` (a stream writes none anywhere else).
    A table created at a location inside a stream's (by ``location=``, or at the catalog's default location of a
    namespace whose folder a stream was given) had every file deleted by that stream's GC once older than the grace
    period. None for any other file."""
    if not key.startswith(root) or not key.endswith((".metadata.json", ".metadata.json.gz")):  # .gz: older Java Iceberg
        return None
    parts = key[len(root):].split("/")
    return "/".join(parts[:-2]) if len(parts) >= 3 and parts[-2] == "metadata" else None


class _Deletes:
    """The sweep's deletes, run :data:`DELETE_BATCH` at a time on a pool of its own sized by pyiceberg's
    ``max-workers`` (threads start with the first delete), and what they did."""

    def __init__(self, io: FileIO) -> None:
        self._io = io
        workers = ExecutorFactory.max_workers()  # None: ThreadPoolExecutor's default, as pyiceberg's own pool
        self._pool = ThreadPoolExecutor(max_workers=None if workers is None else max(1, workers),
                                        thread_name_prefix="lakestream-gc-delete")
        self._batch: list[tuple[str, str, int]] = []
        self.counts: dict[str, int] = defaultdict(int)
        self.sizes: dict[str, int] = defaultdict(int)
        self.failed = 0
        self.first_failure: str | None = None

    def __enter__(self) -> _Deletes:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)

    def count(self, kind: str, size: int) -> None:
        self.counts[kind] += 1
        self.sizes[kind] += size

    def add(self, path: str, kind: str, size: int) -> None:
        self._batch.append((path, kind, size))
        if len(self._batch) >= DELETE_BATCH:
            self.flush()

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        for (path, kind, size), error in zip(batch, self._pool.map(self._delete, batch), strict=True):
            if error is None:
                self.count(kind, size)
            elif not isinstance(error, FileNotFoundError):  # gone already (another GC): nothing to count
                self.failed += 1
                if self.first_failure is None:
                    self.first_failure = f"{path}: {type(error).__name__}: {error}"

    def _delete(self, item: tuple[str, str, int]) -> Exception | None:
        try:
            self._io.delete(item[0])
        except Exception as exc:  # noqa: BLE001 - not only OSError: FsspecFileIO raises botocore's own errors
            return exc
        return None


def known_files(stream: StreamTable, metadata: TableMetadata) -> set[str]:
    """Files some snapshot of ``metadata`` references (so they were committed, not in flight)."""
    return referenced_files(stream.io, metadata, "", stream)
