"""Ray Data producers (``LakestreamDatasink``) and Ray Train consumers, on a real local Ray cluster.

Ray runs locally (``ray.init`` in a module fixture, no dashboard, shut down at the end), the catalog is SQLite with a
local warehouse, every process is real. Nothing waits for a fixed time window: each test waits for progress it can
observe (a step published, a marker file written by a task), with generous bounds only as a safety net.

Logical CPUs: ``ray.init(num_cpus=4)`` on 2 physical cores. Logical CPUs are scheduling tokens, not cores: a test
with a reader beside the job caps the data job at 2 (``execution_options.resource_limits``). The work itself is small;
the cores are shared either way. The Ray Train job (trainers following a job that is still writing, resuming from a
stream checkpoint tag, restarted after a failure) runs on the multi-node cluster of ``test_ray_cluster.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.exceptions import NoSuchTableError

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from lakestream_iceberg import Stream  # noqa: E402
from lakestream_iceberg.errors import BatchError, ConfigError, SchemaMismatchError, StreamExistsError  # noqa: E402
from lakestream_iceberg.integrations.ray import LakestreamDatasink, producer_id  # noqa: E402
from tests.support import sqlite_catalog  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float32())])
BOUND_S = 240  # safety net only: every wait below ends on observed progress


def _rows(start: int, n: int) -> pa.Table:
    ids = list(range(start, start + n))
    return pa.table({"id": ids, "x": [float(i) / 2 for i in ids]}, schema=SCHEMA)


def _wait(what: str, condition: Any, bound_s: float = BOUND_S) -> Any:
    deadline = time.monotonic() + bound_s
    delay = 0.02
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {bound_s}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _task_context(task_idx: int) -> Any:
    from ray.data._internal.execution.interfaces import TaskContext

    return TaskContext(task_idx=task_idx, op_name="Write")


def _step_ids(stream: Stream, step: int) -> list[list[int]]:
    return [stream.read(step, rank=r).column("id").to_pylist() for r in range(stream.world_size)]


# ------------------------------------------------------------------------------------------------ without a cluster


def test_core_imports_without_ray_and_the_integration_names_the_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['ray'] = None\n"  # as if the extra were not installed
        "import lakestream_iceberg, lakestream_iceberg.stream, lakestream_iceberg.read.dataset\n"
        "from lakestream_iceberg.errors import MissingExtraError\n"
        "try:\n    import lakestream_iceberg.integrations.ray\nexcept MissingExtraError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "lakestream-iceberg[ray]" in out.stdout


def test_sink_arguments_are_checked(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    ok = {"catalog": catalog, "stream": "ns.s", "run_name": "prep"}
    with pytest.raises(ConfigError, match="exactly one of rows_per_step"):
        LakestreamDatasink(**ok)
    with pytest.raises(ConfigError, match="rows_per_step must be an integer, got the bool"):
        LakestreamDatasink(**ok, rows_per_step=True)
    with pytest.raises(ConfigError, match="rows_per_step must be >= 1"):
        LakestreamDatasink(**ok, rows_per_step=0)
    with pytest.raises(ConfigError, match="run_name 'bad name' is invalid"):
        LakestreamDatasink(**{**ok, "run_name": "bad name"}, rows_per_step=4)
    with pytest.raises(ConfigError, match="create=True needs world_size"):
        LakestreamDatasink(**ok, rows_per_step=4, create=True)
    with pytest.raises(ConfigError, match="holds secrets"):
        LakestreamDatasink(catalog="prod", stream="ns.s", run_name="p", rows_per_step=4,
                           catalog_properties={"s3.secret-access-key": "hunter22"})
    assert producer_id("prep", 7) == "prep-7"


def test_bad_sink_arguments_are_config_errors_that_name_the_argument(tmp_path: Path) -> None:
    """Each bad argument is a ConfigError naming it: ``create="false"`` was blamed on a missing world_size,
    ``catalog_properties=5`` raised an AttributeError, ``rank_column=""`` failed every write task with a block
    "missing ['']", and ``properties=`` without ``create=True`` were dropped without a word (an unknown key too)."""
    catalog = sqlite_catalog(str(tmp_path))
    ok = {"catalog": catalog, "stream": "ns.s", "run_name": "prep", "rows_per_step": 4}
    for bad, says in (({"create": "false"}, "create must be True or False, got 'false'"),
                      ({"world_size": True, "create": True}, "world_size must be an integer, got the bool"),
                      ({"world_size": -2}, "world_size must be in 1"),
                      ({"rows_per_step": -1}, "rows_per_step must be >= 1"),
                      ({"rank_column": ""}, "rank_column must be a column name, got ''"),
                      ({"catalog": "prod", "catalog_properties": 5}, "catalog_properties must be a dict"),
                      ({"properties": {"lakestream.nope": "1"}}, "lakestream.nope is not a lakestream property")):
        with pytest.raises(ConfigError, match=says):
            LakestreamDatasink(**{**ok, **bad})
    Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=1)
    with pytest.raises(StreamExistsError, match="lakestream.layout='per-rank', not 'packed'"):  # not applied, checked
        LakestreamDatasink(**ok, properties={"lakestream.layout": "packed"}).on_write_start(None)
    LakestreamDatasink(**ok, properties={"lakestream.layout": "per-rank"}).on_write_start(None)


def test_pickled_sink_carries_no_secret(tmp_path: Path) -> None:
    import pickle

    catalog = sqlite_catalog(str(tmp_path))
    catalog.properties["s3.secret-access-key"] = "hunter22-not-shipped"
    sink = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="prep", rows_per_step=4)
    blob = pickle.dumps(sink)
    assert b"hunter22-not-shipped" not in blob
    shipped = pickle.loads(blob).stream_ref
    assert shipped.identifier == "ns.s"
    # the name of what stayed behind travels, as with a pickled stream: a task lacking it is told which setting, and a
    # task with a key pair of its own uses it whole (not the driver's key id with its own secret)
    assert shipped.withheld == ("s3.secret-access-key",) and shipped.secrets == ()


def test_catalog_by_name_is_resolved_from_pyiceberg_config_in_the_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    (tmp_path / "warehouse").mkdir()
    monkeypatch.setenv("PYICEBERG_CATALOG__LOCALRAY__TYPE", "sql")
    monkeypatch.setenv("PYICEBERG_CATALOG__LOCALRAY__URI", f"sqlite:///{tmp_path}/catalog.db")
    monkeypatch.setenv("PYICEBERG_CATALOG__LOCALRAY__WAREHOUSE", f"file://{tmp_path}/warehouse")
    monkeypatch.setenv("PYICEBERG_CATALOG__LOCALRAY__S3__SECRET_ACCESS_KEY", "hunter22-from-env")
    import pyiceberg.catalog
    from pyiceberg.utils.config import Config

    monkeypatch.setattr(pyiceberg.catalog, "_ENV_CONFIG", Config())  # what a worker process reads when it starts
    sink = LakestreamDatasink(catalog="localray", stream="ns.named", run_name="named", rows_per_step=2, create=True,
                              world_size=1)
    sink.on_write_start(SCHEMA.with_metadata({b"pandas": b"{}"}))  # Ray's schema is not used: nothing is created yet
    with pytest.raises(NoSuchTableError):
        Stream.open(sink.stream_ref.catalog(), "ns.named")
    shipped = pickle.loads(pickle.dumps(sink))  # what a Ray task receives: it creates the stream from its first block
    assert b"hunter22-from-env" not in pickle.dumps(sink)
    assert shipped.write(iter([_rows(0, 4)]), _task_context(0)).steps == (1, 2)
    assert Stream.open(shipped.stream_ref.catalog(), "ns.named").payload_arrow_schema.equals(SCHEMA)


def test_write_task_replays_exactly_once_and_detects_a_nondeterministic_rerun(tmp_path: Path) -> None:
    """``Datasink.write`` called as Ray calls it: a retry (same task_idx, same blocks) publishes nothing twice."""
    catalog = sqlite_catalog(str(tmp_path))
    sink = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="job", rows_per_step=4, create=True, world_size=2)
    sink.on_write_start(SCHEMA)
    blocks = [_rows(0, 6), _rows(6, 5)]  # 11 rows: steps of 4, 4 and a last one of 3
    first = sink.write(iter(blocks), _task_context(3))
    assert (first.producer, first.published, first.duplicates, first.rows, first.steps) == ("job-3", 3, 0, 11, (1, 2, 3))
    stream = Stream.open(catalog, "ns.s")
    assert [_step_ids(stream, s) for s in (1, 2, 3)] == [[[0, 2], [1, 3]], [[4, 6], [5, 7]], [[8, 10], [9]]]
    again = sink.write(iter(blocks), _task_context(3))  # the retried task
    assert (again.published, again.duplicates, again.steps) == (0, 3, (1, 2, 3))
    assert stream.refresh().head_step() == 3
    other = sink.write(iter([_rows(100, 4)]), _task_context(4))  # another task: another producer
    assert (other.producer, other.steps) == ("job-4", (4,))
    with pytest.raises(BatchError, match=r"step 2 with \[2, 2\] rows per rank, but this run formed \[1, 0\]: the job is not det"):
        sink.write(iter([_rows(0, 5)]), _task_context(3))
    shuffled = [_rows(6, 5), _rows(0, 6)]  # the same rows, in another order: equal counts, other rows
    with pytest.raises(BatchError, match="other rows for rank 0 than this run formed"):
        sink.write(iter(shuffled), _task_context(3))
    counts_only = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="job", rows_per_step=4, verify_replays="counts")
    assert counts_only.write(iter(shuffled), _task_context(3)).duplicates == 3  # what "counts" cannot see
    drop = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="drop", rows_per_step=4, drop_last=True)
    assert drop.write(iter(blocks), _task_context(0)).steps == (5, 6)


def _commit_at_once(path: str, barrier: Any, trials: int, out: Any) -> None:
    """One of two processes of one write task (a zombie attempt and its retry): each trial, both write the same rows
    as the same task at the same moment."""
    sink = LakestreamDatasink(catalog=sqlite_catalog(path), stream="ns.z", run_name="z", rows_per_step=4)
    reports = []
    for trial in range(trials):
        barrier.wait(BOUND_S)
        try:
            r = sink.write(iter([_rows(0, 8)]), _task_context(trial))
            reports.append((r.published, r.duplicates, r.raced))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            reports.append(repr(exc))
    out.put(reports)


def test_two_attempts_of_a_task_committing_the_same_step_at_once_do_not_fail_the_job(tmp_path: Path) -> None:
    """A worker that lost its node can outlive its raylet and publish while the retry starts: when both commit the same
    (producer, seq) at the same moment, the loser finds the same rows published under its own id and seq, a replay;
    it failed with ProducerConflictError (the whole job failed) in 20 of 20 trials."""
    import multiprocessing

    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.z", schema=SCHEMA, world_size=2)
    spawn = multiprocessing.get_context("spawn")
    barrier, out, trials = spawn.Barrier(2), spawn.Queue(), 12
    children = [spawn.Process(target=_commit_at_once, args=(str(tmp_path), barrier, trials, out)) for _ in range(2)]
    for child in children:
        child.start()
    got = [out.get(timeout=BOUND_S) for _ in children]
    for child in children:
        child.join(BOUND_S)
    assert all(isinstance(r, tuple) for reports in got for r in reports), got
    for trial in range(trials):
        first, second = got[0][trial], got[1][trial]
        assert first[0] + second[0] == 2 and first[0] + first[1] == second[0] + second[1] == 2  # each step once
    assert sum(r[2] for reports in got for r in reports) >= 1  # the race happened (it does nearly every trial)
    stream = Stream.open(catalog, "ns.z")
    assert stream.head_step() == 2 * trials
    for trial in range(trials):
        assert stream.producer(producer_id("z", trial)).next_seq == 2


@pytest.mark.parametrize("verify", ["rows", "counts", "off"])
def test_a_seq_another_attempt_published_at_the_same_moment_is_checked_as_verify_replays_says(
        tmp_path: Path, verify: str) -> None:
    """Another attempt of the task (a zombie) published the seq with other rows of the same counts while this attempt
    committed it (``ProducerConflictError``). That is settled as any replay of the job is: ``verify_replays="rows"``
    fails the task, ``"counts"`` and ``"off"`` take the published step (a job that asked for no row check is not failed
    by one only because the replay came at the same moment)."""
    from lakestream_iceberg.errors import ProducerConflictError

    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.z", schema=SCHEMA, world_size=2)
    name = producer_id("z", 0)
    stream.producer(name).commit([_rows(0, 2), _rows(2, 2)])  # the zombie's batch of seq 0
    sink = LakestreamDatasink(catalog=catalog, stream="ns.z", run_name="z", rows_per_step=4, verify_replays=verify)
    mine = [_rows(10, 2), _rows(12, 2)]  # the same counts, other rows (a job whose preprocessing is not seeded)
    conflict = ProducerConflictError("published at the same moment by another writer")
    settle = sink._settle_conflict  # noqa: SLF001 - the rule for a seq raced by another attempt, without racing one
    if verify == "rows":
        with pytest.raises(ProducerConflictError, match="other rows"):
            settle(stream, stream.producer(name), mine, 0, "task 0", conflict)
    else:
        result = settle(stream, stream.producer(name), mine, 0, "task 0", conflict)
        assert result.duplicate and result.step == 1
    assert stream.head_step() == 1 and stream.read(1, rank=0).column("id").to_pylist() == [0, 1]


def test_rank_column_step_fn_and_schema_errors(tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2)
    by_rank = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="r", rows_per_step=4, rank_column="rank")
    first = _rows(0, 3).append_column("rank", pa.array([1, 1, 0], pa.int8()))
    second = _rows(3, 1).append_column("rank", pa.array([1], pa.int32()))  # a step spans blocks of other rank types
    assert by_rank.write(iter([first, second]), _task_context(0)).steps == (1,)
    stream = Stream.open(catalog, "ns.s")
    assert _step_ids(stream, 1) == [[2], [0, 1, 3]]
    with pytest.raises(BatchError, match=r"outside 0\.\.1"):
        by_rank.write(iter([_rows(0, 4).append_column("rank", pa.array([0, 2, 0, 0], pa.int8()))]), _task_context(1))
    huge = _rows(0, 2).append_column("rank", pa.array([0, 2**63], pa.uint64()))  # pyarrow's ArrowInvalid before
    with pytest.raises(BatchError, match=r"rank_column 'rank' holds values beyond int64 \(max 9223372036854775808\)"):
        by_rank.write(iter([huge]), _task_context(1))

    def halves(table: pa.Table) -> Iterator[list[pa.Table]]:
        yield [table.slice(0, 1), table.slice(1)]

    custom = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="f", step_fn=halves)
    assert custom.write(iter([_rows(10, 3)]), _task_context(0)).steps == (2,)
    assert _step_ids(stream, 2) == [[10], [11, 12]]

    plain = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="s", rows_per_step=2)
    with pytest.raises(SchemaMismatchError, match=r"column 'x' of a block is double, the stream expects float"):
        plain.write(iter([pa.table({"id": [1, 2], "x": [0.5, 1.5]})]), _task_context(0))
    with pytest.raises(SchemaMismatchError, match=r"not in the stream \['extra'\]"):
        plain.write(iter([_rows(0, 2).append_column("extra", pa.array([1, 2]))]), _task_context(0))
    reordered = pa.table({"x": pa.array([0.5, 1.0], pa.float32()), "id": [1, 2]})  # any column order is fine
    required = pa.table({"id": [3], "x": pa.array([2.0], pa.float32())},
                        schema=pa.schema([pa.field("id", pa.int64(), nullable=False), ("x", pa.float32())]))
    assert plain.write(iter([reordered, required, required]), _task_context(0)).published == 2  # nullability differs
    casting = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="c", rows_per_step=2, cast=True)
    assert casting.write(iter([pa.table({"id": [1, 2], "x": [0.5, 1.5]})]), _task_context(0)).published == 1


# ------------------------------------------------------------------------------------------------ on a Ray cluster


def _stop_leftover_workers(raylets: set[str]) -> None:
    """Kill the worker processes of this Ray session that outlived ``ray.shutdown()`` (by PID: those started by one of
    its raylets). A Ray Train controller actor was sometimes left running, holding 430 MB, after every run."""
    def leftovers() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:  # gone, or not ours to read
                continue
            if any(var.startswith(b"RAY_RAYLET_PID=") and var[15:].decode() in raylets for var in env):
                found.append(int(entry.name))
        return found

    if not raylets or not Path("/proc").is_dir():
        return
    for pid in leftovers():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 120
    while (left := leftovers()) and time.monotonic() < deadline:  # SIGKILL is not refused: they go, however slowly
        time.sleep(0.05)
    assert not left, f"Ray worker processes {left} survived SIGKILL"


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """Ray workers import this checkout (and tests.*, for the functions below) whatever the venv's editable install
    points to, and print every log line; the variables are restored afterwards.

    Ray Train's controller polls its workers every 2 s by default, and a ``ray.train.report`` waits for the poll: the
    tests' trainers, which report every second step, spent most of their time waiting for it. Here it polls every
    0.25 s, and runs without the preemption watcher (an actor of its own, for cloud spot instances)."""
    tuned = {"RAY_DEDUP_LOGS": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
             "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", *tuned)}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    os.environ.update(tuned)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with worker_environment():
        # address="local": a new local instance, whatever cluster another process on this machine started (ray.init()
        # without it joins the one named in /tmp/ray/ray_current_cluster, and then refuses num_cpus)
        ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=True)
        raylets = {str(p.process.pid) for p in ray._private.worker.global_worker.node.all_processes.get("raylet", [])}
        try:
            yield
        finally:
            ray.shutdown()
            _stop_leftover_workers(raylets)


def _data_context(cpus: float | None = None) -> Any:
    """A fresh Ray DataContext for one job, Ray's defaults (settings do not leak between tests: a copy of the current
    one kept the preserve_order an earlier test had set)."""
    from ray.data import DataContext, ExecutionResources

    with warnings.catch_warnings():  # making one touches Ray's own deprecated settings
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx = DataContext()
    if cpus is not None:
        ctx.execution_options.resource_limits = ExecutionResources(cpu=cpus)
    DataContext._set_current(ctx)
    return ctx


@pytest.mark.slow
def test_ray_data_job_publishes_exactly_once_and_a_rerun_publishes_nothing(ray_cluster: None, tmp_path: Path) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    _data_context()
    tables, rows, per_step = 6, 24, 8
    dataset = ray.data.from_arrow([_rows(t * rows, rows) for t in range(tables)])
    sink = LakestreamDatasink(catalog=catalog, stream="ns.ray", run_name="prep-a", rows_per_step=per_step, create=True,
                              world_size=2)
    dataset.write_datasink(sink)
    steps = tables * rows // per_step
    assert sink.report is not None and sink.report.published == steps and sink.report.duplicates == 0
    assert sink.report.steps == list(range(1, steps + 1))
    stream = Stream.open(catalog, "ns.ray")
    assert stream.head_step() == steps
    seen = sorted(i for s in range(1, steps + 1) for rank in _step_ids(stream, s) for i in rank)
    assert seen == list(range(tables * rows))  # every row once
    rerun = LakestreamDatasink(catalog=catalog, stream="ns.ray", run_name="prep-a", rows_per_step=per_step)
    ray.data.from_arrow([_rows(t * rows, rows) for t in range(tables)]).write_datasink(rerun)
    assert rerun.report is not None and (rerun.report.published, rerun.report.duplicates) == (0, steps)
    assert stream.refresh().head_step() == steps

    bad = ray.data.from_arrow([pa.table({"id": [1, 2], "x": [0.5, 1.5]})])  # x is double: the job fails loudly
    with pytest.raises(Exception, match="column 'x' of a block is double, the stream expects float"):
        bad.write_datasink(LakestreamDatasink(catalog=catalog, stream="ns.ray", run_name="bad", rows_per_step=2))
    assert stream.refresh().head_step() == steps
    # a sink used again: a failed job leaves no report, not the report of the job before it (which told of 0
    # published and every step a duplicate, as if this job had run)
    with pytest.raises(Exception, match="column 'x' of a block is double"):
        bad.write_datasink(rerun)
    assert rerun.report is None and stream.refresh().head_step() == steps


def _to_payload(batch: pa.Table) -> pa.Table:
    """The preprocessing: other columns than its input's (what a created stream must get)."""
    ids = batch.column("id")
    return pa.table({"id": ids.cast(pa.int64()), "x": pa.compute.divide(ids.cast(pa.float32()), 2)}, schema=SCHEMA)


