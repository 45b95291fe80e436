"""The Ray Data sink: each write task is a producer that commits the steps it forms, exactly once across retries (the
argument and Ray's evidence: :mod:`lakestream_iceberg.integrations.ray`)."""

from __future__ import annotations

import itertools
import logging
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.io.pyarrow import UnsupportedPyArrowTypeException
from ray.data import Datasink
from ray.data.block import BlockAccessor

from lakestream_iceberg.connect.secrets import split_secrets
from lakestream_iceberg.errors import (
    BatchError,
    ConfigError,
    ProducerConflictError,
    ReadError,
    SchemaMismatchError,
    StreamExistsError,
)
from lakestream_iceberg.format.checks import check_identifier, check_int, check_new_identifier
from lakestream_iceberg.format.file_settings import avro_codec, parquet_options
from lakestream_iceberg.format.layout import file_schema, table_arrow_schema
from lakestream_iceberg.format.properties import WORLD_SIZE, check_properties
from lakestream_iceberg.integrations.ray.plan import shape_write
from lakestream_iceberg.integrations.ray.replay import same_rows
from lakestream_iceberg.integrations.ray.reports import MAX_RUN_NAME, SinkReport, TaskReport, producer_id
from lakestream_iceberg.integrations.ray.steps import StepFn, StepRule
from lakestream_iceberg.integrations.ray.streams import open_stream
from lakestream_iceberg.read.stream_ref import PY_CATALOG_IMPL, StreamRef, travelling_properties
from lakestream_iceberg.stream import Stream
from lakestream_iceberg.write.writer import check_producer_id

if TYPE_CHECKING:
    from ray.data._internal.execution.interfaces import TaskContext
    from ray.data.block import Block
    from ray.data.datasource.datasink import WriteResult

    from lakestream_iceberg.format.table import StreamTable

__all__ = ["LakestreamDatasink"]

log = logging.getLogger(__name__)


def _icebergable(schema: pa.Schema, where: str, source: str) -> None:
    """Refuse, before anything is created, a schema that Iceberg cannot hold, with the column and the fix (pyiceberg's
    conversion, the one ``Stream.create`` makes, raises a bare ValueError or TypeError): a column that is all nulls in
    the block it was taken from (``pa.null()``), Ray's tensor columns (numpy arrays of more than one dimension per
    batch), ``timestamp[ns]`` unless pyiceberg is told to downcast it."""
    try:
        Catalog._convert_schema_if_needed(table_arrow_schema(schema))  # noqa: SLF001 - what Stream.create converts
    except (UnsupportedPyArrowTypeException, TypeError, ValueError) as exc:
        raise SchemaMismatchError(
            f"{where}: create=True cannot make the stream from {source} ({_columns(schema)}), which Iceberg cannot "
            f"hold: {str(exc).rstrip('.')}. "
            "Pass schema=pyarrow.schema([...]) with types Iceberg holds to LakestreamDatasink, and make the "
            "preprocessing return them, or pass cast=True where a block's type casts to one (a Ray tensor column to "
            "pyarrow.list_(pyarrow.float32(), n))"
        ) from None


