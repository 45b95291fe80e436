"""Where a producer's (id, seq) was published, and whether what was published is the batch this call wrote.

A producer asks before it writes anything (a re-commit of a published seq is a duplicate) and again each time it reads
the head while committing (its batch may have been carried by another producer's group commit, or its own commit whose
outcome was unknown may have landed). Every published batch records its token (``lakestream.token``, also in its data
file names) and, when another producer's commit carried it, when it was staged (``lakestream.staged-at-ms``): so a
producer tells its own batch from an earlier incarnation's (staged, or committed directly in a snapshot made, before
this producer was made: a duplicate) and from another live writer's under the same id (:class:`ProducerConflictError`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from pyiceberg.io import FileIO
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot

from lakestream_iceberg.errors import CorruptStateError, ProducerConflictError, SequenceError
from lakestream_iceberg.format.expiry import ancestors
from lakestream_iceberg.format.summary import OP_APPEND, StreamState
from lakestream_iceberg.write.writer import StagedBatch

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["BatchFile", "Found", "check_follows", "check_publisher", "check_replay", "find_published"]


class Found(TypedDict):
    """Where a (producer, seq) was published: its step (None once collected), snapshot (None once expired), and how
    many batches that snapshot's commit published (1 once the snapshot expired: no longer known)."""

    step: int | None
    snapshot_id: int | None
    group: int


class BatchFile:
    """A published batch told by its data file once the snapshot that published it has expired: the batch's token, which
    the file's name holds, and when the file was written (the store's modification time, no later than when the batch
    was sent); None for what cannot be read (a file named otherwise, a store that keeps no times).

    ``written_at`` asks the store on first use only (``read_time``, one request): a token that settles the question (the
    call's own batch, one of its failed calls') needs no request, as for a carried batch, the common case."""

    __slots__ = ("_read_time", "_written_at", "token")

    def __init__(self, token: str | None, read_time: Callable[[], float | None] | None = None) -> None:
        self.token = token
        self._read_time = read_time
        self._written_at: float | None = None

    @property
    def written_at(self) -> float | None:
        if self._read_time is not None:
            self._written_at, self._read_time = self._read_time(), None
        return self._written_at


def find_published(stream: StreamTable, metadata: TableMetadata, state: StreamState, *, producer_id: str, branch: str,
                   seq: int) -> Found | None:
    """Where (producer, seq) was published on ``branch`` (whose head records ``state``), or None when it was not.

    Raises:
        SequenceError: ``seq`` is below the producer's published seq but was never published (it was skipped with
            ``allow_gap``), and its absence is certain: nothing was ever collected, or a lower seq of the producer is
            still live (seqs land in order, and GC collects only steps below every live one, so ``seq`` would be
            live too). Only when every earlier seq of the producer was collected is the answer "published, step
            unknown" (``step`` None).
    """
    known = state.lookup(stream.io, producer_id)
    if known is None or known.seq < seq:
        return None
    if known.seq == seq:
        return {"step": known.step, "snapshot_id": known.snapshot_id, "group": _group(metadata, known.snapshot_id)}
    head = metadata.snapshot_by_name(branch)
    for snapshot_id in ancestors(metadata, head.snapshot_id if head else None, len(metadata.snapshots)):
        st = StreamState.of(metadata.snapshot_by_id(snapshot_id))
        if st.op == OP_APPEND and st.producer == producer_id and st.seq == seq:
            return {"step": st.step, "snapshot_id": snapshot_id, "group": st.group}
    # at most the step of the producer's published seq: a fork's own batch of ``seq``, not the one it inherited
    step = stream.index.step_of_file(metadata, branch, f"/data/{producer_id}/{seq:012d}-", up_to=known.step)
    if step is None and (state.collected_below <= 1 or _lower_seq_live(stream, metadata, branch, producer_id, seq)):
        raise SequenceError(
            f"producer {producer_id!r} seq {seq} was never published on branch {branch!r} and never will be: the "
            f"producer's published seq is {known.seq}, so seq {seq} was skipped (a commit with allow_gap=True). "
            f"Commit seq {known.seq + 1} next"
        )
    return {"step": step, "snapshot_id": None, "group": 1}


