"""A worker and beat survive their Redis going away (issue 19 item 0): they reconnect and go on, and no
message is lost on the way.

Two levels. The channel (``workers.broker``), in this process: a consumer with a message in hand loses its
Redis, and Celery's consumer handles the loss as it does in a worker (``on_connection_error_after_connected``:
``collect()``, then ``close()``); kombu used to raise ``AttributeError: 'NoneType' object has no attribute
'hostname'`` there and on the late acknowledgement, which Celery calls an unrecoverable error (the worker
exits). The fleet: two longcall workers and beat on a Redis of this test's own, started with the compose
file's command (append-only file, fsync always), operations in flight, and status reads and creates held by
the server, so polls and submissions are in the workers' hands when Redis goes: it crashes (kill -9) and comes
back, shuts down and comes back, stays down for ten seconds, or freezes for ten seconds (SIGSTOP: nothing
answers, nothing closes). Every process is still the one that started, beat's ticks reach the workers again,
operations sent after the fault run to their end, every message in a worker's hand at the fault has run, and
nothing is lost: every call node has one task on the server, its receipt reaches the pipeline, and every
submission in hand answers its caller (its answer stored through the fault, not dropped "outside body").
"""

from __future__ import annotations

import json
import re
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis
from celery import Celery
from celery.worker.consumer.consumer import Consumer
from kombu import Connection, Exchange, Message, Queue
from kombu.asynchronous import Hub

from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.integration.faults.test_faults_durability import compose_redis_flags
from tests.support.fleet import Fleet, FleetParts, running_fleet
from workers.app import create_app
from workers.broker import RedisChannel, RedisQoS, RedisTransport, WorkerConsumer
from workers.settings import Settings

S = OpState
FINAL = (S.ACCEPTED, S.CANCELLED_ACCEPTED)

PREFIX = "lc-broker:"

# ------------------------------------------------------------------ the channel, in this process


#: A direct exchange of the queues' own, as Celery publishes a task (its queues share one).
EXCHANGE = Exchange("lc-test", type="direct")
HELD = Queue("held", EXCHANGE, routing_key="held")
IDLE = Queue("idle", EXCHANGE, routing_key="idle")


@dataclass
class Consuming:
    """A longcall broker connection consuming ``held`` through an event loop as a worker does (what it
    delivers lands in ``received``), and a second channel consuming ``idle`` (a worker has several)."""

    app: Celery
    connection: Connection
    client: redis.Redis
    received: list[Message]
    loop: Iterator[Any]

    def publish(self) -> None:
        with self.app.producer_or_acquire() as producer:
            producer.publish(
                {"n": 1}, exchange=EXCHANGE, routing_key="held", declare=[HELD, IDLE], serializer="json"
            )

    def deliver(self) -> Message:
        support.wait_for("the message to be delivered", lambda: next(self.loop) or self.received, timeout=20)
        return self.received[0]


@contextmanager
def consuming(server: support.PrivateRedis) -> Iterator[Consuming]:
    app = create_app(Settings(redis_url=server.url, broker_keyprefix=PREFIX))
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    connection = app.connection_for_read()
    hub = Hub()
    try:
        connection.ensure_connection(max_retries=3)
        connection.register_with_event_loop(hub)
        received: list[Message] = []
        connection.Consumer(
            [HELD], callbacks=[lambda _body, m: received.append(m)], accept=["json"]
        ).consume()
        connection.Consumer(
            [IDLE], channel=connection.channel(), callbacks=[lambda _body, _m: None], accept=["json"]
        ).consume()
        yield Consuming(app, connection, client, received, hub.create_loop())
    finally:
        client.close()
        connection.release()
        hub.close()


