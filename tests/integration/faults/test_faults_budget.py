"""Issue 8, items 8 and 9: every HTTP request is charged to the budget of the step that sends it, and a
deadline already past never makes a row due again at once.

Measured where it counts: the demo MCP server's own logs. ``/_control/http_log`` has one entry per HTTP
request to the MCP endpoint (POSTs of requests, notifications and responses, GET streams, DELETEs), each
with the ``Longcall-Budget`` header longcall sends: the bucket the request was charged to (``poll`` or
``control``; none = not charged). Real worker processes, real Postgres and Redis."""

from __future__ import annotations

import itertools
import time
import uuid
from collections import Counter
from typing import Any

import httpx2
import pytest

from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.integration.steps.test_qps import max_in_any_window
from tests.support.fleet import Fleet, FleetParts, running_fleet

S = OpState
WINDOW_S = 1.0


def http_log(fleet: Fleet) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = httpx2.get(f"{fleet.mcp.control}/http_log", timeout=5).json()["entries"]
    return entries


def count_final(ledger: Ledger, op_ids: list[uuid.UUID]) -> int:
    return sum(ledger.get(op_id).is_final for op_id in op_ids)


# ------------------------------------------------------------------------------------------------- item 8

BUDGET_OPERATIONS = 30
BUDGET_POLL_QPS = 5
BUDGET_CONTROL_QPS = 5


@pytest.mark.slow
def test_every_request_is_charged_to_its_steps_budget_under_429s_and_cut_results(
    fleet_parts: FleetParts,
) -> None:
    """4 worker processes, 30 operations, polls refused with 429 and results cut or dropped (so results are
    fetched again in their own step, status read first): in every 1 s window of the server's log, the
    requests charged to poll stay within ``poll_qps``, those charged to control within ``control_qps``, all
    within their sum, and no request arrives uncharged (initialize, notifications/initialized, tools/list,
    the fetch's status read and re-reads included)."""
    ledger = fleet_parts.ledger
    with running_fleet(
        fleet_parts,
        server={"poll_qps": BUDGET_POLL_QPS, "control_qps": BUDGET_CONTROL_QPS},
        workers=2,  # x concurrency 2 = 4 worker processes
    ) as fleet:
        fleet.mcp.faults(
            status_429={"tasks/get": {"count": 15, "retry_after_s": 1}},
            truncate_result=6,
            drop_result=6,
        )
        answers = [
            fleet.submit_nowait(f"n/budget-{index:02d}", "slow_report", {"seconds": 1 + index % 3})
            for index in range(BUDGET_OPERATIONS)
        ]
        op_ids = [uuid.UUID(answer.get(timeout=30)["op_id"]) for answer in answers]
        support.wait_for(
            f"all {BUDGET_OPERATIONS} operations to be final",
            lambda: count_final(ledger, op_ids) == BUDGET_OPERATIONS,
            timeout=180,
        )
        requests = http_log(fleet)
        rpc = fleet.mcp.log()
        switches = httpx2.get(f"{fleet.mcp.control}/faults", timeout=5).json()

    # The faults were met: every 429, cut and dropped result was used up.
    assert switches["status_429"]["tasks/get"]["count"] == 0
    assert (switches["truncate_result"], switches["drop_result"]) == (0, 0)
    assert all(ledger.get(op_id).state is S.ACCEPTED for op_id in op_ids)

    times = [e["t"] for e in requests]
    poll = [e["t"] for e in requests if e["budget"] == "poll"]
    control = [e["t"] for e in requests if e["budget"] == "control"]
    by_label = Counter(str(e["budget"]) for e in requests)
    by_method = Counter((e["method"], e["budget"]) for e in rpc)
    print(f"\nrequests by budget: {dict(by_label)}; JSON-RPC messages by (method, budget): {dict(by_method)}")

    busiest = max_in_any_window(times, WINDOW_S)
    assert busiest <= BUDGET_POLL_QPS + BUDGET_CONTROL_QPS, (
        f"{busiest} requests in one 1-s window: more than poll_qps + control_qps = "
        f"{BUDGET_POLL_QPS + BUDGET_CONTROL_QPS}"
    )
    uncharged = [e for e in rpc if e["budget"] is None]
    assert by_label["None"] == 0, f"{by_label['None']} HTTP requests were not charged, e.g. {uncharged[:5]}"
    assert max_in_any_window(poll, WINDOW_S) <= BUDGET_POLL_QPS
    assert max_in_any_window(control, WINDOW_S) <= BUDGET_CONTROL_QPS
    # The poll budget pays for the poll step's status reads only; a status read a control step makes (the
    # fetch of a result cut before, in its own step) is control traffic.
    assert {m for (m, b) in by_method if b == "poll"} == {"tasks/get"}
    assert by_method["tasks/get", "control"] > 0
    assert by_method["initialize", "control"] >= 1
    assert by_method["tools/list", "control"] >= 1


