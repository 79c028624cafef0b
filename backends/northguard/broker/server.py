"""A Northguard broker process: the store, the coordinator, the client port and the HTTP port.

``Broker.start`` recovers (store WAL replay, metadata journal, sealing of
segments left active by a crash) before it accepts a connection, so a client
never sees a half-recovered broker.  ``Broker.stop`` (SIGTERM) stops
accepting, closes connections, waits for in-flight appends and closes the
store cleanly; a SIGKILL instead is what the crash tests exercise.

Connections: at most ``connections_max`` in total and ``connections_per_peer_max`` from
one peer address; one past either is closed as it is accepted (counted in
``northguard_connections_refused``), so no client can exhaust the broker's
descriptors or memory by opening connections, and well-behaved peers keep theirs.

Cluster: a broker started with ``coordinator`` (the coordinator broker's
address) is a *member*: it registers and heartbeats there
(``membership.py``), follows the replicas the coordinator places on it and
forwards metadata requests to it, and leads the segments the coordinator
places on it first (``leadership.py``).  A broker started without one is the
coordinator; with ``cluster`` it places replicas and leaders on the live
brokers, itself included, and names each range's leader's address in topic
metadata.

TLS: with ``tls_cert`` and ``tls_key`` the client port speaks TLS 1.2+ only
(``backends.northguard.tls``); a plaintext client's connection is dropped by
the handshake.  The HTTP health and metrics port stays plaintext: it carries
no credential and no record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.northguard.broker.connection import BrokerConnection
from backends.northguard.broker.coordinator import Coordinator, CoordinatorConfig
from backends.northguard.broker.http import HealthServer
from backends.northguard.broker.journal import FileJournal
from backends.northguard.broker.leadership import Leadership
from backends.northguard.broker.membership import BROKER_TIMEOUT_S, HEARTBEAT_S, heartbeat_forever
from backends.northguard.broker.metadata_replication import MetadataCopy
from backends.northguard.broker.metrics import BrokerMetrics
from backends.northguard.broker.peers import PeerPool
from backends.northguard.broker.placement import BrokerInfo
from backends.northguard.broker.replication import REPLICA_TIMEOUT_S
from backends.northguard.broker.store_keeper import StoreKeeper
from backends.northguard.credentials import SECRET_ENV
from backends.northguard.frame_reader import FrameReader
from backends.northguard.protocol import FRAME_BYTES_MAX
from backends.northguard.runtime import RealRuntime, Runtime
from backends.northguard.store import FpsStore, MemoryStore, SegmentStore
from backends.northguard.tls import CA_ATTRIBUTE, TLS_ATTRIBUTE, client_context, server_context

log = logging.getLogger(__name__)


@dataclass
class BrokerConfig:
    data_dir: Path
    broker_id: str = "1"
    host: str = "127.0.0.1"
    port: int = 9470
    http_port: int | None = None  # None: no HTTP endpoint; 0: any free port
    attributes: dict[str, str] = field(default_factory=dict)
    store: str = "fps"  # "fps" (durable) or "memory" (tests, simulator)
    segment_bytes_max: int = 1 << 30
    segment_age_s_max: float = 3600.0
    group_commit_ms: float = 5.0  # the least time between two flushes' starts (FpsStore)
    group_commit_bytes_max: int = 10 << 20
    group_commit_records_max: int = 20_000
    frame_bytes_max: int = FRAME_BYTES_MAX
    maintenance_s: float = 1.0
    sealed_segments_max: int = 10_000  # per range; past it the oldest go, data and metadata
    snapshot_ops_max: int | None = None  # journal ops between snapshots; None: JOURNAL_OPS_MAX
    descriptors_max: int | None = None  # segment file pool bound; None: from RLIMIT_NOFILE
    secret: bytes | None = None  # cluster secret: every connection must authenticate; None: open
    tls_cert: Path | None = None  # PEM certificate (chain) of the client port; None: plaintext
    tls_key: Path | None = None  # its private key; given exactly when tls_cert is
    connections_max: int = 4096  # client connections in total; one more is closed on accept
    connections_per_peer_max: int = 512  # from one peer address
    coordinator: str | None = None  # host:port of the coordinator broker; None: this is it
    cluster: bool = False  # the coordinator of a multi-broker cluster (implied by coordinator)
    advertised_address: str | None = None  # host:port peers and clients reach; None: host:port
    replication_factor: int = 1  # replicas of a new segment under the default policy
    heartbeat_s: float = HEARTBEAT_S
    broker_timeout_s: float = BROKER_TIMEOUT_S
    replica_timeout_s: float = REPLICA_TIMEOUT_S
    orphan_scan_s: float = 30.0  # how often members' stores are checked for orphan segments
    peer_tls_ca: Path | None = None  # CA of the peers' certificates (TLS ports); None: system's
    metadata_replication_factor: int = 1  # copies of the coordinator's journal (1: its own only)
    recover_metadata_from: tuple[str, ...] = ()  # members to rebuild an empty journal from
    metadata_policy: str | None = None  # storage policy placing the copies; None: the factor
    force_unclean_metadata_recovery: bool = False  # recover from a copy that may be behind

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a TLS client port needs both tls_cert and tls_key")
        if self.sealed_segments_max < 1:
            raise ValueError("sealed_segments_max is at least 1")
        if self.snapshot_ops_max is not None and self.snapshot_ops_max < 1:
            raise ValueError("snapshot_ops_max is at least 1 (None: the default)")
        if not 1 <= self.connections_per_peer_max <= self.connections_max:
            raise ValueError("1 <= connections_per_peer_max <= connections_max")
        if not 1 <= self.replication_factor <= 16:
            raise ValueError("replication_factor is in 1..16")
        if self.coordinator is not None:
            self.cluster = True
        if not 1 <= self.metadata_replication_factor <= 16:
            raise ValueError("metadata_replication_factor is in 1..16")
        if self.metadata_policy is not None and self.metadata_replication_factor > 1:
            raise ValueError(
                "metadata_policy and metadata_replication_factor > 1 are two ways to say where "
                "the journal's copies live; give one"
            )
        if self.recover_metadata_from and not self.cluster:
            raise ValueError(
                "recover_metadata_from is for the coordinator of a cluster (--cluster)"
            )
        if min(self.heartbeat_s, self.broker_timeout_s, self.replica_timeout_s) <= 0:
            raise ValueError("heartbeat_s, broker_timeout_s and replica_timeout_s are positive")
        if self.orphan_scan_s <= 0:
            raise ValueError("orphan_scan_s is positive")


class Broker:
    def __init__(
        self,
        config: BrokerConfig,
        runtime: Runtime | None = None,
        store: SegmentStore | None = None,
    ) -> None:
        self.config = config
        self.runtime = runtime or RealRuntime()
        self.metrics = BrokerMetrics()
        self.store = store or self._make_store()
        self.metrics.watch_store(self.store)
        self.coordinator = Coordinator(
            self.runtime,
            FileJournal(self.runtime, config.data_dir / "meta"),
            self.store,
            CoordinatorConfig(
                broker_id=config.broker_id,
                attributes=dict(config.attributes),
                segment_bytes_max=config.segment_bytes_max,
                segment_age_s_max=config.segment_age_s_max,
                maintenance_s=config.maintenance_s,
                sealed_segments_max=config.sealed_segments_max,
                snapshot_ops_max=config.snapshot_ops_max,
                replication_factor=config.replication_factor,
                replica_timeout_s=config.replica_timeout_s,
                broker_timeout_s=config.broker_timeout_s,
                orphan_scan_s=config.orphan_scan_s,
                member=config.coordinator is not None,
                cluster=config.cluster,
                metadata_replication_factor=config.metadata_replication_factor,
                recover_metadata_from=list(config.recover_metadata_from),
                metadata_policy=config.metadata_policy,
                force_unclean_metadata_recovery=config.force_unclean_metadata_recovery,
            ),
        )
        self.peers: PeerPool | None = None
        if config.cluster:
            peer_tls = None
            if config.tls_cert is not None:  # the peers' ports speak TLS like this one
                peer_tls = client_context(
                    {
                        TLS_ATTRIBUTE: "true",
                        CA_ATTRIBUTE: "" if config.peer_tls_ca is None else str(config.peer_tls_ca),
                    }
                )
            self.peers = PeerPool(
                self.runtime, config.broker_id, config.secret, config.replica_timeout_s, peer_tls
            )
            self.coordinator.peers = self.peers
            self.coordinator.metadata_replicas.peers = self.peers
            if config.coordinator is not None:
                self.coordinator.metadata_copy = MetadataCopy(
                    self.runtime,
                    config.data_dir / "meta-copy",
                    BrokerInfo(config.broker_id, dict(config.attributes)),
                )
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.metrics.watch_coordinator(self.coordinator)
        self._keeper = StoreKeeper(self.runtime, self.store, self.metrics.registry)
        self._keeper_task: asyncio.Task[None] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._http: asyncio.AbstractServer | None = None
        self._connections: set[BrokerConnection] = set()
        self._per_peer: dict[str, int] = {}
        self._stopped = asyncio.Event()
        # Loaded now, so a missing or mismatched certificate stops the start before recovery.
        self._tls = (
            None
            if config.tls_cert is None or config.tls_key is None
            else server_context(config.tls_cert, config.tls_key)
        )
        self.port = config.port
        self.http_port: int | None = None
        if config.secret is None:
            log.warning(
                "NORTHGUARD BROKER %s STARTED WITHOUT A SECRET: ANY CONNECTION MAY LIST, READ, "
                "WRITE, CREATE, SEAL AND DELETE EVERY TOPIC. Set %s (or --secret-file) to "
                "require credentials.",
                config.broker_id,
                SECRET_ENV,
            )

    def _make_store(self) -> SegmentStore:
        config = self.config
        if config.store == "memory":
            return MemoryStore()
        return FpsStore(
            self.runtime,
            config.data_dir / "store",
            group_commit_ms=config.group_commit_ms,
            group_commit_bytes_max=config.group_commit_bytes_max,
            group_commit_records_max=config.group_commit_records_max,
            queue_bytes_max=max(4 * config.group_commit_bytes_max, 40 << 20),
            descriptors_max=config.descriptors_max,
        )

    async def start(self) -> None:
        """Recover, then serve health and metrics, then clients: the client port opens last, so
        a client port that answers (what a launcher waits for) means the broker is up, its
        health, metrics and start time served too (opened before them, a launcher polling every
        10 ms could ask for health before the HTTP port listened); health says 503 until then."""
        started_s = self.runtime.monotonic_s()
        await self.coordinator.start()
        self._keeper_task = asyncio.create_task(self._keeper.run(), name="northguard-store-keeper")
        self.metrics.start_seconds.set(self.runtime.monotonic_s() - started_s)
        network = self.runtime.network
        if self.config.http_port is not None:
            health = HealthServer(self.health, self.metrics.registry)
            self._http = await network.serve(self.config.host, self.config.http_port, health.handle)
            self.http_port = _bound_port(self._http, self.config.http_port)
        self._server = await network.serve_frames(
            self.config.host,
            self.config.port,
            self._on_connection,
            self.config.frame_bytes_max,
            self._tls,
        )
        self.port = _bound_port(self._server, self.config.port)
        address = self.config.advertised_address or f"{self.config.host}:{self.port}"
        self.coordinator.membership.address = address
        if self.config.coordinator is not None:
            self._join(self.config.coordinator, address)
        log.info(
            "northguard broker %s serving %s on %s:%s (http %s, plaintext), data in %s",
            self.config.broker_id,
            "TLS" if self.tls else "PLAINTEXT",
            self.config.host,
            self.port,
            self.http_port,
            self.config.data_dir,
        )

    def _join(self, coordinator: str, address: str) -> None:
        """A member: forward metadata requests to the coordinator, and heartbeat to it."""
        peers = self.peers
        assert peers is not None
        config = self.config

        async def forward(request: dict[str, Any]) -> dict[str, Any]:
            arguments = {k: v for k, v in request.items() if k != "op"}
            return await peers.request(coordinator, str(request["op"]), **arguments)

        incarnation = secrets.token_hex(8)  # this process: a restart is told from a late beat

        def registration() -> dict[str, Any]:
            return {
                "op": "register_broker",
                "broker_id": config.broker_id,
                "address": address,
                "attributes": dict(config.attributes),
                "store_bytes": sum(info.size_bytes for info in self.store.segments()),
                "incarnation": incarnation,
            }

        async def roll(request: dict[str, Any]) -> dict[str, Any]:
            # a roll may fence a hung replica (one replica timeout) and place a new segment
            arguments = {k: v for k, v in request.items() if k != "op"}
            timeout_s = 3 * config.replica_timeout_s + config.broker_timeout_s
            return await peers.request_with_timeout(
                coordinator, str(request["op"]), timeout_s, **arguments
            )

        self.coordinator.forward = forward
        self.coordinator.leadership = Leadership(self.coordinator, roll)
        self._heartbeat_task = asyncio.create_task(
            heartbeat_forever(self.runtime, forward, registration, config.heartbeat_s),
            name="northguard-heartbeat",
        )

    @property
    def tls(self) -> bool:
        """Whether the client port speaks TLS."""
        return self._tls is not None

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy once the client port serves (``start`` opens it after this one: a probe of
        either port then means the same) and while the store takes writes."""
        failure = self.store.failure
        self.metrics.topics.set(len(self.coordinator.state.topics))
        return failure is None and self._server is not None, {
            "broker_id": self.config.broker_id,
            "topics": len(self.coordinator.state.topics),
            "ranges": len(self.coordinator.state.ranges),
            "segments": len(self.coordinator.state.segments),
            "role": "member" if self.config.coordinator is not None else "coordinator",
            "connections": len(self._connections),
            "serving": self._server is not None,
            "store_failed": failure is not None,
            "store_error": None if failure is None else failure.message,
        }

    async def _on_connection(self, reader: FrameReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) else str(peername)
        from_peer = self._per_peer.get(peer, 0)
        config = self.config
        if (
            len(self._connections) >= config.connections_max
            or from_peer >= config.connections_per_peer_max
        ):
            self.metrics.connections_refused.inc()
            writer.transport.abort()
            return
        self._per_peer[peer] = from_peer + 1
        connection = BrokerConnection(
            self.coordinator,
            self.metrics,
            reader,
            writer,
            self.config.secret,
        )
        self._connections.add(connection)
        try:
            await connection.run()
        finally:
            self._connections.discard(connection)
            left = self._per_peer.pop(peer) - 1
            if left:
                self._per_peer[peer] = left

    async def stop(self) -> None:
        """Stop serving and close everything cleanly.  Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for server in (self._server, self._http):
            if server is not None:
                server.close()
        # Together: each may wait its flush bound (CLOSE_FLUSH_S) for a client that reads nothing.
        closes = [connection.close() for connection in list(self._connections)]
        for failure in await asyncio.gather(*closes, return_exceptions=True):
            if isinstance(failure, BaseException):
                raise failure
        for task in (self._keeper_task, self._heartbeat_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.coordinator.stop()
        if self.peers is not None:
            await self.peers.close()
        with contextlib.suppress(Exception):
            await self.store.close()
        log.info("northguard broker %s stopped", self.config.broker_id)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def _bound_port(server: asyncio.AbstractServer, asked: int) -> int:
    """The port a server listens on (the kernel's choice when ``asked`` is 0)."""
    sockets = getattr(server, "sockets", None) or ()
    for sock in sockets:
        return int(sock.getsockname()[1])
    return asked
