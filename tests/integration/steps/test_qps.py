"""Rule 4 measured where it counts: the server's own request log, with many operations and several worker
processes competing for one server's poll budget."""

from __future__ import annotations

import bisect
import itertools
import statistics
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import text

from ledger.repository import Ledger
from tests import support
from tests.support.fleet import FleetParts, running_fleet

OPERATIONS = 200
POLL_QPS = 10
MEASURE_S = 12.0
WINDOW_S = 1.0


def max_in_any_window(times: list[float], window: float) -> int:
    """The most entries in any half-open window [t, t + window), checking a window starting at each entry
    (the busiest window always starts at some entry)."""
    ordered = sorted(times)
    return max(
        (bisect.bisect_left(ordered, t + window) - i for i, t in enumerate(ordered)),
        default=0,
    )


def count_in_state(ledger: Ledger, state: str) -> int:
    with ledger.engine.begin() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM tool_operation WHERE state = :state"), {"state": state}
        ).scalar_one()
    return int(count)


def rate_limited_events(ledger: Ledger) -> int:
    with ledger.engine.begin() as conn:
        count = conn.execute(
            text(
                "SELECT count(*) FROM operation_event"
                " WHERE kind = 'rate_limited' OR detail->>'error' LIKE '%HTTP 429%'"
            )
        ).scalar_one()
    return int(count)


@pytest.mark.slow
@pytest.mark.serial  # the budget's use is a rate measured on the clock
@pytest.mark.parametrize(("workers", "concurrency"), [(1, 1), (1, 2), (2, 2)], ids=["1-process", "2", "4"])
def test_polls_never_exceed_poll_qps_in_any_window_and_use_the_budget(
    workers: int,
    concurrency: int,
    ledger: Ledger,
    database_url: str,
    broker_prefix: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    log_dir: Path,
) -> None:
    # 1, 2 and 4 worker processes, each booking its batches' slots on the one bucket (``LONGCALL_POLL_BATCH``
    # is 32: every tick's claims of the server travel as one message); a fast control budget so the
    # creates go first.
    with running_fleet(
        FleetParts(ledger, database_url, broker_prefix, redis_client, tmp_path, log_dir),
        server={"poll_qps": POLL_QPS, "control_qps": 50},
        workers=workers,
        concurrency=concurrency,
    ) as fleet:
        for index in range(OPERATIONS):
            fleet.submit_nowait(f"n/qps-{index:03d}", "slow_report", {"seconds": 600})
        support.wait_for(
            f"all {OPERATIONS} operations to be created",
            lambda: count_in_state(ledger, "WORKING") == OPERATIONS,
            timeout=40,
        )
        assert len(fleet.mcp.tasks()) == OPERATIONS

        # Every operation now wants a poll every 200 ms (the server's pollInterval): demand is ~1000/s,
        # the budget 10/s. Measure on the server's clock, from its own log of arrivals.
        start = time.time()
        support.wait_for(
            f"{MEASURE_S:g} s of polling", lambda: time.time() >= start + MEASURE_S, timeout=MEASURE_S + 5
        )
        end = time.time()
        log = fleet.mcp.log()

    polls = [e["t"] for e in log if e["method"] == "tasks/get"]
    measured = [t for t in polls if start <= t < end]
    busiest_overall = max_in_any_window(polls, WINDOW_S)
    busiest = max_in_any_window(measured, WINDOW_S)
    rate = len(measured) / (end - start)
    gaps = sorted(b - a for a, b in itertools.pairwise(measured))
    print(
        f"\nQPS, {workers * concurrency} processes: {len(measured)} polls in {end - start:.2f} s = "
        f"{rate:.2f}/s (budget {POLL_QPS}/s, "
        f"utilization {rate / POLL_QPS:.0%}); max per 1-s window: {busiest} in the measured period, "
        f"{busiest_overall} over the whole run ({len(polls)} polls); gaps between polls: "
        f"median {statistics.median(gaps) * 1000:.0f} ms, "
        f"{sum(g > 0.2 for g in gaps) / max(1, len(gaps)):.0%} longer than 200 ms"
    )
    assert busiest_overall <= POLL_QPS, f"{busiest_overall} polls in one 1-s window"
    # The budget is used, not starved by the buckets: at least half of it on a loaded 2-core machine (the
    # rate a quiet one sustains is bench/scaling.py's figure, not this test's; at 0.8 the test failed at
    # load 4-6 on every revision, the cap holding each time).
    assert rate >= 0.5 * POLL_QPS, f"only {rate:.2f} polls/s of a {POLL_QPS}/s budget"
    assert rate_limited_events(ledger) == 0  # no tasks/get was answered 429
