"""What every benchmark shares: paired rounds, medians and spreads, open-loop latency, the facts
that make a figure true (filesystem, O_DIRECT, broker counters), and the last JSON line.

The last line of stdout is (DESIGN.md §9, shared/BENCHMARKS.md)::

    {"bench": NAME, "machine": {...}, "figures": {NAME: number},
     "spread": {NAME: [min, max]}, "config": {...},
     "targets": {NAME: {value, target, op, met}}}

Exit status: 0 when every target is met, 1 when one is missed, 2 when the bench could not run;
``--no-fail`` keeps 0 for exploration (``finish`` and ``guard``).

A bench typically::

    parser = bench_parser(__doc__)           # --quick, --rounds, --no-fail
    args = parser.parse_args()
    rounds = Rounds()
    for order in alternating(args.rounds, ["ours", "peer"]):
        for side in order: rounds.add(round_figures...)
    rounds.ratio("produce_ratio", "ours_produce", "peer_produce")
    finish("name", rounds, targets, args, config={...}, peer="...")
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import mmap
import os
import platform
import statistics
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_MET = 0
EXIT_MISSED = 1
EXIT_COULD_NOT_RUN = 2


# -- the machine and the facts behind a figure ---------------------------------------------------


def machine(**extra: Any) -> dict[str, Any]:
    """What the figures were measured on; ``extra`` adds versions of the peers in the run."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "cpus": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": load,  # the machine is shared: how busy it was when the run ended
        **extra,
    }


def _mount_of(path: Path | str) -> tuple[str, str]:
    """``(filesystem type, source device)`` of the mount holding ``path`` (``unknown`` when
    /proc/self/mountinfo cannot say)."""
    target_path = os.path.realpath(path)
    best, best_type, best_source = "", "unknown", "unknown"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best_type, best_source
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        mount_point = fields[4].replace("\\040", " ")
        dash = fields.index("-")
        inside = target_path == mount_point or target_path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type, best_source = mount_point, fields[dash + 1], fields[dash + 2]
    return best_type, best_source


def fs_type(path: Path | str) -> str:
    """The filesystem type holding ``path`` (``ext4``, ``tmpfs``...): fsync on tmpfs proves nothing."""
    return _mount_of(path)[0]


def ext4_journal(path: Path | str) -> bool | None:
    """Whether the ext4 holding ``path`` has a journal (None: not ext4).  Without one, every
    file creation scans the recently freed inodes of its group (the kernel's
    ``recently_deleted``): 0.02-0.9 ms each on this project's VMs, so a figure that makes
    files (new segments) depends on it."""
    kind, source = _mount_of(path)
    if kind != "ext4":
        return None
    device = os.path.basename(source)
    try:
        return any(entry.startswith(device + "-") for entry in os.listdir("/proc/fs/jbd2"))
    except OSError:
        return False


def o_direct_granted(directory: Path | str) -> bool:
    """Whether the filesystem of ``directory`` accepts an aligned O_DIRECT write (tmpfs refuses)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    Path(directory).mkdir(parents=True, exist_ok=True)
    probe = Path(directory) / f".o_direct_probe_{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
    except OSError:
        return False
    try:
        buffer = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT requires
        try:
            os.write(fd, buffer)
        except OSError:
            return False
        finally:
            buffer.close()
        return True
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def storage_facts(data_dir: Path | str) -> dict[str, Any]:
    """The ``machine`` entries a durable figure needs: where the data went and how."""
    return {
        "data_dir": str(data_dir),
        "data_dir_fs": fs_type(data_dir),
        "data_dir_ext4_journal": ext4_journal(data_dir),
        "o_direct_granted": o_direct_granted(data_dir),
    }


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prometheus_counters(url: str, prefix: str = "") -> dict[str, float]:
    """Every sample of a Prometheus text endpoint whose name starts with ``prefix``.

    Names keep their labels (``name{a="b"}``); a bench reads a broker's own
    counters before and after a run and reports the difference (``delta``).
    """
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(prefix):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            samples[name] = float(value)
    return samples


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` for every sample in ``after`` (a counter absent before counts from 0)."""
    return {name: after[name] - before.get(name, 0.0) for name in after}


# -- rounds, medians, spreads ----------------------------------------------------------------------


def alternating(rounds: int, sides: Sequence[str]) -> Iterator[list[str]]:
    """The order of the sides in each round, rotated every round, so no side always goes first."""
    for n in range(rounds):
        shift = n % len(sides)
        yield list(sides[shift:]) + list(sides[:shift])


