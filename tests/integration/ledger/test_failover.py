"""A Postgres failover as the ledger meets it: the server it is connected to answers as a standby (a demoted
primary, or one that DNS or a pooler still points at), refusing every write with "cannot execute ... in a
read-only transaction" (``ReadOnlySqlTransaction``). That is the database out of reach for a moment, like a
dropped connection: raised as one of ``ledger.errors.UNAVAILABLE`` (so a message sent by name, such as a
cancel, is tried again within its bound instead of failing and being acknowledged), and the pool's
connections are let go, so that once the primary is back the next write connects to it. Real Postgres: each
connection made while the "standby" lasts is read-only by default."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, text

from ledger import errors
from ledger.repository import Ledger


def test_a_write_refused_by_a_standby_is_the_ledger_out_of_reach_and_the_next_one_reaches_the_primary(
    ledger: Ledger,
) -> None:
    def as_a_standby(dbapi_connection: Any, _: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET default_transaction_read_only = on")
        dbapi_connection.commit()

    ledger.engine.dispose()
    event.listen(ledger.engine, "connect", as_a_standby)
    try:
        with pytest.raises(errors.UNAVAILABLE) as refused:
            ledger.cancel_call_node("n/failover")
        assert "read-only transaction" in str(refused.value)
    finally:
        event.remove(ledger.engine, "connect", as_a_standby)

    # The primary is back: the pool kept no connection of the standby's, so this write reaches it.
    assert ledger.cancel_call_node("n/failover") is None
    with ledger.engine.connect() as conn:
        taken = conn.execute(text("SELECT count(*) FROM call_node_cancel WHERE call_node_id = 'n/failover'"))
        assert taken.scalar_one() == 1
