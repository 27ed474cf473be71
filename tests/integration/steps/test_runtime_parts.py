"""A worker process's parts (its ledger pool, its Redis, its adapters and their HTTP clients, its unchanged
polls waiting for their record) are made once, however many threads ask for them first: a poll batch's
members start side by side in a fresh process. A part made twice lost one of the two, never closed: its
sockets were left to the garbage collector (seen as an unclosed socket of a ``tools/list`` whose client
was dropped), its connections held, and the unchanged polls given to the lost recorder recorded by its
own timer alone, not with the next batch's read, nor flushed when the worker stopped."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fleet import fleet_config, in_process_runtime
from workers.runtime import Runtime

THREADS = 16


@pytest.fixture
def runtime(database_url: str, broker_prefix: str, tmp_path: Path) -> Iterator[Runtime]:
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config("http://127.0.0.1:9/mcp"))  # nothing is sent: the parts are only made
    made = in_process_runtime(database_url, broker_prefix, config)
    try:
        yield made
    finally:
        made.close()


def _first_asked_by_many(ask: Callable[[], object]) -> set[int]:
    """What ``ask`` returns to each of :data:`THREADS` threads that ask at once, as object ids."""
    start = threading.Barrier(THREADS)
    seen: list[int] = []

    def one() -> None:
        start.wait(timeout=10)
        seen.append(id(ask()))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads taking turns as often as they can: the race, if there is one
    try:
        threads = [threading.Thread(target=one) for _ in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        sys.setswitchinterval(switch)
    assert len(seen) == THREADS
    return set(seen)


@pytest.mark.parametrize("part", ["ledger", "hot", "remote", "unrecorded", "adapter"])
def test_each_part_is_made_once_however_many_threads_ask_for_it_first(runtime: Runtime, part: str) -> None:
    asks: dict[str, Callable[[], object]] = {
        "ledger": lambda: runtime.ledger,
        "hot": lambda: runtime.hot,
        "remote": lambda: runtime.remote,
        "unrecorded": lambda: runtime.unrecorded,
        "adapter": lambda: runtime.remote.adapter("reports"),
    }
    made = _first_asked_by_many(asks[part])
    assert len(made) == 1, f"{len(made)} {part} made by {THREADS} threads asking at once"
    # ... and it is the one the runtime holds, which its close closes
    assert made == {id(asks[part]())}
