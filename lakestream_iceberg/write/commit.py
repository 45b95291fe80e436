"""The commit loop: optimistic concurrency against the catalog's compare-and-swap, paced and retried by DAC.

This module owns every retry of a lakestream commit (pyiceberg's own are turned off on stream tables). One call of
:meth:`CommitLoop.run` takes a *planner*, a function from the table's current metadata to either a commit plan
(updates + requirements) or a final answer (e.g. "already published"). Each attempt re-plans on freshly loaded
metadata, so data files are never rewritten, only the small manifests and the snapshot.

Outcomes of one attempt:
* the swap is won: done;
* the swap is lost (``CommitFailedException``, or a concurrent change that made an update invalid): re-plan on the
  refreshed table after the DAC retry delay;
* anything else (``CommitStateUnknownException``, a dropped database connection, a 5xx): the commit may or may not
  have landed. The table is read back (with bounded backoff while the catalog is unreachable) and the planner decides
  from the published state, never a blind repeat. A repeat is safe anyway: every plan requires the branch to still
  point at the parent it was built on, so at most one of two racing copies can land;
* a :class:`LakestreamError` (a planner's refusal, or :class:`CorruptStateError` for a head whose summary holds a value
  lakestream never writes) propagates at once, from the planner and from every read of the head: the table was read,
  so it is not a catalog outage, and retrying until the timeout would only hide it.

Group commit (``carry``): the caller's batch is staged (:mod:`lakestream_iceberg.write.staging`), and any producer's commit
may publish it. Before each attempt the loop *holds* for as long as the policy says, polling whether the staged batch
is gone (another commit carried it), or, where the catalog pointer is cheap to read, whether the head moved: then the
batch was carried, or leads the queue of staged batches and is committed at once (see :meth:`CommitLoop._hold`); then
it reads the head and the planner either finds the batch published (done, with no attempt of its own) or plans a
commit of every staged batch. Once the staged batch is gone the head is first
read *lightly* (:meth:`CommitLoop.peek`: the new ``metadata.json`` as plain JSON, only the summaries asked for parsed):
when it shows the batch published (``Carry.answer``) the call returns from that, and the producer's next commit plans
on a full read of the head, which it makes anyway right before planning. Parsing the whole metadata into pyiceberg's
``TableMetadata`` costs several times more, and in a group commit most batches are carried.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.table.update import TableRequirement, TableUpdate

from lakestream_iceberg.connect.diagnose import transient
from lakestream_iceberg.connect.pointer import PointerWatch, cached_probe, read_moved, refresh_if_moved
from lakestream_iceberg.connect.swap import swap
from lakestream_iceberg.errors import (
    CommitError,
    CommitOutcomeUnknownError,
    CommitTimeoutError,
    ForeignSnapshotError,
    LakestreamError,
)
from lakestream_iceberg.format.lineage import branch_state
from lakestream_iceberg.format.summary import KEY_STEP, StreamState
from lakestream_iceberg.write.dac import CommitPolicy

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Plan(Generic[T]):
    """One attempt's commit: what to send, and what the caller gets back if it lands."""

    updates: tuple[TableUpdate, ...]
    requirements: tuple[TableRequirement, ...]
    result: T
    written: list[str]
    # Cache upkeep once the swap is decided: settle(True, head) after it landed, settle(False, head) after it was lost
    # (``head``: the branch's head snapshot then). Never for an unknown outcome; a failure in it never fails a commit.
    settle: Callable[[bool, Snapshot | None], None] | None = None
    # Files of ``updates`` may still be in flight (object storage, see ManifestPlanner.concurrent_writes): returns once
    # all are written, raises the first failure. The swap calls it after writing metadata.json, before the catalog's
    # update; a failure then publishes nothing and is handled as a failed planning attempt.
    ready: Callable[[], None] | None = None


def _deletes_old_metadata(metadata: TableMetadata) -> bool:
    """Iceberg's ``write.metadata.delete-after-commit.enabled`` (default false); a value that is no boolean deletes
    nothing (and says so once per value)."""
    raw = metadata.properties.get(PROP_DELETE_AFTER_COMMIT)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value not in ("true", "false"):
        if raw not in _WARNED_VALUES:
            _WARNED_VALUES.add(raw)
            log.warning("table property %s=%r is not true or false: old metadata files are kept", PROP_DELETE_AFTER_COMMIT,
                        raw)
        return False
    return value == "true"