@pytest.mark.slow
def test_create_takes_the_schema_of_what_the_sink_receives(ray_cluster: None, tmp_path: Path) -> None:
    """``create=True`` without ``schema=``: the stream gets the schema of the first block the sink writes, not the
    schema Ray passes to ``on_write_start`` (the fused operator's input: the pre-map columns, or a read's internal
    ``__file_chunk_metadata``)."""
    import pyarrow.parquet as pq

    catalog = sqlite_catalog(str(tmp_path))
    _data_context()
    items = ray.data.from_items([{"id": i, "text": f"doc {i}"} for i in range(24)], override_num_blocks=2)
    sink = LakestreamDatasink(catalog=catalog, stream="ns.items", run_name="a", rows_per_step=4, create=True,
                              world_size=2)
    items.map_batches(_to_payload, batch_format="pyarrow").write_datasink(sink)
    stream = Stream.open(catalog, "ns.items")
    assert stream.payload_arrow_schema.names == ["id", "x"] and sink.report is not None and sink.report.published == 6
    assert sorted(i for s in sink.report.steps for rank in _step_ids(stream, s) for i in rank) == list(range(24))

    (tmp_path / "raw").mkdir()
    for f in range(2):
        pq.write_table(pa.table({"id": list(range(f * 8, f * 8 + 8)), "text": ["t"] * 8}), tmp_path / "raw" / f"{f}.parquet")
    sink = LakestreamDatasink(catalog=catalog, stream="ns.parquet", run_name="p", rows_per_step=4, create=True,
                              world_size=1)
    ray.data.read_parquet(str(tmp_path / "raw")).map_batches(_to_payload, batch_format="pyarrow").write_datasink(sink)
    assert Stream.open(catalog, "ns.parquet").payload_arrow_schema.names == ["id", "x"]
    assert sink.report is not None and sink.report.rows == 16 and sink.report.fused is True


