"""Text that leaves longcall (error text the ledger stores, log lines, CLI notes): useful to an operator,
never a credential. The ledger imports nothing of ``workers/``; ``workers.logs`` masks its lines with
:func:`mask_credentials` from here.
"""

from __future__ import annotations

import re

#: ``scheme://user:password@``: the password part is masked.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*):[^\s@/]*@")


def mask_credentials(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` in it replaced by ``***``."""
    return _URL_PASSWORD.sub(r"\g<head>:***@", text)


def error_line(exc: BaseException) -> str:
    """One line for an error: its class and the first line of its text (its repr when the text is empty:
    kombu's ``OperationalError()`` for a broker that is down), URL passwords masked."""
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else repr(exc)
    return mask_credentials(f"{type(exc).__name__}: {text}")


def publish_error(exc: BaseException) -> str:
    """What ``outbox.last_error`` keeps of a failed publish: :func:`error_line`, bounded."""
    return error_line(exc)[:500]
