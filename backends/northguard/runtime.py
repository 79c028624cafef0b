"""The one seam through which Northguard touches the world: time, timers, disk, network, randomness.

Every broker, store and client component takes a ``Runtime`` and never calls
``time``, ``random``, ``os`` or ``asyncio.open_connection`` directly.  Two
implementations exist: ``RealRuntime`` here (asyncio, sockets, files) and the
simulated one of the simulation issue, which runs a whole cluster in one
thread with virtual time and a seeded random source.  Keeping the seam small
is what makes the simulator possible: add to it only what cannot be built on it.

Disk calls are synchronous on purpose: the fps store batches them (group
commit) and runs one flush at a time in a worker thread, so a blocking
``fsync`` never stalls the event loop and ordering on disk is the order of
calls in one flush.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import platform
import random
import secrets
import ssl
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from backends.northguard.frame_reader import FrameReader

T = TypeVar("T")

ConnectionHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
FrameHandler = Callable[[FrameReader, asyncio.StreamWriter], Awaitable[None]]
READER_LIMIT_BYTES = 1 << 20
"""A connection's reading pauses while twice this many bytes wait to be taken."""

TLS_HANDSHAKE_TIMEOUT_S = 10.0
"""A server drops a connection whose TLS handshake has not completed in this time."""
CLOSE_FLUSH_S = 2.0
"""How long a closing connection lets its transport hand the peer what it still holds before it
aborts the transport (``close_writer``)."""


class TlsHandshakeError(ConnectionError):
    """The TCP connection opened but its TLS handshake failed or timed out.

    Kept apart from a refused connection so a client can say which it was (a wrong CA,
    a plaintext peer) instead of "cannot connect".  ``__cause__`` is the ``ssl`` error.
    """


class File(abc.ABC):
    """A file opened for positional reads and writes."""

    @abc.abstractmethod
    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (short writes are retried, never returned)."""

    @abc.abstractmethod
    def pread(self, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset``; fewer only at end of file."""

    @abc.abstractmethod
    def fsync(self) -> None:
        """Make every completed write durable.  Raises ``OSError`` on an I/O error."""

    @abc.abstractmethod
    def truncate(self, size: int) -> None: ...

    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class Disk(abc.ABC):
    @abc.abstractmethod
    def open(self, path: Path, *, create: bool = True, direct: bool = False) -> File:
        """Open read-write.  ``direct`` asks for O_DIRECT; the file reports if it got it."""

    @abc.abstractmethod
    def exists(self, path: Path) -> bool: ...

    @abc.abstractmethod
    def remove(self, path: Path) -> None: ...

    @abc.abstractmethod
    def listdir(self, path: Path) -> list[str]: ...

    @abc.abstractmethod
    def makedirs(self, path: Path) -> None: ...

    @abc.abstractmethod
    def rename(self, source: Path, target: Path) -> None:
        """Atomic rename, then fsync of the directory so the rename is durable."""

    def sync_all(self, directory: Path) -> bool:
        """Make every completed write to every file under ``directory`` durable in one call, if
        this disk has one; ``False`` when it has none, and the caller fsyncs each file.

        The call may sync more than ``directory`` (Linux's ``syncfs`` syncs the whole
        filesystem that holds it).  It is worth its breadth when many files are dirty: a
        checkpoint after writes to 512 segments made 512 fsyncs, 20-25 ms of CPU side by side,
        where one ``syncfs`` took 2-4 ms (measured here, ext4)."""
        return False


class Network(abc.ABC):
    @abc.abstractmethod
    async def serve(
        self, host: str, port: int, handler: ConnectionHandler
    ) -> asyncio.AbstractServer:
        """Listen and run ``handler`` per connection (plain bytes: the HTTP endpoint)."""

    @abc.abstractmethod
    async def serve_frames(
        self,
        host: str,
        port: int,
        handler: FrameHandler,
        frame_bytes_max: int,
        tls: ssl.SSLContext | None = None,
    ) -> asyncio.AbstractServer:
        """Listen and run ``handler`` per connection, its reader decoding Northguard frames.

        With ``tls``, every connection is TLS: ``handler`` sees only connections whose
        handshake completed (within ``TLS_HANDSHAKE_TIMEOUT_S``); the others are dropped.
        """

    @abc.abstractmethod
    async def connect(
        self,
        host: str,
        port: int,
        timeout_s: float,
        frame_bytes_max: int,
        tls: ssl.SSLContext | None = None,
    ) -> tuple[FrameReader, asyncio.StreamWriter]:
        """Open a connection whose reader decodes Northguard frames; raise ``ConnectionError``
        or ``TimeoutError``.

        With ``tls``, the TLS handshake (server name ``host``) completes within
        ``timeout_s`` too, or ``TlsHandshakeError`` is raised.
        """


