"""Request and response bodies of the /v1 API (the shared model is reused where it fits).

Every collection and string has a bound, so the OpenAPI document states the
limits and a request past them is a 422 problem, never a surprise in the store.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from xinfra.keyspace import SHARD_COUNT_MAX
from xinfra.model import EpochState, Name, PhysicalCluster, VirtualCluster

CLIENT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}$"
ClientId = Annotated[str, StringConstraints(pattern=CLIENT_ID_PATTERN, max_length=200)]
ConfigKey = Annotated[str, StringConstraints(min_length=1, max_length=255)]
ConfigValue = Annotated[str, StringConstraints(max_length=4096)]
Config = Annotated[dict[ConfigKey, ConfigValue], Field(max_length=100)]
ShardIndex = Annotated[int, Field(ge=0, lt=SHARD_COUNT_MAX)]
Offset = Annotated[int, Field(ge=0, le=2**63 - 1)]
EndOffsets = Annotated[dict[ShardIndex, Offset], Field(max_length=SHARD_COUNT_MAX)]
Version = Annotated[int, Field(ge=0, le=2**63 - 1)]
ScopeName = Annotated[
    str, StringConstraints(pattern=r"^(\*|[A-Za-z0-9][A-Za-z0-9._-]{0,199})$", max_length=200)
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Problem(BaseModel):
    """RFC 9457 problem details; ``code`` is the stable code of ``xinfra.errors``."""

    type: str
    title: str
    status: int
    detail: str
    code: str
    instance: str | None = None


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    database: str
    notifier: str
    instance: str


class PhysicalClusterOut(PhysicalCluster):
    version: int


class PhysicalClusterList(BaseModel):
    clusters: list[PhysicalClusterOut]


class VirtualClusterOut(VirtualCluster):
    version: int


class VirtualClusterList(BaseModel):
    virtual_clusters: list[VirtualClusterOut]


class TopicCreate(_Body):
    name: Name
    cluster: Name = Field(description="The physical cluster of epoch 0.")
    shards: int = Field(ge=1, le=SHARD_COUNT_MAX)
    config: Config = Field(default_factory=dict)


class TopicState(enum.StrEnum):
    CREATING = "creating"
    ACTIVE = "active"
    DELETING = "deleting"


class TopicSummary(BaseModel):
    virtual_cluster: str
    name: str
    version: int
    state: TopicState
    sealed: bool
    config: dict[str, str]


class TopicPage(BaseModel):
    topics: list[TopicSummary]
    next_after: str | None = Field(
        default=None, description="Pass as `after` for the next page; null on the last page."
    )


class TopicUpdate(_Body):
    config: Config
    expected_version: Version | None = Field(
        default=None, description="Fail with 409 version_conflict unless the topic is at it."
    )


class TopicSeal(_Body):
    expected_version: Version | None = None
    end_offsets: EndOffsets | None = Field(
        default=None,
        description="End offsets of the unsealed epochs' shards; read from the backend when omitted.",
    )


class EpochCreate(_Body):
    cluster: Name = Field(description="The physical cluster of the new epoch.")
    shards: int | None = Field(
        default=None, ge=1, le=SHARD_COUNT_MAX, description="Default: as many as the current epoch."
    )
    state: Literal[EpochState.ACTIVE, EpochState.DUAL_WRITE] = EpochState.ACTIVE
    mirror_of: int | None = Field(default=None, ge=0)
    seal_current: bool = Field(
        default=True,
        description="Seal every unsealed epoch (with its end offsets) in the same change.",
    )
    end_offsets: EndOffsets | None = Field(
        default=None,
        description="End offsets of the epoch being sealed; read from the backend when omitted.",
    )
    expected_version: Version | None = None


class EpochUpdate(_Body):
    state: EpochState
    end_offsets: EndOffsets | None = Field(
        default=None, description="With state=sealed; read from the backend when omitted."
    )
    expected_version: Version | None = None


class ClientKind(enum.StrEnum):
    PRODUCER = "producer"
    CONSUMER = "consumer"


class ClientRegistration(_Body):
    kind: ClientKind
    host: str = Field(default="", max_length=255)
    topics: list[Name] = Field(default_factory=list, max_length=1000)
    ttl_s: float | None = Field(
        default=None,
        gt=0,
        le=86400,
        description="Expiry without a heartbeat; capped by the service.",
    )


class Heartbeat(_Body):
    versions: Annotated[dict[Name, Version], Field(max_length=1000)] = Field(
        default_factory=dict, description="Topic to the metadata version the client runs on."
    )


class ClientOut(BaseModel):
    virtual_cluster: str
    client_id: str
    kind: ClientKind
    host: str
    topics: list[str]
    versions: dict[str, int]
    ttl_s: float
    registered_ms: int
    heartbeat_ms: int
    expires_ms: int


class ClientList(BaseModel):
    clients: list[ClientOut]


class Unacknowledged(BaseModel):
    virtual_cluster: str
    topic: str
    version: int
    clients: list[ClientOut]


class TokenRole(enum.StrEnum):
    ADMIN = "admin"
    CLIENT = "client"


class TokenCreate(_Body):
    name: Name
    role: TokenRole
    scope: ScopeName = Field(default="*", description="A virtual cluster, or * for all.")


class TokenOut(BaseModel):
    name: str
    role: TokenRole
    scope: str
    created_ms: int


class TokenCreated(TokenOut):
    token: str = Field(description="Shown once; only its hash is stored.")


class TokenList(BaseModel):
    tokens: list[TokenOut]


class ReconcileAction(BaseModel):
    action: str = Field(
        description="finished_create | rolled_back_create | finished_delete | "
        "rolled_back_epoch | finished_epoch | finished_settle | deleted_orphan | "
        "missing_physical_topic | orphan | settle_pending"
    )
    virtual_cluster: str | None = None
    topic: str | None = None
    epoch: int | None = None
    cluster: str | None = None
    physical_topic: str | None = None
    detail: str = ""


class ReconcileReport(BaseModel):
    checked_topics: int
    repaired: list[ReconcileAction]
    drift: list[ReconcileAction]
    errors: list[str]
