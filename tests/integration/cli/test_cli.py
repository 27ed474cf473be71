"""The ``longcall`` command against a real ledger: migrate, status, reconcile, watch, and clear refusals."""

from __future__ import annotations

import json
import uuid

import click
import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, inspect, text

from console import output as cli_output
from console.common import EXIT_REFUSED, EXIT_TIMEOUT
from console.main import main
from ledger.engine import normalize_database_url
from ledger.reasons import ReconciliationReason
from ledger.records import Fence
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests.support.ledger_rows import evidence_for, place
from workers import __version__


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_migrate_creates_the_database_and_its_tables(
    monkeypatch: pytest.MonkeyPatch, empty_database_url: str
) -> None:
    monkeypatch.setenv("LONGCALL_DATABASE_URL", empty_database_url)
    code, output = run("migrate")
    assert code == 0, output
    assert "at head" in output
    engine = create_engine(normalize_database_url(empty_database_url))
    assert "terminal_receipt" in inspect(engine).get_table_names()
    engine.dispose()


def test_status_by_op_id_call_node_and_remote_id(cli_env: None, ledger: Ledger) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    for ref in (str(op.id), str(op.submission_key), op.call_node_id, f"reports:{op.remote_id}"):
        code, output = run("status", ref, "--json", "--events")
        assert code == 0, output
        data = json.loads(output)
        assert (data["op_id"], data["state"]) == (str(op.id), "ACCEPTED")
        assert data["receipt"]["terminal_state"] == "completed"
        assert data["events"][-1]["kind"] == "terminal_accepted"
    code, output = run("status", "no-such-node")
    assert code == 1
    assert (
        "no operation with op id, submission key, call node id or SERVER:REMOTE_ID 'no-such-node'" in output
    )


def test_reconcile_lists_and_resolves_with_evidence(cli_env: None, ledger: Ledger) -> None:
    op = place(ledger, OpState.SUBMISSION_UNKNOWN)
    ledger.hand_to_operator(
        op.id,
        Fence(op.execution_epoch, op.cancel_generation),
        from_state=OpState.SUBMISSION_UNKNOWN,
        reason=ReconciliationReason.SUBMISSION_UNKNOWN,
        detail={},
        deadline_s=3600,
    )
    code, output = run("reconcile", "--json")
    assert code == 0, output
    [record] = json.loads(output)
    assert (record["op_id"], record["reason"]) == (str(op.id), "SUBMISSION_UNKNOWN")

    code, output = run("reconcile", str(op.id), "--found", "task-abc")
    assert code == 2
    assert "needs --evidence" in output
    # MCP 2025-11-25 reads a task on the session that created it, and none is recorded: it is named.
    code, output = run("reconcile", str(op.id), "--found", "task-abc", "--evidence", "x")
    assert code == 1
    assert "give --session" in output
    code, output = run(
        "reconcile",
        str(op.id),
        "--found",
        "task-abc",
        "--session",
        "session-1",
        "--evidence",
        "seen in the server's tasks/list",
    )
    assert code == 0, output
    after = ledger.get(op.id)
    assert (after.state, after.remote_id, after.session_ref) == (OpState.WORKING, "task-abc", "session-1")
    assert ledger.open_reconciliations() == []
    [closed] = ledger.reconciliations_for(op.id)
    assert "seen in the server's tasks/list" in (closed.resolution or "")

    code, output = run("reconcile", str(op.id), "--never-created", "--evidence", "x")
    assert code == 1
    assert "not waiting for an operator" in output


def test_watch_ends_when_the_operation_is_final(cli_env: None, ledger: Ledger) -> None:
    op = place(ledger, OpState.CANCEL_REQUESTED)
    ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.CANCELLED))
    code, output = run("watch", op.call_node_id, "--json", "--timeout", "5")
    assert code == 0, output
    kinds = [json.loads(line)["kind"] for line in output.splitlines() if line.startswith("{")]
    assert kinds[-1] == "terminal_accepted"


def test_a_command_that_needs_a_worker_says_so_when_none_answers(cli_env: None, ledger: Ledger) -> None:
    op = place(ledger, OpState.WORKING)
    code, output = run("cancel", str(op.id), "--timeout", "1")
    assert code == EXIT_TIMEOUT
    assert "no longcall worker answered within 1s" in output
    code, output = run("status", str(uuid.uuid4()))
    assert code == 1


def test_rollback_closes_admission_and_bumps_the_epoch_rollout_reopens(cli_env: None, ledger: Ledger) -> None:
    code, output = run("rollback", "--json")
    assert code == 0, output
    assert json.loads(output) == {
        "execution_epoch": 2,
        "admission_open": False,
        "disabled_adapters": [],
        "rollout": {},
        # Rule 13 as amended: the new epoch is owned by this environment's executor identity (the default).
        "epoch_owner": f"longcall/{__version__}",
    }
    code, output = run("rollout")
    assert (code, "admission open; execution epoch 2" in output) == (0, True)
    with ledger.engine.connect() as conn:
        actions = [
            r.action for r in conn.exec_driver_sql("SELECT action FROM executor_control_audit ORDER BY id")
        ]
    assert actions == ["set_admission", "bump_epoch", "set_admission"]


