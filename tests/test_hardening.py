"""Hardening regressions: each test reproduces one finding of the hardening review and fails until it is fixed.

Only the public API (``from lakestream_iceberg import ...``), pyiceberg and pyarrow are used, so the tests survive the
package's restructuring. Races are created deterministically: the catalog's ``commit_table`` is wrapped so that a
competing operation runs at an exact point (after the victim planned, before its compare-and-swap reaches the
catalog); nothing depends on sleeps or timing windows. Staged group-commit intents are forged in the format that
``staging`` documents (a one-row Parquet file holding a JSON document under ``<location>/data/_staging/<branch>/``, or
that JSON document as a row of the SQL catalog's intent table), exactly what a buggy or hostile writer sharing the
bucket or the catalog database could do; every intent test runs with both.

Findings (one section each): 1 GC vs fork, 2 bool/numpy integers and malformed summaries, 3 branch names, 4 trusted
intents, 5 GC grace vs commit timeout, 6 secrets, 7 dataset after GC, 8 step 0 / nested nulls.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.manifest import DataFile
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.update import RemoveSnapshotsUpdate

from lakestream_iceberg import (
    CheckpointError,
    CommitOutcomeUnknownError,
    CommitTimeoutError,
    ConfigError,
    CorruptStateError,
    LakestreamError,
    ProducerConflictError,
    RankError,
    SequenceError,
    StepCollectedError,
    Stream,
    load_catalog,
)
from tests.support import SCHEMA, batch, digest, lakestream_keys, needs_torch, shard

WORLD = 2

# Finding 4 of issue 13 is reproduced here but not fixed yet: strict, so the suite fails the moment its fix lands (then
# the marker is removed), and the marker never hides a regression of a fixed finding.



# --------------------------------------------------------------------------------------------------- helpers


def make(catalog: Catalog, name: str = "ns.stream", *, world_size: int = WORLD, schema: pa.Schema = SCHEMA,
         **props: str) -> Stream:
    return Stream.create(catalog, name, schema=schema, world_size=world_size, properties=props or None)


def local(path: str) -> Path:
    """A ``file://`` URI (or plain path) as a local path."""
    return Path(urlparse(path).path if "://" in path else path)


def files_under_data(stream: Stream) -> set[str]:
    root = local(stream.table.metadata.location) / "data"
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


def summaries(stream: Stream) -> list[dict[str, str]]:
    """The summaries of every snapshot the table still holds."""
    stream.table.refresh()
    return [dict(s.summary.additional_properties) if s.summary else {} for s in stream.table.metadata.snapshots]


def published_by(stream: Stream, producer: str) -> list[dict[str, str]]:
    """Snapshots that published a batch of ``producer`` (append snapshots naming it)."""
    return [s for s in summaries(stream) if s.get("lakestream.producer") == producer and s.get("lakestream.op") == "append"]


def head_producers(stream: Stream, branch: str = "main") -> dict[str, list[int]]:
    stream.table.refresh()
    head = stream.table.metadata.snapshot_by_name(branch)
    raw = head.summary.additional_properties.get("lakestream.producers", "{}") if head and head.summary else "{}"
    return json.loads(raw)


def live_files(stream: Stream) -> list[DataFile]:
    """Every data file of the main branch's current table state (pyiceberg's own scan planning)."""
    stream.table.refresh()
    return [task.file for task in stream.table.scan().plan_files()]


def step_files(stream: Stream, step: int) -> list[DataFile]:
    return sorted((f for f in live_files(stream) if f.partition[0] == step), key=lambda f: f.partition[1])


def file_json(data_file: DataFile, *, rank: int, path: str, records: int | None = None) -> dict[str, Any]:
    """A staged file entry of an intent (the JSON ``staging`` writes) describing ``data_file`` stored at ``path``."""

    def ints(d: dict[int, int] | None) -> dict[str, int]:
        return {str(k): int(v) for k, v in (d or {}).items()}

    def blobs(d: dict[int, bytes] | None) -> dict[str, str]:
        return {str(k): bytes(v).hex() for k, v in (d or {}).items()}

    return {
        "rank": rank, "path": path, "size": int(data_file.file_size_in_bytes),
        "records": int(data_file.record_count if records is None else records),
        "column_sizes": ints(data_file.column_sizes), "value_counts": ints(data_file.value_counts),
        "null_value_counts": ints(data_file.null_value_counts), "nan_value_counts": ints(data_file.nan_value_counts),
        "lower_bounds": blobs(data_file.lower_bounds), "upper_bounds": blobs(data_file.upper_bounds),
        "split_offsets": list(data_file.split_offsets) if data_file.split_offsets is not None else None,
    }


def copy_step(stream: Stream, step: int, *, producer: str, seq: int, token: str) -> list[dict[str, Any]]:
    """Copy the data files of a published step to fresh paths (as if ``producer`` wrote batch ``seq``); their entries."""
    out = []
    for data_file in step_files(stream, step):
        rank = int(data_file.partition[1])
        dest = f"{stream.table.metadata.location.rstrip('/')}/data/{producer}/{seq:012d}-{token}-r{rank:05d}.parquet"
        local(dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local(data_file.file_path), local(dest))
        out.append(file_json(data_file, rank=rank, path=dest))
    assert len(out) == stream.world_size
    return out


def forge_intent(stream: Stream, *, producer: str, seq: int, files: list[dict[str, Any]], allow_gap: bool = False,
                 staged_at: float | None = None, token: str | None = None, branch: str = "main",
                 location: str | None = None) -> str:
    """Stage an intent in the documented format where the stream keeps them (an intent file, or a row of the SQL
    catalog's intent table, see ``connect/intents.py``); return its path."""
    token = token or uuid.uuid4().hex[:12]
    root = (location or stream.table.metadata.location).rstrip("/")
    path = f"{root}/data/_staging/{quote(branch, safe='')}/{producer}@{seq:012d}-{token}.parquet"
    body = {"format": 2, "table_uuid": str(stream.table.metadata.table_uuid), "branch": branch, "producer": producer,
            "seq": seq, "token": token, "allow_gap": allow_gap,
            "staged_at": time.time() if staged_at is None else staged_at, "files": files}
    if stream.staging.kind == "catalog":
        from lakestream_iceberg.connect.intents import IntentTable

        table = IntentTable.of(stream.table.catalog)
        assert table is not None
        table.insert(path, json.dumps(body, separators=(",", ":")))
        return path
    local(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"intent": [json.dumps(body, separators=(",", ":"))]}), str(local(path)), compression="none")
    return path


def both_active(stream: Stream) -> tuple[Any, Any]:
    """Producers "a" and "b", each with two published batches: both see contention, so every commit lists staging."""
    a, b = stream.producer("a"), stream.producer("b")
    for seq in range(2):
        a.commit(batch("a", seq, stream.world_size))
        b.commit(batch("b", seq, stream.world_size))
    return a, b


class Interceptor:
    """Wraps ``catalog.commit_table``: the first commit matching ``when`` runs ``before()`` first, then proceeds."""

    def __init__(self, catalog: Catalog, when: Callable[[tuple[Any, ...]], bool], before: Callable[[], None]) -> None:
        self._catalog = catalog
        self._original = catalog.commit_table
        self._when = when
        self._before = before
        self.fired = False
        catalog.commit_table = self  # type: ignore[method-assign]

    def __call__(self, table: Any, requirements: Any, updates: Any) -> Any:
        if not self.fired and self._when(tuple(updates)):
            self.fired = True  # before running the hook: its own commits pass straight through
            self._before()
        return self._original(table, requirements, updates)

    def remove(self) -> None:
        self._catalog.commit_table = self._original  # type: ignore[method-assign]


# =================================================================================================== 1. GC vs fork


