"""The oracle: each series' one correct outcome, from its timeline and actions alone (never from the
executor, never from the scripted server's record).

The rules it applies are the protocol's (DESIGN §5), stated on the series' tick clock: the driver runs one
step per tick, a create answered "slow down" is made again on the next tick, a worker that died between
the create attempt and its answer is replaced on the next tick, a client's cancel reaches the server in the
tick it is made (when there is a remote operation to cancel), and the server's task ends ``term_tick``
ticks after it was created. A late completion from a fenced execution epoch (``old_epoch_tick``) changes
nothing: the outcome is the one the series would have without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from console.simulation.series import Series

Outcome = Literal["completed", "failed", "cancelled", "manual"]

#: Create faults after which the server may have made the task and the answer never came back.
UNKNOWN_CREATE = ("lost_503", "lost_cut", "crash_before", "crash_after")


@dataclass(frozen=True)
class Expected:
    outcome: Outcome
    #: Operations the server must hold for the call node at the end (0 or 1: never a second one).
    tasks: int
    why: str


def expect(series: Series) -> Expected:
    s = series
    if s.cancel_tick == -1:
        return Expected("cancelled", 0, "cancelled before any create was attempted: no create is made")
    if s.protocol in ("mcp", "mcp-ext") and s.create_fault in UNKNOWN_CREATE:
        # Neither MCP generation has an idempotency key: an unknown create outcome cannot be looked up
        # (rule 2).
        tasks = 0 if s.create_fault == "crash_before" else 1
        return Expected(
            "manual", tasks, "MCP create outcome unknown: an operator decides (SUBMISSION_UNKNOWN)"
        )
    # The tick the server made the one task: a 429 is made again next tick; a crash before the create
    # was sent is looked up next tick by repeating the create with the same request id (AIP-155).
    created = 1 if s.create_fault in ("429", "429_retry_after", "crash_before") else 0
    if (
        s.create_fault in ("429", "429_retry_after")
        and s.cancel_tick is not None
        and s.cancel_tick <= created
    ):
        return Expected("cancelled", 0, "the cancel came while the create was still to be made again")
    term = created + s.term_tick
    cancel_hits = s.cancel_tick is not None and s.cancel_tick < term
    if s.protocol == "mcp":
        if cancel_hits and not s.cancel_ack_lost:
            return Expected("cancelled", 1, "MCP: the tasks/cancel answer is the evidence of the cancel")
        if s.expiry == "before_seen":
            return Expected("manual", 1, "the task was gone before its end was read (UNKNOWN_NOT_FOUND)")
        if cancel_hits:
            return Expected("cancelled", 1, "MCP: cancel ACK lost; the server holds the task cancelled")
        return Expected(s.terminal, 1, "the server's end, read and fetched")
    # AIP-151 and the MCP tasks extension: a cancel is acknowledged only; the outcome comes from polling.
    if s.expiry == "before_seen":
        return Expected("manual", 1, "the operation was gone before its end was read (UNKNOWN_NOT_FOUND)")
    if cancel_hits and s.cancel_policy == "honour":
        return Expected("cancelled", 1, "the server ended the task cancelled after the cancel")
    return Expected(s.terminal, 1, "the server's end (a completion that won the race included)")
