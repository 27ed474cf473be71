"""The Redis side of the fleet: per-server token buckets, a server's hold (its Retry-After, honoured by every
worker) and the cancel-generation CAS (rules 3, 4 and 6).

Each is a single Lua script, so each decision is one atomic step on Redis whatever the number of worker
processes. Redis may lose everything (it keeps nothing on disk here): a lost bucket starts afresh, a lost
generation is re-seeded from the ledger, which stays the record of truth.

The keys are named here (and the request meter's in :mod:`workers.budget`, from :func:`server_tag`): every
key of one server's carries the server's hash tag, ``{s:<server>}``, so the keys of one script call live
in one hash slot and a Redis Cluster runs each call on one node, while different servers spread over the
cluster. :class:`HotState` takes a ``redis.Redis`` or a ``redis.cluster.RedisCluster``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Literal, TypeAlias

import redis
import redis.cluster

Budget = Literal["poll", "control"]

#: A standalone Redis or a Redis Cluster: the hot state runs on either.
RedisClient: TypeAlias = redis.Redis | redis.cluster.RedisCluster

#: What a hot-state call raises when Redis is out of reach or not serving yet: refused or dropped
#: connections, timeouts, "LOADING" while a restarted Redis reads its append-only file (a ConnectionError),
#: "READONLY" from a replica during a failover.
UNAVAILABLE: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)

#: Spacing at 1/rate exactly would let a request that left a little late share a one-second window with
#: one that left on time. The slots are spaced for 80 % of the rate, bursts take 5 % more, and the rest is
#: the margin for what lies between a slot and the server's clock: a process woken late, a thread that
#: waited for the GIL, the server's own scheduling (at 90 %, a loaded two-core machine saw 11 requests in
#: one second at ``poll_qps = 10``). ``workers.budget.late_slot_s`` gives a request its share of it.
RATE_HEADROOM = 0.8
#: The share of the rate a burst may take ahead of schedule.
BURST_SHARE = 0.05

#: The longest wait a server's Retry-After / RetryInfo is honoured for, in seconds (five minutes). A server
#: may ask for a day (``Retry-After: 86400``, or an HTTP-date far ahead); held as asked, it would park every
#: operation on that server, and every step's retry, for that long. Past this, the fleet asks again (and an
#: operation whose wait budget ends first goes to its deadline path meanwhile).
MAX_SERVER_WAIT_S = 300.0


@dataclass(frozen=True, slots=True)
class Token:
    """``granted``: make the call after ``wait_s`` (a booked slot, at most the horizon away).
    Refused: no slot within the horizon; ask again in ``wait_s``."""

    granted: bool
    wait_s: float


@dataclass(frozen=True, slots=True)
class Tokens:
    """What :meth:`HotState.take_slots` booked: one delay per slot granted (make that call after it: the
    slots are spaced by the bucket's interval, those within its burst at 0, none before its own time), in
    order. ``wait_s``: when fewer slots were granted than asked for (none, under a hold), how soon the next
    one comes within reach (ask again then); 0 when all were granted. ``counted``: how many of the slots
    granted counted their request for the meter (the first ``counted`` of them, each in the second it falls
    in; the caller meters the others, past the meter's three seconds, when it sends them)."""

    delays_s: tuple[float, ...]
    wait_s: float
    counted: int = 0

    @property
    def granted(self) -> int:
        return len(self.delays_s)


@dataclass(frozen=True, slots=True)
class SlotMeter:
    """The request meter's keys for a batch of slots (:meth:`HotState.take_slots`): the counter and the
    hour's highest of each of the worker's seconds ``s``, ``s + 1`` and ``s + 2`` (six keys, in that order),
    how long each kind is kept, and how far into second ``s`` the worker is (microseconds)."""

    keys: tuple[str, ...]
    keep_s: tuple[int, int]
    into_second_us: int


@dataclass(slots=True)
class MeterCount:
    """One request for the request meter (``workers.budget.RequestMeter``): the meter's keys of the worker's
    seconds ``s`` to ``s + 2`` (``slots``: the take that books the request's slot counts it in the second the
    slot falls in, now or ahead). ``counted`` is set by the :meth:`HotState.take` it was passed to
    (``meter=``) when that take counted it."""

    slots: SlotMeter
    counted: bool = False


def server_tag(server: str) -> str:
    """The hash tag in every key of ``server``'s (its buckets, its hold, its request counts): a Redis
    Cluster hashes only the tag, so one script call's keys share a slot, and servers spread over the nodes.
    The prefix before it must hold no ``{`` (a tag there would put every key in one slot, or split one
    server's keys apart)."""
    return "{s:" + server + "}"


def bucket_key(prefix: str, server: str, budget: Budget) -> str:
    """The key of ``server``'s ``budget`` bucket (its GCRA theoretical arrival time)."""
    return f"{prefix}bucket:{server_tag(server)}:{budget}"


def hold_key(prefix: str, server: str) -> str:
    """The key of ``server``'s hold (the end of the wait it asked for, Redis time in microseconds)."""
    return f"{prefix}hold:{server_tag(server)}"


def cancel_key(prefix: str, op_id: uuid.UUID) -> str:
    """The key of an operation's hot cancel generation (alone in its script call: any slot will do)."""
    return f"{prefix}cancel:{op_id}"


class HotState:
    def __init__(self, client: RedisClient, *, prefix: str = "longcall:") -> None:
        self.client = client
        self.prefix = prefix
        self._hold = client.register_script(_lua("server_hold.lua"))
        self._held = client.register_script(_lua("server_held.lua"))
        self._cas = client.register_script(_lua("cancel_cas.lua"))
        self._slots = client.register_script(_lua("token_slots.lua"))

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "longcall:", cluster: bool = False) -> HotState:
        """A hot state on the Redis at ``url`` (:func:`connect`)."""
        return cls(connect(url, cluster=cluster), prefix=prefix)

    def take(
        self,
        server: str,
        budget: Budget,
        rate_per_s: float,
        *,
        horizon_s: float = 0.0,
        meter: MeterCount | None = None,
    ) -> Token:
        """Book one call to ``server`` on the ``budget`` bucket, at most ``horizon_s`` ahead.

        GCRA at ``RATE_HEADROOM`` of the rate, with a burst of ``burst_for(rate)`` calls: in any one-second
        window at most ``1 + RATE_HEADROOM * rate + burst <= rate`` slots are handed out. A slot booked
        ahead is a promise to wait for it: slots are spaced, so calls made at their slots keep that bound,
        and a token that comes due is never wasted because no caller happened to ask at that instant.

        While the server's hold (:meth:`hold`) runs, every call to it is refused, on either bucket, with the
        hold's time left as the wait: the same script, the same round trip. It is :meth:`take_slots` for one
        slot asked for now (``token_slots.lua``): one script books every token. With ``meter``, the slot
        granted also counts its request for the meter in the same round trip, in the second the slot falls
        in (now, or ahead: a slot waited for is counted when booked), and sets ``meter.counted``; a refusal
        leaves it uncounted, as does a slot past the meter's three seconds (the caller meters the request
        when it sends it).
        """
        uncounted = None if meter is None or meter.counted else meter.slots
        tokens = self.take_slots(server, budget, rate_per_s, (0.0,), horizon_s=horizon_s, meter=uncounted)
        if meter is not None and tokens.counted:
            meter.counted = True
        if tokens.granted:
            return Token(True, tokens.delays_s[0])
        return Token(False, tokens.wait_s)

    def _bucket_call(
        self, server: str, budget: Budget, rate_per_s: float, horizon_s: float
    ) -> tuple[int, list[str], list[int]]:
        """The interval, and the keys and first four arguments of the bucket's script (``token_slots.lua``):
        the bucket and hold keys; interval, burst tolerance, horizon, longest hold."""
        interval_us = max(1, math.ceil(1_000_000 / (rate_per_s * RATE_HEADROOM)))
        keys = [bucket_key(self.prefix, server, budget), self.hold_key(server)]
        args = [
            interval_us,
            burst_for(rate_per_s) * interval_us,
            math.floor(max(0.0, horizon_s) * 1_000_000),
            math.ceil(MAX_SERVER_WAIT_S * 1_000_000),
        ]
        return interval_us, keys, args

    def take_slots(
        self,
        server: str,
        budget: Budget,
        rate_per_s: float,
        offsets_s: Sequence[float],
        *,
        horizon_s: float = 0.0,
        meter: SlotMeter | None = None,
    ) -> Tokens:
        """Book one call to ``server`` on the ``budget`` bucket for each of ``offsets_s`` (ascending: each
        call's earliest time, in seconds from now), in one script call (``token_slots.lua``): slot i is what
        :meth:`take` would give a caller asking at ``now + offsets_s[i]`` after the slots before it, so the
        bound of :meth:`take` holds for every slot and no call goes before its time. A slot more than
        ``horizon_s`` past its time is not booked, nor any after it (``Tokens.wait_s``: when it comes within
        reach); none under the server's hold. ``Tokens.delays_s``: each slot granted, from now. With
        ``meter``, every slot granted within the meter's three seconds counts its request in the second it
        will leave (``Tokens.counted``: the first that many slots)."""
        if not offsets_s:
            raise ValueError("take_slots books at least one slot")
        _, keys, args = self._bucket_call(server, budget, rate_per_s, horizon_s)
        args.extend([0, 0, 0, 0])
        if meter is not None:
            keys.extend(meter.keys)
            args[4:8] = [*meter.keep_s, 0, meter.into_second_us]
        args.extend(max(0, round(offset * 1_000_000)) for offset in offsets_s)
        granted, wait_us, counted, *delays_us = (int(v) for v in self._call(self._slots, keys, args))
        delays = tuple(max(0, delay) / 1_000_000 for delay in delays_us[:granted])
        return Tokens(delays, wait_us / 1_000_000, counted)

    def hold(self, server: str, delay_s: float) -> float:
        """The server asked for no request for ``delay_s`` (a Retry-After or RetryInfo on a 429 or 503): no
        worker sends it anything, poll or control, until then (Redis time). A hold already set that ends
        later stays. At most :data:`MAX_SERVER_WAIT_S`: a longer wait asked for is held that long, and a
        longer hold already set (by a worker without this cap) ends then too. Returns the seconds the hold
        has left."""
        delay_us = math.ceil(min(max(0.0, delay_s), MAX_SERVER_WAIT_S) * 1_000_000)
        if delay_us <= 0:
            return 0.0
        keys = [self.hold_key(server)]
        args = [delay_us, math.ceil(MAX_SERVER_WAIT_S * 1_000_000)]
        try:
            left_us = self._hold(keys=keys, args=args)
        except redis.ConnectionError:
            left_us = self._hold(keys=keys, args=args)  # one reconnect, as in _call
        return int(left_us) / 1_000_000

    def held_s(self, server: str) -> float:
        """The seconds ``server``'s hold has left (0: none): read by a caller that waited for a booked slot,
        since a hold recorded during that wait must still stop its request. One script reads the hold and
        the clock of the node that holds it (in a cluster, another node's clock is another clock)."""
        [left_us] = self._call(
            self._held, [self.hold_key(server)], [math.ceil(MAX_SERVER_WAIT_S * 1_000_000)]
        )
        return int(left_us) / 1_000_000

    def hold_key(self, server: str) -> str:
        return hold_key(self.prefix, server)

    def bump_cancel_generation(
        self, op_id: uuid.UUID, expected: int, *, keep_s: int = 86_400
    ) -> tuple[bool, int]:
        """CAS the hot generation from ``expected`` to ``expected + 1``; (won, generation now)."""
        won, generation = self._call(self._cas, [cancel_key(self.prefix, op_id)], [expected, keep_s])
        return bool(won), int(generation)

    def seed_cancel_generation(self, op_id: uuid.UUID, generation: int, *, keep_s: int = 86_400) -> None:
        """Reset the hot copy from the ledger (after a lost CAS or a Redis restart)."""
        self.client.set(cancel_key(self.prefix, op_id), generation, ex=keep_s)

    def _call(self, script: redis.commands.core.Script, keys: list[str], args: list[int]) -> list[int]:
        try:
            return list(script(keys=keys, args=args))
        except redis.ConnectionError:
            # One reconnect: a restarted Redis answers the next attempt (and has lost its scripts, which
            # redis-py reloads on NOSCRIPT).
            return list(script(keys=keys, args=args))

    def close(self) -> None:
        self.client.close()


def connect(url: str, *, cluster: bool = False) -> RedisClient:
    """A client of the hot state's Redis at ``url``; ``cluster``: a Redis Cluster, ``url`` one of its nodes
    (the client finds the others from it and sends each script call to the node of its keys' slot).

    Raises:
        redis.ConnectionError: ``cluster``, and no node answers: a cluster client asks for the cluster's
            slots as it is made, and redis-py's refusal then is no ``RedisError``; raised as one, it is
            met where a standalone Redis's first failed command is (no token: the step is due again).
    """
    if cluster:
        try:
            return redis.cluster.RedisCluster.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        except redis.exceptions.RedisClusterException as exc:
            where = url.partition("://")[2].rpartition("@")[2].partition("/")[0]  # no user, no password
            raise redis.ConnectionError(f"the Redis Cluster at {where} cannot be reached: {exc}") from exc
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, retry_on_timeout=True)


def burst_for(rate_per_s: float) -> int:
    """How many calls may go ahead of schedule while a one-second window still holds at most ``rate``: a
    quarter of the headroom (:data:`BURST_SHARE`); the rest stays for calls that reach the server late."""
    return max(0, math.floor(rate_per_s * BURST_SHARE) - 1)


def _lua(name: str) -> str:
    return resources.files("workers").joinpath(name).read_text(encoding="utf-8")
