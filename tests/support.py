"""Shared test data: deterministic global batches whose content names their producer, seq and rank."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import random
import re
import shutil
import subprocess
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

# LakestreamDataset (and TensorCollate) need the torch extra; the core's tests run without it (Python 3.10 has no torch)
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs torch (pip install 'lakestream-iceberg[torch]')")

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


def until(predicate: Callable[[], object], what: str, deadline_s: float = 60.0) -> object:
    """Wait for ``predicate()`` to return something truthy (observed progress, polled every 20 ms) and return it; fail
    the test with ``what`` after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def foreign_delete(stream: Any) -> None:
    """Another engine deletes rows of step 3 (pyiceberg's ``Table.delete``: an overwrite snapshot)."""
    stream.refresh().table.delete("_step == 3")


def foreign_append(stream: Any) -> None:
    """Another engine appends rows into step 3 with plain pyiceberg."""
    table = stream.refresh().table
    rows = batch("x", 0, 1)[0]
    rows = rows.append_column("_step", pa.array([3] * rows.num_rows, pa.int64()))
    rows = rows.append_column("_rank", pa.array([0] * rows.num_rows, pa.int32()))
    table.append(rows.select([f.name for f in table.schema().as_arrow()]).cast(table.schema().as_arrow()))


def lakestream_keys(snapshot: Any) -> dict[str, str]:
    """A lakestream snapshot's ``lakestream.*`` summary keys, to append a snapshot with pyiceberg that lakestream takes
    for its own, as one written by a lakestream that did not record ``lakestream.snapshot-id`` yet (a copy that names
    another snapshot's id is another engine's: tests/test_interop.py): how tests put rows lakestream never writes
    into a stream's lineage."""
    return {k: v for k, v in snapshot.summary.additional_properties.items()
            if k.startswith("lakestream.") and k != "lakestream.snapshot-id"}


def counting_str(compared: list[str]) -> type[str]:
    """A ``str`` subclass whose ``==`` appends the string to ``compared``: a test counts the comparisons a loop over
    names makes (a scan per name, where one pass would do)."""

    class Counted(str):
        __hash__ = str.__hash__

        def __eq__(self, other: object) -> bool:
            compared.append(str(self))
            return str.__eq__(self, other)

    return Counted


@contextlib.contextmanager
def immutable(path: str) -> Iterator[None]:
    """``path`` made immutable (``chattr +i``): not even root deletes it, or a file in it when it is a folder. Always
    made mutable again. Skips the test where the file system cannot."""
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", path], capture_output=True).returncode != 0:
        pytest.skip("this file system cannot make a file immutable (chattr +i)")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", path], check=True)


@contextlib.contextmanager
def raised_by_loader(expected: type[BaseException] | tuple[type[BaseException], ...], match: str) -> Iterator[types.SimpleNamespace]:
    """``pytest.raises`` for a DataLoader with workers that raises. The exception's traceback holds the loader's
    iterator in a reference cycle (torch's ``ExceptionWrapper.reraise`` frame holds the exception), so only a garbage
    collection stops it, after the queues to its workers were closed: torch then waits 5 s per worker. Dropping the
    traceback frees the iterator at once, and torch ends its workers without the wait."""
    raised = types.SimpleNamespace(value=None)  # the exception, for the test to check further
    try:
        yield raised
    except expected as exc:
        if not re.search(match, str(exc)):
            raise AssertionError(f"{type(exc).__name__} does not match {match!r}: {exc}") from exc
        exc.__traceback__ = None
        raised.value = exc
    else:
        pytest.fail(f"DID NOT RAISE {expected}")


SQLITE_MUTEX_STATIC_MEM = 3  # sqlite3.h: the mutex of sqlite3_malloc's statistics, taken by every SQLite allocation


def hold_sqlite_mutex(mutex_id: int, seconds: float) -> tuple[threading.Thread, threading.Event]:
    """A thread that holds one of libsqlite3's static mutexes (the libsqlite3 the ``sqlite3`` module uses) for
    ``seconds`` or until the event is set, as a thread inside libsqlite3 (with the GIL released) does; returns once it
    holds it."""
    import _sqlite3
    import ctypes

    lib = ctypes.CDLL(_sqlite3.__file__)  # its symbols resolve to the libsqlite3 the extension links
    lib.sqlite3_mutex_alloc.restype = ctypes.c_void_p
    lib.sqlite3_mutex_enter.argtypes = lib.sqlite3_mutex_leave.argtypes = [ctypes.c_void_p]
    mutex = lib.sqlite3_mutex_alloc(mutex_id)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        lib.sqlite3_mutex_enter(mutex)
        held.set()
        release.wait(seconds)
        lib.sqlite3_mutex_leave(mutex)

    thread = threading.Thread(target=hold, name="holds-sqlite-mutex", daemon=True)
    thread.start()
    assert held.wait(60)
    return thread, release
