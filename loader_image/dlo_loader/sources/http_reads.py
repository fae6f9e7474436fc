"""Ranged GETs over HTTP for the readers that speak it (`https`, `hf`): one urllib3 pool, the
redirects followed by hand, answers turned into the seam's errors, bodies read into the
caller's buffer.

Owns `HttpClient` (requests of one source: its headers, sent to the source's own origin alone,
a read timeout of the stall timeout, redirects followed, every error answer a `StoreStatus`) and `HttpBody` (a body read straight into the caller's memoryview and hashed as
it lands). Called by the readers of `dlo_loader.sources`; retries nothing itself (the reader's
`Retrier` does). Must not log or raise anything that carries a credential (a header value or a
signed URL's query).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import urllib3

from dlo_loader.errors import SourceError
from dlo_loader.source_retry import ShortBody, Stalled, StoreStatus
from dlo_loader.sources.seam import fill_hashed

_REDIRECTS = 5
"""Most redirects one request follows (the Hub's resolve URL answers with one, to its CDN)."""
_PIECE_BYTES = 2 << 20
"""Most bytes one socket read asks for (see [Note: read size] in `source_body`)."""
_CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Answer:
    """A response with its body unread, and the headers of the first response of its redirect
    chain (where a Hub names the file's identity before it redirects to the bytes)."""

    response: urllib3.BaseHTTPResponse
    first: Mapping[str, str]
    url: str
    """Where the bytes came from, without its query (a signed URL's signature)."""
    location: str = ""
    """Where the bytes came from, whole (a signed URL with its signature, to ask again there):
    never shown."""


def without_query(url: str) -> str:
    """`url` as messages may show it: a signed URL's query carries its credential."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


class HttpClient:
    """The HTTP requests of one source: `headers` (its credential among them) go with a request
    to `origin` (the source's own scheme and host, fixed when the source opens) and to no other,
    whatever URL a request starts from: a redirect's target, or a storage URL a reader saved
    from one and asks directly later, is another host's, so it gets none of them."""

    def __init__(self, *, origin: str, connections: int, stall_timeout_s: float,
                 headers: Mapping[str, str] | None = None) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._origin = _origin(origin)
        self._headers = dict(headers or {})
        self._pool = urllib3.PoolManager(
            num_pools=8, maxsize=connections, retries=False,
            timeout=urllib3.Timeout(connect=_CONNECT_TIMEOUT_S, read=stall_timeout_s))

    def close(self) -> None:
        self._pool.clear()

    def request(self, method: str, url: str, headers: Mapping[str, str] | None = None) -> Answer:
        """`method` of `url`, following redirects; an error answer raises `StoreStatus` (its
        body read and dropped). The body of the answer is not read (`preload_content` off)."""
        first: Mapping[str, str] | None = None
        for _ in range(_REDIRECTS + 1):
            # The credential goes to the source's own origin alone: not the url this request
            # began at, which may be a storage host's (a signed URL saved from a redirect).
            own = self._headers if _origin(url) == self._origin else {}
            sent = {**own, **(headers or {})}
            try:
                response = self._pool.request(method, url, headers=sent, redirect=False,
                                              preload_content=False, decode_content=False)
            except urllib3.exceptions.ReadTimeoutError as exc:
                raise Stalled(f"no answer for {self.stall_timeout_s:g} s") from exc
            first = first if first is not None else dict(response.headers)
            location = response.headers.get("Location")
            if response.status in (301, 302, 303, 307, 308) and location:
                _drop(response)
                url = urllib.parse.urljoin(url, location)
                continue
            if response.status >= 400:
                _drop(response)
                raise StoreStatus(response.status, response.headers.get("X-Error-Code", ""))
            return Answer(response, first, without_query(url), url)
        raise StoreStatus(310, "TooManyRedirects")

    def json(self, url: str, headers: Mapping[str, str] | None = None) -> Any:
        """The JSON document at `url` (a listing)."""
        answer = self.request("GET", url, headers)
        try:
            return json.loads(read_all(answer.response))
        except ValueError as exc:
            raise ShortBody(f"{answer.url} is not a JSON document: {exc}") from exc

    @contextlib.contextmanager
    def ranged(self, url: str, start: int, length: int,
               headers: Mapping[str, str] | None = None) -> Iterator[tuple[Answer, HttpBody]]:
        """A GET of bytes `[start, start + length)` of `url`: the answer (its status and
        `Content-Range` checked: the span asked for, `size_of` tells the total), and its body
        to read into the caller's buffers; closed on the way out. A server that answers with the
        whole file (200) is taken only where that is what was asked for (from 0, of its
        length): a small file some servers do not serve in ranges."""
        answer = self.request("GET", url, {
            **(headers or {}), "Range": f"bytes={start}-{start + length - 1}",
            "Accept-Encoding": "identity"})
        response = answer.response
        body = HttpBody(response, self.stall_timeout_s)
        try:
            span = response.headers.get("Content-Range", "").rpartition("/")[0]
            asked = f"bytes {start}-{start + length - 1}"
            got_length = response.headers.get("Content-Length")
            if response.status == 200 and (start or got_length != str(length)):
                raise SourceError(f"{answer.url}: the server answered a range with the whole "
                                  "file (status 200)",
                                  hint="serve the source from a server that honours Range")
            if response.status == 200:  # the whole file was asked for, and sent
                yield answer, body
                return
            if response.status != 206 or span != asked:
                raise ShortBody(f"status {response.status}, Content-Range "
                                f"{response.headers.get('Content-Range')!r}, asked for {asked!r}")
            if got_length is not None and int(got_length) != length:
                raise ShortBody(f"Content-Length {got_length}, asked for {length}")
            yield answer, body
        finally:
            response.release_conn() if body.complete() else _drop(response)


def size_of(answer: Answer) -> int | None:
    """The object's whole size from a ranged answer's `Content-Range` (None: not stated)."""
    total = answer.response.headers.get("Content-Range", "").rpartition("/")[2]
    return int(total) if total.isdigit() else None


def read_all(response: urllib3.BaseHTTPResponse) -> bytes:
    """A small body (a listing) whole."""
    try:
        return response.read(decode_content=True)
    finally:
        response.release_conn()


def _drop(response: urllib3.BaseHTTPResponse) -> None:
    """Close an answer whose body is not read to its end (its connection is not reused)."""
    with contextlib.suppress(Exception):
        response.close()
    with contextlib.suppress(Exception):
        response.release_conn()


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.netloc


class HttpBody:
    """A ranged answer's body read into caller buffers, each piece hashed as it lands (the
    seam's `Body`). Read from the `http.client` response under urllib3's straight into the
    caller's buffer (see [Note: one copy] in `source_body`), else through urllib3's copy."""

    def __init__(self, response: urllib3.BaseHTTPResponse, stall_timeout_s: float) -> None:
        self._response = response
        raw = getattr(response, "_fp", None)
        self._direct = raw if isinstance(raw, http.client.HTTPResponse) else None
        self._stall_timeout_s = stall_timeout_s

    def fill(self, into: memoryview, algorithm: str, crc: int = 0) -> tuple[int, int]:
        readinto = self._direct.readinto if self._direct is not None else self._response.readinto
        try:
            return fill_hashed(readinto, into, _PIECE_BYTES, algorithm, crc)
        except (socket.timeout, TimeoutError, urllib3.exceptions.ReadTimeoutError) as exc:
            raise Stalled(f"no bytes for {self._stall_timeout_s:g} s") from exc

    def complete(self) -> bool:
        """Whether the body was read to its end (its connection may serve the next request)."""
        if self._direct is None:
            return bool(self._response.closed)
        return self._direct.isclosed()

    def finish(self) -> bool:
        if self._direct is None:
            return bool(self._response.read(1))
        return bool(self._direct.length) or bool(self._direct.length is None
                                                  and self._direct.read(1))