@contextmanager
def consumer_holding_a_message(
    server: support.PrivateRedis,
) -> Iterator[tuple[Celery, Connection, Message, redis.Redis]]:
    """:class:`Consuming` on ``server``, with one message delivered and not acknowledged, and a BRPOP in
    flight on both channels (what the worker's loop keeps sent while it waits)."""
    with consuming(server) as broker:
        broker.publish()
        message = broker.deliver()
        transport = broker.connection.transport
        assert isinstance(transport, RedisTransport)
        assert transport.cycle is not None
        transport.cycle.on_poll_start()  # the loop's next tick: a BRPOP on every consuming channel
        assert isinstance(message.channel, RedisChannel)
        assert broker.client.hlen(f"{PREFIX}unacked") == 1
        yield broker.app, broker.connection, message, broker.client


def lose_the_connection_as_a_worker_does(app: Celery, connection: Connection) -> None:
    """What the worker's consumer runs when its broker connection fails (celery 5.7.0), with a stand-in for
    the consumer's own state. It ignores connection errors; anything else is what stops a worker."""
    consumer = SimpleNamespace(
        connection=connection, app=app, pool=None, qos_global=False, max_prefetch_count=1
    )
    with warnings.catch_warnings():
        # Celery warns that worker_cancel_long_running_tasks_on_connection_loss will default to True.
        warnings.simplefilter("ignore")
        Consumer.on_connection_error_after_connected(
            cast(Consumer, consumer), redis.ConnectionError("broker gone")
        )


def test_a_channel_that_loses_redis_closes_and_acknowledges_its_message_once_redis_is_back(
    tmp_path: Path, log_dir: Path
) -> None:
    """Redis crashes with a message in the consumer's hand. The connection is dropped without an error other
    than a connection error, the message stays in the persisted unacked hash while Redis is down, and the
    acknowledgement of its task, run after Redis is back, removes it (on main: AttributeError 'hostname' in
    both places)."""
    with (
        support.private_redis(tmp_path / "redis", log_dir, *compose_redis_flags()) as server,
        consumer_holding_a_message(server) as (app, connection, message, client),
    ):
        server.stop(signal.SIGKILL)
        lose_the_connection_as_a_worker_does(app, connection)
        assert isinstance(message.channel, RedisChannel)
        assert message.channel.closed

        server.start()
        assert client.hlen(f"{PREFIX}unacked") == 1  # not given back (Redis was down), not lost
        message.ack()
        assert client.hlen(f"{PREFIX}unacked") == 0
        assert client.zcard(f"{PREFIX}unacked_index") == 0
        assert client.llen(f"{PREFIX}held") == 0  # finished, so not delivered again


def test_a_requeue_on_a_channel_closed_by_the_loss_gives_the_message_back(
    tmp_path: Path, log_dir: Path
) -> None:
    """A task that ran through the loss is rejected with requeue afterwards (its pool process died:
    ``task_reject_on_worker_lost``): once Redis is back, its message goes back to its queue at once (on main:
    AttributeError 'hostname', the message left for the visibility timeout, the worker's loop broken)."""
    with (
        support.private_redis(tmp_path / "redis", log_dir, *compose_redis_flags()) as server,
        consumer_holding_a_message(server) as (app, connection, message, client),
    ):
        server.stop(signal.SIGKILL)
        lose_the_connection_as_a_worker_does(app, connection)
        server.start()

        message.reject(requeue=True)
        assert client.hlen(f"{PREFIX}unacked") == 0
        assert client.llen(f"{PREFIX}held") == 1


def test_a_message_given_back_on_close_is_not_acknowledged_again_by_the_closed_channel(
    tmp_path: Path, log_dir: Path
) -> None:
    """A channel that closes while Redis is up gives its message back to the queue; the next delivery holds it
    under the same delivery tag. The first holder's late acknowledgement must not remove the next holder's
    entry from the unacked hash: if that holder then died, the message would be in no queue and no hash."""
    with (
        support.private_redis(tmp_path / "redis", log_dir, *compose_redis_flags()) as server,
        consumer_holding_a_message(server) as (app, connection, message, client),
    ):
        lose_the_connection_as_a_worker_does(app, connection)
        assert client.llen(f"{PREFIX}held") == 1  # given back
        with app.connection_for_read() as again:
            channel = again.default_channel
            assert isinstance(channel, RedisChannel)
            redelivered = channel.basic_get("held")
            assert redelivered is not None
            assert redelivered.delivery_tag == message.delivery_tag
            assert client.hlen(f"{PREFIX}unacked") == 1

            message.ack()  # the first holder's task ends
            assert client.hlen(f"{PREFIX}unacked") == 1  # still the second holder's
            redelivered.ack()
            assert client.hlen(f"{PREFIX}unacked") == 0


