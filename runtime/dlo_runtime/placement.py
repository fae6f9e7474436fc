"""`Placement`: the existing process group DLO shards host weights over, resolved once.

`resolve_placement` turns the validated settings and the group(s) the server passes into this
rank's placement: AllGather over the existing DP group (else SP group) of G ranks, or rank-local
blocks. `pod.enable` resolves it once per process and hands it to every backend it builds; a
backend built directly resolves it from its `group=` argument. It never creates a process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist

from dlo_contract.field_names import Names
from dlo_contract.settings import Settings
from dlo_contract.validation import select_group
from dlo_runtime.tensors import OffloadError


@dataclass(frozen=True)
class Placement:
    """This rank's share of the DLO weights."""

    kind: Literal["dp", "sp", "none"]
    """Which existing group the weights are sharded over; `none` for rank-local blocks."""
    group: Any
    """The process group (None when rank-local)."""
    rank: int
    """This rank's index in `group` (0 when rank-local)."""
    shard_count: int
    """G: every block is split in G shards, one per rank of `group`."""

    @property
    def mode(self) -> str:
        return "allgather" if self.group is not None else "rank-local"


RANK_LOCAL = Placement("none", None, 0, 1)


def resolve_placement(settings: Settings, *, names: Names, group: Any = None,
                      groups: Mapping[str, Any] | None = None) -> Placement:
    """The placement the (validated) settings select (`validation.select_group`, the one
    decision), over `group`, else `groups[kind]`, else the default group when it is exactly the
    group the settings describe. Errors name the settings through `names`."""
    choice = select_group(settings)
    if group is None and groups and choice.kind != "none":
        group = groups.get(choice.kind)
    size = dist.get_world_size(group) if group is not None else 1
    if choice.shard_count == 1:
        if group is not None and size > 1 and choice.allgather_asked:
            p = settings.parallel
            raise OffloadError(
                f"the group passed has {size} ranks, but {names('parallel.dp')}={p.dp} and "
                f"{names('parallel.sp')}={p.sp} select no DLO group",
                hint=f"pass no group, or set {names('parallel.dp')} (or {names('parallel.sp')}) "
                     "to the group size",
            )
        return RANK_LOCAL
    if group is None:
        if not dist.is_initialized() or dist.get_world_size() != choice.shard_count:
            raise OffloadError(
                f"the settings select the existing {choice.kind.upper()} group of "
                f"{choice.shard_count} ranks for DLO AllGather, but no group was passed and "
                "the default group is not that group",
                hint=f"pass the existing group as group=, or set "
                     f"{names('offload.use_allgather')}=false",
            )
        group = dist.group.WORLD
        size = dist.get_world_size()
    if size != choice.shard_count:
        raise OffloadError(
            f"the group passed has {size} ranks, but {names(f'parallel.{choice.kind}')}="
            f"{choice.shard_count} selects a DLO group of {choice.shard_count}",
            hint=f"pass the {choice.kind.upper()} group, or fix {names(f'parallel.{choice.kind}')}",
        )
    return Placement(choice.kind, group, dist.get_rank(group), size)
