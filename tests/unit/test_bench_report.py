"""bench/report.py: the rules every bench shares (paired rounds, open-loop latency, exit status)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import report  # bench/report.py


def test_rounds_alternate_which_side_goes_first() -> None:
    assert list(report.alternating(3, ["ours", "peer"])) == [
        ["ours", "peer"],
        ["peer", "ours"],
        ["ours", "peer"],
    ]


def test_a_ratio_is_the_median_of_paired_round_ratios_with_its_spread() -> None:
    rounds = report.Rounds()
    for ours, peer in ((100.0, 200.0), (300.0, 100.0), (90.0, 100.0)):
        rounds.update({"ours": ours, "peer": peer})
    rounds.ratio("ratio", "ours", "peer")
    figures, spread = rounds.figures(), rounds.spread()
    # Per-round ratios 0.5, 3.0, 0.9: the median is 0.9, not median(ours) / median(peer) = 1.0.
    assert figures["ratio"] == 0.9
    assert spread["ratio"] == [0.5, 3.0]
    assert figures["ours"] == 100 and spread["ours"] == [90, 300]


def test_open_loop_counts_latency_from_the_scheduled_time_through_a_stall() -> None:
    schedule = report.OpenLoop(rate_per_s=10_000, duration_s=1.0)
    schedule.begin()
    schedule.start -= 0.050  # the sender stalled for 50 ms: every record due meanwhile is late
    due = schedule.due()
    assert len(due) >= 500 and due.start == 0
    acked_at = time.perf_counter()
    assert schedule.latency_ms(0, acked_at) >= 50.0
    assert schedule.latency_ms(due[-1], acked_at) < schedule.latency_ms(0, acked_at)
    assert schedule.due().start == due.stop  # nothing is handed out twice
    assert schedule.wait_s() <= schedule.tick_s


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert report.percentile(values, 0.99) == 99.0
    assert report.percentile(values, 0.5) == 50.0
    assert report.latency_figures("x", values)["x_max"] == 100.0


def last_json(captured: str) -> dict[str, Any]:
    line: dict[str, Any] = json.loads(captured.strip().splitlines()[-1])
    return line


@pytest.mark.parametrize(
    ("targets", "no_fail", "status"),
    [
        ({"a": report.target(1.0, 0.8)}, False, 0),
        ({"a": report.target(0.5, 0.8)}, False, 1),
        ({"a": report.target(0.5, 0.8)}, True, 0),
        ({"a": report.report_only(0.5, 0.8), "b": report.target(10.0, 20.0, "<=")}, False, 0),
    ],
    ids=["met", "missed", "missed-no-fail", "report-only-missed"],
)
def test_finish_exits_1_on_a_missed_hard_target(
    capsys: pytest.CaptureFixture[str], targets: dict[str, Any], no_fail: bool, status: int
) -> None:
    with pytest.raises(SystemExit) as exited:
        report.finish(
            "t", {"f": 1}, targets, no_fail=no_fail, spread={"f": [1, 1]}, config={"c": 1}
        )
    assert exited.value.code == status
    line = last_json(capsys.readouterr().out)
    assert set(line) == {"bench", "machine", "figures", "spread", "config", "targets"}
    assert line["config"] == {"c": 1} and line["spread"] == {"f": [1, 1]}


def test_guard_exits_2_with_the_reason_when_a_bench_cannot_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def broken() -> None:
        raise RuntimeError("tansu did not start")

    with pytest.raises(SystemExit) as exited:
        report.guard("t", broken)
    assert exited.value.code == 2
    assert last_json(capsys.readouterr().out)["error"] == "RuntimeError: tansu did not start"


def test_storage_facts_name_the_filesystem(tmp_path: Path) -> None:
    assert report.fs_type("/proc") == "proc"
    facts = report.storage_facts(tmp_path)
    assert facts["data_dir_fs"] not in ("", "unknown")
    assert isinstance(facts["o_direct_granted"], bool)
    if facts["data_dir_fs"] == "ext4":
        assert isinstance(facts["data_dir_ext4_journal"], bool)
    else:
        assert facts["data_dir_ext4_journal"] is None
    assert report.ext4_journal("/proc") is None
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
