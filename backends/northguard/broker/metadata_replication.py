"""Copies of the coordinator's metadata journal on member brokers (issue 15's metadata policy).

The coordinator owns all metadata in its ``FileJournal``; losing its disk would
lose every topic, range and segment although the records sit on the members.
With a metadata replication factor N > 1 the coordinator keeps N - 1 live
members as *metadata replicas* (``MetadataReplicas``) and decides an op only
once its own journal **and** every metadata replica have fsynced it: the same
commit rule as data.  The journal's ops ride the peer connections
(``PeerPool``) as two unary broker requests, no second protocol:

* ``meta_append`` {ops}: a replica appends the ops (their sequence numbers
  must follow its last one) to its own ``FileJournal`` and fsyncs, then answers.
* ``meta_install`` {state}: a new replica (or one that fell behind) replaces its
  copy with the coordinator's whole state at its last applied op (a snapshot;
  the tail follows as ``meta_append``).

A replica that fails an append is dropped (and suspected) and replaced by another
live, unsuspected member, which gets a snapshot plus the batch; with
no member left to take one the op is decided on fewer copies and
``cluster_status`` shows the shortfall (as a data segment sealed on its
survivors).  Factor 1 (the default) sends nothing: today's cost.

Recovery (``meta_fetch``): a coordinator started with an empty journal and
``recover_from`` (the members' addresses) asks each for its copy and rebuilds
its journal from the one with the highest applied sequence number: every
acknowledged op is on every replica, so on the most complete one.  The whole
state travels in one control message, so it must fit ``JSON_BYTES_MAX`` (1 MiB,
a few thousand segments); chunked transfer is left for the sharded metadata issue.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from backends.northguard.broker.journal import JOURNAL_OPS_MAX, FileJournal
from backends.northguard.broker.membership import Membership
from backends.northguard.broker.peers import PeerPool
from backends.northguard.broker.placement import BrokerInfo
from backends.northguard.broker.state import MetadataState
from backends.northguard.runtime import Runtime
from xinfra.errors import Conflict, InvalidRequest, XinfraError

log = logging.getLogger(__name__)

METADATA_OPS = frozenset({"meta_append", "meta_install", "meta_fetch"})
"""Broker requests a member answers about its copy of the coordinator's journal."""


class MetadataReplicas:
    """The coordinator's side: which members hold a copy, and pushing each op batch to them."""

    def __init__(self, factor: int, membership: Membership) -> None:
        self.factor = factor
        self._membership = membership
        self.peers: PeerPool | None = None
        self.holders: list[str] = []  # member broker ids whose copy is at the last decided op
        self.replaced = 0  # metadata replicas dropped after a failure since start

    async def replicate(self, ops: list[dict[str, Any]], state: MetadataState) -> None:
        """Make ``ops`` durable on every metadata replica (``state``: before the ops); fill the
        set up to the factor from live members first.  Raises nothing: a failed replica is
        dropped and replaced."""
        if self.factor <= 1 or self.peers is None:
            return
        holders = list(self.holders) if ops else []
        failed = await asyncio.gather(*(self._append(h, ops) for h in holders))
        for holder, error in zip(holders, failed, strict=True):
            if error is not None:
                log.warning("metadata replica %s failed (%s); replacing it", holder, error)
                self.holders.remove(holder)
                self._membership.suspect(holder)
                self.replaced += 1
        if len(self.holders) < self.factor - 1:
            await self._fill(ops, state)

    async def _fill(self, ops: list[dict[str, Any]], state: MetadataState) -> None:
        snapshot: dict[str, Any] | None = None
        for broker in self._membership.live():
            if len(self.holders) >= self.factor - 1:
                return
            if (
                broker.broker_id == self._membership.me.broker_id
                or broker.broker_id in self.holders
            ):
                continue
            snapshot = snapshot or state.to_json()
            error = await self._send(broker.broker_id, "meta_install", state=snapshot)
            if error is None and ops:
                error = await self._append(broker.broker_id, ops)
            if error is None:
                log.info("broker %s holds a copy of the metadata", broker.broker_id)
                self.holders.append(broker.broker_id)
            else:
                log.warning("broker %s cannot take a metadata copy: %s", broker.broker_id, error)
                self._membership.suspect(broker.broker_id)

    async def _append(self, broker_id: str, ops: list[dict[str, Any]]) -> Exception | None:
        return await self._send(broker_id, "meta_append", ops=ops)

    async def _send(self, broker_id: str, op: str, **arguments: Any) -> Exception | None:
        address = self._membership.address_of(broker_id)
        peers = self.peers
        assert peers is not None
        if address is None:
            return Conflict(f"broker {broker_id} has no address")
        try:
            await peers.request(address, op, **arguments)
        except (TimeoutError, OSError, XinfraError) as error:
            return error
        return None

    def describe(self) -> dict[str, Any]:
        """For ``cluster_status``: the policy, the copies and the shortfall."""
        return {
            "replication_factor": self.factor,
            "replicas": [self._membership.me.broker_id, *self.holders],
            "under_replicated": max(0, self.factor - 1 - len(self.holders)),
            "replaced": self.replaced,
        }


