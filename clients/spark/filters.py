"""Spark's pushed-down filters, turned into the part of the topics a batch read must cover.

Filters on ``topic``, ``epoch``, ``shard``, ``offset`` (comparisons, equality,
IN) and lower bounds on ``timestamp`` narrow the plan: fewer slices, shorter
ranges.  Every filter is still handed back to Spark, which evaluates it on
the rows read, so the narrowing only has to cover every matching record,
never to be exact: a timestamp lower bound starts each shard at the first
offset at or after it (every record before has an older timestamp), while
an upper bound on timestamps cannot end a shard early (timestamps need not
grow with offsets) and is left to Spark alone.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import replace

from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    LessThan,
    LessThanOrEqual,
)

from clients.spark.plan import Bounds, Narrowing


def narrowing(filters: Sequence[Filter]) -> Narrowing:
    """The AND of the filters Spark pushed, as far as the planner can use them."""
    out = Narrowing()
    for item in filters:
        column = item.attribute if len(item.attribute) == 1 else ()  # type: ignore[attr-defined]
        if column == ("topic",):
            names = _topics(item)
            if names is not None:
                out = replace(out, topics=names if out.topics is None else out.topics & names)
        elif column == ("epoch",) and (bounds := _bounds(item)) is not None:
            out = replace(out, epochs=_meet(out.epochs, bounds))
        elif column == ("shard",) and (bounds := _bounds(item)) is not None:
            out = replace(out, shards=_meet(out.shards, bounds))
        elif column == ("offset",) and (bounds := _bounds(item)) is not None:
            out = replace(out, offsets=_meet(out.offsets, bounds))
        elif column == ("timestamp",):
            lowest = _timestamp_min(item)
            if lowest is not None and (
                out.timestamp_ms_min is None or lowest > out.timestamp_ms_min
            ):
                out = replace(out, timestamp_ms_min=lowest)
    return out


def _topics(item: Filter) -> frozenset[str] | None:
    if isinstance(item, EqualTo) and isinstance(item.value, str):
        return frozenset([item.value])
    if isinstance(item, In) and all(isinstance(v, str) for v in item.value):
        return frozenset(item.value)
    return None


def _bounds(item: Filter) -> Bounds | None:
    value = getattr(item, "value", None)
    if isinstance(item, In):
        if all(isinstance(v, int) for v in item.value):
            return Bounds(values=frozenset(item.value))
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    if isinstance(item, EqualTo):
        return Bounds(values=frozenset([value]))
    if isinstance(item, GreaterThan):
        return Bounds(lo=value + 1)
    if isinstance(item, GreaterThanOrEqual):
        return Bounds(lo=value)
    if isinstance(item, LessThan):
        return Bounds(hi=value)
    if isinstance(item, LessThanOrEqual):
        return Bounds(hi=value + 1)
    return None


def _meet(a: Bounds, b: Bounds) -> Bounds:
    values = a.values if b.values is None else b.values if a.values is None else a.values & b.values
    return Bounds(lo=max(a.lo, b.lo), hi=min(a.hi, b.hi), values=values)


def _timestamp_min(item: Filter) -> int | None:
    """The timestamp (ms) every matching record is at or after, for >, >= and = filters."""
    if not isinstance(item, GreaterThan | GreaterThanOrEqual | EqualTo):
        return None
    value = item.value
    if not isinstance(value, datetime.datetime):
        return None
    if value.tzinfo is None:
        value = value.astimezone()  # Spark hands session-local naive datetimes
    return int(value.timestamp() * 1000)
