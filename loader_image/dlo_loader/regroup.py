"""A group of the survivors, after the heartbeat found a member lost.

Owns how the members left agree on who they are and form a process group of their own (see
[Note: regrouping]). Called with a `transport.Group` whose watch found a loss; returns the
survivors' `Group`, whose collectives run on the new process group and whose heartbeat watches
the survivors alone. Must not read the object store, write the cache or re-plan the fill (what
the survivors still have to move is `replan`'s).

[Note: regrouping] gloo's process groups cannot shrink, and the default group cannot be torn
down while a collective cut short by the loss still waits in it (a stopped member's peers wait
for it until the fill's deadline). So the survivors form a new group beside it over the same
store (`dist.new_group` of their ranks with local synchronization: only they take part), each
generation's heartbeat under a prefix of its own. Who is left is decided once, on the store:
the first survivor to ask writes the lost member's rank under the generation's key (a
compare-and-set), and every survivor takes the rank the store holds, so all form the same group
whatever each one's own watch concluded. A survivor that does not arrive is found by the new
generation's heartbeat within `loader.peer_timeout_s`, and everyone fails naming it (one loss
is survived per generation; a second one in the regrouping fails the fill). The member that was
dropped and comes back (SIGCONT after SIGSTOP) reads the verdict that names it in the old
generation, which the survivors' old watches keep up, and fails saying it was dropped; its
late sends in the old group land in buffers nobody reads again. Rank 0 hosts the store: when it
is the one lost, there is no store to regroup over, and the survivors fail naming it, as
before.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

import torch.distributed as dist

from dlo_loader.errors import GroupError
from dlo_loader.peers import Loss, PeerWatch
from dlo_loader.transport import Group

log = logging.getLogger(__name__)

_LOST_KEY = "dlo/regroup/{generation}/lost"
"""The rank (in the default group) of the member the survivors of `generation` drop."""
_PREFIX = "dlo/gen/{generation}/"
"""Where the heartbeat of a group of survivors keeps its keys."""


def survivors_of(group: Group, loss: Loss) -> Group:
    """The group of the members of `group` other than the one `loss` names, formed by each of
    them (see [Note: regrouping]); raises the loss's error where that member is rank 0 (the
    store's host) or this one, and a `GroupError` naming a survivor that does not arrive."""
    watch = group.watch
    if loss.member.rank == 0:
        raise watch.error(loss)
    generation = group.generation + 1
    dropped = _agreed_loss(group, loss, generation)
    me = watch.member(group.rank)
    if dropped == me.rank:
        raise watch.error(Loss(me, loss.how))
    ranks = tuple(r for r in group.ranks if r != dropped)
    members = [watch.member(group.ranks.index(r)) for r in ranks]
    rank = ranks.index(me.rank)
    log.warning("the group continues without %s: %d member(s) left (generation %d)",
                watch.member(group.ranks.index(dropped)), len(ranks), generation)
    prefix = _PREFIX.format(generation=generation)
    new_watch = PeerWatch(rank=rank, members=members, timeout_s=watch.timeout_s,
                          names=watch.names,
                          connect=lambda: dist.PrefixStore(prefix, watch.connect()))
    try:
        pg = new_watch.call(dist.new_group, list(ranks), use_local_synchronization=True,
                            timeout=datetime.timedelta(seconds=group.collective_timeout_s))
    except (RuntimeError, dist.DistError) as exc:
        raise GroupError(f"the survivors of the loader group did not form a group again: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}",
                         hint="see the survivors' loader logs, then rerun every loader") from exc
    return Group(rank=rank, world_size=len(ranks), backend=group.backend, store=group.store,
                 watch=new_watch, pg=pg, generation=generation, ranks=ranks,
                 collective_timeout_s=group.collective_timeout_s,
                 retired=(*group.retired, watch))


def _agreed_loss(group: Group, loss: Loss, generation: int) -> int:
    """The rank every survivor drops: the first one posted for `generation` (compare-and-set
    on the store, through a connection of this call's own: the watch's worker may be stuck in
    the collective the loss cut short)."""
    store: Any = group.watch.connect()
    key = _LOST_KEY.format(generation=generation)
    proposed = json.dumps({"rank": loss.member.rank})
    try:
        agreed = store.compare_set(key, "", proposed)
    except (RuntimeError, dist.DistError) as exc:
        raise group.watch.error(loss) from exc
    return int(json.loads(agreed.decode() if isinstance(agreed, bytes) else agreed)["rank"])
