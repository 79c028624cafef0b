"""How the SDK rides out a retriable failure: retries with backoff and jitter, within a bound.

A broker restarting or a leader moving makes reads fail for a few seconds
with a retriable error (``XinfraError.retriable``: ``Unavailable`` and its
kind).  The application should not see that: ``while True: await
consumer.poll()`` must survive a routine restart.  It must see an outage that
lasts, though, or it would wait forever on a cluster that is gone.

An ``Outage`` is one run of failures of one source (a reader).  Each failure
schedules the next try after ``xinfra.backoff``'s delay (doubling, with
jitter, so that clients failed by the same restart do not come back in step).  The first
failure more than ``bound_s`` after the run began is raised, its message
saying for how long it failed.  A success ends the run (the owner drops it).
"""

from __future__ import annotations

import copy
import random

from xinfra.backoff import backoff_s
from xinfra.errors import XinfraError


class Outage:
    """A run of retriable failures of one source; raises the failure that outlasts ``bound_s``."""

    __slots__ = ("_rng", "bound_s", "failures", "retry_at_s", "since_s")

    def __init__(self, bound_s: float, now_s: float, rng: random.Random | None = None) -> None:
        self.bound_s = bound_s
        self.since_s = now_s
        self.retry_at_s = now_s
        self.failures = 0
        self._rng = rng or random.Random()

    def failed(self, error: XinfraError, now_s: float) -> None:
        """Schedule the next try (``retry_at_s``), or raise ``error`` once the run outlasts the bound.

        A non-retriable error is raised at once: no retry cures it.
        """
        if not error.retriable:
            raise error
        self.failures += 1
        lasted_s = now_s - self.since_s
        if lasted_s > self.bound_s:
            raised = copy.copy(error)
            raised.message = (
                f"{error.message} (still failing after {lasted_s:.1f} s and {self.failures} "
                f"tries; the bound is unavailable_s_max={self.bound_s:g} s)"
            )
            raised.args = (raised.message,)
            raise raised from error
        self.retry_at_s = now_s + backoff_s(self.failures, self._rng)
