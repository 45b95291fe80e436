"""Manifest bookkeeping whose cost per commit does not grow with the stream's history.

Each commit writes one small level-0 manifest holding the new step's files (a group commit: one for the whole group,
see :meth:`ManifestPlanner.group`). Whenever ``fanout`` manifests of one level
accumulate in a snapshot's manifest list they are merged into one manifest of the next level (their entries rewritten
as EXISTING, snapshot ids and sequence numbers kept). This is a log-structured merge: the manifest list stays at most
``(fanout - 1) * levels + 1`` entries long, the entries rewritten per commit are ``O(world_size * log_fanout(steps))``
amortised (no single merge rewrites more than ``lakestream.manifest.max-merge-entries`` entries, default 4096, so no
commit stalls on a huge merge; a level too large to merge whole merges its longest run that fits, and manifests too
large to merge with a neighbour accumulate, at most one per 2,048 files), and manifests keep contiguous step ranges,
so the partition summary
in the manifest list (``_step`` lower/upper bounds) lets a reader open exactly one manifest to find a step's files.

The level is recorded in the manifest's file name (``...-L<level>-m<n>.avro``): no extra metadata, still plain Iceberg.
Manifests and manifest lists are immutable, so they are cached per process by path
(:mod:`lakestream_iceberg.format.manifest_cache`).
"""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pyiceberg.io import FileIO
from pyiceberg.manifest import (
    UNASSIGNED_SEQ,
    DataFile,
    ManifestEntry,
    ManifestEntryStatus,
    ManifestFile,
)
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot

from lakestream_iceberg.errors import ConfigError
from lakestream_iceberg.format.avro_writers import manifest_list_writer, manifest_writer
from lakestream_iceberg.format.file_settings import avro_codec
from lakestream_iceberg.format.manifest_facts import entry_step, manifest_level, step_bounds
from lakestream_iceberg.format.uploads import Uploads

if TYPE_CHECKING:
    from lakestream_iceberg.format.manifest_cache import ManifestCache

_LOCAL_SCHEMES = ("", "file")  # table locations on a local file system (pyiceberg's PyArrowFileIO writes them inline)
# The table format versions whose manifests, manifest lists and snapshots pyiceberg (and so lakestream) writes. Another
# engine may upgrade a stream's table past them (Spark: ALTER TABLE ... SET TBLPROPERTIES ('format-version'='3')).
WRITABLE_FORMAT_VERSIONS = (1, 2)


@dataclass
class SnapshotFiles:
    """What building one snapshot wrote: the manifest list and every manifest (for orphan accounting)."""

    manifest_list: str
    manifests: list[ManifestFile]
    written: list[str] = field(default_factory=list)


def _live_files(manifest: ManifestFile) -> int | None:
    if manifest.added_files_count is None or manifest.existing_files_count is None:
        return None
    return manifest.added_files_count + manifest.existing_files_count


def _with_sequence_number(manifest: ManifestFile, *, was: int, now: int) -> ManifestFile:
    """A copy of ``manifest`` (written by an attempt whose sequence number was ``was``) as the attempt of sequence
    number ``now`` lists it: the sequence numbers :meth:`ManifestPlanner._write` gave it, ``now``; its entries' own
    (explicit in a rewritten manifest) stay."""
    listed = copy.deepcopy(manifest)
    listed.sequence_number = now
    if listed.min_sequence_number == was:
        listed.min_sequence_number = now
    return listed


def _copy_entry(entry: ManifestEntry, status: ManifestEntryStatus, snapshot_id: int | None = None) -> ManifestEntry:
    return ManifestEntry.from_args(
        status=status,
        snapshot_id=snapshot_id if snapshot_id is not None else entry.snapshot_id,
        sequence_number=entry.sequence_number,
        file_sequence_number=entry.file_sequence_number,
        data_file=entry.data_file,
    )


