"""librdkafka errors as Xinfra errors: one table, one function.

Every failure the Kafka backend reports goes through ``to_xinfra`` so that the
SDK sees the same classes whichever backend it talks to.  The message names
the cluster, the operation, librdkafka's own words and what to do next.

Errors the table does not name fall back on librdkafka's verdict: retriable
ones become ``BackendUnavailable`` (try again later), the rest a plain
``XinfraError`` carrying the librdkafka code name, so nothing is swallowed.
"""

from __future__ import annotations

from typing import Final

from confluent_kafka import KafkaError, KafkaException

from xinfra.errors import (
    BackendTimeout,
    BackendUnavailable,
    CorruptData,
    Fenced,
    Forbidden,
    InvalidRequest,
    NotLeader,
    OffsetOutOfRange,
    RecordTooLarge,
    StorageError,
    TopicAlreadyExists,
    TopicNotFound,
    Unauthenticated,
    XinfraError,
)

_HINT_UNAVAILABLE = "check that the brokers run and are reachable, then retry with backoff"

ERROR_TABLE: Final[dict[int, tuple[type[XinfraError], str]]] = {
    # Topic lifecycle.
    KafkaError.UNKNOWN_TOPIC_OR_PART: (TopicNotFound, "create the topic first or check its name"),
    KafkaError._UNKNOWN_TOPIC: (TopicNotFound, "create the topic first or check its name"),
    KafkaError._UNKNOWN_PARTITION: (TopicNotFound, "the topic or this partition does not exist"),
    KafkaError.UNKNOWN_TOPIC_ID: (TopicNotFound, "the topic was deleted; describe it again"),
    KafkaError.TOPIC_ALREADY_EXISTS: (TopicAlreadyExists, "describe it, or pick another name"),
    # Reachability: retriable.
    KafkaError._TRANSPORT: (BackendUnavailable, _HINT_UNAVAILABLE),
    KafkaError._ALL_BROKERS_DOWN: (BackendUnavailable, _HINT_UNAVAILABLE),
    KafkaError._RESOLVE: (BackendUnavailable, "check the bootstrap host names resolve"),
    KafkaError.NETWORK_EXCEPTION: (BackendUnavailable, _HINT_UNAVAILABLE),
    KafkaError.BROKER_NOT_AVAILABLE: (BackendUnavailable, _HINT_UNAVAILABLE),
    KafkaError.LEADER_NOT_AVAILABLE: (NotLeader, "a leader election is under way; retry"),
    KafkaError.NOT_LEADER_FOR_PARTITION: (NotLeader, "leadership moved; retry"),
    KafkaError.NOT_CONTROLLER: (NotLeader, "the controller moved; retry"),
    KafkaError.NOT_ENOUGH_REPLICAS: (BackendUnavailable, "too few in-sync replicas; retry"),
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND: (
        BackendUnavailable,
        "too few in-sync replicas acknowledged; the records may be stored, retry",
    ),
    KafkaError.REQUEST_TIMED_OUT: (BackendTimeout, "the broker did not answer in time; retry"),
    KafkaError._TIMED_OUT: (BackendTimeout, "no answer in time; " + _HINT_UNAVAILABLE),
    KafkaError._MSG_TIMED_OUT: (
        BackendTimeout,
        "not acknowledged within the request timeout; the records may be stored",
    ),
    # Bad requests.
    KafkaError.MSG_SIZE_TOO_LARGE: (RecordTooLarge, "the broker refused the size; split it"),
    KafkaError.RECORD_LIST_TOO_LARGE: (RecordTooLarge, "the broker refused the size; split it"),
    KafkaError.INVALID_MSG_SIZE: (RecordTooLarge, "the broker refused the size; split it"),
    KafkaError.OFFSET_OUT_OF_RANGE: (
        OffsetOutOfRange,
        "read from an offset between the start and end offsets",
    ),
    KafkaError._AUTO_OFFSET_RESET: (
        OffsetOutOfRange,
        "read from an offset between the start and end offsets",
    ),
    KafkaError.TOPIC_EXCEPTION: (InvalidRequest, "use 1-249 characters of [A-Za-z0-9._-]"),
    KafkaError.INVALID_PARTITIONS: (InvalidRequest, "use at least one shard"),
    KafkaError.INVALID_REPLICATION_FACTOR: (InvalidRequest, "use at most as many as brokers"),
    KafkaError.INVALID_CONFIG: (InvalidRequest, "check the topic config names and values"),
    KafkaError.INVALID_REQUEST: (InvalidRequest, "the broker refused the request"),
    KafkaError.POLICY_VIOLATION: (InvalidRequest, "the cluster's create-topic policy refused it"),
    KafkaError.TOPIC_DELETION_DISABLED: (InvalidRequest, "the cluster disables topic deletion"),
    KafkaError._INVALID_ARG: (InvalidRequest, "an argument is out of range"),
    # Security.
    KafkaError.TOPIC_AUTHORIZATION_FAILED: (Forbidden, "ask for ACLs on this topic"),
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: (Forbidden, "ask for ACLs on the cluster"),
    KafkaError.SASL_AUTHENTICATION_FAILED: (Unauthenticated, "check the credentials"),
    KafkaError._AUTHENTICATION: (Unauthenticated, "check the credentials"),
    # Data and storage.
    KafkaError.INVALID_MSG: (CorruptData, "a batch failed its CRC"),
    KafkaError._BAD_MSG: (CorruptData, "a batch could not be parsed"),
    KafkaError._BAD_COMPRESSION: (CorruptData, "a batch could not be decompressed"),
    KafkaError.KAFKA_STORAGE_ERROR: (StorageError, "a broker disk failed; retry"),
    # Idempotent producer.
    KafkaError.PRODUCER_FENCED: (Fenced, "another producer took over; open a new one"),
    KafkaError.INVALID_PRODUCER_EPOCH: (Fenced, "another producer took over; open a new one"),
    KafkaError._FENCED: (Fenced, "another producer took over; open a new one"),
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER: (
        Fenced,
        "the idempotent producer lost its sequence; open a new producer",
    ),
}


def to_xinfra(error: KafkaError, bootstrap: str, what: str) -> XinfraError:
    """The Xinfra error for a librdkafka error met while doing ``what``."""
    code = error.code()
    cls, hint = ERROR_TABLE.get(code, (None, None))
    if cls is None:
        if error.retriable():
            cls, hint = BackendUnavailable, "retriable; retry with backoff"
        else:
            cls, hint = XinfraError, "not expected by Xinfra; see the broker logs"
    return cls(f"kafka {bootstrap}: {what}: {error.str()} ({error.name()}); {hint}")


def from_exception(exc: BaseException, bootstrap: str, what: str) -> XinfraError:
    """The Xinfra error for an exception raised by a confluent-kafka call.

    ``KafkaException`` carries a ``KafkaError``; anything else (a programming
    error in arguments) is reported as ``InvalidRequest`` with its text.
    """
    if isinstance(exc, XinfraError):
        return exc
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return to_xinfra(exc.args[0], bootstrap, what)
    if isinstance(exc, BufferError):
        return BackendUnavailable(
            f"kafka {bootstrap}: {what}: librdkafka's queue is full ({exc}); retry later"
        )
    if isinstance(exc, TimeoutError):
        return BackendTimeout(f"kafka {bootstrap}: {what}: no answer in time; {_HINT_UNAVAILABLE}")
    return InvalidRequest(f"kafka {bootstrap}: {what}: {exc}")
