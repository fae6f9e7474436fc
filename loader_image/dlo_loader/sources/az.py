"""`az://account/container/prefix/` (or `https://account.blob.core.windows.net/container/...`):
Azure Blob Storage, listed with azure-storage-blob and read with ranged GETs sent through the
client's own pipeline (which signs them).

Owns the `az` reader: credentials from the environment the operator writes from the source's
Secret (`AZURE_STORAGE_CONNECTION_STRING`, whose `BlobEndpoint` may name an emulator; else
`AZURE_STORAGE_KEY` for the URI's account, or `AZURE_STORAGE_SAS_TOKEN`; without any, anonymous
reads of a public container), the endpoint (`loader.endpoint_url` where set, else the connection
string's, else `https://<account>.blob.core.windows.net`), the listing (name, size, ETag,
Content-MD5 of every blob under the prefix), and each range read straight into the caller's
buffer (see [Note: client downloads] in `sessions`). A blob's version identity is its ETag:
every read names it (`If-Match`, a 412 where the blob was replaced) and compares the ETag it is
answered with, so a replaced blob is `SourceChanged`, never a mixed file. Azure keeps no CRC of
a whole blob; its Content-MD5 (set for blobs written in one request, or by the uploader) is
compared with the file as written, before publication (`digest.FILE_HASHES`); blobs without one
are counted as unchecked. Must not log or raise anything that carries a credential (a key, a
SAS, a URL with its query).
"""

from __future__ import annotations

import contextlib
import logging
import os
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
    transport_error,
)
from dlo_contract.cache import ObjectIdentity
from dlo_contract.source_credentials import (
    AZURE_ACCOUNT_KEY_ENV,
    AZURE_CONNECTION_STRING_ENV,
    AZURE_SAS_TOKEN_ENV,
)
from dlo_contract.source_uri import AZURE_BLOB_HOST, SourceAddress

CREDENTIALS_HINT = (f"check the loader's Azure credentials ({AZURE_CONNECTION_STRING_ENV}, "
                    f"{AZURE_ACCOUNT_KEY_ENV} or {AZURE_SAS_TOKEN_ENV} from the source's Secret) "
                    "and the container's access policy")
CHECKSUM = "md5"
"""The store's checksum of a whole blob where it keeps one (Content-MD5)."""
_CLIENT_LOG = logging.getLogger(f"{__name__}.client")
"""Where the client logs every request and answer (headers, redacted, at INFO): quiet unless
set lower, or each ranged GET would write a screenful to the loader's log."""
_CLIENT_LOG.setLevel(logging.WARNING)


def open_source(uri: SourceAddress, options: SourceOptions) -> AzureSource:
    return AzureSource(uri, options)


class AzureSource(ListedBlobs):
    """One container client whose pipeline (and `requests` session) the reader threads
    share."""

    def __init__(self, uri: SourceAddress, options: SourceOptions) -> None:
        import requests
        from azure.core.pipeline.transport import RequestsTransport

        self.uri = uri
        self.retry = options.retrier(uri, credentials=CREDENTIALS_HINT)
        self.stall_timeout_s = options.stall_timeout_s
        self._session = requests.Session()
        pool(self._session, options.readers + 1)
        transport = RequestsTransport(session=self._session, session_owner=False,
                                      connection_timeout=CONNECT_TIMEOUT_S,
                                      read_timeout=options.stall_timeout_s)
        self._container = _service(uri, options.endpoint_url, transport).get_container_client(
            uri.container)
        self._urls: dict[str, str] = {}
        """By key, from the last `list`: the blob's URL (with a SAS in its query, if one)."""
        self._listed: dict[str, StoreChecksum] = {}
        self._algorithms: dict[str, str] = {}

    def close(self) -> None:
        self._container.close()
        self._session.close()

    def _object(self, key: str, blob: Any) -> ObjectIdentity:
        """Its ETag as its identity, its Content-MD5 (where it has one) as the store's
        checksum; its URL kept for the reads."""
        self._urls[key] = self._container.get_blob_client(blob.name).url
        md5 = blob.content_settings.content_md5  # none: the blob counts as unchecked
        self._listed[key] = StoreChecksum(CHECKSUM, bytes(md5).hex()) if md5 else StoreChecksum(
            None)
        return ObjectIdentity(key, int(blob.size), str(blob.etag).strip('"'))

    def _blobs(self) -> list[Any]:
        with _azure_errors(self.stall_timeout_s):
            return list(self._container.list_blobs(name_starts_with=self.uri.prefix))

    @contextlib.contextmanager
    def _body(self, obj: ObjectIdentity, start: int, length: int) -> Iterator[HttpBody]:
        """A GET of the range on the condition of the listed ETag, signed by the pipeline. The
        range goes in `x-ms-range`: the client's shared-key signature leaves out `Range`."""
        from azure.core.rest import HttpRequest

        request = HttpRequest("GET", self._urls[obj.key], headers={
            "x-ms-range": f"bytes={start}-{start + length - 1}", "If-Match": f'"{obj.etag}"',
            "x-ms-version": self._container.api_version})
        with _azure_errors(self.stall_timeout_s):
            answer = self._container._pipeline.run(request, stream=True).http_response
        response = answer.internal_response  # the `requests` response, its body unread
        with ranged_body(response, obj, start, length,
                         identity=response.headers.get("ETag", "").strip('"') or None,
                         where=f"{self.uri}{obj.key}", stall_timeout_s=self.stall_timeout_s,
                         error_code=response.headers.get("x-ms-error-code", "")) as body:
            yield body


