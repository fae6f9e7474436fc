"""The object store: listing a checkpoint prefix and reading byte ranges of its objects.

Owns every call to S3: this module and its three parts are the only ones that import botocore.
`ObjectStore` holds the client (endpoint, region, path-style addressing, credentials from the
standard chain: environment, web identity, instance role) and reads ranges; `source_listing`
lists with include globs and asks the store for part sizes and checksums; `source_retry` decides
whether and when a failed call is asked again (backoff with full jitter on throttling, 5xx,
connection resets, short bodies and bodies that fail the store's checksum; at once after a
stall; never for an error of this node, `LocalResourceError`); `source_body` checks each
response and reads its body. Every read names the listed ETag (`If-Match`) and compares the
response's ETag, Content-Range and length with the listing (a store may ignore `If-Match`), so
an object replaced mid-fill is an error, never a mixed file; bodies go straight into the
caller's buffer (see [Note: one copy] in `source_body`). A body that sends no bytes for
`stall_timeout_s` is abandoned and its range asked again at once on a new connection. The
`s3` reader of `dlo_loader.sources` (`open_source`; its reads come with `seam.RangedReads`).
Must not log or raise anything that carries a credential, and must not write files.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import botocore.exceptions as bexc
import botocore.session
import urllib3.exceptions
from botocore.config import Config

from dlo_loader.digest import StoreChecksum
from dlo_loader.source_body import Body, check_response
from dlo_loader.source_listing import Listing
from dlo_loader.source_retry import Retrier, Stalled
from dlo_loader.sources.seam import RangedReads, SourceOptions
from dlo_contract.cache import ObjectIdentity
from dlo_contract.field_names import Names, document_names
from dlo_contract.source_credentials import AWS_ACCESS_KEY_ID_ENV, AWS_SECRET_ACCESS_KEY_ENV
from dlo_contract.source_uri import SourceAddress

CREDENTIALS_HINT = (f"check the loader's S3 credentials ({AWS_ACCESS_KEY_ID_ENV}/"
                    f"{AWS_SECRET_ACCESS_KEY_ENV} from the source's Secret, or its web identity "
                    "(service account)) and the bucket policy")


LISTING_HEADS = 16
"""HEADs the listing may send at once, whatever `readers` is: a checkpoint's large objects are a
handful to a few tens, each HEAD is a round trip before the plan and the first read, and with
the pool at `readers + 1` a loader of few readers sent them in waves (2 readers: 10 objects in 4
round trips). The pool only caps connections open at once; the transfer's reads stay at
`readers`."""


class ObjectStore(RangedReads):
    """One S3 client shared by the reader threads (botocore clients are thread-safe)."""

    def __init__(
        self, uri: SourceAddress, *, endpoint_url: str | None, region: str | None, path_style: bool,
        readers: int, attempts: int, stop: threading.Event | None = None,
        stall_timeout_s: float = 30.0, on_stall: Callable[[str], None] | None = None,
        names: Names = document_names,
    ) -> None:
        """`names` spells the settings in messages (the fill's namer, `validation.names_for`)."""
        self.uri = uri
        self.connections = readers + 1  # the readers, and one for the checksum HEADs
        self.stall_timeout_s = stall_timeout_s
        self.retry = Retrier(str(uri), attempts=attempts, stop=stop or threading.Event(),
                             on_stall=on_stall or (lambda what: None), names=names,
                             credentials=CREDENTIALS_HINT)
        """The retry policy of every call this store makes (`source_retry`)."""
        config = Config(
            s3={"addressing_style": "path" if path_style else "auto"},
            # Our own retry loop knows about short bodies and the fill deadline: one attempt here.
            retries={"total_max_attempts": 1},
            max_pool_connections=max(self.connections, LISTING_HEADS),
            connect_timeout=10,
            read_timeout=stall_timeout_s,  # per socket read: no byte for this long is a stall
        )
        # botocore's session, not boto3's: boto3 also imports s3transfer, a fifth of a second
        # of start-up before the first GET for nothing the loader uses.
        self._client = botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )
        self._listing = Listing(self._client, uri, self.retry,
                                max(self.connections, LISTING_HEADS))

    def close(self) -> None:
        """Close the client's pooled connections."""
        self._client.close()

    def list(self, include: Iterable[str], *, checked_bytes: int | None = None
             ) -> list[ObjectIdentity]:
        """The objects to fill, sorted by key (see `Listing.list`)."""
        return self._listing.list(include, checked_bytes=checked_bytes)

    @property
    def chunk_algorithms(self) -> dict[str, str]:
        """By relative key, from the last `list`: the digest of each object's chunks."""
        return self._listing.chunk_algorithms

    @property
    def listed_checksums(self) -> dict[str, StoreChecksum]:
        """S3's checksums are CRCs, combined from the chunks: none is hashed from the file."""
        return {}

    @property
    def part_bytes(self) -> dict[str, int]:
        """By relative key, from the last `list`: the part size of objects checked by parts."""
        return self._listing.part_bytes

    def checksums(self, files: Sequence[ObjectIdentity]) -> dict[str, StoreChecksum]:
        """The store's checksum of every object of `files`, by key (`Listing.checksums`)."""
        return self._listing.checksums(files)

    def layout_holds(self, obj: ObjectIdentity, part_bytes: int) -> bool:
        """Whether every part of `obj` but the last has `part_bytes` (a HEAD of each)."""
        return self._listing.layout_holds(obj, part_bytes)

    @contextlib.contextmanager
    def _body(self, obj: ObjectIdentity, start: int, length: int) -> Iterator[Body]:
        """The body of a GET of `length` bytes of `obj` from `start`, checked against the
        listing; a read that waits past the stall timeout raises `Stalled`."""
        response = self._client.get_object(
            Bucket=self.uri.container, Key=self.uri.prefix + obj.key,
            Range=f"bytes={start}-{start + length - 1}", IfMatch=f'"{obj.etag}"',
        )
        body = response["Body"]
        try:
            check_response(response, obj, start, length, f"{self.uri}{obj.key}")
            yield Body(body)
        except (urllib3.exceptions.ReadTimeoutError, bexc.ReadTimeoutError, TimeoutError) as exc:
            raise Stalled(f"no bytes for {self.stall_timeout_s:g} s") from exc
        finally:
            body.close()  # returns nothing to the pool unless the body was read to its end


def open_source(uri: SourceAddress, options: SourceOptions) -> ObjectStore:
    """The S3 reader of `uri` (`dlo_loader.sources.s3`)."""
    return ObjectStore(uri, endpoint_url=options.endpoint_url, region=options.region,
                       path_style=options.path_style, readers=options.readers,
                       attempts=options.attempts, stop=options.stop,
                       stall_timeout_s=options.stall_timeout_s, on_stall=options.on_stall,
                       names=options.names)
