"""What a worker process holds: settings, the fleet config and a ledger connection pool.

Built lazily and per process: a pool created before a prefork fork is never used by the child.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from ledger.repository import Ledger
from workers.settings import FleetConfig, Settings, load_settings


@dataclass
class Runtime:
    settings: Settings
    fleet: FleetConfig
    _ledger: Ledger | None = field(default=None, repr=False)
    _pid: int = field(default_factory=os.getpid, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> Runtime:
        return cls(settings=settings, fleet=settings.fleet())

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None or self._pid != os.getpid():
            self._ledger = Ledger.from_url(self.settings.database_url)
            self._pid = os.getpid()
        return self._ledger

    def close(self) -> None:
        if self._ledger is not None and self._pid == os.getpid():
            self._ledger.dispose()
        self._ledger = None


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
