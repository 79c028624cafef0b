"""Metadata service: topic-metadata reads/s and open-loop latency, a 90%-hit mix and cold reads,
and cross-instance change propagation.

Set-up (started here): MySQL (``ensure_mysql``: the machine's MariaDB, a fresh
database), ZooKeeper, and two service instances (``python -m metadata_service
serve``, one process each) sharing both.  N virtual topics (8 shards, epoch 0 on
one Kafka cluster, each with its own version and config) are written straight
into the store, the rows a create writes, so the bench measures the service,
not a broker.  The reads go to instance A; B only takes the propagation probe.

What a real client pays: every read is ``GET /v1/vclusters/default/topics/{t}/metadata``
with a **client token** (16 tokens of role ``client`` made through the API,
spread over the connections: the same token check as any client, no
bootstrap-admin shortcut), over keep-alive HTTP/1.1 from a raw-socket load
generator in this process (an HTTP library would cost more CPU than the
server).  **Every response is checked**: status 200, the right topic, virtual
cluster, version (ETag and body), config, physical topic and shard count.

How each cache state is produced (and measured, never assumed):

* the 90%-hit mix: the metadata cache of A holds ``2 * hot`` topics
  (``XINFRA_METADATA_CACHE_TOPICS_MAX``); 90% of reads go to a hot set of
  ``hot = N / 10`` topics (uniform), 10% walk the other topics in a fixed
  shuffled cycle.  The cycle is longer than the cache, so each of those reads
  finds its topic evicted (LRU) and pays the uncached path: one store query;
* cold (0% hits): every read walks that cycle.
* before each mix run, the hot set is read once, untimed (a cold run before it
  evicted it): the mix is measured in its steady state.
* The hit rates printed are A's own counters (``xinfra_metadata_cache_lookups``,
  ``xinfra_metadata_token_cache_lookups``) over each run, and MariaDB's buffer
  pool hit rate (server-wide: other work on the server counts too).

Each round, for the mix and for cold (their order alternates by round):

* saturation: 32 connections, closed loop, for ``seconds`` → reads/s;
* open loop: reads scheduled at the target rate (5000/s mix, 1000/s cold),
  sent on 64 connections as they fall due, latency counted from each read's
  scheduled time (a stall shows in every read scheduled during it) → p50/p99.

Then propagation: a long-poll parked on B, a config change sent to A, the time
from the change to B's answer.  Figures are medians over rounds with their
min-max spread.

Beside each saturated rate, ``*_service_cpu_us_per_read`` is instance A's own
CPU time (``/proc/<pid>/stat``) per read: on a shared machine it says what a
read costs the service when the rate says mostly how busy the machine was
(``machine.loadavg``).  The load generator shares the machine's 2 cores.

Targets (issue 11): mix ≥ 5000 reads/s and its p99 < 5 ms at 5000/s open-loop;
cold ≥ 1000 reads/s; propagation p99 ≤ 100 ms.  A wrong answer stops the bench
(exit 2, the error names the read and what it got).

    .venv/bin/python bench/metadata_service.py --quick
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pymysql
import sqlalchemy as sa
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import (  # noqa: E402  (bench/report.py: what every bench shares)
    OpenLoop,
    Rounds,
    alternating,
    bench_parser,
    cpu_s,
    delta,
    finish,
    guard,
    latency_figures,
    percentile,
    prometheus_counters,
    rounds_of,
    target,
)
from service import start_metadata_service  # noqa: E402

from metadata_service.migrate import upgrade_database  # noqa: E402
from metadata_service.store import tables as t  # noqa: E402
from xinfra.keyspace import shard_ranges  # noqa: E402
from xinfra.services.mysql import MysqlServer, ensure_mysql  # noqa: E402
from xinfra.services.process import ManagedProcess  # noqa: E402
from xinfra.services.zookeeper import start_zookeeper  # noqa: E402

BENCH = "metadata_service"
ADMIN_TOKEN = "bench-admin-" + uuid.uuid4().hex
VC = "default"
SHARDS = 8
CLIENT_TOKENS = 16
SATURATION_CONNECTIONS = 32
OPEN_LOOP_CONNECTIONS = 64
HOT_SHARE = 0.9
MIX_RATE_PER_S = 5000.0
COLD_RATE_PER_S = 1000.0
PROPAGATION_TOPIC = "propagation"


@dataclass(frozen=True)
class Topic:
    """What a correct answer for one topic says."""

    name: str
    version: int
    config_value: str
    physical_topic: str


def topic_of(index: int) -> Topic:
    return Topic(
        name=f"topic-{index:06d}",
        version=1 + index % 7,
        config_value=str(index),
        physical_topic=f"xinfra.{VC}.topic-{index:06d}.0.bench",
    )


def populate(database_url: str, topics: int) -> None:
    """The rows a create writes, for ``topics`` topics and the propagation probe's topic."""
    engine = sa.create_engine(database_url)
    now = int(time.time() * 1000)
    ranges = json.dumps([r.to_json() for r in shard_ranges(SHARDS)])
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
    names = [topic_of(i) for i in range(topics)]
    names.append(Topic(PROPAGATION_TOPIC, 1, "", f"xinfra.{VC}.{PROPAGATION_TOPIC}.0.bench"))
    for start in range(0, len(names), 1000):
        chunk = names[start : start + 1000]
        with engine.begin() as c:
            c.execute(
                t.topics.insert(),
                [
                    {
                        "virtual_cluster": VC,
                        "name": topic.name,
                        "config": json.dumps({"i": topic.config_value}),
                        "sealed": False,
                        "state": "active",
                        "version": topic.version,
                        "updated_ms": now,
                    }
                    for topic in chunk
                ],
            )
            c.execute(
                t.epochs.insert(),
                [
                    {
                        "virtual_cluster": VC,
                        "topic": topic.name,
                        "number": 0,
                        "cluster": "kafka",
                        "physical_topic": topic.physical_topic,
                        "shards": ranges,
                        "state": "active",
                        "end_offsets": None,
                        "mirror_of": None,
                        "intent": "ready",
                        "updated_ms": now,
                    }
                    for topic in chunk
                ],
            )
    engine.dispose()


