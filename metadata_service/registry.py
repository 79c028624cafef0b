"""The clients registry: producers and consumers with a lease, and the versions they run on.

A client registers with a TTL (capped by ``client_ttl_s_max``), heartbeats to
extend it and reports, per topic, the metadata version it has applied.  A
client whose lease ran out is invisible at once (every read filters on
``expires_ms``) and its row is purged by a background pass.  Migrations ask
``unacknowledged`` which live clients still run on an older version.

A client id belongs to the token (its name) that registered it: only that
token heartbeats or re-registers it, and it or an admin of the virtual
cluster unregisters it.  A heartbeat is checked against the topics' current
versions: a version above one is refused (``version_ahead``), and a version of
a topic that does not exist is not recorded, so that no acknowledgement can
end a seal's or a migration's wait before the client has the version.
"""

from __future__ import annotations

import asyncio
import logging

from metadata_service.auth import Principal
from metadata_service.runtime import Runtime
from metadata_service.schemas import ClientOut, ClientRegistration, Heartbeat, Unacknowledged
from metadata_service.store.repository import ClientRow
from xinfra.errors import VersionAhead

log = logging.getLogger(__name__)


def client_out(row: ClientRow) -> ClientOut:
    return ClientOut(
        virtual_cluster=row.virtual_cluster,
        client_id=row.client_id,
        kind=row.kind,  # type: ignore[arg-type]
        host=row.host,
        topics=row.topics,
        versions=row.acked,
        ttl_s=row.ttl_s,
        registered_ms=row.registered_ms,
        heartbeat_ms=row.heartbeat_ms,
        expires_ms=row.expires_ms,
    )


class RegistryService:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def register(
        self, vc: str, client_id: str, request: ClientRegistration, principal: Principal
    ) -> ClientOut:
        await self.rt.db(self.rt.store.get_vcluster, vc)
        config = self.rt.config
        ttl_s = min(request.ttl_s or config.client_ttl_s_default, config.client_ttl_s_max)
        row = await self.rt.db(
            self.rt.store.upsert_client,
            vc,
            client_id,
            request.kind.value,
            request.host,
            sorted(set(request.topics)),
            ttl_s,
            config.clients_per_vcluster_max,
            principal.name,
        )
        return client_out(row)

    async def heartbeat(
        self, vc: str, client_id: str, request: Heartbeat, principal: Principal
    ) -> ClientOut:
        versions = await self._checked_versions(vc, request.versions)
        return client_out(
            await self.rt.db(
                self.rt.store.heartbeat_client, vc, client_id, versions, principal.name
            )
        )

    async def _checked_versions(self, vc: str, versions: dict[str, int]) -> dict[str, int]:
        """The reported versions of existing topics; ``VersionAhead`` for one above its topic's."""
        if not versions:
            return versions
        current = await self.rt.db(
            self.rt.store.read_metadata_many, [(vc, topic) for topic in sorted(versions)]
        )
        checked: dict[str, int] = {}
        for (_vc, topic), metadata in current.items():
            if metadata is None:
                continue  # no such topic (any more): nothing to acknowledge
            if versions[topic] > metadata.version:
                raise VersionAhead(
                    f"topic {topic!r} of {vc!r} is at version {metadata.version}; "
                    f"a client cannot have applied version {versions[topic]}"
                )
            checked[topic] = versions[topic]
        return checked

    async def get(self, vc: str, client_id: str) -> ClientOut:
        return client_out(await self.rt.db(self.rt.store.get_client, vc, client_id))

    async def delete(self, vc: str, client_id: str, principal: Principal) -> None:
        """By the token that registered the client, or by an admin of ``vc``."""
        owner = None if principal.role == "admin" and principal.can_read(vc) else principal.name
        await self.rt.db(self.rt.store.delete_client, vc, client_id, owner)

    async def list_clients(self, vc: str, topic: str | None) -> list[ClientOut]:
        rows = await self.rt.db(
            self.rt.store.list_clients, vc, self.rt.config.clients_per_vcluster_max
        )
        return [client_out(r) for r in rows if topic is None or topic in r.topics]

    async def unacknowledged(self, vc: str, topic: str) -> Unacknowledged:
        metadata = await self.rt.db(self.rt.store.read_metadata, vc, topic)
        clients = await self.list_clients(vc, topic)
        behind = [c for c in clients if c.versions.get(topic, -1) < metadata.version]
        return Unacknowledged(
            virtual_cluster=vc, topic=topic, version=metadata.version, clients=behind
        )

    async def purge_forever(self) -> None:
        """Remove expired clients every ``client_purge_interval_s``; owned by the app lifespan."""
        config = self.rt.config
        while True:
            try:
                removed = await self.rt.db(
                    self.rt.store.purge_expired_clients, config.client_purge_batch_max
                )
                if removed:
                    self.rt.metrics.clients_expired.inc(removed)
                    continue  # more may be waiting: purge the next batch at once
            except Exception as error:  # the database may be down; try again next pass
                log.warning("purging expired clients failed: %s", error)
            await asyncio.sleep(config.client_purge_interval_s)
