"""Bounded result reads (issue 19, items 1 and 2): a result too large to read, and a read error that never
changes, reach an operator within a bound; a cancel's status reads the server refuses do too.

1. The transport's cap on one answer is derived from ``max_result_bytes`` (one limit): a result under it is
   read and accepted (before: a 5 MiB result was refused by a 4 MiB transport cap and fetched again every
   second for ever), and an answer over it sends the operation to an operator at the first read that proves
   it (RESULT_UNSTORABLE, with the size and ``max_result_bytes``), on every protocol: MCP 2025-11-25
   ``tasks/result``, the MCP tasks extension (the result inline in ``tasks/get``, read by the poll) and
   AIP-151 (the done Operation carries the response, read by the poll too).
2. A result read that fails the same way every time ends with an operator (RESULT_UNREADABLE, the last
   error and the count in the record): the same protocol violation after a few tries, any other failure
   after ``result_retry_s``; a cancel whose status reads the server refuses ends as a poll's refusals do
   (PROTOCOL_VIOLATION after ``MAX_POLL_REJECTIONS`` in a row), not at the wait deadline.

Real Postgres and Redis, longcall's demo servers with their fault switches, and an in-process executor
driving one step at a time (every loop is bounded).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from sqlalchemy import text

from ledger.reasons import ReconciliationReason
from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.aip_fleet import AIP_SERVER, AIP_TOOL, aip_config, args
from tests.support.aip_server import AipServer, start_aip_server
from tests.support.ext_fleet import EXT_SERVER, ext_config, start_ext_demo_server
from tests.support.fleet import McpServer, fleet_config, in_process_runtime, start_mcp_server
from workers.executor import Executor
from workers.runtime import Runtime
from workers.steps.poll import MAX_POLL_REJECTIONS
from workers.steps.result import MAX_SAME_VIOLATIONS
from workers.submission import validate_submission

S = OpState
MIB = 1024 * 1024
#: Bounded loops: far more steps than any bound allows.
STEPS = 40


class Rig:
    """An executor in this process over one demo server (``server``: its name in the configuration)."""

    def __init__(self, executor: Executor, server: str) -> None:
        self.executor = executor
        self.server = server

    @property
    def ledger(self) -> Ledger:
        return self.executor.ledger

    def submit(self, call_node_id: str, tool: str, arguments: dict[str, Any]) -> uuid.UUID:
        new = validate_submission(
            {"call_node_id": call_node_id, "server": self.server, "tool": tool, "arguments": arguments},
            self.executor.rt.fleet,
            max_body_bytes=self.executor.rt.settings.max_body_bytes,
        )
        submission, _ = self.executor.submit(new)
        return submission.operation.id

    def step(self, op_id: uuid.UUID) -> str:
        """One step of the operation, whatever its state, claimed now (due or not)."""
        claim = self.ledger.claim(op_id, lease_s=30)
        assert claim is not None, f"{op_id} could not be claimed"
        state = self.ledger.get(op_id).state
        if state in (S.TERMINAL_OBSERVED, S.FETCHING_RESULT):
            return self.executor.fetch_result(op_id, claim.poll_cursor).action
        if state is S.CANCEL_REQUESTED:
            return self.executor.send_cancel(op_id, claim.poll_cursor).action
        return self.executor.advance(op_id, claim.poll_cursor).action

    def run_until(self, op_id: uuid.UUID, *states: OpState, steps: int = STEPS) -> list[str]:
        """Step until the operation is in one of ``states`` (at most ``steps`` steps); the actions taken."""
        actions: list[str] = []
        for _ in range(steps):
            if self.ledger.get(op_id).state in states:
                return actions
            actions.append(self.step(op_id))
        raise AssertionError(
            f"{op_id} still {self.ledger.get(op_id).state} after {steps} steps: {actions[-10:]} "
            f"(events: {[e['kind'] for e in self.ledger.events(op_id)][-10:]})"
        )

    def working(self, op_id: uuid.UUID) -> None:
        assert self.ledger.get(op_id).state is S.WORKING, self.ledger.get(op_id)

    def events(self, op_id: uuid.UUID) -> list[str]:
        return [e["kind"] for e in self.ledger.events(op_id)]


def receipts(ledger: Ledger, op_id: uuid.UUID) -> int:
    with ledger.engine.begin() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM terminal_receipt WHERE op_id = :id"), {"id": op_id}
        ).scalar_one()
    return int(count)


def big_result(size: int) -> dict[str, Any]:
    """A CallToolResult of about ``size`` bytes of JSON."""
    return {"content": [{"type": "text", "text": "r" * size}], "isError": False}


@pytest.fixture
def parts(database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path) -> dict[str, Any]:
    return {"database_url": database_url, "broker_prefix": broker_prefix, "tmp": tmp_path, "logs": log_dir}


def runtime_for(parts: dict[str, Any], config: Path, settings: dict[str, Any]) -> Runtime:
    return in_process_runtime(parts["database_url"], parts["broker_prefix"], config, lease_s=30, **settings)


@contextmanager
def mcp_rig(parts: dict[str, Any], **settings: Any) -> Iterator[tuple[McpServer, Rig]]:
    """longcall's MCP 2025-11-25 server (tasks poll every 200 ms) and an in-process executor."""
    mcp = start_mcp_server(parts["logs"], poll_interval_ms=200)
    config = parts["tmp"] / "longcall-mcp.toml"
    config.write_text(fleet_config(mcp.url, poll_qps=5000, control_qps=5000))
    runtime = in_process_runtime(
        parts["database_url"], parts["broker_prefix"], config, lease_s=30, **settings
    )
    try:
        yield mcp, Rig(Executor(runtime), "reports")
    finally:
        runtime.close()
        mcp.process.stop()


