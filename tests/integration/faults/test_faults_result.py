"""The result path under faults (issue 8, items 1 and 3): a completed task is never receipted ``failed``, and
the result a consumer receives is the one stored and digested.

Real processes (longcall's MCP server with its ``result_error`` / ``result_payload`` switches, longcall
workers, beat, a pipeline worker that imports nothing of longcall), real Postgres and Redis. Every wait is
bounded (``support.wait_for``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx2
from sqlalchemy import text

from ledger.digests import digest
from ledger.reasons import ReconciliationReason
from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet

S = OpState


def kinds(ledger: Ledger, op_id: uuid.UUID) -> list[str]:
    return [e["kind"] for e in ledger.events(op_id)]


def receipt_rows(ledger: Ledger, op_id: uuid.UUID) -> int:
    with ledger.engine.begin() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM terminal_receipt WHERE op_id = :id"), {"id": op_id}
        ).scalar_one()
    return int(count)


def result_reads(fleet: Fleet) -> int:
    return sum(1 for entry in fleet.mcp.log() if entry["method"] == "tasks/result")


def set_payload(fleet: Fleet, payload: Any) -> None:
    """``result_payload``, sent as Python's JSON (NaN written as NaN, as a lenient server would send it)."""
    httpx2.post(
        f"{fleet.mcp.control}/faults",
        content=json.dumps({"result_payload": payload}),
        headers={"content-type": "application/json"},
        timeout=5,
    ).raise_for_status()


def submit_checked(fleet: Fleet, call_node_id: str, seconds: float = 0.1) -> uuid.UUID:
    """A slow_report whose receipt goes to ``pipeline.check_digest`` (the consumer's recipe, recomputed)."""
    answer = fleet.send(
        "longcall.submit",
        call_node_id=call_node_id,
        server="reports",
        tool="slow_report",
        arguments={"seconds": seconds},
        on_terminal=dict(fleet.pipeline.signature("pipeline.check_digest", queue="pipeline")),
    )
    return uuid.UUID(answer["op_id"])


# ---- item 1: a completed task is never receipted failed ------------------------------------------------


def test_an_error_from_tasks_result_after_completed_is_retried_and_the_real_result_accepted(
    fleet: Fleet,
) -> None:
    """tasks/get says completed; the first two tasks/result answers are -32603 (a transient store error).
    Before: the first -32603 became a *failed* receipt. Now it is read again, and the real result wins."""
    fleet.mcp.faults(result_error={"count": 2, "code": -32603})
    op_id = fleet.submit("n/contradicted-twice", "slow_report", {"seconds": 0.2})

    receipt = fleet.wait_receipt("n/contradicted-twice", timeout=60)

    assert receipt["terminal_state"] == "completed", receipt
    assert receipt["result"]["isError"] is False
    assert receipt["result"]["content"] == [{"type": "text", "text": "report ready after 0.2s"}]
    assert result_reads(fleet) >= 3  # two contradicted reads, then the whole result
    assert fleet.ledger.get(op_id).state is S.ACCEPTED
    assert kinds(fleet.ledger, op_id).count("result_contradicts_status") == 2
    assert "outcome_from_result" not in kinds(fleet.ledger, op_id)  # the outcome was never rewritten


def test_an_error_from_tasks_result_that_persists_after_completed_goes_to_an_operator(
    fleet_parts: FleetParts,
) -> None:
    """The contradiction lasts past ``LONGCALL_RESULT_CONTRADICTION_S``: MANUAL_RECONCILIATION with reason
    RESULT_CONTRADICTS_STATUS and the evidence; no receipt, nothing delivered."""
    env = {"LONGCALL_RESULT_CONTRADICTION_S": "2"}
    with running_fleet(fleet_parts, env=env) as fleet:
        fleet.mcp.faults(result_error={"count": 10_000, "code": -32603, "message": "store down"})
        op_id = fleet.submit("n/contradicted-always", "slow_report", {"seconds": 0.1})

        op = fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=60)

        records = fleet.ledger.reconciliations_for(op_id)
        assert [r.reason for r in records] == [ReconciliationReason.RESULT_CONTRADICTS_STATUS]
        assert records[0].resolved_at is None
        detail = records[0].detail
        assert detail["observed_terminal"] == "completed"
        assert detail["error"]["code"] == -32603
        assert detail["attempts"] >= 2
        assert op.observed_terminal is not None
        assert op.observed_terminal.value == "completed"
        assert receipt_rows(fleet.ledger, op_id) == 0
        assert fleet.receipts() == []


