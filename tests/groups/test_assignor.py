"""The assignor, as properties: every unit owned once, members within one unit of each other
(same subscription), and no more moves than the minimum any fair assignment needs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from metadata_service.groups.assignor import assign, minimum_moves, moves


def members(names: list[str], topics: list[str]) -> dict[str, list[str]]:
    return {name: list(topics) for name in names}


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[list[str]], int]:
    """A sequence of memberships (joins and leaves), over a topic of ``shards`` shards."""
    shards = draw(st.integers(1, 60))
    pool = [f"m{i}" for i in range(12)]
    steps = draw(st.lists(st.sets(st.sampled_from(pool), min_size=1), min_size=1, max_size=8))
    return [sorted(s) for s in steps], shards


@settings(max_examples=300, deadline=None)
@given(histories())
def test_fair_and_sticky_through_joins_and_leaves(history: tuple[list[list[str]], int]) -> None:
    steps, shards = history
    current: dict[str, list[tuple[str, int]]] = {}
    for names in steps:
        target = assign(members(names, ["t"]), {"t": shards}, current)
        units = [u for us in target.values() for u in us]
        assert sorted(units) == [("t", s) for s in range(shards)], "each shard exactly once"
        sizes = [len(us) for us in target.values()]
        assert max(sizes) - min(sizes) <= 1, f"unfair: {sizes}"
        assert moves(current, target) == minimum_moves(current, names, shards), "not sticky"
        current = target


def test_a_member_joining_takes_only_its_share() -> None:
    names = [f"m{i}" for i in range(50)]
    before = assign(members(names, ["t"]), {"t": 200}, {})
    after = assign(members([*names, "new"], ["t"]), {"t": 200}, before)
    assert len(after["new"]) == 3  # 200 / 51 rounds down to 3
    assert moves(before, after) == 3
    assert sum(1 for m in names if after[m] != before[m]) == 3, "only three members gave a shard"


def test_members_of_other_topics_never_move_a_shard() -> None:
    before = assign({"a": ["x"], "b": ["x"]}, {"x": 4, "y": 2}, {})
    after = assign({"a": ["x"], "b": ["x"], "c": ["y"]}, {"x": 4, "y": 2}, before)
    assert after["a"] == before["a"] and after["b"] == before["b"]
    assert after["c"] == [("y", 0), ("y", 1)]


def test_deterministic_and_ignores_unknown_topics() -> None:
    subscription = {"b": ["x", "gone"], "a": ["x"]}
    assert assign(subscription, {"x": 5}, {}) == assign(
        dict(reversed(subscription.items())), {"x": 5}, {}
    )
    assert assign({"a": ["gone"]}, {"x": 3}, {}) == {"a": []}