def _group(metadata: TableMetadata, snapshot_id: int | None) -> int:
    """How many batches the commit that wrote ``snapshot_id`` published (1 when the snapshot is no longer known, or its
    summary cannot tell: that is the summary's reader's error to raise, not a duplicate's)."""
    snapshot = metadata.snapshot_by_id(snapshot_id) if snapshot_id is not None else None
    if snapshot is None:
        return 1
    try:
        return StreamState.of(snapshot).group
    except CorruptStateError:
        return 1


def _lower_seq_live(stream: StreamTable, metadata: TableMetadata, branch: str, producer_id: str, seq: int) -> bool:
    lowest = stream.index.lowest_live_seq(metadata, branch, producer_id)
    return lowest is not None and lowest < seq


def check_publisher(io: FileIO, metadata: TableMetadata, found: Found, staged: StagedBatch, *, producer_id: str,
                    branch: str, since: float, earlier: frozenset[str] = frozenset(),
                    file: BatchFile | None = None) -> bool | None:
    """Whether the snapshot that published (producer, seq) holds ``staged``, the batch this call wrote.

    True: its token is ``staged``'s (this call's commit landed: carried, or its reply was lost). False: it holds a batch
    of that seq that is not another live writer's: an earlier incarnation's, staged before this producer was made
    (``since``, unix seconds) and carried by another producer's commit, or committed directly in a snapshot made before
    then (the snapshot's timestamp: a commit whose caller gave up on it may land late); or this producer's own from an
    earlier call that failed after writing (its token in ``earlier``). The call's seq is then a duplicate. Once that
    snapshot has expired, the batch's data file tells (``file``): its token, and when it was written (also False when
    that cannot be read: the batch is not this call's). None when nothing can be compared (no token recorded or
    readable).

    Raises:
        ProducerConflictError: It holds a batch staged, or committed in a snapshot made (or its data file written),
            since this producer was made, by no call of it: another live writer uses the same producer id (this call's
            files are deleted first: nothing refers to them).
    """
    snapshot = metadata.snapshot_by_id(found["snapshot_id"]) if found["snapshot_id"] is not None else None
    token = StreamState.of(snapshot).token if snapshot is not None else file.token if file is not None else None
    if token is None:
        return None
    if token == staged.token:
        return True
    if (sent := _sent_by_another_in(metadata, found, since=since, earlier=earlier, file=file)) is None:
        return False
    token, how = sent
    for f in staged.files:
        try:
            io.delete(f.path)
        except Exception:  # noqa: BLE001 - GC collects it after the grace period
            pass
    raise ProducerConflictError(
        f"producer {producer_id!r} seq {staged.seq} on branch {branch!r} was published as step {found['step']} "
        f"(snapshot {found['snapshot_id']}) with batch {token!r} ({how}), not with the batch this call wrote "
        f"({staged.token!r}). Another live process is using producer id {producer_id!r} (or "
        "something wrote a staged intent under it). Nothing of this call was published and its files were deleted: "
        f"give every live producer its own id, and check what step {found['step']} holds"
    )


def check_replay(metadata: TableMetadata, found: Found, *, producer_id: str, branch: str, seq: int, since: float,
                 earlier: frozenset[str] = frozenset(), file: BatchFile | None = None) -> None:
    """A call of an explicit ``seq`` that was published before the call began, by no call of this producer: a replay
    (``duplicate=True``) when the batch that published it is an earlier incarnation's, sent before this producer was
    made (``since``) or one of this producer's own failed calls (``earlier``); once the snapshot has expired, its data
    file tells (``file``); nothing to compare when neither records a token, or the file's time cannot be read.

    Raises:
        ProducerConflictError: The batch was staged, or committed in a snapshot made (or its data file written), since
            this producer was made:
            another live writer uses the same producer id (nothing of this call was written).
    """
    if (sent := _sent_by_another_in(metadata, found, since=since, earlier=earlier, file=file)) is None:
        return
    token, how = sent
    raise ProducerConflictError(
        f"producer {producer_id!r} seq {seq} on branch {branch!r} was published as step {found['step']} (snapshot "
        f"{found['snapshot_id']}) with batch {token!r}, {how}, by no call of this producer: it is no replay of an "
        f"earlier incarnation's batch. Another live process is using producer id {producer_id!r}. Nothing of this call "
        f"was written: give every live producer its own id, and check what step {found['step']} holds"
    )


