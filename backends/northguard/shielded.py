"""``to_completion``: finish a step that must not stop halfway, even when its caller is cancelled.

A broker cancels a unary request's task when its connection closes.  If the
request is inside a store mutation or a journal commit, plain cancellation
releases the lock at once while the worker thread is still writing, and the
next holder finds the store half-changed (a WAL file closed and not yet
reopened, an op written to the journal but not applied).  Such steps run to
completion under their lock; the cancellation is delivered afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def to_completion(step: Awaitable[T]) -> T:
    """Await ``step``; if cancelled meanwhile, let it finish first, then re-raise the cancellation."""
    task = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                continue
            except Exception:
                break
        raise
