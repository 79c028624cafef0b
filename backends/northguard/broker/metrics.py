"""The broker's Prometheus metrics, in a registry of its own (several brokers may share a process in tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from backends.northguard.store.fps import FLUSH_SECONDS_BUCKETS


class DataPathCounts:
    """The counters the data path bumps once per Append, Ack, write or Push: plain integers,
    read at scrape time.  A ``prometheus_client.Counter`` takes a lock per ``inc``: four per
    Append were an eighth of the broker's CPU per Append with 512 ranges written at once."""

    __slots__ = (
        "acks",
        "append_bytes",
        "append_records",
        "appends",
        "push_bytes",
        "pushes",
        "writes",
    )

    def __init__(self) -> None:
        self.appends = 0
        self.append_bytes = 0
        self.append_records = 0
        self.acks = 0
        self.writes = 0
        self.pushes = 0
        self.push_bytes = 0


class BrokerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.counts = DataPathCounts()
        r.register(_DataPathCollector(self.counts))
        self.requests = Counter("northguard_requests", "Unary requests", ["op"], registry=r)
        self.errors = Counter("northguard_errors", "Errors sent to clients", ["code"], registry=r)
        self.connections_refused = Counter(
            "northguard_connections_refused",
            "Connections closed on accept: past connections_max or connections_per_peer_max",
            registry=r,
        )
        self.connections = Gauge("northguard_connections", "Open client connections", registry=r)
        self.streams = Gauge("northguard_streams", "Open streams", ["kind"], registry=r)
        self.produce_streams = self.streams.labels("produce")  # a labels() call per open cost
        self.consume_streams = self.streams.labels("consume")  # more than the rest of the open
        self.topics = Gauge("northguard_topics", "Topics", registry=r)
        self.start_seconds = Gauge(
            "northguard_start_seconds",
            "Time the last start took: the metadata journal, store recovery and the checks between",
            registry=r,
        )

    def watch_store(self, store: Any) -> None:
        """Export the store's own flush and fsync counters, read at scrape time.

        A benchmark quoting "fsynced" figures checks these instead of assuming
        them.  A store without ``stats`` (the memory store) exports nothing.
        """
        if getattr(store, "stats", None) is not None:
            self.registry.register(_StoreCollector(store))

    def watch_coordinator(self, coordinator: Any) -> None:
        """Export the metadata journal's group commits and the snapshots' size and build time."""
        self.registry.register(_CoordinatorCollector(coordinator))


