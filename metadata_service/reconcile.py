"""Reconcile: finish or undo operations left mid-way, and report drift from the physical clusters.

Repairs (intents older than the grace period, so no live request is racing):

* topic ``creating``: when every epoch's physical topic exists, finish (activate);
  otherwise roll back (delete what exists, remove the rows);
* topic ``deleting``: delete the physical topics, then the rows;
* epoch intent ``creating`` on an active topic: roll it back (the request that
  wrote it has given up; its version check would fail anyway);
* an owed settle (``metadata_service.settle``): finished when every live
  producer has acknowledged the sealing version or its bound has passed;
  otherwise reported as ``settle_pending`` (and resumed on this instance).

Drift (reported; ``delete_orphans`` also repairs the second kind):

* a ready epoch whose physical topic is missing (data loss outside Xinfra);
* an ``xinfra.``-prefixed physical topic no epoch row names (an orphan of a
  failed rollback).  Physical topics are listed *before* the rows are read, so
  a topic created meanwhile always has its row in the read and is never taken
  for an orphan.
"""

from __future__ import annotations

import time

from metadata_service.runtime import Runtime
from metadata_service.schemas import ReconcileAction, ReconcileReport
from metadata_service.settle import SettleService
from metadata_service.store.repository import SettleRow
from metadata_service.topics import PHYSICAL_TOPIC_PREFIX, TopicService
from xinfra.errors import Conflict, TopicNotFound, XinfraError
from xinfra.model import PhysicalCluster


