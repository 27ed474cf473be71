"""Issue 22, items 1 and 2, on a real fleet: a pipeline's ``client.call(..., then=...)`` continues with the
receipt once the operation has ended (a chain's rest runs once, a group's members each once), and what the
fleet sends its ``then`` and ``on_input`` tasks is what ``client.Receipt`` and ``client.InputRequest`` say,
keys and types.

Real processes (longcall's MCP server, longcall workers, beat, a pipeline worker), real Postgres and Redis.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from celery import chain, group

from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet
from workers import client


def record_any(fleet: Fleet) -> Any:
    return fleet.pipeline.signature("pipeline.record_any", queue="pipeline")


def entries_of(fleet: Fleet, call_node_id: str) -> list[dict[str, Any]]:
    """The pipeline's ``record_any`` calls that belong to ``call_node_id``: those given its receipt, and those
    given (as a chain's next link) the task id of one of them."""
    calls = [d for d in fleet.deliveries() if "args" in d]
    mine = [d for d in calls if d["kwargs"].get("receipt", {}).get("call_node_id") == call_node_id]
    ids = {d["task_id"] for d in mine}
    return mine + [d for d in calls if d["args"] and d["args"][0] in ids]


def outbox_dispatched(fleet: Fleet, call_node_id: str) -> bool:
    op = fleet.ledger.find_by_call_node(call_node_id)
    return op is not None and all(row.status == "dispatched" for row in fleet.ledger.outbox_for(op.id))


def test_then_as_a_chain_runs_its_rest_once_with_the_receipt(fleet: Fleet) -> None:
    then = chain(record_any(fleet), record_any(fleet))
    sig = client.call(
        "n/chain",
        server="reports",
        tool="slow_report",
        arguments={"seconds": 1},
        then=then,
        app=fleet.pipeline,
    )
    answer = sig.apply_async().get(timeout=30)
    assert answer["created"] is True

    support.wait_for("the chain's two links", lambda: len(entries_of(fleet, "n/chain")) >= 2, timeout=40)
    support.wait_for("the receipt's outbox row dispatched", lambda: outbox_dispatched(fleet, "n/chain"))
    first, second = entries_of(fleet, "n/chain")
    assert (first["args"], first["kwargs"]["receipt"]["terminal_state"]) == ([], "completed")
    # The next link gets what the first returned (its task id), nothing else: the chain ran once.
    assert (second["args"], second["kwargs"]) == ([first["task_id"]], {})


def test_then_as_a_group_gives_each_member_the_receipt_once(fleet: Fleet) -> None:
    then = group(record_any(fleet), record_any(fleet))
    sig = client.call(
        "n/group",
        server="reports",
        tool="slow_report",
        arguments={"seconds": 1},
        then=then,
        app=fleet.pipeline,
    )
    sig.apply_async().get(timeout=30)

    support.wait_for("the group's two members", lambda: len(entries_of(fleet, "n/group")) >= 2, timeout=40)
    support.wait_for("the receipt's outbox row dispatched", lambda: outbox_dispatched(fleet, "n/group"))
    members = entries_of(fleet, "n/group")
    assert len(members) == 2
    assert members[0]["task_id"] != members[1]["task_id"]
    assert members[0]["kwargs"]["receipt"] == members[1]["kwargs"]["receipt"]


def conforms(value: Any, hint: Any) -> bool:
    """``value`` (as JSON decoded it) is of the type ``hint`` names."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is dict:
        return isinstance(value, dict)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def mismatches(sent: dict[str, Any], shape: Any) -> list[str]:
    hints = typing.get_type_hints(shape)
    wrong = [
        f"{key}: {sent.get(key)!r} is not {hints[key]}"
        for key in hints
        if not conforms(sent.get(key), hints[key])
    ]
    missing = sorted(set(hints) - set(sent))
    extra = sorted(set(sent) - set(hints))
    return wrong + [f"missing {key}" for key in missing] + [f"not in the TypedDict: {key}" for key in extra]


def test_what_the_fleet_sends_is_what_the_typed_client_says(fleet: Fleet) -> None:
    sink = fleet.pipeline.signature("pipeline.record", queue="pipeline")
    calls: dict[str, tuple[str, dict[str, Any]]] = {
        "n/typed-done": ("slow_report", {"seconds": 1}),
        "n/typed-cancelled": ("slow_report", {"seconds": 60}),
        "n/typed-input": ("ask_approval", {"question": "Ship it?"}),
    }
    for node, (tool, arguments) in calls.items():
        sig = client.call(
            node,
            server="reports",
            tool=tool,
            arguments=arguments,
            then=sink,
            on_input=sink,
            app=fleet.pipeline,
        )
        sig.apply_async().get(timeout=30)
    fleet.wait_operation("n/typed-cancelled", OpState.WORKING)
    client.cancel(call_node_id="n/typed-cancelled", app=fleet.pipeline).apply_async().get(timeout=30)

    [request] = support.wait_for("the input request", lambda: fleet.input_requests() or None, timeout=40)
    assert mismatches(request, client.InputRequest) == []
    answer = client.provide_input(
        request["op_id"],
        request["input_round"],
        {"action": "accept", "content": {"approved": True}},
        app=fleet.pipeline,
    )
    answer.apply_async().get(timeout=30)

    for node, state in (
        ("n/typed-done", "completed"),
        ("n/typed-cancelled", "cancelled"),
        ("n/typed-input", "completed"),
    ):
        receipt = fleet.wait_receipt(node, timeout=40)
        assert receipt["terminal_state"] == state
        assert mismatches(receipt, client.Receipt) == [], node
