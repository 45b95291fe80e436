"""LakestreamDataset against a real SQLite catalog, real DataLoader worker processes and a real producer process.

Every test builds its own stream in ``tmp_path``; no mocks. The whole file runs in well under a minute on two cores.
"""

from __future__ import annotations

import gc
import inspect
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyiceberg.catalog.sql import SqlCatalog

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import (
    CheckpointError,
    ConfigError,
    MissingExtraError,
    RankError,
    ReadTimeoutError,
    StepCollectedError,
    StreamError,
)
from lakestream_iceberg.read.follow import HeadWatcher, consumer_lag
from lakestream_iceberg.read.stream_ref import StreamRef

pytest.importorskip("torch")  # the dataset's tests need the torch extra (the core's run without it)
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lakestream_iceberg.read.dataset import LakestreamDataset, TensorCollate, partition, require_torch  # noqa: E402
from tests.support import SQLITE_MUTEX_STATIC_MEM, hold_sqlite_mutex, raised_by_loader  # noqa: E402

SCHEMA = pa.schema([
    pa.field("x", pa.int64(), nullable=False),
    pa.field("tokens", pa.list_(pa.int32())),
    pa.field("blob", pa.binary()),
    pa.field("f", pa.float32()),
])
CATALOG_NAME = "lakestream_dataset_test"  # not "default": a developer's ~/.pyiceberg.yaml must not leak in
ID = 2**32


def rows_of(step: int, rank: int) -> int:
    return (step * 3 + rank) % 5  # 0..4 rows: empty shards included


def shard(step: int, rank: int) -> pa.Table:
    xs = [step * 10_000 + rank * 1_000 + i for i in range(rows_of(step, rank))]
    return pa.table({
        "x": xs,
        "tokens": [[x % 97 + j for j in range(x % 5 + 1)] for x in xs],
        "blob": [bytes([x % 251]) * (x % 7) for x in xs],
        "f": [x / 2 for x in xs],
    }, schema=SCHEMA)


def global_xs(step: int, world: int) -> list[int]:
    """The x values of a step's global batch in sample-id order (ranks concatenated)."""
    return [x for r in range(world) for x in shard(step, r).column("x").to_pylist()]


