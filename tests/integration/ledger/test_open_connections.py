"""The suite's own check (``tests/support/open_connections.py``): a Postgres connection collected while still
open fails the run with a warning that names the test and the thread that opened it."""

from __future__ import annotations

import gc
import threading
import warnings

import psycopg
import pytest


def test_a_connection_collected_open_names_the_test_and_thread_that_opened_it(
    database_url: str, request: pytest.FixtureRequest
) -> None:
    opened: list[psycopg.Connection[object]] = []
    thread = threading.Thread(target=lambda: opened.append(psycopg.connect(database_url)), name="opener")
    thread.start()
    thread.join(timeout=30)
    assert opened, "no connection was opened"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        opened.clear()  # the last reference: collected here, still open
        gc.collect()
    [leak] = [str(w.message) for w in warned if "deleted while still open" in str(w.message)]
    assert all(w.category is ResourceWarning for w in warned)
    assert f"opened during {request.node.nodeid}, on thread 'opener'" in leak


def test_a_closed_connection_is_collected_without_a_word(database_url: str) -> None:
    opened = [psycopg.connect(database_url)]
    opened[0].close()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        opened.clear()
        gc.collect()
    assert not [w for w in warned if "deleted while still open" in str(w.message)]
