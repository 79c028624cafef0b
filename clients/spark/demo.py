"""``xinfra demo spark``: records per key counted by Spark across a Kafka and a Northguard epoch.

On the local stack (the settings' metadata URL, token and virtual cluster,
like every ``xinfra`` command): a new topic gets its first epoch on a Kafka
cluster, keyed records go there, a Northguard epoch is added (the Kafka one
sealed) and more records go there.  Spark (``local[2]``) then counts records
per key with ``spark.read.format("xinfra")``, and an SDK consumer counts them
too; the two counts are printed side by side and must agree.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from clients import open_consumer, open_producer
from xinfra.errors import InvalidRequest
from xinfra.model import ClusterKind
from xinfra.rest import MetadataClient

POLL_RECORDS = 5000
READ_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Stack:
    """Where the demo runs: the service, a token allowed to create topics, the virtual cluster."""

    url: str
    token: str | None
    virtual_cluster: str


def pick_clusters(admin: MetadataClient) -> tuple[str, str]:
    """The first registered Kafka cluster and the first Northguard one."""
    clusters = admin.list_clusters()
    by_kind: dict[str, str] = {}
    for cluster in clusters:
        by_kind.setdefault(str(cluster["kind"]), str(cluster["name"]))
    missing = [
        k.value for k in (ClusterKind.KAFKA, ClusterKind.NORTHGUARD) if k.value not in by_kind
    ]
    if missing:
        raise InvalidRequest(
            f"the demo needs a {' and a '.join(missing)} cluster registered; found "
            f"{[c['name'] for c in clusters]} (start the local stack with `xinfra up`)"
        )
    return by_kind[ClusterKind.KAFKA.value], by_kind[ClusterKind.NORTHGUARD.value]


async def _produce(stack: Stack, topic: str, seqs: range, keys: int) -> None:
    producer = await open_producer(stack.url, stack.token, stack.virtual_cluster, topics=[topic])
    try:
        futures = [
            await producer.send(topic, b"record-%d" % seq, key=b"key-%d" % (seq % keys))
            for seq in seqs
        ]
        await producer.flush()
        for future in futures:
            await future  # raises a failed send
    finally:
        await producer.close()


async def _sdk_counts(stack: Stack, topic: str, total: int) -> Counter[str]:
    consumer = await open_consumer(stack.url, stack.token, stack.virtual_cluster, topics=[topic])
    counts: Counter[str] = Counter()
    try:
        await consumer.assign(topic)
        deadline = asyncio.get_running_loop().time() + READ_TIMEOUT_S
        while counts.total() < total:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the SDK read {counts.total()} of {total} records")
            for record in await consumer.poll(POLL_RECORDS, 1.0):
                counts[(record.key or b"").decode()] += 1
    finally:
        await consumer.close()
    return counts


def run_demo(
    spark: Any, stack: Stack, topic: str, records: int, keys: int, shards: int
) -> dict[str, Any]:
    """Create and fill the topic, count per key both ways; the result as a JSON-able dict."""
    with MetadataClient(stack.url, token=stack.token) as admin:
        kafka, northguard = pick_clusters(admin)
        admin.create_topic(stack.virtual_cluster, topic, kafka, shards)
        half = records // 2
        asyncio.run(_produce(stack, topic, range(half), keys))
        metadata = admin.add_epoch(stack.virtual_cluster, topic, northguard)
        asyncio.run(_produce(stack, topic, range(half, records), keys))
    sdk = asyncio.run(_sdk_counts(stack, topic, records))
    frame = (
        spark.read.format("xinfra")
        .option("metadata.url", stack.url)
        .option("virtualCluster", stack.virtual_cluster)
        .option("topics", topic)
        .options(**({"token": stack.token} if stack.token else {}))
        .load()
    )
    per_epoch = {row.epoch: row["count"] for row in frame.groupBy("epoch").count().collect()}
    rows = frame.selectExpr("cast(key as string) as key").groupBy("key").count().collect()
    spark_counts = {row.key: row["count"] for row in rows}
    names = sorted(set(spark_counts) | set(sdk), key=lambda k: (len(k), k))
    return {
        "topic": topic,
        "epochs": [
            {"epoch": e.number, "cluster": e.cluster, "records": per_epoch.get(e.number, 0)}
            for e in metadata.epochs
        ],
        "counts": [
            {"key": k, "spark": spark_counts.get(k, 0), "sdk": sdk.get(k, 0)} for k in names
        ],
        "spark_total": sum(spark_counts.values()),
        "sdk_total": sdk.total(),
        "match": spark_counts == dict(sdk),
    }


def local_spark() -> Any:
    """A ``local[2]`` session with the source registered; workers run this interpreter."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import clients.spark

    session = (
        SparkSession.builder.master("local[2]")
        .appName("xinfra-demo-spark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    clients.spark.register(session)
    return session


def default_topic() -> str:
    return f"demo-spark-{uuid.uuid4().hex[:8]}"
