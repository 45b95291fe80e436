"""Background commits: ``Producer.submit`` -> Future, ``flush``, ``close``; order, backpressure, failure, threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from lakestream_iceberg import (
    CommitTimeoutError,
    ConfigError,
    ProducerConflictError,
    ProducerFailedError,
    SchemaMismatchError,
    SequenceError,
    ShardCountError,
    Stream,
)
from tests.support import SCHEMA, batch, digest, until

WORLD = 2
DEADLINE_S = 120


class GatedCatalog(SqlCatalog):
    """A real SQLite catalog whose commits from a producer's committer thread wait at a gate the test opens."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # a committer thread is at the gate

    def commit_table(self, table, requirements, updates):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("lakestream-commit-") and not self.gate.is_set():
            self.waiting.set()
            assert self.gate.wait(DEADLINE_S), "the test never opened the gate"
        return super().commit_table(table, requirements, updates)


def gated(root: Path) -> GatedCatalog:
    return GatedCatalog("gated", uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}/warehouse")


def held_at_the_gate(stream: Stream, producer: Any, batches: int = 1) -> tuple[GatedCatalog, list[Any]]:
    """Submit seqs ``0..batches-1`` with the catalog's gate closed; return once seq 0's commit waits at it."""
    catalog = stream.table.catalog
    assert isinstance(catalog, GatedCatalog)
    catalog.gate.clear()
    futures = [producer.submit(batch("p", seq, WORLD)) for seq in range(batches)]
    assert catalog.waiting.wait(DEADLINE_S)
    return catalog, futures


@pytest.fixture
def stream(tmp_path: Path) -> Stream:
    return Stream.create(gated(tmp_path), "ns.stream", schema=SCHEMA, world_size=WORLD)


def by_step(stream: Stream) -> dict[int, tuple[str, int]]:
    rows = stream.table.catalog.load_table(stream.name).scan(selected_fields=("producer", "seq", "_step")).to_arrow()
    return {r["_step"]: (r["producer"], r["seq"]) for r in rows.to_pylist()}


def test_submitted_batches_publish_in_submit_order_with_consecutive_seqs(stream: Stream) -> None:
    with stream.producer("p") as producer:
        futures = [producer.submit(batch("p", seq, WORLD)) for seq in range(8)]
    results = [f.result(timeout=0) for f in futures]  # close() flushed: every future is done
    assert [r.seq for r in results] == list(range(8))
    assert [r.step for r in results] == list(range(1, 9))
    assert not any(r.duplicate for r in results) and all(r.latency_s > 0 for r in results)
    assert stream.head_step() == 8
    for step, result in enumerate(results, start=1):
        for rank in range(WORLD):
            assert digest(stream.read(step, rank=rank)) == digest(batch("p", result.seq, WORLD)[rank])


def test_submit_continues_the_tables_seqs_and_commit_queues_behind_submitted_batches(stream: Stream) -> None:
    first = stream.producer("p")
    first.commit(batch("p", 0, WORLD))
    producer = stream.producer("p")
    futures = [producer.submit(batch("p", seq, WORLD)) for seq in (1, 2)]
    committed = producer.commit(batch("p", 3, WORLD))  # after submits: in the queue, behind them
    assert committed.seq == 3 and committed.step == 4
    assert [f.result(timeout=0).step for f in futures] == [2, 3]
    again = producer.submit(batch("p", 3, WORLD), seq=3).result(timeout=DEADLINE_S)
    assert again.duplicate and again.step == 4
    assert producer.flush() == 0 and producer.close() == 0
    with pytest.raises(ProducerFailedError, match="closed"):
        producer.submit(batch("p", 4, WORLD))
    assert by_step(stream) == {step: ("p", step - 1) for step in range(1, 5)}


def test_bad_input_raises_in_the_callers_thread_and_nothing_is_queued(stream: Stream) -> None:
    producer = stream.producer("p")
    with pytest.raises(ShardCountError):
        producer.submit([batch("p", 0, WORLD)[0]])
    with pytest.raises(SchemaMismatchError):
        producer.submit([pa.table({"x": [1]})] * WORLD)
    with pytest.raises(SequenceError):
        producer.submit(batch("p", 0, WORLD), seq=-1)
    with pytest.raises(SequenceError):
        producer.submit(batch("p", 0, WORLD), seq=True)
    with pytest.raises(SequenceError, match="gap"):
        producer.submit(batch("p", 5, WORLD), seq=5)
    for bad in (-1.0, True, "1"):
        with pytest.raises(ConfigError, match="timeout_s"):
            producer.submit(batch("p", 0, WORLD), timeout_s=bad)
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match="max_in_flight"):
            stream.producer("q", max_in_flight=bad)
    assert producer.flush() == 0 and stream.head_step() == 0
    assert producer.submit(batch("p", 0, WORLD)).result(timeout=DEADLINE_S).seq == 0  # nothing above took a seq


