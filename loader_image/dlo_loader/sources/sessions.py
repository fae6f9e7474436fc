"""What the `gs` and `az` readers share: a listing in one call, and ranged GETs through the
official client's own `requests` session, read into the caller's buffer.

Owns `ListedBlobs` (`list` from the reader's one listing call: globs, identities, the empty
listing's error), `pool` (the session's connection pool sized for the readers, without urllib3's
own retries), `transport_errors` (a `requests` failure as `Stalled`, or as a `ConnectionError`
the `Retrier` retries) and `ranged_body` (an answer of a ranged GET checked against the listing:
the status and span asked for, the object's total size and version identity, read straight into
the caller's buffer by `http_reads.HttpBody`). Why the clients' own downloads are not used:
[Note: client downloads]. Retries nothing itself; must not log or raise anything that carries a
credential (a header, a signed URL's query).

[Note: client downloads] google-cloud-storage's `Blob.download_to_file(start=, end=)` and azure-
storage-blob's `download_blob(offset=, length=).readinto()` each hand the caller `bytes` objects
the client read, never the caller's buffer, and Azure's splits a range into 4 MiB GETs one after
another. Against the emulators on loopback (`python -m dlo_bench.source_clients`: a 256 MiB
object read whole into a buffer, best of three, on a shared 2-core machine), the clients' own
downloads took 1.3-1.7 (GCS) and 2.5-3.4 (Azure) CPU-seconds per GiB in the reading process; one
GET through the same authorized session (or signing pipeline) read into the buffer took 0.3-0.4,
at 3-5x the throughput (GCS 1.8 GB/s against 0.5, Azure 0.4 against 0.08). So the readers keep
the clients for what they are good at (credentials, signing, listing, endpoints) and send each
ranged GET through the client's session themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import requests
import requests.adapters

from dlo_loader.errors import SourceChanged
from dlo_loader.source_retry import ShortBody, Stalled, StoreStatus
from dlo_loader.sources.http_reads import HttpBody
from dlo_loader.sources.seam import ListedChecksums, RangedReads, matches, nothing_matched
from dlo_contract.cache import ObjectIdentity

CONNECT_TIMEOUT_S = 10.0


class ListedBlobs(ListedChecksums, RangedReads):
    """A reader whose listing is one call: `_blobs()` answers every object under the prefix
    (each with its `name`), and `_object(key, blob)` makes one the fill reads, noting its
    store checksum."""

    def list(self, include: Iterable[str], *, checked_bytes: int | None = None
             ) -> list[ObjectIdentity]:
        """The objects under the prefix whose key relative to it matches a glob, by key."""
        patterns = tuple(include)
        found = []
        for blob in self.retry.run(f"listing {self.uri}", self._blobs):
            key = blob.name[len(self.uri.prefix):]
            if matches(key, patterns):
                found.append(self._object(key, blob))
        if not found:
            raise nothing_matched(self.uri, patterns, self.retry.names)
        return sorted(found, key=lambda o: o.key)

    def _blobs(self) -> list[Any]:
        raise NotImplementedError

    def _object(self, key: str, blob: Any) -> ObjectIdentity:
        raise NotImplementedError


def pool(session: requests.Session, connections: int) -> None:
    """Mount adapters keeping `connections` connections per host, with no retries of
    urllib3's own (the reader's `Retrier` decides)."""
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=connections,
                                            max_retries=0)
    session.mount("https://", adapter)
    session.mount("http://", adapter)


@contextlib.contextmanager
def transport_errors(stall_timeout_s: float) -> Iterator[None]:
    """`requests`' failures as the seam's (`transport_error`)."""
    try:
        yield
    except requests.exceptions.RequestException as exc:
        raise transport_error(exc, stall_timeout_s) from exc


def transport_error(exc: requests.exceptions.RequestException,
                    stall_timeout_s: float) -> Exception:
    """A `requests` failure as the seam's: no answer for the stall timeout is `Stalled`, a
    connection not made or broken a `ConnectionError` (its text names no URL); raise it from
    `exc`, which keeps the chain the `Retrier` reads (an unreachable endpoint, a local error)."""
    if isinstance(exc, requests.exceptions.Timeout) and not isinstance(
            exc, requests.exceptions.ConnectTimeout):
        return Stalled(f"no answer for {stall_timeout_s:g} s")
    return ConnectionError(f"{type(exc).__name__} ({_cause(exc)})")


def _cause(exc: BaseException) -> str:
    """What broke, without the URL (an Azure SAS sits in its query): the first system error
    under `exc`, else the innermost exception's class."""
    seen: set[int] = set()
    current: BaseException | None = exc
    last = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return f"{type(current).__name__}: {current.strerror}"
        last = current
        reason = getattr(current, "reason", None)  # urllib3 keeps the cause there
        current = reason if isinstance(reason, BaseException) else (
            current.__cause__ or current.__context__ or (
                current.args[0] if current.args and isinstance(current.args[0], BaseException)
                else None))
    return type(last).__name__


@contextlib.contextmanager
def ranged_body(response: requests.Response, obj: ObjectIdentity, start: int, length: int, *,
                identity: str | None, where: str, stall_timeout_s: float,
                error_code: str = "") -> Iterator[HttpBody]:
    """The body of `response`, an answer to a GET of bytes `[start, start + length)` of `obj`,
    checked: an error answer is `StoreStatus` (with the store's `error_code`); another version
    (`identity`, the one the answer names; None: not named) or total size is `SourceChanged`;
    another span or length a `ShortBody`. Closed on the way out (its connection reused only
    when its body was read to the end)."""
    try:
        if response.status_code >= 400:
            raise StoreStatus(response.status_code, error_code)
        headers: Mapping[str, str] = response.headers
        span, _, size = headers.get("Content-Range", "").rpartition("/")
        changed = None
        if identity is not None and identity != obj.etag:
            changed = f"version {identity}, listed {obj.etag}"
        elif size and size != str(obj.size):
            changed = f"size {size}, listed {obj.size}"
        if changed:
            raise SourceChanged(
                f"{where}: the object changed since it was listed ({changed}); nothing was "
                "published",
                hint="do not overwrite a checkpoint while it is being loaded; rerun the fill")
        asked = f"bytes {start}-{start + length - 1}"
        if response.status_code != 206 or span != asked:
            raise ShortBody(f"status {response.status_code}, Content-Range "
                            f"{headers.get('Content-Range')!r}, asked for {asked!r}")
        got_length = headers.get("Content-Length")
        if got_length is not None and int(got_length) != length:
            raise ShortBody(f"Content-Length {got_length}, asked for {length}")
        yield HttpBody(response.raw, stall_timeout_s)
    finally:
        if response.raw.isclosed():  # read to its end: the connection goes back to the pool
            response.raw.release_conn()
        else:
            response.close()
