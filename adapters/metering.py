"""How a request budget's refusal travels through an adapter untouched.

A :class:`~adapters.base.RequestBudget` refuses a request by raising, and that exception must reach the
adapter's caller unchanged. It may be of any type, one of this package's errors included, so inside an
adapter it must never meet a handler meant for the server's answers: a ``RateLimited`` refusal would
otherwise be read as the server's own 429, or swallowed where a best-effort read may fail. Hence:

- an adapter's public method is decorated with :func:`budget_edge`, which hands the method body a
  :class:`Metered` budget instead of the caller's;
- inside, a refusal travels as :class:`Refused`, a ``BaseException`` that no handler in this package
  catches (only the two places that must, which say why);
- at the method's edge the budget's own exception is raised again, the same object, unmapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

from adapters.base import UNMETERED, RequestBudget

__all__ = ["Metered", "Refused", "budget_edge"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Refused(BaseException):
    """The budget refused a request; ``refusal`` is what its ``charge()`` raised."""

    def __init__(self, refusal: Exception) -> None:
        super().__init__(refusal)
        self.refusal = refusal


class Metered:
    """The caller's budget as an adapter's internals see it: a refusal is carried as :class:`Refused`."""

    def __init__(self, budget: RequestBudget) -> None:
        self._budget = budget

    def charge(self) -> None:
        try:
            self._budget.charge()
        except Exception as exc:
            raise Refused(exc) from exc


def budget_edge(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a public adapter method that takes a keyword-only ``budget``.

    A call from outside gets its budget wrapped in :class:`Metered` and its refusal re-raised unchanged;
    a call from another such method (its budget is already :class:`Metered`) is left alone, so the
    refusal keeps travelling to the outermost edge.
    """

    @functools.wraps(method)
    def edge(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        # Every decorated method declares ``budget: RequestBudget``; ParamSpec kwargs are untyped.
        budget = cast("RequestBudget", kwargs.get("budget", UNMETERED))
        if isinstance(budget, Metered):
            return method(*args, **kwargs)
        kwargs["budget"] = Metered(budget)
        try:
            return method(*args, **kwargs)
        except Refused as carried:
            refusal = carried.refusal
        # Raised outside the handler so the budget's exception keeps its own __context__.
        raise refusal

    return edge
