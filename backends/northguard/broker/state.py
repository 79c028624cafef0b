"""The metadata state machine: topics, ranges and segments, changed only by applying ops.

Every decision of the coordinator is an op (a small JSON object) that is
first made durable in the journal and then applied here.  ``apply`` is
deterministic and does no I/O, so replaying the journal on restart (or, with
replication, on a follower of the vnode's Raft group) rebuilds exactly the
same state.  Ops name every id they create, so replay never invents one.

Invariants (asserted on every apply):

* A topic's active ranges cover the keyspace exactly once (sealed topics keep
  their last covering).
* A range's segments are contiguous: each starts where the previous ended;
  at most the last is active, and only while the range is active.
* Split and merge follow the buddy rule (``KeyRange.split``/``merge``); the
  parents are sealed before the children exist, so everything in a parent
  happens-before everything in its children.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from xinfra.keyspace import KeyRange, check_covering


class State(enum.StrEnum):
    ACTIVE = "active"
    SEALED = "sealed"


_STATES: dict[str, State] = {state.value: state for state in State}
"""A state by its JSON value: ``State(value)`` costs an enum call, 49,000 of them in a restart."""


@dataclass
class SegmentMeta:
    segment_id: str
    range_id: int
    start_offset: int
    replicas: list[str]
    created_ms: int
    state: State = State.ACTIVE
    end_offset: int | None = None  # known once sealed
    sealed_ms: int | None = None


@dataclass
class RangeMeta:
    range_id: int
    topic: str
    start: int
    end: int
    created_ms: int
    state: State = State.ACTIVE
    segments: list[str] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    start_offset: int = 0  # first retained offset: moves forward with retention
    end_offset: int | None = None  # known once sealed

    @property
    def key_range(self) -> KeyRange:
        return KeyRange(self.start, self.end)


@dataclass
class TopicMeta:
    name: str
    policy: str
    config: dict[str, str]
    created_ms: int
    ranges: list[int]  # every range the topic ever had, in creation order
    state: State = State.ACTIVE


@dataclass
class MetadataState:
    topics: dict[str, TopicMeta] = field(default_factory=dict)
    ranges: dict[int, RangeMeta] = field(default_factory=dict)
    segments: dict[str, SegmentMeta] = field(default_factory=dict)
    next_range_id: int = 1
    applied_seq: int = 0  # the journal sequence number of the last applied op
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Storage policies administrators defined, by name, as checked JSON (``placement``)."""
    metadata_replicas: list[str] = field(default_factory=list)
    """The brokers holding a copy of this journal, the coordinator first (empty: never
    recorded); changed only by ``metadata_replicas`` ops (``metadata_replication``)."""
    metadata_replicas_seq: int = 0
    """The op that recorded ``metadata_replicas``: the newest set among copies is the one
    with the highest (recovery's rule)."""

    # -- queries ---------------------------------------------------------------------------------

    def active_ranges(self, topic: TopicMeta) -> list[RangeMeta]:
        """The topic's current covering, in keyspace order (its last one once sealed)."""
        ranges = [self.ranges[rid] for rid in topic.ranges]
        live = [r for r in ranges if not r.children]
        return sorted(live, key=lambda r: r.start)

    # -- ops -------------------------------------------------------------------------------------

    def apply(self, op: dict[str, Any]) -> None:
        """Apply one op; ``seq`` orders ops and makes replay after a snapshot idempotent."""
        seq = int(op["seq"])
        if seq <= self.applied_seq:
            return
        assert seq == self.applied_seq + 1, f"journal gap: op {seq} after {self.applied_seq}"
        getattr(self, "_apply_" + op["op"])(op)
        self.applied_seq = seq

    def _apply_create_topic(self, op: dict[str, Any]) -> None:
        name = op["name"]
        assert name not in self.topics
        bounds = [KeyRange(int(s), int(e)) for s, e in op["ranges"]]
        check_covering(bounds)
        ids = list(range(self.next_range_id, self.next_range_id + len(bounds)))
        self.next_range_id += len(bounds)
        for rid, bound in zip(ids, bounds, strict=True):
            self.ranges[rid] = RangeMeta(rid, name, bound.start, bound.end, op["created_ms"])
        self.topics[name] = TopicMeta(name, op["policy"], dict(op["config"]), op["created_ms"], ids)

    def _apply_delete_topic(self, op: dict[str, Any]) -> None:
        topic = self.topics.pop(op["name"])
        for rid in topic.ranges:
            meta = self.ranges.pop(rid)
            for sid in meta.segments:
                del self.segments[sid]

    def _apply_seal_topic(self, op: dict[str, Any]) -> None:
        topic = self.topics[op["name"]]
        topic.state = State.SEALED
        for meta in self.active_ranges(topic):
            self._seal_range(meta)

    def _seal_range(self, meta: RangeMeta) -> None:
        if meta.state is State.SEALED:
            return
        if meta.segments:
            last = self.segments[meta.segments[-1]]
            assert last.state is State.SEALED, (
                f"range {meta.range_id} sealed over an active segment"
            )
            meta.end_offset = last.end_offset
        else:
            meta.end_offset = meta.start_offset
        meta.state = State.SEALED

    def _apply_open_segment(self, op: dict[str, Any]) -> None:
        meta = self.ranges[op["range_id"]]
        assert meta.state is State.ACTIVE, f"segment opened in sealed range {meta.range_id}"
        start = int(op["start_offset"])
        if meta.segments:
            last = self.segments[meta.segments[-1]]
            assert last.state is State.SEALED and last.end_offset == start, (
                "segments not contiguous"
            )
        else:
            assert start == meta.start_offset
        sid = op["segment_id"]
        assert sid not in self.segments
        self.segments[sid] = SegmentMeta(
            sid, meta.range_id, start, list(op["replicas"]), op["created_ms"]
        )
        meta.segments.append(sid)

    def _apply_seal_segment(self, op: dict[str, Any]) -> None:
        segment = self.segments[op["segment_id"]]
        assert segment.state is State.ACTIVE
        end = int(op["end_offset"])
        assert end >= segment.start_offset
        segment.state = State.SEALED
        segment.end_offset = end
        segment.sealed_ms = op["sealed_ms"]
        if "replicas" in op:  # the survivors of a replica failure: who holds the sealed segment
            segment.replicas = list(op["replicas"])

    def _apply_create_policy(self, op: dict[str, Any]) -> None:
        policy = dict(op["policy"])
        assert policy["name"] not in self.policies
        self.policies[policy["name"]] = policy

    def _apply_metadata_replicas(self, op: dict[str, Any]) -> None:
        """The set of copies of this journal changed (a copy failed, or one was added)."""
        self.metadata_replicas = [str(b) for b in op["replicas"]]
        self.metadata_replicas_seq = int(op["seq"])

    def _apply_drop_replica(self, op: dict[str, Any]) -> None:
        """A broker no longer holds these sealed segments (its disk was lost): re-replication
        brings them back to their policy's count."""
        for sid in op["segment_ids"]:
            segment = self.segments.get(sid)
            if segment is not None and op["broker_id"] in segment.replicas:
                assert segment.state is State.SEALED, "only sealed segments lose a replica"
                segment.replicas.remove(op["broker_id"])

    def _apply_add_replica(self, op: dict[str, Any]) -> None:
        """Re-replication: a broker now holds a full, checked copy of a sealed segment."""
        segment = self.segments[op["segment_id"]]
        assert segment.state is State.SEALED, "only sealed segments are re-replicated"
        assert op["broker_id"] not in segment.replicas
        segment.replicas.append(op["broker_id"])

    def _apply_delete_segments(self, op: dict[str, Any]) -> None:
        meta = self.ranges[op["range_id"]]
        doomed = list(op["segment_ids"])
        assert meta.segments[: len(doomed)] == doomed, "retention deletes the oldest segments first"
        for sid in doomed:
            segment = self.segments.pop(sid)
            assert segment.state is State.SEALED and segment.end_offset is not None
            meta.start_offset = segment.end_offset
        del meta.segments[: len(doomed)]

    def _apply_split_range(self, op: dict[str, Any]) -> None:
        parent = self.ranges[op["range_id"]]
        self._seal_range(parent)
        low, high = parent.key_range.split()
        topic = self.topics[parent.topic]
        for bound in (low, high):
            rid = self.next_range_id
            self.next_range_id += 1
            self.ranges[rid] = RangeMeta(
                rid, topic.name, bound.start, bound.end, op["created_ms"], parents=[parent.range_id]
            )
            parent.children.append(rid)
            topic.ranges.append(rid)

    def _apply_merge_ranges(self, op: dict[str, Any]) -> None:
        first, second = (self.ranges[rid] for rid in op["range_ids"])
        merged = first.key_range.merge(second.key_range)
        topic = self.topics[first.topic]
        rid = self.next_range_id
        self.next_range_id += 1
        for parent in (first, second):
            self._seal_range(parent)
            parent.children.append(rid)
        self.ranges[rid] = RangeMeta(
            rid,
            topic.name,
            merged.start,
            merged.end,
            op["created_ms"],
            parents=[first.range_id, second.range_id],
        )
        topic.ranges.append(rid)

    # -- snapshots -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The whole state as JSON values, sharing nothing an op changes in place with it.

        Each object's fields are copied shallowly and its lists and dicts by
        hand (a policy is replaced whole, never changed): ``dataclasses.asdict``
        (a recursive deep copy) took 1.2 s for 24,576 ranges and segments, in
        the snapshot thread that shares the GIL with the event loop, against
        0.2 s this way (measured).
        """
        return {
            "topics": [
                {**vars(t), "config": dict(t.config), "ranges": list(t.ranges)}
                for t in self.topics.values()
            ],
            "ranges": [
                {
                    **vars(r),
                    "start": str(r.start),
                    "end": str(r.end),
                    "segments": list(r.segments),
                    "parents": list(r.parents),
                    "children": list(r.children),
                }
                for r in self.ranges.values()
            ],
            "segments": [{**vars(s), "replicas": list(s.replicas)} for s in self.segments.values()],
            "next_range_id": self.next_range_id,
            "applied_seq": self.applied_seq,
            "policies": [dict(p) for p in self.policies.values()],
            "metadata_replicas": list(self.metadata_replicas),
            "metadata_replicas_seq": self.metadata_replicas_seq,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MetadataState:
        """The state ``to_json`` gave (or its JSON text parsed), taking ownership of ``data``'s
        objects: a restart builds one per range and segment, so nothing is copied twice."""
        state = cls(
            next_range_id=data["next_range_id"],
            applied_seq=data["applied_seq"],
            metadata_replicas=list(data.get("metadata_replicas", [])),  # absent from older ones
            metadata_replicas_seq=int(data.get("metadata_replicas_seq", 0)),
        )
        for policy in data.get("policies", []):  # absent from snapshots made before policies
            state.policies[policy["name"]] = dict(policy)
        for t in data["topics"]:
            topic = TopicMeta(**t)
            topic.state = _STATES[topic.state]
            state.topics[topic.name] = topic
        ranges = state.ranges
        for r in data["ranges"]:
            meta = RangeMeta(**r)
            meta.start, meta.end, meta.state = int(meta.start), int(meta.end), _STATES[meta.state]
            ranges[meta.range_id] = meta
        segments = state.segments
        for s in data["segments"]:
            segment = SegmentMeta(**s)
            segment.state = _STATES[segment.state]
            segments[segment.segment_id] = segment
        return state
