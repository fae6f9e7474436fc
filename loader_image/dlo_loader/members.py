"""Who a fill group's members are, and which one it lost: the records every message names.

Owns `Member` (a rank, its pod and its node: how every survivor's error names a lost loader),
`Loss` (a member lost, and how) and where a member posts its record (`MEMBER_KEY`). Used by
`peers` (the heartbeat that finds a loss), `transport`, `group`, `regroup` and the fill's
summary. Must not touch the store or the process group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dlo_loader.errors import GroupError, MemberLost

MEMBER_KEY = "dlo/member"
"""`dlo/member/<rank>`: the member's pod and node, posted as it joins."""


@dataclass(frozen=True)
class Member:
    """One loader of a group as a person finds it: its rank, its pod, its node."""

    rank: int
    pod: str = ""
    node: str = ""

    def __str__(self) -> str:
        where = [f"pod {self.pod}"] if self.pod else []
        where += [f"node {self.node}"] if self.node else []
        return f"loader rank {self.rank}" + (f" ({', '.join(where)})" if where else "")

    def log_hint(self) -> str:
        """Where to look for why this member failed."""
        return f"see the loader log of pod {self.pod}" if self.pod else \
            f"see the log of loader rank {self.rank}"

    def to_json(self) -> str:
        return json.dumps({"pod": self.pod, "node": self.node})

    @classmethod
    def from_json(cls, rank: int, text: str) -> Member:
        data = json.loads(text)
        return cls(rank=rank, pod=str(data.get("pod", "")), node=str(data.get("node", "")))


@dataclass(frozen=True)
class Loss:
    """A member the group lost, and how (one clause: `died ...`, `sent no heartbeat ...`)."""

    member: Member
    how: str

    def error(self, me: Member | None = None) -> GroupError:
        """The error a member raises for this loss; `me`: that member, when the loss is its own
        (it comes back after the others dropped it: see `regroup`)."""
        if me is not None and me.rank == self.member.rank:
            return GroupError(
                f"this loader ({me}) was dropped from its group: the others found that it "
                f"{self.how}; they finish without it, and this loader publishes nothing",
                hint="its node fills again when its pod restarts; if it was stopped or starved, "
                     "check the node")
        return MemberLost(
            f"{self.member} {self.how}; this loader stops too and publishes nothing",
            hint=f"{self.member.log_hint()}"
                 f"{f' and the state of node {self.member.node}' if self.member.node else ''}, "
                 "then rerun every loader of the group")

    def to_json(self) -> str:
        return json.dumps({"rank": self.member.rank, "how": self.how})
