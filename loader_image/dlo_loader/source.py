"""The object store: listing a checkpoint prefix and reading byte ranges of its objects.

Owns every call to S3 (this is the only module that imports botocore): the client (endpoint, region,
path-style addressing, credentials from the standard chain: environment, web identity, instance
role), listing with include globs, and ranged GETs that retry with exponential backoff and full
jitter on throttling (503 SlowDown), other 5xx, connection resets, short bodies and bodies that
fail the store's checksum. Every read names the listed ETag (`If-Match`) and compares the
response's ETag, Content-Range and length with the listing (a store may ignore `If-Match`), so
an object replaced mid-fill is an error, never a mixed file; bodies go straight into the caller's
buffer (see [Note: one copy]). A body that sends no bytes for `stall_timeout_s` is abandoned and
its range asked again at once on a new connection. Running out of descriptors or disk
(`EMFILE`, `ENOSPC`) is this node's problem, not the store's: raised as `LocalResourceError` at
once, never retried. `checksums` asks the store for its checksums of objects (HEAD with
`ChecksumMode=ENABLED`), `list` for the part size of objects uploaded in parts (HEAD with
`PartNumber=1`). Called by `fill`. Must not log or raise anything that
carries a credential, and must not write files.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import http.client
import logging
import random
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import botocore.exceptions as bexc
import botocore.session
import urllib3
import urllib3.exceptions
from botocore.config import Config
from botocore.response import StreamingBody

from dlo_loader import digest, metrics
from dlo_loader.digest import ChecksumKind, StoreChecksum
from dlo_loader.errors import LocalResourceError, SourceChanged, SourceError, SourceUnavailable
from dlo_contract.cache import CRC_ALGORITHMS, ObjectIdentity
from dlo_contract.field_names import Names, document_names
from dlo_contract.settings import STREAM_PIECE_BYTES

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_PIECE_BYTES = 1 << 20
"""Read size on the public path: a piece stays in the CPU cache between urllib3's two copies."""
_DIRECT_PIECE_BYTES = STREAM_PIECE_BYTES
"""Most bytes one read asks for on the direct path (`http.client`'s buffered reader loops on the
socket until they are all in), then hashed at once: a reading alone's whole piece. [Note: read
size] Smaller reads cost more CPU than their calls explain: the kernel sizes a socket's receive
buffer by how much the reader takes at once (on loopback, where a round trip is short, 256 KiB
reads kept it several times smaller than 2 MiB reads, as `ss -tmi` shows), so small reads drain
a small buffer in more, smaller steps. `dlo bench loader` reports the loader's CPU-seconds per
GiB. 2 MiB is still in a core's L2 cache, or its share of L3, when it is hashed."""
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


class _ShortBody(Exception):
    """The server sent fewer (or more) bytes than the range asked for."""


class _Stalled(Exception):
    """The body sent no bytes for the stall timeout."""


@dataclass(frozen=True)
class SourceURI:
    """`s3://bucket/prefix/`; `prefix` is empty or ends with `/`."""

    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_source(uri: str, names: Names = document_names) -> SourceURI:
    """Split an `s3://bucket/prefix` URI; anything else is a configuration error naming the
    setting as `names` spells it."""
    scheme, sep, rest = uri.partition("://")
    bucket, _, prefix = rest.partition("/")
    if scheme != "s3" or not sep or not bucket:
        field = names("loader.source")
        raise SourceError(
            f"{field}={uri!r} is not an s3://bucket/prefix URI",
            hint=f"set {field} (or --source) to e.g. s3://models/flux-dev/",
        )
    prefix = prefix.strip("/")
    return SourceURI(bucket, prefix + "/" if prefix else "")


