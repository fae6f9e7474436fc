"""How the object store seam retries: what a failure is, and whether and when to ask again.

Owns the retry loop of every store call (`Retrier.run`): exponential backoff with full jitter on
throttling (503 SlowDown), other 5xx, connection resets and short bodies; at once on a new
connection after a stall; never for an error of this node (`EMFILE`, `ENOSPC`: raised as
`LocalResourceError`) nor for an answer that will not change (401, 403, 404, a replaced object).
Each failure becomes a `Retry` (a `RetryKind` and the text logs and messages show), so the loop
is steered by the kind, not by the text. An error answer is S3's `ClientError` or, from every
other scheme, a `StoreStatus`; both are judged by their HTTP status and code alike. Called by
every source of `dlo_loader.sources`, which hold the clients; it makes no call to a store itself
and must not log or raise anything that carries a credential.
"""

from __future__ import annotations

import enum
import errno
import http.client
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import botocore.exceptions as bexc
import urllib3.exceptions

from dlo_loader import metrics
from dlo_loader.errors import LocalResourceError, SourceChanged, SourceError, SourceUnavailable
from dlo_contract.field_names import Names, document_names

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_BACKOFF_BASE_S = 0.1
_BACKOFF_CAP_S = 5.0
_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                             "InternalError", "ServiceUnavailable", "RequestLimitExceeded"})
_RETRYABLE = (bexc.ConnectionError, bexc.IncompleteReadError, bexc.ResponseStreamingError,
              bexc.FlexibleChecksumError,
              urllib3.exceptions.HTTPError, http.client.HTTPException, ConnectionError,
              TimeoutError)

_LOCAL_ERRNOS = {errno.EMFILE: "too many open files", errno.ENFILE: "too many open files",
                 errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                 errno.ENOMEM: "out of memory"}
_LOCAL_HINTS: dict[int, Callable[[Names], str]] = {
    errno.EMFILE: lambda n: "raise the loader container's open-file limit (ulimit -n)",
    errno.ENFILE: lambda n: "the node's open-file table is full (fs.file-max)",
    errno.ENOSPC: lambda n: f"free space on the node, or lower {n('loader.readers')}",
    errno.ENOMEM: lambda n: f"lower {n('loader.memory_limit_bytes')} or give the loader more "
                            "memory"}
"""Errors of this node, whatever call they surface in (botocore wraps a socket's EMFILE in an
`EndpointConnectionError`): a retry against the store cannot fix them. Each hint names the
settings through the fill's namer."""


class ShortBody(Exception):
    """The server sent fewer (or more) bytes than the range asked for."""


class StoreStatus(Exception):
    """An error answer of a store that is not S3 (S3's come as botocore's `ClientError`): its
    HTTP status and the store's error code, if it sent one. A source raises it for any answer
    that is not the bytes asked for; the `Retrier` decides from the status alone (see
    `_status_retry`), so every scheme retries and reports alike."""

    def __init__(self, status: int, code: str = "") -> None:
        super().__init__(f"{code or 'HTTP'} ({status})")
        self.status, self.code = status, code


class Stalled(Exception):
    """The body sent no bytes for the stall timeout."""


class RetryKind(enum.Enum):
    """Why a store call is asked again, which decides how."""

    STALLED = "stalled"
    """No bytes for the stall timeout: asked again at once, on a new connection."""
    SHORT_BODY = "short body"
    """A body of another length or span than asked: asked again after a backoff."""
    STORE = "store"
    """The store answered throttling or a server error: asked again after a backoff."""
    CONNECTION = "connection"
    """The connection broke: asked again after a backoff."""
    UNREACHABLE = "unreachable"
    """No connection could be made (refused, no route, no name, connect timeout): asked again
    after a backoff, and given up on as a store that cannot be reached, not a failing one."""


@dataclass(frozen=True)
class Retry:
    """One failed attempt: its kind and what logs and the final error say of it."""

    kind: RetryKind
    text: str
    endpoint: str = ""
    """Where a connection could not be made (`scheme://host:port`), when the error says."""

    @property
    def at_once(self) -> bool:
        return self.kind is RetryKind.STALLED


