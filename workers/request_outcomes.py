"""Every HTTP request a worker sends, counted by server, budget and outcome, for ``longcall metrics``'
``longcall_requests_total`` and ``longcall_polls_total``; and the requests to a server's token endpoint
(counted as budget ``token``: they take no token of the server's budgets) for
``longcall_token_requests_total``.

:class:`CountingTransport` wraps an adapter client's transport: it sees each request go (its budget from the
``Longcall-Budget`` header: ``poll``, ``control``, or ``none`` for a request no budget paid for) and what
came back: ``ok`` (an answer under 400), ``rate_limited`` (429), ``client_error`` (another 4xx),
``server_error`` (5xx) or ``no_answer`` (no HTTP answer: a timeout, a refused or dropped connection).

:class:`RequestOutcomes` keeps the counts in the process and adds them to Redis every :data:`FLUSH_S` (one
``HINCRBY`` per server, budget and outcome counted since, one pipeline per server), by a thread of its own,
never on a request's path. A metric is never worth a request: a Redis failure keeps the counts for the next
try; a process that ends loses what it counted since its last flush (:data:`FLUSH_S` at most).
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
from typing import Any

import httpx2
import redis

from workers.budget import BUDGET_HEADER
from workers.hot import RedisClient, server_tag

__all__ = [
    "FLUSH_S",
    "OUTCOMES",
    "CountingTransport",
    "RequestOutcomes",
    "outcome_of",
    "requests_key",
]

log = logging.getLogger(__name__)

#: How often a process adds its counts to Redis.
FLUSH_S = 2.0
#: What a request can come to.
OUTCOMES = ("ok", "rate_limited", "client_error", "server_error", "no_answer")


def outcome_of(status: int) -> str:
    """The outcome of an HTTP answer with ``status``."""
    if status < 400:
        return "ok"
    if status == 429:
        return "rate_limited"
    return "client_error" if status < 500 else "server_error"


def requests_key(prefix: str, server: str) -> str:
    """The Redis hash of ``server``'s request counts (fields ``<budget>:<outcome>``), under the server's hash
    tag as its bucket is."""
    return f"{prefix}requests:{server_tag(server)}"


class RequestOutcomes:
    """One process's request counts, added to Redis under ``prefix`` every :data:`FLUSH_S`."""

    def __init__(self, client: RedisClient, prefix: str, *, every_s: float = FLUSH_S) -> None:
        self._client = client
        self._prefix = prefix
        self._every_s = every_s
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._flusher: threading.Thread | None = None

    def answered(self, server: str, budget: str, status: int | None) -> None:
        """A request of ``server`` paid by ``budget`` was answered with ``status``, or not at all (None)."""
        self.add(server, budget, "no_answer" if status is None else outcome_of(status))

    def add(self, server: str, budget: str, outcome: str) -> None:
        with self._lock:
            self._counts[(server, budget, outcome)] += 1
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_forever, name="longcall request counts")
                self._flusher.daemon = True
                self._flusher.start()
                atexit.register(self.flush)

    def flush(self) -> None:
        """Add the counts so far to Redis; on a Redis failure they are kept for the next flush."""
        with self._lock:
            taken, self._counts = self._counts, collections.Counter()
        if not taken:
            return
        by_server: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for (server, budget, outcome), n in taken.items():
            by_server[server][f"{budget}:{outcome}"] = n
        try:
            for server, fields in by_server.items():
                key = requests_key(self._prefix, server)
                pipe = self._client.pipeline(transaction=False)
                for field, n in fields.items():
                    pipe.hincrby(key, field, n)
                pipe.execute()
        except redis.RedisError as exc:
            log.debug("request counts not added to Redis yet: %s", exc)
            with self._lock:
                self._counts.update(taken)  # added once Redis answers (a partial flush may count some twice)

    def _flush_forever(self) -> None:
        while True:
            time.sleep(self._every_s)
            try:
                self.flush()
            except Exception:  # a metric is never worth the thread: log and go on
                log.exception("adding the request counts to Redis failed")


class CountingTransport(httpx2.BaseTransport):
    """An adapter client's transport, each request counted with its outcome (:class:`RequestOutcomes`), under
    the budget its ``Longcall-Budget`` header names, or ``budget`` (``token``: a token endpoint's client)."""

    def __init__(
        self,
        inner: httpx2.BaseTransport,
        server: str,
        outcomes: RequestOutcomes,
        *,
        budget: str | None = None,
    ) -> None:
        self._inner = inner
        self._server = server
        self._outcomes = outcomes
        self._budget = budget

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        budget: str = self._budget or request.headers.get(BUDGET_HEADER) or "none"
        try:
            response = self._inner.handle_request(request)
        except Exception:
            self._outcomes.answered(self._server, budget, None)
            raise
        self._outcomes.answered(self._server, budget, response.status_code)
        return response

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> CountingTransport:
        self._inner.__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        self._inner.__exit__(*args)