class ObjectStore:
    """One S3 client shared by the reader threads (botocore clients are thread-safe)."""

    def __init__(
        self, uri: SourceURI, *, endpoint_url: str | None, region: str | None, path_style: bool,
        readers: int, attempts: int, stop: threading.Event | None = None,
        stall_timeout_s: float = 30.0, on_stall: Callable[[str], None] | None = None,
        names: Names = document_names,
    ) -> None:
        """`names` spells the settings in messages (the fill's namer, `validation.names_for`)."""
        self.uri = uri
        self.names = names
        self.connections = readers + 1  # the readers, and one for the checksum HEADs
        self.attempts = attempts
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall or (lambda what: None)
        self.stop = stop or threading.Event()
        self.chunk_algorithms: dict[str, str] = {}
        """By relative key, from the last `list`: the digest of each object's chunks, the CRC
        the listing says the store keeps for it (`digest.algorithm_for`)."""
        self.part_bytes: dict[str, int] = {}
        """By relative key, from the last `list`: the part size of each object whose store
        checksum may be of its parts and whose layout allows checking it (see [Note: composite
        checksums] in `digest`)."""
        self._published: dict[str, StoreChecksum] = {}
        """By relative key: store checksums the last `list` asked for (see [Note: unlisted
        checksums])."""
        config = Config(
            s3={"addressing_style": "path" if path_style else "auto"},
            # Our own retry loop knows about short bodies and the fill deadline: one attempt here.
            retries={"total_max_attempts": 1},
            max_pool_connections=self.connections,
            connect_timeout=10,
            read_timeout=stall_timeout_s,  # per socket read: no byte for this long is a stall
        )
        # botocore's session, not boto3's: boto3 also imports s3transfer, a fifth of a second
        # of start-up before the first GET for nothing the loader uses.
        self._client = botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )

    def close(self) -> None:
        """Close the client's pooled connections."""
        self._client.close()

    def list(self, include: Iterable[str], *, checked_bytes: int | None = None
             ) -> list[ObjectIdentity]:
        """Objects under the prefix whose relative key matches a glob (`*` also matches `/`);
        each one's chunk digest, and the part size of those whose store checksum may be of
        their parts (a HEAD of the first part of each, at once).

        [Note: unlisted checksums] Objects of `checked_bytes` or more are the ones whose store
        checksum the fill checks. A store may keep a checksum without naming it in its listing
        (S3 names it; some S3-compatible stores, ministack among them, answer it only to a
        HEAD): for such an object a HEAD now, before the plan, says which CRC to hash its chunks
        with, so that the check needs no second pass; `checksums` keeps its answer."""
        patterns = tuple(include)
        found, algorithms, of_parts, unlisted = [], {}, {}, []
        for page in self._retrying(f"listing {self.uri}", lambda: self._pages()):
            for item in page:
                rel = item["Key"][len(self.uri.prefix):]
                wanted = any(fnmatch.fnmatchcase(rel, p) for p in patterns)
                if rel and not rel.endswith("/") and wanted:
                    obj = ObjectIdentity(rel, int(item["Size"]), item["ETag"].strip('"'))
                    found.append(obj)
                    said = (item.get("ChecksumAlgorithm", ()), item.get("ChecksumType"))
                    multipart = digest.is_multipart(obj.etag)
                    algorithms[rel] = digest.algorithm_for(*said, multipart=multipart)
                    crc = digest.of_parts_algorithm(*said, multipart=multipart)
                    if crc is not None:
                        of_parts[obj] = crc
                    if not said[0] and checked_bytes is not None and obj.size >= checked_bytes:
                        unlisted.append(obj)
        if not found:
            raise SourceError(
                f"no object under {self.uri} matches "
                f"{self.names('loader.include')}={list(patterns)}",
                hint=f"check {self.names('loader.source')} and {self.names('loader.include')}",
            )
        self._published = self._learn_unlisted(unlisted, algorithms, of_parts)
        self.part_bytes = {}
        if of_parts:
            with ThreadPoolExecutor(max_workers=min(len(of_parts), self.connections)) as pool:
                sizes = dict(zip(of_parts, pool.map(self._even_part_bytes, of_parts)))
            for obj, size in sizes.items():
                if size is not None:
                    self.part_bytes[obj.key], algorithms[obj.key] = size, of_parts[obj]
        self.chunk_algorithms = algorithms
        return sorted(found, key=lambda o: o.key)

    def _learn_unlisted(self, unlisted: Sequence[ObjectIdentity], algorithms: dict[str, str],
                        of_parts: dict[ObjectIdentity, str]) -> dict[str, StoreChecksum]:
        """The store's checksums of `unlisted` by key, their HEADs at once; each one's CRC goes
        into `algorithms` (of the whole object) or `of_parts` (one that may be of its parts)."""
        if not unlisted:
            return {}
        with ThreadPoolExecutor(max_workers=min(len(unlisted), self.connections)) as pool:
            heads = dict(zip(unlisted, pool.map(self._asked_checksum, unlisted)))
        for obj, store in heads.items():
            if store.value is None:
                continue
            if store.kind is ChecksumKind.WHOLE:
                algorithms[obj.key] = store.algorithm
            else:  # a CRC32 or CRC32C that may be of the parts
                of_parts[obj] = store.algorithm
        return {obj.key: store for obj, store in heads.items()}

    def _even_part_bytes(self, obj: ObjectIdentity) -> int | None:
        """The size of `obj`'s first part where its parts can be even (every one but the last
        of that size, as SDKs upload), else None."""
        count = digest.part_count(obj.etag)
        head = self._part_head(obj, 1)
        if head is None or int(head.get("PartsCount") or 0) != count:
            return None
        size = int(head["ContentLength"])
        last = obj.size - (count - 1) * size
        return size if 0 < last <= size else None

    def layout_holds(self, obj: ObjectIdentity, part_bytes: int) -> bool:
        """Whether every part of `obj` but the last has `part_bytes` (a HEAD of each)."""
        count = digest.part_count(obj.etag) or 1
        for number in range(1, count + 1):
            head = self._part_head(obj, number)
            expected = part_bytes if number < count else obj.size - (count - 1) * part_bytes
            if head is None or int(head["ContentLength"]) != expected:
                log.info("%s%s: part %d is not %d bytes; its store checksum (of its parts) is "
                         "not checked", self.uri, obj.key, number, expected)
                return False
        return True

    def _part_head(self, obj: ObjectIdentity, number: int) -> dict | None:
        """HEAD of part `number` of `obj`; None where the store answers a part number with a
        client error (it keeps no parts). Without `If-Match`: a store may compare it with the
        part's own ETag (moto does); the GETs, which send it, find an object replaced since."""
        def head() -> dict | None:
            try:
                return self._client.head_object(
                    Bucket=self.uri.bucket, Key=self.uri.prefix + obj.key, PartNumber=number)
            except bexc.ClientError as exc:
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                if status in (400, 416, 501):
                    return None
                raise

        return self._retrying(f"{self.uri}{obj.key} part {number}", head)

    def _pages(self) -> list[list[dict]]:
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.uri.bucket, Prefix=self.uri.prefix)
        return [page.get("Contents", []) for page in pages]

    def checksums(self, files: Sequence[ObjectIdentity]) -> dict[str, StoreChecksum]:
        """The store's checksum of every object of `files`, by key: as the last `list` learned
        it, else from a HEAD, one at a time on the pool's one connection beyond the readers'
        (`fill` runs this beside the transfer)."""
        return {obj.key: self._published.get(obj.key) or self._asked_checksum(obj)
                for obj in files}

    def _asked_checksum(self, obj: ObjectIdentity) -> StoreChecksum:
        return self._retrying(f"{self.uri}{obj.key} checksum", lambda: self._checksum(obj))

    def _checksum(self, obj: ObjectIdentity) -> StoreChecksum:
        head = self._client.head_object(Bucket=self.uri.bucket, Key=self.uri.prefix + obj.key,
                                        IfMatch=f'"{obj.etag}"', ChecksumMode="ENABLED")
        named = [k[len("Checksum"):].lower() for k in head
                 if k.startswith("Checksum") and k != "ChecksumType"]
        crcs = [name for name in named if name in CRC_ALGORITHMS]
        if not crcs:
            return StoreChecksum(named[0] if named else None)
        return digest.store_checksum(crcs[0], head[f"Checksum{crcs[0].upper()}"],
                                     head.get("ChecksumType"),
                                     multipart=digest.is_multipart(obj.etag))

    def read(self, obj: ObjectIdentity, start: int, into: memoryview, algorithm: str) -> int:
        """Fill `into` with bytes `[start, start+len(into))` of `obj`, exactly, and return their
        running CRC of `algorithm` (`digest.extend`), or raise after the retries."""
        what = f"{self.uri}{obj.key} bytes {start}-{start + len(into) - 1}"
        return self._retrying(what, lambda: self._get(obj, start, into, algorithm))

    def stream(self, obj: ObjectIdentity, start: int, length: int, pieces: Iterator[memoryview],
               deliver: Callable[[int, memoryview], None], algorithm: str) -> int:
        """Read bytes `[start, start+length)` of `obj` a piece at a time, each into the next of
        `pieces` cut to the bytes still to come, handing each piece to `deliver(offset, view)`
        (`offset` from `start`), and return the running CRC of `algorithm` of them all, or raise
        after the retries. A retry asks only for the bytes not delivered yet."""
        what = f"{self.uri}{obj.key} bytes {start}-{start + length - 1}"
        done = [0, 0]  # bytes delivered, their running CRC

        def attempt() -> int:
            while done[0] < length:
                at = start + done[0]
                with self._body(obj, at, length - done[0]) as body:
                    while done[0] < length:
                        view = next(pieces)[:length - done[0]]
                        got, crc = body.fill(view, algorithm, done[1])
                        if got < len(view):
                            raise _ShortBody(f"got {done[0] + got} of {length} bytes")
                        deliver(done[0], view)
                        done[0], done[1] = done[0] + got, crc
                    if body.finish():
                        raise _ShortBody(f"got {length}+ of {length} bytes")
            return done[1]

        return self._retrying(what, attempt)

    def _get(self, obj: ObjectIdentity, start: int, into: memoryview, algorithm: str) -> int:
        length = len(into)
        with self._body(obj, start, length) as body:
            got, crc = body.fill(into, algorithm)
            extra = got == length and body.finish()
        if got != length or extra:
            raise _ShortBody(f"got {got}{'+' if extra else ''} of {length} bytes")
        return crc

    @contextlib.contextmanager
    def _body(self, obj: ObjectIdentity, start: int, length: int) -> Iterator[_Body]:
        """The body of a GET of `length` bytes of `obj` from `start`, checked against the
        listing; a read that waits past the stall timeout raises `_Stalled`."""
        response = self._client.get_object(
            Bucket=self.uri.bucket, Key=self.uri.prefix + obj.key,
            Range=f"bytes={start}-{start + length - 1}", IfMatch=f'"{obj.etag}"',
        )
        body = response["Body"]
        try:
            _check_response(response, obj, start, length, f"{self.uri}{obj.key}")
            yield _Body(body)
        except (urllib3.exceptions.ReadTimeoutError, bexc.ReadTimeoutError, TimeoutError) as exc:
            raise _Stalled(f"no bytes for {self.stall_timeout_s:g} s") from exc
        finally:
            body.close()  # returns nothing to the pool unless the body was read to its end

    def _retrying(self, what: str, call: Callable[[], _T]) -> _T:
        """Run `call`, retrying transient failures with exponential backoff and full jitter."""
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
            except bexc.ClientError as exc:
                reason = _client_error_reason(exc, what, self.names)
            except bexc.NoCredentialsError as exc:
                raise SourceError(
                    f"no S3 credentials for {self.uri}",
                    hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or a web identity "
                         "(service account) for the loader",
                ) from exc
            except _ShortBody as exc:
                reason = f"short body: {exc}"
            except _Stalled as exc:
                reason = f"stalled: {exc}"
                self.on_stall(f"{what}: {exc}; asked again")
            except _RETRYABLE as exc:
                _raise_if_local(exc, what, self.names)
                reason = f"{type(exc).__name__}: {exc}"
            except OSError as exc:
                _raise_if_local(exc, what, self.names)
                raise
            if attempt == self.attempts or self.stop.is_set():
                break
            metrics.record_retry(reason)  # metrics: retries by reason class
            if reason.startswith("stalled"):
                log.warning("%s: %s; asking again at once on a new connection (%d/%d)",
                            what, reason, attempt, self.attempts - 1)
                continue
            delay = random.uniform(0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2 ** attempt))
            log.warning("%s: %s; retry %d/%d in %.2f s",
                        what, reason, attempt, self.attempts - 1, delay)
            if self.stop.wait(delay):
                break
        if reason.startswith("stalled"):
            hint = ("the object store (or the network to it) stops sending mid-object; check "
                    "its health and the path to it, then rerun (more retries only wait longer)")
        else:
            hint = ("the object store is throttling or failing; raise "
                    f"{self.names('loader.max_retries')} or retry later")
        raise SourceUnavailable(
            f"{what}: gave up after {attempt} attempt(s); last error: {reason}", hint=hint)


