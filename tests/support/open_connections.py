"""Which test opened a Postgres connection that was garbage-collected while still open.

psycopg warns (``ResourceWarning``) when a connection nobody closed is collected, and the suite makes every
warning a failure. But the collector runs when it runs, often during a later test, and psycopg's warning
names neither the test nor the thread that opened the connection: a full run failed so on a test that had
not opened it, and the one that had could not be told. Here every connection the tests' process opens
remembers the test that was running and the thread that opened it, and the warning of one collected open
names both (:func:`install`, from the suite's ``conftest.py``). The warning is raised exactly where psycopg
would raise its own, so a leak still fails the run; only its message says more.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import psycopg

__all__ = ["install", "running_test"]

#: The test running now in this process (its node id), set around each test by the suite's conftest.
_running = ["(no test yet)"]
#: Where each connection still alive was opened: the test, the thread.
_origins: weakref.WeakKeyDictionary[psycopg.Connection[Any], tuple[str, str]] = weakref.WeakKeyDictionary()


def running_test(nodeid: str) -> None:
    """The test now running in this process (``nodeid``): the connections opened from now on are its."""
    _running[0] = nodeid


def install() -> None:
    """Remember each connection's origin, and name it in the warning of one collected while open. Once per
    process; a second call changes nothing."""
    if getattr(psycopg.Connection, "_longcall_tests_origins", False):
        return
    opened = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]

    def connect(cls: type[psycopg.Connection[Any]], *args: Any, **kwargs: Any) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] = opened(cls, *args, **kwargs)
        _origins[conn] = (_running[0], threading.current_thread().name)
        return conn

    def deleted_open(conn: psycopg.Connection[Any]) -> None:
        # psycopg's conditions for its warning (BaseConnection.__del__); its message, and where it was opened
        if not hasattr(conn, "pgconn") or conn.closed or hasattr(conn, "_pool"):
            return
        test, thread = _origins.get(conn, ("(unknown: opened before the suite's hook)", "?"))
        warnings.warn(
            f"{object.__repr__(conn)} was deleted while still open: opened during {test}, on thread "
            f"{thread!r}, and collected during {_running[0]}",
            ResourceWarning,
            stacklevel=1,
        )

    psycopg.Connection.connect = classmethod(connect)  # type: ignore[assignment, method-assign]
    psycopg.connect = psycopg.Connection.connect  # the name SQLAlchemy's dialect calls
    psycopg.Connection.__del__ = deleted_open  # type: ignore[method-assign, assignment]
    psycopg.Connection._longcall_tests_origins = True  # type: ignore[attr-defined]
