"""One fill of the node cache from object storage: the loader protocol of DESIGN.md section 5.

Owns the order of the steps and the decisions between them: list the source and derive the entry
id first, and if this node already holds a valid entry, return at once (no object-store reads, no
rendezvous) unless the operator placed this loader in a fill group (then it joins and serves its
ranges from disk); else evict unused entries until the new one fits the cache limits, take the
publication (the cache's `.publish` lock), start reading this rank's share of the group's plan
(see [Note: reading before the group] in `exchange`), join the group (or fall back to reading
alone, per policy, keeping what was read), agree on the plan, run the exchange, validate every
safetensors header and compare chunk digests across ranks, and only then commit. A node whose entry appeared
while it waited for the lock serves its share from disk and publishes nothing. Any failure leaves
no entry (the publication removes its tmp dir). Called by `cli` (and by tests in-process for one
rank). Must not parse flags or print: it returns a `FillResult`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlo_loader import digest as digests_of
from dlo_loader.errors import GroupError, LoaderError, RendezvousTimeout
from dlo_loader import metrics
from dlo_loader.plan import Plan, build_plan
from dlo_loader.progress import Progress, human_bytes, rank_prefix, repeating
from dlo_loader.room import make_room_within
from dlo_loader.source import ObjectStore, parse_source
from dlo_contract.cache import (
    CacheRoot,
    FileRecord,
    ObjectIdentity,
    Publication,
    begin_publication,
    checkpoint_identity,
    entry_id,
    find_entry,
)
from dlo_contract.documents import EntryDocument, FillStatus, FillSummary
from dlo_contract.errors import DloError
from dlo_contract.names import DEFAULT_RENDEZVOUS_PORT
from dlo_contract.settings import Settings
from dlo_contract.validation import names_for

if TYPE_CHECKING:  # transport imports torch: loaded only when a group is needed
    import mmap

    from dlo_loader.exchange import Exchange, Reader
    from dlo_loader.fetch import Span
    from dlo_loader.sink import FileSink
    from dlo_loader.stream import Streamer
    from dlo_loader.transport import Group

TRANSFER_MODULES = ("dlo_loader.exchange", "dlo_loader.sink", "dlo_contract.safetensors_header")
"""Imported when the transfer starts, not before the listing: `cli` imports them on a thread
while this process lists the source (see `cli.preload_transfer_modules`)."""

log = logging.getLogger(__name__)

PRODUCER = "dlo-loader"
WAIT_LINE_INTERVAL_S = 5.0
"""How often a loader waiting for another loader's publication of the same entry says so."""
_COLLECTIVE_TIMEOUT_S = 60.0
"""Longest wait inside one collective: ready ranks wait in a round at most `LATE_AFTER_S` for a
slow one, then poll in status rounds, so only a hung peer hits it."""


@dataclass(frozen=True, kw_only=True)
class FillRequest:
    settings: Settings
    rank: int = 0
    world_size: int = 1
    master_addr: str | None = None
    master_port: int = DEFAULT_RENDEZVOUS_PORT
    emit: Callable[[str], None] | None = None
    """Where progress lines go (the CLI prints them); None: no progress lines."""


@dataclass(frozen=True, kw_only=True)
class FillResult:
    entry_id: str
    root: str
    path: str
    source: str
    mode: str
    rank: int
    world_size: int
    bytes_from_store: int
    bytes_from_peers: int
    bytes_to_peers: int
    seconds: float
    cached: bool
    store_checksums: str = "none"
    """`all`/`some`/`none`: whether the bytes were checked against the store's own checksums
    (of whole objects or of their parts, see `digest`); `none` also for a fill that read
    nothing."""
    stage_seconds: dict[str, float] | None = None
    """Thread-seconds per stage (`progress.STAGES`); None for a cached entry."""

    def summary(self) -> FillSummary:
        """The one-line JSON summary the operator reads from the termination message."""
        return FillSummary(
            status=FillStatus.OK, entry_id=self.entry_id, mode=self.mode, rank=self.rank,
            world_size=self.world_size, bytes_from_store=self.bytes_from_store,
            bytes_from_peers=self.bytes_from_peers, bytes_to_peers=self.bytes_to_peers,
            seconds=round(self.seconds, 3), cached=self.cached,
            store_checksums=self.store_checksums,
            stage_seconds={k: round(v, 3) for k, v in (self.stage_seconds or {}).items()},
        )

    def entry_document(self) -> EntryDocument:
        """What the main container reads from the entry file."""
        return EntryDocument(entry_id=self.entry_id, kind="checkpoint", root=self.root,
                             path=self.path, source=self.source)


