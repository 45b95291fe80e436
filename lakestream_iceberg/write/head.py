"""What one producer id reads from the head of its branch: the stream's state, its next seq, where a seq was published.

A :class:`~lakestream_iceberg.write.producer.Producer` asks before it writes anything (a re-commit of a published seq
is a duplicate, a seq that would leave a gap is refused), and the planner of each of its commits
(:class:`~lakestream_iceberg.write.planner.BatchPlanner`) asks again on every head it plans on. Both read through the
producer's :class:`~lakestream_iceberg.write.commit.CommitLoop`, which holds the producer's view of the table.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

from pyiceberg.table.metadata import TableMetadata

from lakestream_iceberg.connect.storage import modified_at
from lakestream_iceberg.errors import CommitError, ForeignSnapshotError, SequenceError
from lakestream_iceberg.format.checks import check_branch
from lakestream_iceberg.format.lineage import branch_state
from lakestream_iceberg.format.summary import MAX_SEQ, StreamState
from lakestream_iceberg.write.commit import CommitLoop
from lakestream_iceberg.write.reconcile import (
    BatchFile,
    Found,
    check_follows,
    check_publisher,
    check_replay,
    find_published,
)
from lakestream_iceberg.write.writer import StagedBatch

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["ProducerHead"]

log = logging.getLogger(__name__)


class ProducerHead:
    """One producer id on one branch, as the branch's head shows it (read through ``loop``'s view of the table)."""

    def __init__(self, stream: StreamTable, *, producer_id: str, branch: str, loop: CommitLoop) -> None:
        self.stream = stream
        self.producer_id = producer_id
        self.branch = branch
        self.loop = loop

    def refresh(self) -> TableMetadata:
        """The head, read fully (see :meth:`CommitLoop.refresh`), within the stream's commit timeout."""
        return self.loop.refresh(deadline=time.monotonic() + self.stream.config.commit_timeout_s)

    def check_branch(self, metadata: TableMetadata) -> None:
        """Refuse (:class:`CommitError`) a branch deleted or re-tagged since: a producer never commits to a tag."""
        check_branch(metadata, self.branch, stream=self.stream.name, error=CommitError,
                     doing=f"producer {self.producer_id!r} cannot commit to")

    def state(self, metadata: TableMetadata) -> StreamState:
        """The branch's state in ``metadata``; a head another engine changed marks the view stale (the next call reads
        the head again: it may have been repaired meanwhile) and raises :class:`ForeignSnapshotError`."""
        self.check_branch(metadata)
        try:
            return self.stream.branch_state(branch=self.branch, metadata=metadata)
        except ForeignSnapshotError:
            self.loop.mark_stale()
            raise

    def next_seq(self, state: StreamState) -> int:
        return state.next_seq(self.stream.io, self.producer_id)

    def check_seq(self, seq: int, state: StreamState, allow_gap: bool) -> None:
        """Refuse (:class:`SequenceError`) a seq that would skip past this id's next one, unless ``allow_gap``."""
        expected = self.next_seq(state)
        if seq > MAX_SEQ:  # the head's seq of this id is the largest a summary records: a snapshot could not say more
            raise SequenceError(
                f"producer {self.producer_id!r} on branch {self.branch!r} cannot publish seq {seq}: seqs go up to "
                f"{MAX_SEQ} (a 64-bit Iceberg long). Use another producer id"
            )
        if seq > expected and not allow_gap:
            raise SequenceError(
                f"producer {self.producer_id!r} on branch {self.branch!r} would skip from seq {expected} to {seq}; "
                f"commit seq {expected} first, or pass allow_gap=True to skip on purpose"
            )

    def published(self, metadata: TableMetadata, seq: int) -> Found | None:
        """Where this id's ``seq`` was published on the branch (see :func:`find_published`), or None."""
        return find_published(self.stream, metadata, self.state(metadata), producer_id=self.producer_id,
                              branch=self.branch, seq=seq)

    def check_publisher(self, metadata: TableMetadata, found: Found, staged: StagedBatch, *, since: float,
                        earlier: frozenset[str] = frozenset()) -> bool | None:
        """Whether the snapshot that published ``found`` holds ``staged`` (None: cannot tell; see
        :func:`check_publisher`)."""
        return check_publisher(self.stream.io, metadata, found, staged, producer_id=self.producer_id,
                               branch=self.branch, since=since, earlier=earlier,
                               file=self._file(metadata, found, staged.seq))

    def check_replay(self, metadata: TableMetadata, found: Found, *, seq: int, since: float,
                     earlier: frozenset[str] = frozenset()) -> None:
        """Whether ``seq``, published before the call began, may be answered as a replay (see :func:`check_replay`)."""
        check_replay(metadata, found, producer_id=self.producer_id, branch=self.branch, seq=seq, since=since,
                     earlier=earlier, file=self._file(metadata, found, seq))

    def last_seq(self, state: StreamState) -> int:
        """This id's last published seq in ``state`` (-1 when it never published)."""
        return self.next_seq(state) - 1

    def left(self, metadata: TableMetadata, seen: tuple[int, int]) -> int | None:
        """When the branch's head in ``metadata`` no longer descends from ``seen`` (a head this producer read or
        committed: its snapshot id and sequence number), as after another engine rolled the branch back: this id's last
        seq where the head's lineage leaves ``seen``'s, at its newest ancestor older than ``seen`` (-1: none there).
        None when the head descends from ``seen``, or when that cannot be told (expiry cut the head's lineage above
        ``seen``'s age)."""
        seen_id, number = seen
        current = metadata.snapshot_by_name(self.branch)
        if number <= 0 or current is None or seen_id in (current.snapshot_id, current.parent_snapshot_id):
            return None  # the usual case (its own commit on the head it read); format version 1 numbers no commits
        by_id = {s.snapshot_id: s for s in metadata.snapshots}
        walked: set[int] = set()
        while current is not None and current.snapshot_id != seen_id and current.parent_snapshot_id != seen_id:
            if (current.sequence_number or 0) <= number:  # made before ``seen`` (Iceberg numbers commits), yet not below it
                return self.last_seq(branch_state(metadata, current, stream=self.stream.name, branch=self.branch))
            if current.snapshot_id in walked:  # parent links that loop (another engine's): walked forever, newer than
                # ``seen`` all along; whether the head left it cannot be told, as when expiry cut the lineage
                log.warning("the ancestry of branch %r of %s loops back to snapshot %d: whether another engine rolled "
                            "the branch back under producer %s cannot be told", self.branch, self.stream.name,
                            current.snapshot_id, self.producer_id)
                return None
            walked.add(current.snapshot_id)
            parent = current.parent_snapshot_id
            current = by_id.get(parent) if parent is not None else None
        return None

    def check_follows(self, metadata: TableMetadata, *, last: int, seq: int, first_seen: int, since: float,
                      earlier: frozenset[str]) -> None:
        """Before publishing the new ``seq`` after ``last``, published since this producer first read the table and
        answered by no call of it: refuse another live writer's batch (see :func:`check_follows`)."""
        found = self.published(metadata, last)
        if found is None:
            return
        check_follows(metadata, found, producer_id=self.producer_id, branch=self.branch, last=last, seq=seq,
                      first_seen=first_seen, since=since, earlier=earlier, file=self._file(metadata, found, last))

    def _file(self, metadata: TableMetadata, found: Found, seq: int) -> BatchFile | None:
        """This id's batch ``seq`` (published as ``found``) told by its data file, once the snapshot that published it
        has expired (a busy stream keeps a few): the snapshot no longer tells whose batch it was. None while the
        snapshot is there, or when the step is no longer known."""
        snapshot_id = found["snapshot_id"]
        if found["step"] is None or (snapshot_id is not None and metadata.snapshot_by_id(snapshot_id) is not None):
            return None
        return self._batch_file(metadata, found["step"], seq)

    def _batch_file(self, metadata: TableMetadata, step: int, seq: int) -> BatchFile:
        """The token of this id's batch ``seq`` published as ``step``, from its data file's name
        (``data/<producer>/<seq>-<token>-<rank>.parquet``), and that file's modification time; None for what cannot
        be read (a file named otherwise: another engine's)."""
        prefix = f"/data/{self.producer_id}/{seq:012d}-"
        for entry in self.stream.index.entries(metadata.snapshot_by_name(self.branch), step):
            path = entry.data_file.file_path
            at = path.rfind(prefix)
            if at < 0:
                continue
            token = path[at + len(prefix):].split("-", 1)[0]
            return BatchFile(token or None, functools.partial(modified_at, self.stream.io, path))
        return BatchFile(None, None)

    def opens(self, seq: int | None) -> tuple[int, tuple[int, int] | None] | None:
        """This id's next seq as a light read of the head shows it (:meth:`CommitLoop.peek`), when that is ``seq`` or
        ``seq`` is None, with the head's snapshot id and sequence number (:attr:`Peek.head`); else (a duplicate, a gap,
        a head the light read cannot tell) None: read the head fully."""
        self.check_branch(self.loop.metadata)  # a branch that is no branch is refused before anything is written
        peek = self.loop.peek()
        if peek is None:
            return None
        try:
            expected = self.next_seq(peek.state)
        except Exception:  # noqa: BLE001 - e.g. a producer-state file unreadable now: the full read retries or reports
            return None
        return (expected, peek.head) if seq in (None, expected) else None
