"""Cluster membership, the first slice: brokers register with the coordinator broker and heartbeat.

One broker is the **coordinator** (started without ``--coordinator``): it owns
all metadata (the one vnode) and leads every active segment.  Every other
broker is a **member** started with ``--coordinator host:port``: it sends
``register_broker`` {broker_id, address, attributes, store_bytes} every
``heartbeat_s``; the coordinator counts it live while its last heartbeat is
younger than ``broker_timeout_s``.  Membership is soft state: a restarted
coordinator learns the members again from their next heartbeats (within
``heartbeat_s``), so nothing of it is journaled.

This stands where SWIM will (``DESIGN.md`` §3 "Membership"): ``Membership``
answers the questions placement and replication ask (the live brokers with
their attributes and addresses, a broker's address), whatever learns them.
A broker that misses a replica deadline (or whose replica connection fails)
is *suspected*: it stays out of new replica sets for ``broker_timeout_s``.

Bounds: ``MEMBERS_MAX`` brokers; a registration past it is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backends.northguard.broker.placement import BrokerInfo
from backends.northguard.runtime import Runtime
from xinfra.errors import Backpressure, InvalidRequest, XinfraError

log = logging.getLogger(__name__)

MEMBERS_MAX = 1024
"""Brokers one coordinator tracks."""
HEARTBEAT_S = 0.5
"""How often a member registers again with the coordinator."""
BROKER_TIMEOUT_S = 3.0
"""A member whose last heartbeat is older than this is not live (out of new replica sets)."""


@dataclass
class Member:
    broker_id: str
    address: str
    attributes: dict[str, str]
    last_seen_s: float
    store_bytes: int = 0
    suspected_s: float | None = None  # monotonic time of the last suspicion, None: trusted
    incarnation: str = ""  # changes when the broker process restarts


@dataclass
class Membership:
    """The coordinator's table of brokers: itself (always live) and the members that heartbeat."""

    runtime: Runtime
    me: BrokerInfo
    address: str
    broker_timeout_s: float = BROKER_TIMEOUT_S
    members: dict[str, Member] = field(default_factory=dict)

    def heartbeat(
        self,
        broker_id: str,
        address: str,
        attributes: dict[str, str],
        store_bytes: int,
        incarnation: str = "",
    ) -> bool:
        """Record a member's registration; True when it is a known member's new process (a
        restart faster than the broker timeout: what it led in memory is gone)."""
        if broker_id == self.me.broker_id:
            raise InvalidRequest(
                f"broker id {broker_id!r} is the coordinator's own; give every broker its own --id"
            )
        now_s = self.runtime.monotonic_s()
        member = self.members.get(broker_id)
        if member is None:
            if len(self.members) >= MEMBERS_MAX:
                raise Backpressure(f"the coordinator tracks at most {MEMBERS_MAX} brokers")
            log.info("broker %s joined from %s with %s", broker_id, address, attributes)
            self.members[broker_id] = Member(broker_id, address, dict(attributes), now_s)
            member = self.members[broker_id]
        elif member.address != address or member.attributes != attributes:
            log.info("broker %s now at %s with %s", broker_id, address, attributes)
            member.address, member.attributes = address, dict(attributes)
        member.last_seen_s = now_s
        member.store_bytes = store_bytes
        restarted = bool(member.incarnation) and member.incarnation != incarnation
        if restarted:
            log.info("broker %s restarted (a new process)", broker_id)
        member.incarnation = incarnation
        return restarted

    def suspect(self, broker_id: str) -> None:
        """A replica deadline or connection failed: keep it out of new replica sets for a while."""
        member = self.members.get(broker_id)
        if member is not None:
            member.suspected_s = self.runtime.monotonic_s()

    def is_live(self, broker_id: str) -> bool:
        if broker_id == self.me.broker_id:
            return True
        member = self.members.get(broker_id)
        if member is None:
            return False
        now_s = self.runtime.monotonic_s()
        if member.suspected_s is not None and now_s - member.suspected_s < self.broker_timeout_s:
            return False
        return now_s - member.last_seen_s < self.broker_timeout_s

    def live(self) -> list[BrokerInfo]:
        """The brokers new replica sets are chosen from: the coordinator first, then live members."""
        return [self.me] + [
            BrokerInfo(m.broker_id, m.attributes)
            for m in self.members.values()
            if self.is_live(m.broker_id)
        ]

    def address_of(self, broker_id: str) -> str | None:
        if broker_id == self.me.broker_id:
            return self.address
        member = self.members.get(broker_id)
        return None if member is None else member.address

    def describe(self) -> list[dict[str, Any]]:
        now_s = self.runtime.monotonic_s()
        rows: list[dict[str, Any]] = [
            {
                "broker_id": self.me.broker_id,
                "address": self.address,
                "attributes": dict(self.me.attributes),
                "role": "coordinator",
                "live": True,
                "last_seen_s_ago": 0.0,
            }
        ]
        for member in sorted(self.members.values(), key=lambda m: m.broker_id):
            rows.append(
                {
                    "broker_id": member.broker_id,
                    "address": member.address,
                    "attributes": dict(member.attributes),
                    "role": "member",
                    "live": self.is_live(member.broker_id),
                    "last_seen_s_ago": round(now_s - member.last_seen_s, 3),
                    "store_bytes": member.store_bytes,
                }
            )
        return rows


async def heartbeat_forever(
    runtime: Runtime,
    send: Callable[[dict[str, Any]], Any],
    registration: Callable[[], dict[str, Any]],
    heartbeat_s: float = HEARTBEAT_S,
) -> None:
    """A member's loop: register with the coordinator every ``heartbeat_s`` (failures logged,
    retried at the next beat; the owner cancels it at stop)."""
    failing = False
    while True:
        try:
            await send(registration())
            if failing:
                log.info("registered with the coordinator again")
            failing = False
        except (TimeoutError, XinfraError, OSError) as error:
            if not failing:
                log.warning("cannot register with the coordinator: %s; retrying", error)
            failing = True
        except Exception:  # a bug: loud, but membership must not stop
            log.exception("registering with the coordinator failed")
            failing = True
        await runtime.sleep(heartbeat_s)