class Rounds:
    """Per-round values of every figure; medians become figures, min and max the spread.

    A ratio is the median of the per-round ratios of values measured in the
    same round (paired), never a ratio of medians.
    """

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}
        self.fixed: dict[str, Any] = {}

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def update(self, figures: Mapping[str, float]) -> None:
        for name, value in figures.items():
            self.add(name, value)

    def set(self, name: str, value: Any) -> None:
        """A figure that is not per round (a count, a size, a counter over the whole run)."""
        self.fixed[name] = value

    def ratio(self, name: str, numerator: str, denominator: str) -> None:
        pairs = zip(self.values[numerator], self.values[denominator], strict=True)
        for top, bottom in pairs:
            self.add(name, top / bottom if bottom else math.inf)

    def median(self, name: str) -> float:
        return float(statistics.median(self.values[name]))

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.fixed)
        for name, values in self.values.items():
            out[name] = _rounded(statistics.median(values))
        return out

    def spread(self) -> dict[str, list[float]]:
        return {
            name: [_rounded(min(values)), _rounded(max(values))]
            for name, values in self.values.items()
        }


def _rounded(value: float) -> float:
    if math.isinf(value) or math.isnan(value):
        return value
    if abs(value) >= 100:
        return round(value)
    return round(value, 3)


# -- latency ---------------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (``fraction`` in 0..1)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def latency_figures(prefix: str, latencies_ms: Sequence[float]) -> dict[str, float]:
    """``{prefix}_p50/_p99/_p999/_max`` in ms."""
    return {
        f"{prefix}_p50": round(percentile(latencies_ms, 0.50), 2),
        f"{prefix}_p99": round(percentile(latencies_ms, 0.99), 2),
        f"{prefix}_p999": round(percentile(latencies_ms, 0.999), 2),
        f"{prefix}_max": round(max(latencies_ms), 2),
    }


class OpenLoop:
    """A fixed-rate schedule: record ``i`` is due at ``start + i / rate``, whatever happened before.

    The sender wakes every ``tick_s`` (as a paced application does, instead
    of spinning between records), asks ``due()`` for the records whose time
    has come (all of them, however late), sends them, and counts each one's
    latency from its own scheduled time (``scheduled``), not from when it was
    sent: a stall then shows in every record scheduled during it (no
    coordinated omission), and the wait for the tick is counted too.
    """

    def __init__(self, rate_per_s: float, duration_s: float, tick_s: float = 0.001) -> None:
        self.rate = rate_per_s
        self.total = int(rate_per_s * duration_s)
        self.tick_s = tick_s
        self.start = time.perf_counter()
        self.next = 0

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.next = 0

    def scheduled(self, index: int) -> float:
        return self.start + index / self.rate

    def due(self) -> range:
        """Indices due now and not yet handed out."""
        now = time.perf_counter()
        upto = min(self.total, int((now - self.start) * self.rate) + 1)
        first, self.next = self.next, max(self.next, upto)
        return range(first, self.next)

    def wait_s(self) -> float:
        """Seconds until the first tick at or after the next record's time (0: send now)."""
        if self.done:
            return 0.0
        since_start = self.scheduled(self.next) - self.start
        tick = math.ceil(since_start / self.tick_s - 1e-9) * self.tick_s
        return max(0.0, self.start + tick - time.perf_counter())

    @property
    def done(self) -> bool:
        return self.next >= self.total

    def latency_ms(self, index: int, acked_at: float | None = None) -> float:
        acked = acked_at if acked_at is not None else time.perf_counter()
        return (acked - self.scheduled(index)) * 1000


# -- checks of what was read -----------------------------------------------------------------------


class ReadCheck:
    """Count, an order-free checksum of the values, and offset continuity per shard.

    Both sides of a consume bench feed it what they read; ``verify`` raises
    when a record is missing, repeated, out of order or altered.
    """

    def __init__(self) -> None:
        self.count = 0
        self.checksum = 0
        self.next_offset: dict[int, int] = {}
        self.gaps = 0

    def shard_run(self, shard: int, first_offset: int, last_offset: int) -> None:
        """A contiguous run ``first..last`` read from ``shard`` (one call per batch or record)."""
        expected = self.next_offset.get(shard)
        if expected is not None and first_offset != expected:
            self.gaps += 1
        self.next_offset[shard] = last_offset + 1

    def verify(self, count: int, checksum: int, ends: Mapping[int, int] | None = None) -> None:
        problems = []
        if self.count != count:
            problems.append(f"read {self.count} records, expected {count}")
        if self.checksum != checksum:
            problems.append(f"value checksum {self.checksum:#x}, expected {checksum:#x}")
        if self.gaps:
            problems.append(f"{self.gaps} offset gaps or repeats")
        if ends is not None and dict(self.next_offset) != dict(ends):
            problems.append(f"shard ends {self.next_offset}, expected {dict(ends)}")
        if problems:
            raise AssertionError("; ".join(problems))


