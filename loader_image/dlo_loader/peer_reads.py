"""Refilling from peers: a loader filling alone reads its entry's chunks from the nodes that
hold it, and from the store only what no peer can serve.

Owns the peer protocol's reading side. `open_peers` asks the holders the operator listed in the
fill-group document (`dlo_contract.fill_group.Holder`; this node left out) for the entry's
manifest (see [Note: who may read an entry] in `peer_serve`) and keeps the holders whose
manifest is this fill's entry, its identity equal to this fill's listing. `PeerReads.streamer`
wraps the store's `Streamer`: each chunk goes to the next healthy holder in turn (spread over
all of them), its bytes stream to their place as the store's would, and their running CRC must
equal the manifest's digest of that chunk. A holder that fails (refuses, breaks off, sends no
byte for `loader.stallTimeoutSeconds`, answers another range) or sends a chunk whose digest
differs is dropped for the rest of the fill, and the chunk is read from the store (its bytes
written again over the peer's); so is every chunk once no holder is left, and every chunk of a
file whose manifest record is cut or hashed otherwise than this fill's plan. The fill's own
checks (headers, the store's checksums where it has them) then run as after any fill. Called by
`fill` (open) and `transfer` (streamer); must not write files or decide the plan.
"""

from __future__ import annotations

import http.client
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dlo_loader import digest
from dlo_loader.errors import LoaderError
from dlo_loader.plan import Plan
from dlo_loader.peer_serve import ACCESS_HEADER, ENTRY_PATH, access_key
from dlo_loader.progress import Progress
from dlo_loader.sources.seam import fill_hashed
from dlo_loader.stream import Deliver, Streamer
from dlo_contract.cache import CacheCorruptError, FileRecord, Manifest, canonical_json
from dlo_contract.documents import MAX_PEERS_LISTED, PeerBytes
from dlo_contract.fill_group import Holder

log = logging.getLogger(__name__)
MANIFEST_BYTES = 64 << 20
"""The most a manifest answer may hold (a checkpoint's is kilobytes)."""


class PeerFailed(LoaderError):
    """A holder's answer that is not the chunk asked for."""


def open_peers(holders: Sequence[Holder], *, entry_id: str, identity: Mapping[str, Any],
               secret: bytes, timeout_s: float, progress: Progress) -> PeerReads | None:
    """The reads from those of `holders` that serve this entry to a reader holding the DOD's
    fill `secret`; None when none does."""
    key = access_key(secret, identity)
    serving: list[Holder] = []
    manifest: Manifest | None = None
    with ThreadPoolExecutor(max_workers=min(len(holders), 16) or 1,
                            thread_name_prefix="dlo-peer-manifest") as pool:
        answers = list(pool.map(lambda h: _answer(h, entry_id, key, timeout_s), holders))
    for holder, found in zip(holders, answers):
        if isinstance(found, Exception):
            log.warning("peer %s does not serve entry %s: %s", _named(holder), entry_id, found)
            continue
        if found.entry_id != entry_id or canonical_json(found.identity) != canonical_json(
                dict(identity)):
            log.warning("peer %s serves another listing as entry %s; not read from",
                        _named(holder), entry_id)
            continue
        serving.append(holder)
        manifest = manifest or found
    if manifest is None:
        return None
    log.info("refilling entry %s from %d peer(s) that hold it: %s", entry_id, len(serving),
             ", ".join(_named(h) for h in serving))
    return PeerReads(serving, manifest, entry_id=entry_id, key=key, timeout_s=timeout_s,
                     progress=progress)


