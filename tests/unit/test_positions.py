"""``Positions``: the result of ``send_batch``, built on read from ints, reads like a list of positions."""

from __future__ import annotations

from clients import Positions
from xinfra.model import Position


def test_records_spread_over_shards_read_back_in_call_order() -> None:
    positions = Positions(4)
    positions.place([0, 2], 1, 0, [10, 11])
    positions.place([1, 3], 1, 1, [5, 6])
    assert list(positions) == [
        Position(1, 0, 10),
        Position(1, 1, 5),
        Position(1, 0, 11),
        Position(1, 1, 6),
    ]
    assert positions[1:3] == [Position(1, 1, 5), Position(1, 0, 11)]
    assert positions[-1] == Position(1, 1, 6) and len(positions) == 4


def test_a_chunk_that_lands_in_a_later_epoch_keeps_the_others_epochs() -> None:
    positions = Positions(3)
    positions.place([0, 1], 4, 2, [7, 8])
    positions.place([2], 5, 2, [0])
    assert list(positions) == [Position(4, 2, 7), Position(4, 2, 8), Position(5, 2, 0)]
    assert positions[0:3:2] == [Position(4, 2, 7), Position(5, 2, 0)]


def test_a_whole_call_in_one_batch_and_equality_with_lists() -> None:
    positions = Positions(2)
    positions.place([0, 1], 3, 1, [40, 41])
    assert positions == [Position(3, 1, 40), Position(3, 1, 41)]
    assert positions != [Position(3, 1, 40)]
    assert Positions(0) == [] and list(Positions(0)) == []


def test_places_are_applied_at_the_first_read_in_order_and_after_it() -> None:
    positions = Positions(3)
    positions.place([0, 2], 1, 0, [10, 11])
    assert len(positions) == 3
    assert positions[2] == Position(1, 0, 11)
    positions.place([1], 2, 3, [0])
    assert list(positions) == [Position(1, 0, 10), Position(2, 3, 0), Position(1, 0, 11)]