@contextmanager
def ext_rig(parts: dict[str, Any], **settings: Any) -> Iterator[tuple[McpServer, Rig]]:
    """longcall's MCP tasks extension (2026-07-28) demo server and an in-process executor."""
    demo = start_ext_demo_server(parts["logs"])
    config = parts["tmp"] / "longcall-ext.toml"
    config.write_text(ext_config(demo.url, poll_qps=5000, control_qps=5000))
    runtime = in_process_runtime(
        parts["database_url"], parts["broker_prefix"], config, lease_s=30, **settings
    )
    try:
        yield demo, Rig(Executor(runtime), EXT_SERVER)
    finally:
        runtime.close()
        demo.process.stop()


@contextmanager
def aip_rig(parts: dict[str, Any], **settings: Any) -> Iterator[tuple[AipServer, Rig]]:
    """longcall's AIP-151 demo server and an in-process executor."""
    aip = start_aip_server(parts["logs"])
    config = parts["tmp"] / "longcall-aip.toml"
    config.write_text(aip_config(aip.root, poll_qps=5000, control_qps=5000))
    runtime = in_process_runtime(
        parts["database_url"], parts["broker_prefix"], config, lease_s=30, **settings
    )
    try:
        yield aip, Rig(Executor(runtime), AIP_SERVER)
    finally:
        runtime.close()
        aip.stop()


def mcp_methods(mcp: McpServer, method: str) -> int:
    return sum(1 for entry in mcp.log() if entry["method"] == method)


def ext_log(demo: McpServer) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = httpx2.get(f"{demo.control}/log", timeout=5).json()["entries"]
    return entries


def ext_tasks(demo: McpServer) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = httpx2.get(f"{demo.control}/tasks", timeout=5).json()["tasks"]
    return tasks


def wait_done_on_server(mcp: McpServer, tool: str = "slow_report") -> None:
    support.wait_for(
        "the task to end on the server",
        lambda: all(t["status"] in ("completed", "failed") for t in mcp.tasks() if t["tool"] == tool) or None,
        timeout=20,
    )


