"""Arguments and handles are input too: flags that are not bools, numbers that are not numbers, a stream name with an
empty part, a dataset state of another stream, and a handle whose table was dropped and created again all end in an
error from the project's hierarchy before anything is read, shipped or published (the dataset, the Ray sink and the
CLI)."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pyarrow as pa
import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import BatchError, ConfigError, SequenceError, StepCollectedError, StepError, StreamError
from lakestream_iceberg.format.checks import check_int
from tests.support import SCHEMA, batch, lakestream_keys, raised_by_loader, sqlite_catalog

try:
    import torch

    from lakestream_iceberg.read.dataset import LakestreamDataset
except ImportError:  # the core installs without the torch extra: its checks are tested, the dataset's skip
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (pip install 'lakestream-iceberg[torch]')")

WORLD = 2


def make(root: Path, name: str = "ns.s", steps: int = 4) -> Stream:
    root.mkdir(parents=True, exist_ok=True)
    stream = Stream.create(sqlite_catalog(str(root)), name, schema=SCHEMA, world_size=WORLD)
    producer = stream.producer("p")
    for seq in range(steps):
        producer.commit(batch("p", seq, WORLD), seq=seq)
    return stream


# ------------------------------------------------------------------------------------------------ integers and bools
@needs_torch
def test_a_torch_or_numpy_bool_is_not_an_integer(tmp_path: Path) -> None:
    import numpy as np

    for flag in (torch.tensor(True), np.bool_(True), True):
        with pytest.raises(ConfigError, match="bool"):
            check_int(flag, what="seq")
    assert check_int(torch.tensor(3), what="seq") == 3 and check_int(np.int64(3), what="seq") == 3
    stream = make(tmp_path, steps=1)
    with pytest.raises(SequenceError, match="bool"):
        stream.producer("p").commit(batch("p", 1, WORLD), seq=torch.tensor(True))  # was published as seq 1
    assert stream.head_step() == 1


# ------------------------------------------------------------------------------------------------------- the dataset
@needs_torch
def test_ship_credentials_must_be_a_bool_and_false_ships_no_secret(tmp_path: Path) -> None:
    stream = make(tmp_path)
    stream.table.catalog.properties["s3.secret-access-key"] = "hunter22-secret"
    with pytest.raises(ConfigError, match="ship_credentials"):
        LakestreamDataset(stream, rank=0, world_size=1, ship_credentials="false")  # bool("false") shipped the secret
    assert b"hunter22-secret" not in pickle.dumps(LakestreamDataset(stream, rank=0, world_size=1))


@needs_torch
@pytest.mark.parametrize("kwargs", [{"follow": "false"}, {"timeout": "30"}, {"timeout": -1}, {"timeout": math.nan},
                                    {"timeout": True}, {"poll_s": -1}, {"poll_s": 0}, {"max_poll_s": 0.001},
                                    {"timeout": 10**400}, {"poll_s": 10**400}])  # OverflowError, not ConfigError
def test_dataset_flags_and_seconds_are_checked_when_it_is_made(tmp_path: Path, kwargs: dict) -> None:
    stream = make(tmp_path, steps=1)
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        LakestreamDataset(stream, rank=0, world_size=1, follow=kwargs.pop("follow", True), **kwargs)


@pytest.mark.parametrize("kwargs", [{"timeout": None}, {"timeout": "30"}, {"timeout": math.nan}, {"timeout": True},
                                    {"timeout": -1}, {"timeout": 1, "poll_s": 0}, {"timeout": 10**400}])
def test_wait_for_seconds_are_checked(tmp_path: Path, kwargs: dict) -> None:
    """None and text raised TypeError, NaN waited forever, poll_s=0 polled the catalog in a busy loop."""
    stream = make(tmp_path, steps=1)
    with pytest.raises(ConfigError, match=list(kwargs)[-1]):
        stream.wait_for(5, **kwargs)


@needs_torch
def test_a_dataset_on_a_branch_the_stream_does_not_have_is_refused(tmp_path: Path) -> None:
    stream = make(tmp_path)
    stream.checkpoint("ck", step=2)
    with pytest.raises(ConfigError, match="no branch 'mian'"):
        LakestreamDataset(stream, rank=0, world_size=1, branch="mian")  # iterated to nothing, or waited
    with pytest.raises(ConfigError, match="'ck' is a tag"):
        LakestreamDataset(stream, rank=0, world_size=1, branch="ck")
    stream.fork("ck", branch="exp")
    fork = LakestreamDataset(stream, rank=0, world_size=1, branch="exp", start_step=2)
    assert [it["step"] for it in fork] == [2]


@needs_torch
def test_a_state_of_another_stream_or_branch_or_worker_is_refused(tmp_path: Path) -> None:
    a, b = make(tmp_path / "a", "ns.a", steps=6), make(tmp_path / "b", "ns.b", steps=6)
    da = LakestreamDataset(a, rank=0, world_size=1)
    for n, _ in enumerate(da):
        if n == 3:
            break
    state = da.state_dict()
    assert state["next_step"] == 5 and state["branch"] == "main"
    with pytest.raises(ConfigError, match="another stream|this dataset reads"):
        LakestreamDataset(b, rank=0, world_size=1).load_state_dict(state)  # b would have skipped its steps 1..4
    a.checkpoint("c", step=2)
    a.fork("c", branch="exp")
    with pytest.raises(ConfigError, match="branch 'main'"):
        LakestreamDataset(a, rank=0, world_size=1, branch="exp").load_state_dict(state)
    with pytest.raises(ConfigError, match="not a worker"):
        LakestreamDataset(a, rank=0, world_size=1).load_state_dict({**state, "worker_id": 3, "num_workers": 2})
    with pytest.raises(ConfigError, match="bool"):
        LakestreamDataset(a, rank=0, world_size=1).load_state_dict({**state, "next_step": torch.tensor(True)})
    older = {k: state[k] for k in ("next_step", "worker_id", "num_workers")}  # an earlier release's state
    resumed = LakestreamDataset(a, rank=0, world_size=1)
    resumed.load_state_dict(older)
    assert [it["step"] for it in resumed] == [5, 6]


# ------------------------------------------------------------------------------------------------ names and handles
@pytest.mark.parametrize("name", ["a..b", "plain", ".x", "x.", " .y", 3])
def test_a_stream_name_with_an_empty_part_is_a_config_error(tmp_path: Path, name: object) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    with pytest.raises(ConfigError, match="namespace.name"):
        Stream.create(catalog, name, schema=SCHEMA, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="namespace.name"):
        Stream.open(catalog, name)  # type: ignore[arg-type]


def test_a_handle_on_a_table_dropped_and_created_again_publishes_and_reads_nothing(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    old = Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2)
    old.producer("p").commit(batch("p", 0, 2))
    catalog.purge_table("ns.s")
    Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=4)
    with pytest.raises(StreamError, match="dropped and created again"):
        old.producer("q").commit(batch("q", 0, 2))  # 2 shards: right for the old stream, wrong for the new one
    with pytest.raises(StreamError, match="Open the stream again"):
        old.head_step()
    fresh = Stream.open(sqlite_catalog(str(tmp_path)), "ns.s")
    assert fresh.head_step() == 0 and fresh.world_size == 4


# ------------------------------------------------------------------------------------------------------- the Ray sink
def _sink_args(tmp_path: Path) -> dict:
    return {"catalog": sqlite_catalog(str(tmp_path)), "stream": "ns.s", "run_name": "r", "rows_per_step": 4,
            "world_size": 1}


@pytest.mark.parametrize("flag", ["drop_last", "cast", "create"])
def test_sink_flags_must_be_bools(tmp_path: Path, flag: str) -> None:
    pytest.importorskip("ray.data")
    from lakestream_iceberg.integrations.ray import LakestreamDatasink

    with pytest.raises(ConfigError, match=flag):  # bool("false") is True: drop_last="false" dropped rows
        LakestreamDatasink(**_sink_args(tmp_path), **{flag: "false"})


def test_sink_checks_the_branch_on_the_driver(tmp_path: Path) -> None:
    pytest.importorskip("ray.data")
    from lakestream_iceberg.integrations.ray import LakestreamDatasink

    schema = pa.schema([("id", pa.int64())])
    Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=schema, world_size=1)
    sink = LakestreamDatasink(**{**_sink_args(tmp_path), "world_size": None}, branch="mian")
    with pytest.raises(ConfigError, match="no branch 'mian'"):
        sink.on_write_start(schema)  # every write task failed on its own


def _task(task_idx: int) -> object:
    from ray.data._internal.execution.interfaces import TaskContext

    return TaskContext(task_idx=task_idx, op_name="Write")


FLOATS = pa.schema([("id", pa.int64()), ("x", pa.float32())])


def test_a_retried_write_task_whose_step_holds_nan_replays_as_duplicates(tmp_path: Path) -> None:
    """Ray retries a task with the same task_idx and blocks; Arrow's equals() is IEEE (NaN != NaN), which made every
    retry of a step with a NaN feature look like a non-deterministic job and fail it."""
    pytest.importorskip("ray.data")
    from lakestream_iceberg.integrations.ray import LakestreamDatasink

    sink = LakestreamDatasink(catalog=sqlite_catalog(str(tmp_path)), stream="ns.s", run_name="job", rows_per_step=4,
                              create=True, world_size=2)
    sink.on_write_start(FLOATS)
    block = pa.table({"id": [0, 1, 2, 3], "x": pa.array([0.5, math.nan, 1.5, 2.5], pa.float32())}, schema=FLOATS)
    assert sink.write(iter([block]), _task(0)).published == 1
    again = sink.write(iter([block]), _task(0))
    assert (again.published, again.duplicates) == (0, 1)
    other = pa.table({"id": [0, 1, 2, 3], "x": pa.array([0.5, math.nan, 1.5, 9.5], pa.float32())}, schema=FLOATS)
    with pytest.raises(BatchError, match="not deterministic"):  # a real difference is still caught
        sink.write(iter([other]), _task(0))


def test_a_retried_step_fn_yielding_record_batches_replays_as_duplicates(tmp_path: Path) -> None:
    pytest.importorskip("ray.data")
    from lakestream_iceberg.integrations.ray import LakestreamDatasink

    Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=FLOATS, world_size=2)

    def halves(table: pa.Table):  # type: ignore[no-untyped-def]
        rows = table.to_batches()[0]
        yield [rows.slice(0, 1), rows.slice(1)]

    sink = LakestreamDatasink(catalog=sqlite_catalog(str(tmp_path)), stream="ns.s", run_name="f", step_fn=halves)
    block = pa.table({"id": [1, 2, 3], "x": pa.array([0.5, 1.0, 1.5], pa.float32())}, schema=FLOATS)
    assert sink.write(iter([block]), _task(0)).published == 1
    assert sink.write(iter([block]), _task(0)).duplicates == 1  # was a raw TypeError (ChunkedArray vs Array)


def test_a_worker_reopens_its_cached_stream_when_the_table_was_created_again(tmp_path: Path) -> None:
    pytest.importorskip("ray.data")
    from lakestream_iceberg.integrations.ray import LakestreamDatasink

    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.s", schema=FLOATS, world_size=2)
    rows = pa.table({"id": [0, 1, 2, 3], "x": pa.array([0.0, 1.0, 2.0, 3.0], pa.float32())}, schema=FLOATS)
    LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="a", rows_per_step=4).write(iter([rows]), _task(0))
    catalog.purge_table("ns.s")
    Stream.create(catalog, "ns.s", schema=FLOATS, world_size=4)
    again = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="b", rows_per_step=4)
    again.on_write_start(FLOATS)
    assert again.write(iter([rows]), _task(0)).published == 1  # this process's cached handle was the old table's
    fresh = Stream.open(sqlite_catalog(str(tmp_path)), "ns.s")
    with fresh.step_files(1) as files:
        assert files.counts == [1, 1, 1, 1]


# ---------------------------------------------------------------------------------- history and table properties
@pytest.mark.parametrize("steps", [5, (1, 2, 3), (1,), (0, 2), (3, 1), (True, 2)])
def test_history_refuses_a_samples_range_that_is_not_one(tmp_path: Path, steps: object) -> None:
    pytest.importorskip("duckdb")
    stream = make(tmp_path, steps=2)
    with pytest.raises(ConfigError, match="samples_steps"):  # raw TypeError / ValueError before
        stream.history(samples_steps=steps)  # type: ignore[arg-type]
    assert stream.history(samples_steps=(1, 2)).sql("SELECT count(DISTINCT _step) FROM samples").fetchall() == [(2,)]


@pytest.mark.parametrize("branch", [True, 5, None])
def test_a_branch_that_is_no_name_is_refused_by_reads(tmp_path: Path, branch: object) -> None:
    """head_step read a branch True or 5 as one with no step (0) and None as main; read said the step was not
    published yet, and wait_for waited out its timeout."""
    stream = make(tmp_path, steps=2)
    for call in (lambda: stream.head_step(branch=branch), lambda: stream.read(1, rank=0, branch=branch),
                 lambda: stream.wait_for(1, timeout=5, branch=branch)):
        with pytest.raises(ConfigError, match="branch must be a branch name"):
            call()


def test_history_of_a_branch_the_stream_does_not_have_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("duckdb")
    stream = make(tmp_path, steps=2)
    with pytest.raises(ConfigError, match="no branch 'mian'"):
        stream.history(branch="mian")  # empty views, as if the branch existed and had no steps


@pytest.mark.parametrize("value", ["not base64!!", "aGVsbG8="])  # not base64; base64 of b"hello", not an Arrow schema
def test_a_damaged_arrow_schema_property_is_a_corrupt_state_error(tmp_path: Path, value: str) -> None:
    from lakestream_iceberg.errors import CorruptStateError

    stream = make(tmp_path, steps=1)
    with stream.table.transaction() as tx:
        tx.set_properties({"lakestream.arrow-schema": value})
    with pytest.raises(CorruptStateError, match="lakestream.arrow-schema"):  # binascii.Error / ArrowInvalid before
        Stream.open(sqlite_catalog(str(tmp_path)), "ns.s")


def test_the_only_checkpoint_of_a_branch_frees_nothing_when_released(tmp_path: Path) -> None:
    """The checkpoints view says what releasing a checkpoint lets GC collect; a branch without a checkpoint loses
    nothing, so releasing its only one frees nothing (the view said 4 steps)."""
    pytest.importorskip("duckdb")
    from datetime import timedelta

    stream = make(tmp_path, steps=6)
    stream.checkpoint("only", step=3)
    [(steps, size)] = stream.history().sql("SELECT exclusive_steps, exclusive_bytes FROM checkpoints").fetchall()
    stream.release("only")
    report = stream.collect_garbage(dry_run=True, grace=timedelta(0), allow_short_grace=True)
    assert report.collected_below == {} and report.bytes_deleted.get("data", 0) == 0
    assert (steps, size) == (0, 0)


# ------------------------------------------------------------- found reviewing the fixes above (each failed before)
def _recreate(catalog: object, name: str = "ns.s", commits: int = 3) -> Stream:
    catalog.drop_table(name)  # type: ignore[attr-defined]
    again = Stream.create(catalog, name, schema=SCHEMA, world_size=WORLD)  # type: ignore[arg-type]
    for seq in range(commits):
        again.producer("b").commit(batch("b", seq, WORLD))
    return again


@needs_torch
def test_a_follower_of_a_table_created_again_raises_instead_of_waiting(tmp_path: Path) -> None:
    import threading

    from lakestream_iceberg.read.follow import HeadWatcher

    stream = make(tmp_path, steps=1)
    watcher = HeadWatcher(stream, branch="main")
    watcher.check()
    ds = LakestreamDataset(stream, rank=0, world_size=1, follow=True, timeout=60)
    items = iter(ds)
    assert next(items)["step"] == 1
    _recreate(stream.table.catalog)
    with pytest.raises(StreamError, match="dropped and created again"):  # polled it as an outage until the timeout
        watcher.wait(3, timeout=60, stop=threading.Event())
    with pytest.raises(StreamError, match="dropped and created again"):
        next(items)


@needs_torch
def test_dataloader_workers_refuse_a_table_created_again(tmp_path: Path) -> None:
    stream = make(tmp_path, steps=1)
    ds = LakestreamDataset(stream, rank=0, world_size=1, end_step=1)
    _recreate(stream.table.catalog, commits=1)
    with pytest.raises(StreamError):
        list(ds)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with raised_by_loader(Exception, match="dropped and created again"):  # a worker read the new table's rows
        list(loader)


@pytest.mark.parametrize(("step", "rank"), [(None, 0), (0, None), (-2, 0)])
def test_gc_and_history_skip_rows_another_engine_appended_without_a_step(tmp_path: Path, step: object,
                                                                        rank: object) -> None:
    pytest.importorskip("duckdb")
    from datetime import timedelta

    stream = make(tmp_path, steps=1)
    table = stream.table.catalog.load_table("ns.s")
    props = lakestream_keys(table.metadata.snapshot_by_name("main"))
    from tests.support import shard

    rows = shard("x", 0, 0, rows=1)
    table.append(rows.append_column("_step", pa.array([step], pa.int64())).append_column("_rank", pa.array([rank], pa.int32())),
                 snapshot_properties=props)
    stream.refresh()
    producer = stream.producer("p")
    for seq in range(1, 6):
        producer.commit(batch("p", seq, WORLD))
    assert stream.history().sql("SELECT count(*) FROM batches").fetchall() == [(6,)]  # int(None): TypeError before
    stream.checkpoint("c", step=4)
    plan = stream.collect_garbage(dry_run=True, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    report = stream.collect_garbage(dry_run=False, keep_last=1, grace=timedelta(0), allow_short_grace=True)
    assert plan.collected_below == report.collected_below == {"main": 4}
    assert report.files_deleted.get("data", 0) == 3 * WORLD + 1  # steps 1-3, and the row that is no step's
    assert set(stream.read(5, rank=1).column("seq").to_pylist()) <= {4}  # step 5 is seq 4 of p, still readable


@needs_torch
def test_a_slow_poll_alone_is_accepted(tmp_path: Path) -> None:
    stream = make(tmp_path, steps=1)
    ds = LakestreamDataset(stream, rank=0, world_size=1, follow=True, poll_s=1.0)  # max_poll_s defaults to >= poll_s
    assert ds.max_poll_s == 1.0


@needs_torch
def test_a_state_saved_on_main_resumes_on_a_fork_of_its_checkpoint_and_not_past_it(tmp_path: Path) -> None:
    stream = make(tmp_path, steps=5)
    stream.checkpoint("c3", step=3)
    ds = LakestreamDataset(stream, rank=0, world_size=1, end_step=3)
    assert [item["step"] for item in ds] == [1, 2, 3]
    at_checkpoint = ds.state_dict()
    stream.fork("c3", branch="retry")
    stream.producer("q", branch="retry").commit(batch("q", 0, WORLD))
    resumed = LakestreamDataset(stream, rank=0, world_size=1, branch="retry")
    resumed.load_state_dict(at_checkpoint)  # the README's fork flow: steps continue at 4 on the fork
    assert [item["step"] for item in resumed] == [4]
    early = LakestreamDataset(stream, rank=0, world_size=1, end_step=1)
    list(early)
    below = LakestreamDataset(stream, rank=0, world_size=1, branch="retry")
    below.load_state_dict(early.state_dict())  # step 1 is shared, but the fork holds no step below 3 (training guide)
    with pytest.raises(StepCollectedError, match="forked after it"):
        list(below)
    later = LakestreamDataset(stream, rank=0, world_size=1, end_step=5)
    list(later)
    with pytest.raises(ConfigError, match="fork's checkpoint step"):  # main's step 5 is not the fork's step 5
        LakestreamDataset(stream, rank=0, world_size=1, branch="retry").load_state_dict(later.state_dict())


def test_replays_compare_nan_inside_maps_and_large_float_columns_in_arrow() -> None:
    pytest.importorskip("ray.data")
    import numpy as np

    from lakestream_iceberg.integrations.ray.replay import same_rows

    kind = pa.map_(pa.string(), pa.float64())
    one = pa.table({"m": pa.array([[("k", math.nan)]], kind)})
    assert same_rows(one, pa.table({"m": pa.array([[("k", math.nan)]], kind)}))
    assert not same_rows(one, pa.table({"m": pa.array([[("k", 1.0)]], kind)}))
    values = np.random.default_rng(0).random(2_000_000)
    values[0] = np.nan
    def table(v: np.ndarray) -> pa.Table:  # a float column and an embedding column (8 floats per row)
        return pa.table({"x": pa.array(v[:250_000]), "e": pa.FixedSizeListArray.from_arrays(pa.array(v), 8)})

    a, b = table(values), table(values.copy())
    assert same_rows(a, b)  # compared in Arrow (as Python objects, 2M floats took seconds)
    changed = values.copy()
    changed[-1] += 1.0
    assert not same_rows(a, table(changed))


def test_a_stream_may_be_named_by_a_tuple_as_pyiceberg_allows(tmp_path: Path) -> None:
    stream = make(tmp_path, steps=1)
    assert Stream.open(stream.table.catalog, ("ns", "s")).head_step() == 1


# ------------------------------------------------------- Stream.create and open, tried as a careless user (rev-api)
def test_two_names_that_map_to_one_folder_are_refused_before_anything_is_made(tmp_path: Path) -> None:
    """'ns.a/b' and 'ns/a.b' both had the location <warehouse>/ns/a/b: two streams in one folder, whose GCs delete
    each other's files."""
    catalog = sqlite_catalog(str(tmp_path))
    first = Stream.create(catalog, "ns.a_b", schema=SCHEMA, world_size=1)
    for name in ("ns.a/b", "ns/a.b", ("ns", "a\\b"), "ns.a\x00b", "ns.tab\tname", "ns." + "x" * 256, "ns." + "é" * 128):
        with pytest.raises(ConfigError, match="folder of the stream's location"):
            Stream.create(catalog, name, schema=SCHEMA, world_size=1)  # type: ignore[arg-type]
    assert catalog.list_namespaces() == [("ns",)] and catalog.list_tables("ns") == [("ns", "a_b")]
    assert Stream.create(catalog, "ns." + "é" * 127, schema=SCHEMA, world_size=1).head_step() == 0  # 254 bytes
    assert first.head_step() == 0


