"""Issue 21: one bucket call per batch. ``HotState.take_slots`` books a batch's requests in one script
call, each slot what a take asking at its own time would get after the slots before it: one slot at 0 is a
take; no slot is before its time; the slots granted never exceed the rate in any one-second window (Redis
time), however many processes book batches; a hold refuses every slot; a horizon that reaches only some
grants those (and says when the next comes within reach); every slot is counted for the meter in the second
it leaves. ``ServerBudgets.book_slots`` over it: the first charge of each member's budget is its slot."""

from __future__ import annotations

import multiprocessing
import random
import sys
import threading
import time
from typing import Any

import pytest
import redis

from adapters import RateLimited
from tests import support
from workers.budget import RATE_KEEP_S, ServerBudgets, late_slot_s, peak_key, rate_key, slot_meter
from workers.errors import NoToken
from workers.hot import RATE_HEADROOM, HotState, SlotMeter, bucket_key, burst_for
from workers.settings import ServerConfig


def test_one_slot_at_zero_is_a_take(redis_client: redis.Redis, broker_prefix: str) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    for horizon in (0.0, 1.0):
        takes = [hot.take("one-by-one", "control", 2.0, horizon_s=horizon) for _ in range(3)]
        batches = [hot.take_slots("k-of-one", "control", 2.0, [0.0], horizon_s=horizon) for _ in range(3)]
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
    tokens = hot.take_slots("reports", "control", 2.0, [0.0] * 5, horizon_s=1.0)
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
    tokens = hot.take_slots("reports", "poll", rate, [0.0] * (burst + 4), horizon_s=1.0)
    assert tokens.granted == burst + 4
    assert tokens.delays_s[: burst + 1] == (0.0,) * (burst + 1)
    for i, delay in enumerate(tokens.delays_s[burst + 1 :], start=1):
        assert delay == pytest.approx(i * interval, abs=0.01)


