from __future__ import annotations
import signal, threading
from pathlib import Path
from tests.read.test_relay import start_holder, watch, commit, relay_dir  # noqa: F401
from tests.read.test_dataset import make_stream
from tests.support import until
from lakestream_iceberg.read.relay_client import RelayWatcher


def test_kill_while_waiting(tmp_path: Path, relay_dir: Path) -> None:
    stream = make_stream(tmp_path, steps=2)
    holder = start_holder(tmp_path)
    try:
        clients = [watch(stream) for _ in range(3)]
        assert all(isinstance(c, RelayWatcher) and not c.holding for c in clients)
        results: dict[int, object] = {}
        stop = threading.Event()
        def run(i: int) -> None:
            try:
                results[i] = clients[i].wait(3, timeout=60, stop=stop)
            except Exception as exc:
                results[i] = exc
        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        before = [c.requests for c in clients]
        for t in threads: t.start()
        until(lambda: all(c.requests > b for c, b in zip(clients, before)), "clients waiting")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        commit(stream, 3)
        for t in threads: t.join(60)
        print(results)
        assert all(results[i][0] == 3 for i in range(3))
        assert sum(c.holding for c in clients) == 1
        for c in clients: c.close()
    finally:
        holder.kill(); holder.wait(timeout=60)
    assert not list(relay_dir.iterdir())
