"""A stream's batch history as DuckDB views: which producer built step S, what rank 3 saw, why commits slowed down.

:func:`history` reads what the table knows (the branch head's manifests, the retained snapshots' summaries, the
checkpoint tags) into Arrow tables and registers them as views of an in-memory DuckDB connection:

=============== ==========================================================================================================
``batches``     one row per step: ``step, snapshot_id, parent_id, producer, seq, committed_at, attempts, committer,
                group_size, ranks, samples, bytes, samples_per_rank, bytes_per_rank, retained, collected``
                (``committer``: the producer whose compare-and-swap published the step, ``group_size``: how many steps
                that one swap published; see :mod:`lakestream_iceberg.write.staging`; packed layout:
                ``samples_per_rank`` and ``bytes_per_rank`` are NULL, the per-rank rows are in the step file's footer,
                ``stream.step_files(step).counts``)
``files``       one row per data file: ``path, step, rank, records, bytes, producer, seq, snapshot_id`` (``rank`` is
                NULL for a packed layout's file, which holds every rank)
``producers``   ``producer, last_seq, last_step, last_snapshot_id, commits, lag, active`` (``lag`` = head step -
               ``last_step``; ``active``: in the head's summary, else compacted into a producer-state file)
``checkpoints`` every checkpoint (all branches): ``name, branch, step, snapshot_id, source_snapshot_id, created_at,
                pinned_steps, pinned_files, pinned_bytes, exclusive_steps, exclusive_bytes`` (see :func:`checkpoint_rows`)
``snapshots``   every retained snapshot of the branch: ``snapshot_id, parent_id, committed_at, op, operation, step,
                producer, seq, attempts, committer, group_size, summary`` (JSON of the whole Iceberg summary)
``consumers``   every consumer group's recorded positions (all branches): ``group, rank, status, world_size, branch,
                last_step, head_step, lag_steps, lag_s, data_wait_fraction, wait_s, elapsed_s, steps, read_bytes, age_s,
                started_at, report_s, host, pid, workers, source, error`` (see :mod:`lakestream_iceberg.read.lag`)
``samples``     the data itself for ``samples_steps`` (default: the head step), payload columns plus ``_step``, ``_rank``
=============== ==========================================================================================================

What expiry loses. Commits expire old snapshots in passing (``lakestream.snapshots.retain-last``, see
:mod:`lakestream_iceberg.format.expiry`); a step whose snapshot was expired is still a row of ``batches``, rebuilt from the
head's manifests: its files, ranks, records and bytes, the id of the snapshot that added them (manifest entries keep
it), and producer and seq (parsed from the data file path ``<location>/data/<producer>/<seq:012d>-<token>-r<rank>``).
What is gone with the snapshot: ``committed_at``, ``attempts``, ``committer``, ``group_size``, ``parent_id`` (NULL; ``retained`` is false), and the
snapshot's full summary (no row in ``snapshots``). pyiceberg also clears ``parent_id`` of the oldest retained snapshot
once its parent is expired.

What lifecycle GC loses. GC (:mod:`lakestream_iceberg.lifecycle.gc`) removes the steps below the oldest retained
checkpoint from the head's manifests, deletes their data files and expires every snapshot that named them: those steps
leave ``batches``, ``files`` and ``samples`` entirely (a step still named by a retained snapshot but no longer in the
manifests shows ``collected`` true with NULL file columns). ``producers`` comes from the head snapshot's producer
table, so it stays complete whatever was expired or collected: ``last_seq + 1`` is what a producer ever published,
while ``commits`` counts only the steps ``batches`` still knows. Released checkpoints leave ``checkpoints``.

Example:
    >>> con = history(stream)                                                     # doctest: +SKIP
    >>> con.sql("SELECT producer, count(*) FROM batches GROUP BY 1").fetchall()    # doctest: +SKIP
    [('prep-0', 12), ('prep-1', 12)]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

from lakestream_iceberg.errors import ConfigError, MissingExtraError
from lakestream_iceberg.format.checks import check_int
from lakestream_iceberg.format.table import after_gc
from lakestream_iceberg.read.history_rows import (
    adder_rows,
    batch_rows,
    checkpoint_rows,
    file_rows,
    live_entries,
    producer_rows,
    read_samples,
    snapshot_rows,
)
from lakestream_iceberg.read.history_schemas import (
    BATCHES_SCHEMA,
    CHECKPOINTS_SCHEMA,
    FILES_SCHEMA,
    PRODUCERS_SCHEMA,
    SNAPSHOTS_SCHEMA,
)
from lakestream_iceberg.read.lag import consumers_table

if TYPE_CHECKING:
    import duckdb

    from lakestream_iceberg.format.table import StreamTable

__all__ = ["VIEWS", "collect", "history", "import_duckdb", "register_consumers", "register_samples"]

VIEWS = ("batches", "files", "producers", "checkpoints", "snapshots", "consumers", "samples")
# -- the public entry point ---------------------------------------------------------------------------------------------
def import_duckdb() -> Any:
    try:
        import duckdb
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise MissingExtraError(
            "stream history needs DuckDB, which is not installed; install it with: pip install 'lakestream-iceberg[duckdb]'"
        ) from exc
    return duckdb


def history(
    stream: StreamTable,
    *,
    branch: str = "main",
    samples_steps: tuple[int, int] | None = None,
    samples: bool = True,
    refresh: bool = True,
    progress: bool = False,
    consumers: bool = True,
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the stream's history as views (see the module docstring for columns).

    Args:
        stream: The stream.
        branch: Whose history: the branch head's manifests and its retained ancestors.
        samples_steps: Inclusive ``(first, last)`` step range loaded into the ``samples`` view (clipped to the steps
            the table still holds). ``None`` loads the head step only: ``samples`` reads data files, everything else
            reads metadata.
        samples: Register the ``samples`` view now; with False, add it later with :func:`register_samples`.
        refresh: Reload table metadata from the catalog first.
        progress: Show a progress bar (on a terminal) while reading samples.
        consumers: Register the ``consumers`` view now (it lists every recorded position of every group: one row, or
            one object read, per rank); with False, add it later with :func:`register_consumers`.

    Returns:
        A ``duckdb.DuckDBPyConnection``; views: ``batches, files, producers, checkpoints, snapshots, consumers,
        samples``.

    Raises:
        MissingExtraError: DuckDB is not installed (``pip install 'lakestream-iceberg[duckdb]'``).

    Example:
        >>> con = history(stream, samples_steps=(1, 10))                              # doctest: +SKIP
        >>> con.sql("SELECT producer, count(*) FROM batches GROUP BY 1").fetchall()   # doctest: +SKIP
        [('prep-0', 12), ('prep-1', 12)]
        >>> con.sql("SELECT _rank, count(*) FROM samples GROUP BY 1 ORDER BY 1").fetchall()  # doctest: +SKIP
    """
    duckdb = import_duckdb()
    if refresh:
        stream.refresh()
    stream.require_branch(branch, doing="no history of")
    samples_steps = _step_range(samples_steps)
    con = duckdb.connect()
    # a file GC deleted since the view was read: once more on the fresh head (a file still listed is MissingFileError)
    tables = after_gc(lambda: collect(stream, branch=branch, refresh=False, consumers=consumers), refresh=stream.refresh)
    for name, table in tables.items():
        con.register(name, table)
    if samples:
        register_samples(con, stream, branch=branch, samples_steps=samples_steps, progress=progress)
    return con


