"""Worker processes for the matrix and fault tests, on any catalog the parent passes in ``LAKESTREAM_TEST_CATALOG``.

    python -m tests.workers_matrix commit IDENT PRODUCER COUNT      # publish seqs next_seq..COUNT-1, one JSON line each
    python -m tests.workers_matrix stage-and-die IDENT PRODUCER SEQ  # write the batch's data files, then os._exit(1)
    python -m tests.workers_matrix consume IDENT LAST_STEP           # Stream.wait_for + read of steps 1..LAST_STEP
    python -m tests.workers_matrix follow IDENT LAST_STEP            # the same through follow.HeadWatcher (as the dataset)

``LAKESTREAM_TEST_PAUSE_S`` (float) sleeps between commits / reads so that a run spans a fault injected by the parent;
``LAKESTREAM_TEST_READY_FILE`` (a path) is created once the stream is open, so the parent can inject it after start-up.
``LAKESTREAM_TEST_GATE=SEQ:PATH[,SEQ:PATH...]`` (commit): before committing seq ``SEQ`` the worker creates
``PATH.PRODUCER`` and waits until ``PATH`` exists, so the parent can break a service while every producer still has
commits to make.
Each output line is JSON; the parent checks it against ``tests.support.batch``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from lakestream_iceberg import Stream
from tests.backends import catalog_from_env
from tests.support import batch, digest


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def opened(ident: str) -> Stream:
    stream = Stream.open(catalog_from_env(), ident)
    if ready := os.environ.get("LAKESTREAM_TEST_READY_FILE"):
        Path(ready).touch()
    return stream


def commit(ident: str, producer_id: str, count: int, pause: float) -> None:
    stream = opened(ident)
    producer = stream.producer(producer_id)
    gates = dict((int(at), path) for at, _, path in (g.partition(":") for g in os.environ.get("LAKESTREAM_TEST_GATE", "").split(",") if g))
    while (seq := producer.next_seq) < count:
        if (gate := gates.get(seq)) is not None:
            Path(f"{gate}.{producer_id}").touch()
            deadline = time.monotonic() + 600
            while not Path(gate).exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"{producer_id}: the parent never opened the gate {gate}")
                time.sleep(0.01)
        result = producer.commit(batch(producer_id, seq, stream.world_size), seq=seq)
        emit(seq=result.seq, step=result.step, attempts=result.attempts, dup=result.duplicate)
        time.sleep(pause)


def stage_and_die(ident: str, producer_id: str, seq: int) -> None:
    stream = opened(ident)
    staged = stream.writer.write(producer=producer_id, seq=seq, shards=batch(producer_id, seq, stream.world_size))
    emit(paths=[f.path for f in staged.files])
    sys.stdout.flush()
    os._exit(1)  # dies between writing the data files and committing them: no cleanup, no commit


def consume(ident: str, last_step: int, pause: float) -> None:
    stream = opened(ident)
    for step in range(1, last_step + 1):
        stream.wait_for(step, timeout=120)
        emit(
            step=step,
            digests=[digest(stream.read(step, rank=r)) for r in range(stream.world_size)],
            path=stream.locate(step)[0].file_path,
        )
        time.sleep(pause)


def follow(ident: str, last_step: int, pause: float) -> None:
    from lakestream_iceberg.read.follow import HeadWatcher

    stream = opened(ident)
    watcher, stop = HeadWatcher(stream, branch="main"), threading.Event()
    for step in range(1, last_step + 1):
        watcher.wait(step, timeout=120, stop=stop)
        emit(
            step=step,
            digests=[digest(stream.read(step, rank=r)) for r in range(stream.world_size)],
            path=stream.locate(step)[0].file_path,
        )
        time.sleep(pause)


def main() -> None:
    mode, ident = sys.argv[1], sys.argv[2]
    pause = float(os.environ.get("LAKESTREAM_TEST_PAUSE_S", "0"))
    if mode == "commit":
        commit(ident, sys.argv[3], int(sys.argv[4]), pause)
    elif mode == "stage-and-die":
        stage_and_die(ident, sys.argv[3], int(sys.argv[4]))
    elif mode == "consume":
        consume(ident, int(sys.argv[3]), pause)
    elif mode == "follow":
        follow(ident, int(sys.argv[3]), pause)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
