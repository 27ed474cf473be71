"""Issue 19, item 9 (rule 14 as amended): a server removed from (or renamed in) the configuration while it
has operations in flight leaves none of them unclaimed in silence.

A fleet that starts with operations in flight on a server its LONGCALL_CONFIG no longer names says so at
start (an ERROR line naming each server and its count); ``longcall.reconcile`` hands each such operation,
once its lease is free, to an operator with the reason SERVER_UNCONFIGURED (or ends it where nothing needs
the server: a create never sent ends with a failed receipt saying why, a cancelled end or a result already
held is accepted); a step that meets the unknown server (a cancel's) does the same instead of failing; and
``longcall status``, ``longcall gate`` and ``longcall metrics`` show them.

Operations on such a server created after the fleet started are another fleet's (one whose configuration
names the server, e.g. the newer half of a rolling deploy): they are reported, not handed over.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import text

from console.launch_gate import evaluate_gate
from console.main import main
from console.metrics import LongcallCollector, registry_for
from ledger.reasons import ReconciliationReason
from ledger.records import Operation
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.fleet import FleetParts, fleet_config, in_process_runtime, running_fleet
from tests.support.ledger_rows import place
from workers.executor import Executor
from workers.settings import Settings

S = OpState
GONE = "retired_reports"


def retire(ledger: Ledger, *ops: Operation) -> None:
    """The operations' server is one the configuration no longer names."""
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET server = :server WHERE id = ANY(:ids)"),
            {"server": GONE, "ids": [op.id for op in ops]},
        )


def sql(ledger: Ledger, statement: str, **params: Any) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(text(statement), params)


def records(ledger: Ledger, op: Operation) -> list[str]:
    return [r.reason.value for r in ledger.reconciliations_for(op.id) if r.resolved_at is None]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "longcall.toml"
    path.write_text(fleet_config("http://127.0.0.1:9/mcp"))  # "reports" only: nothing is sent anywhere
    return path


@pytest.fixture
def executor_after(database_url: str, broker_prefix: str, config: Path) -> Iterator[Any]:
    """Makes the executor of a fleet that starts now (after the rows the test placed)."""
    made: list[Executor] = []

    def start() -> Executor:
        made.append(Executor(in_process_runtime(database_url, broker_prefix, config, lease_s=30)))
        return made[-1]

    try:
        yield start
    finally:
        for executor in made:
            executor.rt.close()


def test_reconcile_hands_each_operation_of_an_unconfigured_server_over_or_ends_it(
    ledger: Ledger, executor_after: Any
) -> None:
    never_sent = place(ledger, S.SUBMITTING)
    attempted = place(ledger, S.SUBMITTING)
    sql(ledger, "UPDATE tool_operation SET submit_attempted_at = now() WHERE id = :id", id=attempted.id)
    cancelled_before_create = place(ledger, S.SUBMITTING)
    sql(
        ledger,
        "UPDATE tool_operation SET cancel_generation = 1 WHERE id = :id",
        id=cancelled_before_create.id,
    )
    unknown = place(ledger, S.SUBMISSION_UNKNOWN)
    working = place(ledger, S.WORKING)
    waiting = place(ledger, S.INPUT_REQUIRED)
    cancelling = place(ledger, S.CANCEL_REQUESTED)
    observed = place(ledger, S.TERMINAL_OBSERVED)
    cancelled_end = place(ledger, S.FETCHING_RESULT, terminal=TerminalKind.CANCELLED)
    with_operator = place(ledger, S.SUBMISSION_UNKNOWN)
    with_operator = ledger.hand_to_operator(
        with_operator.id,
        with_operator.fence,
        from_state=S.SUBMISSION_UNKNOWN,
        reason=ReconciliationReason.SUBMISSION_UNKNOWN,
        detail={},
        deadline_s=3600,
    )
    leased = place(ledger, S.WORKING)
    sql(
        ledger,
        "UPDATE tool_operation SET lease_until = now() + interval '1 hour' WHERE id = :id",
        id=leased.id,
    )
    configured = place(ledger, S.WORKING)  # on "reports", which the configuration names
    retired = [
        never_sent,
        attempted,
        cancelled_before_create,
        unknown,
        working,
        waiting,
        cancelling,
        observed,
        cancelled_end,
        with_operator,
        leased,
    ]
    retire(ledger, *retired)

    executor = executor_after()
    later = place(ledger, S.WORKING)  # created after the fleet started: another fleet's
    retire(ledger, later)
    counts = executor.reconcile()
    assert (counts["unconfigured_handled"], counts["unconfigured_left"]) == (9, 2), counts

    def state(op: Operation) -> OpState:
        return ledger.get(op.id).state

    # Nothing was sent for it, and nothing can be: it ends, failed, with a receipt saying why.
    assert state(never_sent) is S.ACCEPTED
    receipt = ledger.receipt_for(never_sent.id)
    assert receipt is not None
    assert receipt.terminal_state is TerminalKind.FAILED
    message = ledger.get(never_sent.id).result["error"]["message"]
    assert f"server {GONE!r} is not in LONGCALL_CONFIG" in message
    assert "no create was sent" in message
    assert "create_attempted" not in [e["kind"] for e in ledger.events(never_sent.id)]
    assert "create_never_sent" in [e["kind"] for e in ledger.events(never_sent.id)]
    # A cancel asked for before any create: cancelled, no create.
    assert state(cancelled_before_create) is S.CANCELLED_ACCEPTED
    # A cancelled end needs no result from the server.
    assert state(cancelled_end) is S.CANCELLED_ACCEPTED
    # Everything else that needs the server goes to an operator with the reason.
    for op in (attempted, unknown, working, waiting, cancelling, observed):
        assert state(op) is S.MANUAL_RECONCILIATION, op.state
        assert records(ledger, op) == ["SERVER_UNCONFIGURED"], op.state

    def path(op: Operation) -> list[str]:
        moves = [(e["from_state"], e["to_state"]) for e in ledger.events(op.id)]
        return [to for source, to in moves if source != to][-2:]

    assert path(attempted) == ["SUBMISSION_UNKNOWN", "MANUAL_RECONCILIATION"]  # a create was attempted
    assert path(observed) == ["FETCHING_RESULT", "MANUAL_RECONCILIATION"]
    assert ledger.get(cancelling.id).cancel_generation == cancelling.cancel_generation  # the intent stays
    # Already with an operator: unchanged. Leased: its step is under way; the next reconcile takes it.
    assert (state(with_operator), records(ledger, with_operator)) == (
        S.MANUAL_RECONCILIATION,
        ["SUBMISSION_UNKNOWN"],
    )
    assert state(leased) is S.WORKING
    # The configured server's operation and the newer fleet's are not touched.
    assert state(configured) is S.WORKING
    assert state(later) is S.WORKING
    assert executor.reconcile()["unconfigured_handled"] == 0