def _step_range(steps: object) -> Any:
    """``steps`` as an inclusive ``(first, last)`` step range, 1 <= first <= last, or None."""
    if steps is None:
        return None
    if not isinstance(steps, (tuple, list)) or len(steps) != 2:
        raise ConfigError(f"samples_steps must be a (first, last) pair of steps, got {steps!r}")
    first = check_int(steps[0], what="samples_steps first", minimum=1, hint="steps start at 1")
    last = check_int(steps[1], what="samples_steps last", minimum=first, hint="last >= first")
    return first, last


def register_samples(
    con: duckdb.DuckDBPyConnection, stream: StreamTable, *, branch: str = "main", samples_steps: tuple[int, int] | None = None,
    progress: bool = False,
) -> None:
    """(Re)register the ``samples`` view of ``con`` with the data of ``samples_steps`` (default: the head step)."""
    step_range = None if samples_steps is None else _step_range(samples_steps)

    def samples() -> pa.Table:
        entries = live_entries(stream, branch=branch)
        live_steps = sorted({int(e.data_file.partition[0]) for e in entries})
        if step_range is None:
            wanted = live_steps[-1:]
        else:
            wanted = [s for s in live_steps if step_range[0] <= s <= step_range[1]]
        return read_samples(stream, entries, steps=wanted, progress=progress)

    table = after_gc(samples, refresh=stream.refresh)
    con.register("samples", table.cast(duckdb_schema(table.schema)))


