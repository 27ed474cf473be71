"""Rule 3: a step that may outlast its lease renews it while it runs.

A claim leases its row for ``lease_s``; past that, the dispatcher may claim the row again under a new cursor,
which fences the first step off. That is right for a crashed worker and wrong for a live one that is still
in its remote call (``initialize`` + ``tools/list`` + ``tools/call``, a synchronous call up to its bound, a
large result): its real answer would be refused as stale. :func:`keep_lease` renews the lease every
``lease_s / 3`` while the step runs, under the step's own fence (same epoch, generation and cursor), and
stops when the step ends or when a renewal finds the fence moved (a rollback, a cancel, a takeover) —
quietly: the step's own next write meets the fence and is refused as stale.

One keeper thread per process does the renewing, for every claim in flight: entering :func:`keep_lease`
registers the claim, leaving unregisters it, so an unchanged poll starts and joins no thread. The keeper
sleeps until the earliest due renewal and runs the due ones one after the other (each is one short
UPDATE). It starts on first use; a child forked after that (Celery prefork forks its pool after import)
inherits none of the parent's threads, so it forgets the parent's keeper and starts its own.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from ledger.records import Fence
from ledger.repository import Ledger

__all__ = ["keep_lease"]

log = logging.getLogger("longcall.lease")

#: How much of the lease may pass before it is renewed: a third, so one late renewal still lands in time.
RENEW_FRACTION = 1 / 3

#: The keeper thread's name (one per process).
KEEPER_NAME = "lease keeper"


@contextlib.contextmanager
def keep_lease(
    ledger: Ledger,
    op_id: uuid.UUID,
    fence: Fence,
    lease_s: float,
    *,
    lease_until: dt.datetime | None = None,
) -> Iterator[None]:
    """Renew the lease of the claim ``fence`` on ``op_id`` while the ``with`` block runs. ``lease_until``:
    when the lease the step found runs out; the first renewal comes within it, not ``lease_s`` from the
    step's start (a step that starts late in its claim's lease, its message queued behind others, would
    outlive it and see its row claimed again under it)."""
    if fence.poll_cursor is None:  # not a claim: there is no lease to keep
        yield
        return
    first_s = lease_s
    if lease_until is not None:
        first_s = min(lease_s, max(0.0, (lease_until - dt.datetime.now(dt.UTC)).total_seconds()))
    claim = _Claim(ledger, op_id, fence, lease_s, time.monotonic() + first_s * RENEW_FRACTION)
    _keeper.register(claim)
    try:
        yield
    finally:
        _keeper.unregister(claim)


@dataclass(eq=False, slots=True)
class _Claim:
    """A claim in flight: the lease to renew, under which fence, and when next (``time.monotonic()``)."""

    ledger: Ledger
    op_id: uuid.UUID
    fence: Fence
    lease_s: float
    due: float


class _LeaseKeeper:
    """The process's keeper thread and the claims it renews, under one lock."""

    def __init__(self) -> None:
        self.forget_all()

    def forget_all(self) -> None:
        """A keeper with no thread and no claims (a forked child's: the parent's keeper thread does not run
        there, and its lock may be held for good)."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the keeper sleeps on it until its next due time
        self._settled = threading.Condition(self._lock)  # a leaving step waits on it for a renewal in flight
        self._claims: set[_Claim] = set()
        self._renewing: _Claim | None = None
        self._wakes_at = math.inf
        self._thread: threading.Thread | None = None

    def register(self, claim: _Claim) -> None:
        with self._lock:
            self._claims.add(claim)
            if self._thread is None or not self._thread.is_alive():
                # The first claim, or a keeper that died: a new one (assigned only once it runs).
                keeper = threading.Thread(target=self._run, name=KEEPER_NAME, daemon=True)
                keeper.start()
                self._thread = keeper
            elif claim.due < self._wakes_at:
                self._wake.notify()

    def unregister(self, claim: _Claim) -> None:
        """No renewal of ``claim`` starts after this; one in flight is waited for, at most ``lease_s``: it is
        one short UPDATE, and a stuck database must never hold the step."""
        with self._lock:
            self._claims.discard(claim)
            if self._renewing is claim:
                self._settled.wait_for(lambda: self._renewing is not claim, timeout=claim.lease_s)

    def _run(self) -> None:
        try:
            self._renew_forever()
        except BaseException:
            # Never expected (a renewal's own errors are caught below); the next step that registers a claim
            # starts a new keeper.
            log.error("the lease keeper stopped; the next claim starts another", exc_info=True)
            with self._lock:
                self._renewing = None
                self._settled.notify_all()

    def _renew_forever(self) -> None:
        while True:
            claim = self._next_due()
            renewed = True
            try:
                renewed = claim.ledger.renew_lease(claim.op_id, claim.fence, lease_s=claim.lease_s)
            except Exception:  # a failed renewal is tried again at its next due time; the step goes on
                log.warning("renewing the lease of %s failed", claim.op_id, exc_info=True)
            with self._lock:
                self._renewing = None
                self._settled.notify_all()
                if renewed:
                    claim.due = time.monotonic() + claim.lease_s * RENEW_FRACTION
                else:  # the fence moved or the claim was let go
                    self._claims.discard(claim)

    def _next_due(self) -> _Claim:
        """Sleep until the earliest claim is due; return it, marked as in flight."""
        with self._lock:
            while True:
                now = time.monotonic()
                earliest = min(self._claims, key=_due, default=None)
                if earliest is not None and earliest.due <= now:
                    self._renewing = earliest
                    self._wakes_at = now  # awake: a claim registered meanwhile is seen on the next scan
                    return earliest
                self._wakes_at = math.inf if earliest is None else earliest.due
                self._wake.wait(None if earliest is None else earliest.due - now)


def _due(claim: _Claim) -> float:
    return claim.due


_keeper = _LeaseKeeper()
os.register_at_fork(after_in_child=_keeper.forget_all)
