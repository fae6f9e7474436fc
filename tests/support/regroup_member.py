"""One member of a loader group of three for the regrouping tests, on loopback.

Run as a script. Every member joins and forms the group (`transport`), then prints `{"formed": true}`. The
victim then waits for a line on stdin (the test stops or kills it meanwhile) and, given one,
runs collectives of the old group until one fails, printing the error. The others start a
collective the victim never joins; when the heartbeat finds it lost they form the survivors'
group (`regroup`), run each kind of collective in it, print what they got, and wait for a line
on stdin before they leave (so a returning victim finds the stores up); where they cannot
regroup, they print the error.
Usage: regroup_member RANK PORT VICTIM PEER_TIMEOUT_S
"""

from __future__ import annotations

import json
import os
import sys

from dlo_loader import transport
from dlo_loader.errors import GroupError
from dlo_loader.members import Member
from dlo_loader.regroup import survivors_of

WORLD = 3


def main() -> int:
    rank, port, victim = (int(arg) for arg in sys.argv[1:4])
    peer_timeout_s = float(sys.argv[4])
    rendezvous = transport.join(
        master_addr="127.0.0.1", master_port=port, rank=rank, world_size=WORLD,
        node_key=f"node-{rank}", timeout_s=60.0, peer_timeout_s=peer_timeout_s,
        member=Member(rank, f"pod-{rank}", f"node-{rank}"))
    group = rendezvous.form(backend="gloo", collective_timeout_s=600.0)
    group.all_gather_object(rank)
    print(json.dumps({"formed": True}), flush=True)
    if rank == victim:
        if not sys.stdin.readline():
            return 0
        try:
            while True:
                group.all_gather_object("late")
        except GroupError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
            return 1
    try:
        group.all_gather_object("a round the victim never joins")
    except GroupError as exc:
        loss = group.watch.lost()
        assert loss is not None, exc
        try:
            survivors = survivors_of(group, loss)
        except GroupError as error:
            print(json.dumps({"error": str(error)}), flush=True)
            return 1
    else:
        raise AssertionError("the collective the victim never joined completed")
    gathered = survivors.all_gather_object({"rank": rank})
    status = survivors.status(failed=False, ready=True)
    send = bytearray([rank + 1] * 8)
    receive = bytearray(8 * survivors.world_size)
    survivors.all_gather_into(memoryview(send), memoryview(receive))()
    print(json.dumps({"lost": str(loss.member), "ranks": list(survivors.ranks),
                      "rank": survivors.rank, "generation": survivors.generation,
                      "gathered": gathered, "all_ready": status.all_ready,
                      "chunks": list(receive)}), flush=True)
    sys.stdin.readline()
    survivors.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as the loader's CLI does: no teardown of a group cut short
