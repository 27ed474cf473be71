"""The beat's drain reads a backlog of large receipts a part at a time (rule 9, nothing lost; bounded memory).

A receipt carries its whole result, up to ``max_result_bytes`` (8 MiB by default). After a broker outage the
outbox holds every receipt of the outage, and the beat's drain used to read ``limit`` ready rows at once,
payloads included: 200 receipts of 8 MiB each in one worker's memory. Now the drain reads the ready rows'
ids and stored sizes first, and the whole rows within ``ledger.outbox.DRAIN_STORED_BYTES`` (here a small
``max_bytes``); the rest is published by the next drains, each row once. Real Postgres.
"""

from __future__ import annotations

import base64
import os
import uuid

from sqlalchemy import text

from ledger.records import OutboxMessage
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests.support.ledger_rows import evidence_for, place

#: One large receipt's result: random bytes as base64, which Postgres cannot compress much.
RESULT_CHARS = 300_000


def large_receipt(ledger: Ledger) -> tuple[uuid.UUID, int]:
    op = place(ledger, OpState.FETCHING_RESULT)
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert acceptance.outbox_id is not None
    filler = base64.b64encode(os.urandom(RESULT_CHARS * 3 // 4)).decode()
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox SET payload = jsonb_set(payload, '{filler}', to_jsonb(CAST(:f AS text)))"
                " WHERE id = :id"
            ),
            {"f": filler, "id": acceptance.outbox_id},
        )
    return op.id, acceptance.outbox_id


def stored_bytes(ledger: Ledger, outbox_id: int) -> int:
    with ledger.engine.connect() as conn:
        size = conn.execute(
            text("SELECT pg_column_size(payload) FROM outbox WHERE id = :id"), {"id": outbox_id}
        ).scalar_one()
    return int(size)


def test_a_backlog_of_large_receipts_is_drained_a_part_at_a_time_each_row_once(ledger: Ledger) -> None:
    rows = [large_receipt(ledger)[1] for _ in range(5)]
    sizes = [stored_bytes(ledger, r) for r in rows]
    assert min(sizes) > RESULT_CHARS * 0.9, sizes  # stored nearly whole: the budget below counts them
    budget = sizes[0] + sizes[1] + sizes[2] // 2  # two rows and a half

    published: list[list[int]] = []
    for _ in range(5):
        batch: list[int] = []

        def publish(message: OutboxMessage, into: list[int] = batch) -> None:
            assert len(message.payload["filler"]) == RESULT_CHARS  # published whole
            into.append(message.id)

        report = ledger.drain_outbox(publish, limit=200, max_bytes=budget)
        assert list(report.dispatched) == batch
        published.append(batch)
        if not batch:
            break

    assert published[:3] == [rows[0:2], rows[2:4], rows[4:5]]
    assert published[3:] == [[]]
    assert ledger.ready_outbox_count() == 0


def test_a_receipt_larger_than_the_budget_is_drained_alone(ledger: Ledger) -> None:
    first, second = (large_receipt(ledger)[1] for _ in range(2))
    sent: list[int] = []
    ledger.drain_outbox(lambda m: sent.append(m.id), limit=200, max_bytes=1000)
    assert sent == [first]
    ledger.drain_outbox(lambda m: sent.append(m.id), limit=200, max_bytes=1000)
    assert sent == [first, second]