def unstorable_record(rig: Rig, op_id: uuid.UUID, max_result_bytes: int) -> dict[str, Any]:
    assert rig.ledger.get(op_id).state is S.MANUAL_RECONCILIATION
    records = rig.ledger.reconciliations_for(op_id)
    assert [r.reason for r in records] == [ReconciliationReason.RESULT_UNSTORABLE], records
    detail: dict[str, Any] = dict(records[0].detail)
    assert "too large" in detail["why"], detail
    assert detail["max_result_bytes"] == max_result_bytes, detail
    assert detail["more_than_bytes"] >= max_result_bytes, detail
    assert receipts(rig.ledger, op_id) == 0
    return detail


# ------------------------------------------------------------------------------- item 1: too large


def test_a_result_over_the_old_4_mib_transport_cap_but_within_max_result_bytes_is_accepted(
    parts: dict[str, Any],
) -> None:
    """A 5 MiB result, under the default ``max_result_bytes`` (8 MiB): read once and accepted. Before:
    the transport refused every answer over 4 MiB, so it was fetched again every second, for ever."""
    with mcp_rig(parts) as (mcp, rig):
        mcp.faults(result_payload=big_result(5 * MIB))
        op_id = rig.submit("n/five-mib", "slow_report", {"seconds": 0.2})
        wait_done_on_server(mcp)
        rig.run_until(op_id, S.ACCEPTED, S.MANUAL_RECONCILIATION, steps=10)
        op = rig.ledger.get(op_id)
        assert op.state is S.ACCEPTED, rig.ledger.reconciliations_for(op_id)
        assert len(op.result["content"][0]["text"]) == 5 * MIB
        assert mcp_methods(mcp, "tasks/result") == 1
        assert "result_failed" not in rig.events(op_id)


def test_an_mcp_result_over_max_result_bytes_goes_to_an_operator_at_its_first_read(
    parts: dict[str, Any],
) -> None:
    """``tasks/result`` answers 5 MiB with ``max_result_bytes`` at 1 MiB: one read, refused at the
    transport's cap (the limit plus its envelope margin), and RESULT_UNSTORABLE with the size. Before: the
    4 MiB cap refused it as a protocol violation, read again every second."""
    with mcp_rig(parts, max_result_bytes=MIB) as (mcp, rig):
        mcp.faults(result_payload=big_result(5 * MIB))
        op_id = rig.submit("n/over-size", "slow_report", {"seconds": 0.2})
        wait_done_on_server(mcp)
        rig.run_until(op_id, S.MANUAL_RECONCILIATION, S.ACCEPTED, steps=10)
        unstorable_record(rig, op_id, MIB)
        assert mcp_methods(mcp, "tasks/result") == 1
        assert "result_failed" not in rig.events(op_id)


def test_an_mcp_tasks_extension_result_over_size_inline_in_tasks_get_goes_to_an_operator(
    parts: dict[str, Any],
) -> None:
    """The extension carries the result inline in ``tasks/get``: the poll's read of the completed task is
    the one over size, and it sends the operation to an operator at once. Before: the poll failed and was
    tried again every second until the wait deadline."""
    with ext_rig(parts, max_result_bytes=MIB) as (demo, rig):
        httpx2.post(f"{demo.control}/faults", json={"result_payload": big_result(5 * MIB)}, timeout=5)
        op_id = rig.submit("n/ext-over-size", "slow_report", {"seconds": 0.3})
        rig.working(op_id)
        support.wait_for(
            "the task to complete on the server",
            lambda: all(t["status"] == "completed" for t in ext_tasks(demo)) or None,
            timeout=20,
        )
        gets_before = sum(1 for e in ext_log(demo) if e["method"] == "tasks/get")
        rig.run_until(op_id, S.MANUAL_RECONCILIATION, S.ACCEPTED, steps=10)
        unstorable_record(rig, op_id, MIB)
        assert sum(1 for e in ext_log(demo) if e["method"] == "tasks/get") == gets_before + 1
        assert "poll_failed" not in rig.events(op_id)


