"""The ``xinfra`` data source: Spark's Python Data Source API over ``clients.spark.plan``.

These classes only translate: planning is ``plan.Planner`` (driver, one
``asyncio.run`` per Spark call), reading is ``read.read_slice`` (executor),
writing is ``write.XinfraWriter`` (the SDK producer in each task).
Spark pickles the readers to its tasks, so they hold parsed options and
nothing else; no connection outlives the call that opened it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceWriter,
    Filter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from clients.spark.filters import narrowing
from clients.spark.options import (
    SourceOptions,
    include_headers,
    parse_options,
    parse_write_options,
)
from clients.spark.plan import (
    Narrowing,
    Offsets,
    Planner,
    Slice,
    admit,
    offsets_from_json,
    offsets_to_json,
)
from clients.spark.read import freeze_worker_heap, read_slice
from clients.spark.reader_pool import WORKER_POOL
from clients.spark.write import XinfraWriter, check_schema
from clients.sync import LoopThread
from xinfra.errors import InvalidRequest

T = TypeVar("T")

HEADERS_DDL = "headers array<struct<key: string, value: binary>>"


def schema_ddl(include_headers: bool) -> str:
    columns = ["key binary", "value binary"]
    if include_headers:
        columns.append(HEADERS_DDL)
    columns += ["topic string", "epoch int", "shard int", "offset long", "timestamp timestamp"]
    return ", ".join(columns)


def _plan(options: SourceOptions, work: Callable[[Planner], Awaitable[T]]) -> T:
    async def run() -> T:
        planner = Planner(options)
        try:
            return await work(planner)
        finally:
            await planner.close()

    return asyncio.run(run())


class _Runtime:
    """A planner on its own event-loop thread, kept between the calls of one stream.

    A stream asks for offsets at every trigger; keeping the service client and
    the backends' readers open saves their set-up each time.  Offsets the
    backends answered are forgotten between calls (retention moves on).
    """

    def __init__(self, options: SourceOptions) -> None:
        self.thread = LoopThread("xinfra-spark-planner")

        async def build() -> Planner:
            return Planner(options)

        try:
            self.planner = self.thread.run(build())
        except BaseException:
            self.thread.stop()
            raise

    def run(self, work: Callable[[Planner], Awaitable[T]]) -> T:
        self.planner.forget_offsets()
        return self.thread.run(_call(work, self.planner))

    def close(self) -> None:
        try:
            self.thread.run(self.planner.close())
        finally:
            self.thread.stop()


async def _call(work: Callable[[Planner], Awaitable[T]], planner: Planner) -> T:
    return await work(planner)


def _read(partition: InputPartition, options: SourceOptions) -> Iterator[Any]:
    piece = partition.value
    if piece is None:  # Spark's stand-in when a plan has no slice
        return iter(())
    assert isinstance(piece, Slice)
    freeze_worker_heap()
    return read_slice(piece, options.include_headers, options.fail_on_data_loss, WORKER_POOL)


class XinfraDataSource(DataSource):
    """``spark.read.format("xinfra")`` and ``spark.readStream.format("xinfra")``."""

    @classmethod
    def name(cls) -> str:
        return "xinfra"

    def _options(self, streaming: bool) -> SourceOptions:
        freeze_worker_heap()  # a planner's worker: Spark's daemon collects after each call
        return parse_options(dict(self.options), streaming)

    def schema(self) -> str:
        freeze_worker_heap()
        return schema_ddl(include_headers(dict(self.options)))

    def reader(self, schema: StructType) -> DataSourceReader:
        return XinfraBatchReader(self._options(streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return XinfraStreamReader(self._options(streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """``df.write.format("xinfra").mode("append")``: see ``clients.spark.write``."""
        if overwrite:
            raise InvalidRequest(
                "the xinfra sink only appends to a topic: use mode('append'), not 'overwrite'"
            )
        options = parse_write_options(dict(self.options))
        check_schema(schema, options.explicit_shards)
        return XinfraWriter(options)


class XinfraBatchReader(DataSourceReader):
    """A batch read: every slice between the starting and the ending offsets, planned once."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.narrowing = Narrowing()

    def pushFilters(self, filters: list[Filter]) -> Sequence[Filter]:
        """Narrow the plan by the filters; hand them all back for Spark to apply to the rows."""
        self.narrowing = narrowing(filters)
        return filters

    def partitions(self) -> list[InputPartition]:
        async def work(planner: Planner) -> list[Slice]:
            views = await planner.views()
            available = await planner.available(views)
            start = await planner.resolve(self.options.starting, views, available, ending=False)
            end = await planner.resolve(self.options.ending, views, available, ending=True)
            return await planner.slices(views, start, end, self.narrowing)

        return [InputPartition(piece) for piece in _plan(self.options, work)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(partition, self.options)


class XinfraStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream: offsets per (topic, epoch, shard), admitted under ``maxRecordsPerTrigger``.

    Spark checkpoints the offsets this returns, so a restarted query resumes
    at exactly the next record of every shard.  New epochs (a migration) are
    found at the next trigger.
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.target: Offsets | None = None
        """With Trigger.AvailableNow: how far the shards could be read when the query started."""
        self._runtime: _Runtime | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Tasks get the options, never the driver's connections."""
        state = dict(self.__dict__)
        state["_runtime"] = None
        return state

    def _plan(self, work: Callable[[Planner], Awaitable[T]]) -> T:
        if self._runtime is None:
            self._runtime = _Runtime(self.options)
        return self._runtime.run(work)

    def stop(self) -> None:
        if self._runtime is not None:
            runtime, self._runtime = self._runtime, None
            runtime.close()

    def initialOffset(self) -> dict[str, Any]:
        async def work(planner: Planner) -> Offsets:
            views = await planner.views()
            available = await planner.available(views)
            return await planner.resolve(self.options.starting, views, available, ending=False)

        return offsets_to_json(self._plan(work))

    def getDefaultReadLimit(self) -> ReadLimit:
        rows = self.options.max_records_per_trigger
        return ReadMaxRows(rows) if rows is not None else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        async def work(planner: Planner) -> Offsets:
            return await planner.available(await planner.views())

        self.target = self._plan(work)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = offsets_from_json(start)
        rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        target = self.target

        async def work(planner: Planner) -> Offsets:
            views = await planner.views()
            available = await planner.available(views)
            if target is not None:
                available = {k: min(v, target[k]) for k, v in available.items() if k in target}
            first: Offsets = {}
            for key in available:
                if key not in begin:
                    topic, number, shard = key
                    metadata = views[topic]
                    epoch = next(e for e in metadata.epochs if e.number == number)
                    first[key] = (await planner.retained(metadata, epoch))[shard]
            return admit(views, begin, available, first, rows)

        return offsets_to_json(self._plan(work))

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        begin, stop = offsets_from_json(start), offsets_from_json(end)
        if begin == stop:
            return []

        async def work(planner: Planner) -> list[Slice]:
            return await planner.slices(await planner.views(), begin, stop)

        return [InputPartition(piece) for piece in self._plan(work)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(partition, self.options)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: the offsets Spark checkpoints are the only state."""
