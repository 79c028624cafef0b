"""The coordinator: the business logic of topics, ranges and segments, and the owner of metadata.

Today one broker is the whole cluster, so it is the leader of the one vnode
and its coordinator.  Every decision is an op made durable in the journal
(``FileJournal``, the seam for a vnode's Raft log) and then applied to
``MetadataState``; the coordinator never changes state any other way, so a
restart (or a new leader) continues exactly where the last one stopped.

Decisions and their order on disk, chosen so a crash at any point recovers:

* Open a segment: create it in the store, then record ``open_segment``.  A
  store segment no op names is an orphan and is deleted on recovery.
* Seal a segment: seal it in the store at its durable end, then record
  ``seal_segment``.  On recovery every segment still active is sealed at
  what the store holds (the producer moves to a new segment, as after a
  replica failure): every acknowledged record is durable, so none is lost.
* Delete (topic or retention): record the op, then delete store segments.
* Split/merge: seal the parents' active segments, then record the op, which
  seals the parents and creates the children (buddy rule).

Control plane only: records never pass through here; ``RangeLog`` moves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from backends.northguard.batch import check_batch, record_timestamps
from backends.northguard.broker.journal import JOURNAL_OPS_MAX, FileJournal
from backends.northguard.broker.placement import (
    DEFAULT_POLICY,
    BrokerInfo,
    StoragePolicy,
    choose_replicas,
)
from backends.northguard.broker.range_log import RangeLog
from backends.northguard.broker.state import MetadataState, RangeMeta, State, TopicMeta
from backends.northguard.runtime import Runtime
from backends.northguard.store.base import SegmentStore
from xinfra.errors import (
    InvalidRequest,
    NotFound,
    Sealed,
    ShardOutOfRange,
    TopicAlreadyExists,
    TopicNotFound,
)
from xinfra.keyspace import KeyRange, check_covering
from xinfra.model import SHARD_COUNT_MAX, check_name

log = logging.getLogger(__name__)

TIMESTAMP_SCAN_BYTES = 4 << 20
"""Bytes read per store call when scanning for a timestamp (a cold path)."""


@dataclass
class CoordinatorConfig:
    broker_id: str = "1"
    attributes: dict[str, str] = field(default_factory=dict)
    segment_bytes_max: int = 1 << 30
    segment_age_s_max: float = 3600.0
    maintenance_s: float = 1.0
    policies: dict[str, StoragePolicy] = field(
        default_factory=lambda: {DEFAULT_POLICY.name: DEFAULT_POLICY}
    )


class Coordinator:
    """Owns the metadata of every topic, range and segment, and the range logs built from it."""

    def __init__(
        self,
        runtime: Runtime,
        journal: FileJournal,
        store: SegmentStore,
        config: CoordinatorConfig,
    ) -> None:
        self._runtime = runtime
        self._journal = journal
        self._store = store
        self.config = config
        self.state = MetadataState()
        self.logs: dict[int, RangeLog] = {}
        self._topic_lock = asyncio.Lock()  # topic-level decisions, one at a time
        self._commit_lock = asyncio.Lock()  # sequence numbers and journal order
        self._maintenance: asyncio.Task[None] | None = None
        self._me = BrokerInfo(config.broker_id, config.attributes)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the journal, recover the store against it, build range logs, start maintenance."""
        snapshot, ops = await self._runtime.run_blocking(self._journal.load)
        self.state = MetadataState.from_json(snapshot) if snapshot else MetadataState()
        for op in ops:
            self.state.apply(op)
        await self._store.open()
        known = set(self.state.segments)
        for info in self._store.segments():
            if info.segment_id not in known:
                log.warning("deleting orphan segment %s (no metadata names it)", info.segment_id)
                await self._store.delete_segment(info.segment_id)
        for segment in list(self.state.segments.values()):
            if segment.state is State.ACTIVE:
                try:
                    end = (await self._store.seal(segment.segment_id)).end_offset
                except NotFound:
                    log.error("segment %s is missing from the store", segment.segment_id)
                    end = segment.start_offset
                await self._commit(
                    {
                        "op": "seal_segment",
                        "segment_id": segment.segment_id,
                        "end_offset": end,
                        "sealed_ms": self._runtime.wall_ms(),
                    }
                )
        for meta in self.state.ranges.values():
            self._build_log(meta)
        self._maintenance = asyncio.create_task(self._maintain_forever())
        log.info(
            "coordinator recovered %d topics, %d ranges, %d segments",
            len(self.state.topics),
            len(self.state.ranges),
            len(self.state.segments),
        )

    async def stop(self) -> None:
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
        for range_log in self.logs.values():
            await range_log.stop()
        self._journal.close()

    def _build_log(self, meta: RangeMeta) -> RangeLog:
        range_log = RangeLog(
            self._runtime,
            self._store,
            meta,
            self.state.segments,
            self._roll,
            segment_bytes_max=self.config.segment_bytes_max,
            segment_age_ms_max=int(self.config.segment_age_s_max * 1000),
        )
        self.logs[meta.range_id] = range_log
        return range_log

    async def _commit(self, op: dict[str, Any]) -> None:
        """Decide ``op``: durable in the journal first, then applied."""
        async with self._commit_lock:
            op["seq"] = self.state.applied_seq + 1
            await self._journal.append(op)
            self.state.apply(op)
            if self._journal.ops_since_snapshot >= JOURNAL_OPS_MAX:
                await self._journal.snapshot(self.state.to_json())

    # -- segments (called by range logs) -----------------------------------------------------------

    async def _roll(self, range_log: RangeLog, open_new: bool) -> str | None:
        """Seal the range's active segment at its durable end; open a new one when asked."""
        meta = range_log.meta
        if range_log.active is not None:
            segment_id = range_log.active
            end = range_log.durable_end()
            info = await self._store.seal(segment_id, end)
            await self._commit(
                {
                    "op": "seal_segment",
                    "segment_id": segment_id,
                    "end_offset": info.end_offset,
                    "sealed_ms": self._runtime.wall_ms(),
                }
            )
            range_log.sync_committed(info.end_offset)
            range_log.closed_segment()
        if not open_new:
            return None
        if meta.state is State.SEALED or meta.range_id not in self.state.ranges:
            raise Sealed(f"range {meta.range_id} is sealed; refresh the topic metadata")
        topic = self.state.topics[meta.topic]
        replicas = choose_replicas(self._policy(topic), [self._me], {})
        assert replicas == [self._me.broker_id], "one broker holds every replica today"
        segment_id = f"r{meta.range_id}-{self.state.applied_seq + 1}"
        await self._store.create_segment(segment_id, range_log.committed)
        await self._commit(
            {
                "op": "open_segment",
                "range_id": meta.range_id,
                "segment_id": segment_id,
                "start_offset": range_log.committed,
                "replicas": replicas,
                "created_ms": self._runtime.wall_ms(),
            }
        )
        return segment_id

    def _policy(self, topic: TopicMeta) -> StoragePolicy:
        policy = self.config.policies.get(topic.policy, DEFAULT_POLICY)
        retention = topic.config.get("retention.ms")
        if retention is not None:
            policy = StoragePolicy(policy.name, int(retention), policy.constraints)
        return policy

    # -- topics ----------------------------------------------------------------------------------

    def topic(self, name: str) -> TopicMeta:
        topic = self.state.topics.get(name)
        if topic is None:
            raise TopicNotFound(f"topic {name!r} does not exist on this Northguard cluster")
        return topic

    def range_log(self, topic_name: str, range_id: int) -> RangeLog:
        topic = self.topic(topic_name)
        if range_id not in topic.ranges:
            raise ShardOutOfRange(f"topic {topic_name!r} has no range {range_id}")
        return self.logs[range_id]

    async def create_topic(
        self, name: str, ranges: Sequence[KeyRange], config: dict[str, str]
    ) -> dict[str, Any]:
        try:
            check_name(name, "topic name")
            check_covering(ranges)
        except ValueError as error:
            raise InvalidRequest(str(error)) from error
        if len(ranges) > SHARD_COUNT_MAX:
            raise InvalidRequest(f"a topic has at most {SHARD_COUNT_MAX} ranges, not {len(ranges)}")
        policy = config.get("policy", DEFAULT_POLICY.name)
        if policy not in self.config.policies:
            raise InvalidRequest(f"unknown storage policy {policy!r}")
        if "retention.ms" in config:
            try:
                if int(config["retention.ms"]) <= 0:
                    raise ValueError
            except ValueError as error:
                raise InvalidRequest("retention.ms must be a positive integer") from error
        async with self._topic_lock:
            if name in self.state.topics:
                raise TopicAlreadyExists(f"topic {name!r} already exists")
            await self._commit(
                {
                    "op": "create_topic",
                    "name": name,
                    "policy": policy,
                    "config": dict(config),
                    "ranges": [r.to_json() for r in ranges],
                    "created_ms": self._runtime.wall_ms(),
                }
            )
            topic = self.state.topics[name]
            for rid in topic.ranges:
                self._build_log(self.state.ranges[rid])
        return self.describe(name)

    async def delete_topic(self, name: str) -> None:
        async with self._topic_lock:
            topic = self.topic(name)
            logs = [self.logs[rid] for rid in topic.ranges]
            segments = [sid for rid in topic.ranges for sid in self.state.ranges[rid].segments]
            for range_log in logs:
                range_log.meta.state = State.SEALED  # refuse new appends at once
            for range_log in logs:
                await range_log.stop()
            await self._commit({"op": "delete_topic", "name": name})
            for rid in topic.ranges:
                del self.logs[rid]
        for segment_id in segments:
            await self._store.delete_segment(segment_id)

    async def seal_topic(self, name: str) -> dict[str, Any]:
        async with self._topic_lock:
            topic = self.topic(name)
            if topic.state is not State.SEALED:
                for meta in self.state.active_ranges(topic):
                    await self.logs[meta.range_id].seal_active()
                await self._commit({"op": "seal_topic", "name": name})
        return self.describe(name)

    async def split_range(self, name: str, range_id: int) -> dict[str, Any]:
        async with self._topic_lock:
            self._check_splittable(name, range_id)
            await self.logs[range_id].seal_active()
            await self._commit(
                {"op": "split_range", "range_id": range_id, "created_ms": self._runtime.wall_ms()}
            )
            for child in self.state.ranges[range_id].children:
                self._build_log(self.state.ranges[child])
        return self.describe(name)

    def _check_splittable(self, name: str, range_id: int) -> None:
        topic = self.topic(name)
        meta = self.state.ranges.get(range_id)
        if meta is None or meta.topic != name or meta.children:
            raise InvalidRequest(f"range {range_id} is not a current range of topic {name!r}")
        if topic.state is State.SEALED:
            raise Sealed(f"topic {name!r} is sealed")
        try:
            meta.key_range.split()
        except ValueError as error:
            raise InvalidRequest(str(error)) from error

    async def merge_ranges(self, name: str, first: int, second: int) -> dict[str, Any]:
        async with self._topic_lock:
            topic = self.topic(name)
            metas = [self.state.ranges.get(first), self.state.ranges.get(second)]
            if topic.state is State.SEALED:
                raise Sealed(f"topic {name!r} is sealed")
            for meta, rid in zip(metas, (first, second), strict=True):
                if meta is None or meta.topic != name or meta.children:
                    raise InvalidRequest(f"range {rid} is not a current range of topic {name!r}")
            a, b = metas
            assert a is not None and b is not None
            try:
                a.key_range.merge(b.key_range)
            except ValueError as error:
                raise InvalidRequest(str(error)) from error
            for rid in (first, second):
                await self.logs[rid].seal_active()
            await self._commit(
                {
                    "op": "merge_ranges",
                    "range_ids": [first, second],
                    "created_ms": self._runtime.wall_ms(),
                }
            )
            child = self.state.ranges[a.children[-1]]
            self._build_log(child)
        return self.describe(name)

    def list_topics(self) -> list[str]:
        return sorted(self.state.topics)

    def describe(self, name: str) -> dict[str, Any]:
        topic = self.topic(name)
        return {
            "name": topic.name,
            "state": topic.state.value,
            "policy": topic.policy,
            "config": topic.config,
            "created_ms": topic.created_ms,
            "ranges": [self._range_json(meta) for meta in self.state.active_ranges(topic)],
        }

    def _range_json(self, meta: RangeMeta) -> dict[str, Any]:
        return {
            "range_id": meta.range_id,
            "bounds": meta.key_range.to_json(),
            "state": meta.state.value,
            "start_offset": meta.start_offset,
            "end_offset": self.logs[meta.range_id].committed,
            "parents": meta.parents,
            "leader": self.config.broker_id,
        }

    def segment_metadata(self, name: str, range_id: int) -> dict[str, Any]:
        range_log = self.range_log(name, range_id)
        meta = range_log.meta
        segments = []
        for sid in meta.segments:
            segment = self.state.segments[sid]
            end = segment.end_offset if segment.end_offset is not None else range_log.committed
            segments.append(
                {
                    "segment_id": sid,
                    "state": segment.state.value,
                    "start_offset": segment.start_offset,
                    "end_offset": end,
                    "replicas": segment.replicas,
                    "created_ms": segment.created_ms,
                    "sealed_ms": segment.sealed_ms,
                }
            )
        return {**self._range_json(meta), "segments": segments}

    async def offset_for_timestamp(self, name: str, range_id: int, timestamp_ms: int) -> int:
        """First offset whose record timestamp is >= ``timestamp_ms``; the end if none (a cold scan)."""
        range_log = self.range_log(name, range_id)
        offset = range_log.meta.start_offset
        while True:
            entries = await range_log.read(offset, TIMESTAMP_SCAN_BYTES)
            if not entries:
                return range_log.committed
            for entry in entries:
                _, _, max_ts = check_batch(entry.batch)
                if max_ts >= timestamp_ms:
                    for index, ts in enumerate(record_timestamps(entry.batch)):
                        if ts >= timestamp_ms and entry.base_offset + index >= offset:
                            return entry.base_offset + index
                offset = entry.end_offset

    # -- maintenance: age limits and retention -----------------------------------------------------

    async def _maintain_forever(self) -> None:
        while True:
            await self._runtime.sleep(self.config.maintenance_s)
            try:
                await self.maintain()
            except Exception:
                log.exception("maintenance failed; retrying at the next tick")

    async def maintain(self) -> None:
        """Seal segments past their age limit; delete sealed segments past their retention."""
        now_ms = self._runtime.wall_ms()
        age_ms_max = self.config.segment_age_s_max * 1000
        for range_log in list(self.logs.values()):
            if range_log.active is not None and now_ms - range_log.active_created_ms >= age_ms_max:
                await range_log.seal_active()
        for topic in list(self.state.topics.values()):
            retention_ms = self._policy(topic).retention_ms
            for rid in list(topic.ranges):
                meta = self.state.ranges.get(rid)
                if meta is None:
                    continue
                doomed: list[str] = []
                for sid in meta.segments:
                    segment = self.state.segments[sid]
                    if segment.state is not State.SEALED or segment.sealed_ms is None:
                        break
                    if now_ms - segment.sealed_ms < retention_ms:
                        break
                    doomed.append(sid)
                if doomed and self.state.topics.get(topic.name) is topic:
                    await self._commit(
                        {"op": "delete_segments", "range_id": rid, "segment_ids": doomed}
                    )
                    for sid in doomed:
                        await self._store.delete_segment(sid)
