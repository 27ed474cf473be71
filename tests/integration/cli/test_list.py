"""Issue 22, item 5: ``longcall list``, what is in flight (and with filters what ended), against a real
ledger: newest first, the last error each operation's steps recorded, every filter, ``--json``, and a clear
refusal of a filter it cannot read."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from console.listing import parse_since
from console.main import main
from console.output import elapsed
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Operation
from ledger.repository import Ledger
from ledger.side_rows import append_event
from ledger.states import OpState
from tests.support.ledger_rows import place


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["list", *args], catch_exceptions=False)
    return result.exit_code, result.output


def listed(*args: str) -> list[dict[str, Any]]:
    code, out = run("--json", *args)
    assert code == 0, out
    return json.loads(out)  # type: ignore[no-any-return]


def record_error(ledger: Ledger, op: Operation, kind: EventKind, error: str) -> None:
    with ledger.engine.begin() as conn:
        seq = conn.execute(
            text("UPDATE tool_operation SET event_seq = event_seq + 1 WHERE id = :id RETURNING event_seq"),
            {"id": op.id},
        ).scalar_one()
        append_event(conn, op, seq=seq, kind=kind, from_state=op.state.value, detail={"error": error})


@pytest.fixture
def operations(ledger: Ledger) -> dict[str, Operation]:
    """Four operations, created in this order: done, working (two errors, the newer one shown), waiting
    for input, and working on another server."""
    made = {}
    for name, state in (
        ("done", OpState.ACCEPTED),
        ("working", OpState.WORKING),
        ("input", OpState.INPUT_REQUIRED),
        ("exports", OpState.WORKING),
    ):
        made[name] = place(ledger, state)
    record_error(ledger, made["working"], EventKind.POLL_FAILED, "ReadTimeout: the server took 30 s")
    record_error(ledger, made["working"], EventKind.RATE_LIMITED, "429 Too Many Requests (Retry-After 2)")
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET server = 'exports' WHERE id = :id"), {"id": made["exports"].id}
        )
        conn.execute(
            text("UPDATE tool_operation SET unchanged_polls = 7 WHERE id = :id"), {"id": made["working"].id}
        )
    return made


def test_the_default_is_what_is_in_flight_newest_first_with_its_last_error(
    cli_env: None, operations: dict[str, Operation]
) -> None:
    rows = listed()
    assert [r["op_id"] for r in rows] == [str(operations[n].id) for n in ("exports", "input", "working")]
    working = rows[2]
    assert (working["state"], working["unchanged_polls"]) == ("WORKING", 7)
    assert (working["last_error_kind"], working["last_error"]) == (
        "rate_limited",
        "429 Too Many Requests (Retry-After 2)",
    )
    assert rows[0]["last_error"] is None
    assert all(r["age_s"] >= 0 for r in rows)

    code, out = run()
    assert code == 0, out
    # A table at 80 columns (the runner's width): each operation's short op id and state on one line, no
    # line wider; the last errors under it, a line each.
    assert max(len(line) for line in out.splitlines()) <= 80, out
    shown, _, errors = out.partition("\nlast errors:\n")
    for name, state in (("working", "WORKING"), ("input", "INPUT_REQUIRED"), ("exports", "WORKING")):
        [line] = [x for x in shown.splitlines() if str(operations[name].id)[:8] in x]
        assert state in line, out
    assert str(operations["done"].id)[:8] not in out
    short = str(operations["working"].id)[:8]
    assert f"{short}  rate_limited: 429 Too Many Requests (Retry-After 2)" in errors.splitlines(), out


def test_the_short_op_id_the_table_shows_finds_its_operation(
    cli_env: None, operations: dict[str, Operation]
) -> None:
    op = operations["working"]
    result = CliRunner().invoke(main, ["status", str(op.id)[:8], "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["op_id"] == str(op.id)
    unknown = CliRunner().invoke(main, ["status", "ffffffff"], catch_exceptions=False)
    assert unknown.exit_code != 0
    assert "no operation with op id" in unknown.output


def test_each_filter_narrows_the_list(cli_env: None, operations: dict[str, Operation]) -> None:
    assert [r["op_id"] for r in listed("--state", "final")] == [str(operations["done"].id)]
    both = listed("--state", "working,input_required")
    assert {r["op_id"] for r in both} == {str(operations[n].id) for n in ("working", "input", "exports")}
    assert len(listed("--state", "all")) == 4
    assert [r["server"] for r in listed("--server", "exports")] == ["exports"]
    assert [r["op_id"] for r in listed("--limit", "1")] == [str(operations["exports"].id)]
    assert len(listed("--since", "1h")) == 3
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()
    assert listed("--since", later) == []
    code, out = run("--since", later)
    assert (code, out.strip()) == (0, "no operation matches")
    code, out = run("--limit", "1")
    assert "the newest 1; --limit to see more" in out


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--state", "running"), "unknown state 'running'; one of: "),
        (("--since", "yesterday"), "'yesterday' is neither a duration"),
        (("--limit", "0"), "0 is not in the range"),
    ],
)
def test_a_filter_it_cannot_read_is_refused_in_one_line(
    cli_env: None, args: tuple[str, ...], said: str
) -> None:
    code, out = run(*args)
    assert code == 2
    assert said in out


def test_an_empty_fleet_says_so(cli_env: None, ledger: Ledger) -> None:
    code, out = run()
    assert (code, out.strip()) == (0, "no operation in flight")


def test_since_reads_durations_and_times_and_age_reads_at_a_glance() -> None:
    now = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.UTC)
    assert parse_since("90s", now=now) == now - dt.timedelta(seconds=90)
    assert parse_since("2h", now=now) == now - dt.timedelta(hours=2)
    assert parse_since("2026-12-05T10:00:00", now=now) == dt.datetime(2026, 12, 5, 10, tzinfo=dt.UTC)
    assert [elapsed(s) for s in (5, 425, 11_520, 187_200)] == ["5s", "7m05s", "3h12m", "2d04h"]


# ------------------------------------------------------- item 6: status like a describe, watch's progress


def test_status_says_how_long_how_often_what_failed_last_and_what_waits_for_an_operator(
    cli_env: None, ledger: Ledger, operations: dict[str, Operation]
) -> None:
    op = operations["working"]
    record = ledger.open_reconciliation(
        op.id, ReconciliationReason.UNKNOWN_NOT_FOUND, deadline=dt.timedelta(seconds=-1)
    )
    result = CliRunner().invoke(main, ["status", str(op.id), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["duration_s"] >= 0
    assert data["polls"]["unchanged"] == 7
    assert (data["last_error"]["kind"], data["last_error"]["error"]) == (
        "rate_limited",
        "429 Too Many Requests (Retry-After 2)",
    )
    [shown] = data["open_reconciliations"]
    assert (shown["id"], shown["reason"], shown["overdue"]) == (record.id, "UNKNOWN_NOT_FOUND", True)
    assert data["receipt"] is None
    assert data["delivery"] is None

    table = CliRunner().invoke(main, ["status", str(op.id)], catch_exceptions=False)
    assert table.exit_code == 0, table.output
    for said in (
        "duration",
        "7 unchanged",
        "last error",
        "rate_limited",
        f"reconciliation {record.id}",
        "OVERDUE",
    ):
        assert said in table.output, table.output


def test_watch_shows_the_server_s_progress_between_events(cli_env: None, ledger: Ledger) -> None:
    op = place(ledger, OpState.WORKING)

    def move_on() -> None:
        time.sleep(0.6)
        with ledger.engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE tool_operation SET server_state = 'working', status_message = 'page 3 of 10',"
                    " unchanged_polls = 4 WHERE id = :id"
                ),
                {"id": op.id},
            )

    updater = threading.Thread(target=move_on)
    updater.start()
    result = CliRunner().invoke(
        main, ["watch", str(op.id), "--timeout", "3", "--json"], catch_exceptions=False
    )
    updater.join(timeout=10)
    assert result.exit_code == 4, result.output  # still WORKING when the timeout came
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    progress = [line["progress"] for line in lines if "progress" in line]
    assert len(progress) == 1, lines
    assert (progress[0]["status_message"], progress[0]["unchanged_polls"]) == ("page 3 of 10", 4)
