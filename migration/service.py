"""Migrations run inside the metadata service: persist each state, act, wait for clients.

Every step follows one pattern so a SIGKILL anywhere leaves something a retry
finishes: write ``pending`` (the step under way) to the row, perform the
step's side effect idempotently (each first looks whether it already
happened: the target epoch exists, the source is sealed, ...), wait until every
registered client of the topic has acknowledged the topic's new metadata
version, then write the new state with ``pending`` cleared.  A wait that times
out leaves ``pending`` set, marks the migration paused and names the late
clients; the same step (advance or rollback) resumes it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from prometheus_client import Gauge

from metadata_service.registry import RegistryService
from metadata_service.runtime import Runtime
from metadata_service.schemas import EpochCreate, EpochUpdate
from metadata_service.store.repository import EpochRow
from metadata_service.topics import TopicService
from migration.machine import (
    ROLLBACK,
    Migration,
    State,
    check_rollback,
    next_state,
    plan,
)
from migration.orphans import find_orphans
from xinfra.errors import MigrationNotFound, StepOutOfOrder, TopicNotFound
from xinfra.model import EpochState

ACK_POLL_S = 0.05
"""How often a step re-reads the registry while it waits for clients."""


class MigrationService:
    def __init__(self, runtime: Runtime, topics: TopicService, registry: RegistryService) -> None:
        self.rt = runtime
        self.topics = topics
        self.registry = registry
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.orphaned = Gauge(
            "xinfra_migration_orphaned_records",
            "Records past the recorded end offsets of a sealed Kafka epoch, as last checked.",
            ["vcluster", "topic", "epoch"],
            registry=runtime.metrics.registry,
        )

    # ---- persistence --------------------------------------------------------------------

    async def _load(self, vc: str, topic: str) -> tuple[Migration, int] | None:
        row = await self.rt.db(self.rt.store.get_migration, vc, topic)
        return None if row is None else (Migration.from_json(json.loads(row[0])), row[1])

    async def get(self, vc: str, topic: str) -> Migration:
        loaded = await self._load(vc, topic)
        if loaded is None:
            raise MigrationNotFound(f"{vc}/{topic} has no migration")
        return loaded[0]

    async def status(self, vc: str, topic: str) -> dict[str, Any]:
        """The migration, with the records orphaned past its sealed Kafka epochs' end offsets."""
        migration = await self.get(vc, topic)
        orphans = await find_orphans(self.rt, vc, topic)
        for epoch in orphans.epochs:
            self.orphaned.labels(vc, topic, str(epoch.epoch)).set(epoch.records)
        return {**migration.to_json(), "orphaned": orphans.to_json()}

    async def _save(self, migration: Migration, version: int | None) -> int:
        body = json.dumps(migration.to_json())
        return int(
            await self.rt.db(
                self.rt.store.put_migration,
                migration.virtual_cluster,
                migration.topic,
                body,
                version,
            )
        )

    def _lock(self, vc: str, topic: str) -> asyncio.Lock:
        return self._locks.setdefault((vc, topic), asyncio.Lock())

    # ---- steps --------------------------------------------------------------------------

    async def plan(self, vc: str, topic: str, target: str, shards: int | None) -> Migration:
        _row, epochs = await self.topics._active(vc, topic)
        await self.topics._cluster(target)  # 404 cluster_not_found before anything is written
        source = self._writable(epochs)
        loaded = await self._load(vc, topic)
        migration = plan(
            vc,
            topic,
            source.cluster,
            source.number,
            len(source.shards),
            target,
            shards,
            None if loaded is None else loaded[0],
        )
        await self._save(migration, None if loaded is None else loaded[1])
        return migration

    @staticmethod
    def _writable(epochs: list[EpochRow]) -> EpochRow:
        ready = [e for e in epochs if e.intent == "ready" and e.state != EpochState.SEALED]
        if len(ready) != 1:
            raise StepOutOfOrder(
                f"the topic has {len(ready)} writable epochs; a migration starts from exactly one"
            )
        return ready[0]

    async def advance(
        self, vc: str, topic: str, expected: State | None, ack_timeout_s: float
    ) -> Migration:
        """Perform the next step (or resume the interrupted one) and wait for the clients."""
        async with self._lock(vc, topic):
            migration, version = await self._required(vc, topic)
            step = next_state(migration, expected)
            migration.pending, migration.paused = step.value, False
            version = await self._save(migration, version)
            if step == State.DUAL_WRITE:
                await self._create_target(migration)
            elif step == State.CUT_OVER:
                await self._seal_source(migration)
            else:
                await self._activate_target(migration)
            if not await self._wait_clients(migration, ack_timeout_s):
                migration.record("paused", step=step.value, late_clients=migration.late_clients)
                await self._save(migration, version)
                return migration
            migration.state, migration.pending = step, None
            migration.record(step.value, target_epoch=migration.target_epoch)
            await self._save(migration, version)
            return migration

    async def rollback(self, vc: str, topic: str, ack_timeout_s: float) -> Migration:
        """Back to the source alone: the target epoch is dropped, then its physical topic."""
        async with self._lock(vc, topic):
            migration, version = await self._required(vc, topic)
            check_rollback(migration)
            migration.pending, migration.paused = ROLLBACK, False
            version = await self._save(migration, version)
            physical = await self._drop_target(migration)
            if not await self._wait_clients(migration, ack_timeout_s):
                migration.record("paused", step=ROLLBACK, late_clients=migration.late_clients)
                await self._save(migration, version)
                return migration
            if physical is not None:
                await self.topics._delete_physical(migration.target_cluster, physical)
            migration.state, migration.pending = State.ROLLED_BACK, None
            migration.record(State.ROLLED_BACK.value)
            await self._save(migration, version)
            return migration

    async def _required(self, vc: str, topic: str) -> tuple[Migration, int]:
        loaded = await self._load(vc, topic)
        if loaded is None:
            raise MigrationNotFound(f"{vc}/{topic} has no migration; plan one first")
        return loaded

    # ---- side effects (each idempotent) -------------------------------------------------

    async def _target(self, migration: Migration) -> EpochRow | None:
        _row, epochs = await self.topics._active(migration.virtual_cluster, migration.topic)
        return next(
            (
                e
                for e in epochs
                if e.intent == "ready"
                and e.mirror_of == migration.source_epoch
                and e.cluster == migration.target_cluster
                and (migration.target_epoch is None or e.number == migration.target_epoch)
            ),
            None,
        )

    async def _create_target(self, migration: Migration) -> None:
        existing = await self._target(migration)
        if existing is None:
            await self.topics.add_epoch(
                migration.virtual_cluster,
                migration.topic,
                EpochCreate(
                    cluster=migration.target_cluster,
                    state=EpochState.DUAL_WRITE,
                    mirror_of=migration.source_epoch,
                    seal_current=False,
                ),
                None,
            )
            existing = await self._target(migration)
            assert existing is not None, "the target epoch was just added"
        migration.target_epoch = existing.number

    async def _seal_source(self, migration: Migration) -> None:
        """Seal the source two-phase: end offsets recorded once producers settled (durable)."""
        vc, topic = migration.virtual_cluster, migration.topic
        row, epochs = await self.topics._active(vc, topic)
        source = next(e for e in epochs if e.number == migration.source_epoch)
        if source.state != EpochState.SEALED:
            version = await self.rt.db(
                self.rt.store.update_epochs,
                vc,
                topic,
                row.version,
                {source.number: (EpochState.SEALED, None)},
            )
            await self.rt.publish((vc, topic), version)
        await self.topics._settled(vc, topic)

    async def _activate_target(self, migration: Migration) -> None:
        assert migration.target_epoch is not None
        await self.topics.update_epoch(
            migration.virtual_cluster,
            migration.topic,
            migration.target_epoch,
            EpochUpdate(state=EpochState.ACTIVE),
            None,
        )

    async def _drop_target(self, migration: Migration) -> str | None:
        """Remove the target epoch's row (a version bump producers follow); its physical topic."""
        vc, topic = migration.virtual_cluster, migration.topic
        row, epochs = await self.topics._active(vc, topic)
        target = next(
            (
                e
                for e in epochs
                if e.mirror_of == migration.source_epoch and e.cluster == migration.target_cluster
            ),
            None,
        )
        if target is None:
            return None
        version = await self.rt.db(self.rt.store.drop_epoch, vc, topic, row.version, target.number)
        await self.rt.publish((vc, topic), version)
        return target.physical_topic

    async def _wait_clients(self, migration: Migration, timeout_s: float) -> bool:
        """True once every live client of the topic runs the current version; else names them."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                behind = await self.registry.unacknowledged(
                    migration.virtual_cluster, migration.topic
                )
            except TopicNotFound:
                return True
            late = sorted(c.client_id for c in behind.clients)
            if not late:
                migration.late_clients = []
                return True
            if time.monotonic() >= deadline:
                migration.late_clients, migration.paused = late, True
                return False
            await asyncio.sleep(ACK_POLL_S)
