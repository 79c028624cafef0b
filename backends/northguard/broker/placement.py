"""Storage policies and replica placement: constraints over broker attributes, never racks by name.

A policy has a retention and constraints; a constraint is an expression over
broker attributes (``rack=r1``, ``rack!=r2``, ``*``) and a count of replicas
that must satisfy it.  ``choose_replicas`` picks, for a new segment, the
least-loaded eligible brokers (log striping: new segments go to new brokers
at once, nothing is ever moved).  With one broker the answer is that broker,
when the policy allows it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from xinfra.errors import InvalidRequest, Unavailable

DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000


@dataclass(frozen=True, slots=True)
class Constraint:
    expression: str = "*"
    count: int = 1

    def matches(self, attributes: Mapping[str, str]) -> bool:
        if self.expression.strip() == "*":
            return True
        for clause in self.expression.split(","):
            if "!=" in clause:
                key, value = (part.strip() for part in clause.split("!=", 1))
                if attributes.get(key) == value:
                    return False
            elif "=" in clause:
                key, value = (part.strip() for part in clause.split("=", 1))
                if attributes.get(key) != value:
                    return False
            else:
                raise InvalidRequest(f"constraint clause {clause!r} is not key=value or key!=value")
        return True


@dataclass(frozen=True, slots=True)
class StoragePolicy:
    name: str
    retention_ms: int = DEFAULT_RETENTION_MS
    constraints: tuple[Constraint, ...] = field(default_factory=lambda: (Constraint(),))


DEFAULT_POLICY = StoragePolicy("default")


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    broker_id: str
    attributes: Mapping[str, str]


def choose_replicas(
    policy: StoragePolicy,
    brokers: Sequence[BrokerInfo],
    load: Mapping[str, tuple[int, ...]],
    first: str | None = None,
) -> list[str]:
    """Broker ids for a new segment's replica set; ``Unavailable`` if the policy cannot be met.

    ``load`` orders eligible brokers, least loaded first (a missing broker has none).
    ``first``: a broker that must hold a replica (the segment's leader), placed first
    and counted in the first constraint it satisfies.
    """
    chosen: list[str] = []
    for constraint in policy.constraints:
        eligible = [
            b for b in brokers if b.broker_id not in chosen and constraint.matches(b.attributes)
        ]
        eligible.sort(key=lambda b: (b.broker_id != first, load.get(b.broker_id, ()), b.broker_id))
        if len(eligible) < constraint.count:
            raise Unavailable(
                f"storage policy {policy.name!r} needs {constraint.count} brokers matching "
                f"{constraint.expression!r}; {len(eligible)} are available"
            )
        chosen += [b.broker_id for b in eligible[: constraint.count]]
    if first is not None:
        if first not in chosen:
            raise Unavailable(
                f"storage policy {policy.name!r} leaves out broker {first}, which leads every "
                "active segment of this cluster (its coordinator)"
            )
        chosen.remove(first)
        chosen.insert(0, first)
    return chosen


def with_replication_factor(policy: StoragePolicy, factor: int) -> StoragePolicy:
    """``policy`` with ``factor`` replicas from any broker, when it is the plain default policy.

    A policy with its own constraints says how many replicas it wants; the topic's or the
    broker's replication factor applies to the default policy (one constraint ``*``).
    """
    if policy.constraints == (Constraint(),):
        return StoragePolicy(policy.name, policy.retention_ms, (Constraint("*", factor),))
    return policy


def choose_additional_replica(
    policy: StoragePolicy,
    brokers: Sequence[BrokerInfo],
    load: Mapping[str, tuple[int, ...]],
    current: Sequence[BrokerInfo],
) -> str:
    """One broker to add to a sealed segment's replica set ``current`` (re-replication): the
    least loaded live broker outside it that fills the first constraint ``current`` falls short
    of; ``Unavailable`` when none can."""
    held = {b.broker_id for b in current}
    used: set[str] = set()
    for constraint in policy.constraints:
        matching = [
            b.broker_id
            for b in current
            if b.broker_id not in used and constraint.matches(b.attributes)
        ][: constraint.count]
        used.update(matching)
        if len(matching) >= constraint.count:
            continue
        eligible = [
            b for b in brokers if b.broker_id not in held and constraint.matches(b.attributes)
        ]
        if not eligible:
            raise Unavailable(
                f"storage policy {policy.name!r}: no live broker outside {sorted(held)} matches "
                f"{constraint.expression!r}"
            )
        eligible.sort(key=lambda b: (load.get(b.broker_id, ()), b.broker_id))
        return eligible[0].broker_id
    raise InvalidRequest(f"replica set {sorted(held)} already satisfies policy {policy.name!r}")
