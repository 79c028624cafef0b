"""Unary metadata requests: one JSON request, one JSON response, answered by the coordinator.

Every request names its ``op``; malformed arguments are ``InvalidRequest``,
checked (``fields``) before any work proportional to them: a topic's range
count is bounded before a range is built.
In a cluster a member broker forwards every metadata request to the
coordinator (``Coordinator.forward``, over its peer connection) after
authorizing it here; the coordinator answers it as the owner of all metadata
(the one vnode, until the vnodes of the sharded metadata issue).  The broker
ops (``register_broker``, ``replica_*``) are answered by the broker that gets
them: they are how brokers talk to each other, and need an admin credential;
so are ``lead_segment`` and ``range_ends`` (the coordinator to a member
leader).  ``roll_segment`` (a member leader to the coordinator) is forwarded.
"""

from __future__ import annotations

from typing import Any

from backends.northguard.broker.coordinator import Coordinator
from backends.northguard.broker.fields import int_field, list_field, str_field
from backends.northguard.broker.metadata_replication import METADATA_OPS
from backends.northguard.broker.placement import REPLICAS_MAX
from backends.northguard.broker.rereplication import copy_segment
from backends.northguard.credentials import ADMIN, READ
from xinfra.errors import InvalidRequest
from xinfra.keyspace import SHARD_COUNT_MAX, KeyRange, shard_ranges

REPLICA_OPS = frozenset(
    {
        "replica_create",
        "replica_fence",
        "replica_seal",
        "replica_delete",
        "replica_checksum",
        "replica_copy",
        "replica_list",
    }
)
"""How brokers act on the replicas they hold."""
LEADER_OPS = frozenset({"lead_segment", "range_ends"})
"""How the coordinator hands a segment to its leader (a member) and asks it for range ends."""
LOCAL_OPS = frozenset({"ping", *REPLICA_OPS, *LEADER_OPS, *METADATA_OPS})
"""Ops a member answers itself; it forwards every other one to the coordinator."""
REPLICA_LIST_MAX = 10_000
"""Segment ids per ``replica_list`` answer (under the 1 MiB control message bound)."""
BROKER_OPS = frozenset(
    {
        "cluster_status",
        "register_broker",
        "create_policy",
        "roll_segment",
        *REPLICA_OPS,
        *LEADER_OPS,
        *METADATA_OPS,
    }
)
"""Ops about the whole cluster: an admin credential for every topic (a broker's own) only."""


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
    "list_policies": READ,
    "validate_policy": READ,
    **dict.fromkeys(BROKER_OPS, ADMIN),
}
OPS = frozenset(_OPERATION_OF)
"""Every unary request op, with the credential operation it needs."""


def operation_of(op: str) -> str | None:
    """The credential operation ``op`` needs (None: none, ``ping``); unknown ops need admin,
    so a refusal comes before the ``unknown op`` answer and reveals nothing."""
    return _OPERATION_OF.get(op, ADMIN)


async def handle_request(coordinator: Coordinator, request: dict[str, Any]) -> dict[str, Any]:
    """The result of one unary request; raises ``XinfraError`` for the error response."""
    op = request.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise InvalidRequest(f"unknown request op {op!r}")
    forward = coordinator.forward
    if forward is not None and op not in LOCAL_OPS:
        return await forward(request)
    try:
        return await _dispatch(coordinator, op, request)
    except (KeyError, TypeError, ValueError, ArithmeticError) as error:
        raise InvalidRequest(f"malformed {op} request: {error!r}") from error