def client_tokens(url: str, count: int) -> list[str]:
    """Client tokens made the way an operator makes them (POST /v1/tokens)."""
    tokens = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        for i in range(count):
            response = http.post(
                "/v1/tokens", json={"name": f"bench-client-{i}", "role": "client", "scope": VC}
            )
            response.raise_for_status()
            tokens.append(response.json()["token"])
    return tokens


class BadResponse(AssertionError):
    pass


class Connection:
    """One keep-alive HTTP/1.1 connection reading topic metadata with one client token."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.token = token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    async def read(self, topic: Topic) -> None:
        """One read, its answer checked; raises ``BadResponse`` on anything wrong."""
        assert self.reader is not None and self.writer is not None
        self.writer.write(
            (
                f"GET /v1/vclusters/{VC}/topics/{topic.name}/metadata HTTP/1.1\r\n"
                f"Host: bench\r\nAuthorization: Bearer {self.token}\r\n\r\n"
            ).encode()
        )
        head = (await self.reader.readuntil(b"\r\n\r\n")).lower()
        start = head.index(b"content-length:") + 15
        body = await self.reader.readexactly(int(head[start : head.index(b"\r\n", start)]))
        check(topic, head, body)


def check(topic: Topic, head: bytes, body: bytes) -> None:
    if head[9:12] != b"200":
        raise BadResponse(f"{topic.name}: {head[:12]!r} {body[:200]!r}")
    if f'etag: "{topic.version}"'.encode() not in head:
        raise BadResponse(f"{topic.name}: ETag is not version {topic.version}: {head!r}")
    doc = json.loads(body)
    meta = doc["topic"]
    epoch = doc["epochs"][0]
    if (
        doc["version"] != topic.version
        or meta["name"] != topic.name
        or meta["virtual_cluster"] != VC
        or meta["config"] != {"i": topic.config_value}
        or len(doc["epochs"]) != 1
        or epoch["physical_topic"] != topic.physical_topic
        or len(epoch["shards"]) != SHARDS
        or set(doc["clusters"]) != {"kafka"}
    ):
        raise BadResponse(f"{topic.name} (version {topic.version}): wrong answer {doc}")


class Workload:
    """Which topic each read asks for: hot topics at ``hot_share``, else the next of the cold cycle."""

    def __init__(self, topics: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.hot = [topic_of(i) for i in range(topics // 10)]
        cold = [topic_of(i) for i in range(topics // 10, topics)]
        self.rng.shuffle(cold)
        self.cold = cold
        self.cold_next = 0

    def next_cold(self) -> Topic:
        topic = self.cold[self.cold_next]
        self.cold_next = (self.cold_next + 1) % len(self.cold)
        return topic

    def picker(self, hot_share: float) -> Callable[[], Topic]:
        rng, hot = self.rng, self.hot
        if hot_share <= 0:
            return self.next_cold
        return lambda: rng.choice(hot) if rng.random() < hot_share else self.next_cold()


async def connections(port: int, tokens: list[str], count: int) -> list[Connection]:
    return list(
        await asyncio.gather(
            *(Connection(port, tokens[i % len(tokens)]).open() for i in range(count))
        )
    )


async def warm(port: int, tokens: list[str], topics: list[Topic]) -> None:
    """Read each topic once (untimed): the steady state a mix is measured in."""
    pool = await connections(port, tokens, SATURATION_CONNECTIONS)

    async def reader(connection: Connection, share: list[Topic]) -> None:
        for topic in share:
            await connection.read(topic)

    try:
        await asyncio.gather(*(reader(c, topics[i :: len(pool)]) for i, c in enumerate(pool)))
    finally:
        for connection in pool:
            connection.close()


async def saturate(port: int, tokens: list[str], pick: Callable[[], Topic], seconds: float) -> int:
    """Closed loop on ``SATURATION_CONNECTIONS`` connections: reads done in ``seconds``."""
    pool = await connections(port, tokens, SATURATION_CONNECTIONS)
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(connection: Connection) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await connection.read(pick())
            done += 1

    try:
        await asyncio.gather(*(worker(c) for c in pool))
    finally:
        for connection in pool:
            connection.close()
    return done


async def open_loop(
    port: int, tokens: list[str], pick: Callable[[], Topic], rate: float, seconds: float
) -> tuple[list[float], float]:
    """Reads scheduled at ``rate``; returns their latencies (ms, from each scheduled time, reads
    left unanswered counted with their latency so far) and the answered reads per second."""
    pool = await connections(port, tokens, OPEN_LOOP_CONNECTIONS)
    schedule = OpenLoop(rate, seconds)
    due: asyncio.Queue[int | None] = asyncio.Queue()
    latencies: list[float] = []

    in_flight: dict[int, int] = {}
    completed = 0

    async def worker(connection: Connection) -> None:
        nonlocal completed
        while (index := await due.get()) is not None:
            in_flight[id(connection)] = index
            await connection.read(pick())
            del in_flight[id(connection)]
            latencies.append(schedule.latency_ms(index))
            completed += 1

    workers = [asyncio.create_task(worker(c)) for c in pool]
    try:
        schedule.begin()
        while not schedule.done:
            await asyncio.sleep(schedule.wait_s())
            for index in schedule.due():
                due.put_nowait(index)
            if any(w.done() for w in workers):
                break  # a worker failed: its exception is raised below
        for _ in workers:
            due.put_nowait(None)
        # A backlog gets ``seconds`` more to drain; reads still queued or in flight then count
        # with their latency so far (a lower bound), so an overload cannot hide in the tail.
        finished, _ = await asyncio.wait(workers, timeout=seconds)
        for task in finished:
            task.result()
        if len(finished) < len(workers):
            late: list[int] = []
            while not due.empty():
                index = due.get_nowait()
                if index is not None:
                    late.append(index)
            late.extend(in_flight.values())
            latencies.extend(schedule.latency_ms(index) for index in late)
    finally:
        for task in workers:
            task.cancel()
        for connection in pool:
            connection.close()
    return latencies, completed / (time.perf_counter() - schedule.start)


def hit_rate(counters: dict[str, float], name: str) -> float:
    hits = counters.get(f'{name}{{result="hit"}}', 0.0)
    misses = counters.get(f'{name}{{result="miss"}}', 0.0)
    return hits / (hits + misses) if hits + misses else float("nan")


class BufferPool:
    """MariaDB's InnoDB buffer-pool hit rate over a run (server-wide counters)."""

    def __init__(self, mysql: MysqlServer) -> None:
        self.mysql = mysql

    def sample(self) -> dict[str, float]:
        with self.mysql.connect() as connection, connection.cursor() as cursor:
            cursor.execute("SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_read%'")
            return {name: float(value) for name, value in cursor.fetchall()}

    @staticmethod
    def hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
        requests = after["Innodb_buffer_pool_read_requests"] - before.get(
            "Innodb_buffer_pool_read_requests", 0
        )
        disk = after["Innodb_buffer_pool_reads"] - before.get("Innodb_buffer_pool_reads", 0)
        return 1 - disk / requests if requests else float("nan")


