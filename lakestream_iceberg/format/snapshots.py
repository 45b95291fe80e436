"""The one place that turns "these files, on this parent" into Iceberg snapshots and the updates of one commit.

Producers (one snapshot per batch, several in a group commit), lifecycle GC (a metadata-only delete per collected
branch) and checkpoints (a tagged anchor) all build their snapshots here, as pyiceberg's ``_SnapshotProducer`` builds
every snapshot of a fast append, merge append, overwrite or delete. What is decided once, here:

* **snapshot ids** never collide with one the metadata lists or this commit already took (``new_snapshot_id`` is
  random: a collision would make the commit replace a snapshot);
* **sequence numbers** are consecutive from the metadata's next one, one per snapshot of the commit;
* **summaries** carry Iceberg's counts of what the snapshot adds and removes (pyiceberg's
  ``SnapshotSummaryCollector``) and the ``total-*`` values carried from the parent's summary
  (``update_snapshot_summaries``), so a commit's counts match its manifests' ADDED and DELETED entries (the rule of
  :mod:`lakestream_iceberg.format.manifests`: a commit's own files stay ADDED in a merged manifest). A parent written
  by another engine with totals that are no integers gets none carried (Iceberg's totals are optional), never an
  error;
* **timestamps** increase along the commit's snapshots;
* **refs**: each snapshot is added, then a branch or tag is pointed at it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from pyiceberg.manifest import DataFile
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import SnapshotRef, SnapshotRefType
from pyiceberg.table.snapshots import Operation, Snapshot, SnapshotSummaryCollector, Summary, update_snapshot_summaries
from pyiceberg.table.update import AddSnapshotUpdate, SetSnapshotRefUpdate, TableUpdate

from lakestream_iceberg.connect.integers import parse_int
from lakestream_iceberg.format.summary import KEY_SNAPSHOT_ID, KEY_STEP

__all__ = ["SnapshotBuilder", "set_ref"]

log = logging.getLogger(__name__)


def set_ref(ref_name: str, ref_type: SnapshotRefType, snapshot_id: int, *,
            current: SnapshotRef | None = None) -> SetSnapshotRefUpdate:
    """The update pointing ``ref_name`` (created as a ``ref_type`` if missing) at ``snapshot_id``.

    The update replaces the whole ref, so ``current`` (the ref as the metadata planned on has it) passes on its own
    retention (``max-ref-age-ms``, ``max-snapshot-age-ms``, ``min-snapshots-to-keep``: another engine's ``ALTER TABLE
    ... CREATE BRANCH ... WITH SNAPSHOT RETENTION``), as Iceberg's writers keep it; a new ref gets none, so the table's
    retention applies."""
    if current is None or current.snapshot_ref_type != ref_type:
        return SetSnapshotRefUpdate(ref_name=ref_name, type=ref_type, snapshot_id=snapshot_id, max_ref_age_ms=None,
                                    max_snapshot_age_ms=None, min_snapshots_to_keep=None)
    return SetSnapshotRefUpdate(ref_name=ref_name, type=ref_type, snapshot_id=snapshot_id,
                                max_ref_age_ms=current.max_ref_age_ms, max_snapshot_age_ms=current.max_snapshot_age_ms,
                                min_snapshots_to_keep=current.min_snapshots_to_keep)


class _SummaryCollector(SnapshotSummaryCollector):
    """pyiceberg's summary collector, counting the changed partitions by their values: lakestream records no summary
    per partition (pyiceberg's default limit, 0), so the partition path pyiceberg renders for every file (URL-quoted
    human strings: 60% of a GC plan collecting 1,600 files) would only be counted."""

    def update_partition_metrics(self, partition_spec: PartitionSpec, file: DataFile, is_add_file: bool,
                                 schema: Schema) -> None:
        if self.max_changed_partitions_for_summaries > 0:  # the paths are written into the summary: pyiceberg's own
            super().update_partition_metrics(partition_spec, file, is_add_file, schema)
            return
        partition = file.partition  # pyiceberg renders these values by partition_spec: as many keys as paths
        metrics = self.partition_metrics[repr(tuple(partition[i] for i in range(len(partition))))]
        if is_add_file:
            metrics.add_file(file)
        else:
            metrics.remove_file(file)


class SnapshotBuilder:
    """The snapshots of one commit planned on ``metadata``, and the table updates that add them.

    Example:
        >>> builder = SnapshotBuilder(metadata)  # doctest: +SKIP
        >>> snapshot_id, sequence_number = builder.next_ids()  # doctest: +SKIP
        >>> snap = builder.snapshot(snapshot_id=snapshot_id, sequence_number=sequence_number, parent=head,  # doctest: +SKIP
        ...                         manifest_list=path, operation=Operation.APPEND, added=files, properties=props)
        >>> builder.add(snap, branch="main")  # doctest: +SKIP
        >>> builder.updates  # AddSnapshotUpdate, SetSnapshotRefUpdate  # doctest: +SKIP
    """

    def __init__(self, metadata: TableMetadata) -> None:
        self._metadata = metadata
        self._taken = {s.snapshot_id for s in metadata.snapshots}
        self._sequence_number = metadata.next_sequence_number()
        # never before the metadata's last update: Java engines refuse metadata dated more than a minute before the
        # last entry of its metadata or snapshot log ("Invalid update timestamp"), and hosts' clocks differ (a
        # checkpoint made on a host whose clock runs ahead dated the table after the next producer's commits)
        self._timestamp_ms = metadata.last_updated_ms
        self.updates: list[TableUpdate] = []

    def next_ids(self, *, prefer: int | None = None) -> tuple[int, int]:
        """A snapshot id no snapshot of the metadata or of this commit has (``prefer`` where it is free: an earlier
        attempt's id, whose files this one reuses), and the commit's next sequence number."""
        snapshot_id = prefer if prefer is not None and prefer not in self._taken else self._metadata.new_snapshot_id()
        while snapshot_id in self._taken:
            snapshot_id = self._metadata.new_snapshot_id()
        self._taken.add(snapshot_id)
        sequence_number = self._sequence_number
        self._sequence_number += 1
        return snapshot_id, sequence_number

    def snapshot(self, *, snapshot_id: int, sequence_number: int, parent: Snapshot | None, manifest_list: str,
                 operation: Operation, properties: Mapping[str, str], added: Sequence[DataFile] = (),
                 removed: Sequence[DataFile] = (), totals: Mapping[str, str] | None = None) -> Snapshot:
        """One snapshot of the commit.

        Args:
            parent: Its parent (None: none, e.g. an anchor whose source snapshot expired); the ``total-*`` values are
                carried from the parent's summary unless ``totals`` is given.
            added, removed: The data files it adds and removes (its summary's counts).
            totals: The ``total-*`` values to record instead (a checkpoint anchor's table state is one step).
            properties: The ``lakestream.*`` summary properties (a stream state's also get the snapshot's own id,
                ``lakestream.snapshot-id``: a copy of them on another snapshot is not lakestream's, see
                :func:`~lakestream_iceberg.format.lineage.is_lakestream`).
        """
        collector = _SummaryCollector()
        spec, schema = self._metadata.spec(), self._metadata.schema()
        for data_file in added:
            collector.add_file(data_file, schema=schema, partition_spec=spec)
        for data_file in removed:
            collector.remove_file(data_file, schema=schema, partition_spec=spec)
        if KEY_STEP in properties:
            properties = {**properties, KEY_SNAPSHOT_ID: str(snapshot_id)}
        summary = Summary(operation, **collector.build(), **properties)
        if totals is not None:
            summary = Summary(operation, **{**summary.additional_properties, **totals})
        else:
            previous = parent.summary if parent is not None else None
            try:
                if previous is not None and any(parse_int(v, minimum=0) is None for k, v in previous.additional_properties.items()
                                                if k.startswith("total-")):  # pyiceberg's int() reads " 5" and "5_0"
                    raise ValueError("a total no engine reads")
                summary = update_snapshot_summaries(summary, previous_summary=previous)
            except ValueError:  # a foreign parent's total that is no integer: carry none (they are optional)
                log.warning("snapshot %s: the parent's summary totals are not integers; the new snapshot records none",
                            parent.snapshot_id if parent is not None else None)
                summary = update_snapshot_summaries(summary, previous_summary=None)
                summary = Summary(operation, **{k: v for k, v in summary.additional_properties.items()
                                                if not k.startswith("total-")})
        floor = max(self._timestamp_ms, parent.timestamp_ms if parent is not None else 0)
        self._timestamp_ms = max(int(time.time() * 1000), floor + 1)
        return Snapshot(snapshot_id=snapshot_id, parent_snapshot_id=parent.snapshot_id if parent is not None else None,
                        sequence_number=sequence_number, manifest_list=manifest_list, summary=summary,
                        schema_id=self._metadata.current_schema_id, timestamp_ms=self._timestamp_ms)

    def add(self, snapshot: Snapshot, *, branch: str | None = None, tag: str | None = None) -> None:
        """Add ``snapshot`` to the commit and point ``branch`` (moving it from the snapshot's parent) or ``tag`` at it."""
        self.updates.append(AddSnapshotUpdate(snapshot=snapshot))
        if branch is not None:
            self.updates.append(set_ref(branch, SnapshotRefType.BRANCH, snapshot.snapshot_id,
                                        current=self._metadata.refs.get(branch)))
        if tag is not None:
            self.updates.append(set_ref(tag, SnapshotRefType.TAG, snapshot.snapshot_id))
