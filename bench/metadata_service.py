"""Metadata service: topic-metadata reads/s and latency, and cross-instance change propagation.

Set-up (started here): MySQL (``ensure_mysql``, a fresh database), ZooKeeper,
and two service instances (``python -m metadata_service serve``) sharing both.
N virtual topics are written straight into the store (backend-free, the same
rows a create writes), so the bench measures the service, not a broker.

Figures:

* reads: 32 keep-alive connections issue ``GET .../topics/{random}/metadata``
  against instance A for a fixed time (closed loop, saturation) → reads/s.
  By Little's law the saturated latency is about 32 / throughput, so latency
  targets are measured in a second, paced phase at half the saturated rate
  (the same 32 connections, each sending on a fixed schedule).
* propagation: a long-poll waits on instance B; a config change is sent to
  instance A; the time from sending the change to B's answer (p50/p99).

The load generator is a minimal raw HTTP/1.1 client in this process (httpx
would cost more CPU than the server); the service runs in its own process.

    .venv/bin/python bench/metadata_service.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from metadata_service.migrate import upgrade_database  # noqa: E402
from metadata_service.store import tables as t  # noqa: E402
from xinfra.keyspace import shard_ranges  # noqa: E402
from xinfra.services.mysql import ensure_mysql  # noqa: E402
from xinfra.services.ports import free_port  # noqa: E402
from xinfra.services.process import ManagedProcess  # noqa: E402
from xinfra.services.zookeeper import start_zookeeper  # noqa: E402

TOKEN = "bench-" + uuid.uuid4().hex
VC = "default"
CONNECTIONS = 32


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def machine() -> dict[str, object]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def populate(database_url: str, topics: int, shards: int) -> None:
    engine = sa.create_engine(database_url)
    now = int(time.time() * 1000)
    ranges = json.dumps([r.to_json() for r in shard_ranges(shards)])
    with engine.begin() as c:
        c.execute(
            t.physical_clusters.insert().values(
                name="kafka",
                kind="kafka",
                bootstrap="127.0.0.1:9092",
                attributes="{}",
                version=1,
                updated_ms=now,
            )
        )
    batch = 1000
    for start in range(0, topics, batch):
        names = [f"topic-{i:06d}" for i in range(start, min(start + batch, topics))]
        with engine.begin() as c:
            c.execute(
                t.topics.insert(),
                [
                    {
                        "virtual_cluster": VC,
                        "name": n,
                        "config": "{}",
                        "sealed": False,
                        "state": "active",
                        "version": 1,
                        "updated_ms": now,
                    }
                    for n in names
                ],
            )
            c.execute(
                t.epochs.insert(),
                [
                    {
                        "virtual_cluster": VC,
                        "topic": n,
                        "number": 0,
                        "cluster": "kafka",
                        "physical_topic": f"xinfra.{VC}.{n}.0.bench",
                        "shards": ranges,
                        "state": "active",
                        "end_offsets": None,
                        "mirror_of": None,
                        "intent": "ready",
                        "updated_ms": now,
                    }
                    for n in names
                ],
            )
    engine.dispose()


def start_instance(run_dir: Path, name: str, database_url: str, zookeeper: str) -> ManagedProcess:
    port = free_port()
    env = {
        **os.environ,
        "XINFRA_ADMIN_TOKEN": TOKEN,
        "XINFRA_RUN_DIR": str(run_dir / name),
        "PYTHONPATH": str(ROOT),
    }
    process = ManagedProcess(
        name=f"metadata-{name}",
        argv=[
            sys.executable,
            "-m",
            "metadata_service",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--zookeeper",
            zookeeper,
            "--notify",
            "zookeeper",
            "--no-upgrade",
            "--log-level",
            "warning",
        ],
        log_path=run_dir / f"{name}.log",
        url=f"http://127.0.0.1:{port}",
        env=env,
    )

    def ready() -> bool:
        try:
            return httpx.get(f"{process.url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    return process.start().wait_ready(ready, timeout_s=60)


async def warm(port: int, topics: int) -> float:
    """Read every topic once (fills the instance's cache from MySQL); returns reads/s."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(topics):
        queue.put_nowait(index)
    start = time.perf_counter()

    async def worker() -> None:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as http:
            while not queue.empty():
                index = queue.get_nowait()
                response = await http.get(f"/v1/vclusters/{VC}/topics/topic-{index:06d}/metadata")
                assert response.status_code == 200, response.text

    await asyncio.gather(*(worker() for _ in range(CONNECTIONS)))
    return topics / (time.perf_counter() - start)


async def read_load(
    port: int, topics: int, seconds: float, rate_per_connection: float | None
) -> tuple[int, list[float], int]:
    """Closed loop (rate None) or paced; returns (ok reads, latencies in s, errors)."""
    latencies: list[float] = []
    errors = 0
    ok = 0
    deadline = time.perf_counter() + seconds

    async def worker(seed: int) -> None:
        nonlocal errors, ok
        rng = random.Random(seed)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        next_send = time.perf_counter()
        try:
            while time.perf_counter() < deadline:
                if rate_per_connection is not None:
                    next_send += rng.expovariate(rate_per_connection)
                    delay = next_send - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                path = f"/v1/vclusters/{VC}/topics/topic-{rng.randrange(topics):06d}/metadata"
                request = (
                    f"GET {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
                ).encode()
                start = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                lower = head.lower()
                index = lower.index(b"content-length:") + len(b"content-length:")
                length = int(lower[index : lower.index(b"\r\n", index)])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - start)
                if head[9:12] == b"200":
                    ok += 1
                else:
                    errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(worker(i) for i in range(CONNECTIONS)))
    return ok, latencies, errors


