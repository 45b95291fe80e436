"""Staged batches: a written global batch announced in object storage, so that any producer's commit can publish it.

This is how commits stay cheap when many producers share a stream (group commit). A producer that is not alone writes
its batch's data files, then one small *intent* naming them (a one-row Parquet file holding a JSON document: object
stores that serve Iceberg tables, such as S3 Tables buckets, accept only Parquet and Avro under a table's ``data/``)::

    <table location>/data/_staging/<branch, URL-quoted>/<producer>@<seq:012d>-<token>.parquet

(one flat folder per branch: listing it costs the intents staged now, never a folder per producer id ever seen)

and waits (:mod:`lakestream_iceberg.write.dac` decides how long) for another producer's commit to publish it. Whichever
producer commits next lists the branch's staging folder and publishes every eligible intent in the same
compare-and-swap, each batch as its own snapshot with its own step, its owner's producer id and seq in the summary.
Producers still never talk to each other: they share the object store and the catalog, nothing else.

Rules that keep exactly-once intact:

* An intent is immutable: written once under a unique name (``token`` is the batch's data-file token), never changed.
  A reader that finds a half-written file (a local filesystem has no atomic PUT) skips it this time. Producer ids
  start with a letter or digit, so ``_staging`` never collides with a producer's data folder.
* A commit publishes intent (producer, seq) only when the head it builds on says ``seq`` is that producer's next
  sequence number (or a gap the owner allowed), so the compare-and-swap that checks the head also checks the seq: two
  producers racing to publish the same intent cannot both land, and a published intent is never published again.
* At most one intent per producer per commit; a producer that restarted may leave two intents for one seq (the dead
  incarnation's and its own), and the newer one is taken.
* The owner learns its batch was published when its intent disappears (the committer deletes what it published)
  or when a refresh shows its seq in the head's producer table.
* Intents older than half the GC grace period are never published: lifecycle GC may delete an unreferenced intent and
  its data files once they are older than the grace period.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.io import FileIO

from lakestream_iceberg.connect.diagnose import call_with_retry
from lakestream_iceberg.connect.storage import list_files
from lakestream_iceberg.write.writer import StagedBatch, StagedFile, check_producer_id

log = logging.getLogger(__name__)

__all__ = ["Intent", "StagingArea"]

INTENT_FORMAT = 1
STAGING_DIR = "_staging"  # under the table's data/ folder
_PARQUET_MAGIC = b"PAR1"


@dataclass(frozen=True)
class Intent:
    """A staged batch: where its intent file is, and what it publishes."""

    path: str
    branch: str
    batch: StagedBatch
    allow_gap: bool
    staged_at: float  # unix seconds, by the owner's clock

    def to_bytes(self) -> bytes:
        """The intent file: one row, one string column ``intent`` holding the JSON document."""
        sink = io.BytesIO()
        pq.write_table(pa.table({"intent": [self._json()]}), sink, compression="none")
        return sink.getvalue()

    @classmethod
    def from_bytes(cls, path: str, raw: bytes) -> Intent:
        column = pq.read_table(io.BytesIO(raw)).column("intent")
        if len(column) != 1:
            raise ValueError(f"an intent file holds one row, this one {len(column)}")
        return cls.from_json(path, column[0].as_py())

    def _json(self) -> str:
        return json.dumps(
            {
                "format": INTENT_FORMAT, "branch": self.branch, "producer": self.batch.producer, "seq": self.batch.seq,
                "token": self.batch.token, "allow_gap": self.allow_gap, "staged_at": self.staged_at,
                "files": [f.to_json() for f in self.batch.files],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, path: str, raw: str) -> Intent:
        body = json.loads(raw)
        if body.get("format") != INTENT_FORMAT:
            raise ValueError(f"unknown intent format {body.get('format')!r}")
        files = tuple(StagedFile.from_json(f) for f in body["files"])
        batch = StagedBatch(producer=check_producer_id(body["producer"]), seq=int(body["seq"]), files=files,
                            token=str(body["token"]))
        return cls(path=path, branch=str(body["branch"]), batch=batch, allow_gap=bool(body["allow_gap"]),
                   staged_at=float(body["staged_at"]))


class StagingArea:
    """The intents of one table, under ``<location>/staging/``."""

    def __init__(self, *, io: FileIO, location: str, world_size: int, retry_s: float, max_cached: int = 4096) -> None:
        self._io = io
        self._data = f"{location.rstrip('/')}/data/"
        self._root = f"{self._data}{STAGING_DIR}"
        self._world_size = world_size
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._parsed: OrderedDict[str, Intent | None] = OrderedDict()  # immutable files: parse each once
        self._max_cached = max_cached
        self._listed: dict[str, tuple[float, list[Intent]]] = {}  # branch -> (when, what) of the last listing
        self._rejected: set[str] = set()  # intents found unusable (reported once)

    def folder(self, branch: str) -> str:
        return f"{self._root}/{quote(branch, safe='')}"

    def stage(self, *, branch: str, batch: StagedBatch, allow_gap: bool) -> Intent:
        """Write the intent of a batch whose data files are all written; storage outages are retried."""
        path = f"{self.folder(branch)}/{batch.producer}@{batch.seq:012d}-{batch.token}.parquet"
        intent = Intent(path=path, branch=branch, batch=batch, allow_gap=allow_gap, staged_at=time.time())
        body = intent.to_bytes()

        def write() -> None:
            with self._io.new_output(path).create(overwrite=True) as out:
                out.write(body)

        call_with_retry(write, what=f"staging {path}", timeout_s=self._retry_s)
        self._remember(path, intent)
        return intent

    def exists(self, path: str) -> bool:
        """Whether an intent is still staged (False once a commit published it and its committer removed it)."""
        try:
            return self._io.new_input(path).exists()
        except Exception:  # storage unreachable: still staged, as far as we know
            return True

    def pending(self, branch: str, *, max_age_s: float, every_s: float = 0.0) -> list[Intent]:
        """Every readable intent of ``branch`` younger than ``max_age_s`` (by the store's modification time).

        ``every_s`` > 0 lists the store at most that often and answers from the last listing in between (its intents
        may have been published since: callers check every intent's seq against the head anyway).
        """
        now = time.time()
        last = self._listed.get(branch)
        if every_s > 0 and last is not None and now - last[0] < every_s:
            return last[1]
        out: list[Intent] = []
        try:
            listed = list(list_files(self._io, self.folder(branch)))
        except Exception as exc:  # noqa: BLE001 - storage unreachable: publish no one else's batch this time
            log.warning("cannot list staged batches under %s (%s); committing without them", self.folder(branch),
                        type(exc).__name__)
            return []
        for path, _size, mtime in listed:
            if not path.endswith(".parquet") or (mtime and now - mtime > max_age_s):
                continue
            intent = self._read(path)
            if intent is not None and intent.branch == branch and self._usable(intent):
                out.append(intent)
        self._listed[branch] = (now, out)
        return out

    def remove(self, paths: list[str]) -> None:
        """Delete intents (best effort: one already gone, or a failing store, is left to GC)."""
        for path in paths:
            try:
                self._io.delete(path)
            except Exception:  # noqa: BLE001 - already deleted by its owner or another committer
                pass
            with self._lock:
                self._parsed.pop(path, None)

    # -- internals ----------------------------------------------------------------------------------------------------
    def _remember(self, path: str, intent: Intent | None) -> None:
        with self._lock:
            self._parsed[path] = intent
            self._parsed.move_to_end(path)
            while len(self._parsed) > self._max_cached:
                self._parsed.popitem(last=False)

    def _read(self, path: str) -> Intent | None:
        with self._lock:
            if path in self._parsed:
                return self._parsed[path]
        try:
            with self._io.new_input(path).open() as f:
                raw = f.read()
        except Exception:  # noqa: BLE001 - deleted since the listing (published meanwhile) or unreachable: skip
            return None
        try:
            intent = Intent.from_bytes(path, raw)
        except Exception as exc:  # noqa: BLE001 - half-written (local filesystems have no atomic PUT) or foreign
            if raw.endswith(_PARQUET_MAGIC) and len(raw) > 8:  # complete but unusable: never retry it
                log.warning("ignoring unreadable staged intent %s (%s)", path, exc)
                self._remember(path, None)
            return None
        self._remember(path, intent)
        return intent

    def _usable(self, intent: Intent) -> bool:
        """One file per rank, all of them data files of this table: anything else is never published (and reported
        once)."""
        if intent.path in self._rejected:
            return False
        if self._check(intent):
            return True
        self._rejected.add(intent.path)
        return False

    def _check(self, intent: Intent) -> bool:
        ranks = sorted(f.rank for f in intent.batch.files)
        if ranks != list(range(self._world_size)):
            log.warning("ignoring staged intent %s: it has ranks %s, the stream has world size %d", intent.path, ranks,
                        self._world_size)
            return False
        if not all(f.path.startswith(self._data) and not f.path.startswith(self._root) for f in intent.batch.files):
            log.warning("ignoring staged intent %s: it names files outside %s", intent.path, self._data)
            return False
        return True
