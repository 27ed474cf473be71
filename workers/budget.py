"""Rule 4 per request: the budget a step hands to its adapter call, charged once per HTTP request sent.

A step chooses the bucket (the poll step's status reads: ``poll``; everything a control step sends, its
status reads, handshake, ``tools/list`` and ``tasks/list`` pages included: ``control``) and passes a
:class:`TokenBudget` to the adapter, which calls :meth:`TokenBudget.charge` immediately before each HTTP
request. ``charge`` takes a token from the server's bucket (waiting at most one dispatch tick) or raises
:class:`~workers.errors.NoToken`, which the adapter passes on unchanged: that request is not sent.

Each request also names the bucket it was charged to in a ``Longcall-Budget`` header (:func:`label_request`,
an httpx request hook), so a server's own log can tell a poll from control traffic, and an uncharged
request (no header) stands out.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import httpx

from workers.hot import Budget

__all__ = ["BUDGET_HEADER", "TokenBudget", "label_request"]

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

    def __init__(self, bucket: Budget, take: Callable[..., None], *, prepaid: int = 0) -> None:
        self.bucket = bucket
        self._take = take
        self._prepaid = prepaid
        self._paid = 0

    def charge(self) -> None:
        if self._prepaid > 0:
            self._prepaid -= 1
        else:
            self._take(follow_up=self._paid > 0)
        self._paid += 1
        _charged.set(self.bucket)

    def __repr__(self) -> str:
        return f"TokenBudget({self.bucket!r})"


def label_request(request: httpx.Request) -> None:
    """httpx request hook: name the bucket the request was charged to, once (the next request needs a
    charge of its own)."""
    bucket = _charged.get()
    if bucket is not None:
        request.headers[BUDGET_HEADER] = bucket
        _charged.set(None)
