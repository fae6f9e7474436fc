"""The stores a fill group's generations meet at: rank 0's, and one every other member hosts.

Owns where each member's store listens and how a member reaches one (see [Note: a store for
every generation]). Called by `transport` (each member opens its store and posts its address
as it joins) and `regroup` (the survivors meet at the store of the lowest rank left). Must not
run collectives or decide who is lost.

[Note: a store for every generation] Rank 0 hosts the store every member joins. A group of
survivors meets at the store of its lowest rank (in the group every member formed), so losing
rank 0 or any later host leaves a store to meet at: every member other than rank 0 opens one
as it joins, on a port the system picks, and posts its address (`host:port`) on rank 0's before
it counts as joined, so every member knows every address before any can be lost. The host is
the address this member reaches rank 0 from: the source address of a UDP socket connected to
the master address (no packet is sent), which is the pod's own address in a Kubernetes pod and
the network namespace's own elsewhere (loopback where the master is on loopback).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

ADDRESS_KEY = "dlo/store"
"""`dlo/store/<rank>`: where the store member `<rank>` hosts listens (`host:port`)."""


def reachable_address(master_addr: str, master_port: int) -> str:
    """This member's address as rank 0 would reach it (see [Note: a store for every
    generation])."""
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, master_port))
            return str(probe.getsockname()[0])
    except OSError:  # a name that does not resolve here: the caller's join fails on it anyway
        return socket.gethostname()


def open_store(master_addr: str, master_port: int, world_size: int,
               timeout_s: float) -> tuple[Any, str]:
    """A store this member hosts for a later generation, and the address it posts for it."""
    host = reachable_address(master_addr, master_port)
    store = dist.TCPStore(host, 0, world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, f"{host}:{store.port}"


@dataclass
class Stores:
    """Every member's store address, by rank in the group every member formed, and the store
    this member hosts (kept open for as long as any generation may meet at it)."""

    addresses: tuple[str, ...]
    own: Any
    world_size: int
    timeout_s: float

    def connect(self, rank: int) -> Any:
        """A new connection to the store member `rank` hosts."""
        host, _, port = self.addresses[rank].rpartition(":")
        return dist.TCPStore(host.strip("[]"), int(port), self.world_size, is_master=False,
                             timeout=datetime.timedelta(seconds=self.timeout_s),
                             wait_for_workers=False)

    def gone(self, rank: int, timeout_s: float) -> bool:
        """Whether member `rank`'s process is gone for certain: its store's port refuses a
        connection, which a live process (even a stopped one: the kernel accepts for it) never
        does. A host that does not answer within `timeout_s` is no answer (the heartbeat
        decides): see [Note: a closed connection] in `peers`."""
        host, _, port = self.addresses[rank].rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.own = None
