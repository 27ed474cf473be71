"""Input rounds of the MCP tasks extension (rule 10, DESIGN §7): one round is the set of outstanding
``inputRequests``; a key any earlier round answered is neither asked nor sent again, while the server (its
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
from workers.steps.input_rounds import answered_already, stored_request, unanswered_part

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


def operation(
    stored: InputRequest | None,
    *,
    round_: int = 1,
    failed: bool = False,
    replied: bool = True,
    answered_before: tuple[str, ...] = (),
) -> Operation:
    """WORKING after round ``round_`` asked ``stored``: its reply stored (``replied``; refused by the
    server: ``failed``), the keys of earlier rounds answered ``answered_before``."""
    now = dt.datetime.now(dt.UTC)
    values: dict[str, Any] = {field.name: None for field in dataclasses.fields(Operation)}
    stored_json = (
        None
        if stored is None
        else {
            **stored.to_json(),
            **({"reply_failed": True} if failed else {}),
            **({"answered_keys": list(answered_before)} if answered_before else {}),
        }
    )
    reply: dict[str, Any] = {
        "input_round": round_,
        "response": {},
        "recorded_at": now.isoformat(),
        "sent_at": now.isoformat(),
        "attempts": 1,
        "last_error": None,
        **({"given_up": True} if failed else {}),
    }
    values.update(
        id=uuid.uuid4(),
        state=OpState.WORKING,
        input_round=round_,
        input_request=stored_json,
        input_reply=reply if replied and stored is not None else None,
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


def test_a_round_nobody_answered_is_asked_whole_again() -> None:
    """Round 1 went to an operator unanswered (its deadline passed), who found the task alive and still
    asking: its keys were never answered, so they are asked again, not taken for answered."""
    first = shown(a=elicit("a"), b=elicit("b"))
    op = operation(first, replied=False)
    assert not answered_already(op, first)
    assert unanswered_part(op, first) == first


def test_a_key_answered_two_rounds_back_is_not_asked_again() -> None:
    """Round 1 answered ``a``, round 2 ``b``; the server's ack lags, and a poll shows ``a`` again beside a
    new ``c``: round 3 asks ``c`` only, and ``a`` and ``b`` shown alone are no round at all."""
    round_1 = operation(shown(a=elicit("a")))
    round_2_request = unanswered_part(round_1, shown(a=elicit("a"), b=elicit("b")))
    assert round_2_request is not None
    kept = stored_request(round_1, round_2_request)
    assert kept["answered_keys"] == ["a"]
    round_2 = operation(round_2_request, round_=2, answered_before=("a",))
    assert answered_already(round_2, shown(a=elicit("a"), b=elicit("b")))
    assert answered_already(round_2, shown(a=elicit("a")))
    part = unanswered_part(round_2, shown(a=elicit("a"), c=elicit("c")))
    assert part is not None
    assert list(part.params) == ["c"]
    assert stored_request(round_2, part)["answered_keys"] == ["a", "b"]


def test_after_a_refused_reply_only_its_own_keys_are_open_again() -> None:
    """Round 2's reply (``b``) was refused by the server: ``b`` is open again, ``a`` (round 1's) is not."""
    op = operation(shown(b=elicit("b")), round_=2, failed=True, answered_before=("a",))
    part = unanswered_part(op, shown(a=elicit("a"), b=elicit("b")))
    assert part is not None
    assert list(part.params) == ["b"]
