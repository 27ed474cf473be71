"""Rule 4 in one place: taking a token, holding a server, charging a request.

:class:`ServerBudgets` is what a step holds of it (``ctx.budget``):

- ``take`` books a slot on a server's bucket, or raises :class:`~workers.errors.NoToken` (a Redis failure
  too: no token can be had, so the request is not sent); ``book_slots`` books a batch's requests to one
  server in one script call, each no earlier than its own time (:class:`BookedSlots`);
- ``hold`` records the wait a server asked for in a refusal (:func:`server_wait_s`) as its fleet-wide hold,
  called by each step first thing where it catches an adapter call's error;
- ``per_request`` is the :class:`TokenBudget` an adapter call charges, once per HTTP request.

The Redis scripts and keys under them (the buckets, the holds) are :mod:`workers.hot`'s.

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

A charge is one Redis round trip: the script that books a token counts its request too
(``HotState.take(meter=...)``), in the second its slot falls in on the worker's clock, now or ahead (a slot
waited for is counted when booked, as a batch's slots are: one given up when its server asked for a wait
meanwhile stays counted). A request whose token was prepaid, or whose slot is more than two seconds ahead,
is counted when it is sent (``request_meter.lua``), in that second.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import httpx2
import redis

from adapters import NoBearerToken, OutcomeUnknown, ResultNotReady, Transient
from workers.errors import NoToken
from workers.hot import (
    MAX_SERVER_WAIT_S,
    RATE_HEADROOM,
    Budget,
    HotState,
    MeterCount,
    RedisClient,
    SlotMeter,
    burst_for,
    hold_key,
    server_tag,
)
from workers.settings import ServerConfig

__all__ = [
    "BUDGET_HEADER",
    "FOLLOW_UP_SLOTS",
    "HOLD_RECHECK_S",
    "PEAK_BUCKET_S",
    "PEAK_KEEP_S",
    "RATE_KEEP_S",
    "REDIS_PAUSE_S",
    "BookedSlots",
    "RequestMeter",
    "ServerBudgets",
    "TokenBudget",
    "label_request",
    "peak_key",
    "rate_key",
    "server_wait_s",
    "slot_meter",
    "take_label",
]

log = logging.getLogger(__name__)

#: How long a per-second request counter is kept: long enough for a scrape to read the last ten seconds.
RATE_KEEP_S = 15

#: The span of one highest-per-second record (an hour), and how long one is kept (a week).
PEAK_BUCKET_S = 3600
PEAK_KEEP_S = 7 * 86_400

_METER_LUA = (Path(__file__).with_name("request_meter.lua")).read_text(encoding="utf-8")

#: How many of a bucket's slots ahead a step's later request may wait for (see :meth:`ServerBudgets.take`).
FOLLOW_UP_SLOTS = 2
#: How soon a request refused for a Redis failure (no token could be asked for) may be tried again.
REDIS_PAUSE_S = 1.0

#: How old a batch's reading of its server's hold may be when a member that waited for its booked slot
#: asks it (:meth:`BookedSlots.first_charge`): the members of one batch share one reading per this long,
#: not one Redis call each. A hold recorded by this process (:meth:`ServerBudgets.hold`) is seen at once.
HOLD_RECHECK_S = 0.1

#: The holds this process recorded: the hold's key (its fleet's prefix and server, ``workers.hot.hold_key``)
#: -> when it ends (``time.monotonic``). Two fleets in one process (an embedding app, the tests) do not share
#: their servers' holds.
_held_here: dict[str, float] = {}
#: Held while a hold is recorded in :data:`_held_here`: two members recording their server's waits at once
#: keep the later end, never the one written last.
_held_here_lock = threading.Lock()


def _new_held_here_lock() -> None:
    """A forked child's own lock (the parent's may have been held by another of its threads at the fork)."""
    global _held_here_lock  # noqa: PLW0603 - the one module lock, replaced in a forked child
    _held_here_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_held_here_lock)

#: The header naming the bucket a request was charged to (``poll`` or ``control``).
BUDGET_HEADER = "Longcall-Budget"

#: Set while a request woken too long after its slot asks for a token again (:meth:`ServerBudgets.take`).
_late_again: ContextVar[bool] = ContextVar("longcall_late_again", default=False)

#: The bucket of the last charge, until the request it paid for is sent (charge and send run in one thread,
#: the send immediately after the charge).
_charged: ContextVar[Budget | None] = ContextVar("longcall_charged_budget", default=None)


@dataclass(frozen=True, slots=True)
class ServerBudgets:
    """The servers' budgets (rule 4) over the hot state: ``server`` gives a server's configuration (its
    ``poll_qps`` and ``control_qps``), ``tick_s`` is the dispatch interval (the longest a first request
    waits for a booked slot)."""

    hot: HotState
    server: Callable[[str], ServerConfig]
    tick_s: float

    def take(
        self, server: str, bucket: Budget, *, follow_up: bool = False, meter: MeterCount | None = None
    ) -> None:
        """Book a slot on the server's bucket (rule 4). A slot within one dispatch tick is waited for here;
        none within reach raises :class:`NoToken`: the step is rescheduled, never blocked.

        Called per HTTP request, by the budget :meth:`per_request` hands to the adapter. ``follow_up``:
        a later request of a step that has sent one already (``tools/call`` after the handshake,
        ``tasks/cancel`` or ``tasks/result`` after a status read, the next ``tasks/list`` page). It may
        also wait for the bucket's next :data:`FOLLOW_UP_SLOTS` slots: on a bucket slower than one slot
        per tick, a step of two requests would otherwise never get its second token, and what its first
        request cost would be spent again on every attempt. ``meter``: the request's count for the request
        meter, made by the same script in the second the slot falls in (``meter.counted``).
        """
        config = self.server(server)
        rate = config.poll_qps if bucket == "poll" else config.control_qps
        horizon = self.tick_s
        if follow_up:
            horizon = max(horizon, FOLLOW_UP_SLOTS / (rate * RATE_HEADROOM))
        try:
            token = self.hot.take(server, bucket, rate, horizon_s=horizon, meter=meter)
        except redis.RedisError as exc:
            # The buckets are out of reach (Redis restarting, failing over): no token can be had, so the
            # request is not sent, exactly as without a token (a create never sent is undone, a step is
            # due again shortly), never a failed step nor a request outside the budget (rule 4).
            log.warning("no %s token for %s: Redis failed (%s)", bucket, server, exc)
            raise NoToken(REDIS_PAUSE_S) from exc
        if not token.granted:
            raise NoToken(token.wait_s)
        if token.wait_s > 0:
            slot = time.monotonic() + token.wait_s
            time.sleep(token.wait_s)  # bounded by the horizon
            if time.monotonic() - slot > late_slot_s(rate):
                # Woken too long after the slot (a loaded process): sent now, the request would crowd the
                # slots after it into one second; it asks again, now, as a caller that just came would.
                # Counted already with the slot it gives up (an overcount of one), it is not counted again.
                if _late_again.get():
                    raise NoToken(0.0)
                self._take_again(server, bucket, meter)
                return
            # A server that asked for a wait meanwhile is not sent this request (the slot is given up).
            try:
                held = self.hot.held_s(server)
            except redis.RedisError as exc:
                log.warning("no %s token for %s: Redis failed (%s)", bucket, server, exc)
                raise NoToken(REDIS_PAUSE_S) from exc
            if held > 0:
                raise NoToken(held)

    def _take_again(self, server: str, bucket: Budget, meter: MeterCount | None) -> None:
        """:meth:`take` once more, for a request woken too long after its slot (once: a second late wake
        gives up, and the step is due again at once)."""
        again = _late_again.set(True)
        try:
            self.take(server, bucket, follow_up=True, meter=meter)
        finally:
            _late_again.reset(again)

    def book_slots(self, server: str, bucket: Budget, offsets_s: Sequence[float]) -> BookedSlots:
        """Book a batch's requests to one server in one script call (``HotState.take_slots``): one slot
        for each of ``offsets_s`` (ascending: each request's earliest time, seconds from now), each within
        one dispatch tick of its time, each counted for the meter in the second it will leave. What
        each request does with its slot is :meth:`BookedSlots.budget`'s. A Redis failure books none (each
        request is then refused a token, as :meth:`take` would refuse it)."""
        config = self.server(server)
        rate = config.poll_qps if bucket == "poll" else config.control_qps
        meter = slot_meter(self.hot.prefix, server, bucket)
        booked_at = time.monotonic()
        try:
            tokens = self.hot.take_slots(server, bucket, rate, offsets_s, horizon_s=self.tick_s, meter=meter)
        except redis.RedisError as exc:
            log.warning("no %s tokens for %s: Redis failed (%s)", bucket, server, exc)
            return BookedSlots(self, server, bucket, booked_at, (), refused=NoToken(REDIS_PAUSE_S), counted=0)
        refused = NoToken(tokens.wait_s) if tokens.granted < len(offsets_s) else None
        return BookedSlots(
            self, server, bucket, booked_at, tokens.delays_s, refused=refused, counted=tokens.counted
        )

    def rate(self, server: str, bucket: Budget) -> float:
        """The server's requests per second on ``bucket`` (its ``poll_qps`` or ``control_qps``)."""
        config = self.server(server)
        return config.poll_qps if bucket == "poll" else config.control_qps

    def held_here(self, server: str) -> float:
        """When the hold this process recorded for ``server`` ends (``time.monotonic``; 0: none)."""
        return _held_here.get(hold_key(self.hot.prefix, server), 0.0)

    def held_s(self, server: str) -> float:
        """The seconds ``server``'s hold has left: this process's own record of one first, else Redis's."""
        here = self.held_here(server) - time.monotonic()
        if here > 0:
            return here
        return self.hot.held_s(server)

    def per_request(self, server: str, bucket: Budget, *, prepaid: int = 0) -> TokenBudget:
        """What the adapter call a step makes charges per HTTP request it sends (DESIGN rule 4 as amended):
        a token from ``server``'s ``bucket`` each, waited for within one dispatch tick, else
        :class:`NoToken` (the adapter passes it on; that request is not sent). ``prepaid``: tokens the step
        took with :meth:`take` already, used by the first charges (see :class:`TokenBudget`)."""
        meter = RequestMeter(self.hot.client, self.hot.prefix, server, bucket)  # requests/s for metrics
        return TokenBudget(bucket, functools.partial(self.take, server, bucket), prepaid=prepaid, meter=meter)

    def hold(self, server: str, exc: BaseException) -> None:
        """Record the wait ``exc`` carries (:func:`server_wait_s`), if the server asked for one, as
        ``server``'s fleet-wide hold (:meth:`~workers.hot.HotState.hold`): until it ends, every request to
        that server is refused a token, whichever operation and bucket it is for. Called by a step first
        thing where it catches the error of an adapter call that sent requests (before any other request:
        a status read after a refused cancel must meet the hold). A Redis failure is logged: the step
        itself still waits as asked (``retry_s``)."""
        wait = server_wait_s(exc)
        if wait is None:
            return
        key = hold_key(self.hot.prefix, server)
        with _held_here_lock:
            _held_here[key] = max(_held_here.get(key, 0.0), time.monotonic() + wait)
        try:
            left = self.hot.hold(server, wait)
        except redis.RedisError:
            log.warning("the %.3f s wait %s asked for is not held fleet-wide", wait, server, exc_info=True)
            return
        log.info("%s asked for a %.3f s wait: no request to it for %.3f s", server, wait, left)


