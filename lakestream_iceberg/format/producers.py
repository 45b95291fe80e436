"""Producer state whose cost per commit follows the *active* producers, not every producer id ever seen.

Exactly-once needs, for every producer id, its last published sequence number (and the step and snapshot that
published it). Elastic producer pools (a Ray Data job makes every write task a producer; retries, autoscaling and every
new job run bring new ids) see tens of thousands of ids, most of which commit a few batches and are never seen again.
So the state is split in two, both reachable from the head snapshot alone:

* **active** producers ride in every snapshot summary (``lakestream.producers``: ``id -> [seq, step, snapshot id,
  first step]``, where *first step* is the step of the producer's first commit since it became active). A commit checks
  and updates its producers there, in the same compare-and-swap that publishes the batch.
* **idle** producers (last commit more than :func:`active_horizon` steps ago) are compacted, ``COMPACT_AT`` at a time,
  into immutable producer-state files (Parquet: ``producer, seq, step, snapshot_id``) under
  ``<table location>/data/_producers/``; the summary lists them (``lakestream.producer-files``, oldest first). The
  files are log-structured like the manifests: each compaction writes one small *delta* file, and when more than
  ``MAX_FILES`` files would be listed they are merged into one *base* file. A file is written before the
  compare-and-swap that references it; a lost swap abandons it (lifecycle GC collects it like any unreferenced file).

Each file's footer names its format (``lakestream.producer-state-format``, :data:`FILE_FORMAT`; absent in files of
releases before it was written: format 1). A reader refuses a format it does not read (:class:`ConfigError`: upgrade
lakestream_iceberg) rather than take a newer release's rows for version 1 ones, and a merge, which rewrites every row
it read into the new base, never drops what such a file holds. A newer release that adds a column old readers may
ignore keeps format 1 and must read files without it (older releases' merges rewrite rows without it); one that
changes what a row means writes a new format.

A lookup checks the active map, then the files newest first; files are immutable, so each is read once per process and
cached (:class:`ProducerFiles`). What a commit costs therefore depends on the active producers only: the summary
holds at most the active ones plus ``COMPACT_AT`` idle ones; a compaction writes ``COMPACT_AT`` rows (a merge, every
``MAX_FILES`` compactions, rewrites the base). A returning producer costs one cached lookup, and a new id one lookup in
each listed file (read once per process). Nothing expires: every id's last sequence number is kept (a few tens of
bytes per id in the base file), so an id that returns after any number of others still continues exactly once.
"""

from __future__ import annotations

import bisect
import io as _io
import json
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.io import FileIO

from lakestream_iceberg.errors import ConfigError, CorruptStateError, MissingFileError

__all__ = [
    "COMPACT_AT",
    "MAX_FILES",
    "PRODUCERS_DIR",
    "ProducerFiles",
    "ProducerState",
    "active_horizon",
    "compact",
]

_FILES_KEY = "lakestream.producer-files"  # format.summary's KEY_PRODUCER_FILES (summary imports this module)


PRODUCERS_DIR = "_producers"  # under the table's data/ folder (producer ids start with a letter or digit)
ACTIVE_MIN_STEPS = 32  # an active producer stays in the summary at least this many steps after its last commit
ACTIVE_ROUNDS = 1.5  # ... and this many rounds of the producers taking turns now (see active_horizon; must be < 2)
COMPACT_AT = 32  # idle producers are moved out of the summary this many at a time
MAX_FILES = 8  # producer-state files listed in a summary before they are merged into one

FILE_FORMAT = 1  # the producer-state file format this release writes
_READABLE_FORMATS = (1,)  # ... and those it reads (see the module docstring)
_FORMAT_KEY = b"lakestream.producer-state-format"  # in the footer's key-value metadata (absent: format 1)
_SCHEMA = pa.schema([("producer", pa.string()), ("seq", pa.int64()), ("step", pa.int64()), ("snapshot_id", pa.int64())],
                    metadata={_FORMAT_KEY: str(FILE_FORMAT).encode()})


