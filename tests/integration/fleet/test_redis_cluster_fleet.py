"""Issue 21: a fleet whose hot state is a real 3-node Redis Cluster (``LONGCALL_REDIS_CLUSTER``), its broker
a standalone Redis (the shared one, under the test's prefix) or RabbitMQ (a vhost of the test's own).

Real processes (longcall's MCP server, a longcall worker, beat, the pipeline's worker), real Postgres, a
cluster of three ``redis-server`` in cluster mode started by the test. Operations complete and one is
cancelled, their answers waited on by a caller whose result backend is the one the settings name (the
broker's Redis; ``rpc://`` on RabbitMQ); the buckets, the request counts and the cancel generation are on
the cluster and none of them on the standalone Redis; ``longcall metrics`` and the launch gate read the
cluster too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.cluster
from celery import Celery

from console.launch_gate import evaluate_gate
from ledger.states import OpState
from tests import support
from tests.support.fleet import BROKERS, Fleet, FleetParts, running_fleet
from workers.budget import rate_key
from workers.hot import bucket_key, cancel_key, hold_key
from workers.settings import Settings

S = OpState


@pytest.fixture
def cluster(tmp_path: Path, log_dir: Path) -> Iterator[support.PrivateRedisCluster]:
    with support.private_redis_cluster(tmp_path / "cluster", log_dir, nodes=3) as started:
        yield started


@pytest.fixture
def settings(fleet_parts: FleetParts, cluster: support.PrivateRedisCluster) -> Settings:
    """The fleet's: the hot state on ``cluster``, the broker the standalone Redis the pipeline uses, or the
    test's RabbitMQ vhost."""
    return Settings(
        database_url=fleet_parts.database_url,
        redis_url=cluster.url,
        redis_cluster=True,
        broker_url=fleet_parts.broker_url or fleet_parts.redis_url,
        broker_keyprefix=fleet_parts.broker_prefix,
        config=fleet_parts.tmp_path / "longcall.toml",  # running_fleet writes it there
    )


@pytest.fixture
def cluster_fleet(fleet_parts: FleetParts, settings: Settings) -> Iterator[Fleet]:
    """One longcall worker, beat and the pipeline's worker on ``settings``."""
    env = {
        "LONGCALL_REDIS_URL": settings.redis_url,
        "LONGCALL_REDIS_CLUSTER": "true",
        "LONGCALL_BROKER_URL": settings.broker,
    }
    with running_fleet(fleet_parts, env=env, workers=1) as fleet:
        yield fleet


@pytest.fixture
def caller(settings: Settings) -> Iterator[Celery]:
    """A pipeline's app that waits on longcall's answers: its result backend is the fleet's."""
    app = Celery("caller", broker=settings.broker, backend=settings.result_backend, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options={"global_keyprefix": settings.broker_keyprefix},
        result_backend_transport_options={"global_keyprefix": settings.broker_keyprefix},
    )
    try:
        yield app
    finally:
        app.close()


def send(app: Celery, fleet: Fleet, task: str, **kwargs: Any) -> tuple[str, Any]:
    """Send ``task`` and wait for its answer: (its task id, the answer)."""
    if task == "longcall.submit":
        kwargs["on_terminal"] = dict(fleet.pipeline.signature("pipeline.record", queue="pipeline"))
    sent = app.send_task(task, kwargs=kwargs, queue="longcall.control")
    return sent.id, sent.get(timeout=30)