def test_a_name_part_with_white_space_at_either_end_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    """'ns.s ' made a second, empty stream beside 'ns.s' (in folder 's '), while pyiceberg opens ' ns.s' as 'ns.s':
    a producer and a trainer that differ by one space used two streams."""
    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1)
    for name in ("ns.s ", " ns.s", "ns. s", "ns .s", ("ns", "s\u00a0"), ("ns", "\u3000s")):
        with pytest.raises(ConfigError, match="starts or ends with white space"):
            Stream.create(catalog, name, schema=SCHEMA, world_size=1)
    assert catalog.list_namespaces() == [("ns",)] and catalog.list_tables("ns") == [("ns", "s")]
    assert Stream.create(catalog, "ns.two words", schema=SCHEMA, world_size=1).head_step() == 0  # inside: a folder name


def test_a_producer_seed_that_is_no_integer_is_a_config_error(tmp_path: Path) -> None:
    stream = make(tmp_path, steps=1)
    import numpy as np

    for bad in (True, "x", 1.5, np.float64(2.0)):
        with pytest.raises(ConfigError, match="seed"):
            stream.producer("p", seed=bad)  # type: ignore[arg-type]
    producer = stream.producer("p", seed=np.int64(7))  # type: ignore[arg-type]
    producer.commit(batch("p", 1, WORLD), seq=1)
    assert stream.refresh().head_step() == 2