def fill(request: FillRequest) -> FillResult:
    """Make sure this node's cache holds the checkpoint; see the module docstring for the steps."""
    with _young_objects_only():
        return _Fill(request).run()


class _Fill:
    """The state of one fill, shared by its steps."""

    def __init__(self, request: FillRequest) -> None:
        self.request = request
        self.started = time.monotonic()
        self.loader, self.cache = request.settings.loader, request.settings.cache
        self.deadline = self.started + self.loader.timeout_s
        self.names = names_for(request.settings)
        """How this fill's messages spell the settings, resolved once (see `names_for`)."""
        self.uri = parse_source(self.loader.source, self.names)
        self._listening = self._listen()
        """Rank 0's rendezvous store, listening while the fill lists (until `_join_group`)."""
        self.stop = threading.Event()
        self.store = ObjectStore(
            self.uri, endpoint_url=self.loader.endpoint_url, region=self.loader.region,
            path_style=self.loader.path_style, readers=self.loader.readers,
            attempts=self.loader.max_retries, stop=self.stop,
            stall_timeout_s=self.loader.stall_timeout_s, on_stall=self._stalled,
            names=self.names,
        )
        self.root = CacheRoot(self.cache.root)
        self.store_check: digests_of.StoreCheck | None = None
        self._sink: FileSink | None = None
        """The files being written in the publication's tmp dir, made by the first exchange."""
        self.progress = Progress(total_bytes=0, emit=request.emit,
                                 prefix=rank_prefix(request.rank, request.world_size))
        metrics.FILL.attach(self.progress)  # metrics: /metrics reads this fill's progress

    def _stalled(self, what: str) -> None:
        self.progress.stall(what)

    def run(self) -> FillResult:
        try:
            result = self._run()
        except BaseException:
            self.progress.phase = "failed"  # metrics: phase
            raise
        finally:
            self.store.close()
        self.progress.phase = "done"  # metrics: phase
        return result

    def _run(self) -> FillResult:
        files = self.store.list(self.loader.include, checked_bytes=self.loader.chunk_bytes)
        gc.freeze()  # the S3 client's service model too (see `_young_objects_only`)
        identity = checkpoint_identity(str(self.uri), files, self.names)
        eid = entry_id(identity)
        self.progress.total_bytes = total = sum(f.size for f in files)
        log.info("%s: %d objects, %s; entry %s", self.uri, len(files), human_bytes(total), eid)
        existing = find_entry(self.root, eid, self.cache.verify)
        if existing is not None and not self._in_group():
            log.info("entry %s is cached already at %s; nothing to read", eid, existing)
            return self._result(eid, existing, self.loader.mode, cached=True)
        lock_timeout_s = max(self.deadline - time.monotonic(), 1.0)
        self.progress.phase = "waiting"  # metrics: phase
        # Room is made as the publication's lock owner: a loader that waits for another one
        # publishing the same entry joins it, and must not evict for a second copy.
        publication = begin_publication(self.root, eid, expected_bytes=total,
                                        lock_timeout_s=lock_timeout_s,
                                        min_free_bytes=self.cache.min_free_bytes,
                                        prepare=lambda: self._make_room(eid, total))
        with contextlib.ExitStack() as held:
            # Taking the lock waits while another loader on this node publishes the entry.
            with repeating(self.request.emit or log.info, lambda waited: self._publication_line(
                    eid, waited), interval_s=WAIT_LINE_INTERVAL_S, at_once=False):
                pub = held.enter_context(publication)
            early = self._read_before_joining(pub, files)
            try:
                group, mode = self._join_group()
            except BaseException:
                if early is not None:  # stop reading, and the progress lines before the summary
                    early[1].abandon()
                    self.progress.stop()
                raise
            fetched = None
            if early is not None and group is None:  # fell back: read the rest alone
                fetched = early[1].abandon()
                early = None
            if group is None and pub.existing is not None:
                return self._result(eid, pub.existing, mode, cached=True)
            try:
                plan = early[0] if early else build_plan(
                    files, mode=mode, world_size=self.request.world_size,
                    chunk_bytes=self.loader.chunk_bytes, algorithms=self.store.chunk_algorithms,
                    part_bytes=self.store.part_bytes)
                self._transfer(pub, plan, group, identity, early[1] if early else None, fetched)
            finally:
                if group is not None:
                    group.close()
            final = pub.existing or pub.committed
        assert final is not None
        return self._result(eid, final, mode, cached=pub.existing is not None)

    def _publication_line(self, eid: str, waited_s: float) -> str:
        return (f"{self.progress.prefix} waiting {waited_s:.0f} s for another loader on this node "
                f"to publish entry {eid} ({self.uri}); this loader uses it once published")

    def _in_group(self) -> bool:
        """A loader placed in a group joins it even when its node holds the entry (it serves
        its ranges from disk), so the other members never wait out the rendezvous for it."""
        return self.request.world_size > 1 and self.loader.mode != "independent"

    def _make_room(self, eid: str, incoming: int) -> None:
        """Evict unused entries, least recently used first, until this one fits within the
        node's limits (the platform's, under the operator), then check this deployment's own
        asks, which evict nothing (`room`); the error names the entries in use."""
        removed = make_room_within(self.root, eid, incoming_bytes=incoming, cache=self.cache,
                                   names=self.names)
        if removed:
            log.info("evicted %d unused cache entries to make room for %s: %s", len(removed),
                     human_bytes(incoming), ", ".join(removed))

    def _result(self, eid: str, path: Path, mode: str, *, cached: bool) -> FillResult:
        return FillResult(
            store_checksums=self.store_check.summary if self.store_check else "none",
            stage_seconds=None if cached else dict(self.progress.stage_seconds),
            entry_id=eid, root=str(self.root.path), path=str(path), source=str(self.uri),
            mode=mode, rank=self.request.rank, world_size=self.request.world_size, cached=cached,
            bytes_from_store=self.progress.bytes_from_store,
            bytes_from_peers=self.progress.bytes_from_peers,
            bytes_to_peers=self.progress.bytes_to_peers,
            seconds=time.monotonic() - self.started,
        )

    def _join_group(self) -> tuple[Group | None, str]:
        """The group for this fill, or None to read alone (one rank, independent, fallback)."""
        request, loader = self.request, self.loader
        if request.world_size == 1 or loader.mode == "independent":
            return None, loader.mode
        if not request.master_addr:
            raise LoaderError(
                f"world size {request.world_size} needs a rendezvous address",
                hint="pass --master-addr or set MASTER_ADDR (rank 0's stable DNS name)",
            )
        from dlo_loader import transport

        listening, self._listening = self._listening, None  # the group's from here, or dropped
        try:
            with repeating(request.emit or log.info, self._waiting_line):
                group = transport.rendezvous(
                    backend=loader.backend, master_addr=request.master_addr,
                    master_port=request.master_port, rank=request.rank,
                    world_size=request.world_size, timeout_s=loader.rendezvous_timeout_s,
                    collective_timeout_s=min(_COLLECTIVE_TIMEOUT_S, loader.timeout_s),
                    listening=listening, names=self.names,
                )
        except RendezvousTimeout as exc:
            if loader.on_rendezvous_timeout == "fail":
                raise
            log.warning("%s; falling back to independent mode: this loader reads every byte", exc)
            return None, "independent"
        return group, loader.mode

    def _listen(self) -> Any:
        """Rank 0 of a group: its rendezvous store, listening from the fill's start (see
        [Note: listening early] in `transport`); None elsewhere."""
        request = self.request
        if request.rank != 0 or not self._in_group() or not request.master_addr:
            return None
        from dlo_loader import transport

        return transport.listen(master_addr=request.master_addr,
                                master_port=request.master_port,
                                world_size=request.world_size,
                                timeout_s=self.loader.rendezvous_timeout_s)

    def _waiting_line(self, waited_s: float) -> str:
        """What an operator reading the pod log needs while the rendezvous blocks: every loader
        placed in the group joins it (one whose node holds the entry serves its share from disk),
        so a wait this long means a loader of the group has not started (a pod pending or
        crashing); past the timeout, the policy applies."""
        request, loader = self.request, self.loader
        left = max(loader.rendezvous_timeout_s - waited_s, 0.0)
        then = ("this loader reads everything itself"
                if loader.on_rendezvous_timeout == "independent" else "this loader fails")
        return (f"{self.progress.prefix} waiting for {request.world_size} loaders at "
                f"{request.master_addr}:{request.master_port}; after {left:.0f} s {then} "
                f"({self.names('loader.on_rendezvous_timeout')}={loader.on_rendezvous_timeout}); "
                "this loader reads its "
                "own share meanwhile; a loader that has not joined has not started (check the "
                "group's pods)")

    def _read_before_joining(self, pub: Publication,
                             files: list[ObjectIdentity]) -> tuple[Plan, Exchange] | None:
        """For a loader about to join a group to fill this node: the group's plan, and its
        exchange with this rank's reads already started (see [Note: reading before the group]
        in `exchange`)."""
        if not self._in_group() or pub.existing is not None:
            return None
        plan = build_plan(files, mode=self.loader.mode, world_size=self.request.world_size,
                          chunk_bytes=self.loader.chunk_bytes,
                          algorithms=self.store.chunk_algorithms,
                          part_bytes=self.store.part_bytes)
        return plan, self._exchange(pub, plan, grouped=True)

    def _exchange(self, pub: Publication, plan: Plan, *, grouped: bool,
                  fetched: dict[Span, tuple[mmap.mmap, str]] | None = None) -> Exchange:
        """The plan's data path, its reads started: from the store, or from this node's entry."""
        from dlo_loader.exchange import Exchange
        from dlo_loader.sink import EntryChunks, FileSink

        rank = self.request.rank if grouped else 0
        log.info("plan: %s over %d rank(s), %d chunks of at most %s; this rank reads %s%s",
                 plan.mode, plan.world_size, len(plan.chunks), human_bytes(plan.chunk_bytes),
                 human_bytes(plan.owned_bytes(rank)),
                 " from its cached entry" if pub.existing else "")
        if pub.existing is None and self._sink is None:  # one per publication, kept on fallback
            self._sink = FileSink(pub.tmp_dir, plan.files)
        sink = None if pub.existing is not None else self._sink
        read = (EntryChunks(pub.existing, plan.files, plan.algorithms).read if pub.existing
                else self._reader(plan))
        self.progress.start()
        self.progress.phase = "transferring"  # metrics: phase
        stream = None if pub.existing or grouped else self._streamer(plan)  # alone: streamed
        return Exchange(plan, rank=self.request.rank, grouped=grouped, read=read, sink=sink,
                        progress=self.progress, config=self.loader, deadline=self.deadline,
                        stop=self.stop, fetched=fetched, stream=stream, names=self.names)

    def _transfer(self, pub: Publication, plan: Plan, group: Group | None,
                  identity: dict[str, Any], exchange: Exchange | None,
                  fetched: dict[Span, tuple[mmap.mmap, str]] | None) -> None:
        """Exchange (`exchange`: started before the group formed; `fetched`: chunks read
        before a fallback), check and (unless this node holds the entry already) commit."""
        # The store's whole-object checksums are asked for while the bytes move: a HEAD per large
        # object after the last byte would lengthen every fill by their round trips.
        beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-checksums")
        try:
            published = None if pub.existing is not None else beside.submit(
                self.store.checksums, _checked_files(plan))
            try:
                if group is not None:
                    _agree(group, plan.fingerprint)
                if exchange is None:
                    exchange = self._exchange(pub, plan, grouped=group is not None,
                                              fetched=fetched)
                digests = exchange.run(group)
            finally:
                if exchange is not None:
                    exchange.abandon()
                self.progress.stop()
            self.progress.phase = "checking"  # metrics: phase
            if published is None:
                _conclude(group, digests, lambda: None)
                return
            records, tensors = _conclude(group, digests, lambda: self._check(
                pub.tmp_dir, plan, digests, published.result()))
        finally:  # a failed fill does not wait for a HEAD in flight
            beside.shutdown(wait=False, cancel_futures=True)
        pub.commit("checkpoint", identity, records, tensor_count=tensors, producer=PRODUCER)

    def _check(self, directory: Path | None, plan: Plan, digests: list[str],
               published: dict[str, digests_of.StoreChecksum]) -> tuple[list[FileRecord], int]:
        """Headers, then the store's checksums (`published`), then the manifest records."""
        checked = _check_files(directory, plan, digests, str(self.uri))
        files = []
        for index, obj in enumerate(plan.files):
            chunks = [c for c in plan.chunks if c.file == index]
            files.append(digests_of.FileDigests(
                obj.key, plan.algorithms[index], [c.length for c in chunks],
                [digests[c.index] for c in chunks], plan.part_bytes[index]))
        by_key = {obj.key: obj for obj in plan.files}
        self.store_check = digests_of.check_store(
            files, published, str(self.uri),
            layout_holds=lambda key, part_bytes: self.store.layout_holds(by_key[key],
                                                                         part_bytes))
        log.info("store checksums: %d object(s) match the store's CRC (of the whole object or of "
                 "its parts), %d without one", self.store_check.checked,
                 self.store_check.unavailable)
        return checked

    def _streamer(self, plan: Plan) -> Streamer:
        def stream(file: int, offset: int, length: int, pieces: Iterator[memoryview],
                   deliver: Callable[[int, memoryview], None]) -> int:
            def counted(at: int, view: memoryview) -> None:
                self.progress.add(from_store=len(view))
                deliver(at, view)

            return self.store.stream(plan.files[file], offset, length, pieces, counted,
                                     plan.algorithms[file])

        return stream

    def _reader(self, plan: Plan) -> Reader:
        def read(file: int, offset: int, into: memoryview) -> int:
            crc = self.store.read(plan.files[file], offset, into, plan.algorithms[file])
            self.progress.add(from_store=len(into))
            return crc

        return read


