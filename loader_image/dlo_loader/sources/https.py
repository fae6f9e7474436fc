"""`https://host/path/` (or `http://`): a plain web server or CDN serving a directory that holds
a listing file (`listing_file`), read with ranged GETs (`http_reads`).

Owns `HttpsSource`. Its listing is the listing file's (names, sizes, digests), each chosen file
asked for once with a HEAD: the size must be the listed one (else the listing is stale), and
its strong ETag is the file's version identity, sent as `If-Match` with every read and compared
with every answer's; a server without strong ETags is read with the listed digest as the
identity (each answer's total size still compared). A listed CRC is the file's chunk digest,
checked combined; a listed SHA-256 is checked against the written file. A bearer token in
`DLO_HTTPS_TOKEN` goes with every request to the source's host (never past a redirect to
another host, never into a message). Called through `dlo_loader.sources`.
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from dlo_loader.digest import StoreChecksum
from dlo_loader.errors import SourceError
from dlo_loader.sources.http_reads import Answer, HttpBody, HttpClient, read_all, size_of
from dlo_loader.sources.listing_file import LISTING_FILE, ListedFile, parse
from dlo_loader.sources.seam import (
    ListedChecksums,
    RangedReads,
    SourceOptions,
    matches,
    nothing_matched,
    source_changed,
)
from dlo_contract.cache import CRC_ALGORITHMS, ObjectIdentity
from dlo_contract.source_credentials import HTTPS_TOKEN_ENV
from dlo_contract.source_uri import SourceAddress

CREDENTIALS_HINT = (f"check the bearer token the loader sends ({HTTPS_TOKEN_ENV}, from the "
                    "source's Secret) and the server's access rules")


class HttpsSource(RangedReads, ListedChecksums):
    """The files a listing file names under one URL (see the module docstring)."""

    def __init__(self, uri: SourceAddress, options: SourceOptions) -> None:
        self.uri = uri
        self.retry = options.retrier(uri, credentials=CREDENTIALS_HINT)
        token = os.environ.get(HTTPS_TOKEN_ENV)
        self._connections = options.readers + 1
        self._client = HttpClient(origin=str(uri), connections=self._connections,
                                  stall_timeout_s=options.stall_timeout_s,
                                  headers={"Authorization": f"Bearer {token}"} if token else {})
        self._listed, self._algorithms = {}, {}
        self._if_match: dict[str, str] = {}
        """By key: the strong ETag each read names (absent: the server gave none)."""

    def close(self) -> None:
        self._client.close()

    def _url(self, key: str) -> str:
        return str(self.uri) + urllib.parse.quote(key)

    def list(self, include: Iterable[str], *, checked_bytes: int | None = None
             ) -> list[ObjectIdentity]:
        patterns = tuple(include)
        url = self._url(LISTING_FILE)
        text = self.retry.run(f"{self.uri}{LISTING_FILE}",
                              lambda: read_all(self._client.request("GET", url).response))
        try:
            files = [f for f in parse(text, f"{self.uri}{LISTING_FILE}")
                     if matches(f.name, patterns)]
        except ValueError as exc:
            raise SourceError(str(exc), hint=f"write the listing with python -m "
                              f"dlo_loader.sources.listing_file DIR > DIR/{LISTING_FILE}") from None
        if not files:
            raise nothing_matched(self.uri, patterns, self.retry.names)
        with ThreadPoolExecutor(max_workers=min(len(files), self._connections)) as pool:
            found = list(pool.map(self._identified, files))
        return sorted(found, key=lambda o: o.key)

    def _identified(self, listed: ListedFile) -> ObjectIdentity:
        """The file as the server has it now (a HEAD), checked against its listing."""
        what = f"{self.uri}{listed.name}"
        answer = self.retry.run(what, lambda: self._head(listed.name))
        length = answer.response.headers.get("Content-Length")
        if length is not None and int(length) != listed.size:
            raise SourceError(f"{what}: the server has {length} bytes, the listing says "
                              f"{listed.size}", hint=f"write {LISTING_FILE} again")
        etag = answer.response.headers.get("ETag", "")
        checked = listed.checked
        if etag.startswith('"'):
            self._if_match[listed.name] = etag
            identity = etag.strip('"')
        elif checked is not None:
            identity = ":".join(checked)
        else:
            raise SourceError(f"{what}: the server sends no strong ETag and the listing no "
                              "digest, so a file replaced mid-fill could not be told apart",
                              hint=f"list a digest in {LISTING_FILE} (sha256 or a CRC)")
        if checked is not None:
            algorithm, value = checked
            self._listed[listed.name] = StoreChecksum(algorithm, value)
            if algorithm in CRC_ALGORITHMS:
                self._algorithms[listed.name] = algorithm
        return ObjectIdentity(listed.name, listed.size, identity)

    def _head(self, key: str) -> Answer:
        answer = self._client.request("HEAD", self._url(key))
        answer.response.release_conn()
        return answer

    @contextlib.contextmanager
    def _body(self, obj: ObjectIdentity, start: int, length: int) -> Iterator[HttpBody]:
        etag = self._if_match.get(obj.key)
        headers = {"If-Match": etag} if etag else {}
        with self._client.ranged(self._url(obj.key), start, length, headers) as (answer, body):
            said, total = answer.response.headers.get("ETag"), size_of(answer)
            changed = None
            if etag and said and said != etag:
                changed = f"ETag {said}, listed {etag}"
            elif total is not None and total != obj.size:
                changed = f"size {total}, listed {obj.size}"
            if changed:
                raise source_changed(f"{self.uri}{obj.key}", changed)
            yield body


def open_source(uri: SourceAddress, options: SourceOptions) -> HttpsSource:
    """The `https://` reader of `uri`."""
    return HttpsSource(uri, options)


__all__ = ["HttpsSource", "open_source"]
