"""Error text the ledger stores (``outbox.last_error``): useful to an operator, never a credential.

The ledger imports nothing of ``workers/`` (``workers.logs.mask_credentials`` masks log lines the same way).
"""

from __future__ import annotations

import re

#: ``scheme://user:password@``: the password part, masked in what a failed publish records.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*):[^\s@/]*@")


def publish_error(exc: BaseException) -> str:
    """What ``outbox.last_error`` keeps of a failed publish: the exception's class and the first line of its
    text (its repr when the text is empty: kombu's ``OperationalError()`` for a broker that is down), with
    the password of any URL in it masked, bounded."""
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else repr(exc)
    return _URL_PASSWORD.sub(r"\g<head>:***@", f"{type(exc).__name__}: {text}")[:500]
