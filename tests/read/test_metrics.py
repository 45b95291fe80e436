"""Prometheus metrics of producers and trainer ranks, read from a real ``prometheus_client`` registry; and without the
``metrics`` extra, nothing is exported and nothing breaks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from lakestream_iceberg import BatchError, SchemaMismatchError, Stream
from lakestream_iceberg.connect import metrics
from tests.support import SCHEMA, batch, sqlite_catalog

prometheus_client = pytest.importorskip("prometheus_client")

WORLD = 2
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def registry() -> Iterator[object]:
    registry = prometheus_client.CollectorRegistry()
    metrics.use_registry(registry)
    yield registry
    metrics.use_registry(None)


@pytest.fixture
def stream(tmp_path: Path) -> Stream:
    return Stream.create(sqlite_catalog(str(tmp_path)), "ns.metrics", schema=SCHEMA, world_size=WORLD)


def test_producer_commits_are_measured(stream: Stream, registry: object) -> None:
    producer = stream.producer("prep-0")
    results = [producer.commit(batch("prep-0", seq, WORLD), seq=seq) for seq in range(3)]
    again = producer.commit(batch("prep-0", 1, WORLD), seq=1)
    assert again.duplicate
    labels = {"catalog": "test", "stream": stream.name, "branch": "main"}

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, {**labels, **extra})

    assert value("lakestream_commits_total", outcome="published") == 3
    assert value("lakestream_commits_total", outcome="duplicate") == 1
    assert value("lakestream_commits_total", outcome="carried") is None
    assert value("lakestream_commit_latency_seconds_count") == 4
    assert value("lakestream_commit_latency_seconds_sum") == pytest.approx(sum(r.latency_s for r in [*results, again]))
    assert value("lakestream_commit_attempts_count") == 3  # a duplicate known before writing made no attempt
    assert value("lakestream_commit_attempts_sum") == sum(r.attempts for r in results) >= 3
    assert value("lakestream_staged_intents") == 0  # asked of the staging area when scraped
    assert value("lakestream_commit_group_size_count") == 3  # a lone producer's swaps publish groups of 1
    assert value("lakestream_commit_group_size_sum") == sum(r.group for r in results) == 3


def test_two_streams_of_one_name_in_two_catalogs_are_two_series(tmp_path: Path, registry: object) -> None:
    """One process writing ``ns.metrics`` of two catalogs: each catalog's commits and staged intents are series of
    their own (``catalog`` label), not one series summing both, and not one staging area's count standing for both."""
    streams = {}
    for name in ("east", "west"):
        (tmp_path / name).mkdir()
        streams[name] = Stream.create(sqlite_catalog(str(tmp_path / name), name=name), "ns.metrics", schema=SCHEMA,
                                      world_size=WORLD)
    for name, commits in (("east", 3), ("west", 1)):
        producer = streams[name].producer("prep-0")
        for seq in range(commits):
            producer.commit(batch("prep-0", seq, WORLD), seq=seq)
    staged = streams["west"].writer.write(producer="other", seq=0, shards=batch("other", 0, WORLD))
    streams["west"].staging.stage(branch="main", batch=staged, allow_gap=False)  # another producer's pending batch

    def value(metric: str, catalog: str, **extra: str) -> float | None:
        return registry.get_sample_value(metric, {"catalog": catalog, "stream": "ns.metrics", "branch": "main", **extra})

    assert value("lakestream_commits_total", "east", outcome="published") == 3
    assert value("lakestream_commits_total", "west", outcome="published") == 1
    assert value("lakestream_commit_latency_seconds_count", "east") == 3
    assert value("lakestream_staged_intents", "east") == 0
    assert value("lakestream_staged_intents", "west") == 1
    scraped = [s for m in registry.collect() if m.name == "lakestream_staged_intents" for s in m.samples]
    assert len(scraped) == 2  # one sample per label set


