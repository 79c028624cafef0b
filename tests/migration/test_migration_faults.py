"""Faults during a migration, on real brokers: the state machine resumes or reports, nothing is
lost silently.

* the metadata service SIGKILLed in the cut-over step (while the source's seal settles, and
  while the step waits for clients), then restarted: the step resumes, under keyed load; and
  in the last step and in a rollback, after their side effect (the dual-write step is
  ``test_migration_restart``'s);
* a producer process SIGKILLed mid-dual-write: every record it was told is acknowledged is read
  back, once, at its position, in per-key order;
* a consumer process that never acknowledges (SIGSTOPped): the step pauses naming it, and
  resumes once it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sdk_live import (
    VC,
    LiveService,
    assert_per_key_order,
    needs_kafka,
    needs_northguard,
)
from test_migration_live import call, load, more
from test_sdk_epochs import _read_from_beginning
from waiting import wait_until

from xinfra.model import Position
from xinfra.services.process import ManagedProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "metadata_service"))
from ms_harness import ADMIN_TOKEN, restart, start_instance

pytestmark = [needs_kafka, needs_northguard]
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def request(url: str, method: str, path: str, **body: Any) -> Any:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=url, timeout=90, headers=headers) as client:
        response = client.request(method, path, json=body or None)
    assert response.status_code < 300, response.text
    return response.json() if response.content else None


async def silent(live: LiveService, topic: str, kind: str) -> None:
    """A registered client of ``topic`` that acknowledges no metadata version."""
    await live.call(
        lambda c: c.request(
            "PUT",
            f"/v1/vclusters/{VC}/clients/silent-{kind}",
            json={"kind": kind, "topics": [topic], "ttl_s": 120},
        )
    )


class Via:
    """``load``'s view of a service: tokens minted by ``live`` (same database), calls to ``url``."""

    def __init__(self, url: str, live: LiveService) -> None:
        self.url = url
        self.client_token = live.client_token


@pytest.mark.parametrize("phase", ["settling", "waiting"])
async def test_service_sigkilled_in_the_cut_over_step_resumes_it_under_load(
    live: LiveService, kafka: str, northguard: str, tmp_path: Path, phase: str
) -> None:
    """``settling``: killed while the source's end offsets are owed (a producer has not
    acknowledged the seal); ``waiting``: killed after the seal, while the step waits for a
    consumer.  Either way the restarted service finishes the step, once."""
    topic = f"cut-{phase}"
    base = f"/v1/vclusters/{VC}/topics/{topic}"
    await live.create_topic(topic, kafka, 2)
    victim = start_instance(
        tmp_path, "victim", live.config.database_url, backend="real", seal_settle_s_max=120.0
    )
    try:
        url = str(victim.url)
        victim_live = Via(url, live)
        async with load(victim_live, topic) as stream:  # the producer follows the victim
            await more(stream)
            await asyncio.to_thread(
                request, url, "POST", base + "/migration", target_cluster=northguard
            )
            await asyncio.to_thread(
                request, url, "POST", base + "/migration/advance", ack_timeout_s=30
            )
            await more(stream)
            await silent(live, topic, "producer" if phase == "settling" else "consumer")
            step = asyncio.ensure_future(
                asyncio.to_thread(
                    request, url, "POST", base + "/migration/advance", ack_timeout_s=120
                )
            )

            async def in_phase() -> bool:
                body = await asyncio.to_thread(request, url, "GET", base + "/migration")
                source = (await asyncio.to_thread(request, url, "GET", base))["epochs"][0]
                settled = source["end_offsets"] is not None
                return (
                    body["pending"] == "cut_over"
                    and source["state"] == "sealed"
                    and settled == (phase == "waiting")
                )

            await wait_until(in_phase, 30)
            victim.kill()
            with contextlib.suppress(Exception):
                await step  # the connection died with the process
            await asyncio.to_thread(restart, victim)
            status = await asyncio.to_thread(request, url, "GET", base + "/migration")
            assert (status["state"], status["pending"]) == ("dual_write", "cut_over")
            await more(stream)  # the producer goes on through the crash
            await live.call(
                lambda c: c.request(
                    "DELETE",
                    f"/v1/vclusters/{VC}/clients/silent-{'producer' if phase == 'settling' else 'consumer'}",
                )
            )
            resumed = await asyncio.to_thread(
                request, url, "POST", base + "/migration/advance", ack_timeout_s=30
            )
            assert (resumed["state"], resumed["pending"]) == ("cut_over", None), resumed
            await wait_until(lambda: stream.in_epoch(1) >= 100, 30)
            done = await asyncio.to_thread(
                request, url, "POST", base + "/migration/advance", ack_timeout_s=30
            )
            assert done["state"] == "completed"
            await more(stream)
        metadata = await asyncio.to_thread(request, url, "GET", base)
        assert [(e["number"], e["state"]) for e in metadata["epochs"]] == [
            (0, "sealed"),
            (1, "active"),
        ]
        events = [h["event"] for h in done["history"]]
        assert events == ["planned", "dual_write", "cut_over", "completed"]
        # Read through the victim: the fixture's instance has no ZooKeeper to hear its changes.
        records = await _read_from_beginning(victim_live, [topic], len(stream.acked))
        check_acknowledged(records, stream.acked)
    finally:
        victim.stop()


