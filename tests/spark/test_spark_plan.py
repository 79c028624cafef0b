"""The Spark source's planning rules, without Spark or services: options, admission, splitting.

These are the pure parts of ``clients.spark``: what a plan covers given the
metadata and the offsets the backends report.  The end-to-end behaviour on
real brokers is ``test_spark_source.py``.
"""

from __future__ import annotations

import pytest

from clients.spark.options import parse_options
from clients.spark.plan import (
    Slice,
    admit,
    offsets_from_json,
    offsets_to_json,
    readable_epochs,
    split,
)
from xinfra.errors import InvalidRequest, OffsetOutOfRange
from xinfra.keyspace import shard_of_key, shard_ranges
from xinfra.model import (
    ClusterKind,
    Epoch,
    EpochState,
    PhysicalCluster,
    Shard,
    TopicMetadata,
    VirtualTopic,
)


def topic(*epochs: Epoch) -> TopicMetadata:
    return TopicMetadata(
        topic=VirtualTopic(virtual_cluster="default", name="t"),
        version=1,
        epochs=list(epochs),
        clusters={"k": PhysicalCluster(name="k", kind=ClusterKind.KAFKA, bootstrap="x:1")},
    )


def epoch(
    number: int,
    shards: int = 2,
    ends: dict[int, int] | None = None,
    state: EpochState | None = None,
) -> Epoch:
    """Sealed when given end offsets, active otherwise, unless ``state`` says."""
    return Epoch(
        number=number,
        cluster="k",
        physical_topic=f"p{number}",
        shards=[Shard(index=i, key_range=r) for i, r in enumerate(shard_ranges(shards))],
        state=state or (EpochState.SEALED if ends is not None else EpochState.ACTIVE),
        end_offsets=ends,
    )


def test_readable_epochs_stop_at_the_first_epoch_without_end_offsets() -> None:
    sealed, active = epoch(0, ends={0: 5, 1: 5}), epoch(1)
    dual = epoch(2, state=EpochState.DUAL_WRITE)
    assert readable_epochs(topic(sealed, active, dual)) == [sealed, active]
    retiring = sealed.model_copy(update={"end_offsets": None})  # two-phase seal under way
    assert readable_epochs(topic(retiring, active)) == [retiring]


def test_admit_shares_the_limit_by_backlog_and_opens_an_epoch_only_after_the_one_before() -> None:
    view = {"t": topic(epoch(0, ends={0: 10, 1: 30}), epoch(1))}
    available = {("t", 0, 0): 10, ("t", 0, 1): 30, ("t", 1, 0): 50, ("t", 1, 1): 50}
    first = {("t", 1, 0): 0, ("t", 1, 1): 0}
    start = {("t", 0, 0): 0, ("t", 0, 1): 0}
    step = admit(view, start, available, first, 20)
    assert step == {("t", 0, 0): 5, ("t", 0, 1): 15}, "in proportion to backlog, epoch 1 shut"
    assert sum(step[k] - start[k] for k in start) == 20
    # Shard 0 of epoch 0 finishes first: shard 0 of epoch 1 opens, shard 1 still waits.
    step = admit(view, {("t", 0, 0): 10, ("t", 0, 1): 15}, available, first, 10)
    assert step[("t", 0, 0)] == 10 and ("t", 1, 1) not in step
    assert step[("t", 0, 1)] + step.get(("t", 1, 0), 0) == 15 + 10
    # Without a limit everything is admitted, through the epoch boundary.
    assert admit(view, start, available, first, None) == available
    # Nothing new: the same offsets (Spark then runs no batch).
    assert admit(view, dict(available), available, {}, 7) == available


def test_admit_makes_progress_with_a_limit_below_the_shard_count() -> None:
    view = {"t": topic(epoch(0, shards=4))}
    available = {("t", 0, s): 100 for s in range(4)}
    step = admit(view, {k: 0 for k in available}, available, {}, 2)
    assert sum(step.values()) == 2


