"""Consumer lag, per rank, as ``kafka-consumer-groups --describe`` shows it: what ``lakestream lag`` and the history's
``consumers`` view report.

Each recorded position (:mod:`lakestream_iceberg.read.consumer`) becomes one :class:`ConsumerLag` row:

* ``lag_steps``: the head step of the position's branch minus the last step the rank delivered; negative when the
  branch moved back below that step (another engine's rollback: the steps past the head that the rank delivered left
  the branch; ``error`` says so, and ``lag_s`` is None);
* ``lag_s``: how long ago the oldest step it has not delivered was committed (0 when caught up; where that step's
  snapshot was expired, the oldest retained step after it stands in, so the figure is a lower bound; None when no
  snapshot that published a step after it is retained, as right after a GC);
* ``data_wait_fraction``: the share of the rank's time since it started (or resumed) that the training loop waited for
  data;
* ``status``: ``active``; ``stale`` when the rank has not reported for ``stale_after`` times its report interval (a
  killed or hung process); ``closed`` when it finished or was closed cleanly; ``gone`` when the position belongs to
  another world size than the group's newest incarnation (a rank index that a shrink removed, or one not yet restarted
  after a resize), or to a table since dropped and made again at the same location; ``invalid`` when the stored
  document does not parse (``error`` says why). ``active``, ``stale`` and ``closed`` rows have a lag (a closed
  rank's grows as the head moves past where it stopped, as Kafka shows the lag of a group with no member); a gone rank
  shows its last position without a lag.

:func:`delete_group` deletes a group's positions on demand (``kafka-consumer-groups --delete``), refusing while a rank
of the group is ``active``; groups silent for ``lakestream.consumers.retention-ms`` expire by themselves (see
:mod:`lakestream_iceberg.connect.positions`).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyiceberg.table.refs import SnapshotRefType

from lakestream_iceberg.connect.integers import parse_int
from lakestream_iceberg.connect.positions import PositionStore
from lakestream_iceberg.errors import ConfigError, ConsumerGroupActiveError, CorruptStateError, LakestreamError
from lakestream_iceberg.format.lineage import is_lakestream
from lakestream_iceberg.format.summary import KEY_OP, KEY_STEP, OP_APPEND
from lakestream_iceberg.read.position import Position, check_group

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["CONSUMERS_SCHEMA", "DEFAULT_STALE_AFTER", "ConsumerLag", "consumer_lags", "consumers_table", "delete_group"]

log = logging.getLogger(__name__)

DEFAULT_STALE_AFTER = 3.0
_TS = pa.timestamp("ms", tz="UTC")
CONSUMERS_SCHEMA = pa.schema([
    ("group", pa.string()), ("rank", pa.int32()), ("status", pa.string()), ("world_size", pa.int32()),
    ("branch", pa.string()), ("last_step", pa.int64()), ("head_step", pa.int64()), ("lag_steps", pa.int64()),
    ("lag_s", pa.float64()), ("data_wait_fraction", pa.float64()), ("wait_s", pa.float64()), ("elapsed_s", pa.float64()),
    ("steps", pa.int64()), ("read_bytes", pa.int64()), ("age_s", pa.float64()), ("started_at", _TS),
    ("report_s", pa.float64()), ("host", pa.string()), ("pid", pa.int64()), ("workers", pa.int32()),
    ("source", pa.string()), ("error", pa.string()),
])


@dataclass(frozen=True)
class ConsumerLag:
    """One rank's position and lag (see the module docstring); ``None`` where not known."""

    group: str
    rank: int
    status: str
    world_size: int | None = None
    branch: str | None = None
    last_step: int | None = None
    head_step: int | None = None
    lag_steps: int | None = None
    lag_s: float | None = None
    data_wait_fraction: float | None = None
    wait_s: float | None = None
    elapsed_s: float | None = None
    steps: int | None = None
    read_bytes: int | None = None
    age_s: float | None = None
    started_at: datetime | None = None
    report_s: float | None = None
    host: str | None = None
    pid: int | None = None
    workers: int | None = None
    source: str | None = None
    error: str | None = None


