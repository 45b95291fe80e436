"""The one error tree of lakestream_iceberg.

Every exception the package raises on purpose derives from :class:`LakestreamError`, and every message says what
happened and what to do next. pyiceberg's own exceptions are wrapped (``raise ... from exc``), never leaked::

    LakestreamError
    ├── StreamError                 the table is not a stream / not the stream you asked for
    │   ├── NotAStreamError
    │   ├── StreamNotFoundError     no table has that name (dropped, or never created); also pyiceberg's NoSuchTableError
    │   ├── StreamExistsError
    │   ├── CorruptStateError       stored lakestream state (a summary value, a producer-state file) is malformed or missing
    │   │   └── MissingFileError    a file the head lists is gone from storage, deleted outside lakestream
    │   └── ForeignSnapshotError    another engine changed the stream's data; Stream.repair() brings it back
    ├── BatchError                  a batch handed to a producer is malformed; nothing was written or published
    │   ├── ShardCountError
    │   ├── SchemaMismatchError
    │   └── SequenceError           a gap in a producer's sequence numbers
    ├── CommitError                 a commit could not be published
    │   ├── CommitTimeoutError      the retry budget ran out; this call published nothing (retry with the same seq)
    │   ├── CommitOutcomeUnknownError  the catalog failed and the table could not be read back to reconcile
    │   ├── ProducerConflictError   the producer's (id, seq) was published with a batch it did not write
    │   └── ProducerFailedError     a background commit of this producer failed; open a new producer to go on
    ├── ReadError
    │   ├── StepNotPublishedError   the step does not exist yet (wait_for() it)
    │   ├── StepCollectedError      lifecycle GC removed it; resume from a retained checkpoint
    │   ├── StepError               not a step number: steps are integers starting at 1
    │   ├── RankError               rank outside 0..world_size-1
    │   └── ReadTimeoutError        wait_for() ran out of time
    ├── CheckpointError             checkpoint / release / fork mistakes
    ├── LifecycleError              garbage collection refused to run
    │   └── ConsumerGroupActiveError  a consumer group to delete has a rank still reporting; stop it or pass force
    ├── ConfigError                 a setting is missing or wrong (names the setting, never its secret value)
    └── MissingExtraError           an optional dependency is not installed (names the extra)
"""

from __future__ import annotations

from pyiceberg.exceptions import NoSuchTableError

__all__ = [
    "BatchError",
    "CheckpointError",
    "CommitError",
    "CommitOutcomeUnknownError",
    "CommitTimeoutError",
    "ConfigError",
    "ConsumerGroupActiveError",
    "CorruptStateError",
    "ForeignSnapshotError",
    "LakestreamError",
    "LifecycleError",
    "MissingExtraError",
    "MissingFileError",
    "NotAStreamError",
    "ProducerConflictError",
    "ProducerFailedError",
    "RankError",
    "ReadError",
    "ReadTimeoutError",
    "SchemaMismatchError",
    "SequenceError",
    "ShardCountError",
    "StepCollectedError",
    "StepError",
    "StepNotPublishedError",
    "StreamError",
    "StreamExistsError",
    "StreamNotFoundError",
]


class LakestreamError(Exception):
    """Root of every error raised by lakestream_iceberg."""


class StreamError(LakestreamError):
    """The table is not the stream that was asked for."""


class NotAStreamError(StreamError):
    """The Iceberg table exists but carries no ``lakestream.*`` properties."""


class StreamNotFoundError(StreamError, NoSuchTableError):
    """No table has the stream's name: it was never created, or it was dropped (by another process too). It is also
    pyiceberg's ``NoSuchTableError``, which code written against pyiceberg catches."""


class StreamExistsError(StreamError):
    """``Stream.create`` found an existing stream with a different schema or world size."""


class CorruptStateError(StreamError):
    """Lakestream state read back from the table (a snapshot summary value, a producer-state file) is malformed: it was
    not written by lakestream, or was damaged. The message names the snapshot or file and how to roll back."""