def test_adapters_can_be_disabled_for_new_operations_and_listed(cli_env: None, ledger: Ledger) -> None:
    place(ledger, OpState.WORKING)
    code, output = run("adapters", "--disable", "mcp/2025-11-25", "--json")
    assert code == 0, output
    rows = {row["adapter"]: row for row in json.loads(output)}
    assert rows["mcp/2025-11-25"] == {"adapter": "mcp/2025-11-25", "disabled": True, "in_flight": 1}
    assert ledger.control().disabled_adapters == ("mcp/2025-11-25",)
    code, output = run("adapters", "--disable", "grpc/1")
    assert code == 2
    assert "no adapter 'grpc/1'" in output
    code, output = run("adapters", "--enable", "mcp/2025-11-25", "--json")
    assert {row["adapter"]: row["disabled"] for row in json.loads(output)}["mcp/2025-11-25"] is False


def test_inputs_lists_what_waits_for_input(cli_env: None, ledger: Ledger) -> None:
    op = place(ledger, OpState.INPUT_REQUIRED)
    code, output = run("inputs", "--json")
    assert code == 0, output
    [row] = json.loads(output)
    assert (row["op_id"], row["input_round"], row["method"]) == (str(op.id), 1, "elicitation/create")


def test_result_prints_the_receipts_result_and_refuses_without_a_receipt(
    cli_env: None, ledger: Ledger
) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    code, output = run("result", op.call_node_id)
    assert code == EXIT_REFUSED
    assert f"operation {op.id} has no receipt yet: it is FETCHING_RESULT" in output
    evidence = evidence_for(
        op, TerminalKind.COMPLETED, result={"content": [{"type": "text", "text": "é 42"}]}
    )
    ledger.accept_terminal(op.id, evidence)
    for ref in (str(op.id), op.call_node_id):
        code, output = run("result", ref, "--json")
        assert code == 0, output
        assert json.loads(output) == evidence.result
    code, output = run("result", op.call_node_id)
    assert code == 0, output
    assert "completed" in output
    assert str(evidence.result_digest) in output
    assert '"text": "é 42"' in output  # pretty-printed, as is
    code, output = run("result", "no-such-node")
    assert code == EXIT_REFUSED
    assert "no operation with op id" in output


def test_a_cancelled_operation_has_a_receipt_and_no_result(cli_env: None, ledger: Ledger) -> None:
    op = place(ledger, OpState.CANCEL_REQUESTED)
    ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.CANCELLED))
    code, output = run("result", op.call_node_id, "--json")
    assert (code, json.loads(output)) == (0, None)
    code, output = run("result", op.call_node_id)
    assert "cancelled" in output
    assert "(no result)" in output


#: The commands that only read (no decision, no message to a worker), with the arguments each needs here.
READS: dict[str, list[str]] = {
    "status": ["{call_node}"],
    "watch": ["{call_node}", "--timeout", "1"],
    "result": ["{call_node}"],
    "inputs": [],
    "gate": [],
    "reconcile": [],
    "adapters": [],
}


def test_every_command_has_help_and_every_read_prints_json(cli_env: None, ledger: Ledger) -> None:
    for name, command in main.commands.items():
        assert (command.help or "").strip(), f"{name} has no help text"
        code, output = run(name, "--help")
        assert code == 0, (name, output)
        assert "Usage:" in output
        if name in READS:
            assert any(isinstance(p, click.Option) and "--json" in p.opts for p in command.params), name
    code, output = run("--help")
    assert "Exit codes: 0 ok; 1 refused" in " ".join(output.split())
    op = place(ledger, OpState.INPUT_REQUIRED)
    done = place(ledger, OpState.FETCHING_RESULT)
    ledger.accept_terminal(done.id, evidence_for(done, TerminalKind.COMPLETED))
    for name, args in READS.items():
        ref = done.call_node_id if name in ("result", "watch", "status") else op.call_node_id
        code, output = run(name, *(a.format(call_node=ref) for a in args), "--json")
        # The launch gate fails here (no simulation run yet: no evidence) and says so with exit code 1.
        assert code == (EXIT_REFUSED if name == "gate" else 0), (name, output)
        if name == "watch":  # one JSON object per line
            assert [json.loads(line) for line in output.splitlines()], name
        else:
            json.loads(output)


def test_inputs_shows_round_deadline_and_the_servers_question(cli_env: None, ledger: Ledger) -> None:
    op = place(ledger, OpState.INPUT_REQUIRED)
    request = {"method": "elicitation/create", "params": {"message": "Ship it?", "requestedSchema": {}}}
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET input_request = CAST(:r AS jsonb) WHERE id = :id"),
            {"r": json.dumps(request), "id": op.id},
        )
    code, output = run("inputs", "--json")
    assert code == 0, output
    [row] = json.loads(output)
    assert (row["op_id"], row["input_round"], row["unreadable"]) == (str(op.id), 1, False)
    assert row["deadline"] is not None
    assert row["request"] == request["params"]
    code, output = run("inputs")
    assert code == 0, output
    assert "Ship it?" in output
    assert "longcall input OP --round N" in output
    # A round of several requests (the MCP tasks extension's inputRequests): each key with its question.
    several = {
        "a": {"method": "elicitation/create", "params": {"message": "Approve the budget?"}},
        "b": {"method": "sampling/createMessage", "params": {"messages": []}},
    }
    asked = cli_output.question(several, "tasks/input_response")
    assert asked == "a: Approve the budget?; b: sampling/createMessage"
