"""`hf://org/repo[@revision][/folder/]`: a model repository of the Hugging Face Hub, read at one
commit with ranged GETs of its resolve URLs (`http_reads`).

Owns `HubSource`. The listing is one call of the Hub's API, `GET /api/models/{repo}/revision/
{revision}?blobs=true` (what `huggingface_hub.HfApi.model_info(files_metadata=True)` asks): the
commit the revision names now (`sha`; every read is of that commit, so a branch moved mid-fill
changes nothing) and each file's size, git blob id and, for a file stored with LFS, its
sha256. A file's version identity is its LFS sha256 (else its blob id), with the commit as its
`version_id`. A read is `GET {endpoint}/{repo}/resolve/{commit}/{path}` with a `Range`,
following the redirect to the Hub's storage; the first
answer's `X-Linked-Etag` (else `ETag`) and `X-Linked-Size` must be the listed ones, and the
bytes' total size the listed size (else `SourceChanged`). The storage URL it redirected to (a
signed one) serves the file's next reads directly, one round trip instead of two, until the
storage refuses it (its signature expired) and the resolve URL is asked again. The store
checksums are the LFS sha256 and the git blob id of every file, each checked against the
written file. The endpoint is `loader.endpoint_url`, else `HF_ENDPOINT`, else the public Hub; a
token in `HF_TOKEN` goes with every request to the endpoint's origin and with none to another
host: not past the redirect, not to a saved storage URL read directly (`HttpClient`'s origin is
the endpoint's, whatever URL a read starts from). Called through `dlo_loader.sources`.
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from dlo_loader.digest import StoreChecksum
from dlo_loader.errors import SourceError
from dlo_loader.source_retry import StoreStatus
from dlo_loader.sources.http_reads import Answer, HttpBody, HttpClient, size_of
from dlo_loader.sources.seam import (
    ListedChecksums,
    RangedReads,
    SourceOptions,
    matches,
    nothing_matched,
    source_changed,
)
from dlo_contract.cache import ObjectIdentity
from dlo_contract.source_credentials import HF_TOKEN_ENV
from dlo_contract.source_uri import SourceAddress

PUBLIC_ENDPOINT = "https://huggingface.co"
ENDPOINT_ENV = "HF_ENDPOINT"
"""huggingface_hub's own name for a Hub mirror's address."""
DEFAULT_REVISION = "main"
CREDENTIALS_HINT = (f"check the Hub token the loader sends ({HF_TOKEN_ENV}, from the source's "
                    "Secret): a gated or private repository needs one with read access")


def _etag(value: str | None) -> str:
    """An ETag as the Hub's client compares it: without `W/` and quotes."""
    return (value or "").removeprefix("W/").strip('"')


