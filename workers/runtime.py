"""What a worker process holds: settings, the fleet config and a ledger connection pool.

Built lazily and per process: a pool created before a prefork fork is never used by the child.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from ledger.repository import Ledger
from workers.hot import HotState
from workers.remote import RemotePool
from workers.settings import FleetConfig, Settings, load_settings


@dataclass
class Runtime:
    settings: Settings
    fleet: FleetConfig
    _ledger: Ledger | None = field(default=None, repr=False)
    _hot: HotState | None = field(default=None, repr=False)
    _remote: RemotePool | None = field(default=None, repr=False)
    _pid: int = field(default_factory=os.getpid, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> Runtime:
        return cls(settings=settings, fleet=settings.checked_fleet())

    def _forked(self) -> None:
        """A pool created in a parent process is never used by its child."""
        if self._pid != os.getpid():
            self._ledger = self._hot = self._remote = None
            self._pid = os.getpid()

    @property
    def ledger(self) -> Ledger:
        self._forked()
        if self._ledger is None:
            self._ledger = Ledger.from_url(
                self.settings.database_url, reconcile_deadline_s=self.settings.reconcile_deadline_s
            )
        return self._ledger

    @property
    def hot(self) -> HotState:
        self._forked()
        if self._hot is None:
            self._hot = HotState.from_url(
                self.settings.redis_url, prefix=f"{self.settings.broker_keyprefix}longcall:"
            )
        return self._hot

    @property
    def remote(self) -> RemotePool:
        self._forked()
        if self._remote is None:
            self._remote = RemotePool(self.fleet, max_result_bytes=self.settings.max_result_bytes)
        return self._remote

    def close(self) -> None:
        if self._pid == os.getpid():
            if self._ledger is not None:
                self._ledger.dispose()
            if self._hot is not None:
                self._hot.close()
            if self._remote is not None:
                self._remote.close()
        self._ledger = self._hot = self._remote = None


class RuntimeHolder:
    """Loads the settings on first use (not at import), once per holder."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
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
                    self._runtime = Runtime.from_settings(self.settings)
        return self._runtime
