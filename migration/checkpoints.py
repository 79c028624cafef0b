"""Group checkpoints move with a migration: to the target at the cut-over, back on a rollback.

Why: a group whose checkpoint stays on the source keeps depending on the
source cluster after the migration completed (the cluster a migration exists
to retire), and after a rollback a checkpoint on the dropped target epoch
names an epoch that no longer exists, so the group would start over.

What moves, and when (``migration.service`` calls this):

* **Forward** (the cut-over and the completion, once every client has
  acknowledged the sealed source, so the target's mirrored prefix is final):
  each *idle* group whose latest checkpoint of a shard is on the source gets
  a checkpoint on the target at the exactly translated offset
  (``MirrorMap.to_target``).  The source row is left in place: a reader
  resumes from the latest epoch's row, so writing the target row is the one
  step, and a crash before or after it leaves a correct checkpoint.  A group
  with live members is left alone: its members cross into the target as they
  read (skipping the mirrored prefix) and commit target positions themselves;
  moving its rows under them would race their commits.  A checkpoint with no
  exact target offset stays on the source, where the read-through is exact.
* **Backward** (a rollback, once every client acknowledged the dropped target
  epoch, so the target no longer grows): every group's checkpoints on the
  target return to the source at the translated offset
  (``MirrorMap.to_source``), durably, and only then are the target rows
  deleted.  A crash between the two leaves both; the retried rollback
  translates again, from the same frozen target, to the same offsets.

Each group is changed under its coordinator's lock, so no member joins (and
reads the checkpoint) halfway.  A group coordinated by another instance is
reported, not changed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from metadata_service.groups import Groups
from metadata_service.runtime import Runtime
from migration.translate import MIRRORED_RECORDS_MAX, MirrorMap
from xinfra.errors import NotCoordinator, Timeout, Unavailable
from xinfra.model import PhysicalCluster, mirrored_position

SCAN_POLL_RECORDS = 5000
"""Records one poll of the target may return while its mirrored prefix is scanned."""
SCAN_IDLE_S_MAX = 30.0
"""A scan that gets no record for this long, short of the shard's end, fails (Timeout)."""


