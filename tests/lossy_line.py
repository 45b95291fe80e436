"""A TCP line that loses one exchange on command: a catalog whose reply (or request) is lost on the wire.

    with LossyLine(target_port=pg.port) as line:
        props["uri"] = f"postgresql+psycopg2://{pg.user}@127.0.0.1:{line.port}/{db}"
        line.arm(POINTER_UPDATE, lose="reply")     # the next pointer UPDATE reaches PostgreSQL and runs; its answer
        producer.commit(...)                       # is dropped with the connection before it reaches the client
        assert line.fired.is_set()

Every connection is forwarded byte for byte both ways until a client->server chunk matches the armed pattern:

* ``lose="reply"``: the chunk (and whatever follows it from the client) is forwarded; the server's answer is read up to
  ``reply_end`` (PostgreSQL: ReadyForQuery, sent after the statement's transaction committed; HTTP: the first bytes of
  the response, sent after the handler ran), thrown away, and both ends of the connection are closed: the request was
  applied, the client never hears so (a connection reset after COMMIT, a REST call whose answer never came).
* ``lose="request"``: the chunk is never forwarded and both ends are closed: the server never saw the request.
* ``lose="silence"``: as ``reply``, but the connection stays open and nothing more reaches the client: it times out
  (a REST call that timed out after the server applied it).

One arming fires once (``times``); ``fired`` is set when it did, after the connection was closed. Runs on its own
thread with an asyncio loop (tests/loop_server.py); ``close`` stops it.
"""

from __future__ import annotations

import asyncio
import re
import threading

from tests.loop_server import LoopServer

__all__ = ["COMMIT_QUERY", "HTTP_ANSWER", "POINTER_UPDATE", "PG_READY", "REST_COMMIT", "LossyLine"]

# PostgreSQL (simple Query protocol, as psycopg2 sends every statement): lakestream's conditional pointer swap
POINTER_UPDATE = re.compile(rb"UPDATE iceberg_tables SET metadata_location")
COMMIT_QUERY = re.compile(rb"Q\x00\x00\x00\x0bCOMMIT\x00")  # a transaction's COMMIT (SQLAlchemy's, through psycopg2)
PG_READY = re.compile(rb"Z\x00\x00\x00\x05[ITE]")  # ReadyForQuery: the statement (and its transaction) is finished
# Iceberg REST: a table commit (POST /v1/{prefix}/namespaces/{ns}/tables/{table}); a create POSTs to .../tables
REST_COMMIT = re.compile(rb"POST /v1/(?:[^ ]*/)?namespaces/[^/ ]+/tables/[^/ ?]+ HTTP/1\.1\r\n")
HTTP_ANSWER = re.compile(rb"HTTP/1\.[01] \d{3}")


class LossyLine(LoopServer):
    """Listen on a free 127.0.0.1 port and forward every connection to ``target_port``; lose an exchange when armed."""

    def __init__(self, *, target_port: int, target_host: str = "127.0.0.1") -> None:
        super().__init__(target_port=target_port, target_host=target_host, name="lossy line")
        self.fired = threading.Event()
        self.connections = 0  # connections accepted (a client that bypasses the line shows none)
        self.swallowed = b""  # the last answer thrown away (lose="reply")
        self._armed: tuple[re.Pattern[bytes], str, re.Pattern[bytes]] | None = None
        self._times = 0
        self._skip = 0
        self._lock = threading.Lock()

    def arm(self, pattern: re.Pattern[bytes], *, lose: str, reply_end: re.Pattern[bytes] | None = None,
            times: int = 1, skip: int = 0) -> None:
        """Lose the exchange of the next ``times`` client chunks matching ``pattern`` (see the module docstring),
        after letting ``skip`` matching ones through."""
        if lose not in ("reply", "request", "silence"):
            raise ValueError(f"lose must be 'reply', 'request' or 'silence', not {lose!r}")
        end = reply_end or (HTTP_ANSWER if pattern is REST_COMMIT else PG_READY)
        with self._lock:
            self._armed, self._times, self._skip = (pattern, lose, end), times, skip
            self.fired.clear()

    def disarm(self) -> None:
        with self._lock:
            self._armed, self._times = None, 0

    @property
    def armed(self) -> bool:
        return self._times > 0

    def _take(self, chunk: bytes) -> tuple[str, re.Pattern[bytes]] | None:
        with self._lock:
            if self._armed is None or self._times <= 0 or not self._armed[0].search(chunk):
                return None
            if self._skip > 0:
                self._skip -= 1
                return None
            self._times -= 1
            _, lose, end = self._armed
            if self._times == 0:
                self._armed = None
            return lose, end

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        doomed: asyncio.Future[tuple[str, re.Pattern[bytes]]] = asyncio.get_running_loop().create_future()
        tail = b""  # the end of the previous chunk: a pattern split across two reads still matches
        cut = False  # this connection lost an exchange: reset, not closed

        async def send() -> None:  # client -> server
            nonlocal tail, cut
            while chunk := await client_r.read(1 << 16):
                taken = self._take(tail + chunk)
                tail = chunk[-256:]
                if taken is not None:
                    lose, end = taken
                    if lose == "request":
                        cut = True
                        return  # never forwarded: the finally below closes both ends
                    if not doomed.done():
                        doomed.set_result((lose, end))
                server_w.write(chunk)
                await server_w.drain()
            if server_w.can_write_eof():
                server_w.write_eof()
            await asyncio.Event().wait()  # half-closed: the answer may still come

        async def answer() -> None:  # server -> client
            nonlocal cut
            swallowed = b""
            while chunk := await server_r.read(1 << 16):
                if doomed.done():
                    swallowed += chunk
                    lose, end = doomed.result()
                    if end.search(swallowed):
                        self.swallowed = swallowed
                        if lose == "silence":  # the connection stays open and says nothing: the client times out
                            self.fired.set()
                            continue
                        cut = True
                        return  # the request ran: its answer is lost with the connection
                    continue
                client_w.write(chunk)
                await client_w.drain()

        tasks = [asyncio.ensure_future(t) for t in (send(), answer())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the line closes with the connection open: ended quietly
            for task in tasks:
                task.cancel()
        finally:  # no await here: a coroutine closed with its loop must not wait in its cleanup
            for writer in (client_w, server_w):
                if cut:
                    writer.transport.abort()  # a reset, not an orderly close: as a dropped line
                else:
                    writer.close()
            if cut:
                self.fired.set()
