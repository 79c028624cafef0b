"""A member paused with SIGSTOP past its session is removed: its shards move to the live member,
its late commit is rejected with ``unknown_member``, and once resumed it drops its shards
(``on_lost``) before reading anything more, then rejoins."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from groups_harness import (
    ADMIN_TOKEN,
    HEADERS,
    HERE,
    ROOT,
    VC,
    Deadline,
    ThreadService,
    create_topic,
    register_kafka,
)
from test_group_sdk import member, produce

from metadata_service import ServiceConfig


@pytest.fixture
def quick(
    make_config: Callable[..., ServiceConfig], kafka_bootstrap: str
) -> Iterator[ThreadService]:
    instance = ThreadService(make_config(group_session_s=3.0)).start()
    register_kafka(instance.url, kafka_bootstrap)
    yield instance
    instance.stop()


class MemberProcess:
    def __init__(self, url: str, group: str, topic: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "groups_member.py"), url, ADMIN_TOKEN, group, topic],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.reports: list[dict[str, Any]] = []

    async def next_report(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), 60)
        assert line, "the member process exited"
        report: dict[str, Any] = json.loads(line)
        self.reports.append(report)
        return report

    async def until(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            report = await self.next_report()
            if predicate(report):
                return report

    def stop(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        self.process.wait(10)


async def test_a_paused_member_is_fenced_and_rejoins(quick: ThreadService) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(quick.url, topic, shards=4)
    group = f"g-{uuid.uuid4().hex[:8]}"
    await produce(quick.url, topic, [f"v{i}".encode() for i in range(200)])
    zombie = MemberProcess(quick.url, group, topic)
    live = await member(quick.url, group)
    try:
        await zombie.until(lambda r: len(r["owned"]) == 4)
        await live.subscribe([topic])
        assert live.membership is not None
        deadline = Deadline(60, "a 2/2 split")
        report = zombie.reports[-1]
        # Split 2/2, and the member to be paused idle (it read all it had: no records in flight).
        while not (
            len(report["owned"]) == 2
            and len(live.membership.owned()) == 2
            and not report["records"]
        ):
            deadline.check()
            await live.poll(50, timeout_s=0.05)
            report = await zombie.next_report()
        paused = report
        zombie.process.send_signal(signal.SIGSTOP)
        deadline = Deadline(60, "the live member to take every shard")
        while len(live.membership.owned()) < 4:
            deadline.check()
            await live.poll(50, timeout_s=0.1)
        # The paused member's late commit is refused: the group no longer has it.
        late = httpx.post(
            f"{quick.url}/v1/vclusters/{VC}/groups/{group}/commit",
            json={
                "member_id": paused["member_id"],
                "member_epoch": paused["epoch"],
                "positions": [
                    {"topic": topic, "epoch": 0, "shard": paused["owned"][0][1], "offset": 0}
                ],
            },
            headers=HEADERS,
        )
        assert late.status_code == 404 and late.json()["code"] == "unknown_member", late.text
        zombie.process.send_signal(signal.SIGCONT)
        # Once resumed, the first thing it does is give its shards up, without reading them.
        resumed = await zombie.until(
            lambda r: r["event"] != "poll" or r["records"] or not r["owned"]
        )
        assert resumed["event"] == "lost", resumed
        assert sorted(map(tuple, resumed["shards"])) == sorted(map(tuple, paused["owned"]))
        # It rejoins as a new incarnation and the group splits again; nobody owns a shard twice.
        deadline = Deadline(60, "the resumed member to rejoin")
        while True:
            deadline.check()
            await live.poll(50, timeout_s=0.05)
            report = await zombie.next_report()
            if len(report["owned"]) == 2 and len(live.membership.owned()) == 2:
                break
    finally:
        zombie.stop()
        await live.close()
