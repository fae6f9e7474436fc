"""The loader group: rendezvous and collectives over torch.distributed.

Owns every call to torch.distributed. `listen` opens rank 0's TCP store as early as its fill
starts (see [Note: listening early]); `join` joins the N loaders at that store with a deadline
(the store barrier waits for all N, so a late loader is found out before any collective starts);
past it, `RendezvousTimeout`, and the caller applies its fallback policy. The `Rendezvous` it
returns carries the members' small records through the store (node keys, claims: see [Note:
node order] in `claim`) and forms the process group.
`Group` offers what the exchange needs: a status exchange (who failed, who is ready; polled only
while a rank is late for a round), an all-gather of one chunk per rank (gloo's ring), and an
all-gather of small objects (plan fingerprints, chunk digest lists). Every member joins with its
pod and node (`peers.Member`) and from then on runs each store call and collective through its
`peers.PeerWatch`, so a member that dies or goes silent fails the others within
`loader.peer_timeout_s`, naming it (see [Note: heartbeat] in `peers`); gloo's own timeout is only
the fill's deadline. Backend `gloo` works on CPU buffers; `nccl` stages each chunk through the
current CUDA device. As it joins, every member other than rank 0 opens a store of its own and
posts its address, where survivors meet once rank 0 is lost (`group_stores`); a group of
survivors runs the same collectives on a gloo process group made over such a store
(`regroup`). A member lost while the process group forms leaves the others a group without
one, whose first collective raises the loss (`survive` goes on from there). Called by `fill`
and `exchange`. Must not read the object store or write the cache.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlo_loader.errors import GroupError, MemberLost, RendezvousTimeout
from dlo_loader.group_stores import ADDRESS_KEY, Stores, open_store
from dlo_loader.peers import MEMBER_KEY, Member, PeerWatch, interruptible
from dlo_contract.field_names import Names, document_names

log = logging.getLogger(__name__)

_JOINED_KEY = "dlo/joined"
_ALL_JOINED_KEY = "dlo/all-joined"
FORMED_KEY = "dlo/formed"
"""Counts the loaders whose process group is up (connected to every peer), for whoever watches."""
_NODE_KEY = "dlo/node"
"""`dlo/node/<rank>`: the member's node key (`claim.node_key`), posted as it joins."""


@dataclass(frozen=True)
class RoundStatus:
    failed: tuple[int, ...]
    """Ranks that reported a failure in this round."""
    all_ready: bool
    """Every rank has its chunk for this round in memory."""