class BookedSlots:
    """A batch's slots on one server's bucket (:meth:`ServerBudgets.book_slots`): slot ``i`` is
    ``delays_s[i]`` after ``booked_at`` (``time.monotonic``); a request past the last one granted is
    refused with ``refused`` (the wait until one comes within reach). ``counted``: how many of the granted
    slots (the first ones) the script counted the request of for the meter. The members share one reading
    of the server's hold per :data:`HOLD_RECHECK_S`."""

    def __init__(
        self,
        budgets: ServerBudgets,
        server: str,
        bucket: Budget,
        booked_at: float,
        delays_s: tuple[float, ...],
        *,
        refused: NoToken | None,
        counted: int,
    ) -> None:
        self.budgets = budgets
        self.server = server
        self.bucket = bucket
        self.booked_at = booked_at
        self.delays_s = delays_s
        self.refused = refused
        self.counted = counted
        self._lock = threading.Lock()
        self._held_at = -HOLD_RECHECK_S
        self._held_s = 0.0
        # One meter for the batch's requests (a request that takes a token of its own counts itself).
        self._meter = RequestMeter(budgets.hot.client, budgets.hot.prefix, server, bucket)

    def budget(self, index: int) -> TokenBudget:
        """The :class:`TokenBudget` of the batch's ``index``-th request (in the order the offsets were
        booked): its first charge is its slot (:meth:`first_charge`), any later one a token of its own (a
        follow-up, as :meth:`ServerBudgets.per_request`'s)."""
        budget = TokenBudget(
            self.bucket,
            functools.partial(self.budgets.take, self.server, self.bucket),
            meter=self._meter,
            first=functools.partial(self.first_charge, index),
        )
        if index < len(self.delays_s):
            budget.slot_at = self.booked_at + self.delays_s[index]
        return budget

    def first_charge(self, index: int) -> bool:
        """Wait for slot ``index`` and answer whether its request is counted for the meter already; a slot
        that was not granted raises :class:`NoToken` (the step is rescheduled), as does a hold the server
        asked for while the request waited for its slot (the slot is given up)."""
        if index >= len(self.delays_s):
            raise self.refused or NoToken(REDIS_PAUSE_S)
        slot = self.booked_at + self.delays_s[index]
        wait = slot - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # within one dispatch tick of the request's due time
        if time.monotonic() - slot > late_slot_s(self.budgets.rate(self.server, self.bucket)):
            # The member came to its request too long after its slot (a loaded process): sent now, it
            # would crowd the slots after it into one second. It takes a token of its own instead, as a
            # one-operation poll does (the slot stays unused; its count stays, an overcount of one).
            self.budgets.take(self.server, self.bucket, follow_up=True)
            return index < self.counted
        if self.delays_s[index] > 0:
            held = self._held()
            if held > 0:
                raise NoToken(held)
        return index < self.counted

    def _held(self) -> float:
        """The server's hold as this batch last read it, at most :data:`HOLD_RECHECK_S` ago."""
        with self._lock:
            now = time.monotonic()
            if now - self._held_at >= HOLD_RECHECK_S:
                try:
                    self._held_s = self.budgets.held_s(self.server)
                except redis.RedisError as exc:
                    log.warning("no %s token for %s: Redis failed (%s)", self.bucket, self.server, exc)
                    raise NoToken(REDIS_PAUSE_S) from exc
                self._held_at = now
                return self._held_s
            return max(self._held_s - (now - self._held_at), self.budgets.held_here(self.server) - now)


