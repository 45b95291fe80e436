"""The commit loop: optimistic concurrency against the catalog's compare-and-swap, paced and retried by DAC.

This module owns every retry of a lakestream commit (pyiceberg's own are turned off on stream tables). One call of
:meth:`CommitLoop.run` drives one :class:`Planner`, an object with named steps: :meth:`Planner.plan` turns the table's
current metadata into either a commit plan (updates + requirements) or a final answer (e.g. "already published"). Each
attempt re-plans on freshly loaded metadata, so data files are never rewritten, only the small manifests and the
snapshot. A producer's commit is a :class:`~lakestream_iceberg.write.planner.BatchPlanner`; control commits
(checkpoints, GC, repair) pass a plain function, run as a :class:`FunctionPlanner`.

``run`` is a loop of named steps: [:meth:`CommitLoop._take_turn` ->] :meth:`CommitLoop._plan` -> :meth:`CommitLoop._send`
(-> ``_won`` / ``_lost`` / ``_unknown``) -> :meth:`CommitLoop._check_budget` -> :meth:`CommitLoop._pause`. Outcomes of one
attempt:
* the swap is won: done;
* the swap is lost (``CommitFailedException``, or a concurrent change that made an update invalid): re-plan on the
  refreshed table after the DAC retry delay;
* anything else (``CommitStateUnknownException``, a dropped database connection, a 5xx): the commit may or may not
  have landed. The table is read back (with bounded backoff while the catalog is unreachable) and the planner decides
  from the published state, never a blind repeat. A repeat is safe anyway: every plan requires the branch to still
  point at the parent it was built on, so at most one of two racing copies can land;
* a :class:`LakestreamError` (a planner's refusal, or :class:`CorruptStateError` for a head whose summary holds a value
  lakestream never writes) propagates at once, from the planner and from every read of the head: the table was read,
  so it is not a catalog outage, and retrying until the timeout would only hide it;
* a file of the head planned on was deleted by GC (``FileNotFoundError``): the head is read again and the planner runs
  once more on it (:func:`~lakestream_iceberg.format.table.after_gc`, as every reader does).

Group commit (:meth:`Planner.carry`): the caller's batch is staged (:mod:`lakestream_iceberg.write.staging`), and any
producer's commit may publish it. Before each attempt the loop *holds* for as long as the policy says, polling whether
the staged batch is gone (:meth:`Carry.gone`: another commit carried it), or, where the catalog pointer is cheap to
read, whether the head moved: then the batch was carried, or leads the queue of staged batches (:meth:`Carry.ahead`)
and is committed at once (:mod:`lakestream_iceberg.write.hold`); then it reads the head and the planner either finds the batch
published (done, with no attempt of its own) or plans a commit of every staged batch. Once the staged batch is gone
the head is first read *lightly* (:meth:`CommitLoop.peek`, :mod:`lakestream_iceberg.write.peek`: the new ``metadata.json`` as plain JSON, only the summaries
asked for parsed): when it shows the batch published (:meth:`Carry.answer`) the call returns from that, and the
producer's next commit plans on a full read of the head, which it makes anyway right before planning. Parsing the
whole metadata into pyiceberg's ``TableMetadata`` costs several times more, and in a group commit most batches are
carried. A planner that committed alone and loses a swap may stage its batch then (:meth:`Planner.escalate`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import CommitTableResponse, Table
from pyiceberg.table.metadata import TableMetadata

from lakestream_iceberg.connect.diagnose import explain, one_line, transient
from lakestream_iceberg.connect.log_limit import WarningLimit
from lakestream_iceberg.connect.notify import CommitNotices
from lakestream_iceberg.connect.pointer import cached_probe, refresh_if_moved
from lakestream_iceberg.connect.swap import swap
from lakestream_iceberg.errors import (
    CommitError,
    CommitOutcomeUnknownError,
    CommitTimeoutError,
    ForeignSnapshotError,
    LakestreamError,
)
from lakestream_iceberg.format.layout import check_format_version
from lakestream_iceberg.format.summary import StreamState
from lakestream_iceberg.format.table import after_gc
from lakestream_iceberg.write.dac import CommitPolicy
from lakestream_iceberg.write.hold import Hold
from lakestream_iceberg.write.peek import HeadPeek, head_state
from lakestream_iceberg.write.plan import Carry, Done, FunctionPlanner, Outcome, Peek, Plan, Planner

log = logging.getLogger(__name__)
_failures = WarningLimit(log)  # retried failures: one warning per kind per interval in a process, the rest at DEBUG

T = TypeVar("T")


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


class _WritesFailed(Exception):
    """A file of the plan could not be written (its cause): raised before the catalog's update, nothing published."""


