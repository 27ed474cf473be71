from __future__ import annotations

import contextlib
import fcntl
import time
import uuid
import weakref
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.app import base as celery_base

from ledger.migrate import upgrade
from ledger.repository import Ledger
from tests import support
from tests.support import open_connections

#: How long a test waits for its turn beside (or, marked ``serial``, without) the other xdist worker's tests:
#: the longest serial test's own timeout (test_simulation's 300 s) and then some.
TURN_TIMEOUT_S = 900.0


def _take_lock(lock: int, mode: int, what: str, deadline: float) -> None:
    while True:
        try:
            fcntl.flock(lock, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {TURN_TIMEOUT_S:.0f} s for {what}") from None
            time.sleep(0.05)  # a bounded retry interval: the other worker's test is still running
        else:
            return


@contextlib.contextmanager
def _turn(lock_dir: Path, alone: bool) -> Iterator[None]:
    """Under xdist: a ``serial`` test holds the run's lock exclusively, every other test holds it shared.
    The gate is taken first, so a serial test waiting for the running test is not overtaken by the next one
    (the gate is held shared only while the main lock is taken)."""
    deadline = time.monotonic() + TURN_TIMEOUT_S
    mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
    gate = (lock_dir / "serial-gate.lock").open("a")
    main = (lock_dir / "serial.lock").open("a")
    try:
        _take_lock(gate.fileno(), mode, "the gate of the serial lock", deadline)
        _take_lock(
            main.fileno(), mode, "a serial test to end" if not alone else "the other tests to end", deadline
        )
        if not alone:
            fcntl.flock(gate.fileno(), fcntl.LOCK_UN)
        yield
    finally:
        main.close()  # closing releases its lock
        gate.close()


open_connections.install()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """A test marked ``serial`` (it measures rates or time against a bound) runs with no other test beside
    it: on the other xdist worker, the next test waits. The wait is outside the test's own timeout and its
    durations. Without xdist (``-n 0``) tests run one at a time anyway. The Postgres connections opened from
    here on are the test's (``tests.support.open_connections``: a leaked one's warning names it)."""
    open_connections.running_test(item.nodeid)
    basetemp = item.config.option.basetemp
    if not hasattr(item.config, "workerinput") or not basetemp:
        return (yield)
    # The workers' base directories (popen-gw0, popen-gw1) share this run's parent: the lock is this run's.
    with _turn(Path(basetemp).parent, alone=item.get_closest_marker("serial") is not None):
        return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """One xdist worker runs all the conformance tests of one MCP peer (``mcp_peer`` is session-scoped and
    parametrized over the peers): each peer starts once, not once per worker."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "mcp_peer" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"peer-{callspec.params['mcp_peer']}"))


@pytest.fixture(autouse=True)
def release_celery_apps(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Celery apps a test built in this process have their connections closed as it ends
    (``support.release_app``; ``Celery.close`` leaves them open): left to the garbage collector, their
    sockets are reported unclosed in whichever later test it runs, which then fails (warnings are errors)."""
    built: list[weakref.ref[Celery]] = []
    register = getattr(celery_base, "_register_app")  # noqa: B009 - Celery's, not in its stubs

    def registered(app: Celery) -> None:
        built.append(weakref.ref(app))
        register(app)

    monkeypatch.setattr(celery_base, "_register_app", registered)
    yield
    for ref in built:
        app = ref()
        if app is not None:
            support.release_app(app)


@pytest.fixture(scope="session")
def services() -> None:
    support.require_services()


@pytest.fixture(scope="session")
def template_database(services: None) -> Iterator[str]:
    """A database migrated once per session; each test copies it (CREATE DATABASE ... TEMPLATE)."""
    name = support.create_database()
    try:
        upgrade(support.database_url(name))
        yield name
    finally:
        support.drop_database(name)


@pytest.fixture
def database_url(template_database: str) -> Iterator[str]:
    name = support.create_database(template=template_database)
    try:
        yield support.database_url(name)
    finally:
        support.drop_database(name)


@pytest.fixture
def empty_database_url(services: None) -> Iterator[str]:
    name = support.create_database()
    try:
        yield support.database_url(name)
    finally:
        support.drop_database(name)


@pytest.fixture
def ledger(database_url: str) -> Iterator[Ledger]:
    repository = Ledger.from_url(database_url)
    try:
        yield repository
    finally:
        repository.dispose()


@pytest.fixture(scope="module")
def shared_ledger(template_database: str) -> Iterator[Ledger]:
    """One database for a module whose tests each work on rows of their own (e.g. the pair tables)."""
    name = support.create_database(template=template_database)
    repository = Ledger.from_url(support.database_url(name))
    try:
        yield repository
    finally:
        repository.dispose()
        support.drop_database(name)


@pytest.fixture
def redis_client(services: None) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(support.REDIS_URL)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def broker_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """Isolates this test's queues on the shared Redis; its keys are removed afterwards."""
    prefix = f"lctest-{uuid.uuid4().hex[:10]}:"
    try:
        yield prefix
    finally:
        keys = list(redis_client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            redis_client.delete(*keys)


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path
