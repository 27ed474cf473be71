"""Issue 19, item 7 (rule 13 as amended): a rollback fences the rolled-back fleet for good.

Each fleet runs under an executor identity (``LONGCALL_EXECUTOR_ID``); ``longcall rollback`` records which
identity owns the new epoch (``executor_control.epoch_owner``: the environment's own by default, or
``--owner``). A fleet that is not the owner claims nothing (the dispatcher's tick, a cancel's claim, the
submitting worker's claim: its submission is recorded unclaimed, for the owner) and writes nothing under a
claim; an intent sent by name (a cancel) is still recorded, for the owner to act on. ``longcall adapters``
and ``longcall status`` say who owns the epoch and whether this environment is it.

The last test runs two real fleets on one ledger, broker and server: after ``longcall rollback`` from fleet
A's environment, fleet A finishes the operations in flight and fleet B sends no request to the server (its
requests are told apart by a query string on its configured server URL) and claims nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from click.testing import CliRunner
from sqlalchemy import event

from console.main import main
from ledger.errors import StaleTransition
from ledger.records import Fence, ServerStatus
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.fleet import Fleet, FleetParts, fleet_config, running_fleet
from tests.support.ledger_rows import evidence_for, new_operation, place
from workers.fencing import OWNER_CHECK_S

S = OpState
A_ID, B_ID = "fleet-a", "fleet-b"


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def due(ledger: Ledger, op_id: uuid.UUID) -> None:
    with ledger.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE tool_operation SET next_poll_at = now(), lease_until = NULL WHERE id = %s", (op_id,)
        )


# --------------------------------------------------------------------------------------- the ledger


def test_a_fleet_that_does_not_own_the_epoch_claims_nothing_and_writes_nothing_under_a_claim(
    ledger: Ledger,
) -> None:
    fleet_a = Ledger(ledger.engine, executor_id=A_ID)
    fleet_b = Ledger(ledger.engine, executor_id=B_ID)
    working = place(ledger, S.WORKING)
    queued = place(ledger, S.SUBMITTING)
    # Before any rollback names an owner, every fleet works in the epoch.
    assert fleet_b.owns_epoch()
    assert fleet_a.owns_epoch()
    assert fleet_b.claim(working.id, lease_s=0.001) is not None
    due(ledger, working.id)

    control = ledger.bump_epoch(actor="operator", owner=A_ID)
    assert (control.execution_epoch, control.epoch_owner) == (2, A_ID)
    assert ledger.control().epoch_owner == A_ID
    assert (fleet_a.owns_epoch(), fleet_b.owns_epoch(), ledger.owns_epoch()) == (True, False, True)

    # B claims nothing: not the dispatcher's tick, not the claim a cancel or an operator takes ...
    rooms = [("reports", 10)]
    assert fleet_b.claim_due_by_server(rooms, limit=10, lease_s=30, epoch="current", horizon_s=60) == []
    assert fleet_b.claim_due(limit=10, lease_s=30, epoch=2) == []
    assert fleet_b.claim(working.id, lease_s=30) is None
    # ... nor the submitting worker's: its submission is recorded, unclaimed and due at once, for A.
    submitted = fleet_b.record_submission(new_operation("node/taken-by-b"), lease_s=30)
    assert submitted.created
    assert (submitted.operation.poll_cursor, submitted.operation.lease_until) == (0, None)

    # A write under a claim of the current epoch (a step that read the row after the rollback) is refused
    # to B, with the refusal recorded; the same write is A's to make.
    now = ledger.get(working.id)
    fence = Fence(now.execution_epoch, now.cancel_generation, now.poll_cursor)
    status = ServerStatus("working")
    with pytest.raises(StaleTransition):
        fleet_b.record_poll(working.id, fence, state=S.WORKING, status=status, next_poll_in_s=5)
    assert ledger.events(working.id)[-1]["kind"] == "stale_write_rejected"
    # An intent sent by name is recorded whichever fleet took the message: the owner acts on it.
    cancelled = fleet_b.request_cancel(
        working.id,
        Fence(now.execution_epoch, now.cancel_generation),
        from_state=(S.WORKING, S.INPUT_REQUIRED),
    )
    assert (cancelled.state, cancelled.cancel_generation) == (S.CANCEL_REQUESTED, 1)

    # A (and a ledger that names no executor, e.g. an operator's command) claims them all, in epoch 2.
    claims = fleet_a.claim_due_by_server(rooms, limit=10, lease_s=30, epoch="current", horizon_s=60)
    assert {c.op_id for c in claims} == {working.id, queued.id, submitted.operation.id}
    assert {c.execution_epoch for c in claims} == {2}
    [claim] = [c for c in claims if c.op_id == working.id]
    # B's acceptance under A's claim is refused too; A's goes through.
    held = ledger.get(working.id)
    evidence = evidence_for(held, TerminalKind.CANCELLED)
    assert fleet_b.accept_terminal(working.id, evidence).outcome == "rejected"
    assert fleet_a.accept_terminal(working.id, evidence).outcome == "accepted"
    assert claim.fence.execution_epoch == 2

    # A rollback with no owner opens the epoch to every fleet again.
    assert ledger.bump_epoch(actor="operator").epoch_owner is None
    assert fleet_b.owns_epoch()


def test_owns_epoch_is_read_with_the_row_at_no_extra_statement(ledger: Ledger) -> None:
    """``owns_epoch(max_age_s=...)`` answers from what the last read of an operation saw of the control row
    (the step's own read), unless that was of an older epoch than the operation's."""
    fleet_b = Ledger(ledger.engine, executor_id=B_ID)
    op = place(ledger, S.WORKING)
    fleet_b.get(op.id)
    ledger.bump_epoch(actor="operator", owner=A_ID)
    # What B saw with its last read (before the rollback) is young, but of epoch 1: the operation read now
    # is of epoch 2, so the control row is read again.
    now = fleet_b.get(op.id)
    assert now.execution_epoch == 2
    assert not fleet_b.owns_epoch(max_age_s=60, epoch=now.execution_epoch)
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(str(args[2]))

    event.listen(ledger.engine, "before_cursor_execute", count)
    try:
        fleet_b.get(op.id)
        assert not fleet_b.owns_epoch(max_age_s=60, epoch=now.execution_epoch)
    finally:
        event.remove(ledger.engine, "before_cursor_execute", count)
    assert len(statements) == 1, statements  # the row's read, the owner with it


# ------------------------------------------------------------------------------------------ the CLI


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, database_url: str, broker_prefix: str, tmp_path: Path) -> None:
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config("http://127.0.0.1:9/mcp"))
    monkeypatch.setenv("LONGCALL_DATABASE_URL", database_url)
    monkeypatch.setenv("LONGCALL_BROKER_KEYPREFIX", broker_prefix)
    monkeypatch.setenv("LONGCALL_CONFIG", str(config))
    monkeypatch.setenv("LONGCALL_EXECUTOR_ID", "ops-shell")


def test_rollback_records_the_owner_and_adapters_and_status_say_whether_this_environment_is_it(
    cli_env: None, ledger: Ledger
) -> None:
    code, output = run("rollback", "--reason", "bad deploy", "--json")
    assert code == 0, output
    assert json.loads(output)["epoch_owner"] == "ops-shell"  # by default the environment's own identity
    code, output = run("status", "--json")
    assert code == 0, output
    fleet = json.loads(output)
    assert (fleet["execution_epoch"], fleet["epoch_owner"], fleet["executor_id"], fleet["owns_epoch"]) == (
        2,
        "ops-shell",
        "ops-shell",
        True,
    )

    code, output = run("rollback", "--owner", A_ID, "--reason", "back to A")
    assert code == 0, output
    said = " ".join(output.split())
    assert f"execution epoch now 3, owned by {A_ID} (not this environment, ops-shell)" in said
    code, output = run("adapters")
    said = " ".join(output.split())
    assert f"execution epoch 3 is owned by {A_ID}: this environment (ops-shell) is NOT its owner" in said
    code, output = run("status", "--json")
    assert json.loads(output)["owns_epoch"] is False
    code, output = run("status")
    assert f"owned by {A_ID}" in " ".join(output.split())

    code, output = run("rollback", "--any-owner", "--json")
    assert (code, json.loads(output)["epoch_owner"]) == (0, None)
    code, output = run("adapters")
    assert "execution epoch 4 is open to every fleet (no owner)" in " ".join(output.split())
    code, output = run("rollback", "--any-owner", "--owner", A_ID)
    assert code == 2
    with ledger.engine.connect() as conn:
        owners = [
            r.after.get("epoch_owner")
            for r in conn.exec_driver_sql(
                "SELECT after FROM executor_control_audit WHERE action = 'bump_epoch' ORDER BY id"
            )
        ]
    assert owners == ["ops-shell", A_ID, None]


# --------------------------------------------------------------------------------- two real fleets

#: A step fleet B had begun before the rollback committed may still send the one request it was about to
#: send (its write is refused by the epoch); nothing B sends may reach the server later than this.
IN_FLIGHT_S = 2.0
B_ONLY_QUEUE = "fleet-b-only"


@dataclass
class FleetB:
    env: dict[str, str]
    worker: support.CeleryProcess
    beat: support.CeleryProcess


def requests_of_b(fleet: Fleet) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = httpx2.get(f"{fleet.mcp.control}/http_log", timeout=5).json()["entries"]
    return [e for e in entries if "fleet=b" in (e.get("query") or "")]


def json_lines(process: support.CeleryProcess) -> list[dict[str, Any]]:
    lines = []
    for line in process.log().splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


def at(line: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(line["ts"]).timestamp()


def longcall(env: dict[str, str], *args: str) -> tuple[int, str]:
    """The ``longcall`` command as an operator runs it in fleet A's environment (in this process: the
    fleets' six processes are enough to start)."""
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture
def two_fleets(fleet_parts: FleetParts) -> Iterator[tuple[Fleet, FleetB]]:
    """Fleet A (``running_fleet``: a worker and beat under ``fleet-a``) and fleet B beside it on the same
    ledger, broker, Redis and server: a worker (also consuming a queue of its own) and a beat under
    ``fleet-b``, whose configured server URL carries ``?fleet=b`` and whose log lines are JSON."""
    with running_fleet(fleet_parts, workers=1, env={"LONGCALL_EXECUTOR_ID": A_ID}) as fleet:
        config = fleet_parts.tmp_path / "longcall-b.toml"
        config.write_text(fleet_config(f"{fleet.mcp.url}?fleet=b"))
        env = {
            **fleet.env,
            "LONGCALL_EXECUTOR_ID": B_ID,
            "LONGCALL_CONFIG": str(config),
            "LONGCALL_LOG_FORMAT": "json",
        }
        worker = support.start_worker(
            "workers.app",
            queues=f"longcall.control,longcall.poll,longcall.outbox,{B_ONLY_QUEUE}",
            env=env,
            log_dir=fleet.log_dir,
            name="fleet-b-worker",
        )
        fleet.processes.append(worker)
        beat = support.start_celery(
            ["-A", "workers.app", "beat", "-s", str(fleet_parts.tmp_path / "beat-b"), "--loglevel", "INFO"],
            env=env,
            log_dir=fleet.log_dir,
            name="fleet-b-beat",
            ready_marker="beat: Starting",
        )
        fleet.processes.append(beat)
        yield fleet, FleetB(env, worker, beat)


@pytest.mark.timeout(240)  # two fleets (six processes) to start and stop
def test_after_a_rollback_to_fleet_a_fleet_b_sends_no_request_and_claims_nothing(
    two_fleets: tuple[Fleet, FleetB],
) -> None:
    fleet, b = two_fleets
    nodes = [f"n/epoch-owner-{i}" for i in range(6)]
    for node in nodes:
        fleet.submit_nowait(node, "slow_report", {"seconds": 6})
    for node in nodes:
        fleet.wait_operation(node, S.WORKING, timeout=60)
    support.wait_for("fleet B to poll the server before the rollback", lambda: requests_of_b(fleet) or None)

    code, rolled = longcall(fleet.env, "rollback", "--reason", "fleet B misbehaves", "--json")
    assert code == 0, rolled
    rolled_at = time.time()
    code, reopened = longcall(fleet.env, "rollout", "--reason", "fleet A serves")
    assert code == 0, reopened

    # A submission that fleet B consumes is recorded, unclaimed, for fleet A: B makes no create.
    on_terminal = dict(fleet.pipeline.signature("pipeline.record", queue="pipeline"))
    answer = fleet.pipeline.send_task(
        "longcall.submit",
        kwargs={
            "call_node_id": "n/taken-by-b",
            "server": "reports",
            "tool": "slow_report",
            "arguments": {"seconds": 0.5},
            "on_terminal": on_terminal,
        },
        queue=B_ONLY_QUEUE,
    ).get(timeout=30)
    # And one that either fleet's worker takes.
    fleet.submit_nowait("n/after-rollback", "slow_report", {"seconds": 0.5})

    for node in [*nodes, "n/taken-by-b", "n/after-rollback"]:
        receipt = fleet.wait_receipt(node, timeout=120)
        assert (receipt["terminal_state"], receipt["execution_epoch"]) == ("completed", 2), node
    late = [e for e in requests_of_b(fleet) if e["t"] > rolled_at + IN_FLIGHT_S]
    assert late == [], f"fleet B sent {len(late)} requests after the rollback: {late[:5]}"
    assert json.loads(rolled)["epoch_owner"] == A_ID  # the rolling-back environment's identity
    assert (answer["created"], answer["step"], answer["state"]) == (True, "not_owner", "SUBMITTING")

    # B claimed nothing: each dispatch tick it ran after the rollback dispatched nothing, and within
    # OWNER_CHECK_S it stopped taking longcall's messages off the shared queues (workers/fencing.py: an
    # idle non-owner otherwise wins the race for the owner's steps nearly every time); it said why.
    lines = [line for line in json_lines(b.worker) if at(line) > rolled_at + IN_FLIGHT_S]
    ticks = [
        line["message"]
        for line in lines
        if "longcall.dispatch_due[" in line["message"] and "succeeded" in line["message"]
    ]
    assert all("'dispatched': 0" in tick for tick in ticks), [t for t in ticks if "'dispatched': 0" not in t]
    said = [line for line in json_lines(b.worker) if line["level"] == "WARNING" and B_ID in line["message"]]
    assert any(f"owned by {A_ID}" in line["message"] for line in said), said[:3]
    stopped = [line for line in said if "stopped consuming" in line["message"]]
    assert stopped, said[:3]
    assert "longcall.poll" in stopped[0]["message"]
    assert at(stopped[0]) < rolled_at + OWNER_CHECK_S + 5
    # The operation B recorded was created by A, once.
    op = fleet.ledger.find_by_call_node("n/taken-by-b")
    assert op is not None
    kinds = [e["kind"] for e in fleet.ledger.events(op.id)]
    assert kinds.count("create_attempted") == 1