def test_1_fork_landing_between_gc_plan_and_swap_survives_or_fails_loudly(catalog: SqlCatalog) -> None:
    stream = make(catalog)
    producer = stream.producer("p")
    for seq in range(4):
        producer.commit(batch("p", seq, WORLD))
    old = stream.checkpoint("old", step=2)
    stream.checkpoint("new", step=3)
    forker = Stream.open(catalog, "ns.stream")  # another process's view: the fork lands between GC's plan and swap
    outcome: dict[str, Any] = {}

    def fork() -> None:
        try:
            outcome["fork"] = forker.fork("old", branch="exp")
        except LakestreamError as exc:
            outcome["fork_error"] = exc

    race = Interceptor(catalog, lambda updates: any(isinstance(u, RemoveSnapshotsUpdate) for u in updates), fork)
    try:
        stream.collect_garbage(dry_run=False, keep_last=1)  # releases "old": its anchor is what "exp" is forked at
    except LakestreamError as exc:  # GC may refuse loudly too; then the fork simply stands
        outcome["gc_error"] = exc
    finally:
        race.remove()
    assert race.fired, "the GC commit never reached the catalog"
    refs = stream.refresh().table.metadata.refs
    if "fork_error" in outcome:
        assert "exp" not in refs, "fork reported a failure but created the branch anyway"
        return
    # the fork returned success: its branch must have survived GC's swap, at the checkpoint's state
    assert "exp" in refs, (
        f"fork('old', branch='exp') returned {outcome.get('fork')} but GC's commit dropped the branch "
        f"(refs now {sorted(refs)}): GC expired the anchor snapshot it planned to release"
    )
    assert refs["exp"].snapshot_ref_type == SnapshotRefType.BRANCH
    assert digest(stream.read(old.step, rank=1, branch="exp")) == digest(batch("p", 1, WORLD)[1])
    result = stream.producer("q", branch="exp").commit(batch("q", 0, WORLD))
    assert result.step == old.step + 1, f"the fork's lineage restarted at step {result.step}"
    # and a GC after the fork landed (normally) keeps the branch and its history
    stream.collect_garbage(dry_run=False, keep_last=1)
    assert "exp" in stream.refresh().table.metadata.refs
    assert stream.head_step(branch="exp") == old.step + 1
    assert stream.producer("q", branch="exp").commit(batch("q", 1, WORLD)).step == old.step + 2


# =================================================================================================== 2. bool / numpy


@pytest.fixture
def small(catalog: SqlCatalog) -> tuple[Stream, Any]:
    """A world-2 stream with one published batch of producer "p" (its next seq is 1, so ``True == 1`` is no gap)."""
    stream = make(catalog)
    producer = stream.producer("p")
    producer.commit(batch("p", 0, WORLD))
    return stream, producer


def test_2_seq_true_is_rejected_and_writes_nothing(small: tuple[Stream, Any]) -> None:
    stream, producer = small
    before = files_under_data(stream)
    with pytest.raises(SequenceError):
        producer.commit(batch("p", 1, WORLD), seq=True)
    assert stream.head_step() == 1
    assert files_under_data(stream) == before, "a rejected batch must write no data file"


@pytest.mark.parametrize("seq", [2**63, 10**25])
def test_2_a_seq_past_64_bits_is_rejected_and_the_stream_stays_readable(small: tuple[Stream, Any], seq: int) -> None:
    # it used to be published: its summary then held a seq no reader accepts, and every read of the stream failed
    stream, producer = small
    before = files_under_data(stream)
    with pytest.raises(SequenceError, match="seq must be in 0..9223372036854775807"):
        producer.commit(batch("p", 1, WORLD), seq=seq, allow_gap=True)
    assert stream.head_step() == 1 and files_under_data(stream) == before
    assert (producer.next_seq, producer.commit(batch("p", 1, WORLD)).step) == (1, 2)


def test_2_a_head_at_the_last_64_bit_seq_refuses_the_next_one_before_publishing(catalog: SqlCatalog) -> None:
    # the head's producer table says p published seq 2**63 - 1: its next seq cannot be recorded, and is refused
    producers = json.dumps({"p": [2**63 - 1, 4, 1, 1]})
    stream, producer, _ = malformed_head(catalog, {"lakestream.producers": producers, "lakestream.seq": "3"})
    fresh = Stream.open(catalog, "ns.stream").producer("p")
    with pytest.raises(SequenceError, match="seqs go up to 9223372036854775807"):
        fresh.commit(batch("p", 4, WORLD))
    assert stream.head_step() == 4


@pytest.mark.parametrize(("step", "message"), [(2**63 - 1, f"head step {2**63 - 1}"),
                                               (10**19 - 1, f"lakestream.step='{10**19 - 1}'")])
def test_2_a_head_step_at_the_64_bit_limit_is_refused_with_a_clear_error(catalog: SqlCatalog, step: int,
                                                                         message: str) -> None:
    # the next step cannot be written as an Iceberg long: it used to fail inside the manifest writer (struct.error); a
    # step past a long is no summary value lakestream writes
    stream, _, bad = malformed_head(catalog, {"lakestream.step": str(step), "lakestream.seq": "3"})
    with pytest.raises(CorruptStateError, match=message):
        Stream.open(catalog, "ns.stream").producer("p").commit(batch("p", 3, WORLD))
    assert stream.refresh().table.metadata.snapshot_by_name("main").snapshot_id == bad


def test_2_checkpoint_step_true_is_rejected(small: tuple[Stream, Any]) -> None:
    stream, _ = small
    with pytest.raises(CheckpointError):
        stream.checkpoint("c", step=True)
    assert "c" not in stream.refresh().table.metadata.refs
    assert stream.checkpoints() == []


def test_2_read_rank_true_is_rejected(small: tuple[Stream, Any]) -> None:
    stream, _ = small
    with pytest.raises(RankError):
        stream.read(1, rank=True)


def test_2_numpy_seq_is_accepted(small: tuple[Stream, Any]) -> None:
    stream, producer = small
    result = producer.commit(batch("p", 1, WORLD), seq=np.int64(1))
    assert (result.step, result.seq) == (2, 1)
    assert stream.head_step() == 2 and head_producers(stream)["p"][0] == 1


def test_2_numpy_checkpoint_step_is_accepted(small: tuple[Stream, Any]) -> None:
    stream, _ = small
    checkpoint = stream.checkpoint("c", step=np.int64(1))
    assert checkpoint.step == 1 and [c.step for c in stream.checkpoints()] == [1]


def test_2_numpy_read_step_and_rank_are_accepted(small: tuple[Stream, Any]) -> None:
    stream, _ = small
    assert digest(stream.read(np.int64(1), rank=np.int64(1))) == digest(batch("p", 0, WORLD)[1])


def malformed_head(catalog: SqlCatalog, bad: dict[str, str] | None = None) -> tuple[Stream, Any, int]:
    """A stream whose main head is a snapshot, appended with pyiceberg's own API, carrying ``lakestream.seq=True``.

    The commit budget is short (1 s) so that today's behaviour (retrying the parse error as if the catalog were down)
    ends quickly.
    """
    stream = make(catalog, **{"lakestream.commit.timeout-ms": "1000"})
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, WORLD))
    stream.checkpoint("c1", step=1)
    table = catalog.load_table("ns.stream")
    head = table.metadata.snapshot_by_name("main")
    props = lakestream_keys(head)
    props.update({"lakestream.step": "4", "lakestream.producer": "p", "lakestream.seq": "3"})
    props.update(bad or {"lakestream.seq": "True"})
    rows = shard("p", 3, 0, rows=2)
    rows = rows.append_column("_step", pa.array([4, 4], pa.int64())).append_column("_rank", pa.array([0, 0], pa.int32()))
    table.append(rows, snapshot_properties=props)
    bad = table.metadata.snapshot_by_name("main").snapshot_id
    return stream, producer, bad


def assert_names_bad_summary(exc: BaseException, snapshot_id: int, key: str = "lakestream.seq") -> None:
    assert isinstance(exc, LakestreamError), f"raw {type(exc).__name__}: {exc}"
    assert not isinstance(exc, CommitOutcomeUnknownError), f"a malformed summary is not a catalog outage: {exc}"
    assert str(snapshot_id) in str(exc) and key in str(exc), f"message does not name snapshot {snapshot_id} and {key}: {exc}"


def test_2_malformed_summary_head_step_raises_a_clear_error(catalog: SqlCatalog) -> None:
    stream, _, bad = malformed_head(catalog)
    with pytest.raises(Exception) as info:
        stream.head_step()
    assert_names_bad_summary(info.value, bad)


@pytest.mark.parametrize("key", ["lakestream.producers", "lakestream.producer-files"])
def test_2_summary_json_nested_past_the_parser_stack_raises_a_clear_error(catalog: SqlCatalog, key: str) -> None:
    stream, _, bad = malformed_head(catalog, {key: "[" * 200_000 + "]" * 200_000})
    with pytest.raises(Exception) as info:
        stream.producer("p").next_seq  # noqa: B018
    assert_names_bad_summary(info.value, bad, key=key)


def test_2_malformed_summary_commit_raises_a_clear_error(catalog: SqlCatalog) -> None:
    stream, producer, bad = malformed_head(catalog)
    with pytest.raises(Exception) as info:
        producer.commit(batch("p", 3, WORLD))
    assert_names_bad_summary(info.value, bad)


def test_2_malformed_summary_is_shown_by_the_snapshots_history_not_a_crash(catalog: SqlCatalog) -> None:
    from lakestream_iceberg.read.history_rows import snapshot_rows

    stream, _, bad = malformed_head(catalog)
    stream.table.refresh()
    rows = {r["snapshot_id"]: r for r in snapshot_rows(stream, branch="main")}
    assert rows[bad]["seq"] is None and rows[bad]["step"] == 4  # the malformed value is null, the rest is read
    assert '"lakestream.seq": "True"' in rows[bad]["summary"]  # the raw value stays visible