# ---- item 3: stored is what was fetched, delivered is what was digested ---------------------------------

AWKWARD = {
    "content": [{"type": "text", "text": "numbers"}],
    "structuredContent": {
        "big_float": 1e16,
        "negative_zero": -0.0,
        "huge": 1.5e300,
        "tiny": 1e-7,
        "round": 100.0,
        "two_to_64": 2**64,
        "two_to_70": 2**70,
        "nested": [{"x": 0.1, "y": [1.7976931348623157e308, -1e16, 5e-324]}, {"é": "\u2028 ok"}],
    },
    "isError": False,
}


def test_the_consumer_recomputes_the_receipt_digest_over_the_result_it_received(fleet: Fleet) -> None:
    """Floats that Postgres jsonb spells differently (1e16 comes back 10000000000000000, -0.0 comes back
    0.0) and big integers: the digest on the receipt, the digest the pipeline recomputes with the documented
    recipe over what it received, and the digest of the ledger's stored value are one and the same.
    Before: the receipt's digest was taken over the fetched value, not over what was stored and delivered."""
    set_payload(fleet, AWKWARD)
    op_id = submit_checked(fleet, "n/awkward-numbers")

    delivered = support.wait_for(
        "the checked delivery",
        lambda: next((d for d in fleet.deliveries() if "recomputed" in d), None),
        timeout=60,
    )

    receipt = delivered["kwargs"]["receipt"]
    assert receipt["terminal_state"] == "completed"
    assert delivered["recomputed"] == receipt["result_digest"], (receipt["result"], receipt["result_digest"])
    op = fleet.ledger.get(op_id)
    assert op.result_digest == receipt["result_digest"]
    assert digest(op.result) == receipt["result_digest"]
    stored = fleet.ledger.receipt_for(op_id)
    assert stored is not None
    assert stored.result_digest == receipt["result_digest"]
    # What arrived is the value as stored: 1e16 is the integer it is, big integers exact.
    numbers = receipt["result"]["structuredContent"]
    assert numbers["big_float"] == 10**16
    assert numbers["two_to_64"] == 2**64
    assert numbers["two_to_70"] == 2**70
    assert numbers["nested"][1] == {"é": "\u2028 ok"}


UNSTORABLE: list[tuple[str, Any, str]] = [
    ("nul", {"content": [{"type": "text", "text": "a\u0000b"}], "isError": False}, "not storable"),
    ("nan", {"content": [], "structuredContent": {"x": float("nan")}, "isError": False}, "not JSON"),
    ("infinity", {"content": [], "structuredContent": {"x": float("inf")}, "isError": False}, "not JSON"),
    (
        "kombu-marker",
        {"content": [], "structuredContent": {"__type__": "decimal", "__value__": "1.5"}, "isError": False},
        "Celery JSON",
    ),
    ("too-large", {"content": [{"type": "text", "text": "x" * 5000}], "isError": False}, "too large"),
]


