"""Issue 22, item 3: ``longcall.cancel`` by the pipeline's own call node id. A pipeline knows its call node
ids, not longcall's op ids; and it may send a cancel as it submits, so the cancel can be taken before the
submission is: the intent is then recorded for the call node, and its submission ends cancelled, never
created. Never lost to the order two messages were taken in.

Real processes (longcall's MCP server, longcall workers, beat, a pipeline worker), real Postgres and Redis.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest
from sqlalchemy import text

from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet
from tests.support.ledger_rows import new_operation
from workers.rollout import in_canary

S = OpState


def test_a_cancel_by_call_node_before_its_submission_ends_it_cancelled_with_no_create(fleet: Fleet) -> None:
    answer = fleet.send("longcall.cancel", call_node_id="n/early-cancel")
    assert answer["op_id"] is None
    assert (answer["action"], answer["call_node_id"]) == ("cancel_recorded", "n/early-cancel")

    op_id = fleet.submit("n/early-cancel", "slow_report", {"seconds": 60})
    receipt = fleet.wait_receipt("n/early-cancel", timeout=30)
    assert (receipt["terminal_state"], receipt["op_id"], receipt["result"]) == ("cancelled", str(op_id), None)
    assert "tools/call" not in [e["method"] for e in fleet.mcp.log()]
    assert fleet.mcp.tasks() == []
    op = fleet.ledger.get(op_id)
    assert (op.state, op.cancel_generation) == (S.CANCELLED_ACCEPTED, 1)
    kinds = [e["kind"] for e in fleet.ledger.events(op_id)]
    assert kinds[:2] == ["submitted", "cancel_requested"], kinds
    # The intent was taken by the submission: nothing is left for the call node.
    with fleet.ledger.engine.begin() as conn:
        left = conn.execute(text("SELECT count(*) FROM call_node_cancel")).scalar_one()
    assert left == 0


def test_a_cancel_by_call_node_id_cancels_its_operation_on_the_server(fleet: Fleet) -> None:
    fleet.submit_nowait("n/cancel-by-node", "slow_report", {"seconds": 60})
    op = fleet.wait_operation("n/cancel-by-node", S.WORKING)

    answer = fleet.send("longcall.cancel", call_node_id="n/cancel-by-node")
    assert answer["op_id"] == str(op.id)
    receipt = fleet.wait_receipt("n/cancel-by-node", timeout=30)
    assert receipt["terminal_state"] == "cancelled"
    [task] = fleet.mcp.tasks()
    assert task["status"] == "cancelled"
    # A second cancel of the call node changes nothing: its outcome stands.
    again = fleet.send("longcall.cancel", call_node_id="n/cancel-by-node")
    assert again["op_id"] == str(op.id)
    assert fleet.ledger.get(op.id).state is S.CANCELLED_ACCEPTED


def test_the_operator_cancels_a_call_node_not_submitted_yet(fleet: Fleet) -> None:
    answer = subprocess.run(
        [sys.executable, "-m", "console", "cancel", "--call-node", "n/cli-early", "--json"],
        cwd=support.REPO,
        env=support.celery_env(fleet.env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert answer.returncode == 0, answer.stderr + answer.stdout
    assert json.loads(answer.stdout)["action"] == "cancel_recorded"
    fleet.submit("n/cli-early", "slow_report", {"seconds": 60})
    assert fleet.wait_receipt("n/cli-early", timeout=30)["terminal_state"] == "cancelled"
    assert "tools/call" not in [e["method"] for e in fleet.mcp.log()]


def test_a_cancel_of_a_call_node_outside_the_canary_says_so_and_records_nothing(fleet: Fleet) -> None:
    """A call node answered "not routed" runs on the caller's legacy path, for good (its decision is kept):
    longcall has nothing of it to cancel, and an intent recorded for its next submission would never be
    taken. The cancel says so (before, it answered ``cancel_recorded``: an intent that waits for nothing)."""
    fleet.ledger.set_canary_percent(5, actor="test", reason="canary")
    node = next(f"canary/{i}" for i in range(400) if not in_canary(f"canary/{i}", 5))
    answer = fleet.send(
        "longcall.submit", call_node_id=node, server="reports", tool="quick_lookup", arguments={}
    )
    assert answer["routed"] is False

    cancelled = fleet.send("longcall.cancel", call_node_id=node)
    assert (cancelled["op_id"], cancelled["call_node_id"], cancelled["action"]) == (None, node, "not_routed")
    assert "canary" in cancelled["detail"]["why"]
    with fleet.ledger.engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM call_node_cancel")).scalar_one() == 0
    assert fleet.ledger.find_by_call_node(node) is None

    # A call node the canary has not decided yet (never submitted) still gets its intent recorded.
    fresh = next(f"canary/{i}" for i in range(400, 800) if not in_canary(f"canary/{i}", 5))
    assert fleet.send("longcall.cancel", call_node_id=fresh)["action"] == "cancel_recorded"


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({}, "op_id or call_node_id"),
    ({"op_id": "00000000-0000-0000-0000-000000000001", "call_node_id": "n/x"}, "op_id or call_node_id"),
    ({"call_node_id": "n/x", "cursor": 3}, "a cursor with an op_id only"),
    ({"call_node_id": "  "}, "call_node_id must not be empty"),
    ({"call_node_id": 7}, "call_node_id must be a string"),
]


def test_a_cancel_without_one_clear_target_is_refused_with_its_reason(fleet: Fleet) -> None:
    for kwargs, reason in REFUSED:
        with pytest.raises(Exception, match=reason) as refused:
            fleet.send("longcall.cancel", **kwargs)
        assert type(refused.value).__name__ == "RequestRefused", kwargs
    with fleet.ledger.engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM call_node_cancel")).scalar_one() == 0


def test_a_cancel_and_a_submission_of_one_call_node_at_once_never_lose_the_cancel(ledger: Ledger) -> None:
    """Both at the same instant, many times: either the cancel finds the operation (and records the intent
    on it, as a cancel by op id does), or the operation is born with the intent. Never neither."""
    for index in range(40):
        node = f"n/race-{index}"
        start = threading.Barrier(2)
        found: list[object] = []

        def cancel(node: str = node, start: threading.Barrier = start, found: list[object] = found) -> None:
            start.wait(timeout=10)
            found.append(ledger.cancel_call_node(node))

        canceller = threading.Thread(target=cancel)
        canceller.start()
        start.wait(timeout=10)
        submission = ledger.record_submission(new_operation(node), lease_s=30)
        canceller.join(timeout=10)
        assert not canceller.is_alive()
        [seen] = found
        born_cancelled = submission.operation.cancel_generation == 1
        assert (seen is not None) != born_cancelled, (index, seen, submission.operation.cancel_generation)
        if seen is not None:
            assert seen.id == submission.operation.id  # type: ignore[attr-defined]
    with ledger.engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM call_node_cancel")).scalar_one() == 0
