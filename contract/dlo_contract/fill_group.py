"""The fill-group document: how the operator tells a workload pod's loader which group it fills in.

A loader never derives its group from a replica count baked into the pod template (scaling would
then restart every pod). The operator publishes one document per DOD, in the ConfigMap key
`FILL_GROUP_KEY`, which the pod template hands to the loader as the environment variable
`FILL_GROUP_ENV` (an optional `configMapKeyRef`, resolved by the kubelet when the container is
created); the pod's own name arrives as `POD_NAME_ENV` and the revision of its settings as
`REVISION_ENV`. A loader whose pod is a member of an open group for its revision fills with that
group (rank, world size, rendezvous address); any other loader fills alone, from the store or from
its node's cache. The operator opens a group before it creates the pods of a create or a scale-up
and closes it (no members) once every member's loader has finished, so a pod recreated later
never waits for a group that no longer exists.

The document also lists the entry's holders (`Holder`: the nodes whose loaders published the
DOD's entry and serve it to their peers, with the address and port of that endpoint), open group
or not: a loader that fills alone reads the entry from them before it reads the store (see
`dlo_loader.peer_reads`).

Shared by `dlo_operator` (writes) and `dlo_loader` (reads); standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dlo_contract.names import DEFAULT_RENDEZVOUS_PORT

FILL_GROUP_KEY = "group.json"


@dataclass(frozen=True)
class Holder:
    """A node that holds the DOD's entry, and where its loader serves it to peers."""

    node: str
    address: str
    port: int

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "address": self.address, "port": self.port}

    @classmethod
    def from_dict(cls, data: Any) -> Holder:
        if not isinstance(data, dict) or not isinstance(data.get("address"), str) or not (
                isinstance(data.get("port"), int) and 0 < data["port"] < 65536):
            raise ValueError(f"a fill group holder must name node, address and port, found "
                             f"{data!r:.200}")
        return cls(node=str(data.get("node", "")), address=data["address"], port=data["port"])


@dataclass(frozen=True, kw_only=True)
class FillGroup:
    """One cooperative fill: the member pods (name -> rank) and where rank 0 listens."""

    revision: str = ""
    """The settings revision the members fill for; a loader of another revision ignores it."""
    members: Mapping[str, int] = field(default_factory=dict)
    master_addr: str = ""
    master_port: int = DEFAULT_RENDEZVOUS_PORT
    holders: tuple[Holder, ...] = ()
    """The nodes that hold the entry of `revision`'s settings, by node name."""

    @property
    def world_size(self) -> int:
        return len(self.members)

    def to_json(self) -> str:
        document: dict[str, Any] = {
            "revision": self.revision, "members": dict(sorted(
                self.members.items(), key=lambda item: item[1])),
            "masterAddr": self.master_addr, "masterPort": self.master_port}
        if self.holders:
            document["holders"] = [h.to_dict() for h in self.holders]
        return json.dumps(document, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> FillGroup:
        """Parse a document; raise ValueError naming what is wrong with it."""
        data: Any = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"fill group document must be a JSON object, found {data!r:.80}")
        members = data.get("members") or {}
        if not isinstance(members, dict) or sorted(members.values()) != list(range(len(members))):
            raise ValueError(f"fill group members must map pod names to ranks 0..n-1, found "
                             f"{members!r:.200}")
        holders = data.get("holders") or []
        if not isinstance(holders, list):
            raise ValueError(f"fill group holders must be a list, found {holders!r:.200}")
        return cls(revision=str(data.get("revision", "")), members=dict(members),
                   master_addr=str(data.get("masterAddr", "")),
                   master_port=int(data.get("masterPort", DEFAULT_RENDEZVOUS_PORT)),
                   holders=tuple(Holder.from_dict(h) for h in holders))

    def place(self, pod: str, revision: str) -> tuple[int, int] | None:
        """(rank, world size) of `pod` in this group, or None when it fills alone."""
        if revision != self.revision or pod not in self.members or self.world_size < 2:
            return None
        return self.members[pod], self.world_size


CLOSED = FillGroup()
"""The document once a group has finished: no members, every loader fills alone."""
