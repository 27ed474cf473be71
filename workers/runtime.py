"""What a worker process holds: settings, the fleet config and a ledger connection pool.

Built lazily and per process: a pool created before a prefork fork is never used by the child, and each
part is made once however many threads ask for it first (a poll batch's members, the lease keeper): a
second one made beside it would be dropped unclosed, its sockets and connections with it. The ledger
works for the fleet's executor identity (``LONGCALL_EXECUTOR_ID``, rule 13): once a rollback hands the
epoch to another identity, this fleet claims nothing and writes nothing under a claim, and says so
(:meth:`Runtime.say_not_owner`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

from ledger.engine import make_engine
from ledger.records import EpochOwnership
from ledger.repository import Ledger
from workers.hot import HotState
from workers.records_later import RecordLater
from workers.remote import RemotePool
from workers.request_outcomes import RequestOutcomes
from workers.settings import FleetConfig, Settings, load_settings
from workers.signatures import JSON_RULE, DeliveryCheck

log = logging.getLogger("longcall.executor")

T = TypeVar("T")

#: Held while a runtime makes one of its parts (reentrant: the request outcomes of ``remote`` are counted
#: on ``hot``; ``unrecorded`` records on ``ledger``). A child process starts with a lock of its own: the
#: parent's may have been held by another of its threads at the fork.
_making = threading.RLock()


def _new_lock_in_child() -> None:
    global _making  # noqa: PLW0603 - the one module lock, replaced in a forked child
    _making = threading.RLock()


os.register_at_fork(after_in_child=_new_lock_in_child)

#: How old what a step's own read of its operation saw of the epoch's owner may be for the step to go on
#: on it (``Ledger.epoch_ownership(max_age_s=...)``): that read is milliseconds old; past this, the
#: control row is read again.
OWNER_SEEN_S = 1.0
#: Seconds the start-up check may wait for the database to accept a connection.
START_CHECK_TIMEOUT_S = 5
#: How often a fleet that does not own the epoch says so at WARNING (at DEBUG in between): a line a minute,
#: not one every dispatch tick.
NOT_OWNER_WARN_S = 60.0


@dataclass
class Runtime:
    settings: Settings
    fleet: FleetConfig
    #: When this runtime read its configuration: an operation on a server it does not name that is older
    #: than this is one whose server was removed (or renamed); a newer one is another fleet's (rule 14).
    started_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    #: What the serializer and Celery say of a value before it is sent (a result about to be accepted, a
    #: submission's downstream signatures): the Celery layer's own answers in a worker (``workers/app.py``),
    #: the JSON rule without it.
    delivery: DeliveryCheck = JSON_RULE
    _ledger: Ledger | None = field(default=None, repr=False)
    _hot: HotState | None = field(default=None, repr=False)
    _remote: RemotePool | None = field(default=None, repr=False)
    _unrecorded: RecordLater | None = field(default=None, repr=False)
    _pid: int = field(default_factory=os.getpid, repr=False)
    _not_owner_said_at: float = field(default=-math.inf, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings, *, delivery: DeliveryCheck = JSON_RULE) -> Runtime:
        if settings.result_backend == "rpc://":  # keeps no chord state: a chord could never be sent
            delivery = dataclasses.replace(delivery, chords=False)
        return cls(settings=settings, fleet=settings.checked_fleet(), delivery=delivery)

    def _forked(self) -> None:
        """A pool created in a parent process is never used by its child."""
        if not self._mine():
            self._ledger = self._hot = self._remote = None
            self._unrecorded = None
            self._pid = os.getpid()

    def _made(self, name: str, make: Callable[[], T]) -> T:
        """The part held in attribute ``name``, made by ``make`` if this process has none yet: once,
        however many threads ask at the same moment (the module's docstring). A part already made is read
        without the lock."""
        part = getattr(self, name)
        if part is None or not self._mine():
            with _making:
                self._forked()
                part = getattr(self, name)
                if part is None:
                    part = make()
                    setattr(self, name, part)
        return cast(T, part)

    def _mine(self) -> bool:
        """This process made what it holds (a part made before a fork is the parent's)."""
        return self._pid == os.getpid()

    @property
    def ledger(self) -> Ledger:
        return self._made("_ledger", self._new_ledger)

    def _new_ledger(self) -> Ledger:
        return Ledger.from_url(
            self.settings.database_url,
            pool_size=ledger_pool_size(self.settings),
            reconcile_deadline_s=self.settings.reconcile_deadline_s,
            executor_id=self.settings.executor_id,
        )

    @property
    def unrecorded(self) -> RecordLater:
        """This process's unchanged polls waiting for their record (``workers.records_later``): recorded with
        its next batch's read, or a dispatch tick after the first of them."""
        return self._made("_unrecorded", self._new_recorder)

    def _new_recorder(self) -> RecordLater:
        return RecordLater(self.ledger.record_unchanged_polls, bound_s=self.settings.dispatch_interval_s)

    @property
    def hot(self) -> HotState:
        return self._made("_hot", self._new_hot)

    def _new_hot(self) -> HotState:
        return HotState.from_url(
            self.settings.redis_url,
            prefix=f"{self.settings.broker_keyprefix}longcall:",
            cluster=self.settings.redis_cluster,
        )

    @property
    def remote(self) -> RemotePool:
        return self._made("_remote", self._new_remote)

    def _new_remote(self) -> RemotePool:
        return RemotePool(
            self.fleet,
            max_result_bytes=self.settings.max_result_bytes,
            connections=self.settings.poll_batch,  # a batch's members poll one server at once
            outcomes=RequestOutcomes(self.hot.client, self.hot.prefix),
            status_reads=self.settings.status_reads,
        )

    def say_not_owner(self, ownership: EpochOwnership, doing: str) -> None:
        """Log that this fleet does not own the epoch (rule 13) and what it therefore does not do: at
        WARNING once every :data:`NOT_OWNER_WARN_S` per process, at DEBUG in between."""
        now = time.monotonic()
        loud = now - self._not_owner_said_at >= NOT_OWNER_WARN_S
        if loud:
            self._not_owner_said_at = now
        log.log(
            logging.WARNING if loud else logging.DEBUG,
            "this fleet (executor %s) does not own execution epoch %s (owned by %s): it claims nothing and "
            "sends nothing to any server; %s. Stop this fleet, or hand it the epoch: longcall rollback "
            "--owner %s",
            ownership.executor_id,
            ownership.execution_epoch,
            ownership.epoch_owner,
            doing,
            ownership.executor_id,
        )

    def report_at_start(self) -> None:
        """What a worker or beat says when it starts (rule 14, rule 13): an ERROR line naming each server
        this configuration does not name that has operations in flight, with their counts (each goes to an
        operator at the next ``longcall.reconcile``), and whether this fleet owns the execution epoch. Read
        on a short-lived connection of its own (a pool made before a prefork fork is not the child's), within
        seconds; a database that cannot be read is said, and the start goes on."""
        try:
            ledger = Ledger(
                make_engine(self.settings.database_url, pool_size=1, connect_timeout_s=START_CHECK_TIMEOUT_S),
                executor_id=self.settings.executor_id,
            )
            try:
                in_flight = ledger.in_flight_by_server()
                ownership = ledger.epoch_ownership()
            finally:
                ledger.dispose()
        except Exception as exc:  # noqa: BLE001 - the check never stops a start
            log.warning("could not read the ledger at start to check its servers and epoch: %s", exc)
            return
        unconfigured = {server: n for server, n in in_flight.items() if server not in self.fleet.servers}
        if unconfigured:
            log.error(
                "operations in flight on servers LONGCALL_CONFIG does not name: %s. longcall.reconcile hands "
                "each to an operator (SERVER_UNCONFIGURED), or ends it where nothing needs the server; "
                "restore the server's entry if it was renamed or removed by mistake",
                ", ".join(f"{server} ({n})" for server, n in sorted(unconfigured.items())),
            )
        if not ownership.owns:
            self.say_not_owner(ownership, "it starts fenced")
        elif ownership.epoch_owner is not None:
            log.info(
                "this fleet (executor %s) owns execution epoch %s",
                ownership.executor_id,
                ownership.execution_epoch,
            )

    def close(self) -> None:
        with _making:
            self._close()

    def _close(self) -> None:
        if self._mine():
            if self._unrecorded is not None and self._ledger is not None:
                self._unrecorded.flush()  # the unchanged polls waiting for their record, before the pool goes
            if self._ledger is not None:
                self._ledger.dispose()
            if self._hot is not None:
                self._hot.close()
            if self._remote is not None:
                self._remote.close()
        self._ledger = self._hot = self._remote = None
        self._unrecorded = None


def ledger_pool_size(settings: Settings) -> int:
    """The ledger connections a worker process keeps (and as many more at a peak: the engine's overflow):
    enough for the members of a poll batch that write at once (they run side by side,
    ``workers/members.py``; a member's statement takes milliseconds, so a member that finds the pool busy
    waits that long, not a status read's time), the task's own thread (its drain) and the lease keeper, and
    at most :data:`MAX_LEDGER_POOL`: a fleet's processes share one Postgres's ``max_connections`` (100 by
    default), so a batch size of 32 must not mean 68 connections a process."""
    return max(5, min(settings.poll_batch + 2, MAX_LEDGER_POOL))


#: The most ledger connections a worker process keeps (twice that at a peak).
MAX_LEDGER_POOL = 10


class RuntimeHolder:
    """Loads the settings on first use (not at import), once per holder; its runtime answers with
    ``delivery`` (:attr:`Runtime.delivery`)."""

    def __init__(self, settings: Settings | None = None, *, delivery: DeliveryCheck = JSON_RULE) -> None:
        self._settings = settings
        self._delivery = delivery
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            with self._lock:
                if self._settings is None:
                    self._settings = load_settings()
        return self._settings

    def get(self) -> Runtime:
        if self._runtime is None:
            with self._lock:
                if self._runtime is None:
                    self._runtime = Runtime.from_settings(self.settings, delivery=self._delivery)
        return self._runtime
