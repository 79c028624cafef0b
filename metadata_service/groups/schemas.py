"""Request and response bodies of the consumer-group and checkpoint API (bounded, like the rest)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from metadata_service.schemas import CLIENT_ID_PATTERN, Offset, ShardIndex
from xinfra.model import Name

MemberId = Annotated[str, StringConstraints(pattern=CLIENT_ID_PATTERN, max_length=200)]
EpochNumber = Annotated[int, Field(ge=0, le=2**31 - 1)]
Unit = tuple[Name, ShardIndex]
UNITS_MAX = 100_000
TOPICS_MAX = 1000
POSITIONS_MAX = 10_000


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HeartbeatIn(_Body):
    """One heartbeat of a member (KIP-848 style).

    ``member_epoch`` 0 joins (or rejoins, replacing an older incarnation of
    the same ``member_id``), -1 leaves, anything else is the epoch the member
    last received.  ``topics`` (when given) replaces the subscription;
    ``owned`` (when given) is what the member consumes now, which is how it
    acknowledges a revocation.
    """

    member_id: MemberId
    member_epoch: Annotated[int, Field(ge=-1, le=2**31 - 1)]
    client_id: MemberId | None = None
    topics: Annotated[list[Name], Field(max_length=TOPICS_MAX)] | None = None
    owned: Annotated[list[Unit], Field(max_length=UNITS_MAX)] | None = None


class HeartbeatOut(BaseModel):
    member_id: str
    member_epoch: int
    group_epoch: int
    assignment: list[Unit]
    """What the member may consume now; anything it owns outside it, it must give up and ack."""
    pending: bool
    """True while the member's assignment is not yet its target: heartbeat again soon."""
    heartbeat_interval_ms: int
    session_timeout_ms: int


class CommitPosition(BaseModel):
    topic: Name
    epoch: EpochNumber
    shard: ShardIndex
    offset: Offset


class CommitIn(_Body):
    """Positions to commit; a member commits with its id and epoch, a group without members may omit them."""

    member_id: MemberId | None = None
    member_epoch: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    positions: Annotated[list[CommitPosition], Field(min_length=1, max_length=POSITIONS_MAX)]


class Checkpoints(BaseModel):
    virtual_cluster: str
    group: str
    positions: list[CommitPosition]


class MemberOut(BaseModel):
    member_id: str
    client_id: str
    member_epoch: int
    topics: list[str]
    assignment: list[Unit]
    target: list[Unit]


class ShardLag(BaseModel):
    topic: str
    shard: int
    member_id: str | None
    committed: CommitPosition | None
    end_epoch: int
    end_offset: int
    lag: int | None
    """Records after the committed position (None: nothing committed)."""


class GroupSummary(BaseModel):
    name: str
    state: Literal["empty", "stable", "reconciling"]
    group_epoch: int
    members: int


class GroupList(BaseModel):
    groups: list[GroupSummary]


class GroupDescription(GroupSummary):
    virtual_cluster: str
    coordinator: str
    member_list: list[MemberOut]
    shards: list[ShardLag]


class ResetIn(_Body):
    """Reset one topic's checkpoints; refused while the group has members unless ``force``."""

    topic: Name
    to: Literal["earliest", "latest", "timestamp", "position"]
    timestamp_ms: Annotated[int, Field(ge=0)] | None = None
    positions: Annotated[list[CommitPosition], Field(max_length=POSITIONS_MAX)] | None = None
    force: bool = False
