"""Issues 13 and 21: a charged request costs one Redis round trip. The script that books its token
(token_slots.lua) counts it in the request meter's keys as well, in the second its slot falls in, now or a
slot booked ahead; a prepaid token's request is counted when it is sent (request_meter.lua), in that second.

What Redis ran is read from MONITOR on the real Redis, filtered to this test's key prefix: a command sent by
a client is one round trip; the commands a script runs show as ``lua``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from tests import support
from tests.support.fleet import fleet_config
from workers.budget import PEAK_KEEP_S, RATE_KEEP_S, peak_key
from workers.hot import RATE_HEADROOM
from workers.runtime import Runtime
from workers.settings import Settings
from workers.steps.context import StepContext

POLL_QPS = 1000  # a burst of dozens: every poll charge here is granted for now
CONTROL_QPS = 2  # one slot per 0.56 s: a second charge books a slot ahead and waits for it


@dataclass(frozen=True, slots=True)
class Seen:
    """One command Redis ran on a key of this test."""

    time: float
    by_script: bool
    words: list[str]


@pytest.fixture
def context(broker_prefix: str, tmp_path: Path) -> Iterator[StepContext]:
    config = tmp_path / "longcall.toml"
    # No request is sent: the server's URL is never dialled.
    config.write_text(fleet_config("http://127.0.0.1:1/mcp", poll_qps=POLL_QPS, control_qps=CONTROL_QPS))
    settings = Settings(redis_url=support.REDIS_URL, broker_keyprefix=broker_prefix, config=config)
    runtime = Runtime.from_settings(settings)
    try:
        yield StepContext(runtime)
    finally:
        runtime.close()


def seen_during(prefix: str, action: Callable[[], Any]) -> list[Seen]:
    """The commands Redis ran on keys under ``prefix`` while ``action`` ran, in order. A marker command
    closes the watch; every read is bounded by the socket timeout."""
    watcher = redis.Redis.from_url(support.REDIS_URL, socket_timeout=10)
    marker = f"{prefix}end-of-watch:{uuid.uuid4().hex}"
    seen: list[Seen] = []
    try:
        with watcher.monitor() as monitor:  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
            action()
            watcher.exists(marker)
            while True:
                command = monitor.next_command()
                if marker in command["command"]:
                    break
                if prefix in command["command"]:
                    seen.append(
                        Seen(command["time"], command["client_type"] == "lua", command["command"].split(" "))
                    )
    finally:
        watcher.close()
    return seen


def sent(seen: list[Seen]) -> list[Seen]:
    """The round trips: commands a client sent (not those a script ran)."""
    return [s for s in seen if not s.by_script]


def counted(seen: list[Seen]) -> list[Seen]:
    """The increments of the meter's per-second counters, in order (the take's script adds its slots granted
    for now with one INCRBY, the meter's script a request with INCR)."""
    return [s for s in seen if s.by_script and s.words[0].upper() in {"INCR", "INCRBY"}]


def second_of(counter: str) -> int:
    return int(counter.rsplit(":", 1)[1])


def warm(context: StepContext) -> None:
    """Loads the scripts in Redis (a first call may load one: SCRIPT LOAD and a retried EVALSHA), before
    the tests below start watching."""
    budget = context.budget.per_request("reports", "poll", prepaid=1)
    budget.charge()  # the meter's script
    budget.charge()  # the bucket's
    context.budget.hot.held_s("reports")  # the hold's reader


def test_a_token_granted_for_now_is_taken_and_counted_in_one_round_trip(
    context: StepContext, broker_prefix: str, redis_client: redis.Redis
) -> None:
    warm(context)
    budget = context.budget.per_request("reports", "poll")

    def one_charge() -> None:
        _second_boundary()  # the warm-up's count is a second ago
        budget.charge()

    seen = seen_during(broker_prefix, one_charge)

    assert [s.words[0].upper() for s in sent(seen)] == ["EVALSHA"]
    [increment] = counted(seen)
    counter = increment.words[1]
    assert counter in sent(seen)[0].words  # the take's own script counted it
    peak = peak_key(f"{broker_prefix}longcall:", "reports", "poll", second_of(counter))
    assert int(redis_client.get(counter) or 0) == 1
    assert 0 < redis_client.ttl(counter) <= RATE_KEEP_S
    assert int(redis_client.get(peak) or 0) >= 1
    assert PEAK_KEEP_S - 5 <= redis_client.ttl(peak) <= PEAK_KEEP_S


def test_charges_counted_by_the_take_and_by_the_meter_share_one_count_and_peak(
    context: StepContext, broker_prefix: str, redis_client: redis.Redis
) -> None:
    """Both scripts count a second alike: a prepaid charge between two granted ones is the second's 2nd."""
    warm(context)
    budget = context.budget.per_request("reports", "poll", prepaid=1)
    taken = context.budget.per_request("reports", "poll")

    def three_charges() -> None:
        _second_boundary()
        taken.charge()
        budget.charge()  # prepaid: the meter's own script
        taken.charge()

    seen = seen_during(broker_prefix, three_charges)

    assert len(sent(seen)) == 3
    counters = [s.words[1] for s in counted(seen)]
    assert len(counters) == 3
    if len(set(counters)) != 1:
        pytest.skip("the three charges crossed a second: machine too slow for this test")
    peak = peak_key(f"{broker_prefix}longcall:", "reports", "poll", second_of(counters[0]))
    assert int(redis_client.get(counters[0]) or 0) == 3
    assert int(redis_client.get(peak) or 0) == 3


def test_a_slot_booked_ahead_is_counted_by_the_take_that_books_it_in_the_second_it_falls_in(
    context: StepContext, broker_prefix: str, redis_client: redis.Redis
) -> None:
    warm(context)
    budget = context.budget.per_request("reports", "control")

    def two_charges() -> None:
        budget.charge()  # granted for now
        budget.charge()  # a follow-up: books the next slot, about 0.56 s ahead, and waits for it

    seen = seen_during(broker_prefix, two_charges)

    # The second take's script counts its request, in the second its slot falls in; the hold is read again
    # after the wait (a new one would stop the request: one script reads it with its node's clock). No third
    # call counts the request as it is sent.
    first_take, second_take, hold = sent(seen)
    assert [s.words[0].upper() for s in (first_take, second_take, hold)] == ["EVALSHA"] * 3
    first, second = counted(seen)
    assert first.words[1] in first_take.words
    assert second.words[1] in second_take.words
    interval = 1 / (CONTROL_QPS * RATE_HEADROOM)
    assert second_take.time < first_take.time + interval - 0.1, (
        "machine too slow: the take did not book ahead"
    )
    assert hold.time >= first_take.time + interval - 0.005  # read once the slot came
    # Counted in the second the slot falls in (the worker's clock, read just before the take).
    slot_at = first_take.time + interval
    assert second_of(second.words[1]) <= slot_at + 0.05
    assert slot_at - 0.05 < second_of(second.words[1]) + 1
    assert int(redis_client.get(second.words[1]) or 0) >= 1


def _second_boundary() -> None:
    """Wait (bounded: at most a second) until a new second has just begun, so three charges share one."""
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.005)
