"""Lifecycle garbage collection: delete consumed steps, expire snapshots, remove unreferenced files.

Retention model (see docs/guide/retention.md):

* a checkpoint is *retained* when it is among the ``keep_last`` newest of its branch or younger than ``keep_within``;
  with neither given every checkpoint is retained. GC releases (un-tags) the others;
* on each branch, every step older than the oldest retained checkpoint of that branch is garbage (no resume can reach
  it); a branch without a checkpoint loses nothing, nor does a checkpoint that is not on the branch's timeline: its
  step holds other files on the branch than on its anchor, or is past the head step (another engine moved the branch
  back under it, or dropped the branch and a fork made it again under its name: GC would delete steps, or mark them
  collected, that no checkpoint pins);
* GC's first commit releases those tags and adds one ``delete`` snapshot per collected branch whose state no longer
  lists those steps (a metadata-only delete of whole files, recorded as DELETED manifest entries); it expires every
  snapshot that no ref of the head it was planned on needs (the collected branches' older ancestors included: they
  would pin the collected files), but not the anchors of the tags it releases. Its second commit, planned on a head
  that shows the release, expires what no ref needs any more (the released anchors, unless a fork points at one).
  GC then deletes, only under the table's location, every file that no retained snapshot references: the collected
  steps' data files, manifests, manifest lists and metadata files. Files that no metadata ever referenced (a crashed
  producer's staged shards, a lost compare-and-swap's manifests) are deleted only once older than the grace period
  (``lakestream.gc.grace-period-ms``, default 1 h), because their commit may still be in flight.
* consumer positions (:mod:`lakestream_iceberg.connect.positions`) are no files of a commit: the sweep leaves the
  position objects alone, and GC expires the positions of the groups silent for longer than
  ``lakestream.consumers.retention-ms`` instead, rows or objects, a whole group at a time (kind ``consumer-position``).

``dry_run=True`` (the default) computes the same plan (both commits) and deletes nothing.

**Forks and GC: no commit drops a ref.** Iceberg drops every ref that points at a removed snapshot (pyiceberg and the
Java reference implementation alike), and no standard ``TableRequirement`` says "no other ref points here" (a custom
requirement would not be sent by REST catalogs). So the guarantee comes from which snapshots a commit may remove, and
from how lakestream creates refs:

1. a new ref only ever points at a snapshot that is new (a checkpoint's anchor, a producer's or GC's new head) or at
   the target of a tag that exists when the ref lands: ``fork`` asserts its checkpoint's tag (``AssertRefSnapshotId``),
   and tags never move (a checkpoint asserts its name is free; a release removes the tag);
2. every commit that expires snapshots (both GC commits, and producers' expiry in passing, see
   :mod:`lakestream_iceberg.format.expiry`) removes only snapshots of the head it was planned on that no ref of that
   head points at, tags it is releasing included (GC's first commit also expires the old head of a branch it moves
   in the same commit). By (1), no ref created between its plan and its swap can point at
   one of them: a tag that existed at plan time keeps its target, a tag created later targets a new snapshot;
3. hence a fork from a checkpoint GC releases either lands before the release (it is then a ref of the head the second
   commit is planned on, and its anchor stays) or after it (its tag assertion fails: ``CheckpointError``, nothing
   created). Both GC commits also assert every branch (and the second every ref) they saw, so a ref moved by another
   tool meanwhile makes GC re-plan.

Not covered: a ref that another tool (Spark, pyiceberg's ``manage_snapshots``) creates on an *older, unreferenced*
snapshot while a lakestream commit that expires it is in flight; Iceberg's own snapshot expiry has the same race.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from pyiceberg.manifest import DataFile, ManifestFile
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.snapshots import Operation, Snapshot
from pyiceberg.table.update import (
    AssertRefSnapshotId,
    AssertTableUUID,
    RemoveSnapshotRefUpdate,
    RemoveSnapshotsUpdate,
    TableRequirement,
    TableUpdate,
)

from lakestream_iceberg.connect.positions import PositionStore
from lakestream_iceberg.errors import CommitTimeoutError, CorruptStateError
from lakestream_iceberg.format.checkpoints import Checkpoint, list_checkpoints, on_timeline
from lakestream_iceberg.format.expiry import ancestors, protected, retention, young
from lakestream_iceberg.format.layout import PROP_COMMIT_TIMEOUT_MS
from lakestream_iceberg.format.lineage import branch_state, lineage
from lakestream_iceberg.format.properties import CONSUMERS_RETENTION
from lakestream_iceberg.format.snapshots import SnapshotBuilder
from lakestream_iceberg.format.summary import OP_COLLECT, StreamState
from lakestream_iceberg.format.table import after_gc
from lakestream_iceberg.lifecycle.policy import refuse_shared_files, retained
from lakestream_iceberg.lifecycle.sweep import (
    Swept,
    gc_now,
    kept_after_dry_run,
    known_files,
    norm,
    referenced_files,
    sweep,
)
from lakestream_iceberg.write.commit import CommitLoop
from lakestream_iceberg.write.plan import Done, Plan

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["GCReport", "collect_garbage"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class GCReport:
    """What a garbage collection did (or, for a dry run, would do).

    Attributes:
        dry_run: Only planned: nothing was committed or deleted.
        collected_below: Per branch, the step below which every step was (or would be) collected.
        released_checkpoints: The checkpoints released because they were not retained.
        snapshots_expired: Snapshots expired.
        files_deleted: Files deleted (or to delete), by kind (``data``, ``manifest``, ``metadata``, ``intent``, ...).
        bytes_deleted: Bytes deleted (or to delete), by the same kinds.
        files_in_grace: Unreferenced files kept because they are younger than the grace period.
        files_failed: Unreferenced files whose delete failed (a storage error other than "not found"); they stay
            unreferenced, and the next GC deletes them (once older than its grace period).
        first_failure: The first of those failures (path and error), or None.
        expiry_failed: What GC could not expire this time besides files, each with its error: the consumer positions
            of silent groups, or catalog staging's old intents (the commits and the sweep stand; the next GC retries).
        sweep_refused: Why no unreferenced file was deleted at all (another table of the catalog keeps its metadata
            in the stream's own folder: no file there can be told to be the stream's alone), or None.
    """

    dry_run: bool
    collected_below: dict[str, int] = field(default_factory=dict)
    released_checkpoints: list[str] = field(default_factory=list)
    snapshots_expired: int = 0
    files_deleted: dict[str, int] = field(default_factory=dict)
    bytes_deleted: dict[str, int] = field(default_factory=dict)
    files_in_grace: int = 0
    files_failed: int = 0
    first_failure: str | None = None
    expiry_failed: list[str] = field(default_factory=list)
    sweep_refused: str | None = None

    @property
    def total_files(self) -> int:
        """Files deleted (or to delete), all kinds."""
        return sum(self.files_deleted.values())

    @property
    def total_bytes(self) -> int:
        """Bytes deleted (or to delete), all kinds."""
        return sum(self.bytes_deleted.values())


@dataclass
class Attempts:
    """What GC's first commit keeps from one attempt to the next (they re-plan after each lost race): each collected
    branch's snapshot id, and the manifests written for it. Producers committing meanwhile add steps above the cutoff
    and leave the manifests holding collected steps as they were, so a later attempt writes only what changed, and its
    plan takes about as long as a producer's commit instead of rewriting every collected step's manifest entries
    (which lost every race to a producer committing back to back on a stream of hundreds of steps)."""

    snapshot_ids: dict[str, int] = field(default_factory=dict)
    rewrites: dict[tuple[str, int, int], tuple[ManifestFile, int, list[DataFile]]] = field(default_factory=dict)
    # the last attempt's plan: its report and the snapshots it expires. An attempt whose outcome was unknown (the reply
    # lost) may have landed: the next one finds it on the head and answers with its report (see landed())
    report: GCReport | None = None
    expired: frozenset[int] = frozenset()

    def landed(self, metadata: TableMetadata) -> GCReport | None:
        """The last attempt's report when ``metadata`` shows its commit: each branch it collected has the collect
        snapshot it planned in its lineage, each checkpoint it released is gone, and each snapshot it expired is
        gone (another GC may have done some of it meanwhile). None when it planned nothing to check, or did not land."""
        report = self.report
        if report is None or not (report.collected_below or report.released_checkpoints or self.expired):
            return None
        if any(name in metadata.refs for name in report.released_checkpoints):
            return None
        if any(metadata.snapshot_by_id(sid) is not None for sid in self.expired):
            return None
        by_id = {s.snapshot_id: s for s in metadata.snapshots}
        for branch in report.collected_below:
            ref = metadata.refs.get(branch)
            planned = self.snapshot_ids.get(branch)
            if ref is None or planned is None or planned not in ancestors(metadata, ref.snapshot_id, len(by_id),
                                                                          by_id=by_id):
                return None
        return report


def plan_collect(stream: StreamTable, metadata: TableMetadata, *, keep_last: int | None, keep_within: timedelta | None,
                 write: bool, attempts: Attempts | None = None, now: float | None = None,
                 ) -> tuple[Plan[GCReport] | Done[GCReport], dict[str, tuple[Snapshot, int]], set[int]]:
    """GC's first commit, the collected branches' heads, and the released anchors that the second commit
    (:func:`plan_expire`) will expire. With ``write=False`` nothing is written (dry run): the plan is only reported,
    and ``snapshots_expired`` counts both commits. ``attempts``: kept across the attempts of one commit (see
    :class:`Attempts`); when ``metadata`` shows the last attempt's commit landed (its outcome was unknown), ``Done``
    with that attempt's report (and nothing collected or deferred). ``now``: the time ``keep_within`` counts from
    (unix seconds; :func:`~lakestream_iceberg.lifecycle.sweep.gc_now`, so that a GC host whose clock runs ahead
    releases no checkpoint early); None: this host's clock."""
    if write and attempts is not None and (landed := attempts.landed(metadata)) is not None:
        return Done(landed), {}, set()
    checkpoints = list_checkpoints(metadata)
    keep = retained(checkpoints, keep_last=keep_last, keep_within=keep_within,
                    now=datetime.now(timezone.utc) if now is None else datetime.fromtimestamp(now, tz=timezone.utc))
    kept = {c.name for c in keep}  # tag names are unique; a list's `in` made thousands of tags quadratic
    released = [c for c in checkpoints if c.name not in kept]
    report = GCReport(dry_run=not write, released_checkpoints=[c.name for c in released])
    updates: list[TableUpdate] = [RemoveSnapshotRefUpdate(ref_name=c.name) for c in released]
    requirements: list[TableRequirement] = [AssertTableUUID(uuid=metadata.table_uuid)]
    requirements += [AssertRefSnapshotId(ref=c.name, snapshot_id=c.snapshot_id) for c in released]
    collected: dict[str, tuple[Snapshot, int]] = {}
    planner = stream.manifest_planner(metadata)
    builder = SnapshotBuilder(metadata)
    by_id = {s.snapshot_id: s for s in metadata.snapshots}  # snapshot_by_id scans the list: per branch, quadratic
    by_branch: dict[str, list[Checkpoint]] = defaultdict(list)  # thousands of forks, each with checkpoints
    for c in keep:
        by_branch[c.branch].append(c)
    for branch, ref in sorted(metadata.refs.items()):
        if ref.snapshot_ref_type != SnapshotRefType.BRANCH:
            continue
        requirements.append(AssertRefSnapshotId(ref=branch, snapshot_id=ref.snapshot_id))
        on_branch = by_branch.get(branch)
        if not on_branch:
            continue  # loses nothing: its state is not read, so another engine's branch (its writes) never stops GC
        head = by_id.get(ref.snapshot_id)
        state = branch_state(metadata, head, stream=stream.name, branch=branch)
        cutoff = _first_on_timeline(stream, by_id, head, branch, on_branch, head_step=state.step,
                                    first_kept=state.collected_below)
        if head is None or cutoff is None or cutoff <= state.collected_below:
            continue
        report.collected_below[branch] = cutoff
        collected[branch] = (head, cutoff)
        if not write:
            continue
        snapshot_id, sequence_number = builder.next_ids(
            prefer=None if attempts is None else attempts.snapshot_ids.get(branch))
        if attempts is not None:
            attempts.snapshot_ids[branch] = snapshot_id
        manifests, dropped = planner.without_steps_below(planner.parent_manifests(head), cutoff,
                                                        snapshot_id=snapshot_id, sequence_number=sequence_number,
                                                        rewrites=None if attempts is None else attempts.rewrites)
        manifest_list = planner.write_list(manifests, snapshot_id=snapshot_id, parent_id=head.snapshot_id,
                                           sequence_number=sequence_number)
        new_state = StreamState(op=OP_COLLECT, step=state.step, producers=state.producers, collected_below=cutoff,
                                producer_files=state.producer_files, timeline=state.timeline)
        snapshot = builder.snapshot(snapshot_id=snapshot_id, sequence_number=sequence_number, parent=head,
                                    manifest_list=manifest_list, operation=Operation.DELETE, removed=dropped,
                                    properties=new_state.properties())
        builder.add(snapshot, branch=branch)
    updates += builder.updates
    # Keep every snapshot a ref of this metadata points at, *released tags' anchors included* (a fork may be landing on
    # one right now: see "Forks and GC" above), the new heads, and the retention window of branches not collected. Of
    # a collected branch only the snapshots that age retention keeps for streaming readers of other engines
    # (history.expire.max-snapshot-age-ms) stay: their files stay with them, until a later GC finds them aged out.
    uncollected = metadata.model_copy(update={"refs": {n: r for n, r in metadata.refs.items() if n not in collected}})
    keep_ids = protected(uncollected, **retention(metadata))
    for branch, (head, _) in collected.items():
        keep_ids |= young(metadata, head.snapshot_id, ref=metadata.refs.get(branch), **retention(metadata))
    expired = [s.snapshot_id for s in metadata.snapshots if s.snapshot_id not in keep_ids]
    if expired:
        updates.append(RemoveSnapshotsUpdate(snapshot_ids=expired))
    # What the second commit will expire once the release landed (counted here for dry runs): released anchors that no
    # other ref keeps.
    gone = set(report.released_checkpoints)  # a list's `in` per ref: O(tags x released) in every GC's first commit
    remaining = uncollected.model_copy(update={"refs": {n: r for n, r in uncollected.refs.items() if n not in gone}})
    still = protected(remaining, **retention(metadata))
    deferred = {c.snapshot_id for c in released} - still - set(expired)
    report.snapshots_expired = len(expired) + (0 if write else len(deferred))
    if write and attempts is not None:
        attempts.report, attempts.expired = report, frozenset(expired)
    return Plan(tuple(updates), tuple(requirements), report, planner.written, planner.settle), collected, deferred


