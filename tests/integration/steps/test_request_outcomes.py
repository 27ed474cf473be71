"""Issue 22, item 7: every request a worker sends is counted by server, budget and outcome
(``workers/request_outcomes.py``), in the process, and added to Redis by a thread of its own; a Redis that
does not answer keeps the counts for the next flush."""

from __future__ import annotations

import httpx2
import pytest
import redis

from tests.support.fleet import free_port
from workers.budget import BUDGET_HEADER
from workers.request_outcomes import CountingTransport, RequestOutcomes, outcome_of, requests_key


def answering(status: int) -> httpx2.MockTransport:
    return httpx2.MockTransport(lambda request: httpx2.Response(status))


def failing(request: httpx2.Request) -> httpx2.Response:
    raise httpx2.ConnectError("connection refused", request=request)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(200, "ok"), (202, "ok"), (429, "rate_limited"), (404, "client_error"), (503, "server_error")],
)
def test_an_answer_s_status_is_its_outcome(status: int, outcome: str) -> None:
    assert outcome_of(status) == outcome


def test_each_request_is_counted_with_its_budget_and_outcome_and_added_to_redis(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    outcomes = RequestOutcomes(redis_client, broker_prefix, every_s=3600)  # flushed by the test
    for inner, budget in ((answering(200), "poll"), (answering(200), "poll"), (answering(429), "control")):
        client = httpx2.Client(transport=CountingTransport(inner, "reports", outcomes))
        client.get("http://reports.test/mcp", headers={BUDGET_HEADER: budget})
        client.close()
    unpaid = httpx2.Client(transport=CountingTransport(httpx2.MockTransport(failing), "reports", outcomes))
    with pytest.raises(httpx2.ConnectError):
        unpaid.get("http://reports.test/mcp")
    unpaid.close()

    outcomes.flush()
    raw = redis_client.hgetall(requests_key(broker_prefix, "reports"))
    counted = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
    assert counted == {"poll:ok": 2, "control:rate_limited": 1, "none:no_answer": 1}
    outcomes.flush()  # nothing new: nothing added twice
    assert int(redis_client.hget(requests_key(broker_prefix, "reports"), "poll:ok") or 0) == 2


def test_counts_redis_did_not_take_are_kept_for_the_next_flush(
    redis_client: redis.Redis, broker_prefix: str
) -> None:
    away = redis.Redis(port=free_port(), socket_connect_timeout=1, socket_timeout=1)
    outcomes = RequestOutcomes(away, broker_prefix, every_s=3600)
    outcomes.add("reports", "poll", "ok")
    outcomes.flush()  # Redis does not answer: nothing is lost, nothing raised
    outcomes._client = redis_client  # Redis is back
    outcomes.add("reports", "poll", "ok")
    outcomes.flush()
    assert int(redis_client.hget(requests_key(broker_prefix, "reports"), "poll:ok") or 0) == 2
    away.close()