def register_consumers(con: duckdb.DuckDBPyConnection, stream: StreamTable) -> None:
    """(Re)register the ``consumers`` view of ``con``: every consumer group's recorded positions (all branches)."""
    con.register("consumers", consumers_table(stream))


def duckdb_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with what DuckDB cannot register as a view made a type it can: a half-float (which a stream holds,
    Iceberg storing it as a float) becomes a float32, which holds every half-float value, NaN too."""
    return pa.schema([field.with_type(_duckdb_type(field.type)) for field in schema], metadata=schema.metadata)


def _duckdb_type(kind: pa.DataType) -> pa.DataType:
    if pa.types.is_float16(kind):
        return pa.float32()
    if pa.types.is_fixed_size_list(kind):
        return pa.list_(kind.value_field.with_type(_duckdb_type(kind.value_type)), kind.list_size)
    if pa.types.is_large_list(kind):
        return pa.large_list(kind.value_field.with_type(_duckdb_type(kind.value_type)))
    if pa.types.is_map(kind):
        return pa.map_(kind.key_field.with_type(_duckdb_type(kind.key_type)),
                       kind.item_field.with_type(_duckdb_type(kind.item_type)), kind.keys_sorted)
    if pa.types.is_list(kind):
        return pa.list_(kind.value_field.with_type(_duckdb_type(kind.value_type)))
    if pa.types.is_struct(kind):
        return pa.struct([kind.field(i).with_type(_duckdb_type(kind.field(i).type)) for i in range(kind.num_fields)])
    return kind


def collect(stream: StreamTable, *, branch: str = "main", refresh: bool = True,
            consumers: bool = True) -> dict[str, pa.Table]:
    """The metadata views (all but ``samples``; ``consumers`` only with ``consumers``) as Arrow tables keyed by view
    name."""
    state = stream.state(branch=branch, refresh=refresh)
    entries = live_entries(stream, branch=branch)
    files = file_rows(entries, world_size=stream.world_size)
    snapshots = snapshot_rows(stream, branch=branch)
    batches = batch_rows(files, snapshots, adder_rows(stream, files, snapshots))
    tables = {
        "batches": pa.Table.from_pylist(batches, schema=BATCHES_SCHEMA),
        "files": pa.Table.from_pylist(files, schema=FILES_SCHEMA),
        "producers": pa.Table.from_pylist(producer_rows(state, batches, stream.io), schema=PRODUCERS_SCHEMA),
        "checkpoints": pa.Table.from_pylist(checkpoint_rows(stream, {branch: entries}), schema=CHECKPOINTS_SCHEMA),
        "snapshots": pa.Table.from_pylist(snapshots, schema=SNAPSHOTS_SCHEMA),
    }
    if consumers:
        tables["consumers"] = consumers_table(stream)
    return tables
