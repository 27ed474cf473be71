"""What every ``longcall`` command shares: the console it prints to, the exit codes (stable: scripts rely
on them) and their errors, a connection failure named as one line, the settings with the CLI's connect
timeout, the ledger and the Celery app a command opens, and how an operation is named on the command line.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode

import click
from rich.console import Console

from ledger.errors import OperationNotFound
from workers.errors import ConfigError

if TYPE_CHECKING:
    from celery import Celery

    from ledger.records import Operation
    from ledger.repository import Ledger
    from workers.settings import Settings

# What a command needs is imported when it needs it: the settings (pydantic) and the ledger (SQLAlchemy,
# psycopg) when a command reads, Celery (with kombu and redis) when it sends, the adapters when a failure is
# named. A command's module costs little to load (``longcall status --help``: bench/cli_start.py).

console = Console()

EXIT_OK = 0
#: A refusal: the request was understood and refused (a bad configuration, no such operation, a wrong
#: state, a worker's refusal), with its reason.
EXIT_REFUSED = 1
#: A usage error: a missing or bad option or argument (click's own code).
EXIT_USAGE = 2
#: The database, Redis or the broker cannot be reached: one line naming which and where.
EXIT_UNREACHABLE = 3
#: Nothing answered in time: no worker took the request within ``--timeout``, or ``watch`` ran out.
EXIT_TIMEOUT = 4
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_REFUSED: "refused (the reason on stderr)",
    EXIT_USAGE: "usage error",
    EXIT_UNREACHABLE: "the database, Redis or the broker cannot be reached",
    EXIT_TIMEOUT: "timed out waiting for a worker (or, for watch, for a final state)",
}
#: Seconds the CLI's own connections (Postgres, Redis, the broker) may take to connect, and a Redis
#: command to answer (libpq's smallest connect_timeout is 2 s): a command fails within about 5 s.
CONNECT_TIMEOUT_S = 2


class Unreachable(click.ClickException):
    """A service the command needs cannot be reached: which, where (credentials masked) and why."""

    exit_code = EXIT_UNREACHABLE

    def show(self, file: Any = None) -> None:
        click.echo(f"longcall: {self.message}", err=True)


class TimedOut(click.ClickException):
    exit_code = EXIT_TIMEOUT


def as_unreachable(exc: BaseException, settings: Settings | None = None) -> Unreachable | None:
    """``exc`` (or what it was raised from) as the one-line error of the service it comes from, or None
    when it is no connection failure. A database error with an SQLSTATE is the server's answer, not a
    connection failure."""
    import kombu.exceptions  # noqa: PLC0415 - on a failure only
    import psycopg  # noqa: PLC0415
    import redis.exceptions  # noqa: PLC0415
    import sqlalchemy.exc  # noqa: PLC0415

    from adapters import redact_url  # noqa: PLC0415
    from workers.app import is_redis  # noqa: PLC0415
    from workers.settings import load_settings  # noqa: PLC0415

    # The errors of a connection that failed (refused, timed out, dropped), by the service they come from.
    broker_errors = (kombu.exceptions.OperationalError,)
    redis_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
    database_errors = (psycopg.OperationalError, psycopg.InterfaceError)
    if settings is None:
        try:
            settings = load_settings()
        except ConfigError:
            return None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sqlalchemy.exc.DBAPIError):
            current = current.orig
            continue
        what: str | None = None
        url = ""
        shared = settings.broker == settings.redis_url
        if isinstance(current, broker_errors):
            what, url = ("Redis (broker and result backend)" if shared else "the broker"), settings.broker
        elif isinstance(current, redis_errors):
            what = "Redis (broker and result backend)" if shared else "Redis (result backend, hot state)"
            url = settings.redis_url
            if settings.redis_cluster:
                # The results are on the broker's Redis, if it is one (Settings.result_backend).
                what = "the hot state's Redis Cluster"
                if is_redis(settings.broker):
                    what = "Redis (the hot state's cluster, or the broker's Redis and its results)"
        elif isinstance(current, database_errors) and getattr(current, "sqlstate", None) is None:
            what, url = "the database", settings.database_url
        if what is not None:
            reason = " ".join(str(current).split()) or type(current).__name__
            if what == "the database" and "does not exist" in reason:
                reason += " (longcall migrate creates it)"
            return Unreachable(f"cannot reach {what} at {redact_url(url)}: {reason[:300]}")
        current = current.__cause__ or current.__context__
    return None


def cli_settings() -> Settings:
    """The settings, the CLI's connect timeout added to the database URL (a command never hangs on a
    database that does not answer)."""
    from workers.settings import load_settings  # noqa: PLC0415 - pydantic, when a command reads its settings

    try:
        settings = load_settings()
        settings.checked_fleet()  # refuse a bad LONGCALL_CONFIG before doing anything
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    return settings.model_copy(
        update={"database_url": with_connect_timeout(settings.database_url, CONNECT_TIMEOUT_S)}
    )


def with_connect_timeout(database_url: str, seconds: int) -> str:
    """``database_url`` with libpq's ``connect_timeout`` (unless it sets one already)."""
    base, _, query = database_url.partition("?")
    params = parse_qsl(query, keep_blank_values=True)
    if any(key == "connect_timeout" for key, _ in params):
        return database_url
    return f"{base}?{urlencode([*params, ('connect_timeout', str(seconds))])}"


