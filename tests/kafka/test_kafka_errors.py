"""librdkafka errors map onto ``xinfra.errors`` with messages that name the cluster and the fix."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from backends.kafka.config import BUFFER_RECORDS_MAX, producer_config, reader_config
from backends.kafka.errors import from_exception, to_xinfra
from xinfra.backend import ProducerOptions, ReaderOptions
from xinfra.errors import (
    BackendTimeout,
    BackendUnavailable,
    Fenced,
    InvalidRequest,
    NotLeader,
    OffsetOutOfRange,
    RecordTooLarge,
    Timeout,
    TopicAlreadyExists,
    TopicNotFound,
    XinfraError,
)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (KafkaError.UNKNOWN_TOPIC_OR_PART, TopicNotFound),
        (KafkaError._UNKNOWN_TOPIC, TopicNotFound),
        (KafkaError.TOPIC_ALREADY_EXISTS, TopicAlreadyExists),
        (KafkaError._TRANSPORT, BackendUnavailable),
        (KafkaError._ALL_BROKERS_DOWN, BackendUnavailable),
        (KafkaError.NOT_LEADER_FOR_PARTITION, NotLeader),
        (KafkaError._MSG_TIMED_OUT, BackendTimeout),
        (KafkaError._TIMED_OUT, BackendTimeout),
        (KafkaError.MSG_SIZE_TOO_LARGE, RecordTooLarge),
        (KafkaError.OFFSET_OUT_OF_RANGE, OffsetOutOfRange),
        (KafkaError._AUTO_OFFSET_RESET, OffsetOutOfRange),
        (KafkaError.INVALID_PARTITIONS, InvalidRequest),
        (KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, Fenced),
    ],
)
def test_known_codes_map_to_their_class(code: int, expected: type[XinfraError]) -> None:
    error = to_xinfra(KafkaError(code), "broker:9092", "doing it")
    assert type(error) is expected
    assert "broker:9092" in error.message and "doing it" in error.message
    assert KafkaError(code).name() in error.message


def test_unknown_codes_follow_librdkafkas_retriable_verdict() -> None:
    retriable = to_xinfra(
        KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS, retriable=True), "b", "x"
    )
    assert isinstance(retriable, BackendUnavailable)
    fatal = to_xinfra(KafkaError(KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT), "b", "x")
    assert type(fatal) is XinfraError and "UNSUPPORTED_FOR_MESSAGE_FORMAT" in fatal.message


def test_exceptions_of_confluent_calls_are_mapped() -> None:
    exc = KafkaException(KafkaError(KafkaError._ALL_BROKERS_DOWN))
    assert isinstance(from_exception(exc, "b", "x"), BackendUnavailable)
    assert isinstance(from_exception(BufferError("full"), "b", "x"), BackendUnavailable)
    assert isinstance(from_exception(TimeoutError(), "b", "x"), Timeout)
    assert isinstance(from_exception(TypeError("bad"), "b", "x"), InvalidRequest)
    same = TopicNotFound("t")
    assert from_exception(same, "b", "x") is same


def test_producer_is_idempotent_acks_all_and_batches_by_the_options() -> None:
    options = ProducerOptions(linger_ms=7.0, batch_bytes_max=123_456, request_timeout_s=9.0)
    config = producer_config("b:1", options)
    assert config["enable.idempotence"] is True
    assert config["acks"] == "all"
    assert config["linger.ms"] == 7.0
    assert config["batch.size"] == 123_456
    assert config["message.timeout.ms"] == 9000
    assert config["allow.auto.create.topics"] is False
    # librdkafka's own queue sits above the Xinfra bounds, so Backpressure comes first.
    assert config["queue.buffering.max.messages"] > BUFFER_RECORDS_MAX
    assert config["queue.buffering.max.kbytes"] * 1024 > options.buffer_bytes_max


def test_reader_joins_no_group_and_commits_nothing() -> None:
    first = reader_config("b:1", ReaderOptions())
    second = reader_config("b:1", ReaderOptions())
    assert first["group.id"] != second["group.id"]
    assert first["enable.auto.commit"] is False
    assert first["auto.offset.reset"] == "error"
    assert first["queued.max.messages.kbytes"] * 1024 == ReaderOptions().fetch_bytes_max