def test_2_malformed_summary_gc_raises_a_clear_error(catalog: SqlCatalog) -> None:
    stream, _, bad = malformed_head(catalog)
    with pytest.raises(Exception) as info:
        stream.collect_garbage(dry_run=False, keep_last=1)
    assert_names_bad_summary(info.value, bad)


def test_2_a_foreign_append_naming_only_a_step_does_not_restart_every_producers_seq(catalog: SqlCatalog) -> None:
    """A pyiceberg append that sets only ``lakestream.step`` has no producer table: read as an empty one, every producer
    started over at seq 0 and republished its published batches as new steps."""
    stream = make(catalog)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, WORLD))
    table = catalog.load_table("ns.stream")
    rows = shard("p", 3, 0, rows=2)
    rows = rows.append_column("_step", pa.array([4, 4], pa.int64())).append_column("_rank", pa.array([0, 0], pa.int32()))
    table.append(rows, snapshot_properties={"lakestream.step": "4"})
    bad = table.metadata.snapshot_by_name("main").snapshot_id
    again = Stream.open(catalog, "ns.stream").producer("p")
    with pytest.raises(Exception) as info:
        again.commit(batch("p", 0, WORLD), seq=0)
    assert_names_bad_summary(info.value, bad, key="lakestream.producers")
    assert catalog.load_table("ns.stream").metadata.snapshot_by_name("main").snapshot_id == bad  # nothing published


@pytest.mark.parametrize(("key", "value"), [("lakestream.step", "True"), ("lakestream.source-snapshot-id", "12x"),
                                            ("lakestream.source-snapshot-id", "\u00b2"),
                                            ("lakestream.source-snapshot-id", "9223372036854775808"),
                                            ("lakestream.source-snapshot-id", "+5"),
                                            ("lakestream.created-at-ms", "-1"),
                                            ("lakestream.created-at-ms", "999999999999999999")])
def test_2_malformed_checkpoint_anchor_makes_checkpoints_raise_a_clear_error(catalog: SqlCatalog, key: str,
                                                                            value: str) -> None:
    # what checkpoint("broken", step=True) writes today: a tagged anchor whose summary says lakestream.step=True. Here
    # it is written with pyiceberg's own API (on a scratch branch, then tagged), so the test does not depend on that bug
    stream = make(catalog)
    stream.producer("p").commit(batch("p", 0, WORLD))
    table = catalog.load_table("ns.stream")
    rows = shard("p", 1, 0, rows=1)
    rows = rows.append_column("_step", pa.array([1], pa.int64())).append_column("_rank", pa.array([0], pa.int32()))
    table.manage_snapshots().create_branch(snapshot_id=table.metadata.snapshot_by_name("main").snapshot_id,
                                           branch_name="scratch").commit()
    table.append(rows, branch="scratch", snapshot_properties={
        "lakestream.op": "checkpoint", "lakestream.step": "1", "lakestream.collected-below": "1",
        "lakestream.producers": "{}", "lakestream.checkpoint": "broken", "lakestream.source-branch": "main", key: value})
    bad = table.metadata.snapshot_by_name("scratch").snapshot_id
    table.manage_snapshots().create_tag(snapshot_id=bad, tag_name="broken").remove_branch("scratch").commit()
    assert stream.head_step() == 1
    with pytest.raises(Exception) as info:
        stream.checkpoints()
    if key == "lakestream.step":
        assert_names_bad_summary(info.value, bad, key=key)
    else:  # a checkpoint's own key: the message names the tag and the key
        assert isinstance(info.value, CorruptStateError) and "'broken'" in str(info.value) and key in str(info.value)


@needs_torch
@pytest.mark.parametrize("step", [None, "0"], ids=["no-step", "step-0"])
def test_2_a_checkpoint_anchor_without_a_step_is_not_read_as_step_0(catalog: SqlCatalog, step: str | None) -> None:
    """A tag on a snapshot whose summary names the checkpoint but records no step (or step 0, which no checkpoint has:
    checkpoint() refuses a step below 1) was listed as a checkpoint at step 0, and from_checkpoint resumed the trainer
    at step 1, replaying every step the model had seen, without a word."""
    stream = make(catalog)
    for seq in range(3):
        stream.producer("p").commit(batch("p", seq, WORLD))
    table = catalog.load_table("ns.stream")
    rows = shard("p", 1, 0, rows=1)
    rows = rows.append_column("_step", pa.array([1], pa.int64())).append_column("_rank", pa.array([0], pa.int32()))
    table.manage_snapshots().create_branch(snapshot_id=table.metadata.snapshot_by_name("main").snapshot_id,
                                           branch_name="scratch").commit()
    props = {"lakestream.op": "checkpoint", "lakestream.checkpoint": "broken", "lakestream.source-branch": "main"}
    if step is not None:
        props.update({"lakestream.step": step, "lakestream.collected-below": "1", "lakestream.producers": "{}"})
    table.append(rows, branch="scratch", snapshot_properties=props)
    bad = table.metadata.snapshot_by_name("scratch").snapshot_id
    table.manage_snapshots().create_tag(snapshot_id=bad, tag_name="broken").remove_branch("scratch").commit()
    stream.refresh()
    with pytest.raises(CorruptStateError) as info:
        stream.checkpoints()
    assert "'broken'" in str(info.value) and str(bad) in str(info.value) and "lakestream.step" in str(info.value)
    from lakestream_iceberg.read.dataset import LakestreamDataset

    with pytest.raises(CorruptStateError, match="'broken'"):
        LakestreamDataset.from_checkpoint(stream, "broken", rank=0, world_size=1, follow=False)
    assert stream.head_step() == 3


def test_2_a_producer_listed_twice_in_the_summary_is_not_what_lakestream_writes(catalog: SqlCatalog) -> None:
    """JSON lets an object name a key twice and Python's parser keeps the last: a head whose producer table lists p at
    seq 3 and again at seq 0 (a foreign or damaged summary) gave p next_seq 1, and p published its seqs 1.. again as new
    steps. A producer-state file listing an id twice is refused for the same reason."""
    stream, _, bad = malformed_head(catalog, {"lakestream.producers": '{"p":[3,4,1,1],"p":[0,1,1,1]}'})
    with pytest.raises(Exception) as info:
        Stream.open(catalog, "ns.stream").producer("p").next_seq  # noqa: B018
    assert_names_bad_summary(info.value, bad, key="lakestream.producers")
    assert "'p'" in str(info.value)


@pytest.mark.parametrize("entry", [[2**63, 1, 1], [1, 2**63, 1], [1, 1, 2**64], [1, 1, -(2**63) - 1], [1, 1, 1, -1],
                                   [1, 1, 1, 2**63]])
def test_2_a_producer_table_entry_past_64_bits_is_not_what_lakestream_writes(entry: list[int]) -> None:
    """The producer table's numbers go into the producer-state files as int64: a seq or snapshot id past 64 bits was
    read as valid and made the commit that compacted its producer fail with a raw OverflowError (every commit after)."""
    from lakestream_iceberg.errors import CorruptStateError
    from lakestream_iceberg.format.summary import StreamState

    summary = {"lakestream.step": "4", "lakestream.producers": json.dumps({"p": [2**63 - 1, 3, -(2**63), 3]})}
    assert StreamState.parse(summary).producers["p"].seq == 2**63 - 1
    summary["lakestream.producers"] = json.dumps({"p": entry})
    with pytest.raises(CorruptStateError, match="lakestream.producers"):
        StreamState.parse(summary, snapshot_id=7)


# =================================================================================================== 3. branch names


def test_3_producer_on_a_checkpoint_tag_is_refused_and_the_tag_stays_a_tag(small: tuple[Stream, Any]) -> None:
    stream, _ = small
    stream.checkpoint("ckpt-1", step=1)
    with pytest.raises(LakestreamError, match="main"):
        stream.producer("q", branch="ckpt-1")
    ref = stream.refresh().table.metadata.refs["ckpt-1"]
    assert ref.snapshot_ref_type == SnapshotRefType.TAG
    assert [c.name for c in stream.checkpoints()] == ["ckpt-1"]
    # a real branch made by fork, and main, are accepted
    stream.fork("ckpt-1", branch="exp")
    assert stream.producer("q", branch="exp").commit(batch("q", 0, WORLD)).step == 2
    assert stream.producer("q", branch="main").commit(batch("q", 0, WORLD)).step == 2


def test_3_producer_on_a_misspelt_branch_is_refused(small: tuple[Stream, Any]) -> None:
    stream, _ = small
    with pytest.raises(LakestreamError, match="main"):
        stream.producer("q", branch="mian")
    assert "mian" not in stream.refresh().table.metadata.refs
    assert stream.producer("q", branch="main").commit(batch("q", 0, WORLD)).step == 2


# =================================================================================================== 4. intents

STAGING = "lakestream.commit.group.staging"