class Runtime(abc.ABC):
    disk: Disk
    network: Network
    random: random.Random

    @abc.abstractmethod
    def wall_ms(self) -> int:
        """Wall-clock milliseconds since the epoch: record timestamps, segment create times."""

    @abc.abstractmethod
    def monotonic_s(self) -> float:
        """Seconds on a clock that never goes back: timeouts, ages, latencies."""

    @abc.abstractmethod
    async def sleep(self, seconds: float) -> None: ...

    @abc.abstractmethod
    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle: ...

    @abc.abstractmethod
    async def run_blocking(self, function: Callable[..., T], *args: Any) -> T:
        """Run a blocking call (a disk flush) off the event loop and await it."""

    async def run_background(self, function: Callable[..., T], *args: Any) -> T:
        """``run_blocking`` for work nobody waits for (a writer pass of its own, a timed
        checkpoint): where the system allows, on threads that run only on a CPU nothing else
        wants (``lower_thread_priority``)."""
        return await self.run_blocking(function, *args)


class _OsFile(File):
    def __init__(self, fd: int, direct: bool) -> None:
        self.fd = fd
        self.direct = direct

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self.fd, view, offset)
            view = view[written:]
            offset += written

    def pread(self, size: int, offset: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class OsDisk(Disk):
    def open(self, path: Path, *, create: bool = True, direct: bool = False) -> File:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                return _OsFile(os.open(path, flags | os.O_DIRECT, 0o644), direct=True)
            except OSError:
                pass  # tmpfs and some filesystems refuse O_DIRECT: fall back to buffered I/O
        return _OsFile(os.open(path, flags, 0o644), direct=False)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def listdir(self, path: Path) -> list[str]:
        return sorted(os.listdir(path)) if path.exists() else []

    def makedirs(self, path: Path) -> None:
        """Make ``path`` and its missing parents, each apart from its neighbours on disk.

        On ext4 a new file's inode goes to its directory's block group, and
        without a journal every allocation there first skips each inode freed
        in the last minutes (``recently_deleted``): a segment file made where
        another data directory of 22,000 files was deleted a minute before
        cost up to 1.8 ms of kernel CPU (0.14-0.19 ms after 3,000 deletions),
        against 6 us in a quiet group (measured here).  A directory made here is therefore flagged
        ``FS_TOPDIR_FL`` (the allocator then spreads the directories made in
        it over the groups, as it does the root's), and made under a unique
        name then renamed into place: the spread starts from a hash of the
        name, and ``segments`` under every data directory would otherwise
        start from the same group, the one the last deleted data directory
        used.  Elsewhere the flag is refused and ignored: placement only."""
        if path.is_dir():
            return
        self.makedirs(path.parent)
        made = path.parent / f".{path.name}.{secrets.token_hex(8)}"
        os.mkdir(made)
        _spread_subdirectories(made)
        try:
            os.rename(made, path)
        except OSError as error:  # made meanwhile by another: theirs stays
            os.rmdir(made)
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not path.is_dir():
                raise
            return
        _fsync_directory(path.parent)

    def rename(self, source: Path, target: Path) -> None:
        os.replace(source, target)
        _fsync_directory(target.parent)

    def sync_all(self, directory: Path) -> bool:
        syncfs = _syncfs()
        if syncfs is None:
            return False
        fd = os.open(directory, os.O_RDONLY)
        try:
            if syncfs(fd) != 0:
                number = ctypes.get_errno()
                raise OSError(number, f"syncfs of {directory}: {os.strerror(number)}")
        finally:
            os.close(fd)
        return True


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS = 0x80086601, 0x40086602  # Linux, <linux/fs.h>
_FS_TOPDIR_FL = 0x00020000
_INODE_FLAGS = struct.Struct("i")


def _spread_subdirectories(directory: Path) -> None:
    """Ask the filesystem to place the directories made in ``directory`` apart (ext4's Orlov
    allocator; ``chattr +T``); a filesystem without the flag is left as it is."""
    if not sys.platform.startswith("linux"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (flags,) = _INODE_FLAGS.unpack(fcntl.ioctl(fd, _FS_IOC_GETFLAGS, _INODE_FLAGS.pack(0)))
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, _INODE_FLAGS.pack(flags | _FS_TOPDIR_FL))
    except OSError:
        pass  # tmpfs, overlayfs, ...: no such hint
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _syncfs() -> Callable[[int], int] | None:
    """libc's ``syncfs``, on Linux from 5.8 only: before it, ``syncfs`` did not report the
    writeback errors of the files it synced, and an fsync of each file is the only sure way."""
    release = platform.release().split(".")
    if platform.system() != "Linux" or not all(part.isdigit() for part in release[:2]):
        return None
    if (int(release[0]), int(release[1])) < (5, 8):
        return None
    try:
        syncfs: Callable[[int], int] = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return None
    return syncfs


async def close_writer(writer: asyncio.StreamWriter, flush_s: float = CLOSE_FLUSH_S) -> None:
    """Close ``writer``'s transport: its queued bytes get ``flush_s`` to leave, then it is aborted.

    A transport closed with bytes the socket has not taken keeps the socket open (and stops
    reading it) until the peer reads them; a peer that stopped reading never does, so neither
    ``wait_closed`` nor the socket would ever end.  Returns once the transport reports itself
    closed (bounded: ``flush_s`` twice at most, the second after the abort).
    """
    with contextlib.suppress(Exception):
        writer.close()
    closed = asyncio.ensure_future(writer.wait_closed())
    done, _ = await asyncio.wait({closed}, timeout=flush_s)
    if not done:
        writer.transport.abort()
        done, _ = await asyncio.wait({closed}, timeout=flush_s)
    if not done:
        closed.cancel()
    elif not closed.cancelled():
        closed.exception()  # retrieved: a reset peer is what closing it expects


class AsyncioNetwork(Network):
    async def serve(
        self, host: str, port: int, handler: ConnectionHandler
    ) -> asyncio.AbstractServer:
        return await asyncio.start_server(handler, host, port, limit=READER_LIMIT_BYTES)

    async def serve_frames(
        self,
        host: str,
        port: int,
        handler: FrameHandler,
        frame_bytes_max: int,
        tls: ssl.SSLContext | None = None,
    ) -> asyncio.AbstractServer:
        def connection() -> asyncio.StreamReaderProtocol:
            reader = FrameReader(frame_bytes_max, READER_LIMIT_BYTES)
            # The callback is called with the reader made here: a FrameReader, as FrameHandler wants.
            return asyncio.StreamReaderProtocol(reader, handler)  # type: ignore[arg-type]

        loop = asyncio.get_running_loop()
        if tls is None:
            return await loop.create_server(connection, host, port)
        return await loop.create_server(
            connection, host, port, ssl=tls, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S
        )

    async def connect(
        self,
        host: str,
        port: int,
        timeout_s: float,
        frame_bytes_max: int,
        tls: ssl.SSLContext | None = None,
    ) -> tuple[FrameReader, asyncio.StreamWriter]:
        started_s = time.monotonic()
        loop = asyncio.get_running_loop()
        reader = FrameReader(frame_bytes_max, READER_LIMIT_BYTES)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await asyncio.wait_for(
            loop.create_connection(lambda: protocol, host, port), timeout_s
        )
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        if tls is None:
            return reader, writer
        # Two steps, so a refused TCP connection and a failed handshake stay distinguishable.
        left_s = max(timeout_s - (time.monotonic() - started_s), 0.001)
        try:
            await asyncio.wait_for(
                writer.start_tls(tls, server_hostname=host, ssl_handshake_timeout=left_s),
                left_s,
            )
        except (OSError, TimeoutError, EOFError) as error:  # ssl.SSLError is an OSError
            writer.close()
            detail = str(error) or type(error).__name__
            if isinstance(error, TimeoutError):
                detail = f"no TLS answer in {timeout_s:g} s"
            raise TlsHandshakeError(detail) from error
        except BaseException:
            writer.close()
            raise
        return reader, writer


class RealRuntime(Runtime):
    """The production runtime: the OS clock, files and sockets, a system-seeded random source."""

    def __init__(self, seed: int | None = None) -> None:
        self.disk = OsDisk()
        self.network = AsyncioNetwork()
        self.random = random.Random(seed)

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic_s(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(seconds, callback)

    async def run_blocking(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    async def run_background(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(_background(), function, *args)


def lower_thread_priority() -> None:
    """Run the calling thread under Linux's ``SCHED_IDLE``: it gets a CPU that would otherwise
    be idle, and never takes one from a thread that wants it.

    A broker's background work comes in bursts: a write pass of 512 segment
    files ran on eight threads at once, which took both cores of a 2-core
    machine from the event loop and from the producers sharing it.  At nice
    +10 (until 2026-11-29) those threads still preempted a producer sharing the
    broker's two cores ~440 times in one 512-range run of ``northguard_scale``
    (``sched_switch`` traced); under ``SCHED_IDLE``, in 12 paired rounds
    against nice +10 (two brokers, the same 4,000,000-record runs to 512
    ranges), the producer's rate was 1.12x the median [0.75-1.22], 8 rounds of
    12 above 1.1x, and the broker's CPU 3.68 s against 4.03 s.  RocksDB puts
    its low-priority pool under ``SCHED_IDLE`` the same way (``CpuPriority::
    kIdle``).  Such a thread's I/O takes the idle class too, where the block
    scheduler has classes.

    Work that someone waits for is never given to these threads: a pass a
    read waits for, a checkpoint a seal, a delete or a close waits for.  Nor
    is work that must not fall behind: a pass forced by the bound of
    acknowledged bytes held in memory for their files, a checkpoint that
    releases a full WAL file (``fps``).  On a CPU kept busy by other threads
    these would otherwise wait without end; the rest only waits.  Linux only
    (the policy is per thread there); elsewhere nothing is lowered, and so where
    the system refuses it (a sandbox's syscall filter): a pool whose thread
    initializer raised would refuse every task."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


@functools.cache
def _background() -> ThreadPoolExecutor:
    """Two threads: a checkpoint's steps and a write pass may run at once."""
    return ThreadPoolExecutor(
        max_workers=2, thread_name_prefix="northguard-background", initializer=lower_thread_priority
    )
