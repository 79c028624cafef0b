"""The storage interface of a Northguard broker: segments of opaque record batches.

A broker stores, for each segment replica it holds, a contiguous sequence of
**entries**.  An entry is one record batch exactly as the producer encoded it
(opaque bytes), with the base offset the segment leader assigned and the
number of records it holds.  The store never looks inside a batch; it frames
each entry with its own header and CRC32C so that a flipped bit on disk is
detected on read and on recovery and never served as data.

Promises of every implementation:

* ``append`` returns only after the entry is durable (fsynced): the broker
  acknowledges a produce only then.  Appends to one segment take effect in
  call order and their offsets are contiguous: entry *n+1* starts where
  entry *n* ends (``base_offset + record_count``); the store asserts it.
* A crash loses no entry whose ``append`` returned; after ``open()`` the log
  end of each segment is the end of its last durable entry.
* ``read`` returns whole entries, never torn ones, only entries that are
  durable, and raises ``CorruptData`` instead of returning bad bytes.
* A sealed segment refuses appends with ``Sealed``; sealing is durable.

Offsets are **range** offsets: a segment's ``start_offset`` is where it begins
in its range, so a reader never has to translate.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from xinfra.errors import NotFound, StorageError


class SegmentState(enum.StrEnum):
    ACTIVE = "active"
    SEALED = "sealed"


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored record batch: ``batch`` is the producer's bytes, untouched."""

    base_offset: int
    record_count: int
    batch: bytes

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.record_count


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    segment_id: str
    start_offset: int
    end_offset: int  # one past the last durable record
    size_bytes: int
    state: SegmentState
    created_ms: int


class SegmentStore(abc.ABC):
    """Durable storage for the segment replicas one broker holds."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Recover: replay the write-ahead log, check CRCs, rebuild log ends."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush what is pending and release files.  Idempotent."""

    @abc.abstractmethod
    async def create_segment(self, segment_id: str, start_offset: int) -> SegmentInfo:
        """Create an empty active segment, durably.  Idempotent for the same arguments."""

    @abc.abstractmethod
    async def append(
        self, segment_id: str, base_offset: int, record_count: int, batch: bytes
    ) -> Entry:
        """Append one batch at ``base_offset`` (must equal the segment's log end); durable on return.

        Concurrent appends are grouped (group commit): one WAL write and one
        fsync for many appends.  Raises ``Sealed``, ``NotFound`` or
        ``StorageError`` (then nothing of this append is acknowledged).
        """

    def submit(
        self,
        segment_id: str,
        base_offset: int,
        record_count: int,
        batch: bytes,
        on_done: OnDone[Entry] | None = None,
    ) -> asyncio.Future[Entry]:
        """``append``, taken now (in call order), its outcome a future the store never cancels;
        ``on_done(future)`` runs once it is resolved, never inside this call.

        For a caller that issues many appends and handles each outcome in a
        callback (the range log): a task and a shield per append cost more
        event-loop time than a store's own work on a small batch.  This
        default runs ``append`` in a task; a store may queue it directly, and
        call ``on_done`` itself where it resolves the future (a done-callback
        is a handle scheduled per append).
        """
        future = asyncio.ensure_future(self.append(segment_id, base_offset, record_count, batch))
        call_done_later(on_done, future)
        return future

    @abc.abstractmethod
    async def read(self, segment_id: str, offset: int, bytes_max: int) -> list[Entry]:
        """Whole durable entries from the one holding ``offset`` on, up to about ``bytes_max``.

        At least one entry when any exists at or after ``offset``; an empty
        list at the log end.  Raises ``OffsetOutOfRange`` outside the segment,
        ``CorruptData`` on a CRC mismatch.
        """

    @abc.abstractmethod
    async def seal(self, segment_id: str, end_offset: int | None = None) -> SegmentInfo:
        """Seal durably, first truncating to ``end_offset`` when given (never past the log end)."""

    async def seal_many(self, segment_ids: list[str]) -> dict[str, SegmentInfo]:
        """Seal each segment at its durable end; a store may make them durable together.

        Segments this store does not hold are left out of the result.
        """
        sealed: dict[str, SegmentInfo] = {}
        for segment_id in segment_ids:
            try:
                sealed[segment_id] = await self.seal(segment_id)
            except NotFound:
                continue
        return sealed

    @abc.abstractmethod
    async def delete_segment(self, segment_id: str) -> None:
        """Remove the segment and its data (retention).  Idempotent."""

    @abc.abstractmethod
    def segment(self, segment_id: str) -> SegmentInfo:
        """Raise ``NotFound`` when this store holds no such segment."""

    @abc.abstractmethod
    def segments(self) -> list[SegmentInfo]: ...

    @abc.abstractmethod
    def segment_states(self) -> dict[str, SegmentState]:
        """Every segment held and its state, without a ``SegmentInfo`` made for each: a restart
        looks at all of them, and through ``segment`` 20,480 took 0.05-0.09 s (measured)."""

    @property
    def failure(self) -> StorageError | None:
        """The disk error that stopped every write (fail-stop), or None while writes are accepted."""
        return None

    async def reopen(self) -> None:
        """Leave fail-stop without a restart: release every file and recover as ``open`` does.

        Raises ``StorageError`` (and stays failed) while the disk still fails,
        e.g. before space is freed.  A store that cannot recover in place keeps its failure.
        """
        if self.failure is not None:
            raise self.failure


_T = TypeVar("_T")


OnDone = Callable[[asyncio.Future[_T]], None]
"""A future's outcome callback, called with the resolved future (``call_done``)."""


def call_done_later(on_done: OnDone[_T] | None, future: asyncio.Future[_T]) -> None:
    """Run ``on_done`` once ``future`` is resolved, at a later turn (as a done-callback): for a
    future resolved where its caller may be mid-update, or off the hot path."""
    if on_done is not None:
        future.add_done_callback(on_done)


def call_done(on_done: OnDone[_T], future: asyncio.Future[_T]) -> None:
    """Call a resolved future's outcome callback now, not as a done-callback (a handle scheduled
    and run per future); an error it raises is reported as the loop reports a done-callback's."""
    try:
        on_done(future)
    except Exception as error:
        asyncio.get_running_loop().call_exception_handler(
            {"message": f"outcome callback {on_done!r} failed", "exception": error}
        )
