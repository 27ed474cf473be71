"""The create path under faults (issue 8, items 2, 10 and 12): no second create after an answer that does not
prove "no work done", leases that cover a slow create, and the adapter an operation was submitted with.

Real processes (longcall's MCP server, longcall workers, beat, a pipeline worker), real Postgres and Redis.
Every wait is bounded (``support.wait_for``)."""

from __future__ import annotations

import uuid

from ledger.reasons import ReconciliationReason
from ledger.records import Fence
from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet
from workers.settings import FleetConfig, ServerConfig
from workers.submission import validate_submission

S = OpState

SERVER = ServerConfig(protocol="mcp", protocol_version="2025-11-25", url="http://127.0.0.1:9/mcp")
#: Where an operation rests once its create has been decided one way or the other.
SETTLED = (S.MANUAL_RECONCILIATION, S.WORKING, S.TERMINAL_OBSERVED, S.FETCHING_RESULT, S.ACCEPTED)


def kinds(ledger: Ledger, op_id: uuid.UUID) -> list[str]:
    return [e["kind"] for e in ledger.events(op_id)]


def tool_calls(fleet: Fleet) -> int:
    return sum(1 for e in fleet.mcp.log() if e["method"] == "tools/call")


# ------------------------------------------------------------------------ item 2: no second create after 5xx


def test_an_error_answer_after_the_task_was_created_never_creates_a_second_task(fleet: Fleet) -> None:
    """A gateway answers 503 (or 408, or 500) after the origin created the task: the outcome is unknown
    (rule 1), so the operation goes to an operator, findable by its submission key, and the server holds
    exactly one task for it."""
    for status in (503, 408, 500):
        tasks_before, calls_before = len(fleet.mcp.tasks()), tool_calls(fleet)
        fleet.mcp.faults(status_after_create={"status": status, "count": 1})
        call_node = f"n/gateway-{status}"
        op_id = fleet.submit(call_node, "slow_report", {"seconds": 30})
        op = fleet.wait_state(op_id, *SETTLED, timeout=60)

        assert len(fleet.mcp.tasks()) - tasks_before == 1, f"HTTP {status}: the server holds a second task"
        assert tool_calls(fleet) - calls_before == 1, f"HTTP {status}: tools/call was sent again"
        assert op.state is S.MANUAL_RECONCILIATION, f"HTTP {status}: ended {op.state}, not with an operator"
        [record] = fleet.ledger.reconciliations_for(op.id)
        assert record.reason is ReconciliationReason.SUBMISSION_UNKNOWN
        assert record.detail["submission_key"] == str(op.submission_key)
        assert fleet.ledger.find_by_submission_key(op.submission_key) == op
        trail = kinds(fleet.ledger, op.id)
        assert "create_refused_before_work" not in trail, f"HTTP {status}: the attempt was undone"
        assert f"HTTP {status}" in str(
            fleet.ledger.events(op.id)[trail.index("submission_unknown")]["detail"]
        )


def test_a_429_before_any_work_is_created_again_once_with_one_task_and_a_receipt(fleet: Fleet) -> None:
    """A 429 proves the server did no work: the attempt is undone and the create made again, after the
    server's Retry-After; one task, one receipt."""
    fleet.mcp.faults(status_429={"tools/call": {"count": 1, "retry_after_s": 1}})
    op_id = fleet.submit("n/429-create", "slow_report", {"seconds": 0.2})
    receipt = fleet.wait_receipt("n/429-create", timeout=60)

    assert receipt["terminal_state"] == "completed"
    assert len(fleet.mcp.tasks()) == 1
    assert tool_calls(fleet) == 2  # the refused one and the one that created the task
    trail = kinds(fleet.ledger, op_id)
    assert trail.count("create_refused_before_work") == 1
    assert "submission_unknown" not in trail


# --------------------------------------------------------------------------- item 10: leases cover long steps


