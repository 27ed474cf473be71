"""Issue 19, item 12: operator commands cannot hide an operation, and probing a server is charged to its
budget.

- ``longcall reconcile --close ID`` is refused while record ID is what holds its operation in
  MANUAL_RECONCILIATION (the operation's last open record: closing it would leave the operation waiting
  for an operator with nothing in ``longcall reconcile`` to say so); another open record of the same
  operation may be closed, and resolving the operation closes its records.
- ``longcall reconcile OP --never-created`` is refused when the ledger knows a remote id for OP.
- ``longcall adapters --detect`` takes a control token for every request it sends to a server (rule 4),
  and says so, sending nothing, when none is available.

The command runs in this process (``CliRunner``) against a real ledger, Redis and longcall's MCP server.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import text

from console.common import EXIT_REFUSED
from console.main import main
from ledger.reasons import ReconciliationReason
from ledger.records import Operation
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.fleet import McpServer, fleet_config, in_process_runtime, run_due, start_mcp_server
from tests.support.ledger_rows import place
from workers.budget import rate_key
from workers.executor import Executor
from workers.hot import HotState

S = OpState


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, database_url: str, broker_prefix: str, tmp_path: Path) -> Path:
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config("http://127.0.0.1:9/mcp"))
    monkeypatch.setenv("LONGCALL_DATABASE_URL", database_url)
    monkeypatch.setenv("LONGCALL_REDIS_URL", support.REDIS_URL)
    monkeypatch.setenv("LONGCALL_BROKER_KEYPREFIX", broker_prefix)
    monkeypatch.setenv("LONGCALL_CONFIG", str(config))
    return config


def with_operator(ledger: Ledger, state: OpState, reason: ReconciliationReason) -> Operation:
    op = place(ledger, state)
    return ledger.hand_to_operator(
        op.id, op.fence, from_state=state, reason=reason, detail={"why": "test"}, deadline_s=3600
    )


# ------------------------------------------------------------------------------------- reconcile --close


def test_closing_the_record_that_holds_an_operation_with_an_operator_is_refused(
    cli_env: Path, ledger: Ledger
) -> None:
    op = with_operator(ledger, S.SUBMISSION_UNKNOWN, ReconciliationReason.SUBMISSION_UNKNOWN)
    [held_by] = ledger.open_reconciliations()

    code, output = run("reconcile", "--close", str(held_by.id), "--evidence", "looked at it")
    assert code == EXIT_REFUSED, output
    said = " ".join(output.split())
    assert f"record {held_by.id} holds operation {op.id} in MANUAL_RECONCILIATION" in said
    assert f"resolve the operation instead: longcall reconcile {op.id} --found" in said
    assert [r.id for r in ledger.open_reconciliations()] == [held_by.id]  # nothing was closed
    code, output = run("reconcile", "--json")
    assert [r["op_id"] for r in json.loads(output)] == [str(op.id)]  # still listed for an operator

    # A second record on the same operation: either may be closed while the other still holds it.
    second = ledger.open_reconciliation(
        op.id, ReconciliationReason.SERVER_UNCONFIGURED, deadline=held_by.deadline - held_by.opened_at
    )
    code, output = run("reconcile", "--close", str(held_by.id), "--evidence", "the other record covers it")
    assert code == 0, output
    code, output = run("reconcile", "--close", str(second.id), "--evidence", "x")
    assert code == EXIT_REFUSED, output
    assert [r.id for r in ledger.open_reconciliations()] == [second.id]

    # Resolving the operation closes what held it.
    code, output = run(
        "reconcile", str(op.id), "--found", "task-1", "--session", "", "--evidence", "listed by the server"
    )
    assert code == 0, output
    assert ledger.get(op.id).state is S.WORKING
    assert ledger.open_reconciliations() == []


def test_a_record_of_an_operation_no_longer_with_an_operator_may_be_closed(
    cli_env: Path, ledger: Ledger
) -> None:
    """A record opened beside a final operation (a late completion after an accepted cancel) holds nothing:
    the operator closes it once dealt with."""
    op = place(ledger, S.ACCEPTED)
    record = ledger.open_reconciliation(
        op.id, ReconciliationReason.EFFECT_RECONCILIATION_REQUIRED, deadline=dt.timedelta(hours=1)
    )
    code, output = run("reconcile", "--close", str(record.id), "--evidence", "effect undone by hand")
    assert code == 0, output
    assert ledger.open_reconciliations() == []
    code, output = run("reconcile", "--close", str(record.id), "--evidence", "again")
    assert code == EXIT_REFUSED
    assert f"no open reconciliation record {record.id}" in output


# ------------------------------------------------------------------------------ reconcile --never-created


def test_never_created_is_refused_when_the_ledger_knows_a_remote_id(cli_env: Path, ledger: Ledger) -> None:
    op = with_operator(ledger, S.WORKING, ReconciliationReason.UNKNOWN_NOT_FOUND)
    assert op.remote_id is not None
    code, output = run("reconcile", str(op.id), "--never-created", "--evidence", "not in tasks/list")
    assert code == EXIT_REFUSED, output
    said = " ".join(output.split())
    assert f"the ledger knows remote id {op.remote_id} for operation {op.id}" in said
    after = ledger.get(op.id)
    assert (after.state, after.submit_attempted_at) == (S.MANUAL_RECONCILIATION, op.submit_attempted_at)
    assert "resolved_never_created" not in [e["kind"] for e in ledger.events(op.id)]

    # Without a remote id (the create's answer was lost) the operator's proof is taken.
    lost = with_operator(ledger, S.SUBMISSION_UNKNOWN, ReconciliationReason.SUBMISSION_UNKNOWN)
    code, output = run("reconcile", str(lost.id), "--never-created", "--evidence", "server's audit log")
    assert code == 0, output
    assert ledger.get(lost.id).state is S.SUBMITTING


def test_found_naming_another_remote_operation_is_refused_and_writes_nothing(
    cli_env: Path, ledger: Ledger
) -> None:
    """``--found ID`` where ID is another operation's on the same server, or not the remote id the ledger
    knows for this one: refused with the reason (before: a database error's traceback for the first, and
    for the second the known remote operation silently replaced, left running untracked)."""
    lost = with_operator(ledger, S.SUBMISSION_UNKNOWN, ReconciliationReason.SUBMISSION_UNKNOWN)
    other = place(ledger, S.WORKING)
    assert other.remote_id is not None
    code, output = run(
        "reconcile", str(lost.id), "--found", other.remote_id, "--session", "", "--evidence", "in tasks/list"
    )
    assert code == EXIT_REFUSED, output
    said = " ".join(output.split())
    assert f"remote id {other.remote_id} on {other.server} is operation {other.id}'s" in said
    assert ledger.get(lost.id).state is S.MANUAL_RECONCILIATION

    known = with_operator(ledger, S.WORKING, ReconciliationReason.UNKNOWN_NOT_FOUND)
    code, output = run(
        "reconcile",
        str(known.id),
        "--found",
        "task-elsewhere",
        "--session",
        "",
        "--evidence",
        "in tasks/list",
    )
    assert code == EXIT_REFUSED, output
    said = " ".join(output.split())
    assert f"the ledger knows remote id {known.remote_id} for operation {known.id}" in said
    after = ledger.get(known.id)
    assert (after.state, after.remote_id) == (S.MANUAL_RECONCILIATION, known.remote_id)

    # The remote id the ledger knows is taken.
    code, output = run(
        "reconcile", str(known.id), "--found", str(known.remote_id), "--session", "", "--evidence", "listed"
    )
    assert code == 0, output
    assert ledger.get(known.id).state is S.WORKING


def test_what_waits_for_an_operator_is_listed_by_any_name_of_its_operation(
    cli_env: Path, ledger: Ledger
) -> None:
    """``longcall reconcile REF`` takes REF as every command does (before, only a whole op id: by a call node
    id or an op id prefix it said "nothing waits for an operator" while a record was open)."""
    op = with_operator(ledger, S.SUBMISSION_UNKNOWN, ReconciliationReason.SUBMISSION_UNKNOWN)
    for ref in (str(op.id), op.call_node_id, str(op.id)[:8]):
        code, output = run("reconcile", ref, "--json")
        assert code == 0, output
        assert [r["op_id"] for r in json.loads(output)] == [str(op.id)], ref
    code, output = run("reconcile", "no-such-call-node", "--json")
    assert code != 0
    assert "no-such-call-node" in output


def answered_synchronously_unstorable(ledger: Ledger) -> Operation:
    """A synchronous call (no task: no remote id) whose answer came but could not be stored: held as nothing
    and handed to an operator (RESULT_UNSTORABLE), as ``workers.steps.submit._answered_at_once`` leaves it."""
    op = place(ledger, S.FETCHING_RESULT)
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE tool_operation SET remote_id = NULL WHERE id = :id"), {"id": op.id})
    op = ledger.get(op.id)
    assert (op.remote_id, op.observed_terminal) == (None, TerminalKind.COMPLETED)
    return ledger.hand_to_operator(
        op.id,
        op.fence,
        from_state=S.FETCHING_RESULT,
        reason=ReconciliationReason.RESULT_UNSTORABLE,
        detail={"why": "too large"},
        deadline_s=3600,
    )


def test_never_created_is_refused_when_the_server_answered_the_create(cli_env: Path, ledger: Ledger) -> None:
    """The tool ran (its synchronous answer was seen, though it could not be stored): a resubmission would
    run it a second time. Refused, naming what the ledger saw (before, it was taken: no remote id)."""
    op = answered_synchronously_unstorable(ledger)
    code, output = run("reconcile", str(op.id), "--never-created", "--evidence", "no task on the server")
    assert code == EXIT_REFUSED, output
    said = " ".join(output.split())
    assert f"the server answered the create of operation {op.id}" in said
    assert ledger.get(op.id).state is S.MANUAL_RECONCILIATION
    assert "resolved_never_created" not in [e["kind"] for e in ledger.events(op.id)]


def test_an_operation_with_no_remote_id_can_be_ended_failed_with_the_operators_evidence(
    cli_env: Path, ledger: Ledger, database_url: str, broker_prefix: str
) -> None:
    """Without a remote id there is no result to fetch: ``--terminal completed`` is refused, saying what can
    be done; ``--terminal failed`` ends it failed, its error the operator's evidence (before, both were
    refused and the operation had no way out but ``--never-created``, which runs the tool again)."""
    op = answered_synchronously_unstorable(ledger)
    code, output = run("reconcile", str(op.id), "--terminal", "completed", "--evidence", "ran, 40 MB out")
    assert code == EXIT_REFUSED, output
    assert "--terminal failed" in " ".join(output.split())
    assert ledger.get(op.id).state is S.MANUAL_RECONCILIATION

    code, output = run("reconcile", str(op.id), "--terminal", "failed", "--evidence", "result too large")
    assert code == 0, output
    assert ledger.get(op.id).state is S.TERMINAL_OBSERVED  # the dispatcher's next tick accepts it
    runtime = in_process_runtime(database_url, broker_prefix, cli_env)
    try:
        [step] = run_due(Executor(runtime))
    finally:
        runtime.close()
    assert (step.op_id, step.action) == (op.id, "accepted"), step
    after = ledger.get(op.id)
    assert after.state is S.ACCEPTED
    receipt = ledger.receipt_for(op.id)
    assert receipt is not None
    assert receipt.terminal_state is TerminalKind.FAILED
    assert after.result is not None
    assert after.result["isError"] is True
    assert "result too large" in after.result["error"]["message"]
    assert ledger.open_reconciliations() == []


# ----------------------------------------------------------------------------------- adapters --detect


@pytest.fixture
def mcp(log_dir: Path) -> Iterator[McpServer]:
    server = start_mcp_server(log_dir)
    try:
        yield server
    finally:
        server.process.stop()


def detect_config(cli_env: Path, mcp: McpServer) -> None:
    cli_env.write_text(fleet_config(mcp.url, poll_qps=50, control_qps=50))


def http_log(mcp: McpServer) -> list[dict[str, object]]:
    entries: list[dict[str, object]] = httpx2.get(f"{mcp.control}/http_log", timeout=5).json()["entries"]
    return entries


def test_adapters_detect_charges_every_request_to_the_servers_control_budget(
    cli_env: Path, ledger: Ledger, mcp: McpServer, broker_prefix: str, redis_client: redis.Redis
) -> None:
    detect_config(cli_env, mcp)
    started = int(time.time())
    code, output = run("adapters", "--detect", "--json")
    assert code == 0, output
    [server] = json.loads(output)["servers"]
    assert (server["server"], server["generation"]) == ("reports", "2025-11-25")
    sent = http_log(mcp)
    assert sent, "the probe sent nothing"
    assert [e["budget"] for e in sent] == ["control"] * len(sent)  # each request names its budget
    counted = sum(
        int(redis_client.get(rate_key(f"{broker_prefix}longcall:", "reports", "control", second)) or 0)
        for second in range(started, int(time.time()) + 1)
    )
    assert counted == len(sent)  # and each was counted where longcall metrics reads the request rates


def test_adapters_detect_sends_nothing_and_says_so_without_a_control_token(
    cli_env: Path, ledger: Ledger, mcp: McpServer, broker_prefix: str, redis_client: redis.Redis
) -> None:
    detect_config(cli_env, mcp)
    # The server asked for a wait (as a 429's Retry-After would): no token, on either bucket, until then.
    HotState(redis_client, prefix=f"{broker_prefix}longcall:").hold("reports", 60)
    code, output = run("adapters", "--detect")
    assert code == 0, output
    said = " ".join(output.split())
    assert "reports: not probed: no control token" in said
    assert http_log(mcp) == []
    code, output = run("adapters", "--detect", "--json")
    [server] = json.loads(output)["servers"]
    assert (server["server"], server["generation"], server["probed"]) == ("reports", "unknown", False)
    assert "no control token" in server["detail"]
    assert http_log(mcp) == []