class _Branch:
    """A branch's head step and the commit times of its retained steps (from the metadata in hand: no I/O)."""

    def __init__(self, stream: StreamTable, branch: str) -> None:
        metadata = stream.table.metadata
        self.head: int | None = None
        self.steps: list[int] = []
        self.times: list[float] = []
        self.problem: str | None = None  # why there is no head to measure a lag against
        ref = metadata.refs.get(branch)
        if ref is None or ref.snapshot_ref_type != SnapshotRefType.BRANCH or metadata.snapshot_by_name(branch) is None:
            self.problem = (f"{branch!r} is no branch of the stream now (dropped, or never made): no head to measure a "
                            "lag against")
            return
        try:
            self.head = stream.branch_state(branch=branch, metadata=metadata).step
        except LakestreamError as exc:
            self.problem = f"the head of branch {branch!r} cannot be read: {' '.join(str(exc).split())}"
            return
        by_id = {s.snapshot_id: s for s in metadata.snapshots}
        current = metadata.snapshot_by_name(branch)
        found: dict[int, float] = {}
        passed: set[int] = set()
        while current is not None:
            if current.snapshot_id in passed:  # parent links that loop (another engine's): the steps above are dated
                log.warning("the ancestry of branch %r of %s loops back to snapshot %d; steps below it are not dated "
                            "(lag_s None)", branch, stream.name, current.snapshot_id)
                break
            passed.add(current.snapshot_id)
            summary = current.summary.additional_properties if current.summary is not None else {}
            # only a snapshot that published steps dates them: a collect, checkpoint or repair snapshot carries the
            # head's; a step lakestream never writes (" 5", another engine's) dates none
            # another engine's snapshot that copied a lakestream snapshot's keys (lineage.is_lakestream) published
            # nothing either: it dated the copied step at its own, later, time
            appended = summary.get(KEY_OP, OP_APPEND) == OP_APPEND and is_lakestream(current)
            step = parse_int(summary.get(KEY_STEP), minimum=0, plus=False) if appended else None
            if step is not None and step not in found:
                found[step] = current.timestamp_ms / 1000
            current = by_id.get(current.parent_snapshot_id) if current.parent_snapshot_id is not None else None
        for step in sorted(found):
            self.steps.append(step)
            self.times.append(found[step])

    def lag_s(self, last_step: int, now: float) -> float | None:
        if self.head is None:
            return None
        if last_step >= self.head:
            return 0.0
        i = bisect.bisect_right(self.steps, last_step)  # the oldest retained step the rank has not delivered
        return None if i == len(self.steps) else max(0.0, now - self.times[i])


def consumer_lags(stream: StreamTable, *, group: str | None = None, stale_after: float = DEFAULT_STALE_AFTER,
                  now: float | None = None) -> list[ConsumerLag]:
    """Every recorded position of ``group`` (every group when None) on ``stream``, with its lag, ordered by group and
    rank. Uses the stream's metadata as it is (refresh it first for the current head).

    Example:
        >>> [(c.rank, c.status, c.lag_steps) for c in consumer_lags(stream, group="run-42")]   # doctest: +SKIP
        [(0, 'active', 2), (1, 'stale', 40)]

    Raises:
        ConfigError: ``stale_after`` is not a positive number, or ``group`` is no group name (a dataset's ``group=``
            refuses it, so no position has it: the listing said there were none).
    """
    _check_stale_after(stale_after)
    if group is not None:
        check_group(group)
    store = _store(stream)
    now = time.time() if now is None else now
    uuid = str(stream.table.metadata.table_uuid)
    parsed: list[tuple[Any, Position | None, str | None]] = []
    for row in store.rows(group=group):
        try:
            parsed.append((row, Position.parse(row.body, group=row.group, rank=row.rank), None))
        except CorruptStateError as exc:
            parsed.append((row, None, str(exc)))
    newest: dict[str, Position] = {}  # per group, the position of the newest incarnation (its world size is current)
    for _, position, _ in parsed:
        if position is not None and position.stream == uuid:
            seen = newest.get(position.group)
            if seen is None or position.started_at > seen.started_at:
                newest[position.group] = position
    branches: dict[str, _Branch] = {}
    out = []
    for row, position, error in parsed:
        if position is None:
            out.append(ConsumerLag(group=row.group, rank=row.rank, status="invalid", age_s=row.age_s, error=error))
            continue
        if position.stream != uuid or position.world_size != newest[position.group].world_size:
            status = "gone"
        elif position.closed:
            status = "closed"
        elif row.age_s > stale_after * position.report_s:
            status = "stale"
        else:
            status = "active"
        branch = branches.get(position.branch) or branches.setdefault(position.branch, _Branch(stream, position.branch))
        last = position.last_step
        lagging = status != "gone" and branch.head is not None
        delivered = 0 if last is None else last
        # past the head: the branch moved back (another engine's rollback) below steps the rank delivered, which
        # left the branch; a negative lag, as kafka-consumer-groups shows after a truncation, never "caught up"
        behind = branch.head - delivered if lagging and branch.head is not None else None
        moved_back = behind is not None and behind < 0
        error = None if position.stream == uuid else \
            f"recorded for table UUID {position.stream}, a table since dropped at this location"
        if error is None and status != "gone" and branch.problem is not None:
            error = branch.problem
        if moved_back and error is None and behind is not None:
            error = (f"the head of branch {position.branch!r} (step {branch.head}) is below the last step the rank "
                     f"delivered: the branch moved back (rolled back) since, and steps {delivered + behind + 1}-{delivered} "
                     "it delivered are no longer on it (or the stream's view is older than the position: refresh it)")
        out.append(ConsumerLag(
            group=row.group, rank=row.rank, status=status, world_size=position.world_size, branch=position.branch,
            last_step=last, head_step=branch.head if position.stream == uuid else None,
            lag_steps=behind,
            lag_s=branch.lag_s(delivered, now) if lagging and not moved_back else None,
            data_wait_fraction=min(1.0, position.wait_s / position.elapsed_s) if position.elapsed_s > 0 else None,
            wait_s=position.wait_s, elapsed_s=position.elapsed_s, steps=position.steps, read_bytes=position.read_bytes,
            age_s=row.age_s, started_at=datetime.fromtimestamp(position.started_at, tz=timezone.utc),
            report_s=position.report_s, host=position.host, pid=position.pid, workers=position.workers,
            source=position.source, error=error))
    return out


