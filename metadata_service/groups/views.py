"""What operators and members read of a group: listings, descriptions with lag, checkpoints, resets.

Lag per shard is like ``kafka-consumer-groups --describe``: the records after
the committed position up to the end of the shard, counted through the
epochs after the committed one (a mirrored prefix is counted, so a lag right
after a migration may overstate by what the target mirrors).
"""

from __future__ import annotations

from metadata_service.checkpoints.service import CheckpointService
from metadata_service.groups.coordinator import GroupCoordinator
from metadata_service.groups.directory import Directory
from metadata_service.groups.offsets import Offsets
from metadata_service.groups.schemas import (
    Checkpoints,
    CommitPosition,
    GroupDescription,
    GroupSummary,
    MemberOut,
    ResetIn,
    ShardLag,
)
from metadata_service.groups.state import GroupState
from xinfra.errors import GroupNotFound, InvalidRequest, TopicNotFound


def summary(state: GroupState) -> GroupSummary:
    if not state.members:
        status = "empty"
    elif all(sorted(m.assigned) == m.target for m in state.members.values()):
        status = "stable"
    else:
        status = "reconciling"
    return GroupSummary(
        name=state.group,
        state=status,  # type: ignore[arg-type]
        group_epoch=state.epoch,
        members=len(state.members),
    )


def latest(committed: dict[tuple[str, int, int], int]) -> dict[tuple[str, int], CommitPosition]:
    """The committed position of each (topic, shard): the one in its latest epoch."""
    out: dict[tuple[str, int], CommitPosition] = {}
    for (topic, epoch, shard), offset in sorted(committed.items()):
        out[(topic, shard)] = CommitPosition(topic=topic, epoch=epoch, shard=shard, offset=offset)
    return out


class GroupViews:
    def __init__(
        self,
        coordinator: GroupCoordinator,
        directory: Directory,
        checkpoints: CheckpointService,
        offsets: Offsets,
    ) -> None:
        self.coordinator = coordinator
        self.directory = directory
        self.checkpoints = checkpoints
        self.offsets = offsets

    async def list_groups(self, vc: str) -> list[GroupSummary]:
        names = set(await self.directory.list_groups(vc)) | set(
            await self.checkpoints.list_groups(vc)
        )
        out = []
        for name in sorted(names):
            state = await self.directory.read((vc, name))
            out.append(summary(state or GroupState(vc, name)))
        return out

    async def committed(self, vc: str, group: str) -> Checkpoints:
        """Read where commits are written (the coordinator), so a per-instance cache is current."""
        live = await self.coordinator.live(vc, group, create=True)
        values = await self.checkpoints.read_group(vc, group)
        if not values and live.version < 0:
            await self.coordinator.forget_unknown(vc, group, live)
            raise GroupNotFound(f"consumer group {group!r} does not exist in {vc!r}")
        return Checkpoints(
            virtual_cluster=vc,
            group=group,
            positions=[
                CommitPosition(topic=t, epoch=e, shard=s, offset=p)
                for (t, e, s), p in sorted(values.items())
            ],
        )

    async def describe(self, vc: str, group: str) -> GroupDescription:
        live = await self.coordinator.live(vc, group, create=True)
        state = live.state
        values = await self.checkpoints.read_group(vc, group)
        if not values and live.version < 0:
            await self.coordinator.forget_unknown(vc, group, live)
            raise GroupNotFound(f"consumer group {group!r} does not exist in {vc!r}")
        committed = latest(values)
        owners = {u: m.member_id for m in state.members.values() for u in m.assigned}
        topics = sorted(
            {t for m in state.members.values() for t in m.topics} | {t for t, _ in committed}
        )
        shards: list[ShardLag] = []
        for topic in topics:
            try:
                metadata = await self.offsets.metadata(vc, topic)
            except TopicNotFound:
                continue
            current = metadata.current_epoch
            ends = {e.number: await self.offsets.end_offsets(vc, topic, e) for e in metadata.epochs}
            for shard in range(max(len(e.shards) for e in metadata.epochs)):
                position = committed.get((topic, shard))
                lag = None
                if position is not None:
                    lag = max(0, ends.get(position.epoch, {}).get(shard, 0) - position.offset)
                    lag += sum(
                        ends[e.number].get(shard, 0)
                        for e in metadata.epochs
                        if e.number > position.epoch
                    )
                shards.append(
                    ShardLag(
                        topic=topic,
                        shard=shard,
                        member_id=owners.get((topic, shard)),
                        committed=position,
                        end_epoch=current.number,
                        end_offset=ends[current.number].get(shard, 0),
                        lag=lag,
                    )
                )
        base = summary(state)
        return GroupDescription(
            **base.model_dump(),
            virtual_cluster=vc,
            coordinator=self.coordinator.instance_id,
            member_list=[
                MemberOut(
                    member_id=m.member_id,
                    client_id=m.client_id,
                    member_epoch=m.epoch,
                    topics=m.topics,
                    assignment=sorted(m.assigned),
                    target=m.target,
                )
                for m in sorted(state.members.values(), key=lambda m: m.member_id)
            ],
            shards=shards,
        )

    async def reset(self, vc: str, group: str, request: ResetIn) -> Checkpoints:
        """Set one topic's positions for every shard; refused while members run unless forced."""
        await self.coordinator.require_idle(vc, group, request.force)
        metadata = await self.offsets.metadata(vc, request.topic)
        first, last = metadata.epochs[0], metadata.current_epoch
        values: dict[tuple[int, int], int] = {}
        if request.to == "earliest":
            starts = await self.offsets.start_offsets(vc, request.topic, first)
            values = {(first.number, s): o for s, o in starts.items()}
        elif request.to == "latest":
            ends = await self.offsets.end_offsets(vc, request.topic, last)
            values = {(last.number, s): o for s, o in ends.items()}
        elif request.to == "timestamp":
            if request.timestamp_ms is None:
                raise InvalidRequest("to=timestamp needs timestamp_ms")
            for shard in range(len(last.shards)):
                for epoch in metadata.epochs:
                    offset = await self.offsets.offset_for_timestamp(
                        vc, request.topic, epoch, shard, request.timestamp_ms
                    )
                    end = (await self.offsets.end_offsets(vc, request.topic, epoch)).get(shard, 0)
                    if offset < end or epoch is last:
                        values[(epoch.number, shard)] = min(offset, end)
                        break
        else:
            if not request.positions:
                raise InvalidRequest("to=position needs positions")
            if any(p.topic != request.topic for p in request.positions):
                raise InvalidRequest("every position must be of the topic being reset")
            await self.offsets.check_positions(
                vc, [(p.topic, p.epoch, p.shard, p.offset) for p in request.positions]
            )
            values = {(p.epoch, p.shard): p.offset for p in request.positions}
        await self.checkpoints.replace_group(vc, group, request.topic, values)
        return await self.committed(vc, group)