async def propagation(a_url: str, b_url: str, samples: int) -> list[float]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    topic = "topic-000000"
    url = f"/v1/vclusters/{VC}/topics/{topic}"
    delays: list[float] = []
    async with (
        httpx.AsyncClient(base_url=a_url, headers=headers, timeout=30) as a,
        httpx.AsyncClient(base_url=b_url, headers=headers, timeout=30) as b,
    ):
        version = (await b.get(f"{url}/metadata")).json()["version"]
        for i in range(samples):
            poll = asyncio.create_task(
                b.get(f"{url}/metadata", params={"after_version": version, "timeout_s": 20})
            )
            # The long-poll must be parked on B before the change: wait for B's waiter gauge.
            while True:
                text = (await b.get("/metrics")).text
                if any(
                    line.startswith("xinfra_metadata_long_poll_waiters ")
                    and float(line.split()[1]) >= 1
                    for line in text.splitlines()
                ):
                    break
                await asyncio.sleep(0.002)
            start = time.perf_counter()
            response = await a.patch(url, json={"config": {"i": str(i)}})
            assert response.status_code == 200, response.text
            answer = await poll
            delays.append(time.perf_counter() - start)
            body = answer.json()
            assert body["version"] > version, body
            version = body["version"]
    return delays


async def run(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="xinfra-bench-metadata-"))
    mysql = ensure_mysql(work)
    database = f"xinfra_bench_{uuid.uuid4().hex[:8]}"
    database_url = mysql.create_database(database)
    zookeeper = start_zookeeper(work / "zookeeper")
    instances: list[ManagedProcess] = []
    try:
        upgrade_database(database_url)
        started = time.perf_counter()
        populate(database_url, args.topics, args.shards)
        populate_s = time.perf_counter() - started
        instances = [start_instance(work, name, database_url, zookeeper.url) for name in ("a", "b")]
        a, b = instances
        a_port = int(a.url.rsplit(":", 1)[1])
        # Warm-up: every topic read once, uncached (A's cache fills from MySQL).
        warmup_reads_per_s = await warm(a_port, args.topics)
        ok, latencies, errors = await read_load(a_port, args.topics, args.seconds, None)
        reads_per_s = ok / args.seconds
        paced_rate = max(1.0, reads_per_s * 0.5 / CONNECTIONS)
        paced_ok, paced_latencies, paced_errors = await read_load(
            a_port, args.topics, args.seconds, paced_rate
        )
        delays = await propagation(a.url, b.url, args.samples)
        ms = 1000.0
        figures = {
            "topics": args.topics,
            "shards_per_topic": args.shards,
            "populate_s": round(populate_s, 2),
            "connections": CONNECTIONS,
            "warmup_reads_per_s": round(warmup_reads_per_s, 1),
            "reads_per_s": round(reads_per_s, 1),
            "read_latency_ms_p50_saturated": round(percentile(latencies, 0.5) * ms, 3),
            "read_latency_ms_p99_saturated": round(percentile(latencies, 0.99) * ms, 3),
            "paced_reads_per_s": round(paced_ok / args.seconds, 1),
            "read_latency_ms_p50": round(percentile(paced_latencies, 0.5) * ms, 3),
            "read_latency_ms_p99": round(percentile(paced_latencies, 0.99) * ms, 3),
            "read_errors": errors + paced_errors,
            "propagation_samples": len(delays),
            "propagation_ms_p50": round(percentile(delays, 0.5) * ms, 3),
            "propagation_ms_p99": round(percentile(delays, 0.99) * ms, 3),
            "propagation_ms_mean": round(statistics.fmean(delays) * ms, 3),
        }
        return figures
    finally:
        for instance in instances:
            instance.stop()
        zookeeper.stop()
        mysql.drop_database(database)
        mysql.stop()


def target(value: float, goal: float, op: str) -> dict[str, object]:
    met = value >= goal if op == ">=" else value <= goal
    return {"value": value, "target": goal, "op": op, "met": bool(met)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Reduced size, under a minute.")
    args = parser.parse_args()
    args.topics = 1000 if args.quick else 10_000
    args.shards = 8
    args.seconds = 4.0 if args.quick else 15.0
    args.samples = 50 if args.quick else 200
    figures = asyncio.run(run(args))
    print(json.dumps(figures, indent=2), file=sys.stderr)
    result = {
        "bench": "metadata_service",
        "machine": machine(),
        "figures": figures,
        "targets": {
            "reads_per_s": target(figures["reads_per_s"], 5000, ">="),  # type: ignore[arg-type]
            "read_latency_ms_p99": target(figures["read_latency_ms_p99"], 5.0, "<="),  # type: ignore[arg-type]
            "propagation_ms_p99": target(figures["propagation_ms_p99"], 100.0, "<="),  # type: ignore[arg-type]
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