@pytest.fixture(params=["catalog", "storage"])
def staging(request: pytest.FixtureRequest) -> dict[str, str]:
    """Every intent test runs with intents as rows of the SQL catalog (the default there) and as files."""
    return {STAGING: request.param}


def test_4a_intent_naming_another_tables_file_through_dotdot_is_never_published(catalog: SqlCatalog, staging: dict[str, str]) -> None:
    stream = make(catalog, **staging)
    other = make(catalog, "ns.other", **staging)
    other.producer("x").commit(batch("x", 0, WORLD))
    a, _ = both_active(stream)
    location = stream.table.metadata.location.rstrip("/")
    other_location = other.table.metadata.location.rstrip("/")
    assert location.rsplit("/", 1)[0] == other_location.rsplit("/", 1)[0]  # siblings: <loc>/data/../../other works
    sibling = other_location.rsplit("/", 1)[1]
    files = []
    for data_file in step_files(other, 1):
        rank = int(data_file.partition[1])
        relative = data_file.file_path[len(other_location):]  # "/data/x/...parquet"
        files.append(file_json(data_file, rank=rank, path=f"{location}/data/../../{sibling}{relative}"))
    forge_intent(stream, producer="c", seq=0, files=files)
    a.commit(batch("a", 2, WORLD))
    assert published_by(stream, "c") == [], "an intent naming another table's files (via ..) was published"
    assert not any(".." in f.file_path or not f.file_path.startswith(location + "/data/") for f in live_files(stream))


def test_4b_foreign_gap_intent_is_not_published_by_someone_elses_commit(catalog: SqlCatalog, staging: dict[str, str]) -> None:
    stream = make(catalog, **staging)
    a, _ = both_active(stream)
    forge_intent(stream, producer="c", seq=7, allow_gap=True,
                 files=copy_step(stream, 1, producer="c", seq=7, token="forgedgap01"), token="forgedgap01")
    a.commit(batch("a", 2, WORLD))
    assert published_by(stream, "c") == [], "producer c's seq 7 (a gap it never committed) was published by a's commit"
    assert "c" not in head_producers(stream)
    # c's own next commit publishes normally (not a "duplicate" of a batch it never sent)
    result = stream.producer("c").commit(batch("c", 0, WORLD), seq=0)
    assert result.step is not None and not result.duplicate, f"c's real batch was silently dropped: {result}"
    assert digest(stream.read(result.step, rank=1)) == digest(batch("c", 0, WORLD)[1])


@pytest.mark.parametrize("new_schema", ["same-schema", "other-schema"])
def test_4c_intent_of_a_dropped_table_is_not_published_into_a_new_table_at_its_location(
        catalog: SqlCatalog, new_schema: str, staging: dict[str, str]) -> None:
    old = make(catalog, **staging)
    old.producer("c").commit(batch("c", 0, WORLD))
    location = old.table.metadata.location
    # producer d staged its first batch in the old table and died before anyone published it
    leftover = forge_intent(old, producer="d", seq=0, files=copy_step(old, 1, producer="d", seq=0, token="oldtable001"), token="oldtable001")
    catalog.drop_table("ns.stream")  # no purge: the old table's files (and its staged intent) stay
    schema = SCHEMA if new_schema == "same-schema" else pa.schema([("x", pa.int64()), ("name", pa.string())])
    new = Stream.create(catalog, "ns.stream", schema=schema, world_size=WORLD, location=location, properties=staging)
    assert new.table.metadata.table_uuid != old.table.metadata.table_uuid
    assert new.staging.exists(leftover)
    a, b = new.producer("a"), new.producer("b")

    def rows(producer: str, seq: int, rank: int) -> pa.Table:
        if new_schema == "same-schema":
            return shard(producer, seq, rank, rows=2)
        return pa.table({"x": [seq * 10 + rank], "name": [producer]}, schema=schema)

    for seq in range(2):
        a.commit([rows("a", seq, r) for r in range(WORLD)])
        b.commit([rows("b", seq, r) for r in range(WORLD)])
    a.commit([rows("a", 2, r) for r in range(WORLD)])
    assert published_by(new, "d") == [], "the dropped table's staged batch was published into the new table"
    assert not any("/data/d/" in f.file_path for f in live_files(new))


@pytest.mark.parametrize("defect", ["footer-schema", "footer-types", "row-count"])
def test_4d_staged_file_not_matching_schema_or_declared_rows_is_not_published(catalog: SqlCatalog, defect: str, staging: dict[str, str]) -> None:
    stream = make(catalog, **staging)
    a, _ = both_active(stream)
    files = copy_step(stream, 1, producer="c", seq=0, token="badfooter01")
    if defect == "row-count":
        files = [{**f, "records": f["records"] + 5} for f in files]  # declares rows the file does not hold
    elif defect == "footer-types":
        for f in files:  # the table's field ids and names, but column "i" widened to int64
            table = pq.read_table(str(local(f["path"])))
            field = table.schema.field("i")
            schema = table.schema.set(table.schema.get_field_index("i"),
                                      pa.field("i", pa.int64(), nullable=field.nullable, metadata=field.metadata))
            pq.write_table(table.cast(schema), str(local(f["path"])))
            f["size"] = local(f["path"]).stat().st_size
    else:
        for f in files:  # a valid Parquet file of a different schema, under the declared path and size
            pq.write_table(pa.table({"unrelated": pa.array([1, 2, 3], pa.int64())}), str(local(f["path"])))
            f["size"] = local(f["path"]).stat().st_size
            f["records"] = 3
    forge_intent(stream, producer="c", seq=0, files=files, token="badfooter01")
    a.commit(batch("a", 2, WORLD))
    assert published_by(stream, "c") == [], f"a staged batch with a bad file ({defect}) was published"


def test_4e_producer_whose_seq_was_published_with_foreign_data_does_not_report_success(catalog: SqlCatalog, staging: dict[str, str]) -> None:
    stream = make(catalog, **staging)
    a, b = both_active(stream)
    # a forged intent claiming b's next seq (2), holding a copy of a's step-1 files; its staged_at is the newest, so
    # a committer prefers it over b's real intent of the same seq
    forge_intent(stream, producer="b", seq=2, staged_at=time.time() + 3600,
                 files=copy_step(stream, 1, producer="b", seq=2, token="forgedseq02"), token="forgedseq02")

    def a_commits() -> None:  # lands while b is between planning and its compare-and-swap
        a.commit(batch("a", 2, WORLD))

    race = Interceptor(catalog, lambda _updates: True, a_commits)
    try:
        result = b.commit(batch("b", 2, WORLD))
    except ProducerConflictError as exc:
        assert "'b' seq 2" in str(exc) and "forgedseq02" in str(exc)
        assert race.fired
        return  # detected: b's seq 2 was published with data b did not write
    finally:
        race.remove()
    assert race.fired
    # b reported success: then its step must hold b's own batch, byte for byte
    mine = [digest(t) for t in batch("b", 2, WORLD)]
    got = [digest(stream.read(result.step, rank=r)) for r in range(WORLD)]
    assert got == mine, (
        f"b.commit returned success ({result}) but step {result.step} holds data b did not write (a forged intent "
        "with b's id and seq, published by a's commit)"
    )


@contextlib.contextmanager
def carried_while_writing(stream: Stream, carrier: Any) -> Iterator[list[bool]]:
    """Within the block, the first batch written (after its files, before its commit plans) lets ``carrier`` commit
    first: that commit carries whatever intents are staged. Yields a list that holds True once it happened."""
    original = stream.writer.write
    fired: list[bool] = []

    def write_then_carry(**kwargs: Any) -> Any:
        staged = original(**kwargs)
        if not fired:
            fired.append(True)  # first: the carrier's own write comes through here too
            carrier.commit(batch(carrier.producer_id, 2, stream.world_size))
        return staged

    stream.writer.write = write_then_carry  # type: ignore[method-assign]
    try:
        yield fired
    finally:
        del stream.writer.write


def test_4f_an_earlier_incarnations_staged_batch_carried_during_a_restart_is_a_duplicate(catalog: SqlCatalog, staging: dict[str, str]) -> None:
    """A producer that staged seq 2 and died; its restart commits seq 2 again while another producer's commit carries
    the dead incarnation's intent: the restart gets ``duplicate=True`` and the carried step, not an error."""
    stream = make(catalog, **staging)
    a, _ = both_active(stream)
    dead = stream.writer.write(producer="b", seq=2, shards=batch("b", 2, WORLD))
    stream.staging.stage(branch="main", batch=dead, allow_gap=False)
    with carried_while_writing(stream, a) as fired:  # b's files are written; a's commit carries the staged one
        result = stream.producer("b").commit(batch("b", 2, WORLD))
    assert fired
    carried = [s for s in published_by(stream, "b") if s["lakestream.seq"] == "2"]
    assert len(carried) == 1 and carried[0]["lakestream.token"] == dead.token
    assert result.duplicate and result.step == int(carried[0]["lakestream.step"])
    assert [digest(stream.read(result.step, rank=r)) for r in range(WORLD)] == [digest(t) for t in batch("b", 2, WORLD)]


