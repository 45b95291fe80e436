"""Shared test data: deterministic global batches whose content names their producer, seq and rank."""

from __future__ import annotations

import hashlib
import random

import pyarrow as pa
from pyiceberg.catalog.sql import SqlCatalog

SCHEMA = pa.schema(
    [
        ("producer", pa.string()),
        ("seq", pa.int64()),
        ("rank", pa.int32()),
        ("i", pa.int32()),
        ("tokens", pa.list_(pa.int32())),
        ("image", pa.binary()),
    ]
)


def sqlite_catalog(root: str, name: str = "test") -> SqlCatalog:
    return SqlCatalog(name, uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}/warehouse")


def shard(producer: str, seq: int, rank: int, rows: int | None = None) -> pa.Table:
    rng = random.Random(f"{producer}/{seq}/{rank}")
    n = rng.randint(0, 5) if rows is None else rows
    return pa.table(
        {
            "producer": [producer] * n,
            "seq": [seq] * n,
            "rank": [rank] * n,
            "i": list(range(n)),
            "tokens": [[rng.randint(0, 50_000) for _ in range(rng.randint(0, 40))] for _ in range(n)],
            "image": [rng.randbytes(rng.randint(0, 2_000)) for _ in range(n)],
        },
        schema=SCHEMA,
    )


def batch(producer: str, seq: int, world_size: int) -> list[pa.Table]:
    return [shard(producer, seq, r) for r in range(world_size)]


def digest(table: pa.Table) -> str:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()
