"""The seqs a producer object published itself, as ranges (write/seq_ranges.py)."""

from __future__ import annotations

import random

from lakestream_iceberg.write.seq_ranges import MAX_RANGES, SeqRanges


def test_seqs_added_in_any_order_are_kept_as_the_fewest_ranges() -> None:
    rng = random.Random(5)
    seqs = [s for s in range(400) if s % 7 != 3]
    ranges, kept = SeqRanges(), set()
    for seq in rng.sample(seqs, len(seqs)) + seqs[:20]:  # shuffled, and some twice
        ranges.add(seq)
        kept.add(seq)
        assert all((s in ranges) == (s in kept) for s in range(-2, 402))
    assert len(ranges) == len([s for s in range(400) if s % 7 == 3]) + 1  # one range between each pair of gaps


def test_a_producer_publishing_in_order_holds_one_range() -> None:
    ranges = SeqRanges()
    for seq in range(100_000):
        ranges.add(seq)
    assert len(ranges) == 1 and 0 in ranges and 99_999 in ranges and 100_000 not in ranges


def test_past_the_bound_the_oldest_ranges_are_forgotten() -> None:
    ranges = SeqRanges()
    for seq in range(0, 2 * (MAX_RANGES + 10), 2):  # every other seq: a range each (allow_gap)
        ranges.add(seq)
    assert len(ranges) == MAX_RANGES
    assert 0 not in ranges and 18 not in ranges and 20 in ranges and 2 * (MAX_RANGES + 9) in ranges


def test_the_seqs_above_one_are_forgotten() -> None:
    """What a rollback of the branch takes back (OwnBatches.rebase)."""
    ranges = SeqRanges()
    for seq in [*range(0, 10), *range(20, 30), *range(40, 50)]:
        ranges.add(seq)
    ranges.discard_above(24)
    assert [s for s in range(60) if s in ranges] == [*range(0, 10), *range(20, 25)]
    ranges.discard_above(15)
    assert [s for s in range(60) if s in ranges] == list(range(10))
    ranges.discard_above(-1)
    assert len(ranges) == 0 and 0 not in ranges
    ranges.add(3)  # it goes on from there
    assert 3 in ranges and len(ranges) == 1
