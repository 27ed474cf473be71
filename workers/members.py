"""Rule 3: the members of batched ``longcall.poll`` messages run side by side, on member threads of their
server's, in the background of the worker process that took the message.

Each server has its own pool of threads in each worker process (:func:`submit`), made on first use, at most
as large as :func:`server_threads` says and no larger than keeps up with its members (a server that answers
at once is served by a thread or two), so a server whose status reads are slow fills its own threads only:
the next message, of any server, is taken at once, and another server's polls never wait behind it. A
Celery prefork child forgets its parent's pools (their threads do not run there, and a lock may be held) and
makes its own.

Which (operation, cursor) claims are running in this process is kept here too (:func:`running`): a copy of a
message whose members are still on their way here does nothing. And a batch whose members are done but for
a straggler does not wait for it (:class:`Stragglers`: a batch asks to be finished after a bound, on one
thread of the process that wakes when a batch's bound comes).

What a member touches is thread-safe: the ledger's engine (its pool is sized from ``poll_batch``:
``workers/runtime.py``), the Redis client (redis-py's connection pool), the adapters (their httpx clients,
and the MCP 2025-11-25 session under its lock), the lease keeper (one thread, a lock) and the log context
(context variables: each thread has its own).
"""

from __future__ import annotations

import contextvars
import functools
import heapq
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import TypeVar

__all__ = [
    "Stragglers",
    "admit",
    "hold_claim",
    "in_flight",
    "leave",
    "let_go",
    "process_members",
    "run_side_by_side",
    "say_shed",
    "server_threads",
    "submit",
    "wait_for_members",
]

log = logging.getLogger(__name__)

M = TypeVar("M")
R = TypeVar("R")

#: The member threads' names (``longcall-member-<server>_0``, ...).
THREAD_PREFIX = "longcall-member"
#: How long a server's first waiting member may wait past its time, no member thread free, before one more
#: thread is started for it (:class:`_MemberThreads`), and how often one more while that lasts.
GROW_AFTER_S = 0.03
GROW_EVERY_S = 0.002
#: How long a member thread with nothing to run waits for a member before it ends.
IDLE_EXIT_S = 30.0


def server_threads(poll_batch: int) -> int:
    """How many members of one server a worker process runs at once (waiting for their due time and slot,
    or for their answer): four batches' worth. A member past it is not started (:func:`admit`)."""
    return 4 * max(1, poll_batch)


def process_members(poll_batch: int) -> int:
    """How many members of every server a worker process runs at once: eight batches' worth."""
    return 8 * max(1, poll_batch)


def admit(server: str, wanted: int, *, per_server: int, per_process: int) -> int:
    """Reserve room for up to ``wanted`` members of ``server`` in this process: how many may start now,
    within ``per_server`` of that server and ``per_process`` in all. The others are not started: a process
    that has more polls than it can run sheds them (their claims are handed back, and each is polled when
    its claim said) rather than queueing them behind each other past their leases, which costs each one
    twice and slows every other poll of the process. Each admitted member calls :func:`leave` when it is
    done."""
    with _process.lock:
        room = min(
            wanted,
            per_server - _process.running.get(server, 0),
            per_process - sum(_process.running.values()),
        )
        room = max(0, room)
        if room:
            _process.running[server] = _process.running.get(server, 0) + room
        return room


#: How often a process says, per server, that it shed polls.
SHED_WARNING_EVERY_S = 10.0


def say_shed(server: str) -> bool:
    """Whether to say now that polls of ``server`` were shed: once per :data:`SHED_WARNING_EVERY_S`."""
    now = time.monotonic()
    with _process.lock:
        if now - _process.shed_said.get(server, -SHED_WARNING_EVERY_S) < SHED_WARNING_EVERY_S:
            return False
        _process.shed_said[server] = now
        return True


def leave(server: str) -> None:
    """An admitted member of ``server`` is done."""
    with _process.lock:
        left = _process.running.get(server, 0) - 1
        if left > 0:
            _process.running[server] = left
        else:
            _process.running.pop(server, None)


class _Process:
    """This process's member pools (one per server), its running claims and its straggler thread."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Nothing (a forked child's start: its parent's threads do not run here, and a lock may be held)."""
        self.lock = threading.Lock()
        self.pools: dict[str, _MemberThreads] = {}
        self.claims: dict[tuple[uuid.UUID, int], int] = {}
        self.running: dict[str, int] = {}
        self.shed_said: dict[str, float] = {}
        self.stragglers: Stragglers | None = None
        self.growth: Stragglers | None = None

    def pool(self, server: str, size: int) -> _MemberThreads:
        with self.lock:
            pool = self.pools.get(server)
            if pool is None:
                pool = _MemberThreads(server, size)
                self.pools[server] = pool
            return pool


