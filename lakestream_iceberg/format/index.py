"""Finding a step's data files: through the head snapshot's manifests, pruned by their ``_step`` partition bounds.

A step's own snapshot may have been expired long ago (see :mod:`lakestream_iceberg.format.expiry`); its files are still listed
by the branch head's manifests with ``(_step, _rank)`` (packed layout: ``(_step,)``) as the partition tuple. The manifest list of the head holds a few
dozen manifests with contiguous step ranges (:mod:`lakestream_iceberg.format.manifests`), so a lookup reads one manifest list
and one manifest, both immutable and cached by path: consecutive steps cost one cached lookup each.
"""

from __future__ import annotations

from typing import Any

from pyiceberg.io import FileIO
from pyiceberg.manifest import DataFile, ManifestEntry, ManifestFile
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.typedef import Record

from lakestream_iceberg.errors import CorruptStateError
from lakestream_iceberg.format.manifest_cache import ManifestCache
from lakestream_iceberg.format.manifest_facts import entry_step, step_bounds


def is_packed(data_file: DataFile) -> bool:
    """Whether a data file is a packed layout's step file (partition ``(_step,)``), not one rank's (``(_step, _rank)``)."""
    return len(data_file.partition) == 1


def rank_of(entry: ManifestEntry) -> int:
    """The rank of a per-rank layout's entry (0 for a packed file, which holds every rank)."""
    return 0 if is_packed(entry.data_file) else int(entry.data_file.partition[1])




def _values(record: Record) -> list[Any]:
    """A partition tuple's values (``list(record)``: a ``Record`` has no ``__iter__``, only ``__getitem__``)."""
    return [record[i] for i in range(len(record))]


def _ranked(path: str, step: int, found: list[ManifestEntry]) -> list[ManifestEntry]:
    """A step's entries ordered by rank, after checking their partitions: ``(_step,)`` alone (packed), or
    ``(_step, _rank)`` with ranks ``0..n-1``, each once. A rank missing in the middle or listed twice would hand one
    rank another rank's rows (the reader checks that ``n`` is the world size)."""
    if len(found) == 1 and len(found[0].data_file.partition) == 1:
        return found
    ranks = [e.data_file.partition[1] if len(e.data_file.partition) == 2 else None for e in found]
    ints: list[int] = [r for r in ranks if type(r) is int]
    if len(ints) == len(ranks):  # every rank an int
        order = sorted(range(len(found)), key=ints.__getitem__)
        if [ints[i] for i in order] == list(range(len(found))):
            return [found[i] for i in order]
    raise CorruptStateError(
        f"step {step} of {path} lists data files with partitions {[_values(e.data_file.partition) for e in found][:8]}, "
        "not one file per rank 0..n-1 (per-rank layout) or one file (packed): the table was changed by something other "
        "than lakestream; roll the stream back to a checkpoint before that step"
    )


class StepIndex:
    """Looks up the data files of one step of one branch."""

    def __init__(self, *, io: FileIO, cache: ManifestCache) -> None:
        self._io = io
        self._cache = cache  # also holds each manifest's step map, within its byte bound
        self._bounds: dict[str, tuple[int, int] | None] = {}
        # the step map of the manifest looked up last, also when the cache does not keep it (a manifest too large for
        # it): consecutive steps of a reader behind the head fall in one manifest, which is then read once, not per step
        self._last: tuple[str, dict[int, list[ManifestEntry]]] | None = None

    def _step_map(self, manifest: ManifestFile) -> dict[int, list[ManifestEntry]]:
        last = self._last
        if last is not None and last[0] == manifest.manifest_path:
            return last[1]
        by_step = self._cache.step_map(self._io, manifest)
        self._last = (manifest.manifest_path, by_step)
        return by_step

    def _step_bounds(self, manifest: ManifestFile) -> tuple[int, int] | None:
        path = manifest.manifest_path
        try:
            return self._bounds[path]
        except KeyError:
            pass
        bounds = step_bounds(manifest)
        if len(self._bounds) > 4096:  # a head lists a few dozen manifests; the rest were merged or collected
            self._bounds.clear()  # (another thread may clear it too: the local value is what is returned)
        self._bounds[path] = bounds
        return bounds

    def files(self, snapshot: Snapshot | None, step: int) -> list[DataFile]:
        """The data files of ``step`` in ``snapshot``'s table state, ordered by rank (packed layout: the one file; empty
        when absent)."""
        return [e.data_file for e in self.entries(snapshot, step)]

    def entries(self, snapshot: Snapshot | None, step: int) -> list[ManifestEntry]:
        """The live manifest entries of ``step`` in ``snapshot``'s table state, ordered by rank.

        Raises:
            CorruptStateError: The step's entries are not one per rank ``0..n-1`` (or one packed file).
        """
        if snapshot is None:
            return []
        found: list[ManifestEntry] = []
        for manifest in self._cache.manifests(self._io, snapshot):
            bounds = self._step_bounds(manifest)
            if bounds is not None and not bounds[0] <= step <= bounds[1]:
                continue
            found.extend(self._step_map(manifest).get(step, ()))
        return _ranked(snapshot.manifest_list, step, found) if found else found

    def all_files(self, snapshot: Snapshot | None) -> list[DataFile]:
        """Every live data file of ``snapshot``'s table state."""
        if snapshot is None:
            return []
        return [e.data_file for m in self._cache.manifests(self._io, snapshot) for e in self._cache.entries(self._io, m)]

    def lowest_live_seq(self, metadata: TableMetadata, branch: str, producer_id: str) -> int | None:
        """The lowest seq of ``producer_id`` whose data files are live on ``branch`` (slow path: scans all manifests;
        the seq is read from the file name the writer gives, ``data/<producer>/<seq:012d>-<token>-...``)."""
        fragment = f"/data/{producer_id}/"
        lowest: int | None = None
        for data_file in self.all_files(metadata.snapshot_by_name(branch)):
            path = data_file.file_path
            at = path.rfind(fragment)
            if at < 0:
                continue
            digits = path[at + len(fragment):].split("-", 1)[0]
            if digits.isascii() and digits.isdigit() and (lowest is None or int(digits) < lowest):
                lowest = int(digits)
        return lowest

    def step_of_file(self, metadata: TableMetadata, branch: str, path_fragment: str, *, up_to: int) -> int | None:
        """The newest step, at most ``up_to``, of the live files whose path contains ``path_fragment`` (slow path: scans
        all manifests). Newest: a fork starts its producers' seqs afresh and holds the steps it inherited, so a
        producer's file of one seq may be live twice there, the fork's own at the later step."""
        steps = (entry_step(f) for f in self.all_files(metadata.snapshot_by_name(branch)) if path_fragment in f.file_path)
        return max((step for step in steps if step is not None and step <= up_to), default=None)
