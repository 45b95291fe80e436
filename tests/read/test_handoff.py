"""Items crossing from a DataLoader worker to the training process (lakestream_iceberg/read/handoff.py).

An item is pickled the way DataLoader pickles it (``ForkingPickler``, torch's reductions registered) and loaded back;
in one process that exercises the same code as two (the descriptor goes through multiprocessing's resource sharer
either way). Then real DataLoader workers, fork and spawn, against the items read without workers.
"""

from __future__ import annotations

import gc
import io
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
from collections import Counter
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import ConfigError, ReadError
from lakestream_iceberg.read import handoff
from lakestream_iceberg.read.handoff import Handoff, advise_workers
from lakestream_iceberg.read.tensors import Blobs

pytest.importorskip("torch")  # the dataset's tests need the torch extra (the core's run without it)
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lakestream_iceberg.read.dataset import LakestreamDataset  # noqa: E402
from tests.support import raised_by_loader  # noqa: E402

pytestmark = pytest.mark.skipif(not handoff.supported(), reason="the segment pool needs os.memfd_create (Linux)")


def ship(item: dict) -> dict:
    return pickle.loads(ForkingPickler.dumps(Handoff(item, num_workers=1)))


def sample_item(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (37,), dtype=torch.uint8, generator=g)
    return {
        "step": seed,
        "sample_ids": torch.arange(5, dtype=torch.int64) + seed,
        "tokens": torch.randint(0, 1000, (5, 9), dtype=torch.int32, generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "half": torch.rand(3, 2, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(seed * 1.5),
        "empty": torch.empty(0, 4, dtype=torch.float64),
        "strided": torch.arange(20, dtype=torch.int16).reshape(4, 5).t(),  # not contiguous
        "conjugate": torch.complex(torch.rand(3, generator=g), torch.rand(3, generator=g)).conj(),  # lazy views:
        "negative": torch.complex(torch.rand(2, generator=g), torch.rand(2, generator=g)).conj().imag,  # values kept
        "blob": Blobs(values=values, offsets=torch.tensor([0, 3, 3, 20, 37])),
        "texts": ["a", "b"],
    }


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Blobs):
        return isinstance(b, Blobs) and same(a.values, b.values) and same(a.offsets, b.offsets)
    return a == b


def test_an_item_arrives_equal_as_a_plain_dict_of_views_of_one_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "COPIED_BYTES", 0)  # every tensor a view (sample_item's are all small)
    item = sample_item(3)
    got = ship(item)
    assert type(got) is dict and list(got) == list(item)
    for key, value in item.items():
        assert same(value, got[key]), key
    tensors = [t for t in got.values() if isinstance(t, torch.Tensor) and t.numel()]
    tensors += [got["blob"].values, got["blob"].offsets]
    mapped = [np.frombuffer(m, dtype=np.uint8) for m in handoff._mapped.values()]
    holding = [[i for i, m in enumerate(mapped) if m.ctypes.data <= t.data_ptr()
                and t.data_ptr() + t.numel() * t.element_size() <= m.ctypes.data + m.size] for t in tensors]
    del mapped
    assert len({tuple(h) for h in holding}) == 1 and len(holding[0]) == 1  # one segment, whatever the number of tensors
    got["tokens"][0, 0] = -1  # writable, as a tensor from DataLoader always was
    assert [bytes(b.numpy()) for b in got["blob"]] == [bytes(b.numpy()) for b in item["blob"]]


def test_a_segment_is_reused_only_after_every_view_of_its_item_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "COPIED_BYTES", 0)  # every tensor a view (sample_item's are all small)
    pool = handoff._pool_here()
    first = ship(sample_item(1))
    kept = first["tokens"]  # one view is enough to hold the segment
    del first
    gc.collect()
    second = ship(sample_item(2))
    assert same(kept, sample_item(1)["tokens"])  # the second item went elsewhere
    before = len(pool.segments)
    del kept, second
    gc.collect()
    for seed in range(4, 10):  # one item at a time: the freed segments serve them all
        assert same(ship(sample_item(seed))["tokens"], sample_item(seed)["tokens"])
    assert len(pool.segments) == before