def test_no_slot_is_before_its_own_time_and_late_ones_stay_spaced(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    """The members of a batch are due at their own times within the tick: each slot is at or after its
    time, and the slots keep the bucket's spacing past its burst (a member due late does not bunch with
    the ones before it, nor take a slot that was before its time)."""
    hot = HotState(redis_client, prefix=broker_prefix)
    rate = 10.0  # no burst: every slot spaced by the interval
    interval = 1 / (rate * RATE_HEADROOM)
    offsets = [0.0, 0.02, 0.05, 0.3, 0.3, 0.6]
    tokens = hot.take_slots("reports", "poll", rate, offsets, horizon_s=1.0)
    assert tokens.granted == len(offsets)
    for offset, delay in zip(offsets, tokens.delays_s, strict=True):
        assert delay >= offset - 0.005
    gaps = [b - a for a, b in zip(tokens.delays_s, tokens.delays_s[1:], strict=False)]
    assert min(gaps) == pytest.approx(interval, abs=0.005)
    # Each slot is its time or the one after the slot before it, whichever is later: the sixth, asked at
    # 0.6 s, waits for its spacing if the five before it reach past 0.6 - interval.
    assert tokens.delays_s[-1] == pytest.approx(max(0.6, 5 * interval), abs=0.01)
    assert tokens.delays_s[3] == pytest.approx(max(0.3, 3 * interval), abs=0.01)


def test_a_hold_refuses_every_slot(redis_client: redis.Redis, broker_prefix: str) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    hot.hold("reports", 3.0)
    tokens = hot.take_slots("reports", "poll", 100.0, [0.0] * 5, horizon_s=1.0)
    assert (tokens.granted, tokens.counted) == (0, 0)
    assert 2.5 < tokens.wait_s <= 3.0
    assert redis_client.exists(bucket_key(broker_prefix, "reports", "poll")) == 0  # no slot was booked


def test_every_slot_is_counted_in_the_second_it_leaves(redis_client: redis.Redis, broker_prefix: str) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    second = 1_900_000_000  # the worker's clock, 0.9 s into this second: a slot 0.2 s on leaves in the next
    meter = slot_meter(broker_prefix, "billing", "poll", now=second + 0.9)
    tokens = hot.take_slots("billing", "poll", 1000.0, [0.0, 0.0, 0.2, 0.2, 0.2], horizon_s=0.5, meter=meter)
    assert (tokens.granted, tokens.counted) == (5, 5)
    counts = [
        int(redis_client.get(rate_key(broker_prefix, "billing", "poll", s)) or 0)
        for s in (second, second + 1)
    ]
    assert counts == [2, 3]
    assert int(redis_client.get(peak_key(broker_prefix, "billing", "poll", second + 1)) or 0) == 3
    assert 0 < redis_client.ttl(rate_key(broker_prefix, "billing", "poll", second)) <= RATE_KEEP_S
    # Without a meter, nothing is counted.
    none = hot.take_slots("quiet", "poll", 1000.0, [0.0], meter=None)
    assert (none.granted, none.counted) == (1, 0)
    assert isinstance(meter, SlotMeter)


def test_a_slot_past_the_meters_three_seconds_is_left_to_its_sender(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    """The meter's keys name the worker's seconds s to s + 2: a slot that leaves in a later second is not
    counted in one of them (it would swell that second's count past the bucket's rate), the slots before it
    are, and the caller counts the rest when it sends them."""
    hot = HotState(redis_client, prefix=broker_prefix)
    second = 1_900_000_000  # the worker's clock, 0.9 s into this second: 2.2 s on is second + 3
    meter = slot_meter(broker_prefix, "slow", "poll", now=second + 0.9)
    tokens = hot.take_slots("slow", "poll", 1000.0, [0.0, 1.0, 2.2], horizon_s=0.5, meter=meter)
    assert (tokens.granted, tokens.counted) == (3, 2)
    counts = [
        int(redis_client.get(rate_key(broker_prefix, "slow", "poll", s)) or 0)
        for s in range(second, second + 4)
    ]
    assert counts == [1, 1, 0, 0]


def test_no_offsets_is_refused(redis_client: redis.Redis, broker_prefix: str) -> None:
    hot = HotState(redis_client, prefix=broker_prefix)
    with pytest.raises(ValueError, match="at least one slot"):
        hot.take_slots("reports", "poll", 10.0, [])


def _budgets(redis_client: redis.Redis, broker_prefix: str, *, poll_qps: float) -> ServerBudgets:
    config = ServerConfig(
        protocol="mcp", protocol_version="2025-11-25", url="http://127.0.0.1:1/mcp", poll_qps=poll_qps
    )
    return ServerBudgets(HotState(redis_client, prefix=broker_prefix), lambda _: config, tick_s=1.0)


def test_booked_slots_pay_each_members_first_request_or_refuse_it(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    budgets = _budgets(redis_client, broker_prefix, poll_qps=2.0)
    booked = budgets.book_slots("reports", "poll", [0.0] * 5)
    assert len(booked.delays_s) == 2  # the poll_qps bucket's slots within one dispatch tick
    started = time.monotonic()
    first, second, third = (booked.budget(i) for i in range(3))
    first.charge()
    second.charge()  # waits for its slot, about 0.56 s on
    assert time.monotonic() - started == pytest.approx(1 / (2.0 * RATE_HEADROOM), abs=0.15)
    with pytest.raises(NoToken) as refused:
        third.charge()
    assert 0.0 < refused.value.wait_s <= 1 / (2.0 * RATE_HEADROOM)
    # Both requests were counted when they were booked: none again when sent.
    second_now = int(time.time())
    counted = sum(
        int(redis_client.get(rate_key(broker_prefix, "reports", "poll", s)) or 0)
        for s in range(second_now - 3, second_now + 2)
    )
    assert counted == 2


def test_a_hold_recorded_while_a_member_waits_for_its_slot_stops_its_request(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    budgets = _budgets(redis_client, broker_prefix, poll_qps=2.0)
    booked = budgets.book_slots("reports", "poll", [0.0, 0.0])
    first, second = booked.budget(0), booked.budget(1)
    first.charge()
    budgets.hold("reports", RateLimited("429", retry_after=2.0))  # the first request's answer
    with pytest.raises(NoToken) as held:
        second.charge()
    assert 1.0 < held.value.wait_s <= 2.0


def test_holds_recorded_at_once_by_many_members_keep_the_longest(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    """Members of one server's batch answered by 429s at once record their holds side by side: this
    process's record of the hold (what a member that waited for its slot reads, not Redis) keeps the latest
    end of them all, not the one written last (before, a read and a write of it apart let a 1 s hold
    written after a 60 s one shorten it)."""
    budgets = _budgets(redis_client, broker_prefix, poll_qps=2.0)
    shortened: list[str] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_ in range(60):
            server = f"held-{round_}"
            start = threading.Barrier(8)

            def record(wait_s: float, server: str = server, start: threading.Barrier = start) -> None:
                start.wait(timeout=10)
                budgets.hold(server, RateLimited("429", retry_after=wait_s))

            threads = [threading.Thread(target=record, args=(60.0 if i == 0 else 1.0,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            if budgets.held_here(server) - time.monotonic() < 50:
                shortened.append(server)
    finally:
        sys.setswitchinterval(switch)
    assert shortened == []


def _book_batches(url: str, prefix: str, rate: float, seconds: float, seed: int, out: Any) -> None:
    """Book batches of 1 to 6 slots, each at its own time (up to 50 ms on), send each at its slot, and report
    the Redis time each was sent."""
    hot = HotState.from_url(url, prefix=prefix)
    rng = random.Random(seed)
    sent: list[float] = []
    stop = time.time() + seconds
    while time.time() < stop:
        offsets = sorted(rng.uniform(0.0, 0.05) for _ in range(rng.randint(1, 6)))
        tokens = hot.take_slots("reports", "poll", rate, offsets, horizon_s=0.25)
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
    # The buckets hand out 80 % of the rate (RATE_HEADROOM): 8 a second at 10/s. The steady window is long
    # enough (3.5 s) that one send more or less moves the figure by a tenth of a send a second, not two
    # thirds (a 1.5 s window read 11 sends where 12 were due, 7.33/s, on a loaded CI machine).
    seconds = 5.0
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
    assert used >= 0.7 * rate


def test_a_member_that_comes_too_late_to_its_slot_takes_a_token_of_its_own(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    """Sent long after its slot, a request would crowd the slots after it into one second (the server would
    see more than poll_qps in it): past ``late_slot_s`` it gives the slot up and waits for a slot of its
    own, after the next one."""
    budgets = _budgets(redis_client, broker_prefix, poll_qps=2.0)
    interval = 1 / (2.0 * RATE_HEADROOM)
    booked = budgets.book_slots("reports", "poll", [0.0])
    time.sleep(late_slot_s(2.0) + 0.1)  # a loaded process: the member comes to its request late
    started = time.monotonic()
    booked.budget(0).charge()
    waited = time.monotonic() - started
    assert waited == pytest.approx(interval - (late_slot_s(2.0) + 0.1), abs=0.12)

    on_time = budgets.book_slots("reports", "poll", [0.0])
    started = time.monotonic()
    on_time.budget(0).charge()  # its slot, about one interval on: waited for, then sent on it
    assert time.monotonic() - started == pytest.approx(on_time.delays_s[0], abs=0.05)


def test_a_hold_this_process_recorded_is_its_fleets_not_another_fleets(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    """A process keeps the holds it recorded, so that its own requests meet them at once; two fleets in one
    process (an embedding app; the tests' fleets, one prefix each) name the same server, and one's hold is
    not the other's (before: kept by server name alone, a hold one test recorded refused a later test's
    slot: CI's failure of the late-slot test)."""
    held = _budgets(redis_client, broker_prefix, poll_qps=2.0)
    other = _budgets(redis_client, f"{broker_prefix}other:", poll_qps=2.0)
    held.hold("reports", RateLimited("429", retry_after=5))
    assert held.held_s("reports") > 4
    assert other.held_s("reports") == 0
    booked = other.book_slots("reports", "poll", [0.0, 0.0])
    for index in range(len(booked.delays_s)):
        booked.budget(index).charge()  # none refused for the other fleet's hold