async def _dispatch(coordinator: Coordinator, op: str, request: dict[str, Any]) -> dict[str, Any]:
    if op == "ping":
        return {"broker_id": coordinator.config.broker_id}
    if op == "list_topics":
        return {"topics": coordinator.list_topics()}
    if op == "cluster_status":
        return coordinator.cluster_status()
    if op == "create_policy":
        return await coordinator.create_policy(request.get("policy"))
    if op == "list_policies":
        return {"policies": coordinator.list_policies()}
    if op == "validate_policy":
        return coordinator.validate_policy(request.get("policy"))
    if op in METADATA_OPS:
        if coordinator.metadata_copy is None:
            raise InvalidRequest("only a member broker holds a copy of the metadata")
        return await coordinator.metadata_copy.handle(op, request)
    if op == "register_broker":
        attributes = request.get("attributes") or {}
        if not isinstance(attributes, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in attributes.items()
        ):
            raise InvalidRequest("attributes must map strings to strings")
        member = str_field(request, "broker_id")
        incarnation = request.get("incarnation") or ""
        if not isinstance(incarnation, str) or len(incarnation) > 64:
            raise InvalidRequest("incarnation is a string of at most 64 characters")
        if coordinator.membership.heartbeat(
            member,
            str_field(request, "address"),
            attributes,
            int_field(request, "store_bytes", default=0),
            incarnation,
        ):
            coordinator.broker_restarted(member)
        return {"coordinator": coordinator.config.broker_id}
    if op == "replica_list":
        after = request.get("after") or ""
        if not isinstance(after, str):
            raise InvalidRequest("after must be a segment id")
        limit = int_field(request, "limit", low=1, high=REPLICA_LIST_MAX, default=REPLICA_LIST_MAX)
        ids = sorted(info.segment_id for info in coordinator.store.segments())
        page = [sid for sid in ids if sid > after][:limit]
        return {"segment_ids": page, "more": bool(page) and page[-1] != ids[-1]}
    leadership = coordinator.leadership
    if op == "lead_segment":
        if leadership is None:
            raise InvalidRequest("the coordinator's own segments are led without a request")
        await leadership.lead(request)
        return {}
    if op == "range_ends":
        range_ids = [int(r) for r in list_field(request, "range_ids", length_max=SHARD_COUNT_MAX)]
        return {"ends": {} if leadership is None else leadership.ends(range_ids)}
    if op == "roll_segment":
        segment_id = request.get("segment_id")
        failed = request.get("failed") or []
        if not isinstance(failed, list) or len(failed) > REPLICAS_MAX:
            raise InvalidRequest(f"failed lists at most {REPLICAS_MAX} broker ids")
        return await coordinator.roll_for_leader(
            str_field(request, "name"),
            int_field(request, "range_id"),
            None if segment_id is None else str(segment_id),
            bool(request.get("open_new")),
            [str(b) for b in failed],
        )
    if op.startswith("replica_"):
        segment_id = str_field(request, "segment_id")
        replicas = coordinator.replicas
        if leadership is not None and leadership.range_log_of(segment_id) is not None:
            if op == "replica_fence":  # the segment this broker leads: its range log answers
                return await leadership.fence(segment_id)
            if op == "replica_seal":
                end = await leadership.seal(segment_id, int_field(request, "end_offset"))
                return {"end_offset": end}
        if op == "replica_create":
            await replicas.create(segment_id, int_field(request, "start_offset"))
            return {}
        if op == "replica_fence":
            return {"end_offset": await replicas.fence(segment_id)}
        if op == "replica_seal":
            end = await replicas.seal(segment_id, int_field(request, "end_offset"))
            return {"end_offset": end}
        if op == "replica_checksum":
            return await replicas.checksum(segment_id)
        if op == "replica_copy":
            peers = coordinator.peers
            if peers is None:
                raise InvalidRequest("this broker is not part of a cluster")
            await copy_segment(
                coordinator.store,
                await peers.connection(str_field(request, "source")),
                segment_id,
                str_field(request, "topic"),
                int_field(request, "range_id"),
                int_field(request, "start_offset"),
                int_field(request, "end_offset"),
                coordinator.config.replica_timeout_s,
            )
            return {}
        assert op == "replica_delete"
        await replicas.delete(segment_id)
        return {}
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
        await coordinator.refresh_ends(name)
        return coordinator.describe(name)
    if op == "seal_topic":
        return await coordinator.seal_topic(name)
    range_id = int_field(request, "range_id")
    if op == "segment_metadata":
        await coordinator.refresh_ends(name)
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
