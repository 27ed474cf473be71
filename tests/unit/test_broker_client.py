"""A Redis broker's channel keeps one client (workers/broker.py), and the fleet still names its broker
``redis://`` (issue 13: kombu built a Redis client for every ack, unacked record and event)."""

from __future__ import annotations

import pytest

from workers.app import create_app
from workers.broker import RedisChannel, RedisTransport
from workers.settings import Settings


def test_a_redis_broker_channel_hands_out_one_client_until_its_pool_changes() -> None:
    app = create_app(Settings(broker_url="redis://:secret@127.0.0.1:6379/5", broker_keyprefix="lc:"))
    with app.connection_for_write() as connection:
        assert isinstance(connection.transport, RedisTransport)
        channel = connection.default_channel
        assert isinstance(channel, RedisChannel)
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
        assert first.connection_pool is channel.pool
        # Its key prefix is kombu's own, unchanged.
        assert first.global_keyprefix == "lc:"
        # A reconnect builds a new pool: the client is built again over it.
        channel._pool = None  # type: ignore[attr-defined]
        with channel.conn_or_acquire() as third:
            assert third is not first
            assert third.connection_pool is channel.pool
        # It still shows itself as a redis:// broker (the worker's banner, Flower's broker page).
        assert connection.as_uri() == "redis://:**@127.0.0.1:6379/5"
        assert connection.as_uri(include_password=True) == "redis://:secret@127.0.0.1:6379/5"
        assert connection.transport.driver_type == "redis"


@pytest.mark.parametrize(
    "url", ["amqp://guest@rabbit//", "rediss://127.0.0.1:6380/0", "sentinel://127.0.0.1:26379"]
)
def test_other_brokers_keep_kombus_own_transport(url: str) -> None:
    app = create_app(Settings(broker_url=url))
    assert app.conf.broker_transport is None
