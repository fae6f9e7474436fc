"""The loader group: rendezvous and collectives over torch.distributed.

Owns every call to torch.distributed. `listen` opens rank 0's TCP store as early as its fill
starts (see [Note: listening early]); `rendezvous` joins the N loaders at that store with a
deadline (the store barrier waits for all N, so a late loader is found out before any
collective starts); past it, `RendezvousTimeout`, and the caller applies its fallback policy.
`Group` offers what the exchange needs: a status exchange (who failed, who is ready; polled only
while a rank is late for a round), an all-gather of one chunk per rank (gloo's ring), and an
all-gather of small objects (plan fingerprints, chunk digest lists). Collectives use a short
timeout; a peer that dies closes its sockets, which fails the others' next collective at once.
Backend `gloo` works on CPU buffers; `nccl` stages each chunk through the current CUDA device.
Called by `fill` and `exchange`. Must not read the object store or write the cache.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlo_loader.errors import GroupError, RendezvousTimeout
from dlo_contract.field_names import Names, document_names

log = logging.getLogger(__name__)

_JOINED_KEY = "dlo/joined"
_ALL_JOINED_KEY = "dlo/all-joined"
_FORMED_KEY = "dlo/formed"
"""Counts the loaders whose process group is up (connected to every peer), for whoever watches."""


@dataclass(frozen=True)
class RoundStatus:
    failed: tuple[int, ...]
    """Ranks that reported a failure in this round."""
    all_ready: bool
    """Every rank has its chunk for this round in memory."""


class Group:
    """An initialized process group of `world_size` loaders; `close()` tears it down."""

    def __init__(self, *, rank: int, world_size: int, backend: str, store: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self._store = store  # rank 0 hosts the store: keep it alive as long as the group
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    def status(self, *, failed: bool, ready: bool) -> RoundStatus:
        """Tell every rank whether this one failed and whether it is ready; learn theirs."""
        flags = torch.zeros(2 * self.world_size, dtype=torch.int64, device=self.device)
        flags[self.rank] = int(failed)
        flags[self.world_size + self.rank] = int(ready)
        self._call("a status exchange", dist.all_reduce, flags)
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
            work = self._call(what, dist.all_gather_single, incoming, outgoing,
                              async_op=True)
            return lambda: self._call(what, work.wait)
        staged = torch.empty_like(incoming, device=self.device)
        work = self._call(what, dist.all_gather_single, staged, outgoing.to(self.device),
                          async_op=True)

        def wait() -> None:
            self._call(what, work.wait)
            incoming.copy_(staged.cpu())

        return wait

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        self._call("an all-gather", dist.all_gather_object, gathered, obj)
        return gathered

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None

    def _call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GroupError(
                f"lost contact with the loader group during {what}: {first}",
                hint="another loader died or hung; see its log, then rerun every loader",
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


def rendezvous(
    *, backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
    timeout_s: float, collective_timeout_s: float, listening: dist.TCPStore | None = None,
    names: Names = document_names,
) -> Group:
    """Join the group, or raise `RendezvousTimeout` when not all `world_size` loaders join in
    `timeout_s` seconds (or the master cannot be reached); `listening`: rank 0's store from
    `listen`, else it is made here; `names` spells the settings in the error."""
    deadline = time.monotonic() + timeout_s
    where = f"{master_addr}:{master_port}"
    try:
        store = listening if listening is not None else _store(
            master_addr, master_port, world_size, is_master=rank == 0, timeout_s=timeout_s)
        if store.add(_JOINED_KEY, 1) == world_size:
            store.set(_ALL_JOINED_KEY, "1")
        # Every rank waits here until all have joined, so no collective starts with a late peer.
        remaining = max(deadline - time.monotonic(), 0.001)
        store.wait([_ALL_JOINED_KEY], datetime.timedelta(seconds=remaining))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        store.add(_FORMED_KEY, 1)
    except (RuntimeError, dist.DistError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousTimeout(
            f"rendezvous of {world_size} loaders at {where} did not complete within "
            f"{timeout_s:g} s: {first}",
            hint="start every loader (one per node) with the same master address and world "
                 f"size, or set {names('loader.on_rendezvous_timeout')}=independent",
        ) from exc
    log.info("joined the loader group of %d at %s (%s)", world_size, where, backend)
    return Group(rank=rank, world_size=world_size, backend=backend, store=store)
