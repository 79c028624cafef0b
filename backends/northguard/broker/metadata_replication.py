"""Copies of the coordinator's metadata journal on member brokers (issue 15's metadata policy).

The coordinator owns all metadata in its ``FileJournal``; losing its disk would
lose every topic, range and segment although the records sit on the members.
The *metadata policy* says where copies live: a storage policy (``placement``,
the constraint language of data segments: expressions, counts, ``distinct_by``)
named by ``--metadata-policy`` and defined like any other (``xinfra northguard
policies create``), or ``--metadata-replication-factor N``, the shorthand for
N copies anywhere.  The coordinator's own journal is always a copy (counted in
the first constraint it matches); it keeps live members as *metadata replicas*
(``MetadataReplicas``) chosen under the policy one at a time
(``choose_additional_replica``, in broker id order) and decides an
op only once its own journal **and** every metadata replica have fsynced it: the
same commit rule as data.  The journal's ops ride the peer connections
(``PeerPool``) as two unary broker requests, no second protocol:

* ``meta_append`` {ops}: a replica appends the ops (their sequence numbers
  must follow its last one) to its own ``FileJournal`` and fsyncs, then answers.
* ``meta_install`` {state}: a new replica (or one that fell behind) replaces its
  copy with the coordinator's whole state at its last applied op (a snapshot;
  the tail follows as ``meta_append``).

**The replica set is replicated state** (Kafka's ISR, kept in the journal it
guards): whenever the set changes, a ``metadata_replicas`` op {replicas: the
coordinator first, then the members} is written to the coordinator's journal and
pushed to the *new* set, and the ops that caused the change (the batch a failed
replica missed, or the one a new replica joined with) are acknowledged only
after it.  A replica that fails an append is dropped (and suspected): the op
recording the set without it is decided on the remaining copies; a replacement
the policy allows gets a snapshot, the batch, and the op recording the set with
it.  With no live broker set satisfying the policy, ops are decided on fewer
copies and ``cluster_status`` shows the shortfall and why (as a data segment
sealed on its survivors).  A policy naming one copy (the default) sends nothing.

**Recovery** (``meta_fetch``, ``choose_copy``): a coordinator started with an
empty journal and ``recover_from`` (the members' addresses) asks each for its
copy.  The rule: let S be the newest replica set recorded among the copies that
answered (the one recorded by the highest op); rebuild from the most complete
copy only if **every member of S** (the coordinator whose disk was lost
excepted) answered with a copy; else refuse, naming the members that did not.
Why it is enough: every op acknowledged while S was the set is on every member
of S; a newer set S' would have been recorded on every member of S' before
any op decided under it was acknowledged, and S' keeps at least one member of
S unless every member copy of S failed at once, so some member of S that
answered would hold S' and S would not be the newest.  Why less is not (the
"one current member of S answered" shortcut): a member of S that answered may
itself have been dropped by a set recorded only on the members that did not
answer, and nothing on its disk can tell it; a copy that records no set
cannot show it is current either.  A copy outside S is behind S's members by
construction.  Not covered, and no rule over the copies could be: when every
member copy fails at once, what is decided next is on the coordinator's
journal alone (then on replacements a recovery may not reach), and the old
copies still agree on their set; ``cluster_status`` shows such a window as
``under_replicated``.  ``--force-unclean-metadata-recovery`` takes the most
complete copy that answered anyway, with a loud log line; decided ops may be
lost.  The whole
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
from backends.northguard.broker.placement import (
    BrokerInfo,
    Constraint,
    StoragePolicy,
    choose_additional_replica,
    missing_replicas,
    policy_from_json,
)
from backends.northguard.broker.state import MetadataState
from backends.northguard.runtime import Runtime
from xinfra.errors import Conflict, InvalidRequest, Unavailable, XinfraError

log = logging.getLogger(__name__)

METADATA_OPS = frozenset({"meta_append", "meta_install", "meta_fetch"})
"""Broker requests a member answers about its copy of the coordinator's journal."""
FORCE_FLAG = "--force-unclean-metadata-recovery"