def test_a_full_queue_blocks_submit_and_times_out_without_taking_a_seq(stream: Stream, tmp_path: Path) -> None:
    producer = stream.producer("p", max_in_flight=2)
    catalog, futures = held_at_the_gate(stream, producer, 2)  # seq 0 is committing, seq 1 queued: the queue is full
    with pytest.raises(CommitTimeoutError, match="nothing was queued"):
        producer.submit(batch("p", 2, WORLD), timeout_s=0.05)
    assert producer.flush(timeout_s=0) == 2
    blocked: list[Any] = []
    submitter = threading.Thread(target=lambda: blocked.append(producer.submit(batch("p", 2, WORLD))))
    submitter.start()
    catalog.gate.set()
    submitter.join(DEADLINE_S)
    assert not submitter.is_alive()
    futures += blocked
    assert producer.flush(timeout_s=DEADLINE_S) == 0
    assert [f.result(timeout=0).seq for f in futures] == [0, 1, 2]
    assert by_step(stream) == {1: ("p", 0), 2: ("p", 1), 3: ("p", 2)}


def test_a_failed_commit_fails_the_batches_behind_it_unpublished_and_a_new_producer_resumes(stream: Stream) -> None:
    producer = stream.producer("p")
    catalog, futures = held_at_the_gate(stream, producer, 2)  # seq 0 planned and at the catalog's door
    other = stream.producer("p")  # a second live writer of the same id publishes a different batch as seq 0
    other.commit(batch("p", 100, WORLD), seq=0)
    catalog.gate.set()
    with pytest.raises(Exception) as first:
        futures[0].result(timeout=DEADLINE_S)
    assert isinstance(first.value, ProducerConflictError), first.value
    with pytest.raises(ProducerFailedError, match="seq 1 was not published") as behind:
        futures[1].result(timeout=DEADLINE_S)
    assert "batch seq 0 failed first" in str(behind.value) and behind.value.__cause__ is first.value
    with pytest.raises(ProducerFailedError, match="open a new producer"):
        producer.submit(batch("p", 2, WORLD))
    with pytest.raises(ProducerFailedError, match="seq 0 failed first"):
        producer.flush()
    with pytest.raises(ProducerFailedError):
        producer.commit(batch("p", 2, WORLD))
    assert by_step(stream) == {1: ("p", 100)}  # seq 1 was never published
    fresh = stream.producer("p")
    assert fresh.next_seq == 1
    assert fresh.submit(batch("p", 1, WORLD)).result(timeout=DEADLINE_S).step == 2
    fresh.close()


def test_threads_submitting_and_committing_on_one_producer_publish_each_batch_once(stream: Stream) -> None:
    producer = stream.producer("p", max_in_flight=3)
    results: list[Any] = []
    lock = threading.Lock()

    def work(kind: str) -> None:
        for _ in range(5):
            shards = batch("p", 0, WORLD)
            result = producer.commit(shards) if kind == "commit" else producer.submit(shards).result(DEADLINE_S)
            with lock:
                results.append(result)

    seen: list[int] = []

    def read() -> None:  # the table's next seq, read while the committer thread commits
        seen.extend(producer.next_seq for _ in range(5))

    threads = [threading.Thread(target=work, args=(kind,)) for kind in ("commit", "submit", "submit", "commit")]
    threads.append(threading.Thread(target=read))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
    assert producer.close() == 0
    assert len(seen) == 5 and seen == sorted(seen) and 0 <= seen[0] and seen[-1] <= 20
    assert sorted(r.seq for r in results) == list(range(20)) and not any(r.duplicate for r in results)
    assert sorted((r.seq, r.step) for r in results) == [(seq, seq + 1) for seq in range(20)]
    assert stream.head_step() == 20


def test_allow_gap_must_be_a_bool_and_a_truthy_string_publishes_no_gap(stream: Stream) -> None:
    producer = stream.producer("p")
    for bad in ("False", "no", 1, None):
        with pytest.raises(SequenceError, match="allow_gap must be True or False"):
            producer.commit(batch("p", 5, WORLD), seq=5, allow_gap=bad)  # type: ignore[arg-type]
        with pytest.raises(SequenceError, match="allow_gap must be True or False"):
            producer.submit(batch("p", 5, WORLD), seq=5, allow_gap=bad)  # type: ignore[arg-type]
    assert producer.flush() == 0 and stream.head_step() == 0
    assert producer.submit(batch("p", 0, WORLD)).result(timeout=DEADLINE_S).seq == 0  # nothing above took a seq
    producer.close()


