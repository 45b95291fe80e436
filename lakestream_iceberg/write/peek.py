"""Light reads of a branch head: the catalog pointer, and the ``metadata.json`` it names as plain JSON.

Group commit carries most batches: a producer whose staged batch is gone asks whether it was published, and the
answer is in the head's snapshot summaries. Parsing the whole metadata into pyiceberg's ``TableMetadata`` costs several
times more than reading those summaries from the JSON document, so :class:`HeadPeek` parses only the summaries asked for
(:meth:`StreamState.parse` checks them as a full read does) and keeps the last light read per metadata file (a committed
metadata file never changes). :class:`~lakestream_iceberg.write.commit.CommitLoop` owns one per table view.
"""

from __future__ import annotations

from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata

from lakestream_iceberg.connect.pointer import cached_probe, read_moved
from lakestream_iceberg.format.lineage import branch_state
from lakestream_iceberg.format.summary import KEY_STEP, StreamState
from lakestream_iceberg.write.plan import Peek

__all__ = ["HeadPeek", "head_state"]


def head_state(table: Table, metadata: TableMetadata, branch: str) -> StreamState:
    """The branch's state in ``metadata`` (through foreign snapshots that change no data; see format/lineage.py)."""
    return branch_state(metadata, metadata.snapshot_by_name(branch), stream=".".join(table.name()), branch=branch)


class HeadPeek:
    """Light reads of ``branch``'s head in ``table`` (a view that its owner refreshes in place)."""

    def __init__(self, *, table: Table, branch: str) -> None:
        self._table = table
        self._branch = branch
        self._last: tuple[str, Peek] | None = None  # (metadata location, its light read)

    def forget(self) -> None:
        """Drop the kept light read (the next read reads the metadata file again)."""
        self._last = None

    def read(self) -> Peek | None:
        """The branch head read lightly: the catalog pointer, and the ``metadata.json`` it names as plain JSON with
        only the summaries asked for parsed (:meth:`StreamState.parse` checks them as it does for a full read).

        None when that is not possible or the head is not what a full read would accept (a catalog without a pointer
        probe, an unreachable catalog or file, the branch missing or not a branch, a snapshot the metadata does not
        list): the caller then reads the head fully, which retries, reconciles or raises as usual.
        Raises :class:`CorruptStateError` for a lakestream summary value lakestream never writes, as a full read does.
        """
        try:
            last = self._last
            pointer = None
            if last is not None and (probe := cached_probe(self._table)) is not None:
                pointer = probe()
                if pointer == last[0]:
                    return last[1]  # the pointer has not moved since the last light read (a metadata file never changes)
            found = read_moved(self._table, location=pointer)  # the pointer as just read (None: read it)
        except Exception:  # noqa: BLE001 - unreachable or unreadable: the full read retries and reports it
            return None
        if found is None:
            return None
        location, document = found
        if document is None:  # the pointer did not move: the loaded metadata is the head
            metadata = self._table.metadata

            def loaded(snapshot_id: object) -> StreamState | None:
                if not isinstance(snapshot_id, int) or isinstance(snapshot_id, bool):
                    return None
                snapshot = metadata.snapshot_by_id(snapshot_id)
                return StreamState.of(snapshot) if snapshot is not None else None

            snapshot = metadata.snapshot_by_name(self._branch)
            return Peek(head_state(self._table, metadata, self._branch), loaded,
                        None if snapshot is None else (snapshot.snapshot_id, snapshot.sequence_number or 0))
        refs, snapshots = document.get("refs"), document.get("snapshots")
        ref = refs.get(self._branch) if isinstance(refs, dict) else None
        if not isinstance(ref, dict) or ref.get("type") != "branch" or not isinstance(snapshots, list) or \
                type(ref.get("snapshot-id")) is not int:
            return None  # not a branch, or one naming no snapshot id (a list made the lookup below raise TypeError)
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
        number = by_id[ref["snapshot-id"]].get("sequence-number", 0)  # absent in format version 1: 0, as pyiceberg reads it
        peek = Peek(head, states, (ref["snapshot-id"], number) if type(number) is int else None)
        self._last = (location, peek)
        return peek