@dataclass(frozen=True)
class ProducerState:
    """What the table knows of one producer: its last published sequence, at which step and in which snapshot.

    ``first`` is the step of its first commit since it became active (None: unknown, e.g. read from a file or written
    by an older version); a producer with ``first < step`` committed more than once recently (it recurs).
    """

    seq: int
    step: int
    snapshot_id: int
    first: int | None = None

    @property
    def recurring(self) -> bool:
        return self.first is None or self.first < self.step


def active_horizon(active: Mapping[str, ProducerState], step: int | None = None) -> int:
    """Steps after its last commit that a producer stays active (``step``: the head's; default the newest listed).

    ``ACTIVE_ROUNDS`` rounds of the producers that recur *now*: those whose last commit lies within the horizon itself,
    at least ``ACTIVE_MIN_STEPS``. The horizon is the least fixed point reached from ``ACTIVE_MIN_STEPS`` upwards
    (``h = ACTIVE_ROUNDS x recurring producers within the last h steps``): with ``P`` producers taking turns it is about
    ``ACTIVE_ROUNDS x P``. Counting every recurring id the summary lists instead (as before) never let go of a pool that
    retires its ids: 16 processes taking a fresh id every 3 batches kept every id they ever used in the summary (160
    ids at step 480, none compacted), because each retired id counted as a producer and so lengthened the horizon that
    kept it. An id retired every ``k`` steps now adds ``ACTIVE_ROUNDS / k`` to the fixed point, which exists for every
    ``k >= 2`` (a recurring id commits at least twice) since ``ACTIVE_ROUNDS < 2``.
    """
    recurring = sorted(p.step for p in active.values() if p.recurring)
    if not recurring:
        return ACTIVE_MIN_STEPS
    head = recurring[-1] if step is None else max(step, recurring[-1])
    horizon = ACTIVE_MIN_STEPS
    while True:
        within = len(recurring) - bisect.bisect_right(recurring, head - horizon)
        wanted = max(ACTIVE_MIN_STEPS, math.ceil(ACTIVE_ROUNDS * within))
        if wanted <= horizon:
            return horizon
        horizon = wanted