def values_checksum(values: Iterator[bytes] | Sequence[bytes]) -> int:
    """Order-free checksum of values (sum of CRC32s mod 2**64): what a reader must reproduce."""
    import zlib

    total = 0
    for value in values:
        total += zlib.crc32(value)
    return total & 0xFFFFFFFFFFFFFFFF


# -- the last line and the exit status -------------------------------------------------------------


def target(value: float, goal: float, op: str = ">=") -> dict[str, Any]:
    met = value >= goal if op == ">=" else value <= goal
    return {"value": round(value, 3), "target": goal, "op": op, "met": bool(met)}


def report_only(value: float, goal: float, op: str = ">=") -> dict[str, Any]:
    """A target that is shown (met or not) but does not fail the run: ``"hard": false``."""
    return {**target(value, goal, op), "hard": False}


def emit(
    bench: str,
    figures: dict[str, Any],
    targets: dict[str, Any],
    *,
    spread: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    **machine_extra: Any,
) -> None:
    """Print the one JSON object, last."""
    print(
        json.dumps(
            {
                "bench": bench,
                "machine": machine(**machine_extra),
                "figures": figures,
                "spread": spread or {},
                "config": config or {},
                "targets": targets,
            }
        ),
        flush=True,
    )


def missed(targets: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Names of the hard targets not met."""
    return [name for name, t in targets.items() if not t.get("met", False) and t.get("hard", True)]


def bench_parser(doc: str | None, rounds_default: int = 3) -> argparse.ArgumentParser:
    """The options every bench takes: ``--quick`` (1 round, smaller), ``--rounds``, ``--no-fail``."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a reduced run, under a minute")
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help=f"paired rounds (default {rounds_default}, 1 with --quick)",
    )
    parser.add_argument(
        "--no-fail", action="store_true", help="exit 0 even when a target is missed"
    )
    parser.set_defaults(rounds_default=rounds_default)
    return parser


def rounds_of(args: argparse.Namespace) -> int:
    return int(args.rounds or (1 if args.quick else args.rounds_default))


def finish(
    bench: str,
    figures: dict[str, Any],
    targets: dict[str, Any],
    *,
    no_fail: bool = False,
    spread: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    **machine_extra: Any,
) -> NoReturn:
    """Emit the JSON line, then exit 1 if a hard target was missed (0 with ``no_fail``)."""
    emit(bench, figures, targets, spread=spread, config=config, **machine_extra)
    failed = missed(targets)
    if failed:
        print(f"[{bench}] targets missed: {', '.join(failed)}", file=sys.stderr, flush=True)
    sys.exit(EXIT_MISSED if failed and not no_fail else EXIT_MET)


def guard(bench: str, main: Callable[[], Any]) -> NoReturn:
    """Run ``main``; if it raises, print why and a JSON line with ``error``, and exit 2.

    ``main`` normally ends in ``finish`` (whose ``SystemExit`` passes through).
    """
    try:
        main()
    except SystemExit:
        raise
    except BaseException as error:  # anything that stops a bench means "could not run"
        traceback.print_exc()
        print(
            json.dumps(
                {
                    "bench": bench,
                    "machine": machine(),
                    "figures": {},
                    "spread": {},
                    "config": {},
                    "targets": {},
                    "error": f"{type(error).__name__}: {error}",
                }
            ),
            flush=True,
        )
        sys.exit(EXIT_COULD_NOT_RUN)
    sys.exit(EXIT_MET)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Move every object alive now out of the collector's reach for the timed block.

    A bench holds its inputs (hundreds of thousands of prepared records) for
    the whole run; without this, each full collection during a timed loop
    rescans them, and which loop pays for it depends on where the collector's
    thresholds fall.  Objects the timed code allocates are still collected as
    usual, so a path that makes more garbage still pays for it.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
