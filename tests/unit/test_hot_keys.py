"""Issue 21: the keys of each Redis script call live in one hash slot (so a Redis Cluster runs the call on one
node), and different servers' keys in different slots (so servers spread over the cluster). The calls are
recorded by a client that runs nothing: the keys are the ones :class:`~workers.hot.HotState` really passes."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis
from redis.crc import key_slot

from workers.budget import PEAK_BUCKET_S, RequestMeter, peak_key, rate_key, slot_meter
from workers.hot import HotState, bucket_key, hold_key, server_tag

#: A script's answer, by its first line (the scripts' own header comments).
ANSWERS = {
    "-- A rate limit per": [1, 0, 0, 1],
    "-- A batch's slots": [1, 0, 1, 0],
    '-- A server\'s "wait until"': 5_000_000,
    "-- How long a server's hold": [0],
    "-- Compare-and-set": [1, 1],
    "-- One charged request": 1,
}


class RecordingClient:
    """Stands in for ``redis.Redis``: each registered script records the keys of each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def register_script(self, script: str) -> Callable[..., Any]:
        [answer] = [a for head, a in ANSWERS.items() if script.startswith(head)]

        def call(keys: Sequence[str] = (), args: Sequence[int] = ()) -> Any:
            self.calls.append((script.partition("\n")[0], list(keys)))
            return answer

        return call

    def close(self) -> None:
        pass


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_every_script_call_keeps_its_keys_in_one_slot() -> None:
    recorder = RecordingClient()
    client = cast(redis.Redis, recorder)
    prefix = "celery-x:longcall:"
    hot = HotState(client, prefix=prefix)
    for server in ("reports", "billing", "a:b", "with space"):
        meter = RequestMeter(client, prefix, server, "poll")
        hot.take(server, "poll", 10.0, meter=meter.count())
        hot.take_slots(server, "control", 10.0, [0.0] * 4, meter=slot_meter(prefix, server, "control"))
        hot.hold(server, 2.0)
        hot.held_s(server)
        meter()
    hot.bump_cancel_generation(uuid.uuid4(), 0)
    assert len(recorder.calls) == 4 * 5 + 1
    for script, keys in recorder.calls:
        assert len({slot(key) for key in keys}) == 1, f"{script}: {keys} in {[slot(k) for k in keys]}"
    # One script books every token: a single take's call and a batch's alike carry the bucket, the hold and
    # the meter's keys of three seconds.
    slot_calls = [keys for script, keys in recorder.calls if script.startswith("-- A rate limit")]
    assert len(slot_calls) == 4 * 2
    assert all(len(keys) == 8 for keys in slot_calls)
    assert all(len(keys) == 8 for keys in slot_calls)  # bucket, hold, and three seconds' counter and peak


def test_a_servers_keys_share_its_tag_and_servers_spread() -> None:
    prefix = "longcall:"
    second = 1_700_000_000
    for server in ("reports", "billing"):
        keys = [
            bucket_key(prefix, server, "poll"),
            bucket_key(prefix, server, "control"),
            hold_key(prefix, server),
            *(rate_key(prefix, server, "poll", s) for s in range(second - 10, second)),  # the metrics' MGET
            *(
                peak_key(prefix, server, "control", s)
                for s in range(second, second + 7 * 86_400, PEAK_BUCKET_S)
            ),
        ]
        assert all(server_tag(server) in key for key in keys)
        assert len({slot(key) for key in keys}) == 1, server
    servers = [f"server-{n}" for n in range(30)]
    assert len({slot(hold_key(prefix, s)) * 3 // 16384 for s in servers}) == 3  # every third of the slots


def test_the_key_names() -> None:
    """The names a deploy changes to (issue 21): the server's tag in place of its bare name."""
    assert bucket_key("p:longcall:", "reports", "poll") == "p:longcall:bucket:{s:reports}:poll"
    assert hold_key("p:longcall:", "reports") == "p:longcall:hold:{s:reports}"
    assert peak_key("p:longcall:", "reports", "poll", 7200) == "p:longcall:ratemax:{s:reports}:poll:2"