class ProducerFiles:
    """A process-wide cache of parsed producer-state files (immutable: each is read once).

    Per table (the folder its files are in), it keeps the files that the last ``max_lists`` distinct file lists asked
    about name (a list is what one head's summary holds; a process following a branch or two, or a fork, asks about
    one or two at a time), and drops that table's others whenever a new file of it comes in: once a merge elsewhere
    replaced them by a new base, no head lists them again.
    With one branch, eight lists span the deltas of one or two bases (a merge comes every ``MAX_FILES`` compactions),
    so a process holds about twice what the head lists. Without this a process that never merged itself kept every
    base it ever read, each one larger than the last (6,000 ids left 76,608 entries in 186 files, about ids^2 / 512).
    ``max_entries`` bounds it whatever is listed (least recently used files first; the newest file always stays).
    """

    def __init__(self, *, max_entries: int = 2_000_000, max_lists: int = 8) -> None:
        self._max = max_entries
        self._size = 0
        self._lock = threading.Lock()
        self._files: OrderedDict[str, dict[str, ProducerState]] = OrderedDict()
        # per folder (one table's files), the lists asked about lately; the folders least recently asked about go first
        self._lists: OrderedDict[str, OrderedDict[tuple[str, ...], None]] = OrderedDict()
        self._max_lists = max_lists

    def load(self, io: FileIO, path: str) -> dict[str, ProducerState]:
        with self._lock:
            found = self._files.get(path)
            if found is not None:
                self._files.move_to_end(path)
                return found
        try:
            with io.new_input(path).open() as f:
                raw = f.read()
        except FileNotFoundError as exc:
            raise MissingFileError(
                f"producer-state file {path}, listed by the branch head's summary ({_FILES_KEY}), does not exist: a tool "
                "other than lakestream deleted it, most likely an orphan-file removal that did not exclude "
                f"data/{PRODUCERS_DIR}/ (see the interoperability guide). It holds the last sequence numbers of the "
                "stream's idle producers, so no producer can commit and the history cannot list them without it. "
                "Restore it from a backup (or the bucket's object versioning), or roll the branch back to a snapshot "
                "that does not list it"
            ) from exc
        try:  # in memory: an error from here on is the file's, not the storage's
            table = pq.read_table(pa.BufferReader(raw))
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise CorruptStateError(f"producer-state file {path} is not a readable Parquet file ({exc}); restore it from "
                                    "a backup or roll the branch back to a snapshot that does not list it") from exc
        parsed = _parse(path, table)
        self.remember(path, parsed)
        return parsed

    def remember(self, path: str, parsed: dict[str, ProducerState], *, listed_with: tuple[str, ...] | None = None) -> None:
        """Cache a parsed file (``listed_with``: the files the next head lists beside it, when this process wrote it)."""
        if listed_with is not None:
            self._asked((*listed_with, path))
        folder = _folder(path)
        with self._lock:
            if path in self._files:
                return
            listed = {p for files in self._lists.get(folder, ()) for p in files}
            for old in [p for p in self._files if _folder(p) == folder and p not in listed]:  # replaced since
                self._size -= len(self._files.pop(old))
            self._files[path] = parsed
            self._size += len(parsed)
            while self._size > self._max and len(self._files) > 1:
                _, dropped = self._files.popitem(last=False)
                self._size -= len(dropped)

    def forget(self, paths: Iterable[str]) -> None:
        """Drop files a merge replaced: a head lists only the new base, and a long-lived producer would otherwise keep
        every past base (tens of thousands of entries each) until the LRU bound. An older snapshot that still lists
        them reads them again."""
        with self._lock:
            for path in paths:
                dropped = self._files.pop(path, None)
                if dropped is not None:
                    self._size -= len(dropped)

    @property
    def entries(self) -> int:
        """Producer states held, all files together."""
        return self._size

    @property
    def files(self) -> int:
        """Files held."""
        return len(self._files)

    def _asked(self, files: Iterable[str]) -> tuple[str, ...]:
        listed = tuple(files)
        if not listed:
            return listed
        folder = _folder(listed[0])
        with self._lock:
            recent = self._lists.get(folder)
            if recent is None:
                recent = self._lists[folder] = OrderedDict()
                while len(self._lists) > _MAX_FOLDERS:
                    self._lists.popitem(last=False)
            self._lists.move_to_end(folder)
            recent[listed] = None
            recent.move_to_end(listed)
            while len(recent) > self._max_lists:
                recent.popitem(last=False)
        return listed

    def lookup(self, io: FileIO, files: Iterable[str], producer: str) -> ProducerState | None:
        """The newest state of ``producer`` in ``files`` (listed oldest first)."""
        for path in reversed(self._asked(files)):
            found = self.load(io, path).get(producer)
            if found is not None:
                return found
        return None

    def merged(self, io: FileIO, files: Iterable[str]) -> dict[str, ProducerState]:
        """Every producer of ``files``, the newest file winning."""
        out: dict[str, ProducerState] = {}
        for path in self._asked(files):
            out.update(self.load(io, path))
        return out


_MAX_FOLDERS = 1024  # tables whose recent lists are remembered (a table asked about again starts a new record)


def _folder(path: str) -> str:
    """The folder of a producer-state file: one table's (``<location>/data/_producers``)."""
    return path.rpartition("/")[0]


DEFAULT_FILES = ProducerFiles()


def _check_format(path: str, table: pa.Table) -> None:
    """Refuse (:class:`ConfigError`) a file of a format this release does not read (a newer release wrote it)."""
    raw = (table.schema.metadata or {}).get(_FORMAT_KEY)
    if raw is None or raw in {str(v).encode() for v in _READABLE_FORMATS}:
        return
    raise ConfigError(
        f"producer-state file {path} has {_FORMAT_KEY.decode()}={raw.decode(errors='replace')[:32]!r}, and this release "
        f"of lakestream_iceberg reads format {', '.join(map(str, _READABLE_FORMATS))} only: a newer lakestream_iceberg "
        "wrote it, and its producers' sequence numbers would be misread. Upgrade lakestream_iceberg in every process "
        "that uses the stream (do not delete or rewrite the file: its producers would publish their batches again)"
    )


