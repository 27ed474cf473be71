"""kombu's Redis transport, with one Redis client per channel instead of one per broker command.

kombu's Redis channel builds a new ``redis.Redis`` (over its connection pool) for every command it sends
outside its consumer loop: each delivery's unacked bookkeeping, each acknowledgement, each event and each
publish. Building one fills a table of about 170 response callbacks: about 0.1 ms of CPU, three or four times
per task, in the worker's main process (issue 13's profile of a poll step). This channel keeps the client it
built and hands it out again while its connection pool is the same one. A ``redis.Redis`` over a pool is
safe to share: it takes a pool connection per command and gives it back; the pool (and so what is sent, to
which server, with which timeouts and key prefix) is kombu's own, unchanged.

Used for ``redis://`` brokers (``workers.app.celery_config``); other transports (``rediss://``,
``sentinel://``, AMQP) are kombu's own. A connection over it still shows itself as ``redis://...`` (its
``as_uri``, the worker's banner, the URL Flower reads the broker's queues from): the class is registered
among kombu's transport aliases that connections resolve when they describe themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kombu import connection as kombu_connection
from kombu.transport import redis as kombu_redis

__all__ = ["TRANSPORT", "RedisChannel", "RedisTransport"]

#: The ``broker_transport`` setting naming :class:`RedisTransport`.
TRANSPORT = "workers.broker:RedisTransport"


class RedisChannel(kombu_redis.Channel):
    """A kombu Redis channel that reuses its synchronous client (see the module docstring)."""

    _kept_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        build: Callable[..., Any] = getattr(super(), "_create_client")  # noqa: B009 - kombu's, not in its stubs
        if asynchronous:
            return build(asynchronous=True)
        kept = self._kept_client
        # A reconnected channel has a new pool: the client is built again over it.
        if kept is None or kept.connection_pool is not getattr(self, "pool"):  # noqa: B009
            kept = self._kept_client = build(asynchronous=False)
        return kept

    def close(self) -> None:
        self._kept_client = None
        super().close()


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport over :class:`RedisChannel`."""

    Channel = RedisChannel


# What a connection over it calls its transport when it describes itself (``Connection.as_uri``).
_ALIASES: dict[str, str] = getattr(kombu_connection, "resolve_aliases")  # noqa: B009 - not in kombu's stubs
_ALIASES.setdefault(TRANSPORT, "redis")