@contextlib.contextmanager
def _azure_errors(stall_timeout_s: float) -> Iterator[None]:
    """The Azure client's errors as the seam's: an error answer is `StoreStatus`, a transport
    failure what `sessions.transport_error` makes of the `requests` error under it."""
    import requests
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ServiceRequestError,
        ServiceResponseError,
    )

    try:
        yield
    except ClientAuthenticationError as exc:
        if exc.status_code is not None:  # the service's answer
            raise StoreStatus(int(exc.status_code), _code(exc)) from None
        # Signing failed here, no request sent (a key that is not base64): denied all the same.
        raise StoreStatus(401, type(exc).__name__) from None
    except HttpResponseError as exc:
        raise StoreStatus(int(exc.status_code or 0), _code(exc)) from None
    except (ServiceRequestError, ServiceResponseError) as exc:
        inner = exc.inner_exception
        if isinstance(inner, requests.exceptions.RequestException):
            raise transport_error(inner, stall_timeout_s) from inner
        raise ConnectionError(type(exc).__name__) from exc


def _code(exc: Exception) -> str:
    """The service's error code of an error answer (a `StorageErrorCode`, a str enum)."""
    code = getattr(exc, "error_code", None)
    return str(getattr(code, "value", code) or "")


def _service(uri: SourceAddress, endpoint_url: str | None, transport: Any) -> Any:
    """The account's service client, with the first credentials the environment holds (see the
    module docstring), no retries of its own (the reader's `Retrier` decides)."""
    from azure.storage.blob import BlobServiceClient

    settings: dict[str, Any] = {"transport": transport, "retry_total": 0, "logger": _CLIENT_LOG}
    connection_string = os.environ.get(AZURE_CONNECTION_STRING_ENV)
    if connection_string:
        try:
            service = BlobServiceClient.from_connection_string(connection_string, **settings)
        except ValueError:
            raise SourceError(f"{AZURE_CONNECTION_STRING_ENV} is not an Azure Storage "
                              f"connection string (reading {uri})",
                              hint=CREDENTIALS_HINT) from None
        if service.account_name != uri.account:
            raise SourceError(
                f"{AZURE_CONNECTION_STRING_ENV} is for account {service.account_name!r}, the "
                f"source {uri} is in account {uri.account!r}", hint=CREDENTIALS_HINT)
        if not endpoint_url:
            return service
        return BlobServiceClient(endpoint_url, credential=service.credential, **settings)
    account_url = endpoint_url or f"https://{uri.account}{AZURE_BLOB_HOST}"
    key, sas = os.environ.get(AZURE_ACCOUNT_KEY_ENV), os.environ.get(AZURE_SAS_TOKEN_ENV)
    credential: Any = ({"account_name": uri.account, "account_key": key} if key else
                       sas.lstrip("?") if sas else None)
    return BlobServiceClient(account_url, credential=credential, **settings)
