"""The loader's HTTP server: a WSGI app on a port that no number of slow clients can stop.

Owns `BoundedServer` and its `Limits`. `metrics.Endpoint` runs `/metrics`, the summary and the
peer protocol (`peer_serve`) on it. Must not decide what is answered (the app does) nor log a
request's headers (the peer key and the summary proof travel there).

[Note: slow clients] The endpoint listens on the pod's port, which any pod of the cluster may
reach. A server with a thread per connection (the standard library's) gives a client that sends
half a request and holds a thread for as long as it holds, with no cap. Here one thread reads
every request head, from non-blocking sockets, and only a request whose head arrived whole goes
to one of `Limits.workers` threads; so:
- a head must arrive whole within `Limits.head_timeout_s` of the connection (a total deadline,
  not one per read: a client that trickles a byte at a time is cut too) and within
  `Limits.head_bytes` (else `431`); no request body is read (every path is a GET), and the
  connection closes after one answer;
- at most `Limits.pending` connections wait for their heads; one more closes the oldest of them
  at once, so a flood of slow clients cannot keep a new client's complete request from a
  worker: it arrives whole in one read, long before the flood can push it out;
- at most `Limits.queued` whole requests wait for a worker; one more is answered `503` at once;
- an answer's write that moves no byte for `Limits.send_timeout_s` ends the connection (a
  client that asks and never reads).
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

log = logging.getLogger(__name__)

WsgiApp = Callable[..., Iterable[bytes]]


@dataclass(frozen=True)
class Limits:
    """What one client, or many, may hold of the server (see [Note: slow clients])."""

    head_bytes: int = 16 << 10
    """Most bytes of a request's head (its line and headers): a GET needs well under 1 KiB."""
    head_timeout_s: float = 10.0
    """Seconds from a connection's accept for its whole head to arrive."""
    pending: int = 128
    """Most connections whose head has not arrived whole; the oldest goes first."""
    workers: int = 8
    """Threads answering whole requests (peer reads, scrapes, the summary)."""
    queued: int = 64
    """Most whole requests waiting for a worker."""
    send_timeout_s: float = 30.0
    """Seconds an answer's write may wait for the client to read."""


@dataclass
class _Pending:
    address: Any
    deadline: float
    head: bytearray


class _Handler(WSGIRequestHandler):
    """The standard WSGI request handler, fed a head already read (`request` is the socket and
    the head), writing straight to the socket, logging nothing of the request."""

    def setup(self) -> None:
        self.connection, head = self.request
        self.rfile = io.BytesIO(head)
        self.wfile = _SocketWriter(self.connection)

    def finish(self) -> None:
        self.wfile.flush()

    def get_stderr(self) -> io.TextIOBase:
        return _DebugLog()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        """Requests are not news: the loader's log is for the fill."""


class _SocketWriter(io.RawIOBase):
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._sock.sendall(data)
        return memoryview(data).nbytes


class _DebugLog(io.TextIOBase):
    """Where wsgiref writes a failed answer's traceback (a client gone mid-answer is common and
    no news): one DEBUG line each."""

    def write(self, text: str) -> int:
        if text.strip():
            log.debug("endpoint: %s", text.strip().splitlines()[-1])
        return len(text)