def _check_response(response: dict, obj: ObjectIdentity, start: int, length: int,
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
        raise _ShortBody(f"Content-Range {content_range!r}, asked for {asked!r}")
    if got_length is not None and int(got_length) != length:
        raise _ShortBody(f"Content-Length {got_length}, asked for {length}")


def _raise_if_local(exc: BaseException, what: str, names: Names) -> None:
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


class _Body:
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
        got = 0
        if self._response is not None:
            readinto, piece = self._response.readinto, _DIRECT_PIECE_BYTES
        else:  # botocore's own path (urllib3 allocates a buffer per call)
            readinto, piece = self._body.readinto, _PIECE_BYTES
        while got < len(into):
            count = readinto(into[got:got + piece])
            if not count:
                break
            crc = digest.extend(crc, into[got:got + count], algorithm)
            got += count
        return got, crc

    def finish(self) -> bool:
        """After the bytes asked for: True when more followed (a broken response)."""
        if self._response is None:
            return bool(self._body.read(1))
        response = self._response
        extra = bool(response.length) or bool(response.length is None and response.read(1))
        if not extra and response.isclosed():
            self._raw.release_conn()
        return extra


def _client_error_reason(exc: bexc.ClientError, what: str, names: Names) -> str:
    """The reason to retry a `ClientError`, or a permanent `SourceError` for the rest."""
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if status >= 500 or status == 429 or code in _THROTTLE_CODES:
        return f"{code or 'HTTP'} ({status})"
    if status == 412 or code == "PreconditionFailed":
        raise SourceChanged(
            f"{what}: the object changed since it was listed (ETag no longer matches)",
            hint="do not overwrite a checkpoint while it is being loaded; rerun the fill",
        ) from exc
    if status == 404 or code in ("NoSuchKey", "NoSuchBucket"):
        raise SourceError(f"{what}: not found ({code or status})",
                          hint=f"check {names('loader.source')}") from exc
    if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        raise SourceError(f"{what}: access denied ({code or status})",
                          hint="check the loader's credentials and the bucket policy") from exc
    raise SourceError(f"{what}: {code or 'HTTP error'} ({status})") from exc