class HubSource(RangedReads, ListedChecksums):
    """The files of one repository folder at one commit (see the module docstring)."""

    def __init__(self, uri: SourceAddress, options: SourceOptions) -> None:
        self.uri = uri
        self.retry = options.retrier(uri, credentials=CREDENTIALS_HINT)
        self._endpoint = (options.endpoint_url or os.environ.get(ENDPOINT_ENV)
                          or PUBLIC_ENDPOINT).rstrip("/")
        self._revision = urllib.parse.unquote(uri.revision or DEFAULT_REVISION)
        token = os.environ.get(HF_TOKEN_ENV)
        self._client = HttpClient(origin=self._endpoint, connections=options.readers + 1,
                                  stall_timeout_s=options.stall_timeout_s,
                                  headers={"Authorization": f"Bearer {token}"} if token else {})
        self._listed, self._algorithms = {}, {}
        self.commit: str | None = None
        """The commit the last `list` found the revision at."""
        self._locations: dict[str, str] = {}
        """By key: where its resolve URL redirected (checked then), read from directly until
        the storage refuses it (an expired signature)."""

    def close(self) -> None:
        self._client.close()

    def list(self, include: Iterable[str], *, checked_bytes: int | None = None
             ) -> list[ObjectIdentity]:
        patterns = tuple(include)
        repo = self.uri.container
        url = (f"{self._endpoint}/api/models/{repo}/revision/"
               f"{urllib.parse.quote(self._revision, safe='')}?blobs=true")
        info = self.retry.run(f"listing {self.uri}", lambda: self._client.json(url))
        try:
            self.commit = str(info["sha"])
            found = self._objects(info["siblings"], patterns)
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"listing {self.uri}: the Hub's answer has no commit and files "
                              f"({type(exc).__name__}: {exc})",
                              hint=f"check {self.retry.names('loader.endpoint_url')}") from None
        if not found:
            raise nothing_matched(self.uri, patterns, self.retry.names)
        return sorted(found, key=lambda o: o.key)

    def _objects(self, siblings: list[Mapping[str, Any]], include: tuple[str, ...]
                 ) -> list[ObjectIdentity]:
        found, prefix = [], self.uri.prefix
        self._listed = {}
        for sibling in siblings:
            name = str(sibling["rfilename"])
            key = name[len(prefix):]
            if not name.startswith(prefix) or not matches(key, include):
                continue
            lfs = sibling.get("lfs")
            if lfs:
                identity = str(lfs["sha256"])
                self._listed[key] = StoreChecksum("sha256", identity)
            else:
                identity = str(sibling["blobId"])
                self._listed[key] = StoreChecksum("git-sha1", identity)
            size = int(lfs["size"] if lfs else sibling["size"])
            found.append(ObjectIdentity(key, size, identity, version_id=self.commit))
        return found

    @contextlib.contextmanager
    def _body(self, obj: ObjectIdentity, start: int, length: int) -> Iterator[HttpBody]:
        with contextlib.ExitStack() as stack:
            answer, body = self._opened(stack, obj, start, length)
            total = size_of(answer)
            if total is not None and total != obj.size:
                raise self._changed(obj, f"size {total}, listed {obj.size}")
            yield body

    def _opened(self, stack: contextlib.ExitStack, obj: ObjectIdentity, start: int,
                length: int) -> tuple[Answer, HttpBody]:
        """A ranged answer for `obj`: from where its resolve URL last redirected (the Hub's
        storage, a signed URL), else from the resolve URL, whose first answer must name the
        listed file (see the module docstring)."""
        location = self._locations.get(obj.key)
        if location is not None:
            try:
                return stack.enter_context(self._client.ranged(location, start, length))
            except StoreStatus as exc:
                if exc.status >= 500 or exc.status == 429:
                    raise
                self._locations.pop(obj.key, None)  # a signature expired: resolve again
        path = urllib.parse.quote(self.uri.prefix + obj.key)
        url = f"{self._endpoint}/{self.uri.container}/resolve/{obj.version_id}/{path}"
        answer, body = stack.enter_context(self._client.ranged(url, start, length))
        said = _etag(answer.first.get("X-Linked-Etag") or answer.first.get("ETag"))
        linked_size = answer.first.get("X-Linked-Size")
        if said and said != obj.etag:
            raise self._changed(obj, f"ETag {said}, listed {obj.etag}")
        if linked_size is not None and int(linked_size) != obj.size:
            raise self._changed(obj, f"X-Linked-Size {linked_size}, listed {obj.size}")
        if answer.location != url:
            self._locations[obj.key] = answer.location
        return answer, body

    def _changed(self, obj: ObjectIdentity, how: str) -> Exception:
        return source_changed(
            f"{self.uri}{obj.key} at commit {obj.version_id}", how,
            hint="the Hub (or a mirror) served another file for the commit; rerun the fill, "
                 "or check the endpoint")


def open_source(uri: SourceAddress, options: SourceOptions) -> HubSource:
    """The `hf://` reader of `uri`."""
    return HubSource(uri, options)


__all__ = ["HubSource", "open_source"]