def late_slot_s(rate_per_s: float) -> float:
    """How late after its slot a request may still be sent on it: half the lateness the bucket's bound
    absorbs (at ``rate`` with its burst, the slots of any one second plus those up to ``D`` before it stay
    within ``rate`` while ``D < (rate - burst) / (RATE_HEADROOM * rate) - 1``: 250 ms at 10/s, 190 ms at
    500/s); the other half is left to the network's jitter between worker and server."""
    absorbed = (rate_per_s - burst_for(rate_per_s)) / (RATE_HEADROOM * rate_per_s) - 1
    return max(0.0, absorbed / 2)


def server_wait_s(exc: BaseException) -> float | None:
    """The wait a server asked for with its refusal (a Retry-After or RetryInfo on a 429, a 503 or another
    5xx), in seconds; None when it asked for none. A result asked for too early (:class:`ResultNotReady`)
    carries the task's poll interval, not a server's refusal: no wait; nor does a request that had no bearer
    token (:class:`NoBearerToken`: its wait is the token provider's backoff, in this process)."""
    if isinstance(exc, ResultNotReady | NoBearerToken) or not isinstance(exc, (Transient, OutcomeUnknown)):
        return None
    if exc.retry_after is None or exc.retry_after <= 0:
        return None
    return min(float(exc.retry_after), MAX_SERVER_WAIT_S)


