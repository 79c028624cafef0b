"""``ServiceMetrics.requests_done`` (the commits of one flush counted together) leaves exactly
what as many ``request_done`` calls leave: the count, the latency sum and every bucket."""

from __future__ import annotations

from prometheus_client import generate_latest

from metadata_service.metrics import ServiceMetrics

TEMPLATE = "/v1/vclusters/{vc}/groups/{group}/commit"
# Below, on and past bucket bounds (0.0005, 0.001, ... 30, +Inf), and zero.
LATENCIES = [0.0, 0.0001, 0.0005, 0.0007, 0.001, 0.003, 0.005, 0.02, 0.5, 4.0, 30.0, 31.0, 0.0007]


def test_many_requests_at_once_are_counted_as_one_at_a_time() -> None:
    one_by_one, together = ServiceMetrics(), ServiceMetrics()
    for seconds in LATENCIES:
        one_by_one.request_done("POST", TEMPLATE, 204, seconds)
    together.requests_done("POST", TEMPLATE, 204, LATENCIES[:5])
    together.requests_done("POST", TEMPLATE, 204, [])
    together.requests_done("POST", TEMPLATE, 204, LATENCIES[5:])

    def exposition(metrics: ServiceMetrics) -> list[str]:
        return [
            line
            for line in generate_latest(metrics.registry).decode().splitlines()
            if line.startswith("xinfra_metadata_http_request") and "_created" not in line
        ]

    lines = exposition(together)
    assert lines == exposition(one_by_one)
    assert (
        f'xinfra_metadata_http_requests_total{{method="POST",route="{TEMPLATE}",status="204"}} 13.0'
        in lines
    )