# ------------------------------------------------------------------------------------------------- item 9

EXPIRED_OPERATIONS = 10
POLL_INTERVAL_S = 2.0
MEASURE_S = 10.0


@pytest.mark.slow
@pytest.mark.serial  # the gaps between polls and the cancel's 2 s are measured on the clock
def test_past_expiry_never_polls_faster_than_the_interval_nor_starves_a_cancel(
    fleet_parts: FleetParts,
) -> None:
    """Ten operations whose server TTL (1 s) is far shorter than their run (60 s), and one more that is
    cancelled while they run past their expiry: each is polled at most once per server interval (2 s),
    and the cancel is confirmed within 2 s. The dispatcher claims at most 7 rows a tick on this server, so
    ten rows due at once forever would also keep every other row (the cancel included) from being claimed.
    """
    ledger = fleet_parts.ledger
    with running_fleet(
        fleet_parts,
        poll_interval_ms=int(POLL_INTERVAL_S * 1000),
        server={"poll_qps": 10, "control_qps": 4},
        workers=2,
    ) as fleet:
        expiring = [
            fleet.submit_nowait(f"n/expiring-{index}", "slow_report", {"seconds": 60}, ttl_ms=1000)
            for index in range(EXPIRED_OPERATIONS)
        ]
        expiring_ids = [uuid.UUID(answer.get(timeout=30)["op_id"]) for answer in expiring]
        cancelled_id = fleet.submit("n/to-cancel", "slow_report", {"seconds": 60})
        everyone = [*expiring_ids, cancelled_id]
        support.wait_for(
            "all operations to be created",
            lambda: all(ledger.get(op_id).state is S.WORKING for op_id in everyone),
            timeout=60,
        )
        ops = [ledger.get(op_id) for op_id in expiring_ids]
        assert all(op.expires_at is not None for op in ops)
        last_expiry = max(op.expires_at.timestamp() for op in ops if op.expires_at is not None)
        # Measure once every expiry is well behind (a poll capped at the expiry itself may come early).
        start = max(time.time(), last_expiry + POLL_INTERVAL_S + 0.5)
        support.wait_for("every expiry to be past", lambda: time.time() >= start, timeout=30)

        support.wait_for("half the measured period", lambda: time.time() >= start + MEASURE_S / 2, timeout=30)
        asked = time.monotonic()
        fleet.send_nowait("longcall.cancel", op_id=str(cancelled_id))
        fleet.wait_state(cancelled_id, S.CANCELLED_ACCEPTED, timeout=30)
        took = time.monotonic() - asked

        support.wait_for("the measured period", lambda: time.time() >= start + MEASURE_S, timeout=30)
        end = time.time()
        log = fleet.mcp.log()
        states = {ledger.get(op_id).state for op_id in expiring_ids}

    remote = {ledger.get(op_id).remote_id: op_id for op_id in expiring_ids}
    polls: dict[object, list[float]] = {remote_id: [] for remote_id in remote}
    for entry in log:
        if entry["method"] == "tasks/get" and entry["task_id"] in polls and start <= entry["t"] < end:
            polls[entry["task_id"]].append(entry["t"])
    counts = {str(remote_id): len(times) for remote_id, times in polls.items()}
    print(f"\npolls per operation in {end - start:.1f} s: {counts}; cancel confirmed in {took:.2f} s")

    most = int((end - start) / POLL_INTERVAL_S) + 1
    too_often = {r: n for r, n in counts.items() if n > most}
    assert not too_often, (
        f"polled more than once per {POLL_INTERVAL_S:g} s ({most} in the period): {too_often}"
    )
    closest = {
        str(r): min((b - a for a, b in itertools.pairwise(ts)), default=POLL_INTERVAL_S)
        for r, ts in polls.items()
    }
    assert all(gap >= 0.8 * POLL_INTERVAL_S for gap in closest.values()), f"closest polls: {closest}"
    assert all(n >= 2 for n in counts.values()), f"an operation was not polled: {counts}"
    assert states == {S.WORKING}, states  # still running on the server, past their ttl: nothing decided
    assert took <= 2.0, f"the cancel took {took:.2f} s to be confirmed"
