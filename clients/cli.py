"""``xinfra produce`` and ``xinfra consume``: virtual topics from the shell, like Kafka's console tools.

``produce`` reads stdin in the format ``--input`` names: ``lines`` (the
default), one record per line, the value (with ``--key-separator`` the text
before the first separator is the key); or ``json``, one JSON object per line
``{"key", "value", "headers", "shard", "timestamp_ms"}`` (every field
optional; headers ``[[name, value], ...]`` or ``{name: value}``).  A string is
stored as its UTF-8 bytes, any other JSON value (object, array, number,
boolean) as its JSON text, never a Python repr.  ``--base64``: keys, values
and header values are base64 (in both input formats), so any bytes go in.
``--json`` is the machine-readable output (one summary object on stdout),
never the input format.

``consume`` writes one line per record: the value (with ``--print-key``, key,
separator, value); with ``--json`` one object ``{"topic", "epoch", "shard",
"offset", "timestamp_ms", "key", "value", "headers"}`` (headers a list of
``[name, value]``: names may repeat); with ``--format`` a kcat-like format
string (``consume_format``).  ``--base64`` writes keys, values and header
values in base64 in both, so binary records round-trip; without it bytes that
are not UTF-8 are written with backslash escapes.  ``consume -e`` stops at the
end, ``--from -N`` starts at the last N records of each shard (in the current
epoch).

Both show records and rates on stderr (rich), so stdout stays data.  Exit
codes are ``xinfra.commands.output.exit_code``'s: 0 done, 1 failure (some
records not acknowledged, a bad topic, a revoked token), 3 the metadata
service is unreachable, 4 a physical cluster is.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import enum
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, BinaryIO

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from clients import (
    GroupOptions,
    XinfraConsumerOptions,
    XinfraProducer,
    XinfraProducerOptions,
    open_consumer,
    open_producer,
)
from clients.consumer import XinfraConsumer, XinfraRecord
from xinfra.commands.options import JsonOption, TokenOption, UrlOption, VcOption
from xinfra.commands.output import EXIT_FAILED, exit_codes
from xinfra.errors import InvalidRequest
from xinfra.model import Header, Position

err = Console(stderr=True)

STDIN_CHUNK_BYTES = 1 << 20
"""How much of stdin one read takes; at most ``STDIN_CHUNKS_MAX`` chunks wait to be sent."""
STDIN_CHUNKS_MAX = 8

QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")]
TimeoutOption = Annotated[
    float,
    typer.Option("--connect-timeout-s", help="How long to wait for an unreachable service."),
]
Base64Option = Annotated[
    bool,
    typer.Option(
        "--base64", help="Keys, values and header values are base64 (binary-safe round trips)."
    ),
]


class InputFormat(enum.StrEnum):
    """What ``produce`` reads from stdin."""

    LINES = "lines"
    JSON = "json"


def _progress(quiet: bool) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("[bold]{task.completed:,.0f}[/bold] records"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=quiet,
    )


def _rate(count: int, started: float) -> str:
    elapsed_s = max(time.monotonic() - started, 1e-9)
    return f"{count / elapsed_s:,.0f} rec/s"


# ---- produce -------------------------------------------------------------------------------


def _b64(data: bytes, what: str, line: bytes) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{what} is not base64: {line[:200]!r}") from None


def _json_bytes(value: Any, what: str, line: bytes, as_base64: bool) -> bytes | None:
    """A JSON field as record bytes: a string's UTF-8 (or, with ``--base64``, its decoded bytes),
    any other value its JSON text, so an object is stored as JSON and never as a Python repr."""
    if value is None:
        return None
    if as_base64:
        if not isinstance(value, str):
            raise InvalidRequest(f"{what} must be a base64 string with --base64: {line[:200]!r}")
        return _b64(value.encode(), what, line)
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _parse_json_line(line: bytes, shard: int | None, as_base64: bool) -> dict[str, Any]:
    try:
        body = json.loads(line)
    except ValueError as error:
        raise InvalidRequest(f"line is not JSON ({error}): {line[:200]!r}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"a JSON line must be an object: {line[:200]!r}")
    unknown = set(body) - {"key", "value", "headers", "shard", "timestamp_ms"}
    if unknown:
        raise InvalidRequest(f"unknown fields {sorted(unknown)} in {line[:200]!r}")
    headers = body.get("headers") or []
    pairs = headers.items() if isinstance(headers, dict) else headers
    header_list: list[Header] = []
    try:
        for name, value in pairs:
            if not isinstance(name, str):
                raise TypeError(name)
            encoded = _json_bytes(value, f"header {name!r}", line, as_base64)
            header_list.append((name, b"" if encoded is None else encoded))
    except (TypeError, ValueError):
        raise InvalidRequest(
            f"headers must be [[name, value], ...] or {{name: value}}: {line[:200]!r}"
        ) from None
    for field in ("shard", "timestamp_ms"):
        if body.get(field) is not None and type(body[field]) is not int:
            raise InvalidRequest(f"{field} must be an integer: {line[:200]!r}")
    return {
        "key": _json_bytes(body.get("key"), "key", line, as_base64),
        "value": _json_bytes(body.get("value"), "value", line, as_base64),
        "headers": header_list,
        "shard": body.get("shard", shard),
        "timestamp_ms": body.get("timestamp_ms"),
    }


def _parse_line(
    line: bytes,
    input_format: InputFormat,
    key_separator: str | None,
    shard: int | None,
    as_base64: bool = False,
) -> dict[str, Any]:
    """One stdin line as send() keyword arguments."""
    if input_format is InputFormat.JSON:
        return _parse_json_line(line, shard, as_base64)
    if key_separator is not None:
        key, found, value = line.partition(key_separator.encode())
        if not found:
            raise InvalidRequest(f"no key separator {key_separator!r} in line {line[:200]!r}")
        if as_base64:
            key, value = _b64(key, "key", line), _b64(value, "value", line)
        return {"key": key, "value": value, "shard": shard}
    return {"value": _b64(line, "value", line) if as_base64 else line, "shard": shard}


def _read_stdin(
    stream: BinaryIO,
    loop: asyncio.AbstractEventLoop,
    queue: asyncio.Queue[list[bytes] | None],
    stop: threading.Event,
) -> None:
    """Feed chunks of lines to the loop; blocks (back-pressure) while the queue is full."""
    try:
        while not stop.is_set():
            lines = stream.readlines(STDIN_CHUNK_BYTES)
            if not lines:
                break
            asyncio.run_coroutine_threadsafe(queue.put(lines), loop).result()
    finally:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            asyncio.run_coroutine_threadsafe(queue.put(None), loop).result()


async def _produce(
    topic: str,
    *,
    url: str | None,
    token: str | None,
    vc: str | None,
    input_format: InputFormat,
    as_base64: bool,
    key_separator: str | None,
    shard: int | None,
    linger_ms: float,
    rate_max: float | None,
    connect_timeout_s: float,
    quiet: bool,
    stream: BinaryIO,
) -> dict[str, Any]:
    options = XinfraProducerOptions(linger_ms=linger_ms, metadata_timeout_s=connect_timeout_s)
    producer: XinfraProducer = await open_producer(url, token, vc, options=options, topics=[topic])
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[list[bytes] | None] = asyncio.Queue(STDIN_CHUNKS_MAX)
    stop = threading.Event()
    reader = threading.Thread(
        target=_read_stdin, args=(stream, loop, queue, stop), name="stdin", daemon=True
    )
    counts = {"sent": 0, "acknowledged": 0, "failed": 0}
    first_error: list[BaseException] = []

    def done(future: asyncio.Future[Position]) -> None:
        if future.cancelled() or future.exception() is not None:
            counts["failed"] += 1
            if not first_error:
                first_error.append(future.exception() or asyncio.CancelledError())
        else:
            counts["acknowledged"] += 1

    started = time.monotonic()
    reader.start()
    try:
        with _progress(quiet) as progress:
            task = progress.add_task(f"producing to {topic}", total=None, rate="")
            while (lines := await queue.get()) is not None:
                for raw in lines:
                    line = raw.rstrip(b"\r\n")
                    if not line or (input_format is InputFormat.JSON and not line.strip()):
                        continue
                    future = await producer.send(
                        topic, **_parse_line(line, input_format, key_separator, shard, as_base64)
                    )
                    future.add_done_callback(done)
                    counts["sent"] += 1
                    if rate_max is not None:
                        ahead_s = counts["sent"] / rate_max - (time.monotonic() - started)
                        if ahead_s > 0:
                            await asyncio.sleep(ahead_s)
                progress.update(
                    task, completed=counts["acknowledged"], rate=_rate(counts["sent"], started)
                )
            await producer.flush()
            progress.update(task, completed=counts["acknowledged"])
    finally:
        stop.set()
        await producer.close()
    elapsed_s = time.monotonic() - started
    summary: dict[str, Any] = {
        "topic": topic,
        "input": input_format.value,
        "sent": counts["sent"],
        "acknowledged": counts["acknowledged"],
        "failed": counts["failed"],
        "elapsed_s": round(elapsed_s, 3),
        "records_per_s": round(counts["acknowledged"] / max(elapsed_s, 1e-9), 1),
    }
    if first_error:
        summary["first_error"] = str(first_error[0])
    return summary


def produce(
    topic: Annotated[str, typer.Argument(help="The virtual topic.")],
    as_json: JsonOption = False,
    input_format: Annotated[
        InputFormat,
        typer.Option(
            "--input",
            help="stdin format: lines (a value per line, or key<sep>value with --key-separator) "
            "or json (an object per line: key, value, headers, shard, timestamp_ms).",
        ),
    ] = InputFormat.LINES,
    as_base64: Base64Option = False,
    key_separator: Annotated[
        str | None,
        typer.Option("--key-separator", help="Split each line into key and value at this."),
    ] = None,
    shard: Annotated[
        int | None, typer.Option("--shard", help="Produce every record to this shard.")
    ] = None,
    linger_ms: Annotated[float, typer.Option("--linger-ms", help="Batch linger.")] = 5.0,
    rate_max: Annotated[
        float | None, typer.Option("--rate-max", help="At most this many records per second.")
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
    vc: VcOption = None,
    connect_timeout_s: TimeoutOption = 10.0,
    quiet: QuietOption = False,
) -> None:
    """Produce stdin to a virtual topic (key -> shard by the keyspace; keyless spread evenly).

    ``--json`` prints a summary object on stdout; the input format is ``--input``.
    """
    if rate_max is not None and rate_max <= 0:
        raise typer.BadParameter("--rate-max must be positive")
    if input_format is InputFormat.JSON and key_separator is not None:
        raise typer.BadParameter("--key-separator splits lines: leave it out with --input json")
    with exit_codes():
        summary = asyncio.run(
            _produce(
                topic,
                url=url,
                token=token,
                vc=vc,
                input_format=input_format,
                as_base64=as_base64,
                key_separator=key_separator,
                shard=shard,
                linger_ms=linger_ms,
                rate_max=rate_max,
                connect_timeout_s=connect_timeout_s,
                quiet=quiet,
                stream=sys.stdin.buffer,
            )
        )
    if as_json:
        print(json.dumps(summary), flush=True)
    if not quiet or summary["failed"]:
        colour = "red" if summary["failed"] else "green"
        err.print(
            f"[{colour}]{summary['acknowledged']:,} records acknowledged, "
            f"{summary['failed']:,} failed, {summary['records_per_s']:,.0f} rec/s[/{colour}]"
        )
        if "first_error" in summary:
            err.print(f"[red]first failure: {escape(summary['first_error'])}[/red]")
    if summary["failed"]:
        raise typer.Exit(EXIT_FAILED)


# ---- consume -------------------------------------------------------------------------------


def _text(data: bytes | None, as_base64: bool = False) -> str | None:
    """Bytes for a JSON document: base64 text, else UTF-8 with backslash escapes (lossy)."""
    if data is None:
        return None
    if as_base64:
        return base64.b64encode(data).decode("ascii")
    return data.decode("utf-8", "backslashreplace")


def _raw(data: bytes | None, as_base64: bool) -> bytes:
    """Bytes for a format string: as stored (kcat writes them raw), or base64; null is empty."""
    if data is None:
        return b""
    return base64.b64encode(data) if as_base64 else data


RecordBytes = Callable[[XinfraRecord, bool], bytes]
"""One ``--format`` field: the record (and whether base64 is on) to the bytes it prints."""

FORMAT_FIELDS: dict[str, RecordBytes] = {
    "t": lambda r, _b: r.topic.encode(),
    "s": lambda r, _b: b"%d" % r.shard,
    "o": lambda r, _b: b"%d" % r.offset,
    "e": lambda r, _b: b"%d" % r.epoch,
    "T": lambda r, _b: b"%d" % r.timestamp_ms,
    "k": lambda r, b64: _raw(r.key, b64),
    "v": lambda r, b64: _raw(r.value, b64),
    "h": lambda r, b64: b",".join(n.encode() + b"=" + _raw(v, b64) for n, v in r.headers),
}
"""kcat's tokens in xinfra's words: topic, shard (kcat's %p), offset, epoch, timestamp in ms,
key, value, headers (``name=value,...``, in order, names may repeat)."""
FORMAT_ESCAPES = {"n": b"\n", "t": b"\t", "r": b"\r", "\\": b"\\"}


def compile_format(fmt: str) -> Callable[[XinfraRecord, bool], bytes]:
    """A kcat-like ``--format`` string as a function of a record, parsed once, not per record.

    ``%t %s %o %e %T %k %v %h`` are the fields of ``FORMAT_FIELDS``, ``%%`` a percent
    sign; ``\\n``, ``\\t``, ``\\r`` and ``\\\\`` are escapes (a shell passes them
    literally).  Like kcat, nothing is added after a record: end the format with ``\\n``
    for one line each.  Anything else raises ``typer.BadParameter`` (a usage error, exit 2).
    """
    parts: list[bytes | RecordBytes] = []
    literal = bytearray()
    i = 0
    while i < len(fmt):
        char = fmt[i]
        if char in "%\\" and i + 1 < len(fmt):
            token = fmt[i + 1]
            if char == "%" and token == "%":
                literal += b"%"
            elif char == "%" and token in FORMAT_FIELDS:
                if literal:
                    parts.append(bytes(literal))
                    literal.clear()
                parts.append(FORMAT_FIELDS[token])
            elif char == "\\" and token in FORMAT_ESCAPES:
                literal += FORMAT_ESCAPES[token]
            else:
                raise typer.BadParameter(
                    f"--format: unknown {char}{token} at {i}; fields are "
                    f"{' '.join('%' + f for f in FORMAT_FIELDS)}, %%, and escapes \\n \\t \\r \\\\"
                )
            i += 2
            continue
        if char == "%":
            raise typer.BadParameter("--format ends in a lone %: write %% for a percent sign")
        literal += char.encode()
        i += 1
    if literal:
        parts.append(bytes(literal))

    def render(record: XinfraRecord, as_base64: bool) -> bytes:
        return b"".join(
            part if isinstance(part, bytes) else part(record, as_base64) for part in parts
        )

    return render


def _format(
    record: XinfraRecord,
    as_json: bool,
    print_key: bool,
    separator: str,
    as_base64: bool = False,
) -> bytes:
    """One record as one stdout line (without its newline): JSON, key and value, or the value."""
    if as_json:
        return json.dumps(
            {
                "topic": record.topic,
                **record.position.to_json(),
                "timestamp_ms": record.timestamp_ms,
                "key": _text(record.key, as_base64),
                "value": _text(record.value, as_base64),
                "headers": [[name, _text(value, as_base64)] for name, value in record.headers],
            }
        ).encode()
    value = _raw(record.value, as_base64)
    if print_key:
        return _raw(record.key, as_base64) + separator.encode() + value
    return value


def _start(start: str) -> str | int:
    """earliest, latest, a timestamp in ms (>= 0), or -N: the last N records of each shard."""
    if start in ("earliest", "latest"):
        return start
    try:
        value = int(start)
    except ValueError:
        value = None
    if value is None or (value == 0 and start.startswith("-")):
        raise typer.BadParameter(
            f"--from {start!r}: use earliest, latest, a timestamp in ms, or -N (last N per shard)"
        )
    return value


async def _seek_back(consumer: XinfraConsumer, topic: str, count: int) -> None:
    """Each assigned shard of ``topic`` at its last ``count`` records of the current epoch."""
    metadata = await consumer.metadata(topic)
    epoch = metadata.current_epoch
    shards = [shard for t, shard in consumer.assignment() if t == topic]
    reader = consumer._reader(topic, metadata, epoch)
    lows = await reader.start_offsets(shards)
    highs = await consumer._end_offsets(topic, metadata, epoch, shards)
    for shard in shards:
        consumer.seek(topic, Position(epoch.number, shard, max(lows[shard], highs[shard] - count)))


async def _ends(consumer: XinfraConsumer) -> dict[tuple[str, int], Position]:
    """Where each assigned shard ends now: the high watermark of the topic's current epoch."""
    ends: dict[tuple[str, int], Position] = {}
    for topic, shard in consumer.assignment():
        metadata = await consumer.metadata(topic)
        epoch = metadata.current_epoch
        high = (await consumer._end_offsets(topic, metadata, epoch, [shard]))[shard]
        ends[(topic, shard)] = Position(epoch.number, shard, high)
    return ends


def _at_end(consumer: XinfraConsumer, ends: dict[tuple[str, int], Position]) -> bool:
    positions = consumer.fetch_positions()
    return all(
        (p := positions[key]).epoch > end.epoch or (p.epoch == end.epoch and p.offset >= end.offset)
        for key, end in ends.items()
    )


async def _consume(
    topics: list[str],
    *,
    url: str | None,
    token: str | None,
    vc: str | None,
    start: str | int,
    shards: list[int] | None,
    position: Position | None,
    max_records: int | None,
    idle_s: float | None,
    as_json: bool,
    print_key: bool,
    separator: str,
    connect_timeout_s: float,
    quiet: bool,
    out: BinaryIO,
    group: str | None = None,
    exit_at_end: bool = False,
    render: Callable[[XinfraRecord, bool], bytes] | None = None,
    as_base64: bool = False,
) -> int:
    options = XinfraConsumerOptions(metadata_timeout_s=connect_timeout_s)
    consumer: XinfraConsumer = await open_consumer(
        url,
        token,
        vc,
        options=options,
        topics=topics,
        group=group,
        group_options=GroupOptions(start=start) if group else None,  # type: ignore[arg-type]
    )
    count = 0
    started = time.monotonic()
    try:
        if group is not None:
            await consumer.subscribe(topics)  # the group assigns; close commits what was read
        for topic in topics if group is None else ():
            back = isinstance(start, int) and start < 0
            await consumer.assign(topic, shards, "latest" if back else start)  # type: ignore[arg-type]
            if back:
                await _seek_back(consumer, topic, -int(start))
            if position is not None:
                consumer.seek(topic, position)
        ends = await _ends(consumer) if exit_at_end else None
        last_record = time.monotonic()
        with _progress(quiet) as progress:
            task = progress.add_task(f"consuming {', '.join(topics)}", total=None, rate="")
            while max_records is None or count < max_records:
                if ends is not None and _at_end(consumer, ends):
                    break
                want = 1000 if max_records is None else min(1000, max_records - count)
                records = await consumer.poll(want, timeout_s=0.5)
                if records:
                    if render is not None:
                        out.write(b"".join(render(r, as_base64) for r in records))
                    else:
                        out.write(
                            b"".join(
                                _format(r, as_json, print_key, separator, as_base64) + b"\n"
                                for r in records
                            )
                        )
                    out.flush()
                    count += len(records)
                    last_record = time.monotonic()
                    progress.update(task, completed=count, rate=_rate(count, started))
                elif idle_s is not None and time.monotonic() - last_record >= idle_s:
                    break
    finally:
        await consumer.close()
    return count


def consume(
    topics: Annotated[list[str], typer.Argument(help="One or more virtual topics.")],
    start: Annotated[
        str,
        typer.Option(
            "--from", help="earliest, latest, a timestamp in ms, or -N (the last N of each shard)."
        ),
    ] = "earliest",
    exit_at_end: Annotated[
        bool,
        typer.Option(
            "--exit-at-end", "-e", help="Stop once every shard is read to where it ended at start."
        ),
    ] = False,
    shards: Annotated[
        str | None, typer.Option("--shards", help="Comma-separated shards (default: all).")
    ] = None,
    at: Annotated[
        str | None,
        typer.Option("--position", help="Start at EPOCH:SHARD:OFFSET (one shard, one topic)."),
    ] = None,
    max_records: Annotated[
        int | None, typer.Option("--max-records", "-n", help="Stop after this many records.")
    ] = None,
    idle_s: Annotated[
        float | None,
        typer.Option("--idle-s", help="Stop when nothing arrives for this long (default: never)."),
    ] = None,
    group: Annotated[
        str | None,
        typer.Option(
            "--group", "-g", help="Join this consumer group: it assigns the shards, reads commit."
        ),
    ] = None,
    as_json: JsonOption = False,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            "-f",
            help="kcat-like format string, e.g. '%k %v\\n': %t topic, %s shard, %o offset, "
            "%e epoch, %T timestamp ms, %k key, %v value, %h headers (name=value,...), %%; "
            "escapes \\n \\t \\r \\\\. Nothing is added after a record.",
        ),
    ] = None,
    as_base64: Annotated[
        bool,
        typer.Option(
            "--base64",
            help="Keys, values and header values in base64 (with --json, --format, --print-key).",
        ),
    ] = False,
    print_key: Annotated[bool, typer.Option("--print-key", help="Print key, separator, value.")] = (
        False
    ),
    separator: Annotated[str, typer.Option("--key-separator", help="Key separator.")] = "\t",
    url: UrlOption = None,
    token: TokenOption = None,
    vc: VcOption = None,
    connect_timeout_s: TimeoutOption = 10.0,
    quiet: QuietOption = False,
) -> None:
    """Consume virtual topics through their epochs to stdout (every record once, per-key order)."""
    shard_list: list[int] | None = None
    if shards is not None:
        try:
            shard_list = [int(s) for s in shards.split(",") if s.strip()]
        except ValueError:
            raise typer.BadParameter(f"--shards {shards!r}: use e.g. 0,1,2") from None
    position: Position | None = None
    if at is not None:
        try:
            epoch, shard, offset = (int(part) for part in at.split(":"))
        except ValueError:
            raise typer.BadParameter(f"--position {at!r}: use EPOCH:SHARD:OFFSET") from None
        position = Position(epoch, shard, offset)
        if len(topics) != 1:
            raise typer.BadParameter("--position goes with exactly one topic")
        shard_list = [shard]
    if max_records is not None and max_records < 1:
        raise typer.BadParameter("--max-records must be at least 1")
    if group is not None and (shards is not None or at is not None):
        raise typer.BadParameter("--group assigns the shards: leave out --shards and --position")
    if group is not None and exit_at_end:
        raise typer.BadParameter("--exit-at-end reads fixed shards: leave out --group")
    render = None
    if fmt is not None:
        if as_json or print_key:
            raise typer.BadParameter(
                "--format is the whole output: leave out --json and --print-key"
            )
        render = compile_format(fmt)
    begin = _start(start)
    if group is not None and isinstance(begin, int) and begin < 0:
        raise typer.BadParameter("--from -N reads fixed shards: leave out --group")
    with exit_codes():
        count = asyncio.run(
            _consume(
                topics,
                url=url,
                token=token,
                vc=vc,
                start=begin,
                shards=shard_list,
                position=position,
                max_records=max_records,
                idle_s=idle_s,
                as_json=as_json,
                print_key=print_key,
                separator=separator,
                connect_timeout_s=connect_timeout_s,
                quiet=quiet,
                out=sys.stdout.buffer,
                group=group,
                exit_at_end=exit_at_end,
                render=render,
                as_base64=as_base64,
            )
        )
    if not quiet:
        err.print(f"[green]{count:,} records consumed[/green]")
