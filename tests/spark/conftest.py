"""Fixtures of the Spark tests: one local SparkSession per module, and the SDK's live service.

The live metadata service, tansu and the Northguard broker are the SDK
tests' fixtures (``tests/clients/conftest.py``), imported rather than
copied; ``sdk_live`` sits beside them.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))  # sdk_live

from tests.clients.conftest import (  # fixtures, re-exported to this folder
    kafka,
    live,
    northguard,
    service_config,
    tansu_deviations,
)

__all__ = ["kafka", "live", "northguard", "service_config", "tansu_deviations"]


def java_missing() -> str | None:
    if os.environ.get("JAVA_HOME") and Path(os.environ["JAVA_HOME"], "bin", "java").exists():
        return None
    return None if shutil.which("java") else "no Java runtime (java on PATH or JAVA_HOME)"


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """A local[2] SparkSession with the xinfra source registered (the JVM starts once per module)."""
    if (missing := java_missing()) is not None:
        pytest.skip(f"SKIPPED LOUDLY: {missing}; Spark needs Java 17")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import clients.spark

    session = (
        SparkSession.builder.master("local[2]")
        .appName("xinfra-spark-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    clients.spark.register(session)
    yield session
    session.stop()
