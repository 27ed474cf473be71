"""Where a simulation runs: its own database (created, migrated, commits not waiting for the disk), the
settings' Redis under a prefix of its own, and the series spread over worker processes."""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import ExitStack, contextmanager
from typing import Any

from sqlalchemy.engine import make_url

from console.simulation.runner import Report, SeriesResult, Simulation, run
from console.simulation.series import Protocol
from ledger import simulation_runs as runs
from ledger.engine import normalize_database_url
from ledger.migrate import ensure_database, upgrade
from ledger.repository import Ledger
from workers.hot import HotState
from workers.settings import Settings

#: Series per task handed to a worker process.
CHUNK = 25


SUFFIX = "_simulation"


def scratch_url(database_url: str) -> str:
    """The simulation's own database: LONGCALL_DATABASE_URL's, its name suffixed ``_simulation``."""
    url = make_url(normalize_database_url(database_url))
    name = url.database or "longcall"
    if not name.endswith(SUFFIX):
        name += SUFFIX
    return url.set(database=name).render_as_string(hide_password=False)


def same_database(one: str, other: str) -> bool:
    """Whether two database URLs name the same database (host, port and name)."""
    a, b = make_url(normalize_database_url(one)), make_url(normalize_database_url(other))
    return (a.host, a.port or 5432, a.database) == (b.host, b.port or 5432, b.database)


def prepare_database(database_url: str) -> None:
    """Create and migrate the simulation's database; its commits do not wait for the disk."""
    ensure_database(database_url)
    upgrade(database_url)
    ledger = Ledger.from_url(database_url, pool_size=1)
    try:
        runs.relax_durability(ledger)
    finally:
        ledger.dispose()


def run_prefix(settings: Settings) -> str:
    """A run's Redis key prefix: the settings' broker prefix, then one of the run's own."""
    return f"{settings.broker_keyprefix}longcall-sim-{uuid.uuid4().hex[:8]}:"


def clear_prefix(hot: HotState, prefix: str) -> None:
    """Every series has a server of its own: their buckets and holds go with the run."""
    for batch in _batches(hot.client.scan_iter(match=f"{prefix}*", count=1000), 1000):
        hot.client.delete(*batch)


@contextmanager
def simulation_for(
    settings: Settings, database_url: str, *, prepare: bool = True, prefix: str | None = None
) -> Iterator[Simulation]:
    """A :class:`Simulation` on ``database_url`` (created and migrated unless ``prepare`` is False) and the
    settings' Redis, under a key prefix of its own, cleared on the way out (unless ``prefix`` is given: the
    run's, which its owner clears)."""
    if prepare:
        prepare_database(database_url)
    ledger = Ledger.from_url(database_url, reconcile_deadline_s=settings.reconcile_deadline_s, pool_size=2)
    hot = HotState.from_url(
        settings.redis_url, prefix=prefix or run_prefix(settings), cluster=settings.redis_cluster
    )
    try:
        yield Simulation(settings, ledger, hot)
    finally:
        if prefix is None:
            clear_prefix(hot, hot.prefix)
        hot.close()
        ledger.dispose()


#: A worker process's one simulation (its engine, its statement caches, its connections), kept for every
#: chunk the process runs, closed when the process exits.
_PROCESS: dict[str, Simulation] = {}


def _start_worker(settings_json: dict[str, Any], database_url: str, prefix: str) -> None:
    stack = ExitStack()
    settings = Settings.model_validate(settings_json)
    _PROCESS["simulation"] = stack.enter_context(
        simulation_for(settings, database_url, prepare=False, prefix=prefix)
    )
    atexit.register(stack.close)


def _chunk(seed: int, indexes: list[int], protocols: tuple[Protocol, ...]) -> list[SeriesResult]:
    return run(_PROCESS["simulation"], seed=seed, indexes=indexes, protocols=protocols).results


def run_many(
    settings: Settings,
    database_url: str,
    *,
    seed: int,
    indexes: list[int],
    protocols: tuple[Protocol, ...],
    workers: int,
    progress: Callable[[SeriesResult], None] | None = None,
) -> Report:
    """The series in ``workers`` processes (1: in this one), each on its own connections; the report in
    index order."""
    prepare_database(database_url)
    started = time.monotonic()
    if workers <= 1:
        with simulation_for(settings, database_url, prepare=False) as simulation:
            return run(simulation, seed=seed, indexes=indexes, protocols=protocols, progress=progress)
    results: list[SeriesResult] = []
    chunks = [indexes[i : i + CHUNK] for i in range(0, len(indexes), CHUNK)]
    context = multiprocessing.get_context("spawn")
    prefix = run_prefix(settings)
    try:
        with ProcessPoolExecutor(
            max_workers=workers,
            mp_context=context,
            initializer=_start_worker,
            initargs=(settings.model_dump(mode="json"), database_url, prefix),
        ) as pool:
            futures = [pool.submit(_chunk, seed, chunk, protocols) for chunk in chunks]
            for future in as_completed(futures):
                for result in future.result():
                    results.append(result)
                    if progress is not None:
                        progress(result)
    finally:
        hot = HotState.from_url(settings.redis_url, prefix=prefix, cluster=settings.redis_cluster)
        try:
            clear_prefix(hot, prefix)
        finally:
            hot.close()
    results.sort(key=lambda r: r.series.index)
    return Report(seed, len(results), protocols, time.monotonic() - started, results)


def _batches(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch
