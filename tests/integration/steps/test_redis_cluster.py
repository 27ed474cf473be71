"""Issue 21: the hot state on a real 3-node Redis Cluster (redis-server in cluster mode, redis-py's cluster
client). Every key of one script call carries its server's hash tag, so each call runs on one node, and
different servers' keys land on different nodes: the buckets, the holds, the request meter counted in the
take's own call, ``take_slots`` and the cancel CAS all work there, as they do on a standalone Redis
(test_hot.py, test_take_many.py, test_request_meter.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import redis.cluster

from tests import support
from workers.budget import RequestMeter, peak_key, rate_key, slot_meter
from workers.hot import RATE_HEADROOM, HotState, bucket_key, connect

SERVERS = ("reports", "billing", "search", "mail", "maps", "chat")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.PrivateRedisCluster]:
    base = tmp_path_factory.mktemp("redis-cluster")
    logs = base / "logs"
    logs.mkdir()
    with support.private_redis_cluster(base / "data", logs, nodes=3) as started:
        yield started


@pytest.fixture
def hot(cluster: support.PrivateRedisCluster) -> Iterator[HotState]:
    state = HotState(cluster.client(), prefix=f"lctest-{uuid.uuid4().hex[:10]}:longcall:")
    try:
        yield state
    finally:
        state.close()


def cluster_client(hot: HotState) -> redis.cluster.RedisCluster:
    assert isinstance(hot.client, redis.cluster.RedisCluster)
    return hot.client


def node_of(hot: HotState, key: str) -> str:
    """The node (host:port) that serves ``key``'s slot."""
    node = cluster_client(hot).get_node_from_key(key)  # type: ignore[no-untyped-call]  # untyped in redis-py
    return str(node.name)


def test_each_servers_bucket_works_and_servers_spread_over_the_nodes(hot: HotState) -> None:
    nodes = {server: node_of(hot, bucket_key(hot.prefix, server, "poll")) for server in SERVERS}
    assert len(set(nodes.values())) >= 2, f"every server's keys on one node: {nodes}"
    for server in SERVERS:
        first = hot.take(server, "poll", 2.0)
        refused = hot.take(server, "poll", 2.0)
        booked = hot.take(server, "poll", 2.0, horizon_s=1.0)
        assert (first.granted, first.wait_s) == (True, 0.0), server
        assert not refused.granted
        assert 0.4 < refused.wait_s <= 1 / (2.0 * RATE_HEADROOM)
        assert booked.granted
        assert 0.4 < booked.wait_s <= 1 / (2.0 * RATE_HEADROOM)
        assert hot.client.exists(bucket_key(hot.prefix, server, "poll")) == 1
        # The server's bucket and hold live on the node its tag names, whichever that is.
        assert node_of(hot, hot.hold_key(server)) == nodes[server]


def test_a_hold_refuses_every_take_on_its_server_only(hot: HotState) -> None:
    held, other = (
        "reports",
        next(s for s in SERVERS if node_of(hot, hot.hold_key(s)) != node_of(hot, hot.hold_key("reports"))),
    )
    assert 4.9 < hot.hold(held, 5.0) <= 5.0
    assert 4.5 < hot.held_s(held) <= 5.0
    for budget in ("poll", "control"):
        refused = hot.take(held, budget, 100.0, horizon_s=1.0)
        assert not refused.granted
        assert 4.5 < refused.wait_s <= 5.0
    none = hot.take_slots(held, "poll", 100.0, [0.0] * 5, horizon_s=1.0)
    assert (none.granted, none.counted) == (0, 0)
    assert 4.5 < none.wait_s <= 5.0
    # A server on another node is not held.
    assert hot.held_s(other) == 0.0
    assert hot.take(other, "poll", 100.0).granted


def test_the_request_is_counted_in_the_takes_own_call_and_the_readers_read_one_slot(hot: HotState) -> None:
    meter = RequestMeter(hot.client, hot.prefix, "reports", "poll")
    count = meter.count()
    nodes = {node_of(hot, key) for key in (*count.slots.keys, bucket_key(hot.prefix, "reports", "poll"))}
    assert len(nodes) == 1
    assert hot.take("reports", "poll", 1000.0, meter=count).granted
    assert count.counted
    many = hot.take_slots(
        "reports", "poll", 1000.0, [0.0] * 3, meter=slot_meter(hot.prefix, "reports", "poll")
    )
    assert (many.granted, many.counted) == (3, 3)
    meter()  # request_meter.lua: a request whose token was paid before
    second = int(time.time())
    seconds = range(second - 10, second + 1)
    # The metrics' and the gate's reads: one MGET over one server's seconds (hours) is one slot.
    counts = hot.client.mget([rate_key(hot.prefix, "reports", "poll", s) for s in seconds])
    assert sum(int(v) for v in counts if v is not None) == 5
    peaks = hot.client.mget([peak_key(hot.prefix, "reports", "poll", s) for s in (second - 3600, second)])
    assert max(int(v) for v in peaks if v is not None) >= 4


def test_take_slots_books_what_the_horizon_reaches_on_a_cluster(hot: HotState) -> None:
    tokens = hot.take_slots("billing", "control", 2.0, [0.0] * 5, horizon_s=1.0)
    interval = 1 / (2.0 * RATE_HEADROOM)
    assert tokens.granted == 2
    assert tokens.delays_s[0] == 0.0
    assert tokens.delays_s[1] == pytest.approx(interval, abs=0.02)
    assert 0.0 < tokens.wait_s <= interval


def test_one_cancel_wins_the_cas_on_a_cluster_and_a_lost_key_is_reseeded(hot: HotState) -> None:
    op_id = uuid.uuid4()
    assert hot.bump_cancel_generation(op_id, 3) == (True, 4)
    assert hot.bump_cancel_generation(op_id, 3) == (False, 4)
    hot.client.delete(f"{hot.prefix}cancel:{op_id}")
    assert hot.bump_cancel_generation(op_id, 4) == (True, 5)
    hot.seed_cancel_generation(op_id, 9)
    assert hot.bump_cancel_generation(op_id, 9) == (True, 10)


def test_from_url_opens_a_cluster_client(cluster: support.PrivateRedisCluster) -> None:
    hot = HotState.from_url(cluster.url, prefix=f"lctest-{uuid.uuid4().hex[:10]}:longcall:", cluster=True)
    try:
        assert len(cluster_client(hot).get_primaries()) == 3  # type: ignore[no-untyped-call]
        assert hot.take("reports", "poll", 10.0).granted
    finally:
        hot.close()


def test_a_cluster_no_node_of_which_answers_is_a_connection_error() -> None:
    """redis-py's cluster client asks for the slots as it is made, and its refusal is no ``RedisError``:
    ``connect`` raises it as the ``ConnectionError`` a standalone Redis's first command would, which the
    steps meet as "no token" (due again shortly)."""
    nobody = support.free_port()
    with pytest.raises(
        redis.ConnectionError, match=f"the Redis Cluster at 127.0.0.1:{nobody} cannot be reached"
    ):
        connect(f"redis://user:secret@127.0.0.1:{nobody}/0", cluster=True)
