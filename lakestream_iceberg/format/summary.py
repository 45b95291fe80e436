"""The lakestream part of an Iceberg snapshot summary: step, producer, sequence, and the producer state.

Every snapshot a stream writes carries, as of that snapshot, the state of its active producers (``producer id ->
[last seq, step, snapshot id, first step]``) and the list of producer-state files holding every idle producer (see
:mod:`lakestream_iceberg.format.producers`). A producer's exactly-once state is therefore recovered from the head
snapshot alone, even after older snapshots were expired, and a commit that reads the head and wins the
compare-and-swap has checked its (producer, seq) against the state it replaces: the check and the publish are one
atomic step.

Parsing is strict: a ``lakestream.*`` value lakestream never writes (``"True"`` for a step, a producer table that is
not ``{id: [seq, step, snapshot id, first step]}``) raises :class:`CorruptStateError` naming the snapshot and the key and
saying how to roll the ref back, never a bare ``ValueError`` that a caller could mistake for a transient failure.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from pyiceberg.io import FileIO

from lakestream_iceberg.connect.integers import INT64_MAX, parse_int
from lakestream_iceberg.errors import CorruptStateError, StepCollectedError, StepError, StepNotPublishedError
from lakestream_iceberg.format.producers import DEFAULT_FILES, ProducerState

if TYPE_CHECKING:
    from pyiceberg.table.snapshots import Snapshot

OP_APPEND = "append"
OP_COLLECT = "collect"
OP_CHECKPOINT = "checkpoint"
OP_REPAIR = "repair"  # Stream.repair re-based the state on a foreign snapshot (lifecycle/repair.py): no step published

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
KEY_TOKEN = "lakestream.token"  # the published batch's token (in its data file names): which write of (producer, seq)
# the id of the snapshot lakestream wrote the summary for: a summary another tool copied onto its own snapshot (pyiceberg's
# append(snapshot_properties=...), Spark's snapshot-property.* options) names another id, and that snapshot is foreign
KEY_SNAPSHOT_ID = "lakestream.snapshot-id"
# the checkpoint anchor a fork's timeline starts at (set on the anchor, carried by every snapshot after it): never on
# main's own snapshots, so a main moved onto a fork's snapshots (Spark's fast_forward) is told from its own line
KEY_TIMELINE = "lakestream.timeline"
KEY_STAGED_AT = "lakestream.staged-at-ms"  # a batch another producer's commit carried: when its intent was staged
# a batch its own producer committed: when the call began, by that producer's clock (the snapshot's timestamp-ms may be
# later: a table's dates never go back, so one commit from a host whose clock runs ahead dates the next ones after it)
KEY_SENT_AT = "lakestream.sent-at-ms"

MAX_SEQ = INT64_MAX  # the largest producer seq a summary records (an Iceberg long, as other engines read it)
_TOKEN = re.compile(r"^[A-Za-z0-9]{1,32}$")


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
    token: str | None = None
    staged_at_ms: int | None = None
    sent_at_ms: int | None = None
    timeline: int | None = None  # the anchor a fork's timeline starts at (KEY_TIMELINE); None on main's own line

    @classmethod
    def empty(cls) -> StreamState:
        return cls(op=OP_APPEND, step=0, producers={})

    @classmethod
    def parse(cls, summary: Mapping[str, str] | None, *, snapshot_id: int | None = None,
              parent_id: int | None = None) -> StreamState:
        """The lakestream fields of a snapshot summary (``snapshot_id`` and ``parent_id`` only name it in errors).

        Raises:
            CorruptStateError: A ``lakestream.*`` value is not what lakestream writes (names the snapshot and the key).
        """
        if not summary or KEY_STEP not in summary:
            return cls.empty()
        fields = _Fields(summary, snapshot_id, parent_id)
        step = fields.integer(KEY_STEP)
        collected_below = fields.integer(KEY_COLLECTED_BELOW, "1")
        if collected_below > step + 1:  # GC collects below a checkpoint, at most the head: status and tail showed it
            why = f"above {step + 1}, the step after {KEY_STEP} {step}: GC never collects a step above the head"
            raise fields.error(KEY_COLLECTED_BELOW, summary.get(KEY_COLLECTED_BELOW), why)
        return cls(
            op=summary.get(KEY_OP, OP_APPEND),
            step=step,
            producers=fields.producers(),
            collected_below=collected_below,
            producer=summary.get(KEY_PRODUCER),
            seq=fields.optional(KEY_SEQ),
            group=fields.integer(KEY_GROUP, "1", minimum=1),
            committer=summary.get(KEY_COMMITTER),
            group_commit_ms=fields.number(KEY_GROUP_MS),
            producer_files=fields.files(),
            token=fields.token(),
            staged_at_ms=fields.optional(KEY_STAGED_AT),
            sent_at_ms=fields.optional(KEY_SENT_AT),
            timeline=fields.optional(KEY_TIMELINE),
        )

    @classmethod
    def of(cls, snapshot: Snapshot | None) -> StreamState:
        """The state a snapshot records (empty for None or a snapshot without lakestream fields).

        A snapshot never changes, so its state is parsed once per process (keyed by snapshot id and manifest list,
        which names the table) and shared: its ``producers`` mapping is read-only. A commit, its holders' checks and
        DAC's observation each ask it of the same head several times."""
        if snapshot is None or snapshot.summary is None:
            return cls.empty()
        key = (snapshot.snapshot_id, snapshot.manifest_list)
        state = _PARSED_STATES.get(key)
        if state is None:
            state = cls.parse(snapshot.summary.additional_properties, snapshot_id=snapshot.snapshot_id,
                              parent_id=snapshot.parent_snapshot_id)
            state = replace(state, producers=MappingProxyType(dict(state.producers)))
            if len(_PARSED_STATES) >= _MAX_PARSED_STATES:
                _PARSED_STATES.clear()
            _PARSED_STATES[key] = state
        return state

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
        if self.token is not None:
            props[KEY_TOKEN] = self.token
        if self.staged_at_ms is not None:
            props[KEY_STAGED_AT] = str(self.staged_at_ms)
        if self.sent_at_ms is not None:
            props[KEY_SENT_AT] = str(self.sent_at_ms)
        if self.timeline is not None:
            props[KEY_TIMELINE] = str(self.timeline)
        props.update(extra)
        return props