class Group:
    """An initialized process group of `world_size` loaders; `close()` tears it down."""

    def __init__(self, *, rank: int, world_size: int, backend: str, store: Any,
                 watch: PeerWatch, stores: Stores, pg: Any = None, generation: int = 0,
                 ranks: tuple[int, ...] | None = None, collective_timeout_s: float = 0.0,
                 retired: tuple[PeerWatch, ...] = ()) -> None:
        self.rank = rank
        """This member's rank in this group (its index among `members`)."""
        self.world_size = world_size
        self.backend = backend
        self._store = store  # the connection the group formed over: kept as long as the group
        self.stores = stores
        """Every member's store (the one this member hosts kept open: see `group_stores`)."""
        self._watch = watch
        self.pg = pg
        """The process group the collectives run on: None for the first (the default group),
        else the survivors' gloo process group, made directly over their store (`regroup`).
        None also where a member was lost while it formed: then every call raises that loss
        (the watch's verdict) before it could reach a process group."""
        self.generation = generation
        """0 for the group every member formed, one more for each group of survivors."""
        self.ranks = ranks if ranks is not None else tuple(range(world_size))
        """Each member's rank in the group every member formed, by its rank in this one."""
        self.collective_timeout_s = collective_timeout_s
        self.retired = retired
        """The watches of the groups this one replaced (`regroup`): they keep beating, so a
        member that comes back finds the verdict that dropped it, until this group closes."""
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    def status(self, *, failed: bool, ready: bool) -> RoundStatus:
        """Tell every rank whether this one failed and whether it is ready; learn theirs."""
        flags = torch.zeros(2 * self.world_size, dtype=torch.int64, device=self.device)
        flags[self.rank] = int(failed)
        flags[self.world_size + self.rank] = int(ready)
        if self.pg is None:
            self._call("a status exchange", dist.all_reduce, flags)
        else:
            self._call("a status exchange", lambda: self.pg.allreduce([flags]).wait())
        values = flags.tolist()
        failed_ranks = tuple(r for r in range(self.world_size) if values[r])
        all_ready = sum(values[self.world_size:]) == self.world_size
        return RoundStatus(failed=failed_ranks, all_ready=all_ready)

    def all_gather_into(self, send: memoryview, receive: memoryview) -> Callable[[], None]:
        """Start putting every rank's `send` (all the same length) into its slot of `receive`
        (`world_size` times that length, rank by rank) on every rank; gloo runs it as a ring,
        every link busy in every step. Returns the call that waits for it to end; both buffers
        must stay untouched until then. Several may be in flight, waited for in order."""
        what = "a chunk all-gather"
        outgoing = torch.frombuffer(send, dtype=torch.uint8)
        incoming = torch.frombuffer(receive, dtype=torch.uint8)
        if self.device.type == "cpu":
            work = self._call(what, self._all_gather, incoming, outgoing)
            return lambda: self._call(what, work.wait)
        staged = torch.empty_like(incoming, device=self.device)
        work = self._call(what, self._all_gather, staged, outgoing.to(self.device))

        def wait() -> None:
            self._call(what, work.wait)
            incoming.copy_(staged.cpu())

        return wait

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        if self.pg is None:
            self._call("an all-gather", dist.all_gather_object, gathered, obj)
            return gathered
        # A process group made directly is in none of torch's maps, which its object
        # collectives look it up in: the pickles go as one all-gather of their lengths and one
        # of the bytes, each padded to the longest.
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        lengths = torch.zeros(self.world_size, dtype=torch.int64)
        self._call("an all-gather", lambda: self._all_gather(
            lengths, torch.tensor([len(data)], dtype=torch.int64)).wait())
        width = int(lengths.max())
        padded = torch.zeros(self.world_size * width, dtype=torch.uint8)
        self._call("an all-gather", lambda: self._all_gather(
            padded, torch.cat([data, torch.zeros(width - len(data), dtype=torch.uint8)])).wait())
        return [pickle.loads(padded[r * width:r * width + int(n)].numpy().tobytes())
                for r, n in enumerate(lengths.tolist())]

    def _all_gather(self, incoming: torch.Tensor, outgoing: torch.Tensor) -> Any:
        """Start gathering every rank's `outgoing` into `incoming`; the work to wait for."""
        if self.pg is None:
            return dist.all_gather_single(incoming, outgoing, async_op=True)
        return self.pg._allgather_base(incoming, outgoing)  # noqa: SLF001 (gloo's own)

    def member(self, rank: int) -> Member:
        """Rank `rank` as a person finds it (its pod and node)."""
        return self._watch.member(rank)

    @property
    def watch(self) -> PeerWatch:
        return self._watch

    @property
    def store(self) -> Any:
        return self._store

    def close(self, error: BaseException | None = None) -> None:
        """Tell the others this member ends (finished, or failed with `error`) and tear the
        group down, unless a call was cut short (a loss, a signal): gloo's teardown would wait
        for it, and the process ends without it."""
        self._watch.leave(error)
        for retired in self.retired:
            retired.leave(error)
        # A group of survivors is never torn down: the default group's call cut short by the
        # loss is still waiting, and tearing it down would wait for it.
        if dist.is_initialized() and self._watch.idle and not self.retired:
            dist.destroy_process_group()
        self._store = None
        self.stores.close()

    def _call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._watch.call(function, *args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            # gloo says a peer's sockets closed, not whose: the heartbeat tells (see [Note:
            # heartbeat] in `peers`); its raw text (paths, ports) goes to the log only.
            log.info("%s failed: %s", what, _first_line(exc))
            loss = self._watch.wait_lost()
            if loss is not None:
                raise self._watch.error(loss) from exc
            raise GroupError(
                f"lost contact with the loader group during {what}, while every loader of it "
                "still sends heartbeats",
                hint="check the network between the group's nodes (the loaders' peer ports), "
                     "then rerun every loader",
            ) from exc


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
                     _first_line(exc))
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
            log.info("forming the group failed: %s", _first_line(exc))
            loss = self._watch.wait_lost()
            if loss is not None:
                error = self._watch.error(loss)
                if isinstance(error, MemberLost):
                    return group
                raise error from exc
            raise GroupError(
                f"the loader group at {self.where} did not form: {_first_line(exc)}",
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
            f"{timeout_s:g} s: {_first_line(exc)}",
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
