"""Taking this node's publication of a fill's entry: alone, or in the fill group's node order.

Owns the steps between the listing and the transfer. A loader alone (one rank, `independent`, or
fallen back) takes its node's publication (`begin_publication`: the `.publish` lock, then room
for the entry). A loader placed in a group joins the group's store holding nothing, takes its
node's publication in the group's node order, posts what its node holds, and learns what every
member's node holds. Also owns the lines a waiting loader prints and the record of its waits.
Called by `fill`. Must not read the object store or move bytes.

[Note: node order] Each member of a fill group holds its node's publication of the entry (its
`.publish` lock and its room) until the group has published everywhere. Taken in any order, two
groups of one model on the same two nodes could each take one node and wait for the other: a
cycle that lasted until the rendezvous timeout. So a member holds nothing while its group
gathers (`transport.join`); then the members take their nodes' publications one after another,
in the order of their node keys (`locks.node_key`, the same order in every group), each once the
member before it has posted its claim. A group then waits only for a node later in the order
than every node it holds, and whoever holds that node waits only for nodes later still, so no
wait closes a cycle: of two groups, the one that takes their first common node fills while the
other waits, then finds the entry on its nodes and reads nothing from the store. A lone loader
holds one node's and waits for no one while it holds it. Room is taken with the lock, in the
same order, so waits for room close no cycle either (see [Note: room] in the cache's `room`).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dlo_loader.errors import GroupError, LoaderError, RendezvousTimeout
from dlo_loader.progress import Progress, repeating
from dlo_loader.room import node_names
from dlo_contract.cache import CacheRoot, Publication, RoomLimits, begin_publication, locks
from dlo_contract.field_names import Names
from dlo_contract.settings import Settings

if TYPE_CHECKING:  # transport imports torch: loaded only when a group is needed
    from dlo_loader.members import Member
    from dlo_loader.transport import Rendezvous

log = logging.getLogger(__name__)
WAIT_LINE_INTERVAL_S = 5.0
"""How often a waiting loader says what it waits for."""


class Standing(str, enum.Enum):
    """What a member's node holds once the member has taken its publication."""

    HOLDS = "holds"
    """The entry: the member serves its share from disk and publishes nothing."""
    FILLS = "fills"
    """The publication's tmp dir: the member writes the entry and publishes it."""
    FAILED = "failed"
    """Taking it failed: every member stops."""
    LEFT = "left"
    """It gave up waiting for the group (its rendezvous timed out) before the last member
    joined: every member applies the rendezvous policy (fail, or fill alone)."""


class WaitKind(str, enum.Enum):
    GROUP = "group"
    """For the group's loaders to join (bounded by the rendezvous timeout)."""
    TURN = "turn"
    """For the members earlier in the node order to take their nodes' publications."""
    PUBLICATION = "publication"
    """For another loader's publication of this entry on this node (its `.publish` lock)."""
    ROOM = "room"
    """For publications of other entries in progress on this node to leave room."""


@dataclass
class Waits:
    """How long this loader waited, by kind: what its summary reports."""

    seconds: dict[WaitKind, float] = field(default_factory=lambda: dict.fromkeys(WaitKind, 0.0))

    def add(self, kind: WaitKind, seconds: float) -> None:
        self.seconds[kind] += seconds

    def as_dict(self) -> dict[str, float]:
        return {kind.value: round(value, 3) for kind, value in self.seconds.items()}


@dataclass(frozen=True)
class Claim:
    """This node's publication (entered), and in a group what every member's node holds."""

    publication: Publication
    rendezvous: Rendezvous | None = None
    holders: tuple[int, ...] = ()
    """Ranks whose node held the entry when they took their publication."""
    mode: str = ""


@dataclass(frozen=True, kw_only=True)
class ClaimContext:
    """What taking a publication needs from the fill."""

    settings: Settings
    root: CacheRoot
    entry_id: str
    source: str
    """The source URI as the fill parsed it, for the lines."""
    total_bytes: int
    deadline: float
    names: Names
    progress: Progress
    emit: Callable[[str], None]
    prepare: Callable[[], None]
    """The loader's own checks and eviction, run as the publication's lock owner."""
    waits: Waits
    member: Member | None = None
    """This loader as its group names it (pod, node); None: by its rank alone."""