def test_a_nested_namespace_too_long_for_one_folder_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    """A nested namespace is one folder of the location, its parts joined by '.' (<warehouse>/a.b/name): two parts of
    200 bytes each passed, and creating failed midway (the namespaces made) blaming the catalog's warehouse."""
    catalog = sqlite_catalog(str(tmp_path))
    with pytest.raises(ConfigError, match="namespace .* longer than 255 bytes.*folder of the stream's location"):
        Stream.create(catalog, ("a" * 200, "b" * 200, "s"), schema=SCHEMA, world_size=1)
    assert catalog.list_namespaces() == []
    assert Stream.create(catalog, ("a" * 120, "b" * 120, "s"), schema=SCHEMA, world_size=1).head_step() == 0


@pytest.mark.parametrize("catalog", [None, "default", {"uri": "sqlite://"}])
def test_a_catalog_that_is_no_catalog_is_a_config_error(catalog: object) -> None:
    for call in (lambda: Stream.open(catalog, "ns.s"),  # type: ignore[arg-type]
                 lambda: Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1),  # type: ignore[arg-type]
                 lambda: Stream.drop(catalog, "ns.s")):  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="must be a pyiceberg Catalog.*load_catalog"):  # AttributeError before
            call()


@pytest.mark.parametrize("world_size", [2**31, 2**70])
def test_a_world_size_past_an_iceberg_int_is_refused(tmp_path: Path, world_size: int) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    with pytest.raises(ConfigError, match="world_size must be in 1..2147483647"):  # was created, and never usable
        Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=world_size)
    with pytest.raises(ConfigError, match="lakestream.world-size"):
        Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1, properties={"lakestream.world-size": str(world_size)})
    assert catalog.list_namespaces() == []


