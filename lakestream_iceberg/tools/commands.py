"""The bodies of the ``lakestream`` commands (:mod:`lakestream_iceberg.tools.cli` parses the command line and calls
them): each takes the parsed arguments and an :class:`~lakestream_iceberg.tools.output.Output`, prints tables or JSON,
and returns the exit code; a mistake is a :class:`UserError` (one line, its exit code)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lakestream_iceberg.connect.integers import parse_int
from lakestream_iceberg.errors import LakestreamError
from lakestream_iceberg.format.checks import branches
from lakestream_iceberg.tools.config import CatalogSpec, load, open_stream
from lakestream_iceberg.tools.output import MAX_HUMAN_ROWS, Output, human, megabytes, plain

if TYPE_CHECKING:
    from lakestream_iceberg.stream import Stream

__all__ = ["EXIT_ERROR", "UserError", "cmd_checkpoint", "cmd_checkpoints", "cmd_demo", "cmd_gc", "cmd_host", "cmd_lag",
           "cmd_repair", "cmd_sql", "cmd_status", "cmd_tail", "property_rows", "status_dict", "storage_error"]

EXIT_ERROR = 1


class UserError(LakestreamError):
    """A mistake reported as one line (distinct from bugs, which keep their traceback)."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def _spec(args: argparse.Namespace) -> CatalogSpec:
    return CatalogSpec(name=args.catalog, home=args.home)


def _stream(args: argparse.Namespace) -> Stream:
    spec = _spec(args)
    stream = open_stream(load(spec, create=False), args.stream, spec=spec)  # a misspelt --home makes no catalog
    branch = getattr(args, "branch", None)
    if branch is not None:  # a misspelled branch must not show an empty stream (head step 0) and exit 0
        stream.require_branch(branch, doing=f"lakestream {args.command}: no")
    return stream


def cmd_demo(args: argparse.Namespace, out: Output) -> int:
    from lakestream_iceberg.tools.demo import format_summary, run_demo

    spec = _spec(args)
    result = run_demo(producers=args.producers, ranks=args.ranks, steps_per_producer=args.steps_per_producer,
                      spec=spec, progress=None if not out.json else False)
    if out.json:
        out.emit_json(result.as_dict())
    else:
        print(format_summary(result, hint_args=spec.cli_args()), flush=True)
    return 0 if result.passed else EXIT_ERROR


def status_dict(stream: Stream, branch: str) -> dict[str, Any]:
    """What ``lakestream status`` reports (also its ``--json`` document)."""
    from lakestream_iceberg.format.checkpoints import list_checkpoints
    from lakestream_iceberg.read.history_rows import utc_from_ms

    state = stream.state(branch=branch, refresh=True)
    metadata = stream.table.metadata
    head = stream.head(branch=branch)
    summary = dict(head.summary.additional_properties) if head is not None and head.summary else {}
    try:
        metadata_bytes: int | None = len(stream.io.new_input(stream.table.metadata_location))
    except Exception:  # size is informative only; some FileIOs cannot stat
        metadata_bytes = None
    checkpoints = list_checkpoints(metadata)
    newest = max((c.step for c in checkpoints if c.branch == branch), default=None)
    try:  # batches staged for group commit and not published yet (see lakestream_iceberg.write.staging)
        staged: int | None = len(stream.staging.pending(branch, max_age_s=float("inf")))
    except Exception:  # informative only; a FileIO that cannot list
        staged = None

    try:  # the consumer groups whose ranks record positions on this branch; each rank's row: lakestream lag
        from lakestream_iceberg.read.lag import DEFAULT_STALE_AFTER
        from lakestream_iceberg.tools.lag import lag_report

        report = lag_report(stream, group=None, stale_after=DEFAULT_STALE_AFTER)
        on_branch = {p["group"] for p in report["positions"] if p["branch"] == branch}
        groups: list[dict[str, Any]] | None = [g for g in report["groups"] if g["group"] in on_branch]
    except Exception:  # informative only: positions that cannot be listed (lakestream lag says why)
        groups = None

    def total(key: str) -> int | None:  # the engines' totals: informative, one no engine reads (" 5") shows as null
        return parse_int(summary.get(key), minimum=0)

    return {
        "stream": stream.name,
        "location": metadata.location,
        "world_size": stream.world_size,
        "layout": stream.config.layout,
        "branch": branch,
        "head_step": state.step,
        "head_snapshot_id": head.snapshot_id if head else None,
        "last_commit_at": utc_from_ms(head.timestamp_ms) if head else None,
        "collected_below": state.collected_below,
        "staged_batches": staged,
        "staging": stream.staging.kind,
        "producers": [{"producer": pid, "last_seq": p.seq, "last_step": p.step, "lag": state.step - p.step,
                       "active": pid in state.producers} for pid, p in sorted(state.all_producers(stream.io).items())],
        "consumer_lag": None if newest is None else state.step - newest,
        "consumer_lag_basis": f"head step - newest checkpoint step on {branch}" if newest is not None
        else f"unknown (no checkpoint on {branch})",
        "consumer_groups": groups,
        "checkpoints": checkpoints,
        "branches": branches(metadata),  # main too before its first step, as every command counts it
        "snapshots_retained": len(metadata.snapshots),
        "metadata_file": stream.table.metadata_location,
        "metadata_bytes": metadata_bytes,
        "storage": {"data_files": total("total-data-files"), "records": total("total-records"),
                    "bytes": total("total-files-size")},
        "properties": property_rows(metadata.properties),
    }


