"""Producer processes for the multi-process tests: ``python -m tests.workers ROOT STREAM PRODUCER COUNT [submit]``.

Prints one JSON line per committed batch, flushed as soon as ``commit`` returned: a parent reading the lines sees the
worker's progress as it happens (``elapsed_s``: seconds this batch took, from building it to its commit returning).

With ``submit``, batches go through ``Producer.submit`` (two in flight) and a line is printed when each one's future
completes (``elapsed_s``: from its submit to its publication).

With ``LAKESTREAM_TEST_PRODUCER_CONSTANTS=ACTIVE_MIN_STEPS,COMPACT_AT,MAX_FILES`` set, the worker compacts producer
state with those constants instead of the defaults (the parent test shrank them the same way).
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import Future

from lakestream_iceberg import CommitResult, Producer, Stream
from lakestream_iceberg.format import producers
from tests.support import batch, sqlite_catalog

SMALL_CONSTANTS_ENV = "LAKESTREAM_TEST_PRODUCER_CONSTANTS"


def main() -> None:
    root, name, producer_id, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if constants := os.environ.get(SMALL_CONSTANTS_ENV):
        producers.ACTIVE_MIN_STEPS, producers.COMPACT_AT, producers.MAX_FILES = map(int, constants.split(","))
    stream = Stream.open(sqlite_catalog(root), name)
    producer = stream.producer(producer_id)
    if sys.argv[5:] == ["submit"]:
        submit(producer, count, stream.world_size)
        return
    while (seq := producer.next_seq) < count:
        started = time.monotonic()
        result = producer.commit(batch(producer_id, seq, stream.world_size), seq=seq)
        print(json.dumps({"seq": result.seq, "step": result.step, "attempts": result.attempts, "dup": result.duplicate,
                          "carried": result.carried, "elapsed_s": time.monotonic() - started}), flush=True)


def submit(producer: Producer, count: int, world_size: int) -> None:
    def report(future: Future[CommitResult], started: float) -> None:
        result = future.result()
        print(json.dumps({"seq": result.seq, "step": result.step, "attempts": result.attempts, "dup": result.duplicate,
                          "carried": result.carried, "elapsed_s": time.monotonic() - started}), flush=True)

    with producer:
        for seq in range(producer.next_seq, count):
            started = time.monotonic()
            future = producer.submit(batch(producer.producer_id, seq, world_size), seq=seq)
            future.add_done_callback(lambda f, started=started: report(f, started))


if __name__ == "__main__":
    main()
