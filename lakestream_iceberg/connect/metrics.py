"""Prometheus metrics of producers and trainer ranks, through ``prometheus-client`` (the optional extra ``metrics``).

Without ``prometheus-client`` installed nothing is recorded or exported and nothing else changes: every function here
returns at once. With it, lakestream registers its metrics in ``prometheus_client``'s default registry (or the one
given to :func:`use_registry`) the first time a producer is made or a trainer rank starts recording its position;
exporting them is the application's choice (``prometheus_client.start_http_server(9100)``, or a push gateway). Names
and labels:

=========================================== ========= ===================================================================
``lakestream_commit_latency_seconds``        histogram wall time of ``Producer.commit`` (``catalog``, ``stream``,
                                                       ``branch``)
``lakestream_commit_attempts``               histogram compare-and-swap attempts per commit (``catalog``, ``stream``,
                                                       ``branch``)
``lakestream_commits_total``                 counter   commits by ``outcome``: ``published`` (own swap), ``carried`` (by
                                                       another producer's group commit), ``duplicate``, ``failed``
                                                       (publishing a checked batch raised: in
                                                       ``Producer.commit`` or ``submit()``'s future)
``lakestream_commit_group_size``             histogram batches the swap that published a batch published
                                                       (``CommitResult.group``)
``lakestream_staged_intents``                gauge     batches staged for group commit and not published yet, per
                                                       (``catalog``, ``stream``, ``branch``), counted when scraped
``lakestream_consumer_last_step``            gauge     the last step a rank delivered (``catalog``, ``stream``,
                                                       ``group``, ``rank``);
                                                       before its first, the step before it (0 from step 1)
``lakestream_consumer_steps_behind_head``    gauge     head step minus that step, at the last report; removed when the
                                                       rank's iteration ends
``lakestream_consumer_steps_total``          counter   steps delivered
``lakestream_consumer_data_wait_seconds_total`` counter time the training loop waited for data
``lakestream_consumer_read_bytes_total``     counter   bytes of data files fetched
=========================================== ========= ===================================================================

``catalog`` is the name the catalog was loaded under (``catalog.name``): two streams of one name in two catalogs of
a process are two series, not one (give the catalogs of a process distinct names).

Labels stay bounded in a long-lived process: producer ids, steps and files are not labels (an elastic pool makes new
ids), and a consumer's labels are those of the ranks the process runs: 1,000 trainer ranks are 1,000 label sets across
the fleet, one per process (a few per process with DataLoader workers, whose read-bytes counter has the rank's labels). A rank's series stay when its iteration ends (the last
step and the counters are facts of what it did; a scrape after training still reads them), for the last
:data:`FINISHED_RANKS_KEPT` finished ranks of the process: a service that opens a new group for every run removes the
series of the oldest finished ones, as a Kafka client removes a closed consumer's metrics.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from lakestream_iceberg.errors import ConfigError

__all__ = ["FINISHED_RANKS_KEPT", "ConsumerMetrics", "available", "catalog_label", "consumer_metrics", "observe_commit", "observe_failed_commit", "prepare",
           "use_registry"]

log = logging.getLogger(__name__)

FINISHED_RANKS_KEPT = 1_000  # (stream, group, rank) label sets whose iteration ended and whose series stay
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_COUNT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
_lock = threading.Lock()
_chosen: Any = None  # the registry use_registry() chose (None: prometheus_client's default)
_families: dict[int, _Families] = {}  # by id(registry); the registry is held by its _Families


def _new_lock_after_fork() -> None:
    """A child forked while another thread held ``_lock`` (a committer thread recording a commit while a DataLoader
    forks its workers) would wait for it forever: the child starts with a free lock."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        return None
    return prometheus_client


def available() -> bool:
    """Whether ``prometheus-client`` is installed (``pip install 'lakestream-iceberg[metrics]'``)."""
    return _client() is not None


