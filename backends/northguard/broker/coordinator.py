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
  ``seal_segment``.  A crash between the two leaves it sealed in the store
  and active in the journal: recovery records the seal (one journal write
  for all of them, and none at all after a clean stop).
* Restart: every other active segment stays active.  Its range log, built on
  first use, continues it from the end the store recovered from its WAL and
  file: every acknowledged record is there (the WAL was fsynced before the
  ack) and nothing past it is published, because the store's end *is* the
  durable end.  A restart therefore costs no store or journal write per
  active segment, and the segments do not multiply with restarts.  This
  holds while one broker holds every replica; with replication, a restarted
  replica's active segments must be fenced by the coordinator (sealed at the
  smallest end among the survivors) before anything is appended to them.
* Delete (topic or retention): record the op, then delete store segments.
* Split/merge: seal the parents' active segments, then record the op, which
  seals the parents and creates the children (buddy rule).

**Group commit of ops.**  Ops decided while a journal write is in flight are
written together by the next one (one fsync): the first write to thousands
of new ranges opens thousands of segments in a few journal writes, not one
fsync each.  Each op's precondition runs just before its write, its sequence
number is assigned then, and it is applied once the write is durable.

**Snapshots** are built off the event loop from the previous snapshot and the
ops made since (never from the live state, so no lock is held while
building), then installed with a rename and a rewrite of the ops made during
the build.  What a snapshot holds: every topic, range (split/merge parents
included) and segment whose data still exists; a segment's metadata goes in
the same op that deletes its data (retention, ``delete_topic``), never later.
``sealed_segments_max`` (a broker setting) bounds the sealed segments a range
keeps (the oldest go first, data and metadata, as retention does; enforced at
each maintenance tick), so the snapshot is at most about
ranges x (sealed_segments_max + 1) x 190 B.  Measured: 40,000 segments make a
7.5 MB snapshot that took about 1 s to serialise and 0.6 s to parse (on a
busy test machine), in a worker thread that still shares the GIL with the
loop (switching every 5 ms).

**Cluster (issue 15).**  This broker's coordinator owns all metadata (the
one vnode); other brokers are members (``membership.py``) that register and
heartbeat.  A new segment's replica set is chosen under the topic's policy
from the live brokers, least loaded first (active segments, then stored
bytes); its first broker *leads* it (``_place``: leaders spread least-led
first and stay where they are while live): ``replica_create`` on each
replica, then, led here, replica streams opened and the ``open_segment``
op; led by a member, the op and then ``lead_segment`` (``leadership.py``).
Sealing a replicated segment *fences* every replica, its leader included
(``_fence_and_seal``): each stops taking appends and answers its durable
end; the seal point is the smallest end among the survivors, every survivor
truncates to it and seals, and ``seal_segment`` records the survivors as the
segment's replicas (fewer than asked: under-replicated).  A replica that
does not answer is left out.  The same seal serves a failed follower, a
member leader's roll (``roll_for_leader``), an age limit, and a dead leader
(``_check_leaders``).  A member broker runs no coordinator: its metadata
requests are forwarded here (``forward``); its range logs are those of the
segments it leads, over a mirror of their ranges' metadata.

Control plane only: records never pass through here; ``RangeLog`` moves them
(here, for the ranges whose active segment this broker leads; a range led by
a member has a log here too, which refuses appends with ``NotLeader``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from backends.northguard.batch import check_batch, record_timestamps
from backends.northguard.broker.journal import JOURNAL_OPS_MAX, FileJournal
from backends.northguard.broker.leadership import (
    Leadership,
    lead_payload,
    open_followers,
    read_remote,
)
from backends.northguard.broker.membership import BROKER_TIMEOUT_S, Membership
from backends.northguard.broker.metadata_replication import (
    MetadataCopy,
    MetadataReplicas,
    recover,
)
from backends.northguard.broker.peers import PeerPool
from backends.northguard.broker.placement import (
    DEFAULT_POLICY,
    BrokerInfo,
    StoragePolicy,
    choose_additional_replica,
    choose_replicas,
    leader_first,
    policy_from_json,
    with_replication_factor,
)
from backends.northguard.broker.range_log import RangeLog
from backends.northguard.broker.replication import REPLICA_TIMEOUT_S, ReplicaHost, Replicator
from backends.northguard.broker.state import (
    MetadataState,
    RangeMeta,
    SegmentMeta,
    State,
    TopicMeta,
)
from backends.northguard.runtime import Runtime
from backends.northguard.shielded import to_completion
from backends.northguard.store.base import Entry, SegmentState, SegmentStore
from xinfra.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    NotLeader,
    Sealed,
    ShardOutOfRange,
    StorageError,
    TopicAlreadyExists,
    TopicNotFound,
    Unavailable,
    XinfraError,
)
from xinfra.keyspace import SHARD_COUNT_MAX, KeyRange, check_covering
from xinfra.names import check_name

log = logging.getLogger(__name__)

TIMESTAMP_SCAN_BYTES = 4 << 20
"""Bytes read per store call when scanning for a timestamp (a cold path)."""
REPLICATION_FACTOR_MAX = 16
LOAD_REFRESH_S = 1.0
"""Age of the per-broker load placement uses before it is counted again."""
STATUS_SEGMENTS_MAX = 1000
"""Segments ``cluster_status`` lists (active and under-replicated first); totals are exact."""
HEALING_MAX = 4
"""Sealed segments re-replicated at once (each a consume stream and a copy on one broker)."""
COPY_TIMEOUT_S = 600.0
"""Bound of one ``replica_copy`` request (a whole segment, up to ``segment_bytes_max``)."""
PLACEMENT_ATTEMPTS = 3
"""Replica sets tried for one new segment before its appends fail (each failed follower is
suspected, so the next attempt leaves it out)."""


