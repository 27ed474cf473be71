"""Issue 21: one bucket call per batch. ``HotState.take_many`` books k slots in one script call, as k takes
asking at that instant would get them: k=1 is ``take``; the slots granted never exceed the rate in any
one-second window (Redis time), however many processes book batches; a hold refuses every slot; a horizon
that reaches only some grants those (and says when the next comes within reach)."""

from __future__ import annotations

import multiprocessing
import random
import time
from typing import Any

import pytest
import redis

from tests import support
from workers.budget import RATE_KEEP_S, RequestMeter, ServerBudgets, peak_key, rate_key
from workers.errors import NoToken
from workers.hot import RATE_HEADROOM, HotState, bucket_key, burst_for
from workers.settings import ServerConfig


def test_a_take_many_of_one_is_a_take(redis_client: redis.Redis, broker_prefix: str) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    for horizon in (0.0, 1.0):
        takes = [hot.take("one-by-one", "control", 2.0, horizon_s=horizon) for _ in range(3)]
        batches = [hot.take_many("k-of-one", "control", 2.0, 1, horizon_s=horizon) for _ in range(3)]
        for take, batch in zip(takes, batches, strict=True):
            assert batch.granted == int(take.granted)
            if take.granted:
                assert batch.delays_s[0] == pytest.approx(take.wait_s, abs=0.05)
                assert batch.wait_s == 0.0
            else:
                assert batch.wait_s == pytest.approx(take.wait_s, abs=0.05)
        # Both buckets start afresh for the next horizon.
        redis_client.delete(*(bucket_key(broker_prefix, s, "control") for s in ("one-by-one", "k-of-one")))