class PeerReads:
    """Chunk reads from `holders` (each serving `manifest`), falling back to the store."""

    def __init__(self, holders: Sequence[Holder], manifest: Manifest, *, entry_id: str,
                 key: str, timeout_s: float, progress: Progress) -> None:
        self._healthy = list(holders)
        self._manifest, self._entry_id, self._key = manifest, entry_id, key
        self._timeout_s, self._progress = timeout_s, progress
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._served: Counter[Holder] = Counter()
        """Bytes each holder served that passed their digest check."""

    def streamer(self, plan: Plan, store: Streamer) -> Streamer:
        """`store`'s streamer with every chunk a peer can serve read from a peer first."""
        expected = _expected_digests(plan, self._manifest)

        def stream(file: int, offset: int, length: int, pieces: Iterator[memoryview],
                   deliver: Deliver) -> int:
            wanted = expected.get((file, offset, length))
            holder = self._next() if wanted is not None else None
            if holder is None:
                return store(file, offset, length, pieces, deliver)
            algorithm = plan.algorithms[file]
            try:
                value = self._read(holder, plan.files[file].key, offset, length, pieces,
                                   deliver, algorithm)
                if digest.of_running(value, algorithm) != wanted:
                    raise PeerFailed(f"bytes {offset}-{offset + length - 1} of "
                                     f"{plan.files[file].key} differ from the entry's digest")
            except (OSError, http.client.HTTPException, PeerFailed) as exc:
                self._drop(holder, exc)
                return store(file, offset, length, pieces, deliver)
            self._progress.add(from_peers=length)
            with self._lock:
                self._served[holder] += length
            return value

        return stream

    def bytes_by_peer(self) -> list[PeerBytes]:
        """What each holder served, most first, at most `MAX_PEERS_LISTED` (the summary's)."""
        with self._lock:
            served = self._served.most_common(MAX_PEERS_LISTED)
        return [PeerBytes(node=h.node or f"{h.address}:{h.port}", bytes=n) for h, n in served]

    def _next(self) -> Holder | None:
        """The next healthy holder in turn; None once every one was dropped."""
        with self._lock:
            return self._healthy[next(self._turn) % len(self._healthy)] if self._healthy else None

    def _drop(self, holder: Holder, exc: BaseException) -> None:
        with self._lock:
            if holder not in self._healthy:
                return
            self._healthy.remove(holder)
            left = len(self._healthy)
        log.warning("peer %s dropped, %s: %s", _named(holder),
                    f"{left} peer(s) left" if left else "the store serves the rest", exc)

    def _read(self, holder: Holder, name: str, offset: int, length: int,
              pieces: Iterator[memoryview], deliver: Deliver, algorithm: str) -> int:
        path = f"{ENTRY_PATH}/{self._entry_id}/files/{name}"
        connection = http.client.HTTPConnection(holder.address, holder.port,
                                                timeout=self._timeout_s)
        try:
            connection.request("GET", path, headers={
                ACCESS_HEADER: self._key, "Range": f"bytes={offset}-{offset + length - 1}"})
            answer = connection.getresponse()
            shown = answer.getheader("Content-Range", "")
            if answer.status != 206 or not shown.startswith(
                    f"bytes {offset}-{offset + length - 1}/"):
                raise PeerFailed(f"answered {answer.status} {shown or answer.reason}")
            value = at = 0
            while at < length:
                view = next(pieces)[:length - at]
                got, value = fill_hashed(answer.readinto, view, len(view), algorithm, value)
                if got < len(view):
                    raise PeerFailed(f"sent {at + got} of {length} bytes")
                deliver(at, view)
                at += got
            return value
        finally:
            connection.close()


def _expected_digests(plan: Plan, manifest: Manifest) -> dict[tuple[int, int, int], str]:
    """By `(file, offset, length)`: the manifest's digest of each of the plan's chunks whose
    file's record is cut and hashed as the plan cuts and hashes it."""
    found: dict[tuple[int, int, int], str] = {}
    for chunk in plan.chunks:
        record = manifest.file(plan.files[chunk.file].key)
        wanted = _chunk_digest(record, plan, chunk.file, chunk.number) if record else None
        if wanted is not None:
            found[(chunk.file, chunk.offset, chunk.length)] = wanted
    return found


def _chunk_digest(record: FileRecord, plan: Plan, file: int, number: int) -> str | None:
    if record.size != plan.files[file].size or record.algorithm != plan.algorithms[file]:
        return None
    if record.chunk_bytes is None:
        whole = record.size <= plan.file_chunk_bytes[file] and number == 0
        return record.digest if whole else None
    if record.chunk_bytes != plan.file_chunk_bytes[file]:
        return None
    return record.chunk_digests[number]


def _answer(holder: Holder, entry_id: str, key: str, timeout_s: float) -> Manifest | Exception:
    """The holder's manifest of the entry, or why it gave none (all holders are asked at once:
    one gone from the network costs one timeout, not one each)."""
    try:
        return _manifest(holder, entry_id, key, timeout_s)
    except (OSError, http.client.HTTPException, PeerFailed, CacheCorruptError) as exc:
        return exc


def _manifest(holder: Holder, entry_id: str, key: str, timeout_s: float) -> Manifest:
    connection = http.client.HTTPConnection(holder.address, holder.port, timeout=timeout_s)
    try:
        connection.request("GET", f"{ENTRY_PATH}/{entry_id}/manifest",
                           headers={ACCESS_HEADER: key})
        answer = connection.getresponse()
        body = answer.read(MANIFEST_BYTES)
        if answer.status != 200:
            raise PeerFailed(f"answered {answer.status} {body[:200].decode(errors='replace')}"
                             .strip())
        return Manifest.from_json(body.decode("utf-8", errors="replace"))
    finally:
        connection.close()


def _named(holder: Holder) -> str:
    return f"{holder.node or '?'} ({holder.address}:{holder.port})"

