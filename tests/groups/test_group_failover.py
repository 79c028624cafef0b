"""Two service processes on one MariaDB and one ZooKeeper: SIGKILL of the instance that
coordinates a group moves the group to the other, which resumes it where it stopped (same
members, same shards, same epochs) while the members keep consuming; nothing is lost."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from groups_harness import HEADERS, VC, Deadline, ProcessService, create_topic, register_kafka
from test_group_sdk import assert_disjoint, member, produce

from clients import XinfraConsumer
from metadata_service import ServiceConfig


@pytest.fixture
def instances(
    make_config: Callable[..., ServiceConfig], tmp_path: Path, kafka_bootstrap: str
) -> Iterator[tuple[ProcessService, ProcessService]]:
    started: list[ProcessService] = []
    try:
        for name in ("a", "b"):
            config = make_config(group_zk_session_s=4.0, group_session_s=15.0)
            started.append(ProcessService(config, tmp_path / f"{name}.log").start())
        register_kafka(started[0].url, kafka_bootstrap)
        yield started[0], started[1]
    finally:
        for instance in started:
            instance.stop()


def describe(url: str, group: str) -> dict[str, Any]:
    """Describe through ``url``, following the redirect to the coordinator once it answers."""
    deadline = Deadline(60, "a coordinator to answer")
    while True:
        deadline.check()
        response = httpx.get(f"{url}/v1/vclusters/{VC}/groups/{group}", headers=HEADERS, timeout=30)
        if response.status_code == 307:
            try:
                response = httpx.get(response.headers["location"], headers=HEADERS, timeout=30)
            except httpx.ConnectError:
                continue  # redirected to the killed instance until its ZooKeeper session ends
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body


async def served_checkpoints(url: str, group: str) -> dict[tuple[str, int], int]:
    """The group's checkpoints as ``url`` serves them, once it coordinates the group itself."""
    deadline = Deadline(60, f"{url} to take the group over")
    while True:
        deadline.check()
        response = httpx.get(
            f"{url}/v1/vclusters/{VC}/groups/{group}/checkpoints", headers=HEADERS, timeout=30
        )
        if response.status_code == 200:
            return {(p["topic"], p["shard"]): p["offset"] for p in response.json()["positions"]}
        assert response.status_code in (307, 503), response.text
        await asyncio.sleep(0.05)  # the killed instance's ZooKeeper session has not ended yet


async def test_sigkill_of_the_coordinator_moves_the_group(
    instances: tuple[ProcessService, ProcessService],
) -> None:
    a, b = instances
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(a.url, topic, shards=4)
    group = f"g-{uuid.uuid4().hex[:8]}"
    # b coordinates the group (its first request claims it); members bootstrap through a.
    claim = httpx.post(
        f"{b.url}/v1/vclusters/{VC}/groups/{group}/heartbeat",
        json={"member_id": "probe", "member_epoch": 0, "topics": [topic]},
        headers=HEADERS,
        timeout=30,
    )
    assert claim.status_code == 200, claim.text
    leave = {"member_id": "probe", "member_epoch": -1}
    httpx.post(f"{b.url}/v1/vclusters/{VC}/groups/{group}/heartbeat", json=leave, headers=HEADERS)
    total = 2000
    values = [f"v{i}".encode() for i in range(total)]
    await produce(a.url, topic, values[:1000])
    seen: Counter[bytes] = Counter()
    m1, m2 = await member(a.url, group), await member(a.url, group)
    consumers: list[XinfraConsumer] = [m1, m2]
    try:
        await m1.subscribe([topic])
        await m2.subscribe([topic])
        assert m1.membership is not None and m1.membership.client.coordinator == b.url
        deadline = Deadline(60, "the group to settle on b")
        while sorted(len(c.membership.owned()) for c in consumers if c.membership) != [2, 2]:
            deadline.check()
            for consumer in consumers:
                for record in await consumer.poll(100, timeout_s=0.1):
                    seen[record.value or b""] += 1
        before = describe(b.url, group)
        owned_before = {
            c.membership.member_id: c.membership.owned() for c in consumers if c.membership
        }

        acked = {**await m1.commit(), **await m2.commit()}  # acknowledged by b
        b.kill()
        # Nothing acknowledged is lost with b: a serves the same positions (from MySQL).
        checkpoints = await served_checkpoints(a.url, group)
        assert all(checkpoints[k] >= p.offset for k, p in acked.items()), (checkpoints, acked)
        await produce(a.url, topic, values[1000:])
        deadline = Deadline(90, "every record after the coordinator was killed")
        while len(seen) < total:
            deadline.check()
            for consumer in consumers:
                for record in await consumer.poll(200, timeout_s=0.2):
                    seen[record.value or b""] += 1
                assert_disjoint(consumers)
        # The members reached a, and a resumed the group: same members, same shards, no rejoin.
        deadline = Deadline(60, "a member heartbeat to reach a")
        while not all(
            c.membership and c.membership.client.coordinator in (None, a.url) for c in consumers
        ):
            deadline.check()
            for consumer in consumers:
                await consumer.poll(10, timeout_s=0.1)
        after = describe(a.url, group)
        assert after["members"] == 2
        assert {
            m["member_id"]: [tuple(u) for u in m["assignment"]] for m in after["member_list"]
        } == {k: v for k, v in owned_before.items()}
        assert after["group_epoch"] == before["group_epoch"], "the group was rebuilt, not resumed"
    finally:
        for consumer in consumers:
            await consumer.close()
    assert set(seen) == set(values), "records lost"
    assert sum(seen.values()) == total, "a resumed group re-reads nothing"