def test_properties_cannot_override_the_world_size_or_schema_arguments(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    with pytest.raises(ConfigError, match="world_size=1"):  # the property won: a stream of world size 3
        Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1, properties={"lakestream.world-size": "3"})
    other = pa.schema([("x", pa.int64())])
    from lakestream_iceberg.format.table import encode_schema

    with pytest.raises(ConfigError, match="lakestream.arrow-schema"):
        Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1,
                      properties={"lakestream.arrow-schema": encode_schema(other)})
    assert catalog.list_namespaces() == []
    same = {"lakestream.world-size": "2", "lakestream.arrow-schema": encode_schema(SCHEMA)}
    assert Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2, properties=same).world_size == 2


@pytest.mark.parametrize("location", [5, "", "  ", "relative/dir", "afile", "s3x://bucket/x"])
def test_a_location_that_is_no_folder_is_a_config_error(tmp_path: Path, location: object,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An int raised AttributeError, a file NotADirectoryError, an unknown scheme ValueError, and a relative path was
    taken: each process resolved it from its own working directory."""
    monkeypatch.chdir(tmp_path)  # where a relative location lands
    (tmp_path / "afile").write_text("x")
    if location == "afile":
        location = str(tmp_path / "afile")
    catalog = sqlite_catalog(str(tmp_path))
    with pytest.raises(ConfigError, match="location"):
        Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1, location=location)  # type: ignore[arg-type]
    assert catalog.list_tables("ns") == [] if catalog.list_namespaces() else True
    assert Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1,
                         location=str(tmp_path / "elsewhere")).table.metadata.location == str(tmp_path / "elsewhere")


def test_a_hadoop_style_file_uri_location_is_taken(tmp_path: Path) -> None:
    """'file:/abs/path' (one slash: how Spark and Hadoop write a local table's location) is a URI pyiceberg reads,
    yet the location check refused it as a relative path."""
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1, location=f"file:{tmp_path}/hadoop")
    assert stream.table.metadata.location == f"file:{tmp_path}/hadoop" and (tmp_path / "hadoop" / "metadata").is_dir()
    with pytest.raises(ConfigError, match="relative path"):
        Stream.create(catalog, "ns.t", schema=SCHEMA, world_size=1, location="file:relative/dir")


def test_a_misspelt_branch_is_refused_by_reads_instead_of_read_as_empty(tmp_path: Path) -> None:
    """head_step said 0, read said the step was not published yet (use wait_for), and wait_for waited out its
    timeout: a branch that does not exist is an error, as for datasets and producers."""
    stream = make(tmp_path, steps=2)
    stream.checkpoint("ck", step=1)
    for call in (lambda: stream.head_step(branch="mian"), lambda: stream.read(1, rank=0, branch="mian"),
                 lambda: stream.step_files(1, branch="mian"), lambda: stream.wait_for(1, timeout=600, branch="mian")):
        with pytest.raises(ConfigError, match="no branch 'mian'"):
            call()
    other = Stream.open(stream.table.catalog, "ns.s")  # a branch forked by another process since this view was read
    stream.fork("ck", branch="exp")
    assert other.head_step(branch="exp") == 1 and other.wait_for(1, timeout=5, branch="exp") == 1
    assert stream.head_step(branch="ck") == 1  # a checkpoint reads as what it pins, as before


@needs_torch
@pytest.mark.parametrize("name", ["transform", "collate"])
def test_a_transform_or_collate_that_is_no_function_is_refused_when_the_dataset_is_made(tmp_path: Path, name: str) -> None:
    stream = make(tmp_path, steps=1)
    with pytest.raises(ConfigError, match=f"{name} must be a function"):  # a TypeError at the first item before
        LakestreamDataset(stream, rank=0, world_size=1, **{name: "identity"})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"properties": {"lakestream.snapshots.retain-last": 64}}, "dict of strings"),
    ({"properties": {"lakestream.snapshot.retain-last": "64"}}, "not a lakestream property"),
    ({"stream": "ns.a/b"}, "path separator"),
    ({"world_size": 2**40}, "world_size must be in"),
])
def test_sink_refuses_on_the_driver_what_its_first_write_task_would_create_the_stream_with(
        tmp_path: Path, kwargs: dict, match: str) -> None:
    """With create=True and no schema= the first write task creates the stream: a property or a name Stream.create
    refuses failed every write task, each on its own, after the job started."""
    pytest.importorskip("ray.data")
    from lakestream_iceberg.integrations.ray import LakestreamDatasink

    with pytest.raises(ConfigError, match=match):
        LakestreamDatasink(**{**_sink_args(tmp_path), "create": True, **kwargs})


def test_create_of_an_existing_stream_refuses_properties_it_would_not_apply(tmp_path: Path) -> None:
    """Stream.create of an existing stream returned it as it was: properties={"lakestream.snapshots.retain-last": "64"}
    was ignored without a word (and a misspelt lakestream key was not even checked)."""
    from lakestream_iceberg.errors import StreamExistsError

    catalog = sqlite_catalog(str(tmp_path))
    props = {"lakestream.snapshots.retain-last": "16", "lakestream.commit.group.staging": "auto", "owner": "me",
             "format-version": "2"}
    Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2, properties=props)
    again = Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2, properties=props)  # the same: opened
    assert again.config.retain_snapshots == 16
    assert Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2).world_size == 2
    assert Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2,  # the default, given: the same value
                         properties={"lakestream.commit.max-attempts": str(again.config.commit_max_attempts)})
    for other, match in (({"lakestream.snapshots.retain-last": "64"}, "retain-last='16' \\(not '64'\\)"),
                         ({"owner": "you"}, "owner='me'"), ({"lakestream.commit.timeout-ms": "1000"}, "timeout-ms")):
        with pytest.raises(StreamExistsError, match=match + ".*set_properties"):
            Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2, properties=other)
    with pytest.raises(ConfigError, match="not a lakestream property"):
        Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2, properties={"lakestream.snapshot.retain-last": "64"})
    assert Stream.open(catalog, "ns.s").table.metadata.properties["lakestream.snapshots.retain-last"] == "16"


def test_a_poll_interval_past_what_threading_can_wait_pauses_until_stopped(tmp_path: Path) -> None:
    """poll_s=1e300 passed the seconds check and raised OverflowError in the pause (in the head relay's poll thread,
    which died with a traceback)."""
    import threading

    from lakestream_iceberg.read.follow import HeadWatcher

    stream = make(tmp_path, steps=1)
    watcher = HeadWatcher(stream, branch="main")
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()  # ends the pause; nothing here depends on when
    try:
        assert watcher.pause(1e300, stop) is None  # stopped, not an OverflowError
    finally:
        watcher.close()


def test_fork_of_a_checkpoint_object_its_name_no_longer_marks_is_refused(tmp_path: Path) -> None:
    """fork(checkpoint) used only the checkpoint's name: another stream's checkpoint "c" (or one released and made
    again at another step) forked this stream's "c", at another step, without a word."""
    from lakestream_iceberg.errors import CheckpointError

    a, b = make(tmp_path / "a", "ns.a", steps=4), make(tmp_path / "b", "ns.b", steps=4)
    theirs = b.checkpoint("c", step=3)
    old = a.checkpoint("c", step=1)
    with pytest.raises(CheckpointError, match="another stream's, or was released"):
        a.fork(theirs, branch="x")
    a.release("c")
    mine = a.checkpoint("c", step=2)
    with pytest.raises(CheckpointError, match="at step 2"):
        a.fork(old, branch="x")
    assert "x" not in a.refresh().table.metadata.refs
    assert a.fork(mine, branch="x").step == 2 and a.fork("c", branch="y").step == 2


@needs_torch
@pytest.mark.parametrize("thing", [None, "ns.s", "table"])
def test_a_stream_that_is_no_stream_is_a_config_error(tmp_path: Path, thing: object) -> None:
    """Stream(...), LakestreamDataset(...) and from_checkpoint(...) of None, a name or the pyiceberg table raised
    AttributeError from inside."""
    stream = make(tmp_path, steps=1)
    stream.checkpoint("c", step=1)
    if thing == "table":
        thing = stream.table
    else:
        with pytest.raises(ConfigError, match="pyiceberg Table.*Stream.open"):
            Stream(thing)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a lakestream Stream"):
        LakestreamDataset(thing, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="must be a lakestream Stream"):
        LakestreamDataset.from_checkpoint(thing, "c", rank=0, world_size=1)
    with pytest.raises(ConfigError, match="ManifestCache"):
        Stream(stream.table, cache="big")  # type: ignore[arg-type]


def test_sink_with_properties_an_existing_stream_does_not_have_is_refused_on_the_driver(tmp_path: Path) -> None:
    """create=True with properties= and no schema= opened an existing stream and ignored the properties without a
    word (Stream.create refuses them where the sink passes schema=)."""
    pytest.importorskip("ray.data")
    from lakestream_iceberg.errors import StreamExistsError
    from lakestream_iceberg.integrations.ray import LakestreamDatasink

    schema = pa.schema([("id", pa.int64())])
    Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=schema, world_size=1,
                  properties={"lakestream.snapshots.retain-last": "16"})
    same = LakestreamDatasink(**_sink_args(tmp_path), create=True, properties={"lakestream.snapshots.retain-last": "16"})
    same.on_write_start(schema)
    other = LakestreamDatasink(**_sink_args(tmp_path), create=True, properties={"lakestream.snapshots.retain-last": "64"})
    with pytest.raises(StreamExistsError, match="retain-last='16' \\(not '64'\\)"):
        other.on_write_start(schema)


@pytest.mark.parametrize("warehouse", ["file-path", "bogus://x/y"])
def test_a_warehouse_that_is_no_folder_is_a_config_error_naming_the_setting(tmp_path: Path, warehouse: str) -> None:
    """A catalog whose warehouse is a file, or of a scheme no FileIO reads, raised NotADirectoryError or ValueError."""
    from pyiceberg.catalog.sql import SqlCatalog

    (tmp_path / "afile").write_text("x")
    warehouse = str(tmp_path / "afile") if warehouse == "file-path" else warehouse
    catalog = SqlCatalog("wh", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=warehouse)
    with pytest.raises(ConfigError, match="warehouse.*PYICEBERG_CATALOG__WH__WAREHOUSE"):
        Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1)
    assert catalog.list_namespaces() == []  # nothing made: the namespace made for it is dropped again