def make_catalog(tmp_path: Path) -> SqlCatalog:
    (tmp_path / "wh").mkdir(exist_ok=True)
    return SqlCatalog(CATALOG_NAME, uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/wh")


def make_stream(tmp_path: Path, *, world: int = 2, steps: int = 6, name: str = "ns.s") -> Stream:
    stream = Stream.create(make_catalog(tmp_path), name, schema=SCHEMA, world_size=world)
    producer = stream.producer("prep-0")
    for step in range(1, steps + 1):
        assert producer.commit([shard(step, r) for r in range(world)]).step == step
    return stream


def summary(items) -> list[tuple[int, list[int], list[int]]]:
    """(step, sample ids, x values) per item."""
    return [(it["step"], it["sample_ids"].tolist(), it["x"].tolist()) for it in items]


def check_items(items, *, world: int, rank: int | None, steps: list[int]) -> None:
    assert [it["step"] for it in items] == steps
    for it in items:
        expected = global_xs(it["step"], world)
        ids = it["sample_ids"].tolist()
        assert all(i // ID == it["step"] for i in ids)
        assert it["x"].tolist() == [expected[i % ID] for i in ids]
        if rank is not None:
            assert it["x"].tolist() == shard(it["step"], rank).column("x").to_pylist()


# ------------------------------------------------------------------------------------------------ items and tensors
def test_item_tensors_padded_and_packed(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=3)
    items = list(LakestreamDataset(stream, rank=1, world_size=2, prefetch=0))
    check_items(items, world=2, rank=1, steps=[1, 2, 3])
    for it in items:
        table = shard(it["step"], 1)
        tokens = table.column("tokens").to_pylist()
        lengths = [len(t) for t in tokens]
        assert it["tokens"].dtype == torch.int32 and it["tokens"].shape == (len(tokens), max(lengths, default=0))
        assert it["tokens_lengths"].tolist() == lengths
        assert [row[:n].tolist() for row, n in zip(it["tokens"], lengths, strict=True)] == tokens
        assert all((row[n:] == 0).all() for row, n in zip(it["tokens"], lengths, strict=True))  # right padding with pad_value
        assert [b.dtype for b in it["blob"]] == [torch.uint8] * len(tokens)
        assert [bytes(b.numpy()) for b in it["blob"]] == table.column("blob").to_pylist()
        assert it["f"].dtype == torch.float32 and it["f"].tolist() == table.column("f").to_pylist()

    collate = TensorCollate(lists="packed", binary="padded", pad_value=-1)
    packed = list(LakestreamDataset(stream, rank=1, world_size=2, collate=collate))
    for it in packed:
        table = shard(it["step"], 1)
        offsets = it["tokens_offsets"].tolist()
        rows = [it["tokens"][a:b].tolist() for a, b in zip(offsets, offsets[1:], strict=False)]
        assert rows == table.column("tokens").to_pylist()
        blobs = table.column("blob").to_pylist()
        assert it["blob_lengths"].tolist() == [len(b) for b in blobs]
        assert [bytes(row[:len(b)].numpy()) for row, b in zip(it["blob"], blobs, strict=True)] == blobs


def test_columns_transform_and_empty_shard(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=5)
    ds = LakestreamDataset(stream, rank=0, world_size=2, columns=["x"], transform=lambda it: {**it, "n": len(it["x"])})
    items = list(ds)
    assert set(items[0]) == {"step", "sample_ids", "x", "n"}
    empty = [it for it in items if it["n"] == 0]
    assert empty and all(it["x"].shape == (0,) and it["sample_ids"].shape == (0,) for it in empty)  # delivered, not skipped
    with pytest.raises(ConfigError, match="nope"):
        LakestreamDataset(stream, rank=0, world_size=2, columns=["nope"])


def _reads_a_missing_vocabulary(item: dict) -> dict:
    if item["step"] == 2:
        open(os.path.join(os.path.dirname(__file__), "no-such-vocabulary.json"))  # noqa: SIM115 - raises
    return item


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_transforms_own_file_not_found_error_is_raised_as_it_is(tmp_path: Path, num_workers: int) -> None:
    """A transform (or collate) raising FileNotFoundError for a file of its own was taken for a stream file that
    lifecycle GC deleted: the step was read and transformed again, and the loop ended with a MissingFileError telling
    to restore the stream's files from a backup."""
    stream = make_stream(tmp_path, steps=3)
    ds = LakestreamDataset(stream, rank=0, world_size=2, transform=_reads_a_missing_vocabulary)
    kwargs = {"multiprocessing_context": "fork"} if num_workers else {}
    with raised_by_loader(FileNotFoundError, match="no-such-vocabulary") as raised:
        list(DataLoader(ds, batch_size=None, num_workers=num_workers, **kwargs))
    assert "restore" not in str(raised.value).lower()
    assert not isinstance(raised.value, StreamError)


# ------------------------------------------------------------------------------ order and exactly-once, DataLoader
@pytest.mark.parametrize("num_workers", [0, 2])
def test_order_and_exactly_once_across_ranks_and_fork_workers(tmp_path: Path, num_workers: int) -> None:
    stream = make_stream(tmp_path, steps=7)
    for rank in (0, 1):
        ds = LakestreamDataset(stream, rank=rank, world_size=2)
        kwargs = {"multiprocessing_context": "fork"} if num_workers else {}
        items = list(DataLoader(ds, batch_size=None, num_workers=num_workers, **kwargs))
        check_items(items, world=2, rank=rank, steps=list(range(1, 8)))


@pytest.mark.parametrize(("num_workers", "batch_size"), [(0, 1), (0, 2), (2, 1), (2, 2)])
def test_a_loader_that_batches_steps_with_the_default_collate_is_refused(tmp_path: Path, num_workers: int,
                                                                         batch_size: int) -> None:
    """An item is a batch already: DataLoader's default batch_size=1 stacked each item into a batch of one (a leading
    dimension on every tensor, ``step`` a tensor) and raised torch's TypeError on Blobs naming no fix; batch_size=2
    stacked two steps (with workers, steps w and w + k of one worker). Refused, saying batch_size=None; a collate_fn of
    the user's still combines steps as it likes."""
    stream = make_stream(tmp_path, steps=4)
    kwargs = {"multiprocessing_context": "fork"} if num_workers else {}
    ds = LakestreamDataset(stream, rank=0, world_size=2)
    with raised_by_loader(ConfigError, match="batch_size=None"):
        list(DataLoader(ds, batch_size=batch_size, num_workers=num_workers, **kwargs))
    numbers = LakestreamDataset(stream, rank=0, world_size=2, columns=["x", "f"])  # no Blobs: stacked silently before
    with raised_by_loader(ConfigError, match="batch_size=None"):
        list(DataLoader(numbers, batch_size=batch_size, num_workers=num_workers, **kwargs))
    pairs = list(DataLoader(ds, batch_size=2, num_workers=num_workers, collate_fn=lambda items: [it["step"] for it in items],
                            **kwargs))
    assert sorted(step for pair in pairs for step in pair) == [1, 2, 3, 4]
    assert [it["step"] for it in DataLoader(ds, batch_size=None, num_workers=num_workers, **kwargs)] == [1, 2, 3, 4]


def test_fork_workers_take_their_inherited_objects_out_of_the_collectors_sight(tmp_path: Path) -> None:
    """A worker's first full collection would walk the whole heap it inherited (a stall of every thread of the worker,
    the head relay's too when it serves it): the worker freezes what it started with; the training process is left
    alone."""
    stream = make_stream(tmp_path, steps=3)
    tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()
    assert tracked > 50_000  # torch, pyiceberg, pyarrow: what a worker inherits

    def census(item: dict) -> dict:
        return {**item, "frozen": torch.tensor(gc.get_freeze_count()), "tracked": torch.tensor(len(gc.get_objects()))}

    ds = LakestreamDataset(stream, rank=0, world_size=2, transform=census)
    items = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert [it["step"] for it in items] == [1, 2, 3]
    for it in items:
        assert int(it["frozen"]) > tracked // 2 and int(it["tracked"]) < tracked // 4
    assert gc.get_freeze_count() == frozen  # nothing frozen here


def test_spawn_workers_reopen_the_stream(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=5)
    again = pickle.loads(pickle.dumps(stream))  # a Stream pickles as its address and reopens on load
    assert again.name == stream.name and again.head_step() == 5 and again.table is not stream.table
    ds = LakestreamDataset(stream, rank=0, world_size=2, start_step=2)
    items = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    check_items(items, world=2, rank=0, steps=[2, 3, 4, 5])


def test_stream_ref_reopens_by_catalog_properties(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=1)
    again = pickle.loads(pickle.dumps(StreamRef.of(stream))).open()
    assert again.name == stream.name and again.head_step() == 1


def test_non_follow_end_is_fixed_for_workers(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=3)
    ds = LakestreamDataset(stream, rank=0, world_size=2)
    stream.producer("prep-0").commit([shard(4, r) for r in range(2)])
    workers = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert [it["step"] for it in workers] == [1, 2, 3]  # the end every worker agreed on: the head at construction
    assert [it["step"] for it in ds] == [1, 2, 3, 4]  # without workers: the head when iteration starts
    assert [it["step"] for it in LakestreamDataset(stream, rank=0, world_size=2, end_step=2)] == [1, 2]


# ------------------------------------------------------------------------------------------------------ resume
def _payload(items) -> list[tuple]:
    return [(it["step"], it["sample_ids"].numpy().tobytes(), it["tokens"].numpy().tobytes(),
             b"".join(bytes(b.numpy()) for b in it["blob"])) for it in items]


def test_resume_from_state_dict_is_identical(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=8)
    full = _payload(LakestreamDataset(stream, rank=1, world_size=2))
    first = LakestreamDataset(stream, rank=1, world_size=2)
    head = []
    for item in first:
        head.append(item)
        if len(head) == 3:
            break
    state = first.state_dict()
    ident = {"stream": str(stream.table.metadata.table_uuid), "branch": "main"}
    assert state["last_file"] in {f.file_path for f in stream.locate(3)}  # a file of the last step it delivered
    assert state == {"next_step": 4, "worker_id": 0, "num_workers": 1, "last_file": state["last_file"], **ident,
                     "version": 1}
    resumed = LakestreamDataset(stream, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert _payload(head) + _payload(resumed) == full
    # the same state under DataLoader workers (a single-process state loads under any worker count)
    under_workers = LakestreamDataset(stream, rank=1, world_size=2)
    under_workers.load_state_dict(state)
    loader = DataLoader(under_workers, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert _payload(head) + _payload(loader) == full


def test_a_state_of_a_newer_release_is_refused_not_resumed_without_what_it_added(tmp_path: Path) -> None:
    """A state_dict is saved with a model's checkpoint and may be loaded by another release (a trainer image rolled back
    after a newer one saved it). It carried no version: a newer release's state, with a key of its own that changes
    where to resume (here: rows of the next step already delivered), loaded with that key ignored, and the resumed run
    repeated those rows. States name their version now; one this release does not read is refused, saying to upgrade."""
    stream = make_stream(tmp_path, steps=4)
    first = LakestreamDataset(stream, rank=0, world_size=2)
    assert [it["step"] for _, it in zip(range(2), first)] == [1, 2]
    state = first.state_dict()
    newer = {**state, "next_row": 1, "version": 2}
    ds = LakestreamDataset(stream, rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"state of version 2.*reads version 1 only.*newer lakestream_iceberg saved "
                                          r"it.*upgrade the trainer's image"):
        ds.load_state_dict(newer)
    for bad in ("1", 1.0, True, None):
        with pytest.raises(ConfigError, match=r"reads version 1 only: no release writes it"):
            ds.load_state_dict({**state, "version": bad})
    earlier = {k: v for k, v in state.items() if k != "version"}  # a state of a release before versions: 1
    ds.load_state_dict(earlier)
    assert [it["step"] for it in ds] == [3, 4]
    assert state["version"] == 1


def test_a_newer_releases_state_in_a_mapping_other_than_a_dict_is_refused_too(tmp_path: Path) -> None:
    """A state comes back from a checkpoint as whatever mapping held it (a read-only view, a config library's mapping):
    every other key was read from any mapping, but the version only from a dict, so a newer release's state in another
    mapping resumed as version 1, its own keys ignored."""
    from types import MappingProxyType

    stream = make_stream(tmp_path, steps=4)
    first = LakestreamDataset(stream, rank=0, world_size=2)
    assert [it["step"] for _, it in zip(range(2), first)] == [1, 2]
    state = first.state_dict()
    ds = LakestreamDataset(stream, rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"state of version 2.*reads version 1 only"):
        ds.load_state_dict(MappingProxyType({**state, "next_row": 1, "version": 2}))
    ds.load_state_dict(MappingProxyType(state))
    assert [it["step"] for it in ds] == [3, 4]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_state_loaded_before_workers_resumes_one_epoch_only(tmp_path: Path, context: str) -> None:
    """Every epoch's new workers copy the dataset from the training process: the state loaded there resumes the first
    epoch only, as without workers (and with persistent ones); later epochs start at start_step."""
    stream = make_stream(tmp_path, steps=6)
    state = {"next_step": 4}
    alone = LakestreamDataset(stream, rank=0, world_size=2)
    alone.load_state_dict(state)
    expected = [[it["step"] for it in alone] for _ in range(2)]
    assert expected == [[4, 5, 6], [1, 2, 3, 4, 5, 6]]
    ds = LakestreamDataset(stream, rank=0, world_size=2)
    ds.load_state_dict(state)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    assert [it["step"] for it in loader] == expected[0]
    assert [it["step"] for it in loader] == expected[1]
    assert ds.state_dict()["next_step"] == 1  # applied by the workers: nothing pending here any more


def test_workers_forked_while_another_thread_is_inside_sqlite_deliver(tmp_path: Path) -> None:
    """The garbage collector runs in whatever thread allocates, and closed unreachable catalogs' SQLite connections in
    a pool thread (or s3fs's event-loop thread) with the GIL released: a DataLoader forking its workers then left
    libsqlite3's allocator mutex locked in a worker, whose head watcher's first pointer probe hung on it forever (the
    training process waited in DataLoader's _data_queue.get until pytest-timeout). Here a thread holds that mutex on
    purpose while the workers are forked."""
    stream = make_stream(tmp_path, steps=4)
    ds = LakestreamDataset(stream, rank=0, world_size=2)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=10)
    thread, release = hold_sqlite_mutex(SQLITE_MUTEX_STATIC_MEM, 2)  # at most 2 s: this thread may need it too
    try:
        assert [it["step"] for it in loader] == [1, 2, 3, 4]  # was: "DataLoader timed out after 10 seconds"
    finally:
        release.set()
        thread.join(60)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_state_loaded_between_epochs_of_persistent_workers_resumes_the_next_epoch(tmp_path: Path, context: str) -> None:
    """docs/guide/training.md: "a loaded state resumes the next iteration only, with or without workers". A loop that
    goes back to its last checkpoint (model and data) between epochs of a loader with persistent_workers=True: the
    next epoch started at step 1 while the model resumed after step 3, and state_dict() kept saying 4."""
    stream = make_stream(tmp_path, steps=6)
    ds = LakestreamDataset(stream, rank=0, world_size=2)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context, persistent_workers=True)
    assert [it["step"] for it in loader] == [1, 2, 3, 4, 5, 6]
    ds.load_state_dict({"next_step": 4})
    assert ds.state_dict()["next_step"] == 4
    assert [it["step"] for it in loader] == [4, 5, 6]
    assert ds.state_dict()["next_step"] == 1  # applied by the workers: nothing pending here any more
    assert [it["step"] for it in loader] == [1, 2, 3, 4, 5, 6]  # once: later epochs start at start_step
    ds.load_state_dict({"next_step": 5})  # and again
    assert [it["step"] for it in loader] == [5, 6]
    alone = [it["step"] for it in ds]  # applied by the workers: an iteration without them starts at start_step
    assert alone == [1, 2, 3, 4, 5, 6]


def test_a_state_loaded_into_an_unpickled_dataset_resumes_its_workers_first_epoch_only(tmp_path: Path) -> None:
    """A dataset shipped pickled (a Ray task, a process of your own) carries no shared block: the state loaded where it
    runs resumes the first epoch of the workers started there, as in the process that made it."""
    stream = make_stream(tmp_path, steps=6)
    shipped = pickle.loads(pickle.dumps(LakestreamDataset(stream, rank=0, world_size=2)))
    shipped.load_state_dict({"next_step": 4})
    loader = DataLoader(shipped, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert [[it["step"] for it in loader] for _ in range(2)] == [[4, 5, 6], [1, 2, 3, 4, 5, 6]]


def test_resume_per_worker_states_like_stateful_dataloader(tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader protocol: state_dict() in each worker after each item, load_state_dict() in each
    worker before iter(). Saved here by running the workers' iterations round-robin in-process, loaded in real workers."""
    stream = make_stream(tmp_path, steps=9)
    full = _payload(LakestreamDataset(stream, rank=0, world_size=2))
    workers = [LakestreamDataset(stream, rank=0, world_size=2) for _ in range(2)]
    iters = [w._iterate(stream, i, 2) for i, w in enumerate(workers)]  # what iter() runs in DataLoader worker i of 2
    got = [next(iters[n % 2]) for n in range(5)]  # DataLoader's round-robin: steps 1..5
    states = [w.state_dict() for w in workers]
    for it in iters:
        it.close()
    ident = {"stream": str(stream.table.metadata.table_uuid), "branch": "main", "version": 1}
    for state, last in zip(states, (5, 4)):  # a file of the last step each worker delivered
        assert state["last_file"] in {f.file_path for f in stream.locate(last)}
    assert [{k: v for k, v in state.items() if k != "last_file"} for state in states] == [
        {"next_step": 7, "worker_id": 0, "num_workers": 2, **ident},
        {"next_step": 6, "worker_id": 1, "num_workers": 2, **ident}]

    def load(worker_id: int) -> None:
        torch.utils.data.get_worker_info().dataset.load_state_dict(states[worker_id])

    ds = LakestreamDataset(stream, rank=0, world_size=2)
    # The loader resumes with worker 1 (it delivered 5 items, the 6th comes from worker 5 % 2 == 1); DataLoader itself
    # always starts at worker 0, so emulate StatefulDataLoader's restored worker cursor by reading 7 then 6 in order.
    rest = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", worker_init_fn=load))
    assert [it["step"] for it in rest] == [7, 6, 9, 8]
    by_step = {it["step"]: it for it in got + rest}
    assert _payload([by_step[s] for s in range(1, 10)]) == full
    mismatched = LakestreamDataset(stream, rank=0, world_size=2)
    mismatched.load_state_dict(states[1])
    with pytest.raises(ConfigError, match="num_workers=2"):
        list(mismatched)


def test_a_loaded_state_goes_to_the_iteration_iter_makes_even_one_dropped_before_its_first_item(tmp_path: Path) -> None:
    """"A loaded state resumes the next iteration only": the one iter() makes. It went to the first iteration to deliver
    an item instead, so an iterator made and dropped unstarted (StatefulDataLoader's, below) left it to the next one."""
    stream = make_stream(tmp_path, steps=6)
    ds = LakestreamDataset(stream, rank=0, world_size=2)
    ds.load_state_dict({"next_step": 7})  # saved after the epoch's last step
    dropped = iter(DataLoader(ds, batch_size=None))
    assert ds.state_dict()["next_step"] == 7  # the iteration made resumes there
    del dropped
    assert [it["step"] for it in DataLoader(ds, batch_size=None)] == [1, 2, 3, 4, 5, 6]
    assert [it["step"] for it in ds] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resuming_a_state_saved_at_the_end_of_an_epoch_delivers_the_next_epoch(
        tmp_path: Path, num_workers: int) -> None:
    """torchdata's StatefulDataLoader (docs/guide/training.md), given a state saved once an epoch ended, makes an
    iterator that loads the dataset's state and drops it unstarted, then starts a fresh epoch. Without workers that
    epoch resumed past the last step: a job checkpointed at the end of an epoch lost its next epoch whole (with workers
    it was delivered)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    from torchdata.stateful_dataloader import StatefulDataLoader

    stream = make_stream(tmp_path, steps=6)
    kwargs = {"multiprocessing_context": "fork"} if num_workers else {}

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(LakestreamDataset(stream, rank=0, world_size=2), batch_size=None,
                                  num_workers=num_workers, **kwargs)

    first = loader()
    assert [it["step"] for it in first] == [1, 2, 3, 4, 5, 6]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = loader()
    resumed.load_state_dict(state)
    assert [[it["step"] for it in resumed] for _ in range(2)] == [[1, 2, 3, 4, 5, 6]] * 2
    middle = loader()  # and a state saved mid-epoch resumes that epoch, then whole ones
    assert [next(iter(middle))["step"] for _ in range(1)] == [1]
    state = middle.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert [[it["step"] for it in resumed] for _ in range(2)] == [[2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]


def test_from_checkpoint_starts_after_it(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=6)
    stream.checkpoint("ckpt-a", step=4)
    full = _payload(LakestreamDataset(stream, rank=0, world_size=2))
    ds = LakestreamDataset.from_checkpoint(stream, "ckpt-a", rank=0, world_size=2)
    assert _payload(ds) == full[4:]
    with pytest.raises(CheckpointError, match="ckpt-a"):
        LakestreamDataset.from_checkpoint(stream, "nope", rank=0, world_size=2)
    with pytest.raises(ConfigError, match="takes no start_step.*LakestreamDataset"):  # a raw TypeError before
        LakestreamDataset.from_checkpoint(stream, "ckpt-a", rank=0, world_size=2, start_step=2)


# ------------------------------------------------------------------------------------------------------ elastic
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(1, 12))
def test_partition_is_a_partition(counts: list[int], world: int) -> None:
    seen: list[int] = []
    for rank in range(world):
        for seg in partition(counts, rank, world):
            assert 0 <= seg.start <= seg.stop <= counts[seg.source]
            seen.extend(range(seg.offset + seg.start, seg.offset + seg.stop))
    assert seen == list(range(sum(counts)))  # every sample once, in rank order


def test_partition_maps_whole_files_when_sizes_divide() -> None:
    assert [(s.source, s.start, s.stop) for s in partition([5, 7, 2, 4], 1, 2)] == [(2, 0, 2), (3, 0, 4)]
    assert [(s.source, s.start, s.stop) for s in partition([5, 7], 3, 4)] == [(1, 3, 7)]
    assert [(s.source, s.start, s.stop) for s in partition([5, 7], 1, 2)] == [(1, 0, 7)]


@pytest.mark.parametrize(("producers", "consumers"), [(2, 1), (2, 3), (2, 4), (3, 2)])
def test_elastic_consumer_world_sizes(tmp_path: Path, producers: int, consumers: int) -> None:
    stream = make_stream(tmp_path, world=producers, steps=4)
    per_rank = [list(LakestreamDataset(stream, rank=r, world_size=consumers)) for r in range(consumers)]
    for step in range(1, 5):
        expected = global_xs(step, producers)
        ids: list[int] = []
        for items in per_rank:
            assert [it["step"] for it in items] == [1, 2, 3, 4]
            it = items[step - 1]
            assert it["x"].tolist() == [expected[i % ID] for i in it["sample_ids"].tolist()]
            ids.extend(it["sample_ids"].tolist())
        assert sorted(ids) == [step * ID + i for i in range(len(expected))]  # union is everything, disjoint


# --------------------------------------------------------------------------------------------------- follow mode
def producer_script(tmp_path: Path, first: int, last: int) -> str:
    """A producer process publishing steps ``first..last`` of the test stream, 50 ms apart."""
    head = textwrap.dedent(f"""
        import time
        from pathlib import Path
        import pyarrow as pa
        from pyiceberg.catalog.sql import SqlCatalog
        from lakestream_iceberg import Stream
        SCHEMA = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex({SCHEMA.serialize().to_pybytes().hex()!r})))
        CATALOG_NAME = {CATALOG_NAME!r}
    """)
    tail = textwrap.dedent(f"""
        stream = Stream.open(make_catalog(Path({str(tmp_path)!r})), "ns.s")
        producer = stream.producer("live")
        for step in range({first}, {last} + 1):
            time.sleep(0.05)
            assert producer.commit([shard(step, r) for r in range(2)]).step == step
    """)
    return head + inspect.getsource(rows_of) + inspect.getsource(shard) + inspect.getsource(make_catalog) + tail


def test_follow_mode_with_a_live_producer_process(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=2)
    proc = subprocess.Popen([sys.executable, "-c", producer_script(tmp_path, 3, 12)])
    try:
        ds = LakestreamDataset(stream, rank=1, world_size=2, follow=True, end_step=12, timeout=30, prefetch=2)
        items = list(ds)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    check_items(items, world=2, rank=1, steps=list(range(1, 13)))
    assert ds.lag() == 0


def test_follow_mode_in_workers_with_a_live_producer_thread(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=1)
    producer = stream.producer("other")

    def produce() -> None:
        for step in range(2, 7):
            time.sleep(0.05)
            producer.commit([shard(step, r) for r in range(2)])

    thread = threading.Thread(target=produce)
    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, end_step=6, timeout=30)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    thread.start()
    items = list(loader)
    thread.join()
    check_items(items, world=2, rank=0, steps=[1, 2, 3, 4, 5, 6])


@pytest.mark.parametrize("relay", [True, False])
def test_a_worker_times_out_only_when_no_step_is_published_for_timeout_seconds(tmp_path: Path, relay: bool) -> None:
    """docs/guide/training.md: ReadTimeoutError "after timeout seconds without a new step". A DataLoader worker reads
    every k-th step, so it waits for k steps at a time: a steady stream publishing a step every 3 s timed out workers
    of 2 whose timeout was 5 s."""
    stream = make_stream(tmp_path, steps=2)
    producer = stream.producer("slow")

    def produce() -> None:
        for step in range(3, 6):
            time.sleep(3.0)
            producer.commit([shard(step, r) for r in range(2)])

    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, end_step=5, timeout=5, relay=relay)
    thread = threading.Thread(target=produce)
    thread.start()
    try:
        items = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    finally:
        thread.join()
    check_items(items, world=2, rank=0, steps=[1, 2, 3, 4, 5])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stalled_producer_does_not_hang_past_timeout(tmp_path: Path, num_workers: int) -> None:
    stream = make_stream(tmp_path, steps=2)
    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, timeout=0.5)
    kwargs = {"multiprocessing_context": "fork"} if num_workers else {}
    got: list[int] = []
    started = time.monotonic()
    loader = iter(DataLoader(ds, batch_size=None, num_workers=num_workers, **kwargs))
    with raised_by_loader(ReadTimeoutError, match="step 3"):  # its workers end with the iterator, below
        for item in loader:
            got.append(item["step"])
    assert time.monotonic() - started < 10
    assert got == [1, 2]
    del loader


@pytest.mark.parametrize("drop", [True, False])
def test_a_handler_that_drops_a_loader_errors_traceback_ends_its_workers_at_once(tmp_path: Path, drop: bool) -> None:
    """docs/guide/training.md: the traceback of an error a loader with workers raised holds its iterator in a reference
    cycle (torch's), so its workers outlive the handler until a garbage collection (which then waits 5 s per worker);
    dropping the traceback in the handler ends them before the handler is left."""
    stream = make_stream(tmp_path, steps=2)
    before = {p.pid for p in multiprocessing.active_children()}
    follower = LakestreamDataset(stream, rank=0, world_size=2, follow=True, timeout=0.5)
    caught: list[ReadTimeoutError] = []
    gc.disable()  # no collection during the test (one would end the kept loader's workers, after 10 s)
    try:
        try:
            for _ in DataLoader(follower, batch_size=None, num_workers=2, multiprocessing_context="fork"):
                pass
        except ReadTimeoutError as exc:
            caught.append(exc)
            if drop:
                exc.__traceback__ = None
        left = {p.pid for p in multiprocessing.active_children()} - before
        assert (left == set()) == drop, left
    finally:
        for exc in caught:  # the kept loader's workers end now
            exc.__traceback__ = None
        caught.clear()
        gc.enable()


def test_close_ends_a_waiting_follow_iteration(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=1)
    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, timeout=None)
    it = iter(ds)
    assert next(it)["step"] == 1  # delivered before the close (a timer started first could fire before step 1)
    closed_at: list[float] = []

    def close() -> None:
        closed_at.append(time.monotonic())
        ds.close()

    threading.Timer(0.3, close).start()  # the iteration is now waiting for step 2, which never comes
    assert list(it) == []
    # without the close it would wait forever (timeout=None); the bound only rules out a close that waits out a poll
    assert closed_at and time.monotonic() - closed_at[0] < 30
    assert not [t for t in threading.enumerate() if t.name.startswith("lakestream-read")]


def test_close_stops_an_iteration_between_items(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=5)
    ds = LakestreamDataset(stream, rank=0, world_size=2, prefetch=3)
    it = iter(ds)
    assert next(it)["step"] == 1
    ds.close()
    assert list(it) == []
    assert [item["step"] for item in ds] == [1, 2, 3, 4, 5]  # a new iteration starts afresh


def test_head_watcher_reloads_metadata_only_when_the_pointer_moves(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=1)
    watcher = HeadWatcher(stream, branch="main")
    watcher.check()
    reloads = watcher.reloads
    assert not watcher.check() and not watcher.check() and watcher.reloads == reloads
    stream.producer("other").commit([shard(2, r) for r in range(2)])
    assert watcher.check() and watcher.head()[0] == 2


def test_lag(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=5)
    ds = LakestreamDataset(stream, rank=0, world_size=2)
    assert ds.lag() == 5
    it = iter(ds)
    next(it), next(it)
    assert ds.last_step == 2 and ds.lag() == 3
    assert consumer_lag(stream, 4) == 1


# ------------------------------------------------------------------------------------------- ranks, optional torch
def test_rank_defaults_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = make_stream(tmp_path, steps=1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ds = LakestreamDataset(stream)
    assert (ds.rank, ds.world_size) == (1, 3)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (LakestreamDataset(stream).rank, LakestreamDataset(stream).world_size) == (0, 1)
    with pytest.raises(RankError, match="outside 0..1"):
        LakestreamDataset(stream, rank=2, world_size=2)


def test_missing_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` sees when torch is not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'lakestream-iceberg\[torch\]'") as err:
        require_torch()
    assert isinstance(err.value, ImportError)


def test_module_imports_without_torch() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        import lakestream_iceberg.read.dataset as d
        from lakestream_iceberg import MissingExtraError
        try:
            d.LakestreamDataset
        except MissingExtraError as exc:
            print("MISSING", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    assert "MISSING" in out.stdout and "lakestream-iceberg[torch]" in out.stdout


def test_arrow_owned_copy_for_non_arrow_streams() -> None:
    from lakestream_iceberg.read.reader import _arrow_owned

    buffer = _arrow_owned(b"parquet bytes")
    assert buffer.to_pybytes() == b"parquet bytes" and buffer.is_mutable
    assert _arrow_owned(b"").size == 0


def test_tensors_share_arrow_memory() -> None:
    from lakestream_iceberg.read.dataset import StepShard

    table = pa.Table.from_batches([pa.RecordBatch.from_pydict({"v": np.arange(6), "t": [[1, 2]] * 6})])
    item = TensorCollate()(StepShard(step=1, rank=0, world_size=1, table=table, sample_ids=np.arange(6)))
    buffer_address = table.column("v").chunk(0).buffers()[1].address
    assert item["v"].data_ptr() == buffer_address  # no copy
    assert item["t"].shape == (6, 2)


@pytest.mark.parametrize("lengths", [[2, 2, 2], [3, 0, 1]])
def test_padding_copies_once_into_writable_memory(lengths: list[int]) -> None:
    """Padded lists are built from a read-only view of Arrow's values (one copy, into the padded tensor); rows of one
    length still come out writable (torch must never get read-only memory)."""
    import warnings

    from lakestream_iceberg.read.dataset import StepShard

    rows = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)]
    flat = np.array([v for r in rows for v in r], np.int32)
    values = pa.Array.from_buffers(pa.int32(), len(flat), [None, pa.py_buffer(flat.tobytes())])  # read-only memory
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    table = pa.table({"t": pa.ListArray.from_arrays(offsets, values), "b": [bytes([i]) * n for i, n in enumerate(lengths)]})
    shard = StepShard(step=1, rank=0, world_size=1, table=table, sample_ids=np.arange(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "non-writable NumPy array" warning would fail here
        item = TensorCollate(binary="padded", pad_value=-1)(shard)
    width = max(lengths)
    assert item["t"].tolist() == [r + [-1] * (width - len(r)) for r in rows]
    assert item["b"].tolist() == [[i] * n + [0] * (width - n) for i, n in enumerate(lengths)]
    assert item["t_lengths"].tolist() == lengths
    item["t"][0, 0] = 99  # writable: a copy, Arrow's read-only buffer is untouched
    assert table.column("t").chunk(0).values[0].as_py() == 0


# ------------------------------------------------------------------------------ credentials and pickles
PARENT_SECRET = "parent-only-s3cr3t-value"
ENV_SECRET = "env-only-s3cr3t-value"


def _reopen_and_report(blob: bytes, queue) -> None:  # runs in a spawned process
    dataset = pickle.loads(blob)
    steps = [it["step"] for it in dataset]
    stream = dataset._stream_here()
    queue.put((steps, stream.table.catalog.properties.get("s3.secret-access-key"),
               stream.io.properties.get("s3.secret-access-key")))


@pytest.mark.parametrize("how", ["class", "type"])  # SqlCatalog(...) directly (py-catalog-impl), or load_catalog(type=)
def test_spawned_process_takes_credentials_from_its_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                how: str) -> None:
    import multiprocessing

    from lakestream_iceberg import load_catalog

    name = f"cred{how}"  # no "_": pyiceberg reads PYICEBERG_CATALOG__A_B__... as catalog "a-b"
    props = {"uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/warehouse",
             "s3.secret-access-key": PARENT_SECRET}
    catalog = SqlCatalog(name, **props) if how == "class" else load_catalog(name, type="sql", **props)
    stream = Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2)
    stream.producer("prep-0").commit([shard(1, r) for r in range(2)])
    blob = pickle.dumps(LakestreamDataset(stream, rank=0, world_size=2, prefetch=0))
    assert PARENT_SECRET.encode() not in blob
    # the receiving process is configured like a user would configure it: PYICEBERG_CATALOG__<NAME>__<KEY>
    monkeypatch.setenv(f"PYICEBERG_CATALOG__{name.upper()}__S3__SECRET_ACCESS_KEY", ENV_SECRET)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_reopen_and_report, args=(blob, queue))
    process.start()
    try:
        steps, catalog_secret, io_secret = queue.get(timeout=180)
    finally:
        process.join(60)
    assert steps == [1] and catalog_secret == ENV_SECRET and io_secret == ENV_SECRET
    # shipping credentials is an explicit opt-in, and then the pickle carries them
    shipped = pickle.dumps(LakestreamDataset(stream, rank=0, world_size=2, ship_credentials=True))
    assert PARENT_SECRET.encode() in shipped
    assert dict(pickle.loads(pickle.dumps(StreamRef.of(stream, include_secrets=True))).secrets) == {
        "s3.secret-access-key": PARENT_SECRET}
    assert PARENT_SECRET not in repr(StreamRef.of(stream, include_secrets=True))


def test_prefetched_steps_planned_before_gc_are_re_resolved(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=10)
    ds = LakestreamDataset(stream, rank=0, world_size=2, prefetch=2, collate=lambda it: it.step)
    iterator = iter(ds)
    got = [next(iterator)]  # steps 2 and 3 are in flight on the head of that moment
    stream.checkpoint("early", step=1)
    stream.checkpoint("late", step=6)
    Stream.open(stream.table.catalog, "ns.s").collect_garbage(dry_run=False, keep_last=1)  # collects steps 1..5
    with pytest.raises(StepCollectedError, match="step 4 "):
        got.extend(iterator)
    assert got == [1, 2, 3]  # read before GC deleted them; step 4 was resolved again on the new head: collected
    ds.load_state_dict({"next_step": 6})
    assert list(ds) == [6, 7, 8, 9, 10]
