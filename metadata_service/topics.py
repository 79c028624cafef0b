"""Virtual topics: create, update, seal, delete, epochs, and the long-polled metadata view.

Every operation that touches a physical cluster follows the same intent
protocol so that a failure between the store and the backend never leaves the
virtual layer inconsistent:

1. write the intent (topic ``creating``, epoch intent ``creating``, topic
   ``deleting``) in one single-shard transaction;
2. act on the backend (bounded in time);
3. commit (``active``/``ready``, rows removed) or roll the intent back.

Rows in ``creating`` are invisible to clients; a crash between steps leaves an
intent that ``reconcile`` finishes or undoes.  A seal without given end offsets
writes its second phase as an intent too, with the version that seals: an owed
settle that any instance finishes (``metadata_service.settle``).  Every visible change bumps the
topic version (a compare-and-set, so racing admins get one success and one
``version_conflict``) and is published to every instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Mapping, Sequence

from metadata_service.metadata_reader import MetadataReader
from metadata_service.northguard_credentials import CredentialIssuer
from metadata_service.runtime import Runtime
from metadata_service.schemas import (
    EpochCreate,
    EpochUpdate,
    TopicCreate,
    TopicSeal,
    TopicSummary,
    TopicUpdate,
)
from metadata_service.settle import SettleService, check_end_offsets, seal_end_offsets
from metadata_service.store.repository import EpochRow, TopicRow
from xinfra.errors import (
    Conflict,
    InvalidRequest,
    Sealed,
    ShardCountMismatch,
    TopicNotFound,
    VersionConflict,
    XinfraError,
)
from xinfra.keyspace import KeyRange, shard_ranges
from xinfra.model import EpochState, PhysicalCluster

PHYSICAL_TOPIC_PREFIX = "xinfra."
PHYSICAL_TOPIC_LENGTH_MAX = 249


def physical_topic_name(vcluster: str, topic: str, epoch: int) -> str:
    """``xinfra.<vc scope><topic>.<epoch>.<random>``: owned by Xinfra, unique per creation.

    It starts with ``vc_scope(vcluster)`` and no other virtual cluster's scope.
    The random suffix keeps a re-created topic off a physical name that a slow
    backend may still be deleting.  Too long topic names keep a readable prefix
    and a hash.
    """
    suffix = f"{epoch}.{secrets.token_hex(4)}"
    name = f"{vc_scope(vcluster)}{topic}.{suffix}"
    if len(name) <= PHYSICAL_TOPIC_LENGTH_MAX:
        return name
    digest = hashlib.sha256(topic.encode()).hexdigest()[:16]
    return f"{vc_scope(vcluster)}{topic[:100]}.{digest}.{suffix}"


def vc_scope(vcluster: str) -> str:
    """The physical-topic name prefix of a virtual cluster (a Northguard credential's scope).

    ``xinfra.<length>.<vc>.``: names may contain dots, so without the length
    the scope of ``pay`` (``xinfra.pay.``) would cover every topic of ``pay.x``.
    With it, one scope is a prefix of another only when both name the same
    virtual cluster (the digits end at the first dot, so equal prefixes mean
    equal lengths, then equal names).  A name over 100 characters is
    ``xinfra.h<sha256, 16 hex>.``: distinct, and no digit-led scope starts so.
    """
    if len(vcluster) <= 100:
        return f"{PHYSICAL_TOPIC_PREFIX}{len(vcluster)}.{vcluster}."
    return f"{PHYSICAL_TOPIC_PREFIX}h{hashlib.sha256(vcluster.encode()).hexdigest()[:16]}."


log = logging.getLogger(__name__)

Written = tuple[int, bytes, bool]
"""A write's answer: the version and body of the topic metadata, and whether a settle is still
pending (the request's answer is then 202: the settle finishes in the background)."""


class TopicService:
    def __init__(self, runtime: Runtime, settles: SettleService) -> None:
        self.rt = runtime
        self.settles = settles
        self.reader = MetadataReader(runtime)
        self.credentials = CredentialIssuer(runtime, runtime.config.northguard_credential_ttl_s)

    async def close(self) -> None:
        """Close what the reads hold open (the metadata reader's MySQL connection)."""
        await self.reader.close()

    # ---- reads --------------------------------------------------------------------------

    async def metadata_body(self, vc: str, name: str) -> tuple[int, bytes]:
        """The serialized TopicMetadata a client gets: with Northguard credentials of ``vc``."""
        version, body = await self._cached_body(vc, name)
        return version, await self.credentials.add_to(vc, vc_scope(vc), body)

    def metadata_body_now(self, vc: str, name: str) -> tuple[int, bytes] | None:
        """``metadata_body`` when it needs no store read (a cache hit whose Northguard secrets,
        if any, are known); None otherwise: ``metadata_body`` answers then."""
        if not self.rt.notifier.cache_safe:
            return None
        entry = self.rt.cache.get((vc, name))
        if entry is None:
            return None
        body = self.credentials.add_to_now(vc, vc_scope(vc), entry[1])
        if body is None:
            return None
        self.rt.metrics.cache_hits.inc()
        return entry[0], body

    async def _cached_body(self, vc: str, name: str) -> tuple[int, bytes]:
        """The serialized TopicMetadata, from the cache when it is safe to use it."""
        key = (vc, name)
        notifier = self.rt.notifier
        if notifier.cache_safe:
            entry = self.rt.cache.get(key)
            if entry is not None:
                self.rt.metrics.cache_hits.inc()
                return entry
        self.rt.metrics.cache_misses.inc()
        generation = self.rt.hub.generation
        found = await self.reader.read(key)
        if found is None:
            raise TopicNotFound(f"topic {vc}/{name} does not exist")
        if notifier.cache_safe and self.rt.hub.generation == generation:
            self.rt.cache.put(key, *found)
        return found

    async def wait_metadata(
        self, vc: str, name: str, after_version: int | None, timeout_s: float
    ) -> tuple[int, bytes]:
        """Return at once unless ``after_version`` is current; then wait for a newer one.

        The waiter is registered before the read so that a change landing
        between the read and the wait still wakes it.  On timeout, or once the
        instance is stopping, the current metadata is returned (its version
        tells the client nothing changed).
        """
        if after_version is None:
            return await self.metadata_body(vc, name)
        key = (vc, name)
        deadline = time.monotonic() + min(timeout_s, self.rt.config.long_poll_s_max)
        while True:
            waiter = self.rt.hub.waiter(key)
            self.rt.metrics.waiters.inc()
            try:
                version, body = await self.metadata_body(vc, name)
                remaining = deadline - time.monotonic()
                if version > after_version or remaining <= 0 or self.rt.hub.stopping:
                    return version, body
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter, remaining)
            finally:
                self.rt.hub.discard(key, waiter)
                self.rt.metrics.waiters.dec()

    async def list_topics(
        self, vc: str, after: str | None, limit: int
    ) -> tuple[list[TopicSummary], str | None]:
        await self.rt.db(self.rt.store.get_vcluster, vc)
        limit = max(1, min(limit, self.rt.config.list_limit_max))
        rows = await self.rt.db(self.rt.store.list_topics, vc, after, limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        return [self.summary(r) for r in rows], (rows[-1].name if more else None)

    @staticmethod
    def summary(row: TopicRow) -> TopicSummary:
        return TopicSummary(
            virtual_cluster=row.virtual_cluster,
            name=row.name,
            version=row.version,
            state=row.state,  # type: ignore[arg-type]
            sealed=row.sealed,
            config=row.config,
        )

    async def _active(self, vc: str, name: str) -> tuple[TopicRow, list[EpochRow]]:
        topic, epochs = await self.rt.db(self.rt.store.get_topic, vc, name)
        if topic.state != "active":
            raise TopicNotFound(f"topic {vc}/{name} does not exist (it is {topic.state})")
        return topic, epochs

    @staticmethod
    def _expected(topic: TopicRow, expected_version: int | None) -> int:
        if expected_version is not None and expected_version != topic.version:
            raise VersionConflict(
                f"topic {topic.virtual_cluster}/{topic.name} is at version {topic.version}, "
                f"not {expected_version}; re-read it and retry"
            )
        return topic.version

    async def _cluster(self, name: str) -> PhysicalCluster:
        cluster, _version = await self.rt.db(self.rt.store.get_cluster, name)
        return cluster

    # ---- physical side ------------------------------------------------------------------

    async def _create_physical(
        self,
        cluster: PhysicalCluster,
        physical: str,
        ranges: Sequence[KeyRange],
        config: dict[str, str],
    ) -> None:
        try:
            await self.rt.backends.call(cluster, lambda b: b.create_topic(physical, ranges, config))
        except XinfraError:
            await self._delete_physical_quietly(cluster, physical)
            raise

    async def _delete_physical_quietly(self, cluster: PhysicalCluster, physical: str) -> None:
        """Best effort after a failed create (it may have half-happened); reconcile finds leftovers."""
        with contextlib.suppress(XinfraError):
            await self.rt.backends.call(cluster, lambda b: b.delete_topic(physical))

    async def _delete_physical(self, cluster_name: str, physical: str) -> None:
        cluster = await self._cluster(cluster_name)
        with contextlib.suppress(TopicNotFound):
            await self.rt.backends.call(cluster, lambda b: b.delete_topic(physical))

    async def _end_offsets(self, epoch: EpochRow) -> dict[int, int]:
        return await seal_end_offsets(self.rt, epoch)

    async def _seal_plan(
        self, epochs: Sequence[EpochRow], given: Mapping[int, int] | None
    ) -> dict[int, dict[int, int]]:
        """End offsets for every unsealed ready epoch: ``given`` for the newest, the backend for the rest."""
        unsealed = [e for e in epochs if e.intent == "ready" and e.state != EpochState.SEALED]
        plan: dict[int, dict[int, int]] = {}
        for epoch in unsealed:
            if given is not None and epoch is unsealed[-1]:
                plan[epoch.number] = check_end_offsets(epoch, given)
            else:
                plan[epoch.number] = await self._end_offsets(epoch)
        return plan

    # ---- writes -------------------------------------------------------------------------

    async def create(self, vc: str, request: TopicCreate) -> tuple[int, bytes]:
        await self.rt.db(self.rt.store.get_vcluster, vc)
        cluster = await self._cluster(request.cluster)
        ranges = shard_ranges(request.shards)
        physical = physical_topic_name(vc, request.name, 0)
        epoch0 = EpochRow(vc, request.name, 0, cluster.name, physical, ranges, intent="creating")
        await self.rt.db(
            self.rt.store.insert_topic_intent, vc, request.name, request.config, epoch0
        )
        try:
            await self._create_physical(cluster, physical, ranges, request.config)
        except BaseException:
            await self.rt.db(self.rt.store.remove_topic, vc, request.name, "creating")
            raise
        try:
            version = await self.rt.db(self.rt.store.activate_topic, vc, request.name)
        except Conflict:
            # Reconcile rolled the intent back meanwhile: the physical topic is ours to remove.
            await self._delete_physical_quietly(cluster, physical)
            raise
        await self.rt.publish((vc, request.name), version)
        return await self.metadata_body(vc, request.name)

    async def update(
        self, vc: str, name: str, request: TopicUpdate, if_match: int | None
    ) -> tuple[int, bytes]:
        topic, _epochs = await self._active(vc, name)
        expected = self._expected(topic, pick_expected(request.expected_version, if_match))
        version = await self.rt.db(
            self.rt.store.update_topic, vc, name, expected, config=request.config
        )
        await self.rt.publish((vc, name), version)
        return await self.metadata_body(vc, name)

    async def seal(self, vc: str, name: str, request: TopicSeal, if_match: int | None) -> Written:
        topic, epochs = await self._active(vc, name)
        if topic.sealed:
            return await self._settled(vc, name)  # idempotent: completes an owed settle
        expected = self._expected(topic, pick_expected(request.expected_version, if_match))
        if request.end_offsets is not None:
            plan = await self._seal_plan(epochs, request.end_offsets)
            version = await self.rt.db(
                self.rt.store.update_epochs,
                vc,
                name,
                expected,
                {number: (EpochState.SEALED, offsets) for number, offsets in plan.items()},
                {"sealed": True},
            )
            await self.rt.publish((vc, name), version)
            return (*await self.metadata_body(vc, name), False)
        retiring = self._unsealed(epochs)
        version = await self.rt.db(
            self.rt.store.update_epochs,
            vc,
            name,
            expected,
            {epoch.number: (EpochState.SEALED, None) for epoch in retiring},
            {"sealed": True},
        )
        await self.rt.publish((vc, name), version)
        return await self._settled(vc, name)

    async def _settled(self, vc: str, name: str) -> Written:
        """Finish the topic's owed settles (see ``metadata_service.settle``), then answer."""
        done = await self.settles.settle(vc, name)
        return (*await self.metadata_body(vc, name), not done)

    async def delete(self, vc: str, name: str, expected_version: int | None) -> None:
        topic, epochs = await self.rt.db(self.rt.store.get_topic, vc, name)
        if topic.state == "creating":
            raise Conflict(f"topic {vc}/{name} is being created; retry in a moment")
        if topic.state == "active":
            version = await self.rt.db(
                self.rt.store.mark_deleting, vc, name, self._expected(topic, expected_version)
            )
            await self.rt.publish((vc, name), version)
        await self.finish_delete(vc, name, epochs)

    async def finish_delete(self, vc: str, name: str, epochs: Sequence[EpochRow]) -> None:
        """Delete the physical topics of a 'deleting' topic, then its rows (idempotent)."""
        for epoch in epochs:
            await self._delete_physical(epoch.cluster, epoch.physical_topic)
        await self.rt.db(self.rt.store.remove_topic, vc, name, "deleting")

    async def add_epoch(
        self, vc: str, name: str, request: EpochCreate, if_match: int | None
    ) -> Written:
        topic, epochs = await self._active(vc, name)
        expected = self._expected(topic, pick_expected(request.expected_version, if_match))
        if topic.sealed:
            raise Sealed(f"topic {vc}/{name} is sealed; it takes no new epochs")
        if any(e.intent != "ready" for e in epochs):
            raise Conflict(f"an epoch of {vc}/{name} is being added; retry in a moment")
        ready = [e for e in epochs if e.intent == "ready"]
        assert ready, f"active topic {vc}/{name} has no ready epoch"
        current = ready[-1]
        if request.mirror_of is not None and request.mirror_of not in {e.number for e in ready}:
            raise InvalidRequest(f"mirror_of {request.mirror_of} is not an epoch of {vc}/{name}")
        cluster = await self._cluster(request.cluster)
        ranges = list(current.shards) if request.shards is None else shard_ranges(request.shards)
        if request.mirror_of is not None:
            source = next(e for e in ready if e.number == request.mirror_of)
            if list(source.shards) != ranges:
                # a mirrored record keeps its source shard: positions translate only range for range
                raise ShardCountMismatch(
                    f"epoch {request.mirror_of} of {vc}/{name} has {len(source.shards)} shards; "
                    f"a mirror of it must have the same key ranges, not {len(ranges)} shards"
                )
        # Without given end offsets the seal is two-phase (metadata_service.settle): this change
        # retires the epochs with their end offsets unknown and owes their settle.
        retiring = (
            self._unsealed(ready) if request.seal_current and request.end_offsets is None else []
        )
        sealed: dict[int, dict[int, int] | None] = (
            dict(await self._seal_plan(ready, request.end_offsets))
            if request.seal_current and request.end_offsets is not None
            else {epoch.number: None for epoch in retiring}
        )
        number = max(e.number for e in epochs) + 1
        physical = physical_topic_name(vc, name, number)
        epoch = EpochRow(
            vc,
            name,
            number,
            cluster.name,
            physical,
            ranges,
            state=EpochState(request.state),
            mirror_of=request.mirror_of,
            intent="creating",
        )
        await self.rt.db(self.rt.store.insert_epoch_intent, epoch)
        try:
            await self._create_physical(cluster, physical, ranges, topic.config)
            version = await self.rt.db(
                self.rt.store.commit_epoch, vc, name, expected, number, sealed
            )
        except BaseException:
            await self.rt.db(self.rt.store.remove_epoch, vc, name, number)
            await self._delete_physical_quietly(cluster, physical)
            raise
        await self.rt.publish((vc, name), version)
        return await self._settled(vc, name)

    @staticmethod
    def _unsealed(epochs: Sequence[EpochRow]) -> list[EpochRow]:
        return [e for e in epochs if e.intent == "ready" and e.state != EpochState.SEALED]

    async def update_epoch(
        self, vc: str, name: str, number: int, request: EpochUpdate, if_match: int | None
    ) -> Written:
        topic, epochs = await self._active(vc, name)
        epoch = next((e for e in epochs if e.number == number and e.intent == "ready"), None)
        if epoch is None:
            raise TopicNotFound(f"topic {vc}/{name} has no epoch {number}")
        if epoch.state == EpochState.SEALED and request.state != EpochState.SEALED:
            raise Sealed(f"epoch {number} of {vc}/{name} is sealed; it cannot be reopened")
        if epoch.state == EpochState.SEALED:
            # Idempotent, and completes what is missing: given end offsets finish an owed
            # settle at once; without them the settle is finished (or joined) here.
            if request.end_offsets is not None and epoch.end_offsets is None:
                offsets = check_end_offsets(epoch, request.end_offsets)
                await self.settles.finish(vc, name, [number], {number: offsets})
            return await self._settled(vc, name)
        expected = self._expected(topic, pick_expected(request.expected_version, if_match))
        if epoch.state == request.state:
            return (*await self.metadata_body(vc, name), False)
        end_offsets: dict[int, int] | None = None
        if request.state == EpochState.SEALED:
            end_offsets = (
                check_end_offsets(epoch, request.end_offsets)
                if request.end_offsets is not None
                else await self._end_offsets(epoch)
            )
        elif request.end_offsets is not None:
            raise InvalidRequest("end_offsets go with state=sealed only")
        version = await self.rt.db(
            self.rt.store.update_epochs, vc, name, expected, {number: (request.state, end_offsets)}
        )
        await self.rt.publish((vc, name), version)
        return (*await self.metadata_body(vc, name), False)


def pick_expected(expected_version: int | None, if_match: int | None) -> int | None:
    if expected_version is not None and if_match is not None and expected_version != if_match:
        raise InvalidRequest(
            f"If-Match ({if_match}) and expected_version ({expected_version}) disagree; send one"
        )
    return expected_version if expected_version is not None else if_match
