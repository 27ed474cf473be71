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


#: An ended operation's receipt, as the table shows it.
_TERMINAL_STYLE = {"completed": "green", "failed": "bold red", "cancelled": "yellow"}
#: The states as the table writes them: short enough for 80 columns.
_STATE_TEXT = {
    OpState.MANUAL_RECONCILIATION: "OPERATOR",
    OpState.SUBMISSION_UNKNOWN: "UNKNOWN",
    OpState.CANCEL_REQUESTED: "CANCELLING",
    OpState.INPUT_REQUIRED: "INPUT",
    OpState.FETCHING_RESULT: "FETCHING",
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
    #: The receipt's terminal state once it has one (completed, failed, cancelled): what the row shows
    #: then, not the ledger's ACCEPTED.
    terminal: str | None = None


def state_text(row: ProgressRow) -> str:
    """The state column: the receipt's terminal state once there is one, else the operation's state."""
    if row.terminal is not None:
        return f"[{_TERMINAL_STYLE.get(row.terminal, 'green')}]{row.terminal}[/]"
    if row.state is None:
        return "[dim]-[/]"
    text = _STATE_TEXT.get(row.state, row.state.value)
    style = _STATE_STYLE.get(row.state)
    return f"[{style}]{text}[/]" if style else text


@dataclass(frozen=True)
class ReceiptRow:
    call_node_id: str
    terminal_state: str
    result_digest: str | None
    summary: str


def progress_table(rows: Sequence[ProgressRow], title: str) -> Table:
    """One line per call, 80 columns wide at most: the long texts (what, note) wrap, never the state."""
    table = Table(title=title, title_justify="left", expand=False, box=None, padding=(0, 1))
    table.add_column("call", no_wrap=True)
    table.add_column("what", max_width=20)
    table.add_column("state", no_wrap=True)
    table.add_column("polls", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("note", max_width=24)
    for row in rows:
        table.add_row(
            row.name,
            row.what,
            state_text(row),
            str(row.polls),
            f"{row.elapsed_s:4.0f}s",
            row.note,
        )
    return table


def short_digest(digest: str | None) -> str:
    """The first 16 hex characters after the algorithm (enough to match a receipt by eye or in a test)."""
    if digest is None:
        return "-"
    algorithm, _, value = digest.rpartition(":")
    return f"{algorithm}:{value[:16]}" if algorithm else value[:16]


def receipts_table(rows: Sequence[ReceiptRow], prefix: str = "") -> Table:
    """One line per call, read at 80 columns: a call node by its name less ``prefix`` (the title shows it)."""
    title = "Receipts (from the ledger" + (f"; call nodes {prefix}...)" if prefix else ")")
    table = Table(title=title, title_justify="left")
    table.add_column("call" if prefix else "call node", no_wrap=True)
    table.add_column("terminal", no_wrap=True)
    table.add_column("result digest", no_wrap=True)
    table.add_column("result")
    for row in rows:
        name = row.call_node_id.removeprefix(prefix)
        table.add_row(name, row.terminal_state, short_digest(row.result_digest), row.summary)
    return table


def print_lines(console: Console, lines: Sequence[tuple[str, str]]) -> None:
    width = max((len(label) for label, _ in lines), default=0)
    for label, value in lines:
        console.print(f"  {label.ljust(width)}  {value}", highlight=False, soft_wrap=True)
