"""Records past a sealed Kafka epoch's end offsets: found and reported, never dropped silently.

A Northguard epoch is sealed natively (``Backend.seal_topic``): its broker
refuses later appends.  Kafka cannot refuse them by protocol, so a producer
that missed the settle window (or any client writing the physical topic
directly) can still get an acknowledgement for a record that readers, who
stop at the recorded end offsets, will never deliver.  This module compares
each sealed Kafka epoch's recorded end offsets with what its cluster reports
now; the difference, per shard, is the orphan count.  It is answered with the
migration's status (``xinfra migrate status``) and exported as the gauge
``xinfra_migration_orphaned_records``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from metadata_service.runtime import Runtime
from metadata_service.store.repository import EpochRow
from xinfra.backend import Backend
from xinfra.errors import XinfraError
from xinfra.model import ClusterKind, EpochState


@dataclass
class EpochOrphans:
    epoch: int
    cluster: str
    physical_topic: str
    records: int
    by_shard: dict[int, int] = field(default_factory=dict)
    """Shard -> records past its recorded end offset (shards without any are left out)."""


@dataclass
class Orphans:
    records: int = 0
    epochs: list[EpochOrphans] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Epochs whose cluster could not be read now (their count is unknown, not zero)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def find_orphans(rt: Runtime, epochs: list[EpochRow]) -> Orphans:
    """Count the records past the recorded end offsets of a topic's sealed Kafka epochs."""
    found = Orphans()
    for epoch in epochs:
        if epoch.state != EpochState.SEALED or epoch.end_offsets is None:
            continue  # not sealed yet, or its settle is still owed
        try:
            cluster, _version = await rt.db(rt.store.get_cluster, epoch.cluster)
        except XinfraError as error:  # deregistered: the count is unknown, not zero
            found.errors.append(f"epoch {epoch.number} on {epoch.cluster}: {error}")
            continue
        if cluster.kind != ClusterKind.KAFKA:
            continue  # sealed natively: its broker refuses later appends
        recorded = epoch.end_offsets

        async def read(backend: Backend, physical: str = epoch.physical_topic) -> dict[int, int]:
            reader = backend.reader(physical)
            try:
                return await reader.end_offsets()
            finally:
                await reader.close()

        try:
            now = await rt.backends.call(cluster, read)
        except Exception as error:  # a report must not fail because one cluster is down
            found.errors.append(f"epoch {epoch.number} on {cluster.name}: {error}")
            continue
        by_shard = {
            shard: now[shard] - end for shard, end in recorded.items() if now.get(shard, 0) > end
        }
        records = sum(by_shard.values())
        found.records += records
        found.epochs.append(
            EpochOrphans(epoch.number, cluster.name, epoch.physical_topic, records, by_shard)
        )
    return found