def test_a_message_taken_off_its_queue_as_redis_goes_is_given_back_once_redis_is_back(
    tmp_path: Path, log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu takes a message off its queue (BRPOP), then records it in the unacked hash. Redis goes between
    the two (killed at that instant): the message is in no queue and no hash, only in this process. The
    consumer, connected again, gives it back to the front of its queue (on main: lost; the fleet test below
    lost a submission sent by name that way)."""
    with (
        support.private_redis(tmp_path / "redis", log_dir, *compose_redis_flags()) as server,
        consuming(server) as broker,
    ):
        record = RedisQoS.append

        def redis_goes_first(self: RedisQoS, message: Any, delivery_tag: str) -> None:
            server.stop(signal.SIGKILL)
            record(self, message, delivery_tag)

        monkeypatch.setattr(RedisQoS, "append", redis_goes_first)
        broker.publish()
        with pytest.raises(redis.ConnectionError):  # what the worker's consumer takes for a lost connection
            broker.deliver()
        monkeypatch.setattr(RedisQoS, "append", record)
        assert not broker.received
        lose_the_connection_as_a_worker_does(broker.app, broker.connection)

        server.start()
        client = broker.client
        # Off its queue, not in the hash: only in this process.
        assert (client.llen(f"{PREFIX}held"), client.hlen(f"{PREFIX}unacked")) == (0, 0)
        with broker.app.connection_for_read() as again:
            again.ensure_connection(max_retries=3)
            consumer_state = cast(WorkerConsumer, SimpleNamespace(dropped=[]))
            assert WorkerConsumer.give_back_dropped(consumer_state, again) == 1
            assert client.llen(f"{PREFIX}held") == 1
            channel = again.default_channel
            assert isinstance(channel, RedisChannel)
            redelivered = channel.basic_get("held")
            assert redelivered is not None
            assert redelivered.decode() == {"n": 1}
            redelivered.ack()
        assert (client.llen(f"{PREFIX}held"), client.hlen(f"{PREFIX}unacked")) == (0, 0)


# ------------------------------------------------------------------ a fleet

#: How long the server holds each status read while Redis goes away: the polls are in a worker's hand.
HELD_POLL_MS = 1500

#: How long Redis stays down in the outage case.
OUTAGE_S = 10.0

RECEIVED = re.compile(r"Task (longcall\.\w+)\[([^\]]+)\] received")


def exited(fleet: Fleet) -> list[str]:
    """longcall's processes (its workers and beat) no longer running, with their logs' ends."""
    return [
        f"{p.name} exited with {p.proc.returncode}:\n{p.log()[-3000:]}"
        for p in fleet.processes
        if p.name != "pipeline" and p.proc.poll() is not None
    ]


def final_or_exited(fleet: Fleet, call_node_id: str) -> Callable[[], bool]:
    def probe() -> bool:
        op = fleet.ledger.find_by_call_node(call_node_id)
        return bool(exited(fleet)) or (op is not None and op.state in FINAL)

    return probe


def finished(fleet: Fleet, task_id: str) -> bool:
    """A longcall worker logged the end of this message: the task ran (its result, or its error), or it had
    expired and was discarded (a beat tick past its ``expires``, superseded by the next one)."""
    tid = re.escape(task_id)
    ended = re.compile(rf"\[{tid}\] (succeeded|raised)|Discarding revoked task: \S+\[{tid}\]")
    return any(ended.search(w.log()) for w in fleet.workers())


def received(fleet: Fleet) -> list[tuple[str, str]]:
    """(task name, task id) of every message the longcall workers have received, in their logs' order."""
    return [(m[1], m[2]) for w in fleet.workers() for m in RECEIVED.finditer(w.log())]


def received_since_reconnect(fleet: Fleet) -> set[str]:
    """The ids of the messages the longcall workers received on their current broker connection."""
    since = set()
    for worker in fleet.workers():
        log = worker.log()
        since |= {m[2] for m in RECEIVED.finditer(log, log.rfind("Connected to redis"))}
    return since


def unacked(client: redis.Redis, prefix: str) -> dict[str, str]:
    """The messages in the broker's unacked hash: task id -> task name."""
    held: dict[str, str] = {}
    for raw in client.hvals(f"{prefix}unacked"):
        payload: dict[str, Any] = json.loads(raw)[0]
        held[payload["headers"]["id"]] = payload["headers"]["task"]
    return held


def held_by_the_server(fleet: Fleet, method: str, *, since: float) -> None:
    """Wait until the server has received (and holds) at least two ``method`` requests since ``since``."""
    support.wait_for(
        f"{method} requests on their way (received by the server, held)",
        lambda: sum(1 for e in fleet.mcp.log() if e["method"] == method and e["t"] > since) >= 2,
        timeout=30,
    )


def break_redis(server: support.PrivateRedis, fault: str) -> None:
    if fault == "crash":
        server.restart(signal.SIGKILL)
    elif fault == "restart":
        server.restart(signal.SIGTERM)
    elif fault == "outage":
        server.stop(signal.SIGTERM)
        back_at = time.monotonic() + OUTAGE_S
        support.wait_for("the outage to last its time", lambda: time.monotonic() >= back_at, timeout=60)
        server.start()
    else:
        # Unreachable without a word (a host or network gone silent): connections stay open, nothing answers.
        assert fault == "frozen", fault
        assert server.process is not None
        server.process.proc.send_signal(signal.SIGSTOP)
        back_at = time.monotonic() + OUTAGE_S
        try:
            support.wait_for("the freeze to last its time", lambda: time.monotonic() >= back_at, timeout=60)
        finally:
            server.process.proc.send_signal(signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["crash", "restart", "outage", "frozen"])
def test_workers_and_beat_survive_their_redis_going_away_and_lose_nothing(
    fault: str, ledger: Ledger, database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> None:
    """The pipeline starts after the fault (it is the user's app, on kombu's own transport; and a consumer
    with a short visibility timeout on the same keys would give longcall's unacknowledged messages back
    itself, hiding what the workers do with them)."""
    before = {f"n/before-{i}": round(4.0 + 0.5 * i, 1) for i in range(6)}
    held = {f"n/held-{i}": 1.0 for i in range(4)}
    after = {f"n/after-{i}": 0.5 for i in range(4)}
    nodes = {**before, **held, **after}
    with support.private_redis(tmp_path / "redis", log_dir, *compose_redis_flags()) as hot:
        client = redis.Redis.from_url(hot.url, socket_timeout=5)
        parts = FleetParts(ledger, database_url, broker_prefix, client, tmp_path, log_dir, hot.url)
        try:
            with running_fleet(parts, workers=2, pipeline=False) as fleet:
                for node, seconds in before.items():
                    fleet.submit_nowait(node, "slow_report", {"seconds": seconds})
                for node in before:
                    fleet.wait_operation(node, S.WORKING, *FINAL, timeout=60)
                # A batch of polls is answered when its members start, so its message leaves the workers'
                # hands at once; its members are on their way, on the workers' threads, held by the server.
                held_from = time.time()
                fleet.mcp.faults(delay_ms={"tasks/get": HELD_POLL_MS})
                held_by_the_server(fleet, "tasks/get", since=held_from)
                # Submissions in the workers' hands too: their creates held by the server, so their answers
                # are stored as Redis goes.
                fleet.mcp.faults(delay_ms={"tasks/get": HELD_POLL_MS, "tools/call": HELD_POLL_MS})
                held_at = time.time()
                answers = {
                    node: fleet.submit_nowait(node, "slow_report", {"seconds": seconds})
                    for node, seconds in held.items()
                }
                held_by_the_server(fleet, "tools/call", since=held_at)
                in_hand = unacked(client, broker_prefix)

                break_redis(hot, fault)
                fleet.mcp.faults(delay_ms={})
                received_at_fault = len(received(fleet))

                for node, seconds in after.items():
                    fleet.submit_nowait(node, "slow_report", {"seconds": seconds})
                for node in nodes:
                    support.wait_for(
                        f"the operation of {node} to be final (or a longcall process to exit)",
                        final_or_exited(fleet, node),
                        timeout=120,
                    )
                    assert not exited(fleet), "\n".join(exited(fleet))
                # Beat's ticks reach the workers again (each tick is a new message, received after the fault).
                support.wait_for(
                    "beat's dispatch and drain ticks to be received after the fault",
                    lambda: (
                        {"longcall.dispatch_due", "longcall.drain_outbox"}
                        <= {name for name, _ in received(fleet)[received_at_fault:]}
                    ),
                    timeout=30,
                )
                fleet.start_pipeline()
                support.wait_for(
                    "every receipt delivered",
                    lambda: {r["call_node_id"] for r in fleet.receipts()} == set(nodes),
                    timeout=60,
                )
                support.wait_for("the pipeline to settle", fleet.settled, timeout=60)
                assert not exited(fleet), "\n".join(exited(fleet))

                # Nothing lost: one task per call node on the server, one receipt each, all completed.
                tasks = fleet.mcp.tasks()
                assert sorted(t["arguments"]["seconds"] for t in tasks) == sorted(nodes.values())
                receipts = {r["call_node_id"]: r for r in fleet.receipts()}
                assert {r["terminal_state"] for r in receipts.values()} == {"completed"}
                # The submissions running as Redis went answered their callers: each answer was stored through
                # the fault, not lost with the message acknowledged as a failure "outside body".
                for node, answer in answers.items():
                    assert answer.get(timeout=30)["call_node_id"] == node
                # Every message in a worker's hand as Redis went has run: those it was running, and those it
                # had received and not started, which Celery drops on the loss and the worker's consumer gives
                # back (workers/broker.py); none waits in the unacked hash for the visibility timeout.
                left = unacked(client, broker_prefix)
                not_run = sorted(t for t in in_hand if not finished(fleet, t))
                assert not not_run, (not_run, sorted(left))
                # What the workers took on their new connections leaves the hash once it has run (beat's ticks
                # keep coming, so some are in hand at any moment).
                taken_since = set(left) & received_since_reconnect(fleet)
                support.wait_for(
                    f"the messages taken since the reconnect to be acknowledged: {sorted(taken_since)}",
                    lambda: not taken_since & set(unacked(client, broker_prefix)),
                    timeout=30,
                )
        finally:
            client.close()


@pytest.mark.parametrize(
    ("url", "consumer"),
    [
        ("redis://127.0.0.1:6379/0", "workers.broker:WorkerConsumer"),
        ("amqp://guest@rabbit//", "celery.worker.consumer:Consumer"),
        ("rediss://127.0.0.1:6380/0", "celery.worker.consumer:Consumer"),
    ],
)
def test_the_worker_gives_back_what_it_drops_on_the_redis_broker_it_runs_its_own_channels_on(
    url: str, consumer: str
) -> None:
    """The consumer that gives dropped messages back needs this module's channel (it outlives its
    connection); RabbitMQ gives them back itself, and ``rediss://`` keeps kombu's own transport."""
    assert create_app(Settings(broker_url=url)).conf.worker_consumer == consumer
