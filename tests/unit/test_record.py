"""``Record`` as a C type (``xinfra/_records.c``): the dataclass's behaviour, kept.

Why C: ``Record(value=v)`` is made once per record by every producing
application; what it must keep is everything the slotted dataclass offered.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
from typing import Any

import pytest
from leaks import LEAK_BYTES_MAX, bytes_kept

from xinfra.model import Record


def test_record_is_named_for_where_applications_import_it() -> None:
    """Pickles and reprs name ``xinfra.model.Record``, as they did for the dataclass."""
    assert Record.__module__ == "xinfra.model" and Record.__qualname__ == "Record"


def test_made_as_the_dataclass_was() -> None:
    assert Record(b"v") == Record(value=b"v", key=None, headers=(), timestamp_ms=None)
    record = Record(b"v", b"k", (("h", b"1"),), 5)
    assert (record.value, record.key, record.headers, record.timestamp_ms) == (
        b"v",
        b"k",
        (("h", b"1"),),
        5,
    )
    assert Record(headers=(), value=None).value is None
    assert Record(**{"value": b"v", "timestamp_ms": 1}).timestamp_ms == 1


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "missing 1 required"),
        ((1, 2, 3, 4, 5), {}, "at most 4"),
        ((b"v",), {"value": b"w"}, "multiple values"),
        ((), {"value": b"v", "nope": 1}, "unexpected keyword"),
    ],
)
def test_wrong_arguments_raise_type_errors(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        Record(*args, **kwargs)


def test_equal_and_hashable_by_value_repr_and_size() -> None:
    assert Record(b"v", b"k") == Record(b"v", b"k")
    assert Record(b"v") != Record(b"w")
    assert hash(Record(b"v", b"k")) == hash((b"v", b"k", (), None))
    assert len({Record(b"v"), Record(b"v"), Record(b"w")}) == 2
    assert Record(b"v") != (b"v", None, (), None)
    assert repr(Record(b"v", timestamp_ms=3)) == (
        "Record(value=b'v', key=None, headers=(), timestamp_ms=3)"
    )
    assert Record(b"vv", b"k", (("hh", b"123"),)).size_bytes() == 2 + 1 + 2 + 3
    assert Record(None).size_bytes() == 0
    with pytest.raises(ValueError):
        Record(b"v", headers=(("only a name",),)).size_bytes()  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Record(b"v", headers=(("h", 5),)).size_bytes()  # type: ignore[arg-type]


def test_pickle_copy_match_dataclasses_and_mutation() -> None:
    record = Record(b"v", b"k", (("h", b"1"),), 7)
    assert pickle.loads(pickle.dumps(record)) == record
    assert copy.copy(record) == record and copy.deepcopy(record) == record
    match record:
        case Record(value, key, headers, timestamp_ms):
            assert (value, key, headers, timestamp_ms) == (b"v", b"k", (("h", b"1"),), 7)
        case _:
            pytest.fail("no match")
    assert dataclasses.is_dataclass(record)
    assert [field.name for field in dataclasses.fields(record)] == [
        "value",
        "key",
        "headers",
        "timestamp_ms",
    ]
    assert dataclasses.replace(record, key=None) == Record(b"v", None, (("h", b"1"),), 7)
    assert dataclasses.asdict(record)["timestamp_ms"] == 7
    record.value = b"changed"
    assert record.value == b"changed"
    del record.key
    with pytest.raises(AttributeError):
        _ = record.key
    with pytest.raises(AttributeError):
        hash(record)


def test_a_subclass_and_a_cycle_are_handled() -> None:
    class Sub(Record):
        pass

    sub = Sub(b"v", key=b"k")
    assert ".Sub(value=b'v'" in repr(sub) and sub == Sub(b"v", b"k")  # the qualname
    assert sub != Record(b"v", b"k")
    looped = Record(b"v")
    looped.headers = (("self", looped),)  # type: ignore[assignment]
    assert "..." in repr(looped)
    del looped, sub
    assert gc.collect() >= 1


def test_a_record_that_cannot_reach_a_cycle_is_not_scanned_until_a_field_could() -> None:
    """Built atomic (bytes, int, None, the empty or an untracked tuple), a record is untracked:
    young collections skip it.  A field given an object that could lead back to it tracks it
    again, and the cycle it then closes is collected."""
    plain = Record(b"v", key=b"k", timestamp_ms=5)
    assert not gc.is_tracked(plain)
    assert gc.is_tracked(Record(b"v", headers=[("h", b"1")]))  # type: ignore[arg-type]
    fresh = tuple([("h", b"1")])  # built at run time: tracked until a collection looks at it
    assert gc.is_tracked(fresh) and gc.is_tracked(Record(b"v", headers=fresh))

    class Sub(Record):
        pass

    assert gc.is_tracked(Sub(b"v"))  # a subclass's instance has a __dict__ that may hold anything
    plain.timestamp_ms = 6
    assert not gc.is_tracked(plain)
    holder: list[Any] = []
    plain.headers = holder  # type: ignore[assignment]
    assert gc.is_tracked(plain)
    holder.append(plain)
    gc.collect()
    del plain, holder
    assert gc.collect() >= 2  # the record and the list


def test_making_many_leaks_nothing() -> None:
    def make() -> None:
        for i in range(20_000):
            record = Record(b"v", key=b"k", headers=(("h", b"1"),), timestamp_ms=i)
            record.size_bytes()
            hash(record)
            _ = record == Record(b"v") and repr(record)
            Record(value=b"v")
            with pytest.raises(TypeError):
                Record(b"v", value=b"w")

    kept = bytes_kept(make)
    assert kept < LEAK_BYTES_MAX, kept