_process = _Process()
os.register_at_fork(after_in_child=_process.forget)


def submit(server: str, size: int, run: Callable[[], R], *, not_before: float | None = None) -> Future[R]:
    """Run ``run`` on one of ``server``'s member threads in this process, no earlier than ``not_before``
    (``time.monotonic``; by default now): at most ``size`` of them, as few as keep up
    (:class:`_MemberThreads`); a member past them waits in the server's own queue.

    Raises:
        RuntimeError: no thread could be started for it (the process at its limit); ``run`` will not run.
    """
    when = time.monotonic() if not_before is None else not_before
    return _process.pool(server, size).submit(run, when)


class _MemberThreads:
    """One server's member threads in this process: its members wait in a queue by the time each may
    start, and run on the fewest threads that keep up with them, at most ``size``.

    One free thread (the leader) waits for the first member's time and takes it, handing the lead to the
    free thread that was last busy; the other free threads wait for the lead, so that a thread not needed
    for :data:`IDLE_EXIT_S` ends. A member still waiting :data:`GROW_AFTER_S` past its time with no thread
    free has one more thread started for it, and one more every :data:`GROW_EVERY_S` for as long as that
    lasts: a server that answers at once is served by a thread or two, one whose answers take seconds by as
    many threads as it has members waiting. Issue 21 measured why: a batch of 32 members answered at once
    costs 0.33 ms of CPU a member on 32 threads (the interpreter lock handed between them) and 0.20 ms on
    one."""

    def __init__(self, server: str, size: int) -> None:
        self._server = server
        self._size = max(1, size)
        self._lock = threading.Lock()
        self._lead = threading.Condition(self._lock)
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._threads = 0
        self._leader = False
        self._followers: list[threading.Event] = []  # the free threads but the leader, the last one last
        self._check_at: float | None = None

    def submit(self, run: Callable[[], R], not_before: float) -> Future[R]:
        future: Future[R] = Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                # a context of its own: nothing a member sets (its log context, a charged budget's label)
                # is left on the thread for the next one
                result = contextvars.Context().run(run)
            except BaseException as exc:  # noqa: BLE001 -- the future holds whatever ended the member
                future.set_exception(exc)
            else:
                future.set_result(result)

        with self._lock:
            # Either may raise (no thread can be started: the process is at its limit): before the member is
            # queued, so that a caller told so knows the member will not run.
            if self._threads == 0:
                self._start()
            self._check(max(not_before, time.monotonic()) + GROW_AFTER_S)
            heapq.heappush(self._queue, (not_before, next(self._order), call))
            if self._leader:
                self._lead.notify()  # its wait may be for a later member
            elif self._followers:
                self._followers.pop().set()
        return future

    def threads(self) -> int:
        with self._lock:
            return self._threads

    def _start(self) -> None:
        """One more thread (under the lock).

        Raises:
            RuntimeError: the thread could not be started (the count stays as it was).
        """
        name = f"{THREAD_PREFIX}-{self._server}_{next(self._order)}"
        threading.Thread(target=self._run, name=name, daemon=True).start()
        self._threads += 1

    def _check(self, when: float) -> None:
        """Look at ``when`` whether the threads keep up (under the lock), on the process's growth timer: a
        timer of its own, which nothing else (a batch's record written late) holds up."""
        if self._check_at is None or when < self._check_at:
            growth_timer().at(when, self._keeping_up)  # may raise: no look is set then; the next one tries
            self._check_at = when

    def _keeping_up(self) -> None:
        """A member waiting :data:`GROW_AFTER_S` past its time, no thread free: one more thread."""
        with self._lock:
            now = time.monotonic()
            if self._check_at is not None and self._check_at > now:
                return  # a look superseded by an earlier one: the next one is set
            self._check_at = None
            if not self._queue:
                return
            first = self._queue[0][0]
            if first + GROW_AFTER_S > now:
                self._check(first + GROW_AFTER_S)
                return
            if not self._leader and not self._followers and self._threads < self._size:
                try:
                    self._start()
                except RuntimeError:  # the process has no room for a thread now: the next look tries again
                    log.warning("no member thread could be started for %s", self._server, exc_info=True)
            self._check(now + GROW_EVERY_S)

    def _run(self) -> None:
        event = threading.Event()
        while True:
            with self._lock:
                call = self._next(event)
                if call is None:
                    self._threads -= 1
                    return
            call()

    def _next(self, event: threading.Event) -> Callable[[], None] | None:
        """The next member to run, once its time has come (under the lock); None when the thread was not
        needed for :data:`IDLE_EXIT_S`."""
        while True:
            if not self._leader:
                self._leader = True
                try:
                    call = self._lead_until_due()
                finally:
                    self._leader = False
                if self._followers:
                    self._followers.pop().set()  # the lead goes on: the rest of the queue, or none
                return call
            event.clear()
            self._followers.append(event)
            self._lock.release()
            try:
                woken = event.wait(IDLE_EXIT_S)
            finally:
                self._lock.acquire()
            if not woken and event in self._followers:
                self._followers.remove(event)
                return None

    def _lead_until_due(self) -> Callable[[], None] | None:
        """As the leader: the first member, once its time has come; None after :data:`IDLE_EXIT_S` with
        none."""
        idle_until = time.monotonic() + IDLE_EXIT_S
        while True:
            now = time.monotonic()
            if self._queue:
                first = self._queue[0][0]
                if first <= now:
                    return heapq.heappop(self._queue)[2]
                self._lead.wait(first - now)
                idle_until = time.monotonic() + IDLE_EXIT_S
            elif now >= idle_until:
                return None
            else:
                self._lead.wait(idle_until - now)


