"""The canary and concurrent submissions of one call node (issue 12): the routing decision is taken under
the call node's submission lock, in the transaction that inserts, so a lowered canary never answers "not
routed" for a call node whose live operation is being recorded (two operations for one call node)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select, text

from console.main import main
from ledger.control import read_control
from ledger.digests import request_digest
from ledger.errors import AdmissionClosed
from ledger.records import NewOperation
from ledger.repository import Ledger
from ledger.routing import ROUTING_DECISION
from ledger.statements import OP
from ledger.submissions import insert_submitted, lock_submission
from tests import support
from tests.support.fleet import Fleet
from tests.support.ledger_rows import new_operation, submit
from workers.rollout import in_canary
from workers.settings import FleetConfig, ServerConfig, ToolConfig
from workers.submission import NotRouted, canary_admission

ARGS_KEY = "key"


def node_between(low: float, high: float, prefix: str) -> str:
    """A call node routed at ``high`` % and not at ``low`` %."""
    return next(
        f"{prefix}/{i}"
        for i in range(10_000)
        if in_canary(f"{prefix}/{i}", high) and not in_canary(f"{prefix}/{i}", low)
    )


def lookup(call_node_id: str) -> NewOperation:
    """What ``longcall.submit`` records for ``quick_lookup`` with ``{"key": call_node_id}``."""
    arguments = {ARGS_KEY: call_node_id}
    return new_operation(
        call_node_id,
        arguments=arguments,
        tool_name="quick_lookup",
        request_digest=request_digest(server="reports", tool="quick_lookup", arguments=arguments),
    )


def rows_of(ledger: Ledger, call_node_id: str) -> int:
    with ledger.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(OP.c.call_node_id == call_node_id)).scalar_one())


def advisory_waiters(ledger: Ledger) -> int:
    """Backends of this database waiting for an advisory lock."""
    with ledger.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                    "WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()"
                )
            ).scalar_one()
        )


def test_a_second_submission_while_the_canary_is_lowered_returns_the_live_operation(fleet: Fleet) -> None:
    ledger = fleet.ledger
    ledger.set_canary_percent(50, actor="test", reason="canary at 50")
    call_node_id = node_between(5, 50, "race-lower")
    # Submission A, held open at the point of the race: it took the call node's lock, read 50 %, inserted
    # its live row, and has not committed.
    with ledger.engine.begin() as conn:
        lock_submission(conn, call_node_id)
        control = read_control(conn)
        assert in_canary(call_node_id, control.rollout["canary_percent"])
        row = insert_submitted(
            conn, lookup(call_node_id), execution_epoch=control.execution_epoch, lease_s=None
        )
        assert row is not None
        # The operator lowers the canary (committed), then submission B of the same call node arrives.
        ledger.set_canary_percent(5, actor="test", reason="lower during a submission")
        b = fleet.submit_nowait(call_node_id, "quick_lookup", {ARGS_KEY: call_node_id})
        support.wait_for(
            "submission B to wait for A's lock (or answer)",
            lambda: b.ready() or advisory_waiters(ledger) > 0 or None,
            timeout=30,
        )
        # Before the fix B read 5 %, saw no row and answered {"routed": false} here.
        assert not b.ready(), f"B answered while A's row was uncommitted: {b.get(timeout=1)}"
    answer: dict[str, Any] = b.get(timeout=30)
    assert (answer["routed"], answer["routing"], answer["created"], answer["op_id"]) == (
        True,
        "live",
        False,
        str(row.id),
    )
    assert rows_of(ledger, call_node_id) == 1


FLEET = FleetConfig(
    servers={
        "reports": ServerConfig(
            protocol="mcp",
            protocol_version="2025-11-25",
            url="http://127.0.0.1:9/mcp",
            tools={"quick_lookup": ToolConfig()},
        )
    }
)


def test_a_raise_while_a_not_routed_decision_is_in_flight_writes_nothing(ledger: Ledger) -> None:
    """The reverse: B decides "not routed" at 5 % under the lock, and the canary is raised to 50 % before
    B's transaction ends. B answers from the 5 % it read and inserts nothing; the raise inserts nothing
    either (rows are made only by a submission): no operation exists for the call node afterwards, so no
    live operation runs beside the legacy path B's caller is told to take. A concurrent submission of the
    same call node waits for B's lock meanwhile; one after B's end answers from B's recorded decision."""
    ledger.set_canary_percent(5, actor="test", reason="canary at 5")
    call_node_id = node_between(5, 50, "race-raise")
    new = lookup(call_node_id)
    decided, release = threading.Event(), threading.Event()
    answers: dict[str, Any] = {}

    def held_admission(rollout: Any) -> NewOperation:
        try:
            return canary_admission(FLEET, new)(rollout)
        finally:
            decided.set()
            release.wait(30)

    def run() -> None:
        try:
            answers["b"] = ledger.record_submission(new, admit=held_admission)
        except NotRouted as exc:
            answers["b"] = exc.routing

    b = threading.Thread(target=run)
    b.start()
    try:
        assert decided.wait(30)
        ledger.set_canary_percent(50, actor="test", reason="raise during a submission")
        assert rows_of(ledger, call_node_id) == 0
        # Another submission of the call node cannot slip in: the lock is B's until it ends.
        with ledger.engine.begin() as conn:
            took = conn.execute(
                text("SELECT pg_try_advisory_xact_lock(hashtextextended(:key, 0))"),
                {"key": f"longcall.submission:{call_node_id}"},
            ).scalar_one()
        assert took is False
    finally:
        release.set()
        b.join(30)
    assert answers["b"].answer() == {"routed": False, "reason": "canary", "percent": 5}
    assert rows_of(ledger, call_node_id) == 0
    # A submission after B's end (at 50 % now) is answered from B's recorded decision.
    with pytest.raises(NotRouted) as later:
        ledger.record_submission(new, admit=canary_admission(FLEET, new))
    assert later.value.routing.answer() == {"routed": False, "reason": "canary", "percent": 5}
    assert rows_of(ledger, call_node_id) == 0


