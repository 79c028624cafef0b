"""Driver-side planning: which (topic, epoch, shard, offset range) slices a read covers.

Offsets, for batch ends and streaming checkpoints alike, are one map from
(topic, epoch, shard) to the next offset, written as JSON
``{"topic": {"epoch": {"shard": offset}}}``.  A key absent from a start map
starts at the shard's first retained record; a key absent from an end map is
not read.

Which epochs are readable follows the SDK consumer (``clients/consumer.py``):
a topic's epochs are read oldest first, up to and including the first one that
is not sealed with known end offsets.  A later epoch (a migration's target
while the source still takes dual writes) is read once the one before it is
sealed.  Sealed epochs are read to their recorded end offsets, never past
(records that land on a Kafka epoch after its virtual seal are not part of
the topic).  A migration target's records mirroring a source offset below
the source's end were delivered from the source and are skipped by the
executor (``Slice.mirror``): each record once.

Streaming admission (``admit``) also keeps per-key order across
micro-batches: shard j of epoch N+1 is admitted only once every shard of
epoch N whose key range overlaps j's is admitted to its end.  With a read
limit, the budget is shared among the open shards in proportion to their
backlog.

All metadata comes from the service here, on the driver; a slice carries
everything its executor needs (cluster, physical topic, range, mirror bound),
so no task calls the service.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from clients.metadata import fetch_metadata
from clients.pool import BackendPool
from clients.service import ServiceSource
from clients.spark.options import EARLIEST_OFFSET, LATEST_OFFSET, At, SourceOptions
from xinfra.backend import ShardReader
from xinfra.errors import InvalidRequest, OffsetOutOfRange, TopicNotFound
from xinfra.model import Epoch, EpochState, TopicMetadata

log = logging.getLogger(__name__)

Key = tuple[str, int, int]
"""(topic, epoch, shard)."""
Offsets = dict[Key, int]
METADATA_TIMEOUT_S = 30.0
"""How long planning waits for an unreachable metadata service before failing the query."""
NO_END = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Slice:
    """What one Spark task reads: offsets [start, end) of one shard of one epoch.

    Picklable and self-contained: the executor opens the backend from
    ``cluster`` (a ``PhysicalCluster`` as JSON) and never asks the service.
    ``mirror`` is (source epoch, source end offset) for a migration target:
    records mirroring a source offset below it are skipped.
    """

    topic: str
    epoch: int
    shard: int
    start: int
    end: int
    cluster: str
    physical_topic: str
    mirror: tuple[int, int] | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Bounds:
    """Integer values a pushed-down filter admits: [lo, hi) and, if given, one of ``values``."""

    lo: int = 0
    hi: int = NO_END
    values: frozenset[int] | None = None

    def admits(self, value: int) -> bool:
        return self.lo <= value < self.hi and (self.values is None or value in self.values)

    def span(self) -> tuple[int, int]:
        """The smallest [lo, hi) holding every admitted value."""
        if self.values is None:
            return self.lo, self.hi
        inside = [v for v in self.values if self.admits(v)]
        return (min(inside), max(inside) + 1) if inside else (0, 0)


@dataclass(frozen=True, slots=True)
class Narrowing:
    """The part of the topics the pushed-down filters leave (everything when none)."""

    topics: frozenset[str] | None = None
    epochs: Bounds = field(default_factory=Bounds)
    shards: Bounds = field(default_factory=Bounds)
    offsets: Bounds = field(default_factory=Bounds)
    timestamp_ms_min: int | None = None


def offsets_to_json(offsets: Mapping[Key, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (topic, epoch, shard), offset in sorted(offsets.items()):
        out.setdefault(topic, {}).setdefault(str(epoch), {})[str(shard)] = offset
    return out


def offsets_from_json(body: Mapping[str, Any]) -> Offsets:
    return {
        (topic, int(epoch), int(shard)): int(offset)
        for topic, epochs in body.items()
        for epoch, shards in epochs.items()
        for shard, offset in shards.items()
    }


def readable_epochs(metadata: TopicMetadata) -> list[Epoch]:
    """Oldest first, up to and including the first epoch not sealed with known end offsets."""
    out: list[Epoch] = []
    for epoch in metadata.epochs:
        out.append(epoch)
        if not _sealed(epoch):
            break
    return out


def _sealed(epoch: Epoch) -> bool:
    return epoch.state == EpochState.SEALED and epoch.end_offsets is not None


def mirror_bound(metadata: TopicMetadata, epoch: Epoch, shard: int) -> tuple[int, int] | None:
    """(source epoch, end offset of the source shard) when ``epoch`` mirrors another."""
    if epoch.mirror_of is None:
        return None
    for source in metadata.epochs:
        if source.number == epoch.mirror_of:
            ends = source.end_offsets if _sealed(source) else None
            return (source.number, ends.get(shard, 0) if ends is not None else NO_END)
    return None


def split(slices: list[Slice], min_partitions: int | None) -> list[Slice]:
    """Cut slices into about ``min_partitions`` pieces, each in proportion to its size."""
    if not min_partitions or len(slices) >= min_partitions:
        return slices
    total = sum(s.size for s in slices)
    out: list[Slice] = []
    for piece in slices:
        parts = min(piece.size, max(1, math.ceil(piece.size * min_partitions / total)))
        bounds = [piece.start + piece.size * i // parts for i in range(parts + 1)]
        out.extend(replace(piece, start=a, end=b) for a, b in itertools.pairwise(bounds))
    return out


def admit(
    views: Mapping[str, TopicMetadata],
    start: Offsets,
    available: Offsets,
    first: Offsets,
    limit: int | None,
) -> Offsets:
    """The end offsets of the next micro-batch: at most ``limit`` offsets past ``start``.

    ``available`` is how far each readable shard can be read now, ``first`` the
    first retained offset of shards ``start`` does not name yet.  Shards of an
    epoch open only once the overlapping shards of the epoch before are
    admitted to their end, so a key's records never overtake each other across
    batches.
    """
    position = dict(start)
    budget = limit
    while budget is None or budget > 0:
        frontier: dict[Key, int] = {}
        for key, end in sorted(available.items()):
            at = position.get(key, first.get(key))
            if at is not None and end > at and _open(views[key[0]], key, position, first):
                frontier[key] = end - at
        if not frontier:
            break
        total = sum(frontier.values())
        if budget is None or total <= budget:
            for key in frontier:
                position[key] = available[key]
            if budget is not None:
                budget -= total
            continue
        shares = {key: budget * backlog // total for key, backlog in frontier.items()}
        spare = budget - sum(shares.values())
        for key, backlog in frontier.items():  # the rounding remainder, one each, in key order
            if spare and shares[key] < backlog:
                shares[key] += 1
                spare -= 1
        for key, share in shares.items():
            if share:
                position[key] = available[key] - frontier[key] + share
        break
    return position


def _open(metadata: TopicMetadata, key: Key, position: Offsets, first: Offsets) -> bool:
    topic, number, shard = key
    index = next(i for i, e in enumerate(metadata.epochs) if e.number == number)
    if index == 0:
        return True
    before = metadata.epochs[index - 1]
    if not _sealed(before) or before.end_offsets is None:
        return False
    key_range = metadata.epochs[index].shards[shard].key_range
    for old in before.shards:
        if old.key_range.start < key_range.end and key_range.start < old.key_range.end:
            at = position.get((topic, before.number, old.index))
            if at is None:
                at = first.get((topic, before.number, old.index))
            if at is None or at < before.end_offsets.get(old.index, 0):
                return False
    return True


class Planner:
    """Metadata and offsets for planning, from the service and the backends (driver only).

    All its calls run on one event loop: one ``asyncio.run`` for a batch plan,
    or a stream's own loop thread across its triggers; close it after.  It never registers with the service as a client: a Spark job reads
    fixed ranges and never holds a position the service must wait for.
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.source = ServiceSource(
            "spark",
            url=options.metadata_url,
            token=options.token,
            virtual_cluster=options.virtual_cluster,
        )
        self.pool = BackendPool()
        self._readers: dict[tuple[str, int], ShardReader] = {}
        self._retained: dict[tuple[str, int], dict[int, int]] = {}

    def forget_offsets(self) -> None:
        """Ask the backends afresh from now on (a planner kept across a stream's triggers)."""
        self._retained.clear()

    async def close(self) -> None:
        for reader in self._readers.values():
            await reader.close()
        await self.pool.close()
        await self.source.close()

    async def views(self) -> dict[str, TopicMetadata]:
        """The metadata of every topic read: those named, or those the pattern matches."""
        names = list(self.options.topics)
        if self.options.topic_pattern is not None:
            pattern = self.options.topic_pattern
            names = sorted(n for n in await self.source.topic_names() if pattern.fullmatch(n))
        views: dict[str, TopicMetadata] = {}
        for name in names:
            try:
                views[name] = await fetch_metadata(self.source, name, METADATA_TIMEOUT_S)
            except TopicNotFound as error:
                raise TopicNotFound(
                    f"option 'topics': topic {name!r} does not exist in virtual cluster "
                    f"{self.source.virtual_cluster!r} ({error.message})"
                ) from None
        return views

    def _reader(self, metadata: TopicMetadata, epoch: Epoch) -> ShardReader:
        key = (metadata.topic.name, epoch.number)
        reader = self._readers.get(key)
        if reader is None:
            reader = self.pool.reader(metadata.clusters[epoch.cluster], epoch.physical_topic)
            self._readers[key] = reader
        return reader

    async def retained(self, metadata: TopicMetadata, epoch: Epoch) -> dict[int, int]:
        """First retained offset per shard (asked once per planner)."""
        key = (metadata.topic.name, epoch.number)
        if key not in self._retained:
            self._retained[key] = await self._reader(metadata, epoch).start_offsets()
        return self._retained[key]

    async def available(self, views: Mapping[str, TopicMetadata]) -> Offsets:
        """How far each shard of each readable epoch can be read now.

        A sealed epoch ends at its recorded end offsets; an open one at its
        backend's high watermark.
        """
        out: Offsets = {}
        for topic, metadata in views.items():
            for epoch in readable_epochs(metadata):
                if _sealed(epoch):
                    assert epoch.end_offsets is not None
                    ends = {s.index: epoch.end_offsets.get(s.index, 0) for s in epoch.shards}
                else:
                    ends = await self._reader(metadata, epoch).end_offsets()
                for shard, end in ends.items():
                    out[(topic, epoch.number, shard)] = end
        return out

    async def resolve(
        self, at: At, views: Mapping[str, TopicMetadata], available: Offsets, ending: bool
    ) -> Offsets:
        """The offsets ``at`` names for every readable shard (a start, or with ``ending`` an end)."""
        name = ("endingOffsets" if ending else "startingOffsets") + (
            "" if at.kind != "timestamp" else " (timestamp)"
        )
        named = self._named(at, views, name)
        out: Offsets = {}
        for topic, metadata in views.items():
            for epoch in readable_epochs(metadata):
                for shard in epoch.shards:
                    key = (topic, epoch.number, shard.index)
                    latest = available[key]
                    kind = at.kind
                    if kind == "positions":
                        given = named.get((topic, shard.index))
                        if given is None:
                            kind = "latest" if ending else "earliest"
                        elif epoch.number < given[0]:
                            kind = "latest"
                        elif epoch.number > given[0]:
                            if ending:
                                continue  # ends before this epoch: not read
                            kind = "earliest"
                        elif given[1] == LATEST_OFFSET:
                            kind = "latest"
                        elif given[1] == EARLIEST_OFFSET:
                            kind = "earliest"
                        else:
                            if ending and given[1] > latest:
                                raise InvalidRequest(
                                    f"option 'endingOffsets': offset {given[1]} of {topic!r} "
                                    f"epoch {epoch.number} shard {shard.index} is past its end "
                                    f"{latest}"
                                )
                            out[key] = given[1]
                            continue
                    if kind == "earliest":
                        out[key] = (await self.retained(metadata, epoch))[shard.index]
                    elif kind == "latest":
                        out[key] = latest
                    else:
                        reader = self._reader(metadata, epoch)
                        found = await reader.offset_for_timestamp(shard.index, at.timestamp_ms)
                        out[key] = min(found, latest)
        return out

    @staticmethod
    def _named(
        at: At, views: Mapping[str, TopicMetadata], name: str
    ) -> dict[tuple[str, int], tuple[int, int]]:
        """(topic, shard) -> (epoch, offset) of explicit positions, checked against the metadata."""
        named: dict[tuple[str, int], tuple[int, int]] = {}
        for topic, epochs in at.positions.items():
            metadata = views.get(topic)
            if metadata is None:
                raise InvalidRequest(
                    f"option {name!r} names topic {topic!r}, which this query does not read"
                )
            readable = {e.number: e for e in readable_epochs(metadata)}
            for number, shards in epochs.items():
                epoch = readable.get(number)
                if epoch is None:
                    raise InvalidRequest(
                        f"option {name!r} names epoch {number} of {topic!r}; readable epochs are "
                        f"{sorted(readable)}"
                    )
                for shard, offset in shards.items():
                    if not 0 <= shard < len(epoch.shards):
                        raise InvalidRequest(
                            f"option {name!r} names shard {shard} of {topic!r} epoch {number}, "
                            f"which has {len(epoch.shards)} shards"
                        )
                    named[(topic, shard)] = (number, offset)
        return named

    async def slices(
        self,
        views: Mapping[str, TopicMetadata],
        start: Offsets,
        end: Offsets,
        narrowing: Narrowing | None = None,
    ) -> list[Slice]:
        """The slices between ``start`` and ``end``, narrowed by pushed-down filters.

        A start below a shard's first retained record (removed by retention)
        fails with ``failOnDataLoss`` (the default), or is moved up to it with
        a warning counting the records lost.
        """
        narrowing = narrowing or Narrowing()
        out: list[Slice] = []
        for topic, metadata in views.items():
            if narrowing.topics is not None and topic not in narrowing.topics:
                continue
            for epoch in readable_epochs(metadata):
                if not narrowing.epochs.admits(epoch.number):
                    continue
                cluster = metadata.clusters[epoch.cluster].model_dump_json()
                for shard in epoch.shards:
                    key = (topic, epoch.number, shard.index)
                    if key not in end or not narrowing.shards.admits(shard.index):
                        continue
                    lowest, highest = narrowing.offsets.span()
                    stop = min(end[key], highest)
                    begin = start.get(key)
                    if begin is not None and begin >= stop:
                        continue  # nothing new: no backend asked
                    retained = (await self.retained(metadata, epoch))[shard.index]
                    begin = retained if begin is None else begin
                    if begin < stop and begin < retained:
                        begin = self._lost(key, begin, retained)
                    begin = max(begin, lowest)
                    if narrowing.timestamp_ms_min is not None and begin < stop:
                        found = await self._reader(metadata, epoch).offset_for_timestamp(
                            shard.index, narrowing.timestamp_ms_min
                        )
                        begin = max(begin, found)
                    if begin < stop:
                        mirror = mirror_bound(metadata, epoch, shard.index)
                        out.append(
                            Slice(
                                topic,
                                epoch.number,
                                shard.index,
                                begin,
                                stop,
                                cluster,
                                epoch.physical_topic,
                                mirror,
                            )
                        )
        return split(out, self.options.min_partitions)

    def _lost(self, key: Key, begin: int, retained: int) -> int:
        topic, epoch, shard = key
        message = (
            f"{retained - begin} records of {topic!r} epoch {epoch} shard {shard} "
            f"(offsets {begin} to {retained}) were removed by retention before they were read"
        )
        if self.options.fail_on_data_loss:
            raise OffsetOutOfRange(
                f"{message}; set option 'failOnDataLoss' to false to skip them and go on"
            )
        log.warning("%s; skipped (failOnDataLoss is false)", message)
        return retained