def property_rows(properties: Mapping[str, str]) -> list[dict[str, Any]]:
    """Every table property a stream reads (format/properties.py), with the value the table holds: ``set`` is false
    where the property is absent and ``value`` is then its default."""
    from lakestream_iceberg.format.properties import PROPERTIES

    rows = []
    for prop in PROPERTIES:
        raw = properties.get(prop.key)
        shown = raw if raw is None or len(raw) <= 64 else f"{raw[:24]}... ({len(raw):,} chars)"
        rows.append({"property": prop.key, "value": shown if raw is not None else prop.absent_words(),
                     "set": raw is not None, "unit": prop.unit, "default": prop.default_words(),
                     "live": prop.change.value, "live_short": prop.change.short})
    return rows


def cmd_status(args: argparse.Namespace, out: Output) -> int:
    stream = _stream(args)
    status = status_dict(stream, args.branch)
    if out.json:
        out.emit_json(status)
        return 0
    storage = status["storage"]
    out.fields([
        ("location", status["location"]), ("world size", f"{status['world_size']} ({status['layout']} layout)"),
        ("branch", f"{status['branch']} (branches: {', '.join(status['branches']) or '-'})"),
        ("head step", status["head_step"]), ("last commit", status["last_commit_at"]),
        ("past checkpoint", f"{status['consumer_lag']} steps ({status['consumer_lag_basis']})"
                            if status["consumer_lag"] is not None else status["consumer_lag_basis"]),
        ("steps collected below", status["collected_below"]),
        ("staged batches", ("-" if status["staged_batches"] is None else str(status["staged_batches"]))
         + f" (intents kept in the {status['staging']})"),
        ("snapshots retained", status["snapshots_retained"]),
        ("metadata", f"{megabytes(status['metadata_bytes'])} in {status['metadata_file']}"),
        ("storage", f"{megabytes(storage['bytes'])}, {storage['data_files'] or 0:,} data files, "
                    f"{storage['records'] or 0:,} samples"),
    ], title=f"stream {status['stream']}")
    # the most recent first: a table of the first MAX_HUMAN_ROWS ids by name showed, at thousands of ids, producers
    # retired long ago and none of those committing now
    producers = sorted(status["producers"], key=lambda p: (-p["last_step"], p["producer"]))
    active = sum(p["active"] for p in producers)
    out.table(producers, title=f"producers ({len(producers):,}, {active:,} active; the most recent first)",
              columns=["producer", "last_seq", "last_step", "lag"])
    if status["consumer_groups"] is not None:  # the ranks' recorded positions (lakestream lag: one row per rank)
        out.table([{**g, "ranks": ", ".join(f"{n} {what}" for what, n in g["ranks"].items())}
                   for g in status["consumer_groups"]], title="consumer groups (lakestream lag --group: each rank)",
                  columns=["group", "world_size", "ranks", "unreported", "max_lag_steps"])
    out.table([plain(c) for c in status["checkpoints"]], title="checkpoints",
              columns=["name", "branch", "step", "snapshot_id", "created_at"])
    out.table([{**p, "value": p["value"] if p["set"] else f"({p['value']})", "live change": p["live_short"]}
               for p in status["properties"]], title="table properties (absent: the default, in parentheses)",
              columns=["property", "value", "unit", "live change"])
    return 0


