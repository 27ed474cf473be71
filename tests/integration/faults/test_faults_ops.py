"""Operations hardening (issue 8, items 15-18): bounded growth of the ledger, credentials, reconciliation
deadlines, and bad input refused at the boundary.

Real Postgres and Redis, longcall's MCP server with its fault switches, in-process executors (each one a
'worker' with its own pools) where a step is driven a thousand times, and a real fleet (worker processes,
beat, a pipeline worker) where beat's own schedule is the point. Every wait is bounded.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from console.main import main as cli_main
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.fleet import (
    FleetParts,
    McpServer,
    fleet_config,
    in_process_runtime,
    running_fleet,
    start_mcp_server,
)
from tests.support.ledger_rows import evidence_for, place
from workers import logs
from workers.executor import Executor
from workers.runtime import Runtime
from workers.submission import validate_submission

S = OpState

MakeExecutor = Callable[..., Executor]


@pytest.fixture
def in_process(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> Iterator[tuple[McpServer, MakeExecutor]]:
    """A running MCP server and a factory of in-process executors, each on a server config of its own
    (``make(poll_qps=...)``) and its own runtime, all on this test's ledger and broker prefix."""
    mcp = start_mcp_server(log_dir, poll_interval_ms=200)
    made: list[Runtime] = []

    def make(settings: dict[str, Any] | None = None, **server: Any) -> Executor:
        config = tmp_path / f"longcall-{len(made)}.toml"
        config.write_text(fleet_config(mcp.url, **server))
        runtime = in_process_runtime(
            database_url, broker_prefix, config, **{"lease_s": 30, **(settings or {})}
        )
        made.append(runtime)
        return Executor(runtime)

    try:
        yield mcp, make
    finally:
        for runtime in made:
            runtime.close()
        mcp.process.stop()


def submitted(executor: Executor, call_node_id: str, tool: str, arguments: dict[str, Any]) -> uuid.UUID:
    """Submit through the executor as ``longcall.submit`` does: the create call is made at once."""
    new = validate_submission(
        {"call_node_id": call_node_id, "server": "reports", "tool": tool, "arguments": arguments},
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )
    submission, step = executor.submit(new)
    assert step is not None
    assert step.action == "created", step
    return submission.operation.id


def event_count(ledger: Ledger, op_id: uuid.UUID) -> int:
    return len(ledger.events(op_id))


def test_an_in_process_step_leaves_no_operation_bound_in_its_callers_log_context(
    in_process: tuple[McpServer, MakeExecutor],
) -> None:
    """A step notes the operation it works on so that its log lines name it; run in process (a simulation,
    a test, an embedding application), it leaves the caller's log context as it found it: the next line
    the caller logs names no operation (in CI a later test's log lines carried this one's op id)."""
    _mcp, make = in_process
    executor = make()
    assert logs.current() == (None, None)
    op_id = submitted(executor, "n/bound", "slow_report", {"seconds": 30})
    assert logs.current() == (None, None)
    executor.advance(op_id, executor.ledger.get(op_id).poll_cursor)
    executor.request_cancel(op_id)
    assert logs.current() == (None, None)


# ------------------------------------------------------------------------------ 15. bounded growth


def test_a_thousand_unchanged_polls_and_missing_tokens_add_a_handful_of_event_rows(
    in_process: tuple[McpServer, MakeExecutor],
) -> None:
    """Each poll is a real ``tasks/get`` to the server and a guarded write; an answer that changes nothing
    (same server state, message and interval) and a missing token are counted on the row, not written as
    events. A poll that does change something still writes its ``polled`` event."""
    _mcp, make = in_process
    executor = make(poll_qps=5000)
    ledger = executor.ledger
    op_id = submitted(executor, "n/growth", "slow_report", {"seconds": 600})
    before = event_count(ledger, op_id)

    actions: Counter[str] = Counter()
    for _ in range(1000):
        claim = ledger.claim(op_id, lease_s=30)
        assert claim is not None
        actions[executor.advance(op_id, claim.poll_cursor).action] += 1
    assert actions == {"still_working": 1000}, actions
    added = event_count(ledger, op_id) - before
    assert added <= 3, f"1000 unchanged polls added {added} event rows"

    # The same server's poll budget, now tiny: almost every step finds no token and is rescheduled.
    starved = make(poll_qps=0.01)
    starved_actions: Counter[str] = Counter()
    for _ in range(200):
        claim = ledger.claim(op_id, lease_s=30)
        assert claim is not None
        starved_actions[starved.advance(op_id, claim.poll_cursor).action] += 1
    assert starved_actions["no_token"] >= 199, starved_actions
    added = event_count(ledger, op_id) - before
    assert added <= 5, f"1000 unchanged polls and 200 missing tokens added {added} event rows"

    op = ledger.get(op_id)
    kinds = Counter(e["kind"] for e in ledger.events(op_id))
    assert op.unchanged_polls + kinds["polled"] == 1000 + starved_actions["still_working"]
    assert op.no_token_count == starved_actions["no_token"]
    assert op.last_polled_at is not None
    assert op.state is S.WORKING


