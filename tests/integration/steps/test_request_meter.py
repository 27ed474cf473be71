"""The request meter (workers/budget.py, request_meter.lua) on the real Redis: each charge is counted in its
second, the counter expires, and the hour's highest per-second count only ever rises (issue 13 trimmed the
script's commands: the expiry is set once, when the second's first request creates the counter)."""

from __future__ import annotations

import time

import redis

from workers.budget import PEAK_KEEP_S, RATE_KEEP_S, RequestMeter, peak_key, rate_key


def _second_boundary() -> None:
    """Wait (bounded: at most a second) until a new second has just begun, so three charges share one."""
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.005)


def test_charges_are_counted_per_second_with_an_expiry_and_the_hours_peak_only_rises(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    prefix = f"{broker_prefix}longcall:"
    meter = RequestMeter(redis_client, prefix, "reports", "poll")

    _second_boundary()
    second = int(time.time())
    for _ in range(3):
        meter()
    assert int(time.time()) == second, "the three charges crossed a second: machine too slow for this test"
    counter, peak = rate_key(prefix, "reports", "poll", second), peak_key(prefix, "reports", "poll", second)
    assert int(redis_client.get(counter) or 0) == 3
    assert 0 < redis_client.ttl(counter) <= RATE_KEEP_S
    assert int(redis_client.get(peak) or 0) == 3
    assert PEAK_KEEP_S - 5 <= redis_client.ttl(peak) <= PEAK_KEEP_S

    _second_boundary()
    later = int(time.time())
    meter()  # the first request of its second: a count of 1 never lowers the hour's highest
    assert int(redis_client.get(rate_key(prefix, "reports", "poll", later)) or 0) == 1
    assert 0 < redis_client.ttl(rate_key(prefix, "reports", "poll", later)) <= RATE_KEEP_S
    if later // 3600 == second // 3600:
        assert int(redis_client.get(peak) or 0) == 3


def test_the_first_request_of_an_hour_sets_its_peak(redis_client: redis.Redis, broker_prefix: str) -> None:
    prefix = f"{broker_prefix}longcall:"
    before = int(time.time())
    RequestMeter(redis_client, prefix, "reports", "control")()
    after = int(time.time())
    # The charge's hour is the one before or, across an hour's boundary, the one after.
    peaks = {peak_key(prefix, "reports", "control", s) for s in (before, after)}
    assert sorted(int(redis_client.get(p) or 0) for p in peaks)[-1] == 1
    assert max(redis_client.ttl(p) for p in peaks) >= PEAK_KEEP_S - 5