async def measured(
    name: str,
    a: ManagedProcess,
    pool: BufferPool,
    run: Callable[[], Any],
) -> tuple[Any, float, dict[str, float]]:
    """Run ``run``; return its result, A's CPU seconds over it, and the hit rates of every cache
    on the path (A's metadata and token caches, MariaDB's buffer pool) counted over it."""
    metrics = f"{a.url}/metrics"
    before, innodb = prometheus_counters(metrics, "xinfra_metadata_"), pool.sample()
    cpu_before = cpu_s(a.pid)
    result = await run()
    cpu = cpu_s(a.pid) - cpu_before
    counted = delta(before, prometheus_counters(metrics, "xinfra_metadata_"))
    return (
        result,
        cpu,
        {
            f"{name}_metadata_cache_hit_rate": hit_rate(
                counted, "xinfra_metadata_cache_lookups_total"
            ),
            f"{name}_token_cache_hit_rate": hit_rate(
                counted, "xinfra_metadata_token_cache_lookups_total"
            ),
            f"{name}_innodb_buffer_pool_hit_rate": BufferPool.hit_rate(innodb, pool.sample()),
        },
    )


async def phase(
    name: str,
    hot_share: float,
    rate: float,
    workload: Workload,
    a: ManagedProcess,
    tokens: list[str],
    seconds: float,
    pool: BufferPool,
) -> dict[str, float]:
    pick = workload.picker(hot_share)
    port = int(a.url.rsplit(":", 1)[1])
    if hot_share > 0:
        await warm(port, tokens, workload.hot)  # a cold run before evicted the hot set
    done, cpu, saturated = await measured(
        f"{name}_saturated", a, pool, lambda: saturate(port, tokens, pick, seconds)
    )
    (latencies, answered_per_s), _cpu, paced = await measured(
        name, a, pool, lambda: open_loop(port, tokens, pick, rate, seconds)
    )
    return {
        f"{name}_reads_per_s": done / seconds,
        f"{name}_service_cpu_us_per_read": cpu / done * 1e6,
        **saturated,
        f"{name}_open_loop_rate_per_s": rate,
        f"{name}_open_loop_reads_per_s": answered_per_s,
        **latency_figures(f"{name}_latency_ms", latencies),
        **paced,
    }