def test_a_poll_that_changes_something_still_writes_its_event(ledger: Ledger) -> None:
    """Only an unchanged answer is quiet: a new server state, message or interval is an event."""
    from ledger.records import ServerStatus  # noqa: PLC0415 - this test alone drives the move directly

    op = place(ledger, S.WORKING)
    moves = [
        ServerStatus("working", None, 200),
        ServerStatus("working", None, 200),  # unchanged: counted
        ServerStatus("working", "half way", 200),
        ServerStatus("working", "half way", 500),
        ServerStatus("working", "half way", 500),  # unchanged: counted
    ]
    for status in moves:
        op = ledger.record_poll(op.id, op.fence, state=S.WORKING, status=status, next_poll_in_s=1)
    polled = [e for e in ledger.events(op.id) if e["kind"] == "polled"]
    assert len(polled) == 3
    assert op.unchanged_polls == 2
    assert (op.server_state, op.status_message, op.poll_interval_ms) == ("working", "half way", 500)


def _age(ledger: Ledger, op_id: uuid.UUID, days: float) -> None:
    """Make every event of the operation, and its dispatched outbox rows, ``days`` old."""
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE operation_event SET at = now() - make_interval(secs => :s) WHERE op_id = :id"),
            {"s": days * 86_400, "id": op_id},
        )
        conn.execute(
            text(
                "UPDATE outbox SET dispatched_at = now() - make_interval(secs => :s) "
                "WHERE op_id = :id AND status = 'dispatched'"
            ),
            {"s": days * 86_400, "id": op_id},
        )


def _dispatch_all(ledger: Ledger) -> None:
    ledger.drain_outbox(lambda _message: None, limit=1000)


def test_retention_deletes_exactly_the_old_events_and_dispatched_outbox_rows_of_final_operations(
    ledger: Ledger,
) -> None:
    old_final = place(ledger, S.FETCHING_RESULT)
    assert ledger.accept_terminal(old_final.id, evidence_for(old_final, TerminalKind.COMPLETED)).accepted
    young_final = place(ledger, S.FETCHING_RESULT)
    assert ledger.accept_terminal(young_final.id, evidence_for(young_final, TerminalKind.COMPLETED)).accepted
    old_open = place(ledger, S.WORKING)
    _dispatch_all(ledger)
    # A final operation with a ready (not yet delivered) outbox row: never purged, however old.
    undelivered = place(ledger, S.FETCHING_RESULT)
    assert ledger.accept_terminal(undelivered.id, evidence_for(undelivered, TerminalKind.COMPLETED)).accepted
    for op in (old_final, old_open, undelivered):
        _age(ledger, op.id, days=40)
    _age(ledger, young_final.id, days=2)

    purged = ledger.purge_history(event_retention_s=30 * 86_400, outbox_retention_s=7 * 86_400)

    assert event_count(ledger, old_final.id) == 0
    assert event_count(ledger, young_final.id) > 0
    assert event_count(ledger, old_open.id) == ledger.get(old_open.id).event_seq  # every one kept
    assert event_count(ledger, undelivered.id) == 0  # its events are old and the operation final
    with ledger.engine.begin() as conn:
        outbox = {row.op_id: row.status for row in conn.execute(text("SELECT op_id, status FROM outbox"))}
    assert outbox == {young_final.id: "dispatched", undelivered.id: "ready"}
    assert purged.outbox_rows == 1
    assert purged.events == ledger.get(old_final.id).event_seq + ledger.get(undelivered.id).event_seq
    # The operation row and its terminal receipt stay forever.
    for op in (old_final, young_final, undelivered):
        assert ledger.get(op.id).state is S.ACCEPTED
        assert ledger.receipt_for(op.id) is not None


