"""Issue 22, item 11: ``longcall dev``'s table reads at 80 columns and shows an ended call by its receipt's
terminal state (a failed call as failed, not ACCEPTED); its ports and its Flower password are the same on
every start on one data directory, unless asked otherwise."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest
from rich.console import Console

from console.dev.display import ProgressRow, progress_table
from console.dev.fleet import Kept
from console.dev.services import DevError, free_port
from ledger.states import OpState

ROWS = [
    ProgressRow(
        "lost-create",
        "report 4.5s, answer lost",
        OpState.MANUAL_RECONCILIATION,
        3,
        12.0,
        "operator: found 1f0c2a9b",
    ),
    ProgressRow("report-08", "report 12s", OpState.WORKING, 17, 9.4),
    ProgressRow("report-fails", "report 3s, fails", OpState.ACCEPTED, 4, 3.2, terminal="failed"),
    ProgressRow(
        "cancel-me",
        "report 120s, cancel",
        OpState.CANCELLED_ACCEPTED,
        2,
        5.1,
        "cancel sent at 3.0s",
        terminal="cancelled",
    ),
    ProgressRow("approval", "asks for approval", OpState.INPUT_REQUIRED, 1, 2.0, "answered: approved=true"),
]


def rendered(width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(progress_table(ROWS, "longcall dev demo (call nodes dev/20261205T100000/...)"))
    return console.export_text()


def test_the_table_fits_80_columns_one_line_per_call() -> None:
    text = rendered(80)
    assert max(len(line) for line in text.splitlines()) <= 80
    for row in ROWS:
        [line] = [
            x for x in text.splitlines() if x.lstrip().startswith(row.name)
        ]  # its state on its own line
        assert ("failed" if row.name == "report-fails" else row.name) in line


def test_an_ended_call_shows_its_receipt_s_terminal_state() -> None:
    text = rendered(80)
    [failed] = [x for x in text.splitlines() if x.lstrip().startswith("report-fails")]
    assert "failed" in failed
    assert "ACCEPTED" not in text
    [cancelled] = [x for x in text.splitlines() if x.lstrip().startswith("cancel-me")]
    assert "cancelled" in cancelled


def test_the_ports_and_the_password_are_kept_for_the_next_start(tmp_path: Path) -> None:
    path = tmp_path / "dev.json"
    first = Kept(path)
    ports = {part: first.port(part, {}) for part in ("redis", "demo", "flower", "metrics")}
    first.flower_password = "kept-password"
    first.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds a password

    again = Kept(path)
    assert {part: again.port(part, {}) for part in ports} == ports
    assert again.flower_password == "kept-password"

    asked = free_port()
    assert Kept(path).port("flower", {"flower": asked}) == asked

    with socket.socket() as taken:  # the kept port is in use now: another one, not a failed start
        taken.bind(("127.0.0.1", ports["metrics"]))
        taken.listen()
        assert Kept(path).port("metrics", {}) != ports["metrics"]
        with pytest.raises(DevError, match=f"metrics port {ports['metrics']} is in use"):
            Kept(path).port("metrics", {"metrics": ports["metrics"]})