NAMED_IN_LOG = 10  # checkpoints a log line names; it counts the others


def _first_on_timeline(stream: StreamTable, by_id: Mapping[int, Snapshot], head: Snapshot | None, branch: str,
                       checkpoints: list[Checkpoint], *, head_step: int, first_kept: int) -> int | None:
    """The lowest step of ``checkpoints`` (the branch's retained ones) that is on the branch's timeline
    (:func:`~lakestream_iceberg.format.checkpoints.on_timeline`). Collecting below one that is not would delete steps
    (or mark them collected before they are published again) that no checkpoint pins: such checkpoints collect nothing
    on the branch, with a warning. One below the branch's ``first_kept`` step (collected, or before its fork) has
    nothing left to pin there."""
    others: list[str] = []
    found = None
    for checkpoint in sorted(checkpoints, key=lambda c: c.step):
        if checkpoint.step < first_kept:
            continue
        if checkpoint.step <= head_step and on_timeline(stream.index, checkpoint, anchor=by_id.get(checkpoint.snapshot_id),
                                                        head=head):
            found = checkpoint.step
            break
        others.append(checkpoint.name)
    if others:  # named up to NAMED_IN_LOG (a checkpoint every 100 steps of a 100,000-step run: 1,000 names a line)
        named = ", ".join(others[:NAMED_IN_LOG]) + (f" and {len(others) - NAMED_IN_LOG:,} more" if len(others) >
                                                    NAMED_IN_LOG else "")
        log.warning("GC of %s: %d checkpoint(s) of branch %r are not on the branch's timeline (%s; another engine "
                    "moved the branch back under them, or dropped it and it was made again under its name): their "
                    "steps hold other files on the branch or are past its head step %d, so they collect nothing on "
                    "it; release them once no one resumes from them (lakestream checkpoints lists them)", stream.name,
                    len(others), branch, named, head_step)
    return found


