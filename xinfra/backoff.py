"""How long to wait before trying again after a retriable failure: one rule for every client.

The delay doubles from ``BACKOFF_S_MIN`` to ``BACKOFF_S_MAX`` with "equal
jitter" (half fixed, half random), so a broker that refuses everything (a
failed disk, metadata naming a broker that does not lead the range) is never
hammered, and clients failed by the same restart do not come back in step.
"""

from __future__ import annotations

import random
from typing import Final

BACKOFF_S_MIN: Final = 0.05
"""The delay after the first failure of a run: a restart's connection refusal is brief."""
BACKOFF_S_MAX: Final = 2.0
"""The longest delay between tries: a broker back from a restart is used within it."""


def equal_jitter(delay_s: float, rng: random.Random | None = None) -> float:
    """``delay_s`` with "equal jitter": half fixed, half random, so retries do not come in step."""
    return delay_s * (0.5 + 0.5 * (rng or random).random())


def backoff_s(failures: int, rng: random.Random | None = None) -> float:
    """The wait after the ``failures``-th failure in a row (1: the minimum), jittered."""
    exponent = min(max(failures - 1, 0), 16)
    return equal_jitter(min(BACKOFF_S_MAX, BACKOFF_S_MIN * float(1 << exponent)), rng)
