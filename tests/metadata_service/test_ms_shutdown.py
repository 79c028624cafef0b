"""A stopping instance answers its long-polls at once, with the metadata it has.

Left waiting, they ran into uvicorn's graceful-shutdown timeout, which cancels
each one with a traceback in the log and leaves the client without an answer
(seen at the end of every ``bench/sdk.py`` run: its clients' metadata watches).
A real instance process, stopped with SIGTERM, on MariaDB.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from ms_harness import admin_headers, start_instance
from test_ms_api import VC, wait_for


async def _waiting(http: httpx.AsyncClient) -> bool:
    metrics = (await http.get("/metrics")).text
    line = next(
        s for s in metrics.splitlines() if s.startswith("xinfra_metadata_long_poll_waiters")
    )
    return float(line.split()[-1]) > 0


async def test_sigterm_answers_a_waiting_long_poll_with_the_current_metadata(
    tmp_path: Path, mysql_url: str
) -> None:
    process = start_instance(tmp_path, "ms", mysql_url)
    try:
        async with httpx.AsyncClient(
            base_url=process.url, headers=admin_headers(), timeout=60
        ) as http:
            cluster = {"name": "k1", "kind": "kafka", "bootstrap": "memory-shutdown:9092"}
            assert (await http.post("/v1/clusters", json=cluster)).status_code == 201
            topic = {"name": "orders", "cluster": "k1", "shards": 1}
            assert (await http.post(f"/v1/vclusters/{VC}/topics", json=topic)).status_code == 201
            url = f"/v1/vclusters/{VC}/topics/orders/metadata"
            poll = asyncio.create_task(http.get(url, params={"after_version": 1, "timeout_s": 30}))
            await wait_for(lambda: _waiting(http))
            await asyncio.to_thread(process.stop)
            response = await asyncio.wait_for(poll, 30)
    finally:
        process.stop()
    assert response.status_code == 200, response.text
    assert response.json()["version"] == 1
    log = (tmp_path / "ms.log").read_text()
    assert "Exception in ASGI application" not in log, log[-2000:]