def metrics_once(fleet: Fleet) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    done = subprocess.run(
        [sys.executable, "-m", "console", "metrics", "--once", "--json"],
        cwd=support.REPO,
        env=support.celery_env(fleet.env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return {
        (sample["name"], tuple(sorted(sample["labels"].items()))): sample["value"]
        for family in json.loads(done.stdout)["metrics"]
        for sample in family["samples"]
    }


def cluster_keys(client: redis.cluster.RedisCluster, prefix: str) -> set[str]:
    """Every key under ``prefix`` on every node of the cluster."""
    return {key.decode() for key in client.scan_iter(match=f"{prefix}*", count=1000)}


@pytest.mark.parametrize("broker", BROKERS)
def test_a_fleet_keeps_its_hot_state_on_a_redis_cluster_and_its_queues_and_results_beside_it(
    cluster_fleet: Fleet,
    cluster: support.PrivateRedisCluster,
    fleet_parts: FleetParts,
    settings: Settings,
    caller: Celery,
) -> None:
    fleet = cluster_fleet
    prefix = f"{fleet_parts.broker_prefix}longcall:"

    answered: list[str] = []

    def submit(call_node_id: str, seconds: float) -> uuid.UUID:
        arguments = {"seconds": seconds}
        task_id, answer = send(
            caller,
            fleet,
            "longcall.submit",
            call_node_id=call_node_id,
            server="reports",
            tool="slow_report",
            arguments=arguments,
        )
        answered.append(task_id)
        return uuid.UUID(answer["op_id"])

    done = [submit(f"n/cluster-{i}", 0.3) for i in range(3)]
    long = submit("n/cluster-cancel", 600)
    fleet.wait_state(long, S.WORKING)
    client = cluster.client()
    try:
        # Polled every 200 ms meanwhile: its poll bucket (kept a second past its last slot) is on the
        # cluster, on the node of the server's slot, and the metrics read its requests from there.
        poll_bucket = bucket_key(prefix, "reports", "poll")
        support.wait_for("the poll bucket on the cluster", lambda: client.exists(poll_bucket) == 1)
        # One server's keys on one node: each script call's keys share the server's slot.
        nodes = {
            client.get_node_from_key(key).name  # type: ignore[no-untyped-call]  # untyped in redis-py
            for key in (poll_bucket, bucket_key(prefix, "reports", "control"), hold_key(prefix, "reports"))
        }
        assert len(nodes) == 1
        # The peak is over whole seconds past (the current one is still counting): the polls so far may all
        # be in this second, so the metrics are read again until one has passed (polled every 200 ms).
        polls = (("class", "poll"), ("server", "reports"))
        samples = support.wait_for(
            "a poll counted in a whole second past",
            lambda: (
                found
                if (found := metrics_once(fleet))[("longcall_server_requests_max_per_second", polls)] >= 1
                else None
            ),
            timeout=30,
        )
        assert samples[("longcall_redis_up", ())] == 1
        queued = ("longcall_queue_length", (("queue_name", "longcall.poll"),))
        assert (queued in samples) is (fleet.vhost is None)  # read from a Redis broker, not the cluster

        task_id, answer = send(caller, fleet, "longcall.cancel", op_id=str(long))  # its CAS on the cluster
        assert answer["op_id"] == str(long)
        answered.append(task_id)
        cancelled = fleet.wait_receipt("n/cluster-cancel", timeout=30)
        assert (cancelled["terminal_state"], cancelled["result"]) == ("cancelled", None)
        for index in range(3):
            receipt = fleet.wait_receipt(f"n/cluster-{index}", timeout=30)
            assert receipt["terminal_state"] == "completed"
        support.wait_for("the outbox and the pipeline to settle", fleet.settled)
        assert sorted(r["call_node_id"] for r in fleet.receipts()) == sorted(
            [*(f"n/cluster-{i}" for i in range(3)), "n/cluster-cancel"]
        )
        assert {fleet.ledger.get(op_id).state for op_id in done} == {S.ACCEPTED}
        assert fleet.ledger.get(long).state is S.CANCELLED_ACCEPTED

        # The cancel generation, and the requests counted by bucket and second, stay on the cluster.
        on_cluster = cluster_keys(client, prefix)
        assert cancel_key(prefix, long) in on_cluster, sorted(on_cluster)
        for budget in ("poll", "control"):
            counted = rate_key(prefix, "reports", budget, 0).removesuffix("0")
            assert any(key.startswith(counted) for key in on_cluster), (budget, sorted(on_cluster))
    finally:
        client.close()
    # The standalone Redis holds none of the hot state: the queues and the callers' results of a Redis
    # broker, the pipeline's sink.
    standalone = {key.decode() for key in fleet.redis.scan_iter(match=f"{fleet_parts.broker_prefix}*")}
    assert not {key for key in standalone if key.startswith(prefix)}, sorted(standalone)
    kept = {f"{fleet_parts.broker_prefix}celery-task-meta-{task_id}" for task_id in answered}
    # Where the settings say: on the broker's Redis, or sent back over RabbitMQ (rpc://) and kept nowhere.
    assert kept & standalone == (kept if fleet.vhost is None else set()), sorted(standalone)

    # The launch gate reads the servers' peak request counts from the cluster.
    amplification = next(
        c for c in evaluate_gate(fleet.ledger, settings).criteria if c.name == "poll amplification"
    )
    assert amplification.passed, amplification
    assert "reports poll 0/s" not in amplification.measured, amplification.measured
