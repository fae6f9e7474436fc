"""Where a loader learns its fill group: flags, the torch.distributed environment, or the
operator's fill-group document.

Precedence: `--rank/--world-size/--master-addr/--master-port`, then `RANK`/`WORLD_SIZE`/
`MASTER_ADDR`/`MASTER_PORT` (a prefill Job sets these for its one fill), then the fill-group
document in `DLO_FILL_GROUP` with this pod's name in `DLO_POD_NAME` (a workload pod: a member of
the open group fills with it, anyone else fills alone), else one loader alone. Called by `cli`;
must not start the rendezvous itself (that is `transport`, through `fill`). Also names this
loader to its group (`this_member`: its pod and node), and lists the entry's holders on other
nodes that the document names (`peer_holders`).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from dlo_contract.fill_group import FillGroup, Holder
from dlo_loader.members import Member
from dlo_contract.names import FILL_GROUP_ENV, NODE_NAME_ENV, POD_NAME_ENV, REVISION_ENV
from dlo_contract.names import (
    DEFAULT_RENDEZVOUS_PORT,
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    RANK_ENV,
    WORLD_SIZE_ENV,
)
from dlo_contract.settings import SettingsError

log = logging.getLogger(__name__)
DEFAULT_MASTER_PORT = DEFAULT_RENDEZVOUS_PORT


@dataclass(frozen=True, kw_only=True)
class Placement:
    """This loader's place in its fill group."""

    rank: int = 0
    world_size: int = 1
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    origin: str = "alone"
    """`flags`, `environment`, `fill-group` or `alone`: logged, so a reader sees why."""


def resolve_placement(*, rank: int | None, world_size: int | None, master_addr: str | None,
                      master_port: int | None) -> Placement:
    """The placement from the flags given (None: not given) and the environment."""
    port = _int_or(master_port, MASTER_PORT_ENV, DEFAULT_MASTER_PORT)
    if world_size is not None or rank is not None:
        origin = "flags"
    elif os.environ.get(WORLD_SIZE_ENV) or os.environ.get(RANK_ENV):
        origin = "environment"
    else:
        return _from_document(master_addr, port)
    placement = Placement(rank=_int_or(rank, RANK_ENV, 0),
                          world_size=_int_or(world_size, WORLD_SIZE_ENV, 1),
                          master_addr=master_addr or os.environ.get(MASTER_ADDR_ENV),
                          master_port=port, origin=origin)
    _check(placement)
    return placement


def _from_document(master_addr: str | None, port: int) -> Placement:
    text = os.environ.get(FILL_GROUP_ENV, "")
    if not text.strip():
        return Placement(master_addr=master_addr, master_port=port)
    pod = os.environ.get(POD_NAME_ENV, "")
    revision = os.environ.get(REVISION_ENV, "")
    try:
        group = FillGroup.from_json(text)
    except ValueError as exc:
        raise SettingsError(f"environment variable {FILL_GROUP_ENV} is not a fill group "
                            f"document: {exc}", hint="the operator writes it; check its "
                            "version matches the loader image") from exc
    place = group.place(pod, revision)
    if place is None:
        log.info("pod %s is in no open fill group of revision %s: filling alone", pod or "?",
                 revision or "?")
        return Placement(master_addr=master_addr, master_port=port)
    rank, world = place
    return Placement(rank=rank, world_size=world, master_addr=master_addr or group.master_addr,
                     master_port=group.master_port, origin="fill-group")


def peer_holders() -> tuple[Holder, ...]:
    """The nodes the fill-group document names as holding the entry, this node left out
    (`DLO_NODE_NAME`); none without a document (or one this loader cannot read: its placement
    says why)."""
    try:
        group = FillGroup.from_json(os.environ.get(FILL_GROUP_ENV, "") or "{}")
    except ValueError:
        return ()
    node = os.environ.get(NODE_NAME_ENV, "")
    return tuple(h for h in group.holders if not node or h.node != node)


def this_member(rank: int) -> Member:
    """This loader as its group names it when it is lost: its pod (`DLO_POD_NAME`, the key of
    the fill-group document's members; else the host name, which is the pod's name in
    Kubernetes) and its node (`DLO_NODE_NAME`, from the downward API; else unnamed)."""
    return Member(rank=rank, pod=os.environ.get(POD_NAME_ENV) or socket.gethostname(),
                  node=os.environ.get(NODE_NAME_ENV, ""))


def _check(placement: Placement) -> None:
    if placement.world_size < 1 or not 0 <= placement.rank < placement.world_size:
        raise SettingsError(f"rank {placement.rank} is not within world size "
                            f"{placement.world_size}",
                            hint="set --rank/--world-size (or RANK/WORLD_SIZE) consistently")


def _int_or(value: int | None, env: str, default: int) -> int:
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"environment variable {env}={raw!r} is not an integer") from None
