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
import contextlib
import json
import logging
import time
from typing import Any

from prometheus_client import Counter, Gauge

from metadata_service.groups import Groups
from metadata_service.registry import RegistryService
from metadata_service.runtime import Runtime
from metadata_service.schemas import EpochCreate, EpochUpdate
from metadata_service.store.repository import EpochRow
from metadata_service.topics import TopicService
from migration.checkpoints import (
    Moved,
    cached,
    groups_on_source,
    move_checkpoints,
    scan_mirror,
)
from migration.machine import (
    ROLLBACK,
    Migration,
    State,
    check_rollback,
    next_state,
    plan,
)
from migration.orphans import Orphans, find_orphans
from xinfra.errors import ClusterNotFound, MigrationNotFound, StepOutOfOrder, TopicNotFound
from xinfra.model import EpochState

log = logging.getLogger(__name__)
ACK_POLL_S = 0.05
"""How often a step re-reads the registry while it waits for clients."""


class MigrationService:
    def __init__(
        self,
        runtime: Runtime,
        topics: TopicService,
        registry: RegistryService,
        groups: Groups | None = None,
    ) -> None:
        self.rt = runtime
        self.topics = topics
        self.registry = registry
        self.groups = groups
        """Where group checkpoints live; None (no groups) leaves them to the read-through."""
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.orphaned = Gauge(
            "xinfra_migration_orphaned_records",
            "Records past the recorded end offsets of a sealed Kafka epoch, as last checked.",
            ["vcluster", "topic", "epoch"],
            registry=runtime.metrics.registry,
        )
        self.orphan_checks = Counter(
            "xinfra_migration_orphan_checks",
            "Passes of the periodic orphan check over every migrated topic.",
            registry=runtime.metrics.registry,
        )
        self._watch: asyncio.Task[None] | None = None

    # ---- lifecycle: the periodic orphan check -------------------------------------------

    async def start(self) -> None:
        """Count orphans every ``migration_orphan_check_s`` (0: only when a status is asked).

        Why periodic: a record that lands past a sealed Kafka source's end
        offsets is acknowledged to its producer and never delivered; an
        operator must learn of it from the metrics without asking each topic.
        Cost per pass: one end-offsets request per sealed Kafka epoch of a
        migrated topic (``migration.orphans``), one topic at a time.
        """
        interval_s = self.rt.config.migration_orphan_check_s
        if interval_s > 0 and self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(
                self._watch_orphans(interval_s), name="migration-orphans"
            )

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    async def _watch_orphans(self, interval_s: float) -> None:
        while True:
            try:
                await self.check_orphans()
            except Exception as error:  # the store is down: the next pass tries again
                log.warning("the periodic orphan check failed: %s", error)
            await asyncio.sleep(interval_s)  # the period itself, not a wait for something

    async def check_orphans(self) -> None:
        """One pass: the gauge of every migrated topic whose source is sealed."""
        for vc, topic, body in await self.rt.db(self.rt.store.list_migrations):
            if json.loads(body)["state"] not in (State.CUT_OVER, State.COMPLETED):
                continue  # the source is not sealed: nothing can be orphaned yet
            try:
                _row, epochs = await self.rt.db(self.rt.store.get_topic, vc, topic)
                await self._gauge(vc, topic, await find_orphans(self.rt, epochs))
            except TopicNotFound:
                continue  # deleted since its migration
        self.orphan_checks.inc()

    async def _gauge(self, vc: str, topic: str, orphans: Orphans) -> None:
        for epoch in orphans.epochs:
            self.orphaned.labels(vc, topic, str(epoch.epoch)).set(epoch.records)

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
        """The migration, with the records orphaned past its sealed Kafka epochs' end offsets and,
        once the source is sealed, the groups with live members still on it."""
        migration = await self.get(vc, topic)
        _row, epochs = await self.rt.db(self.rt.store.get_topic, vc, topic)  # read once for both
        orphans = await find_orphans(self.rt, epochs)
        await self._gauge(vc, topic, orphans)
        lagging: list[dict[str, Any]] = []
        if self.groups is not None and migration.state in (State.CUT_OVER, State.COMPLETED):
            ends = next((e.end_offsets for e in epochs if e.number == migration.source_epoch), None)
            lagging = await groups_on_source(self.groups, vc, topic, migration.source_epoch, ends)
        return {**migration.to_json(), "orphaned": orphans.to_json(), "groups_on_source": lagging}

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
            if step in (State.CUT_OVER, State.COMPLETED):
                self._record_moved(migration, await self._checkpoints_forward(migration))
            migration.state, migration.pending = step, None
            migration.record(step.value, target_epoch=migration.target_epoch)
            await self._save(migration, version)
            return migration

    async def rollback(self, vc: str, topic: str, ack_timeout_s: float) -> Migration:
        """Back to the source alone: the target epoch is dropped, then its physical topic.

        The physical topic is deleted, not left for reconcile: during dual writes
        it holds only copies of source records (every target record mirrors
        one), so deleting it loses nothing, and an operator who rolls back
        expects the target cluster as it was before the plan, not a topic no
        epoch names that keeps its disk until someone notices.  It is deleted
        only once every client acknowledged the dropped epoch (no producer
        writes it any more) and after group checkpoints on it were translated
        back, which reads it.  Its name is kept in the migration, so a rollback
        paused between dropping the epoch and deleting the topic deletes it
        when resumed.
        """
        async with self._lock(vc, topic):
            migration, version = await self._required(vc, topic)
            check_rollback(migration)
            migration.pending, migration.paused = ROLLBACK, False
            version = await self._save(migration, version)
            version = await self._drop_target(migration, version)
            if not await self._wait_clients(migration, ack_timeout_s):
                migration.record("paused", step=ROLLBACK, late_clients=migration.late_clients)
                await self._save(migration, version)
                return migration
            if migration.target_physical is not None:
                self._record_moved(migration, await self._checkpoints_backward(migration))
                with contextlib.suppress(ClusterNotFound):  # deregistered: nothing to delete
                    await self.topics._delete_physical(
                        migration.target_cluster, migration.target_physical
                    )
                migration.record("target_deleted", physical_topic=migration.target_physical)
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
        migration.target_physical = existing.physical_topic

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

    async def _drop_target(self, migration: Migration, version: int) -> int:
        """Remove the target epoch's row (a version bump producers follow), its name kept first.

        Returns the migration row's new version (it is saved when the target's
        number and physical topic were not recorded yet: a half-created target).
        """
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
            return version
        if (migration.target_epoch, migration.target_physical) != (
            target.number,
            target.physical_topic,
        ):
            migration.target_epoch = target.number
            migration.target_physical = target.physical_topic
            version = await self._save(migration, version)
        metadata_version = await self.rt.db(
            self.rt.store.drop_epoch, vc, topic, row.version, target.number
        )
        await self.rt.publish((vc, topic), metadata_version)
        return version

    # ---- group checkpoints --------------------------------------------------------------

    async def _checkpoints_forward(self, migration: Migration) -> Moved:
        """Idle groups' checkpoints on the sealed source move to the target (exact offsets)."""
        if self.groups is None or migration.target_epoch is None:
            return Moved()
        vc, topic = migration.virtual_cluster, migration.topic
        _row, epochs = await self.topics._active(vc, topic)
        source = next(e for e in epochs if e.number == migration.source_epoch)
        target = next(e for e in epochs if e.number == migration.target_epoch)
        if source.end_offsets is None:  # the settle is owed: no exact offsets yet
            return Moved(left={"*": "the source's end offsets are not recorded yet"})
        ends = source.end_offsets
        cluster = await self.topics._cluster(target.cluster)

        async def scan(shard: int) -> Any:
            return await scan_mirror(
                self.rt,
                cluster,
                target.physical_topic,
                shard,
                source.number,
                ends.get(shard, 0),
            )

        return await move_checkpoints(
            self.groups, vc, topic, source.number, target.number, cached(scan), forward=True
        )

    async def _checkpoints_backward(self, migration: Migration) -> Moved:
        """Every group's checkpoints on the dropped target return to the source (exact offsets)."""
        if self.groups is None or migration.target_epoch is None:
            return Moved()
        assert migration.target_physical is not None
        physical = migration.target_physical
        try:
            cluster = await self.topics._cluster(migration.target_cluster)
        except ClusterNotFound:
            cluster = None

        async def scan(shard: int) -> Any:
            if cluster is None:
                return None
            try:
                return await scan_mirror(
                    self.rt, cluster, physical, shard, migration.source_epoch, None
                )
            except TopicNotFound:  # deleted by an earlier try: its rows can only be dropped
                return None

        return await move_checkpoints(
            self.groups,
            migration.virtual_cluster,
            migration.topic,
            migration.target_epoch,
            migration.source_epoch,
            cached(scan),
            forward=False,
        )

    @staticmethod
    def _record_moved(migration: Migration, moved: Moved) -> None:
        if moved.groups or moved.left:
            migration.record("checkpoints_moved", **moved.to_json())

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