@needs_torch
def test_a_step_past_an_iceberg_long_is_refused_instead_of_waited_for(tmp_path: Path) -> None:
    """read(2**63) said the step was not published yet (wait_for it), wait_for(2**70) waited out its timeout and a
    follower started at 2**70 waited for a step that can never be published."""
    stream = make(tmp_path, steps=1)
    for call in (lambda: stream.read(2**63, rank=0), lambda: stream.step_files(2**70),
                 lambda: stream.wait_for(2**70, timeout=600)):
        with pytest.raises(StepError, match="step must be"):
            call()
    with pytest.raises(ConfigError, match="start_step must be"):
        LakestreamDataset(stream, rank=0, world_size=1, start_step=2**63, follow=True, timeout=600)
    assert stream.wait_for(1, timeout=5) == 1


@needs_torch
@pytest.mark.parametrize("world_size", [2**31, 2**40, 2**64])
def test_a_consumer_world_size_past_an_iceberg_int_is_refused(tmp_path: Path, world_size: int) -> None:
    """A stream's world size is bounded by an Iceberg int, a reader's was not: a group's rank past it reported a
    position that `lakestream lag` and the consumers view then dropped as written by "another program", and a world
    size past a long was listed as NULL."""
    stream = make(tmp_path, steps=1)
    with pytest.raises(ConfigError, match="world_size"):
        LakestreamDataset(stream, rank=3, world_size=world_size, group="run")
    assert [item["step"] for item in LakestreamDataset(stream, rank=3, world_size=2**31 - 1)] == [1]