def _chunks_in_step(batch: pa.Table, catalog_root: str, per_step: int, drop_x_from: int | None) -> Iterator[pa.Table]:
    """A generator UDF: one step's rows at a time. Before yielding step k+1's rows it waits until the table shows
    step k: the task's steps must be published while the task runs, not when it ends."""
    stream = Stream.open(sqlite_catalog(catalog_root), "ns.streaming")
    for k, start in enumerate(range(0, batch.num_rows, per_step)):
        if k:
            deadline = time.monotonic() + BOUND_S
            while (stream.refresh().head_step() or 0) < k:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step {k} was not published while its task ran")
                time.sleep(0.02)
        chunk = batch.slice(start, per_step)
        yield chunk.drop_columns(["x"]) if drop_x_from is not None and start >= drop_x_from else chunk


@pytest.mark.slow
def test_steps_stream_within_a_task_and_a_batch_missing_a_column_fails_the_job(ray_cluster: None, tmp_path: Path) -> None:
    """With Ray's default 128 MiB target block size, a generator UDF's batches were merged into one block, so a task
    published all its steps at its end, and a batch missing a nullable column was merged with nulls filled in. The sink
    turns block shaping off for the transform that feeds a fused write: every batch is its own block."""
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.streaming", schema=SCHEMA, world_size=1)
    _data_context()
    per_step = 4
    sink = LakestreamDatasink(catalog=catalog, stream="ns.streaming", run_name="gen", rows_per_step=per_step)
    ray.data.from_arrow([_rows(0, 5 * per_step)]).map_batches(
        _chunks_in_step, fn_kwargs={"catalog_root": str(tmp_path), "per_step": per_step, "drop_x_from": None},
        batch_format="pyarrow", batch_size=None).write_datasink(sink)
    assert sink.report is not None and sink.report.steps == [1, 2, 3, 4, 5] and sink.report.fused is True

    missing = LakestreamDatasink(catalog=catalog, stream="ns.streaming", run_name="missing", rows_per_step=per_step)
    with pytest.raises(Exception, match=r"missing \['x'\]"):
        ray.data.from_arrow([_rows(100, 3 * per_step)]).map_batches(
            _chunks_in_step, fn_kwargs={"catalog_root": str(tmp_path), "per_step": per_step, "drop_x_from": per_step},
            batch_format="pyarrow", batch_size=None).write_datasink(missing)
    stream.refresh()
    assert stream.head_step() == 6  # the batch before the one without 'x', and nothing of that one
    assert stream.read(6, rank=0).column("x").null_count == 0


