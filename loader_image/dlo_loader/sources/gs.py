"""`gs://bucket/prefix/`: Google Cloud Storage, listed with google-cloud-storage and read with
ranged media downloads sent through the client's own authorized session.

Owns the `gs` reader: credentials from the client's default chain (a service-account key file
named by `GOOGLE_APPLICATION_CREDENTIALS`, which the operator mounts from the source's Secret,
else the pod's workload identity; `STORAGE_EMULATOR_HOST` points the client at an emulator,
unauthenticated; `loader.endpoint_url` at another endpoint), the listing (name, size,
generation, CRC32C of every object under the prefix), and each range read straight into the
caller's buffer (see [Note: client downloads] in `sessions`). An object's version identity is
its generation: every read names it (`ifGenerationMatch`, a 412 where the object was replaced)
and compares the `X-Goog-Generation` it is answered with (an emulator may ignore the
precondition), so a replaced object is `SourceChanged`, never a mixed file. GCS keeps a CRC32C
of every whole object, so chunks are hashed with it and the fill compares the combined figure
with the store's before publishing, as for S3's CRC64-NVME. Must not log or raise anything that
carries a credential.
"""

from __future__ import annotations

import base64
import contextlib
import urllib.parse
from collections.abc import Iterator
from typing import Any

from dlo_loader.digest import StoreChecksum
from dlo_loader.errors import SourceError
from dlo_loader.source_retry import StoreStatus
from dlo_loader.sources.http_reads import HttpBody
from dlo_loader.sources.seam import SourceOptions
from dlo_loader.sources.sessions import (
    CONNECT_TIMEOUT_S,
    ListedBlobs,
    pool,
    ranged_body,
    transport_errors,
)
from dlo_contract.cache import ObjectIdentity
from dlo_contract.source_credentials import GOOGLE_APPLICATION_CREDENTIALS_ENV
from dlo_contract.source_uri import SourceAddress

CREDENTIALS_HINT = (f"check the loader's GCS credentials ({GOOGLE_APPLICATION_CREDENTIALS_ENV}, "
                    "a service-account key from the source's Secret, or the pod's workload "
                    "identity) and the bucket's IAM policy")
CHECKSUM = "crc32c"
"""The store's checksum of every whole object (`crc32c` in its listing, base64, big-endian)."""
_LISTED_FIELDS = "items(name,size,generation,crc32c),nextPageToken"


def open_source(uri: SourceAddress, options: SourceOptions) -> GcsSource:
    return GcsSource(uri, options)


class GcsSource(ListedBlobs):
    """One google-cloud-storage client whose session the reader threads share."""

    def __init__(self, uri: SourceAddress, options: SourceOptions) -> None:
        self.uri = uri
        self.retry = options.retrier(uri, credentials=CREDENTIALS_HINT)
        self.stall_timeout_s = options.stall_timeout_s
        self._client = _client(uri, options.endpoint_url)
        self._session = self._client._http  # the client's authorized session
        pool(self._session, options.readers + 1)
        self._listed: dict[str, StoreChecksum] = {}
        self._algorithms: dict[str, str] = {}

    def close(self) -> None:
        self._session.close()

    def _object(self, key: str, blob: Any) -> ObjectIdentity:
        """Its generation as its identity, its CRC32C as the store's checksum."""
        if blob.crc32c:
            self._listed[key] = StoreChecksum(CHECKSUM, base64.b64decode(blob.crc32c).hex())
            self._algorithms[key] = CHECKSUM
        return ObjectIdentity(key, int(blob.size), str(blob.generation))

    def _blobs(self) -> list[Any]:
        with _google_errors(self.stall_timeout_s):
            return list(self._client.list_blobs(
                self.uri.container, prefix=self.uri.prefix, fields=_LISTED_FIELDS, retry=None,
                timeout=(CONNECT_TIMEOUT_S, self.stall_timeout_s)))

    @contextlib.contextmanager
    def _body(self, obj: ObjectIdentity, start: int, length: int) -> Iterator[HttpBody]:
        """A media download of the range, on the condition of the listed generation. Asks for
        the stored bytes (`Accept-Encoding: gzip`): an object stored compressed is then served
        as listed (its size, its CRC32C), not decompressed on the way."""
        name = urllib.parse.quote(self.uri.prefix + obj.key, safe="")
        bucket = urllib.parse.quote(self.uri.container, safe="")
        url = f"{self._client.api_endpoint}/download/storage/v1/b/{bucket}/o/{name}"
        with _google_errors(self.stall_timeout_s):
            response = self._session.get(
                url, params={"alt": "media", "ifGenerationMatch": obj.etag}, stream=True,
                headers={"Range": f"bytes={start}-{start + length - 1}",
                         "Accept-Encoding": "gzip"},
                timeout=(CONNECT_TIMEOUT_S, self.stall_timeout_s))
            code = _answer_reason(response) if response.status_code >= 400 else ""
        with ranged_body(response, obj, start, length,
                         identity=response.headers.get("X-Goog-Generation"),
                         where=f"{self.uri}{obj.key}", stall_timeout_s=self.stall_timeout_s,
                         error_code=code) as body:
            yield body


@contextlib.contextmanager
def _google_errors(stall_timeout_s: float) -> Iterator[None]:
    """The GCS client's errors as the seam's: an error answer is `StoreStatus`; credentials
    that cannot be refreshed (a revoked key, no workload identity) a 401 unless google-auth
    says a retry may help; transport failures what `sessions.transport_errors` makes of them."""
    import google.auth.exceptions as auth
    from google.api_core import exceptions

    try:
        with transport_errors(stall_timeout_s):
            yield
    except exceptions.GoogleAPICallError as exc:
        raise StoreStatus(int(exc.code or 0), _reason(exc.errors)) from None
    except auth.RefreshError as exc:
        if getattr(exc, "retryable", False):
            raise ConnectionError(f"credentials refresh: {type(exc).__name__}") from exc
        raise StoreStatus(401, "credentials refresh failed") from None
    except auth.TransportError as exc:
        raise ConnectionError(f"credentials refresh: {type(exc).__name__}") from exc


def _client(uri: SourceAddress, endpoint_url: str | None) -> Any:
    """The storage client of the default chain (or the emulator), at `endpoint_url` if set."""
    import google.auth.exceptions
    from google.cloud import storage

    try:
        return storage.Client(
            project=None,  # a listing and reads of one bucket bill no project
            client_options={"api_endpoint": endpoint_url} if endpoint_url else None)
    except google.auth.exceptions.DefaultCredentialsError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SourceError(f"no GCS credentials for {uri}: {first}",
                          hint=CREDENTIALS_HINT) from None


def _reason(errors: Any) -> str:
    """The first error reason of a JSON API error answer (`forbidden`, `notFound`), if any."""
    first = errors[0] if isinstance(errors, list) and errors else {}
    return str(first.get("reason", "")) if isinstance(first, dict) else ""


def _answer_reason(response: Any) -> str:
    """The reason an error answer of a download gives in its JSON body, if it is one."""
    try:
        return _reason(response.json().get("error", {}).get("errors"))
    except (ValueError, AttributeError):
        return ""