def check_follows(metadata: TableMetadata, found: Found, *, producer_id: str, branch: str, last: int, seq: int,
                  first_seen: int, since: float, earlier: frozenset[str] = frozenset(),
                  file: BatchFile | None = None) -> None:
    """A call about to publish the new ``seq`` after this id's last published seq ``last``, which was published after
    this producer first read the table (the id's last seq was ``first_seen`` then) and which no call of this producer
    answered: fine when its batch is an earlier incarnation's, sent before this producer was made (``since``: a batch
    the dead process staged, or a commit it gave up on, that landed late), or this producer's own from a call that
    failed after writing (its token in ``earlier``), or when that cannot be told (no token recorded, or the snapshot
    expired and its data file, ``file``, does not tell its token or when it was written).

    Raises:
        ProducerConflictError: Another batch, sent since this producer was made, published it: another live writer uses
            the same producer id. Both number their batches after the table's state (``seq=None``), so they would
            publish in turns without ever colliding on a seq (nothing of this call was written).
    """
    if (sent := _sent_by_another_in(metadata, found, since=since, earlier=earlier, file=file)) is None:
        return
    token, how = sent
    raise ProducerConflictError(
        f"producer {producer_id!r} cannot publish seq {seq} on branch {branch!r}: the id's last seq {last} was published "
        f"as step {found['step']} (snapshot {found['snapshot_id']}) with batch {token!r}, {how}, by no call of "
        f"this producer, after it first read the table (the id's last seq was {first_seen} then). Another live process "
        f"is using producer id {producer_id!r}, and the two would publish in turns. Nothing of this call was written: "
        f"give every live producer its own id, and check what step {found['step']} holds"
    )


def _sent_by_another_in(metadata: TableMetadata, found: Found, *, since: float, earlier: frozenset[str],
                        file: BatchFile | None = None) -> tuple[str, str] | None:
    """The token of the batch that published ``found`` and how it was sent, when another live writer sent it
    (:func:`_sent_by_another`); None when it is an earlier incarnation's or this producer's own, or when nothing can be
    compared (no token recorded). Once the snapshot has expired, the batch's data file tells (``file``): written since
    this producer was made, by no call of it, it is another live writer's."""
    snapshot = metadata.snapshot_by_id(found["snapshot_id"]) if found["snapshot_id"] is not None else None
    if snapshot is None:
        if file is None or file.token is None or file.token in earlier:
            return None
        written_at = file.written_at  # asked of the store only here
        if written_at is None or written_at < since:
            return None
        return file.token, (f"whose data file was written at {written_at:.3f} (unix s, by the store's clock; its "
                            f"snapshot has expired since), after this producer was made at {since:.3f}")
    state = StreamState.of(snapshot)
    if state.token is None:
        return None
    how = _sent_by_another(snapshot, state, since=since, earlier=earlier)
    return None if how is None else (state.token, how)


def _sent_by_another(snapshot: Snapshot, state: StreamState, *, since: float, earlier: frozenset[str]) -> str | None:
    """How the batch ``snapshot`` published was sent, when that was since this producer was made (``since``) and not by
    one of its own failed calls (``earlier``): another live writer's; None when it is an earlier incarnation's or its own.

    Sent: staged (carried by another producer's commit), or else in its own commit, whose snapshot it made (when that
    call began, ``lakestream.sent-at-ms``: a commit whose outcome its caller never learnt may land late; the snapshot's
    timestamp for snapshots written without it, which a commit dated after a future-dated one, of another engine or
    of a host whose clock runs ahead, moves later: a restarted producer's replay was then taken for a live twin's)."""
    sent_ms = state.staged_at_ms if state.staged_at_ms is not None else \
        state.sent_at_ms if state.sent_at_ms is not None else snapshot.timestamp_ms
    if state.token in earlier or sent_ms / 1000 < since:
        return None
    how = (f"staged at {sent_ms / 1000:.3f} (unix s)" if state.staged_at_ms is not None else
           f"committed directly by a producer with the same id, in a call made at {sent_ms / 1000:.3f} (unix s)")
    return f"{how}, after this producer was made at {since:.3f}"
