"""The lakestream part of an Iceberg snapshot summary: step, producer, sequence, and the producer state.

Every snapshot a stream writes carries, as of that snapshot, the state of its active producers (``producer id ->
[last seq, step, snapshot id, first step]``) and the list of producer-state files holding every idle producer (see
:mod:`lakestream_iceberg.format.producers`). A producer's exactly-once state is therefore recovered from the head
snapshot alone, even after older snapshots were expired, and a commit that reads the head and wins the
compare-and-swap has checked its (producer, seq) against the state it replaces: the check and the publish are one
atomic step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from pyiceberg.io import FileIO

from lakestream_iceberg.errors import StepCollectedError, StepNotPublishedError
from lakestream_iceberg.format.producers import DEFAULT_FILES, ProducerState

OP_APPEND = "append"
OP_COLLECT = "collect"
OP_CHECKPOINT = "checkpoint"

KEY_OP = "lakestream.op"
KEY_STEP = "lakestream.step"
KEY_PRODUCER = "lakestream.producer"
KEY_SEQ = "lakestream.seq"
KEY_PRODUCERS = "lakestream.producers"  # the active producers (see lakestream_iceberg.format.producers)
KEY_PRODUCER_FILES = "lakestream.producer-files"  # producer-state files of idle producers, oldest first
KEY_ATTEMPTS = "lakestream.attempts"
KEY_CHECKPOINT = "lakestream.checkpoint"
KEY_SOURCE_SNAPSHOT = "lakestream.source-snapshot-id"
KEY_COLLECTED_BELOW = "lakestream.collected-below"
KEY_GROUP = "lakestream.group"  # batches published by the commit that wrote this snapshot (group commit; absent: 1)
KEY_COMMITTER = "lakestream.committer"  # the producer whose compare-and-swap published it (absent: its own producer)
KEY_GROUP_MS = "lakestream.group-commit-ms"  # the committer's typical critical section: how long holders should expect


@dataclass(frozen=True)
class StreamState:
    """The lakestream fields of one snapshot summary."""

    op: str
    step: int
    producers: Mapping[str, ProducerState]  # the active producers only: see ``producer_files`` and :meth:`lookup`
    collected_below: int = 1
    producer: str | None = None
    seq: int | None = None
    group: int = 1
    committer: str | None = None
    group_commit_ms: float | None = None
    producer_files: tuple[str, ...] = ()

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
            producers={k: ProducerState(int(v[0]), int(v[1]), int(v[2]), int(v[3]) if len(v) > 3 else None)
                       for k, v in raw.items()},
            collected_below=int(summary.get(KEY_COLLECTED_BELOW, "1")),
            producer=summary.get(KEY_PRODUCER),
            seq=int(summary[KEY_SEQ]) if KEY_SEQ in summary else None,
            group=int(summary.get(KEY_GROUP, "1")),
            committer=summary.get(KEY_COMMITTER),
            group_commit_ms=float(summary[KEY_GROUP_MS]) if KEY_GROUP_MS in summary else None,
            producer_files=tuple(str(p) for p in json.loads(summary.get(KEY_PRODUCER_FILES, "[]"))),
        )

    def lookup(self, io: FileIO, producer_id: str) -> ProducerState | None:
        """What this snapshot knows of a producer: the active map first, then the producer-state files."""
        found = self.producers.get(producer_id)
        if found is None and self.producer_files:
            found = DEFAULT_FILES.lookup(io, self.producer_files, producer_id)
        return found

    def next_seq(self, io: FileIO, producer_id: str) -> int:
        """The producer's next sequence number (0 for an id this snapshot never saw)."""
        found = self.lookup(io, producer_id)
        return 0 if found is None else found.seq + 1

    def all_producers(self, io: FileIO) -> dict[str, ProducerState]:
        """Every producer this snapshot knows, compacted ones included (reads the producer-state files)."""
        out = DEFAULT_FILES.merged(io, self.producer_files) if self.producer_files else {}
        out.update(self.producers)
        return out

    def properties(self, **extra: str) -> dict[str, str]:
        props = {
            KEY_OP: self.op,
            KEY_STEP: str(self.step),
            KEY_COLLECTED_BELOW: str(self.collected_below),
            KEY_PRODUCERS: json.dumps(
                {k: [v.seq, v.step, v.snapshot_id, *([] if v.first is None else [v.first])]
                 for k, v in sorted(self.producers.items())}, separators=(",", ":")
            ),
        }
        if self.producer_files:
            props[KEY_PRODUCER_FILES] = json.dumps(list(self.producer_files), separators=(",", ":"))
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
