"""Fault injection for the store tests: the real runtime whose disk raises ``OSError`` on request.

``FaultyRuntime`` is ``RealRuntime`` with a disk that wraps ``OsDisk`` and,
when told to, raises from ``fsync``/``pwrite``/``truncate`` of chosen files
(and from ``sync_all`` while any fsync fault is set),
holds their ``fsync`` as a hung device would (``stall_fsync``), refuses
O_DIRECT, or grants it and then rejects direct writes with ``EINVAL``.
``holds`` stop the next ``fsync``, ``pwrite`` or ``rename`` of a chosen file at a point a
test names, so two threads' calls interleave in an order it sets (no sleeps).
Nothing is mocked: every byte goes to a real file.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from backends.northguard.runtime import Disk, File, OsDisk, RealRuntime
from backends.northguard.store import FpsStore


class Hold:
    """The next call of one operation on one file, held: ``reached`` is set when it arrives, and
    it goes on once ``release`` is set (30 s at most: a test that forgets fails, never hangs);
    ``done`` is set when it has returned.  Later calls pass."""

    def __init__(self, *, released: bool = False) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self.done = threading.Event()
        if released:  # only to learn when the call is done
            self.release.set()

    def arrive(self) -> bool:
        """Whether this call is the held one (it waited for ``release``)."""
        if self.reached.is_set():
            return False
        self.reached.set()
        self.release.wait(30)
        return True


class FaultyFile(File):
    def __init__(self, inner: File, disk: FaultyDisk, path: Path) -> None:
        self.inner = inner
        self.disk = disk
        self.path = path
        self.direct: bool = bool(getattr(inner, "direct", False))

    def _injected(self, operation: str) -> bool:
        suffixes = self.disk.faults.get(operation)
        return suffixes is not None and self.path.name.endswith(suffixes)

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        if self.direct and self.disk.einval_direct_writes:
            # Hold a view of the caller's buffer while raising, as ``_OsFile.pwrite`` does when
            # the kernel refuses the write: the traceback then keeps the buffer exported.
            view = memoryview(data)
            raise OSError(errno.EINVAL, f"injected: O_DIRECT write of {len(view)} bytes rejected")
        if self._injected("pwrite"):
            raise OSError(errno.EIO, f"injected pwrite error on {self.path.name}")
        hold = self.disk.held("pwrite", self.path)
        self.inner.pwrite(data, offset)
        if hold is not None:
            hold.done.set()

    def pread(self, size: int, offset: int) -> bytes:
        return self.inner.pread(size, offset)

    def fsync(self) -> None:
        if self._injected("stall_fsync"):  # a hung device: blocks until ``unstall`` (30 s at most)
            self.disk.stalled.set()
            self.disk.unstall.wait(30)
        if self._injected("fsync"):
            self.disk.fsync_failures += 1
            raise OSError(errno.EIO, f"injected fsync error on {self.path.name}")
        hold = self.disk.held("fsync", self.path)
        self.inner.fsync()
        if hold is not None:
            hold.done.set()

    def truncate(self, size: int) -> None:
        if self._injected("truncate"):
            raise OSError(errno.EIO, f"injected truncate error on {self.path.name}")
        self.inner.truncate(size)

    def size(self) -> int:
        return self.inner.size()

    def close(self) -> None:
        self.inner.close()


class FaultyDisk(Disk):
    def __init__(self) -> None:
        self.inner = OsDisk()
        self.faults: dict[str, tuple[str, ...]] = {}  # operation -> file name suffixes it fails on
        self.refuse_direct = False
        self.einval_direct_writes = False
        self.fsync_failures = 0
        self.stalled = threading.Event()  # set by an fsync that "stall_fsync" holds
        self.unstall = threading.Event()
        self.holds: dict[tuple[str, str], Hold] = {}  # (operation, file name suffix) -> its hold

    def held(self, operation: str, path: Path) -> Hold | None:
        """The hold ``path``'s call of ``operation`` waited at, if it was the held one."""
        for (held_operation, suffix), hold in tuple(self.holds.items()):
            if held_operation == operation and path.name.endswith(suffix) and hold.arrive():
                return hold
        return None

    def open(self, path: Path, *, create: bool = True, direct: bool = False) -> File:
        if any(path.name.endswith(suffix) for suffix in self.faults.get("open", ())):
            raise OSError(errno.EMFILE, "Too many open files (injected)")
        inner = self.inner.open(path, create=create, direct=direct and not self.refuse_direct)
        return FaultyFile(inner, self, path)

    def exists(self, path: Path) -> bool:
        return self.inner.exists(path)

    def remove(self, path: Path) -> None:
        self.inner.remove(path)

    def listdir(self, path: Path) -> list[str]:
        return self.inner.listdir(path)

    def makedirs(self, path: Path) -> None:
        self.inner.makedirs(path)

    def rename(self, source: Path, target: Path) -> None:
        hold = self.held("rename", source)
        self.inner.rename(source, target)
        if hold is not None:
            hold.done.set()

    def sync_all(self, directory: Path) -> bool:
        """The files' one sync fails or stalls as their fsyncs are told to: one device."""
        if self.faults.get("stall_fsync"):
            self.stalled.set()
            self.unstall.wait(30)
        if self.faults.get("fsync"):
            self.fsync_failures += 1
            raise OSError(errno.EIO, f"injected sync error on {directory}")
        return self.inner.sync_all(directory)


class FaultyRuntime(RealRuntime):
    def __init__(self) -> None:
        super().__init__(seed=1)
        self.faulty_disk = FaultyDisk()
        self.disk = self.faulty_disk


StoreFactory = Callable[..., Awaitable[FpsStore]]
