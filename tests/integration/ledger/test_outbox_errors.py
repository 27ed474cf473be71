"""What ``drain_outbox`` records of a failed publish (``outbox.last_error``): an operator reading it learns
what failed, and never a credential.

A broker that is down makes kombu raise ``OperationalError`` with no text at all; recorded as
``f"{type}: {exc}"`` that was ``"OperationalError: "``. Real Postgres.
"""

from __future__ import annotations

import uuid

import pytest
from kombu.exceptions import OperationalError
from sqlalchemy import text

from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests.support.ledger_rows import evidence_for, place


def _last_error(ledger: Ledger, failure: BaseException) -> str:
    op = place(ledger, OpState.FETCHING_RESULT)
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))

    def broken(_: object) -> None:
        raise failure

    report = ledger.drain_outbox(broken)
    assert report.failed == (acceptance.outbox_id,)
    with ledger.engine.connect() as conn:
        row = conn.execute(
            text("SELECT attempts, last_error FROM outbox WHERE op_id = :id"), {"id": op.id}
        ).one()
    assert row.attempts == 1
    return str(row.last_error)


def test_a_publish_failure_without_text_is_recorded_by_its_repr(ledger: Ledger) -> None:
    error = _last_error(ledger, OperationalError())
    assert error == "OperationalError: OperationalError()"


@pytest.mark.parametrize("scheme", ["amqp", "redis"])
def test_a_publish_failure_is_recorded_by_its_first_line_with_no_password(
    ledger: Ledger, scheme: str
) -> None:
    secret = uuid.uuid4().hex
    failure = OperationalError(
        f"Error 111 connecting to {scheme}://guest:{secret}@broker:5672//. Connection refused.\n"
        "Traceback (most recent call last): ..."
    )
    error = _last_error(ledger, failure)
    assert secret not in error
    masked = f"{scheme}://guest:***@broker:5672//"
    assert error == f"OperationalError: Error 111 connecting to {masked}. Connection refused."