def test_a_horizon_that_reaches_some_slots_grants_those(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    interval = 1 / (2.0 * RATE_HEADROOM)
    tokens = hot.take_many("reports", "control", 2.0, 5, horizon_s=1.0)
    assert tokens.granted == 2  # slots at 0 and 0.56 s; the third, 1.11 s away, is past the horizon
    assert tokens.delays_s[0] == 0.0
    assert tokens.delays_s[1] == pytest.approx(interval, abs=0.02)
    assert tokens.wait_s == pytest.approx(2 * interval - 1.0, abs=0.02)
    # The slots are taken: the next caller books after them.
    after = hot.take("reports", "control", 2.0, horizon_s=2.0)
    assert after.granted
    assert after.wait_s == pytest.approx(2 * interval, abs=0.05)


def test_slots_within_the_burst_are_for_now_and_the_next_spaced(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    rate = 100.0
    burst, interval = burst_for(rate), 1 / (rate * RATE_HEADROOM)
    tokens = hot.take_many("reports", "poll", rate, burst + 4, horizon_s=1.0)
    assert tokens.granted == burst + 4
    assert tokens.delays_s[: burst + 1] == (0.0,) * (burst + 1)
    for i, delay in enumerate(tokens.delays_s[burst + 1 :], start=1):
        assert delay == pytest.approx(i * interval, abs=0.01)


def test_a_hold_refuses_every_slot(redis_client: redis.Redis, broker_prefix: str) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    hot.hold("reports", 3.0)
    tokens = hot.take_many("reports", "poll", 100.0, 5, horizon_s=1.0)
    assert (tokens.granted, tokens.counted) == (0, 0)
    assert 2.5 < tokens.wait_s <= 3.0
    assert redis_client.exists(bucket_key(broker_prefix, "reports", "poll")) == 0  # no slot was booked


def test_the_slots_granted_for_now_are_counted_in_the_same_call(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    count = RequestMeter(redis_client, broker_prefix, "reports", "poll").count()
    tokens = hot.take_many("reports", "poll", 10.0, 3, horizon_s=1.0, meter=count)  # no burst at 10/s
    assert tokens.granted == 3
    assert tokens.counted == 1  # the slot for now; the two booked ahead are counted when they are sent
    assert not count.counted  # take_many leaves the flag alone
    assert int(redis_client.get(count.keys[0]) or 0) == 1

    bursty = RequestMeter(redis_client, broker_prefix, "billing", "poll").count()
    many = hot.take_many("billing", "poll", 1000.0, 5, meter=bursty)
    assert (many.granted, many.counted) == (5, 5)  # all within the burst: five requests, one INCRBY
    second = int(bursty.keys[0].rsplit(":", 1)[1])
    assert bursty.keys == (
        rate_key(broker_prefix, "billing", "poll", second),
        peak_key(broker_prefix, "billing", "poll", second),
    )
    assert int(redis_client.get(bursty.keys[0]) or 0) == 5
    assert int(redis_client.get(bursty.keys[1]) or 0) == 5  # the hour's highest rose with them
    assert 0 < redis_client.ttl(bursty.keys[0]) <= RATE_KEEP_S


def test_k_below_one_is_refused(redis_client: redis.Redis, broker_prefix: str) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    with pytest.raises(ValueError, match="at least one slot"):
        hot.take_many("reports", "poll", 10.0, 0)


def test_the_budgets_take_many_books_within_one_tick_or_raises_no_token(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    config = ServerConfig(
        protocol="mcp", protocol_version="2025-11-25", url="http://127.0.0.1:1/mcp", poll_qps=2.0
    )
    budgets = ServerBudgets(HotState(redis_client, prefix=broker_prefix), lambda _: config, tick_s=1.0)
    tokens = budgets.take_many("reports", "poll", 5)
    assert tokens.granted == 2  # the poll_qps bucket's slots within one dispatch tick
    with pytest.raises(NoToken) as refused:
        budgets.take_many("reports", "poll", 5)
    assert 0.0 < refused.value.wait_s <= 1 / (2.0 * RATE_HEADROOM)


def _book_batches(url: str, prefix: str, rate: float, seconds: float, seed: int, out: Any) -> None:
    """Book batches of 1 to 6 slots, send each at its slot, and report the Redis time each was sent."""
    hot = HotState.from_url(url, prefix=prefix)
    rng = random.Random(seed)
    sent: list[float] = []
    stop = time.time() + seconds
    while time.time() < stop:
        tokens = hot.take_many("reports", "poll", rate, rng.randint(1, 6), horizon_s=0.25)
        booked = time.monotonic()
        for delay in tokens.delays_s:  # each slot is at most the horizon away
            time.sleep(max(0.0, booked + delay - time.monotonic()))
            seconds_, micros = hot.client.time()
            sent.append(seconds_ + micros / 1e6)
        if not tokens.granted:
            time.sleep(min(tokens.wait_s, 0.05))  # a bounded pause before asking again
    hot.close()
    out.put(sent)


@pytest.mark.serial  # three processes must use most of the rate
@pytest.mark.parametrize("rate", [10.0, 100.0])
def test_slots_booked_in_batches_hold_the_rate_in_every_window_across_processes(
    redis_client: redis.Redis, broker_prefix: str, rate: float
) -> None:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    seconds = 3.0
    processes = [
        context.Process(target=_book_batches, args=(support.REDIS_URL, broker_prefix, rate, seconds, n, out))
        for n in range(3)
    ]
    for process in processes:
        process.start()
    sent = sorted(t for _ in processes for t in out.get(timeout=60))
    for process in processes:
        process.join(timeout=30)

    worst = max(sum(1 for u in sent[i:] if u - t <= 1.0) for i, t in enumerate(sent))
    steady = [t for t in sent if sent[0] + 1.0 <= t <= sent[0] + seconds - 0.5]
    used = len(steady) / (seconds - 1.5)
    print(f"\nbatches at {rate:g}/s, 3 processes: at most {worst} in any 1 s window, {used:.1f}/s used")
    assert worst <= rate
    assert used >= 0.75 * rate
