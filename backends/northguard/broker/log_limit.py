"""Rate-limited logging of a repeated error: a failing disk must not also fill the log.

A broker whose store failed sees the same error on every append and every
roll of every range.  ``LogLimiter`` lets one record per key through each
``interval_s``; the next one that passes says how many were suppressed, so
nothing is hidden, only counted.  Keys are a small fixed set chosen by the
caller (the kind of event, not the range), so its memory is bounded.
"""

from __future__ import annotations

import logging
from typing import Any


class LogLimiter:
    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}  # key -> (logged at, suppressed since)

    def warning(self, now_s: float, key: str, message: str, *args: Any) -> None:
        """Log ``message % args`` unless ``key`` was logged less than ``interval_s`` before ``now_s``."""
        logged_s, suppressed = self._last.get(key, (float("-inf"), 0))
        if now_s - logged_s < self._interval_s:
            self._last[key] = (logged_s, suppressed + 1)
            return
        if suppressed:
            message += " (%d more like it in the last %g s were not logged)"
            args = (*args, suppressed, self._interval_s)
        self._logger.warning(message, *args)
        self._last[key] = (now_s, 0)