PROP_DELETE_AFTER_COMMIT = "write.metadata.delete-after-commit.enabled"
_WARNED_VALUES: set[str] = set()


@dataclass
class Done(Generic[T]):
    """The planner found nothing to commit (e.g. the batch is already published)."""

    result: T


Planner = Callable[[TableMetadata, int], "Plan[T] | Done[T]"]


@dataclass
class Outcome(Generic[T]):
    result: T
    attempts: int  # loop iterations (attempts, and the reconciling read that ended the loop)
    landed: bool
    metadata: TableMetadata
    abandoned_files: list[str]
    sent: int = 0  # compare-and-swap requests sent
    carried_after: float | None = None  # group commit: seconds staged until another producer's commit carried it
    peeked: bool = False  # answered from a light read of the head: ``metadata`` is older than the head (see peek)


@dataclass(frozen=True)
class Peek:
    """The branch head as a light read found it: its state, and ``states(snapshot_id)``, the state any snapshot of
    that metadata records (None for a snapshot it does not hold)."""

    state: StreamState
    states: Callable[[object], StreamState | None]


@dataclass(frozen=True)
class Carry:
    """Group commit: the caller's batch is staged since ``staged_at`` (loop clock); ``gone()`` is true once its intent
    has disappeared, i.e. a commit published it; ``published(metadata)`` whether a head already shows it."""

    staged_at: float
    gone: Callable[[], bool]
    published: Callable[[TableMetadata], bool] = lambda _metadata: False  # the batch is published in this metadata
    queued: Callable[[], int] | None = None  # staged batches older than this one (a listing; see hold_delay)
    # once the batch is gone: the final answer from a light read of the head, or None to read it fully and plan
    answer: Callable[[Peek, int], object | None] | None = None
    # (producer, seq) of the staged batches older than this one that a commit could still publish (one listing), None
    # when this one is no longer listed or the listing failed: the batch leads the queue once all of them are published
    ahead: Callable[[], list[tuple[str, int]] | None] | None = None


class _WritesFailed(Exception):
    """A file of the plan could not be written (its cause): raised before the catalog's update, nothing published."""


