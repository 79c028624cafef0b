"""The shared model: what the metadata service stores, the SDK reads and the CLI prints.

Metadata objects are pydantic models (validated at every boundary, serialised
to the REST API).  ``Record``, ``ConsumedRecord`` and ``Position`` sit on the
data path, where a pydantic model per record would cost more than the I/O:
``Record`` is a C type with a dataclass's behaviour (``xinfra/_records.c``),
and the two made once per record on the hot paths, ``ConsumedRecord`` and
``Position``, are named tuples (built in C, several times faster than a frozen
dataclass).  ``ConsumedRecord``'s fields
are made member descriptors by the C extension ``xinfra._records``
(``fast_fields``): CPython 3.11 specialises reading them, not a named tuple's
own field getters.

Key ranges travel as pairs of decimal strings because 2**64 does not fit a
JSON number safely.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import repeat
from operator import add
from typing import Annotated, Any, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator

from xinfra._records import Record as Record
from xinfra._records import fast_fields as fast_fields
from xinfra._records import record_fields
from xinfra.keyspace import SHARD_COUNT_MAX, KeyRange
from xinfra.names import NAME_PATTERN

Name = Annotated[str, Field(pattern=NAME_PATTERN, min_length=1, max_length=200)]

KeyRangeField = Annotated[
    KeyRange,
    PlainValidator(lambda v: v if isinstance(v, KeyRange) else KeyRange.from_json(v)),
    PlainSerializer(lambda r: r.to_json(), return_type=list[str]),
]


class ClusterKind(enum.StrEnum):
    KAFKA = "kafka"
    NORTHGUARD = "northguard"


class EpochState(enum.StrEnum):
    ACTIVE = "active"  # producers write here
    DUAL_WRITE = "dual_write"  # a migration target or source receiving mirrored writes
    SEALED = "sealed"  # immutable; end offsets known


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PhysicalCluster(_Model):
    """A Kafka or Northguard cluster that physically stores epochs."""

    name: Name
    kind: ClusterKind
    bootstrap: str = Field(min_length=1, max_length=1000, description="host:port[,host:port...]")
    attributes: dict[str, str] = Field(default_factory=dict)


class VirtualCluster(_Model):
    """A namespace of virtual topics that may span several physical clusters."""

    name: Name
    description: str = Field(default="", max_length=1000)


class Shard(_Model):
    """Shard *index* of an epoch: partition *index* on Kafka, the range with these bounds on Northguard."""

    index: int = Field(ge=0, lt=SHARD_COUNT_MAX)
    key_range: KeyRangeField


class Epoch(_Model):
    """One period of a virtual topic's history, stored on one physical cluster.

    ``end_offsets`` is set once the epoch is sealed: shard index to the offset
    one past its last record.  ``mirror_of`` names the epoch whose records this
    one mirrors during a migration; readers skip the mirrored prefix.
    """

    number: int = Field(ge=0)
    cluster: Name
    physical_topic: str = Field(min_length=1, max_length=249)
    shards: list[Shard]
    state: EpochState = EpochState.ACTIVE
    end_offsets: dict[int, int] | None = None
    mirror_of: int | None = None


class VirtualTopic(_Model):
    virtual_cluster: Name
    name: Name
    config: dict[str, str] = Field(default_factory=dict)
    sealed: bool = False


class TopicMetadata(_Model):
    """Everything a client needs to produce to and consume from a virtual topic.

    ``version`` increases with every change; clients long-poll for a newer one
    and report the version they run on.
    """

    topic: VirtualTopic
    version: int = Field(ge=0)
    epochs: list[Epoch]
    clusters: dict[str, PhysicalCluster]

    @property
    def current_epoch(self) -> Epoch:
        return self.epochs[-1]

    @property
    def write_epochs(self) -> list[Epoch]:
        """The epochs a producer writes to: every unsealed one, oldest first (source before target)."""
        return [epoch for epoch in self.epochs if epoch.state != EpochState.SEALED]


Header = tuple[str, bytes]


@dataclass
class _RecordFields:
    """``Record``'s fields as ``dataclasses`` knows them, so ``replace``, ``fields`` and
    ``asdict`` take a ``Record`` as they took the dataclass it replaced.

    ``Record`` itself (``xinfra/_records.c``): ``Record(value, key=None, headers=(),
    timestamp_ms=None)``, what a producer writes; key, value and headers are opaque
    bytes.  Every application builds one per record, so it is a C type:
    ``Record(value=v)`` is one vectorcall where the slotted dataclass it replaced ran a
    Python ``__init__`` (callgrind: 3.5k instructions; a frozen one 5.9k).  Mutable as
    that dataclass was, though a record is not to be modified once sent (a producer
    may still hold it for a retry); equal and hashable by value, pickled by value,
    ``__match_args__`` and a dataclass's repr.
    """

    value: bytes | None
    key: bytes | None = None
    headers: tuple[Header, ...] = ()
    timestamp_ms: int | None = None  # None: the producer stamps the send time


record_fields(_RecordFields.__dataclass_fields__)


class ConsumedRecord(NamedTuple):
    """A record as read back from one shard of one physical topic, with its offset.

    A named tuple: readers make one per record, and ``tuple.__new__`` makes it
    in C where a frozen dataclass costs a Python ``__setattr__`` per field.
    """

    shard: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...] = ()


fast_fields(ConsumedRecord)
"""Its fields are member descriptors, read with one specialised load (``xinfra/_records.c``).
Every ``ConsumedRecord`` must hold all six items: build them with the class, ``_make``,
``prefixed`` or the readers' C conversion, never ``tuple.__new__`` with a shorter row."""


TupleT = TypeVar("TupleT", bound=tuple[Any, ...])


def prefixed(
    cls: type[TupleT], prefixes: Iterable[tuple[Any, ...]], rows: Iterable[tuple[Any, ...]]
) -> Iterator[TupleT]:
    """``cls(*prefix, *row)`` for each pair, made in C (``tuple.__new__`` over ``map``).

    How the read path builds a record per row without a Python frame each:
    a reader prefixes decoded rows with (shard, offset) into ``ConsumedRecord``,
    the SDK prefixes those with (topic, epoch) into its own record.
    """
    return map(tuple.__new__, repeat(cls), map(add, prefixes, rows))


class Position(NamedTuple):
    """Where a record is, or where a consumer is: (epoch, shard, offset).

    A named tuple, not a dataclass: the producer makes one per record on its
    hot path, and a tuple is made several times faster.  Ordered as a tuple.
    """

    epoch: int
    shard: int
    offset: int

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard": self.shard, "offset": self.offset}


@dataclass(frozen=True, slots=True)
class PhysicalTopicInfo:
    """What a backend reports about one physical topic."""

    name: str
    shards: list[KeyRange]
    config: dict[str, str] = field(default_factory=dict)
    sealed: bool = False


MIRROR_HEADER = "xinfra.mirror"
"""Header a migration target record carries: the source position it mirrors.

Readers crossing from a source epoch into the epoch that mirrors it skip every
record whose mirrored source offset is below the source's end offset: those
records were already delivered from the source.  This is what makes the
read-through exact (no loss, no duplicate) across a dual-write migration.
"""


def mirror_header(source: Position) -> Header:
    return (MIRROR_HEADER, f"{source.epoch}:{source.shard}:{source.offset}".encode())


def mirrored_position(headers: tuple[Header, ...]) -> Position | None:
    """The source position a mirrored record carries, or None for an ordinary record."""
    for name, value in headers:
        if name == MIRROR_HEADER:
            epoch, shard, offset = value.split(b":")
            return Position(int(epoch), int(shard), int(offset))
    return None
