"""The one error hierarchy of Xinfra.

Every error carries a stable ``code`` (used in problem+json bodies, in the
Northguard wire protocol and in CLI exit messages) and a message that says what
happened and what to do next.  Operating errors (a peer down, a bad request)
are these exceptions; broken invariants are assertions, never these.

``retriable`` tells a client whether the same request may succeed later
without any change on its side (a broker restarting, a leader moving).
"""

from __future__ import annotations

from typing import ClassVar


class XinfraError(Exception):
    """Base of every error Xinfra raises on purpose."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    retriable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} [{self.code}]"


class InvalidRequest(XinfraError):
    """The request is malformed or breaks a documented limit; fix it and retry."""

    code = "invalid_request"
    http_status = 400


class ProtocolError(InvalidRequest):
    """A peer sent bytes that do not follow the wire protocol; the connection is closed."""

    code = "protocol_error"


class UnsupportedVersion(ProtocolError):
    code = "unsupported_version"


class OutOfOrderSequence(InvalidRequest):
    """A producer's batch sequence skips ahead of the next expected one (batches were lost in
    between) or falls before the broker's duplicate window; the producer must take a fresh id."""

    code = "out_of_order_sequence"


class RecordTooLarge(InvalidRequest):
    code = "record_too_large"
    http_status = 413


class ShardOutOfRange(InvalidRequest):
    code = "shard_out_of_range"


class OffsetOutOfRange(InvalidRequest):
    """The offset is before the first retained record or after the log end."""

    code = "offset_out_of_range"
    http_status = 416


class Unauthenticated(XinfraError):
    code = "unauthenticated"
    http_status = 401


class Forbidden(XinfraError):
    code = "forbidden"
    http_status = 403


class Unauthorized(Forbidden):
    """A Northguard broker refused the connection's credential (missing, forged, expired) or
    an operation outside its scope; fetch fresh metadata (a new credential) or fix the scope."""

    code = "unauthorized"


class NotFound(XinfraError):
    code = "not_found"
    http_status = 404


class TopicNotFound(NotFound):
    code = "topic_not_found"


class ClusterNotFound(NotFound):
    code = "cluster_not_found"


class Conflict(XinfraError):
    code = "conflict"
    http_status = 409


class TopicAlreadyExists(Conflict):
    code = "topic_already_exists"


class VersionConflict(Conflict):
    """An optimistic-concurrency check failed: re-read the resource and retry."""

    code = "version_conflict"


class Sealed(Conflict):
    """The segment, range, epoch or topic is sealed and takes no more appends."""

    code = "sealed"


class Fenced(Conflict):
    """A newer generation, term or epoch has taken over; this request is stale."""

    code = "fenced"


class ProducerFenced(Fenced):
    """A batch carries an older epoch of its producer id than the broker has seen: a newer
    incarnation of that producer took over; this one must stop (or take a fresh id)."""

    code = "producer_fenced"


class UnknownMember(Fenced):
    """The consumer group has no member with this id (it left, expired or never joined): rejoin."""

    code = "unknown_member"
    http_status = 404


class GroupNotFound(NotFound):
    code = "group_not_found"


class VersionAhead(InvalidRequest):
    """A client reports a metadata version its topic has not reached."""

    code = "version_ahead"


class MigrationNotFound(NotFound):
    code = "migration_not_found"


class SameCluster(InvalidRequest):
    """A migration's target cluster is the one the topic already lives on."""

    code = "migration_same_cluster"


class ShardCountMismatch(InvalidRequest):
    """A migration's target must keep the source's shard key ranges."""

    code = "migration_shard_count_mismatch"


class AlreadyMigrating(Conflict):
    code = "migration_in_progress"


class StepOutOfOrder(Conflict):
    code = "migration_step_out_of_order"


class Unavailable(XinfraError):
    """A component needed for the request cannot be reached; retry with backoff."""

    code = "unavailable"
    http_status = 503
    retriable = True


class BackendUnavailable(Unavailable):
    code = "backend_unavailable"


class NotLeader(Unavailable):
    """The request reached a broker that does not lead what it asks for."""

    code = "not_leader"


class NotCoordinator(Unavailable):
    """Another metadata service instance coordinates this consumer group: go there (``url``)."""

    code = "not_coordinator"
    http_status = 307

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class GroupMoved(Unavailable):
    """The instance lost the consumer group to another one while serving the request: retry."""

    code = "group_moved"


class Timeout(Unavailable):
    code = "timeout"
    http_status = 504


class BackendTimeout(Timeout, BackendUnavailable):
    """A physical cluster did not answer in time: a timeout (504) and an unreachable cluster.

    Its own code so that a script (``xinfra`` exits 4 for it, as for
    ``backend_unavailable``) tells a slow or dead cluster from a slow metadata
    service (``timeout``, exit 3).
    """

    code = "backend_timeout"


class Backpressure(Unavailable):
    """A bounded buffer is full; wait for acknowledgements before sending more."""

    code = "backpressure"
    http_status = 429


class CorruptData(XinfraError):
    """Stored or received bytes fail their checksum; they are never served as data."""

    code = "corrupt_data"
    http_status = 500


class StorageError(XinfraError):
    """The disk refused an operation (I/O error, no space); the write was not acknowledged."""

    code = "storage_error"
    http_status = 507
    retriable = True


ALL_ERRORS: dict[str, type[XinfraError]] = {}


def _register(cls: type[XinfraError]) -> None:
    ALL_ERRORS[cls.code] = cls
    for subclass in cls.__subclasses__():
        _register(subclass)


_register(XinfraError)


def error_from_code(code: str, message: str) -> XinfraError:
    """Rebuild the exception a peer reported by its stable code (unknown codes stay generic)."""
    return ALL_ERRORS.get(code, XinfraError)(message)
