"""Unary metadata requests: one JSON request, one JSON response, answered by the coordinator.

Every request names its ``op``; malformed arguments are ``InvalidRequest``,
checked (``fields``) before any work proportional to them: a topic's range
count is bounded before a range is built.
In a cluster any broker would proxy a request to the leader of the vnode that
owns the topic or range; with one broker this broker is that leader.
"""

from __future__ import annotations

from typing import Any

from backends.northguard.broker.coordinator import Coordinator
from backends.northguard.broker.fields import int_field, list_field, str_field
from backends.northguard.credentials import ADMIN, READ
from xinfra.errors import InvalidRequest
from xinfra.keyspace import KeyRange, shard_ranges
from xinfra.model import SHARD_COUNT_MAX

OPS = frozenset(
    {
        "ping",
        "create_topic",
        "delete_topic",
        "list_topics",
        "topic_metadata",
        "seal_topic",
        "segment_metadata",
        "seal_segment",
        "split_range",
        "merge_ranges",
        "offset_for_timestamp",
    }
)


_OPERATION_OF: dict[str, str | None] = {
    "ping": None,
    "list_topics": READ,
    "topic_metadata": READ,
    "segment_metadata": READ,
    "offset_for_timestamp": READ,
    "create_topic": ADMIN,
    "delete_topic": ADMIN,
    "seal_topic": ADMIN,
    "seal_segment": ADMIN,
    "split_range": ADMIN,
    "merge_ranges": ADMIN,
}
assert _OPERATION_OF.keys() == OPS


def operation_of(op: str) -> str | None:
    """The credential operation ``op`` needs (None: none, ``ping``); unknown ops need admin,
    so a refusal comes before the ``unknown op`` answer and reveals nothing."""
    return _OPERATION_OF.get(op, ADMIN)


async def handle_request(coordinator: Coordinator, request: dict[str, Any]) -> dict[str, Any]:
    """The result of one unary request; raises ``XinfraError`` for the error response."""
    op = request.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise InvalidRequest(f"unknown request op {op!r}")
    try:
        return await _dispatch(coordinator, op, request)
    except (KeyError, TypeError, ValueError, ArithmeticError) as error:
        raise InvalidRequest(f"malformed {op} request: {error!r}") from error


async def _dispatch(coordinator: Coordinator, op: str, request: dict[str, Any]) -> dict[str, Any]:
    if op == "ping":
        return {"broker_id": coordinator.config.broker_id}
    if op == "list_topics":
        return {"topics": coordinator.list_topics()}
    name = str_field(request, "name")
    if op == "create_topic":
        if "ranges" in request:
            bounds = list_field(request, "ranges", length_max=SHARD_COUNT_MAX)
            ranges = [KeyRange.from_json(pair) for pair in bounds]
        else:
            ranges = shard_ranges(int_field(request, "count", low=1, high=SHARD_COUNT_MAX))
        config = request.get("config") or {}
        if not isinstance(config, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in config.items()
        ):
            raise InvalidRequest("config must map strings to strings")
        return await coordinator.create_topic(name, ranges, config)
    if op == "delete_topic":
        await coordinator.delete_topic(name)
        return {}
    if op == "topic_metadata":
        return coordinator.describe(name)
    if op == "seal_topic":
        return await coordinator.seal_topic(name)
    range_id = int_field(request, "range_id")
    if op == "segment_metadata":
        return coordinator.segment_metadata(name, range_id)
    if op == "seal_segment":
        await coordinator.range_log(name, range_id).seal_active()
        return coordinator.segment_metadata(name, range_id)
    if op == "split_range":
        return await coordinator.split_range(name, range_id)
    if op == "merge_ranges":
        return await coordinator.merge_ranges(name, range_id, int_field(request, "other_range_id"))
    assert op == "offset_for_timestamp"
    offset = await coordinator.offset_for_timestamp(
        name, range_id, int_field(request, "timestamp_ms", low=-(1 << 63), high=(1 << 63) - 1)
    )
    return {"offset": offset}
