"""The options of the ``xinfra`` Spark source, parsed once at planning.

Names follow Spark's Kafka source where one exists.  Every bad value raises
``InvalidRequest`` naming the option and saying what it accepts, so a typo
fails the query at planning, before any task runs.  Option names are
case-insensitive (Spark's own options are).

Positions in ``startingOffsets``/``endingOffsets`` are JSON per topic, epoch
and shard: ``{"orders": {"1": {"0": 42, "1": -2}}}`` reads shard 0 of epoch 1
from offset 42 and shard 1 from its earliest record.  -2 means earliest,
-1 latest (Kafka's convention).  A shard named in one epoch starts (ends)
there: its earlier epochs are skipped (read whole), its later ones read from
their beginning (not read).  Shards not named take the default.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from xinfra.errors import InvalidRequest

EARLIEST_OFFSET = -2
LATEST_OFFSET = -1

Positions = dict[str, dict[int, dict[int, int]]]
"""topic -> epoch -> shard -> offset, as given in ``startingOffsets``/``endingOffsets``."""

AtKind = Literal["earliest", "latest", "timestamp", "positions"]


@dataclass(frozen=True, slots=True)
class At:
    """Where a read starts or ends: earliest, latest, a timestamp (ms), or explicit positions."""

    kind: AtKind
    timestamp_ms: int = 0
    positions: Positions = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SourceOptions:
    metadata_url: str | None
    token: str | None
    virtual_cluster: str | None
    topics: tuple[str, ...]
    topic_pattern: re.Pattern[str] | None
    starting: At
    ending: At
    max_records_per_trigger: int | None
    min_partitions: int | None
    include_headers: bool
    fail_on_data_loss: bool


KNOWN = {
    "metadata.url": "metadata.url",
    "token": "token",
    "virtualcluster": "virtualCluster",
    "topics": "topics",
    "topicpattern": "topicPattern",
    "startingoffsets": "startingOffsets",
    "endingoffsets": "endingOffsets",
    "startingtimestamp": "startingTimestamp",
    "endingtimestamp": "endingTimestamp",
    "maxrecordspertrigger": "maxRecordsPerTrigger",
    "minpartitions": "minPartitions",
    "includeheaders": "includeHeaders",
    "failondataloss": "failOnDataLoss",
}
IGNORED = {"path"}
"""Options Spark may pass on its own."""


def parse_options(raw: Mapping[str, str], streaming: bool) -> SourceOptions:
    """Validate every option; raise ``InvalidRequest`` naming the first bad one."""
    get = _getter(raw, KNOWN, "source")

    topics_raw, pattern_raw = get("topics"), get("topicPattern")
    if (topics_raw is None) == (pattern_raw is None):
        raise InvalidRequest("set exactly one of options 'topics' and 'topicPattern'")
    topics: tuple[str, ...] = ()
    pattern: re.Pattern[str] | None = None
    if topics_raw is not None:
        topics = tuple(t.strip() for t in topics_raw.split(",") if t.strip())
        if not topics:
            raise InvalidRequest("option 'topics' names no topic: give a comma-separated list")
    else:
        assert pattern_raw is not None
        try:
            pattern = re.compile(pattern_raw)
        except re.error as error:
            raise InvalidRequest(
                f"option 'topicPattern' is not a regular expression: {error}"
            ) from None

    if streaming and (get("endingOffsets") is not None or get("endingTimestamp") is not None):
        name = "endingOffsets" if get("endingOffsets") is not None else "endingTimestamp"
        raise InvalidRequest(f"option {name!r} applies to batch reads only, not to readStream")
    starting = _at(
        get("startingOffsets"),
        get("startingTimestamp"),
        ("startingOffsets", "startingTimestamp"),
        default="latest" if streaming else "earliest",
        forbidden=None if streaming else "latest",
    )
    ending = _at(
        get("endingOffsets"),
        get("endingTimestamp"),
        ("endingOffsets", "endingTimestamp"),
        default="latest",
        forbidden="earliest",
    )
    if ending.kind == "positions" and any(
        offset == EARLIEST_OFFSET
        for epochs in ending.positions.values()
        for shards in epochs.values()
        for offset in shards.values()
    ):
        raise InvalidRequest("option 'endingOffsets' cannot end at -2 (earliest)")
    max_records = _positive(get("maxRecordsPerTrigger"), "maxRecordsPerTrigger")
    if max_records is not None and not streaming:
        raise InvalidRequest("option 'maxRecordsPerTrigger' applies to readStream only")
    return SourceOptions(
        metadata_url=get("metadata.url"),
        token=get("token"),
        virtual_cluster=get("virtualCluster"),
        topics=topics,
        topic_pattern=pattern,
        starting=starting,
        ending=ending,
        max_records_per_trigger=max_records,
        min_partitions=_positive(get("minPartitions"), "minPartitions"),
        include_headers=_bool(get("includeHeaders"), "includeHeaders", False),
        fail_on_data_loss=_bool(get("failOnDataLoss"), "failOnDataLoss", True),
    )


@dataclass(frozen=True, slots=True)
class WriteOptions:
    metadata_url: str | None
    token: str | None
    virtual_cluster: str | None
    topic: str
    explicit_shards: bool
    """Honour a ``shard`` column (``explicitShards``); without it the column is ignored."""


WRITE_KNOWN = {
    "metadata.url": "metadata.url",
    "token": "token",
    "virtualcluster": "virtualCluster",
    "topic": "topic",
    "explicitshards": "explicitShards",
}


def parse_write_options(raw: Mapping[str, str]) -> WriteOptions:
    """The options of ``df.write.format("xinfra")``; ``InvalidRequest`` names a bad one."""
    get = _getter(raw, WRITE_KNOWN, "sink")
    topic = get("topic")
    if not topic:
        raise InvalidRequest("option 'topic' is required: the virtual topic to write to")
    return WriteOptions(
        metadata_url=get("metadata.url"),
        token=get("token"),
        virtual_cluster=get("virtualCluster"),
        topic=topic,
        explicit_shards=_bool(get("explicitShards"), "explicitShards", False),
    )


def _getter(
    raw: Mapping[str, str], known: Mapping[str, str], role: str
) -> Callable[[str], str | None]:
    """Option values by name, any case; an unknown name fails with the closest known one."""
    given = {key.lower(): value for key, value in raw.items()}
    unknown = sorted(set(given) - set(known) - IGNORED)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {known[close[0]]!r}? " if close else ""
        raise InvalidRequest(
            f"unknown option {unknown[0]!r} of the xinfra {role}; {hint}known options: "
            + ", ".join(sorted(known.values()))
        )

    def get(name: str) -> str | None:
        value = given.get(name.lower())
        return value.strip() if value is not None else None

    return get


def include_headers(raw: Mapping[str, str]) -> bool:
    """Only ``includeHeaders``: what the schema needs, before Spark says batch or stream."""
    value = {key.lower(): value for key, value in raw.items()}.get("includeheaders")
    return _bool(value.strip() if value is not None else None, "includeHeaders", False)


def _at(
    offsets: str | None,
    timestamp: str | None,
    names: tuple[str, str],
    default: AtKind,
    forbidden: AtKind | None,
) -> At:
    offsets_name, timestamp_name = names
    if offsets is not None and timestamp is not None:
        raise InvalidRequest(
            f"set one of options {offsets_name!r} and {timestamp_name!r}, not both"
        )
    if timestamp is not None:
        timestamp_ms = _int(timestamp, timestamp_name)
        if timestamp_ms < 0:
            raise InvalidRequest(f"option {timestamp_name!r} must be milliseconds since the epoch")
        return At("timestamp", timestamp_ms=timestamp_ms)
    if offsets is None:
        return At(default)
    if offsets in ("earliest", "latest"):
        if offsets == forbidden:
            raise InvalidRequest(f"option {offsets_name!r} cannot be {offsets!r} here")
        return At(offsets)  # type: ignore[arg-type]
    return At("positions", positions=_positions(offsets, offsets_name))


def _positions(text: str, name: str) -> Positions:
    usage = (
        f'option {name!r} takes "earliest", "latest" or JSON per topic, epoch and shard, '
        'like {"orders": {"0": {"0": 42, "1": -2}}}'
    )
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequest(f"{usage}; got {text!r}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{usage}; got {text!r}")
    out: Positions = {}
    for topic, epochs in parsed.items():
        if not isinstance(epochs, dict):
            raise InvalidRequest(f"{usage}; topic {topic!r} maps to {epochs!r}")
        named: dict[int, int] = {}
        for epoch_key, shards in epochs.items():
            epoch = _index(epoch_key, f"{usage}; epoch {epoch_key!r}")
            if not isinstance(shards, dict):
                raise InvalidRequest(f"{usage}; epoch {epoch_key!r} maps to {shards!r}")
            for shard_key, offset in shards.items():
                shard = _index(shard_key, f"{usage}; shard {shard_key!r}")
                if not isinstance(offset, int) or isinstance(offset, bool) or offset < -2:
                    raise InvalidRequest(f"{usage}; offset {offset!r} of shard {shard}")
                if shard in named:
                    raise InvalidRequest(
                        f"option {name!r} names shard {shard} of topic {topic!r} in epochs "
                        f"{named[shard]} and {epoch}: give one position per shard"
                    )
                named[shard] = epoch
                out.setdefault(topic, {}).setdefault(epoch, {})[shard] = offset
    return out


def _index(text: object, message: str) -> int:
    if isinstance(text, str) and text.isdigit():
        return int(text)
    raise InvalidRequest(message)


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidRequest(f"option {name!r} must be an integer, got {text!r}") from None


def _positive(text: str | None, name: str) -> int | None:
    if text is None:
        return None
    value = _int(text, name)
    if value <= 0:
        raise InvalidRequest(f"option {name!r} must be a positive integer, got {text!r}")
    return value


def _bool(text: str | None, name: str, default: bool) -> bool:
    if text is None:
        return default
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise InvalidRequest(f"option {name!r} must be true or false, got {text!r}")