def cli_app(settings: Settings) -> Celery:
    """The Celery app the CLI sends with: connects within seconds, retries no failed connect or publish
    (a worker's app waits for its broker; a person at a terminal should not)."""
    from workers.app import celery_config, create_app, is_redis  # noqa: PLC0415 - only to send

    app = create_app(settings)
    config = celery_config(settings)
    quick = {"max_retries": 0, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
    broker_options = dict(config["broker_transport_options"])
    broker_options.update(quick)
    if is_redis(settings.broker):
        broker_options.update(socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S)
    app.conf.update(
        broker_connection_timeout=CONNECT_TIMEOUT_S,
        broker_connection_max_retries=1,
        broker_transport_options=broker_options,
        task_publish_retry_policy=quick,
        redis_socket_connect_timeout=CONNECT_TIMEOUT_S,
        redis_socket_timeout=CONNECT_TIMEOUT_S,
        result_backend_transport_options={
            **config["result_backend_transport_options"],
            "retry_policy": quick,
        },
    )
    return app


def send_to_worker(task: str, kwargs: dict[str, Any], timeout: float) -> Any:
    """Send ``task`` by name on ``longcall.control`` and wait up to ``timeout`` for a worker's answer; a
    worker's refusal becomes the command's refusal (exit 1), no answer :class:`TimedOut`."""
    from celery.exceptions import TimeoutError as CeleryTimeout  # noqa: PLC0415 - only to send

    settings = cli_settings()
    app = cli_app(settings)
    try:
        return app.send_task(task, kwargs=kwargs, queue="longcall.control").get(timeout=timeout)
    except CeleryTimeout:
        raise TimedOut(
            f"no longcall worker answered within {timeout:g}s; is one consuming longcall.control?"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the worker's refusal arrives as a rebuilt exception class
        unreachable = as_unreachable(exc, settings)
        if unreachable is not None:
            raise unreachable from None
        raise click.ClickException(f"refused: {exc}") from None
    finally:
        app.close()


@contextmanager
def open_ledger(settings: Settings | None = None) -> Iterator[Ledger]:
    """The ledger for one command, on one connection, disposed on the way out whatever happens."""
    from ledger.repository import Ledger  # noqa: PLC0415 - SQLAlchemy and psycopg, when a command reads

    ledger = Ledger.from_url((settings or cli_settings()).database_url, pool_size=1)
    try:
        yield ledger
    finally:
        ledger.dispose()


def acting_operator() -> str:
    """Who an operator's decision is recorded as (kept in the ledger with the decision)."""
    return os.environ.get("USER", "operator")


def lookup_operation(ref: str) -> Operation:
    """:func:`find_operation` on a ledger opened for this lookup alone."""
    with open_ledger() as ledger:
        return find_operation(ledger, ref)


def find_operation(ledger: Ledger, ref: str) -> Operation:
    """An operation by op id, submission key, call node id, SERVER:REMOTE_ID, or the start of its op id (8
    characters or more, naming one operation), in that order."""
    op: Operation | None = None
    try:
        key = uuid.UUID(ref)
    except ValueError:
        pass
    else:
        try:
            return ledger.get(key)
        except OperationNotFound:
            op = ledger.find_by_submission_key(key)
    op = op or ledger.find_by_call_node(ref)
    if op is None and ":" in ref:
        server, _, remote_id = ref.partition(":")
        op = ledger.find_by_remote(server, remote_id)
    if op is None and OP_ID_PREFIX.fullmatch(ref):
        found = ledger.find_by_id_prefix(ref.lower())
        if len(found) > 1:
            raise click.ClickException(f"op id prefix {ref!r} names more than one operation: give more of it")
        op = found[0] if found else None
    if op is None:
        raise click.ClickException(
            f"no operation with op id, submission key, call node id or SERVER:REMOTE_ID {ref!r} (an op id may"
            " be given by its first 8 or more characters)"
        )
    return op


#: The start of an op id, as ``longcall list`` shows it (8 hexadecimal characters or more).
OP_ID_PREFIX = re.compile(r"[0-9a-fA-F]{8}[0-9a-fA-F-]{0,28}")


def json_option(name: str, value: str) -> Any:
    """The JSON an option ``name`` was given, or click's usage error naming the option."""
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=name) from exc
