"""The worker's errors as an operator reads them (an event's error, ``longcall list``'s last error)."""

from __future__ import annotations

import pickle

from workers.errors import NoToken
from workers.steps.context import describe


def test_no_token_reads_as_a_wait_not_a_number() -> None:
    refused = NoToken(0.066136)
    assert describe(refused) == "NoToken: no token left in the server's request budget; next in 0.07 s"
    again = pickle.loads(pickle.dumps(refused))  # noqa: S301 - our own bytes
    assert (type(again), again.wait_s, str(again)) == (NoToken, 0.066136, str(refused))
