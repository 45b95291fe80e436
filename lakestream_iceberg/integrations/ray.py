"""Ray Data producers and Ray Train consumers: a streaming ``Datasink`` that publishes training steps exactly once.

Install the extra: ``pip install 'lakestream-iceberg[ray]'`` (pins ``ray[data,train]==2.60.0``). The core package
never imports this module.

Producer side::

    sink = LakestreamDatasink(catalog="prod", stream="train.batches", run_name="prep-2026-12-01", rows_per_step=256,
                              create=True, world_size=8)
    ray.data.read_parquet(...).map_batches(preprocess, batch_format="pyarrow").write_datasink(sink)
    sink.report   # SinkReport: steps published, duplicates skipped, per write task

Consumer side, inside a Ray Train ``train_loop_per_worker``: :func:`ray_train_dataset` (a ``LakestreamDataset`` with
rank and world size from ``ray.train.get_context()``, in follow mode).

**Each write task is a producer.** Its id is ``f"{run_name}-{task_idx}"`` (``TaskContext.task_idx``) and its seq counts
the steps that task has formed, 0, 1, 2, ...; every step is committed with that explicit seq, as soon as it is formed
(streaming: a step is visible to trainers while the job is still running, not at the end). A (producer, seq) that is
already published is never published again (:meth:`Producer.commit` returns ``duplicate=True``, before writing any
file), so a task that runs again publishes only the steps its earlier attempts did not.

**What a retried task sees (Ray 2.60.0, read in its source, and observed).**

* ``MapOperator._try_schedule_task`` (``ray/data/_internal/execution/operators/task_pool_map_operator.py``) builds
  ``TaskContext(task_idx=self._next_data_task_idx, ...)`` once, on the driver, and passes it *as an argument* of the
  remote ``_map_task`` together with the input bundle's block refs (``*bundle.block_refs``); ``task_idx`` is unique
  per operator. A retry is Ray Core re-executing that same task spec: same ``task_idx``, same input blocks, same order.
* The task function is made by ``cached_remote_fn`` (``ray/data/_internal/remote_fn.py``) with ``max_retries=-1`` and
  ``retry_exceptions=[RaySystemError]``: a task whose worker process dies (killed, OOM, node lost) is retried without
  limit; an exception raised by the task's code (our ``SchemaMismatchError``, a bug in a UDF) is *not* retried by
  default, and ``write_datasink`` raises it: the job fails loudly. (``DataContext.retried_map_errors`` /
  ``max_map_retries`` can make Ray retry such errors too; a retry then replays the published steps and fails again.)
* Fused upstream maps (``read -> map_batches -> Write`` in one task) run again in the retry, from the same input
  blocks; the Write stage receives their output lazily, block by block (``plan_write_op.generate_write_fn`` hands
  ``Datasink.write`` a generator), so steps are committed while later blocks of the same task are still being computed.
* Observed (``ray.data.range(400)`` with a ``map_batches`` that ``os._exit``-ed its worker on its second batch, on the
  first attempt only): task 3 received block ``[119..143]``, its worker died; the retry ran on a new worker process
  with ``task_idx == 3`` and received ``[119..143]`` then ``[144..156]``, the same blocks in the same order.
  ``tests/test_ray.py::test_killed_write_task_publishes_no_duplicate_and_no_gap`` SIGKILLs a write task's worker after
  its first steps were published and checks the outcome from the table.
* ``on_write_start`` runs on the driver when the first input bundle is ready, before the operator's transformer
  (holding this sink) is serialized (``MapOperator._map_transformer_ref`` is created lazily, after ``on_start``), and
  ``on_write_complete`` runs on the driver after every task finished.

So the steps a task forms depend only on its input blocks, and exactly once holds across task retries and worker
deaths (a worker killed mid-commit leaves an outcome-unknown commit or a staged intent: the retry's commit of the same
seq is reconciled from the table, see README "Group commit").

**Re-running a job** (the driver died, or the job is run again) with the **same run name** publishes nothing twice
provided each ``task_idx`` receives the same rows in the same order as before. That holds when

* the input is read in a deterministic order with a fixed block count (``override_num_blocks=``; the default
  parallelism depends on the cluster's CPUs, so another cluster size would cut other blocks),
* ``DataContext.get_current().execution_options.preserve_order = True`` when the Write is not fused with the read
  (otherwise blocks reach the Write operator, and get their ``task_idx``, in completion order), and
* the preprocessing is deterministic (seeded randomness).

When it does not hold, every (task, seq) already published is still published once, but the re-run's content for it
would be dropped in favour of the published one, so some rows would be lost and others delivered twice. The sink
checks every replayed step against the published one (``verify_replays``): ``"rows"`` (default) reads the published
step back and compares its rows with the replayed ones (a retry or re-run then costs one read of what it replays),
``"counts"`` compares only the per-rank row counts (from the manifests, no data read; equal counts with other rows go
unnoticed), ``"off"`` trusts the job. A difference fails the job with a :class:`BatchError` naming the step and the
fix. Observed (``ray.init(num_cpus=6)``, ``ray.data.range(240, override_num_blocks=24).map_batches(f,
concurrency=4)`` where ``f`` sleeps 0.3 s on every other block, the other half in the re-run, then
``write_datasink(sink, concurrency=1)``, so the Write is not fused): with ``preserve_order=True`` both runs gave write
task ``i`` block ``i`` and the re-run replayed all 24 steps with identical rows; without it the first run gave task 4
the block of ids 50..59 (completion order) and the re-run the block of 40..49, every row count equal, and ``"rows"``
failed the re-run at task 4 (``MapOperator.start`` uses a ``ReorderingBundleQueue``, task order, when
``preserve_order`` is set and a ``FIFOBundleQueue``, completion order, otherwise). With 2 CPUs the same job happened to
keep the order without ``preserve_order``: nothing promises it. To publish the data again on purpose
(a new epoch, a changed pipeline), use a new run name.

**Rows to global batches** (one of):

* ``rows_per_step=N``: a task's rows, in order, are cut into steps of ``N`` rows (a step may span blocks of the same
  task, never tasks). Within a step, rows are dealt to the ``world_size`` ranks round-robin (row ``j`` to rank
  ``j % world_size``), or by ``rank_column`` (an integer column naming each row's rank; dropped unless it is a
  stream column). The last rows of a task (fewer than ``N``) form a smaller last step, or are dropped with
  ``drop_last=True``.
* ``step_fn=f``: ``f(block) -> iterable of steps``, each a sequence of ``world_size`` pyarrow Tables (one per rank):
  full control, one block at a time.

**Schema.** Every block must have the stream's payload columns (any order, plus ``rank_column``) with the stream's
types; ``cast=True`` casts (safely: an overflow is an error). A block that does not match fails its task with a
:class:`SchemaMismatchError` naming the column, and the job fails; no data is skipped.

**Catalogs and secrets.** ``catalog`` is a catalog *name* (resolved in each task by pyiceberg from ``.pyiceberg.yaml``
or ``PYICEBERG_CATALOG__<NAME>__*``, like any ``load_catalog(NAME)``, plus ``catalog_properties``, which must not hold
secrets) or a pyiceberg ``Catalog`` (its name and non-secret properties travel, see :class:`StreamRef`). Task payloads
never carry credentials: configure them on every node.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError

from lakestream_iceberg.connect.secrets import split_secrets
from lakestream_iceberg.errors import BatchError, ConfigError, MissingExtraError, ReadError, SchemaMismatchError
from lakestream_iceberg.format.checks import check_int
from lakestream_iceberg.read.follow import PY_CATALOG_IMPL, StreamRef
from lakestream_iceberg.stream import Stream
from lakestream_iceberg.write.writer import check_producer_id

RAY_EXTRA = "pip install 'lakestream-iceberg[ray]' (ray[data,train]==2.60.0)"

try:
    from ray.data import Datasink
    from ray.data.block import BlockAccessor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtraError(f"lakestream_iceberg.integrations.ray needs Ray Data, which is not installed; {RAY_EXTRA}") from exc

if TYPE_CHECKING:
    from ray.data._internal.execution.interfaces import TaskContext
    from ray.data.block import Block
    from ray.data.datasource.datasink import WriteResult

    from lakestream_iceberg.format.table import StreamTable

__all__ = ["LakestreamDatasink", "SinkReport", "StepFn", "TaskReport", "producer_id", "ray_train_dataset"]

StepFn = Callable[[pa.Table], Iterable[Sequence[pa.Table]]]
MAX_RUN_NAME = 100  # leaves room for "-<task_idx>" within a producer id's 128 characters


def producer_id(run_name: str, task_idx: int) -> str:
    """The producer id of write task ``task_idx`` of run ``run_name``: ``f"{run_name}-{task_idx}"``."""
    return f"{run_name}-{task_idx}"


@dataclass(frozen=True, kw_only=True)
class TaskReport:
    """What one write task did (``Datasink.write``'s return value).

    Attributes:
        task_idx: Ray Data's ``TaskContext.task_idx``.
        producer: The producer id, ``f"{run_name}-{task_idx}"``.
        steps: The step of each of the task's batches, seq order (``None`` for a replayed step GC collected).
        published: Steps this attempt published.
        duplicates: Steps an earlier attempt or run had published already (nothing was written for them).
        rows: Rows of the task's steps (all of them, published or replayed).
        pid: The worker process of the attempt that completed.
        commit_s: Seconds this attempt spent in ``Producer.commit`` (writing files and publishing).
    """

    task_idx: int
    producer: str
    steps: tuple[int | None, ...]
    published: int
    duplicates: int
    rows: int
    pid: int
    commit_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SinkReport:
    """What a whole ``write_datasink`` did (``LakestreamDatasink.report`` after the job)."""

    run_name: str
    stream: str
    tasks: tuple[TaskReport, ...]

    @property
    def published(self) -> int:
        return sum(t.published for t in self.tasks)

    @property
    def duplicates(self) -> int:
        return sum(t.duplicates for t in self.tasks)

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tasks)

    @property
    def steps(self) -> list[int]:
        """Every step the job's batches are published as, ascending."""
        return sorted(s for t in self.tasks for s in t.steps if s is not None)


_streams: dict[tuple[int, StreamRef], Stream] = {}
_streams_lock = threading.Lock()


def _open(ref: StreamRef) -> Stream:
    """The stream, opened once per worker process (a Ray worker runs many write tasks; one catalog engine each)."""
    key = (os.getpid(), ref)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = Stream.open(ref.catalog(), ref.identifier)
        return stream


class LakestreamDatasink(Datasink[TaskReport]):
    """A Ray Data sink that publishes a dataset's rows as global training steps, exactly once, while the job runs.

    Use with ``Dataset.write_datasink(sink)``. Read the module docstring for the exactly-once argument, what makes a
    re-run deterministic, and how rows become global batches.

    Args:
        catalog: A catalog name (resolved on every node by pyiceberg: ``.pyiceberg.yaml`` / ``PYICEBERG_CATALOG__*``)
            or a pyiceberg ``Catalog`` (its name and non-secret properties travel to the tasks).
        stream: The stream's identifier, ``"namespace.name"``.
        run_name: Names this job's producers (``f"{run_name}-{task_idx}"``): the same run name re-run publishes
            nothing twice; a new one publishes everything again.
        rows_per_step: Rows per global step (rows dealt round-robin, or by ``rank_column``, to the ranks).
        rank_column: Integer column with each row's rank (``0..world_size-1``), instead of round-robin.
        step_fn: ``block -> iterable of steps`` (each ``world_size`` pyarrow Tables), instead of ``rows_per_step``.
        drop_last: With ``rows_per_step``, drop a task's last rows when fewer than ``rows_per_step`` remain.
        cast: Cast each block to the stream's schema (safe casts only) instead of requiring the exact types.
        create: Create the stream when missing (``world_size`` required; schema: ``schema`` or the first block's).
        world_size: Ranks per step, for ``create`` (checked against the stream otherwise, when given).
        schema: The payload schema, for ``create`` (default: the first block's, minus ``rank_column``).
        properties: Table properties for ``create``.
        catalog_properties: Extra non-secret catalog properties, with a catalog name (secrets: pyiceberg config).
        branch: The branch to publish into.
        verify_replays: How a replayed step is checked against the published one: ``"rows"`` (read it back and compare
            the rows), ``"counts"`` (per-rank row counts only) or ``"off"`` (see the module docstring).

    Raises:
        ConfigError: An invalid argument (a run name that cannot be part of a producer id, both or neither of
            ``rows_per_step`` and ``step_fn``, a secret in ``catalog_properties``, ...).

    Example:
        >>> sink = LakestreamDatasink(catalog="prod", stream="train.batches", run_name="prep-v1",   # doctest: +SKIP
        ...                           rows_per_step=256, create=True, world_size=8)
        >>> ds.write_datasink(sink)                                                                  # doctest: +SKIP
        >>> sink.report.published, sink.report.steps[-1]                                             # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        catalog: str | Catalog,
        stream: str,
        run_name: str,
        rows_per_step: int | None = None,
        rank_column: str | None = None,
        step_fn: StepFn | None = None,
        drop_last: bool = False,
        cast: bool = False,
        create: bool = False,
        world_size: int | None = None,
        schema: pa.Schema | None = None,
        properties: Mapping[str, str] | None = None,
        catalog_properties: Mapping[str, str] | None = None,
        branch: str = "main",
        verify_replays: Literal["rows", "counts", "off"] = "rows",
    ) -> None:
        if not isinstance(run_name, str) or len(run_name) > MAX_RUN_NAME:
            raise ConfigError(f"run_name must be a string of at most {MAX_RUN_NAME} characters, got {run_name!r}")
        try:
            check_producer_id(run_name)
        except ConfigError:
            raise ConfigError(
                f"run_name {run_name!r} is invalid: it becomes part of producer ids (f'{{run_name}}-{{task_idx}}'), so use "
                "letters, digits, '.', '_' or '-', starting with a letter or digit"
            ) from None
        if (rows_per_step is None) == (step_fn is None):
            raise ConfigError("pass exactly one of rows_per_step= (rows dealt to the ranks) and step_fn= (block -> steps)")
        if rows_per_step is not None:
            rows_per_step = check_int(rows_per_step, what="rows_per_step", minimum=1)
        if step_fn is not None and not callable(step_fn):
            raise ConfigError(f"step_fn must be callable (block -> iterable of steps), got {type(step_fn).__name__}")
        if step_fn is not None and (rank_column is not None or drop_last):
            raise ConfigError("rank_column= and drop_last= apply to rows_per_step=, not to step_fn=")
        if rank_column is not None and not isinstance(rank_column, str):
            raise ConfigError(f"rank_column must be a column name, got {rank_column!r}")
        if world_size is not None:
            world_size = check_int(world_size, what="world_size", minimum=1)
        if create and world_size is None:
            raise ConfigError("create=True needs world_size= (ranks per step)")
        if schema is not None and not isinstance(schema, pa.Schema):
            raise ConfigError(f"schema must be a pyarrow.Schema, got {type(schema).__name__}")
        if not isinstance(stream, str) or not stream:
            raise ConfigError(f"stream must be the stream's identifier ('namespace.name'), got {stream!r}")
        if not isinstance(branch, str) or not branch:
            raise ConfigError(f"branch must be a branch name, got {branch!r}")
        self.run_name, self.rows_per_step, self.rank_column, self.step_fn = run_name, rows_per_step, rank_column, step_fn
        self.drop_last, self.cast, self.create, self.world_size = bool(drop_last), bool(cast), bool(create), world_size
        self.schema = None if schema is None else schema.remove_metadata()
        self.properties = dict(properties or {})
        if verify_replays not in ("rows", "counts", "off"):
            raise ConfigError(f"verify_replays must be 'rows', 'counts' or 'off', got {verify_replays!r}")
        self.branch, self.verify_replays = branch, verify_replays
        self._catalog: Catalog | None = None
        self._ref = self._address(catalog, stream, catalog_properties)
        self.report: SinkReport | None = None  # set on the driver when the job completes

    @staticmethod
    def _address(catalog: str | Catalog, stream: str, extra: Mapping[str, str] | None) -> StreamRef:
        if isinstance(catalog, Catalog):
            if extra:
                raise ConfigError("catalog_properties= applies to a catalog name; a Catalog object has its own properties")
            props = {k: v for k, v in catalog.properties.items() if isinstance(v, str)}
            if "type" not in props and PY_CATALOG_IMPL not in props:
                props[PY_CATALOG_IMPL] = f"{type(catalog).__module__}.{type(catalog).__qualname__}"
            public, _secret = split_secrets(props)  # the secrets stay here: tasks resolve them from their config
            return StreamRef(catalog.name, tuple(sorted(public.items())), stream)
        if not isinstance(catalog, str) or not catalog:
            raise ConfigError(f"catalog must be a catalog name or a pyiceberg Catalog, got {type(catalog).__name__}")
        public, secret = split_secrets({str(k): str(v) for k, v in (extra or {}).items()})
        if secret:
            raise ConfigError(
                f"catalog_properties holds secrets ({sorted(secret)}); they would travel inside Ray task payloads. Put "
                f"them in .pyiceberg.yaml or PYICEBERG_CATALOG__{catalog.upper().replace('-', '_')}__* on every node"
            )
        return StreamRef(catalog, tuple(sorted(public.items())), stream)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_catalog"] = None  # a live catalog (engine, HTTP session, maybe secrets) never travels
        return state

    @property
    def stream_ref(self) -> StreamRef:
        """The stream's address as the tasks see it (no secrets)."""
        return self._ref

    def get_name(self) -> str:
        return "Lakestream"

    # -- driver ---------------------------------------------------------------------------------------------------------
    def on_write_start(self, schema: pa.Schema | None = None) -> None:
        """On the driver, before the first task: create the stream (``create=True``) or check that it exists."""
        catalog = self._ref.catalog()
        if self.create:
            payload = self.schema if self.schema is not None else self._schema_of_first_block(schema)
            stream = Stream.create(catalog, self._ref.identifier, schema=payload, world_size=self.world_size or 1,
                                   properties=self.properties or None)
        else:
            try:
                stream = Stream.open(catalog, self._ref.identifier)
            except NoSuchTableError:
                raise ConfigError(
                    f"stream {self._ref.identifier} does not exist in catalog {self._ref.catalog_name!r}: create it with "
                    "Stream.create(...) or pass create=True, world_size=... to LakestreamDatasink"
                ) from None
            if self.world_size is not None and stream.world_size != self.world_size:
                raise ConfigError(f"stream {stream.name} has world_size {stream.world_size}, the sink was given "
                                  f"world_size={self.world_size}")
        self._check_against(stream)

    def _schema_of_first_block(self, schema: object) -> pa.Schema:
        if not isinstance(schema, pa.Schema):
            raise ConfigError(
                f"create=True could not take the stream's schema from the first block (Ray gave {type(schema).__name__}); "
                "pass schema=pyarrow.schema([...])"
            )
        found: pa.Schema = schema
        if self.rank_column is not None and self.rank_column in found.names:
            found = found.remove(found.get_field_index(self.rank_column))
        return found.remove_metadata()

    def _check_against(self, stream: StreamTable) -> None:
        if self.rank_column is not None and self.rank_column in stream.payload_arrow_schema.names:
            kind = stream.payload_arrow_schema.field(self.rank_column).type
            if not pa.types.is_integer(kind):
                raise ConfigError(f"rank_column {self.rank_column!r} is a {kind} column of {stream.name}; it must be integer")

    def on_write_complete(self, write_result: WriteResult[TaskReport]) -> None:
        reports = [r for r in write_result.write_returns if isinstance(r, TaskReport)]
        self.report = SinkReport(run_name=self.run_name, stream=self._ref.identifier,
                                 tasks=tuple(sorted(reports, key=lambda r: r.task_idx)))

    # -- tasks ----------------------------------------------------------------------------------------------------------
    def write(self, blocks: Iterable[Block], ctx: TaskContext) -> TaskReport:
        """One write task: form steps from its blocks and commit each with the next seq of producer ``run-task_idx``."""
        task_idx = check_int(ctx.task_idx, what="TaskContext.task_idx", minimum=0)
        producer_name = producer_id(self.run_name, task_idx)
        stream = _open(self._ref)
        producer = stream.producer(producer_name, branch=self.branch)
        where = f"Ray Data write task {task_idx} (producer {producer_name!r}) of stream {stream.name}"
        steps: list[int | None] = []
        published = duplicates = rows = 0
        commit_s = 0.0
        for seq, shards in enumerate(self._steps(blocks, stream, where)):
            started = time.monotonic()
            try:
                result = producer.commit(shards, seq=seq)
            except BatchError as exc:
                raise type(exc)(f"{where}, step seq {seq}: {exc}. The job fails rather than skip data") from exc
            commit_s += time.monotonic() - started
            rows += sum(s.num_rows for s in shards)
            steps.append(result.step)
            if result.duplicate:
                duplicates += 1
                if self.verify_replays != "off" and result.step is not None:
                    self._verify_replay(stream, result.step, shards, where, seq)
            else:
                published += 1
        return TaskReport(task_idx=task_idx, producer=producer_name, steps=tuple(steps), published=published,
                          duplicates=duplicates, rows=rows, pid=os.getpid(), commit_s=commit_s)

    def _verify_replay(self, stream: Stream, step: int, shards: Sequence[pa.Table], where: str, seq: int) -> None:
        try:
            files = stream.locate(step, branch=self.branch)
        except ReadError:
            return  # collected by GC since: nothing left to compare with
        published = [int(f.record_count) for f in files]
        replayed = [s.num_rows for s in shards]
        differs = f"{published} rows per rank, but this run formed {replayed}" if published != replayed else ""
        if not differs and self.verify_replays == "rows":
            for rank, shard in enumerate(shards):
                try:
                    stored = stream.read(step, rank=rank, branch=self.branch)
                except ReadError:
                    return  # collected by GC meanwhile
                if not all(a.equals(b) for a, b in zip(stored.columns, shard.columns)):
                    differs = f"other rows for rank {rank} than this run formed (same counts, {replayed})"
                    break
        if differs:
            raise BatchError(
                f"{where}: seq {seq} is already published as step {step} with {differs}: the job is not deterministic "
                "(input order, block count, or preprocessing differ from the run that published it). Nothing was "
                "published twice, but this run's rows for that step would be dropped. Use a new run_name to publish "
                "this data again, or make the job deterministic (override_num_blocks=, "
                "DataContext.execution_options.preserve_order=True, seeded preprocessing)"
            )

    def _steps(self, blocks: Iterable[Block], stream: StreamTable, where: str) -> Iterator[list[pa.Table]]:
        payload = stream.payload_arrow_schema
        world_size = stream.world_size
        if self.world_size is not None and world_size != self.world_size:
            raise ConfigError(f"{where}: the stream has world_size {world_size}, the sink was given {self.world_size}")
        if self.step_fn is not None:
            for block in blocks:
                table = self._conform(BlockAccessor.for_block(block).to_arrow(), payload, where)
                for shards in self.step_fn(table):
                    if isinstance(shards, (pa.Table, pa.RecordBatch)):
                        raise ConfigError(f"{where}: step_fn must yield steps (a sequence of {world_size} pyarrow Tables, "
                                          "one per rank), it yielded a single table")
                    yield list(shards)
            return
        assert self.rows_per_step is not None
        size = self.rows_per_step
        pending: list[pa.Table] = []
        held = 0
        for block in blocks:
            table = self._conform(BlockAccessor.for_block(block).to_arrow(), payload, where)
            if not table.num_rows:
                continue
            pending.append(table)
            held += table.num_rows
            while held >= size:
                rows = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
                pending, held = [rows.slice(size)], held - size
                yield self._deal(rows.slice(0, size), world_size, payload, where)
        if held and not self.drop_last:
            rows = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
            yield self._deal(rows, world_size, payload, where)

    def _conform(self, table: pa.Table, payload: pa.Schema, where: str) -> pa.Table:
        """The block with the stream's columns in the stream's order (plus the rank column), or a clear error."""
        extra = [self.rank_column] if self.rank_column is not None and self.rank_column not in payload.names else []
        want = payload.names + extra
        if sorted(table.column_names) != sorted(want):
            missing = [c for c in want if c not in table.column_names]
            unknown = [c for c in table.column_names if c not in want]
            raise SchemaMismatchError(
                f"{where}: a block has columns {table.column_names}, the stream expects {payload.names}"
                + (f" plus rank_column {self.rank_column!r}" if extra else "")
                + (f"; missing {missing}" if missing else "") + (f"; not in the stream {unknown}" if unknown else "")
                + ". Make the preprocessing return the stream's columns (select or drop them in map_batches); "
                "the job fails rather than skip data"
            )
        table = table.select(want)
        if self.cast:
            target = pa.schema([*payload, *(table.schema.field(c) for c in extra)])
            try:
                table = table.cast(target)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise SchemaMismatchError(f"{where}: a block cannot be cast to the stream's schema: {exc}") from None
        for name, field in zip(payload.names, payload):
            got = table.schema.field(name).type
            if not got.equals(field.type):
                raise SchemaMismatchError(
                    f"{where}: column {name!r} of a block is {got}, the stream expects {field.type}; cast it in the "
                    "preprocessing (or pass cast=True to LakestreamDatasink); the job fails rather than skip data"
                )
        # One schema for every block of the task (nullability and metadata as the stream's), so that rows of several
        # blocks concatenate into one step; nulls in required fields are refused by the commit's own check.
        columns, fields = table.columns, list(payload)
        if extra:
            ranks = columns[-1]
            if not pa.types.is_integer(ranks.type):
                raise SchemaMismatchError(f"{where}: rank_column {self.rank_column!r} is {ranks.type}; it must be integer")
            columns[-1] = ranks.cast(pa.int64())
            fields.append(pa.field(extra[0], pa.int64()))
        return pa.Table.from_arrays(columns, schema=pa.schema(fields))

    def _deal(self, rows: pa.Table, world_size: int, payload: pa.Schema, where: str) -> list[pa.Table]:
        if self.rank_column is None:
            if world_size == 1:
                return [rows]
            return [rows.take(np.arange(r, rows.num_rows, world_size)) for r in range(world_size)]
        ranks = rows.column(self.rank_column)
        low, high = pc.min_max(ranks).values()
        if ranks.null_count or low.as_py() < 0 or high.as_py() >= world_size:
            raise BatchError(
                f"{where}: rank_column {self.rank_column!r} holds {'nulls' if ranks.null_count else 'values'} outside "
                f"0..{world_size - 1} (min {low.as_py()}, max {high.as_py()}); fix the ranks in the preprocessing"
            )
        keep = payload.names
        return [rows.filter(pc.equal(ranks, r)).select(keep) for r in range(world_size)]


def ray_train_dataset(stream: StreamTable, *, checkpoint: str | None = None, follow: bool = True, **kwargs: Any) -> Any:
    """A ``LakestreamDataset`` for this Ray Train worker: rank and world size from ``ray.train.get_context()``.

    Call it inside ``train_loop_per_worker``. ``checkpoint`` resumes after a checkpoint tag
    (``LakestreamDataset.from_checkpoint``); other keyword arguments are ``LakestreamDataset``'s (``end_step=``,
    ``timeout=``, ``collate=``, ...).

    Example:
        >>> def train_loop(config):                                                    # doctest: +SKIP
        ...     for item in ray_train_dataset(config["stream"], end_step=config["steps"]):
        ...         loss = model(item["tokens"]) ...
    """
    import ray.train

    from lakestream_iceberg.read.dataset import LakestreamDataset

    try:
        context = ray.train.get_context()
        rank, world_size = context.get_world_rank(), context.get_world_size()
    except Exception as exc:  # outside a Ray Train worker
        raise ConfigError(f"ray_train_dataset must be called inside a Ray Train training function ({exc})") from None
    if checkpoint is not None:
        return LakestreamDataset.from_checkpoint(stream, checkpoint, rank=rank, world_size=world_size, follow=follow, **kwargs)
    return LakestreamDataset(stream, rank=rank, world_size=world_size, follow=follow, **kwargs)
