"""Issue 22, item 2: the runnable ``examples/pipeline/`` on a real fleet: its own Celery app and worker,
``client.call(..., then=chain(...))``, the receipt handled once even when it is delivered twice."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests import support
from tests.support.fleet import Fleet

QUEUE = "example-pipeline"


def run_example(env: dict[str, str]) -> dict[str, Any]:
    """``python -m examples.pipeline.run n/example`` as a user runs it: longcall's answer to the call."""
    ran = subprocess.run(
        [sys.executable, "-m", "examples.pipeline.run", "n/example", "--seconds", "1"],
        cwd=support.REPO,
        env=support.celery_env(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr + ran.stdout
    answer: dict[str, Any] = json.loads(ran.stdout)
    return answer


def test_the_example_pipeline_publishes_and_archives_once(fleet: Fleet) -> None:
    env = {
        name: fleet.env[name]
        for name in ("LONGCALL_REDIS_URL", "LONGCALL_BROKER_URL", "LONGCALL_BROKER_KEYPREFIX")
        if name in fleet.env
    } | {"PIPELINE_QUEUE": QUEUE}
    worker = support.start_worker(
        "examples.pipeline.app", queues=QUEUE, env=env, log_dir=fleet.log_dir, name="example", concurrency=1
    )
    fleet.processes.append(worker)

    answer = run_example(env)
    assert answer["created"] is True

    support.wait_for("the chain's two steps", lambda: "archived n/example" in worker.log(), timeout=40)
    assert worker.log().count("published report n/example") == 1

    # The same receipt delivered again (at least once): skipped on its outbox id.
    op = fleet.ledger.find_by_call_node("n/example")
    assert op is not None
    [row] = fleet.ledger.outbox_for(op.id)
    receipt = {"outbox_id": row.id, "call_node_id": "n/example", "terminal_state": "completed"}
    fleet.pipeline.send_task("pipeline.publish_report", kwargs={"receipt": receipt}, queue=QUEUE)
    support.wait_for("the redelivery skipped", lambda: "seen before: skipped" in worker.log(), timeout=30)
    assert worker.log().count("published report n/example") == 1

    again = run_example(env)
    assert (again["op_id"], again["created"]) == (answer["op_id"], False)