class ManifestPlanner:
    """Writes the manifests and manifest list of one new snapshot on top of a parent snapshot's manifests."""

    def __init__(self, *, io: FileIO, metadata: TableMetadata, cache: ManifestCache, fanout: int,
                 max_merge_entries: int = 4096) -> None:
        if metadata.format_version not in WRITABLE_FORMAT_VERSIONS:
            raise ConfigError(
                f"the table at {metadata.location} has Iceberg format version {metadata.format_version} (another engine "
                "upgraded it, e.g. ALTER TABLE ... SET TBLPROPERTIES ('format-version'='3')); pyiceberg writes the "
                "manifests and snapshots of format versions 1 and 2 only, so lakestream cannot commit to it (steps are "
                "still read). A format version cannot be downgraded: write the stream into a new one (Stream.create)"
            )
        self._io = io
        self._metadata = metadata
        self._cache = cache
        self._fanout = fanout
        self._max_merge_entries = max_merge_entries
        self._spec: PartitionSpec = metadata.spec()
        self._schema: Schema = metadata.schema()
        self._compression = avro_codec(metadata.properties)
        self._commit_uuid = uuid.uuid4()
        self._counter = 0
        self.written: list[str] = []
        self._replaced: list[str] = []  # manifests this plan's merges replaced (their entries go once it lands)
        self._inner: dict[str, list[ManifestEntry]] = {}  # entries of manifests no head will list (see added(inner=))
        self._uploads: Uploads | None = None  # from concurrent_writes() until wait_written(): the files in flight

    @contextlib.contextmanager
    def concurrent_writes(self) -> Iterator[None]:
        """Within: the manifests and manifest lists this planner writes to object storage are sent concurrently (see
        :mod:`lakestream_iceberg.format.uploads`). They may still be in flight when the block ends: whoever names them
        (the swap, after it wrote ``metadata.json``) first calls :meth:`wait_written`. An exception from the block
        itself waits for them (their failures dropped: nothing may still be writing once the caller cleans up) and,
        on any file system, forgets the manifest entries cached for this plan's files: no head will list them.

        On a local file system they are written inline as before: creating a file is CPU time in the kernel, not a
        wait, and concurrent creations only contend (measured: no gain with 1, 4 or 8 producers on 2 cores)."""
        if urlsplit(self._metadata.location).scheme in _LOCAL_SCHEMES:
            try:
                yield
            except BaseException:
                self._cache.forget_entries(self.written)
                raise
            return
        uploads = self._uploads = Uploads(self._io)
        try:
            yield
        except BaseException:
            self._uploads = None
            with contextlib.suppress(Exception):
                uploads.wait()
            self._cache.forget_entries(self.written)
            raise

    def wait_written(self) -> None:
        """Return once every file :meth:`concurrent_writes` sent is written; raise the first failure (after all of them
        finished), having forgotten the manifest entries cached for this plan's files. A no-op when nothing is in
        flight (a local file system, or waited for already)."""
        uploads, self._uploads = self._uploads, None
        if uploads is None:
            return
        try:
            uploads.wait()
        except BaseException:
            self._cache.forget_entries(self.written)
            raise

    def parent_manifests(self, parent: Snapshot | None) -> list[ManifestFile]:
        """The parent's manifests that still hold live files (all-DELETED manifests are not carried forward)."""
        if parent is None:
            return []
        return [m for m in self._cache.manifests(self._io, parent) if _live_files(m) != 0]

    def _new_path(self, level: int) -> str:
        self._counter += 1
        name = f"{self._commit_uuid}-L{level}-m{self._counter}.avro"
        return f"{self._metadata.location.rstrip('/')}/metadata/{name}"

    def _write(self, level: int, snapshot_id: int, sequence_number: int, entries: Iterable[ManifestEntry], *,
               inner: bool = False) -> ManifestFile:
        path = self._new_path(level)
        self.written.append(path)
        kept: list[ManifestEntry] = []
        with manifest_writer(
            format_version=self._metadata.format_version,
            spec=self._spec,
            schema=self._schema,
            output_file=self._io.new_output(path),
            snapshot_id=snapshot_id,
            avro_compression=self._compression,  # type: ignore[arg-type]
            uploads=self._uploads,
        ) as writer:
            for entry in entries:
                writer.add_entry(entry)
                if entry.status != ManifestEntryStatus.DELETED:
                    kept.append(entry)
        manifest = writer.to_manifest_file()
        if manifest.sequence_number == UNASSIGNED_SEQ:
            manifest.sequence_number = sequence_number
        if manifest.min_sequence_number == UNASSIGNED_SEQ:
            manifest.min_sequence_number = sequence_number
        if inner:
            self._inner[path] = kept
        elif len(kept) <= self._max_merge_entries:  # a larger one is never merged again: no commit reads it back
            self._cache.remember_entries(path, kept)
        return manifest

    def existing(self, *, snapshot_id: int, sequence_number: int, entries: Iterable[ManifestEntry]) -> ManifestFile:
        """A level-0 manifest listing ``entries`` as EXISTING (e.g. a checkpoint anchor's copy of one step's files)."""
        return self._write(0, snapshot_id, sequence_number, (_copy_entry(e, ManifestEntryStatus.EXISTING) for e in entries))

    def added(self, *, snapshot_id: int, sequence_number: int, data_files: Sequence[DataFile],
              inner: bool = False) -> ManifestFile:
        """A level-0 manifest of ADDED entries (sequence numbers explicit, so the entries can be cached as read).

        ``inner``: the manifest of a snapshot inside a group commit, which only that snapshot's list names (the group's
        head lists the :meth:`group` manifest instead), so no later commit merges it: its entries are kept for this
        plan's :meth:`group` only, not in the shared cache, where a few per group pushed out the entries of the live
        manifests that merges read (the cache holds 512 manifests; 480 of them were such manifests)."""
        return self._write(
            0,
            snapshot_id,
            sequence_number,
            (
                ManifestEntry.from_args(
                    status=ManifestEntryStatus.ADDED,
                    snapshot_id=snapshot_id,
                    sequence_number=sequence_number,
                    file_sequence_number=sequence_number,
                    data_file=f,
                )
                for f in data_files
            ),
            inner=inner,
        )

    def group(self, *, earlier: Sequence[ManifestFile], snapshot_id: int, sequence_number: int,
              data_files: Sequence[DataFile]) -> ManifestFile:
        """The last snapshot of a group commit: one level-0 manifest listing the group's ``earlier`` manifests'
        entries as EXISTING (their snapshot ids and sequence numbers kept) and ``data_files`` as ADDED.

        Each snapshot of a group needs a manifest list of its own, but only the last one stays the head: with this
        manifest it lists one new manifest for the whole group instead of one per batch, so the list stays short and
        merges come ``group`` times less often (a merge reads the manifests that other producers' commits wrote)."""
        entries = self._as_existing(earlier)
        entries += [
            ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=snapshot_id,
                                    sequence_number=sequence_number, file_sequence_number=sequence_number, data_file=f)
            for f in data_files
        ]
        return self._write(0, snapshot_id, sequence_number, entries)

    def merged(self, manifests: list[ManifestFile], *, snapshot_id: int, sequence_number: int) -> list[ManifestFile]:
        """Merge every level holding ``fanout`` or more manifests into one manifest of the next level, cascading.

        A level whose manifests hold more than ``max_merge_entries`` live files in all merges the longest run of
        consecutive manifests (in step order) that fits, at least two; a manifest that fits with no neighbour stays
        where it is. Manifests of one level differ in size (a group commit's manifest holds the whole group), so
        without this one large manifest would keep its level from ever merging again, and every later manifest of
        that level would stay in the list."""
        result = list(manifests)
        top = max((manifest_level(m.manifest_path) for m in result), default=0)
        level = 0
        while level <= top:
            at_level = [m for m in result if manifest_level(m.manifest_path) == level]
            run = self._mergeable(sorted(at_level, key=lambda m: step_bounds(m) or (0, 0))) \
                if len(at_level) >= self._fanout else []
            if run:
                merged = self._write(level + 1, snapshot_id, sequence_number, self._as_existing(run, own=snapshot_id))
                gone = {m.manifest_path for m in run}
                result = [m for m in result if m.manifest_path not in gone] + [merged]
                self._replaced.extend(gone)
                top = max(top, level + 1)
            level += 1
        return result

    def settle(self, landed: bool, head: Snapshot | None) -> None:
        """Update the cache once the commit this planner built is decided (``head``: the branch's head then).

        Landed: the manifests its merges and rewrites replaced are no longer listed (their entries would push out
        those of the live, higher-level manifests that the next, larger merge reads). Lost: the manifests this plan
        wrote are listed by no one; those it replaced are forgotten only if the new head no longer lists them either
        (the winner merged them too), since a re-plan on a head that still lists them merges them again."""
        if landed:
            self._cache.forget_entries(self._replaced)
            return
        self._cache.forget_entries(self.written)
        if self._replaced:
            listed = {m.manifest_path for m in self._cache.manifests(self._io, head)} if head is not None else set()
            self._cache.forget_entries(path for path in self._replaced if path not in listed)

    def _as_existing(self, manifests: Iterable[ManifestFile], *, own: int | None = None) -> list[ManifestEntry]:
        """The live entries of ``manifests``, in order, as EXISTING (their snapshot ids and sequence numbers kept),
        except the files that the committing snapshot ``own`` adds: those stay ADDED.

        Iceberg's incremental reads (Java's ``IncrementalAppendScan``, Spark's ``start-snapshot-id`` reads and
        structured streaming, Flink's incremental source) take a snapshot's new files from the ADDED entries of the
        manifests it wrote: a merge that folds the committing snapshot's own manifest into a larger one must keep them
        ADDED (as Java's ``ManifestMergeManager`` does), or that step is never delivered to those readers."""
        return [e if own is not None and e.status == ManifestEntryStatus.ADDED and e.snapshot_id == own
                else _copy_entry(e, ManifestEntryStatus.EXISTING)
                for m in manifests for e in self._entries(m)]

    def _entries(self, manifest: ManifestFile) -> list[ManifestEntry]:
        inner = self._inner.get(manifest.manifest_path)
        if inner is not None:
            return inner
        if self._uploads is not None and self._uploads.pending(manifest.manifest_path):
            self._uploads.wait()  # written by this plan and no longer in the cache: read it once it exists
        return self._cache.entries(self._io, manifest)

    def _mergeable(self, ordered: list[ManifestFile]) -> list[ManifestFile]:
        """What to merge of one level's manifests (in step order): all of them when their live files fit in
        ``max_merge_entries`` (the usual case), else the longest consecutive run that fits, if it has two or more.

        A merge larger than ``max_merge_entries`` would stall one commit for seconds: manifests that fit with no
        neighbour stay at their level, so the list grows by at most one entry per ``max_merge_entries / 2`` files
        (and GC keeps live files bounded)."""
        sizes = [_live_files(m) or 0 for m in ordered]
        if sum(sizes) <= self._max_merge_entries:
            return ordered
        best = (0, 0)  # (start, length)
        for start in range(len(ordered)):
            total, end = 0, start
            while end < len(ordered) and total + sizes[end] <= self._max_merge_entries:
                total += sizes[end]
                end += 1
            if end - start > best[1]:
                best = (start, end - start)
        return ordered[best[0]: best[0] + best[1]] if best[1] >= 2 else []

    def without_steps_below(
        self, manifests: list[ManifestFile], below: int, *, snapshot_id: int, sequence_number: int,
        rewrites: dict[tuple[str, int, int], tuple[ManifestFile, int, list[DataFile]]] | None = None,
    ) -> tuple[list[ManifestFile], list[DataFile]]:
        """Drop every file of a step ``< below``; return the new manifest list and the dropped files.

        Manifests entirely at or above ``below`` are kept as they are; the others are rewritten with the dropped files
        as DELETED entries of the new snapshot (Iceberg's record of a metadata-only delete) and the rest as EXISTING.

        ``rewrites``: the manifests earlier attempts of the same commit rewrote (kept by the caller across attempts):
        a manifest still listed, rewritten for the same ``below`` and ``snapshot_id``, is taken as it was written (its
        entries depend on nothing else) with this attempt's sequence number, not written again. Lifecycle GC re-plans
        on every lost race; without them each attempt rewrote every manifest holding a collected step, and lost again
        to producers committing in far less time.
        """
        out: list[ManifestFile] = []
        dropped: list[DataFile] = []
        for manifest in manifests:
            bounds = step_bounds(manifest)
            if bounds is not None and bounds[0] >= below:
                out.append(manifest)
                continue
            key = (manifest.manifest_path, below, snapshot_id)
            earlier = None if rewrites is None else rewrites.get(key)
            if earlier is not None:
                written, written_seq, gone_files = earlier
                out.append(_with_sequence_number(written, was=written_seq, now=sequence_number))
                dropped.extend(gone_files)
                self._replaced.append(manifest.manifest_path)
                continue
            entries = self._cache.entries(self._io, manifest)
            gone = [e for e in entries if (entry_step(e.data_file) or 0) < below]
            if not gone:
                out.append(manifest)
                continue
            dropped.extend(e.data_file for e in gone)
            kept = [_copy_entry(e, ManifestEntryStatus.EXISTING) for e in entries if (entry_step(e.data_file) or 0) >= below]
            rewritten = [_copy_entry(e, ManifestEntryStatus.DELETED, snapshot_id) for e in gone] + kept
            written = self._write(manifest_level(manifest.manifest_path), snapshot_id, sequence_number, rewritten)
            out.append(written)
            if rewrites is not None:
                rewrites[key] = (copy.deepcopy(written), sequence_number, [e.data_file for e in gone])
            self._replaced.append(manifest.manifest_path)
        return out, dropped

    def write_list(
        self, manifests: list[ManifestFile], *, snapshot_id: int, parent_id: int | None, sequence_number: int,
        inner: bool = False,
    ) -> str:
        """Write a snapshot's manifest list (``inner``: a snapshot inside a group commit, never a commit's parent: not
        cached, see :meth:`added`)."""
        path = f"{self._metadata.location.rstrip('/')}/metadata/snap-{snapshot_id}-0-{self._commit_uuid}.avro"
        self.written.append(path)
        with manifest_list_writer(
            format_version=self._metadata.format_version,
            output_file=self._io.new_output(path),
            snapshot_id=snapshot_id,
            parent_snapshot_id=parent_id,
            sequence_number=sequence_number,
            avro_compression=self._compression,  # type: ignore[arg-type]
            uploads=self._uploads,
        ) as writer:
            writer.add_manifests(manifests)
        if not inner:
            self._cache.remember_list(path, manifests)
        return path
