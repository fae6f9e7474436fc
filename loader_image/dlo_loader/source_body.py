"""Reading one GET's body into the caller's buffers, and checking the response it came with.

Owns what the object store seam does with a response once the store answered: `check_response`
(the bytes are the listed object's, the span asked for) and `Body` (the bytes read straight into
the caller's buffer, hashed as they land). Called by `source`; it asks the store nothing and
retries nothing (a short or broken body raises `ShortBody`, which `source_retry` retries).
"""

from __future__ import annotations

import http.client

import urllib3
from botocore.response import StreamingBody

from dlo_loader.errors import SourceChanged
from dlo_loader.source_retry import ShortBody
from dlo_loader.sources.seam import fill_hashed
from dlo_contract.cache import ObjectIdentity
from dlo_contract.settings import STREAM_PIECE_BYTES

_PIECE_BYTES = 1 << 20
"""Read size on the public path: a piece stays in the CPU cache between urllib3's two copies."""
_DIRECT_PIECE_BYTES = STREAM_PIECE_BYTES
"""Most bytes one read asks for on the direct path (`http.client`'s buffered reader loops on the
socket until they are all in), then hashed at once: a reading alone's whole piece (see [Note:
read size]).

[Note: read size] Smaller reads cost more CPU than their calls explain: the kernel sizes a
socket's receive buffer by how much the reader takes at once (on loopback, where a round trip is
short, 256 KiB reads kept it several times smaller than 2 MiB reads, as `ss -tmi` shows), so
small reads drain a small buffer in more, smaller steps. `dlo bench loader` reports the loader's
CPU-seconds per GiB. 2 MiB is still in a core's L2 cache, or its share of L3, when it is
hashed."""


def check_response(response: dict, obj: ObjectIdentity, start: int, length: int,
                   where: str) -> None:
    """The response must be the listed object's bytes asked for: a store that ignores `If-Match`
    would otherwise mix an overwritten object's new bytes into the old entry. Another ETag or
    object size is a changed object (`SourceChanged`); another span of the same object is a
    broken response, retried like a short body."""
    etag = str(response.get("ETag", "")).strip('"')
    content_range = response.get("ContentRange")
    span, _, size = (content_range or "").rpartition("/")
    asked = f"bytes {start}-{start + length - 1}"
    changed = None
    if etag and etag != obj.etag:
        changed = f"ETag {etag}, listed {obj.etag}"
    elif content_range is not None and size != str(obj.size):
        changed = f"size {size} in Content-Range {content_range!r}, listed {obj.size}"
    if changed:
        raise SourceChanged(
            f"{where}: the object changed since it was listed ({changed}); nothing was "
            "published",
            hint="do not overwrite a checkpoint while it is being loaded; rerun the fill",
        )
    got_length = response.get("ContentLength")
    if content_range is not None and span != asked:
        raise ShortBody(f"Content-Range {content_range!r}, asked for {asked!r}")
    if got_length is not None and int(got_length) != length:
        raise ShortBody(f"Content-Length {got_length}, asked for {length}")


class Body:
    """A response body read into caller buffers, each piece hashed as it lands (see [Note:
    hashing while reading]).

    [Note: one copy] botocore's `readinto` goes through urllib3's, which reads into a new bytes
    object and copies that: a fresh allocation and a second copy of every byte. When the body is
    a plain `StreamingBody` over an undecoded urllib3 response (no checksum wrapper, no content
    decoding), the bytes are read from the `http.client` response straight into the caller's
    buffer instead, and the connection goes back to the pool as urllib3 would return it once
    the body is read to its end. Anything else takes the public, copying path."""

    def __init__(self, body: StreamingBody) -> None:
        self._body = body
        self._raw = getattr(body, "_raw_stream", None)
        response = getattr(self._raw, "_fp", None)
        self._direct = (type(body) is StreamingBody and isinstance(self._raw, urllib3.HTTPResponse)
                        and isinstance(response, http.client.HTTPResponse)
                        and not self._raw.decode_content)
        self._response = response if self._direct else None

    def fill(self, into: memoryview, algorithm: str, crc: int = 0) -> tuple[int, int]:
        """Read until `into` is full or the body ends: the bytes read, and the running CRC `crc`
        of `algorithm` (of the bytes before them) extended by them."""
        if self._response is not None:
            readinto, piece = self._response.readinto, _DIRECT_PIECE_BYTES
        else:  # botocore's own path (urllib3 allocates a buffer per call)
            readinto, piece = self._body.readinto, _PIECE_BYTES
        return fill_hashed(readinto, into, piece, algorithm, crc)

    def finish(self) -> bool:
        """After the bytes asked for: True when more followed (a broken response)."""
        if self._response is None:
            return bool(self._body.read(1))
        response = self._response
        extra = bool(response.length) or bool(response.length is None and response.read(1))
        if not extra and response.isclosed():
            self._raw.release_conn()
        return extra
