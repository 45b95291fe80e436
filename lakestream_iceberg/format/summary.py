"""The lakestream part of an Iceberg snapshot summary: step, producer, sequence, and every producer's state.

Every snapshot a stream writes carries the complete producer table (``producer id -> [last seq, step, snapshot id]``)
as of that snapshot. A producer's exactly-once state is therefore recovered from the head snapshot alone, even after
older snapshots were expired, and a commit that reads the head and wins the compare-and-swap has checked its
(producer, seq) against the state it replaces: the check and the publish are one atomic step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from lakestream_iceberg.errors import StepCollectedError, StepNotPublishedError

OP_APPEND = "append"
OP_COLLECT = "collect"
OP_CHECKPOINT = "checkpoint"

KEY_OP = "lakestream.op"
KEY_STEP = "lakestream.step"
KEY_PRODUCER = "lakestream.producer"
KEY_SEQ = "lakestream.seq"
KEY_PRODUCERS = "lakestream.producers"
KEY_ATTEMPTS = "lakestream.attempts"
KEY_CHECKPOINT = "lakestream.checkpoint"
KEY_SOURCE_SNAPSHOT = "lakestream.source-snapshot-id"
KEY_COLLECTED_BELOW = "lakestream.collected-below"
KEY_GROUP = "lakestream.group"  # batches published by the commit that wrote this snapshot (group commit; absent: 1)
KEY_COMMITTER = "lakestream.committer"  # the producer whose compare-and-swap published it (absent: its own producer)
KEY_GROUP_MS = "lakestream.group-commit-ms"  # the committer's typical critical section: how long holders should expect


@dataclass(frozen=True)
class ProducerState:
    """What the table knows of one producer: its last published sequence, at which step and in which snapshot."""

    seq: int
    step: int
    snapshot_id: int


@dataclass(frozen=True)
class StreamState:
    """The lakestream fields of one snapshot summary."""

    op: str
    step: int
    producers: Mapping[str, ProducerState]
    collected_below: int = 1
    producer: str | None = None
    seq: int | None = None
    group: int = 1
    committer: str | None = None
    group_commit_ms: float | None = None

    @classmethod
    def empty(cls) -> StreamState:
        return cls(op=OP_APPEND, step=0, producers={})

    @classmethod
    def parse(cls, summary: Mapping[str, str] | None) -> StreamState:
        if not summary or KEY_STEP not in summary:
            return cls.empty()
        raw = json.loads(summary.get(KEY_PRODUCERS, "{}"))
        return cls(
            op=summary.get(KEY_OP, OP_APPEND),
            step=int(summary[KEY_STEP]),
            producers={k: ProducerState(int(v[0]), int(v[1]), int(v[2])) for k, v in raw.items()},
            collected_below=int(summary.get(KEY_COLLECTED_BELOW, "1")),
            producer=summary.get(KEY_PRODUCER),
            seq=int(summary[KEY_SEQ]) if KEY_SEQ in summary else None,
            group=int(summary.get(KEY_GROUP, "1")),
            committer=summary.get(KEY_COMMITTER),
            group_commit_ms=float(summary[KEY_GROUP_MS]) if KEY_GROUP_MS in summary else None,
        )

    def next_seq(self, producer_id: str) -> int:
        state = self.producers.get(producer_id)
        return 0 if state is None else state.seq + 1

    def properties(self, **extra: str) -> dict[str, str]:
        props = {
            KEY_OP: self.op,
            KEY_STEP: str(self.step),
            KEY_COLLECTED_BELOW: str(self.collected_below),
            KEY_PRODUCERS: json.dumps(
                {k: [v.seq, v.step, v.snapshot_id] for k, v in sorted(self.producers.items())}, separators=(",", ":")
            ),
        }
        if self.producer is not None:
            props[KEY_PRODUCER] = self.producer
        if self.seq is not None:
            props[KEY_SEQ] = str(self.seq)
        if self.group != 1:
            props[KEY_GROUP] = str(self.group)
        if self.committer is not None and self.committer != self.producer:
            props[KEY_COMMITTER] = self.committer
        if self.group_commit_ms is not None:
            props[KEY_GROUP_MS] = f"{self.group_commit_ms:.1f}"
        props.update(extra)
        return props


def missing_step_error(step: int, state: StreamState, branch: str, name: str) -> Exception:
    """The right error for a step whose files are not in the branch's table state."""
    if step > state.step:
        return StepNotPublishedError(
            f"step {step} of {name} (branch {branch!r}) is not published yet (head step is {state.step}); "
            "use wait_for(step, timeout=...) to block until it is"
        )
    return StepCollectedError(
        f"step {step} of {name} (branch {branch!r}) is no longer in the table: lifecycle GC collected it (steps below "
        f"{state.collected_below} are gone) or the branch was forked after it; resume from a retained checkpoint"
    )