# Producer tables parsed and validated (raw summary value -> its entries; ProducerState is immutable, callers get a
# copy of the dict): a head's table is read at every refresh, plan and reconcile, by every producer of the process,
# and the snapshots of one group commit repeat it. Bounded: cleared when full.
_PARSED_PRODUCERS: dict[str, dict[str, ProducerState]] = {}
_MAX_PARSED = 64
# Parsed states of snapshots, by (snapshot id, manifest list): see StreamState.of. Bounded: cleared when full.
_PARSED_STATES: dict[tuple[int, str], StreamState] = {}
_MAX_PARSED_STATES = 256


class _DuplicateKey(Exception):
    """A JSON object that names a key twice (``args[0]``: the key)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


class _Fields:
    """Strict readers of one summary's values: anything lakestream does not write is a :class:`CorruptStateError`."""

    def __init__(self, summary: Mapping[str, str], snapshot_id: int | None, parent_id: int | None) -> None:
        self._summary, self._snapshot_id, self._parent_id = summary, snapshot_id, parent_id

    def optional(self, key: str) -> int | None:
        return self.integer(key) if key in self._summary else None

    def integer(self, key: str, default: str = "", *, minimum: int = 0) -> int:
        raw = self._summary.get(key, default)
        value = parse_int(raw, minimum=minimum, plus=False)  # ASCII digits, a long: what lakestream writes
        if value is None:
            raise self.error(key, raw, f"expected an integer from {minimum} to {INT64_MAX} in ASCII digits")
        return value

    def number(self, key: str) -> float | None:
        raw = self._summary.get(key)
        if raw is None:
            return None
        try:
            value = float(raw)
        except (TypeError, ValueError):
            value = float("nan")
        if not math.isfinite(value) or value < 0:
            raise self.error(key, raw, "expected a non-negative number")
        return value

    def producers(self) -> dict[str, ProducerState]:
        if KEY_PRODUCERS not in self._summary:  # lakestream writes it with every step: without it, every seq restarts
            raise self.error(KEY_PRODUCERS, None, f"missing beside {KEY_STEP}; lakestream writes both")
        raw = self._summary[KEY_PRODUCERS]
        cached = _PARSED_PRODUCERS.get(raw) if isinstance(raw, str) else None
        if cached is not None:  # the same table, already validated: every refresh of every producer reads it again
            return dict(cached)
        try:
            table = json.loads(raw, object_pairs_hook=_unique_keys)
        except _DuplicateKey as exc:  # the parser keeps the last: which entry wins would decide the producer's next seq
            raise self.error(KEY_PRODUCERS, raw, f"producer {exc.args[0]!r} listed twice; lakestream lists each once") \
                from None
        except (TypeError, ValueError, RecursionError):  # RecursionError: nested deeper than the parser's stack
            raise self.error(KEY_PRODUCERS, raw, "not JSON") from None
        if not isinstance(table, dict):
            raise self.error(KEY_PRODUCERS, raw, "expected a JSON object")
        out = {}
        for producer, value in table.items():
            if not (isinstance(value, list) and len(value) in (3, 4) and all(type(v) is int for v in value)
                    and 0 <= value[0] <= MAX_SEQ and 0 <= value[1] <= MAX_SEQ and -MAX_SEQ - 1 <= value[2] <= MAX_SEQ
                    and (len(value) == 3 or 0 <= value[3] <= MAX_SEQ)):  # Iceberg longs: the state files' int64
                raise self.error(KEY_PRODUCERS, raw, f"producer {producer!r}: expected [seq, step, snapshot id, first "
                                 "step] integers in the 64-bit range, none negative but the snapshot id")
            out[producer] = ProducerState(*value)
        if len(_PARSED_PRODUCERS) >= _MAX_PARSED:
            _PARSED_PRODUCERS.clear()
        _PARSED_PRODUCERS[raw] = out
        return dict(out)

    def token(self) -> str | None:
        raw = self._summary.get(KEY_TOKEN)
        if raw is not None and (not isinstance(raw, str) or not _TOKEN.fullmatch(raw)):
            raise self.error(KEY_TOKEN, raw, "expected 1-32 letters or digits")
        return raw

    def files(self) -> tuple[str, ...]:
        raw = self._summary.get(KEY_PRODUCER_FILES, "[]")
        try:
            files = json.loads(raw)
        except (TypeError, ValueError, RecursionError):
            raise self.error(KEY_PRODUCER_FILES, raw, "not JSON") from None
        if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
            raise self.error(KEY_PRODUCER_FILES, raw, "expected a JSON list of file paths")
        return tuple(files)

    def error(self, key: str, raw: object, why: str) -> CorruptStateError:
        shown = raw if not isinstance(raw, str) or len(raw) <= 200 else raw[:200] + "..."
        back = f"its parent snapshot {self._parent_id}" if self._parent_id is not None else "the last good snapshot"
        return CorruptStateError(
            f"snapshot {self._snapshot_id if self._snapshot_id is not None else '(unknown id)'} has a malformed "
            f"{key}={shown!r} in its summary ({why}). lakestream never writes such a value: the snapshot was written by "
            "another tool (e.g. a plain pyiceberg/Spark append with lakestream.* snapshot properties), or its summary "
            f"was corrupted, and the stream's state cannot be read from it. Point the ref that names it back to {back}, "
            "e.g. with pyiceberg: table.manage_snapshots().rollback_to_snapshot(ID).commit() for main, "
            ".create_branch(ID, BRANCH).commit() to move another branch, or .remove_tag(NAME).commit() for a checkpoint "
            "tag; then check the writer that made it"
        )


def missing_step_error(step: int, state: StreamState, branch: str, name: str) -> Exception:
    """The right error for a step whose files are not in the branch's table state."""
    if step < 1:
        return StepError(f"step {step} of {name} does not exist: steps start at 1")
    if step > state.step:
        return StepNotPublishedError(
            f"step {step} of {name} (branch {branch!r}) is not published yet (head step is {state.step}); "
            "use wait_for(step, timeout=...) to block until it is"
        )
    return StepCollectedError(
        f"step {step} of {name} (branch {branch!r}) is no longer in the table: lifecycle GC collected it (steps below "
        f"{state.collected_below} are gone) or the branch was forked after it; resume from a retained checkpoint"
    )
