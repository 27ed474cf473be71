"""A server's Retry-After holds for the whole fleet (hardening, H11 item 1): once a server answers a 429
with a delay, no worker sends that server anything (poll or control traffic) until the delay is over, and
a cancel asked for meanwhile is sent right after it, not lost.
A very long Retry-After (a day, or an HTTP-date far ahead) is held at most ``MAX_SERVER_WAIT_S``, and an
operation whose wait budget ends inside the hold goes to its deadline path then.

Measured in the demo servers' own logs: the AIP-151 server flags every request that arrived while a
Retry-After it gave was still running (``inside_retry_after``); for the MCP server the window is taken
from the refused request's arrival and its Retry-After. Real worker processes, beat, Postgres and Redis.
"""

from __future__ import annotations

import time
from typing import Any

import httpx2
import pytest
import redis

from adapters import RateLimited
from adapters.jsonrpc import parse_retry_after
from ledger.reasons import ReconciliationReason
from ledger.states import OpState
from tests import support
from tests.support.aip_fleet import AIP_SERVER, args, running_aip_fleet
from tests.support.fleet import Fleet, FleetParts, running_fleet
from workers.budget import server_wait_s
from workers.hot import MAX_SERVER_WAIT_S, HotState
from workers.steps.context import retry_s

S = OpState

OPERATIONS = 5
RETRY_AFTER_S = 4
#: One poll slot every ~1.1 s: a request the fleet sent before the 429 reached it (one on its way already,
#: which no client can call back) would need the 429's answer to take that long to be recorded, so the
#: server must see none inside its window.
POLL_QPS = 1
#: The same for control traffic (creates, the MCP handshake) where it goes on while the 429 arrives.
CONTROL_QPS = 1