def hold_claim(op_id: uuid.UUID, cursor: int) -> bool:
    """Hold the claim ``(op_id, cursor)`` as running in this process: True when it was not held already (a
    copy of the same message, taken while the first is on its way, gets False and must do nothing). The
    holder lets go with :func:`let_go` once the claim's step is recorded."""
    with _process.lock:
        if (op_id, cursor) in _process.claims:
            return False
        _process.claims[(op_id, cursor)] = 1
        return True


def let_go(op_id: uuid.UUID, cursor: int) -> None:
    """The claim's step is recorded (or failed): a copy of its message may run it from now on."""
    with _process.lock:
        _process.claims.pop((op_id, cursor), None)


def running() -> dict[str, int]:
    """How many admitted members of each server run in this process now (their room taken)."""
    with _process.lock:
        return dict(_process.running)


def in_flight() -> int:
    """How many claims run in this process now (a worker's shutdown waits for them)."""
    with _process.lock:
        return len(_process.claims)


def wait_for_members(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for this process's members to be done (a worker that stops lets the polls it
    took finish, so their rows are free at once rather than when their leases run out); False if some were
    still running."""
    deadline = time.monotonic() + timeout_s
    while in_flight():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class Stragglers:
    """One thread of the process that calls each registered ``finish`` at its time (a batch's bound past
    its first done member, unless the batch finished first; a server's look at whether its member threads
    keep up). ``finish`` must be cheap to call twice."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    @classmethod
    def of_process(cls) -> Stragglers:
        with _process.lock:
            if _process.stragglers is None:
                _process.stragglers = cls()
            return _process.stragglers

    def at(self, when: float, finish: Callable[[], None]) -> None:
        """Call ``finish`` at ``when`` (``time.monotonic``).

        Raises:
            RuntimeError: the timer's thread could not be started; ``finish`` is not registered.
        """
        with self._cond:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=f"{THREAD_PREFIX}-stragglers", daemon=True)
                thread.start()  # may raise (the process at its limit of threads): nothing is registered then,
                self._thread = thread  # and the next call starts the thread again
            heapq.heappush(self._due, (when, next(self._order), finish))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._cond.wait(None if not self._due else self._due[0][0] - time.monotonic())
                _, _, finish = heapq.heappop(self._due)
            try:
                finish()
            except Exception:
                log.exception("a timed call of the member threads (%r) failed", finish)


def growth_timer() -> Stragglers:
    """The process's timer of the member threads' looks at whether they keep up (:class:`_MemberThreads`),
    apart from the batches' (:meth:`Stragglers.of_process`), whose calls write to the ledger."""
    with _process.lock:
        if _process.growth is None:
            _process.growth = Stragglers()
        return _process.growth


def run_side_by_side(
    run: Callable[[M], R], members: Sequence[M], *, threads: int, server: str = ""
) -> list[R]:
    """``run(member)`` for every member at once on ``server``'s member threads (at most ``threads`` at a
    time), their answers in the members' order, once all are done. ``run`` answers for its member's
    failures: an exception it lets through is raised here, after every member is done."""
    if len(members) <= 1:
        return [run(member) for member in members]
    futures = [submit(server, max(threads, 1), functools.partial(run, member)) for member in members]
    wait(futures)
    return [future.result() for future in futures]
