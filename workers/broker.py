"""kombu's Redis transport, with one Redis client per channel instead of one per broker command, and a channel
that outlives its connection without taking the worker down.

kombu's Redis channel builds a new ``redis.Redis`` (over its connection pool) for every command it sends
outside its consumer loop: each delivery's unacked bookkeeping, each acknowledgement, each event and each
publish. Building one fills a table of about 170 response callbacks: about 0.1 ms of CPU, three or four times
per task, in the worker's main process (issue 13's profile of a poll step). This channel keeps the client it
built and hands it out again while its connection pool is the same one. A ``redis.Redis`` over a pool is
safe to share: it takes a pool connection per command and gives it back; the pool (and so what is sent, to
which server, with which timeouts and key prefix) is kombu's own, unchanged.

**A worker survives its Redis going away** (issue 19). When the broker connection is lost, Celery's consumer
(``Consumer.on_connection_error_after_connected``) closes the old connection twice: ``collect()``, then
``close()``. The first pass fails early on the channels whose BRPOP was in flight (kombu's ``Channel.close``
reads that reply first, and Redis is gone; the transport's loop over its channels stops at the first that
raises), and ``collect()`` then detaches the transport from its kombu connection (``transport.client =
None``). The second pass closes the channel for real, and kombu, to give
back the messages the worker holds (``restore_unacked``), builds a new connection pool from
``self.connection.client``, which is now None: ``AttributeError: 'NoneType' object has no attribute
'hostname'``. That is not a connection error, so Celery logs "Unrecoverable error" and the worker exits;
the same happens later to the acknowledgement of a task that was running at the loss and ends after the
reconnect (its message belongs to the old channel). kombu does this with its own transport as well (the
same traceback as celery/kombu#582, through the consumer's reconnect instead of gossip); it needs unacked
messages in hand at the loss, so it hits a busy worker, not an idle one.

This channel keeps its connection parameters from when it opened (``_connparams``, computed once), so a
channel whose connection is gone can still reach its Redis: the restore on close either works (Redis is
back) or fails with a connection error, which Celery ignores before it reconnects; and the late
acknowledgement of a task that ran through the loss removes its message from the unacked hash once Redis is
back, instead of raising (or leaving it to be delivered again after the visibility timeout, an hour). A
message is never acknowledged twice across deliveries: once a closing channel has given a message back to
its queue (where the next delivery takes it, under the same delivery tag), its late acknowledgement or
rejection on the old channel leaves Redis alone (``RedisQoS``). A message whose acknowledgement fails
(Redis still down) stays in the unacked hash and is delivered again after the visibility timeout: never lost.

Celery itself forgets, on the loss, the tasks it had received and not started (``WorkerConsumer``): their
messages, which the closing channel could not give back while Redis was down, go back to their queues as
soon as the worker is connected again, instead of an hour later.

**A message taken off its queue as Redis goes is not lost.** kombu takes a message off its queue (BRPOP),
then records it in the unacked hash (a second command). Redis going between the two left the message in no
queue and no hash: only in the worker's memory, which kombu then dropped with the connection (a submission
sent by name, popped as Redis shut down, never ran). ``RedisQoS.append`` keeps such a message
(:data:`UNRECORDED`), and the worker's consumer puts it back at the front of its queue once it is connected
again. A worker killed in that instant (between two Redis replies, well under a millisecond) still loses it:
kombu's Redis transport has no atomic take; a broker that must hold every message through a worker's kill
is RabbitMQ (docs/durability.md, "Brokers").

Used for ``redis://`` brokers (``workers.app.celery_config``); other transports (``rediss://``,
``sentinel://``, AMQP) are kombu's own. A connection over it still shows itself as ``redis://...`` (its
``as_uri``, the worker's banner, the URL Flower reads the broker's queues from): the class is registered
among kombu's transport aliases that connections resolve when they describe themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from kombu import Connection
from kombu import connection as kombu_connection
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

__all__ = ["CONSUMER", "TRANSPORT", "RedisChannel", "RedisQoS", "RedisTransport", "WorkerConsumer"]

#: The ``broker_transport`` setting naming :class:`RedisTransport`.
TRANSPORT = "workers.broker:RedisTransport"
#: The ``worker_consumer`` setting naming :class:`WorkerConsumer`.
CONSUMER = "workers.broker:WorkerConsumer"

logger = logging.getLogger(__name__)


#: Messages this process took off a queue whose record in the unacked hash failed (Redis went as it answered):
#: (payload, exchange, routing key, delivery tag). Only here until the consumer, connected again, gives them
#: back (``WorkerConsumer.give_back_dropped``). A worker's consumer runs on one thread, its event loop.
UNRECORDED: list[tuple[dict[str, Any], str, str, str]] = []


class RedisQoS(kombu_redis.QoS):
    """kombu's Redis acknowledgement emulation, safe for a channel that closed with messages in hand.

    What the channel still holds is ``_delivered``: a message leaves it when it is acknowledged or given back
    to its queue. kombu empties it only once every message is given back; here each one leaves as soon as it
    is, so after a restore that failed half-way (Redis down) it holds exactly the messages whose entries in
    the unacked hash are still this channel's.
    """

    def append(self, message: Any, delivery_tag: str) -> None:
        lost: tuple[type[BaseException], ...] = getattr(self.channel, "connection_errors")  # noqa: B009
        try:
            super().append(message, delivery_tag)
        except lost:
            # Off its queue (the BRPOP that delivered it), not in the unacked hash: kept, or it is lost. (Had
            # the record reached Redis after all, giving it back moves it out of the hash: one delivery.)
            delivery = message.delivery_info
            UNRECORDED.append((message._raw, delivery["exchange"], delivery["routing_key"], delivery_tag))
            logger.warning(
                "A message taken off queue %s as the broker went is kept, to be given back on reconnection",
                delivery["routing_key"],
            )
            raise

    def give_back_unrecorded(self) -> int:
        """Put the messages in :data:`UNRECORDED` back at the front of their queues, each out of the unacked
        hash in the same transaction; how many went back. A connection error leaves the rest for the next
        connect."""
        if not UNRECORDED:
            return 0
        channel = cast("RedisChannel", self.channel)
        given = 0
        with channel.conn_or_acquire() as client:
            while UNRECORDED:
                payload, exchange, routing_key, tag = UNRECORDED[0]
                with client.pipeline() as pipe:
                    getattr(self, "_remove_from_indices")(tag, pipe)  # noqa: B009 - kombu's, not in its stubs
                    restore = getattr(channel, "_do_restore_message")  # noqa: B009
                    restore(payload, exchange, routing_key, pipe, False)
                    pipe.execute()
                UNRECORDED.pop(0)
                given += 1
        return given

    def restore_unacked(self, client: Any | None = None) -> None:
        delivered = self._delivered
        if not delivered:
            return
        channel = cast("RedisChannel", self.channel)
        with channel.conn_or_acquire(client) as acquired:
            for tag in list(delivered):
                self.restore_by_tag(tag, client=acquired)
                delivered.pop(tag, None)

    def ack(self, delivery_tag: str) -> None:
        if self._given_back(delivery_tag):
            virtual.QoS.ack(self, delivery_tag)
            return
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if self._given_back(delivery_tag):
            virtual.QoS.ack(self, delivery_tag)
            return
        super().reject(delivery_tag, requeue=requeue)

    def _given_back(self, delivery_tag: str) -> bool:
        """The channel closed and gave this message back to its queue: its entry in the unacked hash, if any,
        is the next delivery's (the same tag), not this one's."""
        delivered = self._delivered
        return bool(self.channel.closed) and (delivered is None or delivery_tag not in delivered)


class RedisChannel(kombu_redis.Channel):
    """A kombu Redis channel that reuses its synchronous client and outlives its connection (see the module
    docstring)."""

    QoS = RedisQoS

    _kept_client: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._kept_params: dict[bool, dict[str, Any]] = {}
        super().__init__(*args, **kwargs)
        # Both kinds now, while the transport still has its connection (the asynchronous one is already made).
        self._connparams(asynchronous=False)

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        # kombu reads them from the transport's connection each time it builds a pool: after a connection loss
        # that is None by the time the channel closes (module docstring). They never change for a channel.
        kept = self._kept_params.get(asynchronous)
        if kept is None:
            build: Callable[..., dict[str, Any]] = getattr(super(), "_connparams")  # noqa: B009 - kombu's, not in its stubs
            kept = self._kept_params[asynchronous] = build(asynchronous=asynchronous)
        return dict(kept)

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


class WorkerConsumer(Consumer):
    """Celery's worker consumer, which gives back at once the messages it drops on a connection loss.

    When its broker connection drops, Celery forgets the tasks it had received and not started: those waiting
    for a pool process and those waiting for their countdown (``Consumer.on_close``: "they can't be acked
    anyway"). RabbitMQ gives their messages back as the channel closes; on Redis the closing channel gives
    back what it holds, which fails while Redis is down, and the messages then wait in the unacked hash for
    the visibility timeout: a submit, a cancel or an answer sent by name would start an hour later. This
    consumer keeps those requests and, once it is connected again, puts each message the old channel still
    holds back at the front of its queue (kombu's restore, through the new channel; the old channel then
    treats it as given back). A request that started after all (its pool process had it already) is left
    to finish and acknowledge.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The requests Celery dropped on a connection loss, their messages not given back yet.
        self.dropped: list[Any] = []

    def on_close(self) -> None:
        # Reserved (waiting for a pool process) or scheduled (a countdown, as the dispatcher's short ones):
        # what Celery is about to forget. Those that run stay with their pool process.
        waiting = {*worker_state.reserved_requests, *getattr(worker_state, "scheduled_requests", ())}
        dropped = [r for r in waiting if r not in worker_state.active_requests]
        super().on_close()
        self.dropped.extend(dropped)

    def connect(self) -> Connection:
        connection = super().connect()
        self.give_back_dropped(connection)
        return connection

    def give_back_dropped(self, connection: Connection) -> int:
        """Put the messages of the dropped requests back in their queues; how many went back."""
        channel = connection.default_channel
        if not isinstance(channel, RedisChannel):
            self.dropped.clear()
            return 0
        given = cast(RedisQoS, channel.qos).give_back_unrecorded()
        while self.dropped:
            request = self.dropped[0]
            message = request.message
            held = getattr(message.channel, "qos", None)
            delivered = held._delivered if isinstance(held, RedisQoS) else None
            started = request.acknowledged or request.time_start is not None
            if not started and delivered is not None and message.delivery_tag in delivered:
                # Not given back or acknowledged yet: still this worker's. (A connection error here leaves it
                # in the list, for the next connect.)
                cast(RedisQoS, channel.qos).restore_by_tag(message.delivery_tag)
                delivered.pop(message.delivery_tag, None)
                request.acknowledged = True  # the message is the next delivery's now
                given += 1
            self.dropped.pop(0)
        if given:
            logger.warning("Gave back %d message(s) taken before the connection loss and not started", given)
        return given


# What a connection over it calls its transport when it describes itself (``Connection.as_uri``).
_ALIASES: dict[str, str] = getattr(kombu_connection, "resolve_aliases")  # noqa: B009 - not in kombu's stubs
_ALIASES.setdefault(TRANSPORT, "redis")