def test_a_hold_refuses_both_buckets_of_its_server_until_it_ends_and_keeps_the_later(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    """The hold on real Redis: both buckets of the held server refused (the wait is the hold's time left,
    whatever the horizon), another server untouched, a shorter hold never shortens a longer one, and the
    first token after it is granted once it is over."""
    hot = HotState(redis_client, prefix=broker_prefix)
    assert hot.take("held", "poll", 50.0).granted
    started = time.monotonic()
    assert 0.55 < hot.hold("held", 0.6) <= 0.6
    assert hot.hold("held", 0.1) > 0.5  # the later end stays
    for bucket in ("poll", "control"):
        token = hot.take("held", bucket, 50.0, horizon_s=1.0)
        assert not token.granted
        assert 0.4 < token.wait_s <= 0.6
    assert hot.take("other", "poll", 50.0).granted
    support.wait_for(
        "a token after the hold",
        lambda: hot.take("held", "control", 50.0).granted,
        timeout=5,
        interval=0.02,
    )
    assert time.monotonic() - started >= 0.55
    assert hot.hold("held", 0) == 0.0  # no wait asked: nothing held


def first_refused(log: list[dict[str, Any]]) -> dict[str, Any]:
    refused = [e for e in log if e["status"] == 429]
    assert refused, "the server never answered 429: the fault was not met"
    return refused[0]


@pytest.mark.slow
def test_aip_retry_after_holds_the_whole_fleet_and_a_cancel_waits_for_it(fleet_parts: FleetParts) -> None:
    """Five operations polled on one AIP-151 server; one poll gets a 429 (RetryInfo and Retry-After 4 s):
    no request of any operation reaches the server inside those 4 s, polling resumes after them, and a
    cancel asked for inside the window is sent after it and ends its operation cancelled."""
    with running_aip_fleet(
        fleet_parts, exports={"poll_qps": POLL_QPS, "control_qps": 10}, workers=2
    ) as running:
        fleet = running.fleet
        op_ids = [running.submit(f"n/ra-aip-{i}", args(seconds=60)) for i in range(OPERATIONS)]
        support.wait_for(
            "every operation to be working",
            lambda: all(fleet.ledger.get(op_id).state is S.WORKING for op_id in op_ids),
            timeout=60,
        )
        running.aip.faults(status_429={"GetOperation": {"count": 1, "retry_after_s": RETRY_AFTER_S}})
        refused = support.wait_for(
            "a poll refused with 429",
            lambda: next((e for e in running.requests() if e["status"] == 429), None),
            timeout=30,
        )
        # A cancel asked for inside the window: recorded now, sent once the window is over.
        fleet.send_nowait("longcall.cancel", op_id=str(op_ids[0]))
        fleet.wait_state(op_ids[0], S.CANCEL_REQUESTED, S.CANCELLED_ACCEPTED, timeout=10)
        fleet.wait_state(op_ids[0], S.CANCELLED_ACCEPTED, timeout=RETRY_AFTER_S + 20)
        support.wait_for(
            "polling to resume after the window",
            lambda: any(
                e["rpc"] == "GetOperation" and e["t"] > refused["t"] + RETRY_AFTER_S
                for e in running.requests()
            ),
            timeout=RETRY_AFTER_S + 20,
        )
        log = running.requests()

    after = [e for e in log if e["t"] > refused["t"]]
    inside = [e for e in after if e["inside_retry_after"]]
    offsets = [round(e["t"] - refused["t"], 3) for e in inside]
    assert inside == [], (
        f"{len(inside)} requests inside the Retry-After, s after the 429: {offsets}: {inside[:5]}"
    )
    assert first_refused(log) == refused
    cancels = [e for e in log if e["rpc"] == "CancelOperation"]
    assert len(cancels) == 1, cancels
    assert cancels[0]["t"] >= refused["t"] + RETRY_AFTER_S, (
        f"the cancel went {cancels[0]['t'] - refused['t']:.2f} s after the 429, inside its window"
    )


@pytest.mark.slow
def test_mcp_retry_after_holds_the_whole_fleet(fleet_parts: FleetParts) -> None:
    """The same on the MCP server: the first ``tasks/get`` gets a 429 with ``Retry-After: 4`` while the other
    operations are still being created and polled; no HTTP request (any operation, any budget) reaches the
    server in the 4 s after it, and polling resumes after them. The switch is set before any operation
    exists, so the first ``tasks/get`` in the server's log is the refused one."""
    with running_fleet(
        fleet_parts, server={"poll_qps": POLL_QPS, "control_qps": CONTROL_QPS}, workers=2
    ) as fleet:
        fleet.mcp.faults(status_429={"tasks/get": {"count": 1, "retry_after_s": RETRY_AFTER_S}})
        answers = [
            fleet.submit_nowait(f"n/ra-mcp-{i}", "slow_report", {"seconds": 60}) for i in range(OPERATIONS)
        ]
        refused_at = support.wait_for(
            "the refused tasks/get",
            lambda: next((e["t"] for e in fleet.mcp.log() if e["method"] == "tasks/get"), None),
            timeout=30,
        )
        support.wait_for(
            "polling to resume after the window",
            lambda: any(
                e["method"] == "tasks/get" and e["t"] > refused_at + RETRY_AFTER_S for e in fleet.mcp.log()
            ),
            timeout=RETRY_AFTER_S + 20,
        )
        assert all(answer.get(timeout=30)["op_id"] for answer in answers)
        requests = http_log(fleet)
        switches = httpx2.get(f"{fleet.mcp.control}/faults", timeout=5).json()

    assert switches["status_429"]["tasks/get"]["count"] == 0  # the 429 was answered
    # The refused request itself is logged a moment before its JSON-RPC entry; everything after it counts.
    inside = [e for e in requests if refused_at + 0.05 < e["t"] < refused_at + RETRY_AFTER_S]
    offsets = [round(e["t"] - refused_at, 3) for e in inside]
    assert inside == [], (
        f"{len(inside)} requests inside the Retry-After, s after the 429: {offsets}: {inside[:5]}"
    )


def http_log(fleet: Fleet) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = httpx2.get(f"{fleet.mcp.control}/http_log", timeout=5).json()["entries"]
    return entries


#: A day: a server that asks for this must not park an operation (or the fleet) on it.
DAY_S = 86_400


def test_a_very_long_retry_after_is_capped_in_the_hold_and_the_step_s_wait(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    """A day as delta-seconds and an HTTP-date a century ahead: the fleet-wide hold and the step's own pause
    are both at most ``MAX_SERVER_WAIT_S``."""
    far = parse_retry_after("Fri, 01 Jan 2100 00:00:00 GMT")
    assert far is not None
    assert far > DAY_S
    for asked in (float(DAY_S), far):
        refusal = RateLimited("429", retry_after=asked)
        assert server_wait_s(refusal) == MAX_SERVER_WAIT_S
        assert retry_s(refusal) == MAX_SERVER_WAIT_S
    hot = HotState(redis_client, prefix=broker_prefix)
    assert hot.hold("long", DAY_S) == MAX_SERVER_WAIT_S
    assert 0 < hot.held_s("long") <= MAX_SERVER_WAIT_S


@pytest.mark.slow
def test_a_retry_after_of_a_day_hands_the_operation_to_the_deadline_path(fleet_parts: FleetParts) -> None:
    """A poll gets a 429 with Retry-After (and RetryInfo) of a day. The hold is capped, and the operation,
    whose wait budget ends long before either, goes to an operator at its wait budget (DEADLINE_EXCEEDED),
    not parked silently on the server's wait; nothing is sent to the server meanwhile."""
    wait_budget_s = 4.0
    with running_aip_fleet(fleet_parts) as running:
        fleet = running.fleet
        op_id = running.submit("n/ra-day", args(seconds=600), wait_budget_s=wait_budget_s)
        op = fleet.wait_state(op_id, S.WORKING, timeout=30)
        assert op.wait_deadline is not None
        running.aip.faults(status_429={"GetOperation": {"count": 1, "retry_after_s": DAY_S}})
        refused = support.wait_for(
            "a poll refused with a day's Retry-After",
            lambda: next((e for e in running.requests() if e["status"] == 429), None),
            timeout=10,
        )
        deadline = op.wait_deadline.timestamp()
        fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=deadline - time.time() + 10)
        handed_at = time.time()
        held = HotState(fleet_parts.redis_client, prefix=f"{fleet_parts.broker_prefix}longcall:").held_s(
            AIP_SERVER
        )
        records = fleet.ledger.reconciliations_for(op_id)
        log = running.requests()

    assert handed_at <= deadline + 5.0, f"handed over {handed_at - deadline:.1f} s after the wait budget"
    assert 0 < held <= MAX_SERVER_WAIT_S
    assert [r.reason for r in records] == [ReconciliationReason.DEADLINE_EXCEEDED]
    assert [e for e in log if e["t"] > refused["t"]] == [], "a request inside the server's wait"
