"""Producer processes that stage a batch for group commit and then hold it (until the parent kills them).

    python -m tests.workers_group hold IDENT PRODUCER SEQ BRANCH

The producer commits ``batch(PRODUCER, SEQ)`` on ``BRANCH`` as a contended producer would: it stages its batch and
holds, and nothing but another producer's commit ends its hold (no idle rule, no queue rule). The parent watches the
staged intent appear and SIGKILLs the process: a producer dead after staging, before its batch was carried. When the
hold ends anyway (another producer carried the batch), one JSON line reports the result.
"""

from __future__ import annotations

import json
import sys

from lakestream_iceberg import Stream
from lakestream_iceberg.write.dac import CommitPolicy
from tests.backends import catalog_from_env
from tests.support import batch


def hold(ident: str, producer_id: str, seq: int, branch: str) -> None:
    stream = Stream.open(catalog_from_env(), ident)
    producer = stream.producer(producer_id, branch=branch)
    producer._contended = lambda: True  # type: ignore[method-assign]  # noqa: SLF001 - it stages its batch
    producer._loop.policy.hold_delay = lambda **_kw: 3600.0  # type: ignore[method-assign]  # noqa: SLF001
    CommitPolicy.idle_after_s = 3600.0  # type: ignore[misc]  # no "the head stays put": only a carry ends the hold
    CommitPolicy.leads_queue = False  # type: ignore[misc]  # nor "it leads the queue"
    result = producer.commit(batch(producer_id, seq, stream.world_size), seq=seq)
    print(json.dumps({"seq": result.seq, "step": result.step, "dup": result.duplicate, "carried": result.carried}),
          flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "hold":
        hold(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
