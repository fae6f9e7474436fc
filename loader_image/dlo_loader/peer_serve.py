"""Serving this node's published entry to the loaders of the same DOD that refill their node.

Owns the peer protocol's serving side and its bound: `EntryServer` answers, on the sidecar's
metrics endpoint (`metrics.Endpoint.serve_entry`), ranged reads of the one entry this loader
published and holds (`GET ENTRY_PATH/<entry id>/manifest`, `GET ENTRY_PATH/<entry id>/files/
<name>` with `Range: bytes=a-b`), from disk, read-only, every byte through one `Throttle` of
`loader.peerServeBytesPerSecond`, counted in `dlo_loader_bytes_served_total`. Called by `cli`
once the entry is published; `peer_reads` is the reading side.

[Note: who may read an entry] The endpoint listens on the pod's port, which any pod of the
cluster may reach, and an entry's identity (its source's listing: every key, size and version)
is public for a public bucket or a gated Hub repository. So a request must carry
`ACCESS_HEADER`: `access_key(secret, identity)`, an HMAC-SHA256 of the entry's identity keyed by
the DOD's fill secret (`fill_secret`), which the operator mounts in that DOD's loaders alone. A
loader of the same DOD that listed the same source has it; a process of another namespace that
rebuilt the listing, or a loader of another DOD (another secret), gets `403` and nothing else,
not even the manifest, nor whether a guessed entry id is the one served (the key is checked
before the path). A loader without a fill secret (started by hand) serves no entry and
reads from no peer. Only the entry's own id is served, only names its manifest lists (no path
is built from anything else: no traversal), only GET, only whole ranges within the file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from dlo_contract.cache import EntryHandle, canonical_json

log = logging.getLogger(__name__)

ENTRY_PATH = "/entries"
ACCESS_HEADER = "X-DLO-Entry-Key"
PIECE_BYTES = 1 << 20
"""Bytes read from disk and sent at a time (and asked of the throttle at a time)."""
_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


_ACCESS_LABEL = b"dlo peer entry\n"


def access_key(secret: bytes, identity: Mapping[str, Any]) -> str:
    """What a reader of an entry shows it holds: the DOD's fill `secret`, bound to the entry's
    `identity` (see [Note: who may read an entry])."""
    message = _ACCESS_LABEL + canonical_json(dict(identity)).encode("ascii")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


class Throttle:
    """A token bucket of `rate` bytes per second, shared by every response: `take(n)` returns
    once `n` more bytes may go. It starts with one second's worth (a burst), never holds more,
    and asks `sleep` for the wait; `clock` and `sleep` are the test's to replace."""

    def __init__(self, rate: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = rate
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = float(rate)
        self._at = clock()

    def take(self, count: int) -> None:
        with self._lock:  # one waiter at a time: the bucket's debt is paid in order
            now = self._clock()
            self._tokens = min(self._tokens + (now - self._at) * self.rate, float(self.rate))
            self._at = now
            self._tokens -= count
            if self._tokens < 0:
                self._sleep(-self._tokens / self.rate)
                self._tokens, self._at = 0.0, self._clock()


class EntryServer:
    """The WSGI side of serving `entry` (held open by the sidecar) through `throttle` to the
    readers that hold the DOD's fill `secret`; `served(n)` counts the bytes sent."""

    def __init__(self, entry: EntryHandle, throttle: Throttle,
                 served: Callable[[int], None], *, secret: bytes) -> None:
        self.entry, self.throttle, self._served = entry, throttle, served
        self._key = access_key(secret, entry.manifest.identity)
        self._prefix = f"{ENTRY_PATH}/{entry.entry_id}/"

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") != "GET":
            return _answer(start_response, "405 Method Not Allowed", "GET only")
        shown = environ.get("HTTP_" + ACCESS_HEADER.upper().replace("-", "_"), "")
        if not hmac.compare_digest(shown.encode("latin-1", "replace"), self._key.encode()):
            # Before the path: a guessed entry id is not confirmed to a reader without the key.
            return _answer(start_response, "403 Forbidden", "no key of this entry")
        if not path.startswith(self._prefix):
            return _answer(start_response, "404 Not Found", "this loader holds another entry")
        name = path[len(self._prefix):]
        if name == "manifest":
            body = self.entry.manifest.to_json().encode()
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        return self._file(name.removeprefix("files/") if name.startswith("files/") else None,
                          environ.get("HTTP_RANGE", ""), start_response)

    def _file(self, name: str | None, asked: str, start_response: Callable[..., Any]
              ) -> Iterable[bytes]:
        record = self.entry.manifest.file(name) if name else None
        if record is None:
            return _answer(start_response, "404 Not Found", "no such file in the entry")
        match = _RANGE.fullmatch(asked.strip())
        if not match or not int(match[1]) <= int(match[2]) < record.size:
            return _answer(start_response, "416 Range Not Satisfiable",
                           f"ask for bytes=a-b within {record.size} bytes")
        start, end = int(match[1]), int(match[2]) + 1
        fd = os.open(self.entry.path / record.name, os.O_RDONLY | os.O_CLOEXEC)
        start_response("206 Partial Content", [
            ("Content-Type", "application/octet-stream"), ("Content-Length", str(end - start)),
            ("Content-Range", f"bytes {start}-{end - 1}/{record.size}")])
        return self._pieces(fd, start, end)

    def _pieces(self, fd: int, start: int, end: int) -> Iterator[bytes]:
        try:
            at = start
            while at < end:
                count = min(PIECE_BYTES, end - at)
                self.throttle.take(count)
                piece = os.pread(fd, count, at)
                if not piece:
                    return  # the file is shorter than its record: the reader's check fails
                yield piece
                self._served(len(piece))
                at += len(piece)
        finally:
            os.close(fd)


def _answer(start_response: Callable[..., Any], status: str, text: str) -> list[bytes]:
    body = (text + "\n").encode()
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
