"""What a Ray Data write with :class:`~lakestream_iceberg.integrations.ray.LakestreamDatasink` did: per write task and
for the whole job, and how a task's producer id is named."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_RUN_NAME", "SinkReport", "TaskReport", "producer_id"]

MAX_RUN_NAME = 100  # leaves room for "-<task_idx>" within a producer id's 128 characters


def producer_id(run_name: str, task_idx: int) -> str:
    """The producer id of write task ``task_idx`` of run ``run_name``: ``f"{run_name}-{task_idx}"``.

    Args:
        run_name: The sink's ``run_name``.
        task_idx: Ray Data's ``TaskContext.task_idx``.

    Returns:
        The producer id.
    """
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
        raced: Steps another attempt of this task published with the same rows at the same moment as this one (a
            zombie attempt whose node was lost): replays, counted in ``duplicates``.
    """

    task_idx: int
    producer: str
    steps: tuple[int | None, ...]
    published: int
    duplicates: int
    rows: int
    pid: int
    commit_s: float = 0.0
    raced: int = 0


@dataclass(frozen=True, kw_only=True)
class SinkReport:
    """What a whole ``write_datasink`` did (``LakestreamDatasink.report`` after the job).

    Attributes:
        run_name: The sink's ``run_name``.
        stream: The stream's identifier.
        tasks: Every write task's report, by task index.
        fused: Whether Ray fused the write with the transform that feeds it (then each batch that transform returns
            reaches the sink as its own block, and steps stream as they are formed); None when the sink could not see
            Ray's plan.
        warnings: What ``on_write_start`` warned about (a write whose re-run may give a task index other rows).
    """

    run_name: str
    stream: str
    tasks: tuple[TaskReport, ...]
    fused: bool | None = None
    warnings: tuple[str, ...] = ()

    @property
    def published(self) -> int:
        """Steps the job published (its tasks' ``published``, summed)."""
        return sum(t.published for t in self.tasks)

    @property
    def duplicates(self) -> int:
        """Steps the job found published already and skipped (replays)."""
        return sum(t.duplicates for t in self.tasks)

    @property
    def rows(self) -> int:
        """Rows of every step the job formed."""
        return sum(t.rows for t in self.tasks)

    @property
    def steps(self) -> list[int]:
        """Every step the job's batches are published as, ascending."""
        return sorted(s for t in self.tasks for s in t.steps if s is not None)
