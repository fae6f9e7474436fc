"""The loader's sources: one seam between the fill and every kind of store it reads.

`open_source(uri, options)` opens the reader of the URI's scheme: the module
`dlo_loader.sources.<scheme>` (`s3`, `file`, `gs`, `az`, `https`, `hf`; imported only when a
fill uses it, so one scheme's client costs the others nothing) and its
`open_source(uri: SourceAddress, options: SourceOptions) -> Source`. A scheme without a module
in this image is a `SourceError` naming the field. The URI's record is
`dlo_contract.source_uri.SourceAddress` (`parse_source` here raises the loader's `SourceError`);
`str(uri)` is the source in every message and in the cache identity, and carries no credential.

The contract of a `Source` (`seam.Source`), which `fill`, `transfer` and `exchange` rely on:

- `list(include, *, checked_bytes=None)`: the objects under the URI whose key relative to it
  matches a glob (`seam.matches`), as `ObjectIdentity(key, size, etag, version_id)` sorted by
  key; no match is `seam.nothing_matched`'s error. `etag` is the version identity a read checks
  (S3 and Azure: the ETag; GCS: the generation; file: modification time, size and inode; https:
  the server's strong ETag, else the listing file's digest; hf: the LFS sha256 or git blob id,
  with the commit in `version_id`): the cache entry's id is derived from the listing, so an
  object replaced under the same key makes another entry, never a mixed one. `checked_bytes`
  is S3's (objects whose unlisted checksum a HEAD learns); others ignore it.
- `chunk_algorithms`: by key, the CRC to hash each object's chunks with (`digest.ALGORITHM`
  where absent), the store's own where it keeps one of the whole object (GCS: crc32c), so that
  the check before publication needs no second pass. `part_bytes`: by key, the part size of
  objects whose store checksum is of their parts (S3 only; others `{}`).
- `read(obj, start, into, algorithm)`: exactly bytes `[start, start + len(into))` of `obj`
  into the caller's memoryview, returning their running CRC (`digest.extend`), retried by
  `retry` (a `source_retry.Retrier` from `SourceOptions.retrier`). `stream(obj, start, length,
  pieces, deliver, algorithm)`: the same a piece at a time, a retry asking only for the bytes
  not delivered yet. Both come with `seam.RangedReads` from one `_body(obj, start, length)`.
  Every read names the listed identity where the store can (`If-Match`, a generation
  precondition) and checks the answer's identity and total size itself (a store may ignore the
  precondition): another is `errors.SourceChanged` (nothing publishes). A body sends no byte
  for `stall_timeout_s`: raise `source_retry.Stalled` (asked again at once). Fewer or more
  bytes than asked: `ShortBody`. An error answer: `source_retry.StoreStatus(status, code)`
  (5xx/429 retried with backoff; 401/403 a `SourceError` with the reader's credentials hint;
  404 not found; 412 `SourceChanged`). Broken connections: the transport's exceptions, or
  `ConnectionError`/`TimeoutError` (retried). Errors of this node (EMFILE, ENOSPC) are never
  retried (`source_retry.raise_if_local`).
- `checksums(files)`: by key, the store's own checksum (`digest.StoreChecksum`) of at least
  `files` (a reader whose listing gave them all returns them all: `seam.ListedChecksums`);
  called on a thread beside the transfer. A CRC of `chunk_algorithms` is combined from the
  chunk digests; a whole-file hash (`sha256`, `md5`, `git-sha1`: `digest.FILE_HASHES`) is
  computed from the written file before publication. A mismatch publishes nothing.
  `listed_checksums`: by key, those the last `list` gave without another call (a fill reading
  alone hashes such files while it writes them, `file_hashes`); `{}` where there are none.
  `layout_holds(obj, part_bytes)`: S3's composite checksums; others False.
- `close()`: release connections. Messages, logs and errors name `str(uri)` and keys, never a
  credential (the names of the variables a scheme reads are `dlo_contract.source_credentials`).

Shared by every scheme: `source_retry` (backoff, stall, the error classes), `digest` (CRCs,
store checksums), `metrics` (retries counted by the `Retrier`, stalls through
`options.on_stall`, bytes by the fill), `seam` (globs, the empty listing, ranged reads) and
`http` (ranged GETs over urllib3 into the caller's buffer, for readers that speak HTTP).
"""

from __future__ import annotations

import importlib

from dlo_loader.errors import SourceError
from dlo_loader.sources.seam import Source, SourceOptions
from dlo_contract.field_names import Names, document_names
from dlo_contract.source_uri import SourceAddress, parse_source_uri
from dlo_contract.errors import DloError

__all__ = ["Source", "SourceOptions", "open_source", "parse_source"]


def parse_source(uri: str, names: Names = document_names) -> SourceAddress:
    """The record of `uri`, or a `SourceError` naming the field as `names` spells it."""
    try:
        return parse_source_uri(uri, names)
    except DloError as exc:
        raise SourceError(str(exc), hint=exc.hint) from None


def open_source(uri: SourceAddress, options: SourceOptions) -> Source:
    """The reader of `uri`'s scheme (`dlo_loader.sources.<scheme>.open_source`)."""
    name = f"{__name__}.{uri.scheme.value}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        field = options.names("loader.source")
        raise SourceError(f"{field}={str(uri)!r}: this loader does not read "
                          f"{uri.scheme.value}:// sources",
                          hint="use a loader image that has this scheme's reader") from None
    return module.open_source(uri, options)
