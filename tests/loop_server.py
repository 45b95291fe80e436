"""A TCP server on a free 127.0.0.1 port, served by an asyncio loop on a thread of its own: the base of the test lines
that stand between a client and a real service (tests/faulty_s3.py, tests/lossy_line.py).

    class Line(LoopServer):
        async def _serve(self, reader, writer): ...    # one client connection; forward to self.target

    with Line(target_port=port, name="line") as line:  # listening once entered
        props["s3.endpoint"] = f"http://127.0.0.1:{line.port}"

``close`` (or leaving the ``with``) stops listening and cancels every connection still open, then stops the loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

__all__ = ["LoopServer"]


class LoopServer:
    """Listen on a free 127.0.0.1 port; each connection runs :meth:`_serve` on the server's own loop and thread."""

    def __init__(self, *, target_port: int, target_host: str = "127.0.0.1", name: str = "loop-server",
                 limit: int = 1 << 16) -> None:
        self.target = (target_host, target_port)
        self.name = name
        self.port = 0
        self._limit = limit  # the StreamReader buffer of each connection (a line reads whole HTTP heads)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Any:
        self._thread.start()
        if not self._ready.wait(30) or not self.port:
            raise RuntimeError(f"the {self.name} did not start listening")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        """Stop listening, then end every connection still open (each one's own cleanup runs)."""
        if self._server is not None:
            self._server.close()
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, limit=self._limit))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
            self._loop.run_until_complete(self._shutdown())  # a connection accepted while close() was stopping it
        finally:
            self._loop.close()
