"""What the store says about a checkpoint's objects before any byte is read.

Owns `Listing`: the objects under the prefix that match the include globs, the digest of each
one's chunks, the part size of objects uploaded in parts (HEAD with `PartNumber=1`) and the
store's own checksums of objects (HEAD with `ChecksumMode=ENABLED`). Called by `source`'s
`ObjectStore`, which lends it the client and the retry policy; it reads no object bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import botocore.exceptions as bexc

from dlo_loader import digest
from dlo_loader.digest import ChecksumKind, StoreChecksum
from dlo_loader.source_retry import Retrier
from dlo_loader.sources.seam import matches, nothing_matched
from dlo_contract.cache import CRC_ALGORITHMS, ObjectIdentity

log = logging.getLogger(__name__)


class Listing:
    """The listing of one source and what HEADs added to it (see `list`)."""

    def __init__(self, client: Any, uri: Any, retry: Retrier, connections: int) -> None:
        """`uri`: the source's `SourceAddress`; `connections`: how many HEADs may run at once."""
        self._client, self.uri, self._retry, self._connections = client, uri, retry, connections
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
        for page in self._retry.run(f"listing {self.uri}", lambda: self._pages()):
            for item in page:
                rel = item["Key"][len(self.uri.prefix):]
                if matches(rel, patterns):
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
            raise nothing_matched(self.uri, patterns, self._retry.names)
        self._published = self._learn_unlisted(unlisted, algorithms, of_parts)
        self.part_bytes = {}
        if of_parts:
            with ThreadPoolExecutor(max_workers=min(len(of_parts), self._connections)) as pool:
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
        with ThreadPoolExecutor(max_workers=min(len(unlisted), self._connections)) as pool:
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
                    Bucket=self.uri.container, Key=self.uri.prefix + obj.key, PartNumber=number)
            except bexc.ClientError as exc:
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                if status in (400, 416, 501):
                    return None
                raise

        return self._retry.run(f"{self.uri}{obj.key} part {number}", head)

    def _pages(self) -> list[list[dict]]:
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.uri.container, Prefix=self.uri.prefix)
        return [page.get("Contents", []) for page in pages]

    def checksums(self, files: Sequence[ObjectIdentity]) -> dict[str, StoreChecksum]:
        """The store's checksum of every object of `files`, by key: as the last `list` learned
        it, else from a HEAD, one at a time on the pool's one connection beyond the readers'
        (`fill` runs this beside the transfer)."""
        return {obj.key: self._published.get(obj.key) or self._asked_checksum(obj)
                for obj in files}

    def _asked_checksum(self, obj: ObjectIdentity) -> StoreChecksum:
        return self._retry.run(f"{self.uri}{obj.key} checksum", lambda: self._checksum(obj))

    def _checksum(self, obj: ObjectIdentity) -> StoreChecksum:
        head = self._client.head_object(Bucket=self.uri.container, Key=self.uri.prefix + obj.key,
                                        IfMatch=f'"{obj.etag}"', ChecksumMode="ENABLED")
        named = [k[len("Checksum"):].lower() for k in head
                 if k.startswith("Checksum") and k != "ChecksumType"]
        crcs = [name for name in named if name in CRC_ALGORITHMS]
        if not crcs:
            return StoreChecksum(named[0] if named else None)
        return digest.store_checksum(crcs[0], head[f"Checksum{crcs[0].upper()}"],
                                     head.get("ChecksumType"),
                                     multipart=digest.is_multipart(obj.etag))
