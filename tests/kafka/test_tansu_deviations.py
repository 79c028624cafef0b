"""Standard Kafka behaviour measured straight through confluent-kafka on the test broker (tansu).

Each deviation tansu 0.6.0 has is a strict xfail naming it: the day tansu is
fixed (or the suite runs on real Kafka) the test passes, the xfail fails, and
the work-around or the xfail elsewhere can go.  What tansu does support is
asserted plainly.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from containers import KAFKA_IS_TANSU

RECORDS = 10
TIMEOUT_S = 15.0


@pytest.fixture
def batch_of_ten(kafka_bootstrap: str) -> Iterator[str]:
    """A one-partition topic holding one idempotent batch of 10 records, timestamps 1000..1009."""
    topic = f"tansu-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 1, -1)])[topic].result(TIMEOUT_S)
    producer = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 50,
        }
    )
    errors: list[KafkaError] = []

    def on_delivery(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            errors.append(error)

    for i in range(RECORDS):
        producer.produce(topic, b"v", None, 0, on_delivery=on_delivery, timestamp=1000 + i)
    assert producer.flush(TIMEOUT_S) == 0
    assert errors == []  # tansu supports InitProducerId: the idempotent producer works
    yield topic
    admin.delete_topics([topic])[topic].result(TIMEOUT_S)


def consumer(bootstrap: str) -> Consumer:
    return Consumer(
        {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex, "enable.auto.commit": False}
    )


@pytest.mark.xfail(
    KAFKA_IS_TANSU,
    strict=True,
    reason="tansu 0.6.0 deviation: ListOffsets(latest) answers the base offset of the last "
    "batch + 1 (here 1), not the high watermark (10); backends/kafka/watermark.py reads the "
    "high watermark of a Fetch instead",
)
def test_list_offsets_latest_is_the_high_watermark(kafka_bootstrap: str, batch_of_ten: str) -> None:
    client = consumer(kafka_bootstrap)
    try:
        low, high = client.get_watermark_offsets(TopicPartition(batch_of_ten, 0), TIMEOUT_S)
        assert (low, high) == (0, RECORDS)
    finally:
        client.close()


def test_a_fetch_response_carries_the_right_high_watermark(
    kafka_bootstrap: str, batch_of_ten: str
) -> None:
    client = consumer(kafka_bootstrap)
    try:
        client.assign([TopicPartition(batch_of_ten, 0, 0)])
        got = []
        while len(got) < RECORDS:
            got += [m for m in client.consume(RECORDS, TIMEOUT_S) if m.error() is None]
        _, high = client.get_watermark_offsets(TopicPartition(batch_of_ten, 0), cached=True)
        assert high == RECORDS
    finally:
        client.close()


@pytest.mark.xfail(
    KAFKA_IS_TANSU,
    strict=True,
    reason="tansu 0.6.0 deviation: ListOffsets by timestamp answers offset 0 whatever the "
    "timestamp (the first batch's base offset), also past the last record",
)
def test_list_offsets_by_timestamp(kafka_bootstrap: str, batch_of_ten: str) -> None:
    client = consumer(kafka_bootstrap)
    try:
        found = client.offsets_for_times([TopicPartition(batch_of_ten, 0, 1005)], timeout=TIMEOUT_S)
        assert found[0].offset == 5
        past = client.offsets_for_times([TopicPartition(batch_of_ten, 0, 5000)], timeout=TIMEOUT_S)
        assert past[0].offset == -1
    finally:
        client.close()