async def propagation(a_url: str, b_url: str, token: str, samples: int) -> list[float]:
    """Change on A → answer of a long-poll parked on B (ms)."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    url = f"/v1/vclusters/{VC}/topics/{PROPAGATION_TOPIC}"
    delays: list[float] = []
    async with (
        httpx.AsyncClient(base_url=a_url, headers=admin, timeout=30) as a,
        httpx.AsyncClient(
            base_url=b_url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as b,
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
            delays.append((time.perf_counter() - start) * 1000)
            body = answer.json()
            assert body["version"] == version + 1 and body["topic"]["config"] == {"i": str(i)}
            version = body["version"]
    return delays


async def run(args: Any) -> tuple[Rounds, dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="xinfra-bench-metadata-"))
    mysql = ensure_mysql(work)
    server = mysql_version(mysql.host, mysql.port)
    database = f"xinfra_bench_{uuid.uuid4().hex[:8]}"
    database_url = mysql.create_database(database)
    zookeeper = start_zookeeper(work / "zookeeper")
    instances: list[ManagedProcess] = []
    hot = args.topics // 10
    cache_topics_max = 2 * hot
    try:
        upgrade_database(database_url)
        populate(database_url, args.topics)
        instances = [
            start_metadata_service(
                work,
                name,
                admin_token=ADMIN_TOKEN,
                database_url=database_url,
                zookeeper=zookeeper.url,
                env={"XINFRA_METADATA_CACHE_TOPICS_MAX": str(cache_topics_max)},
            )
            for name in ("a", "b")
        ]
        a, b = instances
        port = int(a.url.rsplit(":", 1)[1])
        tokens = client_tokens(a.url, CLIENT_TOKENS)
        workload = Workload(args.topics, seed=11)
        pool = BufferPool(mysql)
        # Warm-up: every code path exercised once (the mix warms its hot set itself).
        await saturate(port, tokens, workload.picker(HOT_SHARE), 1.0)
        rounds = Rounds()
        delays_all: list[float] = []
        phases = {
            "mix": (HOT_SHARE, MIX_RATE_PER_S),
            "cold": (0.0, COLD_RATE_PER_S),
        }
        for order in alternating(args.rounds, list(phases)):
            for name in order:
                hot_share, rate = phases[name]
                rounds.update(
                    await phase(name, hot_share, rate, workload, a, tokens, args.seconds, pool)
                )
            delays = await propagation(a.url, b.url, tokens[0], args.samples)
            delays_all.extend(delays)
            rounds.add("propagation_ms_p50", percentile(delays, 0.5))
            rounds.add("propagation_ms_p99", percentile(delays, 0.99))
        rounds.set("propagation_samples", len(delays_all))
        rounds.set("propagation_ms_max", round(max(delays_all), 2))
        config = {
            "topics": args.topics,
            "shards_per_topic": SHARDS,
            "hot_topics": hot,
            "hot_share": HOT_SHARE,
            "metadata_cache_topics_max": cache_topics_max,
            "cold_cycle_topics": args.topics - hot,
            "token_cache_s": 5.0,
            "client_tokens": CLIENT_TOKENS,
            "saturation_connections": SATURATION_CONNECTIONS,
            "open_loop_connections": OPEN_LOOP_CONNECTIONS,
            "seconds_per_run": args.seconds,
            "rounds": args.rounds,
            "propagation_samples_per_round": args.samples,
            "service": "python -m metadata_service serve (uvicorn, one process), ZooKeeper notifier",
            "store": f"MySQL {mysql.host}:{mysql.port}, server shared with other work",
            "mysql": server,
        }
        return rounds, config
    finally:
        for instance in instances:
            instance.stop()
        zookeeper.stop()
        mysql.drop_database(database)
        mysql.stop()
        shutil.rmtree(work, ignore_errors=True)


def mysql_version(host: str, port: int) -> str:
    connection = pymysql.connect(host=host, port=port, user="root", connect_timeout=3)
    with connection, connection.cursor() as cursor:
        cursor.execute("SELECT VERSION()")
        return str(cursor.fetchone()[0])


def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    args.rounds = rounds_of(args)
    args.topics = 1000 if args.quick else 10_000
    args.seconds = 3.0 if args.quick else 8.0
    args.samples = 30 if args.quick else 60
    rounds, config = uvloop.run(run(args))
    figures = rounds.figures()
    print(json.dumps(figures, indent=2), file=sys.stderr)
    targets = {
        "mix_reads_per_s": target(figures["mix_reads_per_s"], MIX_RATE_PER_S, ">="),
        "mix_latency_ms_p99": target(figures["mix_latency_ms_p99"], 5.0, "<="),
        "cold_reads_per_s": target(figures["cold_reads_per_s"], COLD_RATE_PER_S, ">="),
        "propagation_ms_p99": target(figures["propagation_ms_p99"], 100.0, "<="),
    }
    finish(
        BENCH,
        figures,
        targets,
        no_fail=args.no_fail,
        spread=rounds.spread(),
        config=config,
        mysql=config["mysql"],
    )


if __name__ == "__main__":
    guard(BENCH, main)
