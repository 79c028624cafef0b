"""The request-head timer of the guarded protocols (``metadata_service.server._HeadTimer``):
one timer per connection, and still every head cut ``header_timeout_s`` after it began,
never earlier.  Driven by a hand-turned clock: what it checks is which deadline the timer
keeps, not how long anything takes (the live cuts are in ``test_ms_security_limits``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from metadata_service.server import _HeadTimer

TIMEOUT_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, Callable[[], None], Handle]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Handle:
        handle = Handle()
        self.timers.append((self.now + delay, callback, handle))
        return handle

    def advance(self, to: float) -> None:
        self.now = to
        while due := [t for t in self.timers if t[0] <= to and not t[2].cancelled]:
            entry = min(due, key=lambda t: t[0])
            self.timers.remove(entry)
            entry[1]()

    def live_timers(self) -> int:
        return sum(1 for t in self.timers if not t[2].cancelled)


class Handle:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Transport:
    closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class Connection(_HeadTimer):
    def __init__(self, clock: Clock) -> None:
        self.loop: Any = clock
        self.transport: Any = Transport()
        self.header_timeout_s = TIMEOUT_S
        self._head_timer = None
        self._head_since = None
        self.in_head = False

    def head_begins(self) -> None:
        self.in_head = True
        self._arm()

    def head_ends(self) -> None:
        self.in_head = False
        self._disarm()

    def _in_head_now(self) -> bool:
        return self.in_head


def test_many_requests_share_one_timer_and_a_later_head_gets_its_whole_timeout() -> None:
    clock = Clock()
    connection = Connection(clock)
    for request in range(100):  # a busy kept-alive connection: a head every 0.05 s
        clock.advance(request * 0.05)
        connection.head_begins()
        connection.head_ends()
    assert len(clock.timers) == 1, "a timer per request"
    clock.advance(9.9)
    connection.head_begins()  # begins 0.1 s before the first timer fires, never ends
    clock.advance(TIMEOUT_S + 1)
    assert not connection.transport.closed, "cut before its own timeout"
    assert clock.live_timers() == 1
    clock.advance(9.9 + TIMEOUT_S - 0.001)
    assert not connection.transport.closed
    clock.advance(9.9 + TIMEOUT_S)
    assert connection.transport.closed


def test_a_head_that_never_ends_is_cut_and_an_ended_one_never_is() -> None:
    clock = Clock()
    quiet, stalled = Connection(clock), Connection(clock)
    quiet.head_begins()
    stalled.head_begins()
    clock.advance(1.0)
    quiet.head_ends()
    clock.advance(TIMEOUT_S)
    assert stalled.transport.closed and not quiet.transport.closed
    assert quiet._head_timer is None, "a timer kept for a connection between heads"
    clock.advance(100.0)
    quiet.head_begins()  # the next head arms again
    clock.advance(100.0 + TIMEOUT_S)
    assert quiet.transport.closed


def test_a_lost_connection_drops_its_timer() -> None:
    clock = Clock()
    connection = Connection(clock)
    connection.head_begins()
    connection._drop_head_timer()
    assert clock.live_timers() == 0
