"""Input rounds of the MCP tasks extension (rule 10, DESIGN §7): one round is the set of outstanding
``inputRequests``; a key the last round answered is neither asked nor sent again, while the server (its
``tasks/update`` ack is eventually consistent) may still show it."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from typing import Any

from adapters import InputRequest
from adapters.mcp_2026_07_28.wire import parse_task
from ledger.records import Operation
from ledger.states import OpState
from workers.steps.input_rounds import answered_already, unanswered_part

TASK = "tsk-1"


def elicit(message: str) -> dict[str, Any]:
    return {
        "method": "elicitation/create",
        "params": {"message": message, "requestedSchema": {"type": "object"}},
    }


def shown(**requests: dict[str, Any]) -> InputRequest:
    status = parse_task({"taskId": TASK, "status": "input_required", "inputRequests": requests})
    assert status.input_request is not None
    return status.input_request


def operation(stored: InputRequest | None, *, round_: int = 1, failed: bool = False) -> Operation:
    now = dt.datetime.now(dt.UTC)
    values: dict[str, Any] = {field.name: None for field in dataclasses.fields(Operation)}
    stored_json = (
        None if stored is None else {**stored.to_json(), **({"reply_failed": True} if failed else {})}
    )
    values.update(
        id=uuid.uuid4(),
        state=OpState.WORKING,
        input_round=round_,
        input_request=stored_json,
        remote_id=TASK,
        protocol="mcp",
        protocol_version="2026-07-28",
        created_at=now,
        updated_at=now,
    )
    return Operation(**values)


def test_the_answered_round_shown_again_is_not_a_new_round() -> None:
    first = shown(a=elicit("a"), b=elicit("b"))
    op = operation(first)
    assert answered_already(op, shown(b=elicit("b"), a=elicit("a")))
    assert answered_already(op, shown(a=elicit("a")))  # partly applied already


def test_a_new_key_beside_an_answered_one_opens_a_round_of_the_new_key_only() -> None:
    op = operation(shown(a=elicit("a")))
    request = shown(a=elicit("a"), c=elicit("c"))
    assert not answered_already(op, request)
    part = unanswered_part(op, request)
    assert part is not None
    assert list(part.params) == ["c"]
    assert part.request_id == '["c"]'
    assert part.schema == {"c": {"type": "object"}}


def test_after_a_failed_reply_the_keys_are_open_again() -> None:
    first = shown(a=elicit("a"))
    op = operation(first, failed=True)
    assert not answered_already(op, first)
    assert unanswered_part(op, first) == first


def test_the_first_round_is_asked_whole() -> None:
    request = shown(a=elicit("a"))
    op = operation(None, round_=0)
    assert not answered_already(op, request)
    assert unanswered_part(op, request) == request
