"""The metadata service SIGKILLed in the middle of a step: the restarted one resumes it.

The instance under test is a real process (``tests/metadata_service``'s
harness) on the live fixture's database and brokers.  A client that never
acknowledges holds the step at its wait, after its side effect (the target
epoch) and before its new state was written: the worst place to die.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import httpx
from sdk_live import VC, LiveService, needs_kafka, needs_northguard
from waiting import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "metadata_service"))
from ms_harness import ADMIN_TOKEN, restart, start_instance

pytestmark = [needs_kafka, needs_northguard]


def request(url: str, method: str, path: str, **body: Any) -> Any:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=url, timeout=90, headers=headers) as client:
        response = client.request(method, path, json=body or None)
    assert response.status_code < 300, response.text
    return response.json() if response.content else None


async def test_sigkill_while_a_step_waits_then_the_restarted_service_resumes_it(
    live: LiveService, kafka: str, northguard: str, tmp_path: Path
) -> None:
    topic = "crashing"
    base = f"/v1/vclusters/{VC}/topics/{topic}"
    await live.create_topic(topic, kafka, 2)
    await live.call(
        lambda c: c.request(
            "PUT",
            f"/v1/vclusters/{VC}/clients/silent-1",
            json={"kind": "consumer", "topics": [topic], "ttl_s": 120},
        )
    )
    process = start_instance(
        tmp_path, "victim", live.config.database_url, backend="real", seal_settle_s_max=30.0
    )
    try:
        url = str(process.url)
        await asyncio.to_thread(
            request, url, "POST", base + "/migration", target_cluster=northguard
        )
        step = asyncio.ensure_future(
            asyncio.to_thread(request, url, "POST", base + "/migration/advance", ack_timeout_s=120)
        )

        async def waiting_for_clients() -> bool:
            body = await asyncio.to_thread(request, url, "GET", base + "/migration")
            metadata = await asyncio.to_thread(request, url, "GET", base)
            return body["pending"] == "dual_write" and len(metadata["epochs"]) == 2

        await wait_until(waiting_for_clients, 30)
        process.kill()
        with contextlib.suppress(Exception):
            await step  # the connection died with the process
        await asyncio.to_thread(restart, process)

        status = await asyncio.to_thread(request, url, "GET", base + "/migration")
        assert (status["state"], status["pending"]) == ("planned", "dual_write")
        await live.call(lambda c: c.request("DELETE", f"/v1/vclusters/{VC}/clients/silent-1"))
        resumed = await asyncio.to_thread(
            request, url, "POST", base + "/migration/advance", ack_timeout_s=10
        )
        assert (resumed["state"], resumed["pending"], resumed["target_epoch"]) == (
            "dual_write",
            None,
            1,
        )
        metadata = await asyncio.to_thread(request, url, "GET", base)
        assert [(e["number"], e["state"]) for e in metadata["epochs"]] == [
            (0, "active"),
            (1, "dual_write"),
        ], json.dumps(metadata["epochs"])
        back = await asyncio.to_thread(
            request, url, "POST", base + "/migration/rollback", ack_timeout_s=10
        )
        assert back["state"] == "rolled_back"
        metadata = await asyncio.to_thread(request, url, "GET", base)
        assert [e["number"] for e in metadata["epochs"]] == [0]
    finally:
        process.stop()
