"""A TCP line with a fixed one-way delay, to stand an object store on this host in for one across a network.

    with DelayedLine(target_port=weed_s3_port, delay_s=0.010) as line:
        props["s3.endpoint"] = f"http://127.0.0.1:{line.port}"

Every byte a client sends reaches the server ``delay_s`` after it arrived, in order (a chunk is held until its own
arrival time plus the delay, not queued behind the previous chunk's delay): a request and its answer take one delay
more than they would (a round trip of ``delay_s`` plus the server's own time), like a store ``delay_s`` away. Answers
go back at once. Runs on its own thread with an asyncio loop; ``close`` (or leaving the ``with``) stops it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

__all__ = ["DelayedLine"]


class DelayedLine:
    """Listen on a free 127.0.0.1 port and forward every connection to ``target_port``, delaying what clients send."""

    def __init__(self, *, target_port: int, delay_s: float, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._run, name="delayed-line", daemon=True)

    def __enter__(self) -> DelayedLine:
        self._thread.start()
        if not self._ready.wait(30) or not self.port:
            raise RuntimeError("the delayed line did not start listening")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:  # the connections still open end with the line: their tasks are cancelled and awaited
            self._server.close()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def receive() -> None:  # client -> the queue, each chunk stamped with when it arrived
            while chunk := await client_r.read(1 << 16):
                held.put_nowait((time.monotonic(), chunk))
            held.put_nowait((time.monotonic(), b""))

        async def deliver() -> None:  # the queue -> server, each chunk at its arrival time plus the delay
            while True:
                arrived, chunk = await held.get()
                wait = arrived + self.delay_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    server_w.write_eof() if server_w.can_write_eof() else None
                    return
                server_w.write(chunk)
                await server_w.drain()

        async def answer() -> None:  # server -> client, at once
            while chunk := await server_r.read(1 << 16):
                client_w.write(chunk)
                await client_w.drain()

        tasks = [asyncio.ensure_future(t) for t in (receive(), deliver(), answer())]
        try:  # all three end at the two ends' EOFs; a connection reset on either side ends the others
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            pass  # the line closes: this connection ends with it (raised on, asyncio would log it as an error)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in (client_w, server_w):
                writer.close()