@dataclass
class Moved:
    """What a step did to the topic's group checkpoints (recorded in the migration's history)."""

    groups: dict[str, int] = field(default_factory=dict)
    """Group -> shards whose checkpoint moved."""
    left: dict[str, str] = field(default_factory=dict)
    """Group -> why some or all of its checkpoints stayed where they were."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def scan_mirror(
    rt: Runtime,
    cluster: PhysicalCluster,
    physical: str,
    shard: int,
    source_epoch: int,
    end: int | None,
) -> MirrorMap | None:
    """The mirrored prefix of ``shard`` of the target, read once; None past the size bound.

    The prefix is what a crossing reader skips: records mirroring ``source_epoch``
    at an offset below ``end`` (every mirrored record when ``end`` is None).
    """
    backend = rt.backends.get(cluster)
    reader = backend.reader(physical)
    try:
        starts = await rt.backends.call(cluster, lambda _b: reader.start_offsets([shard]))
        ends = await rt.backends.call(cluster, lambda _b: reader.end_offsets([shard]))
        first, last = starts.get(shard, 0), ends.get(shard, 0)
        pairs: list[tuple[int, int]] = []
        after = last
        if first < last:
            reader.assign({shard: first})
            loop = asyncio.get_running_loop()
            idle_until = loop.time() + SCAN_IDLE_S_MAX
            position = first
            while position < last and after == last:
                records = await rt.backends.call(
                    cluster, lambda _b: reader.poll(SCAN_POLL_RECORDS, timeout_s=1.0)
                )
                if not records:
                    if loop.time() > idle_until:
                        raise Timeout(
                            f"scanning shard {shard} of {physical!r} on {cluster.name!r} got no "
                            f"record at offset {position} (of {last}) in {SCAN_IDLE_S_MAX:.0f} s"
                        )
                    continue
                idle_until = loop.time() + SCAN_IDLE_S_MAX
                for record in records:
                    if record.shard != shard or record.offset < position:
                        continue
                    position = record.offset + 1
                    mirrored = mirrored_position(record.headers)
                    if (
                        mirrored is None
                        or mirrored.epoch != source_epoch
                        or mirrored.shard != shard
                        or (end is not None and mirrored.offset >= end)
                    ):
                        after = record.offset  # past the prefix: readers deliver from here
                        break
                    pairs.append((record.offset, mirrored.offset))
                    if len(pairs) > MIRRORED_RECORDS_MAX:
                        return None
        return MirrorMap.build(first, after, end, pairs)
    finally:
        await reader.close()


MapsFor = Callable[[int], Awaitable[MirrorMap | None]]
"""Shard -> its mirror map (built on first use, then kept for the step)."""


def cached(build: MapsFor) -> MapsFor:
    """Scan each shard at most once per step, and only if some group needs it."""
    built: dict[int, MirrorMap | None] = {}

    async def get(shard: int) -> MirrorMap | None:
        if shard not in built:
            built[shard] = await build(shard)
        return built[shard]

    return get


async def move_checkpoints(
    groups: Groups,
    vc: str,
    topic: str,
    from_epoch: int,
    to_epoch: int,
    maps: MapsFor,
    forward: bool,
) -> Moved:
    """Move every group's latest checkpoints of ``topic`` on ``from_epoch`` to ``to_epoch``.

    ``forward``: idle groups only, source rows kept (see the module docstring).
    Backward: every group, and the ``from_epoch`` rows are deleted after.
    """
    moved = Moved()
    for name in await groups.checkpoints.list_groups(vc):
        if not _on(await groups.checkpoints.read_group(vc, name), topic, from_epoch):
            continue
        try:
            live = await groups.coordinator.live(vc, name, create=True)
        except (NotCoordinator, Unavailable) as error:
            moved.left[name] = f"not moved: {error}"
            continue
        async with live.lock:
            if forward and live.state.members:
                moved.left[name] = (
                    f"{len(live.state.members)} live members: they cross into the target "
                    "as they read and commit there"
                )
                continue
            latest = _on(await groups.checkpoints.read_group(vc, name), topic, from_epoch)
            translated: dict[tuple[str, str, str, int, int], int] = {}
            stuck: list[int] = []
            for shard, offset in sorted(latest.items()):
                mirror = await maps(shard)
                new = None
                if mirror is not None:
                    new = mirror.to_target(offset) if forward else mirror.to_source(offset)
                if new is None:
                    stuck.append(shard)
                else:
                    translated[(vc, name, topic, to_epoch, shard)] = new
            if translated:
                await groups.checkpoints.commit(translated)  # durable on return
                moved.groups[name] = len(translated)
            if not forward:
                await groups.checkpoints.drop_epoch(vc, name, topic, from_epoch)
            if stuck:
                moved.left[name] = f"shards {stuck}: no exact position on epoch {to_epoch}" + (
                    ", read through from the source" if forward else ", rows dropped"
                )
    return moved


def _on(values: dict[tuple[str, int, int], int], topic: str, epoch: int) -> dict[int, int]:
    """Shard -> offset of the shards of ``topic`` whose latest checkpoint is on ``epoch``."""
    latest: dict[int, tuple[int, int]] = {}
    for (t, e, shard), offset in values.items():
        if t == topic and (shard not in latest or e > latest[shard][0]):
            latest[shard] = (e, offset)
    return {shard: offset for shard, (e, offset) in latest.items() if e == epoch}


async def groups_on_source(
    groups: Groups, vc: str, topic: str, source: int, source_ends: dict[int, int] | None
) -> list[dict[str, Any]]:
    """Groups with live members that still have records to read on ``source``.

    Why a status lists them: a group with live members is not moved by the
    service (its members cross as they read), so after the cut-over one that
    still commits source positions short of the source's end is a reader that
    lags or is stuck on the old cluster, which an operator must see before
    retiring that cluster.  A shard whose latest checkpoint is the source's end
    (``source_ends``, the sealed epoch's end offsets) is not counted: the group
    read all of it and its next record is in the target, so the old cluster can
    go (a member that crossed and has read nothing in the target yet commits
    just that).  Without the end offsets (the seal's settle is still owed)
    every shard checkpointed on the source counts.  Each: ``group``,
    ``members`` (None when another instance coordinates it), ``shards`` on the
    source.
    """
    found: list[dict[str, Any]] = []
    for name in await groups.checkpoints.list_groups(vc):
        positions = _on(await groups.checkpoints.read_group(vc, name), topic, source)
        shards = [
            shard
            for shard, offset in positions.items()
            if source_ends is None or shard not in source_ends or offset < source_ends[shard]
        ]
        if not shards:
            continue
        try:
            members: int | None = len((await groups.coordinator.live(vc, name)).state.members)
        except (NotCoordinator, Unavailable):
            members = None
        if members != 0:
            found.append({"group": name, "members": members, "shards": sorted(shards)})
    return found
