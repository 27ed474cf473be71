"""``longcall list``: what is in flight, or with filters what ended, one line per operation (like ``temporal
workflow list`` or ``celery inspect active``)."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from console.common import console, open_ledger
from console.output import elapsed
from ledger.records import LISTED_AT_MOST
from ledger.states import FINAL_STATES, OpState

if TYPE_CHECKING:
    from ledger.listing import OperationLine

__all__ = ["list_", "parse_since"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_STATES = {s.value.lower(): s for s in OpState}


def parse_since(value: str, *, now: dt.datetime | None = None) -> dt.datetime:
    """``--since``: a duration back from now (``90s``, ``10m``, ``2h``, ``7d``) or an ISO 8601 time (a time
    without a zone is UTC)."""
    now = now or dt.datetime.now(dt.UTC)
    if match := _DURATION.match(value.strip()):
        return now - dt.timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    try:
        moment = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither a duration (90s, 10m, 2h, 7d) nor an ISO 8601 time", param_hint="--since"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


def _states(values: Sequence[str]) -> set[OpState] | None:
    """``--state``: none given, the states in flight (None); ``all``, every state; else the states named
    (any case), an unknown one refused with the list of known ones."""
    if not values:
        return None
    chosen: set[OpState] = set()
    for value in values:
        for name in value.split(","):
            key = name.strip().lower()
            if key == "all":
                return set(OpState)
            if key == "final":
                chosen |= FINAL_STATES
            elif key in _STATES:
                chosen.add(_STATES[key])
            else:
                known = ", ".join(sorted(s.value for s in OpState))
                raise click.BadParameter(
                    f"unknown state {name!r}; one of: {known}, final, all", param_hint="--state"
                )
    return chosen


@click.command("list")
@click.option(
    "--state",
    "states",
    multiple=True,
    help="Only these states (repeat or comma-separate; any case; 'final' for the ended ones, 'all' for every"
    " state). Default: the operations in flight.",
)
@click.option("--server", default=None, help="Only this server's operations.")
@click.option(
    "--since", default=None, help="Only those created since: a duration (10m, 2h, 7d) or an ISO time."
)
@click.option(
    "--limit",
    type=click.IntRange(1, LISTED_AT_MOST),
    default=50,
    show_default=True,
    help="At most this many, the newest first.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON array.")
def list_(states: tuple[str, ...], server: str | None, since: str | None, limit: int, as_json: bool) -> None:
    """List operations: by default what is in flight, newest first, with age, polls and the last error."""
    wanted = _states(states)
    start = parse_since(since) if since is not None else None
    now = dt.datetime.now(dt.UTC)
    with open_ledger() as ledger:
        lines = ledger.list_operations(states=wanted, server=server, since=start, limit=limit)
    rows = [as_row(line, now) for line in lines]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        filtered = wanted is not None or server is not None or start is not None
        console.print("no operation matches" if filtered else "no operation in flight")
        return
    wide = console.width >= WIDE
    console.print(table(rows, wide=wide))
    if errors := ([] if wide else error_lines(rows)):
        console.print("\nlast errors:", style="bold")
        for line in errors:
            console.print(line, highlight=False, markup=False)
    if len(rows) == limit:
        console.print(f"(the newest {limit}; --limit to see more)")


def as_row(line: OperationLine, now: dt.datetime) -> dict[str, Any]:
    """One line as ``--json`` prints it (times in ISO 8601, the age in seconds)."""

    def iso(moment: dt.datetime | None) -> str | None:
        return moment.isoformat() if moment is not None else None

    return {
        "op_id": str(line.op_id),
        "call_node_id": line.call_node_id,
        "server": line.server,
        "protocol": line.protocol,
        "state": line.state.value,
        "server_state": line.server_state,
        "status_message": line.status_message,
        "remote_id": line.remote_id,
        "created_at": iso(line.created_at),
        "updated_at": iso(line.updated_at),
        "age_s": round((now - line.created_at).total_seconds(), 1),
        "unchanged_polls": line.unchanged_polls,
        "last_polled_at": iso(line.last_polled_at),
        "next_poll_at": iso(line.next_poll_at),
        "last_error": line.last_error,
        "last_error_kind": line.last_error_kind,
        "last_error_at": iso(line.last_error_at),
    }


#: How much of an op id the table shows (``longcall status`` and the other commands take such a prefix when
#: it names one operation; ``--json`` prints the whole id).
SHORT_ID = 8


#: The width from which the last error is a column; on a narrower terminal it is a line under the table.
WIDE = 120


def table(rows: Sequence[dict[str, Any]], *, wide: bool = True) -> Table:
    """No borders: only the call node folds (rather than be cut: it is the pipeline's own id), and the last
    error wraps. ``wide``: the server and the last error as columns; else the server is left out (``--server``
    filters, ``--json`` has it) and the last errors are :func:`error_lines`, under the table."""
    out = Table(box=None, padding=(0, 1), header_style="bold", pad_edge=False)
    out.add_column("op", no_wrap=True)
    out.add_column("call node", overflow="fold", min_width=12)
    if wide:
        out.add_column("server", no_wrap=True)
    out.add_column("state", no_wrap=True)
    out.add_column("server\nstate", no_wrap=True)
    out.add_column("age", no_wrap=True, justify="right")
    out.add_column("polls", no_wrap=True, justify="right")
    if wide:
        out.add_column("last error", min_width=16, ratio=1)
    for row in rows:
        cells = [
            row["op_id"][:SHORT_ID],
            row["call_node_id"],
            *([row["server"]] if wide else []),
            row["state"],
            row["server_state"] or "",
            elapsed(row["age_s"]),
            str(row["unchanged_polls"]),
        ]
        out.add_row(*cells, *([_error(row)] if wide else []))
    return out


def error_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The last errors of ``rows`` (those that have one), a line each under its op: a narrow terminal's."""
    return [f"{row['op_id'][:SHORT_ID]}  {_error(row)}" for row in rows if row["last_error"]]


def _error(row: dict[str, Any]) -> str:
    error = row["last_error"]
    return f"{row['last_error_kind']}: {error}" if error else ""
