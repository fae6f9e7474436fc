"""A group of the survivors, after the heartbeat found a member lost.

Owns how the members left agree on who they are and form a process group of their own (see
[Note: regrouping]). Called with a `group.Group` whose watch found a loss; returns the
survivors' `Group`, whose collectives run on the new process group and whose heartbeat watches
the survivors alone. Must not read the object store, write the cache or re-plan the fill (what
the survivors still have to move is `replan`'s).

[Note: regrouping] gloo's process groups cannot shrink, and the default group cannot be torn
down while a collective cut short by the loss still waits in it (a stopped member's peers wait
for it until the fill's deadline). So the survivors form a new group beside it: a gloo process
group made directly over the store of the lowest rank left (see [Note: a store for every
generation] in `group_stores`: rank 0's while it lives, else the one the next rank opened as
it joined), not `dist.new_group`, which needs the default group's store, gone with rank 0;
each generation's heartbeat and process group keep their keys under a prefix of their own.
Who is left is decided once, on that store: the first survivor to ask writes the lost member's
rank under the generation's key (a compare-and-set), and every survivor takes the rank the
store holds, so all form the same group whatever each one's own watch concluded. Survivors
notice a loss at different times (one may be waiting on its own reads, not on the group), so
the new generation's heartbeat gives a survivor that has not beaten in it yet twice
`loader.peer_timeout_s` to arrive. One that does not is found lost: the group returned has no process group, and its first call raises
that loss, like a group every member formed where one was lost while it formed (`transport`).
A loss in a group of survivors is survived the same way, generation after generation, while
one member is left (`survive`): losing the host of the survivors' store moves the next
generation to the next rank's. Not survived: the next host lost before the survivors reach its
store (two members lost at once, the lower of them the store's host): each fails naming the
loss it found.
The member that was dropped and comes back (SIGCONT after SIGSTOP) reads the verdict that
names it in the old generation, which the survivors' old watches keep up (a stopped rank 0
gets it in its own store once it runs again), and fails saying it was dropped; its late sends
in the old group land in buffers nobody reads again.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

import torch.distributed as dist

from dlo_loader.errors import GroupError, MemberLost
from dlo_loader.members import Loss
from dlo_loader.peers import PeerWatch
from dlo_loader.group import Group

log = logging.getLogger(__name__)

_LOST_KEY = "dlo/regroup/{generation}/lost"
"""The rank (in the group every member formed) of the member the survivors of `generation`
drop."""
_PREFIX = "dlo/gen/{generation}/"
"""Where the heartbeat of a group of survivors keeps its keys."""


def survivors_of(group: Group, loss: Loss) -> Group:
    """The group of the members of `group` other than the one `loss` names, formed by each of
    them at the store of the lowest rank left (see [Note: regrouping]); raises the loss's
    error where this member is the one dropped or no member is left but this one's, and a
    `GroupError` naming a survivor that does not arrive."""
    watch = group.watch
    generation = group.generation + 1
    host = min(r for r in group.ranks if r != loss.member.rank)
    store = _meeting(group, loss, host)
    dropped = _agreed_loss(store, group, loss, generation)
    me = watch.member(group.rank)
    if dropped == me.rank:
        raise watch.error(Loss(me, loss.how))
    ranks = tuple(r for r in group.ranks if r != dropped)
    if min(ranks) != host:
        raise GroupError(f"the survivors of the loader group disagree on who is lost: this "
                         f"loader found {loss.member}, another loader rank {dropped}",
                         hint="see the survivors' loader logs, then rerun every loader")
    members = [watch.member(group.ranks.index(r)) for r in ranks]
    rank = ranks.index(me.rank)
    log.warning("the group continues without %s: %d member(s) left (generation %d), meeting "
                "at the store of loader rank %d", watch.member(group.ranks.index(dropped)),
                len(ranks), generation, host)
    prefix = _PREFIX.format(generation=generation)
    stores = group.stores
    new_watch = PeerWatch(rank=rank, members=members, timeout_s=watch.timeout_s,
                          names=watch.names, arrival_s=watch.timeout_s,
                          connect=lambda: dist.PrefixStore(prefix, stores.connect(host)),
                          gone=lambda r, timeout_s: stores.gone(ranks[r], timeout_s))
    timeout = datetime.timedelta(seconds=group.collective_timeout_s)
    try:
        pg = new_watch.call(dist.ProcessGroupGloo, dist.PrefixStore(prefix + "pg/", store), rank,
                            len(ranks), timeout)
    except MemberLost:  # the group returned raises it at its first call, survived as any
        log.warning("the survivors lost another member while they formed their group")
        pg = None
    except (RuntimeError, dist.DistError) as exc:
        raise GroupError(f"the survivors of the loader group did not form a group again: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}",
                         hint="see the survivors' loader logs, then rerun every loader") from exc
    return Group(rank=rank, world_size=len(ranks), backend="gloo", store=store, stores=stores,
                 watch=new_watch, pg=pg, generation=generation, ranks=ranks,
                 collective_timeout_s=group.collective_timeout_s,
                 retired=(*group.retired, watch))


def _meeting(group: Group, loss: Loss, host: int) -> Any:
    """A connection of this call's own to the store the survivors meet at, the one member
    `host` hosts (the watch's worker may be stuck in the collective the loss cut short)."""
    try:
        return group.stores.connect(host)
    except (RuntimeError, dist.DistError, OSError) as exc:
        raise group.watch.error(loss) from exc


def _agreed_loss(store: Any, group: Group, loss: Loss, generation: int) -> int:
    """The rank every survivor drops: the first one posted for `generation` (compare-and-set
    on the store the survivors meet at)."""
    key = _LOST_KEY.format(generation=generation)
    proposed = json.dumps({"rank": loss.member.rank})
    try:
        agreed = store.compare_set(key, "", proposed)
    except (RuntimeError, dist.DistError) as exc:
        raise group.watch.error(loss) from exc
    return int(json.loads(agreed.decode() if isinstance(agreed, bytes) else agreed)["rank"])