def test_a_commit_that_raises_is_counted_as_failed_and_a_refused_batch_is_not(stream: Stream, registry: object) -> None:
    producer = stream.producer("prep-0")
    producer.commit(batch("prep-0", 0, WORLD), seq=0)
    with pytest.raises(BatchError):  # refused by its checks before anything is written: not a commit
        producer.commit(batch("prep-0", 1, WORLD)[:1], seq=1)
    with stream.table.update_schema() as update:  # another engine drops a payload column: every commit is refused
        update.delete_column("i")
    with pytest.raises(SchemaMismatchError, match="no longer has the payload column 'i'"):
        producer.commit(batch("prep-0", 1, WORLD), seq=1)
    future = producer.submit(batch("prep-0", 1, WORLD), seq=1)  # the committer thread's commit: refused the same
    with pytest.raises(SchemaMismatchError, match="no longer has the payload column 'i'"):
        future.result(timeout=120)
    labels = {"catalog": "test", "stream": stream.name, "branch": "main"}
    assert registry.get_sample_value("lakestream_commits_total", {**labels, "outcome": "failed"}) == 2
    assert registry.get_sample_value("lakestream_commits_total", {**labels, "outcome": "published"}) == 1


def test_a_group_size_is_recorded_where_the_commit_result_has_one(stream: Stream, registry: object) -> None:
    result = stream.producer("prep-0").commit(batch("prep-0", 0, WORLD), seq=0)
    carried = types.SimpleNamespace(**{**dataclasses.asdict(result), "carried": True, "group": 3})
    metrics.observe_commit(carried, stream=stream.name, branch="main", catalog="test")
    metrics.observe_commit(types.SimpleNamespace(**{**dataclasses.asdict(result), "group": True}), stream=stream.name,
                           branch="main", catalog="test")  # not a size: ignored
    labels = {"catalog": "test", "stream": stream.name, "branch": "main"}
    assert registry.get_sample_value("lakestream_commit_group_size_count", labels) == 2  # the real commit's 1, then 3
    assert registry.get_sample_value("lakestream_commit_group_size_sum", labels) == 1 + 3
    assert registry.get_sample_value("lakestream_commits_total", {**labels, "outcome": "carried"}) == 1


def test_a_trainer_rank_is_measured(stream: Stream, registry: object) -> None:
    pytest.importorskip("torch")
    from lakestream_iceberg.read.dataset import LakestreamDataset
    from lakestream_iceberg.read.lag import consumer_lags
    from tests.support import until

    producer = stream.producer("prep-0")
    for seq in range(4):
        producer.commit(batch("prep-0", seq, WORLD), seq=seq)
    ds = LakestreamDataset(stream, rank=1, world_size=WORLD, group="run", report_s=0.05)
    labels = {"catalog": "test", "stream": stream.name, "group": "run", "rank": "1"}
    value = registry.get_sample_value
    steps = []
    for item in ds:
        steps.append(item["step"])
        if steps[-1] == 2:  # head 4; refreshed at each report (every 0.05 s)
            until(lambda: value("lakestream_consumer_steps_behind_head", labels) == 2, "the gauge at 2 steps behind")
    assert steps == [1, 2, 3, 4]
    assert value("lakestream_consumer_steps_total", labels) == 4
    assert value("lakestream_consumer_last_step", labels) == 4
    # the iteration ended: nothing refreshes the lag any more, and a frozen one would be false once the head moves on
    assert value("lakestream_consumer_steps_behind_head", labels) is None
    assert value("lakestream_consumer_data_wait_seconds_total", labels) >= 0
    position = consumer_lags(stream.refresh(), group="run")[0]
    assert value("lakestream_consumer_read_bytes_total", labels) == position.read_bytes > 0


