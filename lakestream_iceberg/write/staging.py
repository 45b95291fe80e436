"""Staged batches: a written global batch announced where every producer can see it, so that any producer's commit can
publish it.

This is how commits stay cheap when many producers share a stream (group commit). A producer that is not alone writes
its batch's data files, then one small *intent* naming them (a JSON document, its format in
:mod:`lakestream_iceberg.write.intent`), kept under the path::

    <table location>/data/_staging/<branch, URL-quoted>/<producer>@<seq:012d>-<token>.parquet

as a row of the SQL catalog's database or as a one-row Parquet file at that path (:mod:`lakestream_iceberg.write.
intent_store`; one flat folder per branch: listing it costs the intents staged now, never a folder per producer id
ever seen)

and waits (:mod:`lakestream_iceberg.write.dac` decides how long) for another producer's commit to publish it. Whichever
producer commits next lists the branch's staging folder and publishes every eligible intent in the same
compare-and-swap, each batch as its own snapshot with its own step, its owner's producer id and seq in the summary.
Producers still never talk to each other: they share the object store and the catalog, nothing else.

Rules that keep exactly-once intact:

* An intent is immutable: written once under a unique name (``token`` is the batch's data-file token), never changed.
  A reader that finds a half-written file (a local filesystem has no atomic PUT) skips it this time; one unchanged
  for longer than a writer retries a write (its writer died while writing it) is never published, and no held batch
  waits for it. Producer ids start with a letter or digit, so ``_staging`` never collides with a producer's data
  folder.
* A commit publishes intent (producer, seq) only when the head it builds on says ``seq`` is that producer's next
  sequence number (or a gap the owner allowed), so the compare-and-swap that checks the head also checks the seq: two
  producers racing to publish the same intent cannot both land, and a published intent is never published again.
* At most one intent per producer per commit; a producer that restarted may leave two intents for one seq (the dead
  incarnation's and its own), and the newer one is taken.
* The owner learns its batch was published when its intent disappears (the committer deletes what it published)
  or when a refresh shows its seq in the head's producer table.
* Intents older than half the GC grace period are never published: lifecycle GC may delete an unreferenced intent and
  its data files once they are older than the grace period. The age counted is the data files', not the intent's: an
  intent declares how long before staging its files were written (``files_age_s``, by the owner's clock, which wrote
  both), and a committer adds the intent's age by the store's clock. A batch its owner held alone for a while and staged
  late is not published with files GC may already be deleting.

What a committer checks before it publishes another producer's staged batch (an intent is input read from storage,
not a trusted message; see docs/security.md):

* the intent names this table (its UUID: a table dropped and re-created at the same location has another one) and
  this branch, and its file name is exactly ``<producer>@<seq>-<token>.parquet`` for the producer, seq and token its
  body declares;
* every data file is exactly ``<location>/data/<producer>/<seq:012d>-<token>-r<rank:05d>.parquet`` (packed layout:
  ``-packed.parquet``), the name the owner's writer gives it: no ``..``, no other producer's folder, no other table; one
  file per rank (packed: one file);
* its seq is the owner's next one: a gap (``allow_gap``) is published only by the owner's own commit;
* each file's Parquet footer (read once per file, cached: a footer, not the data) matches the table's file schema
  (field ids, names, types, nullability), the declared row count and the declared size; a packed file's rank table
  (:mod:`lakestream_iceberg.format.packed`) fits the world size and the file.

An intent failing any check is never published (reported once in the log); GC removes it after the grace period.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.io import FileIO
from pyiceberg.io.pyarrow import pyarrow_to_schema
from pyiceberg.schema import Schema
from pyiceberg.types import IcebergType, ListType, MapType, StructType

from lakestream_iceberg.connect.fork import ProcessPool
from lakestream_iceberg.errors import CorruptStateError
from lakestream_iceberg.format.packed import PackedFooter
from lakestream_iceberg.write.intent import INTENT_NAME, STAGING_DIR, Intent, intent_name
from lakestream_iceberg.write.intent_store import CatalogIntents, Entry, FileIntents, UnusableIntent
from lakestream_iceberg.write.writer import StagedBatch, StagedFile, data_file_path

log = logging.getLogger(__name__)

__all__ = ["Intent", "StagingArea"]

class StagingArea:
    """The intents of one table, under ``<location>/data/_staging/``."""

    def __init__(self, *, io: FileIO, location: str, world_size: int, retry_s: float, table_uuid: str,
                 file_schema: Schema, packed: bool = False, max_cached: int = 4096,
                 store: FileIntents | CatalogIntents | None = None) -> None:
        self._io = io
        self._store = store if store is not None else FileIntents(io=io, retry_s=retry_s)
        self._packed = packed
        self._location = location.rstrip("/")
        self._data = f"{self._location}/data/"
        self._root = f"{self._data}{STAGING_DIR}"
        self._world_size = world_size
        self._table_uuid = str(table_uuid)
        self._file_shape = _shape(file_schema.as_struct())
        self._footers: dict[str, bool] = {}  # data file path -> its footer matched (immutable files: checked once)
        self._good_schemas: list[pa.Schema] = []  # footers' Arrow schemas (with field metadata) that matched the table's
        self._pool = ProcessPool(max_workers=8, name="lakestream-footer")  # made on first use, in each process
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._parsed: OrderedDict[str, Intent | None] = OrderedDict()  # immutable files: parse each once
        self._max_cached = max_cached
        self._listed: dict[str, tuple[float, list[Intent]]] = {}  # branch -> (monotonic when, what) of the last listing
        self._rejected: set[str] = set()  # intents found unusable (reported once)

    @property
    def kind(self) -> str:
        """Where intents are kept: ``storage`` (files) or ``catalog`` (rows of the SQL catalog's database)."""
        return self._store.kind

    @property
    def root(self) -> str:
        """The staging root of the table: every branch's folder is under it."""
        return self._root

    def folder(self, branch: str) -> str:
        return f"{self._root}/{quote(branch, safe='')}"

    def stage(self, *, branch: str, batch: StagedBatch, allow_gap: bool) -> Intent:
        """Write the intent of a batch whose data files are all written; storage outages are retried."""
        path = f"{self.folder(branch)}/{intent_name(batch)}"
        staged_at = time.time()
        files_age_s = max(0.0, batch.age_s(staged_at, time.monotonic()) or 0.0)  # a stepped wall clock never lowers it
        intent = Intent(path=path, branch=branch, batch=batch, allow_gap=allow_gap, staged_at=staged_at,
                        table_uuid=self._table_uuid, files_age_s=files_age_s)
        self._store.put(intent)
        self._remember(path, intent)
        return intent

    def exists(self, path: str) -> bool:
        """Whether an intent is still staged (False once a commit published it and its committer removed it)."""
        return self.watch(path)()

    def watch(self, path: str) -> Callable[[], bool]:
        """``exists(path)`` as a function to call repeatedly (a holding producer polls it): the path is resolved once,
        each call is one metadata request (a stat, a HEAD, an indexed SELECT)."""
        return self._store.watch(path)

    def pending(self, branch: str, *, max_age_s: float, every_s: float = 0.0) -> list[Intent]:
        """Every readable intent of ``branch`` whose data files are younger than ``max_age_s``: the intent's age by the
        store's modification time plus the age its files had when it was staged (``Intent.files_age_s``).

        ``every_s`` > 0 lists the store at most that often and answers from the last listing in between (its intents
        may have been published since: callers check every intent's seq against the head anyway).
        """
        now, listed_at = time.time(), time.monotonic()  # ages against the store's times; the cache's by the monotonic
        last = self._listed.get(branch)  # clock (a wall clock stepped back kept serving one listing until it caught up)
        if every_s > 0 and last is not None and listed_at - last[0] < every_s:
            return last[1]
        out: list[Intent] = []
        folder = self.folder(branch)
        try:
            listed = self._store.listing(folder, bodies=True)
        except Exception as exc:  # noqa: BLE001 - storage unreachable: publish no one else's batch this time
            log.warning("cannot list staged batches under %s (%s); committing without them", self.folder(branch),
                        type(exc).__name__)
            return []
        for entry in listed:
            path, mtime = entry.path, entry.modified
            if mtime and now - mtime > max_age_s:
                continue
            name = path[len(folder) + 1:] if path.startswith(folder + "/") else ""
            if not INTENT_NAME.fullmatch(name):  # a sub-folder, or not a name stage() gives: never ours to publish
                self._reject(path, f"its name is not <producer>@<seq:012d>-<token>.parquet directly under {folder}")
                continue
            intent = self._read(entry)
            # the store's age of the intent, or the owner's (staged_at is taken before the intent's write, which may be
            # retried for a while): the larger, plus how old its files were when it was staged
            if intent is not None and max(now - mtime if mtime else 0.0, now - intent.staged_at) + intent.files_age_s \
                    > max_age_s:
                continue  # its data files are older than the bound, though the intent is not
            if intent is not None and self._usable(intent, branch=branch, name=name):
                out.append(replace(intent, modified=mtime or None))
        self._listed[branch] = (listed_at, out)
        self._forget_unlisted(folder, {entry.path for entry in listed})
        return out

    def _forget_unlisted(self, folder: str, present: set[str]) -> None:
        """Drop what this process keeps about intents of ``folder`` that are gone (published and removed by another
        producer, or collected): they never come back under the same name. Without this every intent another
        producer published stayed parsed (with its files' statistics) until 4,096 were, and its files' footer checks
        until 65,536 were."""
        prefix = folder + "/"
        with self._lock:
            gone = [p for p in self._parsed if p.startswith(prefix) and p not in present]
            for path in gone:
                self._forget(path)
            self._rejected.difference_update([p for p in self._rejected if p.startswith(prefix) and p not in present])

    def queued(self, branch: str, path: str, *, max_age_s: float) -> int:
        """How many intents of ``branch`` were staged before the intent at ``path`` (see :meth:`ahead`): its place in
        the queue of staged batches. 0 when it is gone (published) or the store cannot be listed."""
        ahead = self.ahead(branch, path, max_age_s=max_age_s)
        return 0 if ahead is None else len(ahead)

    def ahead(self, branch: str, path: str, *, max_age_s: float) -> list[tuple[str, int]] | None:
        """The ``(producer, seq)`` of every intent of ``branch`` staged before the intent at ``path`` (by the store's
        modification time, then name: every producer that lists the folder sees the same order), from one listing, no
        intent read. Names that are not intents, intents this process rejected and intents older than ``max_age_s``
        (never published) do not count. None when ``path`` is not listed (published and removed, or withdrawn) or
        the store cannot be listed."""
        folder = self.folder(branch)
        try:
            listed = [e for e in self._store.listing(folder, bodies=False) if e.path not in self._rejected]
        except Exception:  # noqa: BLE001 - storage unreachable: the caller cannot tell its place
            return None
        mine = next((e.order for e in listed if e.path == path), None)
        if mine is None:
            return None
        now = time.time()
        out: list[tuple[str, int]] = []
        for e in listed:
            p, mtime = e.path, e.modified
            if e.order >= mine or (mtime and now - mtime > max_age_s):
                continue
            match = INTENT_NAME.fullmatch(p[len(folder) + 1:]) if p.startswith(folder + "/") else None
            if match is not None:
                out.append((match["producer"], int(match["seq"])))
        return out

    def close(self) -> None:
        """Stop this process's footer-check threads (made again on the next use)."""
        self._pool.shutdown(wait=True)

    def remove(self, paths: list[str]) -> None:
        """Delete intents (best effort: one already gone, or a failing store, is left to GC).

        They also leave this process's last listing (``pending(every_s=...)`` answers from it): a listing that still
        held an intent this process published would offer it again to a commit on a head where its seq is open again
        (the branch was rolled back), and that commit would publish a batch its owner may be committing anew."""
        gone = set(paths)
        self._store.delete(list(paths))
        with self._lock:
            for path in paths:  # its files are published now: no commit checks their footers again
                self._forget(path)
            for branch, (when, listed) in list(self._listed.items()):
                if any(i.path in gone for i in listed):
                    self._listed[branch] = (when, [i for i in listed if i.path not in gone])

    # -- internals ----------------------------------------------------------------------------------------------------
    def _forget(self, path: str) -> None:
        """Drop the parsed intent at ``path`` and its files' footer checks (called with ``_lock`` held)."""
        intent = self._parsed.pop(path, None)
        if intent is not None:
            for f in intent.batch.files:
                self._footers.pop(f.path, None)

    def _remember(self, path: str, intent: Intent | None) -> None:
        with self._lock:
            self._parsed[path] = intent
            self._parsed.move_to_end(path)
            while len(self._parsed) > self._max_cached:
                self._parsed.popitem(last=False)

    def _read(self, entry: Entry) -> Intent | None:
        path = entry.path
        with self._lock:
            if path in self._parsed:
                return self._parsed[path]
        try:
            intent = self._store.load(entry)
        except UnusableIntent as exc:  # complete but unusable: never read again
            log.warning("ignoring unreadable staged intent %s (%s)", path, exc)
            self._remember(path, None)
            with self._lock:  # never published: no held batch waits for it in the queue either (see ahead)
                self._rejected.add(path)
            return None
        if intent is not None:
            self._remember(path, intent)
        return intent

    def expire(self, *, older_than_s: float, delete: bool) -> list[str]:
        """The intents of every branch staged more than ``older_than_s`` ago where GC's sweep of the table's files does
        not reach them (catalog staging), removed unless ``delete`` is false; returns their paths. Their data files
        are unreferenced files, which the sweep deletes once older than the grace period."""
        return self._store.expire(self._root, older_than_s=older_than_s, delete=delete)

    def verified(self, intent: Intent) -> bool:
        """Whether every data file of another producer's staged batch has the footer its intent declares: the table's
        file schema, the declared row count and size. Reads each footer once (files are immutable); False for a file
        that is missing or unreadable (retried at the next commit) or that does not match (never retried)."""
        if intent.path in self._rejected:
            return False
        files = [f for f in intent.batch.files if self._footers.get(f.path) is not True]
        if not files:
            return True
        if len(files) == 1:
            reasons = [self._footer(files[0])]
        else:
            reasons = [future.result() for future in [self._pool.submit(self._footer, f) for f in files]]
        for f, reason in zip(files, reasons):
            if reason is None:
                if len(self._footers) >= 65536:  # published long ago: forget (a re-check is one footer read)
                    self._footers.clear()
                self._footers[f.path] = True
            elif reason != _UNREADABLE:
                self._reject(intent.path, f"its file {f.path} {reason}")
                return False
        return all(reason is None for reason in reasons)

    def _footer(self, f: StagedFile) -> str | None:
        """None when ``f``'s Parquet footer matches its declaration, else why not (``_UNREADABLE``: try again later)."""
        try:
            with self._io.new_input(f.path).open() as stream:
                metadata = pq.read_metadata(stream)
                stream.seek(0, 2)
                size = stream.tell()
        except Exception as exc:  # noqa: BLE001 - missing (GC'd, not yet visible) or storage unreachable
            log.debug("cannot read the footer of staged file %s (%s)", f.path, exc)
            return _UNREADABLE
        if size != f.size_bytes:
            return f"is {size} bytes, its intent declares {f.size_bytes}"
        if metadata.num_rows != f.record_count:
            return f"holds {metadata.num_rows} rows, its intent declares {f.record_count}"
        if self._packed:
            try:
                PackedFooter.of(metadata, path=f.path, world_size=self._world_size)
            except CorruptStateError as exc:
                return f"has no usable rank table ({exc})"
        try:
            arrow = metadata.schema.to_arrow_schema().remove_metadata()  # field metadata (ids) stays
        except Exception as exc:  # noqa: BLE001 - a schema Arrow cannot represent
            return f"has no Iceberg schema ({exc})"
        if any(arrow.equals(known, check_metadata=True) for known in self._good_schemas):
            return None  # field for field (field ids in the field metadata) a schema that matched: the same shape
        try:
            shape = _shape(pyarrow_to_schema(arrow).as_struct())
        except Exception as exc:  # noqa: BLE001 - e.g. a Parquet file without Iceberg field ids
            return f"has no Iceberg schema ({exc})"
        if shape != self._file_shape:
            return "does not have the table's file schema (field ids, names, types, nullability)"
        with self._lock:
            if len(self._good_schemas) < 8:
                self._good_schemas.append(arrow)
        return None

    def _usable(self, intent: Intent, *, branch: str, name: str) -> bool:
        """The cheap checks (no I/O): this table and branch, the name its body declares, one file per rank, each at the
        exact path its owner's writer gives it. Anything else is never published (and reported once)."""
        if intent.path in self._rejected:
            return False
        reason = self._check(intent, branch=branch, name=name)
        if reason is None:
            return True
        self._reject(intent.path, reason)
        return False

    def _check(self, intent: Intent, *, branch: str, name: str) -> str | None:
        batch = intent.batch
        if intent.table_uuid != self._table_uuid:
            return f"it belongs to table {intent.table_uuid}, not this one ({self._table_uuid}): a dropped table's leftover"
        if intent.branch != branch:
            return f"it names branch {intent.branch!r} but is staged under branch {branch!r}"
        if name != intent_name(batch):
            return f"its name does not match its producer {batch.producer!r}, seq {batch.seq} and token {batch.token!r}"
        ranks = [f.rank for f in batch.files]
        if self._packed and ranks != [None]:
            return f"it lists {len(ranks)} files with ranks {ranks}; the stream is packed: one file of every rank"
        if not self._packed and (None in ranks or sorted(ranks) != list(range(self._world_size))):  # type: ignore[type-var]
            return f"it has ranks {ranks}, the stream has world size {self._world_size}"
        for f in batch.files:
            expected = data_file_path(self._location, producer=batch.producer, seq=batch.seq, token=batch.token,
                                      rank=f.rank)
            if f.path != expected:
                return f"rank {f.rank}'s file {f.path!r} is not where its owner writes it ({expected!r})"
        return None

    def _reject(self, path: str, reason: str) -> None:
        with self._lock:  # another thread's listing may be forgetting rejections (_forget_unlisted)
            new = path not in self._rejected
            self._rejected.add(path)
        if new:
            log.warning("ignoring staged intent %s: %s; it is never published (GC removes it)", path, reason)


_UNREADABLE = "unreadable"


def _shape(struct: StructType) -> tuple[Any, ...]:
    """What a data file's schema must match: field ids, names, types and nullability, nested (docs ignored)."""
    return tuple((f.field_id, f.name, f.required, _type_shape(f.field_type)) for f in struct.fields)


def _type_shape(t: IcebergType) -> Any:
    if isinstance(t, StructType):
        return ("struct", _shape(t))
    if isinstance(t, ListType):
        return ("list", t.element_id, t.element_required, _type_shape(t.element_type))
    if isinstance(t, MapType):
        return ("map", t.key_id, _type_shape(t.key_type), t.value_id, t.value_required, _type_shape(t.value_type))
    return str(t)
