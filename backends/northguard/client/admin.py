"""Admin calls (unary requests) and the topic view clients route by.

``TopicView`` is what a producer or reader needs of a topic: its current
ranges in keyspace order (shard *i* is range *i*), their ids, offsets and
state.  ``AdminClient`` wraps one connection with typed methods; it
reconnects when the last connection failed, trying every bootstrap address
in turn (any broker of a cluster answers metadata requests: a member forwards
them to the coordinator).  A range names its leader's address in a cluster
(``RangeView.leader``); streams go there (``connection_to``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from backends.northguard.client.connection import ClientConnection, CredentialSource
from backends.northguard.runtime import Runtime
from xinfra.errors import BackendUnavailable, ShardOutOfRange
from xinfra.keyspace import KeyRange


@dataclass(frozen=True, slots=True)
class RangeView:
    range_id: int
    key_range: KeyRange
    sealed: bool
    start_offset: int
    end_offset: int
    leader: str | None = None  # host:port of the broker leading its active segment (a cluster)


@dataclass(frozen=True, slots=True)
class TopicView:
    name: str
    sealed: bool
    config: dict[str, str]
    ranges: list[RangeView]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TopicView:
        return cls(
            name=data["name"],
            sealed=data["state"] == "sealed",
            config=dict(data.get("config") or {}),
            ranges=[
                RangeView(
                    r["range_id"],
                    KeyRange.from_json(r["bounds"]),
                    r["state"] == "sealed",
                    r["start_offset"],
                    r["end_offset"],
                    r.get("leader_address"),
                )
                for r in data["ranges"]
            ],
        )

    def range_of_shard(self, shard: int) -> RangeView:
        if not 0 <= shard < len(self.ranges):
            raise ShardOutOfRange(
                f"shard {shard} is out of range: topic {self.name!r} has shards 0..{len(self.ranges) - 1}"
            )
        return self.ranges[shard]


class AdminClient:
    """Unary requests to one broker over a lazily (re)opened connection."""

    def __init__(
        self,
        runtime: Runtime,
        address: str,
        timeout_s: float,
        credential_source: CredentialSource | None = None,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self._runtime = runtime
        self._credential_source = credential_source
        self._tls_context = tls_context
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.address = self.addresses[0]
        self.timeout_s = timeout_s
        self._connection: ClientConnection | None = None
        self._others: dict[str, ClientConnection] = {}  # by address: leaders of streams

    async def connection(self) -> ClientConnection:
        """A connection to any bootstrap broker: the last one that answered, else the next."""
        if self._connection is not None and not self._connection.closed:
            return self._connection
        start = self.addresses.index(self.address)
        failure: BackendUnavailable | None = None
        for step in range(len(self.addresses)):
            address = self.addresses[(start + step) % len(self.addresses)]
            try:
                self._connection = await self._open(address)
            except BackendUnavailable as error:
                failure = error
                continue
            self.address = address
            return self._connection
        assert failure is not None
        raise failure

    async def connection_to(self, address: str | None) -> ClientConnection:
        """A connection to ``address`` (a range's leader), or to any bootstrap broker (None)."""
        if address is None or address == self.address:
            return await self.connection()
        existing = self._others.get(address)
        if existing is None or existing.closed:
            existing = self._others[address] = await self._open(address)
        return existing

    async def _open(self, address: str) -> ClientConnection:
        return await ClientConnection.open(
            self._runtime,
            address,
            self.timeout_s,
            credential_source=self._credential_source,
            tls_context=self._tls_context,
        )

    async def request(self, op: str, **arguments: Any) -> dict[str, Any]:
        connection = await self.connection()
        return await connection.request(op, self.timeout_s, **arguments)

    async def ping(self) -> str:
        return str((await self.request("ping"))["broker_id"])

    async def create_topic(
        self, name: str, ranges: list[KeyRange], config: dict[str, str] | None = None
    ) -> TopicView:
        result = await self.request(
            "create_topic", name=name, ranges=[r.to_json() for r in ranges], config=config or {}
        )
        return TopicView.from_json(result)

    async def topic(self, name: str) -> TopicView:
        return TopicView.from_json(await self.request("topic_metadata", name=name))

    async def list_topics(self) -> list[str]:
        return list((await self.request("list_topics"))["topics"])

    async def delete_topic(self, name: str) -> None:
        await self.request("delete_topic", name=name)

    async def seal_topic(self, name: str) -> TopicView:
        return TopicView.from_json(await self.request("seal_topic", name=name))

    async def split_range(self, name: str, range_id: int) -> TopicView:
        return TopicView.from_json(await self.request("split_range", name=name, range_id=range_id))

    async def merge_ranges(self, name: str, range_id: int, other_range_id: int) -> TopicView:
        result = await self.request(
            "merge_ranges", name=name, range_id=range_id, other_range_id=other_range_id
        )
        return TopicView.from_json(result)

    async def segment_metadata(self, name: str, range_id: int) -> dict[str, Any]:
        return await self.request("segment_metadata", name=name, range_id=range_id)

    async def seal_segment(self, name: str, range_id: int) -> dict[str, Any]:
        return await self.request("seal_segment", name=name, range_id=range_id)

    async def offset_for_timestamp(self, name: str, range_id: int, timestamp_ms: int) -> int:
        result = await self.request(
            "offset_for_timestamp", name=name, range_id=range_id, timestamp_ms=timestamp_ms
        )
        return int(result["offset"])

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
        for connection in self._others.values():
            await connection.close()
        self._others.clear()
