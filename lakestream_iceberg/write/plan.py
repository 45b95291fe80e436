"""What the commit loop (:mod:`lakestream_iceberg.write.commit`) and its planners say to each other.

A :class:`Planner` is one commit call: :meth:`Planner.plan` answers a head with a :class:`Plan` (one compare-and-swap)
or :class:`Done` (nothing to commit); while its batch is staged for group commit it is also a :class:`Carry`, which the
loop asks while it holds. :meth:`CommitLoop.run <lakestream_iceberg.write.commit.CommitLoop.run>` returns an
:class:`Outcome`. A :class:`Peek` is the head as a light read found it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.table.update import TableRequirement, TableUpdate

from lakestream_iceberg.format.summary import StreamState

__all__ = ["Carry", "Done", "FunctionPlanner", "Outcome", "Peek", "Plan", "Planner"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


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


@dataclass
class Done(Generic[T]):
    """The planner found nothing to commit (e.g. the batch is already published)."""

    result: T


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
    """The branch head as a light read found it: its state, ``states(snapshot_id)``, the state any snapshot of
    that metadata records (None for a snapshot it does not hold), and ``head``, the head's snapshot id and sequence
    number (None when not told)."""

    state: StreamState
    states: Callable[[object], StreamState | None]
    head: tuple[int, int] | None = None


class Carry(Protocol[T_co]):
    """Group commit: the caller's batch, staged since ``staged_at`` (loop clock), which any producer's commit may
    publish (*carry*). The loop holds before each attempt, asking it:"""

    staged_at: float

    def gone(self) -> bool:
        """Whether its intent has disappeared, i.e. a commit published it."""

    def published(self, metadata: TableMetadata) -> bool:
        """Whether ``metadata``'s head shows it published."""

    def queued(self) -> int:
        """How many staged batches are older than this one (a listing; see ``CommitPolicy.hold_delay``)."""

    def ahead(self) -> list[tuple[str, int]] | None:
        """(producer, seq) of the staged batches older than this one that a commit could still publish (one
        listing); None when this one is no longer listed or the listing failed. It leads the queue once all of them
        are published."""

    def answer(self, peek: Peek, attempt: int) -> T_co | None:
        """Once the batch is gone: the final answer from a light read of the head, or None to read it fully and
        plan."""


class Planner(Protocol[T]):
    """One commit call, as :meth:`CommitLoop.run` drives it: plan on a head, and group commit's staged batch."""

    def plan(self, metadata: TableMetadata, attempt: int) -> Plan[T] | Done[T]:
        """The commit to attempt on ``metadata`` (attempt 1, 2, ...), or the final answer without one."""

    def carry(self) -> Carry[T] | None:
        """The caller's batch as staged for group commit (hold before each attempt), or None: commit directly."""

    def escalate(self) -> Carry[T] | None:
        """Called once, when an attempt made without a carry loses the swap: it may stage the batch and return its
        carry, so a producer that thought itself alone joins group commit at once."""


@dataclass(frozen=True)
class FunctionPlanner(Generic[T]):
    """A plain function of ``(metadata, attempt)`` as a :class:`Planner`: a commit that is never staged
    (checkpoints, releases, forks, repair, GC)."""

    function: Callable[[TableMetadata, int], Plan[T] | Done[T]]

    def plan(self, metadata: TableMetadata, attempt: int) -> Plan[T] | Done[T]:
        return self.function(metadata, attempt)

    def carry(self) -> Carry[T] | None:
        return None

    def escalate(self) -> Carry[T] | None:
        return None
