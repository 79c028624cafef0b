"""Storage policies and replica placement: constraints over broker attributes, never racks by name.

A policy has a retention and constraints; a constraint is an expression over
broker attributes (``rack=r1``, ``rack!=r2``, ``*``) and a count of replicas
that must satisfy it.  ``choose_replicas`` picks, for a new segment, the
least-loaded eligible brokers (log striping: new segments go to new brokers
at once, nothing is ever moved).  With one broker the answer is that broker,
when the policy allows it.

``distinct_by`` (an attribute key) makes every replica of a segment differ in
that attribute: ``distinct_by=rack`` with one ``*`` constraint of 3 is rack
awareness without naming a rack.  ``policy_from_json`` is the one check of a
policy an administrator defines: a bad one is refused at creation, with what
is wrong, before it can block any segment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from xinfra.errors import InvalidRequest, Unavailable
from xinfra.names import check_name

DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000
REPLICAS_MAX = 16
"""Replicas a policy may ask for in total."""
CONSTRAINTS_MAX = 16


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
    distinct_by: str | None = None  # an attribute every replica of a segment differs in

    @property
    def replicas(self) -> int:
        return sum(c.count for c in self.constraints)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "retention_ms": self.retention_ms,
            "constraints": [
                {"expression": c.expression, "count": c.count} for c in self.constraints
            ],
            "distinct_by": self.distinct_by,
        }


def policy_from_json(data: Any) -> StoragePolicy:
    """A checked policy; ``InvalidRequest`` saying what is wrong (name, counts, expressions)."""
    if not isinstance(data, dict):
        raise InvalidRequest("a storage policy is a JSON object")
    name = data.get("name")
    if not isinstance(name, str):
        raise InvalidRequest("a storage policy needs a name")
    try:
        check_name(name, "policy name")
    except ValueError as error:
        raise InvalidRequest(str(error)) from error
    retention_ms = data.get("retention_ms", DEFAULT_RETENTION_MS)
    if not isinstance(retention_ms, int) or isinstance(retention_ms, bool) or retention_ms <= 0:
        raise InvalidRequest(f"policy {name!r}: retention_ms must be a positive integer")
    raw = data.get("constraints")
    if not isinstance(raw, list) or not 1 <= len(raw) <= CONSTRAINTS_MAX:
        raise InvalidRequest(f"policy {name!r}: 1..{CONSTRAINTS_MAX} constraints are required")
    constraints: list[Constraint] = []
    for item in raw:
        if not isinstance(item, dict):
            raise InvalidRequest(f"policy {name!r}: a constraint is {{expression, count}}")
        expression, count = item.get("expression"), item.get("count")
        if not isinstance(expression, str) or not expression.strip():
            raise InvalidRequest(f"policy {name!r}: a constraint needs an expression ('*' for any)")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise InvalidRequest(f"policy {name!r}: constraint {expression!r} needs a count >= 1")
        _check_expression(name, expression)
        constraints.append(Constraint(expression.strip(), count))
    total = sum(c.count for c in constraints)
    if total > REPLICAS_MAX:
        raise InvalidRequest(f"policy {name!r} asks for {total} replicas; at most {REPLICAS_MAX}")
    distinct_by = data.get("distinct_by")
    if distinct_by is not None and (not isinstance(distinct_by, str) or not distinct_by.strip()):
        raise InvalidRequest(f"policy {name!r}: distinct_by is an attribute key")
    return StoragePolicy(name, retention_ms, tuple(constraints), distinct_by or None)


def _check_expression(policy: str, expression: str) -> None:
    if expression.strip() == "*":
        return
    for clause in expression.split(","):
        separator = "!=" if "!=" in clause else "=" if "=" in clause else None
        if separator is None:
            raise InvalidRequest(
                f"policy {policy!r}: clause {clause.strip()!r} of {expression!r} is not "
                "key=value or key!=value"
            )
        key, value = (part.strip() for part in clause.split(separator, 1))
        if not key or not value:
            raise InvalidRequest(
                f"policy {policy!r}: clause {clause.strip()!r} of {expression!r} needs a key "
                "and a value"
            )


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
    ``first``: a broker that must hold a replica, placed first and counted in the first
    constraint it satisfies (``Unavailable`` when the policy leaves it out).
    """
    chosen: list[str] = []
    taken: set[str] = set()  # values of ``distinct_by`` the chosen brokers have
    key = policy.distinct_by
    for constraint in policy.constraints:
        eligible = [
            b for b in brokers if b.broker_id not in chosen and constraint.matches(b.attributes)
        ]
        eligible.sort(key=lambda b: (b.broker_id != first, load.get(b.broker_id, ()), b.broker_id))
        picked: list[BrokerInfo] = []
        for broker in eligible:
            if len(picked) == constraint.count:
                break
            if key is not None:
                value = broker.attributes.get(key)
                if value is None or value in taken:
                    continue
                taken.add(value)
            picked.append(broker)
        if len(picked) < constraint.count:
            distinct = "" if key is None else f" with distinct {key!r}"
            raise Unavailable(
                f"storage policy {policy.name!r} needs {constraint.count} brokers matching "
                f"{constraint.expression!r}{distinct}; only {len(picked)} live brokers do"
            )
        chosen += [b.broker_id for b in picked]
    if first is not None:
        if first not in chosen:
            raise Unavailable(f"storage policy {policy.name!r} leaves out broker {first}")
        chosen.remove(first)
        chosen.insert(0, first)
    return chosen


