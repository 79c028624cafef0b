"""What a physical cluster must offer Xinfra: the backend contract.

The SDK, the migration and the Spark source use only this module; they never
import a backend.  ``backends/kafka`` and ``backends/northguard`` implement it
and pass one parametrized contract suite (``tests/contract``).

Shards, not partitions or ranges.  A physical topic is created over an ordered
list of key ranges from ``xinfra.keyspace``; shard *i* is the *i*-th range.
On Kafka it is partition *i* (the producer always names the partition; Kafka's
partitioner is never used), on Northguard the range with those bounds.

Promises every backend keeps:

* **Order.** Records one ``ShardProducer`` sends to one shard are stored in
  the order of the ``send`` calls and, inside a call, in list order, also when
  the backend retries internally (idempotent producer / sequence numbers).
* **Durability.** A ``send`` future resolves only after the records are
  committed: Kafka ``acks=all`` (in-sync replicas), Northguard fsynced on every
  replica of the active segment.  A resolved offset is never lost and never
  reassigned.  A failed future means the records *may or may not* be stored
  (at-least-once); nothing is reported stored that is not.
* **Visibility.** A reader sees a record only once it is committed, at the
  offset its producer was told, and reads each shard in offset order.
* **Offsets.** Offsets of a shard increase; they may have gaps (Kafka control
  records), so the next position after offset *o* is *o + 1*, never a count.
* **Errors.** Every failure is an ``xinfra.errors.XinfraError``:
  ``TopicNotFound``, ``ShardOutOfRange``, ``RecordTooLarge``,
  ``BackendUnavailable`` (retriable), ``Sealed``, ``CorruptData``...

Threading: every coroutine and ``send`` must be called from the event loop
that created the object.  Backends choose their own I/O model behind it.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from xinfra.errors import InvalidRequest
from xinfra.keyspace import KeyRange
from xinfra.model import ClusterKind, ConsumedRecord, PhysicalCluster, PhysicalTopicInfo, Record


@dataclass(frozen=True, slots=True)
class ProducerOptions:
    """Bounds of a shard producer.  Every buffer has a limit and a designed behaviour at it."""

    linger_ms: float = 5.0
    """How long a partial batch waits for more records before it is sent."""
    batch_bytes_max: int = 1 << 20
    """A batch is sent as soon as it holds this many payload bytes."""
    buffer_bytes_max: int = 64 << 20
    """Unacknowledged bytes a producer may hold; ``send`` raises ``Backpressure`` past it."""
    record_bytes_max: int = 1 << 20
    """A larger record raises ``RecordTooLarge`` at ``send`` and is never sent."""
    request_timeout_s: float = 30.0
    """A send not acknowledged in this time fails with ``Timeout`` (it may still be stored)."""


@dataclass(frozen=True, slots=True)
class ReaderOptions:
    fetch_bytes_max: int = 8 << 20
    """Bytes a reader may buffer ahead of the application, over all its shards."""
    record_type: type[tuple[Any, ...]] = ConsumedRecord
    """The tuple type ``poll`` returns: ``record_type(*record_prefix, *consumed_record)``."""
    record_prefix: tuple[Any, ...] = ()
    """Fields put before each record's own (``ConsumedRecord``'s), in the C pass that makes
    it: how the SDK gets its records, with their topic and epoch, made once.  Copying each
    backend record into the SDK's cost 2.8k instructions per record (a second object to
    make, free and scan for garbage) over the bare read loop's 8.5k; this, 0.6k."""

    def __post_init__(self) -> None:
        """A record type whose fields the prefix and a record do not fill exactly is refused.

        Not only a type check: the readers build records with ``tuple.__new__`` or in C,
        and the named tuples' fields are member descriptors (``xinfra.model.fast_fields``)
        that read their item with no bounds check, so a shorter record would be read out of
        bounds.
        """
        fields = getattr(self.record_type, "_fields", None)
        width = len(self.record_prefix) + len(ConsumedRecord._fields)
        if fields is not None and len(fields) != width:
            raise InvalidRequest(
                f"record_type {self.record_type.__name__} has {len(fields)} fields; "
                f"record_prefix and a record make {width}"
            )


