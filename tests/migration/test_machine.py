"""The pure state machine: order of steps, rollback window, resume markers, JSON round trip."""

from __future__ import annotations

import pytest

from migration.machine import (
    ROLLBACK,
    Migration,
    State,
    check_rollback,
    next_state,
    plan,
)
from xinfra.errors import (
    AlreadyMigrating,
    SameCluster,
    ShardCountMismatch,
    StepOutOfOrder,
    error_from_code,
)


def planned() -> Migration:
    return plan("vc", "t", "kafka", 0, 3, "ng", None, None)


def test_steps_follow_one_order_and_resume_the_pending_one() -> None:
    m = planned()
    assert next_state(m, None) == State.DUAL_WRITE
    with pytest.raises(StepOutOfOrder):
        next_state(m, State.CUT_OVER)
    m.pending = State.DUAL_WRITE.value  # a crash or timeout left the step under way
    assert next_state(m, State.DUAL_WRITE) == State.DUAL_WRITE
    m.state, m.pending = State.CUT_OVER, None
    assert next_state(m, None) == State.COMPLETED
    m.state = State.COMPLETED
    with pytest.raises(StepOutOfOrder):
        next_state(m, None)


@pytest.mark.parametrize(
    ("state", "pending", "allowed"),
    [
        (State.PLANNED, None, True),
        (State.PLANNED, "dual_write", True),
        (State.DUAL_WRITE, None, True),
        (State.DUAL_WRITE, ROLLBACK, True),
        (State.DUAL_WRITE, "cut_over", False),
        (State.CUT_OVER, None, False),
        (State.COMPLETED, None, False),
        (State.ROLLED_BACK, None, False),
    ],
)
def test_rollback_only_before_dual_writes_stop(
    state: State, pending: str | None, allowed: bool
) -> None:
    m = planned()
    m.state, m.pending = state, pending
    if allowed:
        check_rollback(m)
    else:
        with pytest.raises(StepOutOfOrder):
            check_rollback(m)


def test_plan_refusals() -> None:
    with pytest.raises(SameCluster):
        plan("vc", "t", "kafka", 0, 3, "kafka", None, None)
    with pytest.raises(ShardCountMismatch):
        plan("vc", "t", "kafka", 0, 3, "ng", 4, None)
    with pytest.raises(AlreadyMigrating):
        plan("vc", "t", "kafka", 0, 3, "ng", None, planned())
    done = planned()
    done.state = State.ROLLED_BACK
    assert plan("vc", "t", "kafka", 0, 3, "ng", 3, done).state == State.PLANNED


def test_json_round_trip_and_codes_rebuilt_by_clients() -> None:
    m = planned()
    m.record("paused", late_clients=["a"])
    assert Migration.from_json(m.to_json()) == m
    assert isinstance(error_from_code("migration_step_out_of_order", "x"), StepOutOfOrder)