def test_a_small_tensor_kept_past_its_step_does_not_hold_its_items_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept ``item["sample_ids"]`` held its item's whole segment: a loop keeping each step's ids (for logging, for an
    epoch's record) took one segment per step, shared memory that only grew. Tensors of at most COPIED_BYTES arrive as
    copies; a larger one is a view of the segment, and keeping it holds the segment, as before."""
    # a pool of this test's own segments, and their mappings: both are per process, and the other tests' items go on
    # through the pool and the mappings they had (a segment's mapping is keyed by its number, sent once)
    monkeypatch.setattr(handoff, "_pool", None)
    monkeypatch.setattr(handoff, "_mapped", {})
    pool = handoff._pool_here()
    big = (handoff.COPIED_BYTES // 4) + 1  # int32 values: one element past the copied size

    def item(seed: int) -> dict:
        return {**sample_item(seed), "large": torch.arange(big, dtype=torch.int32) + seed}

    first = ship(item(1))
    before = len(pool.segments)
    kept = [first["sample_ids"], first["half"], first["blob"].offsets]  # small ones, a bfloat16 among them
    large = first["large"]
    del first
    gc.collect()
    second = ship(item(2))
    assert len(pool.segments) == before + 1  # the large tensor holds the first segment
    del large, second
    gc.collect()
    ids = [ship(item(seed))["sample_ids"] for seed in range(3, 12)]  # each step's ids kept, the rest dropped
    assert len(pool.segments) == before + 1  # the freed segments serve every later item
    assert [t.tolist() for t in ids] == [(torch.arange(5) + seed).tolist() for seed in range(3, 12)]
    assert same(kept[0], sample_item(1)["sample_ids"]) and same(kept[1], sample_item(1)["half"])
    assert same(kept[2], sample_item(1)["blob"].offsets)
    for tensor in ids:  # memory of their own: writable, and not in any mapped segment
        tensor[0] = -1
        assert not any(np.frombuffer(m, dtype=np.uint8).ctypes.data <= tensor.data_ptr()
                       < np.frombuffer(m, dtype=np.uint8).ctypes.data + len(m) for m in handoff._mapped.values())


def test_items_without_tensors_and_other_types_pass_unchanged() -> None:
    assert ship({"step": 1, "rows": [1, 2]}) == {"step": 1, "rows": [1, 2]}
    got = ship({"step": 2, "ids": torch.arange(3), "grad": torch.ones(2, requires_grad=True)})
    assert got["grad"].requires_grad and torch.equal(got["ids"], torch.arange(3))
    # a nested tensor (strided, no single shape) goes through torch's own pickling: raising in DataLoader's queue
    # feeder thread dropped the item, and the training loop waited for it forever
    nested = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    got = ship({"step": 3, "ids": torch.arange(3), "nested": nested})
    assert got["nested"].is_nested and [t.tolist() for t in got["nested"].unbind()] == [[1.0, 1.0], [0.0, 1.0, 2.0]]



def test_a_one_element_tensor_under_a_stride_other_than_one_arrives_equal() -> None:
    """``tokens[:, 0]`` of a one-row shard (one element, stride = the row length) counts as contiguous in torch, and its
    flat view refused ``view(torch.uint8)``: the RuntimeError rose in DataLoader's queue feeder thread, which drops the
    item, so the training loop waited for it forever."""
    tokens = torch.arange(7, dtype=torch.int64).reshape(1, 7)
    item = {"first": tokens[:, 0], "last": tokens[:, -1:].t(), "every_other": torch.arange(3.0)[::2][:1],
            "half": torch.ones(1, 3, dtype=torch.bfloat16)[:, 1], "tokens": tokens}
    got = ship(item)
    assert all(same(item[key], got[key]) for key in item), {key: (item[key], got[key]) for key in item}


def test_an_item_goes_through_torchs_own_sharing_when_no_segment_can_be_made(monkeypatch: pytest.MonkeyPatch,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """memfd_create failing (descriptors or shared memory exhausted) raised in DataLoader's queue feeder thread, which
    drops the item: the training loop waited for it forever. The item is pickled as a plain dict instead, once logged."""
    import errno

    def exhausted(*_: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(handoff, "_pool", None)  # a fresh pool: every segment must be made
    monkeypatch.setattr(handoff, "_fallbacks", Counter())
    monkeypatch.setattr(handoff.os, "memfd_create", exhausted)
    shipped_through_torchs_sharing(caplog, "OSError")


def test_items_that_fall_back_leave_no_record_per_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose segments cannot be made (descriptors or shared memory exhausted) falls back at every step for as
    long as it runs, days in follow mode: what it keeps of the fallbacks is counts, not one entry per item."""
    import errno

    def exhausted(*_: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(handoff, "_pool", None)
    monkeypatch.setattr(handoff, "_fallbacks", type(handoff._fallbacks)())  # noqa: SLF001
    monkeypatch.setattr(handoff.os, "memfd_create", exhausted)
    item, kept = sample_item(1), []
    for _ in range(2):  # 300 items, then 300 more
        for _ in range(300):
            assert type(ship(item)) is dict
        kept.append(sys.getsizeof(handoff._fallbacks))  # noqa: SLF001
    assert kept[1] <= kept[0], kept  # a list of reasons grew with every item: 2,520 -> 5,432 bytes


def shipped_through_torchs_sharing(caplog: pytest.LogCaptureFixture, reason: str) -> None:
    """Two items shipped: each arrives equal, as a plain dict through torch's own sharing, and the fallback (for
    ``reason``, an exception's class name) is logged once."""
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read.dataset"):
        for seed in (1, 2):
            item = sample_item(seed)
            got = ship(item)
            assert type(got) is dict and all(same(item[k], got[k]) for k in item)
    assert handoff._fallbacks == {reason: 2}  # noqa: SLF001
    assert len([r for r in caplog.records if "torch's own sharing" in r.getMessage()]) == 1


def test_an_item_whose_tensors_cannot_be_copied_goes_through_torchs_own_sharing_and_frees_its_segment(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever fails while an item is copied into its segment (a tensor layout the copy does not take, as the
    one-element case above did) would raise in DataLoader's queue feeder thread and lose the item: it goes through
    torch's own sharing instead, logged once, and the segment it took is free for the next item."""
    def refuse(*_: object) -> None:
        raise RuntimeError("a layout the copy does not take")

    monkeypatch.setattr(handoff, "_pool", None)
    monkeypatch.setattr(handoff, "_mapped", {})  # the new pool's mappings, keyed as the old pool's are
    monkeypatch.setattr(handoff, "_fallbacks", Counter())
    monkeypatch.setattr(handoff, "COPIED_BYTES", 0)  # every tensor a view (sample_item's are all small)
    with monkeypatch.context() as patch:
        patch.setattr(handoff, "_copy_into", refuse)
        shipped_through_torchs_sharing(caplog, "RuntimeError")
    pool = handoff._pool  # noqa: SLF001
    assert pool is not None and len(pool.segments) == 1 and pool.segments[0].free()  # taken twice, freed each time
    item = sample_item(3)
    got = ship(item)  # the copy works again: through the segment, which the item's views now hold
    assert all(same(item[k], got[k]) for k in item)
    assert len(pool.segments) == 1 and not pool.segments[0].free()


def test_a_finalizer_an_exception_is_raised_into_finishes_its_work() -> None:
    """DataLoader's SIGCHLD handler raises in the training thread when a worker died, at whatever line it is on: inside
    the finalizer that drops a dead worker's mappings it stopped the work half done (its segment stayed mapped: seen
    once in a full run of the suite, by the killed-worker test below). The work is done again, and the exception
    (which a finalizer could only print) is left to DataLoader, which raises it again where the loop waits."""
    done: list[int] = []
    raised = iter([RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed."), OSError("interrupted")])

    def work(pid: int) -> None:
        if (exc := next(raised, None)) is not None:
            raise exc
        done.append(pid)

    handoff._finalizer(work)(7)  # noqa: SLF001
    assert done == [7]
    handoff._finalizer(lambda: (_ for _ in ()).throw(RuntimeError("always")))()  # noqa: SLF001 - gives up quietly


# ---------------------------------------------------------------------------------------------- real workers
SCHEMA = pa.schema([pa.field("tokens", pa.list_(pa.int32())), pa.field("blob", pa.binary()), pa.field("label", pa.int64())])


def make_stream(tmp_path: Path, steps: int) -> Stream:
    catalog = SqlCatalog("t", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}/wh")
    stream = Stream.create(catalog, "ns.handoff", schema=SCHEMA, world_size=1)
    producer = stream.producer("p")
    for step in range(1, steps + 1):
        rows = range(step * 10, step * 10 + 3 + step % 3)
        producer.commit([pa.table({"tokens": [list(range(r % 7)) for r in rows], "blob": [bytes([r % 256]) * (r % 5) for r in rows],
                                   "label": list(rows)}, schema=SCHEMA)])
    return stream


def payload(items: list[dict]) -> list[tuple]:
    return [(it["step"], it["sample_ids"].tolist(), it["tokens"].tolist(), it["tokens_lengths"].tolist(),
             [bytes(b.numpy()) for b in it["blob"]], it["label"].tolist()) for it in items]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_items_from_workers_equal_the_items_without_workers_all_held_at_once(tmp_path: Path, context: str) -> None:
    stream = make_stream(tmp_path, steps=9)
    alone = list(LakestreamDataset(stream, rank=0, world_size=1))
    held = list(DataLoader(LakestreamDataset(stream, rank=0, world_size=1), batch_size=None, num_workers=2,
                           multiprocessing_context=context))  # every item kept: no segment may be written twice
    assert payload(held) == payload(alone) and [it["step"] for it in held] == list(range(1, 10))
    assert all(type(it) is dict and isinstance(it["blob"], Blobs) for it in held)


def first_token(item: dict) -> dict:
    return {"step": item["step"], "first": item["tokens"][:, 0], "label": item["label"]}


def test_a_transform_taking_one_column_of_a_one_row_shard_reaches_the_loop_from_workers(tmp_path: Path) -> None:
    """A transform's ``tokens[:, 0]`` of a one-row shard: the worker's item was lost in DataLoader's queue feeder
    thread (see the test above) and the loop waited forever (here: DataLoader's own timeout)."""
    catalog = SqlCatalog("t", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}/wh")
    stream = Stream.create(catalog, "ns.one_row", schema=SCHEMA, world_size=1)
    producer = stream.producer("p")
    for step in range(1, 5):
        producer.commit([pa.table({"tokens": [[step, 1, 2]] * (step % 2 + 1), "blob": [b"x"] * (step % 2 + 1),
                                   "label": [step] * (step % 2 + 1)}, schema=SCHEMA)])  # one row in steps 2 and 4
    loader = DataLoader(LakestreamDataset(stream, rank=0, world_size=1, transform=first_token), batch_size=None,
                        num_workers=2, multiprocessing_context="fork", timeout=60)
    assert [(it["step"], it["first"].tolist()) for it in loader] == [(1, [1, 1]), (2, [2]), (3, [3, 3]), (4, [4])]


def handoff_memory() -> set[int]:
    """The segments (memfd inodes) this process holds, by a descriptor or a mapping."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "lakestream-handoff" in os.readlink(f"/proc/self/fd/{fd}"):
                held.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # the listing's own descriptor, closed since
            pass
    with open("/proc/self/maps") as maps:
        held |= {int(line.split()[4]) for line in maps if "lakestream-handoff" in line}
    return held


def test_the_training_process_lets_go_of_a_workers_segments_once_its_loader_is_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training process kept every segment of a finished DataLoader's workers mapped (with a descriptor each)
    until a later DataLoader's worker sent its first item: after a loop over huge steps, their memory stayed taken."""
    monkeypatch.setattr(handoff, "COPIED_BYTES", 0)  # every tensor a view (these items' are all small)
    stream = make_stream(tmp_path, steps=9)
    alone = payload(list(LakestreamDataset(stream, rank=0, world_size=1)))
    before = handoff_memory()

    def loader(**kwargs: object) -> DataLoader:
        return DataLoader(LakestreamDataset(stream, rank=0, world_size=1), batch_size=None, num_workers=2, **kwargs)

    steps = []
    for item in loader():  # each item dropped as the loop goes on
        steps.append(item["step"])
        assert handoff_memory() - before
    del item
    assert steps == list(range(1, 10))
    gc.collect()
    assert not handoff_memory() - before

    held = list(loader(multiprocessing_context="spawn"))  # items kept past the loader's end keep their segments
    gc.collect()
    assert payload(held) == alone and handoff_memory() - before
    first = held[0]["tokens"]
    del held
    gc.collect()
    assert first.tolist() == alone[0][2] and handoff_memory() - before  # a view holds its segment
    del first
    gc.collect()
    assert not handoff_memory() - before

    persistent = loader(persistent_workers=True)  # workers alive between epochs: their segments stay for reuse
    for _ in range(2):
        assert payload(list(persistent)) == alone
    gc.collect()
    assert handoff_memory() - before
    del persistent
    gc.collect()
    assert not handoff_memory() - before


def fail_at_step_5(item: dict) -> dict:
    if item["step"] == 5:
        raise ValueError("a transform failed at step 5")
    return item


def test_a_worker_that_fails_or_is_killed_ends_the_loop_leaving_kept_items_intact_and_no_segment(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=9)
    alone = payload(list(LakestreamDataset(stream, rank=0, world_size=1)))
    before = handoff_memory()
    kept = []
    # the error's traceback dropped: the first loader's iterator goes now, not as garbage in a reference cycle collected
    # later, while the second loader's killed worker is registered (DataLoader's SIGCHLD handler may then raise in its
    # __del__, and pytest keeps that unraisable exception, with the iterator and its workers' Process objects, so their
    # segments, to the end of the test)
    with raised_by_loader(ValueError, match="failed at step 5"):
        for item in DataLoader(LakestreamDataset(stream, rank=0, world_size=1, transform=fail_at_step_5),
                               batch_size=None, num_workers=2):
            kept.append(item)
    gc.collect()
    items = iter(DataLoader(LakestreamDataset(stream, rank=0, world_size=1), batch_size=None, num_workers=2))
    kept.append(next(items))
    # DataLoader's SIGCHLD handler raises in this thread as soon as the worker is gone, wherever the test is then
    # ("killed by signal"), or the loop finds it dead while waiting ("exited unexpectedly"): the kill is inside the block
    # (or, when it died with an item sent but its memory not yet handed over, the ReadError the item's rebuild raises)
    with pytest.raises((RuntimeError, ReadError), match="killed by signal|exited unexpectedly|exited before"):
        os.kill(items._workers[1].pid, signal.SIGKILL)  # noqa: SLF001 - the worker DataLoader started
        kept += list(items)
    try:  # what deleting the iterator does; the SIGCHLD handler may raise here too (the other worker exits while the
        items._shutdown_workers()  # noqa: SLF001 - killed one is still registered), and in __del__ that exception's
    except RuntimeError:  # traceback, kept by pytest as unraisable, would keep the iterator and its workers alive
        pass
    del items, item
    assert payload(kept[:4]) == alone[:4] and payload(kept[4:5]) == alone[:1]
    del kept
    deadline = time.monotonic() + 120
    while handoff_memory() - before:  # the workers' segments go once their Process objects do (reaped, then freed)
        assert time.monotonic() < deadline, handoff_memory() - before
        multiprocessing.active_children()  # reaps the workers that exited
        gc.collect()
        time.sleep(0.05)


def collect_garbage(_: int) -> None:
    gc.collect()


def test_an_item_collected_in_a_forked_child_is_not_released_for_the_training_process(tmp_path: Path) -> None:
    """An item that was garbage in a reference cycle when the training process forked (another DataLoader's workers)
    was released by the child's collection too: its segment was then freed twice, the second time while it held a
    later item the training process kept, and the worker wrote a third item over that one."""
    stream = make_stream(tmp_path, steps=9)
    alone = payload(list(LakestreamDataset(stream, rank=0, world_size=1)))
    items = iter(DataLoader(LakestreamDataset(stream, rank=0, world_size=1), batch_size=None, num_workers=1,
                            multiprocessing_context="fork"))
    held = [next(items)]
    gc.disable()  # the cycle stays garbage until the fork below
    try:
        cycle: list = [next(items)]
        cycle.append(cycle)
        del cycle
        other = DataLoader(list(range(2)), batch_size=None, num_workers=1, multiprocessing_context="fork",
                           worker_init_fn=collect_garbage)  # e.g. an eval loader, whose forked worker collects
        assert list(other) == [0, 1]
        held.append(next(items))
    finally:
        gc.enable()
    gc.collect()  # the training process releases the item in its cycle, as it should
    held += list(items)
    assert [it["step"] for it in held] == [1] + list(range(3, 10))
    assert payload(held) == [alone[0]] + alone[2:]  # every item kept intact


def test_an_item_with_empty_tensors_saves_with_torch_save(tmp_path: Path) -> None:
    """An empty tensor (a 0-row step, a column of empty lists or blobs) was a view at the place of the next tensor in
    the segment: ``torch.save`` of the item raised "Cannot save multiple tensors or storages that view the same data
    as different types", where the same item read without workers saved."""
    catalog = SqlCatalog("t", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}/wh")
    stream = Stream.create(catalog, "ns.handoff", schema=SCHEMA, world_size=1)
    producer = stream.producer("p")
    for rows in ([1, 2], [], [3, 4]):  # a 0-row step, then rows whose lists and blobs are all empty
        producer.commit([pa.table({"tokens": [list(range(r % 3 - 1)) for r in rows], "blob": [b"x" * (r % 3 - 1) for r in rows],
                                   "label": rows}, schema=SCHEMA)])
    alone = payload(list(LakestreamDataset(stream, rank=0, world_size=1)))
    items = list(DataLoader(LakestreamDataset(stream, rank=0, world_size=1), batch_size=None, num_workers=1))
    saved = []
    for item in items:
        buffer = io.BytesIO()
        torch.save(item, buffer)
        saved.append(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    assert payload(saved) == payload(items) == alone
    assert alone[1][1] == [] and alone[2][2] == [[], []]
    got = ship(sample_item(4))  # every kind of tensor, an empty one among them
    torch.save(got, io.BytesIO())


def grow(item: dict) -> dict:
    """A transform (module level: spawned workers pickle it) whose items grow with the step, as a curriculum's do."""
    return {**item, "grown": torch.full((item["step"] * 25_000,), item["step"], dtype=torch.int32)}


def handoff_bytes() -> int:
    """The memory the segments this process holds a descriptor of take (their pages written)."""
    taken = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "lakestream-handoff" in os.readlink(f"/proc/self/fd/{fd}"):
                found = os.stat(f"/proc/self/fd/{fd}")
                taken[found.st_ino] = found.st_blocks * 512
        except OSError:  # the listing's own descriptor, closed since
            pass
    return sum(taken.values())


def test_segments_outgrown_by_growing_items_give_their_memory_back(tmp_path: Path) -> None:
    """A worker makes a larger segment for an item no free one fits, and kept every smaller one with its memory: items
    growing step after step (a curriculum's) left the memory of every size they passed through taken, in the worker and
    the training process, for as long as the loader lived: 10x the largest item after 40 steps here."""
    stream = make_stream(tmp_path, steps=40)
    loader = DataLoader(LakestreamDataset(stream, rank=0, world_size=1, transform=grow), batch_size=None,
                        num_workers=1, persistent_workers=True)  # segments stay between epochs
    before = handoff_bytes()
    sizes = [item["grown"].numel() * 4 for item in loader if bool((item["grown"] == item["step"]).all())]
    assert len(sizes) == 40
    gc.collect()
    # the items in flight at most (the loop's, DataLoader's prefetch_factor=2, the worker's next) and the header pages
    assert handoff_bytes() - before <= 6 * max(sizes)
    again = list(loader)  # the segments given back are written again
    assert payload(again) == payload(list(LakestreamDataset(stream, rank=0, world_size=1)))
    assert [(it["grown"].numel(), bool((it["grown"] == it["step"]).all())) for it in again] == [
        (step * 25_000, True) for step in range(1, 41)]


def test_workers_that_leave_no_core_free_are_advised_against_once(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(handoff, "_advised", set())
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read.dataset"):
        assert advise_workers(1, cores=2) is False  # a free core: no advice
        assert advise_workers(2, cores=2) is True
        assert advise_workers(2, cores=2) is False  # once per process
        assert advise_workers(4, cores=2) is True
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "num_workers=2) on 2 usable CPU cores" in messages[0] and "num_workers=0" in messages[0]


def record_thread(item: dict) -> dict:
    """A transform (module level: spawned workers pickle it) that notes the thread building the item."""
    import threading

    return {**item, "thread": threading.current_thread().name}


@pytest.mark.parametrize(("prefetch", "expected"), [(None, "lakestream-read"), (0, "MainThread")])
def test_a_worker_reads_ahead_in_one_thread_by_default(tmp_path: Path, prefetch: int | None, expected: str) -> None:
    stream = make_stream(tmp_path, steps=6)
    alone = list(LakestreamDataset(stream, rank=0, world_size=1))
    ds = LakestreamDataset(stream, rank=0, world_size=1, transform=record_thread, prefetch=prefetch)
    items = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert payload(items) == payload(alone) and [it["step"] for it in items] == list(range(1, 7))
    assert {it["thread"].split("_")[0] for it in items} == {expected}


def test_recommended_workers_leaves_the_decoding_to_read_ahead_threads_on_few_cores() -> None:
    import lakestream_iceberg

    assert [handoff.recommended_workers(cores=c) for c in (1, 2, 3, 4, 5, 8, 16, 64)] == [0, 0, 0, 0, 3, 6, 8, 8]
    assert lakestream_iceberg.recommended_workers() == handoff.recommended_workers(cores=handoff._usable_cores())
    for bad in (0, -1, True, 2.0, "4"):
        with pytest.raises(ConfigError, match="cores must be"):
            handoff.recommended_workers(cores=bad)  # type: ignore[arg-type]
    assert handoff.recommended_workers(cores=np.int64(8)) == 6  # os.cpu_count()-like numpy ints were refused


def _send_item(conn: Any) -> None:
    conn.send_bytes(bytes(ForkingPickler.dumps(Handoff({"x": torch.arange(10)}, num_workers=2))))
    conn.close()  # and exit: the descriptor of the item's segment goes with this process


def test_an_item_whose_worker_died_before_handing_over_its_memory_is_a_read_error() -> None:
    """A worker killed after it sent an item but before the training process fetched the segment's descriptor (from
    the worker itself, over a socket): the rebuild raised the socket's raw ConnectionResetError (or
    FileNotFoundError) out of DataLoader. It is a ReadError that says what happened and what to do."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    worker = context.Process(target=_send_item, args=(sender,))
    worker.start()
    sender.close()
    data = receiver.recv_bytes()
    worker.join()
    with pytest.raises(ReadError, match=rf"DataLoader worker \(pid {worker.pid}\) exited before the training process "
                                        r"took the shared memory of its item .*Make a new DataLoader"):
        pickle.loads(data)


def _send_and_wait(conn: Any) -> None:
    conn.send_bytes(bytes(ForkingPickler.dumps(Handoff({"x": torch.arange(10)}, num_workers=2))))
    conn.recv_bytes()  # alive until the training process took the item's memory


def _start_grandchild(conn: Any) -> None:
    grandchild = multiprocessing.get_context("fork").Process(target=_send_and_wait, args=(conn,))
    grandchild.start()
    grandchild.join()


def test_the_segments_of_a_worker_gone_before_it_was_watched_go_when_a_loader_lets_go_of_its_workers() -> None:
    """A worker killed just as its first segment arrived is gone before the training process looks for its Process
    object (to drop its segments when DataLoader lets go of it): its segments stayed mapped until a later loader's
    worker sent an item. They go once a loader lets go of any worker, as that worker's own do."""
    before = handoff_memory()
    context = multiprocessing.get_context("fork")
    items = []
    to_worker, worker_end = context.Pipe()
    worker = context.Process(target=_send_and_wait, args=(worker_end,))  # a worker a DataLoader holds
    worker.start()
    items.append(pickle.loads(to_worker.recv_bytes()))
    to_other, other_end = context.Pipe()
    parent = context.Process(target=_start_grandchild, args=(other_end,))  # the sender: a process the training
    parent.start()                                                       # process never finds among its children
    items.append(pickle.loads(to_other.recv_bytes()))
    to_other.send_bytes(b"taken")
    parent.join()  # and the sender with it
    to_worker.send_bytes(b"taken")
    worker.join()
    del parent
    assert [item["x"].tolist() for item in items] == [list(range(10))] * 2
    del items
    gc.collect()
    assert len(handoff_memory() - before) == 2  # both still mapped while the loader holds its worker
    del worker  # the loader lets go of it
    gc.collect()
    assert not handoff_memory() - before
