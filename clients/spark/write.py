"""``df.write.format("xinfra")``: each Spark task sends its rows through the SDK producer.

Columns: ``value`` (binary or string, required), ``key`` (binary or string,
null for a keyless record), ``headers`` (array<struct<key string, value
binary>>) and ``shard`` (an integer, honoured only with ``explicitShards``).
The columns a read of the source adds (topic, epoch, offset, timestamp) are
ignored, so a DataFrame read from one topic can be written to another as it
is; any other column fails the write before a task runs, naming it, since a
misspelled ``key`` would otherwise silently send keyless records.

Why ``shard`` is ignored by default, unlike the ``partition`` column of
Spark's Kafka sink: every read of a topic carries a ``shard`` column, and it
names a shard of the topic read, not of the topic written.  Honouring it
would put each record in its source shard, and when the two topics' key
ranges differ (another shard count, a split) a key's records would land
outside its key's shard, silently breaking per-key routing and order.  So a
written record goes to its key's shard (keyless: the producer's sticky
choice) unless the user asks otherwise.  With ``explicitShards=true`` the
column is honoured: a keyless record goes to its shard; a keyed record must
name its key's shard in the topic's current epoch (or null), else the task
fails naming the column before it sends any row of that Arrow batch.  A
shard outside the topic fails likewise (``ShardOutOfRange``).

A task returns only once its producer has flushed and every record it sent is
acknowledged: a write Spark reports as successful lost nothing.  A failed task
fails the job with the producer's error; records other tasks (or the failed
one) already stored stay stored (at-least-once, like Spark's Kafka sink).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    DataType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
)

from clients import open_producer
from clients.spark.options import WriteOptions
from xinfra.errors import InvalidRequest, Timeout
from xinfra.keyspace import KeyRange, shard_of_key_in
from xinfra.model import Position

log = logging.getLogger(__name__)

BYTES_TYPES = (BinaryType, StringType)
SHARD_TYPES = (ByteType, ShortType, IntegerType, LongType)
READ_ONLY_COLUMNS = frozenset({"topic", "epoch", "offset", "timestamp"})
"""Columns of a read that a write ignores (and ``shard`` without ``explicitShards``)."""
USAGE = (
    "the xinfra sink takes columns value (binary or string), and optionally key (binary or "
    "string), headers (array<struct<key: string, value: binary>>) and, with option "
    "explicitShards=true, shard (integer)"
)


def check_schema(schema: StructType, explicit_shards: bool) -> None:
    """Raise ``InvalidRequest`` naming the first column the sink cannot write."""
    fields = {f.name: f.dataType for f in schema.fields}
    if "value" not in fields:
        raise InvalidRequest(f"no column 'value' to write; {USAGE}")
    for name, kind in fields.items():
        if name in READ_ONLY_COLUMNS or (name == "shard" and not explicit_shards):
            continue
        if name in ("key", "value"):
            ok = isinstance(kind, BYTES_TYPES)
        elif name == "headers":
            ok = _headers_type(kind)
        elif name == "shard":
            ok = isinstance(kind, SHARD_TYPES)
        else:
            raise InvalidRequest(f"column {name!r} cannot be written; {USAGE}")
        if not ok:
            raise InvalidRequest(
                f"column {name!r} has type {kind.simpleString()}, which cannot be written; {USAGE}"
            )


def _headers_type(kind: DataType) -> bool:
    if not isinstance(kind, ArrayType) or not isinstance(kind.elementType, StructType):
        return False
    inner = {f.name: f.dataType for f in kind.elementType.fields}
    return (
        set(inner) == {"key", "value"}
        and isinstance(inner["key"], StringType)
        and isinstance(inner["value"], BYTES_TYPES)
    )


@dataclass
class Written(WriterCommitMessage):
    """What one task wrote: records acknowledged per shard."""

    shards: dict[int, int] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return sum(self.shards.values())


class XinfraWriter(DataSourceArrowWriter):
    """Sends each task's Arrow batches through one SDK producer, flushed before the task ends."""

    def __init__(self, options: WriteOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Written:
        return asyncio.run(_send_all(self.options, iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        written = [m for m in messages if isinstance(m, Written)]
        log.info(
            "wrote %d records to %r in %d tasks",
            sum(m.records for m in written),
            self.options.topic,
            len(written),
        )

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to undo: acknowledged records stay (the sink is at-least-once)."""
        stored = sum(m.records for m in messages if isinstance(m, Written))
        log.warning(
            "write to %r failed; %d records acknowledged by finished tasks stay stored",
            self.options.topic,
            stored,
        )


async def _send_all(options: WriteOptions, batches: Iterator[pa.RecordBatch]) -> Written:
    topic = options.topic
    producer = await open_producer(
        options.metadata_url, options.token, options.virtual_cluster, topics=[topic]
    )
    written = Written()
    pending: list[asyncio.Future[Position]] = []
    try:
        for batch in batches:
            ranges = None
            if options.explicit_shards:
                metadata = await producer.metadata(topic)
                ranges = [s.key_range for s in metadata.current_epoch.shards]
            for key, value, headers, shard in rows(batch, topic, ranges):
                pending.append(
                    await producer.send(topic, value, key=key, headers=headers, shard=shard)
                )
            pending = _settle(pending, written)
        await producer.flush()
        if _settle(pending, written):
            raise Timeout(f"records sent to {topic!r} were not acknowledged when flush returned")
    finally:
        await producer.close()
    return written


def _settle(
    pending: list[asyncio.Future[Position]], written: Written
) -> list[asyncio.Future[Position]]:
    """Count the acknowledged sends, raise the first failure; the sends still open."""
    still: list[asyncio.Future[Position]] = []
    for future in pending:
        if not future.done():
            still.append(future)
            continue
        shard = future.result().shard  # raises the send's failure
        written.shards[shard] = written.shards.get(shard, 0) + 1
    return still


def rows(
    batch: pa.RecordBatch, topic: str, ranges: Sequence[KeyRange] | None
) -> list[tuple[Any, Any, Any, Any]]:
    """(key, value, headers, shard) per row, strings encoded as UTF-8.

    ``ranges`` are the key ranges of the topic's current epoch when
    ``explicitShards`` is on: the ``shard`` column is honoured, and a keyed
    row naming another shard than its key's raises ``InvalidRequest`` naming
    the column, before any row of the batch is sent.  ``None``: the column is
    ignored and every shard is ``None`` (the producer routes by key).
    """
    names = batch.schema.names
    count = batch.num_rows

    def column(name: str) -> list[Any]:
        if name not in names:
            return [None] * count
        values: list[Any] = batch.column(name).to_pylist()
        if pa.types.is_string(batch.schema.field(name).type):
            return [v.encode() if v is not None else None for v in values]
        return values

    headers: list[Any] = column("headers")
    headers = [tuple((h["key"], _bytes(h["value"])) for h in hs) if hs else () for hs in headers]
    keys = column("key")
    shards = column("shard") if ranges is not None else [None] * count
    if ranges is not None:
        for key, shard in zip(keys, shards, strict=True):
            if key is not None and shard is not None:
                home = shard_of_key_in(key, ranges) if 0 <= shard < len(ranges) else shard
                if home != shard:
                    raise InvalidRequest(
                        f"column 'shard' sends key {key!r} to shard {shard} of {topic!r}, whose "
                        f"current epoch keeps that key in shard {home}: a keyed record goes to "
                        "its key's shard (null the column for keyed rows, or drop option "
                        "'explicitShards' to route every record by its key)"
                    )
    return list(zip(keys, column("value"), headers, shards, strict=True))


def _bytes(value: bytes | str | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value
