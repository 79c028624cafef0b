"""The durable state of one consumer group: what a new coordinator needs to resume it.

Kept as one JSON document per group (in ZooKeeper, or in memory for the
embedded default) and written whole with a compare-and-set on its version.
Heartbeat times are not in it: a new coordinator gives every member a fresh
session, as a Kafka coordinator does after a failover.

Invariant (asserted by ``check``): a unit is in the ``assigned`` set of at
most one member.  ``assigned`` is what a member may consume now; ``target`` is
where the coordinator wants it to end.  A unit moves from one member's
``assigned`` to another's only after the first member acknowledged giving it
up, so two members never consume one shard at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from metadata_service.groups.assignor import Unit


@dataclass
class Member:
    member_id: str
    client_id: str
    topics: list[str]
    epoch: int
    """The member epoch: the group epoch whose target this member last reached."""
    floor: int
    """The epoch this incarnation joined at; a request below it comes from a replaced incarnation."""
    assigned: list[Unit] = field(default_factory=list)
    target: list[Unit] = field(default_factory=list)


@dataclass
class GroupState:
    virtual_cluster: str
    group: str
    epoch: int = 0
    """The group epoch: bumped whenever the target assignment changes."""
    members: dict[str, Member] = field(default_factory=dict)

    def owner_of(self, unit: Unit) -> str | None:
        for member in self.members.values():
            if unit in member.assigned:
                return member.member_id
        return None

    def check(self) -> None:
        seen: dict[Unit, str] = {}
        for member in self.members.values():
            for unit in member.assigned:
                assert unit not in seen, f"{unit} assigned to {seen[unit]} and {member.member_id}"
                seen[unit] = member.member_id
            assert member.floor <= member.epoch <= self.epoch, (member, self.epoch)

    def to_json(self) -> bytes:
        self.check()
        return json.dumps(
            {
                "virtual_cluster": self.virtual_cluster,
                "group": self.group,
                "epoch": self.epoch,
                "members": [
                    {
                        "member_id": m.member_id,
                        "client_id": m.client_id,
                        "topics": m.topics,
                        "epoch": m.epoch,
                        "floor": m.floor,
                        "assigned": [list(u) for u in m.assigned],
                        "target": [list(u) for u in m.target],
                    }
                    for m in self.members.values()
                ],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> GroupState:
        raw: dict[str, Any] = json.loads(data)
        state = cls(raw["virtual_cluster"], raw["group"], int(raw["epoch"]))
        for m in raw["members"]:
            state.members[m["member_id"]] = Member(
                member_id=m["member_id"],
                client_id=m["client_id"],
                topics=list(m["topics"]),
                epoch=int(m["epoch"]),
                floor=int(m["floor"]),
                assigned=[(str(t), int(s)) for t, s in m["assigned"]],
                target=[(str(t), int(s)) for t, s in m["target"]],
            )
        state.check()
        return state
