"""Rule 4 per request: the budget a step hands to its adapter call, charged once per HTTP request sent.

A step chooses the bucket (the poll step's status reads: ``poll``; everything a control step sends, its
status reads, handshake, ``tools/list`` and ``tasks/list`` pages included: ``control``) and passes a
:class:`TokenBudget` to the adapter, which calls :meth:`TokenBudget.charge` immediately before each HTTP
request. ``charge`` takes a token from the server's bucket (waiting at most one dispatch tick) or raises
:class:`~workers.errors.NoToken`, which the adapter passes on unchanged: that request is not sent.

Each request also names the bucket it was charged to in a ``Longcall-Budget`` header (:func:`label_request`,
an httpx request hook), so a server's own log can tell a poll from control traffic, and an uncharged
request (no header) stands out.

Each charge is also counted for ``longcall metrics`` (:class:`RequestMeter`): one Redis counter per server,
bucket and second, kept :data:`RATE_KEEP_S` seconds, so the requests a server received per second can be
set against its ``poll_qps`` / ``control_qps`` without any state in a worker. The same script also raises
the highest count of any one second per server, bucket and hour (:func:`peak_key`, kept :data:`PEAK_KEEP_S`),
which the launch gate (``longcall gate``) sets against the budgets over the last week.

A charge is one Redis round trip when it can be: a token granted for now counts its request in the script
that grants it (``HotState.take(meter=...)``). A request whose token was prepaid, or whose slot was
booked ahead and waited for, is counted when it is sent (``request_meter.lua``), so each request still
counts in the second it leaves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path

import httpx
import redis

from workers.hot import Budget, MeterCount

__all__ = [
    "BUDGET_HEADER",
    "PEAK_BUCKET_S",
    "PEAK_KEEP_S",
    "RATE_KEEP_S",
    "RequestMeter",
    "TokenBudget",
    "label_request",
    "peak_key",
    "rate_key",
]

log = logging.getLogger(__name__)

#: How long a per-second request counter is kept: long enough for a scrape to read the last ten seconds.
RATE_KEEP_S = 15

#: The span of one highest-per-second record (an hour), and how long one is kept (a week).
PEAK_BUCKET_S = 3600
PEAK_KEEP_S = 7 * 86_400

_METER_LUA = (Path(__file__).with_name("request_meter.lua")).read_text(encoding="utf-8")

#: The header naming the bucket a request was charged to (``poll`` or ``control``).
BUDGET_HEADER = "Longcall-Budget"

#: The bucket of the last charge, until the request it paid for is sent (charge and send run in one thread,
#: the send immediately after the charge).
_charged: ContextVar[Budget | None] = ContextVar("longcall_charged_budget", default=None)


class TokenBudget:
    """A :class:`~adapters.base.RequestBudget` over one server's ``bucket``: ``take`` books a token or
    raises :class:`~workers.errors.NoToken`.

    ``take(follow_up=...)`` is told whether the request follows one this budget paid for already (it may
    wait longer: the step is under way). ``prepaid`` tokens were taken by the step before it committed to
    sending (an input reply: the token is taken before the reply is recorded, so a reply recorded is a
    reply sent); the first ``prepaid`` charges use them instead of taking new ones.
    """

    def __init__(
        self,
        bucket: Budget,
        take: Callable[..., None],
        *,
        prepaid: int = 0,
        meter: Callable[[], None] | None = None,
    ) -> None:
        self.bucket = bucket
        self._take = take
        self._prepaid = prepaid
        self._paid = 0
        self._meter = meter

    def charge(self) -> None:
        counted = False
        if self._prepaid > 0:
            self._prepaid -= 1
        else:
            counted = self._take_and_count(follow_up=self._paid > 0)
        self._paid += 1
        if self._meter is not None and not counted:
            self._meter()
        _charged.set(self.bucket)

    def _take_and_count(self, *, follow_up: bool) -> bool:
        """Take a token; True if the take counted the request as well (a token granted for now)."""
        if not isinstance(self._meter, RequestMeter):
            self._take(follow_up=follow_up)
            return False
        count = self._meter.count()
        self._take(follow_up=follow_up, meter=count)
        return count.counted

    def __repr__(self) -> str:
        return f"TokenBudget({self.bucket!r})"


def rate_key(prefix: str, server: str, bucket: Budget, second: int) -> str:
    """The Redis key counting the requests charged to ``server``'s ``bucket`` in the Unix ``second``."""
    return f"{prefix}rate:{server}:{bucket}:{second}"


def peak_key(prefix: str, server: str, bucket: Budget, second: int) -> str:
    """The Redis key holding the most requests charged to ``server``'s ``bucket`` in any one second of the
    hour (:data:`PEAK_BUCKET_S`) that holds the Unix ``second``."""
    return f"{prefix}ratemax:{server}:{bucket}:{second // PEAK_BUCKET_S}"


class RequestMeter:
    """Counts one charged request in its second (the worker's clock, when the request is about to be sent)
    and raises its hour's highest per-second count: one Lua script (``request_meter.lua``), one round trip.
    A metric is never worth a request: a Redis error is logged and the request goes on."""

    def __init__(self, client: redis.Redis, prefix: str, server: str, bucket: Budget) -> None:
        self._client = client
        self._prefix = prefix
        self._server = server
        self._bucket = bucket
        self._script = client.register_script(_METER_LUA)

    def __call__(self) -> None:
        count = self.count()
        try:
            self._script(keys=list(count.keys), args=list(count.keep_s))
        except redis.RedisError as exc:
            log.debug("request rate not counted for %s/%s: %s", self._server, self._bucket, exc)

    def count(self) -> MeterCount:
        """The request about to be sent, as a token take may count it (``HotState.take(meter=...)``):
        the keys of this second, and how long each is kept."""
        second = int(time.time())
        keys = (
            rate_key(self._prefix, self._server, self._bucket, second),
            peak_key(self._prefix, self._server, self._bucket, second),
        )
        return MeterCount(keys, (RATE_KEEP_S, PEAK_KEEP_S))


def label_request(request: httpx.Request) -> None:
    """httpx request hook: name the bucket the request was charged to, once (the next request needs a
    charge of its own)."""
    bucket = _charged.get()
    if bucket is not None:
        request.headers[BUDGET_HEADER] = bucket
        _charged.set(None)
