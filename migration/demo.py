"""``xinfra demo migration``: a Kafka-backed topic moved to Northguard under load, then verified.

On the local stack (the settings' metadata URL, token and virtual cluster):
a new topic gets its epoch on the first registered Kafka cluster; keyed
producers write it at a steady rate and a consumer group reads it; the
topic is migrated to the first Northguard cluster step by step (plan, dual
writes, cut-over, complete) while they run.  Then the verification, which
trusts nothing the migration says about itself:

* what the producers were told is acknowledged (value -> position), against
* what the group delivered, and what an independent reader reading the topic
  from the beginning (across both epochs) delivers.

Printed: records produced, acknowledged, consumed, lost (acknowledged, never
delivered), read twice, per-key order violations, and the longest producer
stall (the largest time from a record's scheduled send to its
acknowledgement: the schedule is open-loop, so a stall is not hidden by sends
that queued behind it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from clients import GroupOptions, XinfraProducerOptions, open_consumer, open_producer
from xinfra.errors import InvalidRequest
from xinfra.model import ClusterKind, Position
from xinfra.rest import MetadataClient

READ_TIMEOUT_S = 60.0
"""How long the readers may take to deliver every acknowledged record before it is called lost."""


@dataclass(frozen=True, slots=True)
class DemoConfig:
    topic: str = field(default_factory=lambda: f"demo-migration-{uuid.uuid4().hex[:8]}")
    producers: int = 2
    consumers: int = 2
    keys: int = 16
    shards: int = 4
    rate: float = 500.0
    """Records per second per producer (scheduled open-loop)."""
    phase_s: float = 2.0
    """Load before the migration, between its steps and after it."""


def pick_clusters(admin: MetadataClient) -> tuple[str, str]:
    """The first registered Kafka cluster (the source) and the first Northguard one (target)."""
    clusters = admin.list_clusters()
    by_kind: dict[str, str] = {}
    for cluster in clusters:
        by_kind.setdefault(str(cluster["kind"]), str(cluster["name"]))
    missing = [k.value for k in (ClusterKind.KAFKA, ClusterKind.NORTHGUARD) if k not in by_kind]
    if missing:
        raise InvalidRequest(
            f"the demo needs a {' and a '.join(missing)} cluster registered; found "
            f"{[c['name'] for c in clusters]} (start the local stack with `xinfra up`)"
        )
    return by_kind[ClusterKind.KAFKA.value], by_kind[ClusterKind.NORTHGUARD.value]


class _Producer:
    """One keyed producer on an open-loop schedule; what it was told, and how long it waited."""

    def __init__(self, index: int, config: DemoConfig) -> None:
        self.index = index
        self.config = config
        self.sent = 0
        self.acked: dict[bytes, Position] = {}
        self.failed: list[str] = []
        self.latencies_s: list[float] = []
        self._stop = asyncio.Event()

    def value(self, seq: int) -> tuple[bytes, bytes]:
        key = f"p{self.index}-k{seq % self.config.keys}"
        return key.encode(), f"{key}:{seq}".encode()

    async def run(self, stack: tuple[str, str | None, str]) -> None:
        url, token, vc = stack
        producer = await open_producer(
            url, token, vc, XinfraProducerOptions(linger_ms=2), topics=[self.config.topic]
        )
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            interval = 1.0 / self.config.rate
            while not self._stop.is_set():
                scheduled = start + self.sent * interval
                delay = scheduled - loop.time()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), delay)  # the schedule's pace
                    if self._stop.is_set():
                        break
                key, value = self.value(self.sent)
                self.sent += 1
                future = await producer.send(self.config.topic, value, key=key)
                future.add_done_callback(
                    lambda f, v=value, s=scheduled: self._done(v, s, f)  # type: ignore[misc]
                )
            await producer.flush()
        finally:
            await producer.close()

    def _done(self, value: bytes, scheduled: float, future: asyncio.Future[Position]) -> None:
        self.latencies_s.append(asyncio.get_running_loop().time() - scheduled)
        error = future.exception()
        if error is not None:
            self.failed.append(str(error))
        else:
            self.acked[value] = future.result()

    def stop(self) -> None:
        self._stop.set()


def check(delivered: list[list[bytes]], acked: dict[bytes, Position]) -> dict[str, int]:
    """Lost, read twice and per-key order violations of what readers delivered, each reader's
    records in the order it got them (a key lives on one shard, read by one member at a time)."""
    counts: dict[bytes, int] = {}
    violations = 0
    for values in delivered:
        last: dict[str, int] = {}
        for value in values:
            counts[value] = counts.get(value, 0) + 1
            key, seq = value.decode().rsplit(":", 1)
            if int(seq) < last.get(key, -1):
                violations += 1
            last[key] = max(int(seq), last.get(key, -1))
    return {
        "consumed": sum(counts.values()),
        "lost": sum(1 for v in acked if v not in counts),
        "read_twice": sum(n - 1 for n in counts.values() if n > 1),
        "order_violations": violations,
    }


async def _read(consumer: Any, into: list[bytes], stop: asyncio.Event) -> None:
    while not stop.is_set():
        into.extend(r.value or b"" for r in await consumer.poll(1000, timeout_s=0.2))


async def _until(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)  # polling the readers' progress, bounded by the deadline
    return True


async def run_demo(url: str, token: str | None, vc: str, config: DemoConfig) -> dict[str, Any]:
    """Create the topic, load it, migrate it, verify; the figures as a JSON-ready dict."""
    admin = MetadataClient(url, token=token, timeout_s=120)
    try:
        source, target = await asyncio.to_thread(pick_clusters, admin)
        await asyncio.to_thread(admin.create_topic, vc, config.topic, source, config.shards)
        path = f"/v1/vclusters/{vc}/topics/{config.topic}/migration"

        def step(suffix: str, body: dict[str, Any]) -> dict[str, Any]:
            result: dict[str, Any] = admin.request("POST", path + suffix, json=body, timeout_s=120)
            return result

        group = f"{config.topic}-readers"
        members = [
            await open_consumer(
                url, token, vc, group=group, group_options=GroupOptions(auto_commit_interval_s=0.5)
            )
            for _ in range(config.consumers)
        ]
        seen: list[list[bytes]] = [[] for _ in members]
        stop_reading = asyncio.Event()
        producers = [_Producer(i, config) for i in range(config.producers)]
        steps: list[dict[str, Any]] = []
        try:
            for member in members:
                await member.subscribe([config.topic])
            readers = [
                asyncio.create_task(_read(m, seen[i], stop_reading)) for i, m in enumerate(members)
            ]
            writers = [asyncio.create_task(p.run((url, token, vc))) for p in producers]
            await asyncio.sleep(config.phase_s)  # load before the migration
            began = time.monotonic()
            for suffix, body in (
                ("", {"target_cluster": target}),
                ("/advance", {"expected_state": "dual_write"}),
                ("/advance", {"expected_state": "cut_over"}),
                ("/advance", {"expected_state": "completed"}),
            ):
                at = time.monotonic()
                answer = await asyncio.to_thread(step, suffix, body)
                steps.append(
                    {
                        "state": answer["state"],
                        "paused": answer["paused"],
                        "late_clients": answer["late_clients"],
                        "took_s": round(time.monotonic() - at, 3),
                    }
                )
                if answer["paused"]:
                    break
                await asyncio.sleep(config.phase_s)  # load between the steps, and after
            migrated_s = time.monotonic() - began
            for producer in producers:
                producer.stop()
            await asyncio.gather(*writers)
            acked = {v: p for producer in producers for v, p in producer.acked.items()}
            await _until(
                lambda: len({v for s in seen for v in s} & acked.keys()) >= len(acked),
                READ_TIMEOUT_S,
            )
            await asyncio.sleep(0.3)  # a short drain: whatever else arrives was read twice
            stop_reading.set()
            await asyncio.gather(*readers)
        finally:
            stop_reading.set()
            for member in members:
                await member.close()
        through = await _read_through(url, token, vc, config.topic, len(acked))
        metadata = await asyncio.to_thread(admin.topic_metadata, vc, config.topic)
    finally:
        admin.close()
    group_check = check(seen, acked)
    through_check = check([through], acked)
    latencies = sorted(x for p in producers for x in p.latencies_s)
    result: dict[str, Any] = {
        "topic": config.topic,
        "source_cluster": source,
        "target_cluster": target,
        "config": {
            "producers": config.producers,
            "consumers": config.consumers,
            "keys_per_producer": config.keys,
            "shards": config.shards,
            "rate_per_producer": config.rate,
            "phase_s": config.phase_s,
        },
        "steps": steps,
        "state": steps[-1]["state"] if steps else "none",
        "migration_s": round(migrated_s, 3),
        "epochs": [
            {"epoch": e.number, "cluster": e.cluster, "state": e.state.value}
            for e in metadata.epochs
        ],
        "produced": sum(p.sent for p in producers),
        "acknowledged": len(acked),
        "failed": sum(len(p.failed) for p in producers),
        "consumed": group_check["consumed"],
        "lost": group_check["lost"],
        "read_twice": group_check["read_twice"],
        "order_violations": group_check["order_violations"],
        "read_through": through_check,
        "longest_stall_ms": round(1000 * latencies[-1], 1) if latencies else 0.0,
        "produce_p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 1)
        if latencies
        else 0.0,
    }
    result["ok"] = (
        result["state"] == "completed"
        and result["failed"] == 0
        and result["acknowledged"] == result["produced"]
        and all(group_check[k] == 0 for k in ("lost", "read_twice", "order_violations"))
        and all(through_check[k] == 0 for k in ("lost", "read_twice", "order_violations"))
    )
    return result


async def _read_through(
    url: str, token: str | None, vc: str, topic: str, expected: int
) -> list[bytes]:
    """Everything in the topic from the beginning, across its epochs, by a fresh reader."""
    consumer = await open_consumer(url, token, vc, topics=[topic])
    values: list[bytes] = []
    try:
        await consumer.assign(topic)
        deadline = time.monotonic() + READ_TIMEOUT_S
        while len(values) < expected and time.monotonic() < deadline:
            values.extend(r.value or b"" for r in await consumer.poll(5000, timeout_s=0.5))
        values.extend(r.value or b"" for r in await consumer.poll(5000, timeout_s=0.3))
    finally:
        await consumer.close()
    return values
