"""After ``Stream.repair()`` the objects that met the foreign change go on: a producer refused with
``ForeignSnapshotError`` commits again at the right next seq, exactly once, whoever repaired the branch (the same
``Stream``, another ``Stream`` object, another process); a held ``Stream`` and dataset read again. A producer whose
background committer was stopped by the refusal (``Producer.submit``) says to open a new one, and a new one resumes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from lakestream_iceberg import ForeignSnapshotError, Stream
from lakestream_iceberg.errors import ProducerFailedError
from tests.backends import (
    ROOT,
    Backend,
    backend,
    moto_service,
    postgres_service,
    published,
    seaweedfs_service,
)
from tests.support import SCHEMA, batch, foreign_append, foreign_delete

__all__ = ["backend", "moto_service", "postgres_service", "seaweedfs_service"]  # fixtures used by name

WORLD = 2
BACKENDS = pytest.mark.parametrize("backend", ["sqlite-local", "postgres-seaweedfs"], indirect=True)


def create(backend: Backend) -> Stream:
    return Stream.create(backend.catalog(), backend.identifier(), schema=SCHEMA, world_size=WORLD)


def another(backend: Backend) -> Stream:
    """The stream as another process opens it: its own catalog object and connections."""
    return Stream.open(backend.catalog(), backend.identifier())


def repair_in_a_process(backend: Backend) -> None:
    """``Stream.repair()`` in a separate Python process on the same catalog."""
    code = ("from tests.backends import catalog_from_env; from lakestream_iceberg import Stream; "
            f"print(Stream.open(catalog_from_env(), {backend.identifier()!r}).repair().repaired)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=backend.worker_env(), capture_output=True,
                          text=True, timeout=300, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr


REPAIRS: dict[str, Callable[[Stream, Backend], None]] = {
    "same-stream": lambda stream, _backend: stream.repair(),
    "another-stream": lambda _stream, backend: another(backend).repair(),
    "another-process": lambda _stream, backend: repair_in_a_process(backend),
}


@BACKENDS
@pytest.mark.parametrize("repair", sorted(REPAIRS))
@pytest.mark.parametrize("write", [foreign_delete, foreign_append], ids=["delete", "append"])
def test_the_refused_producer_goes_on_after_the_repair_exactly_once(backend: Backend, repair: str, write) -> None:
    """A lone producer (its own last commit is its view of the head) is refused on the foreign change; once the
    branch is repaired, the same object retries the refused seq and publishes it once, then goes on."""
    stream = create(backend)
    producer = stream.producer("a")
    for seq in range(5):
        assert producer.commit(batch("a", seq, WORLD), seq=seq).step == seq + 1
    write(another(backend))
    foreign = another(backend).table.metadata.current_snapshot().snapshot_id
    with pytest.raises(ForeignSnapshotError, match=r"stream.repair\(\)"):
        producer.commit(batch("a", 5, WORLD), seq=5)
    assert another(backend).table.metadata.current_snapshot().snapshot_id == foreign
    REPAIRS[repair](stream, backend)
    again = producer.commit(batch("a", 5, WORLD), seq=5)  # the refused seq, retried by the same object
    assert (again.step, again.seq, again.duplicate) == (6, 5, False)
    assert [(r.step, r.duplicate) for r in (producer.commit(batch("a", 5, WORLD), seq=5),
                                            producer.commit(batch("a", 2, WORLD), seq=2))] == [(6, True), (3, True)]
    assert producer.next_seq == 6 and producer.commit(batch("a", 6, WORLD)).step == 7
    assert published(another(backend)) == {step: ("a", step - 1) for step in range(1, 8)}


@BACKENDS
@pytest.mark.parametrize("repair", ["same-stream", "another-stream"])
def test_producers_of_the_same_stream_made_before_and_after_the_refusal_go_on(backend: Backend, repair: str) -> None:
    """Two producers that both committed (each plans on a fresh head), and one made from the stream's view while it
    showed the foreign change: every one of them continues after the repair, each seq once."""
    stream = create(backend)
    a, b = stream.producer("a"), stream.producer("b")
    for seq in range(2):
        a.commit(batch("a", seq, WORLD), seq=seq)
        b.commit(batch("b", seq, WORLD), seq=seq)
    foreign_delete(another(backend))
    for producer in (a, b):
        with pytest.raises(ForeignSnapshotError):
            producer.commit(batch(producer.producer_id, 2, WORLD), seq=2)
    with pytest.raises(ForeignSnapshotError):
        stream.head_step()  # the stream's own view shows the foreign change now
    c = stream.producer("c")
    with pytest.raises(ForeignSnapshotError):
        c.commit(batch("c", 0, WORLD), seq=0)
    REPAIRS[repair](stream, backend)
    assert [p.commit(batch(p.producer_id, s, WORLD), seq=s).step for p, s in ((b, 2), (c, 0), (a, 2))] == [5, 6, 7]
    assert a.commit(batch("a", 2, WORLD), seq=2).duplicate and c.commit(batch("c", 0, WORLD), seq=0).duplicate
    assert published(another(backend)) == {1: ("a", 0), 2: ("b", 0), 3: ("a", 1), 4: ("b", 1), 5: ("b", 2),
                                           6: ("c", 0), 7: ("a", 2)}


@BACKENDS
def test_a_held_stream_and_dataset_read_again_after_the_repair(backend: Backend) -> None:
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg import LakestreamDataset

    stream = create(backend)
    producer = stream.producer("a")
    for seq in range(4):
        producer.commit(batch("a", seq, WORLD), seq=seq)
    dataset = LakestreamDataset(stream, rank=0, world_size=1, collate=lambda shard: shard.step)
    assert list(dataset) == [1, 2, 3, 4]
    foreign_delete(another(backend))
    with pytest.raises(ForeignSnapshotError):
        stream.head_step()
    with pytest.raises(ForeignSnapshotError):
        stream.read(1, rank=0)
    with pytest.raises(ForeignSnapshotError):
        list(dataset)
    another(backend).repair()
    assert stream.head_step() == 4 and stream.read(3, rank=1).equals(batch("a", 2, WORLD)[1])
    assert list(dataset) == [1, 2, 3, 4]


@BACKENDS
def test_a_submitting_producer_stopped_by_the_refusal_says_to_open_a_new_one_which_resumes(backend: Backend) -> None:
    """``submit``'s committer stops at the refusal as at any failed batch (a later seq would leave a gap): the batch
    behind it fails unpublished, and the producer takes no more batches, saying to open a new producer with the same
    id. After the repair that new producer publishes the refused seq and the one behind it, each once."""
    stream = create(backend)
    producer = stream.producer("a")
    assert [f.result().step for f in [producer.submit(batch("a", seq, WORLD)) for seq in range(4)]] == [1, 2, 3, 4]
    foreign_delete(another(backend))
    refused = producer.submit(batch("a", 4, WORLD))
    with pytest.raises(ProducerFailedError):  # queued behind the refused batch, or submitted after it failed
        producer.submit(batch("a", 5, WORLD)).result()
    with pytest.raises(ForeignSnapshotError):
        refused.result()
    another(backend).repair()
    for call in (lambda: producer.submit(batch("a", 4, WORLD)), lambda: producer.commit(batch("a", 4, WORLD), seq=4)):
        with pytest.raises(ProducerFailedError, match=r"ForeignSnapshotError.*open a new producer with the same id"):
            call()
    resumed = stream.producer("a")
    assert [f.result().step for f in (resumed.submit(batch("a", 4, WORLD)), resumed.submit(batch("a", 5, WORLD)))] \
        == [5, 6]
    assert resumed.close() == 0
    assert published(another(backend)) == {step: ("a", step - 1) for step in range(1, 7)}