class Retrier:
    """Runs store calls with the loader's retry policy (see the module docstring)."""

    def __init__(self, source: str, *, attempts: int, stop: threading.Event,
                 on_stall: Callable[[str], None] = lambda what: None,
                 names: Names = document_names,
                 credentials: str = "check the loader's credentials and the bucket policy",
                 address: str = "loader.endpoint_url") -> None:
        """`source`: the store's URI, for the error without credentials; `on_stall(what)` is
        told of every stall; `names` spells the settings in hints; `credentials`: the hint of
        an access denied (where the scheme's credentials come from, never their values);
        `address`: the setting that says where the store is (the endpoint, or the source URI
        itself where the scheme's public endpoint is used), named when it cannot be reached."""
        self.source, self.attempts, self.stop = source, attempts, stop
        self.on_stall, self.names, self.credentials = on_stall, names, credentials
        self.address = address

    def run(self, what: str, call: Callable[[], _T]) -> _T:
        """Run `call`, retrying transient failures; `what` names the call in logs and errors."""
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
            except bexc.NoCredentialsError as exc:
                raise SourceError(
                    f"no S3 credentials for {self.source}", hint=self.credentials) from exc
            except Exception as exc:  # noqa: BLE001 - `_retry_of` re-raises what is not retried
                retry = self._retry_of(exc, what)
            if attempt == self.attempts or self.stop.is_set():
                break
            metrics.record_retry(retry.text)  # metrics: retries by reason class
            if retry.at_once:
                log.warning("%s: %s; asking again at once on a new connection (%d/%d)",
                            what, retry.text, attempt, self.attempts - 1)
                continue
            delay = random.uniform(0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2 ** attempt))
            log.warning("%s: %s; retry %d/%d in %.2f s",
                        what, retry.text, attempt, self.attempts - 1, delay)
            if self.stop.wait(delay):
                break
        raise SourceUnavailable(
            f"{what}: gave up after {attempt} attempt(s); last error: {retry.text}",
            hint=self._give_up_hint(retry))

    def _retry_of(self, exc: Exception, what: str) -> Retry:
        """The retry `exc` calls for; raises it (or the permanent error it means) otherwise."""
        if isinstance(exc, bexc.ClientError):
            error = exc.response.get("Error", {})
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            return self._status_retry(exc, status, str(error.get("Code", "")), what)
        if isinstance(exc, StoreStatus):
            return self._status_retry(exc, exc.status, exc.code, what)
        if isinstance(exc, ShortBody):
            return Retry(RetryKind.SHORT_BODY, f"short body: {exc}")
        if isinstance(exc, Stalled):
            self.on_stall(f"{what}: {exc}; asked again")
            return Retry(RetryKind.STALLED, f"stalled: {exc}")
        if isinstance(exc, _RETRYABLE):
            raise_if_local(exc, what, self.names)
            unreachable = _unreachable(exc)
            kind = RetryKind.CONNECTION if unreachable is None else RetryKind.UNREACHABLE
            return Retry(kind, f"{type(exc).__name__}: {exc}", unreachable or "")
        if isinstance(exc, OSError):
            raise_if_local(exc, what, self.names)
        raise exc

    def _status_retry(self, exc: Exception, status: int, code: str, what: str) -> Retry:
        """The retry an error answer calls for, or a permanent `SourceError` for the rest."""
        if status >= 500 or status == 429 or code in _THROTTLE_CODES:
            return Retry(RetryKind.STORE, f"{code or 'HTTP'} ({status})")
        if status == 412 or code == "PreconditionFailed":
            raise SourceChanged(
                f"{what}: the object changed since it was listed (ETag no longer matches)",
                hint="do not overwrite a checkpoint while it is being loaded; rerun the fill",
            ) from exc
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket"):
            raise SourceError(f"{what}: not found ({code or status})",
                              hint=f"check {self.names('loader.source')}") from exc
        if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId",
                                            "SignatureDoesNotMatch"):
            raise SourceError(f"{what}: access denied ({code or status})",
                              hint=self.credentials) from exc
        raise SourceError(f"{what}: {code or 'HTTP error'} ({status})") from exc

    def _give_up_hint(self, retry: Retry) -> str:
        if retry.kind is RetryKind.STALLED:
            return ("the object store (or the network to it) stops sending mid-object; check "
                    "its health and the path to it, then rerun (more retries only wait longer)")
        if retry.kind is RetryKind.UNREACHABLE:
            return (f"the object store{f' at {retry.endpoint}' if retry.endpoint else ''} "
                    "cannot be reached (no connection could be made); check "
                    f"{self.names(self.address)}, that the store is up, and the "
                    "loader's network path (and DNS) to it")
        return ("the object store is throttling or failing; raise "
                f"{self.names('loader.max_retries')} or retry later")


_CONNECT_ERRORS = (bexc.EndpointConnectionError, bexc.ConnectTimeoutError,
                   urllib3.exceptions.ConnectTimeoutError, ConnectionRefusedError)
"""Failures to make a connection at all (urllib3's `NewConnectionError`, a refused or
unresolved connection, is one of its connect errors)."""


def _unreachable(exc: BaseException) -> str | None:
    """None when `exc` is not a failure to connect; else the endpoint (`scheme://host:port`)
    it names, or "" when it names none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _CONNECT_ERRORS):
            url = (getattr(current, "kwargs", None) or {}).get("endpoint_url", "")
            conn = getattr(current, "conn", None)
            if not url and conn is not None and getattr(conn, "host", None):
                url = f"{getattr(conn, 'scheme', 'http')}://{conn.host}:{conn.port}"
            parts = urlsplit(str(url))
            return f"{parts.scheme}://{parts.netloc}" if parts.netloc else ""
        reason = getattr(current, "reason", None)  # urllib3's MaxRetryError keeps it there
        current = (reason if isinstance(reason, BaseException)
                   else current.__cause__ or current.__context__)
    return None


def raise_if_local(exc: BaseException, what: str, names: Names) -> None:
    """Raise `LocalResourceError` when `exc` (or what it wraps) is an error of this node."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = getattr(current, "errno", None)
        if code in _LOCAL_ERRNOS:
            raise LocalResourceError(
                f"{what}: {_LOCAL_ERRNOS[code]} on this node ({errno.errorcode[code]}); not "
                "an object store failure, so not retried",
                hint=_LOCAL_HINTS[code](names) if code in _LOCAL_HINTS else None,
            ) from exc
        wrapped = getattr(current, "kwargs", None)  # botocore keeps the cause in kwargs
        wrapped = wrapped.get("error") if isinstance(wrapped, dict) else None
        if isinstance(wrapped, BaseException):
            current = wrapped
        else:
            current = current.__cause__ or current.__context__