def test_an_aip151_done_operation_over_size_goes_to_an_operator_at_the_first_poll(
    parts: dict[str, Any],
) -> None:
    """The done Operation of GetOperation carries a 5 MiB response with ``max_result_bytes`` at 1 MiB: the
    first poll that reads it sends the operation to an operator. Before: the poll failed and was retried
    every second (a control token, a download and an event row each time)."""
    with aip_rig(parts, max_result_bytes=MIB) as (aip, rig):
        aip.faults(response_padding_bytes=5 * MIB)
        op_id = rig.submit("n/aip-over-size", AIP_TOOL, args(seconds=0.3))
        rig.working(op_id)
        support.wait_for(
            "the operation to be done on the server",
            lambda: all(o.get("done") for o in aip.operations()["operations"]) or None,
            timeout=20,
        )
        reads_before = sum(1 for e in aip.log() if e["rpc"] == "GetOperation")
        rig.run_until(op_id, S.MANUAL_RECONCILIATION, S.ACCEPTED, steps=10)
        unstorable_record(rig, op_id, MIB)
        assert sum(1 for e in aip.log() if e["rpc"] == "GetOperation") == reads_before + 1
        assert "poll_failed" not in rig.events(op_id)


def test_an_aip151_done_operation_under_max_result_bytes_is_accepted(parts: dict[str, Any]) -> None:
    """The same padding under the limit (512 KiB of 1 MiB): the poll reads it and it is accepted."""
    with aip_rig(parts, max_result_bytes=MIB) as (aip, rig):
        aip.faults(response_padding_bytes=512 * 1024)
        op_id = rig.submit("n/aip-in-size", AIP_TOOL, args(seconds=0.2))
        support.wait_for(
            "the operation to be done on the server",
            lambda: all(o.get("done") for o in aip.operations()["operations"]) or None,
            timeout=20,
        )
        rig.run_until(op_id, S.ACCEPTED, S.MANUAL_RECONCILIATION, steps=10)
        op = rig.ledger.get(op_id)
        assert op.state is S.ACCEPTED, rig.ledger.reconciliations_for(op_id)
        assert len(op.result["response"]["padding"]) == 512 * 1024


# ------------------------------------------------------------------ item 2: an error that never changes


def test_the_same_protocol_violation_from_every_result_read_goes_to_an_operator_within_its_tries(
    parts: dict[str, Any],
) -> None:
    """Every ``tasks/result`` answer is the same unparsable body: after ``MAX_SAME_VIOLATIONS`` reads,
    RESULT_UNREADABLE with the last error and the count (before: read again every second, for ever)."""
    with mcp_rig(parts) as (mcp, rig):
        mcp.faults(malformed_result=10_000)
        op_id = rig.submit("n/malformed", "slow_report", {"seconds": 0.2})
        wait_done_on_server(mcp)
        rig.run_until(op_id, S.MANUAL_RECONCILIATION, S.ACCEPTED)
        records = rig.ledger.reconciliations_for(op_id)
        assert [r.reason for r in records] == [ReconciliationReason.RESULT_UNREADABLE], records
        detail = records[0].detail
        assert detail["failures"] == MAX_SAME_VIOLATIONS, detail
        assert detail["error"].startswith("ProtocolViolation"), detail
        assert detail["observed_terminal"] == "completed"
        assert mcp_methods(mcp, "tasks/result") == MAX_SAME_VIOLATIONS
        assert receipts(rig.ledger, op_id) == 0


