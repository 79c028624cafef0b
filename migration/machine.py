"""The migration state machine, pure: which step may follow which, and the bad-input checks.

A topic moves from its source epoch (on one cluster) to a target epoch (on
another) in four states::

    planned -> dual_write -> cut_over -> completed
       \\           \\
        +-----------+--> rolled_back

* ``dual_write``: the target epoch exists (same shard key ranges, ``mirror_of``
  the source); producers write both, source first, each target record carrying
  the source position it mirrors.
* ``cut_over``: the source is sealed with its end offsets (the two-phase
  settle); producers stop writing it and readers cross into the target at the
  exactly translated position (they skip the mirrored prefix).  The
  checkpoints of idle groups move to the target at the translated offsets
  (``migration.checkpoints``), again at ``completed``; a group with live
  members moves itself, committing target positions once it crossed.
* ``completed``: the target is an ordinary active epoch.

Producers are never held by a step: no send waits for a metadata version.
What a migration adds to a send is the dual write itself (a batch goes to the
source, then, carrying its source positions, to the target: one batch in
flight per shard, so a send costs about the two writes in series) and, at
the cut-over, the switch of the batch in flight to the target.  A Northguard
source refuses that batch (``Sealed``) once sealed; it then waits until its
producer sees the version that seals the source, and a step waits at most its
``ack_timeout_s`` for every producer to acknowledge that version (past it the
step pauses and names the late producer).  Hence the documented bound,
``producer_stall_s_max(ack_timeout_s)``: no ``send`` of a producer that keeps
up with the metadata waits longer than the step's ack timeout plus
``PRODUCER_SETTLE_S`` (the batch ahead on its shard and its own two writes, in
series) for its acknowledgement.  The migration tests assert it per step
under steady produce (``tests/migration/test_migration_ng_to_ng.py`` and
``test_migration_live.py``); ``xinfra demo migration`` and
``bench/migration.py`` measure the longest stall and p99 per step.

Nothing is lost silently at the seal: a Northguard source is sealed natively
(a late producer gets ``Sealed``); records that land past a Kafka source's
recorded end offsets are counted as orphaned (``migration.orphans``).

Rollback is possible while the source still takes writes (planned,
dual_write): the target epoch is dropped, group checkpoints on it return to
the source at translated offsets, and its physical topic is deleted.  The service (``migration.service``) persists every state with
its history, performs a step's side effects idempotently, and records a
``pending`` step before acting so a restarted service resumes it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from xinfra.errors import AlreadyMigrating, SameCluster, ShardCountMismatch, StepOutOfOrder

PRODUCER_SETTLE_S = 5.0
"""The writes a send may wait behind besides the new metadata version: the batch ahead on its
shard and its own, each a source then a target write in series.  A local write is a few ms; 5 s
leaves room for an fsync or a pause of a broker, and a wait beyond it is a stall, not load."""


def producer_stall_s_max(ack_timeout_s: float) -> float:
    """The longest a ``send`` may wait for its acknowledgement during a step waiting ``ack_timeout_s``.

    Why this sum: a batch refused by a natively sealed source waits for the
    producer to see the sealing version, which a step allows ``ack_timeout_s``
    for, and then writes, behind at most one batch of its shard.
    """
    return ack_timeout_s + PRODUCER_SETTLE_S


class State(StrEnum):
    PLANNED = "planned"
    DUAL_WRITE = "dual_write"
    CUT_OVER = "cut_over"
    COMPLETED = "completed"
    ROLLED_BACK = "rolled_back"


NEXT: dict[State, State] = {
    State.PLANNED: State.DUAL_WRITE,
    State.DUAL_WRITE: State.CUT_OVER,
    State.CUT_OVER: State.COMPLETED,
}
ROLLBACK_FROM = frozenset({State.PLANNED, State.DUAL_WRITE})
FINISHED = frozenset({State.COMPLETED, State.ROLLED_BACK})
ROLLBACK = "rollback"
"""The ``pending`` marker of a rollback in progress (else ``pending`` names the target state)."""


@dataclass
class Migration:
    virtual_cluster: str
    topic: str
    source_cluster: str
    source_epoch: int
    target_cluster: str
    shards: int
    state: State = State.PLANNED
    target_epoch: int | None = None
    target_physical: str | None = None
    """The target epoch's physical topic, kept so a rollback deletes it even after the
    epoch's row is gone (a rollback paused between the two)."""
    pending: str | None = None
    """The step under way (a target state, or ``rollback``): a restart resumes it."""
    paused: bool = False
    late_clients: list[str] = field(default_factory=list)
    """Clients that had not acknowledged the step's metadata version when it timed out."""
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Migration:
        return cls(**{**body, "state": State(body["state"])})

    def record(self, event: str, **details: Any) -> None:
        self.history.append({"at_ms": int(time.time() * 1000), "event": event, **details})


def plan(
    vc: str,
    topic: str,
    source_cluster: str,
    source_epoch: int,
    source_shards: int,
    target_cluster: str,
    shards: int | None,
    current: Migration | None,
) -> Migration:
    """A new migration, or the 4xx that says why not (nothing is written on a refusal)."""
    if current is not None and current.state not in FINISHED:
        raise AlreadyMigrating(
            f"{vc}/{topic} is already migrating to {current.target_cluster} "
            f"(state {current.state}); finish or roll it back first"
        )
    if target_cluster == source_cluster:
        raise SameCluster(f"{vc}/{topic} is already on cluster {target_cluster}")
    if shards is not None and shards != source_shards:
        raise ShardCountMismatch(
            f"{vc}/{topic} has {source_shards} shards; a migration keeps them ({shards} asked)"
        )
    migration = Migration(vc, topic, source_cluster, source_epoch, target_cluster, source_shards)
    migration.record("planned", source=source_cluster, target=target_cluster)
    return migration


def next_state(migration: Migration, expected: State | None) -> State:
    """The state the next step leads to; ``expected`` guards against a step out of order."""
    if migration.pending is not None and migration.pending != ROLLBACK:
        step = State(migration.pending)  # resume the step a crash or timeout interrupted
    elif migration.state in NEXT:
        step = NEXT[migration.state]
    else:
        raise StepOutOfOrder(f"the migration of {migration.topic} is {migration.state}")
    if migration.pending == ROLLBACK:
        raise StepOutOfOrder(f"the migration of {migration.topic} is rolling back")
    if expected is not None and expected != step:
        raise StepOutOfOrder(
            f"the migration of {migration.topic} is {migration.state}: its next step is "
            f"{step}, not {expected}"
        )
    return step


def check_rollback(migration: Migration) -> None:
    if migration.pending == ROLLBACK:
        return  # resume
    if migration.state not in ROLLBACK_FROM or migration.pending not in (
        None,
        State.DUAL_WRITE.value,
    ):
        raise StepOutOfOrder(
            f"the migration of {migration.topic} is {migration.state}: dual writes have "
            "stopped, it can no longer be rolled back"
        )