def check_acknowledged(records: list[Any], acked: dict[bytes, Position]) -> None:
    """Every acknowledged record read once, at its position, in per-key order; an unacknowledged
    one (a producer killed before its answer) may be there, but also only once."""
    values = [r.value for r in records]
    twice = len(values) - len(set(values))
    assert twice == 0, f"{twice} records read twice"
    lost = set(acked) - set(values)
    assert not lost, f"{len(lost)} acknowledged records lost, e.g. {sorted(lost)[:5]}"
    assert_per_key_order(values)
    moved = [
        (r.value, r.position) for r in records if r.value in acked and r.position != acked[r.value]
    ]
    assert not moved, f"read elsewhere than acknowledged: {moved[:3]}"


@contextlib.contextmanager
def client_process(
    tmp_path: Path, role: str, url: str, token: str, topic: str, client_id: str, lease_s: float
) -> Iterator[tuple[ManagedProcess, Path]]:
    out = tmp_path / f"{client_id}.out"
    process = ManagedProcess(
        name=client_id,
        argv=[
            sys.executable,
            str(HERE / "migration_client.py"),
            role,
            url,
            token,
            VC,
            topic,
            client_id,
            str(out),
            str(lease_s),
        ],
        log_path=tmp_path / f"{client_id}.log",
        url=url,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    process.start().wait_ready(lambda: out.exists() and out.read_text().startswith("ready\n"))
    try:
        yield process, out
    finally:
        process.stop()


def acknowledged(out: Path) -> dict[bytes, Position]:
    acked: dict[bytes, Position] = {}
    for line in out.read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) == 4:  # a line cut by the SIGKILL is not an acknowledgement seen
            value, epoch, shard, offset = parts
            acked[value.encode()] = Position(int(epoch), int(shard), int(offset))
    return acked


async def test_a_producer_sigkilled_mid_dual_write_loses_nothing_acknowledged(
    live: LiveService, kafka: str, northguard: str, tmp_path: Path
) -> None:
    topic = "killed-writer"
    await live.create_topic(topic, kafka, 3)
    token = await live.client_token("killed-writer")
    with client_process(tmp_path, "producer", live.url, token, topic, "writer-1", 3.0) as (
        writer,
        out,
    ):
        await wait_until(lambda: len(acknowledged(out)) >= 200, 30)
        await call(live, "POST", topic, target_cluster=northguard)
        dual = await call(live, "POST", topic, "/advance", expected_state="dual_write")
        assert dual["late_clients"] == []  # the writer runs the dual-write version now
        mark = len(acknowledged(out))
        await wait_until(lambda: len(acknowledged(out)) >= mark + 300, 30)
        writer.kill()
    acked = acknowledged(out)
    # Its lease expires: the cut-over waits for it no longer (its seal settles without it).
    cut = await call(live, "POST", topic, "/advance", expected_state="cut_over", ack_timeout_s=60)
    assert (cut["state"], cut["paused"]) == ("cut_over", False)
    done = await call(live, "POST", topic, "/advance", expected_state="completed")
    assert done["state"] == "completed"
    records = await _read_from_beginning(live, [topic], len(acked))
    check_acknowledged(records, acked)
    assert {r.position.epoch for r in records} == {0}, "nothing was written after the cut-over"