def _parse(path: str, table: pa.Table) -> dict[str, ProducerState]:
    _check_format(path, table)
    try:
        cols = [table.column(name).to_pylist() for name in ("producer", "seq", "step", "snapshot_id")]
    except (KeyError, pa.ArrowInvalid) as exc:
        raise CorruptStateError(f"producer-state file {path} is not one lakestream wrote (columns {table.column_names}); "
                                "restore it from a backup or roll the branch back to a snapshot that does not list it") from exc
    out: dict[str, ProducerState] = {}
    for producer, seq, step, snapshot_id in zip(*cols, strict=True):
        if not (isinstance(producer, str) and type(seq) is int and seq >= 0 and type(step) is int and step >= 0
                and type(snapshot_id) is int):
            raise CorruptStateError(f"producer-state file {path} holds a malformed row for producer {producer!r} "
                                    f"(seq {seq!r}, step {step!r}, snapshot id {snapshot_id!r}); restore it from a backup "
                                    "or roll the branch back to a snapshot that does not list it")
        if producer in out:  # lakestream writes each id once: which row wins would decide its next seq
            raise CorruptStateError(f"producer-state file {path} holds producer {producer!r} twice (seqs "
                                    f"{out[producer].seq} and {seq}); lakestream writes each id once: restore it from a "
                                    "backup or roll the branch back to a snapshot that does not list it")
        out[producer] = ProducerState(seq, step, snapshot_id)
    return out


def _write(io: FileIO, location: str, entries: Mapping[str, ProducerState], cache: ProducerFiles,
           listed_with: tuple[str, ...]) -> str:
    path = f"{location.rstrip('/')}/data/{PRODUCERS_DIR}/{uuid.uuid4().hex}.parquet"
    names = sorted(entries)
    table = pa.table({
        "producer": pa.array(names, pa.string()),
        "seq": pa.array([entries[n].seq for n in names], pa.int64()),
        "step": pa.array([entries[n].step for n in names], pa.int64()),
        "snapshot_id": pa.array([entries[n].snapshot_id for n in names], pa.int64()),
    }, schema=_SCHEMA)
    sink = _io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    with io.new_output(path).create(overwrite=True) as out:
        out.write(sink.getvalue())
    cache.remember(path, {n: ProducerState(e.seq, e.step, e.snapshot_id) for n, e in entries.items()},
                   listed_with=listed_with)
    return path


@dataclass(frozen=True)
class Compacted:
    active: dict[str, ProducerState]
    files: tuple[str, ...]
    written: tuple[str, ...]


def compact(
    io: FileIO,
    location: str,
    *,
    step: int,
    active: Mapping[str, ProducerState],
    files: tuple[str, ...],
    cache: ProducerFiles = DEFAULT_FILES,
) -> Compacted:
    """The producer state a snapshot at ``step`` records: idle producers moved to a new file once ``COMPACT_AT`` of
    them accumulated, and the files merged once more than ``MAX_FILES`` would be listed. Writes at most two files."""
    horizon = active_horizon(active, step)
    idle = {k: v for k, v in active.items() if v.step <= step - horizon}
    if len(idle) < COMPACT_AT:
        return Compacted(dict(active), files, ())
    keep = {k: v for k, v in active.items() if k not in idle}
    if len(files) + 1 <= MAX_FILES:
        path = _write(io, location, idle, cache, listed_with=files)
        return Compacted(keep, (*files, path), (path,))
    merged = cache.merged(io, files)
    merged.update(idle)
    path = _write(io, location, merged, cache, listed_with=())
    cache.forget(files)
    return Compacted(keep, (path,), (path,))


def encode_files(files: tuple[str, ...]) -> str:
    return json.dumps(list(files), separators=(",", ":"))
