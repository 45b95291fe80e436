"""What the sink does to the write operator Ray Data built, in ``on_write_start`` (on the driver, before the operator's
transformer is serialized: Ray's ``MapOperator._map_transformer_ref`` is created lazily so that an ``on_start`` hook
may change it). Read against Ray 2.60.0's source (``plan_write_op.py``, ``map_operator.py``, ``map_transformer.py``,
``output_buffer.py``); with another layout nothing is changed and nothing is warned about."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["shape_write"]


def shape_write(sink: object, *, run_name: str, rows_per_step: int | None = None) -> tuple[bool | None, tuple[str, ...]]:
    """Look at the operator whose first input called ``sink.on_write_start``; returns whether the write is fused with
    the transform that feeds it (None: not seen) and what to warn about.

    * Fused: Ray's block shaping is turned off for the output of the transform that feeds the write, so every batch
      the preprocessing returns or yields reaches the sink as its own block. With the default 128 MiB target block
      size Ray merged a task's batches into one block: the task published all its steps at its end, and a batch that
      lacked a nullable column was merged with nulls filled in. A row-wise transform (``Dataset.map``, ``flat_map``,
      ``filter`` with a function) outputs one row at a time: turning shaping off made every row a block (a ``step_fn``
      was called once per row, and each row went through the sink's per-block work, 4-8x slower). Its output is cut
      into blocks of ``rows_per_step`` rows instead (each step's block reaches the sink once the next row is
      mapped), and left to Ray's shaping with ``step_fn``.
    * Fed by another operator (not fused with it, or fused but fed by one: Ray 2.60's ``read_parquet`` is a ListFiles
      operator feeding ``ReadFiles->...->Write``), ``preserve_order`` off: write tasks receive their inputs in
      completion order (ListFiles lists files so), so a re-run under the same run name may give a task index other
      rows (``verify_replays`` then fails it): a warning. Only a write fed straight from the input is in input order.
    * ``DataContext.max_errored_blocks`` other than 0: Ray ignores that many failed tasks, write tasks included, and
      the job succeeds with their rows from the failure on unpublished (nothing in the sink's report showed it): a
      warning.
    """
    op = _calling_operator()
    notes = _errored_blocks(op, run_name)
    if op is None:  # called by hand, or another Ray version: nothing to shape (docs/guide/producers.md says what to set)
        return None, notes
    transforms = op._map_transformer.get_transform_fns()  # noqa: SLF001 - see the module docstring
    write_at = next((i for i, t in enumerate(transforms) if _is_write_transform(t, sink)), None)
    if write_at is None:
        return None, notes
    fused = write_at > 0
    if fused:
        _stream_batches(transforms[write_at - 1], rows_per_step)
    from ray.data._internal.execution.operators.input_data_buffer import InputDataBuffer

    upstream = op.input_dependencies[0] if op.input_dependencies else None
    if isinstance(upstream, InputDataBuffer) or op.data_context.execution_options.preserve_order:
        return fused, notes  # blocks reach the write in input order: task i gets the same rows in every run
    name = getattr(upstream, "name", "?")
    fed = (f"the write (fused with the transforms before it) is fed by another operator ({name}; Ray 2.60's "
           "read_parquet lists files in completion order)" if fused else
           f"the write is not fused with the operator before it ({name})")
    return fused, (
        *notes,
        f"LakestreamDatasink (run {run_name!r}): {fed} and DataContext.execution_options.preserve_order is off, so "
        "write tasks receive their inputs in completion order: a re-run with the same run_name may give a task index "
        "other rows, which verify_replays then refuses (nothing is published twice, but the re-run fails). Set "
        "ray.data.DataContext.get_current().execution_options.preserve_order = True before building the dataset"
        + ("" if fused else ", or keep the write fused with the map (no concurrency= on map_batches or "
           "write_datasink, the same ray_remote_args)"),
    )


def _errored_blocks(op: Any, run_name: str) -> tuple[str, ...]:
    from ray.data import DataContext

    context = op.data_context if op is not None else DataContext.get_current()
    allowed = getattr(context, "max_errored_blocks", 0)
    if allowed == 0:
        return ()
    return (
        f"LakestreamDatasink (run {run_name!r}): DataContext.max_errored_blocks is {allowed}, so Ray ignores "
        f"{'every' if allowed < 0 else f'up to {allowed}'} failed task(s), write tasks included: the job then succeeds "
        "while a failed write task's rows from its failure on are not published (sink.report lists the tasks that "
        "completed). Set max_errored_blocks = 0 for the write, or re-run the job with the same run_name, which "
        "publishes what is missing and nothing twice",
    )


def _calling_operator() -> Any:
    """The Ray Data ``MapOperator`` whose ``_notify_first_input`` called ``on_write_start`` (directly, or through the
    ``fused_on_start`` of operator fusion), or None."""
    try:
        from ray.data._internal.execution.operators.map_operator import MapOperator
    except ImportError:  # pragma: no cover - another Ray version
        return None
    frame: Any = sys._getframe(1)  # noqa: SLF001
    for _ in range(8):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, MapOperator):
            return candidate
        frame = frame.f_back
    return None


def _is_write_transform(transform: Any, sink: object) -> bool:
    """Whether ``transform`` is the one ``plan_write_op.generate_write_fn`` made for ``sink`` (its closure holds it)."""
    fn = getattr(transform, "_fn", None)
    cells = getattr(fn, "__closure__", None) or ()
    return any(_cell(c) is sink for c in cells)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _stream_batches(transform: Any, rows_per_step: int | None) -> None:
    """Make ``transform`` hand each output batch on as its own block (``disable_block_shaping``), or a row-wise
    transform blocks of ``rows_per_step`` rows (Ray's shaping with ``step_fn``), unless the job asked for a row count
    per block or turned shaping off itself."""
    from ray.data._internal.execution.operators.map_transformer import RowMapTransformFn
    from ray.data._internal.output_buffer import OutputBlockSizeOption

    option = getattr(transform, "_output_block_size_option", None)
    if option is not None and (option.disable_block_shaping or option.target_num_rows_per_block is not None):
        return
    if isinstance(transform, RowMapTransformFn):  # its output "batches" are single rows
        if rows_per_step is not None:
            transform._output_block_size_option = OutputBlockSizeOption.of(  # noqa: SLF001
                target_max_block_size=option.target_max_block_size if option is not None else None,
                target_num_rows_per_block=rows_per_step)
        return
    transform._output_block_size_option = OutputBlockSizeOption.of(disable_block_shaping=True)  # noqa: SLF001