def claim_alone(context: ClaimContext, held: contextlib.ExitStack, mode: str) -> Claim:
    """This node's publication of the entry, for a loader that fills alone."""
    return Claim(publication=_take(context, held), mode=mode)


def claim_in_group(context: ClaimContext, held: contextlib.ExitStack, *, rank: int,
                   world_size: int, master_addr: str, master_port: int,
                   listening: Any) -> Claim:
    """Join the group holding nothing, then take this node's publication in the group's node
    order (see [Note: node order]); falls back to `claim_alone` per policy when the group does
    not gather."""
    from dlo_loader import transport

    loader = context.settings.loader
    key = locks.node_key(_ensured(context.root).locks)
    context.progress.phase = "waiting"  # metrics: phase
    started = time.monotonic()
    try:
        with repeating(context.emit, lambda waited: _gathering_line(
                context, world_size, f"{master_addr}:{master_port}", waited)):
            rendezvous = transport.join(
                master_addr=master_addr, master_port=master_port, rank=rank,
                world_size=world_size, node_key=key, timeout_s=loader.rendezvous_timeout_s,
                peer_timeout_s=loader.peer_timeout_s, member=context.member,
                listening=listening, names=context.names,
                leaving=("claim", _record(Standing.LEFT, "its rendezvous timed out")))
    except RendezvousTimeout as exc:
        # Rank 0's store stays up while this fill runs on alone: a member that joined after
        # this one gave up reads there that it left, instead of waiting for its claim.
        held.callback(_keep, listening)
        return _fall_back(context, held, exc, None)
    finally:
        context.waits.add(WaitKind.GROUP, time.monotonic() - started)
    held.push(rendezvous.leave)  # as the fill ends: the others learn whether it failed
    try:
        order = _node_order(rendezvous.node_keys(), context.root)
        position = order.index(rank)
        if position > 0:
            _wait_for_turn(context, rendezvous, order[position - 1])
        publication = _take(context, held)
    except RendezvousTimeout as exc:  # a member before this one left: the ones after follow
        rendezvous.post("claim", _record(Standing.LEFT, str(exc)))
        return _fall_back(context, held, exc, None)
    except BaseException as exc:  # the members after this one must not wait for it
        rendezvous.post("claim", _record(Standing.FAILED, str(exc)))
        raise
    standing = Standing.FILLS if publication.existing is None else Standing.HOLDS
    rendezvous.post("claim", _record(standing))
    try:
        claims = _claims(rendezvous, list(range(world_size)), context.deadline)
    except RendezvousTimeout as exc:
        return _fall_back(context, held, exc, publication)
    holders = tuple(r for r, claim in enumerate(claims) if claim["standing"] == Standing.HOLDS)
    log.info("every node of the group took its publication of entry %s; holding it already: "
             "%s", context.entry_id, ", ".join(f"rank {r}" for r in holders) or "none")
    return Claim(publication=publication, rendezvous=rendezvous, holders=holders,
                 mode=loader.mode)


def _take(context: ClaimContext, held: contextlib.ExitStack) -> Publication:
    """Enter this node's publication (waiting for another one of this entry, then for room)."""
    cache = context.settings.cache
    remaining = max(context.deadline - time.monotonic(), 1.0)
    node_max, node_floor = cache.node_limits
    publication = begin_publication(
        context.root, context.entry_id, expected_bytes=context.total_bytes,
        lock_timeout_s=remaining, names=node_names(cache, context.names),
        room=RoomLimits(max_bytes=node_max, min_free_bytes=node_floor, evict=True,
                        timeout_s=remaining),
        prepare=context.prepare)
    context.progress.phase = "waiting"  # metrics: phase
    # Taking the lock waits while another loader on this node publishes the entry.
    with repeating(context.emit, lambda waited: _publication_line(context, waited),
                   interval_s=WAIT_LINE_INTERVAL_S, at_once=False):
        entered = held.enter_context(publication)
    context.waits.add(WaitKind.PUBLICATION, entered.waited_lock_s)
    context.waits.add(WaitKind.ROOM, entered.waited_room_s)
    return entered