def use_registry(registry: Any) -> None:
    """Record lakestream's metrics into ``registry`` (a ``prometheus_client.CollectorRegistry``) from now on; None
    goes back to ``prometheus_client.REGISTRY``. lakestream's metric families are registered in ``registry`` here, so
    that anything but a registry, or a registry that already holds a metric of one of lakestream's names (another
    library's, or the application's), is a ``ConfigError`` at this call rather than metrics lost later; passing the
    same registry again is harmless. Without the extra this does nothing."""
    global _chosen
    client = _client()
    if client is not None and registry is not None:
        if not (callable(getattr(registry, "register", None)) and callable(getattr(registry, "unregister", None))):
            raise ConfigError(f"use_registry() takes a prometheus_client.CollectorRegistry or None, not "
                              f"{type(registry).__name__}")
        with _lock:
            _families_in(client, registry)
    with _lock:
        _chosen = registry


class _StagedCollector:
    """``lakestream_staged_intents``: asks each staging area it knows for its pending intents when scraped.

    Areas are told apart by their table (``table``: its location), not by their labels: two streams of one name in two
    catalogs that share a name are one series, their sum, rather than one of them unreported."""

    def __init__(self) -> None:
        # (table, branch) -> (labels, the staging area); one per table and branch (a stream opened twice stages in one folder)
        self._areas: dict[tuple[str, str], tuple[tuple[str, str, str], Callable[[], Any]]] = {}

    def add(self, catalog: str, stream: str, branch: str, staging: Any, *, table: str) -> None:
        key = (table, branch)
        if key not in self._areas or self._areas[key][1]() is None:
            self._areas[key] = ((catalog, stream, branch), weakref.ref(staging))

    def describe(self) -> list[Any]:
        return []  # registered without describe-time collection: a scrape asks the staging areas, registering does not

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "lakestream_staged_intents", "Batches staged for group commit and not published yet",
            labels=["catalog", "stream", "branch"])
        counts: dict[tuple[str, str, str], int] = {}
        for key, (labels, ref) in list(self._areas.items()):
            staging = ref()
            if staging is None:
                self._areas.pop(key, None)
                continue
            try:
                counts[labels] = counts.get(labels, 0) + len(staging.pending(labels[2], max_age_s=float("inf")))
            except Exception as exc:  # noqa: BLE001 - a scrape never fails for one unreachable store
                log.debug("counting staged intents of %s failed: %s", labels[1], exc)
        for labels, count in counts.items():
            family.add_metric(list(labels), count)
        yield family


class _Families:
    """lakestream's metric families in one registry."""

    def __init__(self, client: Any, registry: Any) -> None:
        self.registry = registry
        h, c, g = client.Histogram, client.Counter, client.Gauge
        r: dict[str, Any] = {"registry": None}  # registered below, all or none
        producer, consumer = ["catalog", "stream", "branch"], ["catalog", "stream", "group", "rank"]
        self.latency = h("lakestream_commit_latency_seconds", "Wall time of Producer.commit", producer,
                         buckets=_LATENCY_BUCKETS, **r)
        self.attempts = h("lakestream_commit_attempts", "Compare-and-swap attempts per commit", producer,
                          buckets=_COUNT_BUCKETS, **r)
        self.commits = c("lakestream_commits", "Commits by outcome (published, carried, duplicate, failed)",
                         [*producer, "outcome"], **r)
        self.group = h("lakestream_commit_group_size", "Batches published by the swap that published a batch", producer,
                       buckets=_COUNT_BUCKETS, **r)
        self.staged = _StagedCollector()
        self.last_step = g("lakestream_consumer_last_step", "Last step a consumer rank delivered", consumer, **r)
        self.behind = g("lakestream_consumer_steps_behind_head", "Head step minus the last step delivered", consumer, **r)
        self.steps = c("lakestream_consumer_steps", "Steps delivered to the training loop", consumer, **r)
        self.wait = c("lakestream_consumer_data_wait_seconds", "Time the training loop waited for data", consumer, **r)
        self.read = c("lakestream_consumer_read_bytes", "Bytes of data files fetched", consumer, **r)
        done: list[Any] = []
        for collector in (self.latency, self.attempts, self.commits, self.group, self.staged, self.last_step,
                          self.behind, self.steps, self.wait, self.read):
            try:
                registry.register(collector)
            except Exception as exc:
                for registered in done:  # none of them, rather than some: a later try finds the registry as it was
                    try:
                        registry.unregister(registered)
                    except Exception:  # noqa: BLE001, S110 - best effort; the error below says what failed
                        pass
                raise ConfigError(f"lakestream's Prometheus metrics cannot be registered in {type(registry).__name__}: "
                                  f"{exc} (another metric there has one of lakestream's names; give lakestream its "
                                  f"own registry with lakestream_iceberg.connect.metrics.use_registry)") from exc
            done.append(collector)


