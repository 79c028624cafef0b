"""``fast_fields``: a named tuple's fields as member descriptors, everything else kept.

Why the swap: CPython 3.11 specialises reading a ``T_OBJECT_EX`` member
(``LOAD_ATTR_SLOT``) but not a named tuple's ``_tuplegetter``.  What it must
not change: indexing, unpacking, ``_fields``, ``_replace``, ``_asdict``,
pickling, pattern matching, properties, read-only fields.
"""

from __future__ import annotations

import copy
import pickle
from collections import namedtuple
from typing import Any, NamedTuple

import pytest

from clients.consumer import XinfraRecord
from xinfra.backend import ReaderOptions
from xinfra.errors import InvalidRequest
from xinfra.model import ConsumedRecord, fast_fields


def test_the_records_fields_are_member_descriptors() -> None:
    for cls in (ConsumedRecord, XinfraRecord):
        for name in cls._fields:
            assert type(cls.__dict__[name]).__name__ == "member_descriptor", (cls, name)


def test_a_record_behaves_as_the_named_tuple_it_is() -> None:
    record = ConsumedRecord(1, 2, 3, b"k", b"v")
    assert (record.shard, record.offset, record.timestamp_ms) == (1, 2, 3)
    assert (record.key, record.value, record.headers) == (b"k", b"v", ())
    assert record[1] == 2 and record[-1] == ()
    shard, offset, *_ = record
    assert (shard, offset) == (1, 2)
    assert record._replace(offset=9).offset == 9
    assert record._asdict()["value"] == b"v"
    assert ConsumedRecord._make(tuple(record)) == record
    assert pickle.loads(pickle.dumps(record)) == record
    assert copy.deepcopy(record) == record
    assert ConsumedRecord.offset.__doc__ == "Alias for field number 1"
    match record:
        case ConsumedRecord(shard=1, offset=offset):
            assert offset == 2
        case _:
            pytest.fail("no match")
    with pytest.raises(AttributeError):
        record.offset = 5  # type: ignore[misc]
    full = XinfraRecord("t", 4, 1, 2, 3, None, b"v")
    assert full.position == (4, 1, 2)
    assert repr(full).startswith("XinfraRecord(topic='t', epoch=4")


def test_applying_it_twice_changes_nothing() -> None:
    descriptor = ConsumedRecord.__dict__["offset"]
    assert fast_fields(ConsumedRecord) is ConsumedRecord
    assert ConsumedRecord.__dict__["offset"] is descriptor


def test_types_whose_instances_could_hold_other_things_are_refused() -> None:
    """Only plain named tuples: no ``__dict__``, no slots, each field its own item's getter."""

    class WithDict(namedtuple("Base", "a b")):  # type: ignore[misc]
        pass  # no __slots__: instances get a __dict__

    class Overridden(NamedTuple):
        a: int

    Overridden.a = property(lambda self: 0)  # type: ignore[assignment,misc]
    swapped: Any = namedtuple("Swapped", "a b")
    swapped.a, swapped.b = swapped.b, swapped.a
    for refused in (WithDict, Overridden, swapped, tuple, int):
        with pytest.raises(TypeError):
            fast_fields(refused)
    with pytest.raises(TypeError):
        fast_fields(42)  # type: ignore[type-var]


def test_reader_options_refuse_a_record_type_the_prefix_does_not_fill() -> None:
    """Records are built with the prefix; a shorter one would be read out of bounds."""
    ReaderOptions(record_type=XinfraRecord, record_prefix=("t", 1))
    with pytest.raises(InvalidRequest, match="fields"):
        ReaderOptions(record_type=XinfraRecord)
    with pytest.raises(InvalidRequest, match="fields"):
        ReaderOptions(record_prefix=("t",))