def plan_expire(stream: StreamTable, metadata: TableMetadata,
                planned: list[frozenset[int]] | None = None) -> Plan[int] | Done[int]:
    """GC's second commit: expire every snapshot that no ref of ``metadata`` needs (released anchors, once their tag
    is gone). Planned on a head that already shows the release, so no fork can target those anchors any more, and a
    fork that landed before the release is a ref of ``metadata``: its anchor is kept.

    ``planned``: the snapshots each earlier attempt of this call expires (the function adds each plan's). When the
    last one's are all gone, an attempt whose outcome was unknown (the reply lost) landed (or another GC expired
    them): ``Done`` with its count."""
    if planned and not any(metadata.snapshot_by_id(sid) is not None for sid in planned[-1]):
        return Done(len(planned[-1]))
    keep = protected(metadata, **retention(metadata))
    expired = [s.snapshot_id for s in metadata.snapshots if s.snapshot_id not in keep]
    if not expired:
        return Done(0)
    if planned is not None:
        planned.append(frozenset(expired))
    requirements: list[TableRequirement] = [AssertTableUUID(uuid=metadata.table_uuid)]
    requirements += [AssertRefSnapshotId(ref=n, snapshot_id=r.snapshot_id) for n, r in sorted(metadata.refs.items())]
    return Plan((RemoveSnapshotsUpdate(snapshot_ids=expired),), tuple(requirements), len(expired), [])