def test_split_honours_min_partitions_in_proportion_to_size() -> None:
    pieces = [Slice("t", 0, 0, 0, 90, "{}", "p"), Slice("t", 0, 1, 100, 110, "{}", "p")]
    out = split(pieces, 10)
    assert len(out) >= 10
    assert sum(s.size for s in out) == 100
    assert [(s.start, s.end) for s in out if s.shard == 0] == [
        (i, i + 10) for i in range(0, 90, 10)
    ]
    assert [(s.start, s.end) for s in out if s.shard == 1] == [(100, 110)]
    assert split(pieces, 2) == pieces


def test_offsets_round_trip_through_checkpoint_json() -> None:
    offsets = {("a", 0, 1): 5, ("a", 1, 0): 0, ("b", 3, 2): 99}
    body = offsets_to_json(offsets)
    assert body == {"a": {"0": {"1": 5}, "1": {"0": 0}}, "b": {"3": {"2": 99}}}
    assert offsets_from_json(body) == offsets


@pytest.mark.parametrize(
    ("raw", "streaming", "named"),
    [
        ({"topics": "t", "topicPattern": "t.*"}, False, "topicPattern"),
        ({"topics": "t", "startingOffsets": "[1]"}, False, "startingOffsets"),
        ({"topics": "t", "startingOffsets": '{"t": {"x": {"0": 1}}}'}, False, "startingOffsets"),
        (
            {"topics": "t", "startingOffsets": '{"t": {"0": {"0": 1}, "1": {"0": 2}}}'},
            False,
            "startingOffsets",
        ),
        (
            {"topics": "t", "startingOffsets": "earliest", "startingTimestamp": "1"},
            False,
            "startingTimestamp",
        ),
        ({"topics": "t", "endingTimestamp": "-5"}, False, "endingTimestamp"),
        ({"topics": "t", "endingOffsets": "earliest"}, False, "endingOffsets"),
        ({"topics": "t", "endingOffsets": '{"t": {"0": {"0": -2}}}'}, False, "endingOffsets"),
        ({"topics": "t", "endingOffsets": "latest"}, True, "endingOffsets"),
        ({"topics": "t", "maxRecordsPerTrigger": "x"}, True, "maxRecordsPerTrigger"),
        ({"topics": "t", "failOnDataLoss": "maybe"}, True, "failOnDataLoss"),
        ({"topics": "t", "maxrecordspertriger": "5"}, True, "maxRecordsPerTrigger"),
    ],
)
def test_bad_options_name_themselves(raw: dict[str, str], streaming: bool, named: str) -> None:
    with pytest.raises(InvalidRequest, match=f"'{named}'"):
        parse_options(raw, streaming)


def test_option_defaults_follow_the_kafka_source() -> None:
    batch = parse_options({"TOPICS": "a, b"}, streaming=False)
    assert batch.topics == ("a", "b")
    assert (batch.starting.kind, batch.ending.kind) == ("earliest", "latest")
    assert batch.fail_on_data_loss and not batch.include_headers
    stream = parse_options({"topics": "a", "maxRecordsPerTrigger": "10"}, streaming=True)
    assert stream.starting.kind == "latest" and stream.max_records_per_trigger == 10


def test_the_writer_ignores_a_shard_column_unless_explicit_shards_and_checks_keyed_rows() -> None:
    """A read's ``shard`` names a shard of the topic read: written elsewhere as it is, it must not
    route records (the key does).  With explicitShards a keyless row goes to its shard, and a keyed
    row naming another shard than its key's fails, naming the column, before the batch is sent."""
    import pyarrow as pa
    from pyspark.sql.types import StringType, StructField, StructType

    from clients.spark.options import parse_write_options
    from clients.spark.write import check_schema, rows

    ranges = shard_ranges(3)
    key = b"k1"
    home = shard_of_key(key, 3)
    other = (home + 1) % 3
    frame = pa.record_batch(
        {
            "key": pa.array([key, None, key], pa.binary()),
            "value": pa.array([b"a", b"b", b"c"], pa.binary()),
            "shard": pa.array([other, 2, None], pa.int32()),
            "offset": pa.array([7, 8, 9], pa.int64()),
        }
    )
    assert [row[3] for row in rows(frame, "t", None)] == [None, None, None], "column ignored"
    with pytest.raises(InvalidRequest, match=f"column 'shard' sends key b'k1' to shard {other}"):
        rows(frame, "t", ranges)
    agreeing = frame.set_column(2, "shard", pa.array([home, 2, None], pa.int32()))
    assert [(row[0], row[3]) for row in rows(agreeing, "t", ranges)] == [
        (key, home),
        (None, 2),
        (key, None),
    ]

    wrong_type = StructType(
        [StructField("value", StringType()), StructField("shard", StringType())]
    )
    check_schema(wrong_type, explicit_shards=False)  # ignored like a read's topic or offset
    with pytest.raises(InvalidRequest, match="column 'shard' has type string"):
        check_schema(wrong_type, explicit_shards=True)
    assert not parse_write_options({"topic": "t"}).explicit_shards
    assert parse_write_options({"topic": "t", "explicitshards": "TRUE"}).explicit_shards
    with pytest.raises(InvalidRequest, match="'explicitShards'"):
        parse_write_options({"topic": "t", "explicitShards": "yes"})