@dataclass
class CoordinatorConfig:
    broker_id: str = "1"
    attributes: dict[str, str] = field(default_factory=dict)
    segment_bytes_max: int = 1 << 30
    segment_age_s_max: float = 3600.0
    maintenance_s: float = 1.0
    sealed_segments_max: int = 10_000
    """Sealed segments a range keeps; past it the oldest are deleted, like retention."""
    snapshot_ops_max: int | None = None
    """Ops in the journal before a snapshot is built, off the event loop (None: JOURNAL_OPS_MAX)."""
    policies: dict[str, StoragePolicy] = field(
        default_factory=lambda: {DEFAULT_POLICY.name: DEFAULT_POLICY}
    )
    replication_factor: int = 1
    """Replicas of a new segment under the default policy (a topic's ``replication.factor``
    overrides it)."""
    replica_timeout_s: float = REPLICA_TIMEOUT_S
    broker_timeout_s: float = BROKER_TIMEOUT_S
    orphan_scan_s: float = 30.0
    """How often the coordinator lists each live member's segments to delete orphans."""
    member: bool = False
    """A member broker: no metadata of its own, requests forwarded to the coordinator."""
    cluster: bool = False
    """Part of a multi-broker cluster: topic metadata names the leader's address."""
    metadata_replication_factor: int = 1
    """Copies of the metadata journal: this broker's and N - 1 live members' (1: only here)."""
    recover_metadata_from: list[str] = field(default_factory=list)
    """Members' addresses to rebuild an empty journal from (``metadata_replication.recover``)."""
    metadata_policy: str | None = None
    """The storage policy placing the journal's copies (None: ``metadata_replication_factor``)."""
    force_unclean_metadata_recovery: bool = False
    """Recover from the most complete copy reached even when it may be behind (loudly)."""


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
        self.logs: dict[int, RangeLog] = _RangeLogs(self._build_missing_log)
        self._topic_lock = asyncio.Lock()  # topic-level decisions, one at a time
        self._commit_lock = asyncio.Lock()  # sequence numbers and journal order
        self._pending: list[_PendingOp] = []  # decided, waiting for the next journal write
        self._committer: asyncio.Task[None] | None = None
        self._ops_since_snapshot: list[dict[str, Any]] = []
        self._snapshotter: asyncio.Task[None] | None = None
        self._snapshot_base: MetadataState | None = None  # see ``_build_snapshot``
        self.snapshots = 0
        self.snapshot_bytes = 0
        self.snapshot_build_s = 0.0
        self.snapshot_hook: Callable[[str], None] | None = None
        """Test seam: called in the build's worker thread with "built" (the state is in memory)
        and "written" (``snapshot.tmp`` is synced, not yet installed), to hold or crash a build
        at a known point; it must not touch the live state."""
        self.journal_writes = 0
        self.journal_ops = 0
        self._maintenance: asyncio.Task[None] | None = None
        self._me = BrokerInfo(config.broker_id, config.attributes)
        self.membership = Membership(runtime, self._me, "", config.broker_timeout_s)
        self.metadata_replicas = MetadataReplicas(
            config.metadata_replication_factor, self.membership, journal, config.metadata_policy
        )
        self.metadata_copy: MetadataCopy | None = None  # a member's copy of the journal
        self.metadata_recovered = False  # this start rebuilt the journal from a member's copy
        self.peers: PeerPool | None = None  # set by the broker in a cluster
        self.replicas = ReplicaHost(store)
        self.forward: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._healing: set[str] = set()  # segment ids being re-replicated
        self._opening: set[str] = set()  # segment ids created on replicas, op not yet written
        self._orphans_seen: dict[str, set[str]] = {}  # by broker: orphans of the last scan
        self._orphan_scan: asyncio.Task[None] | None = None
        self._orphan_scanned_s = 0.0
        self._aging_due_ms = 0.0  # wall ms of the next look for aged segments (``_seal_aged``)
        self._retention_due_ms = 0  # and for expired ones (``_apply_retention``); 0: next pass
        self.orphans_deleted = 0
        self._load_cache: dict[str, list[int]] | None = None
        self._load_cached_s = 0.0
        self._unfenced: set[int] = set()  # ranges whose replicated active segment a restart left
        self._fencing: asyncio.Task[None] | None = None
        self.healed = 0  # replicas added by re-replication since start
        self.replica_failures = 0  # followers left out of a seal since start
        self.under_replicated = 0  # at the last heal scan
        self.leadership: Leadership | None = None  # a member: the segments it leads
        self._leader_ends: dict[int, int] = {}  # committed offsets leaders reported, by range
        self._reported_failed: dict[str, set[str]] = {}  # followers a leader reported failed
        self._failing_over: set[int] = set()  # ranges whose dead leader's segment is being sealed
        self.leader_failovers = 0  # segments sealed because their leader died, since start

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the journal, recover the store against it, build range logs, start maintenance."""
        snapshot, ops = await self._runtime.run_blocking(self._journal.load)
        self.state = MetadataState.from_json(snapshot) if snapshot else MetadataState()
        if not snapshot and not ops and self.config.recover_metadata_from:
            assert self.peers is not None, "recovery needs the peer connections"
            recovered = await recover(
                self.peers,
                self.config.recover_metadata_from,
                self._journal,
                self.membership,
                self.config.force_unclean_metadata_recovery,
            )
            if recovered is None:
                log.error("metadata recovery: no member holds a copy; starting empty")
            else:
                self.state, self.metadata_recovered = recovered, True
        self.snapshot_bytes = self._journal.snapshot_bytes
        for op in ops:
            self.state.apply(op)
        self._ops_since_snapshot = list(ops)
        await self._store.open()
        if self.config.member:  # the coordinator owns the metadata; replicas are its to delete
            log.info("member broker: %d segment replicas in the store", len(self._store.segments()))
            return
        held = self._store.segment_states()  # 20k+ here: no SegmentInfo made for each
        known = self.state.segments
        for segment_id in [sid for sid in held if sid not in known]:
            log.warning("deleting orphan segment %s (no metadata names it)", segment_id)
            await self._store.delete_segment(segment_id)
            del held[segment_id]
        unfinished = self._unfinished_seals(held)
        if unfinished:  # one journal write for all; none after a clean stop
            await self._commit_many(unfinished)
        lost = self._lost_sealed_replicas(held)
        if lost:  # the metadata must not name this broker for them: healing copies them back
            log.warning("%d sealed segments lost their replica here; re-replicating", len(lost))
            await self._commit(
                {"op": "drop_replica", "broker_id": self._me.broker_id, "segment_ids": lost}
            )
        if self.config.cluster:
            self._unfenced = {
                meta.range_id
                for meta in self.state.ranges.values()
                if meta.segments
                and self.state.segments[meta.segments[-1]].state is State.ACTIVE
                and len(self.state.segments[meta.segments[-1]].replicas) > 1
            }
            self._fencing = self._spawn(self._fence_restarted())  # maintenance waits for it
        self._maintenance = asyncio.create_task(self._maintain_forever())
        log.info(
            "coordinator recovered %d topics, %d ranges, %d segments (range logs built on first use)",
            len(self.state.topics),
            len(self.state.ranges),
            len(self.state.segments),
        )

    @property
    def journal_fsyncs(self) -> int:
        """fsync calls of the journal since start: what recovery and group commits cost."""
        return self._journal.fsyncs

    def _unfinished_seals(self, held: dict[str, SegmentState]) -> list[dict[str, Any]]:
        """The ``seal_segment`` ops a crash kept from the journal: segments active in the metadata
        but sealed in the store (a roll cut between its two steps), or missing from it.

        Every other active segment stays active and its range continues it
        (``RangeLog``): no store or journal write per active segment, so the
        restart's time does not grow with them.  A look-up per active
        segment, in memory.
        """
        ops: list[dict[str, Any]] = []
        for segment in self.state.segments.values():
            if segment.state is not State.ACTIVE:
                continue
            state = held.get(segment.segment_id)
            if state is None:
                if self.metadata_recovered and len(segment.replicas) > 1:
                    continue  # this disk was lost: the fence seals it on the other replicas
                log.error(
                    "segment %s is missing from the store; sealing it empty", segment.segment_id
                )
                end = segment.start_offset
            elif state is not SegmentState.SEALED:
                continue
            else:
                end = self._store.segment(segment.segment_id).end_offset
            ops.append(
                {
                    "op": "seal_segment",
                    "segment_id": segment.segment_id,
                    "end_offset": end,
                    "sealed_ms": self._runtime.wall_ms(),
                }
            )
        return ops

    def _lost_sealed_replicas(self, held: dict[str, SegmentState]) -> list[str]:
        """Sealed segments the metadata says this broker holds and its store does not (a lost
        data disk, the metadata recovered from a member's copy): until the metadata says so
        too, they count as fully replicated and are never healed."""
        me = self._me.broker_id
        return [
            segment.segment_id
            for segment in self.state.segments.values()
            if segment.state is State.SEALED
            and me in segment.replicas
            and segment.segment_id not in held
        ]

    async def stop(self) -> None:
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
        for range_log in self.logs.values():
            await range_log.stop()
        for background in list(self._background):
            background.cancel()
        for task in (self._committer, self._snapshotter):
            if task is not None and not task.done():
                with contextlib.suppress(Exception):
                    await task  # a journal write or a snapshot install in flight finishes first
        self._journal.close()

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    @property
    def segments_led(self) -> int:
        """Active segments this broker leads (its range logs with an active segment here)."""
        if self.leadership is not None:
            return len(self.leadership.leading)
        return sum(1 for r in self.logs.values() if r.active is not None and r.led_by is None)

    def _build_missing_log(self, range_id: int) -> RangeLog:
        meta = self.state.ranges.get(range_id)
        if meta is None:
            raise KeyError(range_id)
        range_log = self._build_log(meta)
        if meta.segments and self.leadership is None:
            last = self.state.segments[meta.segments[-1]]
            if last.state is State.ACTIVE and last.replicas[0] != self._me.broker_id:
                range_log.led_by = self.membership.address_of(last.replicas[0]) or ""
        return range_log

    async def roll_for_leader(
        self, name: str, range_id: int, segment_id: str | None, open_new: bool, failed: list[str]
    ) -> dict[str, Any]:
        """``roll_segment``, from a member leading the range: seal its active segment (unless
        another roll already did), open the next when asked; answer the active segment now."""
        range_log = self.range_log(name, range_id)
        if segment_id is not None and failed:
            self._reported_failed.setdefault(segment_id, set()).update(failed)
        await range_log.roll_segment(segment_id, open_new)
        active = range_log.active
        if active is None:
            return {"segment_id": None}
        leader = self.state.segments[active].replicas[0]
        return {
            "segment_id": active,
            "leader": leader,
            "leader_address": self.membership.address_of(leader),
        }

    async def _fail_over(self, range_log: RangeLog, segment_id: str) -> None:
        """The leader of ``segment_id`` died: seal it on the survivors, open the next on live
        brokers (producers find it through the metadata and resend what was not acknowledged)."""
        range_id = range_log.meta.range_id
        try:
            log.warning("segment %s: its leader is not live; sealing it", segment_id)
            await range_log.roll_segment(segment_id, open_new=True)
            self.leader_failovers += 1
        except XinfraError as error:
            log.warning("segment %s: fail-over failed (retried): %s", segment_id, error)
        finally:
            self._failing_over.discard(range_id)

    def _check_leaders(self, restarted: str | None = None) -> None:
        """Start a fail-over for each active segment whose leader (a member) is no longer live,
        or is ``restarted`` (a new process: the segments it led in memory are gone)."""
        for range_id, range_log in list(self.logs.items()):
            if not range_log.led_by or range_log.active is None or range_id in self._failing_over:
                continue
            segment = self.state.segments.get(range_log.active)
            if segment is None:
                continue
            leader = segment.replicas[0]
            if leader != restarted and self.membership.is_live(leader):
                continue
            self._failing_over.add(range_id)
            self._spawn(self._fail_over(range_log, range_log.active))

    def broker_restarted(self, broker_id: str) -> None:
        """A member registered from a new process: fail over the segments it led."""
        self._check_leaders(restarted=broker_id)

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
        if self.peers is not None:
            range_log.remote_read = functools.partial(self._read_remote, meta.topic)
        self.logs[meta.range_id] = range_log
        return range_log

    async def _read_remote(
        self, topic: str, segment: SegmentMeta, offset: int, bytes_max: int
    ) -> list[Entry]:
        peers = self.peers
        assert peers is not None
        leadership = self.leadership
        address_of = (
            leadership.addresses.get if leadership is not None else self.membership.address_of
        )
        if self.metadata_recovered:  # replicas this broker lost with its disk: ask the others
            others = [b for b in segment.replicas if b != self._me.broker_id]
            segment = dataclasses.replace(segment, replicas=others)
        return await read_remote(
            peers, address_of, segment, topic, offset, bytes_max, self.config.replica_timeout_s
        )

    async def _commit(
        self, op: dict[str, Any], precondition: Callable[[], None] | None = None
    ) -> None:
        """Decide ``op``: durable in the journal first, then applied (a disk error: StorageError).

        ``precondition`` runs under the commit lock just before the op is
        written and raises to refuse it: what was true when a step began
        (a range still active) may have changed while it awaited the store,
        and an op the state cannot apply must never reach the journal.
        """
        pending = _PendingOp(op, precondition, _Decision())
        self._queue_ops([pending])
        await _decided(pending.done)

    async def _commit_many(self, ops: list[dict[str, Any]]) -> None:
        """Decide every op of ``ops`` (in one journal write when nothing else is in flight)."""
        pending = [_PendingOp(op, None, _Decision()) for op in ops]
        self._queue_ops(pending)
        for item in pending:
            await _decided(item.done)

    def _queue_ops(self, pending: list[_PendingOp]) -> None:
        self._pending.extend(pending)
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_pending(), name="ng-journal")

    async def _commit_pending(self) -> None:
        """Write every op decided so far in one journal write; repeat while more arrive."""
        batch: list[_PendingOp] = []
        try:
            await self._commit_batches(batch)
        finally:  # cancelled (the broker stops): nobody may wait for an op never decided
            for pending in [*batch, *self._pending]:
                if not pending.done.done():
                    pending.done.set_exception(
                        Unavailable(
                            "the broker stopped; the op stands only if it reached the journal"
                        )
                    )

    async def _commit_batches(self, batch: list[_PendingOp]) -> None:
        while self._pending:
            batch[:], self._pending = self._pending, []
            async with self._commit_lock:
                accepted: list[_PendingOp] = []
                seq = self.state.applied_seq
                touched: set[tuple[str, Any]] | None = set()
                for index, pending in enumerate(batch):
                    if pending.precondition is not None and accepted:
                        keys = self._touches(pending.op)
                        if touched is None or keys is None or keys & touched:
                            # Its precondition sees the state before this batch: an op
                            # accepted ahead of it may change what it checks.  It goes
                            # to the next journal write, after those ops are applied.
                            self._pending[:0] = batch[index:]
                            break
                    try:
                        if pending.precondition is not None:
                            pending.precondition()
                    except Exception as error:
                        pending.done.set_exception(error)
                        continue
                    seq += 1
                    pending.op["seq"] = seq
                    accepted.append(pending)
                    keys = self._touches(pending.op)
                    if keys is None:
                        touched = None
                    elif touched is not None:
                        touched |= keys  # in place: a new set per op made a batch O(n^2)
                if not accepted:
                    continue
                try:
                    await to_completion(self._journal.append_many([p.op for p in accepted]))
                except OSError as error:
                    for pending in accepted:
                        pending.done.set_exception(
                            StorageError(f"metadata journal: {error}; {pending.op['op']} not made")
                        )
                    continue
                recorded: list[dict[str, Any]] = []
                if self.metadata_replicas.active:  # before applying: state is the base
                    recorded = await to_completion(
                        self.metadata_replicas.replicate([p.op for p in accepted], self.state)
                    )
                self.journal_writes += 1
                self.journal_ops += len(accepted)
                for pending in accepted:
                    try:
                        self.state.apply(pending.op)
                    except Exception as error:  # a broken invariant: the caller hears of it
                        log.exception("applying %s failed", pending.op["op"])
                        pending.done.set_exception(error)
                        continue
                    if pending.op["op"] in _SEALING_OPS:
                        self._retention_due_ms = 0  # a new candidate: the next pass looks
                    self._ops_since_snapshot.append(pending.op)
                    pending.done.set_result(None)
                self._apply_recorded(recorded)
            snapshot_ops_max = self.config.snapshot_ops_max or JOURNAL_OPS_MAX
            if len(self._ops_since_snapshot) >= snapshot_ops_max and (
                self._snapshotter is None or self._snapshotter.done()
            ):
                self._snapshotter = asyncio.create_task(self._snapshot(), name="ng-snapshot")

    def _apply_recorded(self, ops: list[dict[str, Any]]) -> None:
        """Apply the metadata replica set changes ``MetadataReplicas.replicate`` made durable."""
        for op in ops:
            self.state.apply(op)
            self._ops_since_snapshot.append(op)
        self.journal_ops += len(ops)

    def _touches(self, op: dict[str, Any]) -> set[tuple[str, Any]] | None:
        """The topics, ranges and segments ``op`` changes; None when it may change any range
        of a topic (deleting, sealing, splitting or merging)."""
        if op["op"] in ("delete_topic", "seal_topic", "split_range", "merge_ranges"):
            return None
        if op["op"] == "create_policy":
            return {("policy", op["policy"]["name"])}
        keys: set[tuple[str, Any]] = set()
        if "name" in op:
            keys.add(("topic", op["name"]))
        if "range_id" in op:
            keys.add(("range", op["range_id"]))
        segment_ids = [
            *op.get("segment_ids", ()),
            *([op["segment_id"]] if "segment_id" in op else []),
        ]
        for segment_id in segment_ids:
            keys.add(("segment", segment_id))
            segment = self.state.segments.get(segment_id)
            if segment is not None:
                keys.add(("range", segment.range_id))
        return keys

    async def _snapshot(self) -> None:
        """Build the snapshot in a thread from the last one plus the ops since; install it."""
        ops = list(self._ops_since_snapshot)
        upto_seq = int(ops[-1]["seq"])
        started_s = self._runtime.monotonic_s()
        try:
            size = await self._runtime.run_blocking(self._build_snapshot, ops)
            await to_completion(self._journal.install_snapshot(upto_seq))
        except Exception:
            log.exception("metadata snapshot failed; the journal keeps every op, retrying later")
            return
        self._ops_since_snapshot = [
            op for op in self._ops_since_snapshot if int(op["seq"]) > upto_seq
        ]
        self.snapshots += 1
        self.snapshot_bytes = size
        self.snapshot_build_s = self._runtime.monotonic_s() - started_s
        log.info(
            "metadata snapshot at op %d: %d bytes in %.3f s", upto_seq, size, self.snapshot_build_s
        )

    def _build_snapshot(self, ops: list[dict[str, Any]]) -> int:
        """In a worker thread: touches only ``ops`` (never mutated), the state of the last build
        (``_snapshot_base``, its own) or else the snapshot on disk.

        The last build's state is kept and brought forward by the ops since
        (``apply`` skips those it holds): reading and parsing the snapshot it
        wrote was half of a build's CPU (0.33 s of 0.67 s at 24,576 ranges and
        segments, measured), all of it in the thread that shares the GIL with
        the event loop.  It costs a second copy of the metadata in memory
        (12 MB there).  A build that fails midway drops it; the next reads
        the disk.
        """
        state, self._snapshot_base = self._snapshot_base, None
        if state is None:
            base = self._journal.read_snapshot()
            state = MetadataState.from_json(base) if base else MetadataState()
        for op in ops:
            state.apply(op)
        hook = self.snapshot_hook
        if hook is not None:
            hook("built")
        size = self._journal.write_snapshot_file(state.to_json())
        if hook is not None:
            hook("written")
        self._snapshot_base = state
        return size

    # -- segments (called by range logs) -----------------------------------------------------------

    async def _roll(self, range_log: RangeLog, open_new: bool) -> str | None:
        """Seal the range's active segment (at the smallest end among its surviving replicas);
        open a new one on a fresh replica set when asked."""
        if self.leadership is not None:  # a member leads it: the coordinator rolls
            return await self.leadership.roll(range_log, open_new)
        meta = range_log.meta
        if range_log.active is not None:
            segment_id = range_log.active
            segment = self.state.segments[segment_id]
            if segment.replicas == [self._me.broker_id]:
                info = await self._store.seal(segment_id, range_log.durable_end())
                end, survivors = info.end_offset, list(segment.replicas)
            else:
                end, survivors = await self._fence_and_seal(range_log, segment)

            def still_active() -> None:
                # the topic may have been deleted (or the segment sealed) while the store sealed
                segment = self.state.segments.get(segment_id)
                if segment is None or segment.state is not State.ACTIVE:
                    raise Sealed(f"segment {segment_id} is sealed or deleted already")

            op: dict[str, Any] = {
                "op": "seal_segment",
                "segment_id": segment_id,
                "end_offset": end,
                "sealed_ms": self._runtime.wall_ms(),
            }
            if survivors != segment.replicas:
                op["replicas"] = survivors
            await self._commit(op, still_active)
            range_log.sync_committed(end)
            range_log.closed_segment()
            range_log.led_by = None  # until the next segment: appends come here and roll it
        if not open_new:
            return None

        def still_open() -> None:
            if (
                meta.state is State.SEALED
                or range_log.closing
                or meta.range_id not in self.state.ranges
            ):
                raise Sealed(f"range {meta.range_id} is sealed; refresh the topic metadata")

        still_open()
        topic = self.state.topics[meta.topic]
        policy = self._policy(topic)
        failure: XinfraError | None = None
        for attempt in range(PLACEMENT_ATTEMPTS):
            replicas = self._place(policy, meta)
            leader = replicas[0]
            segment_id = f"r{meta.range_id}-{self.state.applied_seq + 1}"
            if attempt:
                segment_id += f"-{attempt}"
            start_offset = range_log.committed
            self._opening.add(segment_id)
            try:
                if leader == self._me.broker_id:
                    await self._store.create_segment(segment_id, start_offset)
                    replicator = await self._open_followers(
                        range_log, segment_id, start_offset, replicas[1:]
                    )
                else:  # its leader opens the replica streams (``leadership.py``)
                    await self._create_on(replicas, segment_id, start_offset)
                    replicator = None
            except XinfraError as error:
                self._opening.discard(segment_id)
                failure = error
                await self._delete_everywhere([segment_id], replicas)
                continue
            try:
                await self._commit(
                    {
                        "op": "open_segment",
                        "range_id": meta.range_id,
                        "segment_id": segment_id,
                        "start_offset": start_offset,
                        "replicas": replicas,
                        "created_ms": self._runtime.wall_ms(),
                    },
                    still_open,
                )
            except Sealed:  # sealed while the store created it: the segment is an orphan now
                if replicator is not None:
                    replicator.close_streams()
                await self._delete_everywhere([segment_id], replicas)
                raise
            finally:
                self._opening.discard(segment_id)
            range_log.replicator = replicator
            if leader != self._me.broker_id:
                try:
                    await self._push_lead(range_log, segment_id, leader)
                except XinfraError as error:  # open with no leader: seal it empty, place again
                    failure = error
                    log.warning("segment %s: leader %s failed: %s", segment_id, leader, error)
                    self.membership.suspect(leader)
                    range_log.active = segment_id
                    end, survivors = await self._fence_and_seal(
                        range_log, self.state.segments[segment_id]
                    )
                    await self._commit(
                        {
                            "op": "seal_segment",
                            "segment_id": segment_id,
                            "end_offset": end,
                            "sealed_ms": self._runtime.wall_ms(),
                            "replicas": survivors,
                        }
                    )
                    range_log.sync_committed(end)
                    range_log.closed_segment()
                    range_log.led_by = None
                    continue
                return segment_id
            range_log.led_by = None
            if replicator is not None and replicator.failed:  # failed while the op was written
                failed_id, failure = next(iter(replicator.failed.items()))
                range_log.replica_failed(failed_id, failure)
            return segment_id
        assert failure is not None
        raise Unavailable(
            f"range {meta.range_id}: no replica set of {len(replicas)} could be led "
            f"in {PLACEMENT_ATTEMPTS} attempts; last: {failure.message}"
        )

    async def _open_followers(
        self, range_log: RangeLog, segment_id: str, start_offset: int, followers: list[str]
    ) -> Replicator | None:
        """Open the replica streams of a segment this broker leads (created on the followers)."""
        if not followers:
            return None
        peers = self.peers
        assert peers is not None
        addresses: dict[str, str] = {}
        for broker_id in followers:
            address = self.membership.address_of(broker_id)
            if address is None:
                raise Unavailable(f"broker {broker_id} has no known address")
            addresses[broker_id] = address
        await self._create_on(followers, segment_id, start_offset)
        return await open_followers(
            self._runtime,
            peers,
            range_log,
            segment_id,
            start_offset,
            addresses,
            self.config.replica_timeout_s,
            self.membership.suspect,
        )

    async def _create_on(self, replicas: list[str], segment_id: str, start_offset: int) -> None:
        """Create a new segment on every broker of ``replicas`` (this one through its store);
        a broker that fails is suspected (left out of the next attempt) and raises."""
        peers = self.peers

        async def create(broker_id: str) -> None:
            if broker_id == self._me.broker_id:
                await self._store.create_segment(segment_id, start_offset)
                return
            address = self.membership.address_of(broker_id)
            if address is None or peers is None:
                raise Unavailable(f"broker {broker_id} has no known address")
            try:
                await peers.request(
                    address, "replica_create", segment_id=segment_id, start_offset=start_offset
                )
            except XinfraError:
                self.membership.suspect(broker_id)
                raise

        results = await asyncio.gather(*(create(b) for b in replicas), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                if isinstance(result, XinfraError):
                    raise result
                raise Unavailable(f"creating segment {segment_id} failed: {result!r}")

    async def _push_lead(self, range_log: RangeLog, segment_id: str, leader: str) -> None:
        """Hand a new segment to its leader (a member): it opens the replica streams and takes
        the range's appends; clients follow ``leader_address``."""
        address = self.membership.address_of(leader)
        peers = self.peers
        if address is None or peers is None:
            raise Unavailable(f"broker {leader} has no known address")
        range_log.lead_elsewhere(address)
        await peers.request(
            address, "lead_segment", **lead_payload(self, range_log.meta, segment_id)
        )

    def _place(self, policy: StoragePolicy, meta: RangeMeta) -> list[str]:
        """A new segment's replica set under ``policy``, its leader first: striped least loaded
        first.  The leader, when the policy admits it: the previous segment's leader while it
        is live (clients are connected to it), else the live replica of the previous segment
        leading the fewest segments (it holds the batches its duplicate table is rebuilt
        from); a range's first segment: the chosen broker leading the fewest."""
        brokers = self.membership.live() if self.peers is not None else [self._me]
        load = self._load() if len(brokers) > 1 else {}  # a scan of every segment
        live = {b.broker_id for b in brokers}
        previous = self.state.segments[meta.segments[-1]].replicas if meta.segments else []
        led = {b: int(row[2]) if len(row) > 2 else 0 for b, row in load.items()}
        prefer: list[str] = []
        if previous and previous[0] in live:  # leadership stays where readers and producers are
            prefer = [previous[0]]
        elif any(b in live for b in previous):
            prefer = [min((b for b in previous if b in live), key=lambda b: (led.get(b, 0), b))]
        replicas: list[str] | None = None
        if prefer:
            with contextlib.suppress(Unavailable):
                replicas = choose_replicas(policy, brokers, load, first=prefer[0])
        if replicas is None:
            replicas = choose_replicas(policy, brokers, load)
        replicas = leader_first(replicas, led, prefer)
        self._placed(replicas)  # now: placements decided meanwhile see it
        return replicas

    async def _fence_and_seal(
        self, range_log: RangeLog, segment: SegmentMeta
    ) -> tuple[int, list[str]]:
        """Fence every replica of ``segment`` (its leader too), seal the survivors at the
        smallest durable end among them; returns that end and the survivors.

        Every acknowledged record is on every replica (an ack waits for each one's fsync),
        so that end is at least the committed offset: nothing acknowledged is lost; the longer
        tails are cut.  A replica that does not answer (a dead leader or follower) is left
        out; one that answers below the committed offset never survives.
        """
        segment_id = segment.segment_id
        me = self._me.broker_id
        leader = segment.replicas[0]
        replicator = range_log.replicator
        failed = set(replicator.failed) if replicator is not None else set()
        failed |= self._reported_failed.pop(segment_id, set())
        if replicator is not None:
            replicator.close()
        peers = self.peers
        committed = range_log.committed
        others = [b for b in segment.replicas if b != me]
        if range_log.needs_fence:  # after a restart: give the members one timeout to register
            deadline_s = self._runtime.monotonic_s() + self.config.broker_timeout_s
            while not all(self.membership.is_live(b) for b in others):
                if self._runtime.monotonic_s() >= deadline_s:
                    break
                await self._runtime.sleep(0.05)

        async def fence(broker_id: str) -> tuple[int, int] | None:
            if broker_id in failed:
                return None
            if broker_id == me:
                if leader == me:
                    if self.metadata_recovered:
                        try:
                            self._store.segment(segment_id)
                        except NotFound:  # this disk was lost (metadata recovered from a copy)
                            return None
                    return range_log.durable_end(), committed
                try:
                    return await self.replicas.fence(segment_id), 0
                except NotFound:
                    return None
            address = self.membership.address_of(broker_id)
            if address is None or peers is None:
                return None
            try:
                result = await peers.request(address, "replica_fence", segment_id=segment_id)
            except XinfraError as error:
                log.warning("segment %s: cannot fence %s: %s", segment_id, broker_id, error)
                self.membership.suspect(broker_id)
                return None
            return int(result["end_offset"]), int(result.get("committed", 0))

        answers = await asyncio.gather(*(fence(b) for b in segment.replicas))
        committed = max([committed, *(a[1] for a in answers if a is not None)])
        ends: dict[str, int] = {}
        for broker_id, answer in zip(segment.replicas, answers, strict=True):
            if answer is None:
                continue
            if answer[0] < committed:  # a replica that lost acknowledged records
                log.error(
                    "segment %s: broker %s holds up to %d, below the committed %d; left out",
                    segment_id, broker_id, answer[0], committed,
                )  # fmt: skip
                continue
            ends[broker_id] = answer[0]
        self.replica_failures += len(segment.replicas) - len(ends)
        for broker_id in failed:
            self.membership.suspect(broker_id)
        if not ends:
            raise Unavailable(f"no replica of segment {segment_id} answered its fence; retrying")
        end = min(ends.values())

        async def seal(broker_id: str) -> bool:
            if broker_id == me:
                if leader == me:
                    info = await self._store.seal(segment_id, end)
                    assert info.end_offset == end
                else:
                    await self.replicas.seal(segment_id, end)
                return True
            address = self.membership.address_of(broker_id)
            assert address is not None and peers is not None
            try:
                await peers.request(address, "replica_seal", segment_id=segment_id, end_offset=end)
            except XinfraError as error:
                log.warning("segment %s: cannot seal on %s: %s", segment_id, broker_id, error)
                self.membership.suspect(broker_id)
                return False
            return True

        sealed = await asyncio.gather(*(seal(b) for b in ends))
        kept = [b for b, ok in zip(ends, sealed, strict=True) if ok]
        if len(kept) < len(segment.replicas):
            log.warning(
                "segment %s sealed at %d on %s (of %s): under-replicated",
                segment_id, end, kept, segment.replicas,
            )  # fmt: skip
        return end, kept

    def _load(self) -> dict[str, tuple[int, ...]]:
        """Per broker: active segment replicas, stored bytes (what striping balances), then
        active segments led (what spreads leaders).

        A scan of every segment, so it is cached for ``LOAD_REFRESH_S``; each placement
        made meanwhile adds its active replicas to the cache (``_placed``), so a burst of
        new segments (a topic of 4,096 ranges) still spreads, at O(brokers) per segment.
        """
        now_s = self._runtime.monotonic_s()
        if self._load_cache is None or now_s - self._load_cached_s >= LOAD_REFRESH_S:
            active: dict[str, int] = {}
            led: dict[str, int] = {}
            for segment in self.state.segments.values():
                if segment.state is State.ACTIVE:
                    for broker_id in segment.replicas:
                        active[broker_id] = active.get(broker_id, 0) + 1
                    led[segment.replicas[0]] = led.get(segment.replicas[0], 0) + 1
            stored = {m.broker_id: m.store_bytes for m in self.membership.members.values()}
            stored[self._me.broker_id] = sum(info.size_bytes for info in self._store.segments())
            self._load_cache = {
                broker_id: [
                    active.get(broker_id, 0),
                    stored.get(broker_id, 0),
                    led.get(broker_id, 0),
                ]
                for broker_id in {*active, *stored}
            }
            self._load_cached_s = now_s
        return {broker_id: tuple(row) for broker_id, row in self._load_cache.items()}

    def _placed(self, replicas: list[str]) -> None:
        if self._load_cache is not None:
            for broker_id in replicas:
                self._load_cache.setdefault(broker_id, [0, 0, 0])[0] += 1
            self._load_cache[replicas[0]][2] += 1

    async def _delete_everywhere(self, segment_ids: list[str], replicas: list[str]) -> None:
        """Delete segments here now and on the other replicas in the background (best effort:
        a replica that misses it keeps an orphan until the re-replication issue cleans up)."""
        for segment_id in segment_ids:
            with contextlib.suppress(NotFound):
                await self._store.delete_segment(segment_id)
        others = [b for b in replicas if b != self._me.broker_id]
        if not others or self.peers is None:
            return
        peers = self.peers

        async def delete_on(broker_id: str) -> None:
            address = self.membership.address_of(broker_id)
            if address is None:
                return
            for segment_id in segment_ids:
                try:
                    await peers.request(address, "replica_delete", segment_id=segment_id)
                except XinfraError as error:
                    log.info("deleting %s on %s failed: %s", segment_id, broker_id, error)
                    return

        for broker_id in others:
            task = asyncio.create_task(delete_on(broker_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def policy(self, name: str) -> StoragePolicy | None:
        """The policy named ``name``: one an administrator defined, else a configured one."""
        defined = self.state.policies.get(name)
        if defined is not None:
            return policy_from_json(defined)
        return self.config.policies.get(name)

    def list_policies(self) -> list[dict[str, Any]]:
        names = sorted({*self.config.policies, *self.state.policies})
        return [p.to_json() for name in names if (p := self.policy(name)) is not None]

    async def create_policy(self, data: Any) -> dict[str, Any]:
        """Define a storage policy (checked first: a bad one is refused with what is wrong)."""
        policy = policy_from_json(data)

        def new_name() -> None:
            if self.policy(policy.name) is not None:
                raise Conflict(f"storage policy {policy.name!r} already exists")

        new_name()
        await self._commit({"op": "create_policy", "policy": policy.to_json()}, new_name)
        return policy.to_json()

    def validate_policy(self, data: Any) -> dict[str, Any]:
        """Check a policy (given, or by name) and whether the live brokers can satisfy it now."""
        policy = self.policy(data) if isinstance(data, str) else policy_from_json(data)
        if policy is None:
            raise NotFound(f"no storage policy {data!r}")
        brokers = self.membership.live() if self.peers is not None else [self._me]
        try:
            replicas = choose_replicas(policy, brokers, self._load())
        except XinfraError as error:
            return {"policy": policy.to_json(), "satisfiable": False, "reason": error.message}
        return {"policy": policy.to_json(), "satisfiable": True, "replicas": replicas}

    def _policy(self, topic: TopicMeta) -> StoragePolicy:
        policy = self.policy(topic.policy) or DEFAULT_POLICY
        factor = topic.config.get("replication.factor")
        policy = with_replication_factor(
            policy, int(factor) if factor is not None else self.config.replication_factor
        )
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

    @property
    def store(self) -> SegmentStore:
        """This broker's segment store (its replicas, led or followed)."""
        return self._store

    @property
    def store_failure(self) -> StorageError | None:
        """The store's disk error while it refuses writes (produce streams are refused then)."""
        return self._store.failure

    def range_log(self, topic_name: str, range_id: int) -> RangeLog:
        if self.leadership is not None and range_id not in self.state.ranges:
            raise NotLeader(
                f"broker {self.config.broker_id} leads no segment of range {range_id} of "
                f"{topic_name!r}; stream to the leader topic metadata names (leader_address)"
            )
        self.topic(topic_name)
        meta = self.state.ranges.get(range_id)  # a dict lookup: a topic may have 4,096 ranges
        if meta is None or meta.topic != topic_name:
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
        if self.policy(policy) is None:
            raise InvalidRequest(
                f"unknown storage policy {policy!r}; define it first (xinfra northguard policies "
                "create) or use one of: " + ", ".join(p["name"] for p in self.list_policies())
            )
        if "replication.factor" in config:
            try:
                if not 1 <= int(config["replication.factor"]) <= REPLICATION_FACTOR_MAX:
                    raise ValueError
            except ValueError as error:
                raise InvalidRequest(
                    f"replication.factor must be an integer in 1..{REPLICATION_FACTOR_MAX}"
                ) from error
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
            holders = {sid: list(self.state.segments[sid].replicas) for sid in segments}
            for range_log in logs:
                # refuse new appends and segments at once; never the metadata itself, which
                # only ops change (an open_segment being written now must still apply)
                range_log.closing = True
            for range_log in logs:
                await range_log.stop()

            def still_there() -> None:
                if self.state.topics.get(name) is not topic:
                    raise TopicNotFound(f"topic {name!r} does not exist on this Northguard cluster")

            await self._commit({"op": "delete_topic", "name": name}, still_there)
            for rid in topic.ranges:
                del self.logs[rid]
        for segment_id in segments:
            await self._delete_everywhere([segment_id], holders[segment_id])

    async def seal_topic(self, name: str) -> dict[str, Any]:
        async with self._topic_lock:
            topic = self.topic(name)
            if topic.state is not State.SEALED:
                logs = [self.logs[meta.range_id] for meta in self.state.active_ranges(topic)]
                async with _closing(logs):
                    for range_log in logs:
                        await range_log.seal_active()
                    await self._commit({"op": "seal_topic", "name": name})
        return self.describe(name)

    async def split_range(self, name: str, range_id: int) -> dict[str, Any]:
        async with self._topic_lock:
            self._check_splittable(name, range_id)
            async with _closing([self.logs[range_id]]):
                await self.logs[range_id].seal_active()
                await self._commit(
                    {
                        "op": "split_range",
                        "range_id": range_id,
                        "created_ms": self._runtime.wall_ms(),
                    }
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
            async with _closing([self.logs[first], self.logs[second]]):
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
        end = self._committed(meta.range_id)
        leader = self._leader_of(meta)
        return {
            "range_id": meta.range_id,
            "bounds": meta.key_range.to_json(),
            "state": meta.state.value,
            "start_offset": meta.start_offset,
            "end_offset": end,
            "parents": meta.parents,
            "leader": leader,
            "leader_address": self.membership.address_of(leader) if self.config.cluster else None,
        }

    def _committed(self, range_id: int) -> int:
        """The range's committed offset: its log's, or what its leader last reported."""
        range_log = self.logs[range_id]
        end = range_log.committed
        if range_log.led_by:
            end = max(end, self._leader_ends.get(range_id, end))
        return end

    def _leader_of(self, meta: RangeMeta) -> str:
        """The broker clients stream to for the range: its active segment's leader; without
        one, this one.  A member serves a range only while it leads the active segment (its
        mirror of the range comes with ``lead_segment`` and goes with its process), and a
        sealed segment's first replica need not have led it (a replica dropped with a lost
        disk, a seal without a dead leader): naming it sent readers to a broker answering
        ``not_leader`` to every reopen.  This one holds the whole range and reads a segment it
        does not hold from a replica (``remote_read``)."""
        if meta.segments:
            last = self.state.segments[meta.segments[-1]]
            if last.state is State.ACTIVE and last.replicas:
                return last.replicas[0]
        return self._me.broker_id

    async def refresh_ends(self, name: str) -> None:
        """Ask the leaders of the topic's ranges led elsewhere for their committed offsets (one
        request per leader; one that does not answer keeps its last reported end)."""
        peers = self.peers
        if peers is None:
            return
        by_leader: dict[str, list[int]] = {}
        for meta in self.state.active_ranges(self.topic(name)):
            range_log = self.logs.get(meta.range_id)
            if range_log is None or not range_log.led_by or range_log.active is None:
                continue
            leader = self.state.segments[range_log.active].replicas[0]
            if self.membership.is_live(leader):  # a dead one is being failed over
                by_leader.setdefault(range_log.led_by, []).append(meta.range_id)

        async def ask(address: str, range_ids: list[int]) -> None:
            try:
                answer = await peers.request_with_timeout(
                    address, "range_ends", self.config.replica_timeout_s, range_ids=range_ids
                )
            except XinfraError as error:
                log.info("range ends from %s: %s", address, error)
                return
            for rid, end in answer["ends"].items():
                self._leader_ends[int(rid)] = int(end)

        await asyncio.gather(*(ask(a, ids) for a, ids in by_leader.items()))

    def segment_metadata(self, name: str, range_id: int) -> dict[str, Any]:
        range_log = self.range_log(name, range_id)
        meta = range_log.meta
        segments = []
        for sid in meta.segments:
            segment = self.state.segments[sid]
            end = segment.end_offset
            if end is None:
                end = self._committed(meta.range_id)
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

    def cluster_status(self) -> dict[str, Any]:
        """Brokers (attributes, liveness, load) and segments with their replica sets; a sealed
        segment with fewer replicas than its policy asks for is under-replicated.  The load is
        counted afresh (an operator's rare request; placement's own may be a second old)."""
        self._load_cache = None
        load = self._load()
        brokers = self.membership.describe()
        for row in brokers:
            active, stored, led = load.get(row["broker_id"], (0, 0, 0))
            row["active_segments"] = active
            row["store_bytes"] = stored
            row["leading_segments"] = led
        segments: list[dict[str, Any]] = []
        under: list[str] = []
        # Under-replicated and active segments first: what an operator looks for.
        ordered = sorted(self.state.segments.values(), key=lambda s: s.state is State.SEALED)
        for segment in ordered:
            meta = self.state.ranges[segment.range_id]
            topic = self.state.topics[meta.topic]
            wanted = self._policy(topic).replicas
            if len(segment.replicas) < wanted:
                under.append(segment.segment_id)
            if len(segments) >= STATUS_SEGMENTS_MAX:
                continue
            segments.append(
                {
                    "segment_id": segment.segment_id,
                    "topic": meta.topic,
                    "range_id": segment.range_id,
                    "state": segment.state.value,
                    "start_offset": segment.start_offset,
                    "end_offset": segment.end_offset,
                    "replicas": segment.replicas,
                    "replicas_wanted": wanted,
                }
            )
        return {
            "coordinator": self.config.broker_id,
            "brokers": brokers,
            "segments": segments,
            "segments_total": len(self.state.segments),
            "under_replicated": under[:STATUS_SEGMENTS_MAX],
            "under_replicated_total": len(under),
            "metadata": self.metadata_replicas.describe(self.state),
        }

    # -- maintenance: age limits and retention -----------------------------------------------------

    async def _maintain_forever(self) -> None:
        while True:
            await self._runtime.sleep(self.config.maintenance_s)
            try:
                await self.maintain()
            except Exception:
                log.exception("maintenance failed; retrying at the next tick")

    def _spawn(self, coroutine: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _fence_restarted(self) -> None:
        """Seal, at the smallest end among their replicas, the replicated active segments the
        previous process left: an append or a read past the fence could see records no
        follower has (their appends were never acknowledged).  Retried at each tick."""
        for range_id in sorted(self._unfenced):
            if range_id not in self.state.ranges:
                self._unfenced.discard(range_id)
                continue
            range_log = self.logs[range_id]
            try:
                if range_log.needs_fence:  # only the segment the restart found (a roll a
                    # leader asked for meanwhile may have sealed it and opened the next)
                    # After a lost disk the next segment opens now: the survivors of one
                    # this broker led never led the range, so none could take appends.
                    await range_log.roll_segment(range_log.active, open_new=self.metadata_recovered)
            except XinfraError as error:
                log.warning("range %s: fencing after the restart failed: %s", range_id, error)
                continue
            if not self.logs[range_id].needs_fence:
                self._unfenced.discard(range_id)

    def heal(self) -> None:
        """Start re-replicating under-replicated sealed segments (at most ``HEALING_MAX`` at
        once; each in a task of its own, so a slow copy never holds maintenance)."""
        if self.peers is None:
            return
        live = self.membership.live()
        load: dict[str, tuple[int, ...]] | None = None
        short = 0
        for segment in list(self.state.segments.values()):
            if segment.state is not State.SEALED:
                continue
            topic = self.state.topics[self.state.ranges[segment.range_id].topic]
            policy = self._policy(topic)
            if len(segment.replicas) >= policy.replicas:
                continue
            short += 1
            if segment.segment_id in self._healing or len(self._healing) >= HEALING_MAX:
                continue
            sources = sorted(  # this broker's own replica first: its checksum is local
                (b for b in segment.replicas if self.membership.is_live(b)),
                key=lambda b: b != self._me.broker_id,
            )
            if not sources:
                continue  # no live replica to copy from
            load = load or self._load()
            current = [BrokerInfo(b, self._attributes_of(b)) for b in segment.replicas]
            try:
                target = choose_additional_replica(policy, live, load, current)
            except XinfraError:
                continue  # no broker can take it now; the next tick looks again
            self._healing.add(segment.segment_id)
            self._spawn(self._heal_one(segment.segment_id, target, sources[0]))
        self.under_replicated = short

    async def _collect_orphans(self) -> None:
        """Delete the segments a live member holds that it is no replica of (a replica left out
        of a seal, a copy that failed, a segment of a deleted topic the member missed).

        A segment counts as an orphan only when two scans in a row found it so (and it is
        neither being opened nor re-replicated): one being opened or copied between the
        list and the check is never taken for one.
        """
        peers = self.peers
        assert peers is not None
        for member in list(self.membership.members.values()):
            broker_id = member.broker_id
            if not self.membership.is_live(broker_id):
                continue
            try:
                held: list[str] = []
                after = ""
                while True:
                    page = await peers.request(member.address, "replica_list", after=after)
                    held += page["segment_ids"]
                    if not page["more"] or not page["segment_ids"]:
                        break
                    after = page["segment_ids"][-1]
            except XinfraError as error:
                log.info("listing the segments of broker %s failed: %s", broker_id, error)
                continue
            orphans = set()
            for segment_id in held:
                if segment_id in self._opening or segment_id in self._healing:
                    continue
                segment = self.state.segments.get(segment_id)
                if segment is None or broker_id not in segment.replicas:
                    orphans.add(segment_id)
            confirmed = orphans & self._orphans_seen.get(broker_id, set())
            self._orphans_seen[broker_id] = orphans - confirmed
            for segment_id in sorted(confirmed):
                try:
                    await peers.request(member.address, "replica_delete", segment_id=segment_id)
                except XinfraError as error:
                    log.info("deleting orphan %s on %s failed: %s", segment_id, broker_id, error)
                    continue
                self.orphans_deleted += 1
                log.info("deleted orphan segment %s on broker %s", segment_id, broker_id)

    def _attributes_of(self, broker_id: str) -> dict[str, str]:
        if broker_id == self._me.broker_id:
            return dict(self._me.attributes)
        member = self.membership.members.get(broker_id)
        return {} if member is None else dict(member.attributes)

    async def _heal_one(self, segment_id: str, target: str, source: str) -> None:
        """Copy one sealed segment from ``source`` to ``target`` over the consume protocol,
        compare checksums, record."""
        peers = self.peers
        assert peers is not None
        try:
            segment = self.state.segments.get(segment_id)
            address = self.membership.address_of(target)
            if segment is None or address is None or segment.end_offset is None:
                return
            meta = self.state.ranges[segment.range_id]
            log.info("segment %s: copying to broker %s", segment_id, target)
            await peers.request_with_timeout(
                address,
                "replica_copy",
                COPY_TIMEOUT_S,
                segment_id=segment_id,
                topic=meta.topic,
                range_id=meta.range_id,
                start_offset=segment.start_offset,
                end_offset=segment.end_offset,
                source=self.membership.address_of(source),
            )
            theirs = await peers.request(address, "replica_checksum", segment_id=segment_id)
            if source == self._me.broker_id:
                ours = await self.replicas.checksum(segment_id)
            else:
                source_address = self.membership.address_of(source)
                assert source_address is not None
                ours = await peers.request(
                    source_address, "replica_checksum", segment_id=segment_id
                )
            if theirs["sha256"] != ours["sha256"] or theirs["end_offset"] != ours["end_offset"]:
                log.error("segment %s: the copy on %s differs; deleting it", segment_id, target)
                await peers.request(address, "replica_delete", segment_id=segment_id)
                return

            def still_wanted() -> None:
                current = self.state.segments.get(segment_id)
                if current is None or target in current.replicas:
                    raise NotFound(f"segment {segment_id} was deleted or already on {target}")

            await self._commit(
                {"op": "add_replica", "segment_id": segment_id, "broker_id": target},
                still_wanted,
            )
            self.healed += 1
            log.info("segment %s: re-replicated to broker %s", segment_id, target)
        except XinfraError as error:
            log.warning("segment %s: re-replication to %s failed: %s", segment_id, target, error)
            self.membership.suspect(target)
        finally:
            self._healing.discard(segment_id)

    async def maintain(self) -> None:
        """Seal segments past their age limit; delete sealed segments past their retention;
        start re-replicating under-replicated sealed segments."""
        if self._unfenced and (self._fencing is None or self._fencing.done()):
            self._fencing = self._spawn(self._fence_restarted())
        self.heal()
        self._check_leaders()
        copies = self.metadata_replicas
        if copies.active and copies.short(self.state):
            async with self._commit_lock:  # the state at its last decided op, nothing in flight
                self._apply_recorded(await copies.replicate([], self.state))
        now_s = self._runtime.monotonic_s()
        if (
            self.peers is not None
            and now_s - self._orphan_scanned_s >= self.config.orphan_scan_s
            and (self._orphan_scan is None or self._orphan_scan.done())
        ):
            self._orphan_scanned_s = now_s
            self._orphan_scan = self._spawn(self._collect_orphans())
        now_ms = self._runtime.wall_ms()
        if now_ms >= self._aging_due_ms:
            self._aging_due_ms = await self._seal_aged(now_ms)
        if now_ms >= self._retention_due_ms:
            self._retention_due_ms = _NEVER_MS  # a seal applied during the pass sets it to 0
            try:
                due = await self._apply_retention(now_ms)
            except BaseException:
                self._retention_due_ms = 0  # the next pass tries again
                raise
            self._retention_due_ms = min(self._retention_due_ms, due)

    async def _seal_aged(self, now_ms: int) -> float:
        """Seal the active segments past ``segment_age_s_max``; return when the next can be due.

        Every range is looked at only then (the earliest creation time among
        the active segments left, plus the age limit; a segment opened later
        is due later still), not every second: at 24,576 ranges a look at all
        of them took 20 ms of the event loop (measured).  A pass that sealed
        anything looks again at the next one, as a refused seal must be retried.
        """
        age_ms_max = self.config.segment_age_s_max * 1000
        due = now_ms + age_ms_max
        for created_ms, range_id, range_log in self._active_segments():
            if now_ms - created_ms < age_ms_max:
                due = min(due, created_ms + age_ms_max)
                continue
            if range_log is None:
                range_log = self.logs[range_id]  # builds the log a restart left unbuilt
            await range_log.seal_active()
            due = now_ms
        return due

    def _active_segments(self) -> Iterator[tuple[float, int, RangeLog | None]]:
        """(creation time, range id, its log) of each active segment: those of the built range
        logs, then those a restart left unbuilt (no log yet), listed once the first are done."""
        for range_log in list(self.logs.values()):
            if range_log.active is not None:
                yield range_log.active_created_ms, range_log.meta.range_id, range_log
        for meta in list(self.state.ranges.values()):
            if meta.range_id in self.logs or not meta.segments:
                continue
            last = self.state.segments[meta.segments[-1]]
            if last.state is State.ACTIVE:
                yield last.created_ms, meta.range_id, None

    async def _apply_retention(self, now_ms: int) -> int:
        """Delete the sealed segments past their topic's retention or ``sealed_segments_max``;
        return when the next sealed segment expires.

        Sealing is what makes a segment a candidate: an applied op that seals
        one asks for a pass at once (``_retention_due_ms``), and between seals
        the ranges are looked at only when the oldest sealed segment expires
        (17 ms of the event loop at 24,576 ranges, measured).  A pass that
        deleted anything, or could not, looks again at the next one.
        """
        due = _NEVER_MS
        for topic in list(self.state.topics.values()):
            retention_ms = self._policy(topic).retention_ms
            for rid in list(topic.ranges):
                meta = self.state.ranges.get(rid)
                if meta is None:
                    continue
                doomed: list[str] = []
                excess = len(meta.segments) - self.config.sealed_segments_max
                if excess > 0 and self.state.segments[meta.segments[-1]].state is State.ACTIVE:
                    excess -= 1  # the active segment does not count
                for sid in meta.segments:
                    segment = self.state.segments[sid]
                    if segment.state is not State.SEALED or segment.sealed_ms is None:
                        break
                    if now_ms - segment.sealed_ms < retention_ms and len(doomed) >= excess:
                        due = min(due, segment.sealed_ms + retention_ms)
                        break
                    doomed.append(sid)
                if doomed and self.state.topics.get(topic.name) is topic:
                    due = now_ms

                    def still_there(rid: int = rid, first: str = doomed[0]) -> None:
                        # a topic deleted while this op waited for the journal takes its segments
                        meta = self.state.ranges.get(rid)
                        if meta is None or not meta.segments or meta.segments[0] != first:
                            raise NotFound(f"range {rid} changed; retention retries later")

                    holders = {sid: list(self.state.segments[sid].replicas) for sid in doomed}
                    try:
                        await self._commit(
                            {"op": "delete_segments", "range_id": rid, "segment_ids": doomed},
                            still_there,
                        )
                    except NotFound:
                        continue
                    for sid in doomed:
                        await self._delete_everywhere([sid], holders[sid])
        return due


_SEALING_OPS = frozenset({"seal_segment", "seal_topic", "split_range", "merge_ranges"})
"""Ops that seal segments: what makes a segment a candidate for retention."""
_NEVER_MS = 1 << 62


class _RangeLogs(dict[int, RangeLog]):
    """Range logs built on first use: a restart builds none, so its time does not grow with the
    ranges (a range's log is built when a client or maintenance first needs it)."""

    def __init__(self, build: Callable[[int], RangeLog]) -> None:
        super().__init__()
        self._build = build

    def __missing__(self, range_id: int) -> RangeLog:
        return self._build(range_id)  # stores it; KeyError for a range that does not exist


class _Decision(asyncio.Future[None]):
    """Whether a queued op was written and applied: a future its waiter's cancellation cannot
    cancel.  ``Task.cancel`` then leaves the task waiting and delivers the cancellation when
    the op is decided (``_decided``)."""

    def cancel(self, msg: Any | None = None) -> bool:
        return False


@dataclass(eq=False)
class _PendingOp:
    op: dict[str, Any]
    precondition: Callable[[], None] | None
    done: _Decision


async def _decided(done: _Decision) -> None:
    """Wait until a queued op is written and applied (or refused), even if the caller is cancelled.

    A request cancelled by its client must not release the locks it holds
    (the topic lock) while its op is still queued: the next request would
    decide against a state that this op is about to change (two deletes of
    one topic).  The cancellation is delivered once the op is decided.  An
    awaited future, not ``asyncio.wait``: a roll waits for one op, and a
    first write to 4,096 new ranges makes 4,096 rolls at once.
    """
    try:
        await done
    except asyncio.CancelledError:
        if done.done():
            done.exception()  # retrieved: the cancellation wins over the op's own error
        raise


@contextlib.asynccontextmanager
async def _closing(logs: list[RangeLog]) -> AsyncIterator[None]:
    """Refuse new segments in ``logs`` while they are sealed by one op; lifted if the op fails."""
    for range_log in logs:
        range_log.closing = True
    try:
        yield
    finally:
        for range_log in logs:
            range_log.closing = False  # the op sealed them (meta.state) or they stay usable
