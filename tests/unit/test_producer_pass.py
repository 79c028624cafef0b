"""The producer's two passes over a send's records, in C (``xinfra._records``).

Why these tests: ``record_sizes`` decides what ``send`` refuses before
anything is queued, and ``produce_records`` decides what reaches librdkafka;
both read the C ``Record``'s fields directly and everything else through
attributes, so each must agree with the Python semantics they replace
(``Record.size_bytes()``, the positional ``produce`` call), say how far they
got when a call raises, and hold and release every reference they take.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from leaks import LEAK_BYTES_MAX, bytes_kept

from xinfra._records import produce_records, record_sizes
from xinfra.model import Record

payloads = st.none() | st.binary(max_size=64)
headers = st.lists(st.tuples(st.text(max_size=8), st.binary(max_size=16)), max_size=4).map(tuple)
records = st.builds(
    Record,
    value=payloads,
    key=payloads,
    headers=headers,
    timestamp_ms=st.none() | st.integers(min_value=0, max_value=2**62),
)


def python_sizes(sent: Sequence[Any]) -> tuple[int, int, bool]:
    """The pass ``send`` made in Python before it moved to C: the reference semantics."""
    size = largest = 0
    plain = True
    for record in sent:
        value, key = record.value, record.key
        record_size = (0 if value is None else len(value)) + (0 if key is None else len(key))
        if record.headers or record.timestamp_ms is not None:
            plain = False
            record_size = record.size_bytes()
        size += record_size
        largest = max(largest, record_size)
    return size, largest, plain


class SubRecord(Record):
    """A subclass takes the generic attribute path."""


@dataclasses.dataclass
class Duck:
    """Not a Record at all, but with its four fields and ``size_bytes``."""

    value: bytes | None
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None

    def size_bytes(self) -> int:
        size = len(self.key or b"") + len(self.value or b"")
        return size + sum(len(name) + len(value) for name, value in self.headers)


def as_type(record: Record, kind: Callable[..., Any]) -> Any:
    return kind(record.value, record.key, record.headers, record.timestamp_ms)


# -- record_sizes ----------------------------------------------------------------------------


@given(st.lists(records, max_size=20))
def test_sizes_are_the_python_passes_for_records_subclasses_and_ducks(
    sent: list[Record],
) -> None:
    expected = python_sizes(sent)
    assert record_sizes(sent) == expected
    assert record_sizes(tuple(sent)) == expected
    assert record_sizes([as_type(r, SubRecord) for r in sent]) == expected
    assert record_sizes([as_type(r, Duck) for r in sent]) == expected
    for record in sent:
        if record.headers or record.timestamp_ms is not None:
            assert record_sizes([record])[0] == record.size_bytes()


def test_sizes_of_no_records() -> None:
    assert record_sizes([]) == (0, 0, True)


class NoSizeBytes:
    value = b"v"
    key = None
    headers = (("h", b"1"),)
    timestamp_ms = None


class NegativeSize(Duck):
    def size_bytes(self) -> int:
        return -1


def deleted(field: str) -> Record:
    record = Record(b"v", headers=(("h", b"1"),))
    delattr(record, field)
    return record


@pytest.mark.parametrize(
    ("sent", "error", "message"),
    [
        (5, TypeError, "must be a sequence"),
        ([1], AttributeError, "value"),
        ([Record(b"v"), object()], AttributeError, "value"),
        ([Record(7)], TypeError, "has no len"),  # type: ignore[arg-type]
        ([Record(b"v", key=7)], TypeError, "has no len"),  # type: ignore[arg-type]
        ([Record(b"v", headers=((1, b"x"),))], TypeError, "has no len"),  # type: ignore[arg-type]
        ([Record(b"v", headers=(("h",),))], ValueError, "pair"),  # type: ignore[arg-type]
        ([Record(b"v", headers=5)], TypeError, "headers must be a sequence"),  # type: ignore[arg-type]
        ([NoSizeBytes()], AttributeError, "size_bytes"),
        ([NegativeSize(b"v", timestamp_ms=1)], ValueError, "negative"),
        ([deleted("value")], AttributeError, "value"),
        ([deleted("timestamp_ms")], AttributeError, "timestamp_ms"),
    ],
)
def test_what_is_not_a_record_is_refused(sent: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        record_sizes(sent)


# -- produce_records -------------------------------------------------------------------------


class Calls:
    """A stand-in for ``Producer.produce``: the calls made, raising at call ``fail_at``."""

    def __init__(self, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_at = fail_at
        self.error = error if error is not None else BufferError("Local: Queue full")

    def __call__(self, *args: Any) -> None:
        if len(self.calls) == self.fail_at:
            raise self.error
        self.calls.append(args)


def report(error: object, message: object) -> None:
    """An ``on_delivery`` never called here: only passed on."""


def test_plain_records_are_produced_with_five_positional_arguments() -> None:
    sent: list[Any] = [Record(b"a"), Record(b"b", key=b"k"), SubRecord(None), Duck(b"d", b"e")]
    produce = Calls()
    assert produce_records(produce, "topic", 3, report, sent, True) == 4
    assert produce.calls == [
        ("topic", b"a", None, 3, report),
        ("topic", b"b", b"k", 3, report),
        ("topic", None, None, 3, report),
        ("topic", b"d", b"e", 3, report),
    ]
    assert produce.calls[0][1] is sent[0].value  # passed on, not copied


@given(st.lists(records, max_size=10))
def test_records_with_headers_or_timestamps_are_produced_as_the_python_call_was(
    sent: list[Record],
) -> None:
    produce = Calls()
    assert produce_records(produce, "t", 0, report, sent, False) == len(sent)
    assert produce.calls == [
        (
            "t",
            r.value,
            r.key,
            0,
            report,
            None,
            r.timestamp_ms or 0,
            list(r.headers) if r.headers else None,
        )
        for r in sent
    ]
    for call in produce.calls:
        assert call[7] is None or type(call[7]) is list


def test_no_records_no_calls() -> None:
    produce = Calls()
    assert produce_records(produce, "t", 0, report, [], True) == 0
    assert produce.calls == []


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("fail_at", [0, 1, 4])
def test_a_refused_produce_propagates_with_the_count_queued_before_it(
    fail_at: int, plain: bool
) -> None:
    error = BufferError("Local: Queue full")
    produce = Calls(fail_at, error)
    with pytest.raises(BufferError) as raised:
        produce_records(produce, "t", 0, report, [Record(b"%d" % i) for i in range(6)], plain)
    assert raised.value is error
    assert raised.value.records_queued == fail_at  # type: ignore[attr-defined]
    assert len(produce.calls) == fail_at


def test_a_record_that_cannot_be_read_stops_the_pass_with_the_count_queued() -> None:
    produce = Calls()
    sent: list[Any] = [Record(b"a"), Record(b"b"), object(), Record(b"c")]
    with pytest.raises(AttributeError) as raised:
        produce_records(produce, "t", 0, report, sent, True)
    assert raised.value.records_queued == 2  # type: ignore[attr-defined]
    bad_headers = [Record(b"a", timestamp_ms=1), Record(b"b", headers=5)]  # type: ignore[arg-type]
    with pytest.raises(TypeError) as raised_type:
        produce_records(Calls(), "t", 0, report, bad_headers, False)
    assert raised_type.value.records_queued == 1  # type: ignore[attr-defined]


def test_an_interrupt_propagates_too() -> None:
    with pytest.raises(KeyboardInterrupt) as raised:
        produce_records(Calls(1, KeyboardInterrupt()), "t", 0, report, [Record(b"a")] * 3, True)
    assert raised.value.records_queued == 1  # type: ignore[attr-defined]


class Sealed(Exception):
    """An exception that takes no attributes: it still propagates, without the count."""

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(name)


def test_an_exception_refusing_the_count_still_propagates_unchanged() -> None:
    error = Sealed("refused")
    with pytest.raises(Sealed) as raised:
        produce_records(Calls(2, error), "t", 0, report, [Record(b"a")] * 3, True)
    assert raised.value is error and not hasattr(error, "records_queued")
    assert raised.value.__traceback__ is not None


def test_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="got 2 arguments"):
        produce_records(Calls(), "t")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="must be a sequence"):
        produce_records(Calls(), "t", 0, report, 5, True)  # type: ignore[arg-type]


def test_records_changed_by_the_produce_call_are_read_safely() -> None:
    """``produce`` may run Python code: shrinking the list or replacing fields cannot crash."""
    sent = [Record(b"x" * 100) for _ in range(10)]

    def shrinking(*args: Any) -> None:
        for record in sent:
            record.value = b"y" * 100  # drops the value being passed on
        sent.clear()

    assert produce_records(shrinking, "t", 0, report, sent, True) == 1


# -- references ------------------------------------------------------------------------------


def exercise() -> None:
    """Every path of both functions, errors included, many times."""
    plain: list[Any] = [Record(b"v" * 10, b"k") for _ in range(50)]
    rich: list[Any] = [Record(b"v", b"k", (("h", b"1"),), 5) for _ in range(50)]
    ducks: list[Any] = [Duck(b"v", headers=(("h", b"1"),)) for _ in range(10)]
    stranger: list[Any] = [object()]
    for _ in range(200):
        record_sizes(plain)
        record_sizes(rich + ducks)
        produce_records(Calls(), "t", 0, report, plain, True)
        produce_records(Calls(), "t", 0, report, rich + ducks, False)
        for fail_at in (0, 7):
            with pytest.raises(BufferError):
                produce_records(Calls(fail_at), "t", 0, report, rich, False)
        with pytest.raises(AttributeError):
            record_sizes(plain + stranger)
        with pytest.raises(TypeError):
            record_sizes([Record(b"v", headers=((1, b"x"),))])  # type: ignore[arg-type]
        with pytest.raises(AttributeError):
            produce_records(Calls(), "t", 0, report, rich + stranger, False)


def test_many_passes_leak_nothing() -> None:
    kept = bytes_kept(exercise)
    assert kept < LEAK_BYTES_MAX, kept


def test_every_reference_taken_is_released() -> None:
    value, key, topic = b"value-held", b"key-held", "topic-held"
    stamp = 2**40
    header = ("h", b"1")
    head = (header,)
    sent = [Record(value, key, head, stamp), Record(value, key)]
    watched: list[object] = [value, key, topic, stamp, header, head, report, *sent]
    before = [sys.getrefcount(item) for item in watched]
    for _ in range(100):
        record_sizes(sent)
        produce_records(Calls(), topic, 0, report, sent, False)
        produce_records(Calls(), topic, 0, report, sent[1:], True)
        with pytest.raises(BufferError):
            produce_records(Calls(1), topic, 0, report, sent, False)
    gc.collect()
    assert [sys.getrefcount(item) for item in watched] == before
