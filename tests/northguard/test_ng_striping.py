"""Log striping on real broker processes (issue 15's Done-when): a sixth broker joins a loaded
five-broker cluster and takes its share of new segments at once; nothing is moved to it.

The placement logic alone is simulated in ``test_ng_placement.py``; here the coordinator places
real segments rolled by size (``--segment-bytes-max``) on real processes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from ng_harness import backend_for
from test_ng_cluster import checksums, request, wait_until
from test_ng_leadership import broker_id

from backends.northguard.launcher import NorthguardProcess, start_northguard_broker
from xinfra.backend import ProducerOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

RANGES = 12
"""Ranges written at once: each has an active segment, so placement balances active replicas
(the first load criterion) across the brokers, as in a loaded cluster."""
ROUNDS_BEFORE = 3
ROUNDS_AFTER = 6
"""Segments made after the join: ``RANGES * ROUNDS_AFTER`` (72), enough that the new broker's
catch-up (it starts with no active replica) and the one-replica granularity stay within 20%."""
SEGMENT_BYTES_MAX = 4000
"""Every send below (10 records of 400-600 bytes) fills a segment: the next send rolls it."""


def _segments(coordinator: NorthguardProcess, topic: str) -> dict[str, dict[str, Any]]:
    """Every segment of ``topic`` by id, as the coordinator's metadata lists it."""
    ranges = request(coordinator, "topic_metadata", name=topic)["ranges"]
    return {
        segment["segment_id"]: segment
        for range_ in ranges
        for segment in request(
            coordinator, "segment_metadata", name=topic, range_id=range_["range_id"]
        )["segments"]
    }


def _held(process: NorthguardProcess) -> set[str]:
    """Ids of the segment replicas ``process`` stores (its own listing, page by page)."""
    held: list[str] = []
    while True:
        page = request(process, "replica_list", after=held[-1] if held else "")
        held += page["segment_ids"]
        if not page["more"]:
            return set(held)


def _bytes_per_broker(coordinator: NorthguardProcess, since_s: float) -> dict[str, int]:
    """Store bytes per live broker as the coordinator reports them, once they cover what was
    written before ``since_s`` (monotonic): every member has heartbeaten (each heartbeat
    carries its store's size) after it; ``cluster_status`` counts the load afresh."""

    def status() -> dict[str, Any]:
        return request(coordinator, "cluster_status")

    def heard() -> bool:
        elapsed_s = time.monotonic() - since_s
        return all(row["last_seen_s_ago"] < elapsed_s for row in status()["brokers"] if row["live"])

    wait_until(heard, "a heartbeat of every member after the writes")
    return {row["broker_id"]: row["store_bytes"] for row in status()["brokers"] if row["live"]}


def _skew(stored: dict[str, int]) -> float:
    return max(stored.values()) / (sum(stored.values()) / len(stored))


async def _write_rounds(coordinator: NorthguardProcess, topic: str, rounds: int, seed: int) -> None:
    """``rounds`` sends to every range at once, each filling a segment."""
    backend = backend_for(coordinator.url)
    try:
        producer = backend.producer(topic, ProducerOptions(linger_ms=1))
        for round_ in range(rounds):
            await asyncio.gather(
                *(
                    producer.send(
                        shard,
                        [
                            Record(key=b"k", value=b"%d" % n + b"x" * (400 + (seed + n) % 200))
                            for n in range(round_ * 10 + shard, round_ * 10 + shard + 10)
                        ],
                    )
                    for shard in range(RANGES)
                )
            )
        await producer.close()
    finally:
        await backend.close()


@pytest.mark.slow
async def test_a_joining_broker_takes_its_share_of_new_segments_and_nothing_moves(
    clusters: Any,
) -> None:
    processes: list[NorthguardProcess] = clusters(
        5, replication_factor=3, extra_args=["--segment-bytes-max", str(SEGMENT_BYTES_MAX)]
    )
    coordinator = processes[0]
    backend = backend_for(coordinator.url)
    try:
        await backend.create_topic("striped", shard_ranges(RANGES))
    finally:
        await backend.close()
    await _write_rounds(coordinator, "striped", ROUNDS_BEFORE, seed=0)
    for range_ in request(coordinator, "topic_metadata", name="striped")["ranges"]:
        request(coordinator, "seal_segment", name="striped", range_id=range_["range_id"])
    written_s = time.monotonic()
    before = _segments(coordinator, "striped")
    assert len(before) >= RANGES * ROUNDS_BEFORE
    assert all(s["state"] == "sealed" and len(s["replicas"]) == 3 for s in before.values())
    digests = {sid: checksums(processes, s) for sid, s in before.items()}
    bytes_before = _bytes_per_broker(coordinator, written_s)

    joined = start_northguard_broker(
        coordinator.data_dir.parent / "broker-6",
        broker_id="6",
        extra_args=[
            "--segment-bytes-max",
            str(SEGMENT_BYTES_MAX),
            "--replication-factor",
            "3",
            "--coordinator",
            coordinator.url,
        ],
    )
    try:
        wait_until(
            lambda: sum(r["live"] for r in request(coordinator, "cluster_status")["brokers"]) == 6,
            "the sixth broker's registration",
        )
        await _write_rounds(coordinator, "striped", ROUNDS_AFTER, seed=7)
        written_s = time.monotonic()
        after = _segments(coordinator, "striped")
        new = {sid: s for sid, s in after.items() if sid not in before}
        assert len(new) >= RANGES * ROUNDS_AFTER
        shares = dict.fromkeys([*(broker_id(p) for p in processes), "6"], 0)
        for segment in new.values():
            for replica in segment["replicas"]:
                shares[replica] += 1
        average = sum(shares.values()) / len(shares)
        bytes_after = _bytes_per_broker(coordinator, written_s)
        print(
            f"new replicas per broker over {len(new)} new segments: {shares} "
            f"(new broker {shares['6'] / average:.2f}x the average); byte skew (max/mean) "
            f"{_skew(bytes_before):.3f} on 5 brokers before the join, "
            f"{_skew(bytes_after):.3f} on 6 after; bytes {bytes_before} -> {bytes_after}"
        )
        assert abs(shares["6"] - average) <= 0.2 * average, shares

        # nothing moved: every old segment on the same replicas, byte-identical to before
        for sid, segment in before.items():
            now = after[sid]
            assert (now["replicas"], now["end_offset"]) == (
                segment["replicas"],
                segment["end_offset"],
            )
            assert checksums(processes, now) == digests[sid]
        held = _held(joined)
        assert held and held <= set(new), held - set(new)
    finally:
        joined.stop()