def awaiting_rebase(metadata: TableMetadata) -> list[str]:
    """The branches whose head's lineage was expired below its foreign snapshots before any lakestream snapshot (e.g.
    Spark's ``rewrite_manifests`` then ``expire_snapshots(retain_last => 1)``): ``repair()`` re-bases them on the state
    it reads back from the metadata log, whose producer-state files no retained snapshot lists."""
    out = []
    for branch, ref in sorted(metadata.refs.items()):
        if ref.snapshot_ref_type != SnapshotRefType.BRANCH:
            continue
        try:
            broken = lineage(metadata, metadata.snapshot_by_id(ref.snapshot_id)).broken
        except CorruptStateError:  # parent links that loop: nothing is known of its state, keep the files
            broken = True
        if broken:
            out.append(branch)
    return out


def snapshots_expired(plan: Plan[GCReport]) -> set[int]:
    return {sid for u in plan.updates if isinstance(u, RemoveSnapshotsUpdate) for sid in u.snapshot_ids}


def collect_garbage(stream: StreamTable, loop: CommitLoop, *, dry_run: bool, keep_last: int | None,
                    keep_within: timedelta | None, grace_s: float,
                    expire_intents: Callable[[float, bool], list[str]] | None = None) -> GCReport:
    """Lifecycle GC of ``stream`` through ``loop`` (its control commit loop on ``main``): release the checkpoints the
    policy does not retain, collect every branch's steps below its oldest retained checkpoint, expire what no ref
    needs, and delete the files no retained snapshot references once older than ``grace_s`` (validated by the
    caller: :func:`check_policy`, :func:`grace_seconds`). A dry run commits and deletes nothing and reports the plan.

    ``expire_intents(older_than_s, delete)``: catalog staging's intent rows older than the grace period (their rows are
    no files the sweep finds), or None where intents are files.
    """
    def head() -> TableMetadata:
        return loop.refresh(deadline=time.monotonic() + stream.config.commit_timeout_s)

    def read_head() -> tuple[TableMetadata, set[str]]:
        metadata = head()
        return metadata, known_files(stream, metadata)

    # the time files, positions and checkpoints (keep_within) age by, read before any head: a file the sweep finds older than the grace period
    # then was older still when each head was read, so no commit publishing it can land after that read (the grace
    # rule); and the store's clock where it is earlier than this host's (a GC host whose clock runs ahead)
    now = gc_now(stream, stream.table.metadata.location, probe=not dry_run)

    # Another GC running at the same time may delete files of the head this one read (snapshots it expired): each read
    # of the head's files is made once more on the head read again, as reads and commits do (format/table.py's after_gc)
    metadata, known = after_gc(read_head, refresh=lambda: None)
    if not dry_run:
        refuse_shared_files(metadata.properties, stream.name, doing="lakestream gc deletes files",
                            left="Nothing was committed or deleted", instead="dry runs still report")
    # read before anything is committed: a bad value (another engine's) raised only after the commits and the sweep
    positions_s = CONSUMERS_RETENTION.seconds(CONSUMERS_RETENTION.get(metadata.properties) or 0)
    rebase = awaiting_rebase(metadata)
    if rebase:
        log.warning("GC of %s keeps every producer-state file: branches %s lost the snapshots recording their state "
                    "to another engine's expiry, and stream.repair() reads it back with the files it lists; run "
                    "repair, then GC again", stream.name, rebase)
    if dry_run:
        def survey(metadata: TableMetadata) -> tuple[Plan[GCReport], set[str]]:
            plan, collected, deferred = plan_collect(stream, metadata, keep_last=keep_last, keep_within=keep_within,
                                                     write=False, now=now)
            assert isinstance(plan, Plan)  # a dry run never answers Done: it has no earlier attempt
            return plan, kept_after_dry_run(stream, metadata, stream.table.metadata_location, collected,
                                            snapshots_expired(plan) | deferred)

        plan, keep = after_gc(lambda: survey(metadata), refresh=lambda: None, again=lambda: survey(head()))
        _record(plan.result, sweep(stream, location=metadata.location, keep=keep, known=known, grace_s=grace_s,
                                   delete=False, now=now, keep_producer_state=bool(rebase)))
        _expire_intents(stream, plan.result, expire_intents, grace_s=grace_s, delete=False)
        _expire_positions(stream, plan.result, metadata, retention_s=positions_s, delete=False, now=now)
        return plan.result
    # Two commits (see "Forks and GC" above): release + collect first, then expire what no ref needs, planned on a head
    # that shows the release, so a fork racing GC either keeps its anchor or fails loudly.
    attempts = Attempts()
    try:
        outcome = loop.run(lambda md, _: plan_collect(stream, md, keep_last=keep_last, keep_within=keep_within,
                                                      write=True, attempts=attempts, now=now)[0], pace=False)
    except CommitTimeoutError as exc:
        raise _gave_up(f"GC of {stream.name} gave up its first commit after {exc.why}: nothing was released, collected "
                       f"or deleted. Run GC again, or raise {PROP_COMMIT_TIMEOUT_MS} / lakestream.commit.max-attempts",
                       exc) from exc
    report = outcome.result
    try:
        expiries: list[frozenset[int]] = []  # an attempt whose reply was lost may have landed: the next one finds it
        expiry = loop.run(lambda md, _: plan_expire(stream, md, expiries), pace=False)
    except CommitTimeoutError as exc:
        raise _gave_up(
            f"GC of {stream.name} released {len(report.released_checkpoints)} checkpoints and collected "
            f"{report.collected_below or 'no step'}, then gave up expiring the snapshots no ref needs any more "
            f"after {exc.why}: no file was deleted. Run GC again: it expires them and deletes their files then",
            exc) from exc
    report.snapshots_expired += expiry.result
    keep = after_gc(lambda: referenced_files(stream.io, expiry.metadata, stream.table.metadata_location, stream),
                    refresh=lambda: None,
                    again=lambda: referenced_files(stream.io, head(), stream.table.metadata_location, stream))
    known |= {norm(p) for p in outcome.abandoned_files}
    _record(report, sweep(stream, location=expiry.metadata.location, keep=keep, known=known, grace_s=grace_s,
                          delete=True, now=now, keep_producer_state=bool(rebase)))
    _expire_intents(stream, report, expire_intents, grace_s=grace_s, delete=True)
    _expire_positions(stream, report, expiry.metadata, retention_s=positions_s, delete=True, now=now)
    return report