def test_a_cancel_of_an_operation_on_an_unconfigured_server_goes_to_an_operator(
    ledger: Ledger, executor_after: Any
) -> None:
    op = place(ledger, S.WORKING)
    retire(ledger, op)
    executor = executor_after()
    outcome = executor.request_cancel(op.id)
    assert outcome.action == "manual_reconciliation", outcome
    after = ledger.get(op.id)
    assert (after.state, after.cancel_generation) == (S.MANUAL_RECONCILIATION, 1)  # the intent is kept
    assert records(ledger, op) == ["SERVER_UNCONFIGURED"]
    assert after.lease_until is None


def test_status_gate_and_metrics_show_operations_on_unconfigured_servers(
    ledger: Ledger,
    database_url: str,
    broker_prefix: str,
    config: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_client: redis.Redis,
) -> None:
    ops = [place(ledger, S.WORKING), place(ledger, S.MANUAL_RECONCILIATION), place(ledger, S.ACCEPTED)]
    retire(ledger, *ops)
    place(ledger, S.WORKING)
    monkeypatch.setenv("LONGCALL_DATABASE_URL", database_url)
    monkeypatch.setenv("LONGCALL_BROKER_KEYPREFIX", broker_prefix)
    monkeypatch.setenv("LONGCALL_CONFIG", str(config))

    result = CliRunner().invoke(main, ["status", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["unconfigured_servers"] == {GONE: 2}  # in flight: not final
    result = CliRunner().invoke(main, ["status"], catch_exceptions=False)
    said = " ".join(result.output.split())
    assert f"{GONE}: 2 operations in flight on a server LONGCALL_CONFIG does not name" in said

    settings = Settings(
        database_url=database_url, redis_url=support.REDIS_URL, broker_keyprefix=broker_prefix, config=config
    )
    report = evaluate_gate(ledger, settings, redis_client)
    [criterion] = [c for c in report.criteria if c.name == "operations on unconfigured servers"]
    assert not criterion.passed
    assert criterion.behind == [f"{GONE}: 2 in flight"]

    collector = LongcallCollector(settings, settings.fleet(), ledger.engine, redis_client)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry_for(collector).collect()
        for s in family.samples
    }
    assert samples[("longcall_unconfigured_server_operations", (("server", GONE),))] == 2
    assert samples[("longcall_unconfigured_server_operations", (("server", "reports"),))] == 0


# ------------------------------------------------------------------------------------------ a real fleet


def test_a_fleet_starting_with_operations_on_an_unconfigured_server_says_so_and_hands_them_over(
    fleet_parts: FleetParts,
) -> None:
    ledger = fleet_parts.ledger
    ops = [place(ledger, S.WORKING), place(ledger, S.WORKING), place(ledger, S.SUBMITTING)]
    retire(ledger, *ops)
    with running_fleet(fleet_parts, workers=1, env={"LONGCALL_RECONCILE_INTERVAL_S": "1"}) as fleet:
        said = re.compile(
            rf"ERROR.*operations in flight on servers LONGCALL_CONFIG does not name: {GONE} \(3\)"
        )
        for process in (p for p in fleet.processes if p.name in ("longcall0", "beat")):
            assert said.search(process.log()), process.log()[-2000:]
        for op in ops[:2]:
            fleet.wait_state(op.id, S.MANUAL_RECONCILIATION, timeout=30)
            assert records(ledger, op) == ["SERVER_UNCONFIGURED"]
        fleet.wait_state(ops[2].id, S.ACCEPTED, timeout=30)