def test_4f_a_live_twins_batch_staged_after_the_producer_was_made_is_a_conflict_not_a_duplicate(
        catalog: SqlCatalog, staging: dict[str, str]) -> None:
    """Two live processes with one id: the producer "b" was made (a restart, while the old process still runs); the old
    one then stages its own seq 2, and another producer's commit carries it while "b" commits seq 2. That batch cannot
    be an earlier incarnation's: it was staged after "b" was made. "b" must be told (``ProducerConflictError``), not
    answered ``duplicate=True`` while its batch is dropped."""
    stream = make(catalog, **staging)
    a, _ = both_active(stream)
    restarted = stream.producer("b")
    twin = stream.writer.write(producer="b", seq=2, shards=[shard("b", 2, r, rows=3) for r in range(WORLD)])  # the twin's
    stream.staging.stage(branch="main", batch=twin, allow_gap=False)
    with carried_while_writing(stream, a) as fired:  # b's files are written; a's commit carries the staged one
        with pytest.raises(ProducerConflictError, match="'b' seq 2"):
            restarted.commit(batch("b", 2, WORLD))
    assert fired
    carried = [s for s in published_by(stream, "b") if s["lakestream.seq"] == "2"]
    assert len(carried) == 1 and carried[0]["lakestream.token"] == twin.token


def test_4f_an_explicit_seq_a_live_twin_published_before_the_call_is_a_conflict_not_a_replay(
        catalog: SqlCatalog, staging: dict[str, str]) -> None:
    """A live twin with the same id published seq 2 after producer "b" was made, before b's call of seq 2 began: the
    call is answered from the table, and was ``duplicate=True`` whoever published the seq, so b's batch was dropped
    without a word. b's replays of its own seqs, and a producer made after the seq was published (a restart replaying
    its predecessor's batches), still get ``duplicate=True``."""
    stream = make(catalog, **staging)
    _, b = both_active(stream)  # b published seqs 0 and 1 itself (committed, or carried by a's group commits)
    twin = stream.producer("b")
    twin.commit(batch("b", 2, WORLD))
    assert b.next_seq == 3  # b reads the head: its call of seq 2 begins with seq 2 published
    with pytest.raises(ProducerConflictError, match=r"'b' seq 2 .*by no call of this producer"):
        b.commit(batch("b", 2, WORLD), seq=2)
    own = b.commit(batch("b", 1, WORLD), seq=1)
    assert own.duplicate and own.step is not None
    restarted = stream.producer("b")
    replay = restarted.commit(batch("b", 2, WORLD), seq=2)
    assert replay.duplicate and replay.step == stream.head_step()
    assert [s["lakestream.seq"] for s in published_by(stream, "b")].count("2") == 1


def test_4f_two_live_producers_of_one_id_numbering_after_the_table_do_not_publish_in_turns(
        catalog: SqlCatalog, staging: dict[str, str]) -> None:
    """Two live producers with one id that both take the next seq from the table (``seq=None``, ``submit``) never
    collide on a seq: each published every other one, both answered with success, and a zombie and its restart fed
    the stream the same input twice without a word. The one about to publish after the other's batch is refused
    (``ProducerConflictError``); the other goes on, and a producer made after both (a restart) resumes."""
    stream = make(catalog, **staging)
    _, b = both_active(stream)  # b published seqs 0 and 1
    twin = stream.producer("b")  # made after b's seqs: they are an earlier incarnation's to it
    assert twin.commit(batch("b", 2, WORLD)).seq == 2
    assert b.next_seq == 3  # b reads the head (a commit colliding on seq 2 was refused before: see the test above)
    with pytest.raises(ProducerConflictError, match=r"'b' cannot publish seq 3 .*last seq 2 .*by no call of this "
                                                    r"producer, after it first read the table"):
        b.commit(batch("b", 3, WORLD))
    with pytest.raises(ProducerConflictError, match=r"cannot publish seq 3"):  # an explicit seq: the same
        b.commit(batch("b", 3, WORLD), seq=3)
    with pytest.raises(ProducerConflictError, match=r"cannot publish seq 3"):  # submitted: the same
        b.submit(batch("b", 3, WORLD)).result()
    assert twin.commit(batch("b", 3, WORLD)).seq == 3  # its own last seq: it goes on
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1", "2", "3"]
    restarted = stream.producer("b")
    assert restarted.next_seq == 4 and restarted.commit(batch("b", 4, WORLD)).seq == 4
    with pytest.raises(ProducerConflictError):  # to the twin, seq 4 is another writer's (whether it numbers 4 or 5)
        twin.commit(batch("b", 5, WORLD))
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1", "2", "3", "4"]


def test_4f_an_explicit_seq_a_live_twin_published_past_the_producers_view_is_a_conflict_not_a_gap(
        catalog: SqlCatalog, staging: dict[str, str]) -> None:
    """A live twin with the same id published seqs 2 and 3 after producer "b" last read the head (its view still says
    seq 2 is next). b's call of an explicit seq 3 was checked for a gap on that old view alone: ``SequenceError``
    "would skip from seq 2 to 3; commit seq 2 first", which is false (seq 2 is published) and names no second writer,
    and every later seq of b failed the same way. It must read the head before refusing a gap, and find the twin."""
    stream = make(catalog, **staging)
    _, b = both_active(stream)  # b published seqs 0 and 1; its view of the head is fresh from its own last commit
    twin = stream.producer("b")
    twin.commit(batch("b", 2, WORLD))
    twin.commit(batch("b", 3, WORLD))
    with pytest.raises(ProducerConflictError, match=r"'b' seq 3 .*by no call of this producer"):
        b.commit(batch("b", 3, WORLD), seq=3)
    with pytest.raises(SequenceError, match="would skip from seq 4 to 5"):  # a real gap, on the head as it is now
        b.commit(batch("b", 5, WORLD), seq=5)
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1", "2", "3"]


@pytest.mark.parametrize("how", ["commit", "submit"])
def test_4f_an_earlier_incarnations_batch_published_after_the_restart_read_the_table_is_followed(
        catalog: SqlCatalog, staging: dict[str, str], how: str) -> None:
    """A producer staged seq 2 and died; its restart reads ``next_seq`` (2), and only then another producer's group
    commit carries the dead incarnation's batch. That batch was sent before the restart was made: an earlier
    incarnation's, as a replay of seq 2 would be told (``duplicate=True``). The restart reads ``next_seq`` again (3),
    and its next batch (``seq=None``, or submitted) is published as seq 3; it raised ProducerConflictError ("another
    live process is using producer id"), though no other writer lived."""
    stream = make(catalog, **staging)
    a, _ = both_active(stream)
    dead = stream.writer.write(producer="b", seq=2, shards=batch("b", 2, WORLD))
    stream.staging.stage(branch="main", batch=dead, allow_gap=False)  # the process that staged it died
    restarted = stream.producer("b")
    assert restarted.next_seq == 2
    a.commit(batch("a", 2, WORLD))  # carries the dead incarnation's seq 2
    assert published_by(stream, "b")[-1]["lakestream.token"] == dead.token
    assert restarted.next_seq == 3
    result = restarted.commit(batch("b", 3, WORLD)) if how == "commit" else restarted.submit(batch("b", 3, WORLD)).result()
    assert result.seq == 3 and not result.duplicate
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1", "2", "3"]


def b_seq_2_expired(catalog: SqlCatalog, staging: dict[str, str], *, twin: bool,
                    read: bool = False) -> tuple[Stream, Any]:
    """A stream keeping 2 snapshots where producer b's seq 2 was published by a live twin made after b (``twin``;
    ``read``: b read the table just before), or by b's dead earlier incarnation, whose staged batch another producer's
    commit carried (b, returned, is then its restart); other commits expired that snapshot since."""
    stream = make(catalog, **staging, **{"lakestream.snapshots.retain-last": "2"})
    a, b = both_active(stream)
    if twin:
        if read:
            assert b.next_seq == 2  # its last read of the table
        stream.producer("b").commit(batch("b", 2, WORLD))  # a live twin made after b
    else:
        dead = stream.writer.write(producer="b", seq=2, shards=batch("b", 2, WORLD))
        stream.staging.stage(branch="main", batch=dead, allow_gap=False)  # the process that staged it died
        b = stream.producer("b")  # its restart
        assert b.next_seq == 2
    for seq in range(2, 5):
        a.commit(batch("a", seq, WORLD))  # (carries the dead incarnation's seq 2) and expires the snapshot of b's seq 2
    assert "2" not in [s["lakestream.seq"] for s in published_by(stream, "b")]
    return stream, b