def _gave_up(message: str, exc: CommitTimeoutError) -> CommitTimeoutError:
    """GC's own :class:`CommitTimeoutError` for a commit that gave up (``exc``): what GC did and what is left."""
    error = CommitTimeoutError(message)
    error.why = exc.why
    return error


def _record(report: GCReport, swept: Swept) -> None:
    report.files_deleted, report.bytes_deleted = swept.files_deleted, swept.bytes_deleted
    report.files_in_grace += swept.files_in_grace
    report.files_failed += swept.files_failed
    report.first_failure = report.first_failure or swept.first_failure
    report.sweep_refused = report.sweep_refused or swept.refused


def _expire_positions(stream: StreamTable, report: GCReport, metadata: TableMetadata, *, retention_s: float,
                      delete: bool, now: float) -> None:
    """The consumer positions of groups silent for longer than ``retention_s`` (``lakestream.consumers.retention-ms``,
    read when GC began; rows: 0 bytes, aged by the database's clock; objects: aged at ``now``, :func:`gc_now`)."""
    try:
        store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=metadata.location)
        count, size = store.expire(older_than_s=retention_s, delete=delete, now=now)
    except Exception as exc:  # noqa: BLE001 - the rest of the collection stands; the next one retries
        log.warning("GC of %s could not expire the consumer positions of old groups (%s); the next GC retries",
                    stream.name, exc)
        report.expiry_failed.append(f"consumer positions: {type(exc).__name__}: {exc}")
        return
    if count:
        report.files_deleted["consumer-position"] = report.files_deleted.get("consumer-position", 0) + count
        report.bytes_deleted["consumer-position"] = report.bytes_deleted.get("consumer-position", 0) + size


def _expire_intents(stream: StreamTable, report: GCReport, expire: Callable[[float, bool], list[str]] | None, *,
                    grace_s: float, delete: bool) -> None:
    """Catalog staging: intents older than the grace period are rows, not files the sweep finds (kind ``intent``,
    0 bytes); their data files are unreferenced files, which the sweep deletes once as old."""
    if expire is None:
        return
    try:
        expired = expire(grace_s, delete)
    except Exception as exc:  # noqa: BLE001 - the rest of the collection stands; the next one retries
        log.warning("GC of %s could not expire old staged intents in the catalog (%s); the next GC retries",
                    stream.name, exc)
        report.expiry_failed.append(f"staged intents: {type(exc).__name__}: {exc}")
        return
    if expired:
        report.files_deleted["intent"] = report.files_deleted.get("intent", 0) + len(expired)
        report.bytes_deleted.setdefault("intent", 0)
