"""The broker's fsync counters against the fsync system calls the kernel saw (strace).

A real broker process runs under ``strace -f -y -e trace=fsync,syncfs``
(seccomp: only those stop the process), a producer writes to many ranges at
once for several flushes, and once a checkpoint has synced the segment
files, the counters on ``/metrics`` must equal the calls in the trace, kind
by kind: WAL files, segment files, directories (renames and their marker
files), whole-filesystem syncs (a checkpoint's ``syncfs`` of many segment
files, where the kernel reports its errors) and the metadata journal.  ``northguard_store_fsyncs_total`` (what the gauge
``northguard_store_fsyncs_per_flush`` divides by the flushes) must count them
all, so fsyncs per flush grows when a flush's real cost does.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from ng_harness import WAIT_S, backend_for, broker_metrics

from backends.northguard.launcher import NorthguardProcess
from xinfra.backend import ProducerOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import Record
from xinfra.services.ports import free_port, port_open

RANGES = 128
ROUNDS = 5
_FSYNC = re.compile(r"(?P<call>syncfs|fsync)\(\d+<(?P<path>[^>]*)>\)\s+= 0")


@pytest.fixture
def traced_broker(tmp_path: Path) -> Iterator[tuple[NorthguardProcess, Path]]:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed")
    data_dir = tmp_path / "data"
    trace = tmp_path / "fsync.trace"
    port, http_port = free_port(), free_port()
    argv = [strace, "-f", "-qq", "-y", "--seccomp-bpf", "-e", "trace=fsync,syncfs"]
    argv += ["-e", "status=successful", "-o", str(trace), "--"]
    argv += [sys.executable, "-m", "backends.northguard.broker", "--port", str(port)]
    argv += ["--http-port", str(http_port), "--data-dir", str(data_dir)]
    process = NorthguardProcess(
        name="traced northguard broker",
        argv=argv,
        log_path=tmp_path / "broker.log",
        url=f"127.0.0.1:{port}",
        cwd=Path(__file__).resolve().parents[2],
        port=port,
        http_port=http_port,
        data_dir=data_dir,
    )
    process.start()
    try:
        process.wait_ready(lambda: port_open("127.0.0.1", port), timeout_s=60)
        yield process, trace
    finally:
        process.stop()


def traced_fsyncs(trace: Path, data_dir: Path) -> Counter[str]:
    """The fsync calls in the trace that returned 0, by the kind the broker counts them as."""
    counts: Counter[str] = Counter()
    store, meta = str(data_dir / "store") + "/", str(data_dir / "meta")
    for match in _FSYNC.finditer(trace.read_text(errors="replace")):
        path = match["path"]
        name = path.rsplit("/", 1)[-1].removesuffix(".tmp")
        if match["call"] == "syncfs":
            counts["filesystem"] += 1
        elif path.startswith(meta):
            counts["journal"] += 1
        elif not path.startswith(store) or path.startswith(store + "index"):
            continue  # RocksDB syncs its own files: the broker counts its sync calls as "index"
        elif name.endswith(".wal"):
            counts["wal"] += 1
        elif name.endswith(".seg"):
            counts["segment"] += 1
        else:
            counts["directory"] += 1
    return counts


def counted_fsyncs(metrics: dict[str, float]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for kind in ("wal", "segment", "directory", "filesystem"):
        counts[kind] = int(metrics[f'northguard_store_file_fsyncs_total{{kind="{kind}"}}'])
    counts["journal"] = int(metrics["northguard_journal_fsyncs_total"])
    return counts


async def test_fsync_counters_are_the_calls_the_kernel_saw(
    traced_broker: tuple[NorthguardProcess, Path],
) -> None:
    process, trace = traced_broker
    admin = backend_for(process.url)
    await admin.create_topic("many", shard_ranges(RANGES))
    await admin.close()
    backend = backend_for(process.url)
    producer = backend.producer("many", ProducerOptions(linger_ms=2))
    try:
        for number in range(ROUNDS):  # each round: every range, several flushes
            await asyncio.gather(
                *(producer.send(s, [Record(value=b"%d" % number)]) for s in range(RANGES))
            )
    finally:
        await producer.close()
        await backend.close()

    deadline = time.monotonic() + WAIT_S
    while True:  # until a checkpoint has synced the segments and the trace has caught up
        metrics = broker_metrics(process)
        counted = counted_fsyncs(metrics)
        traced = traced_fsyncs(trace, process.data_dir)
        synced = counted["filesystem"] >= 1 or counted["segment"] >= RANGES  # one way or other
        # A file is synced once its frames are in it: every range's, by one writer pass or more.
        written = metrics["northguard_store_segment_writes_total"] >= RANGES
        if synced and written and counted == traced:
            break
        assert time.monotonic() < deadline, f"counted {dict(counted)}, traced {dict(traced)}"
        await asyncio.sleep(0.05)

    now = metrics  # the scrape the trace matched: the broker may fsync again after it
    flushes = now["northguard_store_flushes_total"]
    assert flushes >= ROUNDS
    store_calls = sum(counted[kind] for kind in ("wal", "segment", "directory", "filesystem"))
    index_calls = now['northguard_store_file_fsyncs_total{kind="index"}']
    assert now["northguard_store_fsyncs_total"] == store_calls + index_calls
    # Every flush fsyncs the WAL (more when it rolls); the segment files are synced by checkpoints.
    assert (
        flushes
        <= now["northguard_store_flush_fsyncs_total"]
        <= counted["wal"] + counted["directory"]
    )
    assert (
        1
        <= now["northguard_store_segment_write_passes_total"]
        <= now["northguard_store_segment_writes_total"]
    )
    segment_syncs = counted["segment"] + counted["filesystem"]
    assert segment_syncs >= 1  # RANGES files: fsynced each, or all in one syncfs
    assert now["northguard_store_checkpoint_fsyncs_total"] >= segment_syncs
    per_flush = now["northguard_store_fsyncs_per_flush"]
    assert per_flush == pytest.approx(now["northguard_store_fsyncs_total"] / flushes)
    assert per_flush > 1  # the segment syncs of RANGES ranges show, paid per checkpoint
