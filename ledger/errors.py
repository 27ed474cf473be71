"""The ledger's exception tree. Every refusal says what was expected and what was found.

LedgerError
├── IllegalTransition    a programming error: an edge the state table does not have (never retried)
├── OperationNotFound    no such operation
├── StaleTransition      a guarded write matched zero rows: the writer's view is out of date (rule 5)
├── CallNodeConflict     the call node already runs a different request (rule 1)
├── AdmissionClosed      new operations are refused (executor_control.admission_open)
├── AdapterDisabled      new operations for this adapter are refused (executor_control.disabled_adapters)
├── UnstorableResult     a result the ledger cannot store and give back exactly (never retried)
└── LegacyOutcomeRefused a shadow comparison's legacy outcome that cannot be recorded (ledger/shadow.py)

Not ledger failures, so outside ``LedgerError`` (an ``except LedgerError`` never swallows them):

NotJson (ValueError)     a value with no exact JSON form (ledger/digests.py): the caller's value is at fault
NotAdmitted (Exception)  an admission that routes the call node nowhere (ledger/routing.py): raised by the
                         admission (``workers.submission.NotRouted``), recorded, raised again after the commit

Raised *to* the ledger: :class:`PublishUnavailable`, by which an outbox publisher (``workers/delivery.py``)
says the broker is out of reach; the drain paces the row without counting the attempt (``ledger/outbox.py``).

Not raised by the ledger but by its driver, listed here because only the ledger knows its driver:
:data:`UNAVAILABLE`, what a call raises when Postgres is out of reach or went away mid-statement.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

__all__ = [
    "UNAVAILABLE",
    "AdapterDisabled",
    "AdmissionClosed",
    "CallNodeConflict",
    "CallNodeNotRouted",
    "IllegalTransition",
    "LedgerError",
    "LegacyOutcomeRefused",
    "NotAdmitted",
    "NotJson",
    "OperationNotFound",
    "PublishRefusedForGood",
    "PublishUnavailable",
    "StaleTransition",
    "UnstorableResult",
]


#: What a ledger call raises when Postgres is out of reach or went away mid-statement: a restart or a
#: failover (connection refused, "terminating connection due to administrator command", "the database
#: system is starting up", a write refused by a server that is no primary: ``ledger.engine
#: .no_primary_is_a_disconnect``), a connection the server or the network closed, a pool that found no
#: connection in time, a statement cancelled by its timeout. What the call was to record may or may not
#: have committed (a COMMIT whose answer was lost): a caller that tries again meets the ledger's own answer
#: to a repeat (the same call node's operation, a stale write refused by its fence, an intent already
#: recorded), never a second effect.
if TYPE_CHECKING:
    UNAVAILABLE: tuple[type[Exception], ...]


def __getattr__(name: str) -> Any:
    """:data:`UNAVAILABLE`, built when first asked for: the errors are SQLAlchemy's and psycopg's, and a
    command that only names a state (``longcall --help``, ``status --help``) does not import either."""
    if name != "UNAVAILABLE":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import psycopg  # noqa: PLC0415
    import sqlalchemy.exc  # noqa: PLC0415

    unavailable: tuple[type[Exception], ...] = (
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        sqlalchemy.exc.TimeoutError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )
    globals()["UNAVAILABLE"] = unavailable
    return unavailable


class LedgerError(Exception):
    """Base of every error the ledger raises on purpose."""


class IllegalTransition(LedgerError, ValueError):
    """A programming error: the code asked for an edge the state table does not have."""


class OperationNotFound(LedgerError):
    def __init__(self, op_id: uuid.UUID | str) -> None:
        super().__init__(f"no operation {op_id} in the ledger")
        self.op_id = op_id


class StaleTransition(LedgerError):
    """A guarded write matched zero rows: the writer's view (state, epoch, generation, cursor) is out of date.

    The rejection was recorded as an ``operation_event`` (kind ``stale_write_rejected``) and nothing else
    changed.
    """

    def __init__(self, op_id: uuid.UUID, attempted: str, expected: dict[str, Any], found: dict[str, Any]):
        differs = sorted(k for k in expected if k in found and expected[k] != found[k])
        super().__init__(
            f"stale write to operation {op_id} ({attempted}) refused: "
            + ", ".join(f"{k} expected {expected[k]!r} found {found[k]!r}" for k in differs)
        )
        self.op_id = op_id
        self.attempted = attempted
        self.expected = expected
        self.found = found


class CallNodeConflict(LedgerError):
    """The call node already has an operation for a different request (rule 1)."""

    def __init__(self, call_node_id: str, existing_digest: str, new_digest: str) -> None:
        super().__init__(
            f"call node {call_node_id!r} already has an operation for a different request "
            f"(existing request digest {existing_digest}, this one {new_digest}); a call node runs exactly "
            "one request: use a new call_node_id for a different request"
        )
        self.call_node_id = call_node_id


class CallNodeNotRouted(LedgerError):
    """The call node was answered "not routed" by the canary (its decision kept): it runs on the caller's
    legacy path, and longcall has nothing of it to cancel."""

    def __init__(self, call_node_id: str, percent: float) -> None:
        super().__init__(
            f"call node {call_node_id!r} is outside the canary (decided at {percent:g} %): it runs on the "
            "caller's legacy path, and longcall has nothing of it to cancel"
        )
        self.call_node_id = call_node_id
        self.percent = percent


class AdmissionClosed(LedgerError):
    def __init__(self) -> None:
        super().__init__("admission of new operations is closed (executor_control.admission_open is false)")


class AdapterDisabled(LedgerError):
    def __init__(self, protocol: str, protocol_version: str) -> None:
        super().__init__(
            f"the {protocol} {protocol_version} adapter is disabled for new operations "
            "(executor_control.disabled_adapters)"
        )


class UnstorableResult(LedgerError):
    """A result the ledger cannot store and give back exactly: not JSON (NaN, an infinity, a lone
    surrogate), refused by ``jsonb`` (a ``\\u0000`` in a string), or too large. ``why`` says which."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class LegacyOutcomeRefused(LedgerError):
    """A legacy outcome that cannot be recorded: its call node runs live (longcall's receipt is its only
    outcome), or a different legacy outcome was recorded for it already. Nothing was written."""


class NotJson(ValueError):
    """A value that has no exact JSON form (NaN, infinities, non-string keys, arbitrary objects)."""


class NotAdmitted(Exception):
    """Raised by an admission that routes the call node nowhere (``workers.submission.NotRouted``): the
    submission records the decision, writes nothing else and raises it again after the commit."""


class PublishRefusedForGood(Exception):
    """Raised by an outbox publisher for a message that can never be published (a downstream signature whose
    ``expires`` date has passed): the drain dead-letters its row at once, with this reason, instead of
    spending its ``outbox_max_attempts`` on it (rule 9)."""


class PublishUnavailable(Exception):
    """Raised by an outbox publisher when the broker is out of reach (a connection refused, reset or timed
    out, a broker restarting), as opposed to a broker that refused the message: the row is not at fault, so
    the drain paces it and stops, and the attempt does not count toward ``outbox_max_attempts`` (rule 9).
    The broker's own error is its ``__cause__``."""