def test_a_timeout_longer_than_a_thread_can_wait_waits_as_long_as_it_takes(stream: Stream) -> None:
    producer = stream.producer("p", max_in_flight=1)
    catalog, (first,) = held_at_the_gate(stream, producer)  # seq 0 is committing: the queue is full
    got: list[Any] = []

    def submit() -> None:
        try:
            got.append(producer.submit(batch("p", 1, WORLD), timeout_s=float("inf")))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            got.append(exc)

    submitter = threading.Thread(target=submit)
    submitter.start()
    queue = producer._queue
    assert queue is not None
    until(lambda: queue._cond._waiters or not submitter.is_alive(), "the submit to wait for a slot or end")
    catalog.gate.set()
    submitter.join(DEADLINE_S)
    assert not submitter.is_alive() and len(got) == 1 and not isinstance(got[0], BaseException), got
    assert producer.flush(timeout_s=float("inf")) == 0 and producer.close(timeout_s=1e12) == 0
    assert [first.result(timeout=0).seq, got[0].result(timeout=0).seq] == [0, 1]


def test_close_that_returns_with_batches_in_flight_takes_no_more_batches(stream: Stream) -> None:
    producer = stream.producer("p")
    catalog, (future,) = held_at_the_gate(stream, producer)
    assert producer.close(timeout_s=0) == 1
    with pytest.raises(ProducerFailedError, match="closed"):
        producer.submit(batch("p", 1, WORLD))
    with pytest.raises(ProducerFailedError, match="closed"):
        producer.commit(batch("p", 1, WORLD))
    catalog.gate.set()
    assert producer.close() == 0  # the batch in flight at the first close is still published
    assert future.result(timeout=0).step == 1
    assert by_step(stream) == {1: ("p", 0)}


def test_a_closed_producer_that_never_submitted_takes_no_more_batches(stream: Stream) -> None:
    with stream.producer("p") as producer:
        producer.commit(batch("p", 0, WORLD))
    with pytest.raises(ProducerFailedError, match="closed"):
        producer.commit(batch("p", 1, WORLD))
    with pytest.raises(ProducerFailedError, match="closed"):
        producer.submit(batch("p", 1, WORLD))
    assert by_step(stream) == {1: ("p", 0)}


def test_a_submit_made_once_a_failed_future_is_done_raises_and_queues_nothing(stream: Stream) -> None:
    producer = stream.producer("p")
    catalog, (failing,) = held_at_the_gate(stream, producer)
    stream.producer("p").commit(batch("p", 100, WORLD), seq=0)  # seq 0 published with another batch: a conflict
    after: list[Any] = []

    def submit_after(_: Any) -> None:  # runs as soon as the future is done (in the committer thread)
        try:
            after.append(producer.submit(batch("p", 1, WORLD)))
        except ProducerFailedError as exc:
            after.append(exc)

    failing.add_done_callback(submit_after)
    catalog.gate.set()
    with pytest.raises(ProducerConflictError):
        failing.result(timeout=DEADLINE_S)
    with pytest.raises(ProducerFailedError):
        producer.flush(timeout_s=DEADLINE_S)
    assert len(after) == 1 and isinstance(after[0], ProducerFailedError), after
    assert by_step(stream) == {1: ("p", 100)}


def test_a_done_callback_that_would_wait_for_the_committer_thread_is_refused(stream: Stream) -> None:
    """A future's done-callback runs on the committer thread: a flush, close, commit or blocked submit there would wait
    for that thread itself. Each raises ConfigError in the callback, and the producer goes on."""
    producer = stream.producer("p", max_in_flight=1)
    catalog, (first,) = held_at_the_gate(stream, producer)  # seq 0 is committing: the callback is added before it is done
    refused: list[str | None] = []
    ran = threading.Event()

    def wait_in_callback(_: Any) -> None:  # on the committer thread, while seq 0 still takes the only slot
        for call in (producer.flush, producer.close, lambda: producer.commit(batch("p", 1, WORLD)),
                     lambda: producer.submit(batch("p", 1, WORLD))):
            try:
                call()
                refused.append(None)
            except ConfigError as exc:
                refused.append(str(exc))
        ran.set()

    first.add_done_callback(wait_in_callback)
    catalog.gate.set()
    assert ran.wait(DEADLINE_S), "the callback never returned"
    assert all(message is not None and "committer thread" in message for message in refused), refused
    assert first.result(timeout=0).seq == 0
    assert producer.submit(batch("p", 1, WORLD)).result(timeout=DEADLINE_S).seq == 1
    assert producer.close(timeout_s=DEADLINE_S) == 0
    assert by_step(stream) == {1: ("p", 0), 2: ("p", 1)}