async def test_a_consumer_that_never_acknowledges_pauses_the_migration_naming_it(
    live: LiveService, kafka: str, northguard: str, tmp_path: Path
) -> None:
    topic = "stuck-reader"
    await live.create_topic(topic, kafka, 2)
    token = await live.client_token("stuck-reader")
    with client_process(tmp_path, "consumer", live.url, token, topic, "reader-1", 60.0) as (
        reader,
        _out,
    ):
        await call(live, "POST", topic, target_cluster=northguard)
        os.killpg(reader.pid, signal.SIGSTOP)  # alive (its lease holds) but answers nothing
        try:
            paused = await call(live, "POST", topic, "/advance", ack_timeout_s=1)
            assert (paused["state"], paused["pending"], paused["paused"]) == (
                "planned",
                "dual_write",
                True,
            )
            assert paused["late_clients"] == ["reader-1"]
            status = await call(live, "GET", topic)
            assert status["paused"] and status["late_clients"] == ["reader-1"]
            assert status["history"][-1]["event"] == "paused"
            assert status["history"][-1]["late_clients"] == ["reader-1"]
        finally:
            os.killpg(reader.pid, signal.SIGCONT)
        resumed = await call(live, "POST", topic, "/advance", ack_timeout_s=30)
        assert (resumed["state"], resumed["paused"], resumed["late_clients"]) == (
            "dual_write",
            False,
            [],
        )


@pytest.mark.parametrize("step", ["completed", "rollback"])
async def test_service_sigkilled_in_the_last_step_or_a_rollback_resumes_it(
    live: LiveService, kafka: str, northguard: str, tmp_path: Path, step: str
) -> None:
    """Killed after the step's side effect (the target activated, or dropped), while it waits
    for a client: the restarted service finishes the same step, and nothing else."""
    topic = f"last-{step}"
    base = f"/v1/vclusters/{VC}/topics/{topic}"
    await live.create_topic(topic, kafka, 2)
    victim = start_instance(tmp_path, "victim", live.config.database_url, backend="real")
    try:
        url = str(victim.url)

        def call_victim(method: str, path: str = "/migration", **body: Any) -> Any:
            return request(url, method, base + path, **body)

        await asyncio.to_thread(call_victim, "POST", target_cluster=northguard)
        await asyncio.to_thread(call_victim, "POST", "/migration/advance", ack_timeout_s=30)
        if step == "completed":
            await asyncio.to_thread(call_victim, "POST", "/migration/advance", ack_timeout_s=30)
        await silent(live, topic, "consumer")
        suffix = "/migration/advance" if step == "completed" else "/migration/rollback"
        pending = asyncio.ensure_future(
            asyncio.to_thread(call_victim, "POST", suffix, ack_timeout_s=120)
        )

        async def side_effect_done() -> bool:
            body = await asyncio.to_thread(call_victim, "GET")
            epochs = (await asyncio.to_thread(call_victim, "GET", ""))["epochs"]
            states = [(e["number"], e["state"]) for e in epochs]
            done = states == (
                [(0, "sealed"), (1, "active")] if step == "completed" else [(0, "active")]
            )
            return body["pending"] == step and done

        await wait_until(side_effect_done, 30)
        victim.kill()
        with contextlib.suppress(Exception):
            await pending
        await asyncio.to_thread(restart, victim)
        status = await asyncio.to_thread(call_victim, "GET")
        assert status["pending"] == step
        await live.call(
            lambda c: c.request("DELETE", f"/v1/vclusters/{VC}/clients/silent-consumer")
        )
        final = await asyncio.to_thread(call_victim, "POST", suffix, ack_timeout_s=30)
        assert (final["state"], final["pending"]) == (
            "completed" if step == "completed" else "rolled_back",
            None,
        )
        events = [h["event"] for h in final["history"] if h["event"] != "paused"]
        assert events[-1] == final["state"] and events.count(final["state"]) == 1
    finally:
        victim.stop()