def _wait_for_turn(context: ClaimContext, rendezvous: Rendezvous, before: int) -> None:
    """Until the member before this one in the node order has posted its claim."""
    started = time.monotonic()
    try:
        with repeating(context.emit, lambda waited: (
                f"{context.progress.prefix} waiting {waited:.0f} s for loader rank {before} "
                f"(an earlier node in the group's node order) to take its node's publication "
                f"of entry {context.entry_id}"), interval_s=WAIT_LINE_INTERVAL_S, at_once=False):
            _claims(rendezvous, [before], context.deadline)
    finally:
        context.waits.add(WaitKind.TURN, time.monotonic() - started)


def _claims(rendezvous: Rendezvous, ranks: list[int], deadline: float) -> list[dict[str, str]]:
    """The claims `ranks` posted; a failed one fails this loader too, and one that left raises
    `RendezvousTimeout` (the caller applies the policy)."""
    posted = [json.loads(text) for text in rendezvous.wait_posted("claim", ranks, deadline)]
    for rank, claim in zip(ranks, posted):
        if claim["standing"] == Standing.FAILED:
            member = rendezvous.member(rank)
            raise GroupError(f"{member} failed: {claim['error']}",
                             hint=f"{member.log_hint()}; nothing was published")
        if claim["standing"] == Standing.LEFT:
            raise RendezvousTimeout(
                f"loader rank {rank} left the group at {rendezvous.where} before it formed: "
                f"{claim['error']}",
                hint="start every loader of the group within the rendezvous timeout")
    return posted


def _fall_back(context: ClaimContext, held: contextlib.ExitStack, exc: RendezvousTimeout,
               publication: Publication | None) -> Claim:
    """The rendezvous policy: fail, or fill alone (with this node's publication, if taken)."""
    if context.settings.loader.on_rendezvous_timeout == "fail":
        raise exc
    log.warning("%s; falling back to independent mode: this loader reads every byte", exc)
    if publication is None:
        return claim_alone(context, held, "independent")
    return Claim(publication=publication, mode="independent")


def _keep(store: Any) -> None:
    """Called as the fill ends, holding `store` until then."""


def _record(standing: Standing, error: str = "") -> str:
    """A member's claim as the group's store carries it."""
    return json.dumps({"standing": standing.value, "error": error})


def _node_order(keys: list[str], root: CacheRoot) -> list[int]:
    """Ranks in the order their nodes' publications are taken; one node per member."""
    seen: dict[str, int] = {}
    for rank, key in enumerate(keys):
        if key in seen:
            raise LoaderError(
                f"loader ranks {seen[key]} and {rank} of the group use the same node cache "
                f"({root.path}): a fill group has one loader per node",
                hint="give each loader of a group its own node (or cache root)")
        seen[key] = rank
    return sorted(range(len(keys)), key=lambda rank: keys[rank])


def _ensured(root: CacheRoot) -> CacheRoot:
    root.ensure()
    return root


def _publication_line(context: ClaimContext, waited_s: float) -> str:
    return (f"{context.progress.prefix} waiting {waited_s:.0f} s for another loader on this "
            f"node to publish entry {context.entry_id} ({context.source}); "
            "this loader uses it once published")


def _gathering_line(context: ClaimContext, world_size: int, where: str, waited_s: float) -> str:
    """What an operator reading the pod log needs while the group gathers: every loader placed
    in the group joins it (one whose node holds the entry serves its share from disk), so a
    wait this long means a loader of the group has not started (a pod pending or crashing);
    past the timeout, the policy applies."""
    loader, names = context.settings.loader, context.names
    left = max(loader.rendezvous_timeout_s - waited_s, 0.0)
    then = ("this loader reads everything itself"
            if loader.on_rendezvous_timeout == "independent" else "this loader fails")
    return (f"{context.progress.prefix} waiting for {world_size} loaders at {where}; after "
            f"{left:.0f} s {then} ({names('loader.on_rendezvous_timeout')}="
            f"{loader.on_rendezvous_timeout}); this loader holds nothing meanwhile; a loader "
            "that has not joined has not started (check the group's pods)")
