"""One fill of the node cache from object storage: the loader protocol of docs/design.md section 5.

Owns the order of the phases and the decisions between them: list the source and derive the
entry id first, and if this node already holds a valid entry, return at once (no object-store
reads, no rendezvous) unless the operator placed this loader in a fill group (then it joins and
serves its ranges from disk). Else take this node's publication (`claim`: alone, or in the
group's node order, see [Note: node order] there; the publication evicts unused entries and
reserves room for the new one), build the plan (where some members' nodes hold the entry, only
they read, from disk), start reading this rank's share (see [Note: reading before the group] in
`exchange`), form the group, and run the transfer (`transfer`: exchange, headers, store
checksums, digests compared across ranks, commit). A node whose entry appeared while it waited
serves its share from disk and publishes nothing. A fill alone whose entry other nodes hold
(the fill-group document's holders) reads it from them first (`peer_reads`). Any failure
leaves no entry (the publication removes its tmp dir). Called by `cli` (and by tests
in-process for one rank). Must not parse flags or print: it takes a `FillRequest` and returns a
`FillResult` (`fill_records`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlo_loader import metrics
from dlo_loader.claim import Claim, ClaimContext, Waits, claim_alone, claim_in_group
from dlo_loader.errors import LoaderError
from dlo_loader.fill_records import FillRequest, FillResult, lost_members
from dlo_loader.plan import Plan, build_plan
from dlo_loader.progress import Progress, rank_prefix
from dlo_loader.room import make_room_within
from dlo_loader.sources import SourceOptions, open_source, parse_source
from dlo_loader.transfer import Transfer
from dlo_contract.cache import (
    CacheRoot,
    ObjectIdentity,
    checkpoint_identity,
    entry_id,
    find_entry,
)
from dlo_contract.units import human_bytes
from dlo_contract.validation import names_for

if TYPE_CHECKING:
    from dlo_loader.peer_reads import PeerReads
    from dlo_loader.group import Group

TRANSFER_MODULES = ("dlo_loader.exchange", "dlo_loader.sink", "dlo_contract.safetensors_header")
"""Imported when the transfer starts, not before the listing: `cli` imports them on a thread
while this process lists the source (see `cli.preload_transfer_modules`)."""

__all__ = ["TRANSFER_MODULES", "FillRequest", "FillResult", "fill"]
log = logging.getLogger(__name__)


def fill(request: FillRequest) -> FillResult:
    """Make sure this node's cache holds the checkpoint; see the module docstring for the steps."""
    with _young_objects_only():
        return _Fill(request).run()


