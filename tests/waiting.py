"""The one way tests wait for a condition: poll it against a deadline, never sleep a guess."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(
    condition: Callable[[], Awaitable[T | None] | T | None],
    timeout_s: float = 20.0,
    what: str = "condition",
) -> T:
    """Poll ``condition`` (plain or async) until it is truthy and return its value; fail the
    test after ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.02)
