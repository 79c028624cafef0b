"""``MirrorMap``: a translated position is exact or there is none, checked against brute force.

Exact forward means: reading the target from the translated offset yields the
source records ``[o, end)`` each once, then what follows the prefix.  Exact
backward means: the records not yet read from the target are exactly the
source records at or past the translated offset (those the target has).
"""

from __future__ import annotations

import random

import pytest

from migration.translate import MirrorMap


def _map(sources: list[int], end: int | None, first: int = 100) -> MirrorMap:
    targets = range(first, first + len(sources))
    return MirrorMap.build(first, first + len(sources), end, zip(targets, sources, strict=True))


def _forward_exact(sources: list[int], end: int, offset: int) -> int | None:
    """The index from which the target's records are exactly [offset, end), by brute force."""
    for index in range(len(sources) + 1):
        if sorted(sources[index:]) == list(range(offset, end)) and all(
            s < offset for s in sources[:index]
        ):
            return index
    return None


def test_a_clean_dual_write_translates_every_offset_both_ways() -> None:
    mirror = _map(list(range(40, 60)), 60)  # source 40..59 mirrored at target 100..119
    assert mirror.to_target(40) == 100
    assert mirror.to_target(47) == 107
    assert mirror.to_target(60) == 120  # read to the source's end: the first unmirrored record
    assert mirror.to_target(39) is None  # before the dual writes: stays on the source
    assert mirror.to_source(100) == 40
    assert mirror.to_source(107) == 47
    assert mirror.to_source(120) == 60


def test_a_missing_mirror_or_a_duplicate_is_never_translated_across() -> None:
    gap = _map([40, 41, 43, 44], 45)  # 42 was written to the source only
    assert gap.to_target(41) is None  # reading the target from 41 would lose 42
    assert gap.to_target(43) == 102
    assert gap.to_source(102) == 42  # backward: 42 is read from the source
    twice = _map([40, 41, 41, 42], 43)
    assert twice.to_target(41) is None and twice.to_target(40) is None
    assert twice.to_target(42) == 103


def test_interleaved_producers_translate_only_at_clean_cuts() -> None:
    mirror = _map([40, 42, 41, 43], 44)
    assert mirror.to_target(40) == 100
    assert mirror.to_target(41) == 101  # 42 then 41: the target's order, each once
    assert mirror.to_target(42) is None  # 41 would come after it: read twice
    assert mirror.to_target(43) == 103
    assert mirror.to_source(102) is None  # read 40, 42: 41 unread below 42
    assert mirror.to_source(103) == 43


@pytest.mark.parametrize("seed", range(200))
def test_forward_translation_agrees_with_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    start, end = 10, 10 + rng.randint(0, 12)
    sources = list(range(start, end))
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(["swap", "drop", "repeat"])
        if len(sources) >= 2 and kind == "swap":
            i = rng.randrange(len(sources) - 1)
            sources[i], sources[i + 1] = sources[i + 1], sources[i]
        elif sources and kind == "drop":
            sources.pop(rng.randrange(len(sources)))
        elif sources and kind == "repeat":
            i = rng.randrange(len(sources))
            sources.insert(i + 1, sources[i])
    mirror = _map(sources, end)
    for offset in range(start - 2, end + 1):
        index = _forward_exact(sources, end, offset)
        assert mirror.to_target(offset) == (None if index is None else 100 + index), (
            sources,
            offset,
        )
