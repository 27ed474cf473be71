"""The dispatcher's messages (issue 21): polls of WORKING operations of one server share a message, up to
``poll_batch``; every other step is a message of its own, sent first; a batch's id is its members'."""

from __future__ import annotations

import uuid

from ledger.states import OpState
from workers.steps.dispatch import Dispatch, messages


def _poll(server: str, delay_s: float = 0.0, state: OpState = OpState.WORKING) -> Dispatch:
    return Dispatch("longcall.poll", uuid.uuid4(), 7, delay_s, server, state)


def test_polls_of_one_server_share_a_message_up_to_the_batch_size() -> None:
    polls = [_poll("a") for _ in range(5)] + [_poll("b") for _ in range(2)]

    sent = messages(polls, poll_batch=2)

    assert [m.size for m in sent] == [2, 2, 1, 2]
    assert [m.task for m in sent] == ["longcall.poll"] * 4
    batched = [tuple(op[0] for op in m.kwargs["ops"]) for m in sent if "ops" in m.kwargs]
    assert {op for ops in batched for op in ops} | {
        m.kwargs["op_id"] for m in sent if "op_id" in m.kwargs
    } == {str(d.op_id) for d in polls}
    single = next(m for m in sent if m.size == 1)
    assert single.kwargs == {"op_id": single.kwargs["op_id"], "cursor": 7}  # a batch of one: the old form
    assert single.task_id.startswith("longcall.poll:")
    assert ":batch:" not in single.task_id


def test_other_steps_are_single_messages_and_go_first() -> None:
    cancel = Dispatch("longcall.cancel", uuid.uuid4(), 3, 0.0, "a", OpState.CANCEL_REQUESTED)
    fetch = Dispatch("longcall.fetch_result", uuid.uuid4(), 4, 0.0, "a", OpState.TERMINAL_OBSERVED)
    create = Dispatch("longcall.poll", uuid.uuid4(), 5, 0.0, "a", OpState.SUBMITTING)
    polls = [_poll("a"), _poll("a")]

    sent = messages([*polls, cancel, fetch, create], poll_batch=32)

    assert [m.task_id for m in sent[:3]] == [cancel.task_id, fetch.task_id, create.task_id]
    assert sent[3].size == 2
    assert len(sent) == 4


def test_a_batch_of_one_is_todays_message() -> None:
    polls = [_poll("a"), _poll("b")]

    assert [(m.kwargs, m.task_id) for m in messages(polls, poll_batch=1)] == [
        ({"op_id": str(d.op_id), "cursor": 7}, d.task_id) for d in polls
    ]
    assert [m.kwargs for m in messages(polls, poll_batch=32)] == [
        {"op_id": str(d.op_id), "cursor": 7} for d in polls
    ]


def test_a_batch_goes_with_its_earliest_countdown_and_each_member_waits_the_rest() -> None:
    late, soon, now = _poll("a", 0.2), _poll("a", 0.05), _poll("a", 0.0)

    [sent] = messages([late, soon, now], poll_batch=32)

    assert sent.countdown is None  # the earliest is due now
    assert sent.kwargs["ops"] == [
        [str(now.op_id), 7],
        [str(soon.op_id), 7, 0.05],
        [str(late.op_id), 7, 0.2],
    ]
    [later] = messages([late, soon], poll_batch=32)
    assert later.countdown == 0.05
    assert later.kwargs["ops"] == [[str(soon.op_id), 7], [str(late.op_id), 7, 0.15]]


def test_the_same_batch_has_the_same_id_whatever_its_order() -> None:
    polls = [_poll("a", 0.01 * i) for i in range(4)]

    ids = {m.task_id for m in messages(polls, poll_batch=32)} | {
        m.task_id for m in messages(list(reversed(polls)), poll_batch=32)
    }

    assert len(ids) == 1
    [task_id] = ids
    lead = min(polls, key=lambda d: str(d.op_id))
    assert task_id == f"longcall.poll:batch:{lead.op_id}:7:4"