def test_a_result_read_that_keeps_failing_goes_to_an_operator_after_result_retry_s(
    parts: dict[str, Any],
) -> None:
    """Every ``tasks/result`` connection is closed unanswered (a failure that decides nothing, each time):
    past ``result_retry_s`` (2 s here) since the first failure, RESULT_UNREADABLE with the last error, the
    count and the time (before: retried for ever)."""
    with mcp_rig(parts, result_retry_s=2.0) as (mcp, rig):
        mcp.faults(drop_result=10_000)
        op_id = rig.submit("n/dropped-always", "slow_report", {"seconds": 0.2})
        wait_done_on_server(mcp)

        def handed_over() -> bool:
            if rig.ledger.get(op_id).state in (S.TERMINAL_OBSERVED, S.FETCHING_RESULT, S.WORKING):
                rig.step(op_id)
            return rig.ledger.get(op_id).state is S.MANUAL_RECONCILIATION

        support.wait_for("the hand-over to an operator", handed_over, timeout=30, interval=0.3)
        records = rig.ledger.reconciliations_for(op_id)
        assert [r.reason for r in records] == [ReconciliationReason.RESULT_UNREADABLE], records
        detail = records[0].detail
        assert detail["failures"] >= 2, detail
        assert detail["for_s"] >= 2.0, detail
        assert detail["result_retry_s"] == 2.0
        assert "Transient" in detail["error"], detail
        assert receipts(rig.ledger, op_id) == 0


def test_a_result_read_that_fails_a_few_times_is_still_read_again_and_accepted(
    parts: dict[str, Any],
) -> None:
    """Two dropped reads and one unparsable answer, then the whole result: accepted (the bound ends a
    failure that never changes, not one that passes)."""
    with mcp_rig(parts) as (mcp, rig):
        mcp.faults(drop_result=2, malformed_result=MAX_SAME_VIOLATIONS - 1)
        op_id = rig.submit("n/dropped-twice", "slow_report", {"seconds": 0.2})
        wait_done_on_server(mcp)
        rig.run_until(op_id, S.ACCEPTED, S.MANUAL_RECONCILIATION)
        assert rig.ledger.get(op_id).state is S.ACCEPTED, rig.ledger.reconciliations_for(op_id)
        assert rig.events(op_id).count("result_failed") == 2 + MAX_SAME_VIOLATIONS - 1


def _set_session(ledger: Ledger, op_id: uuid.UUID, session_ref: str | None) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET session_ref = :session WHERE id = :id"),
            {"session": session_ref, "id": op_id},
        )


def test_a_cancel_whose_status_reads_are_refused_goes_to_an_operator_after_the_refusals_in_a_row(
    parts: dict[str, Any],
) -> None:
    """MCP 2025-11-25, the task's session lost from the row: the cancel and every status read after it are
    refused ("400 Missing session ID"). After ``MAX_POLL_REJECTIONS`` refused reads in a row the operation
    goes to an operator (PROTOCOL_VIOLATION, the refusal in the record), the cancel sent once; before, the
    cancel and its read were sent again every second until the wait deadline (an hour by default)."""
    with mcp_rig(parts) as (mcp, rig):
        op_id = rig.submit("n/cancel-refused-reads", "slow_report", {"seconds": 600})
        rig.working(op_id)
        _set_session(rig.ledger, op_id, None)
        first = rig.executor.request_cancel(op_id).action
        actions = [first, *rig.run_until(op_id, S.MANUAL_RECONCILIATION, S.CANCELLED_ACCEPTED)]
        assert actions[-1] == "manual_reconciliation", actions
        records = rig.ledger.reconciliations_for(op_id)
        assert [r.reason for r in records] == [ReconciliationReason.PROTOCOL_VIOLATION], records
        detail = records[0].detail
        assert detail["rejections"] == MAX_POLL_REJECTIONS, detail
        assert detail["http_status"] == 400
        assert "Missing session ID" in detail["error"]
        assert detail["cancel_answer"] == "refused"
        assert mcp_methods(mcp, "tasks/cancel") == 1
        assert mcp_methods(mcp, "tasks/get") == MAX_POLL_REJECTIONS


