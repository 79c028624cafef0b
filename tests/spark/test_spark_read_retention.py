"""What a slice read does when retention races it: a shard reader scripted in memory, a fake clock.

No broker and no JVM: ``RacingShard`` holds offsets [start, high) of one shard,
retention moves ``start`` at the moment a test names, and its own answers to
``start_offsets`` may lag behind what its polls already enforce (a fetch that
saw the deletion before the offset listing did).  Every poll that finds
nothing advances the clock by the poll's timeout, as a real wait would, so
the stall timeout (``STALL_S_MAX``) is reached in simulated time, and a read
that would poll forever is stopped by the polls bound instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from clients.spark.plan import Slice
from clients.spark.read import POLL_TIMEOUT_S, STALL_S_MAX, _Cursor
from xinfra.backend import ShardReader
from xinfra.errors import OffsetOutOfRange, Timeout
from xinfra.model import ConsumedRecord

POLLS_MAX = 10_000
"""A read still polling after this many polls is a spin: the test fails instead of hanging."""


REQUEST_S = 0.01
"""How long a refused fetch takes in simulated time."""


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.now_s += seconds


class RacingShard(ShardReader):
    """Shard 0 holding offsets [start, high); a poll outside them raises ``OffsetOutOfRange``."""

    def __init__(self, high: int, clock: Clock) -> None:
        self.start = 0
        self.high = high
        self.clock = clock
        self.position: int | None = None
        self.listed_start: int | None = None
        """What ``start_offsets`` answers when set (a listing lagging behind the fetch path)."""
        self.empty_polls_before_retention = 0
        self.retention_to: int | None = None
        self.polls = 0

    def assign(self, positions: Mapping[int, int]) -> None:
        self.position = positions.get(0)

    async def poll(self, max_records: int = 1000, timeout_s: float = 1.0) -> list[ConsumedRecord]:
        self.polls += 1
        if self.polls > POLLS_MAX:
            raise AssertionError(f"still polling after {POLLS_MAX} polls: the read spins")
        if self.empty_polls_before_retention > 0:  # a slow broker: nothing comes, time passes
            self.empty_polls_before_retention -= 1
            self.clock.now_s += timeout_s
            return []
        if self.retention_to is not None:  # then retention removes records
            self.start, self.retention_to = self.retention_to, None
        assert self.position is not None
        if not self.start <= self.position <= self.high:
            self.clock.now_s += REQUEST_S  # a refusal comes back at once, after a round trip
            raise OffsetOutOfRange(f"offset {self.position} outside [{self.start}, {self.high}]")
        end = min(self.high, self.position + max_records)
        records = [
            ConsumedRecord(0, offset, 0, None, b"v%d" % offset)
            for offset in range(self.position, end)
        ]
        if not records:
            self.clock.now_s += timeout_s
        self.position = end
        return records

    async def start_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        return {0: self.start if self.listed_start is None else self.listed_start}

    async def end_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        return {0: self.high}

    async def offset_for_timestamp(self, shard: int, timestamp_ms: int) -> int:
        raise NotImplementedError

    async def close(self) -> None:
        pass


def read(shard: RacingShard, clock: Clock, end: int, fail_on_data_loss: bool) -> list[int]:
    """The offsets a slice [0, end) of the shard yields, read as ``read_slice`` reads."""
    piece = Slice("t", 0, 0, 0, end, cluster="{}", physical_topic="t")

    async def run() -> list[int]:
        cursor = _Cursor(piece, fail_on_data_loss, clock, clock.sleep)
        shard.assign({0: piece.start})
        offsets: list[int] = []
        while cursor.next < piece.end:
            offsets += [record.offset for record in await cursor.poll(shard)]
        return offsets

    return asyncio.run(run())


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_fetch_refused_while_the_listing_still_shows_the_records_ends_within_the_stall_timeout(
    fail_on_data_loss: bool,
) -> None:
    """Retention removed offsets 0-4; every poll is refused (OffsetOutOfRange) but the shard's
    listed first offset still says 0 and its end 10, so neither retention nor a lost end
    explains it.  The read must neither spin (each refusal comes back at once: polling again
    straight away hammers the broker and, in simulated time, never reaches the stall timeout)
    nor poll on forever: it waits a poll's timeout between tries and fails once the stall
    timeout passes."""
    clock = Clock()
    shard = RacingShard(high=10, clock=clock)
    shard.start = 5
    shard.listed_start = 0
    with pytest.raises(Timeout, match="yielded nothing"):
        read(shard, clock, end=10, fail_on_data_loss=fail_on_data_loss)
    assert clock.now_s - 1000.0 > STALL_S_MAX
    assert shard.polls <= STALL_S_MAX / POLL_TIMEOUT_S + 2


def test_retention_caught_up_by_the_listing_fails_naming_retention() -> None:
    clock = Clock()
    shard = RacingShard(high=10, clock=clock)
    shard.empty_polls_before_retention = 3
    shard.retention_to = 5
    with pytest.raises(OffsetOutOfRange, match="removed by retention"):
        read(shard, clock, end=10, fail_on_data_loss=True)


def test_a_skip_past_retention_is_progress_for_the_stall_timeout() -> None:
    """A slow shard yields nothing for the whole stall timeout but a round trip, then retention
    removes offsets 0-4.  Without failOnDataLoss the read skips to 5: that is progress, and
    offsets 5-9 are there, so the read must return them, not time out on the skip because the
    shard was slow before it."""
    clock = Clock()
    shard = RacingShard(high=10, clock=clock)
    shard.empty_polls_before_retention = int(STALL_S_MAX / POLL_TIMEOUT_S)
    shard.retention_to = 5
    assert read(shard, clock, end=10, fail_on_data_loss=False) == [5, 6, 7, 8, 9]