def test_a_create_answered_after_its_lease_ran_out_ends_working_not_with_an_operator(
    fleet_parts: FleetParts,
) -> None:
    """The server answers tools/call lease_s + 5 s late: the submitting worker renews its lease while it
    waits, so no other worker claims the row, calls it SUBMISSION_UNKNOWN and discards the real answer."""
    lease_s = 3
    with running_fleet(fleet_parts, env={"LONGCALL_LEASE_S": str(lease_s)}) as fleet:
        fleet.mcp.faults(delay_ms={"tools/call": (lease_s + 5) * 1000})
        op_id = fleet.submit("n/slow-create", "slow_report", {"seconds": 0.5})
        op = fleet.wait_state(op_id, *SETTLED, timeout=60)
        assert op.state is not S.MANUAL_RECONCILIATION, kinds(fleet.ledger, op_id)
        receipt = fleet.wait_receipt("n/slow-create", timeout=60)

        assert receipt["terminal_state"] == "completed"
        trail = kinds(fleet.ledger, op_id)
        assert "submission_unknown" not in trail, trail
        assert "manual_reconciliation" not in trail, trail
        assert "stale_write_rejected" not in trail, trail
        assert trail.index("created") < trail.index("terminal_accepted")
        assert (len(fleet.mcp.tasks()), tool_calls(fleet)) == (1, 1)


def test_a_lease_is_renewed_only_under_its_own_claim(ledger: Ledger) -> None:
    """The renewal is guarded like every write: the claim's cursor, epoch and generation, and a lease still
    held; anything else renews nothing."""
    new = validate_submission(
        {
            "call_node_id": "n/renew",
            "server": "reports",
            "tool": "slow_report",
            "arguments": {"seconds": 1},
        },
        FleetConfig(servers={"reports": SERVER}),
        max_body_bytes=1024,
    )
    op = ledger.record_submission(new, lease_s=30).operation
    fence = Fence(op.execution_epoch, op.cancel_generation, op.poll_cursor)
    assert ledger.renew_lease(op.id, fence, lease_s=60)
    renewed = ledger.get(op.id)
    assert renewed.lease_until is not None
    assert op.lease_until is not None
    assert renewed.lease_until > op.lease_until

    moved = Fence(op.execution_epoch, op.cancel_generation, op.poll_cursor + 1)
    assert not ledger.renew_lease(op.id, moved, lease_s=600)
    assert ledger.get(op.id).lease_until == renewed.lease_until
    assert ledger.events(op.id) == ledger.events(op.id)[:1]  # renewals write no event


# ------------------------------------------------------------------ item 12: the adapter is the operation's


def test_an_operation_keeps_the_adapter_it_was_submitted_with_when_the_config_moves(
    fleet_parts: FleetParts,
) -> None:
    """Submitted under MCP 2025-11-25; the configuration then moves the server to another version (one this
    longcall has no adapter for) and the workers restart: the operation is still followed with the adapter
    of its recorded version, to its receipt."""
    with running_fleet(fleet_parts) as fleet:
        op_id = fleet.submit("n/keeps-adapter", "slow_report", {"seconds": 4})
        op = fleet.wait_state(op_id, S.WORKING, timeout=30)
        assert (op.protocol, op.protocol_version) == ("mcp", "2025-11-25")

        support.stop_all(fleet.workers())
        for worker in fleet.workers():
            fleet.processes.remove(worker)
        config = fleet_parts.tmp_path / "longcall.toml"
        moved = config.read_text().replace('"2025-11-25"', '"2026-07-28"')
        assert moved != config.read_text()
        config.write_text(moved)
        fleet.start_worker("longcall-moved")

        receipt = fleet.wait_receipt("n/keeps-adapter", timeout=60)
        assert receipt["terminal_state"] == "completed"
        assert fleet.ledger.get(op_id).protocol_version == "2025-11-25"
        assert len(fleet.mcp.tasks()) == 1


def test_a_queued_create_whose_adapter_was_disabled_makes_no_tools_call(fleet: Fleet) -> None:
    """A create refused with a 429 waits for its retry; meanwhile the operator disables the adapter version.
    The queued create is refused without a remote call: a failed receipt saying why, no task."""
    fleet.mcp.faults(status_429={"tools/call": {"count": 1, "retry_after_s": 4}})
    op_id = fleet.submit("n/disabled", "slow_report", {"seconds": 0.2})
    support.wait_for(
        "the first create to be refused before any work",
        lambda: "create_refused_before_work" in kinds(fleet.ledger, op_id),
        timeout=30,
    )
    fleet.ledger.set_adapter_disabled("mcp", "2025-11-25", disabled=True, actor="test")

    receipt = fleet.wait_receipt("n/disabled", timeout=60)
    assert receipt["terminal_state"] == "failed"
    assert "disabled" in receipt["result"]["error"]["message"]
    assert tool_calls(fleet) == 1  # the refused one only
    assert fleet.mcp.tasks() == []
    trail = kinds(fleet.ledger, op_id)
    assert trail.index("adapter_disabled") < trail.index("terminal_accepted")