def delete_group(stream: StreamTable, *, group: str, force: bool = False,
                 stale_after: float = DEFAULT_STALE_AFTER) -> int:
    """Delete every recorded position of ``group`` on ``stream`` (rows of the catalog's database, or objects under the
    table location), as ``kafka-consumer-groups --delete`` does; returns how many were deleted (0: none recorded).

    A rank that is still reporting would write its row again at its next report, so the deletion is refused while a
    rank of the group is ``active`` (reported within ``stale_after`` times its report interval, not closed) unless
    ``force``. Stale, closed, gone and invalid ranks do not hold the group.

    Example:
        >>> delete_group(stream, group="run-41")   # doctest: +SKIP
        8

    Raises:
        ConsumerGroupActiveError: A rank of the group is active and ``force`` is false (nothing deleted).
        ConfigError: ``group`` is not a group name, ``force`` not a bool, or ``stale_after`` not positive.
    """
    check_group(group)
    if not isinstance(force, bool):
        raise ConfigError(f"force must be True or False, not {force!r}")
    _check_stale_after(stale_after)
    if not force:
        active = [c.rank for c in consumer_lags(stream, group=group, stale_after=stale_after) if c.status == "active"]
        if active:
            shown = ", ".join(map(str, active[:8])) + (f" and {len(active) - 8} more" if len(active) > 8 else "")
            raise ConsumerGroupActiveError(
                f"consumer group {group!r} of {stream.name} is still reading: rank(s) {shown} reported within the last "
                f"{stale_after:g} report intervals, and would write their positions again. Stop the group's ranks "
                "first (lakestream lag shows them stale or closed then), or delete anyway with force=True "
                "(lakestream lag --delete --force)")
    removed = _store(stream).delete(group=group)
    log.info("deleted %d consumer positions of group %r on %s", removed, group, stream.name)
    return removed


def _store(stream: StreamTable) -> PositionStore:
    return PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)


def _check_stale_after(stale_after: object) -> None:
    if isinstance(stale_after, bool) or not isinstance(stale_after, (int, float)) or not stale_after > 0:
        raise ConfigError(f"stale_after must be a positive number of report intervals, got {stale_after!r}")


def consumers_table(stream: StreamTable, *, stale_after: float = DEFAULT_STALE_AFTER) -> pa.Table:
    """Every group's positions as an Arrow table (the history's ``consumers`` view); empty, with a warning, when the
    positions cannot be listed (the other views do not depend on them)."""
    try:
        rows = consumer_lags(stream, stale_after=stale_after)
    except Exception as exc:  # noqa: BLE001 - informative only, like the staged-batch count of ``lakestream status``
        log.warning("the consumers view of %s is empty: listing its consumer positions failed (%s)", stream.name, exc)
        rows = []
    return pa.Table.from_pylist([asdict(c) for c in rows], schema=CONSUMERS_SCHEMA)
