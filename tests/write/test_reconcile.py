"""Telling whose batch published a seq (lakestream_iceberg/write/reconcile.py)."""

from __future__ import annotations

from lakestream_iceberg.write.reconcile import BatchFile, _sent_by_another_in


def test_a_batch_told_by_its_data_file_asks_the_store_for_its_time_only_when_the_token_does_not_settle_it() -> None:
    """Once the snapshot that published a seq has expired, the batch is told by its data file: the token in its name,
    and (only when the token does not say it is this producer's own) the file's modification time, one store request.
    The request was made for every such lookup, also for the producer's own batches, the common case."""
    asked: list[str] = []

    def read_time() -> float:
        asked.append("modified_at")
        return 2_000.0

    expired = {"step": 7, "snapshot_id": None, "group": 1}
    own = BatchFile("tok1", read_time)
    assert _sent_by_another_in(None, expired, since=1_000.0, earlier=frozenset({"tok1"}), file=own) is None  # type: ignore[arg-type]
    assert asked == []  # one of this producer's own batches: no request
    other = BatchFile("tok2", read_time)
    sent = _sent_by_another_in(None, expired, since=1_000.0, earlier=frozenset({"tok1"}), file=other)  # type: ignore[arg-type]
    assert sent is not None and sent[0] == "tok2" and "written at 2000.000" in sent[1]
    assert other.written_at == 2_000.0 and asked == ["modified_at"]  # asked once, kept
    assert BatchFile(None).written_at is None
