"""The loader group's rendezvous over torch.distributed: from the store to the process group.

Owns the rendezvous. `listen` opens rank 0's TCP store as early as its fill starts (see [Note:
listening early]); `join` joins the N loaders at that store with a deadline (the store barrier
waits for all N, so a late loader is found out before any collective starts); past it,
`RendezvousTimeout`, and the caller applies its fallback policy. The `Rendezvous` it returns
carries the members' small records through the store (node keys, claims: see [Note: node order]
in `claim`) and forms the process group, a `group.Group`. Every member joins with its pod and
node (`members.Member`) and from then on runs each store call through its `peers.PeerWatch`.
As it joins, every member other than rank 0 opens a store of its own and posts its address,
where survivors meet once rank 0 is lost (`group_stores`). Called by `fill` and `claim`. Must
not read the object store or write the cache.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from typing import Any

import torch.distributed as dist

from dlo_loader.errors import GroupError, MemberLost, RendezvousTimeout
from dlo_loader.group import Group, first_line
from dlo_loader.group_stores import ADDRESS_KEY, Stores, open_store
from dlo_loader.members import MEMBER_KEY, Member
from dlo_loader.peers import PeerWatch, interruptible
from dlo_contract.field_names import Names, document_names

log = logging.getLogger(__name__)

_JOINED_KEY = "dlo/joined"
_ALL_JOINED_KEY = "dlo/all-joined"
FORMED_KEY = "dlo/formed"
"""Counts the loaders whose process group is up (connected to every peer), for whoever watches."""
_NODE_KEY = "dlo/node"
"""`dlo/node/<rank>`: the member's node key (`claim.node_key`), posted as it joins."""


