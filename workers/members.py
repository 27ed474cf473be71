"""Rule 3: the members of a batched ``longcall.poll`` run side by side, on the process's member threads.

One pool of threads per worker process, made on first use (Celery prefork forks its children after import:
a child forgets its parent's pool, whose threads do not run there, and makes its own), as large as the
largest batch it was asked to run (``poll_batch``), so every member of a batch has its thread and a slow
member holds up no other. What a member touches is thread-safe: the ledger's engine (its pool is sized from
``poll_batch``: ``workers/runtime.py``), the Redis client (redis-py's connection pool), the adapters (their
httpx clients, and the MCP 2025-11-25 session under its lock), the lease keeper (one thread, a lock) and the
log context (context variables: each thread has its own).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["run_side_by_side"]

M = TypeVar("M")
R = TypeVar("R")

#: The member threads' names (``longcall-member_0``, ...).
THREAD_PREFIX = "longcall-member"


class _MemberThreads:
    """The process's pool, under a lock; grown (a new pool) when a larger batch comes."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """No pool (a forked child's: its parent's threads do not run there, and the lock may be held)."""
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def pool(self, size: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._size < size:
                old = self._pool
                self._pool, self._size = ThreadPoolExecutor(size, thread_name_prefix=THREAD_PREFIX), size
                if old is not None:
                    old.shutdown(wait=False)  # its members finish; it takes no more
            return self._pool


_threads = _MemberThreads()
os.register_at_fork(after_in_child=_threads.forget)


def run_side_by_side(run: Callable[[M], R], members: Sequence[M], *, threads: int) -> list[R]:
    """``run(member)`` for every member at once (at most ``threads`` at a time), their answers in the
    members' order, once all are done. ``run`` answers for its member's failures: an exception it lets
    through is raised here, after every member is done."""
    if len(members) <= 1:
        return [run(member) for member in members]
    pool = _threads.pool(max(threads, 1))
    futures = [pool.submit(run, member) for member in members]
    wait(futures)
    return [future.result() for future in futures]