class BoundedServer:
    """`app` served on `addr:port` by one reading thread and `limits.workers` answering ones,
    until `close()` (see [Note: slow clients])."""

    def __init__(self, addr: str, port: int, app: WsgiApp, *, limits: Limits = Limits(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.limits, self._clock = app, limits, clock
        self._listener = socket.create_server((addr, port), backlog=socket.SOMAXCONN)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.base_environ = {"SERVER_NAME": addr, "GATEWAY_INTERFACE": "CGI/1.1",
                             "SERVER_PORT": str(self.port), "REMOTE_HOST": "",
                             "CONTENT_LENGTH": "", "SCRIPT_NAME": ""}
        self._pending: collections.OrderedDict[socket.socket, _Pending] = \
            collections.OrderedDict()
        self._waiting = 0  # whole requests queued or being answered, under `_lock`
        self._lock = threading.Lock()
        self._wake_read, self._wake_write = socket.socketpair()  # close() wakes the loop
        self._closing = False
        self._requests: queue.SimpleQueue[tuple[socket.socket, bytes, Any] | None] = \
            queue.SimpleQueue()
        for number in range(limits.workers):  # daemons: an answer under way holds no exit
            threading.Thread(target=self._work, name=f"dlo-endpoint-{number}",
                             daemon=True).start()
        self._thread = threading.Thread(target=self._serve, name="dlo-endpoint-heads",
                                        daemon=True)
        self._thread.start()

    def get_app(self) -> WsgiApp:  # what `WSGIRequestHandler` asks its server for
        return self.app

    def close(self) -> None:
        """Stop accepting and drop the heads not yet whole; the answers under way end on their
        own (their workers then stop)."""
        self._closing = True
        self._wake_write.send(b"x")
        self._thread.join()
        for _ in range(self.limits.workers):
            self._requests.put(None)
        for sock in (self._listener, self._wake_read, self._wake_write):
            sock.close()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while not self._closing:
                for key, _ in selector.select(self._until_next_deadline()):
                    if key.fileobj is self._listener:
                        self._accept(selector)
                    elif key.fileobj is not self._wake_read:
                        self._read(selector, key.fileobj)  # type: ignore[arg-type]
                self._expire(selector)
            for sock in list(self._pending):
                self._drop(selector, sock)

    def _until_next_deadline(self) -> float | None:
        if not self._pending:
            return None  # nothing times out: wait for a connection or close()
        first = next(iter(self._pending.values()))  # accepted first, so it times out first
        return max(first.deadline - self._clock(), 0.0)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the next select tries again
                log.debug("endpoint: accept failed: %s", exc)
                return
            sock.setblocking(False)
            if len(self._pending) >= self.limits.pending:
                self._drop(selector, next(iter(self._pending)))  # the oldest head goes
            self._pending[sock] = _Pending(address, self._clock() + self.limits.head_timeout_s,
                                           bytearray())
            selector.register(sock, selectors.EVENT_READ)

    def _read(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        pending = self._pending.get(sock)
        if pending is None:
            return
        try:
            data = sock.recv(self.limits.head_bytes + 1 - len(pending.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop(selector, sock)
            return
        seen = max(len(pending.head) - 3, 0)
        pending.head += data
        if pending.head.find(b"\r\n\r\n", seen) >= 0 or pending.head.find(b"\n\n", seen) >= 0:
            self._release(selector, sock)
            self._hand_over(sock, pending)
        elif len(pending.head) > self.limits.head_bytes:
            self._release(selector, sock)
            _refuse(sock, "431 Request Header Fields Too Large",
                    f"a request head has at most {self.limits.head_bytes} bytes")

    def _hand_over(self, sock: socket.socket, pending: _Pending) -> None:
        with self._lock:
            full = self._waiting >= self.limits.workers + self.limits.queued
            if not full:
                self._waiting += 1
        if full:
            _refuse(sock, "503 Service Unavailable", "too many requests at once; ask again")
            return
        self._requests.put((sock, bytes(pending.head), pending.address))

    def _work(self) -> None:
        while (request := self._requests.get()) is not None:
            self._answer(*request)

    def _answer(self, sock: socket.socket, head: bytes, address: Any) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(self.limits.send_timeout_s)
            _Handler((sock, head), address, self)  # type: ignore[arg-type]
        except Exception as exc:  # the client went away or stopped reading; a worker stays
            log.debug("endpoint: answer to %s cut: %s", address, exc)
        finally:
            with self._lock:
                self._waiting -= 1
            _close(sock)

    def _expire(self, selector: selectors.BaseSelector) -> None:
        now = self._clock()
        while self._pending:
            sock, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                return
            self._drop(selector, sock)

    def _release(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        """Stop watching `sock` for its head (it is whole, or refused)."""
        del self._pending[sock]
        selector.unregister(sock)

    def _drop(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        self._release(selector, sock)
        _close(sock)


def _refuse(sock: socket.socket, status: str, text: str) -> None:
    """A one-line answer sent without waiting (a client that does not read loses it)."""
    body = (text + "\n").encode()
    with contextlib.suppress(OSError):
        sock.send(f"HTTP/1.0 {status}\r\nContent-Type: text/plain\r\nContent-Length: "
                  f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    _close(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