class ReconcileService:
    def __init__(self, runtime: Runtime, topics: TopicService, settles: SettleService) -> None:
        self.rt = runtime
        self.topics = topics
        self.settles = settles

    async def _settles(
        self, repaired: list[ReconcileAction], drift: list[ReconcileAction], errors: list[str]
    ) -> None:
        owed: dict[tuple[str, str, int], list[SettleRow]] = {}
        for row in await self.rt.db(self.rt.store.owed_settles):
            owed.setdefault((row.virtual_cluster, row.topic, row.version), []).append(row)
        for (vc, name, version), rows in owed.items():
            numbers = [r.epoch for r in rows]
            left_s = (
                min(r.created_ms for r in rows) / 1000
                + self.rt.config.seal_settle_s_max
                - time.time()
            )
            try:
                behind = await self.settles.behind(vc, name, version)
                if behind and left_s > 0:
                    self.settles.resume(vc, name)
                    for number in numbers:
                        drift.append(
                            ReconcileAction(
                                action="settle_pending",
                                virtual_cluster=vc,
                                topic=name,
                                epoch=number,
                                detail=f"sealed by version {version}; waiting up to {left_s:.0f} s "
                                f"more for producers {behind} to acknowledge it",
                            )
                        )
                    continue
                await self.settles.finish(vc, name, numbers)
                for number in numbers:
                    repaired.append(
                        ReconcileAction(
                            action="finished_settle", virtual_cluster=vc, topic=name, epoch=number
                        )
                    )
            except XinfraError as error:
                errors.append(f"settle of epochs {numbers} of {vc}/{name}: {error}")

    async def _physical_exists(self, cluster: PhysicalCluster, physical: str) -> bool:
        try:
            await self.rt.backends.call(cluster, lambda b: b.describe_topic(physical))
            return True
        except TopicNotFound:
            return False

    async def run(self, grace_s: float | None, delete_orphans: bool) -> ReconcileReport:
        grace = self.rt.config.intent_grace_s if grace_s is None else grace_s
        store = self.rt.store
        repaired: list[ReconcileAction] = []
        drift: list[ReconcileAction] = []
        errors: list[str] = []
        clusters = {c.name: c for c, _v in await self.rt.db(store.list_clusters)}

        physical: dict[str, set[str]] = {}
        for name, cluster in clusters.items():
            try:
                listed = await self.rt.backends.call(cluster, lambda b: b.list_topics())
                physical[name] = {t for t in listed if t.startswith(PHYSICAL_TOPIC_PREFIX)}
            except XinfraError as error:
                errors.append(f"cluster {name}: cannot list topics: {error}")

        cutoff_ms = int((time.time() - grace) * 1000)
        pending = await self.rt.db(store.pending_intents, cutoff_ms)
        for topic in pending.creating_topics:
            vc, name = topic.virtual_cluster, topic.name
            try:
                _row, epochs = await self.rt.db(store.get_topic, vc, name)
                exists = [
                    await self._physical_exists(clusters[e.cluster], e.physical_topic)
                    for e in epochs
                ]
                if epochs and all(exists):
                    version = await self.rt.db(store.activate_topic, vc, name)
                    await self.rt.publish((vc, name), version)
                    repaired.append(
                        ReconcileAction(action="finished_create", virtual_cluster=vc, topic=name)
                    )
                    continue
                for epoch, present in zip(epochs, exists, strict=True):
                    if present:
                        await self.topics._delete_physical(epoch.cluster, epoch.physical_topic)
                await self.rt.db(store.remove_topic, vc, name, "creating")
                repaired.append(
                    ReconcileAction(action="rolled_back_create", virtual_cluster=vc, topic=name)
                )
            except (XinfraError, KeyError) as error:
                errors.append(f"topic {vc}/{name}: {error}")
        for topic in pending.deleting_topics:
            vc, name = topic.virtual_cluster, topic.name
            try:
                _row, epochs = await self.rt.db(store.get_topic, vc, name)
                await self.topics.finish_delete(vc, name, epochs)
                repaired.append(
                    ReconcileAction(action="finished_delete", virtual_cluster=vc, topic=name)
                )
            except XinfraError as error:
                errors.append(f"topic {vc}/{name}: {error}")
        for epoch in pending.creating_epochs:
            vc, name = epoch.virtual_cluster, epoch.topic
            try:
                if epoch.cluster in clusters and await self._physical_exists(
                    clusters[epoch.cluster], epoch.physical_topic
                ):
                    await self.topics._delete_physical(epoch.cluster, epoch.physical_topic)
                if await self.rt.db(store.remove_epoch, vc, name, epoch.number):
                    repaired.append(
                        ReconcileAction(
                            action="rolled_back_epoch",
                            virtual_cluster=vc,
                            topic=name,
                            epoch=epoch.number,
                            cluster=epoch.cluster,
                            physical_topic=epoch.physical_topic,
                        )
                    )
            except (XinfraError, Conflict) as error:
                errors.append(f"epoch {epoch.number} of {vc}/{name}: {error}")

        await self._settles(repaired, drift, errors)

        rows = await self.rt.db(store.all_epochs)
        known: dict[str, set[str]] = {}
        for epoch in rows:
            known.setdefault(epoch.cluster, set()).add(epoch.physical_topic)
            on_cluster = physical.get(epoch.cluster)
            if (
                epoch.intent == "ready"
                and on_cluster is not None
                and epoch.physical_topic not in on_cluster
            ):
                drift.append(
                    ReconcileAction(
                        action="missing_physical_topic",
                        virtual_cluster=epoch.virtual_cluster,
                        topic=epoch.topic,
                        epoch=epoch.number,
                        cluster=epoch.cluster,
                        physical_topic=epoch.physical_topic,
                        detail="the physical topic is gone; its records cannot be read",
                    )
                )
        for cluster_name, names in physical.items():
            for orphan in sorted(names - known.get(cluster_name, set())):
                action = ReconcileAction(
                    action="orphan",
                    cluster=cluster_name,
                    physical_topic=orphan,
                    detail="no epoch refers to this physical topic",
                )
                if delete_orphans:
                    try:
                        await self.topics._delete_physical(cluster_name, orphan)
                        repaired.append(action.model_copy(update={"action": "deleted_orphan"}))
                        continue
                    except XinfraError as error:
                        errors.append(f"orphan {cluster_name}/{orphan}: {error}")
                drift.append(action)
        checked = await self.rt.db(store.count_topics)
        return ReconcileReport(
            checked_topics=checked, repaired=repaired, drift=drift, errors=errors
        )
