"""Follow mode at scale and over time: many ranks, repeated iterations, leaks (threads, descriptors, connections)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import ReadTimeoutError
from tests.backends import fresh_name, postgres_service
from tests.read.test_dataset import SCHEMA, shard
from tests.read.test_relay import relay_dir  # autouse: a relay directory of its own

pytest.importorskip("torch")  # the dataset's tests need the torch extra (the core's run without it)
from lakestream_iceberg.read.dataset import LakestreamDataset  # noqa: E402

__all__ = ["postgres_service", "relay_dir"]


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.services
@pytest.mark.parametrize("relay", [False, True])
def test_follow_iterations_that_time_out_on_postgresql_leak_nothing(tmp_path: Path, postgres_service: object,
                                                                    relay: bool) -> None:
    import psycopg2
    from pyiceberg.catalog.sql import SqlCatalog

    database = fresh_name("db")
    uri = postgres_service.create_database(database)  # type: ignore[attr-defined]
    catalog = SqlCatalog("pg", uri=uri, warehouse=f"file://{tmp_path}/warehouse")
    catalog.create_namespace("ns")
    stream = Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2)
    stream.producer("p").commit([shard(1, r) for r in range(2)])
    probe = psycopg2.connect(uri.replace("postgresql+psycopg2", "postgresql"))
    probe.autocommit = True

    def backends() -> int:
        with probe.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                        (database,))
            return int(cur.fetchone()[0])

    def once() -> None:
        ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, timeout=0.3, relay=relay)
        with pytest.raises(ReadTimeoutError):
            for _ in ds:
                pass

    try:
        for _ in range(3):
            once()
        base = (descriptors(), threading.active_count(), backends())
        for _ in range(15):
            once()
        after = (descriptors(), threading.active_count(), backends())
        print(base, after)
        assert after[0] <= base[0] + 2 and after[1] <= base[1] and after[2] <= base[2] + 1
    finally:
        probe.close()
        catalog.engine.dispose()


def test_many_ranks_following_through_one_relay_get_each_sample_once_in_order(tmp_path: Path) -> None:
    """64 ranks (threads of one process: one holder, the others its clients) follow while two producers commit: every
    rank gets every step once, in order, and together they get every sample of every step once."""
    from tests.read.test_dataset import make_catalog

    ranks, steps, world = 64, 12, 4
    rows = 2 * ranks // world + 1

    def rows_of(step: int, rank: int) -> pa.Table:
        xs = [step * 10_000 + rank * 1_000 + i for i in range(rows)]
        return pa.table({"x": xs, "tokens": [[1]] * rows, "blob": [b"a"] * rows, "f": [0.0] * rows}, schema=SCHEMA)

    Stream.create(make_catalog(tmp_path), "ns.s", schema=SCHEMA, world_size=world)
    got: dict[int, list[tuple[int, list[int]]]] = {}
    errors: list[BaseException] = []

    def read(rank: int) -> None:
        try:
            stream = Stream.open(make_catalog(tmp_path), "ns.s")
            ds = LakestreamDataset(stream, rank=rank, world_size=ranks, follow=True, end_step=steps, timeout=120)
            got[rank] = [(item["step"], item["sample_ids"].tolist()) for item in ds]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def produce(name: str) -> None:
        producer = Stream.open(make_catalog(tmp_path), "ns.s").producer(name)
        for _ in range(steps // 2):
            producer.commit([rows_of(0, r) for r in range(world)])

    readers = [threading.Thread(target=read, args=(rank,)) for rank in range(ranks)]
    producers = [threading.Thread(target=produce, args=(f"p{i}",)) for i in range(2)]
    for thread in readers + producers:
        thread.start()
    for thread in readers + producers:
        thread.join(timeout=300)
    assert not errors
    assert all([step for step, _ in got[rank]] == list(range(1, steps + 1)) for rank in range(ranks))
    ids = [i for rank in range(ranks) for _, item in got[rank] for i in item]
    assert len(ids) == len(set(ids)) == steps * rows * world
