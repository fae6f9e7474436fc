"""A threaded HTTP file server on loopback for the `https://` source tests: byte ranges, strong
ETags, `If-Match`, an optional bearer token, and counters of what it served.

`send_file_bytes` answers one GET or HEAD of a byte string (whole, or one `Range`), checking
`If-Match` against the ETag; `DirectoryServer` serves a directory with it (the ETag is the
file's modification time, size and inode, so a file rewritten mid-fill gets another);
`hub_server` reuses `send_file_bytes` for the Hub's resolve URLs. Test support only.
"""

from __future__ import annotations

import os
import re
import threading
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """Clients that vanish mid-body (resets, killed loaders) are expected."""


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 (kept-alive connections, as a store's) without an access log."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib name)
        """Silent: tests read counters."""


class ServerThread:
    """`handler` served on a loopback port by threads, from now until `close`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = QuietServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Served:
    """What a server sent: object bytes, requests by method, and ranged GETs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.object_bytes = 0
        self.requests: Counter[str] = Counter()
        self.if_match = 0
        """Ranged GETs that named an `If-Match`."""

    def count(self, method: str, sent: int = 0, *, if_match: bool = False) -> None:
        with self._lock:
            self.requests[method] += 1
            self.object_bytes += sent
            self.if_match += int(if_match)


def send_error(handler: BaseHTTPRequestHandler, status: int, code: str = "") -> None:
    payload = f'{{"error": "{code or status}"}}'.encode()
    handler.send_response(status)
    if code:
        handler.send_header("X-Error-Code", code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(payload)


def send_file_bytes(handler: BaseHTTPRequestHandler, data: bytes | FileBytes, etag: str | None,
                    served: Served, headers: dict[str, str] | None = None, *,
                    ranges: bool = True) -> None:
    """Answer `handler`'s GET or HEAD with `data` (one `Range`, or whole; always whole
    without `ranges`); `etag` (quoted, or None for a server without ETags) is sent and compared
    with `If-Match` (412)."""
    asked_match = handler.headers.get("If-Match")
    if asked_match is not None and asked_match != "*" and asked_match != etag:
        served.count(handler.command)
        send_error(handler, 412, "PreconditionFailed")
        return
    wanted = handler.headers.get("Range") if ranges else None
    status, body, extra = 200, data[0:len(data)], {}
    if wanted:
        match = _RANGE.match(wanted)
        first = int(match.group(1)) if match else len(data)
        if first >= len(data):
            served.count(handler.command)
            send_error(handler, 416, "InvalidRange")
            return
        last = min(int(match.group(2)) if match.group(2) else len(data) - 1, len(data) - 1)
        status, body = 206, data[first:last + 1]
        extra["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
    # Counted before the answer goes out: a client that has it sees it counted.
    served.count(handler.command, len(body) if handler.command == "GET" and wanted else 0,
                 if_match=asked_match is not None)
    handler.send_response(status)
    for name, value in {**(headers or {}), **extra}.items():
        handler.send_header(name, value)
    if etag is not None:
        handler.send_header("ETag", etag)
    handler.send_header("Accept-Ranges", "bytes")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command == "GET":
        handler.wfile.write(body)


class FileBytes:
    """A file's bytes as `send_file_bytes` takes them, reading only the slice it asks for (a
    ranged GET of a large file does not read the whole file)."""

    def __init__(self, path: Path) -> None:
        self.path, self._size = path, path.stat().st_size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, span: slice) -> bytes:
        start, stop, _ = span.indices(self._size)
        with open(self.path, "rb") as handle:
            return os.pread(handle.fileno(), max(stop - start, 0), start)


def file_etag(path: Path) -> str:
    info = path.stat()
    return f'"{info.st_mtime_ns:x}-{info.st_size:x}-{info.st_ino:x}"'


class DirectoryServer:
    """Serves `root` at `http://127.0.0.1:<port>/` in threads (`with DirectoryServer(root)`);
    with `token`, every request must send `Authorization: Bearer <token>` (else 401);
    `etags=False` serves without ETags (a server that has none), `ranges=False` every file
    whole (one that ignores `Range`)."""

    def __init__(self, root: Path, *, token: str | None = None, etags: bool = True,
                 ranges: bool = True) -> None:
        self.root, self.token, self.etags, self.ranges = root, token, etags, ranges
        self.served = Served()
        self._thread = ServerThread(self._handler())
        self.url = self._thread.url

    def __enter__(self) -> DirectoryServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._thread.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
                if owner.token and self.headers.get("Authorization") != f"Bearer {owner.token}":
                    owner.served.count(self.command)
                    send_error(self, 401, "Unauthorized")
                    return
                path = owner.root / urllib.parse.unquote(self.path.split("?")[0]).lstrip("/")
                if not path.is_file() or not path.resolve().is_relative_to(owner.root.resolve()):
                    owner.served.count(self.command)
                    send_error(self, 404, "NotFound")
                    return
                send_file_bytes(self, FileBytes(path),
                                file_etag(path) if owner.etags else None, owner.served,
                                ranges=owner.ranges)

            do_HEAD = do_GET

        return Handler


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` by a rename, as a publisher replacing a file does."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)