def _families_in(client: Any, registry: Any) -> _Families:
    """lakestream's families in ``registry``, registered there the first time (hold ``_lock``)."""
    found = _families.get(id(registry))
    if found is None or found.registry is not registry:
        found = _families[id(registry)] = _Families(client, registry)
    return found


def _families_now() -> _Families | None:
    client = _client()
    if client is None:
        return None
    with _lock:
        return _families_in(client, _chosen if _chosen is not None else client.REGISTRY)


def prepare() -> None:
    """Import the client and register lakestream's metric families now (a producer calls it when it is made), so that
    the first commit does not pay for it (importing ``prometheus_client`` takes tens of ms). Never raises."""
    try:
        _families_now()
    except Exception as exc:  # noqa: BLE001 - metrics must not fail a producer
        _warn_once(exc)


def catalog_label(table: Any) -> str:
    """The ``catalog`` label of a pyiceberg table's metrics: the name its catalog was loaded under ("" where unknown)."""
    name = getattr(getattr(table, "catalog", None), "name", None)
    return name if isinstance(name, str) else ""


def observe_commit(result: Any, *, stream: str, branch: str, staging: Any = None, catalog: str = "",
                   table: str | None = None) -> None:
    """Record one ``Producer.commit`` result (a ``CommitResult``: ``attempts``, ``latency_s``, ``carried``,
    ``duplicate``, and ``group`` where the result has it). ``catalog``: the catalog's name (a label); ``table``: the
    table's location, which tells ``staging`` areas of equally labelled streams apart (default: the labels). Never
    raises: metrics must not fail a commit."""
    try:
        families = _families_now()
        if families is None:
            return
        labels = (catalog, stream, branch)
        families.latency.labels(*labels).observe(float(result.latency_s))
        outcome = "duplicate" if result.duplicate else "carried" if result.carried else "published"
        families.commits.labels(*labels, outcome).inc()
        if not result.duplicate:  # a duplicate published nothing: no attempt, no group of its own
            families.attempts.labels(*labels).observe(int(result.attempts))
            group = getattr(result, "group", None)  # CommitResult.group; read defensively (results of older releases)
            if isinstance(group, int) and not isinstance(group, bool) and group >= 1:
                families.group.labels(*labels).observe(group)
        if staging is not None:
            families.staged.add(catalog, stream, branch, staging, table=f"{catalog}/{stream}" if table is None else table)
    except ConfigError as exc:  # lakestream's metrics cannot be registered: said once, not at every commit
        _warn_once(exc)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.debug("recording commit metrics failed: %s", exc)


def observe_failed_commit(*, stream: str, branch: str, catalog: str = "") -> None:
    """Count one ``Producer.commit`` that raised (``outcome="failed"``). Never raises."""
    try:
        families = _families_now()
        if families is not None:
            families.commits.labels(catalog, stream, branch, "failed").inc()
    except ConfigError as exc:
        _warn_once(exc)
    except Exception as exc:  # noqa: BLE001 - metrics must not change the error a commit raises
        log.debug("recording commit metrics failed: %s", exc)