def test_an_aip151_cancel_whose_status_reads_are_refused_goes_to_an_operator(parts: dict[str, Any]) -> None:
    """AIP-151: the cancel is acknowledged, then every GetOperation is refused PERMISSION_DENIED: an
    operator after ``MAX_POLL_REJECTIONS`` refused reads in a row, one CancelOperation sent."""
    with aip_rig(parts) as (aip, rig):
        op_id = rig.submit("n/aip-cancel-refused-reads", AIP_TOOL, args(seconds=600))
        rig.working(op_id)
        aip.faults(refuse={"GetOperation": {"count": 10_000, "status": "PERMISSION_DENIED"}})
        first = rig.executor.request_cancel(op_id).action
        actions = [first, *rig.run_until(op_id, S.MANUAL_RECONCILIATION, S.CANCELLED_ACCEPTED)]
        assert actions[-1] == "manual_reconciliation", actions
        records = rig.ledger.reconciliations_for(op_id)
        assert [r.reason for r in records] == [ReconciliationReason.PROTOCOL_VIOLATION], records
        detail = records[0].detail
        assert detail["rejections"] == MAX_POLL_REJECTIONS, detail
        assert detail["http_status"] == 403
        assert detail["cancel_answer"] == "acknowledged"
        assert sum(1 for e in aip.log() if e["rpc"] == "CancelOperation") == 1
        refused = [e for e in aip.log() if e["rpc"] == "GetOperation" and e["status"] == 403]
        assert len(refused) == MAX_POLL_REJECTIONS


def test_an_aip151_done_operation_with_the_same_malformed_response_goes_to_an_operator(
    parts: dict[str, Any],
) -> None:
    """AIP-151's result is read by the poll (the done Operation): a done Operation whose response is not an
    Any object, the same every time, sends the operation to an operator (PROTOCOL_VIOLATION, the error in
    the record) after ``MAX_SAME_VIOLATIONS`` reads in a row; before, it was polled every second until the
    wait deadline (an hour by default)."""
    with aip_rig(parts) as (aip, rig):
        aip.faults(malformed_response=True)
        op_id = rig.submit("n/aip-malformed", AIP_TOOL, args(seconds=0.2))
        support.wait_for(
            "the operation to be done on the server",
            lambda: all(o.get("done") for o in aip.operations()["operations"]) or None,
            timeout=20,
        )
        reads_before = sum(1 for e in aip.log() if e["rpc"] == "GetOperation")
        actions = rig.run_until(op_id, S.MANUAL_RECONCILIATION, S.ACCEPTED)
        assert actions == ["poll_failed"] * (MAX_SAME_VIOLATIONS - 1) + ["manual_reconciliation"], actions
        records = rig.ledger.reconciliations_for(op_id)
        assert [r.reason for r in records] == [ReconciliationReason.PROTOCOL_VIOLATION], records
        detail = records[0].detail
        assert detail["violations"] == MAX_SAME_VIOLATIONS, detail
        assert "not an Any object" in detail["error"], detail
        assert sum(1 for e in aip.log() if e["rpc"] == "GetOperation") == reads_before + MAX_SAME_VIOLATIONS
        assert receipts(rig.ledger, op_id) == 0


def test_a_protocol_violation_short_of_the_bound_is_read_past_and_the_result_accepted(
    parts: dict[str, Any],
) -> None:
    """The malformed done Operation one read short of the bound, then the server answers it whole: the poll
    reads past the passing fault and the operation ends ACCEPTED, no operator."""
    with aip_rig(parts) as (aip, rig):
        aip.faults(malformed_response=True)
        op_id = rig.submit("n/aip-malformed-passing", AIP_TOOL, args(seconds=0.2))
        support.wait_for(
            "the operation to be done on the server",
            lambda: all(o.get("done") for o in aip.operations()["operations"]) or None,
            timeout=20,
        )
        assert [rig.step(op_id) for _ in range(MAX_SAME_VIOLATIONS - 1)] == ["poll_failed"] * (
            MAX_SAME_VIOLATIONS - 1
        )
        aip.faults(malformed_response=False)
        rig.run_until(op_id, S.ACCEPTED, S.MANUAL_RECONCILIATION, steps=5)
        assert rig.ledger.get(op_id).state is S.ACCEPTED, rig.ledger.reconciliations_for(op_id)
        assert rig.ledger.reconciliations_for(op_id) == []