class TokenBudget:
    """A :class:`~adapters.base.RequestBudget` over one server's ``bucket``: ``take`` books a token or
    raises :class:`~workers.errors.NoToken`.

    ``take(follow_up=...)`` is told whether the request follows one this budget paid for already (it may
    wait longer: the step is under way). ``prepaid`` tokens were taken by the step before it committed to
    sending (an input reply: the token is taken before the reply is recorded, so a reply recorded is a
    reply sent); the first ``prepaid`` charges use them instead of taking new ones. ``first``: what pays the
    first charge instead (a slot its batch booked: :meth:`BookedSlots.first_charge`), answering whether it
    counted the request for the meter already.
    """

    def __init__(
        self,
        bucket: Budget,
        take: Callable[..., None],
        *,
        prepaid: int = 0,
        meter: Callable[[], None] | None = None,
        first: Callable[[], bool] | None = None,
    ) -> None:
        self.bucket = bucket
        #: When its first request's slot comes (``time.monotonic``), when a batch booked one.
        self.slot_at: float | None = None
        self._take = take
        self._first = first
        self._prepaid = prepaid
        self._paid = 0
        self._meter = meter

    def charge(self) -> None:
        counted = False
        if self._first is not None:
            first, self._first = self._first, None
            counted = first()
        elif self._prepaid > 0:
            self._prepaid -= 1
        else:
            counted = self._take_and_count(follow_up=self._paid > 0)
        self._paid += 1
        if self._meter is not None and not counted:
            self._meter()
        _charged.set(self.bucket)

    def _take_and_count(self, *, follow_up: bool) -> bool:
        """Take a token; True if the take counted the request as well (a slot within the meter's seconds)."""
        if not isinstance(self._meter, RequestMeter):
            self._take(follow_up=follow_up)
            return False
        count = self._meter.count()
        self._take(follow_up=follow_up, meter=count)
        return count.counted

    def __repr__(self) -> str:
        return f"TokenBudget({self.bucket!r})"