def _columns(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


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
        create: Create the stream when missing (``world_size`` required; schema: ``schema``, created on the driver, or
            that of the first block a write task writes, created by that task).
        world_size: Ranks per step, for ``create`` (checked against the stream otherwise, when given).
        schema: The payload schema, for ``create`` (default: the first block's, minus ``rank_column``); checked
            against the stream otherwise, when given.
        properties: Table properties for ``create``; checked against a stream that exists (never changed).
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
        for name, flag in (("drop_last", drop_last), ("cast", cast), ("create", create)):
            if not isinstance(flag, bool):  # bool("false") is True: a string must not drop rows or create a stream
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if (rows_per_step is None) == (step_fn is None):
            raise ConfigError("pass exactly one of rows_per_step= (rows dealt to the ranks) and step_fn= (block -> steps)")
        if rows_per_step is not None:
            rows_per_step = check_int(rows_per_step, what="rows_per_step", minimum=1)
        if step_fn is not None and not callable(step_fn):
            raise ConfigError(f"step_fn must be callable (block -> iterable of steps), got {type(step_fn).__name__}")
        if step_fn is not None and (rank_column is not None or drop_last):
            raise ConfigError("rank_column= and drop_last= apply to rows_per_step=, not to step_fn=")
        if rank_column is not None and (not isinstance(rank_column, str) or not rank_column):
            raise ConfigError(f"rank_column must be a column name, got {rank_column!r}")
        if world_size is not None:
            world_size = check_int(world_size, what="world_size", minimum=1, maximum=WORLD_SIZE.maximum)
        if create and world_size is None:
            raise ConfigError("create=True needs world_size= (ranks per step)")
        if properties is not None and (not isinstance(properties, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in properties.items())):
            raise ConfigError(f"properties must be a dict of strings to strings (table properties, e.g. "
                              f"{{'lakestream.snapshots.retain-last': '64'}}), got {properties!r}"[:300])
        if catalog_properties is not None and not isinstance(catalog_properties, Mapping):
            raise ConfigError(f"catalog_properties must be a dict of catalog property names to values, got "
                              f"{type(catalog_properties).__name__}")
        if create:  # what Stream.create would refuse in every write task (the first one creates the stream): here
            check_new_identifier(check_identifier(stream))
        check_properties(dict(properties or {}))  # an unknown lakestream.* key, with or without create
        if schema is not None and not isinstance(schema, pa.Schema):
            raise ConfigError(f"schema must be a pyarrow.Schema, got {type(schema).__name__}")
        if not isinstance(stream, str) or not stream:
            raise ConfigError(f"stream must be the stream's identifier ('namespace.name'), got {stream!r}")
        if not isinstance(branch, str) or not branch:
            raise ConfigError(f"branch must be a branch name, got {branch!r}")
        self.run_name, self.rows_per_step, self.rank_column, self.step_fn = run_name, rows_per_step, rank_column, step_fn
        self.drop_last, self.cast, self.create, self.world_size = drop_last, cast, create, world_size
        self.schema = None if schema is None else schema.remove_metadata()
        self.properties = dict(properties or {})
        if verify_replays not in ("rows", "counts", "off"):
            raise ConfigError(f"verify_replays must be 'rows', 'counts' or 'off', got {verify_replays!r}")
        self.branch, self.verify_replays = branch, verify_replays
        self._catalog: Catalog | None = None
        self._ref = self._address(catalog, stream, catalog_properties)
        self.report: SinkReport | None = None  # set on the driver when the job completes (None again at each start)
        self._fused: bool | None = None  # what on_write_start saw of Ray's plan (None: not seen)
        self._plan_notes: list[str] = []

    @staticmethod
    def _address(catalog: str | Catalog, stream: str, extra: Mapping[str, str] | None) -> StreamRef:
        if isinstance(catalog, Catalog):
            if extra:
                raise ConfigError("catalog_properties= applies to a catalog name; a Catalog object has its own properties")
            props = travelling_properties(catalog.properties)
            if "type" not in props and PY_CATALOG_IMPL not in props:
                props[PY_CATALOG_IMPL] = f"{type(catalog).__module__}.{type(catalog).__qualname__}"
            public, secret = split_secrets(props)  # the secrets stay here: tasks resolve them from their config
            # their names travel: a task that lacks one says which (and one with its own key pair uses it whole)
            return StreamRef(catalog.name, tuple(sorted(public.items())), stream, withheld=tuple(sorted(secret)))
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
        """The sink's name in Ray's progress output and metrics.

        Returns:
            ``"Lakestream"``.
        """
        return "Lakestream"

    # -- driver ---------------------------------------------------------------------------------------------------------
    def on_write_start(self, schema: pa.Schema | None = None) -> None:
        """On the driver, before the first task: look at the write operator Ray built (:meth:`_shape_plan`), then create
        the stream (``create=True`` with ``schema=``) or check that it exists.

        ``schema`` (what Ray passes) is not used: it is the schema of the operator's *input* blocks, which in a fused
        read -> map_batches -> write operator is the read's (with Ray's internal columns), not what the sink receives.
        With ``create=True`` and no ``schema=``, the first write task creates the stream from the first block it
        writes.

        Args:
            schema: What Ray passes (unused, see above).

        Raises:
            ConfigError: The stream does not exist and ``create`` is false, its world size differs from
                ``world_size``, its schema from ``schema`` (without ``create``), the branch is not a branch, or ``rank_column`` is not an integer column.
            StreamExistsError: ``properties`` the existing stream holds other values of (with or without ``create``).
            SchemaMismatchError: Another engine dropped, renamed or retyped a payload column of the stream (as making a
                producer refuses).
        """
        self.report = None  # a sink used for another job: a failed one must not leave the last job's report
        self._shape_plan()
        catalog = self._ref.catalog()
        if self.create and self.schema is not None:
            _icebergable(self.schema, f"LakestreamDatasink for stream {self._ref.identifier}", "schema=")
            stream = Stream.create(catalog, self._ref.identifier, schema=self.schema, world_size=self.world_size or 1,
                                   properties=self.properties or None)
        else:
            try:
                stream = Stream.open(catalog, self._ref.identifier)
            except NoSuchTableError:
                if self.create:
                    return  # the first write task creates it, from the first block it writes (see _task_stream)
                raise ConfigError(
                    f"stream {self._ref.identifier} does not exist in catalog {self._ref.catalog_name!r}: create it with "
                    "Stream.create(...) or pass create=True, world_size=... to LakestreamDatasink"
                ) from None
            if self.world_size is not None and stream.world_size != self.world_size:
                raise ConfigError(f"stream {stream.name} has world_size {stream.world_size}, the sink was given "
                                  f"world_size={self.world_size}")
            if self.schema is not None and not stream.payload_arrow_schema.equals(self.schema):
                raise ConfigError(f"stream {stream.name} has schema ({_columns(stream.payload_arrow_schema)}), the sink "
                                  f"was given schema=({_columns(self.schema)}): blocks must have the stream's; pass "
                                  "its schema, or leave schema= out (it is for create=True)")
            if self.properties:  # checked as schema= is (they are not applied to a stream that exists): Stream.create
                # says which differ
                Stream.create(catalog, self._ref.identifier, schema=stream.payload_arrow_schema,
                              world_size=stream.world_size, properties=self.properties)
        self._check_against(stream)

    def _shape_plan(self) -> None:
        """What :func:`~lakestream_iceberg.integrations.ray.plan.shape_write` sees and does (batches as blocks when the
        write is fused; a warning when it is neither fused nor ordered)."""
        self._fused, notes = shape_write(self, run_name=self.run_name, rows_per_step=self.rows_per_step)
        self._plan_notes = list(notes)
        for note in notes:
            log.warning("%s", note)
            warnings.warn(note, RuntimeWarning, stacklevel=3)

    def _check_against(self, stream: StreamTable) -> None:
        # the table's file settings and the branch, once on the driver: not an error in every write task (and retry)
        stream.require_branch(self.branch, doing="the sink cannot write to")
        # a payload column another engine dropped, renamed or retyped: what making a producer refuses, once here
        file_schema(stream.table.schema(), stream.config.layout, stream.payload_arrow_schema, stream=stream.name)
        parquet_options(stream.table.metadata.properties, strict=False)
        avro_codec(stream.table.metadata.properties)
        if self.rank_column is not None and self.rank_column in stream.payload_arrow_schema.names:
            kind = stream.payload_arrow_schema.field(self.rank_column).type
            if not pa.types.is_integer(kind):
                raise ConfigError(f"rank_column {self.rank_column!r} is a {kind} column of {stream.name}; it must be integer")

    def on_write_complete(self, write_result: WriteResult[TaskReport]) -> None:
        """On the driver, after every task finished: set :attr:`report` from the tasks' reports.

        Args:
            write_result: Ray's result of the write, whose ``write_returns`` are the tasks' ``TaskReport`` s.
        """
        reports = [r for r in write_result.write_returns if isinstance(r, TaskReport)]
        self.report = SinkReport(run_name=self.run_name, stream=self._ref.identifier,
                                 tasks=tuple(sorted(reports, key=lambda r: r.task_idx)), fused=self._fused,
                                 warnings=tuple(self._plan_notes))

    # -- tasks ----------------------------------------------------------------------------------------------------------
    def write(self, blocks: Iterable[Block], ctx: TaskContext) -> TaskReport:
        """One write task: form steps from its blocks and commit each with the next seq of producer ``run-task_idx``.

        Args:
            blocks: The task's input blocks, in order.
            ctx: Ray Data's task context (its ``task_idx`` names the producer).

        Returns:
            The task's :class:`~lakestream_iceberg.integrations.ray.TaskReport`.

        Raises:
            SchemaMismatchError: A block does not have the stream's columns and types.
            BatchError: A replayed step differs from the published one (``verify_replays``), or a rank column is out
                of range.
            ProducerConflictError: Another job publishes under the same run name.
            CommitTimeoutError: A step could not be published in time (Ray then fails the task).
        """
        task_idx = check_int(ctx.task_idx, what="TaskContext.task_idx", minimum=0)
        producer_name = producer_id(self.run_name, task_idx)
        where = f"Ray Data write task {task_idx} (producer {producer_name!r}) of stream {self._ref.identifier}"
        tables: Iterator[pa.Table] = (BlockAccessor.for_block(block).to_arrow() for block in blocks)
        stream, tables = self._task_stream(tables, where)
        steps: list[int | None] = []
        published = duplicates = rows = raced = 0
        commit_s = 0.0
        if stream is None:  # create=True, the stream is missing and this task has no rows: nothing to publish
            return TaskReport(task_idx=task_idx, producer=producer_name, steps=(), published=0, duplicates=0, rows=0,
                              pid=os.getpid(), commit_s=0.0)
        producer = stream.producer(producer_name, branch=self.branch)
        for seq, shards in enumerate(self._steps(tables, stream, where)):
            started, settled = time.monotonic(), False
            try:
                result = producer.commit(shards, seq=seq)
            except BatchError as exc:
                raise type(exc)(f"{where}, step seq {seq}: {exc}. The job fails rather than skip data") from exc
            except ProducerConflictError as exc:
                producer = stream.producer(producer_name, branch=self.branch)  # a fresh view of the head
                result = self._settle_conflict(stream, producer, shards, seq, where, exc)
                raced, settled = raced + 1, True  # compared with the published step as verify_replays says
            commit_s += time.monotonic() - started
            rows += sum(s.num_rows for s in shards)
            steps.append(result.step)
            if result.duplicate:
                duplicates += 1
                if self.verify_replays != "off" and result.step is not None and not settled:
                    self._verify_replay(stream, result.step, shards, where, seq)
            else:
                published += 1
        return TaskReport(task_idx=task_idx, producer=producer_name, steps=tuple(steps), published=published,
                          duplicates=duplicates, rows=rows, pid=os.getpid(), commit_s=commit_s, raced=raced)

    def _task_stream(self, tables: Iterator[pa.Table], where: str) -> tuple[Stream | None, Iterator[pa.Table]]:
        """The stream, and the task's tables. With ``create=True`` and no ``schema=``, a missing stream is created
        here from the first block this task writes (what the sink receives, after every fused map): tasks that race
        to create it agree on one (``Stream.create`` opens the winner's), and each block is then checked against it."""
        try:
            return open_stream(self._ref), tables
        except NoSuchTableError:
            if not self.create:
                raise ConfigError(f"{where}: the stream does not exist (dropped while the job ran?); create it with "
                                  "Stream.create(...) or pass create=True, world_size=... to LakestreamDatasink") from None
        first = next((t for t in tables if t.num_rows), None)
        if first is None:
            return None, tables
        if not first.num_columns:
            raise ConfigError(f"{where}: create=True cannot take the stream's schema from a block without columns; "
                              "pass schema=pyarrow.schema([...]) to LakestreamDatasink")
        payload = self._payload_of(first.schema)
        _icebergable(payload, where, "the first block it writes")
        try:
            Stream.create(self._ref.catalog(), self._ref.identifier, schema=payload,
                          world_size=self.world_size or 1, properties=self.properties or None)
        except StreamExistsError:
            pass  # another task created it from its first block (other nullability, or another schema: conform says)
        stream = open_stream(self._ref)
        self._check_against(stream)
        return stream, itertools.chain([first], tables)

    def _payload_of(self, found: pa.Schema) -> pa.Schema:
        if self.rank_column is not None and self.rank_column in found.names:
            found = found.remove(found.get_field_index(self.rank_column))
        return found.remove_metadata()

    def _settle_conflict(self, stream: Stream, producer: Any, shards: Sequence[pa.Table], seq: int, where: str,
                         conflict: ProducerConflictError) -> Any:
        """Another attempt of this task (a zombie: a worker that outlived its lost node, publishing while the retry
        starts) committed this seq at the same moment, or staged it after this attempt began. The same rows published
        under this producer id and seq are a replay, not a conflict; other rows are a real conflict (two jobs sharing a
        run name), and fail the task. As for any replay, ``verify_replays`` says what is compared: with ``"counts"``
        the rows per rank, with ``"off"`` nothing."""
        result = producer.commit(shards, seq=seq)  # published: answered from the head, nothing written
        if result.step is None or self.verify_replays == "off":
            return result  # collected by GC since (nothing left to compare with), or no check asked for
        differs = self._replay_difference(stream, result.step, shards, mode=self.verify_replays)
        if differs:
            raise ProducerConflictError(
                f"{where}, seq {seq}: another attempt or job published this seq as step {result.step} with {differs}. "
                f"Two jobs are using run_name {self.run_name!r} at once: give each job its own run_name ({conflict})"
            ) from conflict
        log.info("%s, seq %s: published at the same moment by another attempt of this task, with the same rows: "
                 "a replay", where, seq)
        return result

    def _steps(self, tables: Iterable[pa.Table], stream: StreamTable, where: str) -> Iterator[list[pa.Table]]:
        world_size = stream.world_size
        if self.world_size is not None and world_size != self.world_size:
            raise ConfigError(f"{where}: the stream has world_size {world_size}, the sink was given {self.world_size}")
        rule = StepRule(rows_per_step=self.rows_per_step, step_fn=self.step_fn, rank_column=self.rank_column,
                        drop_last=self.drop_last, cast=self.cast)
        return rule.steps(tables, payload=stream.payload_arrow_schema, world_size=world_size, where=where)

    def _verify_replay(self, stream: Stream, step: int, shards: Sequence[pa.Table], where: str, seq: int) -> None:
        differs = self._replay_difference(stream, step, shards, mode=self.verify_replays)
        if differs:
            raise BatchError(
                f"{where}: seq {seq} is already published as step {step} with {differs}: the job is not deterministic "
                "(input order, block count, or preprocessing differ from the run that published it). Nothing was "
                "published twice, but this run's rows for that step would be dropped. Use a new run_name to publish "
                "this data again, or make the job deterministic (override_num_blocks=, "
                "DataContext.execution_options.preserve_order=True, seeded preprocessing)"
            )

    def _replay_difference(self, stream: Stream, step: int, shards: Sequence[pa.Table], *, mode: str) -> str:
        """How the published ``step`` differs from ``shards`` ("" when it holds them, or is gone)."""
        try:
            with stream.step_files(step, branch=self.branch) as files:
                published = files.counts
        except (ReadError, FileNotFoundError):
            return ""  # collected by GC since: nothing left to compare with
        replayed = [s.num_rows for s in shards]
        if published != replayed:
            return f"{published} rows per rank, but this run formed {replayed}"
        if mode == "rows":
            for rank, shard in enumerate(shards):
                try:
                    stored = stream.read(step, rank=rank, branch=self.branch)
                except ReadError:
                    return ""  # collected by GC meanwhile
                if not same_rows(stored, shard):
                    return f"other rows for rank {rank} than this run formed (same counts, {replayed})"
        return ""