def test_beat_runs_the_retention_on_a_live_fleet(fleet_parts: FleetParts) -> None:
    """Through beat's own schedule (``longcall.reconcile``): a final operation's events and its dispatched
    outbox row go once older than their retention; an operation still running keeps every event."""
    env = {
        "LONGCALL_EVENT_RETENTION_S": "2",
        "LONGCALL_OUTBOX_RETENTION_S": "2",
        "LONGCALL_RECONCILE_INTERVAL_S": "0.5",
    }
    with running_fleet(fleet_parts, env=env) as fleet:
        running = fleet.submit("n/still-running", "slow_report", {"seconds": 120})
        done = fleet.submit("n/done", "slow_report", {"seconds": 0.2})
        fleet.wait_receipt("n/done")
        support.wait_for(
            "the final operation's events and outbox row to be purged",
            lambda: event_count(fleet.ledger, done) == 0 and _outbox_rows(fleet.ledger, done) == 0,
            timeout=60,
        )
        op = fleet.ledger.get(running)
        assert op.state is S.WORKING
        assert op.created_at < dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)
        seqs = [e["seq"] for e in fleet.ledger.events(running)]
        assert seqs == list(range(1, op.event_seq + 1))
        assert fleet.ledger.get(done).state is S.ACCEPTED
        assert fleet.ledger.receipt_for(done) is not None


def _outbox_rows(ledger: Ledger, op_id: uuid.UUID) -> int:
    with ledger.engine.begin() as conn:
        return int(
            conn.execute(text("SELECT count(*) FROM outbox WHERE op_id = :id"), {"id": op_id}).scalar_one()
        )


# ------------------------------------------------------------------- 17. reconciliation deadlines


