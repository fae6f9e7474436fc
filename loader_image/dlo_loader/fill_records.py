"""What a fill is asked to do and what it reports: `FillRequest` (the CLI's flags and the
settings, or a test's) and `FillResult`, with the one-line summary the operator reads
(`FillResult.summary`) and the entry file the main container reads (`entry_document`).

Owns these records and how a result names the members a group finished without
(`lost_members`). Called by `fill`, which takes a request and returns a result, and by `cli`
and the tests through it. Must do no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dlo_loader.members import Member
from dlo_contract.documents import (
    EntryDocument,
    FillStatus,
    FillSummary,
    GroupMember,
    PeerBytes,
)
from dlo_contract.fill_group import Holder
from dlo_contract.names import DEFAULT_RENDEZVOUS_PORT
from dlo_contract.settings import Settings

if TYPE_CHECKING:
    from dlo_loader.survive import Survived


@dataclass(frozen=True, kw_only=True)
class FillRequest:
    settings: Settings
    rank: int = 0
    world_size: int = 1
    master_addr: str | None = None
    master_port: int = DEFAULT_RENDEZVOUS_PORT
    emit: Callable[[str], None] | None = None
    """Where progress lines go (the CLI prints them); None: no progress lines."""
    member: Member | None = None
    """This loader as its group names it (pod, node); None: by its rank alone."""
    holders: tuple[Holder, ...] = ()
    """Other nodes that hold the entry and serve it (the fill-group document's): a fill alone
    reads from them first (`peer_reads`)."""
    fill_secret: bytes | None = field(default=None, repr=False)
    """The DOD's fill secret (`fill_secret.read_fill_secret`), which keys the group's stores
    (`group_keys`) and the reads from `holders` (see [Note: who may read an entry] in
    `peer_serve`); None: an open group, and no peer is read."""


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
    wait_seconds: dict[str, float] | None = None
    """Seconds waited, by `claim.WaitKind`; None for an entry found at once."""
    without: tuple[Member, ...] = ()
    """The group's members this fill finished without (lost mid-exchange: `survive`)."""
    bytes_read_again: int = 0
    """Of `bytes_from_store`: what this loader read again for a member the group lost."""
    bytes_by_peer: tuple[PeerBytes, ...] = ()
    """A refill from the nodes that hold the entry: what each served (`peer_reads`)."""

    def summary(self) -> FillSummary:
        """The one-line JSON summary the operator reads from the termination message."""
        return FillSummary(
            status=FillStatus.OK, entry_id=self.entry_id, mode=self.mode, rank=self.rank,
            world_size=self.world_size, bytes_from_store=self.bytes_from_store,
            bytes_from_peers=self.bytes_from_peers, bytes_to_peers=self.bytes_to_peers,
            seconds=round(self.seconds, 3), cached=self.cached,
            store_checksums=self.store_checksums,
            stage_seconds={k: round(v, 3) for k, v in (self.stage_seconds or {}).items()},
            wait_seconds=self.wait_seconds,
            without=[m.rank for m in self.without] or None,
            bytes_read_again=self.bytes_read_again if self.without else None,
            lost=[GroupMember(rank=m.rank, pod=m.pod, node=m.node)
                  for m in self.without] or None,
            bytes_by_peer=list(self.bytes_by_peer) or None,
        )

    def entry_document(self) -> EntryDocument:
        """What the main container reads from the entry file."""
        return EntryDocument(entry_id=self.entry_id, kind="checkpoint", root=self.root,
                             path=self.path, source=self.source)


def lost_members(survived: Survived | None) -> tuple[Member, ...]:
    """The members a group that lost some finished without, as the group every member formed
    named them (the watch of generation 0: the first one its survivors' group retired)."""
    if survived is None:
        return ()
    first = (*survived.group.retired, survived.group.watch)[0]
    return tuple(first.member(rank) for rank in survived.without)
