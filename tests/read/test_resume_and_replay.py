"""Resuming on forks, replay comparisons and GC reports at the edges (found in a review of the input checks; each
test failed before its fix)."""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from lakestream_iceberg import Stream
from tests.support import SCHEMA, batch, lakestream_keys, shard, sqlite_catalog

pytest.importorskip("torch")  # the dataset's tests need the torch extra (the core's run without it)
from lakestream_iceberg.read.dataset import LakestreamDataset  # noqa: E402

WORLD = 2


def make(root: Path, name: str = "ns.s", steps: int = 4, properties: dict | None = None) -> Stream:
    root.mkdir(parents=True, exist_ok=True)
    stream = Stream.create(sqlite_catalog(str(root)), name, schema=SCHEMA, world_size=WORLD, properties=properties)
    producer = stream.producer("p")
    for seq in range(steps):
        producer.commit(batch("p", seq, WORLD), seq=seq)
    return stream


# 1. multi-worker (StatefulDataLoader) states of the source branch are refused on the fork ----------------------------
def test_worker_states_saved_on_main_load_on_a_fork_of_the_checkpoint_they_stopped_at(tmp_path: Path) -> None:
    """Two DataLoader workers consumed steps 1..4 on main (worker 0: 1, 3; worker 1: 2, 4), the trainer checkpoints at
    step 4 and forks there. Worker 0's state says next_step 5, worker 1's next_step 6: neither has read a step > 4,
    so both positions are right on the fork."""
    stream = make(tmp_path, steps=6)
    stream.checkpoint("c4", step=4)
    stream.fork("c4", branch="retry")
    states = [{"next_step": 5, "worker_id": 0, "num_workers": 2}, {"next_step": 6, "worker_id": 1, "num_workers": 2}]
    uuid = str(stream.table.metadata.table_uuid)
    for state in states:
        LakestreamDataset(stream, rank=0, world_size=1, branch="retry").load_state_dict(
            {**state, "stream": uuid, "branch": "main"})  # worker 1 was refused (next_step 6 > S + 1)