@pytest.mark.parametrize("case", ["twin", "earlier incarnation"])
def test_4f_the_follow_rule_holds_once_the_snapshot_of_the_ids_last_seq_expired(
        catalog: SqlCatalog, staging: dict[str, str], case: str) -> None:
    """Other producers' commits expire the snapshot that published the id's last seq before the producer's next call
    (a busy stream keeps a few snapshots): that batch is then told by its data file, whose name holds its token and
    whose modification time says it was written after (a live twin's) or before (an earlier incarnation's) the
    producer was made. Without a snapshot to compare, two live twins took turns undetected."""
    stream, b = b_seq_2_expired(catalog, staging, twin=case == "twin")
    assert b.next_seq == 3
    if case == "twin":
        with pytest.raises(ProducerConflictError, match=r"cannot publish seq 3 .*data file was written at .*expired"):
            b.commit(batch("b", 3, WORLD))
    else:
        assert b.commit(batch("b", 3, WORLD)).seq == 3


@pytest.mark.parametrize("case", ["twin", "twin, explicit seq", "twin, explicit seq read", "earlier incarnation"])
def test_4f_a_seq_published_by_another_batch_whose_snapshot_expired_is_told_by_its_data_file(
        catalog: SqlCatalog, staging: dict[str, str], case: str) -> None:
    """The producer numbers its next batch from its own view of the table (its last read), and the batch that
    published that seq meanwhile was committed so long before its call planned that other producers' commits expired its
    snapshot (a busy stream keeps a few): with nothing to compare, a live twin's batch was taken for this call's own,
    which was dropped and answered as published (``carried=True``, ``duplicate=False``: silent loss), and an explicit
    seq's for a replay. The batch's data file tells, as for the follow rule: its name holds its token, its modification
    time when it was written (after the producer was made: a live twin's; before: an earlier incarnation's, a
    duplicate). The same holds when the producer reads the head before its call of an explicit seq (a replay's check)."""
    stream, b = b_seq_2_expired(catalog, staging, twin=case.startswith("twin"), read=True)
    seq, step = head_producers(stream)["b"][:2]
    assert seq == 2
    explicit = {"seq": 2} if case.startswith("twin, explicit seq") else {}
    if case == "twin, explicit seq read":
        assert b.next_seq == 3  # b reads the head: its call of seq 2 begins with seq 2 published (check_replay)
    if case.startswith("twin"):
        with pytest.raises(ProducerConflictError, match=r"'b' seq 2 .*data file was written at .*expired"):
            b.commit(batch("b", 2, WORLD), **explicit)
    else:
        result = b.commit(batch("b", 2, WORLD))
        assert (result.seq, result.step, result.duplicate) == (2, step, True)
    assert head_producers(stream)["b"][:2] == [2, step]  # nothing of b's call was published


def test_4f_a_replay_on_a_fork_whose_snapshot_expired_is_answered_with_the_forks_step(catalog: SqlCatalog) -> None:
    """A fork starts its producers' seqs afresh, and its table state holds the steps it inherited: a producer id that
    published on ``main`` before the fork has a data file of the same seq in both. Once the snapshot that published a
    seq on the fork has expired, a replay of it was answered with the inherited step of ``main``'s batch (its step, and
    the batch the replay check compared with): a restart replaying on the fork got another step than the one its seq
    published, and a live twin's batch on the fork passed for an earlier incarnation's (``duplicate=True``)."""
    stream = make(catalog, **{"lakestream.snapshots.retain-last": "2"})
    b = stream.producer("b")
    for seq in range(3):
        b.commit(batch("b", seq, WORLD))
    stream.fork(stream.checkpoint("c", step=3), branch="f")
    made = stream.producer("b", branch="f")  # made before the fork's batches below: they are another writer's to it
    # a file's modification time comes from the kernel's coarse clock, up to a tick behind time.time(): a batch written
    # within that tick of the producer's making passes for an earlier incarnation's; the fork's batches come later
    probe = local(stream.table.metadata.location) / "after-made"
    while probe.touch() or probe.stat().st_mtime <= made._sent.made_at:
        pass
    probe.unlink()
    first = stream.producer("b", branch="f")
    steps = [first.commit(batch("f", seq, WORLD)).step for seq in range(60)]  # expires the fork's early snapshots
    restarted = stream.producer("b", branch="f")
    for seq in range(3):
        replay = restarted.commit(batch("f", seq, WORLD), seq=seq)
        assert (replay.duplicate, replay.step) == (True, steps[seq])
    for seq in range(3):
        with pytest.raises(ProducerConflictError, match=rf"'b' seq {seq} .*data file was written at .*expired"):
            made.commit(batch("f", seq, WORLD), seq=seq)


@pytest.mark.parametrize("first", ["b", "twin"])
def test_4f_the_follow_rule_follows_the_branch_back_after_a_rollback(
        catalog: SqlCatalog, staging: dict[str, str], first: str) -> None:
    """Two live producers of one id across a rollback by another engine: the fence of each (the id's last seq when it
    first read the table, and the seqs it answered) stayed above the rolled-back head, so the seqs published again after
    it passed for ones it may follow, and the two took turns undetected. The fence follows the branch back: the one
    about to publish after the other's batch is refused (``ProducerConflictError``), the other goes on."""
    stream = make(catalog, **staging)
    _, b = both_active(stream)
    for seq in (2, 3):
        b.commit(batch("b", seq, WORLD))
    twin = stream.producer("b")
    assert twin.next_seq == 4  # its first read: b's seqs 0..3 are an earlier incarnation's to it
    stream.table.refresh()
    at1 = next(s for s in stream.table.metadata.snapshots if s.summary is not None and
               s.summary.additional_properties.get("lakestream.producer") == "b" and
               s.summary.additional_properties.get("lakestream.seq") == "1")
    stream.table.manage_snapshots().rollback_to_snapshot(at1.snapshot_id).commit()  # seqs 2 and 3 leave the branch
    goes_on, refused = (b, twin) if first == "b" else (twin, b)
    assert goes_on.commit(batch("b", 2, WORLD)).seq == 2
    with pytest.raises(ProducerConflictError, match=r"'b' cannot publish seq 3 .*last seq 2 .*by no call of this "
                                                    r"producer"):
        refused.commit(batch("b", 3, WORLD))
    assert goes_on.commit(batch("b", 3, WORLD)).seq == 3
    assert head_producers(stream)["b"][0] == 3


def test_4f_a_producers_next_batch_after_its_call_failed_past_publishing_is_no_conflict(catalog: SqlCatalog) -> None:
    """A call whose batch was published and which then failed while tidying up (removing intents: a store error, a
    KeyboardInterrupt) recorded its seq neither as answered nor as failed: the producer's next batch took its own
    published one for another live writer's (``ProducerConflictError``)."""
    stream = make(catalog)
    b = stream.producer("b")
    b.commit(batch("b", 0, WORLD))
    remove = stream.staging.remove

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError("the store went away while intents were removed (injected)")

    stream.staging.remove = fail  # type: ignore[method-assign]
    try:
        with pytest.raises(OSError, match="went away"):
            b.commit(batch("b", 1, WORLD))
    finally:
        stream.staging.remove = remove  # type: ignore[method-assign]
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1"]
    assert b.next_seq == 2 and b.commit(batch("b", 2, WORLD)).seq == 2


def test_4f_a_producers_replay_of_a_seq_whose_commit_landed_unseen_is_a_duplicate(catalog: SqlCatalog) -> None:
    """A producer committing alone: the catalog applies its commit of seq 2 but the answer is lost, and the producer
    finds the seq published by its own batch when it reads the table back. A later replay of seq 2 by the same producer
    is its own replay (``duplicate=True``), not another writer's batch sent after it was made."""
    stream = make(catalog)
    b = stream.producer("b")
    for seq in range(2):
        b.commit(batch("b", seq, WORLD))
    original = catalog.commit_table
    lost: list[bool] = []

    def apply_then_lose_the_answer(table: Any, requirements: Any, updates: Any) -> Any:
        response = original(table, requirements, updates)
        if not lost:
            lost.append(True)
            raise ConnectionResetError("connection reset by peer (injected: the commit was applied)")
        return response

    catalog.commit_table = apply_then_lose_the_answer  # type: ignore[method-assign]
    try:
        first = b.commit(batch("b", 2, WORLD))
    finally:
        del catalog.commit_table
    assert lost and first.step == stream.head_step()
    replay = b.commit(batch("b", 2, WORLD), seq=2)
    assert replay.duplicate and replay.step == first.step


