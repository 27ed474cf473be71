"""Entry points for the race tests' child processes (spawned: each has its own interpreter and pool)."""

from __future__ import annotations

import time
import uuid
from multiprocessing.synchronize import Barrier
from typing import Any

from ledger.records import TerminalEvidence
from ledger.repository import Ledger
from tests.support.ledger_rows import new_operation


def accept(url: str, op_id: str, evidence: TerminalEvidence, barrier: Barrier, out: Any) -> None:
    ledger = Ledger.from_url(url, pool_size=1)
    try:
        ledger.get(uuid.UUID(op_id))  # connect before the start line, so the race is the statement itself
        barrier.wait(timeout=60)
        started = time.perf_counter()
        acceptance = ledger.accept_terminal(uuid.UUID(op_id), evidence)
        out.put((acceptance.outcome, time.perf_counter() - started))
    finally:
        ledger.dispose()


def submit(url: str, call_node_id: str, barrier: Barrier, out: Any) -> None:
    ledger = Ledger.from_url(url, pool_size=1)
    try:
        ledger.control()
        barrier.wait(timeout=60)
        submission = ledger.record_submission(new_operation(call_node_id))
        out.put((str(submission.operation.id), submission.created))
    finally:
        ledger.dispose()


def drain(url: str, name: str, barrier: Barrier, out: Any) -> None:
    ledger = Ledger.from_url(url, pool_size=1)
    delivered: list[int] = []
    try:
        ledger.control()
        barrier.wait(timeout=60)
        while True:
            report = ledger.drain_outbox(lambda message: delivered.append(message.id), limit=7)
            if not report.dispatched and ledger.ready_outbox_count() == 0:
                break
        out.put((name, delivered))
    finally:
        ledger.dispose()