# 3. GC dry run and real run disagree on a null-step row merged into a manifest whose steps are all retained ---------
def test_gc_dry_run_and_real_run_agree_on_a_null_step_row_in_a_retained_manifest(tmp_path: Path) -> None:
    stream = make(tmp_path, steps=3, properties={"lakestream.manifest.merge-fanout": "3"})  # L0 m1..m3 -> L1 (1-3)
    table = stream.table.catalog.load_table("ns.s")
    props = lakestream_keys(table.metadata.snapshot_by_name("main"))
    rows = shard("x", 0, 0, rows=1)
    table.append(rows.append_column("_step", pa.array([None], pa.int64())).append_column("_rank", pa.array([0], pa.int32())),
                 snapshot_properties=props)
    stream.refresh()
    producer = stream.producer("p")
    for seq in range(3, 6):  # steps 4..6: the foreign manifest merges with steps 4 and 5 (lower bound 4)
        producer.commit(batch("p", seq, WORLD), seq=seq)
    stream.checkpoint("c4", step=4)
    plan = stream.collect_garbage(dry_run=True, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    report = stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert plan.collected_below == report.collected_below == {"main": 4}
    assert plan.files_deleted.get("data") == report.files_deleted.get("data"), (plan.files_deleted, report.files_deleted)


# 4. the Ray sink's replay check: float16 columns (Parquet and the stream accept them) ------------------------------
@pytest.mark.parametrize("kind", [pa.float16(), pa.list_(pa.float16())])
def test_a_replay_of_float16_with_nan_is_the_same_rows(kind: pa.DataType) -> None:
    pytest.importorskip("ray.data")
    from lakestream_iceberg.integrations.ray.replay import same_rows

    value = np.float16(math.nan)
    data = [value, np.float16(1)] if not pa.types.is_list(kind) else [[value], [np.float16(1)]]
    stored = pa.table({"x": pa.array(data, kind)})
    assert same_rows(stored, pa.table({"x": pa.array(data, kind)}))  # ArrowNotImplementedError: no half-float kernels


def test_a_float16_stream_roundtrips_so_the_replay_check_sees_float16(tmp_path: Path) -> None:
    pytest.importorskip("ray.data")
    from lakestream_iceberg.integrations.ray.replay import same_rows

    schema = pa.schema([("x", pa.float16())])
    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.h", schema=schema, world_size=1)
    shard16 = pa.table({"x": pa.array([np.float16(math.nan), np.float16(2)], pa.float16())})
    stream.producer("p").commit([shard16], seq=0)
    assert same_rows(stream.read(1, rank=0), shard16)


# 1b. the fork check walks parent links from the fork's head: after retain-last commits on the fork they are broken ---
def test_a_state_of_main_loads_on_a_fork_that_has_run_for_more_than_retain_last_steps(tmp_path: Path) -> None:
    stream = make(tmp_path, steps=5)
    stream.checkpoint("c3", step=3)
    ds = LakestreamDataset(stream, rank=0, world_size=1, end_step=3)
    assert [item["step"] for item in ds] == [1, 2, 3]
    at_checkpoint = ds.state_dict()
    stream.fork("c3", branch="retry")
    producer = stream.producer("q", branch="retry")
    for seq in range(12):  # default lakestream.snapshots.retain-last is 8: the anchor's children expire
        producer.commit(batch("q", seq, WORLD), seq=seq)
    resumed = LakestreamDataset(stream, rank=0, world_size=1, branch="retry", end_step=5)
    resumed.load_state_dict(at_checkpoint)  # was refused: the parent chain ended at the oldest retained snapshot
    assert [item["step"] for item in resumed] == [4, 5]


# 6. tuple names: the address a pickled Stream / StreamRef carries is the dotted join, which is lossy -----------------
def test_a_tuple_name_with_a_dotted_part_is_refused(tmp_path: Path) -> None:
    """A stream travels to workers (pickles, StreamRef) as its dotted name: ("ns", "s.x") would reopen as namespace
    ns.s, table x."""
    from lakestream_iceberg.errors import ConfigError

    with pytest.raises(ConfigError, match="namespace.name"):
        Stream.create(sqlite_catalog(str(tmp_path)), ("ns", "s.x"), schema=SCHEMA, world_size=WORLD)


def test_a_tuple_name_with_an_empty_dotted_segment_is_a_config_error(tmp_path: Path) -> None:
    from lakestream_iceberg.errors import ConfigError

    with pytest.raises(ConfigError):  # was pyiceberg's bare ValueError
        Stream.create(sqlite_catalog(str(tmp_path)), ("ns.", "s"), schema=SCHEMA, world_size=WORLD)


# 4b. latent: pc.all() of an empty array is null, so an all-empty list column reached through the cast branch differs
def test_an_all_empty_list_column_that_needed_a_cast_is_the_same_rows() -> None:
    pytest.importorskip("ray.data")
    from lakestream_iceberg.integrations.ray.replay import same_rows

    stored = pa.table({"e": pa.array([[], None], pa.list_(pa.float32()))})
    shard64 = pa.table({"e": pa.array([[], None], pa.list_(pa.float64()))})
    assert same_rows(stored, shard64)  # pc.all() of an empty array is null, not True


def test_from_checkpoint_of_a_dropped_branch_says_to_fork_from_it(tmp_path: Path) -> None:
    """A checkpoint taken on a fork whose branch was dropped since: from_checkpoint said "cannot read branch 'exp' ...
    it has no branch 'exp'" (a ConfigError about a branch the caller never named), though its docstring promises a
    CheckpointError that says to fork from the checkpoint, which resumes it."""
    from lakestream_iceberg.errors import CheckpointError

    stream = make(tmp_path, steps=3)
    stream.checkpoint("c1", step=2)
    stream.fork("c1", branch="exp")
    producer = stream.producer("e", branch="exp")
    for seq in range(2):
        producer.commit(batch("e", seq, WORLD), seq=seq)
    stream.checkpoint("c2", step=3, branch="exp")
    stream.table.catalog.load_table("ns.s").manage_snapshots().remove_branch("exp").commit()
    stream.refresh()
    with pytest.raises(CheckpointError, match=r"'c2'.*branch 'exp'.*stream.fork\('c2'"):
        LakestreamDataset.from_checkpoint(stream, "c2", rank=0, world_size=1, follow=False)
    stream.fork("c2", branch="again")  # as the message says
    stream.producer("e", branch="again").commit(batch("e", 0, WORLD), seq=0)
    resumed = LakestreamDataset.from_checkpoint(stream, "c2", rank=0, world_size=1, follow=False, branch="again")
    assert [item["step"] for item in resumed] == [4]