def test_a_location_that_holds_files_or_lies_in_a_table_is_refused(tmp_path: Path) -> None:
    """GC deletes every file under a stream's location that the stream does not reference: a stream made at the
    warehouse's root (or a namespace's folder) deleted every other stream's data and metadata at its first GC, and one
    inside another stream's folder had its files deleted by that stream's GC."""
    stream = make(tmp_path, steps=2)
    home = stream.table.metadata.location
    for location in (f"file://{tmp_path}/warehouse", f"file://{tmp_path}/warehouse/ns", home + "/data",
                     home + "/sub/folder"):
        with pytest.raises(ConfigError, match="GC"):
            Stream.create(stream.table.catalog, "other.b", schema=SCHEMA, world_size=WORLD, location=location)
        assert not stream.table.catalog.table_exists("other.b")
    own = Stream.create(stream.table.catalog, "other.b", schema=SCHEMA, world_size=WORLD,
                        location=f"file://{tmp_path}/elsewhere/b")  # a folder of its own
    assert own.table.metadata.location.endswith("/elsewhere/b") and stream.read(2, rank=0).num_rows >= 0



def test_a_default_location_inside_a_stream_or_holding_one_is_refused(tmp_path: Path) -> None:
    """Only a location= given was checked: a stream given a namespace's folder while it was empty, then a stream created
    in that namespace without location= (the catalog's default place, inside the first), or a stream given a folder
    inside a table's default place before that table existed: one lay inside the other, and the outer one's GC
    deleted the inner one's files. The default location is checked as a given one now."""
    catalog = sqlite_catalog(str(tmp_path))
    warehouse = f"file://{tmp_path}/warehouse"
    outer = Stream.create(catalog, "ns.outer", schema=SCHEMA, world_size=WORLD, location=f"{warehouse}/ns")
    with pytest.raises(ConfigError, match="default location.*inside the folder of another table.*pass location="):
        Stream.create(catalog, "ns.inner", schema=SCHEMA, world_size=WORLD)
    assert not catalog.table_exists("ns.inner")
    inner = Stream.create(catalog, "other.inner", schema=SCHEMA, world_size=WORLD, location=f"{warehouse}/ns2/s/in")
    with pytest.raises(ConfigError, match="default location.*holds in"):
        Stream.create(catalog, "ns2.s", schema=SCHEMA, world_size=WORLD)
    assert not catalog.table_exists("ns2.s") and not catalog.namespace_exists("ns2")
    fine = Stream.create(catalog, "ns3.s", schema=SCHEMA, world_size=WORLD)  # a default place of its own
    assert fine.table.metadata.location == f"{warehouse}/ns3/s"
    assert Stream.create(catalog, "ns.outer", schema=SCHEMA, world_size=WORLD).name == outer.name  # opened, not made
    assert inner.head_step() == 0

@needs_torch
def test_a_state_next_step_past_a_long_is_refused_not_wrapped(tmp_path: Path) -> None:
    """A state_dict read back from a checkpoint file is input: a next_step past an Iceberg long (no step is ever
    published there; start_step= refuses it) was taken, and under DataLoader workers it went through the shared block's
    64-bit slots, which wrap silently: 2**64 + 2 resumed at step 2, replaying steps the model had seen."""
    from torch.utils.data import DataLoader

    stream = make(tmp_path, steps=4)
    for bad in ({"next_step": 2**64 + 2}, {"next_step": 2**63}, {"next_step": 1, "worker_id": 0, "num_workers": 2**64 + 1}):
        ds = LakestreamDataset(stream, rank=0, world_size=1, follow=False)
        with pytest.raises(ConfigError, match="state_dict"):
            ds.load_state_dict(bad)
            list(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork"))
