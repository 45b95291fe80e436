"""What one producer object sent, so that it tells its own batches from those of another writer with the same id.

A producer id is the only fence between writers (docs/concepts.md, "Two live processes with one id"). To tell its own
batches from an earlier incarnation's and from another live writer's, a :class:`~lakestream_iceberg.write.producer.Producer`
keeps, in an :class:`OwnBatches`:

* when it was made: a batch of its id sent (staged, or committed directly) before then is an earlier incarnation's;
* the seqs it answered with success (:class:`~lakestream_iceberg.write.seq_ranges.SeqRanges`): a replay of one of them
  is answered the same way, whoever's batch published it;
* the tokens of its calls that failed after writing, the last :data:`UNSETTLED_KEPT`: their batches may still be
  published (carried by another producer's group commit, or a commit the catalog applied late), and are its own;
* the id's last published seq when it first read the table: a later seq of the id that it did not publish was sent by
  someone else;
* the head it last read or committed (:attr:`OwnBatches.seen`): when another engine rolls the branch back (or points
  it at another lineage), the seqs published after the point where the new head's lineage leaves that one are no
  longer on the branch, and may be published again, by anyone: the fence and the answered seqs follow the branch back
  to that point (:meth:`OwnBatches.rebase`), so that a live twin's batch published again there is told as before;
* the tokens of the batches it published last, the last :data:`UNSETTLED_KEPT`: those a rollback took off the branch
  are still its own should another engine bring them back (a fast-forward to the old head).
"""

from __future__ import annotations

import time
from collections import deque

from lakestream_iceberg.write.seq_ranges import SeqRanges

__all__ = ["UNSETTLED_KEPT", "OwnBatches"]

UNSETTLED_KEPT = 64  # the calls that failed after writing whose batches a producer still recognises as its own


class OwnBatches:
    """The batches one producer object sent (module docstring)."""

    def __init__(self) -> None:
        self.made_at = time.time()
        self._answered = SeqRanges()
        self._failed: deque[tuple[int, str]] = deque(maxlen=UNSETTLED_KEPT)
        self._kept: deque[tuple[int, str]] = deque(maxlen=UNSETTLED_KEPT)  # its own batches it published last
        self._left: deque[tuple[int, str]] = deque(maxlen=UNSETTLED_KEPT)  # those of them a rollback took off the branch
        self.first_seen: int | None = None  # the id's last seq at the first read of the table (-1: none; None: unread)
        self.seen: tuple[int, int] | None = None  # the head last read or committed: (snapshot id, sequence number)

    def answered(self, seq: int, token: str | None = None) -> None:
        """``seq`` was answered with success: its batch (``token``, when this producer published it), or one judged an
        earlier incarnation's."""
        self._answered.add(seq)
        if token is not None:
            self._kept.append((seq, token))

    def __contains__(self, seq: int) -> bool:
        """Whether ``seq`` was answered with success (a replay of it is answered the same way)."""
        return seq in self._answered

    def failed(self, seq: int, token: str) -> None:
        """A call of ``seq`` failed after writing the batch ``token``: it may still be published."""
        self._failed.append((seq, token))

    def failed_tokens(self, seq: int) -> frozenset[str]:
        """The tokens of this producer's own batches of ``seq`` that the branch may show, though no call of it answered
        them: the calls that failed after writing (the last :data:`UNSETTLED_KEPT`), and the batches it published that a
        rollback took off the branch (another engine may bring them back: a fast-forward to the old head)."""
        return frozenset(token for failed, token in (*self._failed, *self._left) if failed == seq)

    def returned(self, seq: int) -> bool:
        """Whether this producer published a batch of ``seq`` that a rollback took off the branch (see :meth:`rebase`):
        found on the branch again, it is that batch, not a later one."""
        return any(left == seq for left, _ in self._left)

    def follows(self, last: int) -> bool:
        """Whether this id's last published seq ``last`` (-1: none) is one the producer may publish after without a
        check: one published before it first read the table (an earlier incarnation's; the first call records that
        read), or one it answered itself. Any other is checked
        (:func:`~lakestream_iceberg.write.reconcile.check_follows`): another live writer's, its own from a failed call,
        or an earlier incarnation's that landed late (sent before this producer was made). Two producers of one id that
        both number after the table (``seq=None``) would otherwise publish in turns, each every other seq, and never
        collide on one; of two live writers, the one about to publish after the other's batch (sent once both were
        made) is refused, and the other goes on."""
        if self.first_seen is None:
            self.first_seen = last
        return last <= self.first_seen or last in self._answered

    def rebase(self, last: int) -> None:
        """The branch was rolled back to where this id's last published seq is ``last`` (-1: none): the seqs after it
        left the branch, so neither the fence (:attr:`first_seen`) nor the seqs answered above it say any more who
        published them, should they be published again."""
        if self.first_seen is not None:
            self.first_seen = min(self.first_seen, last)
        self._answered.discard_above(last)
        self._left.extend(kept for kept in self._kept if kept[0] > last)  # still its own, should they come back
        below = [kept for kept in self._kept if kept[0] <= last]
        self._kept.clear()
        self._kept.extend(below)