class _Fill:
    """The state of one fill, shared by its phases."""

    def __init__(self, request: FillRequest) -> None:
        self.request = request
        self.started = time.monotonic()
        self.loader, self.cache = request.settings.loader, request.settings.cache
        self.deadline = self.started + self.loader.timeout_s
        self.names = names_for(request.settings)
        """How this fill's messages spell the settings, resolved once (see `names_for`)."""
        self.uri = parse_source(self.loader.source, self.names)
        self._listening = self._listen()
        """Rank 0's rendezvous store, listening while the fill lists (until the claim)."""
        self.stop = threading.Event()
        self.store = open_source(self.uri, SourceOptions.of(
            self.loader, stop=self.stop, on_stall=self._stalled, names=self.names))
        self.root = CacheRoot(self.cache.root)
        self.waits = Waits()
        self.progress = Progress(total_bytes=0, emit=request.emit,
                                 prefix=rank_prefix(request.rank, request.world_size))
        self.transfer = Transfer(store=self.store, progress=self.progress, config=self.loader,
                                 rank=request.rank, deadline=self.deadline, stop=self.stop,
                                 source=str(self.uri), names=self.names)
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
        gc.freeze()  # the store client's (S3's service model) too (see `_young_objects_only`)
        identity = checkpoint_identity(str(self.uri), files, self.names)
        eid = entry_id(identity)
        self.progress.total_bytes = total = sum(f.size for f in files)
        log.info("%s: %d objects, %s; entry %s", self.uri, len(files), human_bytes(total), eid)
        existing = find_entry(self.root, eid, self.cache.verify)
        if existing is not None and not self._in_group():
            log.info("entry %s is cached already at %s; nothing to read", eid, existing)
            return self._result(eid, existing, self.loader.mode, cached=True, waited=False)
        with contextlib.ExitStack() as held:
            claim = self._claim(eid, total, held)
            pub = claim.publication
            if claim.rendezvous is None:
                if pub.existing is not None:
                    return self._result(eid, pub.existing, claim.mode, cached=True)
                self.transfer.peers = self._peers(eid, identity)
                self.transfer.run(pub, self._plan(files, claim), None, identity, None)
            else:
                self._in_group_transfer(claim, files, identity)
            final = pub.existing or pub.committed
        assert final is not None
        return self._result(eid, final, claim.mode, cached=pub.existing is not None)

    def _claim(self, eid: str, total: int, held: contextlib.ExitStack) -> Claim:
        """This node's publication: alone, or in the group's node order."""
        context = ClaimContext(
            settings=self.request.settings, root=self.root, entry_id=eid, source=str(self.uri),
            total_bytes=total,
            deadline=self.deadline, names=self.names, progress=self.progress,
            emit=self.request.emit or log.info, waits=self.waits, member=self.request.member,
            # This deployment's own limits (`room`); the node's are the publication's room.
            prepare=lambda: make_room_within(self.root, eid, incoming_bytes=total,
                                             cache=self.cache, names=self.names))
        request = self.request
        if not self._in_group():
            return claim_alone(context, held, self.loader.mode)
        if not request.master_addr:
            raise LoaderError(
                f"world size {request.world_size} needs a rendezvous address",
                hint="pass --master-addr or set MASTER_ADDR (rank 0's stable DNS name)",
            )
        listening, self._listening = self._listening, None  # the group's from here, or dropped
        return claim_in_group(context, held, rank=request.rank, world_size=request.world_size,
                              master_addr=request.master_addr,
                              master_port=request.master_port, listening=listening)

    def _in_group_transfer(self, claim: Claim, files: list[ObjectIdentity],
                           identity: dict[str, Any]) -> None:
        """Read this rank's share before the group forms, form it, and run the transfer; where
        every member's node holds the entry, only agree (the members end together)."""
        assert claim.rendezvous is not None
        pub, plan = claim.publication, self._plan(files, claim)
        everywhere = len(claim.holders) == self.request.world_size
        exchange = (self.transfer.start(pub, plan, grouped=True)
                    if pub.existing is None else None)
        try:
            # A silent peer is the heartbeat's to find (see [Note: heartbeat] in `peers`):
            # gloo's own timeout is only the fill's deadline.
            group = claim.rendezvous.form(
                backend=self.loader.backend,
                collective_timeout_s=max(self.deadline - time.monotonic(), 1.0))
        except BaseException:
            if exchange is not None:  # stop reading, and the progress lines before the summary
                exchange.abandon()
                self.progress.stop()
            raise
        try:
            if everywhere:
                self._agree_held(group, plan)
            else:
                self.transfer.run(pub, plan, group, identity, exchange)
        except BaseException as exc:  # the others name this loader and why it left
            self._last_group(group).close(exc)
            raise
        self._last_group(group).close()

    def _agree_held(self, group: Group, plan: Plan) -> None:
        """Every member's node holds the entry: the members only agree on the plan, and a member
        lost meanwhile costs the others nothing (nothing moves, nobody publishes)."""
        from dlo_loader.checks import agree
        from dlo_loader.errors import MemberLost

        try:
            agree(group, plan.fingerprint)
        except MemberLost:
            loss = group.watch.lost()
            if loss is None:
                raise
            log.warning("%s was lost while the group agreed on the plan; every node holds the "
                        "entry already, so this loader finishes", loss.member)

    def _last_group(self, group: Group) -> Group:
        """The group the fill ends in: its survivors' where it lost a member (`survive`)."""
        survived = self.transfer.survived
        return survived.group if survived is not None else group

    def _peers(self, eid: str, identity: dict[str, Any]) -> PeerReads | None:
        """The reads from the other nodes that hold the entry, for a fill alone; None when the
        document names none, none serves it, or this loader has no fill secret to show them."""
        secret = self.request.fill_secret
        if not self.request.holders or secret is None:
            return None
        from dlo_loader.peer_reads import open_peers

        return open_peers(self.request.holders, entry_id=eid, identity=identity, secret=secret,
                          timeout_s=self.loader.stall_timeout_s, progress=self.progress)

    def _plan(self, files: list[ObjectIdentity], claim: Claim) -> Plan:
        grouped = claim.rendezvous is not None
        return build_plan(files, mode=claim.mode,
                          world_size=self.request.world_size if grouped else 1,
                          chunk_bytes=self.loader.chunk_bytes,
                          algorithms=self.store.chunk_algorithms,
                          part_bytes=self.store.part_bytes, sources=claim.holders)

    def _in_group(self) -> bool:
        """A loader placed in a group joins it even when its node holds the entry (it serves
        its ranges from disk), so the other members never wait out the rendezvous for it."""
        return self.request.world_size > 1 and self.loader.mode != "independent"

    def _result(self, eid: str, path: Path, mode: str, *, cached: bool,
                waited: bool = True) -> FillResult:
        store_check, survived = self.transfer.store_check, self.transfer.survived
        return FillResult(
            without=lost_members(survived),
            bytes_by_peer=tuple(self.transfer.peers.bytes_by_peer()) if self.transfer.peers
            else (),
            bytes_read_again=survived.read_again if survived is not None else 0,
            store_checksums=store_check.summary if store_check else "none",
            stage_seconds=None if cached else dict(self.progress.stage_seconds),
            wait_seconds=self.waits.as_dict() if waited else None,
            entry_id=eid, root=str(self.root.path), path=str(path), source=str(self.uri),
            mode=mode, rank=self.request.rank, world_size=self.request.world_size, cached=cached,
            bytes_from_store=self.progress.bytes_from_store,
            bytes_from_peers=self.progress.bytes_from_peers,
            bytes_to_peers=self.progress.bytes_to_peers,
            seconds=time.monotonic() - self.started,
        )

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
