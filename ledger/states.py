"""The local state machine of one tool operation, as data.

This module is pure: no I/O, no SQLAlchemy. The database CHECK constraint, the diagram in the docs and the
exhaustive transition test are all derived from (or checked against) the tables below.

Local states are longcall's own vocabulary. The protocol's word for where the remote operation stands is
kept verbatim in ``tool_operation.server_state`` and is never one of these.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from ledger.errors import IllegalTransition

__all__ = [
    "ACCEPT_FROM",
    "ACCEPT_TO",
    "CANCEL_WAITS_IN",
    "EDGES",
    "EXTENSION_EDGES",
    "FINAL_STATES",
    "NEVER_POLLED",
    "REMOTE_ID_REQUIRED",
    "SEED_EDGES",
    "TERMINAL_KNOWN",
    "IllegalTransition",  # raised here, defined with the ledger's other errors
    "OpState",
    "TerminalKind",
    "check_edges",
    "mermaid",
    "states_document",
    "successors",
]


class OpState(enum.StrEnum):
    SUBMITTING = "SUBMITTING"
    SUBMISSION_UNKNOWN = "SUBMISSION_UNKNOWN"
    NOT_FOUND_SAFE = "NOT_FOUND_SAFE"
    WORKING = "WORKING"
    INPUT_REQUIRED = "INPUT_REQUIRED"
    CANCEL_REQUESTED = "CANCEL_REQUESTED"
    TERMINAL_OBSERVED = "TERMINAL_OBSERVED"
    FETCHING_RESULT = "FETCHING_RESULT"
    MANUAL_RECONCILIATION = "MANUAL_RECONCILIATION"
    ACCEPTED = "ACCEPTED"
    CANCELLED_ACCEPTED = "CANCELLED_ACCEPTED"


class TerminalKind(enum.StrEnum):
    """What a terminal receipt records, normalized; the protocol's verbatim word stays in server_state."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = OpState

#: The seed graph of DESIGN §4: every edge the protocol needs in the ordinary course of an operation.
SEED_EDGES: Mapping[tuple[OpState, OpState], str] = {
    (S.SUBMITTING, S.WORKING): "the create call returned a queryable remote id",
    (S.SUBMITTING, S.SUBMISSION_UNKNOWN): "the create call was attempted and its answer was lost",
    (S.WORKING, S.INPUT_REQUIRED): "the server asks the client for input",
    (S.INPUT_REQUIRED, S.WORKING): "the input was delivered and the server resumed",
    (S.SUBMISSION_UNKNOWN, S.WORKING): "a lookup by submission key found the operation",
    (S.SUBMISSION_UNKNOWN, S.NOT_FOUND_SAFE): "the server proved the operation was never created",
    (S.WORKING, S.CANCEL_REQUESTED): "a cancel was requested (generation bumped first)",
    (S.INPUT_REQUIRED, S.CANCEL_REQUESTED): "a cancel was requested while the server waited for input",
    (S.WORKING, S.TERMINAL_OBSERVED): "a poll saw a terminal server state",
    (S.INPUT_REQUIRED, S.TERMINAL_OBSERVED): "the server ended the operation while waiting for input",
    (S.TERMINAL_OBSERVED, S.FETCHING_RESULT): "the result fetch started",
    (S.FETCHING_RESULT, S.ACCEPTED): "a whole result was held and accept_terminal wrote the receipt",
    (S.CANCEL_REQUESTED, S.CANCELLED_ACCEPTED): "the server confirmed the cancel (e.g. MCP tasks/cancel ok)",
    (S.CANCEL_REQUESTED, S.TERMINAL_OBSERVED): "the operation ended otherwise before the cancel took hold",
}

#: The documented extensions of DESIGN §4, each one edge with the reason it exists.
EXTENSION_EDGES: Mapping[tuple[OpState, OpState], str] = {
    (S.SUBMITTING, S.TERMINAL_OBSERVED): (
        "the create call itself returned the final answer: a definitive JSON-RPC/HTTP rejection, or a "
        "synchronous result from a server or tool without task support"
    ),
    (S.NOT_FOUND_SAFE, S.SUBMITTING): (
        "resubmission after the server proved 'never created'; allowed only here, with the same key"
    ),
    (S.FETCHING_RESULT, S.CANCELLED_ACCEPTED): (
        "the fetch found a cancelled terminal state (e.g. the cancel ACK was lost, or the server "
        "cancelled on its own); a cancelled receipt never carries a success payload"
    ),
    **{
        (source, S.MANUAL_RECONCILIATION): "no rule can decide; an operator resolves it before a deadline"
        for source in (
            S.SUBMISSION_UNKNOWN,
            S.WORKING,
            S.INPUT_REQUIRED,
            S.CANCEL_REQUESTED,
            S.FETCHING_RESULT,
        )
    },
    (S.SUBMITTING, S.CANCEL_REQUESTED): (
        "the create answered with a remote id after a cancel was requested (rule 6): the id is recorded "
        "and the cancel is sent"
    ),
    (S.SUBMISSION_UNKNOWN, S.CANCEL_REQUESTED): (
        "a lookup by submission key found the operation after a cancel was requested: the cancel is sent"
    ),
    (S.MANUAL_RECONCILIATION, S.CANCEL_REQUESTED): (
        "a cancel was requested for an operation an operator holds under a known remote id, or the "
        "operator found it after a cancel was requested: the cancel is sent"
    ),
    (S.SUBMITTING, S.CANCELLED_ACCEPTED): (
        "a cancel was requested before any create was attempted (or before the resubmission that followed "
        "a proof of 'never created'): nothing runs on the server, the receipt is cancelled, no create is made"
    ),
    (S.MANUAL_RECONCILIATION, S.WORKING): "the operator found the operation alive on the server",
    (S.MANUAL_RECONCILIATION, S.NOT_FOUND_SAFE): "the operator proved the operation was never created",
    (S.MANUAL_RECONCILIATION, S.TERMINAL_OBSERVED): "the operator found the operation ended on the server",
}