class _PlanFiles:
    """A plan's files that may still be in flight (``Plan.ready``): waited for once, by the swap (:meth:`wait`) or,
    when the swap failed before it waited, by :meth:`drain` with failures dropped (nothing names these files)."""

    def __init__(self, plan: Plan[T]) -> None:
        self._ready = plan.ready
        self.pending = plan.ready is not None

    def wait(self) -> None:
        self.pending = False
        try:
            self._ready()  # type: ignore[misc]
        except Exception as exc:
            raise _WritesFailed() from exc

    def drain(self) -> None:
        if self.pending:
            self.pending = False
            try:
                self._ready()  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - the attempt failed already; nothing names these files
                pass


class _Next(Enum):
    """What follows an attempt that did not land."""

    REPLAN = "replan"  # at once: nothing was sent (a file of the plan could not be written)
    RETRY = "retry"  # within the budget, after a hold (staged) or the retry delay: the swap was lost or its outcome unknown


@dataclass
class _Call(Generic[T]):
    """The state of one :meth:`CommitLoop.run` across its attempts."""

    planner: Planner[T]
    carry: Carry[T] | None  # the batch as staged for group commit (set by escalate() after a lost swap)
    start: float
    deadline: float
    metadata: TableMetadata  # the head the next attempt plans on
    stale: bool  # read the head again before planning
    attempt: int = 0  # loop iterations (attempts, and the reconciling read that ended the loop)
    sent: int = 0  # compare-and-swap requests sent
    abandoned: list[str] = field(default_factory=list)  # files written by attempts that did not land
    carried_after: float | None = None
    io_delay: float = 0.05  # the next back-off after a storage failure that published nothing
    invalid: int = 0  # consecutive attempts refused as invalid (ValueError)
    escalated: bool = False
    failure: str | None = None  # the last attempt's failure, when it failed (not lost a race): what a timeout names

    def plan(self) -> Plan[T] | Done[T]:
        return self.planner.plan(self.metadata, self.attempt)