def count_policy(factor: int) -> StoragePolicy:
    """``--metadata-replication-factor N``: N copies on any brokers, the coordinator's included."""
    return StoragePolicy("metadata", constraints=(Constraint("*", factor),))


class MetadataReplicas:
    """The coordinator's side: which members hold a copy, and pushing each op batch to them."""

    def __init__(
        self,
        factor: int,
        membership: Membership,
        journal: FileJournal | None = None,
        policy_name: str | None = None,
    ) -> None:
        self.factor = factor
        self.policy_name = policy_name
        self._membership = membership
        self._journal = journal
        self.peers: PeerPool | None = None
        self.holders: list[str] = []  # member broker ids whose copy is at the last decided op
        self.replaced = 0  # metadata replicas dropped after a failure since start
        self.reason: str | None = None  # why the policy is not met, at the last fill

    @property
    def active(self) -> bool:
        """Whether any copy besides the coordinator's may be wanted (else nothing is sent)."""
        return self.factor > 1 or self.policy_name is not None

    def policy(self, state: MetadataState) -> StoragePolicy:
        """The metadata policy: the named one once defined, else the count shorthand."""
        if self.policy_name is not None:
            data = state.policies.get(self.policy_name)
            if data is not None:
                return policy_from_json(data)
        return count_policy(self.factor)

    def _current(self) -> list[BrokerInfo]:
        members = self._membership.members
        return [self._membership.me] + [
            BrokerInfo(h, members[h].attributes if h in members else {}) for h in self.holders
        ]

    def short(self, state: MetadataState) -> int:
        """Copies the policy asks for beyond those held (0: met)."""
        return missing_replicas(self.policy(state), self._current())

    async def replicate(
        self, ops: list[dict[str, Any]], state: MetadataState
    ) -> list[dict[str, Any]]:
        """Make ``ops`` durable on every metadata replica (``state``: before the ops); fill the
        set under the policy from live members first.  A failed replica is dropped.  Returns
        the ``metadata_replicas`` ops recording set changes, durable on the coordinator's
        journal and on the set each records, to apply after ``ops`` (the caller acknowledges
        ``ops`` only then).  Raises ``OSError`` only when the coordinator's journal fails."""
        if not self.active or self.peers is None:
            return []
        if ops:
            await self._push(ops)
        await self._fill(ops, state)
        recorded: list[dict[str, Any]] = []
        seq = state.applied_seq + len(ops)
        last = state.metadata_replicas
        me = self._membership.me.broker_id
        while [me, *self.holders] != last:  # a failed push shrinks the set: record that too
            seq += 1
            last = [me, *self.holders]
            op = {"op": "metadata_replicas", "seq": seq, "replicas": last}
            assert self._journal is not None, "the set is recorded in the coordinator's journal"
            await self._journal.append_many([op])
            recorded.append(op)
            await self._push([op])
            log.info("metadata replica set is now %s (op %d)", ",".join(last), seq)
        return recorded

    async def _push(self, ops: list[dict[str, Any]]) -> None:
        holders = list(self.holders)
        failed = await asyncio.gather(*(self._append(h, ops) for h in holders))
        for holder, error in zip(holders, failed, strict=True):
            if error is not None:
                log.warning("metadata replica %s failed (%s); dropping it", holder, error)
                self.holders.remove(holder)
                self._membership.suspect(holder)
                self.replaced += 1

    async def _fill(self, ops: list[dict[str, Any]], state: MetadataState) -> None:
        policy = self.policy(state)
        snapshot: dict[str, Any] | None = None
        self.reason = None
        while True:
            try:
                target = choose_additional_replica(
                    policy, self._membership.live(), {}, self._current()
                )
            except InvalidRequest:  # met
                return
            except Unavailable as unmet:
                self.reason = unmet.message
                return
            snapshot = snapshot or state.to_json()
            error = await self._send(target, "meta_install", state=snapshot)
            if error is None and ops:
                error = await self._append(target, ops)
            if error is None:
                log.info("broker %s holds a copy of the metadata", target)
                self.holders.append(target)
            else:
                log.warning("broker %s cannot take a metadata copy: %s", target, error)
                self._membership.suspect(target)  # out of ``live`` for the next choice

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

    def describe(self, state: MetadataState) -> dict[str, Any]:
        """For ``cluster_status``: the policy, the copies, the shortfall and why."""
        policy = self.policy(state)
        short = missing_replicas(policy, self._current())
        reason = self.reason if short else None
        if self.policy_name is not None and self.policy_name not in state.policies:
            reason = f"metadata policy {self.policy_name!r} is not defined; copies by count"
        return {
            "policy": policy.to_json() if self.policy_name is not None else None,
            "replication_factor": policy.replicas,
            "replicas": [self._membership.me.broker_id, *self.holders],
            "under_replicated": short,
            "reason": reason,
            "replaced": self.replaced,
        }


