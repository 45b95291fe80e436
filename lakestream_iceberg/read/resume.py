"""Resuming a ``LakestreamDataset`` from a ``state_dict``: checking a loaded state, and applying it once.

A state is ``{"next_step": s, "worker_id": w, "num_workers": k, "stream": uuid, "branch": b, "last_file": path,
"version": 1}``. It is saved with a model's checkpoint and may be loaded by another release of lakestream_iceberg (a
trainer image upgraded, or rolled back, between the two): ``version`` (:data:`STATE_VERSION`; absent in the states of
earlier releases: 1) is what a release that gives a key a meaning older ones would not honour raises; a state of a
version this release does not read is refused (:class:`ConfigError`: resume with a release at least as new as the one
that saved it), never resumed with the keys it does not know ignored.
(see :mod:`lakestream_iceberg.read.dataset`; ``last_file``, a data file of the last step delivered, is checked against
the branch when loaded: :func:`still_holds`). :meth:`LoadedState.load` checks one against the dataset's stream and branch
(a state of the branch a fork was made from loads on the fork while everything it delivered is shared,
:func:`delivered_on_both`); :meth:`LoadedState.first` applies it to the first iteration that starts.

With DataLoader workers a state loaded in the training process reaches the workers through a small block of shared
memory the dataset makes when it is built (only the processes the training process starts inherit it): the state and
its generation, and per worker id the generation that id applied. Every epoch's new workers (non-persistent) and
persistent workers starting their next epoch read it there, so a state loaded between two epochs of persistent workers
resumes the next one too, and each state is applied by the first worker of each id only.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pyiceberg.table.refs import SnapshotRefType

from lakestream_iceberg.errors import CheckpointError, ConfigError
from lakestream_iceberg.format.checkpoints import Checkpoint, on_timeline
from lakestream_iceberg.format.checks import MAX_STEP, check_int
from lakestream_iceberg.format.lineage import branch_state
from lakestream_iceberg.format.table import after_gc

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["STATE_VERSION", "LoadedState", "delivered_on_both", "still_holds"]

STATE_VERSION = 1  # the state_dict version this release writes and reads (see the module docstring)

_TAKEN_SLOTS = 1024  # DataLoader worker ids that record applying a loaded state (a worker beyond applies it always)
# the shared block: the latest state's generation, whether it is still to apply, its next_step, worker_id and
# num_workers, then per worker id the generation that id applied
_GENERATION, _ACTIVE, _NEXT, _WORKER, _WORKERS, _APPLIED = 0, 1, 2, 3, 4, 5


class LoadedState:
    """A loaded ``state_dict`` not yet applied, and which DataLoader worker ids applied it (shared with the workers).

    Args:
        identity: The dataset's ``{"stream": table UUID, "branch": name}``.
    """

    def __init__(self, identity: dict[str, str]) -> None:
        self._identity = identity
        self._pending: dict[str, Any] | None = None
        self._loaded_in = os.getpid()  # the process that loaded _pending
        self._owner = os.getpid()  # the training process: a state it loads goes to its workers through _shared
        self._generation = 0  # _shared's generation of _pending, when the owner loaded it
        self._shared: Any = multiprocessing.RawArray("q", _APPLIED + _TAKEN_SLOTS)  # see the module docstring

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None:
            state["_shared"] = None  # shared memory goes only to the processes this one starts (DataLoader's workers)
        return state

    def _from_owner(self) -> bool:
        """Whether this is a process the training process started (a DataLoader worker) sharing its block."""
        return self._shared is not None and self._owner != os.getpid()

    def load(self, state: dict[str, Any], *, forked_after: Callable[[object, int, int], bool],
             holds: Callable[[str, int, str], bool], in_worker: bool = False) -> None:
        """Check ``state`` and hold it for the next iteration.

        ``in_worker``: loaded in a DataLoader worker (torchdata's ``StatefulDataLoader``), for that worker alone;
        elsewhere the process becomes the one whose DataLoader workers the state goes to (a copy of the dataset
        unpickled or forked into another process gets a block of its own).

        ``forked_after(branch, next_step, num_workers)``: whether a state of ``branch`` may load on this dataset's
        branch (:func:`delivered_on_both`); asked only for a state of another branch of the same stream.
        ``holds(branch, step, path)``: whether ``branch`` still holds data file ``path`` at ``step`` (the last step
        the state delivered, :func:`still_holds`); asked for a state that names the file, on the state's own branch
        (on a fork, :func:`delivered_on_both` compares the fork with that branch as it is now, which may be another
        timeline than the one the state read: the branch dropped and forked again under its name).

        Raises:
            ConfigError: Not such a state, or one of another stream or branch (a state without ``stream`` /
                ``branch``, from an earlier release, is taken as this dataset's).
            CheckpointError: The state's branch no longer holds the last step the state delivered as it was delivered
                (loaded on that branch or on a fork of it).
        """
        # any mapping, as the keys below are read (a state comes back as whatever mapping the checkpoint held it in)
        version = state.get("version", STATE_VERSION) if isinstance(state, Mapping) else STATE_VERSION
        if type(version) is not int or version != STATE_VERSION:  # not True, 1.0, "1": no release writes those
            raise ConfigError(
                f"the state_dict is a LakestreamDataset state of version {repr(version)[:40]}, and this release of "
                f"lakestream_iceberg reads version {STATE_VERSION} only: "
                + ("a newer lakestream_iceberg saved it, and resuming without what it added would skip or repeat "
                   "steps. Resume with a lakestream_iceberg at least as new as the one that saved it (upgrade the "
                   "trainer's image)" if type(version) is int and version > STATE_VERSION else
                   "no release writes it; load a state_dict() of a LakestreamDataset")
            )
        try:
            raw = {"next_step": state["next_step"], "worker_id": state.get("worker_id", 0),
                   "num_workers": state.get("num_workers", 1)}
            identity = {key: state.get(key, mine) for key, mine in self._identity.items()}
        except (KeyError, TypeError, AttributeError):
            raise ConfigError(f"not a LakestreamDataset state_dict: {state!r}") from None
        # at most a long: no step is published past one, and the shared block's 64-bit slots would wrap a larger value
        # silently (2**64 + 2 resumed DataLoader workers at step 2)
        pending = {key: check_int(value, what=f"state_dict {key}", minimum=1 if key != "worker_id" else 0,
                                  maximum=MAX_STEP) for key, value in raw.items()}
        if identity != self._identity and not (identity["stream"] == self._identity["stream"]
                                               and forked_after(identity["branch"], pending["next_step"],
                                                                pending["num_workers"])):
            raise ConfigError(
                f"the state_dict is of stream {identity['stream']!r} branch {identity['branch']!r}, this dataset reads "
                f"stream {self._identity['stream']!r} (table UUID) branch {self._identity['branch']!r}: its next_step "
                "would skip or repeat steps here. Load the state into a dataset of the stream and branch that saved it "
                "(a state of the branch a fork was made from loads on the fork while everything it delivered is shared: "
                "up to the fork's checkpoint step; "
                "LakestreamDataset.from_checkpoint starts a fork at its checkpoint)"
            )
        if pending["worker_id"] >= pending["num_workers"]:
            raise ConfigError(f"state_dict worker_id {pending['worker_id']} is not a worker of num_workers "
                              f"{pending['num_workers']} (0..{pending['num_workers'] - 1})")
        last_file = state.get("last_file")
        if last_file is not None and (not isinstance(last_file, str) or not last_file):
            raise ConfigError(f"state_dict last_file must be a data file's path (or None), got {last_file!r}"[:300])
        last = pending["next_step"] - pending["num_workers"]
        if last_file is not None and last >= 1 and not holds(identity["branch"], last, last_file):
            raise CheckpointError(
                f"the state_dict delivered step {last} of branch {identity['branch']!r}, which the branch no longer "
                "holds as it was read (it was dropped and made again under its name, or moved back by another engine "
                "and published again): resuming at its next_step would read another timeline's steps after those the "
                "model saw. Fork from a checkpoint of the old timeline (stream.fork) and resume there, or start "
                "afresh (start_step=)"
            )
        self._pending = {**pending, "last_file": last_file} if last_file is not None else pending
        self._loaded_in = os.getpid()
        if not in_worker and (self._shared is None or self._owner != os.getpid()):
            self._shared, self._owner = multiprocessing.RawArray("q", _APPLIED + _TAKEN_SLOTS), os.getpid()
        shared = self._shared
        if self._owner == os.getpid():  # for the workers, persistent ones included
            shared[_ACTIVE] = 0
            shared[_NEXT], shared[_WORKER], shared[_WORKERS] = (pending["next_step"], pending["worker_id"],
                                                                pending["num_workers"])
            self._generation = shared[_GENERATION] = shared[_GENERATION] + 1
            shared[_ACTIVE] = 1

    def pending(self) -> dict[str, int] | None:
        """The loaded state not yet applied, in this process or by DataLoader workers it started (a worker's own copy
        stays until it applies it)."""
        shared = self._shared
        if (self._pending is not None and shared is not None and self._owner == os.getpid() and self._generation
                and self._generation in shared[_APPLIED:]):
            self._pending = None
        return self._pending

    def first(self, worker_id: int, num_workers: int, *, start_step: int, in_worker: bool = False) -> int:
        """This worker's first step, consuming the loaded state.

        A state loaded in the training process is applied once, as without workers: by the first DataLoader worker of
        each id (forked or spawned) to start an iteration after it was loaded, which reads it from the shared block
        (module docstring): every later iteration's workers (non-persistent workers of a new epoch, or persistent ones
        starting their next) find that their id applied it, and start at ``start_step``. A persistent worker finds a
        state loaded between two epochs there too. A state loaded in the worker itself (torchdata's
        ``StatefulDataLoader``) is that worker's own.

        Raises:
            ConfigError: The state was saved by a worker of another number of workers.
        """
        state, shared = self.pending(), self._shared
        self._pending = None
        if in_worker and self._from_owner() and not (state is not None and self._loaded_in == os.getpid()):
            # a DataLoader worker: the state the training process loaded last, unless this id applied it already (a
            # worker of an earlier epoch, or this persistent worker); a state loaded in the worker itself (torchdata's
            # StatefulDataLoader) is the worker's own
            state = None
            generation = shared[_GENERATION]
            if shared[_ACTIVE] and (worker_id >= _TAKEN_SLOTS or shared[_APPLIED + worker_id] < generation):
                state = {"next_step": shared[_NEXT], "worker_id": shared[_WORKER], "num_workers": shared[_WORKERS]}
                if worker_id < _TAKEN_SLOTS:
                    shared[_APPLIED + worker_id] = generation
        elif state is not None and shared is not None and self._owner == os.getpid() and self._generation:
            shared[_ACTIVE] = 0  # applied here, without workers: later DataLoader workers start at start_step
            self._generation = 0
        if state is None:
            return start_step + worker_id
        if state["num_workers"] == 1:
            return state["next_step"] + worker_id
        if (state["worker_id"], state["num_workers"]) != (worker_id, num_workers):
            raise ConfigError(
                f"the loaded state was saved by DataLoader worker {state['worker_id']} of {state['num_workers']}; resume "
                f"with num_workers={state['num_workers']} (this is worker {worker_id} of {num_workers})"
            )
        return state["next_step"]


def still_holds(stream: StreamTable, *, branch: str, step: int, path: str) -> bool:
    """Whether ``branch`` holds data file ``path`` at ``step``, as when a reader delivered it: False when the branch
    is behind the step (moved back) or lists other files at it (dropped and made again, or moved back and published
    again); True when the step was collected (GC) or is before the branch's fork, where nothing tells."""

    def check() -> bool:  # on the current head: run again after a GC deleted a manifest of the view it read
        metadata = stream.table.metadata
        state = stream.branch_state(branch=branch, metadata=metadata)
        if step > state.step:
            return False
        if step < state.collected_below:
            return True
        return any(f.file_path == path for f in stream.index.files(metadata.snapshot_by_name(branch), step))

    stream.refresh()
    return after_gc(check, refresh=stream.refresh)


def delivered_on_both(stream: StreamTable, *, branch: str, source: object, next_step: int, num_workers: int) -> bool:
    """Whether every step a worker with this position delivered on branch ``source`` is the same step on ``branch``:
    the branch was forked from ``source`` at or after the worker's last delivered step, so resuming there neither skips
    nor repeats one. A worker delivered up to ``next_step - num_workers`` (its stride); a step lists the same data files
    on both branches exactly when both lineages share it (after a fork each branch writes its own files), which holds
    however many snapshots either branch has expired since."""
    if not isinstance(source, str):
        return False
    last = next_step - num_workers
    if last < 1:
        return True  # nothing delivered yet
    metadata = stream.refresh().table.metadata
    if source not in metadata.refs:
        return False
    here, there = metadata.snapshot_by_name(branch), metadata.snapshot_by_name(source)
    # A fork starts at its checkpoint's anchor, which lists only the checkpoint step: steps below it are not on the
    # fork (StreamState.collected_below). Below that lowest step, compare the lowest step itself: when it is shared,
    # so is everything the worker delivered.
    step = max(last, stream.branch_state(branch=branch, metadata=metadata).collected_below)
    mine = [f.file_path for f in stream.index.files(here, step)]
    return bool(mine) and mine == [f.file_path for f in stream.index.files(there, step)]


def check_resumable(stream: StreamTable, checkpoint: Checkpoint, *, branch: str) -> None:
    """Refuse (:class:`CheckpointError`) to resume after ``checkpoint`` on ``branch`` when the branch is no longer on
    its timeline (:func:`~lakestream_iceberg.format.checkpoints.on_timeline`): its steps after the checkpoint's would be
    another timeline's, not the ones the trainer read before, or when it is the checkpoint's own branch and was dropped.
    Another branch that does not exist is left to the dataset (which names the branches); a step the branch no longer
    holds (collected, or before its fork) to the read (``StepCollectedError``)."""
    metadata = stream.table.metadata
    ref = metadata.refs.get(branch)
    fork = (f"fork from it (stream.fork({checkpoint.name!r}, branch=...)) and go on on the fork, or resume from a "
            "checkpoint the branch holds")
    if ref is None and branch == checkpoint.branch:  # the checkpoint's own branch, dropped since: not the caller's typo
        raise CheckpointError(
            f"checkpoint {checkpoint.name!r} (step {checkpoint.step}) was taken on branch {branch!r}, which {stream.name} "
            f"no longer has (dropped): the steps after the checkpoint went with it; {fork} (then "
            f"LakestreamDataset.from_checkpoint(stream, {checkpoint.name!r}, branch=...) on the fork)")
    if ref is None or ref.snapshot_ref_type != SnapshotRefType.BRANCH:
        return
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    head = by_id.get(ref.snapshot_id)
    state = branch_state(metadata, head, stream=stream.name, branch=branch)
    if checkpoint.step > state.step:
        raise CheckpointError(
            f"checkpoint {checkpoint.name!r} (step {checkpoint.step}) is past the head step {state.step} of branch "
            f"{branch!r} of {stream.name}: another engine moved the branch back under it (a rollback, REPLACE "
            f"BRANCH), so the steps the branch publishes after it would be another timeline's; {fork}")
    if checkpoint.step < state.collected_below:
        return
    if not on_timeline(stream.index, checkpoint, anchor=by_id.get(checkpoint.snapshot_id), head=head):
        raise CheckpointError(
            f"checkpoint {checkpoint.name!r} (step {checkpoint.step}) is not on the timeline of branch {branch!r} of "
            f"{stream.name} any more: the branch holds other files at step {checkpoint.step} (it was dropped and made "
            "again under its name, or moved back by another engine and published again), so resuming would read "
            f"another timeline's steps; {fork}")
