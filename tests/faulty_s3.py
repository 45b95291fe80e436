"""A fault-injecting HTTP/1.1 proxy in front of a real S3 server (SeaweedFS or moto), for tests.

    with FaultyS3(target_port=moto.ports["s3"]) as proxy:
        props["s3.endpoint"] = proxy.endpoint
        proxy.add(Fault("PUT", r"/data/.*\\.parquet$", "slowdown", every=3))

Each client connection is read request by request (request line, headers, a ``Content-Length`` or chunked body); every
request is sent to the server on a connection of its own and the server's whole answer is relayed back, unless a
:class:`Fault` matches it (by method and a regular expression searched in the request target, every ``every``-th match,
at most ``times`` times):

* ``slowdown`` / ``internal`` / ``unavailable``: the proxy answers itself, with the status and S3 XML error body real S3
  sends (``503 Slow Down`` + ``<Code>SlowDown</Code>``, ``500 Internal Server Error`` + ``InternalError``,
  ``503 Service Unavailable`` + ``ServiceUnavailable``); the request never reaches the server;
* ``rest-forbidden`` / ``rest-unauthorized``: the proxy answers as an Iceberg REST catalog refusing the request (403,
  401, with the REST spec's JSON error body), for the proxy in front of a REST catalog;
* ``reset``: the connection is cut before the request is forwarded (it never landed);
* ``lost``: the request is forwarded and answered by the server (it landed), then the connection is cut without the
  answer (the client cannot tell whether it landed).

``log`` records ``(method, target, action)`` for every request (``"ok"`` when forwarded normally). Runs on its own
thread with an asyncio loop; ``close`` (or leaving the ``with``) stops it.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import threading
import uuid
from dataclasses import dataclass, field

from tests.loop_server import LoopServer

__all__ = ["ERRORS", "REST_ERRORS", "Fault", "FaultyS3"]

ERRORS: dict[str, tuple[int, str, str, str]] = {  # action -> status, reason, S3 code, message
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "unavailable": (503, "Service Unavailable", "ServiceUnavailable", "Service is unable to handle request."),
}
# an Iceberg REST catalog's error answer (its JSON ErrorModel), for the proxy in front of a REST catalog
REST_ERRORS: dict[str, tuple[int, str, str, str]] = {  # action -> status, reason, error type, message
    "rest-forbidden": (403, "Forbidden", "ForbiddenException", "Principal is not allowed to update this table"),
    "rest-unauthorized": (401, "Unauthorized", "NotAuthorizedException", "Not authorized: the token is not valid"),
}
ACTIONS = frozenset(ERRORS) | frozenset(REST_ERRORS) | {"reset", "lost"}


@dataclass
class Fault:
    """Fault ``action`` on every ``every``-th request whose method is ``method`` (None: any) and whose target matches
    ``pattern`` (``re.search``), at most ``times`` times (None: no limit)."""

    method: str | None
    pattern: str
    action: str
    every: int = 1
    times: int | None = None
    matched: int = 0
    fired: int = 0
    hits: list[str] = field(default_factory=list)  # the targets it fired on

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; choose from {sorted(ACTIONS)}")
        self._re = re.compile(self.pattern)

    def take(self, method: str, target: str) -> bool:
        if (self.method is not None and method != self.method) or not self._re.search(target):
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.matched += 1
        if self.matched % self.every:
            return False
        self.fired += 1
        self.hits.append(target)
        return True


class _Closed(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise
        raise _Closed from None


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    out: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            key, value = line.split(":", 1)
            out[key.strip().lower()] = value.strip()
    return lines[0], out


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], *, until_eof: bool = False) -> bytes:
    """The raw body bytes as sent (chunked bodies kept chunked)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            parts.append(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = await reader.readuntil(b"\r\n")
                    parts.append(line)
                    if line == b"\r\n":
                        return b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read() if until_eof else b""


def _rest_error_response(action: str) -> bytes:
    status, reason, kind, message = REST_ERRORS[action]
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def _error_response(action: str, method: str, target: str) -> bytes:
    if action in REST_ERRORS:
        return _rest_error_response(action)
    status, reason, code, message = ERRORS[action]
    request_id = uuid.uuid4().hex[:16].upper()
    resource = target.split("?", 1)[0]
    body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
            f"<RequestId>{request_id}</RequestId></Error>").encode()  # fmt: skip
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nx-amz-request-id: {request_id}\r\n"
            f"Content-Length: {0 if method == 'HEAD' else len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + (b"" if method == "HEAD" else body)


def _cut(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dropped connection looks to the client."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultyS3(LoopServer):
    """Listen on a free 127.0.0.1 port and relay S3 requests to ``target_port``, failing the ones the faults match."""

    def __init__(self, *, target_port: int, target_host: str = "127.0.0.1") -> None:
        super().__init__(target_port=target_port, target_host=target_host, name="faulty S3 proxy", limit=1 << 20)
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def requests(self, method: str | None = None, pattern: str = "", action: str | None = None) -> list[str]:
        """The targets of the requests seen so far that match."""
        found = re.compile(pattern)
        with self._lock:
            return [t for m, t, a in self.log
                    if (method is None or m == method) and found.search(t) and (action is None or a == action)]

    def _decide(self, method: str, target: str) -> str:
        with self._lock:
            action = "ok"
            for fault in self.faults:
                if fault.take(method, target):
                    action = fault.action
                    break
            self.log.append((method, target, action))
            return action

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await _read_head(reader)
                request_line, headers = _headers(head)
                method, target = request_line.split(" ")[:2]
                action = self._decide(method, target)
                if action == "reset":
                    _cut(writer)
                    return
                if headers.get("expect", "").lower() == "100-continue":  # answered here: the body comes whole
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                    head = re.sub(rb"(?im)^expect:[^\r\n]*\r\n", b"", head)
                body = await _read_body(reader, headers)
                if action in ERRORS or action in REST_ERRORS:
                    writer.write(_error_response(action, method, target))
                    await writer.drain()
                    continue
                answer, keep = await self._forward(method, head + body)
                if action == "lost":
                    _cut(writer)
                    return
                writer.write(answer)
                await writer.drain()
                if not keep or headers.get("connection", "").lower() == "close":
                    writer.close()
                    return
        except (_Closed, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.transport.abort()
        except asyncio.CancelledError:  # the proxy is closing
            writer.transport.abort()

    async def _forward(self, method: str, request: bytes) -> tuple[bytes, bool]:
        """Send one request to the server on a new connection; its whole answer, and whether the client's connection
        may stay open after it."""
        server_r, server_w = await asyncio.open_connection(*self.target, limit=1 << 20)
        try:
            server_w.write(request)
            await server_w.drain()
            while True:
                head = await server_r.readuntil(b"\r\n\r\n")
                status_line, headers = _headers(head)
                status = int(status_line.split(" ")[1])
                if status >= 200 or status == 101:
                    break  # a 1xx the server sent anyway: the client already had its 100 Continue from us
            if method == "HEAD" or status in (204, 304):
                return head, True
            framed = "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers
            body = await _read_body(server_r, headers, until_eof=True)
            if not framed:  # the server ended the body by closing: tell the client the same way
                head = head[:-2] + b"Content-Length: %d\r\n\r\n" % len(body)
            return head + body, True
        finally:
            server_w.close()