class ConsumerMetrics:
    """One consumer rank's metric children (see the module docstring); made by :func:`consumer_metrics`.

    ``gauges=False``: the counters alone (a process that fetches data for a rank whose position another process
    records: a DataLoader worker), which shows no gauge of its own for the rank."""

    def __init__(self, families: _Families, *, stream: str, group: str, rank: int, gauges: bool = True,
                 catalog: str = "") -> None:
        labels = (catalog, stream, group, str(rank))
        self._families, self._labels = families, labels
        self._steps = families.steps.labels(*labels)
        self._wait = families.wait.labels(*labels)
        self._read = families.read.labels(*labels)
        self._last = self._behind = None
        self._released = not gauges
        if gauges:
            with _lock:
                key = (id(families.registry), labels)
                _reporting[key] = _reporting.get(key, 0) + 1
                _finished.pop(key, None)  # reporting again: not a finished rank
            self._last = families.last_step.labels(*labels)
            self._behind = families.behind.labels(*labels)

    def delivered(self, *, step: int, wait_s: float) -> None:
        if self._last is not None:
            self._last.set(step)
        self._steps.inc()
        if wait_s > 0:
            self._wait.inc(wait_s)

    def starts_after(self, step: int) -> None:
        """Before its first step a rank stands at the step before its first (0: none)."""
        if self._last is not None:
            self._last.set(step)

    def read(self, nbytes: int) -> None:
        if nbytes > 0:
            self._read.inc(nbytes)

    def behind(self, steps: int) -> None:
        if self._behind is not None:
            self._behind.set(max(0, steps))

    def release(self) -> None:
        """The rank stopped reporting here (its iteration ended or was closed): its steps-behind gauge is removed once
        no other reporter of this process has the same labels, since nothing refreshes it any more while the head moves
        on (a frozen lag is a false one). The last step and the counters stay: facts of what the rank did, until
        :data:`FINISHED_RANKS_KEPT` ranks of this process finished after it. Idempotent; a later update of this
        object's gauges goes nowhere."""
        with _lock:
            if self._released:
                return
            self._released = True
            key = (id(self._families.registry), self._labels)
            left = _reporting.get(key, 1) - 1
            if left > 0:
                _reporting[key] = left
                return
            _reporting.pop(key, None)
            _remove(self._families.behind, self._labels)
            _finished[key] = self._families
            while len(_finished) > FINISHED_RANKS_KEPT:  # the oldest finished rank's series go
                (_, old), families = _finished.popitem(last=False)
                for family in (families.last_step, families.steps, families.wait, families.read):
                    _remove(family, old)


def _remove(family: Any, labels: tuple[str, ...]) -> None:
    try:
        family.remove(*labels)
    except KeyError:  # never set, or removed already
        pass


_warned: set[str] = set()


def _warn_once(exc: Exception) -> None:
    """Say once per distinct failure that lakestream's metrics are not recorded (producers and ranks go on)."""
    if str(exc) not in _warned:
        _warned.add(str(exc))
        log.warning("lakestream's metrics are not recorded: %s", exc)


_reporting: dict[tuple[int, tuple[str, ...]], int] = {}  # (id(registry), labels) -> unreleased ConsumerMetrics
# (id(registry), labels) of ranks whose last reporter released, oldest first -> their families
_finished: collections.OrderedDict[tuple[int, tuple[str, ...]], _Families] = collections.OrderedDict()


def consumer_metrics(*, stream: str, group: str, rank: int, gauges: bool = True,
                     catalog: str = "") -> ConsumerMetrics | None:
    """The metrics of one consumer rank, or None without the extra, or where lakestream's metrics cannot be registered
    (logged; metrics never stop training) (``gauges``: see :class:`ConsumerMetrics`; ``catalog``: the catalog's
    name)."""
    try:
        families = _families_now()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        _warn_once(exc)
        return None
    return None if families is None else ConsumerMetrics(families, stream=stream, group=group, rank=rank,
                                                         gauges=gauges, catalog=catalog)
