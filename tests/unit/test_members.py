"""A batch's members run side by side (``workers/members.py``), each with its own log context."""

from __future__ import annotations

import threading
import uuid

from workers import logs
from workers.members import run_side_by_side


def test_members_run_at_once_each_in_its_own_log_context_answers_in_order() -> None:
    ids = [uuid.uuid4() for _ in range(8)]
    # Every member waits for all the others: only members running at once get past it (bounded: a member
    # run one after another fails the wait instead of hanging).
    together = threading.Barrier(len(ids), timeout=10)

    def member(op_id: uuid.UUID) -> tuple[str | None, str | None]:
        with logs.bind(op_id, f"node-{op_id}"):
            together.wait()
            return logs.current()

    seen = run_side_by_side(member, ids, threads=len(ids))

    assert seen == [(str(op_id), f"node-{op_id}") for op_id in ids]
    assert logs.current() == (None, None)  # the caller's context is untouched


def test_a_single_member_runs_in_the_callers_thread() -> None:
    caller = threading.get_ident()

    assert run_side_by_side(lambda _: threading.get_ident(), [1], threads=4) == [caller]