class ShardProducer(abc.ABC):
    """An asynchronous, batching, per-shard ordered producer to one physical topic."""

    @abc.abstractmethod
    def send(self, shard: int, records: Sequence[Record]) -> asyncio.Future[list[int]]:
        """Queue records for one shard; the future resolves to their offsets, in order.

        Raises at once (before queueing anything) ``ShardOutOfRange``,
        ``RecordTooLarge`` or ``Backpressure``.  Later failures arrive
        through the future.
        """

    @abc.abstractmethod
    async def flush(self) -> None:
        """Return when every record sent before the call is acknowledged or failed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush, then release connections.  Idempotent."""


class ShardReader(abc.ABC):
    """A reader over some shards of one physical topic, each from its own offset."""

    @abc.abstractmethod
    def assign(self, positions: Mapping[int, int]) -> None:
        """Read exactly these shards, each from the given next offset.

        Replaces the previous assignment; records buffered for shards or
        offsets no longer assigned are dropped, never returned.
        """

    @abc.abstractmethod
    async def poll(self, max_records: int = 1000, timeout_s: float = 1.0) -> list[ConsumedRecord]:
        """Up to ``max_records`` committed records from the assigned shards.

        Each shard's records come in offset order, continuing where the last
        poll stopped.  Returns an empty list when nothing arrives in time.  The
        list is a new one, the caller's to keep or consume.  The records are
        ``ConsumedRecord``s, or what ``ReaderOptions.record_type`` and
        ``record_prefix`` asked for.
        """

    @abc.abstractmethod
    async def start_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        """Offset of the first retained record per shard (all shards when None)."""

    @abc.abstractmethod
    async def end_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        """Offset one past the last committed record per shard (the high watermark)."""

    @abc.abstractmethod
    async def offset_for_timestamp(self, shard: int, timestamp_ms: int) -> int:
        """The first offset whose record timestamp is at or after ``timestamp_ms``.

        The shard's end offset when no such record exists yet.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections.  Idempotent."""


class Backend(abc.ABC):
    """One physical cluster, as Xinfra sees it."""

    kind: ClusterKind

    @abc.abstractmethod
    async def check(self) -> None:
        """Raise ``BackendUnavailable`` unless the cluster answers now."""

    @abc.abstractmethod
    async def create_topic(
        self, name: str, ranges: Sequence[KeyRange], config: Mapping[str, str] | None = None
    ) -> PhysicalTopicInfo:
        """Create a physical topic whose shard *i* is ``ranges[i]``.

        ``ranges`` must cover the keyspace (``keyspace.check_covering``).
        Raises ``TopicAlreadyExists``; idempotent retries should describe first.
        """

    @abc.abstractmethod
    async def describe_topic(self, name: str) -> PhysicalTopicInfo:
        """Raise ``TopicNotFound`` when absent."""

    @abc.abstractmethod
    async def list_topics(self) -> list[str]: ...

    @abc.abstractmethod
    async def delete_topic(self, name: str) -> None:
        """Delete the topic and its data.  Raises ``TopicNotFound`` when absent."""

    async def seal_topic(self, name: str) -> dict[int, int]:
        """Refuse later appends where the backend can; the end offsets per shard.

        Called when an epoch is sealed, once its producers settled.  Northguard
        seals the topic natively, so a late producer gets ``Sealed``, never an
        acknowledgement, and the offsets are final.  Kafka cannot refuse appends
        by protocol: this default only reads the end offsets, and records that
        land past them later are reported as orphaned (``migration.orphans``).
        Idempotent.
        """
        reader = self.reader(name)
        try:
            return await reader.end_offsets()
        finally:
            await reader.close()

    @abc.abstractmethod
    def producer(self, topic: str, options: ProducerOptions | None = None) -> ShardProducer: ...

    @abc.abstractmethod
    def reader(self, topic: str, options: ReaderOptions | None = None) -> ShardReader: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


BACKEND_ENTRY_POINTS = "xinfra.backends"


def open_backend(cluster: PhysicalCluster) -> Backend:
    """The backend for a physical cluster, found by its kind among installed entry points.

    ``xinfra`` never imports a backend package: backends register themselves
    under the ``xinfra.backends`` entry-point group (see pyproject.toml), with
    a factory taking the ``PhysicalCluster``.
    """
    for entry in entry_points(group=BACKEND_ENTRY_POINTS):
        if entry.name == cluster.kind.value:
            factory = entry.load()
            backend: Backend = factory(cluster)
            return backend
    raise InvalidRequest(
        f"no backend installed for cluster kind {cluster.kind.value!r}; "
        "reinstall xinfra (`pip install -e .`) so its entry points are registered"
    )