def _cli(monkeypatch: pytest.MonkeyPatch, executor: Executor, *args: str) -> str:
    settings = executor.rt.settings
    monkeypatch.setenv("LONGCALL_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("LONGCALL_CONFIG", str(settings.config))
    result = CliRunner().invoke(cli_main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_reconciliation_deadlines_default_to_the_seeds_gate_and_overdue_records_are_flagged(
    in_process: tuple[McpServer, MakeExecutor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create whose answer is lost goes to an operator (MCP has no lookup by key) with the seed's gate
    as its deadline: resolved within 15 minutes unless configured otherwise. ``longcall reconcile`` marks
    a record past its deadline, in the table and in ``--json``."""
    mcp, make = in_process
    executor = make()
    assert executor.rt.settings.reconcile_deadline_s == 900
    mcp.faults(lose_create_response=1)
    new = validate_submission(
        {
            "call_node_id": "n/unknown",
            "server": "reports",
            "tool": "slow_report",
            "arguments": {"seconds": 60},
        },
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )
    submission, _step = executor.submit(new)
    op_id = submission.operation.id
    assert executor.ledger.get(op_id).state is S.MANUAL_RECONCILIATION
    [record] = executor.ledger.reconciliations_for(op_id)
    assert record.deadline - record.opened_at == dt.timedelta(minutes=15)

    [listed] = json.loads(_cli(monkeypatch, executor, "reconcile", "--json"))
    assert (listed["id"], listed["overdue"]) == (record.id, False)
    assert "OVERDUE" not in _cli(monkeypatch, executor, "reconcile")

    with executor.ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE reconciliation SET deadline = now() - interval '1 s' WHERE id = :id"),
            {"id": record.id},
        )
    [listed] = json.loads(_cli(monkeypatch, executor, "reconcile", "--json"))
    assert (listed["id"], listed["overdue"]) == (record.id, True)
    assert "OVERDUE" in _cli(monkeypatch, executor, "reconcile")

    # Configurable: the same path with LONGCALL_RECONCILE_DEADLINE_S = 60.
    quick = make({"reconcile_deadline_s": 60})
    mcp.faults(lose_create_response=1)
    other, _step = quick.submit(
        validate_submission(
            {"call_node_id": "n/unknown2", "server": "reports", "tool": "slow_report", "arguments": {}},
            quick.rt.fleet,
            max_body_bytes=quick.rt.settings.max_body_bytes,
        )
    )
    [record] = quick.ledger.reconciliations_for(other.operation.id)
    assert record.deadline - record.opened_at == dt.timedelta(seconds=60)


def test_a_late_completion_after_an_accepted_cancel_gets_the_configured_deadline(ledger: Ledger) -> None:
    """EFFECT_RECONCILIATION_REQUIRED (rule 6) is opened by the acceptance point itself: its deadline is
    the ledger's configured one too (the seed's gate by default), not a fixed day."""
    quick = Ledger(ledger.engine, reconcile_deadline_s=120)
    op = place(quick, S.CANCEL_REQUESTED)
    assert quick.accept_terminal(op.id, evidence_for(op, TerminalKind.CANCELLED)).accepted
    late = quick.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert late.outcome == "effect_reconciliation"
    [record] = quick.reconciliations_for(op.id)
    assert record.reason.value == "EFFECT_RECONCILIATION_REQUIRED"
    assert record.deadline - record.opened_at == dt.timedelta(seconds=120)
    assert Ledger(ledger.engine).reconcile_deadline == dt.timedelta(minutes=15)


# --------------------------------------------------------------------------- 18. bad input at the boundary


def test_bad_input_at_the_boundary_is_refused_by_the_workers_and_writes_nothing(
    fleet_parts: FleetParts,
) -> None:
    """Through real workers: an input reply over ``LONGCALL_MAX_BODY_BYTES`` is refused with a clear error and
    nothing recorded (a reply within the limit then goes through); a downstream signature whose countdown
    outlasts the Redis broker's visibility timeout is refused at submit, before any row exists."""
    with running_fleet(fleet_parts, env={"LONGCALL_MAX_BODY_BYTES": "4096"}) as fleet:
        op_id = fleet.submit("n/ask", "ask_approval", {"question": "Deploy?"})
        op = fleet.wait_state(op_id, S.INPUT_REQUIRED, timeout=60)
        before = fleet.ledger.events(op_id)
        big = {"action": "accept", "content": {"approved": True, "note": "x" * 5000}}
        with pytest.raises(Exception, match="LONGCALL_MAX_BODY_BYTES"):
            fleet.send("longcall.provide_input", op_id=str(op_id), input_round=op.input_round, response=big)
        assert fleet.ledger.events(op_id) == before
        assert fleet.ledger.get(op_id).state is S.INPUT_REQUIRED
        assert "notifications/elicitation" not in [e["method"] for e in fleet.mcp.log()]

        fine = {"action": "accept", "content": {"approved": True}}
        fleet.send("longcall.provide_input", op_id=str(op_id), input_round=op.input_round, response=fine)
        assert fleet.wait_receipt("n/ask", timeout=60)["terminal_state"] == "completed"

        late = dict(fleet.pipeline.signature("pipeline.record", queue="pipeline", countdown=2 * 3600))
        with pytest.raises(Exception, match="visibility timeout"):
            fleet.send(
                "longcall.submit",
                call_node_id="n/late-callback",
                server="reports",
                tool="slow_report",
                arguments={"seconds": 1},
                on_terminal=late,
            )
        assert fleet.ledger.find_by_call_node("n/late-callback") is None


# ------------------------------------------------------------------------------------ 16. credentials

PASSWORD = "pw-s3cret-7Qx"


def test_a_rotated_token_works_without_a_restart_and_a_url_password_never_shows(
    fleet_parts: FleetParts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bearer token is read per request (``auth_file``: a file the operator, or a secret mount,
    rewrites; ``auth_env`` is read per request too): the server starts requiring a new token between two
    operations and the same worker processes go on with it. The server URL carries user:password: it is
    never written to events, receipts, the CLI's output or the workers' logs."""
    token = fleet_parts.tmp_path / "reports.token"
    token.write_text("token-A\n")
    with running_fleet(
        fleet_parts,
        server={"auth_file": str(token)},
        url_userinfo=f"lc-user:{PASSWORD}",
    ) as fleet:
        fleet.mcp.faults(require_bearer="token-A")
        first = fleet.submit("n/before-rotation", "slow_report", {"seconds": 0.2})
        assert fleet.wait_receipt("n/before-rotation", timeout=60)["terminal_state"] == "completed"

        token.write_text("token-B\n")
        fleet.mcp.faults(require_bearer="token-B")
        second = fleet.submit("n/after-rotation", "slow_report", {"seconds": 0.2})
        assert fleet.wait_receipt("n/after-rotation", timeout=60)["terminal_state"] == "completed"

        monkeypatch.setenv("LONGCALL_DATABASE_URL", fleet.env["LONGCALL_DATABASE_URL"])
        monkeypatch.setenv("LONGCALL_CONFIG", fleet.env["LONGCALL_CONFIG"])
        written = json.dumps(
            [fleet.ledger.events(op_id) for op_id in (first, second)] + fleet.deliveries(), default=str
        )
        status = CliRunner().invoke(cli_main, ["status", str(second), "--json", "--events"])
        assert status.exit_code == 0, status.output
        logs = "".join(p.log() for p in fleet.processes)
    for where, text_ in (("the ledger or the deliveries", written), ("longcall status", status.output)):
        assert PASSWORD not in text_, f"the URL's password shows in {where}"
    leaked = [line for line in logs.splitlines() if PASSWORD in line]
    assert not leaked, f"the URL's password shows in the logs: {leaked[:3]}"
