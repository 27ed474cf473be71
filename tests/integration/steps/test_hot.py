"""Rule 4 and rule 6 on the real Redis: the token bucket holds across processes, the cancel CAS has one
winner and re-seeds from the ledger after Redis lost it."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from typing import Any

import pytest
import redis

from tests import support
from workers.hot import MAX_SERVER_WAIT_S, RATE_HEADROOM, HotState, burst_for


def _hammer(url: str, prefix: str, rate: float, seconds: float, out: Any) -> None:
    hot = HotState.from_url(url, prefix=prefix)
    granted: list[float] = []
    stop = time.time() + seconds
    while time.time() < stop:
        token = hot.take("reports", "poll", rate, horizon_s=0.25)
        if token.granted:
            time.sleep(token.wait_s)  # the booked slot: at most the horizon away
            seconds_, micros = hot.client.time()
            granted.append(seconds_ + micros / 1e6)
        else:
            time.sleep(min(token.wait_s, 0.05))  # a bounded pause before asking again
    hot.close()
    out.put(granted)


@pytest.mark.serial  # four processes must reach 85% of the rate
@pytest.mark.parametrize("rate", [10.0, 200.0])
def test_the_bucket_holds_the_rate_in_every_window_across_processes(
    redis_client: redis.Redis, broker_prefix: str, rate: float
) -> None:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    seconds = 3.0
    processes = [
        context.Process(target=_hammer, args=(support.REDIS_URL, broker_prefix, rate, seconds, out))
        for _ in range(4)
    ]
    for process in processes:
        process.start()
    grants = sorted(t for _ in processes for t in out.get(timeout=60))
    for process in processes:
        process.join(timeout=30)

    worst = max(sum(1 for u in grants[i:] if u - t <= 1.0) for i, t in enumerate(grants))
    steady = [t for t in grants if grants[0] + 1.0 <= t <= grants[0] + seconds - 0.5]
    used = len(steady) / (seconds - 1.5)
    print(f"\nbucket at {rate:g}/s, 4 processes: at most {worst} in any 1 s window, {used:.1f}/s used")
    assert worst <= rate
    assert used >= (RATE_HEADROOM - 0.05) * rate  # the slots are spaced for RATE_HEADROOM of the rate


def test_a_slot_is_booked_only_within_the_horizon(redis_client: redis.Redis, broker_prefix: str) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    first = hot.take("reports", "control", 2.0, horizon_s=0.0)
    refused = hot.take("reports", "control", 2.0, horizon_s=0.0)
    booked = hot.take("reports", "control", 2.0, horizon_s=1.0)
    assert (first.granted, first.wait_s) == (True, 0.0)
    assert not refused.granted
    assert 0.4 < refused.wait_s <= 1 / (2.0 * RATE_HEADROOM)
    assert booked.granted
    assert 0.4 < booked.wait_s <= 1 / (2.0 * RATE_HEADROOM)  # the caller waits for its slot


def test_a_hold_longer_than_the_cap_set_by_an_older_worker_is_cut_where_it_is_read(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    """A worker without the cap (a rolling deploy) wrote a day-long hold: no request goes out, so no new
    Retry-After comes to cut it through ``hold``. The bucket and ``held_s`` cut it to MAX_SERVER_WAIT_S
    where they read it, and the key itself is cut, so the server is asked again within the cap."""
    hot = HotState(redis_client, prefix=broker_prefix)
    seconds, micros = redis_client.time()
    now_us = seconds * 1_000_000 + micros
    redis_client.set(hot.hold_key("reports"), now_us + 86_400 * 1_000_000, px=86_400_000)

    assert hot.held_s("reports") <= MAX_SERVER_WAIT_S
    refused = hot.take("reports", "poll", 10.0)
    assert not refused.granted
    assert MAX_SERVER_WAIT_S - 5 < refused.wait_s <= MAX_SERVER_WAIT_S
    assert (
        int(float(redis_client.get(hot.hold_key("reports")) or 0)) <= now_us + (MAX_SERVER_WAIT_S + 5) * 1e6
    )
    assert redis_client.pttl(hot.hold_key("reports")) <= (MAX_SERVER_WAIT_S + 1) * 1000 + 1000


def test_burst_keeps_the_window_within_the_rate() -> None:
    for rate in (1, 5, 10, 15, 40, 100, 500, 5000):
        assert 1 + int(RATE_HEADROOM * rate) + burst_for(rate) <= rate


def test_one_cancel_wins_the_cas_and_a_lost_key_is_reseeded(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    op_id = uuid.uuid4()
    assert hot.bump_cancel_generation(op_id, 3) == (True, 4)  # missing key: seeded from the ledger's 3
    assert hot.bump_cancel_generation(op_id, 3) == (False, 4)  # a second caller with the same view loses
    redis_client.delete(f"{broker_prefix}cancel:{op_id}")  # Redis lost it
    assert hot.bump_cancel_generation(op_id, 4) == (True, 5)
    hot.seed_cancel_generation(op_id, 9)
    assert hot.bump_cancel_generation(op_id, 9) == (True, 10)