class _DataPathCollector(Collector):
    def __init__(self, counts: DataPathCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        c = self._counts
        for name, help_text, value in (
            ("northguard_appends", "Appends received", c.appends),
            ("northguard_append_bytes", "Batch bytes appended", c.append_bytes),
            ("northguard_append_records", "Records appended", c.append_records),
            ("northguard_acks", "Ack frames sent", c.acks),
            ("northguard_writes", "Socket writes to clients (a turn's frames go in one)", c.writes),
            ("northguard_pushes", "Push frames sent", c.pushes),
            ("northguard_push_bytes", "Batch bytes pushed", c.push_bytes),
        ):
            yield CounterMetricFamily(name, help_text, value=value)


class _StoreCollector(Collector):
    def __init__(self, store: Any) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        stats = self._store.stats
        pool = self._store.pool
        # One reading of the counts: the total, the kinds and the per-flush gauge of one scrape agree.
        synced = self._store.syncs.by_kind()
        store_synced = sum(synced.values())  # the journal counts its own
        flushes = stats.flushes
        creations = self._store.file_creations
        for name, help_text, value in (
            ("northguard_store_flushes", "Group commits (flushes) done", flushes),
            (
                "northguard_store_fsyncs",
                "fsync calls the store made, every kind (WAL, segment files, directories, index)",
                store_synced,
            ),
            (
                "northguard_store_flush_fsyncs",
                "fsync calls made inside flushes (the WAL's: one, three when it rolls)",
                stats.fsyncs,
            ),
            (
                "northguard_store_segments_created",
                "Segments created by the store",
                stats.segments_created,
            ),
            (
                "northguard_store_create_batches",
                "Batches of segment creations (one index sync and one directory sync each)",
                stats.create_batches,
            ),
            (
                "northguard_store_recovered_frames",
                "WAL frames re-applied to segment files by the last open",
                stats.recovered_frames,
            ),
            (
                "northguard_store_adopted_frames",
                "Frames found whole past a segment's synced end by the last open",
                stats.adopted_frames,
            ),
            (
                "northguard_store_segment_write_passes",
                "Writer passes: acknowledged frames copied from memory to their segment files",
                stats.segment_write_passes,
            ),
            (
                "northguard_store_segment_writes",
                "Segment file appends by writer passes (one per segment per pass)",
                stats.segment_writes,
            ),
            ("northguard_store_flush_seconds", "Time spent in flushes", stats.flush_s_total),
            ("northguard_store_flushed_appends", "Appends made durable", stats.flushed_appends),
            ("northguard_store_flushed_records", "Records made durable", stats.flushed_records),
            ("northguard_store_cache_hits", "Reads served by the read cache", stats.cache_hits),
            ("northguard_store_cache_misses", "Reads that went to disk", stats.cache_misses),
            (
                "northguard_store_checkpoints",
                "Checkpoints (segment files synced, WAL released)",
                stats.checkpoints,
            ),
            (
                "northguard_store_checkpoint_fsyncs",
                "fsync calls made by checkpoints",
                stats.checkpoint_fsyncs,
            ),
            (
                "northguard_store_checkpoint_seconds",
                "Time spent in checkpoints",
                stats.checkpoint_s_total,
            ),
            (
                "northguard_store_descriptor_refusals",
                "Operations failed for want of a file descriptor",
                stats.descriptor_refusals,
            ),
            (
                "northguard_store_segment_files_created",
                "Segment files made by their first open (O_CREAT: an inode allocation each)",
                creations.files,
            ),
            (
                "northguard_store_segment_file_create_seconds",
                "Time spent in the opens that made segment files",
                creations.seconds,
            ),
            ("northguard_store_pool_opens", "Segment files opened by the pool", pool.opens),
            ("northguard_store_pool_closes", "Idle segment files closed by the pool", pool.closes),
        ):
            yield CounterMetricFamily(name, help_text, value=value)
        by_kind = CounterMetricFamily(
            "northguard_store_file_fsyncs",
            "fsync calls the store made, by kind of file, counted as each returned",
            labels=["kind"],
        )
        for kind, count in synced.items():
            if kind != "journal":
                by_kind.add_metric([kind], count)
        yield by_kind
        yield GaugeMetricFamily(
            "northguard_store_fsyncs_per_flush",
            "Every fsync the store made per flush since start (checkpoints' segment syncs included)",
            store_synced / flushes if flushes else 0.0,
        )
        buckets = []
        cumulative = 0
        for bound, count in zip(FLUSH_SECONDS_BUCKETS, stats.flush_s_buckets, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        yield HistogramMetricFamily(
            "northguard_store_flush_duration_seconds",
            "Duration of each flush (WAL write and fsync, segment writes)",
            buckets=buckets,
            sum_value=stats.flush_s_total,
        )
        yield GaugeMetricFamily(
            "northguard_store_pool_descriptors",
            "File descriptors held open by the segment file pool",
            pool.descriptors,
        )
        yield GaugeMetricFamily(
            "northguard_store_pool_descriptors_max",
            "Bound of the segment file pool (checked against RLIMIT_NOFILE at start)",
            pool.descriptors_max,
        )
        yield GaugeMetricFamily(
            "northguard_store_pool_files", "Segment files open right now", pool.open_files()
        )
        direct, total = self._store.direct_io_segments()
        yield GaugeMetricFamily(
            "northguard_store_segments_direct_io",
            "Open segment files written with O_DIRECT",
            direct,
        )
        yield GaugeMetricFamily("northguard_store_segments", "Segments in the store", total)
        yield GaugeMetricFamily(
            "northguard_store_unwritten_bytes",
            "Acknowledged frame bytes waiting in memory (and in the WAL) for a write to their segment files",
            self._store.unwritten_bytes(),
        )
        yield GaugeMetricFamily(
            "northguard_store_wal_bytes",
            "Acknowledged frame bytes the WAL holds until a checkpoint releases them: what a crash "
            "now would replay (0 once everything acknowledged is in synced segment files)",
            self._store.wal_bytes(),
        )


class _CoordinatorCollector(Collector):
    def __init__(self, coordinator: Any) -> None:
        self._coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        c = self._coordinator
        yield CounterMetricFamily(
            "northguard_journal_writes",
            "Metadata journal writes (one fsync each)",
            c.journal_writes,
        )
        yield CounterMetricFamily(
            "northguard_journal_ops", "Metadata ops made durable", c.journal_ops
        )
        yield CounterMetricFamily(
            "northguard_journal_fsyncs",
            "fsync calls of the metadata journal since start (writes, snapshots, cut tails)",
            c.journal_fsyncs,
        )
        yield CounterMetricFamily("northguard_snapshots", "Metadata snapshots written", c.snapshots)
        yield GaugeMetricFamily(
            "northguard_live_brokers",
            "Brokers this coordinator counts live (itself included; 1 on a member)",
            len(c.membership.live()),
        )
        yield CounterMetricFamily(
            "northguard_replica_failures",
            "Replicas left out of a seal (failed, fell behind the replica timeout, did not answer)",
            c.replica_failures,
        )
        yield CounterMetricFamily(
            "northguard_leader_failovers",
            "Active segments sealed on their survivors because their leader was no longer live",
            c.leader_failovers,
        )
        yield GaugeMetricFamily(
            "northguard_segments_led",
            "Active segments this broker leads (clients stream their appends here)",
            c.segments_led,
        )
        yield GaugeMetricFamily(
            "northguard_under_replicated_segments",
            "Sealed segments with fewer replicas than their policy asks (at the last heal scan)",
            c.under_replicated,
        )
        yield CounterMetricFamily(
            "northguard_segments_healed",
            "Replicas added by re-replication (copied over the consume protocol, checksum checked)",
            c.healed,
        )
        yield GaugeMetricFamily(
            "northguard_metadata_replicas",
            "Copies of the metadata journal that every op waits for (the coordinator's included)",
            1 + len(c.metadata_replicas.holders),
        )
        yield CounterMetricFamily(
            "northguard_metadata_replicas_replaced",
            "Metadata replicas dropped after a failed append and replaced under the policy",
            c.metadata_replicas.replaced,
        )
        yield CounterMetricFamily(
            "northguard_orphan_segments_deleted",
            "Segments deleted on members that held them without being their replica",
            c.orphans_deleted,
        )
        yield CounterMetricFamily(
            "northguard_replica_appends_received",
            "ReplicaAppends with records this broker stored as a follower",
            c.replicas.appends_received,
        )
        yield CounterMetricFamily(
            "northguard_replica_bytes_received",
            "Batch bytes this broker stored as a follower",
            c.replicas.bytes_received,
        )
        yield GaugeMetricFamily(
            "northguard_snapshot_bytes", "Size of the last metadata snapshot", c.snapshot_bytes
        )
        yield GaugeMetricFamily(
            "northguard_snapshot_build_seconds",
            "Time to build and install the last snapshot (off the event loop)",
            c.snapshot_build_s,
        )
