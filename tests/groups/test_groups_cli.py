"""``xinfra groups`` as a user runs it (a subprocess, --json): list, describe with lag per shard,
reset-offsets refused while members run unless --force, delete."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from groups_harness import ADMIN_TOKEN, HEADERS, VC, ThreadService, create_topic
from test_group_sdk import produce


def xinfra(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XINFRA_METADATA_URL": url, "XINFRA_TOKEN": ADMIN_TOKEN}
    return subprocess.run(
        [str(Path(sys.executable).parent / "xinfra"), "groups", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@contextlib.asynccontextmanager
async def live_member(url: str, group: str, topic: str) -> AsyncIterator[None]:
    """A member that joins and keeps heartbeating while the block runs."""
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=30) as http:
        path = f"/v1/vclusters/{VC}/groups/{group}/heartbeat"
        member_id = f"m-{uuid.uuid4().hex[:6]}"
        joined = await http.post(
            path, json={"member_id": member_id, "member_epoch": 0, "topics": [topic]}
        )
        assert joined.status_code == 200, joined.text
        epoch = joined.json()["member_epoch"]

        async def beat() -> None:
            while True:
                await asyncio.sleep(0.3)  # the heartbeat interval, not a synchronisation
                await http.post(path, json={"member_id": member_id, "member_epoch": epoch})

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def run(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(xinfra, url, *args)


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


async def test_groups_cli(service: ThreadService, kafka: str) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(service.url, topic, shards=2)
    await produce(service.url, topic, [f"v{i}".encode() for i in range(20)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    # A group with no members yet: positions committed by an operator, at the start.
    response = httpx.post(
        f"{service.url}/v1/vclusters/{VC}/groups/{group}/commit",
        json={"positions": [{"topic": topic, "epoch": 0, "shard": s, "offset": 0} for s in (0, 1)]},
        headers=HEADERS,
    )
    assert response.status_code == 204, response.text
    assert group in [g["name"] for g in as_json(xinfra(service.url, "list", "--json"))]
    described = as_json(xinfra(service.url, "describe", group, "--json"))
    lags = {s["shard"]: (s["lag"], s["end_offset"]) for s in described["shards"]}
    assert sum(lag for lag, _end in lags.values()) > 0
    assert all(lag == end for lag, end in lags.values())  # committed at 0: lag is the end
    human = xinfra(service.url, "describe", group)
    assert human.returncode == 0 and topic in human.stdout and "lag" in human.stdout
    # A live member blocks a reset unless --force.
    async with live_member(service.url, group, topic):
        refused = await run(service.url, "reset-offsets", group, "--topic", topic, "--to-latest")
        assert refused.returncode == 1 and "live members" in refused.stderr
        reset = as_json(
            await run(
                service.url,
                "reset-offsets",
                group,
                "--topic",
                topic,
                "--to-latest",
                "--force",
                "--json",
            )
        )
    assert {p["shard"]: p["offset"] for p in reset["positions"]} == {
        s: end for s, (_lag, end) in lags.items()
    }
    after = httpx.get(f"{service.url}/v1/vclusters/{VC}/groups/{group}", headers=HEADERS).json()
    assert [s["lag"] for s in after["shards"]] == [0, 0]
    # Bad input: an unknown group is exit 1 with its code; delete needs --force while m is there.
    missing = xinfra(service.url, "describe", f"nope-{uuid.uuid4().hex[:6]}")
    assert missing.returncode == 1 and "group_not_found" in missing.stderr
    async with live_member(service.url, group, topic):
        assert (await run(service.url, "delete", group)).returncode == 1
    assert as_json(xinfra(service.url, "delete", group, "--force", "--json")) == {"deleted": group}
    gone = httpx.get(f"{service.url}/v1/vclusters/{VC}/groups/{group}", headers=HEADERS)
    assert gone.status_code == 404 and gone.json()["code"] == "group_not_found"


def consume(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XINFRA_METADATA_URL": url, "XINFRA_TOKEN": ADMIN_TOKEN}
    return subprocess.run(
        [str(Path(sys.executable).parent / "xinfra"), "consume", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


async def test_consume_in_a_group_commits_and_the_next_run_resumes(
    service: ThreadService, kafka: str
) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(service.url, topic, shards=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    await produce(service.url, topic, [f"v{i}".encode() for i in range(10)])
    first = await asyncio.to_thread(
        consume, service.url, topic, "--group", group, "-n", "10", "--quiet"
    )
    assert first.returncode == 0, first.stderr
    assert sorted(first.stdout.split()) == sorted(f"v{i}" for i in range(10))
    await produce(service.url, topic, [b"late"])
    second = await asyncio.to_thread(
        consume, service.url, topic, "--group", group, "-n", "1", "--quiet"
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["late"]  # resumed from the first run's commit
