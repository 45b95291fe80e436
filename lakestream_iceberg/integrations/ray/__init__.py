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
  ``tests/integrations/test_ray.py::test_killed_write_task_publishes_no_duplicate_and_no_gap`` SIGKILLs a write task's worker after
  its first steps were published and checks the outcome from the table.
* ``on_write_start`` runs on the driver when the first input bundle is ready, before the operator's transformer
  (holding this sink) is serialized (``MapOperator._map_transformer_ref`` is created lazily, after ``on_start``), and
  ``on_write_complete`` runs on the driver after every task finished. The schema Ray passes to ``on_write_start`` is
  that of the operator's *input* bundle: in a fused ``read -> map_batches -> Write`` operator, the read's (with Ray's
  internal ``__file_chunk_metadata`` column) or the pre-map columns, never what the sink receives. The sink ignores it.

**What the sink does to Ray's plan** (:func:`~lakestream_iceberg.integrations.ray.plan.shape_write`, in
``on_write_start``, on the operator that called it, before its transformer is serialized):

* **Fused write: every batch is its own block.** Ray's output buffer merges the batches a transform returns or yields
  into blocks of ``DataContext.target_max_block_size`` (128 MiB by default), so with the defaults a task's steps were
  formed only when its whole block arrived: the head jumped ``0 -> 1 -> 4 -> 8 -> 12`` as tasks finished. The sink turns
  block shaping off for the transform that feeds the write (``OutputBlockSizeOption(disable_block_shaping=True)``,
  unless the job set a row count per block): a generator UDF's chunks reach the sink as they are yielded, and each
  step is published as soon as its rows exist (``SinkReport.fused`` says whether this applied). The blocks stay in the
  task's process (fused), so nothing more goes through the object store. A row-wise transform (``Dataset.map``,
  ``flat_map``, ``filter`` with a function) outputs single rows, not batches: its output is cut into blocks of
  ``rows_per_step`` rows instead (left to Ray's shaping with ``step_fn``), not into one block per row.
* **Fed by another operator, not ordered: a warning.** When the write is not fused with the operator before it
  (``map_batches(concurrency=...)``, ``write_datasink(concurrency=...)``, other remote args, a repartition), or is
  fused but its operator is fed by another one (Ray 2.60's ``read_parquet`` is a ``ListFiles`` operator feeding
  ``ReadFiles->MapBatches->Write``, and lists files in completion order: observed, a task's files came in another
  order in each run), and ``preserve_order`` is off, write tasks get their inputs in completion order, so a re-run
  with the same run name may give a task index other rows (``verify_replays`` then fails it: safe, but surprising).
  The sink warns at start (``RuntimeWarning``, logged, and in ``SinkReport.warnings``) naming the fix. Reading
  straight from the input (``from_arrow``, ``from_items``, ...: no operator before the write's) keeps the input order
  and is not warned about.
* **Failed tasks ignored: a warning.** With ``DataContext.max_errored_blocks`` other than 0, Ray ignores failed
  tasks, write tasks included: the job succeeds while a failed write task's rows from its failure on are not
  published. The sink warns at start in the same way; a re-run with the same run name publishes what is missing.

So the steps a task forms depend only on its input blocks, and exactly once holds across task retries and worker
deaths (a worker killed mid-commit leaves an outcome-unknown commit or a staged intent: the retry's commit of the same
seq is reconciled from the table, see docs/concepts.md, "Group commit").

**A zombie attempt.** A worker whose node is lost can outlive its raylet for a moment and keep publishing while Ray
starts the retry elsewhere. When both attempts commit the same seq at the same moment, or the zombie stages a seq
after the retry began, the retry's commit finds that seq published under its producer id with a batch it did not
write (``ProducerConflictError``: two processes with one producer id committing an identical batch lost this race in
20 of 20 trials, and the job failed). The sink then checks the published step as it checks any replay
(``verify_replays``): the same rows (``"rows"``, the default) or rows per rank (``"counts"``) are a replay (counted in
``TaskReport.duplicates`` and ``TaskReport.raced``); others are a real conflict (two jobs running under one run name)
and fail the task with ``ProducerConflictError``. With ``"off"`` the published step is taken as it is.

**Re-running a job** (the driver died, or the job is run again) with the **same run name** publishes nothing twice
provided each ``task_idx`` receives the same rows in the same order as before. That holds when

* the input is read in a deterministic order with a fixed block count (``override_num_blocks=``; the default
  parallelism depends on the cluster's CPUs, so another cluster size would cut other blocks),
* ``DataContext.get_current().execution_options.preserve_order = True`` unless the write's operator reads straight
  from the input (otherwise blocks reach the Write operator, and get their ``task_idx``, in completion order, and a
  ``read_parquet`` lists its files in completion order even when fused; the sink warns at start when it sees this), and
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
:class:`SchemaMismatchError` naming the column, and the job fails; no data is skipped. A block without rows is skipped
whatever its columns (Ray hands the sink one without columns where a ``filter``, ``flat_map`` or generator emptied a
task's input), and ``step_fn`` is never called with one. With a fused write every batch
of the preprocessing is its own block, so a batch that lacks a column fails the job. A batch merged with others
*before* the sink sees it (by an upstream operator of an unfused write) is another matter: Ray fills a missing
nullable column with nulls when it merges, and the sink cannot tell those from real nulls; declare such a column
required (``nullable=False`` in the stream's schema) and a filled-in null fails the task (``BatchError``).

**Creating the stream.** ``create=True, world_size=W`` with ``schema=`` creates it on the driver, before any task. Without
``schema=`` the first write task with rows creates it from the first block it writes (what the preprocessing
returned, minus ``rank_column``): tasks that race to create it agree on one (``Stream.create`` opens the winner's),
and a job that fails before any block reaches the sink creates nothing. For a stream that exists, ``schema=``,
``world_size=`` and ``properties=`` are checked against it on the driver, before any task runs (never changed).

**Catalogs and secrets.** ``catalog`` is a catalog *name* (resolved in each task by pyiceberg from ``.pyiceberg.yaml``
or ``PYICEBERG_CATALOG__<NAME>__*``, like any ``load_catalog(NAME)``, plus ``catalog_properties``, which must not hold
secrets) or a pyiceberg ``Catalog`` (its name and non-secret properties travel, see :class:`StreamRef`). Task payloads
never carry credentials: configure them on every node.
"""

from __future__ import annotations

from lakestream_iceberg.errors import MissingExtraError

RAY_EXTRA = "pip install 'lakestream-iceberg[ray]' (ray[data,train]==2.60.0)"

try:
    import ray.data  # noqa: F401 - the extra is installed: the modules below import what they need
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtraError(f"lakestream_iceberg.integrations.ray needs Ray Data, which is not installed; {RAY_EXTRA}") from exc

from lakestream_iceberg.integrations.ray.reports import SinkReport, TaskReport, producer_id  # noqa: E402
from lakestream_iceberg.integrations.ray.sink import LakestreamDatasink  # noqa: E402
from lakestream_iceberg.integrations.ray.steps import StepFn, StepRule  # noqa: E402
from lakestream_iceberg.integrations.ray.train import ray_train_dataset  # noqa: E402

__all__ = ["LakestreamDatasink", "SinkReport", "StepFn", "StepRule", "TaskReport", "producer_id", "ray_train_dataset"]
