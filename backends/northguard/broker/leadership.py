"""Segment leadership on any broker: the leader's side of a segment the coordinator placed.

The coordinator owns metadata (segment create and seal, its journal) and
places every new segment; the first broker of the replica set *leads* it:
clients stream to it (topic metadata names it as the range's
``leader_address``), its range log appends to its store and replicates to
the followers (``Replicator``), and acknowledges once every replica fsynced.

On a member broker this module is that leader's half:

* ``lead_segment`` (the coordinator, after the ``open_segment`` op): mirror
  the range's metadata (topic, range, its last ``MIRROR_SEGMENTS_MAX``
  segments), build the range log if needed, open the replica streams, lead.
* ``roll``: the range log's roller on a member.  A roll (size or age limit,
  a follower failed, an append broke) asks the coordinator
  (``roll_segment``), which fences and seals the segment on its replicas
  (this broker answers ``replica_fence`` and ``replica_seal`` through
  ``fence`` and ``seal``, its range log's) and places the next one; when it
  is led here, ``lead_segment`` has installed it before the answer arrives.
  Led elsewhere: ``NotLeader``, and the producers follow the metadata.
* ``range_ends``: the committed offsets of the ranges led here (what topic
  metadata reports as their ends).

The fence, the seal at the smallest durable end and the resend of what the
seal cut are the coordinator's one mechanism (``Coordinator._fence_and_seal``,
``RangeLog.sync_committed``); this module only answers for the leader.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from backends.northguard.batch import check_batch
from backends.northguard.broker.peers import PeerPool
from backends.northguard.broker.range_log import RangeLog
from backends.northguard.broker.replication import ReplicaStream, Replicator
from backends.northguard.broker.state import RangeMeta, SegmentMeta, State, TopicMeta
from backends.northguard.client.consume_stream import ConsumeStream
from backends.northguard.protocol import CONSUME_WINDOW_BYTES_MAX
from backends.northguard.runtime import Runtime
from backends.northguard.store.base import Entry
from xinfra.errors import (
    BackendTimeout,
    NotFound,
    NotLeader,
    OffsetOutOfRange,
    Unavailable,
    XinfraError,
)

if TYPE_CHECKING:
    from backends.northguard.broker.coordinator import Coordinator

log = logging.getLogger(__name__)

MIRROR_SEGMENTS_MAX = 1000
"""Segments of a range a leader is told of (the newest): reads below them go elsewhere."""


async def open_followers(
    runtime: Runtime,
    peers: PeerPool,
    range_log: RangeLog,
    segment_id: str,
    start_offset: int,
    followers: dict[str, str],
    timeout_s: float,
    suspect: Callable[[str], None],
) -> Replicator | None:
    """Open the replica stream of each follower (by id: address) of a segment this broker leads
    (created on them already); None when it has none.  A follower that fails is ``suspect``ed
    and raises."""
    if not followers:
        return None
    replicator = Replicator(
        runtime, segment_id, start_offset, timeout_s, range_log.advance, range_log.replica_failed
    )

    async def open_one(broker_id: str, address: str) -> None:
        try:
            connection = await peers.connection(address)
            stream = ReplicaStream(
                connection,
                broker_id,
                segment_id,
                start_offset,
                replicator.on_ack,
                replicator.stream_failed,
            )
            replicator.add(stream)
            end = await asyncio.wait_for(asyncio.shield(stream.opened), timeout_s)
            if end != start_offset:
                raise Unavailable(f"broker {broker_id} holds segment {segment_id} up to {end}")
        except TimeoutError:
            suspect(broker_id)
            raise Unavailable(f"broker {broker_id} did not open a replica stream") from None
        except XinfraError:
            suspect(broker_id)
            raise

    results = await asyncio.gather(
        *(open_one(b, a) for b, a in followers.items()), return_exceptions=True
    )
    for result in results:
        if isinstance(result, BaseException):
            replicator.close_streams()
            if isinstance(result, XinfraError):
                raise result
            raise Unavailable(f"opening replica streams failed: {result!r}")
    return replicator


async def read_remote(
    peers: PeerPool,
    address_of: Callable[[str], str | None],
    segment: SegmentMeta,
    topic: str,
    offset: int,
    bytes_max: int,
    timeout_s: float,
) -> list[Entry]:
    """Entries of a sealed segment this broker does not hold (it leads the range, yet was not
    a replica of that segment), from the first replica that serves them: a consume stream
    naming the segment (as re-replication reads).  A cold path: one stream per call."""
    failure: XinfraError | None = None
    window = max(1, min(bytes_max, CONSUME_WINDOW_BYTES_MAX))
    for broker_id in segment.replicas:
        address = address_of(broker_id)
        if address is None:
            continue
        try:
            connection = await peers.connection(address)
        except XinfraError as error:
            failure = error
            continue
        data = asyncio.Event()
        stream = ConsumeStream(
            connection, topic, segment.range_id, offset, window, data.set, segment.segment_id
        )
        try:
            while not stream.entries and stream.failure is None:
                data.clear()
                await asyncio.wait_for(data.wait(), timeout_s)
        except TimeoutError:
            failure = BackendTimeout(f"broker {broker_id} sent nothing of {segment.segment_id}")
            continue
        finally:
            pushed, failure = list(stream.entries), stream.failure or failure
            stream.close()  # (clears its entries)
        if pushed:
            return [Entry(base, check_batch(batch)[0], batch) for base, batch in pushed]
    raise OffsetOutOfRange(
        f"offset {offset} of range {segment.range_id} is in segment {segment.segment_id}, "
        f"which no replica served: {failure.message if failure else 'none is known'}"
    )


def lead_payload(coordinator: Coordinator, meta: RangeMeta, segment_id: str) -> dict[str, Any]:
    """What ``lead_segment`` tells a leader: the range's metadata and its followers' addresses."""
    state = coordinator.state
    topic = state.topics[meta.topic]
    segment = state.segments[segment_id]
    addresses = {b: coordinator.membership.address_of(b) for b in segment.replicas[1:]}
    mirrored = meta.segments[-MIRROR_SEGMENTS_MAX:]
    holders = {b for sid in mirrored for b in state.segments[sid].replicas}
    return {
        "segment_id": segment_id,
        "followers": addresses,
        "addresses": {b: coordinator.membership.address_of(b) for b in sorted(holders)},
        "topic": {
            "name": topic.name,
            "policy": topic.policy,
            "config": topic.config,
            "created_ms": topic.created_ms,
        },
        "range": {
            "range_id": meta.range_id,
            "start": str(meta.start),  # 2**64 does not fit a JSON number safely
            "end": str(meta.end),
            "created_ms": meta.created_ms,
            "start_offset": meta.start_offset,
            "parents": meta.parents,
        },
        "segments": [
            {
                "segment_id": sid,
                "start_offset": state.segments[sid].start_offset,
                "end_offset": state.segments[sid].end_offset,
                "replicas": state.segments[sid].replicas,
                "created_ms": state.segments[sid].created_ms,
            }
            for sid in mirrored
        ],
    }


class Leadership:
    """The segments this member broker leads, and its half of their rolls."""

    def __init__(
        self,
        coordinator: Coordinator,
        forward: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
    ) -> None:
        self._coordinator = coordinator
        self._forward = forward
        self.leading: dict[str, int] = {}  # segment id: range id, of the segments led here
        self.addresses: dict[str, str] = {}  # broker id: address, of the mirrored replicas
        self._locks: dict[int, asyncio.Lock] = {}

    def range_log_of(self, segment_id: str) -> RangeLog | None:
        range_id = self.leading.get(segment_id)
        return None if range_id is None else self._coordinator.logs.get(range_id)

    async def lead(self, payload: dict[str, Any]) -> None:
        """Take the lead of a segment the coordinator placed here (idempotent)."""
        coordinator = self._coordinator
        segment_id = str(payload["segment_id"])
        range_id = int(payload["range"]["range_id"])
        lock = self._locks.setdefault(range_id, asyncio.Lock())
        async with lock:
            if segment_id in self.leading:
                return
            for broker, address in (payload.get("addresses") or {}).items():
                if address is not None:
                    self.addresses[str(broker)] = str(address)
            range_log = coordinator.logs.get(range_id)
            segments = payload["segments"]
            me = coordinator.config.broker_id
            previous = segments[-2] if len(segments) > 1 else None
            if range_log is not None and (previous is None or previous["replicas"][0] != me):
                # this broker did not lead the range's previous segment: its log (offsets,
                # duplicate table) is stale; a fresh one rebuilds both from the metadata
                if range_log.roll_running:
                    raise Unavailable(f"range {range_id} is rolling here; the coordinator retries")
                range_log.lead_elsewhere("")  # its streams go to the new log through a reopen
                await range_log.stop()
                del coordinator.logs[range_id]
                range_log = None
            meta = self._mirror(payload, with_last=range_log is not None)
            if range_log is None:
                range_log = coordinator.logs[range_id]  # built without the new segment
                meta.segments.append(segment_id)
            peers = coordinator.peers
            assert peers is not None
            active = coordinator.state.segments[segment_id]
            replicator = await open_followers(
                coordinator.runtime,
                peers,
                range_log,
                segment_id,
                active.start_offset,
                {str(b): str(a) for b, a in payload["followers"].items()},
                coordinator.config.replica_timeout_s,
                lambda _: None,
            )
            range_log.sync_committed(max(range_log.committed, active.start_offset))
            range_log.replicator = replicator
            self.leading[segment_id] = range_id
            range_log.lead(segment_id)
            log.info("leading segment %s of range %s", segment_id, range_id)

    def _mirror(self, payload: dict[str, Any], with_last: bool) -> RangeMeta:
        """Copy the range's metadata into this member's state (its last segment only when
        ``with_last``: a log built from the mirror must not see it active)."""
        state = self._coordinator.state
        topic = payload["topic"]
        name = str(topic["name"])
        data = payload["range"]
        range_id = int(data["range_id"])
        if name not in state.topics:
            state.topics[name] = TopicMeta(
                name, str(topic["policy"]), dict(topic["config"]), int(topic["created_ms"]), []
            )
        if range_id not in state.topics[name].ranges:
            state.topics[name].ranges.append(range_id)
        meta = state.ranges.get(range_id)
        if meta is None:
            meta = state.ranges[range_id] = RangeMeta(
                range_id, name, int(data["start"]), int(data["end"]), int(data["created_ms"])
            )
        meta.start_offset = int(data["start_offset"])
        meta.parents = list(data["parents"])
        ids: list[str] = []
        for row in payload["segments"]:
            sid = str(row["segment_id"])
            ids.append(sid)
            end = row["end_offset"]
            segment = state.segments.get(sid)
            if segment is None:
                segment = state.segments[sid] = SegmentMeta(
                    sid, range_id, int(row["start_offset"]), [], int(row["created_ms"])
                )
            segment.replicas = list(row["replicas"])
            if end is not None:
                segment.state, segment.end_offset = State.SEALED, int(end)
        meta.segments[:] = ids if with_last else ids[:-1]
        return meta

    async def roll(self, range_log: RangeLog, open_new: bool) -> str | None:
        """The roller of a range led here: the coordinator seals the active segment and places
        the next; returns it when it is led here (``lead`` installed it meanwhile)."""
        segment_id = range_log.active
        failed = list(range_log.replicator.failed) if range_log.replicator is not None else []
        answer = await self._forward(
            {
                "op": "roll_segment",
                "name": range_log.meta.topic,
                "range_id": range_log.meta.range_id,
                "segment_id": segment_id,
                "open_new": open_new,
                "failed": failed,
            }
        )
        if segment_id is not None and range_log.active == segment_id:
            # the coordinator could not seal it here (this broker was left out): stop leading
            self.leading.pop(segment_id, None)
            range_log.closed_segment()
        new = answer.get("segment_id")
        if new is None:
            return None
        if answer.get("leader") == self._coordinator.config.broker_id:
            if new in self.leading:
                return str(new)
            raise Unavailable(f"segment {new} of range {range_log.meta.range_id} is not led yet")
        range_log.lead_elsewhere(str(answer.get("leader_address") or ""))
        raise NotLeader(
            f"range {range_log.meta.range_id} is now led by broker {answer.get('leader')}"
        )

    async def fence(self, segment_id: str) -> dict[str, Any]:
        range_log = self.range_log_of(segment_id)
        if range_log is None or range_log.active != segment_id:
            raise NotFound(f"segment {segment_id} is not led here")
        end, committed = await range_log.fence()
        return {"end_offset": end, "committed": committed}

    async def seal(self, segment_id: str, end_offset: int) -> int:
        range_log = self.range_log_of(segment_id)
        assert range_log is not None
        info = await self._coordinator.store.seal(segment_id, end_offset)
        segment = self._coordinator.state.segments.get(segment_id)
        if segment is not None:
            segment.state, segment.end_offset = State.SEALED, info.end_offset
        self.leading.pop(segment_id, None)
        if range_log.active == segment_id:
            range_log.sealed_at(info.end_offset)
        return info.end_offset

    def ends(self, range_ids: list[int]) -> dict[str, int]:
        """The committed offsets of the ranges (of ``range_ids``) whose active segment is led here."""
        led = set(self.leading.values())
        logs = self._coordinator.logs
        return {str(rid): logs[rid].committed for rid in range_ids if rid in led and rid in logs}
