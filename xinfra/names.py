"""The one naming rule for clusters, topics and groups.

Apart from ``xinfra.model`` so that a Northguard broker checks names without
importing the model (its pydantic classes are built at import, at every broker
start).
"""

from __future__ import annotations

import re

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
"""1-200 characters of letters, digits, '.', '_' and '-', not starting with punctuation (Kafka's
legal characters, minus a leading dot so no name collides with internal topics)."""

_NAME_RE = re.compile(NAME_PATTERN)


def check_name(name: str, what: str = "name") -> str:
    if not _NAME_RE.match(name):
        raise ValueError(
            f"{what} {name!r} is invalid: use 1-200 of [A-Za-z0-9._-], starting with a letter or digit"
        )
    return name
