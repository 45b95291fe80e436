"""A stream: one Iceberg table of Transactional Global Batches, and the entry point to everything else.

A stream is a plain Iceberg table (format v2) with ``lakestream.*`` table properties (see :mod:`lakestream_iceberg.format.layout`).
Any catalog that ``pyiceberg.catalog.load_catalog`` returns works: SQLite/PostgreSQL SQL catalogs, REST, Glue, Hive.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from datetime import timedelta
from functools import cached_property
from typing import Any

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import (
    NoSuchNamespaceError,
    NoSuchTableError,
    TableAlreadyExistsError,
)
from pyiceberg.schema import Schema, index_by_name
from pyiceberg.table import Table
from pyiceberg.table.refs import SnapshotRefType

from lakestream_iceberg.connect.catalog_settings import check_catalog_keys
from lakestream_iceberg.connect.diagnose import config_errors, transient
from lakestream_iceberg.connect.fork import fork_safe
from lakestream_iceberg.connect.intents import IntentTable
from lakestream_iceberg.connect.metadata_read import MALFORMED, malformed_metadata, unparsable
from lakestream_iceberg.connect.positions import PositionStore
from lakestream_iceberg.connect.retry import call_with_retry, read_with_retry
from lakestream_iceberg.connect.sqlite import prefer_wal
from lakestream_iceberg.connect.storage import warn_unbounded_requests
from lakestream_iceberg.errors import (
    ConfigError,
    LifecycleError,
    ReadTimeoutError,
    StepError,
    StreamNotFoundError,
)
from lakestream_iceberg.format.checks import (
    MAX_STEP,
    check_bool,
    check_catalog,
    check_identifier,
    check_int,
    check_location,
    check_new_identifier,
    check_seconds,
)
from lakestream_iceberg.format.file_settings import avro_codec
from lakestream_iceberg.format.layout import (
    StreamConfig,
    check_rank,
    file_schema,
    table_arrow_schema,
)
from lakestream_iceberg.format.manifest_cache import ManifestCache
from lakestream_iceberg.format.properties import WORLD_SIZE, by_key
from lakestream_iceberg.format.table import MAIN, StreamTable, after_gc
from lakestream_iceberg.lifecycle.checkpoint import Checkpoint, plan_checkpoint, plan_fork, plan_release
from lakestream_iceberg.lifecycle.gc import GCReport, collect_garbage
from lakestream_iceberg.lifecycle.policy import check_policy, grace_seconds, refuse_shared_files
from lakestream_iceberg.lifecycle.purge import quiet_about_collected
from lakestream_iceberg.lifecycle.repair import PlannedRepair, RepairReport, plan_repair
from lakestream_iceberg.read.follow import HeadWatcher
from lakestream_iceberg.read.reader import StepFiles, check_columns
from lakestream_iceberg.read.stream_ref import StreamRef
from lakestream_iceberg.write.commit import CommitLoop
from lakestream_iceberg.write.create import check_existing, check_property_strings, create_table
from lakestream_iceberg.write.dac import CommitPolicy, PolicyConfig
from lakestream_iceberg.write.intent_store import CatalogIntents, intent_table
from lakestream_iceberg.write.producer import Producer
from lakestream_iceberg.write.staging import StagingArea
from lakestream_iceberg.write.writer import BatchWriter

__all__ = ["Stream"]

log = logging.getLogger(__name__)


def _reopen(ref: StreamRef) -> Stream:
    return Stream.open(ref.catalog(), ref.identifier)


class Stream(StreamTable):
    """One stream of global training batches.

    Make one with :meth:`create` or :meth:`open` rather than the constructor.

    Args:
        table: The stream's pyiceberg ``Table`` (as ``catalog.load_table`` returns it).
        cache: The manifest cache this stream uses; default: the process-wide cache bounded by the table's
            ``lakestream.manifest.cache-bytes``.

    Raises:
        NotAStreamError: The table carries no ``lakestream.*`` properties.
        ConfigError: A ``lakestream.*`` property is invalid, or ``lakestream.commit.group.staging=catalog`` on a
            catalog that cannot keep staged intents.

    Example:
        >>> from pyiceberg.catalog import load_catalog                                  # doctest: +SKIP
        >>> catalog = load_catalog("default")                                           # doctest: +SKIP
        >>> schema = pa.schema([("tokens", pa.list_(pa.int32()))])                      # doctest: +SKIP
        >>> stream = Stream.create(catalog, "train.batches", schema=schema, world_size=2)  # doctest: +SKIP
        >>> stream.producer("prep-0").commit([rank0_table, rank1_table]).step           # doctest: +SKIP
        1
        >>> stream.read(1, rank=0)                                                      # doctest: +SKIP
    """

    def __init__(self, table: Table, *, cache: ManifestCache | None = None) -> None:
        super().__init__(table, cache=cache)
        prefer_wal(table.catalog)  # SQLite catalogs: write-ahead log unless lakestream.sqlite.wal=false (connect/sqlite.py)
        fork_safe(table.catalog)  # SQL catalogs: a forked child opens its own connections (connect/fork.py)
        warn_unbounded_requests(table.io, table.metadata.location)  # FsspecFileIO without timeouts (connect/storage.py)
        self._intent_table = intent_table(table.catalog, self.config.group_staging, name=".".join(table.name()))
        self._policies: dict[str, CommitPolicy] = {}  # branch -> the DAC state of the last producer made here

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as an address (catalog name + properties + identifier): the process that unpickles reopens it."""
        return (_reopen, (StreamRef.of(self),))

    def close(self) -> None:
        """Stop the worker threads this stream started in this process (the data writer's, the staged-batch footer
        checks'); idempotent. It releases threads only: the catalog and the table stay the caller's, nothing staged or
        published changes, and the stream stays usable (a later commit starts its threads again). Call it, or use the
        stream as a context manager, where a long-lived process opens many streams; producers should be done first
        (a commit running in another thread meanwhile finishes, but may start the threads again)."""
        for name in ("writer", "staging"):
            part = self.__dict__.get(name)  # cached_property: only what was made
            if part is not None:
                part.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- construction -------------------------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        catalog: Catalog,
        identifier: str | tuple[str, ...],
        *,
        schema: pa.Schema,
        world_size: int,
        location: str | None = None,
        properties: dict[str, str] | None = None,
    ) -> Stream:
        """Create a stream (or open it when it already exists with the same schema, world size and the properties given).

        Args:
            catalog: Any pyiceberg catalog.
            identifier: ``"namespace.name"`` (or pyiceberg's ``("namespace", "name")``); the namespace is created when
                missing (and dropped again, while empty, when the stream cannot be created).
            schema: The pyarrow schema of one sample (the payload); ``_step`` and ``_rank`` are reserved.
            world_size: Ranks per global batch.
            location: Table location; defaults to the catalog's warehouse.
            properties: Extra table properties, e.g. ``{"lakestream.snapshots.retain-last": "64"}`` (every property a
                stream reads: docs/configuration.md). The layout, ``lakestream.layout`` (``per-rank``: one data file per
                rank and step; ``packed``: one per step), is fixed here; by default a stream of world size 8 or more is
                packed (docs/concepts.md, "Layouts").

        Returns:
            The stream, created or opened.

        Raises:
            ConfigError: ``catalog`` is not a pyiceberg catalog; ``identifier`` is not ``"namespace.name"`` (no empty
                part) or a part cannot be a folder name (a ``/``, a control character, over 255 bytes; a nested
                namespace over 255 bytes with its parts joined by ``.``); ``location`` is not a URI or an absolute
                path, or no folder can be made there (or in the catalog's warehouse), or it holds other folders than a
                table's ``data`` and ``metadata`` (the warehouse's root) or lies inside another table's folder (GC
                deletes every file under a stream's location it does not reference); ``world_size`` is not in
                1..2**31-1; a property holds a value the stream cannot use, says another world size or schema than the
                arguments, or is a ``lakestream.*`` key lakestream does not read (each names the property);
                ``format-version`` is not 1 or 2 (the Iceberg versions pyiceberg writes); a REST catalog refused the
                table (a location outside its warehouse).
            StreamExistsError: A stream of that name exists with another schema or world size, or another value of a
                property given (``properties`` apply only to a stream created here).
            NotAStreamError: A plain Iceberg table of that name exists.
            SchemaMismatchError: The schema uses a reserved column name, or a type Iceberg cannot hold.
        """
        _check_catalog(catalog)
        identifier = check_identifier(identifier)
        check_new_identifier(identifier)
        location = check_location(location)
        with config_errors(catalog.properties, action=f"creating stream {identifier}", catalog=catalog.name):
            return cls._create(catalog, identifier, schema=schema, world_size=world_size, location=location,
                               properties=properties)

    @classmethod
    def _create(cls, catalog: Catalog, identifier: str | tuple[str, ...], *, schema: pa.Schema, world_size: int,
                location: str | None, properties: dict[str, str] | None) -> Stream:
        world_size = check_int(world_size, what="world_size", minimum=1, maximum=WORLD_SIZE.maximum,
                               hint="ranks are Iceberg ints")
        if not isinstance(schema, pa.Schema):
            raise ConfigError(f"schema must be a pyarrow.Schema, got {type(schema).__name__}")
        check_property_strings(properties)
        arrow = table_arrow_schema(schema)
        try:
            existing = cls.open(catalog, identifier)
        except NoSuchTableError:
            existing = None
        if existing is None:
            try:
                return cls(create_table(catalog, identifier, schema=schema, arrow=arrow, world_size=world_size,
                                        location=location, properties=properties))
            except TableAlreadyExistsError:  # another process created it meanwhile
                existing = cls.open(catalog, identifier)
        try:
            check_existing(existing, identifier, schema=schema, world_size=world_size, properties=properties)
        except Exception:
            existing.close()  # refused: the stream opened to compare holds connections of its own
            raise
        return existing

    @classmethod
    def open(cls, catalog: Catalog, identifier: str | tuple[str, ...]) -> Stream:
        """Open an existing stream.

        Args:
            catalog: Any pyiceberg catalog.
            identifier: ``"namespace.name"`` (or pyiceberg's ``("namespace", "name")``).

        Returns:
            The stream.

        Raises:
            StreamNotFoundError: No table has that name (also pyiceberg's ``NoSuchTableError``).
            NotAStreamError: The table is a plain Iceberg table.
            ConfigError: ``catalog`` is not a pyiceberg catalog, ``identifier`` is not ``"namespace.name"``, or the
                catalog is unreachable.
        """
        _check_catalog(catalog)
        identifier = check_identifier(identifier)
        with config_errors(catalog.properties, action=f"opening stream {identifier}", catalog=catalog.name):
            try:
                table = catalog.load_table(identifier)
            except (NoSuchTableError, NoSuchNamespaceError) as exc:
                raise StreamNotFoundError(
                    f"no stream {identifier} in catalog {catalog.name!r}: create it with Stream.create(), or check the "
                    "name and the catalog"
                ) from exc
            except MALFORMED as exc:
                if not unparsable(exc):  # an HTTP client's JSONDecodeError (a REST token refresh): not a metadata file
                    raise
                raise malformed_metadata(f"the current metadata file of table {identifier} (the one catalog "
                                         f"{catalog.name!r} names for it)", exc) from exc
            return cls(table)

    @classmethod
    def drop(cls, catalog: Catalog, identifier: str | tuple[str, ...], *, purge: bool = False) -> int:
        """Drop a stream: its catalog entry, and what it keeps as rows of a SQL catalog's database, which nothing would
        remove once the table is gone (GC of the stream expires them while it exists): the batches still staged for
        group commit (catalog staging) and the consumer positions of its readers (``lakestream lag``). Stop the
        stream's producers first: a producer still holding a staged batch would wait on an intent removed under it (its
        commit then fails, the table being gone).

        Args:
            catalog: The stream's catalog.
            identifier: ``"namespace.name"`` (or pyiceberg's ``("namespace", "name")``).
            purge: Also delete the files the table references (pyiceberg's ``purge_table``; files no snapshot names,
                such as storage-staged intents and abandoned uploads, stay, as with any Iceberg table).

        Returns:
            How many staged intents were removed from the catalog's database (0 on catalogs without an intent table);
            the consumer positions removed are logged.

        Raises:
            ConfigError: ``identifier`` is not ``"namespace.name"``, or ``purge`` is not a bool.
            LifecycleError: ``purge=True`` on a table whose ``gc.enabled`` is false (its files may be shared; nothing
                is dropped).
            NotAStreamError: The table is a plain Iceberg table, not a stream (nothing is dropped).
            StreamNotFoundError: No table has that name (also pyiceberg's ``NoSuchTableError``).
            Exception: The catalog's database unreachable after the table was dropped, unchanged; the intents and
                positions left are unusable rows (their table is gone) and a later drop of a stream at the same
                location, or its GC, removes them.
        """
        check_bool(purge, what="purge")
        stream = cls.open(catalog, identifier)  # a plain Iceberg table is refused before anything is dropped
        if purge:
            try:
                refuse_shared_files(stream.table.metadata.properties, stream.name, doing="purge=True deletes them",
                                    left="Nothing was dropped", instead="or drop it without purge=True")
            except LifecycleError:
                stream.close()
                raise
        root = stream.staging.root
        retry_s = stream.config.io_retry_timeout_s
        positions = PositionStore(catalog=catalog, io=stream.io, location=stream.table.metadata.location)
        stream.close()
        identifier = check_identifier(identifier)
        with config_errors(catalog.properties, action=f"dropping stream {identifier}", catalog=catalog.name):
            if purge:
                with quiet_about_collected(stream.io):
                    catalog.purge_table(identifier)
            else:
                catalog.drop_table(identifier)
        if positions.kind == "catalog database":  # objects under the location stay, as the table's other files do
            dropped = call_with_retry(positions.delete, what=f"removing the consumer positions of {identifier}",
                                      timeout_s=retry_s)
            if dropped:
                log.info("dropped stream %s and %d consumer positions", identifier, dropped)
        intents = IntentTable.of(catalog)  # whatever the staging property said: rows of an earlier setting too
        if intents is None:
            return 0
        removed = call_with_retry(lambda: intents.remove_under(root), what=f"removing the staged intents of {identifier}",
                                  timeout_s=retry_s)
        if removed:
            log.info("dropped stream %s and %d staged intents", identifier, removed)
        return removed

    # -- properties -----------------------------------------------------------------------------------------------------
    @cached_property
    def writer(self) -> BatchWriter:
        avro_codec(self.table.metadata.properties)  # a producer is refused before it writes anything
        written = self._file_schema()
        self.written_ids = index_by_name(written)  # each (nested) field's id: every commit checks the table still has them
        return BatchWriter(
            io=self.io, location=self.table.metadata.location,
            file_schema=written, properties=self.table.metadata.properties,
            retry_s=self.config.io_retry_timeout_s, packed_row_group_bytes=self.config.packed_row_group_bytes if self.config.packed else None,
        )

    @cached_property
    def staging(self) -> StagingArea:
        """Where producers stage written batches for group commit (see :mod:`lakestream_iceberg.write.staging`)."""
        retry_s = self.config.io_retry_timeout_s
        store = CatalogIntents(table=self._intent_table, retry_s=retry_s) if self._intent_table is not None else None
        return StagingArea(io=self.io, location=self.table.metadata.location, world_size=self.world_size,
                           retry_s=retry_s, table_uuid=str(self.table.metadata.table_uuid),
                           file_schema=self._file_schema(), packed=self.config.packed,
                           store=store)

    def _file_schema(self) -> Schema:
        """The data files' schema: the stream's payload columns as the table's current schema types them."""
        return file_schema(self.table.schema(), self.config.layout, self.payload_arrow_schema, stream=self.name)

    # -- writing --------------------------------------------------------------------------------------------------------
    def producer(self, producer_id: str, *, branch: str = MAIN, seed: int | None = None,
                 max_in_flight: int = 2) -> Producer:
        """A producer publishing into ``branch``; each producer keeps its own view of the table.

        Its commit pacing (DAC) starts from what the previous producer made by this ``Stream`` on ``branch`` learned
        (:meth:`CommitPolicy.inherit`): a worker that takes a fresh producer id every few batches keeps its timings
        and its turn in group commit.

        ``max_in_flight`` bounds the batches :meth:`Producer.submit` keeps queued or committing in the background (a
        submit beyond it waits for a slot).

        Args:
            producer_id: A stable id: a restarted producer with the same id continues at its next seq, exactly once.
            branch: A branch of the stream: ``main``, one made by :meth:`fork`, or one another engine made.
            seed: Seed of the pacing policy's jitter (tests and simulations).
            max_in_flight: Batches :meth:`Producer.submit` may keep queued or committing in the background.

        Returns:
            The :class:`~lakestream_iceberg.write.producer.Producer`.

        Raises:
            ConfigError: ``branch`` is not a branch of the stream (a checkpoint tag, a typo); ``main`` always is;
                ``seed`` is neither None nor an integer; or ``max_in_flight`` is not an integer >= 1.
        """
        # Its own view of the table, starting from ours: the first commit refreshes it (on SQL catalogs one read of the
        # catalog pointer, no metadata reload when nothing moved), so making a producer costs no catalog round trip.
        self.require_branch(branch, doing=f"cannot make producer {producer_id!r} on")
        if seed is not None:
            seed = check_int(seed, what="seed", hint="or None")
        table = Table(self.table.name(), metadata=self.table.metadata, metadata_location=self.table.metadata_location,
                      io=self.table.io, catalog=self.table.catalog, config=self.table.config)
        policy = CommitPolicy(clock=time.monotonic, rng=random.Random(seed),
                              config=PolicyConfig(group_max_batches=self.config.group_max_batches))
        predecessor = self._policies.get(branch)
        if predecessor is not None:  # the same process keeps its place and timings across producer ids
            policy.inherit(predecessor)
        self._policies[branch] = policy
        loop = CommitLoop(
            table=table,
            policy=policy,
            branch=branch,
            timeout_s=self.config.commit_timeout_s,
            max_attempts=self.config.commit_max_attempts,
        )
        loop.mark_stale()
        return Producer(self, producer_id, branch=branch, loop=loop, writer=self.writer, staging=self.staging,
                        max_in_flight=max_in_flight)

    # -- checkpoints and lifecycle -----------------------------------------------------------------------------------
    def _named_errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        """A refused credential or an unreachable store as the :class:`ConfigError` naming the setting: a commit loop
        (GC's, a checkpoint's) leaves that to its caller, as a producer's does."""
        return config_errors(self.io.properties, action=f"{action} {self.name}", catalog=self.table.catalog.name)

    def _control_loop(self, branch: str) -> CommitLoop:
        loop = CommitLoop(table=self.table, policy=CommitPolicy(clock=time.monotonic), branch=branch,
                          timeout_s=self.config.commit_timeout_s, max_attempts=self.config.commit_max_attempts)
        loop.mark_stale()
        return loop

    def checkpoint(self, name: str, *, step: int, branch: str = MAIN) -> Checkpoint:
        """Record a checkpoint watermark at ``step`` as an Iceberg tag (see :mod:`lakestream_iceberg.lifecycle.checkpoint`).

        Args:
            name: The checkpoint's (tag's) name.
            step: A published step of ``branch``.
            branch: The branch whose step it pins.

        Returns:
            The :class:`~lakestream_iceberg.format.checkpoints.Checkpoint`.

        Raises:
            CheckpointError: Invalid or duplicate name, unpublished or already collected step.
        """
        planned: set[int] = set()  # an attempt whose reply was lost may have landed: the next one finds its anchor
        with self._named_errors("checkpointing"):
            return self._control_loop(branch).run(
                lambda md, _: plan_checkpoint(self, md, name=name, step=step, branch=branch, planned=planned),
                pace=False).result

    def release(self, name: str) -> None:
        """Remove a checkpoint's tag; lifecycle GC may then collect what only it needed.

        Args:
            name: The checkpoint's name.

        Raises:
            CheckpointError: No checkpoint has that name.
        """
        planned: list[int] = []  # an attempt whose reply was lost may have landed: the next one finds the tag gone
        with self._named_errors("releasing a checkpoint of"):
            self._control_loop(MAIN).run(lambda md, _: plan_release(md, name=name, planned=planned), pace=False)

    def fork(self, checkpoint: Checkpoint | str, *, branch: str) -> Checkpoint:
        """Start an Iceberg branch at a checkpoint: producers and readers on ``branch`` continue at its step + 1.

        Args:
            checkpoint: The checkpoint, or its name.
            branch: The new branch's name.

        Returns:
            The checkpoint the branch starts at.

        Raises:
            CheckpointError: No checkpoint has that name (GC may have released it), a :class:`Checkpoint` given is
                not the one its name marks here (another stream's, or released and made again), or ``branch`` is
                invalid or already used by a tag or branch.
        """
        expected = checkpoint if isinstance(checkpoint, Checkpoint) else None
        name = checkpoint.name if isinstance(checkpoint, Checkpoint) else checkpoint
        planned: list[Checkpoint] = []  # an attempt whose reply was lost may have landed: the next one finds the branch
        with self._named_errors("forking"):
            return self._control_loop(MAIN).run(
                lambda md, _: plan_fork(md, name=name, branch=branch, expected=expected, planned=planned),
                pace=False).result

    def repair(self, *, branch: str = MAIN, dry_run: bool = False) -> RepairReport:
        """Roll ``branch`` back to its last lakestream snapshot when another engine changed its data.

        A snapshot another engine wrote that changes a stream's data (an append, a ``DELETE``, an overwrite,
        ``rewrite_data_files``) stops commits and reads with :class:`ForeignSnapshotError`. This moves the branch
        back to the snapshot lakestream wrote below it (see :mod:`lakestream_iceberg.lifecycle.repair`): every
        published step stays as it was published, producers go on at the next step (a re-commit of a published seq
        is a duplicate), and the foreign change leaves the branch. Metadata-only foreign snapshots
        (``rewrite_manifests``) need no repair.

        Args:
            branch: The branch to repair.
            dry_run: Only report what would be rolled back.

        Returns:
            A :class:`RepairReport` (``foreign`` empty: nothing to repair).

        Raises:
            LifecycleError: ``branch`` is not a branch of the stream.
            ForeignSnapshotError: No lakestream snapshot is left below the foreign ones (expired).

        Example:
            >>> report = stream.repair()  # doctest: +SKIP
            >>> report.rolled_back_to, report.foreign, report.step  # doctest: +SKIP
        """
        dry_run = check_bool(dry_run, what="dry_run", error=LifecycleError)
        if not isinstance(branch, str) or not branch:
            raise LifecycleError(f"branch must be a branch name, not {branch!r}")
        planned: list[PlannedRepair] = []  # an attempt whose reply was lost may have landed: the next one finds it
        return self._control_loop(branch).run(
            lambda md, _: plan_repair(self, md, branch=branch, dry_run=dry_run, planned=planned), pace=False).result

    def collect_garbage(
        self,
        *,
        dry_run: bool = True,
        keep_last: int | None = None,
        keep_within: timedelta | None = None,
        grace: timedelta | None = None,
        allow_short_grace: bool = False,
    ) -> GCReport:
        """Delete what no retained checkpoint can reach (see :mod:`lakestream_iceberg.lifecycle.gc`).

        Args:
            dry_run: Only report the plan (the default; pass ``dry_run=False`` to delete).
            keep_last: Retain the newest K checkpoints of each branch (others are released).
            keep_within: Retain checkpoints younger than this, aged from GC's reading of the time (the earlier of
                this host's clock and the object store's, docs/guide/retention.md#garbage-collection).
            grace: Minimum age of never-referenced files before deletion (default ``lakestream.gc.grace-period-ms``).
                It must be at least twice ``lakestream.commit.timeout-ms`` (the GC grace rule, docs/guide/retention.md): a younger
                file may belong to a commit in flight.
            allow_short_grace: Permit a shorter ``grace``: only on a quiescent table (no producer running), e.g.
                ``grace=timedelta(0)`` in tests and benchmarks.

        Returns:
            A :class:`~lakestream_iceberg.lifecycle.gc.GCReport` of what was (or, in a dry run, would be) collected.

        Raises:
            LifecycleError: Invalid ``keep_last`` / ``keep_within``, ``dry_run`` / ``allow_short_grace`` not a bool, or
                (not in a dry run) the table property ``gc.enabled`` is false.
            ConfigError: ``grace`` breaks the GC grace rule and ``allow_short_grace`` is false.
            CommitTimeoutError: Other commits kept winning until the commit budget ran out; the message says what
                landed (run GC again).
        """
        for name, flag in (("dry_run", dry_run), ("allow_short_grace", allow_short_grace)):
            if not isinstance(flag, bool):  # dry_run=None must not delete, nor "no" allow anything
                raise LifecycleError(f"{name} must be True or False, not {flag!r}")
        keep_last = check_policy(keep_last, keep_within)
        # the grace period and commit timeout of now as well as of when the stream was opened: another engine may have
        # raised them since, and producers opened after the change publish files as old as the new ones allow
        current = StreamConfig.from_properties(self.refresh().table.metadata.properties, stream=self.name)
        grace_s = grace_seconds(grace, self.config, allow_short=allow_short_grace, current=current)
        with self._named_errors("collecting garbage of"):
            return collect_garbage(self, self._control_loop(MAIN), dry_run=dry_run, keep_last=keep_last,
                                   keep_within=keep_within, grace_s=grace_s,
                                   expire_intents=self._expire_intents if self._intent_table is not None else None)

    def _expire_intents(self, older_than_s: float, delete: bool) -> list[str]:
        return call_with_retry(lambda: self.staging.expire(older_than_s=older_than_s, delete=delete),
                               what="expiring staged intents", timeout_s=self.config.io_retry_timeout_s)

    def delete_consumer_group(self, group: str, *, force: bool = False) -> int:
        """Delete every recorded position of consumer ``group`` on this stream, as ``kafka-consumer-groups --delete``
        does (``lakestream lag STREAM --group RUN --delete``); see :func:`lakestream_iceberg.read.lag.delete_group`.
        Groups silent for ``lakestream.consumers.retention-ms`` (default 7 days) expire without it.

        Args:
            group: The consumer group (a dataset's ``group=``, a training run's name).
            force: Delete even while a rank of the group is still reporting (it writes its position again at its next
                report).

        Returns:
            How many positions were deleted (0: the group has none).

        Raises:
            ConsumerGroupActiveError: A rank of the group reported within the last 3 report intervals and ``force`` is
                false; nothing was deleted.
            ConfigError: ``group`` is not a group name, or ``force`` is not a bool.

        Example:
            >>> stream.delete_consumer_group("run-41")  # doctest: +SKIP
            8
        """
        from lakestream_iceberg.read.lag import delete_group

        return delete_group(self, group=group, force=force)

    def history(self, *, branch: str = MAIN, samples_steps: tuple[int, int] | None = None) -> Any:
        """DuckDB views of this stream's batch history (see :mod:`lakestream_iceberg.read.history`).

        Args:
            branch: The branch whose steps the views show.
            samples_steps: ``(first, last)``: the steps the ``samples`` view reads (default: the head step only, since
                ``samples`` reads data files; pass a range to look further back).

        Returns:
            A DuckDB connection with the views ``batches``, ``files``, ``producers``, ``checkpoints``, ``snapshots``,
            ``consumers`` and ``samples``.

        Raises:
            MissingExtraError: DuckDB is not installed (``pip install 'lakestream-iceberg[duckdb]'``).

        Example:
            >>> stream.history().sql("SELECT producer, count(*) FROM batches GROUP BY 1").fetchall()  # doctest: +SKIP
        """
        from lakestream_iceberg.read.history import history

        return history(self, branch=branch, samples_steps=samples_steps)

    # -- reading --------------------------------------------------------------------------------------------------------
    def step_files(self, step: int, *, branch: str = MAIN) -> StepFiles:
        """The data files of a published ``step`` and where each rank's rows are in them (packed layout: reads the
        step file's footer); close it when done.

        Args:
            step: A published step.
            branch: The branch to look the step up on.

        Returns:
            A ``StepFiles`` (a context manager) whose ``counts`` are the rows per rank.

        Raises:
            StepNotPublishedError: The step is not committed yet.
            StepCollectedError: Lifecycle GC removed the step.
            CorruptStateError: The step's files do not fit the stream (ranks, footer).
        """
        return StepFiles(self.io, self.locate(step, branch=branch), world_size=self.world_size,
                         packed=self.config.packed, schema=self.payload_arrow_schema)

    def read(self, step: int, *, rank: int, branch: str = MAIN, columns: list[str] | None = None) -> pa.Table:
        """The rows committed for ``rank`` at ``step``, reading only that rank's data file (packed layout: the row
        groups of the step's file that hold its rows).

        Args:
            step: A published step (steps start at 1).
            rank: The trainer rank, ``0..world_size-1``.
            branch: The branch to read.
            columns: Payload columns to read (default: all).

        Returns:
            The rank's rows, with the payload schema (no ``_step`` / ``_rank``).

        Raises:
            StepError: ``step`` is not an integer >= 1 (steps start at 1).
            RankError: ``rank`` is outside ``0..world_size-1``.
            ConfigError: ``columns`` names a column the stream does not have, or the stream has no branch ``branch``.
            StepNotPublishedError: The step is not committed yet.
            StepCollectedError: Lifecycle GC removed the step.
            CorruptStateError: The step's data files do not match its manifest entries (damaged or replaced).
            ReadError: The object store kept failing (throttling, server errors) for ``lakestream.io.retry-timeout-ms``.
        """
        step = check_int(step, what="step", error=StepError, minimum=1, maximum=MAX_STEP, hint="steps start at 1")
        rank = check_rank(rank, self.world_size)
        columns = check_columns(columns, self.payload_arrow_schema, stream=self.name)

        def read_rank() -> pa.Table:
            with self.step_files(step, branch=branch) as files:
                return files.read(rank, columns=columns)

        def once() -> pa.Table:  # GC collected files our (stale) view still listed: re-resolved on the head, once
            return after_gc(read_rank, refresh=self.refresh)

        what = f"reading step {step} rank {rank} of {self.name}"
        with config_errors(self.io.properties, action=what, catalog=self.table.catalog.name):  # a wrong secret fails at once
            return read_with_retry(once, what=what, timeout_s=self.config.io_retry_timeout_s,
                                   properties=self.io.properties)

    def wait_for(self, step: int, *, timeout: float, branch: str = MAIN, poll_s: float = 0.05) -> int:
        """Block until ``step`` is published on ``branch``; return the head step then.

        Polls the catalog with bounded exponential backoff (``poll_s`` doubling up to 1 s); on SQL catalogs a poll reads
        only the table pointer and reloads the metadata when it moved; on PostgreSQL catalogs a commit notification
        wakes it at once (see :mod:`lakestream_iceberg.connect.notify`).

        Args:
            step: The step to wait for.
            timeout: Seconds to wait at most.
            branch: The branch to watch.
            poll_s: The first polling interval, in seconds.

        Returns:
            The head step once ``step`` is published (at least ``step``).

        Raises:
            ReadTimeoutError: ``timeout`` seconds passed first.
            ReadError: ``branch`` was dropped, or replaced by a tag, while it was watched.
            ConfigError: ``timeout`` or ``poll_s`` is not a finite number of seconds (``poll_s`` at least 1 ms), or the
                stream has no branch ``branch``.
        """
        step = check_int(step, what="step", error=StepError, minimum=0, maximum=MAX_STEP)  # a larger one: never published
        timeout = check_seconds(timeout, what="timeout")  # None or NaN waited forever, text raised TypeError
        poll_s = check_seconds(poll_s, what="poll_s", minimum=1e-3)  # 0 polled the catalog in a busy loop
        self.require_ref(branch, doing="cannot wait for a step of")  # a misspelt branch waited out the timeout
        ref = self.table.metadata.refs.get(branch)
        if ref is not None and ref.snapshot_ref_type != SnapshotRefType.BRANCH:  # a checkpoint's tag reads as what it
            head = self.branch_state(branch=branch).step  # pins (it never moves): a step it holds is there already
            if head >= step:
                return head
        watcher = HeadWatcher(self, branch=branch)
        try:
            deadline = time.monotonic() + timeout
            delay = poll_s
            error: Exception | None = None
            while True:
                try:
                    watcher.check()
                    error = None
                except Exception as exc:  # the catalog or storage is unreachable for now: keep polling until the deadline
                    if not transient(exc):
                        raise
                    error = exc
                head = watcher.head()[0]
                if head >= step:
                    return head
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ReadTimeoutError(
                        f"step {step} of {self.name} was not published within {timeout}s (head step is {head}); "
                        "are the producers running?"
                    ) from error
                delay = poll_s if watcher.pause(min(delay, remaining)) else min(delay * 2, 1.0)
        finally:
            watcher.close()


def _check_catalog(catalog: object) -> None:
    """A pyiceberg catalog whose ``lakestream.*`` properties are all ones lakestream reads (a misspelt
    ``lakestream.sqlite.wal`` was ignored, and a table property set on the catalog configures no stream)."""
    check_catalog(catalog)
    properties = getattr(catalog, "properties", None)
    if isinstance(properties, dict):
        check_catalog_keys(str(getattr(catalog, "name", "")), properties,
                           table_property=lambda key: by_key(key) is not None)
