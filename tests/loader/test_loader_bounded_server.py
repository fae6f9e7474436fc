"""The loader's HTTP server under clients that hold it (`bounded_server`, [Note: slow clients]):
a head past its size cap is refused, a head trickled a byte at a time is cut at its deadline
while a whole request is answered, and whole requests past the workers and the queue are told
to ask again at once. Loopback sockets; the app holds its answers on an event the test sets."""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from dlo_loader.bounded_server import BoundedServer, Limits
from dlo_loader.metrics import Endpoint

GUARD_S = 30.0
"""How long a client waits for an answer that must come (a hang guard, not a timing assertion)."""


class App:
    """Answers `ok`; with `hold` cleared, each answer waits for it (`entered` counts them)."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Semaphore(0)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        self.entered.release()
        self.hold.wait(GUARD_S)
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "3")])
        return [b"ok\n"]


@pytest.fixture
def app() -> Iterator[App]:
    made = App()
    yield made
    made.hold.set()


def _serve(app: App, **limits: Any) -> BoundedServer:
    return BoundedServer("127.0.0.1", 0, app, limits=Limits(**limits))


def _ask(port: int, head: bytes) -> bytes:
    """What the server sends back to `head` before it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=GUARD_S) as sock:
        sock.sendall(head)
        answer = b""
        while piece := sock.recv(65536):
            answer += piece
        return answer


def test_a_head_past_the_size_cap_gets_431_and_a_whole_request_its_answer() -> None:
    endpoint = Endpoint(0, addr="127.0.0.1")
    try:
        huge = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (Limits().head_bytes + 1)
        assert _ask(endpoint.port, huge).startswith(b"HTTP/1.0 431 ")
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics",
                                    timeout=GUARD_S) as reply:
            assert reply.status == 200
    finally:
        endpoint.close()


def test_a_trickled_head_is_cut_at_its_deadline_while_a_whole_request_is_answered(
        app: App) -> None:
    """The trickling client sends a byte whenever the server has not closed it; the server
    closes it (its deadline counts from the connect, not from each byte)."""
    server = _serve(app, head_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=GUARD_S) as slow:
            slow.settimeout(0.05)
            closed = False
            for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"s" * 10_000:
                try:
                    slow.sendall(bytes([byte]))
                    closed = slow.recv(1) == b""
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                if closed:
                    break
            assert closed
        assert _ask(server.port, b"GET / HTTP/1.0\r\n\r\n").endswith(b"\r\n\r\nok\n")
    finally:
        server.close()


def test_whole_requests_past_the_workers_and_the_queue_get_503_at_once(app: App) -> None:
    """One worker, no queue: while it answers, the next whole request is refused at once."""
    server = _serve(app, workers=1, queued=0)
    app.hold.clear()
    answers: list[bytes] = []
    held = threading.Thread(target=lambda: answers.append(
        _ask(server.port, b"GET / HTTP/1.0\r\n\r\n")))
    try:
        held.start()
        assert app.entered.acquire(timeout=GUARD_S)  # the one worker is busy
        assert _ask(server.port, b"GET / HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 503 ")
    finally:
        app.hold.set()
        held.join(GUARD_S)
        server.close()
    assert answers[0].endswith(b"\r\n\r\nok\n")