def _parse_steps(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        first, _, last = text.partition(":")
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise UserError(f"--steps {text!r} is not a step range; write FIRST:LAST (e.g. 1:100) or one step") from None
    if not 1 <= lo <= hi:
        raise UserError(f"--steps {text!r} is not a step range: steps start at 1 and FIRST <= LAST (e.g. 1:100)")
    return lo, hi


def cmd_sql(args: argparse.Namespace, out: Output) -> int:
    from lakestream_iceberg.read.history import history, import_duckdb, register_consumers, register_samples

    duckdb = import_duckdb()  # MissingExtraError naming the extra when DuckDB is not installed

    stream = _stream(args)
    steps = _parse_steps(args.steps)
    # Metadata views first; the samples view reads data files and the consumers view every recorded position of every
    # group (a row, or an object read, per rank), so each is loaded only when the query names it (once).
    con = history(stream, branch=args.branch, samples=False, consumers=False)
    later = {
        "samples": lambda: register_samples(con, stream, branch=args.branch, samples_steps=steps,
                                            progress=not out.json),
        "consumers": lambda: register_consumers(con, stream),
    }
    try:
        while True:
            try:
                relation = con.sql(args.query)
                break
            except duckdb.CatalogException as exc:
                missing = next((name for name in later if name in str(exc)), None)
                if missing is None:
                    raise
                later.pop(missing)()
        rows = []
        if out.json and relation is not None:  # a table shows MAX_HUMAN_ROWS: fetching every row cost gigabytes
            columns = _unique_names(relation.columns)
            rows = [dict(zip(columns, values, strict=True)) for values in relation.fetchall()]
        if not out.json and relation is not None:
            import shutil

            sys.stdout.flush()
            relation.show(max_width=max(shutil.get_terminal_size((120, 24)).columns, 80), max_rows=MAX_HUMAN_ROWS)
    except duckdb.Error as exc:
        raise UserError("SQL error: " + " ".join(str(exc).split()) + " (views: batches, files, producers, checkpoints, "
                        "snapshots, consumers, samples)") from None
    if out.json:
        out.emit_json(rows)
    elif relation is None:
        print("OK")
    return 0


def _unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with each repeat renamed as DuckDB's JSON export renames it (``a, a, a_1, a`` -> ``a, a_1, a_1_1,
    a_2``): one JSON key per column, where a join's two ``step`` columns were one key and one column's values lost."""
    taken: dict[str, int] = {}
    unique = []
    for name in names:
        chosen = name
        while chosen in taken:
            taken[name] += 1
            chosen = f"{name}_{taken[name]}"
        taken[chosen] = 0
        unique.append(chosen)
    return unique


def cmd_checkpoint(args: argparse.Namespace, out: Output) -> int:
    stream = _stream(args)
    step = args.step if args.step is not None else stream.head_step(branch=args.branch)
    checkpoint = stream.checkpoint(args.name, step=step, branch=args.branch)
    if out.json:
        out.emit_json(checkpoint)
    else:
        out.fields(list(plain(checkpoint).items()), title=f"checkpoint {args.name} of {stream.name}")
    return 0


def cmd_checkpoints(args: argparse.Namespace, out: Output) -> int:
    stream = _stream(args)
    listing = [c for c in stream.checkpoints() if args.branch is None or c.branch == args.branch]
    if out.json:
        out.emit_json(listing)
    else:
        # the newest first: in the order of the listing (the oldest first), a run that checkpoints every 100 steps
        # showed its first 50 of 1,000 checkpoints and none of those one resumes from
        # (committed last first: the anchor's sequence number, which no host's clock decides)
        newest = sorted(listing, key=lambda c: (-1 if c.sequence_number is None else c.sequence_number, c.step, c.name),
                        reverse=True)
        out.table([plain(c) for c in newest], title=f"checkpoints of {stream.name} ({len(listing):,}; the newest first)",
                  columns=["name", "branch", "step", "created_at", "snapshot_id", "source_snapshot_id"])
    return 0


def cmd_gc(args: argparse.Namespace, out: Output) -> int:
    stream = _stream(args)
    kwargs: dict[str, Any] = {"dry_run": args.dry_run}
    if args.keep_last is not None:
        kwargs["keep_last"] = args.keep_last
    if args.keep_within is not None:
        kwargs["keep_within"] = args.keep_within
    if out.json:
        report = stream.collect_garbage(**kwargs)
        out.emit_json(report)
        _fail_on_what_gc_left(report)
        return 0
    with out.console.status("planning garbage collection" if args.dry_run else "collecting garbage"):
        report = stream.collect_garbage(**kwargs)
    pairs = [(k, ", ".join(map(str, v)) or "-" if isinstance(v, list) else v) for k, v in plain(report).items()]
    pairs += [("total", f"{report.total_files:,} files, {megabytes(report.total_bytes)}")] if hasattr(report, "total_files") else []
    out.fields(pairs, title=f"gc of {stream.name}" + (" (dry run: nothing deleted)" if args.dry_run else ""))
    _fail_on_what_gc_left(report)
    return 0


def _fail_on_what_gc_left(report: Any) -> None:
    """The commits stand and the report is printed; deletes or expiries that failed make the command fail (a cron job
    notices)."""
    if getattr(report, "sweep_refused", None):  # nothing deleted: storage grows until the folder is fixed
        raise UserError(report.sweep_refused)
    if getattr(report, "files_failed", 0):
        raise UserError(f"{report.files_failed:,} unreferenced files could not be deleted (the first: "
                        f"{report.first_failure}). Let this process delete under the table's location: the next gc "
                        "deletes them (those written within the grace period once they are older)")
    if getattr(report, "expiry_failed", None):
        if report.dry_run:  # nothing was to be expired: what failed is the count of what would be
            raise UserError(f"gc --dry-run could not count what it would expire: {'; '.join(report.expiry_failed)}. "
                            "Check that this process can reach and read the catalog and the table's location")
        raise UserError(f"gc could not expire {'; '.join(report.expiry_failed)}. Check that this process can reach "
                        "and write the catalog and the table's location: the next gc retries")


def cmd_repair(args: argparse.Namespace, out: Output) -> int:
    stream = _stream(args)
    report = stream.repair(branch=args.branch, dry_run=args.dry_run)
    if out.json:
        out.emit_json(report)
        return 0
    if not report.foreign:
        out.fields([("branch", report.branch), ("head step", report.step), ("foreign data changes", "none")],
                   title=f"repair of {stream.name}: nothing to repair")
        return 0
    done: list[tuple[str, object]]
    if report.rebased_on is not None:
        done = [("re-based on", report.rebased_on)]
    elif report.cleared:
        left = "leave the branch" if args.dry_run else "left the branch"
        done = [("rolled back to", "before the first step (main's ref removed: the stream is as it was created)"),
                ("their changes", f"{left}; their files stay until lakestream gc removes them")]
    else:
        left = "leave the branch" if args.dry_run else "left the branch"
        done = [("rolled back to", report.rolled_back_to),
                ("their changes", f"{left}; their files stay until lakestream gc removes them")]
    what = report.changes or ("",) * len(report.foreign)
    foreign = "; ".join(f"{sid} ({change})" if change else str(sid) for sid, change in zip(report.foreign, what))
    out.fields([("branch", report.branch), ("foreign snapshots", foreign), *done, ("head step", report.step)],
               title=f"repair of {stream.name}" + (" (dry run: nothing changed)" if args.dry_run else ""))
    return 0


def cmd_host(args: argparse.Namespace, out: Output) -> int:
    from lakestream_iceberg.write.host import check_copy

    check = check_copy()
    report = dict(plain(check), ratio=check.ratio)
    if out.json:
        out.emit_json(report)
    else:
        verdict = "SLOW at short distances (glibc bug 30994)" if check.slow else "ok"
        out.fields([("libc", check.libc), ("GLIBC_TUNABLES", check.tunables or "-"),
                    ("64 KiB copy, distance 0 mod 4 KiB", f"{check.aligned_gb_s:.1f} GB/s"),
                    ("64 KiB copy, distance 4 mod 4 KiB", f"{check.near_gb_s:.1f} GB/s"),
                    ("ratio", f"{check.ratio:.2f}"), ("verdict", verdict)],
                   title="this host's memcpy, as pyarrow's Parquet writer uses it")
        if check.advice:  # plain print: the variable must not be folded or cut by the table
            print(f"advice: {check.advice}")
    return 1 if check.slow and args.strict else 0


def cmd_tail(args: argparse.Namespace, out: Output) -> int:
    import threading

    from lakestream_iceberg.errors import ReadTimeoutError
    from lakestream_iceberg.read.follow import HeadWatcher
    from lakestream_iceberg.read.history_rows import step_rows

    stream = _stream(args)
    watcher = HeadWatcher(stream, branch=args.branch)  # polls the catalog pointer; reloads metadata only on change
    watcher.check()
    next_step = args.from_step if args.from_step is not None else watcher.head()[0] + 1
    first_kept = stream.branch_state(branch=args.branch).collected_below
    gone = f" (steps below {first_kept} are gone: collected by GC, or before a fork)" if next_step < first_kept else ""
    next_step = max(next_step, first_kept)  # a replay shows what is kept, and the line above it says where it starts
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    never = threading.Event()
    shown = 0
    if not out.json:
        out.console.print(f"following {stream.name} (branch {args.branch}) from step {next_step}{gone}; Ctrl-C to stop",
                          style="dim", soft_wrap=True)
    while args.max_steps is None or shown < args.max_steps:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            break
        try:
            waited = watcher.wait(next_step, timeout=remaining, stop=never, poll_s=args.poll)
        except ReadTimeoutError as exc:
            if exc.__cause__ is not None:  # the last poll failed too: the catalog is unreachable, not the stream idle
                raise UserError(f"tail: the catalog could not be polled when --timeout {args.timeout:g} ran out: "
                                f"{storage_error(exc.__cause__, args.catalog)}") from None
            break
        head = waited[0] if waited else next_step
        last = head if args.max_steps is None else min(head, next_step + args.max_steps - shown - 1)
        for row in step_rows(stream, range(next_step, last + 1), branch=args.branch):
            if out.json:
                out.emit_json(row, compact=True)
            else:
                out.console.print(
                    f"step {row['step']:>7}  {row['producer'] or '?'} seq {row['seq'] if row['seq'] is not None else '?'}"
                    f"  {row['samples'] if row['samples'] is not None else '-'} samples {row['samples_per_rank'] or ''}"
                    f"  {(row['bytes'] or 0) / 1e3:,.1f} kB  attempts {row['attempts'] or '-'}"
                    f"  {human(row['committed_at'])}",
                    soft_wrap=True,  # one line per step, whatever the width: piped, rich wraps at 80 columns
                )
            shown += 1
        next_step = last + 1
    return 0


def cmd_lag(args: argparse.Namespace, out: Output) -> int:
    from lakestream_iceberg.tools.lag import delete_positions, lag_report, show_lag

    if args.force and not args.delete:
        raise UserError("--force only applies to --delete: lakestream lag STREAM --group RUN --delete --force")
    if args.delete:
        if args.group is None:
            raise UserError("--delete needs the group whose positions to delete: lakestream lag STREAM --group RUN "
                            "--delete")
        delete_positions(_stream(args), out, group=args.group, force=args.force, stale_after=args.stale_after)
        return 0
    show_lag(lag_report(_stream(args), group=args.group, stale_after=args.stale_after), out, group=args.group)
    return 0


# -- parser -------------------------------------------------------------------------------------------------------------


def storage_error(exc: BaseException, catalog: str | None) -> str:
    """What the storage (or the catalog) raised, as one line naming the setting to fix where it is a connection or
    credential failure; never a secret of the catalog's configuration."""
    from lakestream_iceberg.connect.diagnose import explain, redact

    settings: dict[str, Any] = {}
    try:  # the catalog's configuration, for its endpoint and to redact its secrets
        from pyiceberg.utils.config import Config

        settings = dict(Config().get_catalog_config(catalog) or {}) if catalog else {}
    except Exception:  # noqa: BLE001 - a malformed configuration: the environment's secrets are still redacted
        pass
    explained = explain(exc, settings, catalog=catalog)
    return str(explained) if explained is not None else redact(f"{type(exc).__name__}: {exc}", settings)
