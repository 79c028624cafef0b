"""The group coordinator: server-side, incremental rebalancing in the manner of Kafka's KIP-848.

Members heartbeat.  A change of membership or subscription bumps the group
epoch and computes a new target assignment (``assignor.assign``: fair, then
sticky).  Each member then reconciles on its own heartbeats, with no
group-wide barrier:

1. it is told to give up what is no longer in its target (its assignment
   shrinks) and keeps its old member epoch until it has;
2. it acknowledges by heartbeating what it still owns (``owned``);
3. it then receives the units of its target that nobody else owns any more,
   and its member epoch moves to the group epoch.

A unit is granted only when no member's ``assigned`` holds it, so two members
never consume one shard at once.  A member that nothing moved from is never
told to revoke: it keeps consuming through every rebalance.

Fencing: each incarnation of a member has a *floor*, the group epoch it
joined at.  A heartbeat or commit whose member epoch is below the floor comes
from a replaced incarnation (``Fenced``); one from a member the group no
longer has (expired, left) is ``UnknownMember``.  Commits also require the
shard to be assigned to the member, so a revoked shard is committed by its
owner before the owner acknowledges giving it up (at least once).

State lives in the ``Directory`` (ZooKeeper) with versioned writes; heartbeat
times live in memory, and a new coordinator gives every member a fresh
session.  One asyncio lock per group serializes its changes on this instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from metadata_service.checkpoints.service import CheckpointService
from metadata_service.groups import assignor
from metadata_service.groups.directory import Directory, GroupKey
from metadata_service.groups.offsets import Offsets
from metadata_service.groups.schemas import HeartbeatIn, HeartbeatOut
from metadata_service.groups.state import GroupState, Member
from xinfra.errors import (
    Conflict,
    Fenced,
    GroupMoved,
    GroupNotFound,
    InvalidRequest,
    NotCoordinator,
    TopicNotFound,
    Unavailable,
    UnknownMember,
    XinfraError,
)

log = logging.getLogger(__name__)

Position4 = tuple[str, int, int, int]
"""(topic, epoch, shard, offset)."""


@dataclass
class LiveGroup:
    state: GroupState
    version: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    deadlines: dict[str, float] = field(default_factory=dict)
    """Member id -> loop time at which its session ends."""


class GroupCoordinator:
    def __init__(
        self,
        directory: Directory,
        checkpoints: CheckpointService,
        offsets: Offsets,
        instance_id: str,
        session_s: float,
        heartbeat_s: float,
    ) -> None:
        self.directory = directory
        self.checkpoints = checkpoints
        self.offsets = offsets
        self.instance_id = instance_id
        self.session_s = session_s
        self.heartbeat_s = heartbeat_s
        self._groups: dict[GroupKey, LiveGroup] = {}
        self._claim_locks: dict[GroupKey, asyncio.Lock] = {}
        self._expiry: asyncio.Task[None] | None = None
        directory.on_lost(self._drop_all)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.directory.start()
        self._expiry = asyncio.get_running_loop().create_task(
            self._expire_forever(), name="group-expiry"
        )

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        await self.directory.stop()
        self._groups.clear()

    def _drop_all(self) -> None:
        """The ZooKeeper session is gone, and with it every claim: forget every group."""
        if self._groups:
            log.warning("lost the ZooKeeper session: giving up %d groups", len(self._groups))
        self._groups.clear()

    def coordinates(self, vc: str, group: str) -> bool:
        return (vc, group) in self._groups

    # -- claiming --------------------------------------------------------------------------

    async def live(self, vc: str, group: str, create: bool = False) -> LiveGroup:
        """The group, coordinated here; ``NotCoordinator`` names the instance that does."""
        if not self.directory.connected():
            raise Unavailable("this instance is not connected to ZooKeeper; retry")
        key = (vc, group)
        live = self._groups.get(key)
        if live is not None:
            return live
        lock = self._claim_locks.setdefault(key, asyncio.Lock())
        async with lock:
            live = self._groups.get(key)
            if live is not None:
                return live
            claim = await self.directory.claim(key, create)
            if not claim.mine:
                if claim.url is None:
                    raise Unavailable(
                        f"group {group!r} is coordinated by instance {claim.instance}, "
                        "which advertises no URL; retry against it"
                    )
                raise NotCoordinator(
                    f"group {group!r} is coordinated by instance {claim.instance} at {claim.url}",
                    claim.url,
                )
            now = asyncio.get_running_loop().time()
            state = claim.state or GroupState(vc, group)
            live = LiveGroup(state, claim.version)
            live.deadlines = {m: now + self.session_s for m in state.members}
            # The previous coordinator may have died with a failed cache write-through.
            await self.checkpoints.invalidate(vc, group)
            self._groups[key] = live
            self._claim_locks.pop(key, None)  # claimed: later requests find the group first
            if claim.state is not None:
                log.info("coordinating group %s/%s from epoch %d", vc, group, state.epoch)
            return live

    async def _save(self, live: LiveGroup) -> None:
        key = (live.state.virtual_cluster, live.state.group)
        try:
            live.version = await self.directory.save(key, live.state, live.version)
        except GroupMoved:
            self._groups.pop(key, None)
            raise

    # -- the protocol ----------------------------------------------------------------------

    async def heartbeat(self, vc: str, group: str, request: HeartbeatIn) -> HeartbeatOut:
        live = await self.live(vc, group, create=request.member_epoch == 0)
        async with live.lock:
            if self._groups.get((vc, group)) is not live:
                raise GroupMoved(f"group {group!r} moved while this request waited; retry")
            try:
                return await self._heartbeat(live, request)
            except Exception as error:
                if not isinstance(error, XinfraError) or error.http_status >= 500:
                    # The state in memory may be half changed: reload it from the directory.
                    self._groups.pop((vc, group), None)
                raise

    async def _heartbeat(self, live: LiveGroup, request: HeartbeatIn) -> HeartbeatOut:
        state = live.state
        member_id = request.member_id
        member = state.members.get(member_id)
        changed = False
        if request.member_epoch == -1:
            if member is not None:
                del state.members[member_id]
                live.deadlines.pop(member_id, None)
                await self._retarget(state)
                await self._save(live)
            return self._out(state, member_id, -1, [], False)
        if request.member_epoch == 0:
            if not request.topics:
                raise InvalidRequest(
                    "a member joins with the topics it subscribes to (topics=[...])"
                )
            topics = sorted(set(request.topics))
            for topic in topics:
                await self.offsets.metadata(state.virtual_cluster, topic)  # TopicNotFound: 404
            # A rejoin replaces the older incarnation: what it owned is free, its epochs are fenced.
            member = Member(member_id, request.client_id or member_id, topics, 0, 0)
            state.members[member_id] = member
            await self._retarget(state)
            member.epoch = member.floor = state.epoch
            changed = True
        else:
            member = self._member(state, member_id, request.member_epoch)
            if request.topics is not None and sorted(set(request.topics)) != member.topics:
                topics = sorted(set(request.topics))
                for topic in topics:
                    await self.offsets.metadata(state.virtual_cluster, topic)
                member.topics = topics
                await self._retarget(state)
                changed = True
        live.deadlines[member_id] = asyncio.get_running_loop().time() + self.session_s
        target = set(member.target)
        if request.owned is not None:
            owned = {(t, int(s)) for t, s in request.owned}
            kept = [u for u in member.assigned if u in owned or u in target]
            if kept != member.assigned:
                member.assigned, changed = kept, True
        revoking = [u for u in member.assigned if u not in target]
        if not revoking:
            taken = {u for m in state.members.values() for u in m.assigned}
            gained = [u for u in member.target if u not in taken]
            if gained:
                member.assigned = sorted(member.assigned + gained)
                changed = True
            if member.epoch != state.epoch:
                member.epoch, changed = state.epoch, True
        if changed:
            await self._save(live)
        assignment = [u for u in member.assigned if u in target]
        pending = sorted(assignment) != member.target
        return self._out(state, member_id, member.epoch, assignment, pending)

    def _out(
        self,
        state: GroupState,
        member_id: str,
        epoch: int,
        assignment: list[assignor.Unit],
        pending: bool,
    ) -> HeartbeatOut:
        return HeartbeatOut(
            member_id=member_id,
            member_epoch=epoch,
            group_epoch=state.epoch,
            assignment=sorted(assignment),
            pending=pending,
            heartbeat_interval_ms=int(self.heartbeat_s * 1000),
            session_timeout_ms=int(self.session_s * 1000),
        )

    def _member(self, state: GroupState, member_id: str, epoch: int) -> Member:
        member = state.members.get(member_id)
        if member is None:
            raise UnknownMember(
                f"group {state.group!r} has no member {member_id!r} (it left, or its session "
                "expired and its shards moved); rejoin with member_epoch 0"
            )
        if epoch < member.floor:
            raise Fenced(
                f"member {member_id!r} of group {state.group!r} was replaced: epoch {epoch} is "
                f"older than its current incarnation ({member.floor}); this incarnation must stop"
            )
        if epoch > member.epoch:
            raise Fenced(
                f"member epoch {epoch} of {member_id!r} is ahead of the group's {member.epoch}; "
                "rejoin with member_epoch 0"
            )
        return member

    async def _retarget(self, state: GroupState) -> None:
        """Bump the group epoch and compute the target assignment of every member."""
        state.epoch += 1
        counts: dict[str, int] = {}
        for topic in sorted({t for m in state.members.values() for t in m.topics}):
            try:
                counts[topic] = await self.offsets.shard_count(state.virtual_cluster, topic)
            except TopicNotFound:
                continue  # deleted: its shards are nobody's
        targets = assignor.assign(
            {m.member_id: m.topics for m in state.members.values()},
            counts,
            {m.member_id: m.target for m in state.members.values()},
        )
        for member in state.members.values():
            member.target = targets[member.member_id]

    async def _expire_forever(self) -> None:
        """Remove members whose session ended; owned by ``start``/``stop``."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(self.session_s / 4, 1.0))
            now = loop.time()
            for live in list(self._groups.values()):
                expired = [m for m, deadline in live.deadlines.items() if deadline < now]
                if not expired:
                    continue
                try:
                    async with live.lock:
                        for member_id in expired:
                            if live.deadlines.get(member_id, now) < now:
                                live.deadlines.pop(member_id, None)
                                live.state.members.pop(member_id, None)
                                log.info("member %s of %s expired", member_id, live.state.group)
                        await self._retarget(live.state)
                        await self._save(live)
                except Exception as error:  # ZooKeeper down or the group moved: next pass
                    log.warning("expiring members of %s failed: %s", live.state.group, error)

    # -- commits ---------------------------------------------------------------------------

    async def commit(
        self,
        vc: str,
        group: str,
        member_id: str | None,
        member_epoch: int,
        positions: list[Position4],
    ) -> None:
        """Durable on return.  A member commits only shards assigned to it, at a current epoch."""
        live = await self.live(vc, group, create=member_id is None)
        self._check_commit(live, member_id, member_epoch, positions)
        await self.offsets.check_positions(vc, positions)
        await self.checkpoints.commit(
            {(vc, group, t, e, s): offset for t, e, s, offset in positions}
        )

    def commit_now(
        self,
        vc: str,
        group: str,
        member_id: str | None,
        member_epoch: int,
        positions: list[Position4],
    ) -> asyncio.Future[None] | None:
        """``commit`` without waiting, when every check passes on what this instance holds (the
        group coordinated here, its topics' metadata and ends known) and the buffer has room:
        the future of the flush that makes it durable.  None otherwise, without a side effect:
        ``commit`` then answers, its errors included."""
        live = self._groups.get((vc, group))
        if live is None or not self.directory.connected():
            return None
        try:
            self._check_commit(live, member_id, member_epoch, positions)
        except XinfraError:
            return None
        if not self.offsets.known_valid(vc, positions):
            return None
        return self.checkpoints.offer(
            {(vc, group, t, e, s): offset for t, e, s, offset in positions}
        )

    def _check_commit(
        self,
        live: LiveGroup,
        member_id: str | None,
        member_epoch: int,
        positions: list[Position4],
    ) -> None:
        state = live.state
        if member_id is None:
            if state.members:
                raise Conflict(
                    f"group {state.group!r} has {len(state.members)} members: commit as a member "
                    "(member_id, member_epoch), or stop them first"
                )
            return
        member = self._member(state, member_id, member_epoch)
        assigned = set(member.assigned)
        for topic, _epoch, shard, _offset in positions:
            if (topic, shard) not in assigned:
                raise Fenced(
                    f"shard {shard} of {topic!r} is not assigned to member {member_id!r} "
                    f"of group {state.group!r} (it moved); its position was not committed"
                )

    # -- administration --------------------------------------------------------------------

    async def delete(self, vc: str, group: str, force: bool) -> None:
        live = await self.live(vc, group, create=True)
        async with live.lock:
            if live.version < 0 and group not in await self.checkpoints.list_groups(vc):
                # nothing to delete: give up the claim this request made (forget_unknown)
                self._groups.pop((vc, group), None)
                await self.directory.delete((vc, group), -1)
                raise GroupNotFound(f"consumer group {group!r} does not exist in {vc!r}")
            if live.state.members and not force:
                raise Conflict(
                    f"group {group!r} has {len(live.state.members)} live members; "
                    "stop them or pass force"
                )
            await self.directory.delete((vc, group), live.version)
            self._groups.pop((vc, group), None)
            await self.checkpoints.delete_group(vc, group)

    async def forget_unknown(self, vc: str, group: str, live: LiveGroup) -> None:
        """Give up a group claimed only to be looked at, that turned out not to exist.

        A describe of an unknown name must not leave a claim, a znode and a
        ``LiveGroup`` behind: probing names would grow all three, and the name
        would then be listed as a group.
        """
        async with live.lock:
            if live.version >= 0 or live.state.members:
                return  # it came to life meanwhile (a member joined)
            if self._groups.get((vc, group)) is live:
                del self._groups[(vc, group)]
                await self.directory.delete((vc, group), -1)

    async def require_idle(self, vc: str, group: str, force: bool) -> None:
        """Refuse a reset while the group has members (unless ``force``)."""
        live = await self.live(vc, group, create=True)
        if live.state.members and not force:
            raise Conflict(
                f"group {group!r} has {len(live.state.members)} live members; "
                "stop them or pass force"
            )