def _one_step_per_block(block: pa.Table) -> Iterator[list[pa.Table]]:
    yield [block]


def _row_after_step(row: dict[str, Any], catalog_root: str, first_id: int, per_step: int, head: int) -> dict[str, Any]:
    """A row-wise UDF: the second row of step k+1 waits until the table shows step k (``head`` steps before the job):
    the task's steps are published while it runs."""
    j = row["id"] - first_id
    if j > per_step and j % per_step == 1:
        stream = Stream.open(sqlite_catalog(catalog_root), "ns.rows")
        deadline = time.monotonic() + BOUND_S
        while (stream.refresh().head_step() or 0) < head + j // per_step:
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {j // per_step} was not published while its task ran")
            time.sleep(0.02)
    return row


@pytest.mark.slow
def test_a_row_wise_map_feeds_the_sink_blocks_of_a_step_not_single_rows(ray_cluster: None, tmp_path: Path) -> None:
    """Block shaping turned off for a row-wise transform (``Dataset.map``) made every row its own block: a ``step_fn``
    was called once per row (12 one-row steps instead of one), and each row went through the sink's per-block work
    (4-8x slower). Its rows reach the sink in blocks of ``rows_per_step`` rows, each step still published while the
    task runs, or as Ray shapes them with ``step_fn``."""
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.rows", schema=SCHEMA, world_size=1)
    _data_context()
    per_block = LakestreamDatasink(catalog=catalog, stream="ns.rows", run_name="blocks", step_fn=_one_step_per_block,
                                   cast=True)
    ray.data.from_arrow([_rows(0, 12)]).map(lambda row: row).write_datasink(per_block)
    assert per_block.report is not None and per_block.report.fused is True and per_block.report.steps == [1]
    per_step = 4
    sink = LakestreamDatasink(catalog=catalog, stream="ns.rows", run_name="rows", rows_per_step=per_step, cast=True)
    ray.data.from_arrow([_rows(100, 3 * per_step)]).map(
        _row_after_step, fn_kwargs={"catalog_root": str(tmp_path), "first_id": 100, "per_step": per_step, "head": 1}
    ).write_datasink(sink)
    assert sink.report is not None and sink.report.steps == [2, 3, 4]
    stream.refresh()
    assert [_step_ids(stream, s)[0] for s in (2, 3, 4)] == [list(range(100 + k, 104 + k)) for k in (0, 4, 8)]


@pytest.mark.slow
def test_a_task_whose_rows_a_filter_removed_publishes_nothing_and_fails_nothing(ray_cluster: None, tmp_path: Path) -> None:
    """Where a row-wise ``filter`` (or ``flat_map``, or a generator that yields nothing) removes every row of a task's
    input, Ray hands that write task a block without rows and *without columns*: the sink checked it against the
    stream's columns and failed the whole job ("missing ['id', 'x']"). A block without rows is skipped and the other
    tasks' rows are published (``step_fn`` too: the next test, without a cluster)."""
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.filtered", schema=SCHEMA, world_size=1)
    _data_context()
    sink = LakestreamDatasink(catalog=catalog, stream="ns.filtered", run_name="rows", cast=True, rows_per_step=4)
    ray.data.from_arrow([_rows(i * 4, 4) for i in range(3)]).filter(
        lambda row: not 4 <= row["id"] < 8).write_datasink(sink)  # the second block loses every row (x: a double)
    assert sink.report is not None and sink.report.rows == 8 and len(sink.report.tasks) == 3
    assert sorted(len(t.steps) for t in sink.report.tasks) == [0, 1, 1]
    stream.refresh()
    assert stream.head_step() == 2
    assert sorted(i for s in range(1, 3) for i in _step_ids(stream, s)[0]) == [*range(4), *range(8, 12)]


@pytest.mark.parametrize("how", ["rows", "fn"])
def test_step_rule_skips_a_block_without_rows_or_columns_and_never_hands_it_to_step_fn(how: str) -> None:
    """The block Ray hands a write task whose input a filter emptied (no rows, no columns), between two real ones."""
    from lakestream_iceberg.integrations.ray import StepRule

    called: list[int] = []

    def one_rank(block: pa.Table) -> Iterator[list[pa.Table]]:
        called.append(block.num_rows)
        yield [block]

    rule = StepRule(rows_per_step=4 if how == "rows" else None, step_fn=one_rank if how == "fn" else None,
                    rank_column=None, drop_last=False, cast=True)
    blocks = [_rows(0, 4), pa.table({}), _rows(8, 4)]
    steps = list(rule.steps(iter(blocks), payload=SCHEMA, world_size=1, where="test"))
    assert [step[0].column("id").to_pylist() for step in steps] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert called == ([4, 4] if how == "fn" else [])


@pytest.mark.slow
def test_an_unfused_write_without_preserve_order_is_warned_about(ray_cluster: None, tmp_path: Path) -> None:
    """A write that is not fused with the map before it receives blocks in completion order unless preserve_order is
    set: a re-run may give a task index other rows (verify_replays then fails it). The sink says so at start."""
    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.order", schema=SCHEMA, world_size=1)

    def job(run_name: str) -> LakestreamDatasink:
        sink = LakestreamDatasink(catalog=catalog, stream="ns.order", run_name=run_name, rows_per_step=4)
        ray.data.from_arrow([_rows(i * 4, 4) for i in range(4)]).map_batches(
            _to_payload, batch_format="pyarrow").write_datasink(sink, concurrency=1)
        return sink

    _data_context()
    with pytest.warns(RuntimeWarning, match="preserve_order is off"):
        unordered = job("unordered")
    assert unordered.report is not None and unordered.report.fused is False and len(unordered.report.warnings) == 1
    _data_context().execution_options.preserve_order = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ordered = job("ordered")
    assert ordered.report is not None and ordered.report.fused is False and ordered.report.warnings == ()
    assert ordered.report.published == 4


@pytest.mark.slow
def test_a_fused_write_fed_by_another_operator_without_preserve_order_is_warned_about(ray_cluster: None,
                                                                                    tmp_path: Path) -> None:
    """``read_parquet(...).map_batches(f).write_datasink(sink)`` (the README's job) is one fused operator, but Ray
    2.60 feeds it from a ListFiles operator that lists files in completion order without ``preserve_order``: a task's
    files came in another order in each run (observed: ids 50.., 0.., 100.. then 50.., 100.., 0..), so a re-run with
    the same run name failed with verify_replays' BatchError, and the sink had warned of nothing (it warned of unfused
    writes only). It warns of a write fed by another operator, fused or not; with preserve_order the files come in
    listing order and a re-run replays every step."""
    import pyarrow.parquet as pq

    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.files", schema=SCHEMA, world_size=1)
    (tmp_path / "raw").mkdir()
    for f in range(3):
        pq.write_table(_rows(f * 8, 8), tmp_path / "raw" / f"{f}.parquet")

    def job(run_name: str) -> LakestreamDatasink:
        sink = LakestreamDatasink(catalog=catalog, stream="ns.files", run_name=run_name, rows_per_step=4)
        ray.data.read_parquet(str(tmp_path / "raw"), override_num_blocks=3).map_batches(
            _to_payload, batch_format="pyarrow").write_datasink(sink)
        return sink

    _data_context()
    with pytest.warns(RuntimeWarning, match=r"fed by another operator \(ListFiles.*preserve_order is off"):
        unordered = job("unordered")
    assert unordered.report is not None and unordered.report.fused is True and len(unordered.report.warnings) == 1
    _data_context().execution_options.preserve_order = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ordered, again = job("ordered"), job("ordered")
    assert ordered.report is not None and ordered.report.warnings == () and ordered.report.published == 6
    assert again.report is not None and (again.report.published, again.report.duplicates) == (0, 6)


# -- faults: a write task's worker process is killed mid-job ---------------------------------------------------------


def _kill_me_once(batch: pa.Table, kill_id: int, marks: str) -> pa.Table:
    """On the first attempt, the batch holding ``kill_id`` reports this worker's pid and waits to be SIGKILLed."""
    from ray.data._internal.execution.interfaces import TaskContext

    ids = batch.column("id").to_pylist()
    if kill_id in ids and not os.path.exists(os.path.join(marks, "killed")):
        task = TaskContext.get_current()
        Path(marks, "victim.tmp").write_text(json.dumps({"pid": os.getpid(), "task_idx": task.task_idx if task else None}))
        os.replace(os.path.join(marks, "victim.tmp"), os.path.join(marks, "victim"))
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            time.sleep(0.1)
        raise TimeoutError("the test did not kill this worker")
    return batch


@pytest.mark.slow
def test_killed_write_task_publishes_no_duplicate_and_no_gap(ray_cluster: None, tmp_path: Path) -> None:
    from lakestream_iceberg import LakestreamDataset

    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.faults", schema=SCHEMA, world_size=2)
    ctx = _data_context(cpus=2)
    ctx.target_max_block_size = 64  # each map batch of 8 rows (96 bytes) becomes its own block: a task streams several blocks
    tables, rows, per_step, batch = 4, 32, 8, 8
    kill_id = rows + 3 * batch  # the 4th block of task 1: its steps of the first 3 blocks are already published
    marks = tmp_path / "marks"
    marks.mkdir()
    dataset = ray.data.from_arrow([_rows(t * rows, rows) for t in range(tables)]).map_batches(
        _kill_me_once, fn_kwargs={"kill_id": kill_id, "marks": str(marks)}, batch_format="pyarrow", batch_size=batch)
    sink = LakestreamDatasink(catalog=catalog, stream="ns.faults", run_name="faulty", rows_per_step=per_step)
    steps = tables * rows // per_step

    follower = LakestreamDataset(stream, rank=0, world_size=1, follow=True, end_step=steps, timeout=BOUND_S,
                                 collate=lambda shard: (shard.step, shard.table.column("id").to_pylist()))
    seen: list[tuple[int, list[int]]] = []
    reader = threading.Thread(target=lambda: seen.extend(follower), daemon=True)
    reader.start()
    outcome: dict[str, Any] = {}

    def job() -> None:
        try:
            dataset.write_datasink(sink)
        except BaseException as exc:
            outcome["error"] = exc

    writer = threading.Thread(target=job, daemon=True)
    writer.start()
    victim = json.loads(_wait("the victim task to report its pid", lambda: (marks / "victim").exists()
                              and (marks / "victim").read_text()))
    assert victim["task_idx"] is not None
    name = producer_id("faulty", victim["task_idx"])
    published_before = stream.refresh().producer(name).next_seq
    assert published_before >= 1  # killed mid-task: some of its steps are out, the rest is not
    (marks / "killed").touch()
    os.kill(victim["pid"], signal.SIGKILL)
    writer.join(BOUND_S)
    reader.join(BOUND_S)
    assert not writer.is_alive() and "error" not in outcome, outcome.get("error")
    assert not reader.is_alive()

    stream.refresh()
    assert stream.head_step() == steps  # no gap, nothing twice: exactly the job's steps
    assert sink.report is not None
    retried = next(t for t in sink.report.tasks if t.task_idx == victim["task_idx"])
    assert retried.pid != victim["pid"] and retried.duplicates == published_before  # replayed, not republished
    # the report holds each task's completing attempt: the retry replayed what the killed attempt had published
    assert sink.report.published + published_before == steps and sink.report.duplicates == published_before
    everything = sorted(i for s in range(1, steps + 1) for rank in _step_ids(stream, s) for i in rank)
    assert everything == list(range(tables * rows))
    # the follower (a trainer) saw every step once, in order, each whole: what it read is the final content
    assert [s for s, _ in seen] == list(range(1, steps + 1))
    for step, ids in seen:
        assert len(ids) == per_step and sorted(ids) == sorted(i for rank in _step_ids(stream, step) for i in rank)


def test_step_rule_deals_rows_across_blocks_round_robin_and_keeps_or_drops_the_rest() -> None:
    """The rows-to-steps rule on its own (pure pyarrow): steps span blocks, rows go to rank row % world_size."""
    from lakestream_iceberg.integrations.ray import StepRule

    payload = pa.schema([("x", pa.int64())])
    blocks = [pa.table({"x": list(range(0, 5))}), pa.table({"x": list(range(5, 11))})]
    for drop_last, expected in ((False, 3), (True, 2)):
        rule = StepRule(rows_per_step=4, step_fn=None, rank_column=None, drop_last=drop_last, cast=False)
        steps = list(rule.steps(iter(blocks), payload=payload, world_size=2, where="test"))
        assert len(steps) == expected
        assert [s.column("x").to_pylist() for s in steps[0]] == [[0, 2], [1, 3]]
        assert [s.column("x").to_pylist() for s in steps[1]] == [[4, 6], [5, 7]]
        if not drop_last:
            assert [s.column("x").to_pylist() for s in steps[2]] == [[8, 10], [9]]


def _maps_schema(key: pa.DataType, value: pa.DataType) -> pa.Schema:
    return pa.schema([("id", pa.int64()), ("m", pa.map_(key, value)), ("lm", pa.list_(pa.map_(key, value))),
                      ("s", pa.struct([("m", pa.map_(key, value))]))])


def _map_keys(array: pa.Array) -> Iterator[pa.Array]:
    """The keys of every map in ``array``, at any depth."""
    kind = array.type
    if pa.types.is_map(kind):
        yield array.keys
        yield from _map_keys(array.items)
    elif pa.types.is_struct(kind):
        for i in range(kind.num_fields):
            yield from _map_keys(array.field(i))
    elif pa.types.is_list(kind):
        yield from _map_keys(array.values)


@pytest.mark.parametrize("how", ["take", "filter"])
def test_the_cast_path_hands_the_writer_map_keys_without_a_validity_bitmap(tmp_path: Path, how: str) -> None:
    """pyarrow before 26 (the last for Python 3.10 is 25) aborts the process, a failed C++ check ("Map array keys
    array should have no nulls") and not an exception, casting a map whose keys carry a validity bitmap, as take() and
    filter() make them (Ray's blocks too), to another key type. The writer rebuilds such keys without the bitmap
    before its own cast, but ``cast=True`` cast each block first: a block with large_string keys (a pyiceberg or
    pandas read) for a stream with string keys killed the write task's worker. The block's keys, at any depth, reach
    the cast, and the writer, without a bitmap; on pyarrow 26 nothing aborts, so the test checks that property."""
    from lakestream_iceberg.integrations.ray import StepRule

    source, payload = _maps_schema(pa.large_string(), pa.int32()), _maps_schema(pa.string(), pa.int64())
    whole = pa.table({"id": [0, 1, 2, 3],
                      "m": [[("a", 1)], None, [("b", 2), ("c", 3)], []],
                      "lm": [[[("a", 1)]], [None, [("d", 4)]], None, [[]]],
                      "s": [{"m": [("e", 5)]}, None, {"m": None}, {"m": [("f", 6), ("g", 7)]}]}, schema=source)
    block = whole.take([2, 0, 1, 3]) if how == "take" else whole.filter(pa.array([True, False, True, True]))
    assert any(keys.buffers()[0] is not None for column in block.columns for chunk in column.chunks
               for keys in _map_keys(chunk))  # what Ray hands the sink: keys with a bitmap
    rule = StepRule(rows_per_step=8, step_fn=None, rank_column=None, drop_last=False, cast=True)
    ((shard,),) = rule.steps(iter([block]), payload=payload, world_size=1, where="test")
    assert shard.schema == payload and shard.to_pylist() == block.to_pylist()
    bitmaps = [keys.type for column in shard.columns for chunk in column.chunks for keys in _map_keys(chunk)
               if keys.buffers()[0] is not None]
    assert not bitmaps, f"map keys of {bitmaps} reach the writer with a validity bitmap"

    catalog = sqlite_catalog(str(tmp_path))  # and the whole way, through a write task, for two ranks
    sink = LakestreamDatasink(catalog=catalog, stream="ns.maps", run_name="maps", rows_per_step=8, cast=True,
                              create=True, world_size=2, schema=payload)
    sink.on_write_start(None)
    report = sink.write([block], _task_context(0))
    stream = Stream.open(catalog, "ns.maps")
    assert report.steps == (1,)
    assert [stream.read(1, rank=r).to_pylist() for r in range(2)] == [block.to_pylist()[0::2], block.to_pylist()[1::2]]


def test_cast_takes_a_nested_column_of_the_streams_type_with_nulls_under_null_parents(tmp_path: Path) -> None:
    """A struct whose field is required may hold a null under a null struct (Arrow allows it: ``take()`` with a null
    index makes one); no reader sees it and the writer fills it. ``cast=True`` cast every column, and pyarrow's cast
    of such a struct to its own type refuses it ("nulls in input cannot be viewed as non-nullable"): the block that
    ``cast=False`` publishes failed the task. Only the columns whose type differs are cast."""
    required = pa.struct([pa.field("a", pa.int64(), nullable=False), pa.field("b", pa.string())])
    payload = pa.schema([("id", pa.int64()), ("s", required)])
    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.nested", schema=payload, world_size=1)
    whole = pa.table({"id": [0, 1, 2], "s": pa.array([{"a": 1, "b": "x"}, None, {"a": 3, "b": None}], required)},
                     schema=payload)
    block = whole.take(pa.array([0, None, 2])).set_column(0, "id", pa.array([0, 1, 2], pa.int32()))  # id: to cast
    assert block.column("s").chunk(0).field(0).null_count == 1  # the hidden null
    sink = LakestreamDatasink(catalog=catalog, stream="ns.nested", run_name="n", rows_per_step=3, cast=True)
    sink.on_write_start(None)
    assert sink.write([block], _task_context(0)).steps == (1,)
    assert Stream.open(catalog, "ns.nested").read(1, rank=0).to_pylist() == [
        {"id": 0, "s": {"a": 1, "b": "x"}}, {"id": 1, "s": None}, {"id": 2, "s": {"a": 3, "b": None}}]


def test_a_context_that_ignores_failed_tasks_is_warned_about(tmp_path: Path) -> None:
    """With ``DataContext.max_errored_blocks`` other than 0 Ray ignores failed write tasks: a job whose write task
    failed after publishing part of its steps succeeded, the rest of that task's rows unpublished and nothing in the
    sink's report (observed: 20 rows of 24, report tasks [0, 2]). The sink warns at start, and the report keeps it."""
    from ray.data import DataContext

    catalog = sqlite_catalog(str(tmp_path))
    saved = DataContext.get_current()
    try:
        for allowed, says in ((0, None), (2, "ignores up to 2 failed task"), (-1, "ignores every failed task")):
            _data_context().max_errored_blocks = allowed
            sink = LakestreamDatasink(catalog=catalog, stream="ns.errored", run_name="e", rows_per_step=2, create=True,
                                      world_size=1, schema=SCHEMA)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sink.on_write_start(None)
            found = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            if says is None:
                assert not found
                continue
            assert len(found) == 1 and says in found[0] and "re-run the job with the same run_name" in found[0]
            sink.on_write_complete(type("WriteResult", (), {"write_returns": []})())
            assert sink.report is not None and sink.report.warnings == tuple(found)
    finally:
        DataContext._set_current(saved)


@pytest.mark.parametrize("world_size", [1, 3, 4, 4096])
def test_dealing_by_rank_column_gives_each_rank_its_rows_in_their_order(world_size: int) -> None:
    """Rows dealt by ``rank_column`` were filtered once per rank (O(rows x world size): 4,096 ranks, 1M rows, 1.1 s a
    step); one stable sort and a slice per rank must give each rank exactly the rows a filter gives, in their order,
    ranks without rows included."""
    import numpy as np
    import pyarrow.compute as pc

    from lakestream_iceberg.integrations.ray import StepRule

    rows = 10_000
    payload = pa.schema([("x", pa.int64())])
    rule = StepRule(rows_per_step=rows, step_fn=None, rank_column="rank", drop_last=False, cast=False)
    ranks = np.random.default_rng(world_size).integers(0, max(1, world_size - 1), rows)  # the last rank gets none
    table = pa.table({"x": np.arange(rows), "rank": ranks})
    (step,) = rule.steps(iter([table]), payload=payload, world_size=world_size, where="test")
    assert len(step) == world_size
    for rank, shard in enumerate(step):
        expected = table.filter(pc.equal(table.column("rank"), rank)).select(["x"])
        assert shard.select(["x"]).equals(expected), rank


def test_a_worker_keeps_a_bounded_number_of_streams_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived Ray worker that wrote to many streams (one job after another) keeps the least recently used few
    open, closing the others (their threads and catalog connections); it kept every one, each with its engine and
    thread pools. A handle a forked worker inherited is forgotten there, never closed from the child."""
    from lakestream_iceberg.integrations.ray import streams
    from lakestream_iceberg.read.stream_ref import StreamRef

    streams._streams.clear()  # noqa: SLF001 - what earlier tests of this process opened
    released: list[object] = []
    release = streams._release  # noqa: SLF001

    def spy(stream: Stream) -> None:
        released.append(stream)
        release(stream)

    monkeypatch.setattr(streams, "_release", spy)
    refs = []
    for i in range(streams.MAX_OPEN_STREAMS + 3):
        (tmp_path / f"c{i}").mkdir()
        stream = Stream.create(sqlite_catalog(str(tmp_path / f"c{i}")), f"ns.s{i}", schema=SCHEMA, world_size=2)
        refs.append(StreamRef.of(stream))
    opened = [streams.open_stream(ref) for ref in refs]
    assert len(streams._streams) == streams.MAX_OPEN_STREAMS  # noqa: SLF001
    kept = {id(s) for s in streams._streams.values()}  # noqa: SLF001
    assert kept == {id(s) for s in opened[-streams.MAX_OPEN_STREAMS:]}
    assert released == opened[:3]  # the least recently used, closed: threads and catalog connections
    assert opened[0].table.catalog.engine.pool.checkedin() == 0  # its catalog's engine was disposed
    assert opened[-1].table.catalog.engine.pool.checkedin() >= 1  # a kept one's was not
    assert streams.open_stream(refs[-1]) is opened[-1]  # still cached, the same handle
    first = opened[0]
    assert "writer" not in first.__dict__ and "staging" not in first.__dict__  # closed (never used: nothing made)
    first.producer("p").commit([_rows(0, 2), _rows(2, 2)])  # an evicted handle stays usable for whoever holds it
    first.close()
    again = streams.open_stream(refs[0])  # reopened, evicting the least recently used
    assert again is not first and again.head_step() == 1
    assert len(streams._streams) == streams.MAX_OPEN_STREAMS  # noqa: SLF001
    # a key of another process (what a forked worker inherits) is dropped at the next open, not closed
    inherited = next(iter(streams._streams))  # noqa: SLF001
    streams._streams[(inherited[0] + 1, inherited[1])] = streams._streams.pop(inherited)  # noqa: SLF001
    streams.open_stream(refs[1])  # not cached: opened, and the foreign key dropped
    assert all(pid == os.getpid() for pid, _ in streams._streams)  # noqa: SLF001
    assert len(streams._streams) == streams.MAX_OPEN_STREAMS  # noqa: SLF001
    streams._streams.clear()  # noqa: SLF001


def test_nulls_in_a_required_column_fail_the_task(tmp_path: Path) -> None:
    """What a job that must never publish a filled-in null declares: the column as required (``nullable=False``).
    A batch that lacked a nullable column and was merged with others by an upstream Ray operator arrives with nulls
    in it (Ray fills them in); in a required column they fail the task, and nothing of the step is published."""
    catalog = sqlite_catalog(str(tmp_path))
    required = pa.schema([("id", pa.int64()), pa.field("x", pa.float32(), nullable=False)])
    Stream.create(catalog, "ns.req", schema=required, world_size=1)
    sink = LakestreamDatasink(catalog=catalog, stream="ns.req", run_name="req", rows_per_step=2)
    merged = pa.table({"id": [1, 2, 3, 4], "x": pa.array([0.5, 1.0, None, None], pa.float32())})  # as Ray merges them
    with pytest.raises(BatchError, match="step seq 1: shard for rank 0: column 'x' is required but has nulls"):
        sink.write(iter([merged]), _task_context(0))
    assert Stream.open(catalog, "ns.req").head_step() == 1  # the first step (no nulls) only


def test_create_refuses_a_schema_iceberg_cannot_hold_with_the_column_and_the_fix(tmp_path: Path) -> None:
    """``create=True`` from a first block (or ``schema=``) Iceberg cannot hold: a column all nulls in that block
    (``pa.null()``, what Ray makes of ``None`` values), a Ray tensor column (a numpy batch of 2-D arrays), a
    ``timestamp[ns]``: a SchemaMismatchError naming the column and the fix, and no stream. pyiceberg's bare ValueError
    or UnsupportedPyArrowTypeException failed the job instead."""
    import numpy as np
    from ray.data.extensions import ArrowTensorArray

    catalog = sqlite_catalog(str(tmp_path))
    ids = pa.array([0, 1], pa.int64())
    firsts = {
        "nulls": pa.table({"id": ids, "c": pa.array([None, None], pa.null())}),
        "tensor": pa.table({"id": ids, "c": ArrowTensorArray.from_numpy(np.ones((2, 3), np.float32))}),
        "nanos": pa.table({"id": ids, "c": pa.array([1, 2], pa.timestamp("ns"))}),
    }
    for name, first in firsts.items():
        sink = LakestreamDatasink(catalog=catalog, stream=f"ns.{name}", run_name="r", rows_per_step=2, create=True,
                                  world_size=1)
        sink.on_write_start(None)
        with pytest.raises(SchemaMismatchError, match=r"task 0 .*cannot make the stream from the first block it writes "
                                                      r"\(id: int64, c: .*Pass schema="):
            sink.write(iter([first]), _task_context(0))
        given = LakestreamDatasink(catalog=catalog, stream=f"ns.{name}", run_name="r", rows_per_step=2, create=True,
                                   world_size=1, schema=first.schema)
        with pytest.raises(SchemaMismatchError, match=r"cannot make the stream from schema= \(id: int64, c: "):
            given.on_write_start(None)
        with pytest.raises(NoSuchTableError):
            Stream.open(catalog, f"ns.{name}")


def test_a_schema_other_than_the_existing_streams_is_refused_before_anything_is_published(tmp_path: Path) -> None:
    """``schema=`` given for a stream that exists: without ``create`` it was ignored without a word (the job published
    blocks of the stream's schema, whatever the sink was told); it is checked as ``world_size=`` is, on the driver."""
    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2)
    other = pa.schema([("id", pa.int64()), ("y", pa.string())])
    sink = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="r", rows_per_step=2, schema=other)
    with pytest.raises(ConfigError, match=r"stream ns.s has schema \(id: int64, x: float\), the sink was given "
                                          r"schema=\(id: int64, y: string\)"):
        sink.on_write_start(None)
    creating = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="r", rows_per_step=2, schema=other,
                                  create=True, world_size=2)
    with pytest.raises(StreamExistsError, match="already exists with world_size=2 and schema"):
        creating.on_write_start(None)  # as Stream.create refuses it
    assert Stream.open(catalog, "ns.s").head_step() == 0
    same = LakestreamDatasink(catalog=catalog, stream="ns.s", run_name="r", rows_per_step=2, schema=SCHEMA)
    same.on_write_start(None)
    assert same.write(iter([_rows(0, 2)]), _task_context(0)).steps == (1,)