class CommitLoop:
    """Runs planners against one table until they land, their answer is final, or the budget is spent."""

    def __init__(
        self,
        *,
        table: Table,
        policy: CommitPolicy,
        branch: str,
        timeout_s: float,
        max_attempts: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.table = table
        self.policy = policy
        self._branch = branch
        self._timeout_s = timeout_s
        self._max_attempts = max_attempts
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._fresh = False
        self._refreshes = 0
        # True from an answer found by peek() until the next full read: table.metadata is older than the head
        self.peeked = False
        self._carried_peek: Peek | None = None  # the light read of the head a hold found its batch published in
        self._blind = False  # a hold's light read of the head failed: it polls its intent instead
        self._last_peek: tuple[str, Peek] | None = None  # (metadata location, its light read)

    def refresh(self, *, deadline: float) -> TableMetadata:
        """Reload the table, retrying a failing catalog with bounded, jittered backoff until ``deadline``."""
        delay = 0.05
        while True:
            try:
                refresh_if_moved(self.table)  # reads metadata.json only when the catalog pointer moved (SQL catalogs)
                self._fresh = True
                self.peeked = False
                # every producer reads the same producer table: the same count of active producers, and its age rank
                self._observe(self.table.metadata)
                self._refreshes += 1
                if self._refreshes % 32 == 1:
                    self._observe_metadata_size()
                return self.table.metadata
            except LakestreamError:
                raise  # e.g. CorruptStateError from _observe: the table was read fine, its head is malformed
            except Exception as exc:  # the catalog or storage is unreachable
                if self._clock() + delay > deadline:
                    raise CommitOutcomeUnknownError(
                        f"could not read table {self.table.name()} back from the catalog ({type(exc).__name__}); "
                        "the last commit may or may not have landed. Retry the same commit with the same seq once the "
                        "catalog is reachable: it will be reconciled, not duplicated"
                    ) from exc
                log.warning("catalog unreachable while refreshing %s (%s); retrying", self.table.name(), type(exc).__name__)
                self._sleep(delay * self._rng.uniform(0.5, 1.5))
                delay = min(delay * 2, 2.0)

    def peek(self) -> Peek | None:
        """The branch head read lightly: the catalog pointer, and the ``metadata.json`` it names as plain JSON with
        only the summaries asked for parsed (:meth:`StreamState.parse` checks them as it does for a full read).

        None when that is not possible or the head is not what a full read would accept (a catalog without a pointer
        probe, an unreachable catalog or file, the branch missing or not a branch, a snapshot the metadata does not
        list): the caller then reads the head fully, which retries, reconciles or raises as usual.
        Raises :class:`CorruptStateError` for a lakestream summary value lakestream never writes, as a full read does.
        """
        try:
            last = self._last_peek
            if last is not None and (probe := cached_probe(self.table)) is not None and probe() == last[0]:
                return last[1]  # the pointer has not moved since the last light read (a metadata file never changes)
            found = read_moved(self.table)
        except Exception:  # noqa: BLE001 - unreachable or unreadable: the full read retries and reports it
            return None
        if found is None:
            return None
        location, document = found
        if document is None:  # the pointer did not move: the loaded metadata is the head
            metadata = self.table.metadata

            def loaded(snapshot_id: object) -> StreamState | None:
                if not isinstance(snapshot_id, int) or isinstance(snapshot_id, bool):
                    return None
                snapshot = metadata.snapshot_by_id(snapshot_id)
                return StreamState.of(snapshot) if snapshot is not None else None

            return Peek(self._head_state(metadata), loaded)
        refs, snapshots = document.get("refs"), document.get("snapshots")
        ref = refs.get(self._branch) if isinstance(refs, dict) else None
        if not isinstance(ref, dict) or ref.get("type") != "branch" or not isinstance(snapshots, list):
            return None
        ids = [s.get("snapshot-id") if isinstance(s, dict) else None for s in snapshots]
        if not all(type(i) is int for i in ids) or len(set(ids)) != len(ids):
            return None  # not what lakestream or pyiceberg writes (an id that is no integer, or one id twice)
        by_id: dict[object, dict] = dict(zip(ids, snapshots, strict=True))

        def states(snapshot_id: object) -> StreamState | None:
            if not isinstance(snapshot_id, int) or isinstance(snapshot_id, bool):
                return None
            snapshot = by_id.get(snapshot_id)
            if snapshot is None:
                return None
            summary = snapshot.get("summary")
            if not isinstance(summary, dict) or not all(isinstance(v, str) for v in summary.values()):
                return None
            parent = snapshot.get("parent-snapshot-id")
            return StreamState.parse(summary, snapshot_id=snapshot_id, parent_id=parent if type(parent) is int else None)

        head_summary = by_id.get(ref.get("snapshot-id"), {}).get("summary")
        if not isinstance(head_summary, dict) or KEY_STEP not in head_summary:
            return None  # another engine's snapshot: the full read finds the state under it (or refuses it)
        head = states(ref.get("snapshot-id"))
        if head is None:
            return None
        peek = Peek(head, states)
        self._last_peek = (location, peek)
        return peek

    def _observe(self, metadata: TableMetadata) -> None:
        try:
            state = self._head_state(metadata)
        except ForeignSnapshotError:  # the planner refuses it (or repairs it): pacing has nothing to observe
            return
        self._observe_state(state)

    def _base_step(self, metadata: TableMetadata) -> int:
        """The head step an attempt plans on, for pacing (0 under a foreign data change: the planner refuses it)."""
        try:
            return self._head_state(metadata).step
        except ForeignSnapshotError:
            return 0

    def _observe_state(self, state: StreamState) -> None:
        # DAC counts the producers that contend: those that recur (committed more than once since they became
        # active) or rode in the head's group; a pool that uses every id once is one producer after another.
        recent = state.step - state.group if state.group > 1 else state.step
        self.policy.observe_head(state.step, producers=[p.step for p in state.producers.values() if p.recurring or p.step > recent],
                                 group=state.group,
                                 group_commit_s=state.group_commit_ms / 1000 if state.group_commit_ms else None)

    def _hold(self, seconds: float, carry: Carry) -> bool:
        """Wait up to ``seconds`` for the staged batch to be carried; True when it was. False (commit now) as soon as:

        * the batch leads the queue of staged batches (``carry.ahead``): every batch staged before it is published.
          Checked when the hold starts and whenever the head moves, read from the catalog pointer where that is
          cheap (SQL catalogs): the commit ahead of it landed, so the catalog is free and nobody else is due. A
          commit then starts as soon as the previous one landed, with whatever was staged meanwhile, and while it
          runs the producers it did not carry write their next batches;
        * the head has not moved for ``policy.idle_after_s``: nobody is committing (the producers ahead stopped).

        Without a pointer probe (REST catalogs) it holds for ``seconds``, polling whether its intent is gone."""
        start = self._clock()
        end = start + seconds
        idle_s = self.policy.idle_after_s
        probe = self._probe()
        lead = carry.ahead is not None and self.policy.leads_queue and probe is not None
        watch = PointerWatch(probe, start, every_s=0.0 if lead else idle_s / 4) if lead or seconds > idle_s else None
        self._carried_peek = None
        polls = not lead  # whether every poll checks the intent (with ``lead``: on every move of the head)
        while (now := self._clock()) < end:
            if lead and watch is not None and watch.moved(now):
                place = self._place(carry)
                if place is not None:
                    return place
                polls = polls or self._blind
            self._sleep(min(self.policy.poll_delay(waited=now - carry.staged_at), end - now))
            if (polls or (watch is not None and not watch.readable)) and carry.gone():  # no pointer now: the intent
                return True
            if watch is not None and seconds > idle_s and watch.idle_for(self._clock()) >= idle_s:
                log.debug("head of branch %s idle for %.3fs while holding: committing now", self._branch, idle_s)
                return False
        return False

    def _place(self, carry: Carry) -> bool | None:
        """The held batch's place once the head moved: True when it was carried (the light read that shows it is kept
        for :meth:`_answer`), False when it leads the queue (every batch staged before it is published), None to keep
        holding. Sets ``_blind`` when the head could not be read lightly (then every poll checks the intent)."""
        assert carry.ahead is not None
        self._blind = False
        if carry.gone():  # published, and its committer removed the intent
            return True
        ahead = carry.ahead()
        if ahead is None:  # no longer listed (published and removed since), or the listing failed
            return True if carry.gone() else None
        if not ahead:
            return False
        peek = self.peek()
        if peek is None:
            self._blind = True
            return None
        if carry.answer is not None and carry.answer(peek, 0) is not None:  # published by the commit that moved it
            self._carried_peek = peek
            return True
        producers = peek.state.producers
        if all((known := producers.get(producer)) is not None and known.seq >= seq for producer, seq in ahead):
            return False  # what is listed before it is published (its committer removes the intents right after)
        return None

    def _probe(self) -> Callable[[], str | None] | None:
        """The table's catalog pointer probe (None: the catalog has none, or it cannot be made now)."""
        try:
            return cached_probe(self.table)
        except Exception:  # noqa: BLE001 - e.g. the database unreachable right now: hold without watching the head
            return None

    def _observe_metadata_size(self) -> None:
        try:
            self.policy.observe_metadata(len(self.table.io.new_input(self.table.metadata_location)))
        except Exception:  # a size is only a hint for the policy
            pass

    def _head_state(self, metadata: TableMetadata) -> StreamState:
        """The branch's state (through foreign snapshots that change no data; see format/lineage.py)."""
        return branch_state(metadata, metadata.snapshot_by_name(self._branch), stream=".".join(self.table.name()),
                            branch=self._branch)

    def mark_stale(self) -> None:
        self._fresh = False
        self.peeked = False

    def run(self, planner: Planner[T], *, pace: bool = True, carry: Carry | None = None,
            escalate: Callable[[], Carry | None] | None = None) -> Outcome[T]:
        """Plan and commit until the plan lands or the planner says it is done.

        ``carry``: the caller's batch is staged for group commit (hold before each attempt). ``escalate``: called once
        when an attempt made without ``carry`` loses the swap; it may stage the batch and return its ``Carry``, so a
        producer that thought itself alone joins group commit at once.
        """
        start = self._clock()
        deadline = start + self._timeout_s
        if pace and carry is None:
            delay = self.policy.pacing_delay()
            if delay > 0:
                self._sleep(delay)
        reuse = self._fresh and self.policy.contenders < 1.5  # alone: our own last commit is still the head
        metadata = self.table.metadata if reuse or carry is not None else self.refresh(deadline=deadline)
        stale = carry is not None  # group commit: the head is read after holding, right before planning
        abandoned: list[str] = []
        attempt = 0
        sent = 0
        carried_after: float | None = None
        io_delay = 0.05
        invalid = 0
        while True:
            attempt += 1
            if carry is not None:
                waited = self._clock() - carry.staged_at if attempt == 1 else 0.0
                # after a lost swap the head just read may already show the batch published (the winner carried it)
                if attempt > 1 and carry.published(metadata):
                    hold = 0.0
                else:
                    queued = carry.queued() if carry.queued is not None and self.policy.wants_queue else None
                    led = carry.ahead is not None and self.policy.leads_queue and self._probe() is not None
                    hold = self.policy.hold_delay(waited=waited, queued=queued, led=led)
                if hold > 0:
                    if self._hold(min(hold, max(0.0, deadline - self._clock())), carry):
                        carried_after = self._clock() - carry.staged_at
                        answer = self._answer(carry, attempt)
                        if answer is not None:
                            return Outcome(answer, attempt, False, self.table.metadata, abandoned, sent, carried_after,
                                           peeked=True)
                    stale = True
                if stale:
                    metadata = self.refresh(deadline=deadline)
                    stale = False
            began = self._clock()
            base_step = self._base_step(metadata)
            try:
                plan = planner(metadata, attempt)
            except FileNotFoundError:
                # A file of the state we planned on is gone (GC collected it after a newer commit): re-plan on the head.
                self._fresh = False
                metadata = self.refresh(deadline=deadline)
                if attempt >= self._max_attempts or self._clock() >= deadline:
                    raise
                continue
            except Exception as exc:
                # Storage unreachable while writing this attempt's manifests: nothing was committed; back off, re-plan.
                io_delay = self._back_off(exc, io_delay, deadline=deadline, what=f"planning commit attempt {attempt}")
                metadata = self.refresh(deadline=deadline)
                continue
            if isinstance(plan, Done):
                if carry is not None and carried_after is None:  # found published by a commit it did not send
                    carried_after = self._clock() - carry.staged_at
                return Outcome(plan.result, attempt, False, metadata, abandoned, sent,
                               carried_after if carry is not None else None)
            readied = plan.ready is None

            def ready(plan: Plan[T] = plan) -> None:
                nonlocal readied
                readied = True
                try:
                    plan.ready()  # type: ignore[misc]
                except Exception as exc:
                    raise _WritesFailed() from exc

            unwritten: BaseException | None = None
            try:
                sent += 1
                # SQL: from the held metadata; the plan's files are waited for before the catalog's update
                response = swap(self.table, plan.requirements, plan.updates, ready=None if readied else ready)
            except _WritesFailed as failed:
                unwritten = failed.__cause__  # handled below, where it is raised as itself (not as this one's context)
            except (CommitFailedException, ValueError) as exc:
                # Lost the compare-and-swap (or a concurrent change invalidated an update): re-plan on the new head.
                invalid = invalid + 1 if isinstance(exc, ValueError) else 0
                if invalid >= 5:  # not a race: the same update keeps being refused
                    self._settle(plan, landed=False, metadata=metadata)
                    raise CommitError(
                        f"the catalog keeps refusing this commit to {self.table.name()} as invalid ({exc}); nothing was "
                        "published. This is a bug or an incompatible table change: please report it"
                    ) from exc
                abandoned.extend(plan.written)
                self._fresh = False
                metadata = self.refresh(deadline=deadline)
                self._settle(plan, landed=False, metadata=metadata)
                foreign = max(0, self._head_state(metadata).step - base_step)
                self.policy.record_attempt(started=began, ended=self._clock(), won=False, head_step=base_step + foreign, foreign=foreign)
                log.debug("commit attempt %d on %s lost (%s)", attempt, self.table.name(), exc)
                if carry is None and escalate is not None:  # not alone after all: join group commit
                    carry, escalate = escalate(), None
            except (LakestreamError, AttributeError, TypeError, NameError, KeyError, AssertionError):
                raise  # our own errors and programming errors are not catalog outcomes to reconcile
            except Exception as exc:
                # Outcome unknown: read the table back and let the planner reconcile.
                log.warning(
                    "commit attempt %d on %s failed with %s; reconciling from the table",
                    attempt,
                    self.table.name(),
                    type(exc).__name__,
                )
                self._fresh = False
                metadata = self.refresh(deadline=deadline)
                self.policy.record_attempt(started=began, ended=self._clock(), won=False, head_step=base_step, foreign=0)
            else:
                self._adopt(response.metadata, response.metadata_location, previous=metadata)
                self._settle(plan, landed=True, metadata=response.metadata)
                new_step = self._head_state(response.metadata).step
                self.policy.record_attempt(started=began, ended=self._clock(), won=True, head_step=new_step, foreign=0)
                self._observe(response.metadata)
                return Outcome(plan.result, attempt, True, response.metadata, abandoned, sent)
            finally:
                if not readied:  # the swap failed before it waited for the plan's files: nothing may still be writing
                    self._drain(plan)
            if isinstance(unwritten, Exception):
                # A file this attempt sent could not be written: nothing was swapped. As a planning failure: back off
                # and re-plan when transient (the files it did write are abandoned, as a lost swap's).
                sent -= 1  # the catalog was not asked
                abandoned.extend(plan.written)
                io_delay = self._back_off(unwritten, io_delay, deadline=deadline,
                                          what=f"writing the files of commit attempt {attempt}")
                metadata = self.refresh(deadline=deadline)
                continue
            if attempt >= self._max_attempts or self._clock() >= deadline:
                raise CommitTimeoutError(
                    f"gave up committing to {self.table.name()} after {attempt} attempts and "
                    f"{self._clock() - start:.1f}s of contention; nothing was published. Retry the same call (same seq) "
                    "or raise lakestream.commit.timeout-ms / lakestream.commit.max-attempts"
                )
            if carry is not None:
                continue  # hold again (its length comes from the position in the new head's group)
            delay = self.policy.retry_delay(attempt)
            if delay > 0:
                self._sleep(delay)
                # plan the retry on the head as it is now: a commit that landed during the sleep would doom it
                metadata = self.refresh(deadline=deadline)

    def _back_off(self, exc: Exception, delay: float, *, deadline: float, what: str) -> float:
        """After a storage failure that published nothing: raise ``exc`` unless it is transient and ``delay`` fits
        before ``deadline``; else sleep about ``delay`` and return the next one (the caller re-reads the head)."""
        if not transient(exc) or self._clock() + delay > deadline:
            raise exc
        log.warning("%s on %s failed (%s); retrying", what, self.table.name(), type(exc).__name__)
        self._sleep(delay * self._rng.uniform(0.5, 1.5))
        self._fresh = False
        return min(delay * 2, 2.0)

    @staticmethod
    def _drain(plan: Plan[T]) -> None:
        """Wait for a plan's files that are still in flight, failures dropped (its swap was not sent)."""
        if plan.ready is not None:
            try:
                plan.ready()
            except Exception:  # noqa: BLE001 - the attempt failed already; nothing names these files
                pass

    def _answer(self, carry: Carry, attempt: int) -> T | None:
        """The carried batch's final answer from a light read of the head (see :meth:`peek`), or None."""
        peek, self._carried_peek = self._carried_peek, None
        if carry.answer is None or (peek is None and (peek := self.peek()) is None):
            return None
        answer = carry.answer(peek, attempt)
        if answer is None:
            return None
        self._observe_state(peek.state)
        self._fresh = False  # table.metadata is older than the head now
        self.peeked = True
        return answer  # type: ignore[return-value]

    def _settle(self, plan: Plan[T], *, landed: bool, metadata: TableMetadata) -> None:
        if plan.settle is None:
            return
        try:
            plan.settle(landed, metadata.snapshot_by_name(self._branch))
        except Exception:  # noqa: BLE001 - cache upkeep (it may read a manifest list): never a commit's outcome
            log.debug("cache upkeep after a commit attempt on %s failed", self.table.name(), exc_info=True)

    def _adopt(self, metadata: TableMetadata, location: str, *, previous: TableMetadata) -> None:
        """Take the committed metadata as the table's current state (no reload) and drop the metadata files that aged
        out of its log, when ``write.metadata.delete-after-commit.enabled`` says so (as Iceberg's writers do: off
        unless set; lakestream sets it when it creates a stream, and a user may turn it off)."""
        self.table.metadata = metadata
        self.table.metadata_location = location
        self._fresh = True
        self.peeked = False
        if not _deletes_old_metadata(metadata):
            return
        kept = {entry.metadata_file for entry in metadata.metadata_log}
        for entry in previous.metadata_log:
            if entry.metadata_file not in kept:
                try:
                    self.table.io.delete(entry.metadata_file)
                except Exception:  # already gone, or deleted by the producer that aged it out first
                    pass
