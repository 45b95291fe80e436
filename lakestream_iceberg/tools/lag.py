"""``lakestream lag STREAM --group RUN``: each trainer rank's position and lag, like ``kafka-consumer-groups --describe``.

The rows come from :func:`lakestream_iceberg.read.lag.consumer_lags` (their meaning is documented there); this module
prints them: a summary per group and a table per rank for people, one JSON document with ``--json``.
``--delete`` deletes a group's positions instead (:func:`lakestream_iceberg.read.lag.delete_group`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from lakestream_iceberg.tools.output import MAX_HUMAN_ROWS, Output

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["COLUMNS", "delete_positions", "lag_report", "show_lag"]

MAX_NOTES = 20  # ranks whose error is printed under the table
# with more rows than the table shows, the ranks that need a look come first: unreadable, silent, then the most behind
ATTENTION = {"invalid": 0, "stale": 1, "active": 2, "closed": 3, "gone": 4}
COLUMNS = ["rank", "status", "last_step", "head_step", "lag_steps", "lag_s", "data_wait", "read_MB", "age_s", "host",
           "pid"]


def lag_report(stream: StreamTable, *, group: str | None, stale_after: float) -> dict[str, Any]:
    """What ``lakestream lag`` reports (also its ``--json`` document): the stream, the groups with their rank counts by
    status, the ranks of their world size with no record (``unreported``) and their largest lag, and one row per rank."""
    from lakestream_iceberg.read.lag import consumer_lags

    stream.refresh()
    rows = consumer_lags(stream, group=group, stale_after=stale_after)
    by_group: dict[str, list[Any]] = {}  # one pass over the positions, not one per group
    for r in rows:
        by_group.setdefault(r.group, []).append(r)
    groups = []
    for name in sorted(by_group):
        mine = by_group[name]
        counts = Counter(r.status for r in mine)
        lags = [r.lag_steps for r in mine if r.lag_steps is not None]  # gone ranks have none
        world = max((r.world_size for r in mine if r.status != "gone" and r.world_size), default=None)
        # ranks of the world size with no record at all: never started (or hung before making their dataset), which
        # no row of the table shows. A position's rank is below its world size (Position.parse), so the recorded ranks
        # of that world size are counted, not every rank of it walked (a world size may be up to 2**31 - 1)
        seen = {r.rank for r in mine if r.status != "gone" and r.world_size == world}
        unreported = None if world is None else world - len(seen)
        groups.append({"group": name, "ranks": dict(sorted(counts.items())), "world_size": world,
                       "unreported": unreported, "max_lag_steps": max(lags, default=None)})
    return {"stream": stream.name, "stale_after_reports": stale_after, "groups": groups,
            "positions": [asdict(r) for r in rows]}


def delete_positions(stream: StreamTable, out: Output, *, group: str, force: bool, stale_after: float) -> None:
    """``lakestream lag STREAM --group RUN --delete [--force]``: delete the group's positions and say how many."""
    from lakestream_iceberg.read.lag import delete_group

    removed = delete_group(stream, group=group, force=force, stale_after=stale_after)
    if out.json:
        out.emit_json({"stream": stream.name, "group": group, "deleted": removed})
    else:
        out.console.print(f"deleted {removed} recorded position(s) of group {group!r} on {stream.name}"
                          if removed else f"no recorded positions of group {group!r} on {stream.name}: nothing deleted")


def show_lag(report: dict[str, Any], out: Output, *, group: str | None) -> None:
    """Print ``report`` (from :func:`lag_report`)."""
    if out.json:
        out.emit_json(report)
        return
    if not report["positions"]:
        out.console.print(f"no recorded positions on {report['stream']}" + (f" for group {group!r}" if group else "")
                          + " (a LakestreamDataset records them when made with group=...)", soft_wrap=True)
        return
    for g in report["groups"]:
        counts = ", ".join([f"{n} {status}" for status, n in g["ranks"].items()]
                           + ([f"{g['unreported']} never reported"] if g["unreported"] else []))
        out.console.print(f"group {g['group']} on {report['stream']}: world size {g['world_size']}, ranks: {counts}, "
                          f"max lag {g['max_lag_steps'] if g['max_lag_steps'] is not None else '-'} steps", soft_wrap=True)
    rows = []
    for p in report["positions"]:
        wait = p["data_wait_fraction"]
        rows.append({**p, "data_wait": None if wait is None else f"{100 * wait:.1f}%",
                     "read_MB": None if p["read_bytes"] is None else round(p["read_bytes"] / 1e6, 2),
                     "lag_s": None if p["lag_s"] is None else round(p["lag_s"], 2),
                     "age_s": None if p["age_s"] is None else round(p["age_s"], 1)})
    if len(rows) > MAX_HUMAN_ROWS:  # by rank, a job of 1,000 ranks showed ranks 0-49, whatever the others were doing
        rows.sort(key=lambda r: (ATTENTION.get(r["status"], len(ATTENTION)), -(r["lag_steps"] or 0), r["group"],
                                 r["rank"]))
        out.console.print(f"{len(rows):,} ranks: those invalid, then stale, then the most behind first", soft_wrap=True)
    out.table(rows, columns=COLUMNS if len(report["groups"]) == 1 else ["group", *COLUMNS])
    # why a rank is invalid or gone (or past a head that moved back): a table cell would fold it beyond reading
    notes = [p for p in report["positions"] if p["error"]]
    for p in notes[:MAX_NOTES]:  # as written: an error quotes names and values that rich would read as markup
        out.console.print(f"group {p['group']} rank {p['rank']} ({p['status']}): {p['error']}", markup=False, soft_wrap=True)
    if len(notes) > MAX_NOTES:
        out.console.print(f"... {len(notes) - MAX_NOTES} more (use --json for all of them)")