def test_a_producer_dropped_unclosed_publishes_what_it_submitted_and_its_committer_thread_ends(stream: Stream) -> None:
    """As ThreadPoolExecutor's workers: the committer holds its queue only while batches are queued, so a producer
    dropped without close() still publishes its submitted batches (their futures complete), then is collected and its
    thread ends instead of idling (with the producer's memory) for the life of the process."""
    import gc

    producer = stream.producer("p", max_in_flight=3)
    catalog, futures = held_at_the_gate(stream, producer, batches=3)
    committer = producer._queue._thread  # type: ignore[union-attr]  # noqa: SLF001
    del producer
    gc.collect()
    assert committer.is_alive()  # batches are queued: the thread keeps the queue
    catalog.gate.set()
    assert [f.result(timeout=DEADLINE_S).step for f in futures] == [1, 2, 3]
    until(lambda: gc.collect() >= 0 and not committer.is_alive(), "the idle committer thread to end once its producer is "
          "collected", deadline_s=DEADLINE_S)
    assert by_step(stream) == {1: ("p", 0), 2: ("p", 1), 3: ("p", 2)}


def test_a_submit_whose_seq_another_writer_of_the_id_published_meanwhile_fails_with_a_conflict(stream: Stream) -> None:
    # The submit path numbers batches itself (seq=None: the one after the last submitted). When another live writer of
    # the same id (a second producer object, the child of a fork, another process) published that seq meanwhile, the
    # batch is not a replay of the published one: it was reported duplicate=True and silently never published.
    producer = stream.producer("p")
    assert producer.submit(batch("p", 0, WORLD)).result(timeout=DEADLINE_S).seq == 0
    stream.producer("p").commit(batch("p", 100, WORLD))  # the other writer takes seq 1
    assert producer.next_seq == 2  # read from the table, as the submit's commit then plans on it
    lost = producer.submit(batch("p", 1, WORLD))
    with pytest.raises(ProducerConflictError, match="seq 1 .*was published as step 2") as conflict:
        lost.result(timeout=DEADLINE_S)
    assert "give every live producer its own id" in str(conflict.value)
    assert by_step(stream) == {1: ("p", 0), 2: ("p", 100)}
    with pytest.raises(ProducerFailedError):
        producer.close()
    replay = stream.producer("p")  # an explicit seq that is published is still a replay: duplicate, nothing written
    assert replay.submit(batch("p", 100, WORLD), seq=1).result(timeout=DEADLINE_S).duplicate
    replay.close()


def test_a_first_submit_that_would_leave_a_gap_names_the_next_seq(stream: Stream) -> None:
    # The message said "submitted up to seq -1" for a producer that had submitted nothing.
    producer = stream.producer("p")
    with pytest.raises(SequenceError) as gap:
        producer.submit(batch("p", 3, WORLD), seq=3)
    assert "-1" not in str(gap.value)
    assert "would skip from seq 0 to 3" in str(gap.value) and "allow_gap=True" in str(gap.value)
    assert producer.submit(batch("p", 0, WORLD)).result(timeout=DEADLINE_S).seq == 0
    with pytest.raises(SequenceError, match="would skip from seq 1 to 5"):
        producer.submit(batch("p", 5, WORLD), seq=5)
    producer.close()


def test_a_producer_whose_with_block_raised_is_closed_too(stream: Stream) -> None:
    # Leaving the block by an exception closed the committer of a producer that had submitted, but one that had only
    # committed stayed open: it went on publishing batches after its block was left.
    for submitted in (False, True):
        with pytest.raises(KeyError), stream.producer(f"p{submitted:d}") as producer:
            if submitted:
                producer.submit(batch("p", 0, WORLD)).result(timeout=DEADLINE_S)
            else:
                producer.commit(batch("p", 0, WORLD))
            raise KeyError("the caller's own error")
        head = stream.head_step()
        with pytest.raises(ProducerFailedError, match="closed"):
            producer.commit(batch("p", 1, WORLD))
        with pytest.raises(ProducerFailedError, match="closed"):
            producer.submit(batch("p", 1, WORLD))
        assert stream.head_step() == head
