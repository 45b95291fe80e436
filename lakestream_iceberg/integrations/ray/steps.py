"""How a write task's rows become global batches: ``rows_per_step`` rows dealt to the ranks (round-robin or by a rank
column), or a user ``step_fn``; every block conformed to the stream's schema first. Pure pyarrow: no Ray here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lakestream_iceberg.errors import BatchError, ConfigError, SchemaMismatchError
from lakestream_iceberg.format.batches import map_keys_unmasked

__all__ = ["StepFn", "StepRule"]

StepFn = Callable[[pa.Table], Iterable[Sequence[pa.Table]]]
"""A ``step_fn``: takes one block, returns (or yields) its steps, each a sequence of ``world_size`` pyarrow Tables."""


@dataclass(frozen=True)
class StepRule:
    """The rule a :class:`~lakestream_iceberg.integrations.ray.LakestreamDatasink` was given (see its arguments).

    Attributes:
        rows_per_step: Rows per step, or None with ``step_fn``.
        step_fn: The user's :data:`StepFn`, or None with ``rows_per_step``.
        rank_column: The integer column naming each row's rank, or None for round-robin.
        drop_last: Drop a task's last rows when fewer than ``rows_per_step`` remain.
        cast: Cast blocks to the stream's schema (safe casts only).
    """

    rows_per_step: int | None
    step_fn: StepFn | None
    rank_column: str | None
    drop_last: bool
    cast: bool

    def steps(self, tables: Iterable[pa.Table], *, payload: pa.Schema, world_size: int,
              where: str) -> Iterator[list[pa.Table]]:
        """The global batches (one pyarrow Table per rank each) that a task's blocks, in order, form.

        Args:
            tables: The task's blocks, in order; blocks without rows are skipped (whatever their columns).
            payload: The stream's payload schema.
            world_size: Ranks per step.
            where: Names the task in error messages.

        Returns:
            An iterator of steps, each a list of ``world_size`` tables.

        Raises:
            SchemaMismatchError: A block does not fit the stream's schema.
            BatchError: A rank column value outside ``0..world_size-1``.
            ConfigError: ``step_fn`` returned something other than steps of ``world_size`` tables.
        """
        # A block without rows holds nothing to publish, and Ray hands the sink one *without columns* where a
        # filter, flat_map or generator emptied a task's input: skipped before it is checked (it failed the task with
        # "missing [every column]"), and never passed to a step_fn (an empty step would depend on Ray's blocking)
        tables = (block for block in tables if block.num_rows)
        if self.step_fn is not None:
            for block in tables:
                table = self.conform(block, payload, where)
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
        for block in tables:
            table = self.conform(block, payload, where)
            pending.append(table)
            held += table.num_rows
            while held >= size:
                rows = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
                pending, held = [rows.slice(size)], held - size
                yield self.deal(rows.slice(0, size), world_size, payload, where)
        if held and not self.drop_last:
            rows = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
            yield self.deal(rows, world_size, payload, where)

    def conform(self, table: pa.Table, payload: pa.Schema, where: str) -> pa.Table:
        """The block with the stream's columns in the stream's order (plus the rank column), or a clear error.

        Args:
            table: One block.
            payload: The stream's payload schema.
            where: Names the task in error messages.

        Returns:
            The conformed block.

        Raises:
            SchemaMismatchError: A column is missing or has another type (and cannot be cast with ``cast=True``), or
                the rank column is not an integer column.
            BatchError: A rank column value beyond int64 (no rank of any world size).
        """
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
            # pyarrow < 26 aborts the process casting a map whose keys carry a validity bitmap (take() and filter()
            # make them; so do Ray's operators) to another key type: the writer's own fix (format/batches.py) comes
            # after this cast, so the keys lose it here first (zero-copy, every pyarrow: the property is testable)
            table = map_keys_unmasked(table)
            # only the columns whose type differs: pyarrow's cast of a nested column to its own type refuses a null
            # that a non-nullable field holds under a null parent (take() with a null index makes them), which Arrow
            # allows, no reader sees, and the writer fills (format/batches.py): cast=True refused what cast=False took
            for i, want in enumerate(target):
                if table.schema.field(i).type.equals(want.type):
                    continue
                try:
                    table = table.set_column(i, want, table.column(i).cast(want.type))
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                    raise SchemaMismatchError(f"{where}: a block cannot be cast to the stream's schema: column "
                                              f"{want.name!r}: {exc}") from None
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
            try:
                columns[-1] = ranks.cast(pa.int64())
            except pa.ArrowInvalid:  # a uint64 rank beyond int64: no rank of any world size
                raise BatchError(f"{where}: rank_column {self.rank_column!r} holds values beyond int64 (max "
                                 f"{pc.max(ranks).as_py()}); fix the ranks in the preprocessing") from None
            fields.append(pa.field(extra[0], pa.int64()))
        return pa.Table.from_arrays(columns, schema=pa.schema(fields))

    def deal(self, rows: pa.Table, world_size: int, payload: pa.Schema, where: str) -> list[pa.Table]:
        """One step's rows dealt to the ranks: round-robin (row ``j`` to rank ``j % world_size``) or by the rank column.

        Args:
            rows: The step's rows, conformed.
            world_size: Ranks per step.
            payload: The stream's payload schema (the rank column is dropped unless it is a stream column).
            where: Names the task in error messages.

        Returns:
            ``world_size`` tables, one per rank.

        Raises:
            BatchError: A rank column value outside ``0..world_size-1``.
        """
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
        keep = rows.select(payload.names)
        if world_size == 1:
            return [keep]
        # One stable sort by rank, then a slice per rank: each rank's rows in their order, as a filter per rank gave
        # them, for O(n log n + world_size) instead of O(n x world_size) (4,096 ranks, 1M rows: 1.1 s a step).
        grouped = keep.take(pc.sort_indices(ranks))
        ends = np.cumsum(np.bincount(ranks.to_numpy(), minlength=world_size)).tolist()
        return [grouped.slice(start, end - start) for start, end in zip([0, *ends[:-1]], ends, strict=True)]
