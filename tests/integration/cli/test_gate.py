"""The launch gate (``longcall gate``) over a real ledger and Redis: each criterion passes on good evidence
and fails, naming what is behind it, on bad; the command's exit codes and ``--json``; and a real fleet run
with an MCP and an AIP-151 server whose gate passes."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from rich.console import Console
from sqlalchemy import text

from console import common as cli
from console.common import EXIT_REFUSED
from console.launch_gate import BEHIND_LIMIT, Criterion, GateReport, evaluate_gate
from console.main import main
from console.output import launch_gate_table
from ledger.records import Operation
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.aip_fleet import AIP_SERVER, args, running_aip_fleet
from tests.support.fleet import FleetParts
from tests.support.ledger_rows import evidence_for, place
from workers.budget import RequestMeter
from workers.hot import Budget
from workers.settings import Settings

S = OpState

CONFIG = """
[servers.reports]
protocol = "mcp"
protocol_version = "2025-11-25"
url = "http://127.0.0.1:9/mcp"
poll_qps = 2
control_qps = 4

[servers.exports]
protocol = "aip151"
protocol_version = "v1"
url = "http://127.0.0.1:9"
poll_qps = 10
"""

NAMES = (
    "terminal-state divergence",
    "second operations from duplicate submissions",
    "poll amplification",
    "cancel confirmation p99",
    "UNKNOWN reconciliation age p99",
    "UNKNOWN past its deadline",
    "operations on unconfigured servers",
    "downstream advances traceable to a terminal receipt",
)


@pytest.fixture
def settings(database_url: str, broker_prefix: str, tmp_path: Path) -> Settings:
    config = tmp_path / "longcall.toml"
    config.write_text(CONFIG)
    return Settings(
        database_url=database_url,
        redis_url=support.REDIS_URL,
        broker_keyprefix=broker_prefix,
        config=config,
    )


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    monkeypatch.setenv("LONGCALL_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("LONGCALL_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("LONGCALL_BROKER_KEYPREFIX", settings.broker_keyprefix)
    monkeypatch.setenv("LONGCALL_CONFIG", str(settings.config))


def run(*argv: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(argv), catch_exceptions=False)
    return result.exit_code, result.output


def gate(ledger: Ledger, settings: Settings, client: redis.Redis) -> dict[str, Criterion]:
    report = evaluate_gate(ledger, settings, client)
    assert [c.name for c in report.criteria] == list(NAMES)
    return {c.name: c for c in report.criteria}


# ------------------------------------------------------------------------------------------- evidence


def add_simulation(ledger: Ledger, **overrides: Any) -> int:
    now = dt.datetime.now(dt.UTC)
    values: dict[str, Any] = {
        "started_at": now - dt.timedelta(seconds=30),
        "finished_at": now,
        "seed": 7,
        "series": 500,
        "protocols": json.dumps(["mcp/2025-11-25", "mcp/2026-07-28", "aip151/v1"]),
        "divergences": 0,
        "second_operations": 0,
        "max_receipts_per_call_node": 1,
        "advances_without_receipt": 0,
        "late_completions_advanced": 0,
        "series_per_s": 100.0,
        "passed": True,
        **overrides,
    }
    columns = ", ".join(values)
    params = ", ".join(f"CAST(:{c} AS jsonb)" if c == "protocols" else f":{c}" for c in values)
    with ledger.engine.begin() as conn:
        return int(
            conn.execute(
                text(f"INSERT INTO simulation_run ({columns}) VALUES ({params}) RETURNING id"), values
            ).scalar_one()
        )


def add_shadow(ledger: Ledger, call_node_id: str, legacy: str, longcall: str) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO shadow_comparison (call_node_id, legacy_terminal_state, "
                "longcall_terminal_state, diverged, compared_at) "
                "VALUES (:node, :legacy, :longcall, :diverged, now())"
            ),
            {"node": call_node_id, "legacy": legacy, "longcall": longcall, "diverged": legacy != longcall},
        )


def add_event(
    ledger: Ledger,
    op_id: uuid.UUID,
    kind: str,
    *,
    ago_s: float = 0.0,
    moved: tuple[S, S] | None = None,
    **detail: Any,
) -> None:
    """One event appended to the operation's series (setup only), ``ago_s`` seconds ago; ``moved``: the
    transition it records (from, to)."""
    from_state, to_state = (moved[0].value, moved[1].value) if moved is not None else (None, None)
    with ledger.engine.begin() as conn:
        seq = conn.execute(
            text("UPDATE tool_operation SET event_seq = event_seq + 1 WHERE id = :id RETURNING event_seq"),
            {"id": op_id},
        ).scalar_one()
        conn.execute(
            text(
                "INSERT INTO operation_event (op_id, seq, at, kind, from_state, to_state, detail) "
                "VALUES (:id, :seq, now() - make_interval(secs => :ago), :kind, :from_state, :to_state, "
                "CAST(:detail AS jsonb))"
            ),
            {
                "id": op_id,
                "seq": seq,
                "ago": ago_s,
                "kind": kind,
                "from_state": from_state,
                "to_state": to_state,
                "detail": json.dumps(detail),
            },
        )


def add_record(
    ledger: Ledger,
    op_id: uuid.UUID,
    *,
    opened_ago_s: float,
    resolved_ago_s: float | None,
    deadline_in_s: float,
) -> int:
    with ledger.engine.begin() as conn:
        return int(
            conn.execute(
                text(
                    "INSERT INTO reconciliation "
                    "(op_id, reason, opened_at, deadline, resolved_at, resolution) "
                    "VALUES (:id, 'SUBMISSION_UNKNOWN', now() - make_interval(secs => :opened), "
                    "now() + make_interval(secs => :deadline), "
                    "CASE WHEN CAST(:resolved AS float8) IS NULL THEN NULL "
                    "ELSE now() - make_interval(secs => CAST(:resolved AS float8)) END, "
                    "CASE WHEN CAST(:resolved AS float8) IS NULL THEN NULL ELSE 'found' END) RETURNING id"
                ),
                {"id": op_id, "opened": opened_ago_s, "deadline": deadline_in_s, "resolved": resolved_ago_s},
            ).scalar_one()
        )


def cancelled_after(ledger: Ledger, seconds: float) -> Operation:
    """An operation whose cancel was requested ``seconds`` ago and whose cancelled receipt is accepted now."""
    op = place(ledger, S.CANCEL_REQUESTED)
    add_event(ledger, op.id, "cancel_requested", ago_s=seconds)
    ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.CANCELLED))
    return op


def delivered(ledger: Ledger) -> Operation:
    """A completed operation whose downstream advance is dispatched."""
    op = place(ledger, S.FETCHING_RESULT)
    ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    ledger.drain_outbox(lambda message: None)
    return op


def meter(client: redis.Redis, settings: Settings, server: str, bucket: Budget, requests: int) -> None:
    """``requests`` charges counted by the workers' own meter (the real Lua script on the real Redis)."""
    count = RequestMeter(client, f"{settings.broker_keyprefix}longcall:", server, bucket)
    for _ in range(requests):
        count()


