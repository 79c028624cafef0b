"""Fuzzing the REST API from its OpenAPI document: generated requests (valid and invalid) against a
real service process over MariaDB, with a fixed seed and a bound on time.  No 5xx, no crash, every
response conforms to the document (status, content type, schema).

The CI run sends ``REQUESTS`` requests; a longer run is the same test with more, e.g.
``XINFRA_FUZZ_REQUESTS=12000 XINFRA_FUZZ_TIME_S=3600 pytest tests/metadata_service/test_ms_openapi.py``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from ms_harness import ADMIN_TOKEN, start_instance
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup

from xinfra.services.process import ManagedProcess

SEED = int(os.environ.get("XINFRA_FUZZ_SEED", "20261123"))
REQUESTS = int(os.environ.get("XINFRA_FUZZ_REQUESTS", "1000"))
TIME_S_MAX = float(os.environ.get("XINFRA_FUZZ_TIME_S", "120"))
"""The bound on the run: past it no more requests are sent (and the count is not asserted)."""
REQUESTS_MIN = 1000
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def fuzzed(tmp_path: Path, mysql_url: str) -> Iterator[ManagedProcess]:
    """The service as its own process, so a crash shows (and the fuzzer does not share its GIL).

    Settles are bounded at 1 s: a generated producer lease must not stall a generated seal.
    """
    process = start_instance(tmp_path, "fuzzed", mysql_url, seal_settle_s_max=1.0)
    yield process
    process.stop()


def test_openapi_document_is_complete(live_url: str) -> None:
    document = requests.get(f"{live_url}/openapi.json", timeout=10).json()
    assert "Problem" in document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert operation.get("summary") or operation.get("description"), (method, path)
            if path.startswith("/v1"):
                problem = operation["responses"]["422"]["content"]
                assert "application/problem+json" in problem, (method, path)


def test_generated_requests_never_fail_the_server(fuzzed: ManagedProcess) -> None:
    url = fuzzed.url
    document = requests.get(f"{url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(document)
    # Some real state so that generated requests also reach the success paths.
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    bootstrap = f"memory-{uuid.uuid4().hex[:8]}:9092"
    session = requests.Session()
    session.headers.update(headers)
    assert (
        session.post(
            f"{url}/v1/clusters", json={"name": "k1", "kind": "kafka", "bootstrap": bootstrap}
        ).status_code
        == 201
    )
    assert (
        session.post(
            f"{url}/v1/vclusters/default/topics",
            json={"name": "t", "cluster": "k1", "shards": 2},
        ).status_code
        == 201
    )

    strategies = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            strategies.append(operation.as_strategy(generation_mode=mode))
    sent = 0
    crashes: list[str] = []
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + TIME_S_MAX

    @seed(SEED)
    @settings(
        max_examples=REQUESTS,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        print_blob=True,
    )
    @given(case=st.one_of(strategies))
    def check(case: schemathesis.Case) -> None:
        nonlocal sent
        if time.monotonic() > deadline:
            return  # the time bound: generate on, send no more
        if case.operation.path.endswith("/metadata"):  # no generated long-poll stalls the run
            case.query = {**(case.query or {}), "timeout_s": 0}
        try:
            response = case.call(base_url=url, session=session, headers=headers, timeout=30)
        except (
            requests.exceptions.InvalidHeader,
            requests.exceptions.InvalidURL,
            UnicodeError,
            ValueError,
        ):
            return  # the generated request cannot even be sent over HTTP
        except requests.exceptions.ConnectionError as error:
            crashes.append(f"{case.method} {case.formatted_path}: {error}")
            raise AssertionError(f"the service dropped the connection: {crashes[-1]}") from None
        sent += 1
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as failures:
            raise AssertionError(f"{case.method} {case.formatted_path}: {failures}") from None

    started = time.monotonic()
    check()
    elapsed_s = time.monotonic() - started
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    unhandled = fuzzed.log_path.read_text(errors="replace").count("Exception in ASGI application")
    print(
        f"fuzz seed {SEED}: sent {sent} requests in {elapsed_s:.0f} s; 5xx {server_errors}; "
        f"crashes {len(crashes)}; unhandled exceptions {unhandled}; "
        f"statuses {sorted(statuses.items())}"
    )
    assert fuzzed.alive(), f"the service exited:\n{fuzzed.log_tail()}"
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert server_errors == 0 and not crashes and unhandled == 0, statuses
    if time.monotonic() < deadline:
        assert sent >= min(REQUESTS, REQUESTS_MIN), f"only {sent} requests sent"


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
