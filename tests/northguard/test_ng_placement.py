"""Replica placement: policies over attributes, least loaded first, the leader first, healing.

Includes a deterministic striping simulation (the placement function as the
coordinator calls it, load = active segment replicas then stored bytes): a
broker that joins a loaded cluster takes new replicas at once, its share of
the new follower replicas ends within 20% of the average, and the byte skew
among the followers (max/mean) is reported before and after; nothing moves.
This is the placement logic only; the process-level striping test of issue 15
is ``test_ng_striping.py``.
"""

from __future__ import annotations

import random

import pytest

from backends.northguard.broker.placement import (
    DEFAULT_POLICY,
    BrokerInfo,
    Constraint,
    StoragePolicy,
    choose_additional_replica,
    choose_replicas,
    missing_replicas,
    with_replication_factor,
)
from xinfra.errors import InvalidRequest, Unavailable

RACKS = [BrokerInfo(str(i), {"rack": f"r{(i - 1) % 3 + 1}"}) for i in range(1, 7)]
"""Brokers 1..6 on racks r1, r2, r3, r1, r2, r3."""
ONE_PER_RACK = StoragePolicy(
    "one-per-rack",
    constraints=(Constraint("rack=r1", 1), Constraint("rack=r2", 1), Constraint("rack=r3", 1)),
)


def test_least_loaded_first_and_the_leader_first() -> None:
    policy = with_replication_factor(DEFAULT_POLICY, 3)
    load = {"1": (5, 0), "2": (0, 10), "3": (0, 5), "4": (1, 0), "5": (0, 0), "6": (2, 0)}
    assert choose_replicas(policy, RACKS, load) == ["5", "3", "2"]
    assert choose_replicas(policy, RACKS, load, first="1") == ["1", "5", "3"]


def test_rack_awareness_is_a_policy() -> None:
    load = {b.broker_id: (0, int(b.broker_id)) for b in RACKS}
    chosen = choose_replicas(ONE_PER_RACK, RACKS, load, first="4")
    assert chosen[0] == "4"
    assert sorted(RACKS[int(b) - 1].attributes["rack"] for b in chosen) == ["r1", "r2", "r3"]
    with pytest.raises(Unavailable, match="rack=r3"):
        choose_replicas(ONE_PER_RACK, [b for b in RACKS if b.attributes["rack"] != "r3"], {})
    with pytest.raises(Unavailable, match="leaves out broker 9"):
        choose_replicas(ONE_PER_RACK, RACKS, {}, first="9")


def test_replication_factor_applies_to_the_default_policy_only() -> None:
    assert with_replication_factor(DEFAULT_POLICY, 3).constraints == (Constraint("*", 3),)
    assert with_replication_factor(ONE_PER_RACK, 5) is ONE_PER_RACK


def test_healing_fills_the_short_constraint_least_loaded_first() -> None:
    survivors = [RACKS[0], RACKS[1]]  # racks r1 and r2: r3 lost its replica
    load = {"3": (4, 0), "6": (1, 0)}
    assert choose_additional_replica(ONE_PER_RACK, RACKS, load, survivors) == "6"
    assert (
        choose_additional_replica(with_replication_factor(DEFAULT_POLICY, 3), RACKS, {}, survivors)
        == "3"
    )
    with pytest.raises(Unavailable):
        choose_additional_replica(ONE_PER_RACK, RACKS[:2], {}, survivors)
    with pytest.raises(InvalidRequest):
        choose_additional_replica(ONE_PER_RACK, RACKS, {}, RACKS[:3])


def test_a_joining_broker_takes_its_share_of_new_segments() -> None:
    rng = random.Random(15)
    policy = with_replication_factor(DEFAULT_POLICY, 3)
    brokers = [BrokerInfo(str(i), {}) for i in range(1, 6)]
    active: dict[int, list[str]] = {}
    stored: dict[str, int] = {}

    def roll(range_id: int) -> list[str]:
        for broker_id in active.get(range_id, []):  # sealed: its bytes stay where they are
            stored[broker_id] = stored.get(broker_id, 0) + rng.randint(50, 150)
        counts: dict[str, int] = {}
        for replicas in active.values():
            for broker_id in replicas:
                counts[broker_id] = counts.get(broker_id, 0) + 1
        load = {
            b.broker_id: (counts.get(b.broker_id, 0), stored.get(b.broker_id, 0)) for b in brokers
        }
        active[range_id] = choose_replicas(policy, brokers, load, first="1")
        return active[range_id]

    def follower_skew() -> float:
        values = [stored.get(b.broker_id, 0) for b in brokers if b.broker_id != "1"]
        return max(values) / (sum(values) / len(values))

    for _ in range(400):
        roll(rng.randrange(20))
    skew_before = follower_skew()
    stored_before = dict(stored)
    brokers.append(BrokerInfo("6", {}))
    first = roll(rng.randrange(20))
    assert "6" in first, "a new broker receives new segments at once"
    shares = {b.broker_id: 0 for b in brokers if b.broker_id != "1"}
    for _ in range(1000):
        for broker_id in roll(rng.randrange(20))[1:]:
            shares[broker_id] += 1
    average = sum(shares.values()) / len(shares)
    print(f"follower byte skew (max/mean): {skew_before:.3f} before the join, "
          f"{follower_skew():.3f} after 1000 more segments; new broker share {shares['6'] / average:.3f}x")  # fmt: skip
    assert abs(shares["6"] - average) <= 0.2 * average, shares
    assert all(stored[b] >= stored_before[b] for b in stored_before), "nothing is ever moved"


def test_missing_replicas_counts_what_a_set_lacks_under_the_policy() -> None:
    """The shortfall the metadata copies report: per constraint, brokers of the set that match
    it (and no earlier one), with distinct values where the policy asks."""
    spread = StoragePolicy("spread", constraints=(Constraint("*", 3),), distinct_by="rack")
    r1, r2, r3, r1b = RACKS[0], RACKS[1], RACKS[2], RACKS[3]
    assert missing_replicas(spread, [r1, r2, r3]) == 0
    assert missing_replicas(spread, [r1, r1b, r2]) == 1  # two on r1 count once
    assert missing_replicas(spread, []) == 3
    pinned = StoragePolicy("pinned", constraints=(Constraint("rack=r1", 1), Constraint("*", 1)))
    assert missing_replicas(pinned, [r2]) == 1  # r2 fills "*", nothing fills rack=r1
    assert missing_replicas(pinned, [r2, r1]) == 0


def test_healing_and_the_shortfall_agree_on_distinct_values() -> None:
    """A set that ``missing_replicas`` finds short is one healing adds to: two copies on one
    rack count once under a distinct-rack policy (copies placed by count before the policy
    was defined), so the third goes to the rack none holds."""
    spread = StoragePolicy("spread", constraints=(Constraint("*", 3),), distinct_by="rack")
    current = [RACKS[0], RACKS[3], RACKS[1]]  # racks r1, r1, r2
    assert missing_replicas(spread, current) == 1
    assert choose_additional_replica(spread, RACKS, {}, current) == "3"
    with pytest.raises(InvalidRequest):
        choose_additional_replica(spread, RACKS, {}, [*current, RACKS[2]])
