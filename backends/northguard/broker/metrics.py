"""The broker's Prometheus metrics, in a registry of its own (several brokers may share a process in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class BrokerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.appends = Counter("northguard_appends", "Appends received", registry=r)
        self.append_bytes = Counter("northguard_append_bytes", "Batch bytes appended", registry=r)
        self.append_records = Counter("northguard_append_records", "Records appended", registry=r)
        self.acks = Counter("northguard_acks", "Ack frames sent", registry=r)
        self.pushes = Counter("northguard_pushes", "Push frames sent", registry=r)
        self.push_bytes = Counter("northguard_push_bytes", "Batch bytes pushed", registry=r)
        self.requests = Counter("northguard_requests", "Unary requests", ["op"], registry=r)
        self.errors = Counter("northguard_errors", "Errors sent to clients", ["code"], registry=r)
        self.connections = Gauge("northguard_connections", "Open client connections", registry=r)
        self.streams = Gauge("northguard_streams", "Open streams", ["kind"], registry=r)
        self.topics = Gauge("northguard_topics", "Topics", registry=r)