def test_the_series_of_finished_ranks_stay_for_the_last_few_and_the_oldest_go(stream: Stream, registry: object,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived service opening a new group for every run would keep ~8 series per finished rank forever: the
    newest FINISHED_RANKS_KEPT finished ranks keep theirs (a scrape after training reads them), older ones go."""
    pytest.importorskip("torch")
    from lakestream_iceberg.read.dataset import LakestreamDataset

    monkeypatch.setattr(metrics, "FINISHED_RANKS_KEPT", 2)
    producer = stream.producer("prep-0")
    for seq in range(2):
        producer.commit(batch("prep-0", seq, WORLD), seq=seq)

    def steps(group: str) -> float | None:
        return registry.get_sample_value("lakestream_consumer_steps_total",
                                         {"catalog": "test", "stream": stream.name, "group": group, "rank": "0"})

    def last(group: str) -> float | None:
        return registry.get_sample_value("lakestream_consumer_last_step",
                                         {"catalog": "test", "stream": stream.name, "group": group, "rank": "0"})

    for run in range(3):
        assert [item["step"] for item in LakestreamDataset(stream, rank=0, world_size=WORLD, group=f"run-{run}")] == [1, 2]
    assert steps("run-0") is None and last("run-0") is None  # the oldest finished rank: removed
    assert steps("run-1") == steps("run-2") == 2 and last("run-1") == last("run-2") == 2
    running = iter(LakestreamDataset(stream, rank=0, world_size=WORLD, group="run-1"))  # run-1 reports again
    assert next(running)["step"] == 1
    for run in range(3, 5):  # two more finish: run-2 goes, run-1 (reporting, then finished last) stays
        assert [item["step"] for item in LakestreamDataset(stream, rank=0, world_size=WORLD, group=f"run-{run}")] == [1, 2]
    assert steps("run-1") == 3 and steps("run-2") is None and steps("run-4") == 2
    assert [item["step"] for item in running] == [2]  # run-1 ends, the newest finished: run-3, the oldest, goes
    assert steps("run-1") == 4 and steps("run-3") is None and steps("run-4") == 2


def test_a_rank_that_delivered_nothing_yet_is_measured_where_its_position_says_it_is(stream: Stream,
                                                                                     registry: object) -> None:
    """Before its first step a rank's position is the step before its first (None from step 1), and lakestream lag
    shows it that far behind the head; its gauges said last step 0 (a rank resumed at step 3), or the last step of its
    previous iteration, and 0 steps behind (a rank from step 1 with four steps published), whatever the head."""
    pytest.importorskip("torch")
    import threading

    from lakestream_iceberg.read.dataset import LakestreamDataset
    from lakestream_iceberg.read.lag import consumer_lags
    from tests.support import until

    producer = stream.producer("prep-0")
    for seq in range(4):
        producer.commit(batch("prep-0", seq, WORLD), seq=seq)
    gate = threading.Event()

    def held(item: object) -> object:  # the rank's first step is still being read
        gate.wait(60)
        return item

    value = registry.get_sample_value
    try:
        for rank, start, last, behind in [(0, 3, 2, 2), (0, 1, 0, 4)]:  # then again from step 1 (not at 3 now)
            ds = LakestreamDataset(stream, rank=rank, world_size=WORLD, group="run", report_s=0.05, start_step=start,
                                   transform=held, prefetch=1)
            waiting = threading.Thread(target=lambda ds=ds: next(iter(ds)), daemon=True)
            waiting.start()
            position = None if start == 1 else last
            row = until(lambda key=(rank, position, 0): [c for c in consumer_lags(stream.refresh(), group="run")
                                                         if (c.rank, c.last_step, c.steps) == key],
                        "the rank's first report")[0]
            assert row.lag_steps == behind
            labels = {"catalog": "test", "stream": stream.name, "group": "run", "rank": str(rank)}
            assert (value("lakestream_consumer_last_step", labels),
                    value("lakestream_consumer_steps_behind_head", labels)) == (last, behind)
            gate.set()
            waiting.join(60)
            ds.close()
            gate.clear()
    finally:
        gate.set()


def test_a_ranks_lag_gauge_goes_with_its_last_reporter_in_the_process(stream: Stream, registry: object) -> None:
    """The steps-behind gauge stayed at its last value once a rank's iteration ended (an epoch's end, an elastic
    resize giving the process another rank), while the head moved on: a lag that was no longer true. It goes when the
    last reporter of its labels in the process closes; the last step and the counters stay."""
    from lakestream_iceberg.connect.positions import PositionStore
    from lakestream_iceberg.read.consumer import PositionReporter
    from tests.support import until

    store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)
    head = [5]

    def reporter() -> PositionReporter:
        return PositionReporter(store=store, group="run", rank=0, world_size=WORLD, branch="main", name=stream.name,
                                stream=str(stream.table.metadata.table_uuid), report_s=0.05, workers=0,
                                source="iterator", head=lambda: head[0], catalog="test")

    labels = {"catalog": "test", "stream": stream.name, "group": "run", "rank": "0"}

    def behind() -> float | None:
        return registry.get_sample_value("lakestream_consumer_steps_behind_head", labels)

    first, second = reporter(), reporter()  # e.g. two iterations of one dataset at once
    first.delivered(2, wait_s=0.0)
    until(lambda: behind() == 3, "the gauge at 3 steps behind")
    first.close()
    second.delivered(1, wait_s=0.0)
    head[0] = 7  # the head moves on: the second reporter still refreshes the gauge
    until(lambda: behind() == 6, "the gauge of the reporter left, at 6 steps behind")
    second.close()
    assert behind() is None
    assert registry.get_sample_value("lakestream_consumer_last_step", labels) == 1
    assert registry.get_sample_value("lakestream_consumer_steps_total", labels) == 2
    first.close()  # again, and after the second: nothing comes back
    assert behind() is None
    again = reporter()  # the rank's next iteration shows it again
    until(lambda: behind() == 7, "the next iteration's gauge")
    again.close()
    assert behind() is None
    reads = metrics.consumer_metrics(stream=stream.name, group="run", rank=1, gauges=False, catalog="test")  # a DataLoader worker's
    reads.read(10)
    assert registry.get_sample_value("lakestream_consumer_read_bytes_total", {**labels, "rank": "1"}) == 10
    assert registry.get_sample_value("lakestream_consumer_last_step", {**labels, "rank": "1"}) is None


def test_without_prometheus_client_nothing_is_exported_and_nothing_breaks(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})

        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name == "prometheus_client" or name.startswith("prometheus_client."):
                    raise ImportError("prometheus_client is not installed here")
                return None

        sys.meta_path.insert(0, Blocker())
        from lakestream_iceberg import Stream
        from lakestream_iceberg.connect import metrics
        from lakestream_iceberg.connect.positions import PositionStore
        from lakestream_iceberg.read.consumer import PositionReporter
        from lakestream_iceberg.read.lag import consumer_lags
        from tests.support import SCHEMA, batch, sqlite_catalog

        stream = Stream.create(sqlite_catalog({str(tmp_path)!r}), "ns.bare", schema=SCHEMA, world_size=2)
        producer = stream.producer("prep-0")
        for seq in range(2):
            producer.commit(batch("prep-0", seq, 2), seq=seq)
        store = PositionStore(catalog=stream.table.catalog, io=stream.io, location=stream.table.metadata.location)
        reporter = PositionReporter(store=store, group="run", rank=0, world_size=2, branch="main", name=stream.name,
                                    stream=str(stream.table.metadata.table_uuid), report_s=0.05, workers=0,
                                    source="iterator", head=lambda: 2)
        steps = [1, 2]
        for step in steps:  # what a dataset's iterator does for each step it hands over (torch not needed here)
            reporter.read(100)
            reporter.delivered(step, wait_s=0.01)
        reporter.close()
        metrics.use_registry(None)
        assert metrics.consumer_metrics(stream=stream.name, group="run", rank=0) is None
        print(metrics.available(), steps, [c.status for c in consumer_lags(stream.refresh(), group="run")],
              "prometheus_client" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "False [1, 2] ['closed'] False"  # a producer and a rank, no client loaded


def test_the_steps_behind_gauge_is_refreshed_between_rare_position_reports(stream: Stream, registry: object,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Past 1,000 ranks a position is written every world_size / 200 s, and the gauge was set only then: a rank that
    reported every 100 s showed a head up to 100 s old. The gauge is refreshed every METRICS_S meanwhile."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from lakestream_iceberg.read import consumer
    from lakestream_iceberg.read.dataset import LakestreamDataset
    from tests.support import until

    monkeypatch.setattr(consumer, "METRICS_S", 0.05)
    producer = stream.producer("prep-0")
    for seq in range(4):
        producer.commit(batch("prep-0", seq, WORLD), seq=seq)
    ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=3600, relay=False)
    items = iter(ds.track(DataLoader(ds, batch_size=None, num_workers=0)))
    assert next(items)["step"] == 1
    labels = {"catalog": "test", "stream": stream.name, "group": "run", "rank": "0"}
    for seq in range(4, 7):
        producer.commit(batch("prep-0", seq, WORLD), seq=seq)
    until(lambda: registry.get_sample_value("lakestream_consumer_steps_behind_head", labels) == 7 - 1,
          "the gauge to see head step 7 with the rank at step 1")
    items.close()


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_the_steps_behind_gauge_of_a_following_rank_sees_steps_published_while_it_trains(
        stream: Stream, registry: object, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory,
        relay: bool) -> None:
    """A follow-mode rank iterated without workers (the default) set the gauge from its watcher's head "as last
    seen", and the watcher polls only once the rank has read ahead up to that head: a rank falling behind (training
    slower than the producers publish) showed its lag shrinking to 0 while it grew, until it caught up with the head
    it last saw. ``lakestream lag`` showed the real lag meanwhile."""
    pytest.importorskip("torch")
    from lakestream_iceberg.read import consumer
    from lakestream_iceberg.read.dataset import LakestreamDataset
    from lakestream_iceberg.read.lag import consumer_lags
    from tests.support import until

    directory = tmp_path_factory.mktemp("relay")
    directory.chmod(0o700)
    monkeypatch.setenv("LAKESTREAM_RELAY_DIR", str(directory))
    monkeypatch.setattr(consumer, "METRICS_S", 0.05)
    producer = stream.producer("prep-0")
    for seq in range(4):
        producer.commit(batch("prep-0", seq, WORLD), seq=seq)
    ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", report_s=3600, follow=True, timeout=30,
                           relay=relay)
    items = iter(ds)
    assert next(items)["step"] == 1  # the rank trains on step 1 while the producers publish steps 5-12
    for seq in range(4, 12):
        producer.commit(batch("prep-0", seq, WORLD), seq=seq)
    labels = {"catalog": "test", "stream": stream.name, "group": "run", "rank": "0"}
    try:
        until(lambda: registry.get_sample_value("lakestream_consumer_steps_behind_head", labels) == 12 - 1,
              "the gauge to see head step 12 with the rank at step 1", deadline_s=10)
    finally:
        shown = registry.get_sample_value("lakestream_consumer_steps_behind_head", labels)
        items.close()
        ds.close()
    assert shown == 11 == consumer_lags(stream.refresh(), group="run")[0].lag_steps


@pytest.mark.parametrize("bad", ["registry", 5, prometheus_client])
def test_use_registry_refuses_what_is_not_a_registry(stream: Stream, bad: object) -> None:
    """``use_registry("x")`` was accepted: producers then recorded nothing (silently), and every dataset with a group
    failed at its first step with ``AttributeError: 'str' object has no attribute 'register'``."""
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg import LakestreamDataset
    from lakestream_iceberg.errors import ConfigError

    try:
        with pytest.raises(ConfigError, match="CollectorRegistry or None"):
            metrics.use_registry(bad)
        stream.producer("prep-0").commit(batch("prep-0", 0, WORLD), seq=0)
        ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", end_step=1)
        assert [int(item["step"]) for item in ds] == [1]
        ds.close()
    finally:
        metrics.use_registry(None)


def test_a_registry_holding_one_of_lakestreams_names_is_refused_and_left_as_it_was(stream: Stream) -> None:
    """A registry that already had ``lakestream_commits`` (the application's own counter) got lakestream's first two
    families registered, then the third failed: the registry kept half of lakestream's metrics, and every dataset with
    a group failed at its first step with ``DuplicateTimeseries``. Now ``use_registry`` says so and registers none."""
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    from lakestream_iceberg import LakestreamDataset
    from lakestream_iceberg.errors import ConfigError

    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("lakestream_commits", "the application's own", registry=registry)
    before = prometheus_client.generate_latest(registry)
    try:
        with pytest.raises(ConfigError, match="lakestream_commits.*use_registry"):
            metrics.use_registry(registry)
        assert prometheus_client.generate_latest(registry) == before
        ds = LakestreamDataset(stream, rank=0, world_size=WORLD, group="run", end_step=1)
        stream.producer("prep-0").commit(batch("prep-0", 0, WORLD), seq=0)
        assert [int(item["step"]) for item in ds] == [1]
        ds.close()
        fresh = prometheus_client.CollectorRegistry()
        metrics.use_registry(fresh)
        metrics.use_registry(fresh)  # the same registry twice: one set of families
    finally:
        metrics.use_registry(None)


def test_a_conflict_in_the_default_registry_never_stops_a_producer_or_a_rank(tmp_path: Path) -> None:
    """With no registry chosen, a name of lakestream's taken in ``prometheus_client.REGISTRY`` made every dataset with a
    group fail at its first step (``DuplicateTimeseries``), while producers went on: now both go on, and one warning
    says why nothing is recorded."""
    pytest.importorskip("torch")  # LakestreamDataset needs the torch extra
    code = textwrap.dedent(f"""
        import logging, sys
        sys.path.insert(0, {str(ROOT)!r})
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
        import prometheus_client
        prometheus_client.Counter("lakestream_consumer_steps", "someone else's")
        from lakestream_iceberg import LakestreamDataset, Stream
        from tests.support import SCHEMA, batch, sqlite_catalog

        stream = Stream.create(sqlite_catalog({str(tmp_path)!r}), "ns.clash", schema=SCHEMA, world_size=2)
        producer = stream.producer("prep-0")
        for seq in range(2):
            producer.commit(batch("prep-0", seq, 2), seq=seq)
        ds = LakestreamDataset(stream, rank=0, world_size=2, group="run", end_step=2)
        print("steps", [int(item["step"]) for item in ds])
        ds.close()
        print("families", sorted(n for n in prometheus_client.REGISTRY._names_to_collectors if "lakestream" in n))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "lakestream" in line or line.startswith("steps")]
    assert "steps [1, 2]" in lines, proc.stdout
    assert sum("metrics are not recorded" in line for line in lines) == 1, proc.stdout
    families = next(line for line in lines if line.startswith("families"))
    assert "lakestream_commits_total" not in families, families  # none of lakestream's half-registered


def test_a_child_forked_while_the_metrics_lock_was_held_records_its_metrics(registry: object) -> None:
    """A fork (a DataLoader starting its workers) while another thread of the parent held the metrics' lock (a
    committer thread recording a commit) left the child's copy of the lock held forever: a worker's first read
    (``consumer_metrics``) hung."""
    with metrics._lock:
        pid = os.fork()
        if pid == 0:  # the child: exit at once, whatever happens
            code = 1
            try:
                code = 0 if metrics.consumer_metrics(stream="s", group="g", rank=0, gauges=False) is not None else 2
            finally:
                os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the metrics lock")
