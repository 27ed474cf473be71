"""What ``longcall dev`` shows: the live progress table, the receipts, the fleet's addresses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from ledger.states import OpState

FINAL = {OpState.ACCEPTED, OpState.CANCELLED_ACCEPTED}
_STATE_STYLE = {
    OpState.ACCEPTED: "green",
    OpState.CANCELLED_ACCEPTED: "yellow",
    OpState.MANUAL_RECONCILIATION: "bold red",
    OpState.INPUT_REQUIRED: "bold magenta",
    OpState.CANCEL_REQUESTED: "yellow",
    OpState.SUBMISSION_UNKNOWN: "red",
}


@dataclass(frozen=True)
class ProgressRow:
    #: The call's name in the demo (its call node id less the run's prefix, which the title shows).
    name: str
    what: str
    state: OpState | None
    polls: int
    elapsed_s: float
    note: str = ""


@dataclass(frozen=True)
class ReceiptRow:
    call_node_id: str
    terminal_state: str
    result_digest: str | None
    summary: str


def progress_table(rows: Sequence[ProgressRow], title: str) -> Table:
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("call", no_wrap=True)
    table.add_column("what", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("polls", justify="right")
    table.add_column("elapsed", justify="right")
    table.add_column("note")
    for row in rows:
        state = "-" if row.state is None else row.state.value
        style = _STATE_STYLE.get(row.state) if row.state is not None else "dim"
        table.add_row(
            row.name,
            row.what,
            f"[{style}]{state}[/]" if style else state,
            str(row.polls),
            f"{row.elapsed_s:5.1f}s",
            row.note,
        )
    return table


def short_digest(digest: str | None) -> str:
    """The first 16 hex characters after the algorithm (enough to match a receipt by eye or in a test)."""
    if digest is None:
        return "-"
    algorithm, _, value = digest.rpartition(":")
    return f"{algorithm}:{value[:16]}" if algorithm else value[:16]


def receipts_table(rows: Sequence[ReceiptRow]) -> Table:
    table = Table(title="Receipts (from the ledger)", title_justify="left")
    table.add_column("call node", no_wrap=True)
    table.add_column("terminal", no_wrap=True)
    table.add_column("result digest", no_wrap=True)
    table.add_column("result")
    for row in rows:
        table.add_row(row.call_node_id, row.terminal_state, short_digest(row.result_digest), row.summary)
    return table


def print_lines(console: Console, lines: Sequence[tuple[str, str]]) -> None:
    width = max((len(label) for label, _ in lines), default=0)
    for label, value in lines:
        console.print(f"  {label.ljust(width)}  {value}", highlight=False, soft_wrap=True)