EDGES: Mapping[tuple[OpState, OpState], str] = {**SEED_EDGES, **EXTENSION_EDGES}

FINAL_STATES: frozenset[OpState] = frozenset({S.ACCEPTED, S.CANCELLED_ACCEPTED})

#: States in which the remote operation is known by its id: these rows must carry ``remote_id``.
REMOTE_ID_REQUIRED: frozenset[OpState] = frozenset({S.WORKING, S.INPUT_REQUIRED, S.CANCEL_REQUESTED})

#: States that hold an observed terminal outcome: these rows must carry ``observed_terminal``.
TERMINAL_KNOWN: frozenset[OpState] = frozenset(
    {S.TERMINAL_OBSERVED, S.FETCHING_RESULT, S.ACCEPTED, S.CANCELLED_ACCEPTED}
)

#: States that are never auto-polled: ``next_poll_at`` is NULL (rule 10 pauses polling on input).
NEVER_POLLED: frozenset[OpState] = FINAL_STATES | {S.INPUT_REQUIRED, S.NOT_FOUND_SAFE}

#: Where a terminal receipt may be accepted from, per terminal kind (rule 8).
ACCEPT_FROM: Mapping[TerminalKind, frozenset[OpState]] = {
    TerminalKind.COMPLETED: frozenset({S.FETCHING_RESULT}),
    TerminalKind.FAILED: frozenset({S.FETCHING_RESULT}),
    TerminalKind.CANCELLED: frozenset({S.FETCHING_RESULT, S.CANCEL_REQUESTED, S.SUBMITTING}),
}

#: Where a cancel request is recorded as an intent that waits, the state unchanged (rule 6): no remote
#: operation is known to cancel yet. The bumped ``cancel_generation`` is the intent: it is applied when a
#: remote operation becomes known (-> CANCEL_REQUESTED), or ends the operation cancelled without a create
#: once "never created" is proved (SUBMITTING with no create attempted -> CANCELLED_ACCEPTED).
CANCEL_WAITS_IN: frozenset[OpState] = frozenset(
    {S.SUBMITTING, S.SUBMISSION_UNKNOWN, S.NOT_FOUND_SAFE, S.MANUAL_RECONCILIATION}
)

#: The final state a receipt of each kind moves the operation to.
ACCEPT_TO: Mapping[TerminalKind, OpState] = {
    TerminalKind.COMPLETED: S.ACCEPTED,
    TerminalKind.FAILED: S.ACCEPTED,
    TerminalKind.CANCELLED: S.CANCELLED_ACCEPTED,
}


def check_edges(sources: Iterable[OpState], target: OpState) -> tuple[OpState, ...]:
    """Return ``sources`` as a tuple if every one of them has an edge to ``target``; raise otherwise."""
    sources = tuple(sources)
    if not sources:
        raise IllegalTransition(f"no source state given for a move to {target}")
    missing = [s for s in sources if (s, target) not in EDGES]
    if missing:
        raise IllegalTransition(f"no edge {', '.join(missing)} -> {target} in ledger/states.py")
    return sources


def successors(source: OpState) -> frozenset[OpState]:
    return frozenset(t for (s, t) in EDGES if s == source)


def _check_table() -> None:
    for source, target in EDGES:
        if source in FINAL_STATES:
            raise AssertionError(f"final state {source} has an outgoing edge to {target}")
    for kind, sources in ACCEPT_FROM.items():
        for source in sources:
            if (source, ACCEPT_TO[kind]) not in EDGES:
                raise AssertionError(f"acceptance of {kind} from {source} has no edge")


_check_table()


def mermaid() -> str:
    """The state diagram for the docs, generated from the table (extensions marked ``ext``)."""
    lines = ["stateDiagram-v2"]
    for source, target in EDGES:
        lines.append(f"    {source} --> {target}" + ("" if (source, target) in SEED_EDGES else ": ext"))
    lines.extend(f"    {final} --> [*]" for final in sorted(FINAL_STATES))
    return "\n".join(lines)


def states_document() -> str:
    """docs/states.md: ``python -m ledger.states > docs/states.md`` (a test checks it is current)."""
    lines = [
        "# The states of an operation",
        "",
        "Generated from `ledger/states.py` by `python -m ledger.states > docs/states.md`; do not edit.",
        "",
        "```mermaid",
        mermaid(),
        "```",
        "",
        "| from | to | kind | why |",
        "| --- | --- | --- | --- |",
    ]
    for (source, target), reason in EDGES.items():
        kind = "seed" if (source, target) in SEED_EDGES else "extension"
        lines.append(f"| {source} | {target} | {kind} | {reason} |")
    lines.append("")
    lines.append(
        f"Final: {', '.join(sorted(FINAL_STATES))}. Never polled: {', '.join(sorted(NEVER_POLLED))}."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(states_document(), end="")
