"""Issues 13 and 21: the CPU of an unchanged poll in this process, one operation at a time or by the batch.

**One at a time** (the default): what ``longcall.poll`` with ``op_id`` runs for a WORKING operation whose
server answers "still working", without Celery: the claim (``Ledger.claim``, as a dispatch tick makes it),
then ``Executor.advance`` (the row's read, the poll token's Lua script, ``tasks/get`` to longcall's MCP
server, the reschedule), for each ``--body-bytes`` size (a string argument of that many bytes besides the
tool's own): the poll path reads the row without them, so the figure should not grow with the size.

**By the batch** (``--batch N``): what the fleet runs for N WORKING operations of one server, per member:
the dispatcher's share (``Executor.dispatch_due``: the claim of the due rows, ``Ledger.claim_due_by_server``;
the messages built, ``workers.steps.dispatch.messages``, and published over a real broker) and the
worker's (the message's ``ops`` decoded, then ``Executor.advance_batch``: one ``Ledger.record_then_read``
reading the batch's rows, the status reads' slots booked in one script call, the members side by side on
their server's member threads, each ``tasks/get`` at its slot, and the batch's unchanged polls recorded in
one statement). The batches here run one after another, each waiting for its record, so that record is
made by the process's recorder a dispatch tick on (``workers.records_later.RecordLater.flush``, its own
transaction), as in a worker that gets no next batch; a busy worker makes it with its next batch's read,
in that read's transaction (the ``read`` part then carries it). Each part's CPU is printed per
poll: the thread CPU clock (``time.thread_time``) around each part where it runs (a member's parts on its
own thread), and the process clock around ``advance_batch`` as a whole (its threads' CPU, the pool's
hand-offs included). Between two repetitions the rows are made due again by a statement not counted.

The machine is shared and noisy, so every figure is measured over ``--rounds`` rounds of ``--reps``
batches and the median is printed (with the lowest and highest round), and beside it the figure in
*reference units*: divided by the CPU of a fixed pure-Python workload measured in the same round, which
cancels most of what a busy machine does to the clock (no hardware instruction counter is available here).

``--stub-request``: the adapter's ``get`` answers each operation from memory after its first status read
(its token still taken): what a poll costs besides its HTTP request, which is most of it and the noisiest.

The Celery message's own cost (a worker's receive, trace, events and ack) is not in it: it is a no-op
task's, which ``bench/lifecycle.py`` measures on the fleet; per poll it is that divided by the batch.
``--profile`` profiles one more round (not counted in the figures) with the members run one after the
other in this thread, so that cProfile sees them, and prints the top functions by own and by cumulative
time.

Run: ``.venv/bin/python bench/step_cpu.py [--body-bytes 0 262144 1000000] [--polls 1000] [--profile]``, or
``.venv/bin/python bench/step_cpu.py --batch 32 [--rounds 7] [--reps 20] [--broker redis|rabbitmq|none]
[--stub-request] [--profile]``
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import redis
from _fleet import fleet_config
from _harness import (
    SHARED_REDIS_URL,
    alarm,
    database_url,
    delete_prefixed,
    free_port,
    fresh_database,
    listening,
    log_directory,
    rabbitmq_vhost,
    start_child,
)
from celery import Celery

import workers.members
from demo_server.command import command as demo_server_command
from workers.app import create_app
from workers.budget import ServerBudgets, TokenBudget
from workers.executor import Executor, PollMember
from workers.runtime import Runtime
from workers.settings import Settings
from workers.steps.context import StepAction
from workers.steps.dispatch import messages
from workers.submission import validate_submission
from workers.tasks import _members, publish_dispatches

F = TypeVar("F", bound=Callable[..., Any])

#: An attribute a target did not have of its own before :func:`instrumented` set it.
_ABSENT = object()


@contextmanager
def mcp_server(log_dir: Path, poll_interval_ms: int | None = None) -> Iterator[str]:
    """longcall's MCP server on a free port (suggesting ``poll_interval_ms``); its ``/mcp`` URL."""
    port = free_port()

    child = start_child(
        demo_server_command(port, poll_interval_ms=poll_interval_ms),
        env={},
        log_dir=log_dir,
        name="mcp",
        ready=listening(f"http://127.0.0.1:{port}/_control"),
    )
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        child.stop()