# ------------------------------------------------------------------------ longcall status shows the routing


def test_status_shows_the_routing_of_an_operation(
    monkeypatch: pytest.MonkeyPatch, ledger: Ledger, database_url: str, broker_prefix: str, tmp_path: Path
) -> None:
    config = tmp_path / "longcall.toml"
    config.write_text(
        '[servers.reports]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\nurl = "http://127.0.0.1:9/mcp"\n'
    )
    monkeypatch.setenv("LONGCALL_DATABASE_URL", database_url)
    monkeypatch.setenv("LONGCALL_BROKER_KEYPREFIX", broker_prefix)
    monkeypatch.setenv("LONGCALL_CONFIG", str(config))
    live = submit(ledger, "status/live")
    shadow = submit(ledger, "status/shadow", routing="shadow", on_terminal=None)
    for op, routing in ((live, "live"), (shadow, "shadow")):
        result = CliRunner().invoke(main, ["status", op.call_node_id, "--json"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["routing"] == routing
        result = CliRunner().invoke(main, ["status", str(op.id)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        [line] = [row for row in result.output.splitlines() if row.split()[:1] == ["routing"]]
        assert line.split() == ["routing", routing]


def decision_of(ledger: Ledger, call_node_id: str) -> tuple[bool, float] | None:
    """The call node's row of ``routing_decision``: (routed, percent), or None."""
    with ledger.engine.connect() as conn:
        row = conn.execute(
            select(ROUTING_DECISION.c.routed, ROUTING_DECISION.c.percent).where(
                ROUTING_DECISION.c.call_node_id == call_node_id
            )
        ).first()
    return (row.routed, row.percent) if row is not None else None


def test_a_call_node_answered_not_routed_stays_not_routed_after_a_raise(ledger: Ledger) -> None:
    """Reported by H12: a "not routed" answer wrote nothing, so a submission of the same call node after a
    raise (a caller's retry, a redelivered longcall.submit) was routed live beside the legacy path the
    first answer started. The answer is kept in routing_decision and given again, at the first percentage."""
    ledger.set_canary_percent(5, actor="test", reason="canary at 5")
    call_node_id = node_between(5, 50, "race-resubmit")
    new = lookup(call_node_id)
    with pytest.raises(NotRouted) as first:
        ledger.record_submission(new, admit=canary_admission(FLEET, new))
    assert first.value.routing.answer() == {"routed": False, "reason": "canary", "percent": 5}
    # The answer is committed on its own: no operation, the decision.
    assert (rows_of(ledger, call_node_id), decision_of(ledger, call_node_id)) == (0, (False, 5.0))
    ledger.set_canary_percent(50, actor="test", reason="raise")
    with pytest.raises(NotRouted) as again:  # the caller runs its legacy path for this call node already
        ledger.record_submission(new, admit=canary_admission(FLEET, new))
    assert again.value.routing.answer() == {"routed": False, "reason": "canary", "percent": 5}
    assert (rows_of(ledger, call_node_id), decision_of(ledger, call_node_id)) == (0, (False, 5.0))
    # A call node never answered is decided at the new percentage, and recorded.
    fresh = node_between(5, 50, "race-resubmit-fresh")
    created = ledger.record_submission(lookup(fresh), admit=canary_admission(FLEET, lookup(fresh)))
    assert (created.created, created.operation.routing, decision_of(ledger, fresh)) == (
        True,
        "live",
        (True, 50.0),
    )


def test_a_routed_call_node_stays_routed_after_a_lowering(ledger: Ledger) -> None:
    ledger.set_canary_percent(50, actor="test", reason="canary at 50")
    call_node_id = node_between(5, 50, "lower-resubmit")
    new = lookup(call_node_id)
    first = ledger.record_submission(new, admit=canary_admission(FLEET, new))
    assert (first.created, first.operation.routing, decision_of(ledger, call_node_id)) == (
        True,
        "live",
        (True, 50.0),
    )
    ledger.set_canary_percent(5, actor="test", reason="lower")
    again = ledger.record_submission(new, admit=canary_admission(FLEET, new))
    assert (again.created, again.operation.id) == (False, first.operation.id)
    assert (rows_of(ledger, call_node_id), decision_of(ledger, call_node_id)) == (1, (True, 50.0))


def test_no_decision_is_recorded_without_a_canary_percentage(ledger: Ledger) -> None:
    new = lookup("no-canary/1")
    submission = ledger.record_submission(new, admit=canary_admission(FLEET, new))
    assert (submission.created, submission.operation.routing) == (True, "live")
    assert decision_of(ledger, "no-canary/1") is None


def test_a_refused_submission_records_no_decision(ledger: Ledger) -> None:
    ledger.set_canary_percent(5, actor="test", reason="canary at 5")
    ledger.set_admission(open_=False, actor="test", reason="closed")
    call_node_id = node_between(5, 50, "refused")
    new = lookup(call_node_id)
    with pytest.raises(AdmissionClosed):
        ledger.record_submission(new, admit=canary_admission(FLEET, new))
    assert decision_of(ledger, call_node_id) is None


def test_a_redelivered_submit_after_a_raise_gets_the_first_answer(fleet: Fleet) -> None:
    """Through longcall.submit on a real worker: answered "not routed" at 5 %, the same call node submitted
    again after a raise to 50 % is answered "not routed" at 5 % again, and nothing is written or sent."""
    ledger = fleet.ledger
    ledger.set_canary_percent(5, actor="test", reason="canary at 5")
    call_node_id = node_between(5, 50, "redelivered")
    not_routed = {"routed": False, "reason": "canary", "percent": 5}
    assert fleet.submit_nowait(call_node_id, "quick_lookup", {ARGS_KEY: call_node_id}).get(timeout=30) == (
        not_routed
    )
    ledger.set_canary_percent(50, actor="test", reason="raise")
    assert fleet.submit_nowait(call_node_id, "quick_lookup", {ARGS_KEY: call_node_id}).get(timeout=30) == (
        not_routed
    )
    assert (rows_of(ledger, call_node_id), decision_of(ledger, call_node_id)) == (0, (False, 5.0))