@contextlib.contextmanager
def _young_objects_only() -> Iterator[None]:
    """During a fill, the garbage collector looks at objects made since it began only.

    Every ranged GET makes a few hundred short-lived objects, and the S3 client's creation tens
    of thousands; each time enough pile up, a full collection would walk everything the process
    holds (the imports, torch's among them: several hundred thousand objects) with the GIL held,
    on the one core the readers share; one set off by the client's creation came before the
    transfer, when only the transfer set them aside. Objects that exist when the fill starts
    are set aside (`gc.freeze`), those the client and the listing made once it is listed, and
    all are put back after the fill."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _agree(group: Group, fingerprint: str) -> None:
    """Every rank must have listed the same objects and built the same plan."""
    fingerprints = group.all_gather_object(fingerprint)
    differing = [r for r, f in enumerate(fingerprints) if f != fingerprint]
    if differing:
        raise GroupError(
            f"loader ranks {differing} built a different transfer plan than rank {group.rank}",
            hint="every loader needs the same settings (source, include, mode, chunk_bytes) "
                 "and the source must not change during the fill",
        )


def _conclude(group: Group | None, digests: list[str], check: Callable[[], Any]) -> Any:
    """Run this rank's final checks, then (with a group) learn every rank's outcome and compare
    chunk digests, so no rank publishes unless all agree byte for byte."""
    try:
        value, mine = check(), {"digests": digests}
    except DloError as exc:
        value, mine = exc, {"error": str(exc)}
    gathered = group.all_gather_object(mine) if group is not None else [mine]
    if isinstance(value, BaseException):
        raise value
    for rank, other in enumerate(gathered):
        if "error" in other:
            raise GroupError(f"loader rank {rank} failed: {other['error']}",
                             hint=f"see the log of rank {rank}; nothing was published")
        if other["digests"] != digests:
            chunk = next(i for i, (a, b) in enumerate(zip(digests, other["digests"])) if a != b)
            raise GroupError(f"chunk {chunk} differs between this loader and rank {rank} "
                             "(corrupted in transfer or on disk)", hint="rerun the fill")
    return value


def _check_files(directory: Path | None, plan: Plan, digests: list[str],
                 source: str) -> tuple[list[FileRecord], int]:
    """Validate every safetensors header; build the manifest records from the chunk digests."""
    from dlo_contract.safetensors_header import read_header

    assert directory is not None
    by_file: dict[int, list[str]] = {}
    for chunk in plan.chunks:
        by_file.setdefault(chunk.file, []).append(digests[chunk.index])
    tensors = 0
    records = []
    for index, obj in enumerate(plan.files):
        if obj.key.endswith(".safetensors"):
            tensors += len(read_header(directory / obj.key, source + obj.key).tensors)
        records.append(_record(obj, plan.file_chunk_bytes[index], by_file.get(index, []),
                               plan.algorithms[index]))
    return records, tensors


def _checked_files(plan: Plan) -> list[ObjectIdentity]:
    """The objects whose store checksum the fill compares: those of more than one chunk, or cut
    at their parts (a single chunk is compared across ranks only)."""
    return [obj for obj, cut, parts in zip(plan.files, plan.file_chunk_bytes, plan.part_bytes)
            if obj.size >= cut or parts is not None]


def _record(obj: ObjectIdentity, chunk_bytes: int, chunk_digests: list[str],
            algorithm: str) -> FileRecord:
    """Small files carry one digest (their single chunk's); larger ones the chunk list."""
    if obj.size > chunk_bytes:
        return FileRecord(obj.key, obj.size, chunk_bytes=chunk_bytes,
                          chunk_digests=tuple(chunk_digests), algorithm=algorithm)
    single = chunk_digests[0] if chunk_digests else digests_of.chunk_digest(b"", algorithm)
    return FileRecord(obj.key, obj.size, digest=single, algorithm=algorithm)