def create_working(executor: Executor, body_bytes: int = 0) -> uuid.UUID:
    """A new operation of ``reports.slow_report`` (an hour long), created on the server: WORKING."""
    arguments: dict[str, object] = {"seconds": 3600}
    if body_bytes:
        arguments["payload"] = "x" * body_bytes
    new = validate_submission(
        {
            "call_node_id": f"step-cpu/{uuid.uuid4()}",
            "server": "reports",
            "tool": "slow_report",
            "arguments": arguments,
        },
        executor.rt.fleet,
        max_body_bytes=max(executor.rt.settings.max_body_bytes, body_bytes + 4096),
    )
    submission, step = executor.submit(new)
    if step is None or step.action != "created":
        raise RuntimeError(f"the operation was not created: {step}")
    return submission.operation.id


def measure(
    executor: Executor, body_bytes: int, polls: int, warmup: int, profile: bool
) -> tuple[float, float]:
    """CPU and wall ms per unchanged poll of one operation carrying ``body_bytes`` more of arguments."""
    op_id = create_working(executor, body_bytes)

    def one() -> None:
        claim = executor.ledger.claim(op_id, lease_s=30)
        if claim is None:
            raise RuntimeError("the operation could not be claimed")
        outcome = executor.advance(op_id, claim.poll_cursor)
        if outcome.action != "still_working":
            raise RuntimeError(f"the poll did not find the operation working: {outcome}")

    for _ in range(warmup):
        one()
    profiler = cProfile.Profile(time.process_time) if profile else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(polls):
        one()
    if profiler is not None:
        profiler.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    return 1000 * cpu / polls, 1000 * wall / polls


# ------------------------------------------------------------------------------------------ by the batch

#: The parts of an unchanged poll, in the order they run, as printed (an indented part is within the one
#: above it: a member's request within its step, the bucket within the request).
PARTS = (
    ("claim", "Executor.dispatch_due: the claim and its Dispatch list"),
    ("  statement", "  of which Ledger.claim_due_by_server"),
    ("build", "messages(): the batch messages built"),
    ("publish", "publish_dispatches: build and send over the broker"),
    ("decode", "the message's ops decoded (tasks._members)"),
    ("read", "advance_batch: the rows read (Ledger.record_then_read)"),
    ("book", "advance_batch: the status reads' slots booked (ServerBudgets.book_slots)"),
    ("member", "advance_batch: one member's step (its thread)"),
    ("  request", "  of which the adapter's get (tasks/get)"),
    ("    bucket", "    of which its slot (TokenBudget.charge)"),
    ("record", "advance_batch: its unchanged polls recorded, a tick on (RecordLater.flush)"),
    ("batch", "advance_batch as a whole (process CPU: its threads and the pool)"),
    ("pool", "advance_batch less its parts: threads, futures, log context, the batch's record keeping"),
    ("total", "claim + publish + decode + advance_batch"),
)