class CommitLoop:
    """Runs planners against one table until they land, their answer is final, or the budget is spent.

    The loop holds ``table``, its owner's view of the table (a producer's own copy, or the stream's for control
    commits). Two methods change it in place: :meth:`refresh` (reload from the catalog) and :meth:`adopt` (take the
    metadata a commit returned); nothing else does. :attr:`fresh` says whether the view was read (or committed) since
    it was last marked stale.
    """

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
        self._policy = policy
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
        self._peek = HeadPeek(table=table, branch=branch)
        self._notices: CommitNotices | None | bool = False  # False: not looked up yet
        self._hold = Hold(policy=policy, branch=branch, probe=self._probe, peek=self.peek, clock=clock, sleep=sleep,
                          notices=self._commit_notices)

    def refresh(self, *, deadline: float) -> TableMetadata:
        """Reload the table, retrying a failing catalog with bounded, jittered backoff until ``deadline``."""
        delay = 0.05
        while True:
            try:
                refresh_if_moved(self.table)  # reads metadata.json only when the catalog pointer moved (SQL catalogs)
                # before the head is parsed: a newer lakestream_iceberg may have upgraded the stream (a producer's
                # next_seq, GC's reads of the head and every commit attempt read it through here)
                check_format_version(self.table.metadata.properties, stream=".".join(self.table.name()))
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
                # an OSError is the object store's (the table's metadata file), anything else the catalog's
                where = "the object store" if isinstance(exc, OSError) else "the catalog"
                if self._clock() + delay > deadline:
                    raise CommitOutcomeUnknownError(
                        f"could not read table {self.table.name()} back from {where} ({one_line(exc)}); the last "
                        f"commit may or may not have landed. Retry the same commit with the same seq once {where} "
                        "answers: it will be reconciled, not duplicated"
                    ) from exc
                _failures.warning(("refresh", where, type(exc).__name__),
                                  "%s unreachable or failing while refreshing %s (%s); retrying", where,
                                  self.table.name(), type(exc).__name__)
                self._sleep(delay * self._rng.uniform(0.5, 1.5))
                delay = min(delay * 2, 2.0)

    @property
    def policy(self) -> CommitPolicy:
        """The pacing, retry and hold policy (replaceable: the hold follows)."""
        return self._policy

    @policy.setter
    def policy(self, policy: CommitPolicy) -> None:
        self._policy = policy
        self._hold.policy = policy

    def peek(self) -> Peek | None:
        """The branch head read lightly (see :meth:`HeadPeek.read`); None when the caller must read it fully."""
        return self._peek.read()

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

    def _commit_notices(self) -> CommitNotices | None:
        """The table's commit notifications (None: its catalog sends none, or they cannot be set up now)."""
        if self._notices is False:
            try:
                self._notices = CommitNotices.open(self.table)
            except Exception:  # noqa: BLE001 - e.g. the database unreachable right now: holds poll, asked again later
                return None
        return self._notices if isinstance(self._notices, CommitNotices) else None

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
        return head_state(self.table, metadata, self._branch)

    @property
    def metadata(self) -> TableMetadata:
        """The view's current metadata (as last refreshed or adopted; not read again)."""
        return self.table.metadata

    @property
    def fresh(self) -> bool:
        """Whether the view was refreshed or committed since :meth:`mark_stale` (or a failed attempt) made it stale."""
        return self._fresh

    def mark_stale(self) -> None:
        """The next call reads the head again before it plans (also after a :class:`ForeignSnapshotError`: a view
        showing the foreign change is never planned on again, so a repair made meanwhile is seen)."""
        self._fresh = False
        self.peeked = False

    def run(self, planner: Planner[T] | Callable[[TableMetadata, int], Plan[T] | Done[T]], *,
            pace: bool = True) -> Outcome[T]:
        """Plan and commit until the plan lands or the planner says it is done.

        Each attempt: hold while the planner's batch is staged (group commit: it may be carried meanwhile), plan on
        the head (:meth:`_plan`), send the plan (:meth:`_send`), then, when it did not land, re-plan at once, after
        a hold, or after the policy's retry delay, within the budget (:meth:`_check_budget`).

        Args:
            planner: A :class:`Planner`, or a plain function of ``(metadata, attempt)`` for a commit that is never
                staged (:class:`FunctionPlanner`).
            pace: Sleep the policy's pacing delay before a commit that is not staged.
        """
        call = self._begin(planner if not callable(planner) else FunctionPlanner(planner), pace=pace)
        try:
            return self._attempts(call)
        except ForeignSnapshotError:
            # Refused on a head another engine changed (by the planner, or by the pacing read after a lost swap): the
            # view that shows it must not be reused, since the branch may be repaired (here or by another process)
            # before the next call, which then reads the head again and plans on the repaired one.
            self.mark_stale()
            raise

    def _attempts(self, call: _Call[T]) -> Outcome[T]:
        """The attempts of one :meth:`run` until one lands or the planner's answer is final."""
        while True:
            call.attempt += 1
            if call.carry is not None and (carried := self._take_turn(call)) is not None:
                return carried
            began, base_step = self._clock(), self._base_step(call.metadata)
            plan = self._plan(call)
            if plan is None:  # storage failed while planning: backed off, the head read again
                continue
            if isinstance(plan, Done):
                return self._found(call, plan)
            sent = self._send(call, plan, began=began, base_step=base_step)
            if isinstance(sent, Outcome):
                return sent
            if sent is _Next.REPLAN:  # a file of the plan could not be written: nothing was swapped
                continue
            self._check_budget(call)
            if call.carry is None:
                self._pause(call)

    def _begin(self, planner: Planner[T], *, pace: bool) -> _Call[T]:
        """The call's state before its first attempt; paced and on a fresh head when not staged."""
        start = self._clock()
        deadline = start + self._timeout_s
        carry = planner.carry()
        if pace and carry is None:
            delay = self.policy.pacing_delay()
            if delay > 0:
                self._sleep(delay)
        reuse = self._fresh and self.policy.contenders < 1.5  # alone: our own last commit is still the head
        # group commit: the head is read after holding, right before planning
        metadata = self.table.metadata if reuse or carry is not None else self.refresh(deadline=deadline)
        return _Call(planner=planner, carry=carry, start=start, deadline=deadline, metadata=metadata,
                     stale=carry is not None)

    def _take_turn(self, call: _Call[T]) -> Outcome[T] | None:
        """Group commit, before an attempt: hold as long as the policy says; the Outcome when the batch was carried
        meanwhile and a light read of the head answers the call, else None with the head read (when the hold makes
        it stale) for the attempt."""
        carry = call.carry
        assert carry is not None
        hold = self._hold.delay(carry, attempt=call.attempt, head=call.metadata)
        if hold > 0:
            if self._hold.wait(min(hold, max(0.0, call.deadline - self._clock())), carry):
                call.carried_after = self._clock() - carry.staged_at
                answer = self._answer(carry, call.attempt)
                if answer is not None:
                    return Outcome(answer, call.attempt, False, self.table.metadata, call.abandoned, call.sent,
                                   call.carried_after, peeked=True)
            call.stale = True
        if call.stale:
            call.metadata = self.refresh(deadline=call.deadline)
            call.stale = False
        return None

    def _plan(self, call: _Call[T]) -> Plan[T] | Done[T] | None:
        """The planner's answer on the call's head; None after a transient storage failure (backed off, the head
        read again: re-plan). When GC deleted a file of the head planned on, it plans once more on the current head
        (:func:`after_gc`)."""
        try:
            return after_gc(call.plan, refresh=lambda: self._reread(call))
        except Exception as exc:
            # Storage unreachable while writing this attempt's manifests: nothing was committed; back off, re-plan.
            call.io_delay = self._back_off(exc, call.io_delay, deadline=call.deadline,
                                           what=f"planning commit attempt {call.attempt}")
            call.metadata = self.refresh(deadline=call.deadline)
            return None

    def _reread(self, call: _Call[T]) -> None:
        self._fresh = False
        call.metadata = self.refresh(deadline=call.deadline)

    def _found(self, call: _Call[T], done: Done[T]) -> Outcome[T]:
        """The planner found nothing to commit (e.g. the batch published by a commit this call did not send)."""
        if call.carry is not None and call.carried_after is None:
            call.carried_after = self._clock() - call.carry.staged_at
        return Outcome(done.result, call.attempt, False, call.metadata, call.abandoned, call.sent,
                       call.carried_after if call.carry is not None else None)

    def _send(self, call: _Call[T], plan: Plan[T], *, began: float, base_step: int) -> Outcome[T] | _Next:
        """One compare-and-swap of ``plan``: the Outcome when it landed, else what to do next (the head is read
        again either way)."""
        files = _PlanFiles(plan)
        call.sent += 1
        try:
            # SQL: from the held metadata; the plan's files are waited for before the catalog's update
            response = swap(self.table, plan.requirements, plan.updates, ready=files.wait if files.pending else None)
        except _WritesFailed as failed:
            unwritten = failed.__cause__  # handled below, where it is raised as itself (not as this one's context)
        except (CommitFailedException, ValueError) as exc:
            self._lost(call, plan, exc, began=began, base_step=base_step)
            return _Next.RETRY
        except (LakestreamError, AttributeError, TypeError, NameError, KeyError, AssertionError):
            raise  # our own errors and programming errors are not catalog outcomes to reconcile
        except Exception as exc:
            self._unknown(call, exc, began=began, base_step=base_step)
            return _Next.RETRY
        else:
            return self._won(call, plan, response, began=began)
        finally:
            files.drain()  # the swap failed before it waited for the plan's files: nothing may still be writing
        # A file this attempt sent could not be written: nothing was swapped. As a planning failure: back off and
        # re-plan when transient (the files it did write are abandoned, as a lost swap's).
        call.sent -= 1  # the catalog was not asked
        call.abandoned.extend(plan.written)
        assert isinstance(unwritten, Exception)
        call.io_delay = self._back_off(unwritten, call.io_delay, deadline=call.deadline,
                                       what=f"writing the files of commit attempt {call.attempt}")
        call.metadata = self.refresh(deadline=call.deadline)
        return _Next.REPLAN

    def _won(self, call: _Call[T], plan: Plan[T], response: CommitTableResponse, *, began: float) -> Outcome[T]:
        self.adopt(response.metadata, response.metadata_location, previous=call.metadata)
        self._settle(plan, landed=True, metadata=response.metadata)
        # landed: a branch another engine changed (a fork or release on a control loop of main) must not make it
        # look failed
        new_step = self._base_step(response.metadata)
        self.policy.record_attempt(started=began, ended=self._clock(), won=True, head_step=new_step, foreign=0)
        self._observe(response.metadata)
        return Outcome(plan.result, call.attempt, True, response.metadata, call.abandoned, call.sent)

    def _lost(self, call: _Call[T], plan: Plan[T], exc: Exception, *, began: float, base_step: int) -> None:
        """Lost the compare-and-swap (or a concurrent change invalidated an update): the new head is read for the
        re-plan; a caller that committed alone may join group commit now (:meth:`Planner.escalate`)."""
        call.invalid = call.invalid + 1 if isinstance(exc, ValueError) else 0
        call.failure = None
        if call.invalid >= 5:  # not a race: the same update keeps being refused
            self._settle(plan, landed=False, metadata=call.metadata)
            raise CommitError(
                f"the catalog keeps refusing this commit to {self.table.name()} as invalid ({exc}); nothing was "
                "published. This is a bug or an incompatible table change: please report it"
            ) from exc
        call.abandoned.extend(plan.written)
        self._fresh = False
        call.metadata = self.refresh(deadline=call.deadline)
        self._settle(plan, landed=False, metadata=call.metadata)
        foreign = max(0, self._base_step(call.metadata) - base_step)  # a fork or release on main that needs repair retries
        self.policy.record_attempt(started=began, ended=self._clock(), won=False, head_step=base_step + foreign,
                                   foreign=foreign)
        log.debug("commit attempt %d on %s lost (%s)", call.attempt, self.table.name(), exc)
        if call.carry is None and not call.escalated:  # not alone after all: join group commit
            call.escalated = True
            call.carry = call.planner.escalate()

    def _unknown(self, call: _Call[T], exc: Exception, *, began: float, base_step: int) -> None:
        """Outcome unknown: the table is read back and the planner reconciles from it on the next attempt."""
        _failures.warning(("unknown", type(exc).__name__),
                          "commit attempt %d on %s failed with %s; reconciling from the table", call.attempt,
                          self.table.name(), type(exc).__name__)
        call.failure = one_line(exc)
        self._fresh = False
        call.metadata = self.refresh(deadline=call.deadline)
        self.policy.record_attempt(started=began, ended=self._clock(), won=False, head_step=base_step, foreign=0)

    def _check_budget(self, call: _Call[T]) -> None:
        if call.attempt >= self._max_attempts or self._clock() >= call.deadline:
            why = "contention with other commits" if call.failure is None else f"failures (the last: {call.failure})"
            error = CommitTimeoutError(
                f"gave up committing to {self.table.name()} after {call.attempt} attempts and "
                f"{self._clock() - call.start:.1f}s of {why}; nothing was published. Retry the same call (same "
                "seq) or raise lakestream.commit.timeout-ms / lakestream.commit.max-attempts"
            )
            error.why = why
            raise error

    def _pause(self, call: _Call[T]) -> None:
        """Before a retry that is not staged (a staged one holds again instead): the policy's retry delay, then the
        head as it is now: a commit that landed during the sleep would doom a plan on the older one."""
        delay = self.policy.retry_delay(call.attempt)
        if delay > 0:
            self._sleep(delay)
            call.metadata = self.refresh(deadline=call.deadline)

    def _back_off(self, exc: Exception, delay: float, *, deadline: float, what: str) -> float:
        """After a storage failure that published nothing: raise ``exc`` unless it is transient and ``delay`` fits
        before ``deadline``; else sleep about ``delay`` and return the next one (the caller re-reads the head)."""
        if not transient(exc):
            raise exc
        if self._clock() + delay > deadline:
            if explain(exc, self.table.io.properties) is not None:
                raise exc  # unreachable, refused: its owner's config_errors names the setting
            error = CommitTimeoutError(  # throttled, failing: storage, not a setting; the budget ran out
                f"{what} on {self.table.name()} kept failing until lakestream.commit.timeout-ms ran out (the last: "
                f"{one_line(exc)}); nothing was published. Retry the same call (same seq) once the object store "
                "recovers, or raise lakestream.commit.timeout-ms"
            )
            error.why = f"failures of the object store (the last: {one_line(exc)})"
            raise error from exc
        _failures.warning(("storage", type(exc).__name__), "%s on %s failed (%s); retrying", what, self.table.name(),
                          type(exc).__name__)
        self._sleep(delay * self._rng.uniform(0.5, 1.5))
        self._fresh = False
        return min(delay * 2, 2.0)

    def _answer(self, carry: Carry[T], attempt: int) -> T | None:
        """The carried batch's final answer from a light read of the head (see :meth:`peek`), or None."""
        peek = self._hold.take_peek()
        if peek is None and (peek := self.peek()) is None:
            return None
        answer = carry.answer(peek, attempt)
        if answer is None:
            return None
        self._observe_state(peek.state)
        self._fresh = False  # table.metadata is older than the head now
        self.peeked = True
        return answer

    def _settle(self, plan: Plan[T], *, landed: bool, metadata: TableMetadata) -> None:
        if plan.settle is None:
            return
        try:
            plan.settle(landed, metadata.snapshot_by_name(self._branch))
        except Exception:  # noqa: BLE001 - cache upkeep (it may read a manifest list): never a commit's outcome
            log.debug("cache upkeep after a commit attempt on %s failed", self.table.name(), exc_info=True)

    def adopt(self, metadata: TableMetadata, location: str, *, previous: TableMetadata) -> None:
        """Take the metadata a commit of this loop returned as the table view's current state (no reload): one of the
        two places that change :attr:`table` (with :meth:`refresh`). Then drop the metadata files that aged out of
        its log, when ``write.metadata.delete-after-commit.enabled`` says so (as Iceberg's writers do: off unless set;
        lakestream sets it when it creates a stream, and a user may turn it off)."""
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

