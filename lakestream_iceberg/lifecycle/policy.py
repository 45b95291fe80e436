"""What GC is asked and may do, checked before it plans: which checkpoints a retention policy keeps
(:func:`retained`), the policy's arguments (:func:`check_policy`), the grace period (:func:`grace_seconds`, the GC
grace rule of docs/guide/retention.md), and a table whose files may be shared (:func:`refuse_shared_files`).
:mod:`lakestream_iceberg.lifecycle.gc` plans and runs the collection with them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime, timedelta

from lakestream_iceberg.errors import ConfigError, LifecycleError
from lakestream_iceberg.format.checkpoints import Checkpoint
from lakestream_iceberg.format.checks import check_int
from lakestream_iceberg.format.layout import GRACE_PER_COMMIT_TIMEOUT, PROP_COMMIT_TIMEOUT_MS, PROP_GC_GRACE_MS, StreamConfig
from lakestream_iceberg.format.properties import GC_ENABLED

__all__ = ["check_policy", "grace_seconds", "refuse_shared_files", "retained"]


def retained(checkpoints: list[Checkpoint], *, keep_last: int | None, keep_within: timedelta | None, now: datetime) -> list[Checkpoint]:
    """The checkpoints the policy keeps: the newest ``keep_last`` of each branch and those younger than
    ``keep_within`` (every one when both are None).

    Newest by commit order (the anchors' sequence numbers), then creation time: ``created_at`` is the clock of the host
    that made each checkpoint, and one made later on a host whose clock runs behind looked older, so ``keep_last``
    released the checkpoint a trainer would resume from and kept an older one."""
    if keep_last is None and keep_within is None:
        return list(checkpoints)
    newest = sorted(checkpoints, key=lambda c: (c.sequence_number or 0, c.created_at, c.step), reverse=True)
    keep: set[str] = set()
    if keep_last is not None:  # of each branch: a fork's checkpoints never release the last ones of the run it forked
        by_branch: dict[str, list[Checkpoint]] = defaultdict(list)  # grouped once: thousands of forks, each with some
        for c in newest:
            by_branch[c.branch].append(c)
        for newest_first in by_branch.values():
            keep.update(c.name for c in newest_first[:keep_last])
    if keep_within is not None:
        keep.update(c.name for c in checkpoints if now - c.created_at <= keep_within)
    return [c for c in checkpoints if c.name in keep]


def check_policy(keep_last: int | None, keep_within: timedelta | None) -> int | None:
    """Validate the retention arguments; ``keep_last`` as an int (numpy integers accepted, bools refused)."""
    if keep_last is not None:
        keep_last = check_int(keep_last, what="keep_last", error=LifecycleError, minimum=1, hint="or None")
    if keep_within is not None and (not isinstance(keep_within, timedelta) or keep_within.total_seconds() < 0):
        raise LifecycleError(f"keep_within must be a non-negative datetime.timedelta (or None), got {keep_within!r}")
    return keep_last


def grace_seconds(grace: timedelta | None, config: StreamConfig, *, allow_short: bool,
                  current: StreamConfig | None = None) -> float:
    """The grace period GC uses: ``grace``, or ``lakestream.gc.grace-period-ms`` when None.

    ``config``: the stream's settings as it was opened (its own producers commit with them); ``current``: as the
    table's properties say now (producers opened since commit with them). Another engine may change the grace period
    and the commit timeout while a stream lives (a GC run by a long-lived process): the longer of the two grace
    periods is used, and an explicit ``grace`` is checked against the longer commit timeout.

    The GC grace rule (docs/guide/retention.md): a grace shorter than ``GRACE_PER_COMMIT_TIMEOUT`` x ``lakestream.commit.timeout-ms`` can
    delete the files of a batch that a commit in flight still publishes, so it is refused unless ``allow_short``: the
    explicit opt-in for quiescent tables (no producer running: tests, benchmarks, maintenance windows).

    Raises:
        ConfigError: ``grace`` is not a non-negative ``timedelta``, or is too short without ``allow_short``.
    """
    configs = [config] if current is None else [config, current]
    if grace is None:
        return max(c.gc_grace_s for c in configs)  # each property itself obeys the rule (StreamConfig)
    if not isinstance(grace, timedelta) or grace.total_seconds() < 0:
        raise ConfigError(f"grace must be a non-negative datetime.timedelta (or None), got {grace!r}")
    need_s = GRACE_PER_COMMIT_TIMEOUT * max(c.commit_timeout_s for c in configs)
    if grace.total_seconds() < need_s and not allow_short:
        raise ConfigError(
            f"grace={grace} is shorter than {GRACE_PER_COMMIT_TIMEOUT} x {PROP_COMMIT_TIMEOUT_MS} ({need_s:g}s): with "
            "producers running, GC could delete the files of a batch that a commit is about to publish. Leave grace "
            f"unset (the stream's {PROP_GC_GRACE_MS}), or pass allow_short_grace=True only when no producer is running"
        )
    return grace.total_seconds()


def refuse_shared_files(properties: Mapping[str, str], name: str, *, doing: str, left: str, instead: str) -> None:
    """Refuse (:class:`LifecycleError`) to delete the files of a table whose ``gc.enabled`` is false: Iceberg's mark of
    files possibly shared with other tables (Spark's snapshot and migrate procedures set it; Spark's expire_snapshots,
    remove_orphan_files and purge refuse such tables)."""
    if GC_ENABLED.get(properties):
        return
    raise LifecycleError(
        f"{name} has table property {GC_ENABLED.key}=false: another engine or a person marked its files as possibly "
        "shared with other tables (Spark's snapshot and migrate procedures set it; Spark's expire_snapshots, "
        f"remove_orphan_files and Iceberg's purge refuse such tables), and {doing}. {left}. Set {GC_ENABLED.key}=true "
        f"once no other table references its files; {instead}"
    )
