"""Issue 22, items 8 and 9, on a real fleet: Flower's event stream shows the operations' tasks and none of
beat's ticks (``dispatch_due``, ``drain_outbox``, ``reconcile``: four and more a second), and an expected
refusal is one line in the worker's log with its reason, never a traceback.

Real processes (longcall's MCP server, longcall workers, beat, a pipeline worker), real Postgres and Redis;
the events are read as Flower reads them, with Celery's event receiver on the fleet's broker.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest

from tests import support
from tests.support.fleet import Fleet

TICKS = {"longcall.dispatch_due", "longcall.drain_outbox", "longcall.reconcile"}


def test_the_event_stream_shows_the_operations_tasks_and_not_beats_ticks(fleet: Fleet) -> None:
    seen: Counter[str] = Counter()
    names: dict[str, str] = {}
    ready = threading.Event()

    def on_event(event: dict[str, Any]) -> None:
        if event.get("type") == "task-received":
            names[event["uuid"]] = event["name"]
        name = names.get(event.get("uuid", ""))
        if name is not None:
            seen[name] += 1

    with fleet.pipeline.connection_for_read() as connection:
        receiver = fleet.pipeline.events.Receiver(connection, handlers={"*": on_event})

        def capture() -> None:
            ready.set()
            receiver.capture(limit=None, timeout=None, wakeup=False)

        listener = threading.Thread(target=capture, daemon=True)
        listener.start()
        ready.wait(timeout=10)
        time.sleep(1.0)  # the receiver's queue is bound before the work starts (no event to wait on for it)
        fleet.submit("n/seen", "slow_report", {"seconds": 1})
        fleet.wait_receipt("n/seen", timeout=30)
        support.wait_for(
            "the operation's task events",
            lambda: seen["longcall.submit"] > 0 and seen["longcall.poll"] + seen["longcall.fetch_result"] > 0,
            timeout=10,
        )
        receiver.should_stop = True
        listener.join(timeout=10)

    assert seen["longcall.submit"] > 0, dict(seen)
    assert seen["longcall.poll"] + seen["longcall.fetch_result"] > 0, dict(seen)
    assert not TICKS & set(seen), dict(seen)
    # The ticks did run all along (beat's schedule): the workers' logs have them.
    logs = "".join(p.log() for p in fleet.workers())
    assert "longcall.dispatch_due[" in logs


def test_an_expected_refusal_is_one_line_with_its_reason_never_a_traceback(fleet: Fleet) -> None:
    refusals: list[tuple[str, dict[str, Any]]] = [
        ("longcall.submit", {"call_node_id": "n/nowhere", "server": "nowhere", "tool": "t", "arguments": {}}),
        ("longcall.cancel", {"op_id": "00000000-0000-0000-0000-000000000001", "call_node_id": "n/x"}),
        (
            "longcall.provide_input",
            {"op_id": "not-an-id", "input_round": 1, "response": {"action": "decline"}},
        ),
    ]
    for task, kwargs in refusals:
        with pytest.raises(Exception, match=r"takes op_id|not an operation id|unknown server"):
            fleet.send(task, **kwargs)

    def expected_lines() -> list[str] | None:
        # The caller has its answer as the worker writes its log line: wait (bounded) for the three lines.
        found = [line for p in fleet.workers() for line in p.log().splitlines() if "raised expected" in line]
        return found if len(found) >= 3 else None

    expected = support.wait_for("the three refusals' log lines", expected_lines, timeout=15)
    assert len(expected) == 3, expected
    logs = "".join(p.log() for p in fleet.workers())
    assert any("call node 'n/nowhere': unknown server 'nowhere'" in line for line in expected), expected
    assert "raised unexpected" not in logs
    assert "Traceback" not in logs
