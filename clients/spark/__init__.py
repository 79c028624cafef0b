"""Spark reads virtual topics: the ``xinfra`` Python data source (DESIGN.md §7).

``register(spark)`` once per session, then::

    df = (spark.read.format("xinfra")
          .option("metadata.url", "http://127.0.0.1:8000")
          .option("virtualCluster", "default")
          .option("topics", "orders,payments")
          .load())

or ``spark.readStream.format("xinfra")`` with the same options.  See
``clients/spark/README.md`` for every option, the columns, the offsets JSON
and what a plan reads.
"""

from __future__ import annotations

from typing import Any

from clients.spark.source import XinfraDataSource

FILTER_PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


def register(spark: Any) -> None:
    """Make ``format("xinfra")`` known to this session, with filter pushdown on.

    Spark refuses a Python source that pushes filters unless
    ``spark.sql.python.filterPushdown.enabled`` is set, so this sets it: a
    narrow query (one shard, an offset range) then reads only what it names.
    """
    spark.conf.set(FILTER_PUSHDOWN_CONF, "true")
    spark.dataSource.register(XinfraDataSource)


__all__ = ["FILTER_PUSHDOWN_CONF", "XinfraDataSource", "register"]