def test_4f_a_retry_of_a_failed_call_carried_meanwhile_is_still_a_duplicate(catalog: SqlCatalog,
                                                                            staging: dict[str, str]) -> None:
    """The same producer's own earlier call of seq 2 failed after staging (its outcome unknown to the caller), and a
    commit of another producer carries that batch while the call is retried: the retry gets ``duplicate=True``, not a
    conflict, though the batch was staged after the producer was made."""
    stream = make(catalog, **staging)
    a, b = both_active(stream)
    stage = stream.staging.stage
    staged_first: list[Any] = []

    def stage_then_fail(**kwargs: Any) -> Any:
        staged_first.append(stage(**kwargs))
        raise RuntimeError("the host lost its network after staging (the caller cannot tell whether it lands)")

    stream.staging.stage = stage_then_fail  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="lost its network") as failed:
            b.commit(batch("b", 2, WORLD))
    finally:
        del stream.staging.stage
    assert staged_first and stream.staging.exists(staged_first[0].path)  # it stays staged: a commit may carry it
    if hasattr(failed.value, "add_note"):  # the error names the seq a caller that let the table number it retries with
        assert any("retry it with seq=2" in note for note in getattr(failed.value, "__notes__", []))
    with carried_while_writing(stream, a) as fired:  # b's files are written; a's commit carries the staged one
        result = b.commit(batch("b", 2, WORLD))
    assert fired
    carried = [s for s in published_by(stream, "b") if s["lakestream.seq"] == "2"]
    assert len(carried) == 1 and carried[0]["lakestream.token"] == staged_first[0].batch.token
    assert result.duplicate and result.step == int(carried[0]["lakestream.step"])


def _fail_after_staging(stream: Stream, producer: Any, shards: list[pa.Table], **kwargs: Any) -> None:
    """``producer.commit(shards, **kwargs)`` fails after its batch was staged: a later commit may still carry it."""
    stage = stream.staging.stage

    def stage_then_fail(**kwargs: Any) -> Any:
        stage(**kwargs)
        raise RuntimeError("the host lost its network after staging (the caller cannot tell whether it lands)")

    stream.staging.stage = stage_then_fail  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="lost its network"):
            producer.commit(shards, **kwargs)
    finally:
        del stream.staging.stage


def test_4f_the_next_batch_after_a_failed_call_whose_batch_was_published_since_is_published_too(
        catalog: SqlCatalog, staging: dict[str, str]) -> None:
    """A seq=None call failed after staging its batch, and the caller went on to its next batch (a loop that logs a
    failed commit and moves on); another producer's commit had carried the failed one meanwhile. The next batch was
    numbered on the producer's old view as the failed call's seq, found published there by the producer's own batch,
    and answered duplicate=True: never published. A batch other than the failed one is the next seq."""
    stream = make(catalog, **staging)
    a, b = both_active(stream)
    _fail_after_staging(stream, b, batch("b", 2, WORLD))
    a.commit(batch("a", 2, WORLD))  # carries b's staged batch
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1", "2"]
    result = b.commit(batch("b", 3, WORLD))
    assert (result.seq, result.duplicate) == (3, False)
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1", "2", "3"]
    assert digest(stream.read(result.step, rank=0)) == digest(batch("b", 3, WORLD)[0])


def test_4f_a_seq_none_retry_of_a_failed_batch_published_since_is_a_duplicate_whatever_the_producer_read(
        catalog: SqlCatalog, staging: dict[str, str]) -> None:
    """The failed call's batch is published (carried by another producer's commit), and the producer reads the table
    (next_seq) before the caller retries the batch with seq=None: it was numbered after it and published a second
    time. The same batch again is the failed call's retry: duplicate=True, published once."""
    stream = make(catalog, **staging)
    a, b = both_active(stream)
    _fail_after_staging(stream, b, batch("b", 2, WORLD))
    a.commit(batch("a", 2, WORLD))  # carries b's staged batch
    assert b.next_seq == 3
    result = b.commit(batch("b", 2, WORLD))
    assert (result.seq, result.duplicate) == (2, True)
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1", "2"]
    assert b.commit(batch("b", 3, WORLD)).seq == 3  # and the producer goes on after it


def test_4f_the_next_explicit_seq_after_a_failed_call_whose_batch_was_carried_since_is_published(
        catalog: SqlCatalog, staging: dict[str, str]) -> None:
    """The producer's call of seq 2 failed after staging, and another producer's commit carried that batch afterwards.
    Its next call, of seq 3, was checked for a gap on the producer's own view of the head, which predates the carry:
    ``SequenceError`` "would skip from seq 2 to 3; commit seq 2 first", for a seq 2 that is published (and a replay
    of seq 2 is a duplicate). The gap is checked on the head before it is refused."""
    stream = make(catalog, **staging)
    a, b = both_active(stream)
    _fail_after_staging(stream, b, batch("b", 2, WORLD), seq=2)
    a.commit(batch("a", 2, WORLD))  # carries b's staged seq 2
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1", "2"]
    result = b.commit(batch("b", 3, WORLD), seq=3)
    assert result.seq == 3 and not result.duplicate
    assert b.commit(batch("b", 2, WORLD), seq=2).duplicate
    assert [s["lakestream.seq"] for s in published_by(stream, "b")] == ["0", "1", "2", "3"]


def test_4f_a_direct_commit_sent_before_the_producer_was_made_and_landing_during_its_retry_is_a_duplicate(
        catalog: SqlCatalog) -> None:
    """A producer committing alone (no staging) sends its commit of seq 2; the connection drops and the call gives up
    (``CommitTimeoutError``), but the catalog applies that request later, while a producer made after the failure (the
    restart, or ``stream.producer(...)`` again in the same process) retries seq 2. The batch was sent before that
    producer was made: an earlier incarnation's, so the retry gets ``duplicate=True`` and its step, as it does for a
    staged batch; it used to raise ``ProducerConflictError`` ("committed directly by a producer with the same id")."""
    stream = make(catalog, **{"lakestream.commit.max-attempts": "3"})
    first = stream.producer("b")
    for seq in range(2):
        first.commit(batch("b", seq, WORLD))
    original = catalog.commit_table
    held: list[tuple[Any, Any, Any]] = []

    def drop(table: Any, requirements: Any, updates: Any) -> Any:  # the first request reaches the catalog late
        if not held:
            held.append((table, requirements, updates))
        raise ConnectionResetError("connection reset by peer (injected: the request is still on its way)")

    catalog.commit_table = drop  # type: ignore[method-assign]
    try:
        with pytest.raises(CommitTimeoutError):
            first.commit(batch("b", 2, WORLD))
    finally:
        del catalog.commit_table
    assert len(held) == 1
    restarted = stream.producer("b")

    def land_late_then_commit(table: Any, requirements: Any, updates: Any) -> Any:
        if held:
            original(*held.pop())  # the first call's request lands now, before the retry's own
        return original(table, requirements, updates)

    catalog.commit_table = land_late_then_commit  # type: ignore[method-assign]
    try:
        result = restarted.commit(batch("b", 2, WORLD))
    finally:
        del catalog.commit_table
    assert not held
    landed = [s for s in published_by(stream, "b") if s["lakestream.seq"] == "2"]
    assert len(landed) == 1 and "lakestream.staged-at-ms" not in landed[0]
    assert result.duplicate and result.step == int(landed[0]["lakestream.step"])


def test_4g_a_carried_batch_records_its_token_and_when_it_was_staged(catalog: SqlCatalog, staging: dict[str, str]) -> None:
    stream = make(catalog, **staging)
    a, _ = both_active(stream)
    staged = stream.writer.write(producer="b", seq=2, shards=batch("b", 2, WORLD))
    intent = stream.staging.stage(branch="main", batch=staged, allow_gap=False)
    a.commit(batch("a", 2, WORLD))
    carried = [s for s in published_by(stream, "b") if s["lakestream.seq"] == "2"]
    assert len(carried) == 1 and carried[0]["lakestream.token"] == staged.token
    assert abs(int(carried[0]["lakestream.staged-at-ms"]) / 1000 - intent.staged_at) < 5
    own = [s for s in published_by(stream, "a") if s["lakestream.seq"] == "2"]
    assert own[0]["lakestream.token"] and "lakestream.staged-at-ms" not in own[0]


# =================================================================================================== 5. GC grace


def test_5_gc_grace_shorter_than_the_commit_timeout_is_refused_unless_opted_in(small: tuple[Stream, Any]) -> None:
    stream, _ = small  # default lakestream.commit.timeout-ms: 300 s
    with pytest.raises(ConfigError):
        stream.collect_garbage(grace=timedelta(seconds=1))
    with pytest.raises(ConfigError):
        stream.collect_garbage(dry_run=False, grace=timedelta(seconds=1))
    report = stream.collect_garbage(grace=timedelta(seconds=1), allow_short_grace=True)
    assert report.dry_run


def test_5_stream_with_grace_period_shorter_than_commit_timeout_is_refused(catalog: SqlCatalog) -> None:
    with pytest.raises(ConfigError, match="lakestream.gc.grace-period-ms"):
        make(catalog, **{"lakestream.gc.grace-period-ms": "1000", "lakestream.commit.timeout-ms": "5000"})


# =================================================================================================== 6. secrets


