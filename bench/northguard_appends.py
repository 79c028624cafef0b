"""The broker alone: its CPU per append against the number of ranges written at once.

``northguard_scale`` runs the SDK's producer and the broker on the same
cores, so its 512/1 ratio mixes three things: the producer's own cost per
batch, the broker's, and the two sharing the CPU.  This bench takes the
producer out.  One raw connection (``backends.northguard.protocol``) replays
Appends encoded before the timed region: ``--appends`` batches of 100
records of 100 B (~10 KB each, what a producer sends per append at 512
ranges), spread evenly over ``width`` produce streams, one per range of a
fresh topic, for width 1 and 512.  At most ``IN_FLIGHT_APPENDS`` appends
are unacknowledged at a time (12 MB, under the window every stream asks
for), and every Ack is checked: each stream's sequence numbers in order,
each range's offsets contiguous from 0.

Reported per width: appends/s (to the last Ack); the broker's CPU per
append, in all its threads and in its event loop's thread alone (``/proc``;
the others flush the WAL, write segment files, checkpoint), counted until
the store is quiet again (every acknowledged frame in its synced segment
file: the work the appends caused, after the last Ack too, so the writes
and checkpoint a run leaves are its own); and its own counters: flushes,
segment writes, segment files made and the seconds that took (on an ext4
without a journal, a file made soon after many were deleted pays for
skipping them: see the README).  The widths alternate their order each
round.  There is no
peer and no target: these are the broker's own costs, the figures a change
to its append path is judged by (the 512-range run of ``northguard_scale``
makes ~40,000 such appends, the 1-range run ~500).

    .venv/bin/python bench/northguard_appends.py            # full: 5 rounds of 40,000 appends
    .venv/bin/python bench/northguard_appends.py --quick    # 1 round of 10,240
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from northguard_scale import metrics, quiet
from report import (  # bench/report.py: what every bench shares
    Rounds,
    alternating,
    bench_parser,
    cpu_s,
    delta,
    finish,
    guard,
    rounds_of,
    storage_facts,
)

from backends.northguard import protocol
from backends.northguard.batch import encode_batch
from backends.northguard.client.admin import AdminClient
from backends.northguard.launcher import NorthguardProcess, start_northguard_broker
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import RealRuntime
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

WIDTHS = (1, 512)
RECORDS_PER_BATCH = 100
IN_FLIGHT_APPENDS = 1024
WINDOW_BYTES = 16 << 20
PRODUCER_ID = 1 << 40
"""One producer id for every stream: its sequence numbers are per range."""
REPLAY_TIMEOUT_S = 300.0
"""The most a run's stream opens, Appends and Acks may take: a broker that stops answering
(without closing the connection) fails the bench instead of hanging it."""


def progress(message: str) -> None:
    print(f"[bench northguard_appends] {message}", file=sys.stderr, flush=True)


def thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds one thread has run (``/proc/<pid>/task/<tid>/schedstat``)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9


class Replay:
    """Appends out on one connection, at most ``IN_FLIGHT_APPENDS`` unacknowledged; Acks checked."""

    def __init__(self, width: int, count: int, batches: list[bytes]) -> None:
        self.width = width
        self.count = count
        self.batches = batches  # by sequence number: batch n goes to stream n % width as n // width
        self.decoder = protocol.FrameDecoder()
        self.next_seq = [0] * width  # per stream: the sequence number its next Ack starts at
        self.next_offset = [0] * width
        self.acked = 0
        self.progressed = asyncio.Event()

    async def open(self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader, topic: str,
                   ranges: list[int]) -> None:  # fmt: skip
        for stream, range_id in enumerate(ranges, start=1):
            payload = {
                "topic": topic,
                "range_id": range_id,
                "producer_id": PRODUCER_ID,
                "window_bytes": WINDOW_BYTES,
            }
            writer.write(protocol.encode_json(MsgType.PRODUCE_OPEN, stream, payload))
        opened = 0
        while opened < len(ranges):
            for frame in self.decoder.feed(await reader.read(1 << 16)):
                if frame.type is not MsgType.PRODUCE_OPENED:
                    raise AssertionError(
                        f"a stream open answered {frame.type.name}: {frame.body!r}"
                    )
                opened += 1

    async def send(self, writer: asyncio.StreamWriter) -> None:
        sent = 0
        total = self.count
        while sent < total:
            while sent - self.acked >= IN_FLIGHT_APPENDS:
                self.progressed.clear()
                await self.progressed.wait()
            end = min(sent + 64, total, self.acked + IN_FLIGHT_APPENDS)
            for n in range(sent, end):
                stream, seq = n % self.width + 1, n // self.width
                writer.write(protocol.encode_append(stream, seq, self.batches[seq]))
            sent = end
            await writer.drain()

    async def receive(self, reader: asyncio.StreamReader) -> None:
        while self.acked < self.count:
            data = await reader.read(1 << 18)
            if not data:
                raise AssertionError("the broker closed the connection")
            for frame in self.decoder.feed(data):
                self.check(frame)
            self.progressed.set()

    def check(self, frame: protocol.Frame) -> None:
        if frame.type is not MsgType.ACK:
            raise AssertionError(f"{frame.type.name} on a produce stream: {frame.body!r}")
        for stream, first_seq, offsets, _ in protocol.decode_acks(frame.body):
            index = stream - 1
            if first_seq != self.next_seq[index]:
                raise AssertionError(
                    f"stream {stream}: an Ack from {first_seq}, not {self.next_seq[index]}"
                )
            for offset in offsets:
                if offset != self.next_offset[index]:
                    raise AssertionError(
                        f"stream {stream}: offset {offset}, not {self.next_offset[index]}"
                    )
                self.next_offset[index] += RECORDS_PER_BATCH
            self.next_seq[index] += len(offsets)
            self.acked += len(offsets)


def batches_by_seq(count: int, width: int) -> list[bytes]:
    """The batches of a run of ``count`` appends to ``width`` ranges, by sequence number: the
    same producer id on every stream, so they differ only in that number."""
    records = [Record(os.urandom(100)) for _ in range(RECORDS_PER_BATCH)]
    return [
        encode_batch(records, 1, producer_id=PRODUCER_ID, producer_epoch=0, sequence=seq)
        for seq in range(-(-count // width))
    ]


async def run_width(
    process: NorthguardProcess, topic: str, width: int, count: int
) -> dict[str, float]:
    """One run of ``count`` appends to a new topic of ``width`` ranges; its figures."""
    admin = AdminClient(RealRuntime(), process.url, 120.0)
    try:
        ranges = [r.range_id for r in (await admin.create_topic(topic, shard_ranges(width))).ranges]
    finally:
        await admin.close()
    batches = batches_by_seq(count, width)  # before anything is timed
    assert process.popen is not None
    pid = process.popen.pid
    host, port = process.url.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    replay = Replay(width, count, batches)
    try:
        async with asyncio.timeout(REPLAY_TIMEOUT_S):
            await replay.open(writer, reader, topic, ranges)
            before = metrics(process)
            cpu_before = (cpu_s(pid), thread_cpu_s(pid, pid))
            started = time.perf_counter()
            await asyncio.gather(replay.send(writer), replay.receive(reader))
            elapsed = time.perf_counter() - started
        # The CPU is counted until every acknowledged frame is in its synced segment file: the
        # writes and the checkpoint that the appends cause are theirs, even after the last Ack.
        await quiet(process)
        cpu_after = (cpu_s(pid), thread_cpu_s(pid, pid))
        after = metrics(process)
    finally:
        writer.close()
    counts = delta(before, after)
    cpu, loop_cpu = (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1])
    return {
        f"appends_{width}_ranges_per_s": count / elapsed,
        f"broker_us_per_append_{width}_ranges": cpu / count * 1e6,
        f"loop_us_per_append_{width}_ranges": loop_cpu / count * 1e6,
        f"threads_us_per_append_{width}_ranges": (cpu - loop_cpu) / count * 1e6,
        f"flushes_{width}_ranges": counts.get("northguard_store_flushes_total", 0.0),
        f"segment_writes_{width}_ranges": counts.get("northguard_store_segment_writes_total", 0.0),
        f"files_created_{width}_ranges": counts.get(
            "northguard_store_segment_files_created_total", 0.0
        ),
        f"file_create_s_{width}_ranges": counts.get(
            "northguard_store_segment_file_create_seconds_total", 0.0
        ),
    }


async def run(args: argparse.Namespace) -> tuple[Rounds, dict[str, Any]]:
    rounds = Rounds()
    facts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ng-appends-", dir=args.dir) as run_dir:
        data_dir = Path(run_dir) / "ng-data"
        process = start_northguard_broker(data_dir, log_path=Path(run_dir) / "ng.log")
        try:
            facts.update(storage_facts(data_dir))
            await run_width(process, "warm", 8, args.appends // 4)
            for number, order in enumerate(alternating(args.rounds, [str(w) for w in WIDTHS])):
                for name in order:
                    width = int(name)
                    figures = await run_width(process, f"t-{number}-{width}", width, args.appends)
                    rounds.update(figures)
                    progress(
                        f"round {number + 1}: {width} ranges: "
                        f"{figures[f'appends_{width}_ranges_per_s']:,.0f} appends/s, broker "
                        f"{figures[f'broker_us_per_append_{width}_ranges']:.1f} us per append"
                    )
            rounds.ratio(
                "broker_us_per_append_512_vs_1",
                "broker_us_per_append_512_ranges",
                "broker_us_per_append_1_ranges",
            )
        finally:
            process.stop()
    return rounds, facts


def main() -> None:
    parser = bench_parser(__doc__, rounds_default=5)
    parser.add_argument("--appends", type=int, default=0, help="appends per width run")
    parser.add_argument("--dir", default=None, help="where the data directory goes")
    args = parser.parse_args()
    args.rounds = rounds_of(args)
    args.appends = args.appends or (10_240 if args.quick else 40_960)
    rounds, facts = asyncio.run(run(args))
    figures = rounds.figures()
    figures["rounds"] = args.rounds
    finish(
        "northguard_appends",
        figures,
        {},
        no_fail=args.no_fail,
        spread=rounds.spread(),
        config={
            "appends": args.appends,
            "records_per_batch": RECORDS_PER_BATCH,
            "value_bytes": 100,
            "in_flight_appends": IN_FLIGHT_APPENDS,
            "widths": list(WIDTHS),
        },
        **facts,
    )


if __name__ == "__main__":
    guard("northguard_appends", main)
