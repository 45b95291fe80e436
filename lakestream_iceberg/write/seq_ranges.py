"""The seqs one producer object answered with success (its own batches, or replays judged an earlier incarnation's), as
a few ranges: a replay of one of them is answered the same way, whenever its batch was sent (see
:meth:`lakestream_iceberg.write.producer.Producer.commit`)."""

from __future__ import annotations

import bisect

__all__ = ["MAX_RANGES", "SeqRanges"]

# A producer publishes consecutive seqs (one range); each gap it skips (allow_gap) starts another. Past this many the
# oldest are forgotten: a replay of one of those seqs is then judged by when its batch was sent, as an earlier
# incarnation's would be.
MAX_RANGES = 1024


class SeqRanges:
    """A set of ints kept as sorted, disjoint, non-adjacent ``[first, last]`` ranges (at most :data:`MAX_RANGES`)."""

    def __init__(self) -> None:
        self._firsts: list[int] = []
        self._lasts: list[int] = []

    def __contains__(self, seq: int) -> bool:
        i = bisect.bisect_right(self._firsts, seq) - 1
        return i >= 0 and seq <= self._lasts[i]

    def __len__(self) -> int:
        """The number of ranges."""
        return len(self._firsts)

    def add(self, seq: int) -> None:
        firsts, lasts = self._firsts, self._lasts
        if lasts and lasts[-1] + 1 == seq:  # the usual case: the next seq
            lasts[-1] = seq
            return
        if seq in self:
            return
        i = bisect.bisect_right(firsts, seq)  # ranges before i start at or below seq (and end below it)
        joins_left = i > 0 and lasts[i - 1] + 1 == seq
        joins_right = i < len(firsts) and firsts[i] - 1 == seq
        if joins_left and joins_right:
            lasts[i - 1] = lasts[i]
            del firsts[i], lasts[i]
        elif joins_left:
            lasts[i - 1] = seq
        elif joins_right:
            firsts[i] = seq
        else:
            firsts.insert(i, seq)
            lasts.insert(i, seq)
            if len(firsts) > MAX_RANGES:
                del firsts[0], lasts[0]

    def discard_above(self, seq: int) -> None:
        """Forget every seq above ``seq``."""
        firsts, lasts = self._firsts, self._lasts
        i = bisect.bisect_right(firsts, seq)  # ranges from i on start above seq
        del firsts[i:], lasts[i:]
        if lasts and lasts[-1] > seq:
            lasts[-1] = seq