def test_an_unstorable_or_too_large_result_ends_in_a_reconciliation_record_not_a_retry_loop(
    fleet_parts: FleetParts,
) -> None:
    """Each result Postgres jsonb or the Celery JSON serializer cannot carry exactly (a NUL character, NaN,
    an infinity, an object the serializer would decode into another type) or over
    ``LONGCALL_MAX_RESULT_BYTES``: MANUAL_RECONCILIATION with reason RESULT_UNSTORABLE, no receipt, and the
    event count stays put (before: the acceptance raised, and the step was retried for ever)."""
    with running_fleet(fleet_parts, env={"LONGCALL_MAX_RESULT_BYTES": "4000"}) as fleet:
        ops: dict[str, uuid.UUID] = {}
        for name, payload, _ in UNSTORABLE:
            set_payload(fleet, payload)
            ops[name] = submit_checked(fleet, f"n/unstorable-{name}")
            fleet.wait_state(ops[name], S.MANUAL_RECONCILIATION, timeout=60)

        counted = {name: len(kinds(fleet.ledger, op_id)) for name, op_id in ops.items()}
        # An observation window in which nothing may happen: twelve dispatch ticks, one lease time.
        time.sleep(3)
        for name, payload, why in UNSTORABLE:
            op_id = ops[name]
            records = fleet.ledger.reconciliations_for(op_id)
            assert [r.reason for r in records] == [ReconciliationReason.RESULT_UNSTORABLE], name
            assert records[0].resolved_at is None
            assert why in records[0].detail["why"], (name, records[0].detail)
            assert fleet.ledger.get(op_id).state is S.MANUAL_RECONCILIATION
            assert len(kinds(fleet.ledger, op_id)) == counted[name], name
            assert receipt_rows(fleet.ledger, op_id) == 0, name
            del payload
        assert fleet.receipts() == []


def _quick_lookup(fleet: Fleet, call_node_id: str, *, on_terminal: str) -> uuid.UUID:
    """``quick_lookup`` (a synchronous call, bound 5 s) submitted through the fleet, its receipt sent to the
    pipeline's task ``on_terminal``: the operation's id."""
    answer = fleet.send(
        "longcall.submit",
        call_node_id=call_node_id,
        server="reports",
        tool="quick_lookup",
        arguments={"key": "k1"},
        on_terminal=dict(fleet.pipeline.signature(on_terminal, queue="pipeline")),
    )
    return uuid.UUID(answer["op_id"])


def test_an_unstorable_result_of_a_synchronous_call_goes_to_an_operator_with_its_reason(
    fleet_parts: FleetParts,
) -> None:
    """A tool run as one synchronous call (no task) whose answer jsonb cannot hold: the create's own
    answer is not stored half-way nor the call repeated; an operator gets a RESULT_UNSTORABLE record
    (before: the hold of the result raised, the redelivered step found the attempt committed and called the
    outcome unknown: SUBMISSION_UNKNOWN, the wrong reason)."""
    with running_fleet(fleet_parts) as fleet:
        set_payload(fleet, UNSTORABLE[0][1])
        op_id = _quick_lookup(fleet, "n/sync-unstorable", on_terminal="pipeline.check_digest")
        fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=60)
        records = fleet.ledger.reconciliations_for(op_id)
        assert [r.reason for r in records] == [ReconciliationReason.RESULT_UNSTORABLE]
        assert "not storable" in records[0].detail["why"], records[0].detail
        assert receipt_rows(fleet.ledger, op_id) == 0
        assert [e["method"] for e in fleet.mcp.log()].count("tools/call") == 1
        assert fleet.ledger.get(op_id).remote_id is None


def test_a_call_whose_answer_is_dribbled_is_let_go_at_its_bound_not_when_the_server_is_done(
    fleet_parts: FleetParts,
) -> None:
    """A synchronous call (bound 5 s) whose server sends the answer a byte at a time, 0.1 s apart (each
    byte within any read timeout, the head alone some 30 s): the worker lets it go at the call's bound, as
    a call whose answer was lost (an operator decides; the call is not repeated). Before, the answer's head
    was read a byte at a time for as long as the server sent it (only the body was held to the bound): the
    worker process was held there, and nothing said why (a server dribbling every answer's head held every
    worker for as long as it liked)."""
    with running_fleet(fleet_parts) as fleet:
        fleet.mcp.faults(dribble_call_answer=1)
        started = time.monotonic()
        op_id = _quick_lookup(fleet, "n/sync-dribbled", on_terminal="pipeline.record")
        fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=20)
        assert time.monotonic() - started < 15  # the bound, 5 s, and the fleet's own; the head takes 30
        records = fleet.ledger.reconciliations_for(op_id)
        assert [r.reason for r in records] == [ReconciliationReason.SUBMISSION_UNKNOWN], records
        assert [e["method"] for e in fleet.mcp.log()].count("tools/call") == 1