def leader_first(
    replicas: Sequence[str], led: Mapping[str, int], prefer: Sequence[str] = ()
) -> list[str]:
    """``replicas`` with the new segment's leader first: one of ``prefer`` (the live replicas of
    the range's previous segment, which hold the batches the leader's duplicate table is
    rebuilt from) when the set has one, else any; among those, the one leading the fewest
    active segments (``led``), so leaders spread over the brokers as replicas do."""
    candidates = [b for b in replicas if b in prefer] or list(replicas)
    leader = min(candidates, key=lambda b: (led.get(b, 0), b))
    return [leader, *(b for b in replicas if b != leader)]


def with_replication_factor(policy: StoragePolicy, factor: int) -> StoragePolicy:
    """``policy`` with ``factor`` replicas from any broker, when it is the plain default policy.

    A policy with its own constraints says how many replicas it wants; the topic's or the
    broker's replication factor applies to the default policy (one constraint ``*``).
    """
    if policy.constraints == (Constraint(),):
        return StoragePolicy(
            policy.name, policy.retention_ms, (Constraint("*", factor),), policy.distinct_by
        )
    return policy


def _matched(policy: StoragePolicy, current: Sequence[BrokerInfo]) -> list[int]:
    """Per constraint, how many brokers of ``current`` count for it: those matching it and no
    earlier constraint, up to its count, with distinct values of ``distinct_by`` where the
    policy asks (two replicas on one rack count once)."""
    used: set[str] = set()
    taken: set[str] = set()
    key = policy.distinct_by
    counted: list[int] = []
    for constraint in policy.constraints:
        matched = 0
        for broker in current:
            if matched == constraint.count:
                break
            if broker.broker_id in used or not constraint.matches(broker.attributes):
                continue
            if key is not None:
                value = broker.attributes.get(key)
                if value is None or value in taken:
                    continue
                taken.add(value)
            used.add(broker.broker_id)
            matched += 1
        counted.append(matched)
    return counted


def missing_replicas(policy: StoragePolicy, current: Sequence[BrokerInfo]) -> int:
    """Replicas ``current`` lacks to satisfy ``policy`` (0: satisfied), counted as ``_matched``
    counts them."""
    return sum(
        c.count - matched
        for c, matched in zip(policy.constraints, _matched(policy, current), strict=True)
    )


def choose_additional_replica(
    policy: StoragePolicy,
    brokers: Sequence[BrokerInfo],
    load: Mapping[str, tuple[int, ...]],
    current: Sequence[BrokerInfo],
) -> str:
    """One broker to add to a sealed segment's replica set ``current`` (re-replication): the
    least loaded live broker outside it that fills the first constraint ``current`` falls short
    of (as ``missing_replicas`` counts it); ``Unavailable`` when none can."""
    held = {b.broker_id for b in current}
    counted = _matched(policy, current)
    for constraint, matched in zip(policy.constraints, counted, strict=True):
        if matched >= constraint.count:
            continue
        key = policy.distinct_by
        taken = {b.attributes.get(key) for b in current} if key is not None else set()
        eligible = [
            b
            for b in brokers
            if b.broker_id not in held
            and constraint.matches(b.attributes)
            and (key is None or b.attributes.get(key) not in taken | {None})
        ]
        if not eligible:
            values = sorted(v for v in taken if v is not None)
            distinct = "" if key is None else f" with a distinct {key!r} (taken: {values})"
            raise Unavailable(
                f"storage policy {policy.name!r}: no live broker outside {sorted(held)} matches "
                f"{constraint.expression!r}{distinct}"
            )
        eligible.sort(key=lambda b: (load.get(b.broker_id, ()), b.broker_id))
        return eligible[0].broker_id
    raise InvalidRequest(f"replica set {sorted(held)} already satisfies policy {policy.name!r}")