class MissingFileError(CorruptStateError, FileNotFoundError):
    """A file that the branch's current head lists (a data file, a manifest, a manifest list, a producer-state file) is
    gone from storage, and lifecycle GC did not delete it (the head read again still lists it): an orphan-file cleanup
    that did not exclude the stream's folders, a bucket lifecycle rule or a manual delete removed it. Nothing was
    published on the way. It is also a ``FileNotFoundError``, which code written against pyiceberg catches."""


class ForeignSnapshotError(StreamError):
    """A snapshot that another engine wrote on a stream's branch changed its data (an append, a delete, an overwrite,
    a data-file rewrite), or hides the stream's lineage: lakestream refuses to commit on it or read through it rather
    than republish or mis-read a step. ``Stream.repair()`` (``lakestream repair``) rolls the branch back to its last
    lakestream snapshot, with every published step intact. ``snapshot_id`` names the foreign snapshot."""

    def __init__(self, message: str, *, snapshot_id: int | None = None) -> None:
        super().__init__(message)
        self.snapshot_id = snapshot_id


class BatchError(LakestreamError):
    """A batch handed to a producer is malformed; nothing was written or published."""


class ShardCountError(BatchError):
    """The number of shards differs from the stream's world size."""


class SchemaMismatchError(BatchError):
    """A shard's columns or types differ from the stream's payload schema."""


class SequenceError(BatchError):
    """A producer sequence number would leave a gap (or is negative)."""


class CommitError(LakestreamError):
    """A batch could not be published.

    Attributes:
        seq: The producer seq the failed call used, once it had written its batch (else None). A batch the producer
            numbered itself (``seq=None``) is retried with this seq, or with ``seq=None`` through the same producer
            object (its next call takes the same batch for the retry); another producer object, after a restart,
            numbers a ``seq=None`` batch after the last seq the table shows, which may be this batch's.
    """

    seq: int | None = None


class CommitTimeoutError(CommitError):
    """The commit loop ran out of attempts or time; this call published nothing. A batch it had staged for group
    commit is withdrawn, but another producer's group commit that read it before may still publish it: retry with the
    same seq (``seq``), which is reconciled either way (a duplicate when it landed); with ``seq=None`` only through the
    same producer object after a ``seq=None`` call (see :class:`CommitError`).

    Attributes:
        why: What used the budget up: ``"contention with other commits"``, or the storage or catalog failure that
            kept recurring (the last one, on one line).
    """

    why: str = "contention with other commits"


class CommitOutcomeUnknownError(CommitError):
    """The catalog failed mid-commit and the table could not be read back to tell whether the batch landed."""


class ProducerConflictError(CommitError):
    """While this call was committing, its (producer id, seq) was published with a batch this call did not write:
    another live process uses the same producer id, or something wrote a staged intent under it."""


class ProducerFailedError(CommitError):
    """A batch submitted in the background was not published because an earlier one of the same producer failed
    (its future holds that error); the producer takes no more batches. A new producer with the same id resumes from
    the table's state: every published seq stays published once, and the next seq is the first unpublished one."""


class ReadError(LakestreamError):
    """A step could not be read."""


class StepNotPublishedError(ReadError):
    """The step has not been committed (yet)."""


class StepCollectedError(ReadError):
    """The step was removed by lifecycle garbage collection."""


class StepError(ReadError):
    """The step is not a step number (an integer >= 1): steps start at 1."""


class RankError(ReadError):
    """The rank is outside ``0..world_size-1``."""


class ReadTimeoutError(ReadError):
    """Waiting for a step ran out of time."""


class CheckpointError(LakestreamError):
    """A checkpoint could not be created, released, resumed or forked."""


class LifecycleError(LakestreamError):
    """Garbage collection refused to run."""


class ConsumerGroupActiveError(LifecycleError):
    """Deleting a consumer group's positions was refused: a rank of the group reported within the last few report
    intervals, so the group is still reading (its next report would write its row again). Stop the group's ranks first,
    or pass ``force=True`` (``lakestream lag --delete --force``)."""


class ConfigError(LakestreamError):
    """A setting is missing or invalid. Messages name the setting, never a secret value."""


class MissingExtraError(LakestreamError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""