SECRETS = {"s3.secret-access-key": "s3cr3t-value", "rest.password": "pa55word-value", "token": "t0ken-value"}


def test_6_load_catalog_error_never_quotes_the_uri_password() -> None:
    with pytest.raises(ConfigError) as info:
        load_catalog("deadrest", type="rest", uri="http://user:s3cr3t@127.0.0.1:1",
                     **{"rest.request-timeout": "1", "rest.connect-timeout": "1"})
    text = f"{info.value} {info.value!r} {info.value.args}"
    assert "s3cr3t" not in text, f"the REST uri's password is in the error: {info.value}"


@pytest.fixture
def secret_stream(tmp_path: Path) -> Stream:
    catalog = SqlCatalog("secret", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse",
                         **SECRETS)
    stream = make(catalog)
    stream.producer("p").commit(batch("p", 0, WORLD))
    return stream


def assert_no_secret(blob: bytes | str, what: str) -> None:
    data = blob.encode() if isinstance(blob, str) else blob
    for key, value in SECRETS.items():
        assert value.encode() not in data, f"{what} contains the value of {key}"


def test_6_pickled_stream_carries_no_secret(secret_stream: Stream) -> None:
    assert_no_secret(repr(secret_stream), "repr(stream)")
    assert_no_secret(pickle.dumps(secret_stream), "pickle.dumps(stream)")


@needs_torch
def test_6_pickled_dataset_carries_no_secret(secret_stream: Stream) -> None:
    from lakestream_iceberg import LakestreamDataset

    dataset = LakestreamDataset(secret_stream, rank=0, world_size=1, prefetch=0)
    assert_no_secret(repr(dataset), "repr(dataset)")
    assert_no_secret(pickle.dumps(dataset), "pickle.dumps(dataset)")


# =================================================================================================== 7. dataset + GC


@needs_torch
@pytest.mark.parametrize("consumers", [1, 2])
def test_7_dataset_continuing_after_gc_never_raises_a_raw_file_not_found(catalog: SqlCatalog, consumers: int) -> None:
    from lakestream_iceberg import LakestreamDataset

    stream = make(catalog)
    producer = stream.producer("p")
    for seq in range(8):
        producer.commit(batch("p", seq, WORLD))
    dataset = LakestreamDataset(stream, rank=consumers - 1, world_size=consumers, prefetch=0,
                                collate=lambda item: item.step)
    iterator: Iterator[int] = iter(dataset)
    assert [next(iterator), next(iterator)] == [1, 2]
    # another job checkpointed further ahead; GC keeps only its checkpoint, collecting steps 1..3 and expiring every
    # snapshot the dataset's view was planned on (manifest lists deleted)
    stream.checkpoint("early", step=1)
    stream.checkpoint("late", step=4)
    report = Stream.open(catalog, "ns.stream").collect_garbage(dry_run=False, keep_last=1)
    assert report.collected_below == {"main": 4} and report.files_deleted.get("manifest-list", 0) > 0
    try:
        rest = list(iterator)
    except FileNotFoundError as exc:
        pytest.fail(f"raw FileNotFoundError from a dataset whose view GC outdated (step 3 was collected): {exc}")
    except StepCollectedError:
        pass  # re-resolved on the current head: step 3 is gone, and the error says so
    else:
        pytest.fail(f"step 3 was collected (its files are deleted), yet the iteration ended without an error: {rest}")
    # resuming at the retained checkpoint delivers every retained step
    dataset.load_state_dict({"next_step": 5})
    assert list(dataset) == [5, 6, 7, 8]


@needs_torch
def test_7_a_file_deleted_outside_lakestream_is_a_missing_file_error_and_publishes_nothing(catalog: SqlCatalog) -> None:
    """A data file or a manifest list the head still lists, deleted by something else (an orphan-file cleanup that
    did not exclude the stream, a bucket rule): readers, history and producers raised pyarrow's raw FileNotFoundError.
    It is a MissingFileError (a CorruptStateError, still a FileNotFoundError) saying what happened and what to do, and
    a producer publishes nothing on a head it cannot read."""
    from lakestream_iceberg import LakestreamDataset, MissingFileError
    from lakestream_iceberg.format.manifest_cache import ManifestCache

    stream = make(catalog)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, WORLD), seq=seq)
    data = next(f for f in stream.table.refresh().scan().plan_files() if int(f.file.partition[0]) == 2)
    local(data.file.file_path).unlink()
    fresh = Stream(catalog.load_table("ns.stream"), cache=ManifestCache())  # as another process: nothing cached
    for what, call in [("read", lambda: fresh.read(2, rank=int(data.file.partition[1]))),
                       ("dataset", lambda: list(LakestreamDataset(fresh, rank=int(data.file.partition[1]), world_size=WORLD,
                                                                  follow=False, prefetch=0)))]:
        with pytest.raises(MissingFileError, match="missing from storage.*Restore it") as info:
            call()
        assert data.file.file_path.removeprefix("file://") in str(info.value), (what, str(info.value))
        assert isinstance(info.value, CorruptStateError) and isinstance(info.value, FileNotFoundError)
    head = stream.table.refresh().current_snapshot()
    assert head is not None
    local(head.manifest_list).unlink()
    lost = Stream(catalog.load_table("ns.stream"), cache=ManifestCache())
    for what, call in [("history", lambda: lost.history()),
                       ("commit", lambda: lost.producer("q").commit(batch("q", 0, WORLD), seq=0))]:
        with pytest.raises(MissingFileError, match="missing from storage") as info:
            call()
        assert head.manifest_list.removeprefix("file://") in str(info.value), (what, str(info.value))
    after = stream.table.refresh().current_snapshot()
    assert after is not None and after.snapshot_id == head.snapshot_id  # nothing published on the unreadable head


# =================================================================================================== 8. small


@pytest.mark.parametrize("step", [0, -3])
def test_8_reading_step_below_one_says_steps_start_at_one(small: tuple[Stream, Any], step: int) -> None:
    stream, _ = small
    with pytest.raises(LakestreamError) as info:
        stream.read(step, rank=0)
    assert not isinstance(info.value, StepCollectedError), f"step {step} was never collected: {info.value}"
    assert "start" in str(info.value).lower() and "1" in str(info.value), str(info.value)


def test_8_null_in_a_required_nested_field_is_rejected_before_anything_is_written(catalog: SqlCatalog) -> None:
    inner = pa.struct([pa.field("a", pa.int64(), nullable=False), pa.field("b", pa.string())])
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("meta", inner)])
    stream = make(catalog, schema=schema)
    good = pa.table({"id": [1, 2], "meta": pa.array([{"a": 1, "b": "x"}, {"a": 2, "b": None}], type=inner)}, schema=schema)
    bad = pa.table({"id": [3, 4], "meta": pa.array([{"a": 3, "b": "x"}, {"a": None, "b": "y"}], type=inner)}, schema=schema)
    assert bad.column("meta").chunk(0).field(0).null_count == 1
    with pytest.raises(LakestreamError):
        stream.producer("p").commit([good, bad])
    assert files_under_data(stream) == set(), "a rejected batch left data files behind"
    assert stream.head_step() == 0


@pytest.mark.parametrize("key", ["lakestream.step", "lakestream.collected-below"])
def test_2_a_summary_number_with_a_trailing_newline_is_not_what_lakestream_writes(key: str) -> None:
    """``$`` matches before a final newline: "4\\n" passed the check of a summary integer and int() read it as 4. A
    value lakestream never writes is refused loudly, never read as another."""
    from lakestream_iceberg.errors import CorruptStateError
    from lakestream_iceberg.format.summary import StreamState

    summary = {"lakestream.step": "4", "lakestream.producers": "{}", "lakestream.collected-below": "1"}
    assert StreamState.parse(summary).step == 4
    summary[key] += "\n"
    with pytest.raises(CorruptStateError, match=key):
        StreamState.parse(summary, snapshot_id=7)


def test_2_a_collected_below_past_the_step_after_the_head_is_refused_not_shown() -> None:
    """GC collects steps below a checkpoint, at most the head step, so ``lakestream.collected-below`` is never past the
    step after ``lakestream.step``. Another tool's summary with 500 over a head of 100 was read as is: ``lakestream
    status`` showed steps collected below 500 on a head of 100, the history and ``tail`` skipped every step (tail
    waited for step 500), GC's plan started from it. It is refused loudly, as every value lakestream never writes."""
    from lakestream_iceberg.errors import CorruptStateError
    from lakestream_iceberg.format.summary import StreamState

    summary = {"lakestream.step": "100", "lakestream.producers": "{}", "lakestream.collected-below": "101"}
    assert StreamState.parse(summary).collected_below == 101
    summary["lakestream.collected-below"] = "500"
    with pytest.raises(CorruptStateError, match="lakestream.collected-below=.500.*step 100"):
        StreamState.parse(summary, snapshot_id=7)
