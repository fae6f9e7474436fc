"""The loader group's collectives over torch.distributed, once its process group is formed.

Owns `Group`, what the exchange needs: a status exchange (who failed, who is ready; polled only
while a rank is late for a round), an all-gather of one chunk per rank (gloo's ring), and an
all-gather of small objects (plan fingerprints, chunk digest lists). Each collective runs
through the member's `peers.PeerWatch`, so a member that dies or goes silent fails the others
within `loader.peer_timeout_s`, naming it (see [Note: heartbeat] in `peers`); gloo's own timeout
is only the fill's deadline. Backend `gloo` works on CPU buffers; `nccl` stages each chunk
through the current CUDA device. A group of survivors runs the same collectives on a gloo
process group made over a member's store (`regroup`); a member lost while the process group
forms leaves the others a group without one, whose first collective raises the loss. Made by
`transport` (the group every member formed) and `regroup`; called by `exchange`, `ring`,
`checks` and `survive`. Must not read the object store or write the cache.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlo_loader.errors import GroupError, MemberLost
from dlo_loader.group_stores import Stores
from dlo_loader.members import Member
from dlo_loader.peers import PeerWatch

log = logging.getLogger(__name__)


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
            log.info("%s failed: %s", what, first_line(exc))
            loss = self._watch.wait_lost()
            if loss is not None:
                raise self._watch.error(loss) from exc
            raise GroupError(
                f"lost contact with the loader group during {what}, while every loader of it "
                "still sends heartbeats",
                hint="check the network between the group's nodes (the loaders' peer ports), "
                     "then rerun every loader",
            ) from exc


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
