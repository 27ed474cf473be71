"""Issue 21: a fleet whose hot state is a real 3-node Redis Cluster (``LONGCALL_REDIS_CLUSTER``), its broker
and result backend a standalone Redis (the shared one, under the test's prefix).

Real processes (longcall's MCP server, a longcall worker, beat, the pipeline's worker), real Postgres, a
cluster of three ``redis-server`` in cluster mode started by the test. Operations complete and one is
cancelled; the buckets, the request counts and the cancel generation are on the cluster and none of them on
the standalone Redis, which holds the queues and the results the callers waited on; ``longcall metrics``
and the launch gate read the cluster too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.cluster

from console.launch_gate import evaluate_gate
from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet
from workers.budget import rate_key
from workers.hot import bucket_key, cancel_key
from workers.settings import Settings

S = OpState


@pytest.fixture
def cluster(tmp_path: Path, log_dir: Path) -> Iterator[support.PrivateRedisCluster]:
    with support.private_redis_cluster(tmp_path / "cluster", log_dir, nodes=3) as started:
        yield started


@pytest.fixture
def cluster_fleet(fleet_parts: FleetParts, cluster: support.PrivateRedisCluster) -> Iterator[Fleet]:
    """One longcall worker, beat and the pipeline's worker: the hot state on ``cluster``, the broker (and so
    the results) on the standalone Redis the pipeline uses."""
    env = {
        "LONGCALL_REDIS_URL": cluster.url,
        "LONGCALL_REDIS_CLUSTER": "true",
        "LONGCALL_BROKER_URL": fleet_parts.redis_url,
    }
    with running_fleet(fleet_parts, env=env, workers=1) as fleet:
        yield fleet


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


def test_a_fleet_keeps_its_hot_state_on_a_redis_cluster_and_its_queues_and_results_beside_it(
    cluster_fleet: Fleet, cluster: support.PrivateRedisCluster, fleet_parts: FleetParts
) -> None:
    fleet = cluster_fleet
    prefix = f"{fleet_parts.broker_prefix}longcall:"
    # Waited on through the result backend: the broker's Redis.
    done = [fleet.submit(f"n/cluster-{i}", "slow_report", {"seconds": 0.3}) for i in range(3)]
    long = fleet.submit("n/cluster-cancel", "slow_report", {"seconds": 600})
    fleet.wait_state(long, S.WORKING)

    # Polled every 200 ms meanwhile: the metrics read its requests from the cluster.
    samples = metrics_once(fleet)
    assert samples[("longcall_redis_up", ())] == 1
    polls = (("class", "poll"), ("server", "reports"))
    assert samples[("longcall_server_requests_max_per_second", polls)] >= 1
    assert samples[("longcall_queue_length", (("queue_name", "longcall.poll"),))] >= 0

    answer = fleet.send("longcall.cancel", op_id=str(long))  # its CAS on the cluster
    assert answer["op_id"] == str(long)
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

    client = cluster.client()
    try:
        on_cluster = cluster_keys(client, prefix)
        expected = {
            bucket_key(prefix, "reports", "poll"),
            bucket_key(prefix, "reports", "control"),
            cancel_key(prefix, long),
        }
        assert expected <= on_cluster, sorted(on_cluster)
        assert any(
            key.startswith(rate_key(prefix, "reports", "poll", 0).removesuffix("0")) for key in on_cluster
        )
        # One server's keys on one node: each script call's keys share the server's slot.
        nodes = {client.get_node_from_key(key).name for key in expected - {cancel_key(prefix, long)}}  # type: ignore[no-untyped-call]
        assert len(nodes) == 1
    finally:
        client.close()
    # The standalone Redis holds none of the hot state: its queues and the callers' results only.
    standalone = {key.decode() for key in fleet.redis.scan_iter(match=f"{fleet_parts.broker_prefix}*")}
    assert not {key for key in standalone if key.startswith(prefix)}, sorted(standalone)
    assert any("celery-task-meta-" in key for key in standalone), sorted(standalone)

    # The launch gate reads the servers' peak request counts from the cluster.
    settings = Settings(
        database_url=fleet_parts.database_url,
        redis_url=cluster.url,
        redis_cluster=True,
        broker_url=fleet_parts.redis_url,
        broker_keyprefix=fleet_parts.broker_prefix,
        config=Path(fleet.env["LONGCALL_CONFIG"]),
    )
    amplification = next(
        c for c in evaluate_gate(fleet.ledger, settings).criteria if c.name == "poll amplification"
    )
    assert amplification.passed, amplification
    assert "reports poll 0/s" not in amplification.measured, amplification.measured