def _store(master_addr: str, master_port: int, world_size: int, *, is_master: bool,
           timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(master_addr, master_port, world_size, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def listen(*, master_addr: str, master_port: int, world_size: int,
           timeout_s: float) -> dist.TCPStore | None:
    """Rank 0's rendezvous store, listening from now on, or None where it cannot listen
    (`rendezvous` then tries again and says why).

    [Note: listening early] Rank 0 listens as its fill starts, not once it has listed the
    source: the other loaders connect when they are ready to join, and a connection refused
    because rank 0 was still listing makes torch's store client retry after a backoff, which the
    whole group then waits for (with 8 loaders starting together in `dlo bench cluster`, a
    larger part of a second than rank 0's listing took)."""
    try:
        return _store(master_addr, master_port, world_size, is_master=True, timeout_s=timeout_s)
    except (RuntimeError, dist.DistError, OSError) as exc:
        log.debug("the rendezvous store cannot listen on port %d yet: %s", master_port, exc)
        return None


class Rendezvous:
    """The group's store before its process group exists: every loader has joined it; members
    post small records under a topic (`post`) and wait for one another's (`wait_posted`), then
    `form` the process group. Rank 0 hosts the store: it must outlive every member's use."""

    def __init__(self, store: Any, *, rank: int, world_size: int, where: str,
                 watch: PeerWatch, stores: Stores) -> None:
        self.rank, self.world_size, self.where = rank, world_size, where
        self._store = store
        self._watch = watch
        self.stores = stores
        """Every member's store, for the survivors of a lost one (`regroup`)."""

    def member(self, rank: int) -> Member:
        """Rank `rank` as a person finds it (its pod and node)."""
        return self._watch.member(rank)

    def node_keys(self) -> list[str]:
        """Every member's node key, posted as it joined (see `join`), by rank."""
        return [value.decode() for value in self._watch.call(self._store.multi_get, [
            f"{_NODE_KEY}/{rank}" for rank in range(self.world_size)])]

    def post(self, topic: str, value: str) -> None:
        self._watch.call(self._store.set, f"dlo/{topic}/{self.rank}", value)

    def wait_posted(self, topic: str, ranks: list[int], deadline: float) -> list[str]:
        """What `ranks` posted under `topic`, waiting for them until `deadline` (monotonic),
        or until the watch finds a member lost."""
        keys = [f"dlo/{topic}/{rank}" for rank in ranks]
        try:
            remaining = max(deadline - time.monotonic(), 0.001)
            self._watch.call(self._store.wait, keys, datetime.timedelta(seconds=remaining))
            return [value.decode() for value in self._watch.call(self._store.multi_get, keys)]
        except (RuntimeError, dist.DistError) as exc:
            log.info("waiting for the %s of rank(s) %s failed: %s", topic, ranks,
                     first_line(exc))
            raise GroupError(
                f"{', '.join(str(self.member(rank)) for rank in ranks)} of the group at "
                f"{self.where} did not post their {topic} in time",
                hint="see the log of those loaders; a loader that died stops the group") from exc

    def form(self, *, backend: str, collective_timeout_s: float) -> Group:
        """The process group of every member (each one calls it). Where a member is lost
        while it forms, the group returned has none: its first collective raises that loss,
        which the fill survives like one in the exchange (`survive`)."""
        group = Group(rank=self.rank, world_size=self.world_size, backend=backend,
                      store=self._store, watch=self._watch, stores=self.stores,
                      collective_timeout_s=collective_timeout_s)
        try:
            self._watch.call(
                dist.init_process_group, backend, store=self._store, rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=collective_timeout_s))
            self._watch.call(self._store.add, FORMED_KEY, 1)
        except MemberLost:
            log.warning("the loader group at %s lost a member while it formed", self.where)
            return group
        except (RuntimeError, dist.DistError, OSError) as exc:
            log.info("forming the group failed: %s", first_line(exc))
            loss = self._watch.wait_lost()
            if loss is not None:
                error = self._watch.error(loss)
                if isinstance(error, MemberLost):
                    return group
                raise error from exc
            raise GroupError(
                f"the loader group at {self.where} did not form: {first_line(exc)}",
                hint="another loader died or cannot be reached; see its log, then rerun every "
                     "loader") from exc
        log.info("formed the loader group of %d at %s (%s)", self.world_size, self.where,
                 backend)
        return group

    def leave(self, exc_type: type[BaseException] | None = None,
              exc: BaseException | None = None, traceback: object = None) -> None:
        """The fill ends, with `exc` or not (an `ExitStack` exit callback): unless a group
        formed from it has left already, the others learn that this member left and why."""
        self._watch.leave(exc)
        self._store = None


def join(
    *, master_addr: str, master_port: int, rank: int, world_size: int, node_key: str,
    timeout_s: float, peer_timeout_s: float, member: Member | None = None,
    listening: dist.TCPStore | None = None, names: Names = document_names,
    leaving: tuple[str, str] | None = None,
) -> Rendezvous:
    """Join the group's store with this loader's `node_key` and `member` record (its pod and
    node) and wait until all `world_size` loaders have, or raise `RendezvousTimeout` when they
    do not in `timeout_s` seconds (or the master cannot be reached); then watch the members'
    heartbeats (`peer_timeout_s`, see [Note: heartbeat] in `peers`). `listening`: rank 0's
    store from `listen`, else it is made here; `names` spells the settings in the errors;
    `leaving`: a (topic, value) this loader posts as it gives up, for members that joined after
    it stopped waiting and now wait for its post. Waits holding nothing (see [Note: node
    order] in `claim`)."""
    deadline = time.monotonic() + timeout_s
    where = f"{master_addr}:{master_port}"
    store = listening
    own = None
    try:
        # Blocking calls into torch's store run where SIGTERM can still end the wait.
        store = listening if listening is not None else interruptible(lambda: _store(
            master_addr, master_port, world_size, is_master=rank == 0, timeout_s=timeout_s))
        store.set(f"{_NODE_KEY}/{rank}", node_key)  # before it counts as joined
        store.set(f"{MEMBER_KEY}/{rank}", (member or Member(rank)).to_json())
        if rank != 0:  # a store for the survivors of rank 0 (see `group_stores`)
            own, address = open_store(master_addr, master_port, world_size, peer_timeout_s)
            store.set(f"{ADDRESS_KEY}/{rank}", address)
        if store.add(_JOINED_KEY, 1) == world_size:
            store.set(_ALL_JOINED_KEY, "1")
        # Every rank waits here until all have joined, so a late loader is found out at once.
        remaining = max(deadline - time.monotonic(), 0.001)
        interruptible(lambda: store.wait([_ALL_JOINED_KEY],
                                         datetime.timedelta(seconds=remaining)))
        members = [Member.from_json(r, value.decode()) for r, value in enumerate(
            store.multi_get([f"{MEMBER_KEY}/{r}" for r in range(world_size)]))]
        addresses = (where, *(value.decode() for value in store.multi_get(
            [f"{ADDRESS_KEY}/{r}" for r in range(1, world_size)])))
    except (RuntimeError, dist.DistError, OSError) as exc:
        if store is not None and leaving is not None:
            with contextlib.suppress(RuntimeError, dist.DistError, OSError):
                store.set(f"dlo/{leaving[0]}/{rank}", leaving[1])
        raise RendezvousTimeout(
            f"rendezvous of {world_size} loaders at {where} did not complete within "
            f"{timeout_s:g} s: {first_line(exc)}",
            hint="start every loader (one per node) with the same master address and world "
                 f"size, or set {names('loader.on_rendezvous_timeout')}=independent",
        ) from exc
    log.info("joined the loader group of %d at %s", world_size, where)
    stores = Stores(addresses=addresses, own=store if rank == 0 else own,
                    world_size=world_size, timeout_s=peer_timeout_s)
    watch = PeerWatch(rank=rank, members=members, timeout_s=peer_timeout_s, names=names,
                      connect=lambda: _store(master_addr, master_port, world_size,
                                             is_master=False, timeout_s=peer_timeout_s),
                      gone=stores.gone)
    return Rendezvous(store, rank=rank, world_size=world_size, where=where, watch=watch,
                      stores=stores)
