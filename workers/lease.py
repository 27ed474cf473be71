"""Rule 3: a step that may outlast its lease renews it while it runs.

A claim leases its row for ``lease_s``; past that, the dispatcher may claim the row again under a new cursor,
which fences the first step off. That is right for a crashed worker and wrong for a live one that is still
in its remote call (``initialize`` + ``tools/list`` + ``tools/call``, a synchronous call up to its bound, a
large result): its real answer would be refused as stale. :func:`keep_lease` renews the lease every
``lease_s / 3`` from a thread while the step runs, under the step's own fence (same epoch, generation and
cursor), and stops when the step ends or when a renewal finds the fence moved (a rollback, a cancel, a
takeover) — quietly: the step's own next write meets the fence and is refused as stale.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator

from ledger.records import Fence
from ledger.repository import Ledger

__all__ = ["keep_lease"]

log = logging.getLogger("longcall.lease")

#: How much of the lease may pass before it is renewed: a third, so one late renewal still lands in time.
RENEW_FRACTION = 1 / 3


@contextlib.contextmanager
def keep_lease(ledger: Ledger, op_id: uuid.UUID, fence: Fence, lease_s: float) -> Iterator[None]:
    """Renew the lease of the claim ``fence`` on ``op_id`` while the ``with`` block runs."""
    if fence.poll_cursor is None:  # not a claim: there is no lease to keep
        yield
        return
    stop = threading.Event()
    keeper = threading.Thread(
        target=_renew_until_stopped,
        args=(ledger, op_id, fence, lease_s, stop),
        name=f"lease {op_id}:{fence.poll_cursor}",
        daemon=True,
    )
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        # A renewal in flight is one short UPDATE; the keeper is a daemon, so a stuck database never
        # holds the step.
        keeper.join(timeout=lease_s)


def _renew_until_stopped(
    ledger: Ledger, op_id: uuid.UUID, fence: Fence, lease_s: float, stop: threading.Event
) -> None:
    while not stop.wait(lease_s * RENEW_FRACTION):
        try:
            if not ledger.renew_lease(op_id, fence, lease_s=lease_s):
                return  # the fence moved or the claim was let go
        except Exception:  # a failed renewal is tried again; the step goes on either way
            log.warning("renewing the lease of %s failed", op_id, exc_info=True)