def choose_copy(
    copies: dict[str, dict[str, Any]],
    unreached: list[str],
    coordinator_id: str,
    force: bool,
) -> dict[str, Any] | None:
    """The copy to rebuild from under the module's rule (None: no copy, and every address
    answered: a new cluster); ``Unavailable`` naming what is missing when the rule refuses
    and ``force`` is off.  ``copies``: broker id: its state, for the members that answered
    with one; ``unreached``: the addresses that did not answer."""
    problem: str | None = None
    best: dict[str, Any] | None = None
    if not copies:
        if unreached:
            problem = f"no member answered with a copy and {', '.join(unreached)} did not answer"
    else:
        newest = max(copies.values(), key=lambda c: int(c.get("metadata_replicas_seq", 0)))
        replica_set = [str(b) for b in newest.get("metadata_replicas", [])]
        members = [b for b in replica_set[1:] if b != coordinator_id]
        candidates = [copies[b] for b in members if b in copies] or list(copies.values())
        best = max(candidates, key=lambda c: int(c["applied_seq"]))
        missing = [b for b in members if b not in copies]
        if not replica_set:
            problem = f"the copies of {', '.join(sorted(copies))} record no metadata replica set"
        elif missing:
            problem = (
                f"member(s) {', '.join(missing)} of the newest metadata replica set "
                f"{','.join(replica_set)} (op {newest['metadata_replicas_seq']}) did not answer "
                f"with a copy (answered: {', '.join(sorted(copies))}; not reached: "
                f"{', '.join(unreached) or 'none'}); the copies reached may be behind"
            )
    if problem is None:
        return best
    if not force:
        raise Unavailable(
            f"metadata recovery refused: {problem}. Reach them "
            f"(--recover-metadata-from), or start with {FORCE_FLAG} to take the most complete "
            "copy reached and lose what only the others hold"
        )
    log.error(
        "UNCLEAN METADATA RECOVERY (%s): %s; taking %s, decided ops may be lost",
        FORCE_FLAG,
        problem,
        "nothing" if best is None else f"the copy at op {best['applied_seq']}",
    )
    return best


async def recover(
    peers: PeerPool,
    addresses: list[str],
    journal: FileJournal,
    membership: Membership,
    force: bool = False,
) -> MetadataState | None:
    """Rebuild an empty journal from the copy ``choose_copy`` takes among ``addresses`` (None:
    no copy, every address answered; the coordinator starts empty and says so).  Every
    member that answers is registered at once (as its heartbeat would): reads of sealed
    segments this broker lost go to the other replicas from the first request on."""
    copies: dict[str, dict[str, Any]] = {}
    unreached: list[str] = []
    for address in addresses:
        try:
            answer = await peers.request(address, "meta_fetch")
        except (TimeoutError, OSError, XinfraError) as error:
            log.warning("metadata recovery: %s did not answer: %s", address, error)
            unreached.append(address)
            continue
        membership.heartbeat(answer["broker_id"], address, answer["attributes"], 0)
        if answer.get("state") is not None:
            copies[str(answer["broker_id"])] = answer["state"]
    best = choose_copy(copies, unreached, membership.me.broker_id, force)
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
                # In a thread (0.2 s at 24,576 ranges and segments): nothing changes the copy
                # while this holds the lock, and the member's event loop serves its appends.
                snapshot = await self._runtime.run_blocking(state.to_json)
                await self._journal.replace(snapshot)
            return {}