async def recover(
    peers: PeerPool, addresses: list[str], journal: FileJournal, membership: Membership
) -> MetadataState | None:
    """Rebuild an empty journal from the most complete copy among ``addresses`` (None: no
    member answered with a copy; the coordinator starts empty and says so).  Every member
    that answers is registered at once (as its heartbeat would): reads of sealed segments
    this broker lost go to the other replicas from the first request on."""
    best: dict[str, Any] | None = None
    for address in addresses:
        try:
            answer = await peers.request(address, "meta_fetch")
        except (TimeoutError, OSError, XinfraError) as error:
            log.warning("metadata recovery: %s did not answer: %s", address, error)
            continue
        membership.heartbeat(answer["broker_id"], address, answer["attributes"], 0)
        state = answer.get("state")
        if state is not None and (best is None or state["applied_seq"] > best["applied_seq"]):
            best = state
    if best is None:
        return None
    await journal.replace(best)
    log.warning("metadata recovered from a member's copy at op %d", best["applied_seq"])
    return MetadataState.from_json(best)


class MetadataCopy:
    """A member's side: its copy of the coordinator's journal in ``<data>/meta-copy``."""

    def __init__(self, runtime: Runtime, directory: Path, me: BrokerInfo) -> None:
        self._runtime = runtime
        self._me = me
        self._journal = FileJournal(runtime, directory)
        self._state: MetadataState | None = None
        self._lock = asyncio.Lock()

    async def _loaded(self) -> MetadataState:
        if self._state is None:
            snapshot, ops = await self._runtime.run_blocking(self._journal.load)
            state = MetadataState.from_json(snapshot) if snapshot else MetadataState()
            for op in ops:
                state.apply(op)
            self._state = state
        return self._state

    async def handle(self, op: str, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one of ``METADATA_OPS``."""
        async with self._lock:
            state = await self._loaded()
            if op == "meta_fetch":
                return {
                    "state": state.to_json() if state.applied_seq else None,
                    "broker_id": self._me.broker_id,
                    "attributes": dict(self._me.attributes),
                }
            if op == "meta_install":
                data = request.get("state")
                if not isinstance(data, dict):
                    raise InvalidRequest("meta_install needs the state")
                new = MetadataState.from_json(data)
                await self._journal.replace(data)
                self._state = new
                return {}
            ops = request.get("ops")
            if not isinstance(ops, list) or not ops or not all(isinstance(o, dict) for o in ops):
                raise InvalidRequest("meta_append needs a list of ops")
            if int(ops[0]["seq"]) != state.applied_seq + 1:
                raise Conflict(
                    f"metadata copy at op {state.applied_seq}, not before {ops[0]['seq']}"
                )
            await self._journal.append_many(ops)
            for item in ops:
                state.apply(item)
            if self._journal.ops_since_snapshot >= JOURNAL_OPS_MAX:
                await self._journal.replace(state.to_json())
            return {}
