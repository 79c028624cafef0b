"""The broker's frames fuzzed through a real socket, seeded and bounded (see ``frame_fuzz``).

In CI: a fixed seed for about three seconds.  ``NG_FUZZ_FRAMES=100000``
(and ``NG_FUZZ_SEED``) turn it into a long run bounded by frames instead;
``tests/northguard/frame_fuzz.py`` runs the same thing as a script.
"""

from __future__ import annotations

import os

from frame_fuzz import first_traceback, run_fuzz

from backends.northguard.launcher import NorthguardProcess

SEED = 20261123
SECONDS_MAX = 3.0


def test_fuzzed_frames_never_crash_the_broker_nor_stall_a_bystander(
    private_broker: NorthguardProcess,
) -> None:
    frames_max = int(os.environ.get("NG_FUZZ_FRAMES", "0"))
    report = run_fuzz(
        private_broker.url,
        seed=int(os.environ.get("NG_FUZZ_SEED", SEED)),
        frames_max=frames_max or 10**9,
        seconds_max=float("inf") if frames_max else SECONDS_MAX,
    )
    print(report)
    assert report.frames >= min(frames_max or 1000, 1000)
    assert report.pings >= 1  # a bystander was answered during and after the run
    assert not report.internal_errors, report.internal_errors[:5]
    assert private_broker.popen is not None and private_broker.popen.poll() is None
    log_text = private_broker.log_tail(10**6)
    trace = first_traceback(log_text)
    assert not trace, trace
    errors = [line for line in log_text.splitlines() if line.split(" ", 3)[2:3] == ["ERROR"]]
    assert not errors, errors[:5]
    # the fuzz reached the handlers, not only the frame decoder
    assert report.responses.get("invalid_request", 0) > 0
    assert report.responses.get("PRODUCE_OPENED", 0) + report.responses.get("CONSUME_OPENED", 0) > 0
