"""A writer process that SIGKILLs itself at a chosen point, on any catalog the parent passes in
``LAKESTREAM_TEST_CATALOG`` (tests/backends.py).

    python -m tests.workers_crash produce IDENT PRODUCER COUNT [submit] [staged]  # seqs next_seq..COUNT-1, a JSON line
                                                                            # each; staged: as a contended producer
    python -m tests.workers_crash gc IDENT KEEP_LAST                       # a real GC, grace 0
    python -m tests.workers_crash checkpoint IDENT NAME STEP
    python -m tests.workers_crash release IDENT NAME
    python -m tests.workers_crash fork IDENT NAME BRANCH
    python -m tests.workers_crash repair IDENT

``LAKESTREAM_TEST_CRASH_AT=MODULE:ATTR:N:WHEN`` (``WHEN``: ``before`` or ``after``) replaces ``ATTR`` (a function, or
``Class.method``) of ``MODULE`` in this process only by a wrapper that, on its ``N``-th call (from 1), sends this process
SIGKILL before calling it or after it returned: a real kill at a real point. Nothing else is changed; the parent sees
the point was reached by the exit status (-SIGKILL), which nothing else in the worker sends.
``LAKESTREAM_TEST_PRODUCER_CONSTANTS`` shrinks the producer-state compaction constants as in tests/workers.py.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import signal
import sys
from datetime import timedelta

from lakestream_iceberg import Stream
from lakestream_iceberg.format import producers
from tests.backends import catalog_from_env
from tests.support import batch
from tests.workers import SMALL_CONSTANTS_ENV

CRASH_ENV = "LAKESTREAM_TEST_CRASH_AT"


def install(spec: str) -> None:
    module_name, attr, nth, when = spec.split(":")
    module = importlib.import_module(module_name)
    owner: object = module
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = [0]

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        hit = calls[0] == int(nth)
        if hit and when == "before":
            die()
        result = original(*args, **kwargs)
        if hit and when == "after":
            die()
        return result

    setattr(owner, name, wrapper)


def produce(stream: Stream, producer_id: str, count: int, mode: list[str]) -> None:
    producer = stream.producer(producer_id)
    if "staged" in mode:  # as a contended producer: each batch is staged (an intent) before its commit
        producer._contended = lambda: True  # type: ignore[method-assign]  # noqa: SLF001
        mode = [m for m in mode if m != "staged"]
    if mode == ["submit"]:
        with producer:
            for seq in range(producer.next_seq, count):
                future = producer.submit(batch(producer_id, seq, stream.world_size), seq=seq)
                future.add_done_callback(lambda f: print(json.dumps({"seq": f.result().seq, "step": f.result().step}),
                                                         flush=True))
        return
    while (seq := producer.next_seq) < count:
        result = producer.commit(batch(producer_id, seq, stream.world_size), seq=seq)
        print(json.dumps({"seq": result.seq, "step": result.step, "dup": result.duplicate}), flush=True)


def main() -> None:
    op, ident, *args = sys.argv[1:]
    if constants := os.environ.get(SMALL_CONSTANTS_ENV):  # as the parent shrank them (tests/workers.py)
        producers.ACTIVE_MIN_STEPS, producers.COMPACT_AT, producers.MAX_FILES = map(int, constants.split(","))
    if spec := os.environ.get(CRASH_ENV):
        install(spec)
    stream = Stream.open(catalog_from_env(), ident)
    if op == "produce":
        produce(stream, args[0], int(args[1]), args[2:])
    elif op == "gc":
        report = stream.collect_garbage(dry_run=False, keep_last=int(args[0]), grace=timedelta(0),
                                        allow_short_grace=True)
        print(json.dumps({"collected_below": report.collected_below, "files": report.total_files}), flush=True)
    elif op == "checkpoint":
        print(json.dumps({"step": stream.checkpoint(args[0], step=int(args[1])).step}), flush=True)
    elif op == "release":
        stream.release(args[0])
    elif op == "fork":
        print(json.dumps({"step": stream.fork(args[0], branch=args[1]).step}), flush=True)
    elif op == "repair":
        print(json.dumps({"repaired": repr(stream.repair())}), flush=True)
    else:
        raise SystemExit(f"unknown op {op!r}")


if __name__ == "__main__":
    main()