class PartClock:
    """CPU seconds per part, from the thread CPU clock of whichever thread ran it (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def add(self, part: str, seconds: float) -> None:
        with self._lock:
            self.seconds[part] += seconds

    def timed(self, part: str, run: F) -> F:
        """``run``, its thread's CPU counted to ``part``."""

        @functools.wraps(run)
        def timed_run(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return run(*args, **kwargs)
            finally:
                self.add(part, time.thread_time() - start)

        return timed_run  # type: ignore[return-value]

    @contextmanager
    def around(self, part: str, clock: Callable[[], float] = time.thread_time) -> Iterator[None]:
        start = clock()
        try:
            yield
        finally:
            self.add(part, clock() - start)


@contextmanager
def instrumented(executor: Executor, clock: PartClock) -> Iterator[None]:
    """The parts that run inside ``Executor.dispatch_due`` and ``advance_batch`` counted on ``clock``: the
    ledger's claim, read and record (on this ledger only), a member's step (on this executor only), the
    booking of a batch's slots, the adapter's ``get`` and the token's charge (on their classes, restored on
    the way out)."""
    ledger = executor.ledger
    adapter_class = type(executor.rt.remote.adapter("reports"))
    patches: list[tuple[object, str, Any]] = [
        (ledger, "claim_due_by_server", clock.timed("  statement", ledger.claim_due_by_server)),
        (ledger, "record_then_read", clock.timed("read", ledger.record_then_read)),
        (executor.rt.unrecorded, "_record", clock.timed("record", executor.rt.unrecorded._record)),
        (executor, "_advance_member", clock.timed("member", executor._advance_member)),
        (ServerBudgets, "book_slots", clock.timed("book", ServerBudgets.book_slots)),
        (adapter_class, "get", clock.timed("  request", adapter_class.get)),
        (TokenBudget, "charge", clock.timed("    bucket", TokenBudget.charge)),
    ]
    saved = [(target, name, vars(target).get(name, _ABSENT)) for target, name, _ in patches]
    for target, name, value in patches:
        setattr(target, name, value)
    try:
        yield
    finally:
        for target, name, value in saved:
            if value is _ABSENT:
                delattr(target, name)
            else:
                setattr(target, name, value)


@contextmanager
def answers_from_memory(executor: Executor) -> Iterator[None]:
    """The adapter's ``get`` answers each operation from memory after its first real status read, still
    charging its token as the read would (``--stub-request``): what a poll costs besides its HTTP request,
    free of the request's noise."""
    adapter_class = type(executor.rt.remote.adapter("reports"))
    real = adapter_class.get
    answers: dict[str, Any] = {}

    def get(self: Any, remote: Any, *, read_input: bool = True, budget: Any = None) -> Any:
        answer = answers.get(remote.remote_id)
        if answer is None:
            answer = answers[remote.remote_id] = real(self, remote, read_input=read_input, budget=budget)
        elif budget is not None:
            budget.charge()
        return answer

    setattr(adapter_class, "get", get)  # noqa: B010 - a method replaced for the run
    try:
        yield
    finally:
        setattr(adapter_class, "get", real)  # noqa: B010


@contextmanager
def members_in_this_thread() -> Iterator[None]:
    """``advance_batch``'s members run one after the other in the calling thread (for cProfile, which
    sees one thread): the same work, without the member threads' hand-offs. A member still waits for its
    time (its due time and booked slot, ``not_before``), as on its thread."""
    on_threads = workers.members.submit

    def at_once(
        server: str, size: int, run: Callable[[], Any], *, not_before: float | None = None
    ) -> Future[Any]:
        if not_before is not None:
            time.sleep(max(0.0, not_before - time.monotonic()))
        done: Future[Any] = Future()
        done.set_result(run())
        return done

    setattr(workers.members, "submit", at_once)  # noqa: B010 - the threads replaced for the run
    try:
        yield
    finally:
        setattr(workers.members, "submit", on_threads)  # noqa: B010


def reference_work() -> None:
    """A fixed pure-Python workload (JSON, dicts, UUIDs, f-strings, calls): the unit the parts are also
    given in, its CPU measured in the same round as theirs."""
    row = {"id": str(uuid.UUID(int=7)), "state": "WORKING", "cursor": 12, "detail": {"n": list(range(20))}}
    for index in range(100):
        text = json.dumps(row)
        back = json.loads(text)
        back["cursor"] = index
        row = {key: back[key] for key in sorted(back)}
        _ = f"{row['id']}:{row['cursor']}:{len(text)}"


def reference_ms(repeat: int = 5) -> float:
    """The least CPU ms of :func:`reference_work` over ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time()
        reference_work()
        best = min(best, time.thread_time() - start)
    return 1000 * best


@dataclass
class Batch:
    """The bench's fixture: the executor, the broker's app (None: nothing published), the operations, and a
    connection of its own that makes them due again between repetitions."""

    executor: Executor
    app: Celery | None
    op_ids: list[uuid.UUID]
    reset: psycopg.Connection[Any]
    #: Profiles the measured parts when set (not the statements that make the rows due, nor the purge).
    profiler: cProfile.Profile | None = None

    def make_due(self) -> None:
        self.reset.execute(
            "UPDATE tool_operation SET next_poll_at = now(), lease_until = NULL WHERE id = ANY(%s)",
            (self.op_ids,),
        )

    def purge(self) -> None:
        if self.app is None:
            return
        self.app.control.purge()

    @contextmanager
    def part(
        self, clock: PartClock, name: str, cpu: Callable[[], float] = time.thread_time
    ) -> Iterator[None]:
        """A measured part: counted on ``clock``, and profiled when :attr:`profiler` is set."""
        if self.profiler is not None:
            self.profiler.enable()
        try:
            with clock.around(name, cpu):
                yield
        finally:
            if self.profiler is not None:
                self.profiler.disable()

    def once(self, clock: PartClock) -> None:
        """One batch: made due (not counted), then claimed, published and polled, each part counted."""
        self.make_due()
        executor, poll_batch = self.executor, self.executor.rt.settings.poll_batch
        with self.part(clock, "claim"):
            dispatches = executor.dispatch_due()
        if len(dispatches) != len(self.op_ids):
            raise RuntimeError(f"{len(dispatches)} of {len(self.op_ids)} operations were claimed")
        with self.part(clock, "build"):
            sent = messages(dispatches, poll_batch)
        if self.app is not None:
            with self.part(clock, "publish"):
                publish_dispatches(self.app, dispatches, poll_batch=poll_batch)
            self.purge()
        for message in sent:
            with self.part(clock, "decode"):
                ops = message.kwargs.get("ops") or [[message.kwargs["op_id"], message.kwargs["cursor"]]]
                members = _members(json.loads(json.dumps(ops)))  # as the worker receives them
            with self.part(clock, "batch", time.process_time):
                steps = executor.advance_batch(members)
            self.check(members, steps)

    @staticmethod
    def check(members: Sequence[PollMember], steps: Sequence[Any]) -> None:
        changed = [s for s in steps if not (s.action is StepAction.STILL_WORKING and s.unchanged)]
        if changed or len(steps) != len(members):
            raise RuntimeError(f"polls that were not unchanged: {changed[:3]}")


def batch_round(fixture: Batch, reps: int) -> dict[str, float]:
    """One round: ``reps`` batches; each part's CPU ms per poll, the derived parts, and ``ref`` (the
    reference workload's CPU ms, measured before and after: the lower)."""
    before = reference_ms()
    clock = PartClock()
    with instrumented(fixture.executor, clock):
        for _ in range(reps):
            fixture.once(clock)
    after = reference_ms()
    polls = reps * len(fixture.op_ids)
    ms = {part: 1000 * seconds / polls for part, seconds in clock.seconds.items()}
    ms.setdefault("publish", 0.0)
    inside = ms["read"] + ms.setdefault("book", 0.0) + ms["member"] + ms.setdefault("record", 0.0)
    ms["pool"] = ms["batch"] - inside
    ms["total"] = ms["claim"] + ms["publish"] + ms["decode"] + ms["batch"]
    ms["ref"] = min(before, after)
    return ms


def print_batch(rounds: Sequence[dict[str, float]], batch: int, *, stubbed: bool = False) -> None:
    refs = [r["ref"] for r in rounds]
    stub = " (the adapter's get answering from memory: no HTTP request)" if stubbed else ""
    print(
        f"unchanged polls by the batch of {batch}{stub}, CPU ms per poll: median of {len(rounds)} rounds "
        f"[lowest, highest]; ref units: the part's CPU over the reference workload's in the same round "
        f"(median {statistics.median(refs):.3f} ms [{min(refs):.3f}, {max(refs):.3f}])"
    )
    for part, what in PARTS:
        values = [r.get(part, 0.0) for r in rounds]
        units = [r.get(part, 0.0) / r["ref"] for r in rounds]
        print(
            f"  {part:<11} {statistics.median(values):7.3f} ms [{min(values):.3f}, {max(values):.3f}]"
            f"  {statistics.median(units):6.3f} ref   {what}"
        )


def profile_round(fixture: Batch, reps: int, top: int) -> None:
    """One more round under cProfile (CPU clock), the members in this thread; the top functions."""
    profiler = fixture.profiler = cProfile.Profile(time.process_time)
    try:
        with members_in_this_thread():
            for _ in range(reps):
                fixture.once(PartClock())
    finally:
        fixture.profiler = None
    stats = pstats.Stats(profiler)
    if out := os.environ.get("BENCH_PROFILE_OUT"):
        stats.dump_stats(out)  # for a closer look: pstats, snakeviz
    print(f"\nprofile of {reps} batches of {len(fixture.op_ids)} (members in turn), by own time:")
    stats.sort_stats("tottime").print_stats(top)
    print("by cumulative time:")
    stats.sort_stats("cumulative").print_stats(top)


@contextmanager
def broker_url(kind: str) -> Iterator[str | None]:
    if kind == "none":
        yield None
    elif kind == "rabbitmq":
        with rabbitmq_vhost() as url:
            yield url
    else:
        yield SHARED_REDIS_URL


def run_batch(args: argparse.Namespace, settings: Settings) -> None:
    runtime = Runtime.from_settings(settings)
    app = create_app(settings) if args.broker != "none" else None
    try:
        executor = Executor(runtime)
        op_ids = [create_working(executor) for _ in range(args.batch)]
        with psycopg.connect(settings.database_url.replace("+psycopg", ""), autocommit=True) as reset:
            fixture = Batch(executor, app, op_ids, reset)
            batch_round(fixture, args.warmup_reps)  # connections, pools, caches, the first status write
            with answers_from_memory(executor) if args.stub_request else contextlib.nullcontext():
                rounds = [batch_round(fixture, args.reps) for _ in range(args.rounds)]
                print_batch(rounds, args.batch, stubbed=args.stub_request)
                if args.profile:
                    profile_round(fixture, args.reps, args.top)
    finally:
        if app is not None:
            app.close()
        runtime.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--body-bytes", type=int, nargs="+", default=[0, 262_144, 1_000_000])
    parser.add_argument("--polls", type=int, default=1000, help="measured steps per size")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--batch", type=int, default=0, help="measure polls by the batch of this many")
    parser.add_argument("--rounds", type=int, default=7, help="batch mode: rounds (the median is printed)")
    parser.add_argument("--reps", type=int, default=20, help="batch mode: batches per round")
    parser.add_argument("--warmup-reps", type=int, default=5, help="batch mode: batches before the rounds")
    parser.add_argument("--broker", choices=("redis", "rabbitmq", "none"), default="redis")
    parser.add_argument(
        "--stub-request", action="store_true", help="batch mode: the status read answered from memory"
    )
    parser.add_argument("--profile", action="store_true", help="profile the measured steps (CPU clock)")
    parser.add_argument("--top", type=int, default=35, help="batch mode: functions the profile prints")
    parser.add_argument("--max-s", type=int, default=600, help="bound on the whole run")
    args = parser.parse_args(argv)
    prefix = f"lc-bench-step-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    with (
        alarm(args.max_s),
        log_directory("step-cpu") as log_dir,
        fresh_database() as name,
        # By the batch, a minute's interval: every member of a batch runs before the next poll its claim
        # set, however slowly (profiled), so its answer is unchanged.
        mcp_server(log_dir, 60_000 if args.batch else None) as url,
        broker_url(args.broker if args.batch else "none") as broker,
    ):
        config = log_dir / "longcall.toml"
        config.write_text(fleet_config(url, 100_000.0))
        settings = Settings(
            database_url=database_url(name),
            redis_url=SHARED_REDIS_URL,
            broker_url=broker,
            broker_keyprefix=prefix,
            config=config,
            lease_s=30,
            poll_batch=max(1, args.batch),
            dispatch_batch=max(500, args.batch),
        )
        try:
            if args.batch:
                run_batch(args, settings)
                return 0
            runtime = Runtime.from_settings(settings)
            try:
                executor = Executor(runtime)
                print(f"one unchanged poll step in process (claim + advance), {args.polls} per size:")
                for size in args.body_bytes:
                    cpu_ms, wall_ms = measure(executor, size, args.polls, args.warmup, profile=args.profile)
                    print(
                        f"  arguments +{size:>9,} bytes: {cpu_ms:.3f} ms CPU, {wall_ms:.3f} ms wall per poll"
                    )
            finally:
                runtime.close()
        finally:
            delete_prefixed(client, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
