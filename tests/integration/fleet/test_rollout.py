"""Shadow mode, the canary and audited controls (issue 12): the real ledger, a real fleet, the CLI."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy.exc
from click.testing import CliRunner
from sqlalchemy import func, select, text

from console import fleet as cli
from console.common import EXIT_REFUSED, EXIT_USAGE
from console.launch_gate import Criterion, GateReport
from console.main import main
from ledger.digests import digest
from ledger.errors import LegacyOutcomeRefused
from ledger.records import Operation
from ledger.repository import Ledger
from ledger.shadow import LOCK_PREFIX
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet
from tests.support.ledger_rows import RESULT, evidence_for, place
from workers.rollout import in_canary

#: slow_report is marked side-effect-free (a TOML dotted key under [servers.reports]); quick_lookup is not.
SHADOW_TOOLS = {"tools.slow_report.side_effect_free": True}


def shadowed(ledger: Ledger, state: OpState) -> Operation:
    """An operation placed in ``state``, routed in shadow (setup only; no signatures, as admit makes it)."""
    op = place(ledger, state)
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE tool_operation SET routing = 'shadow', on_terminal = NULL, on_input = NULL "
                "WHERE id = :id"
            ),
            {"id": op.id},
        )
    return ledger.get(op.id)


def audit_rows(ledger: Ledger) -> list[Any]:
    with ledger.engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT actor, action, reason, before, after FROM executor_control_audit ORDER BY id")
            ).all()
        )


# ------------------------------------------------------------------------------------ the ledger alone


def test_a_shadow_operation_cannot_keep_a_downstream_signature(ledger: Ledger) -> None:
    op = place(ledger, OpState.WORKING)  # keeps the pipeline's on_terminal
    with (
        pytest.raises(sqlalchemy.exc.IntegrityError, match="shadow_never_delivered"),
        ledger.engine.begin() as conn,
    ):
        conn.execute(text("UPDATE tool_operation SET routing = 'shadow' WHERE id = :id"), {"id": op.id})


def test_legacy_first_then_receipt_compares_in_the_acceptance(ledger: Ledger) -> None:
    op = shadowed(ledger, OpState.FETCHING_RESULT)
    held, outcome = ledger.record_legacy_outcome(
        op.call_node_id, TerminalKind.COMPLETED, result_digest=digest(RESULT)
    )
    assert (outcome, held.diverged, held.compared_at) == ("recorded", None, None)
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert acceptance.accepted
    compared = ledger.shadow_comparison(op.call_node_id)
    assert compared is not None
    assert (compared.longcall_terminal_state, compared.longcall_result_digest, compared.diverged) == (
        TerminalKind.COMPLETED,
        digest(RESULT),
        False,
    )
    # The outbox row names no signature: nothing can be delivered downstream.
    with ledger.engine.connect() as conn:
        payload = conn.execute(
            text("SELECT payload FROM outbox WHERE op_id = :id"), {"id": op.id}
        ).scalar_one()
    assert payload["signature"] is None


def test_receipt_first_then_legacy_compares_and_any_difference_diverges(ledger: Ledger) -> None:
    same_state_other_digest = shadowed(ledger, OpState.FETCHING_RESULT)
    other_state = shadowed(ledger, OpState.FETCHING_RESULT)
    for op in (same_state_other_digest, other_state):
        assert ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED)).accepted
        assert ledger.shadow_comparison(op.call_node_id) is None  # nothing to compare with yet

    held, outcome = ledger.record_legacy_outcome(
        same_state_other_digest.call_node_id, TerminalKind.COMPLETED, result_digest=digest({"other": 1})
    )
    assert (outcome, held.diverged) == ("compared", True)
    held, outcome = ledger.record_legacy_outcome(other_state.call_node_id, TerminalKind.FAILED)
    assert (outcome, held.diverged, held.longcall_terminal_state) == (
        "compared",
        True,
        TerminalKind.COMPLETED,
    )
    # A redelivered message changes nothing; a different legacy outcome is refused.
    again, outcome = ledger.record_legacy_outcome(other_state.call_node_id, TerminalKind.FAILED)
    assert (outcome, again) == ("already_recorded", held)
    with pytest.raises(LegacyOutcomeRefused, match="has a legacy outcome already"):
        ledger.record_legacy_outcome(other_state.call_node_id, TerminalKind.COMPLETED)


def test_a_live_call_node_has_no_legacy_outcome(ledger: Ledger) -> None:
    op = place(ledger, OpState.WORKING)
    with pytest.raises(LegacyOutcomeRefused, match="routed live, not shadowed"):
        ledger.record_legacy_outcome(op.call_node_id, TerminalKind.COMPLETED)
    assert ledger.shadow_comparison(op.call_node_id) is None


def _waiting_on_a_lock(ledger: Ledger) -> int:
    with ledger.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        )


@pytest.mark.parametrize("legacy_state", [TerminalKind.COMPLETED, TerminalKind.FAILED])
def test_legacy_outcome_and_receipt_arriving_together_are_compared_once(
    ledger: Ledger, legacy_state: TerminalKind
) -> None:
    """Both sides start while the call node's lock is held elsewhere, so each one's read of the other side
    happens only after the other may have committed: neither is lost, whichever wins the lock."""
    op = shadowed(ledger, OpState.FETCHING_RESULT)
    errors: list[BaseException] = []

    def run(action: Any) -> None:
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread below
            errors.append(exc)

    holder = ledger.engine.connect()
    holder.begin()
    holder.execute(
        select(func.pg_advisory_xact_lock(func.hashtextextended(LOCK_PREFIX + op.call_node_id, 0)))
    )
    threads = [
        threading.Thread(
            target=run,
            args=(lambda: ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED)),),
        ),
        threading.Thread(
            target=run, args=(lambda: ledger.record_legacy_outcome(op.call_node_id, legacy_state),)
        ),
    ]
    try:
        for thread in threads:
            thread.start()
        support.wait_for(
            "both sides to wait for the call node's lock", lambda: _waiting_on_a_lock(ledger) >= 2, timeout=10
        )
    finally:
        holder.rollback()
        holder.close()
        for thread in threads:
            thread.join(timeout=10)
    assert not errors
    compared = ledger.shadow_comparison(op.call_node_id)
    assert compared is not None
    assert compared.compared_at is not None
    assert compared.longcall_terminal_state is TerminalKind.COMPLETED
    assert compared.diverged is (legacy_state is not TerminalKind.COMPLETED)


# ------------------------------------------------------------------------------------------- the fleet


@pytest.fixture
def shadow_fleet(fleet_parts: FleetParts) -> Iterator[Fleet]:
    with running_fleet(fleet_parts, server=SHADOW_TOOLS) as fleet:
        yield fleet


def test_shadow_runs_receipts_delivers_nothing_and_compares_with_legacy(shadow_fleet: Fleet) -> None:
    fleet = shadow_fleet
    fleet.ledger.set_shadow(on=True, actor="test", reason="compare before the canary")

    first = fleet.send(
        "longcall.submit",
        call_node_id="n/shadow-agrees",
        server="reports",
        tool="slow_report",
        arguments={"seconds": 2},
        on_terminal=dict(fleet.pipeline.signature("pipeline.record", queue="pipeline")),
        on_input=dict(fleet.pipeline.signature("pipeline.record", queue="pipeline")),
    )
    assert (first["routed"], first["routing"], first["reason"], first["created"]) == (
        False,
        "shadow",
        "shadow",
        True,
    )
    # Legacy first: recorded while longcall's operation still runs.
    recorded = fleet.send(
        "longcall.record_legacy_outcome", call_node_id="n/shadow-agrees", terminal_state="completed"
    )
    assert (recorded["outcome"], recorded["diverged"]) == ("recorded", None)
    assert fleet.ledger.receipt_for(fleet.wait_operation("n/shadow-agrees").id) is None

    fleet.submit("n/shadow-differs", "slow_report", {"seconds": 0.2, "fail": True})
    live = fleet.submit("n/live-lookup", "quick_lookup", {"key": "k1"})  # not side-effect-free: live

    agrees = fleet.wait_operation("n/shadow-agrees", OpState.ACCEPTED)
    differs = fleet.wait_operation("n/shadow-differs", OpState.ACCEPTED)
    assert (agrees.routing, differs.routing, fleet.ledger.get(live).routing) == ("shadow", "shadow", "live")
    assert (agrees.on_terminal, agrees.on_input) == (None, None)
    receipt = fleet.ledger.receipt_for(differs.id)
    assert receipt is not None
    assert receipt.terminal_state is TerminalKind.FAILED
    # Legacy after the receipt: compared at once.
    late = fleet.send(
        "longcall.record_legacy_outcome",
        call_node_id="n/shadow-differs",
        terminal_state="completed",
        result={"content": [{"type": "text", "text": "legacy report"}], "isError": False},
    )
    assert (late["outcome"], late["diverged"], late["longcall_terminal_state"]) == (
        "compared",
        True,
        "failed",
    )
    compared = support.wait_for(
        "the receipt to complete the first comparison",
        lambda: c if (c := fleet.ledger.shadow_comparison("n/shadow-agrees")) and c.compared_at else None,
    )
    assert (compared.diverged, compared.longcall_terminal_state) == (False, TerminalKind.COMPLETED)

    # Nothing of the shadow operations reached the pipeline; the live one did, once.
    assert fleet.wait_receipt("n/live-lookup")["terminal_state"] == "completed"
    support.wait_for("the outbox to drain", fleet.settled)
    assert [r["call_node_id"] for r in fleet.receipts()] == ["n/live-lookup"]
    assert fleet.input_requests() == []
    with fleet.ledger.engine.connect() as conn:
        statuses = conn.execute(
            text(
                "SELECT o.status, o.payload->'signature' FROM outbox o "
                "JOIN tool_operation t ON t.id = o.op_id WHERE t.routing = 'shadow'"
            )
        ).all()
    assert sorted(s for s, _ in statuses) == ["dispatched", "dispatched"]
    assert all(signature is None for _, signature in statuses)

    # Refusals at the boundary, and for a call node that runs live.
    with pytest.raises(Exception, match="terminal_state must be one of"):
        fleet.send("longcall.record_legacy_outcome", call_node_id="n/x", terminal_state="done")
    with pytest.raises(Exception, match="routed live, not shadowed"):
        fleet.send("longcall.record_legacy_outcome", call_node_id="n/live-lookup", terminal_state="completed")


def test_canary_routes_its_share_and_answers_the_rest_not_routed(fleet: Fleet) -> None:
    fleet.ledger.set_canary_percent(5, actor="test", reason="first canary")
    ids = [f"canary/{i}" for i in range(400)]
    routed = [i for i in ids if in_canary(i, 5)][:3]
    not_routed = [i for i in ids if not in_canary(i, 5)][:12]
    assert len(routed) == 3

    for call_node_id in not_routed:
        answer = fleet.send(
            "longcall.submit", call_node_id=call_node_id, server="reports", tool="quick_lookup", arguments={}
        )
        assert answer == {"routed": False, "reason": "canary", "percent": 5}
    for call_node_id in routed:
        fleet.submit(call_node_id, "quick_lookup", {"key": call_node_id})
    for call_node_id in routed:
        assert fleet.wait_receipt(call_node_id)["terminal_state"] == "completed"

    # Not routed: no row, no remote call; routed: one create each.
    for call_node_id in not_routed:
        assert fleet.ledger.find_by_call_node(call_node_id) is None
    creates = [e for e in fleet.mcp.log() if e["method"] == "tools/call"]
    assert len(creates) == len(routed)
    # A call node that has its operation keeps it when the canary is lowered: never a legacy run beside it.
    fleet.ledger.set_canary_percent(0, actor="test", reason="stop")
    again = fleet.send(
        "longcall.submit",
        call_node_id=routed[0],
        server="reports",
        tool="quick_lookup",
        arguments={"key": routed[0]},
        on_terminal=dict(fleet.pipeline.signature("pipeline.record", queue="pipeline")),
    )
    assert (again["created"], again["routed"]) == (False, True)
    assert fleet.send(
        "longcall.submit", call_node_id="canary/new", server="reports", tool="quick_lookup", arguments={}
    ) == {"routed": False, "reason": "canary", "percent": 0}


# ------------------------------------------------------------------------------------------- the CLI


CONFIG = """
[servers.reports]
protocol = "mcp"
protocol_version = "2025-11-25"
url = "http://127.0.0.1:9/mcp"
"""


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, database_url: str, broker_prefix: str, tmp_path: Path) -> Path:
    config = tmp_path / "longcall.toml"
    config.write_text(CONFIG)
    monkeypatch.setenv("LONGCALL_DATABASE_URL", database_url)
    monkeypatch.setenv("LONGCALL_BROKER_KEYPREFIX", broker_prefix)
    monkeypatch.setenv("LONGCALL_CONFIG", str(config))
    monkeypatch.setenv("USER", "operator-7")
    return config


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_the_gate_refuses_a_raise_and_force_needs_a_reason(cli_env: Path, ledger: Ledger) -> None:
    code, output = run("rollout", "--percent", "5", "--reason", "first canary", "--json")
    assert code == 0, output
    assert json.loads(output)["rollout"] == {"canary_percent": 5}
    # A diverged shadow comparison (and no simulation run yet): the gate fails, the raise is refused.
    op = shadowed(ledger, OpState.FETCHING_RESULT)
    ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    ledger.record_legacy_outcome(op.call_node_id, TerminalKind.FAILED)

    code, output = run("rollout", "--percent", "25", "--reason", "more")
    assert code == EXIT_REFUSED, output
    assert "the launch gate refuses raising the canary from 5% to 25%" in " ".join(output.split())
    assert "divergence" in output
    assert ledger.control().rollout == {"canary_percent": 5}

    code, output = run("rollout", "--percent", "25", "--force")
    assert code == EXIT_USAGE
    assert "--force needs --percent and a --reason" in output
    code, output = run("rollout", "--percent", "25", "--force", "--reason", "incident 42 accepted by CTO")
    assert code == 0, output
    assert ledger.control().rollout == {"canary_percent": 25}
    code, output = run("rollout", "--percent", "2", "--reason", "back down")  # lowering asks no gate
    assert code == 0, output

    forced = audit_rows(ledger)[-2]
    assert (forced.actor, forced.action) == ("operator-7", "force_canary_percent")
    assert forced.reason.startswith("forced past the launch gate (failing: ")
    assert forced.reason.endswith("): incident 42 accepted by CTO")
    assert (forced.before["rollout"], forced.after["rollout"]) == (
        {"canary_percent": 5},
        {"canary_percent": 25},
    )


def test_a_raise_the_gate_passes_is_made(
    cli_env: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []

    def passing(*_: Any, **__: Any) -> GateReport:
        asked.append(1)
        return GateReport([Criterion("terminal-state divergence", "0", "0", True)])

    monkeypatch.setattr(cli, "evaluate_gate", passing)
    assert run("rollout", "--percent", "5")[0] == 0
    assert asked == []  # the first canary asks no gate
    code, output = run("rollout", "--percent", "50", "--reason", "the gate passed")
    assert code == 0, output
    assert (asked, ledger.control().rollout["canary_percent"]) == ([1], 50)


def test_every_control_change_is_audited_with_actor_and_reason(cli_env: Path, ledger: Ledger) -> None:
    code, output = run("rollout", "--shadow", "on", "--reason", "compare first")
    assert code == EXIT_REFUSED
    assert "side_effect_free = true" in output  # no tool is marked: shadow mode would run nothing
    cli_env.write_text(CONFIG + "[servers.reports.tools.slow_report]\nside_effect_free = true\n")

    steps = [
        ("rollout", "--shadow", "on", "--reason", "compare first"),
        ("rollout", "--percent", "5", "--reason", "first canary"),
        ("adapters", "--disable", "mcp/2025-11-25", "--reason", "peer upgrade"),
        ("adapters", "--enable", "mcp/2025-11-25", "--reason", "peer upgraded"),
        ("rollback", "--reason", "divergence seen"),
        ("rollout", "--reason", "fixed"),
        ("rollout", "--shadow", "off"),
    ]
    for step in steps:
        code, output = run(*step)
        assert code == 0, (step, output)
    expected = [
        ("shadow_on", "compare first"),
        ("set_canary_percent", "first canary"),
        ("disable_adapter", "peer upgrade"),
        ("enable_adapter", "peer upgraded"),
        ("set_admission", "divergence seen"),
        ("bump_epoch", "divergence seen"),
        ("set_admission", "fixed"),
        ("shadow_off", None),
    ]
    rows = audit_rows(ledger)
    assert [(r.action, r.reason) for r in rows] == expected
    assert {r.actor for r in rows} == {"operator-7"}
    assert ledger.control().rollout == {"shadow": False, "canary_percent": 5}

    code, output = run("rollout", "--history", "--json")
    assert code == 0, output
    history = json.loads(output)
    assert [(h["action"], h["reason"], h["actor"]) for h in history] == [
        (a, r, "operator-7") for a, r in reversed(expected)
    ]
    code, output = run("rollout", "--history")
    assert "operator-7 shadow_on: compare first" in output