def test_timestamp_filters_give_an_exact_millisecond_lower_bound() -> None:
    """A pushed-down ``timestamp >= t`` starts each shard at the first record at or after ``t``:
    a bound a millisecond high would miss records."""
    import datetime

    from pyspark.sql.datasource import GreaterThanOrEqual, LessThan

    from clients.spark.filters import narrowing

    utc = datetime.UTC
    for ms in (1_700_000_000_123, 1_763_912_345_001, 999):
        at = datetime.datetime(1970, 1, 1, tzinfo=utc) + datetime.timedelta(milliseconds=ms)
        assert narrowing([GreaterThanOrEqual(("timestamp",), at)]).timestamp_ms_min == ms
    upper = narrowing([LessThan(("timestamp",), datetime.datetime.now(utc))])
    assert upper.timestamp_ms_min is None, "an upper bound on timestamps is not pushed"


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_start_below_the_retained_records_fails_or_skips_per_fail_on_data_loss(
    fail_on_data_loss: bool,
) -> None:
    """A checkpoint (or startingOffsets) behind retention: the plan fails naming the option, or
    starts at the first retained record; the planner asks the backend, here a stand-in."""
    import asyncio

    from clients.spark.plan import Planner

    class Retained(Planner):
        async def retained(self, metadata: TopicMetadata, epoch: Epoch) -> dict[int, int]:
            return {0: 5, 1: 0}

    raw = {"topics": "t", "failOnDataLoss": str(fail_on_data_loss).lower()}
    view = {"t": topic(epoch(0, ends={0: 10, 1: 10}))}
    start, end = {("t", 0, 0): 2, ("t", 0, 1): 0}, {("t", 0, 0): 10, ("t", 0, 1): 10}

    async def plan() -> list[Slice]:
        planner = Retained(parse_options(raw, streaming=False))
        try:
            return await planner.slices(view, start, end)
        finally:
            await planner.close()

    if fail_on_data_loss:
        with pytest.raises(OffsetOutOfRange, match=r"3 records .* shard 0 .*'failOnDataLoss'"):
            asyncio.run(plan())
    else:
        assert [(s.shard, s.start, s.end) for s in asyncio.run(plan())] == [(0, 5, 10), (1, 0, 10)]


def test_arrow_batches_carry_each_records_offset_with_or_without_gaps() -> None:
    """The offset column is built by arithmetic when a poll is contiguous, per record otherwise
    (a compacted topic, a skipped mirror prefix): both give each record its own offset."""
    from clients.spark.read import _Columns, arrow_schema
    from xinfra.model import ConsumedRecord

    columns = _Columns(Slice("t", 3, 1, 0, 100, "{}", "p"), include_headers=False)
    for offsets in ([40, 41, 42, 43], [40, 42, 43, 47], [7]):
        records = [ConsumedRecord(1, o, 1_000 + o, b"k%d" % o, b"v%d" % o) for o in offsets]
        batch = columns.batch(records)
        assert batch.schema == arrow_schema(False)
        assert batch.column("offset").to_pylist() == offsets
        assert batch.column("value").to_pylist() == [b"v%d" % o for o in offsets]
        assert batch.column("shard").to_pylist() == [1] * len(offsets)
        assert [round(t.timestamp() * 1000) for t in batch.column("timestamp").to_pylist()] == [
            1_000 + o for o in offsets
        ]
