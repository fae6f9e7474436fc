"""A counting, fault-injecting HTTP proxy between an object store's client and its server.

Owns the evidence for the loader's claims: every object read (a GET with a `Range` header, or
Azure Blob's `x-ms-range`) that passes through is counted in bytes actually sent to the client,
so a test can check how many object-store bytes each loader rank read without trusting the
loader (one proxy per rank). A `FaultPlan` turns chosen object reads into the failures real
object stores produce: 503 SlowDown, 500 InternalError, a connection reset in the middle of the
body, a truncated body (a short but well-formed response) and a stall (half the body, then
silence for `stall_s`); it can also slow every read down, act as a store that ignores `If-Match`
(`ignore_if_match`) or one whose listings name no checksum (`unlisted_checksums`); `reads_open`
holds object reads until it is set. Other requests pass through untouched.

Runs in threads of the calling process (`with FaultProxy(upstream) as proxy: proxy.url`). Used by
the loader tests and benchmarks; it must not be imported by the loader.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULT_KINDS = ("slowdown", "internal", "reset", "truncate")
"""Faults a retry recovers from quickly; `stall` (below) waits out the client's stall timeout."""
STALL = "stall"
CORRUPT = "corrupt"
"""Flips one byte in the middle of the body: bytes damaged on the way that no retry is asked for
(only a checksum of the whole object can tell)."""
_LISTED_CHECKSUM = re.compile(rb"<Checksum(Algorithm|Type)>[^<]*</Checksum(Algorithm|Type)>")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te",
               "trailer", "upgrade", "content-length"}
_ERROR_BODIES = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
}


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Which object reads fail: every `every`-th one, cycling through `kinds`, `limit` times
    (None: forever, a fault that persists). `delay_s` slows every object read (a slow store,
    so that a test can act while a fill is in progress)."""

    kinds: tuple[str, ...] = ()
    every: int = 1
    limit: int | None = None
    delay_s: float = 0.0
    stall_s: float = 30.0
    """How long a `stall` fault holds the connection silent after half the body."""
    ignore_if_match: bool = False
    """Drop `If-Match` before the server sees it (stores that do not implement it)."""
    unlisted_checksums: bool = False
    """Drop the checksum algorithm and type from listings (stores that keep an object's
    checksum and answer it to a HEAD, but do not name it in a listing)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - {*FAULT_KINDS, STALL, CORRUPT})
        if unknown or self.every < 1:
            raise ValueError(f"FaultPlan kinds must be among {FAULT_KINDS} and every >= 1; "
                             f"got kinds={self.kinds}, every={self.every}")


class FaultProxy:
    """Reverse proxy on 127.0.0.1 forwarding to `upstream` (an `http://host:port` URL)."""

    def __init__(self, upstream: str, plan: FaultPlan | None = None) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.plan = plan or FaultPlan()
        self._lock = threading.Lock()
        self.object_bytes = 0
        """Body bytes of object reads delivered to the client, faults included."""
        self.object_requests = 0
        self.faults: Counter[str] = Counter()
        self.reads_open = threading.Event()
        """Object reads wait for this (set: they pass at once). A test clears it to hold a
        loader's reads until something it waits for happened, and sets it to let them go."""
        self.reads_open.set()
        self._server = _QuietServer(("127.0.0.1", 0), _handler_class(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.reads_open.set()  # held reads end with the proxy, not with the process
        self._server.shutdown()
        self._server.server_close()

    def _next_fault(self) -> str | None:
        """Count one object read and decide its fate (under the lock: numbering is global)."""
        with self._lock:
            self.object_requests += 1
            injected = sum(self.faults.values())
            plan = self.plan
            if not plan.kinds or self.object_requests % plan.every:
                return None
            if plan.limit is not None and injected >= plan.limit:
                return None
            kind = plan.kinds[injected % len(plan.kinds)]
            self.faults[kind] += 1
            return kind

    def _count(self, sent: int) -> None:
        with self._lock:
            self.object_bytes += sent


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """Clients that vanish (killed loaders, resets we inject) are expected here."""


def _handler_class(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(_ProxyHandler):
        owner = proxy

    return Handler


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib name)
        """Silent: the loader's tests read counters, not access logs."""

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        self._forward()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _forward(self) -> None:
        is_object_read = self.command == "GET" and any(
            name in self.headers for name in ("Range", "x-ms-range"))  # Azure Blob's own too
        fault = self.owner._next_fault() if is_object_read else None
        if is_object_read:
            self.owner.reads_open.wait()
        if is_object_read and self.owner.plan.delay_s:
            time.sleep(self.owner.plan.delay_s)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if fault in _ERROR_BODIES:
            self._send_error_body(*_ERROR_BODIES[fault])
            return
        status, reason, headers, payload = self._upstream_call(body)
        if self.owner.plan.unlisted_checksums and "list-type=" in self.path:
            payload = _LISTED_CHECKSUM.sub(b"", payload)
        if fault == "truncate":
            payload = payload[: len(payload) // 2]
        if fault == CORRUPT and payload:
            middle = len(payload) // 2
            payload = payload[:middle] + bytes([payload[middle] ^ 0xFF]) + payload[middle + 1:]
        self.send_response(status, reason)
        for name, value in headers:
            kept = self.command == "HEAD" and name.lower() == "content-length"
            if kept or name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        if self.command != "HEAD":  # a HEAD's length is the object's, as upstream said
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if fault == "reset":
            self._reset_after(payload[: len(payload) // 2])
            return
        if fault == STALL:
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            time.sleep(self.owner.plan.stall_s)
            self.close_connection = True
            return
        if self.command != "HEAD":
            self.wfile.write(payload)
        if is_object_read:
            self.owner._count(len(payload))

    def _upstream_call(self, body: bytes | None) -> tuple[int, str, list[tuple[str, str]], bytes]:
        dropped = _HOP_BY_HOP | ({"if-match"} if self.owner.plan.ignore_if_match else set())
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        reconnected = False
        while True:
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
            try:
                self._upstream.request(self.command, self.path, body=body, headers=headers)
                response = self._upstream.getresponse()
                payload = response.read()
                return response.status, response.reason, response.getheaders(), payload
            except (http.client.HTTPException, OSError):
                # A kept-alive upstream connection may have been closed by the server: reconnect
                # once; a second failure is the server's and reaches the client as a reset.
                self._upstream.close()
                self._upstream = None
                if reconnected:
                    raise
                reconnected = True

    def _send_error_body(self, status: int, code: str, message: str) -> None:
        payload = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                   f"<Message>{message}</Message><RequestId>fault</RequestId></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _reset_after(self, partial: bytes) -> None:
        """Send part of the body, then abort the connection with RST (SO_LINGER 0)."""
        self.wfile.write(partial)
        self.wfile.flush()
        self.owner._count(len(partial))
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass  # the client (a killed loader, or a reset we made) is gone
        if self._upstream is not None:
            self._upstream.close()