def test_a_payload_column_renamed_between_runs_is_refused_by_a_worker_that_wrote_before(tmp_path: Path) -> None:
    """A Ray worker keeps the streams it wrote to open across jobs (``open_stream``), and a stream checks the table's
    schema once, when its writer is made: after another engine renamed a payload column between two runs, a worker
    that had written before published the next run's steps, which a stream opened afresh refuses. The driver refuses
    the job before any task, and a worker's cached stream is opened again (an added optional column still works)."""
    from pyiceberg.types import StringType

    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.evolved", schema=SCHEMA, world_size=1)
    first = LakestreamDatasink(catalog=catalog, stream="ns.evolved", run_name="first", rows_per_step=2)
    first.on_write_start(None)
    assert first.write([_rows(0, 2)], _task_context(0)).steps == (1,)  # this process is now a worker that wrote

    with stream.table.update_schema() as update:  # another engine, between the runs: legal, lakestream keeps going
        update.add_column("note", StringType())
    added = LakestreamDatasink(catalog=catalog, stream="ns.evolved", run_name="added", rows_per_step=2)
    added.on_write_start(None)
    assert added.write([_rows(2, 2)], _task_context(0)).steps == (2,)

    with catalog.load_table("ns.evolved").update_schema() as update:  # refused by lakestream producers
        update.rename_column("x", "x2")
    second = LakestreamDatasink(catalog=catalog, stream="ns.evolved", run_name="second", rows_per_step=2)
    with pytest.raises(SchemaMismatchError, match="no longer has the payload column 'x'"):
        second.on_write_start(None)
    with pytest.raises(SchemaMismatchError, match="no longer has the payload column 'x'"):
        second.write([_rows(4, 2)], _task_context(0))
    assert stream.refresh().head_step() == 2


def test_ray_train_dataset_refuses_a_rank_or_world_size_of_its_own(tmp_path: Path) -> None:
    """``rank=`` or ``world_size=`` passed to ``ray_train_dataset`` (they are Ray Train's) failed in the training
    worker with Python's 'got multiple values for keyword argument'; it is a ConfigError saying where they come from,
    raised before Ray Train's context is asked."""
    from lakestream_iceberg.integrations.ray import ray_train_dataset

    stream = Stream.create(sqlite_catalog(str(tmp_path)), "ns.s", schema=SCHEMA, world_size=2)
    for given in ({"rank": 0}, {"world_size": 4}, {"rank": 1, "world_size": 2}):
        with pytest.raises(ConfigError, match=r"ray_train_dataset takes rank and world size from "
                                              r"ray\.train\.get_context\(\).*got " + ", ".join(sorted(given))):
            ray_train_dataset(stream, **given)