def good_evidence(ledger: Ledger, settings: Settings, client: redis.Redis) -> None:
    """A ledger and Redis on which every criterion passes."""
    add_simulation(ledger)
    add_shadow(ledger, "shadow/same", "completed", "completed")
    cancelled_after(ledger, 3.0)
    delivered(ledger)
    resolved = place(ledger, S.WORKING)
    add_record(ledger, resolved.id, opened_ago_s=120, resolved_ago_s=60, deadline_in_s=600)
    fine = place(ledger, S.WORKING)
    for kind in ("create_attempted", "create_refused_before_work", "create_attempted"):
        add_event(ledger, fine.id, kind)  # a create refused before any work, then sent once: one operation
    add_event(ledger, fine.id, "created", remote_id=fine.remote_id)
    meter(client, settings, "reports", "poll", 1)
    meter(client, settings, "exports", "control", 2)


# ------------------------------------------------------------------------------------------------ tests


def test_every_criterion_passes_on_good_evidence(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    good_evidence(ledger, settings, redis_client)
    report = evaluate_gate(ledger, settings, redis_client)
    assert report.passed, report.to_json()
    criteria = {c.name: c for c in report.criteria}
    assert all(c.behind == [] for c in report.criteria)
    assert "shadow: 0 of 1 compared diverged" in criteria["terminal-state divergence"].measured
    assert "reports poll 1/s of 2 (0.50)" in criteria["poll amplification"].measured
    assert "exports control 2/s of 5 (0.40)" in criteria["poll amplification"].measured
    assert criteria["cancel confirmation p99"].measured.startswith("3.")
    assert "100.0 % (2 of 2 dispatched advances)" in criteria[NAMES[-1]].measured


def test_without_a_simulation_run_the_gate_says_the_evidence_is_missing_and_does_not_pass(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    criteria = gate(ledger, settings, redis_client)
    divergence = criteria["terminal-state divergence"]
    assert not divergence.passed
    assert divergence.verdict == "no evidence"
    assert "no simulation run yet" in divergence.measured
    assert divergence.behind == []
    assert divergence.missing == ["no simulation run yet: run longcall gate simulate"]
    assert all(c.passed for name, c in criteria.items() if name != "terminal-state divergence")


def test_a_shadow_divergence_or_a_diverging_simulation_fails_naming_the_call_node_and_the_run(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    add_simulation(ledger, finished_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1), divergences=3)
    newest = add_simulation(ledger)
    add_shadow(ledger, "shadow/differs", "completed", "failed")
    add_shadow(ledger, "shadow/same", "cancelled", "cancelled")
    criterion = gate(ledger, settings, redis_client)["terminal-state divergence"]
    assert not criterion.passed
    assert criterion.behind == ["call node shadow/differs (legacy completed, longcall failed)"]
    assert f"simulation #{newest}" in criterion.measured  # the newest run is the one read
    with ledger.engine.begin() as conn:
        conn.execute(text("DELETE FROM shadow_comparison WHERE diverged"))
    add_simulation(ledger, divergences=2, seed=99, passed=False)
    criterion = gate(ledger, settings, redis_client)["terminal-state divergence"]
    assert not criterion.passed
    assert criterion.behind == [f"simulation #{newest + 1} (seed 99): 2 divergences"]


def test_a_second_create_or_a_second_remote_id_is_a_second_operation_named_by_op(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    add_simulation(ledger)
    twice = place(ledger, S.WORKING)
    add_event(ledger, twice.id, "create_attempted")
    add_event(ledger, twice.id, "create_attempted")  # no refusal, no proof between: a second create sent
    rebound = place(ledger, S.WORKING)
    add_event(ledger, rebound.id, "create_attempted")
    add_event(ledger, rebound.id, "created", remote_id="task-first")  # the row now holds another id
    proved = place(ledger, S.WORKING)  # a lost create, proved never created, then resubmitted: legitimate
    add_event(ledger, proved.id, "create_attempted")
    add_event(ledger, proved.id, "created", remote_id="task-gone")
    add_event(ledger, proved.id, "resolved_never_created")
    add_event(ledger, proved.id, "create_attempted")
    add_event(ledger, proved.id, "created", remote_id=proved.remote_id)
    criterion = gate(ledger, settings, redis_client)["second operations from duplicate submissions"]
    assert not criterion.passed
    assert criterion.measured.startswith("ledger: 2 in 3 operations")
    named = " ".join(criterion.behind)
    assert str(twice.id) in named
    assert str(rebound.id) in named
    assert str(proved.id) not in named
    assert len(criterion.behind) == 2


def test_a_simulation_with_a_second_operation_fails_the_criterion(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    add_simulation(ledger, second_operations=1, seed=5)
    criterion = gate(ledger, settings, redis_client)["second operations from duplicate submissions"]
    assert not criterion.passed
    assert len(criterion.behind) == 1
    assert "seed 5" in criterion.behind[0]


def test_poll_amplification_over_a_budget_fails_naming_the_server_and_class(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    add_simulation(ledger)
    meter(redis_client, settings, "reports", "poll", 6)  # poll_qps 2: at least 3 in one second
    meter(redis_client, settings, "exports", "poll", 3)  # poll_qps 10: well within
    criterion = gate(ledger, settings, redis_client)["poll amplification"]
    assert not criterion.passed
    assert len(criterion.behind) == 1
    assert criterion.behind[0].startswith("reports poll: ")
    assert criterion.behind[0].endswith("budget 2/s")


def test_the_peak_outlives_the_per_second_counters_and_redis_unreadable_fails(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    add_simulation(ledger)
    meter(redis_client, settings, "reports", "control", 6)  # control_qps 4
    prefix = f"{settings.broker_keyprefix}longcall:"
    seconds = list(redis_client.scan_iter(match=f"{prefix}rate:{{s:reports}}:control:*"))
    assert seconds
    redis_client.delete(*seconds)  # the 15 s counters are gone: the hour's peak remains (kept a week)
    [peak] = list(redis_client.scan_iter(match=f"{prefix}ratemax:{{s:reports}}:control:*"))
    assert 6 * 86_400 < int(redis_client.ttl(peak)) <= 7 * 86_400
    assert not gate(ledger, settings, redis_client)["poll amplification"].passed
    nowhere = redis.Redis(port=support.free_port(), socket_connect_timeout=1)
    try:
        criterion = gate(ledger, settings, nowhere)["poll amplification"]
    finally:
        nowhere.close()
    assert not criterion.passed
    assert "Redis cannot be read" in criterion.measured


def test_slow_and_unconfirmed_cancels_fail_the_p99_naming_the_operations(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    add_simulation(ledger)
    quick = cancelled_after(ledger, 2.0)
    slow = cancelled_after(ledger, 120.0)
    criterion = gate(ledger, settings, redis_client)["cancel confirmation p99"]
    assert not criterion.passed
    assert criterion.measured.startswith("120.")
    assert len(criterion.behind) == 1
    assert str(slow.id) in criterion.behind[0]
    assert str(quick.id) not in " ".join(criterion.behind)
    with ledger.engine.begin() as conn:
        conn.execute(text("DELETE FROM operation_event WHERE op_id = :id"), {"id": slow.id})
    assert gate(ledger, settings, redis_client)["cancel confirmation p99"].passed
    pending = place(ledger, S.CANCEL_REQUESTED)
    add_event(ledger, pending.id, "cancel_requested", ago_s=90.0)  # never confirmed: counted by its age
    criterion = gate(ledger, settings, redis_client)["cancel confirmation p99"]
    assert not criterion.passed
    assert "still open" in criterion.measured
    assert (
        f"op {pending.id} (call node {pending.call_node_id}, reports, no receipt yet, CANCEL_REQUESTED)"
        in (criterion.behind[0])
    )


def test_old_and_overdue_unknowns_fail_naming_the_operations(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    add_simulation(ledger)
    slow = place(ledger, S.WORKING)
    add_record(ledger, slow.id, opened_ago_s=1500, resolved_ago_s=100, deadline_in_s=-600)  # 23 min
    criteria = gate(ledger, settings, redis_client)
    assert not criteria["UNKNOWN reconciliation age p99"].passed
    assert str(slow.id) in criteria["UNKNOWN reconciliation age p99"].behind[0]
    assert criteria["UNKNOWN past its deadline"].passed  # resolved: late, but no longer waiting
    late = place(ledger, S.MANUAL_RECONCILIATION)
    record = add_record(ledger, late.id, opened_ago_s=60, resolved_ago_s=None, deadline_in_s=-1)
    criterion = gate(ledger, settings, redis_client)["UNKNOWN past its deadline"]
    assert not criterion.passed
    assert criterion.behind[0].startswith(f"op {late.id} (record {record}, SUBMISSION_UNKNOWN, deadline ")
    stuck = place(ledger, S.SUBMISSION_UNKNOWN)  # no record (AIP-151 looks it up itself): counted by age
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET updated_at = now() - interval '20 minutes' WHERE id = :id"),
            {"id": stuck.id},
        )
    criterion = gate(ledger, settings, redis_client)["UNKNOWN reconciliation age p99"]
    assert f"op {stuck.id} (SUBMISSION_UNKNOWN, reports)" in " ".join(criterion.behind)


def test_an_unknown_resolved_without_an_operator_counts_with_its_age_and_an_operator_one_once(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    """An AIP-151 create whose answer was lost goes SUBMISSION_UNKNOWN and is found by its request id, with
    no reconciliation record: that UNKNOWN's age (into SUBMISSION_UNKNOWN to out of it) counts even after it
    ended. (Before: only an operation still in SUBMISSION_UNKNOWN counted, so a 20-minute UNKNOWN vanished
    from the gate the moment it resolved.) An UNKNOWN handed to an operator counts once, by its record."""
    add_simulation(ledger)
    slow = place(ledger, S.WORKING)
    add_event(ledger, slow.id, "submission_unknown", ago_s=1300, moved=(S.SUBMITTING, S.SUBMISSION_UNKNOWN))
    add_event(ledger, slow.id, "found_by_key", ago_s=100, moved=(S.SUBMISSION_UNKNOWN, S.WORKING))
    quick = place(ledger, S.WORKING)
    add_event(ledger, quick.id, "submission_unknown", ago_s=30, moved=(S.SUBMITTING, S.SUBMISSION_UNKNOWN))
    add_event(ledger, quick.id, "found_by_key", ago_s=28, moved=(S.SUBMISSION_UNKNOWN, S.WORKING))
    operator = place(ledger, S.WORKING)
    add_event(ledger, operator.id, "submission_unknown", ago_s=61, moved=(S.SUBMITTING, S.SUBMISSION_UNKNOWN))
    add_event(
        ledger,
        operator.id,
        "manual_reconciliation",
        ago_s=60,
        moved=(S.SUBMISSION_UNKNOWN, S.MANUAL_RECONCILIATION),
    )
    add_record(ledger, operator.id, opened_ago_s=60, resolved_ago_s=10, deadline_in_s=840)
    criterion = gate(ledger, settings, redis_client)["UNKNOWN reconciliation age p99"]
    assert not criterion.passed
    assert criterion.measured.startswith("1200.")  # each event's now() is its own transaction's
    assert " s over 3 " in criterion.measured  # slow, quick, and the operator's record (not its episode)
    [named] = criterion.behind
    assert named.startswith(f"op {slow.id} (SUBMISSION_UNKNOWN, reports, resolved: found_by_key): 1200.")


def test_an_advance_that_does_not_carry_its_receipt_fails_naming_the_outbox_row(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    add_simulation(ledger)
    good = delivered(ledger)
    bad = delivered(ledger)
    with ledger.engine.begin() as conn:
        outbox_id = conn.execute(
            text(
                "UPDATE outbox SET payload = "
                "jsonb_set(payload, '{receipt,receipt_id}', to_jsonb(CAST(:other AS text))) "
                "WHERE op_id = :id RETURNING id"
            ),
            {"id": bad.id, "other": str(uuid.uuid4())},
        ).scalar_one()
    criterion = gate(ledger, settings, redis_client)[NAMES[-1]]
    assert not criterion.passed
    assert criterion.measured.startswith("50.0 % (1 of 2 dispatched advances)")
    assert criterion.behind == [f"outbox {outbox_id} (op {bad.id})"]
    assert str(good.id) not in " ".join(criterion.behind)
    shadow = place(ledger, S.FETCHING_RESULT)
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE tool_operation SET routing = 'shadow', on_terminal = NULL, on_input = NULL "
                "WHERE id = :id"
            ),
            {"id": shadow.id},
        )
    ledger.accept_terminal(shadow.id, evidence_for(shadow, TerminalKind.COMPLETED))
    ledger.drain_outbox(lambda message: None)
    measured = gate(ledger, settings, redis_client)[NAMES[-1]].measured
    assert measured.startswith("50.0 % (1 of 2 dispatched advances)")  # a shadow row advances nothing
    add_simulation(ledger, late_completions_advanced=1, seed=11)
    assert any("seed 11" in b for b in gate(ledger, settings, redis_client)[NAMES[-1]].behind)


def test_a_long_list_behind_a_failure_is_capped_with_and_n_more(
    ledger: Ledger, settings: Settings, redis_client: redis.Redis
) -> None:
    add_simulation(ledger)
    for index in range(BEHIND_LIMIT + 3):
        add_shadow(ledger, f"shadow/{index:02}", "completed", "cancelled")
    behind = gate(ledger, settings, redis_client)["terminal-state divergence"].behind
    assert len(behind) == BEHIND_LIMIT + 1
    assert behind[0].startswith("call node shadow/00 ")
    assert behind[-1] == "and 3 more"


def test_the_command_prints_a_table_or_json_and_exits_non_zero_when_a_criterion_fails(
    cli_env: None,
    ledger: Ledger,
    settings: Settings,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli.console, "width", 400)  # one line per criterion: the names stay whole
    code, output = run("gate", "--json")
    assert code == EXIT_REFUSED, output
    data = json.loads(output)
    assert set(data) == {"passed", "verdict", "criteria"}
    assert (data["passed"], data["verdict"]) == (False, "missing evidence")
    assert [c["name"] for c in data["criteria"]] == list(NAMES)
    for c in data["criteria"]:
        assert set(c) == {"name", "measured", "target", "passed", "behind", "missing", "verdict"}
    code, output = run("gate")
    assert code == EXIT_REFUSED  # a gate without its evidence does not pass: no rollout on it
    assert "FAIL" not in output
    assert "no evidence" in output
    assert "gate: MISSING EVIDENCE: no simulation run yet: run longcall gate simulate" in output

    good_evidence(ledger, settings, redis_client)
    code, output = run("gate")
    assert code == 0, output
    assert "gate: PASSED" in output
    assert "FAIL" not in output
    code, output = run("gate", "--json")
    assert code == 0, output
    assert json.loads(output)["passed"] is True


def test_a_real_fleet_run_with_an_mcp_and_an_aip151_server_passes_the_gate(
    fleet_parts: FleetParts, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Operations on both protocols (completed, failed, one cancelled on each) through real workers at low
    QPS; the meter's peaks, the cancel lags and the dispatched advances are the run's own. The simulation
    run row is the one evidence set up here (``longcall gate simulate`` writes it in production)."""
    with running_aip_fleet(
        fleet_parts,
        # Low budgets: poll_qps 3. (control_qps below 4 = one slot per 250 ms dispatch tick stalls an AIP-151
        # cancel: see test_an_aip151_cancel_on_a_slow_control_budget_ends.)
        exports={"poll_qps": 3, "control_qps": 5},
    ) as aip_fleet:
        fleet = aip_fleet.fleet
        ledger = fleet.ledger
        fleet.submit("n/mcp-done", "slow_report", {"seconds": 0.5})
        fleet.submit("n/mcp-failed", "slow_report", {"seconds": 0.3, "fail": True})
        mcp_long = fleet.submit("n/mcp-cancel", "slow_report", {"seconds": 60})
        aip_fleet.submit("n/aip-done", args(0.5))
        aip_fleet.submit("n/aip-failed", args(0.3, "error"))
        aip_long = aip_fleet.submit("n/aip-cancel", args(60))
        fleet.wait_state(mcp_long, S.WORKING)
        fleet.wait_state(aip_long, S.WORKING)
        fleet.send("longcall.cancel", op_id=str(mcp_long))
        fleet.send("longcall.cancel", op_id=str(aip_long))
        for node in (
            "n/mcp-done",
            "n/mcp-failed",
            "n/mcp-cancel",
            "n/aip-done",
            "n/aip-failed",
            "n/aip-cancel",
        ):
            fleet.wait_receipt(node, timeout=60)
        support.wait_for(
            "every advance dispatched",
            lambda: ledger.ready_outbox_count() == 0 or None,
            timeout=30,
        )
        add_simulation(ledger, seed=20261201)
        settings = Settings(
            database_url=fleet_parts.database_url,
            redis_url=fleet_parts.redis_url,
            broker_keyprefix=fleet_parts.broker_prefix,
            config=Path(fleet.env["LONGCALL_CONFIG"]),
        )
        report: GateReport = evaluate_gate(ledger, settings, fleet.redis)
        assert report.passed, report.to_json()
        criteria = {c.name: c for c in report.criteria}
        amplification = criteria["poll amplification"].measured
        assert f"{AIP_SERVER} poll " in amplification
        assert "reports poll " in amplification
        assert f"{AIP_SERVER} poll 0/s" not in amplification  # the run's own polls were metered
        assert "over 2" in criteria["cancel confirmation p99"].measured
        assert "(6 of 6 dispatched advances)" in criteria[NAMES[-1]].measured
        for name, value in (
            ("LONGCALL_DATABASE_URL", settings.database_url),
            ("LONGCALL_REDIS_URL", settings.redis_url),
            ("LONGCALL_BROKER_KEYPREFIX", settings.broker_keyprefix),
            ("LONGCALL_CONFIG", str(settings.config)),
        ):
            monkeypatch.setenv(name, value)
        code, output = run("gate")
        assert code == 0, output
        with capsys.disabled():  # the table the note quotes
            Console(width=250).print(launch_gate_table(report.to_json()))


def test_an_aip151_cancel_on_a_slow_control_budget_ends(fleet_parts: FleetParts) -> None:
    with running_aip_fleet(fleet_parts, exports={"poll_qps": 3, "control_qps": 2}) as aip_fleet:
        fleet = aip_fleet.fleet
        op_id = aip_fleet.submit("n/aip-slow-cancel", args(60))
        fleet.wait_state(op_id, S.WORKING)
        fleet.send("longcall.cancel", op_id=str(op_id))
        try:
            receipt = fleet.wait_receipt("n/aip-slow-cancel", timeout=30)
        finally:
            cancels = len(aip_fleet.requests("CancelOperation"))
        assert receipt["terminal_state"] == "cancelled"
        assert cancels == 1