def slot_meter(prefix: str, server: str, bucket: Budget, *, now: float | None = None) -> SlotMeter:
    """The request meter's keys for a batch's slots booked at ``now`` (the worker's clock): each slot counts
    its request in the second it will leave (``HotState.take_slots``), this one or one of the next two."""
    now = time.time() if now is None else now
    second = int(now)
    keys: list[str] = []
    for ahead in range(3):
        keys += [
            rate_key(prefix, server, bucket, second + ahead),
            peak_key(prefix, server, bucket, second + ahead),
        ]
    return SlotMeter(tuple(keys), (RATE_KEEP_S, PEAK_KEEP_S), int((now - second) * 1_000_000))


def rate_key(prefix: str, server: str, bucket: Budget, second: int) -> str:
    """The Redis key counting the requests charged to ``server``'s ``bucket`` in the Unix ``second``. It
    carries the server's hash tag (:func:`~workers.hot.server_tag`), as its bucket and hold do: the token
    bucket's script counts a request in it, and a read over one server's seconds (an ``MGET``) is one slot."""
    return f"{prefix}rate:{server_tag(server)}:{bucket}:{second}"


def peak_key(prefix: str, server: str, bucket: Budget, second: int) -> str:
    """The Redis key holding the most requests charged to ``server``'s ``bucket`` in any one second of the
    hour (:data:`PEAK_BUCKET_S`) that holds the Unix ``second``."""
    return f"{prefix}ratemax:{server_tag(server)}:{bucket}:{second // PEAK_BUCKET_S}"


class RequestMeter:
    """Counts one charged request in its second (the worker's clock, when the request is about to be sent)
    and raises its hour's highest per-second count: one Lua script (``request_meter.lua``), one round trip.
    A metric is never worth a request: a Redis error is logged and the request goes on."""

    def __init__(self, client: RedisClient, prefix: str, server: str, bucket: Budget) -> None:
        self._client = client
        self._prefix = prefix
        self._server = server
        self._bucket = bucket
        self._script = client.register_script(_METER_LUA)

    def __call__(self) -> None:
        now = slot_meter(self._prefix, self._server, self._bucket)  # its first two keys: this second's
        try:
            self._script(keys=list(now.keys[:2]), args=list(now.keep_s))
        except redis.RedisError as exc:
            log.debug("request rate not counted for %s/%s: %s", self._server, self._bucket, exc)

    def count(self) -> MeterCount:
        """The request about to be booked, as the take that books its slot counts it
        (``HotState.take(meter=...)``): the keys of this second and the next two, and how long each kind is
        kept."""
        return MeterCount(slot_meter(self._prefix, self._server, self._bucket))


def take_label(bucket: Budget) -> Budget | None:
    """The request about to be sent was charged to ``bucket``: its label, taken as :func:`label_request`
    takes it (for a request sent without the request hooks: ``adapters.lean_client``); else None, the
    label left for the hook."""
    if _charged.get() != bucket:
        return None
    _charged.set(None)
    return bucket


def label_request(request: httpx2.Request) -> None:
    """httpx2 request hook: name the bucket the request was charged to, once (the next request needs a
    charge of its own)."""
    bucket = _charged.get()
    if bucket is not None:
        request.headers[BUDGET_HEADER] = bucket
        _charged.set(None)
