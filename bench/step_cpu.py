"""Issue 13: the CPU of one unchanged poll step in this process, by the size of the operation's arguments.

What ``longcall.poll`` runs for a WORKING operation whose server answers "still working", without Celery:
the claim (``Ledger.claim``, as a dispatch tick makes it), then ``Executor.advance`` (the row's read, the
poll token's Lua script, ``tasks/get`` to longcall's MCP server, the reschedule), on a fresh migrated ledger
database, the shared Redis under a key prefix of its own and the demo MCP server on loopback. The process's
CPU clock (``time.process_time``) and the wall clock over ``--polls`` steps after ``--warmup``, for each
``--body-bytes`` size (a string argument of that many bytes besides the tool's own).

The Celery no-op's cost and the dispatcher's send are not in it (``bench/lifecycle.py`` measures the step as
the fleet runs it); this is the step's own cost, for profiling (``--profile`` prints the top functions) and
for what the arguments' size does to it: the poll path reads the row without them (``Ledger.get(
with_body=False)``), so the figure should not grow with ``--body-bytes``.

Run: ``.venv/bin/python bench/step_cpu.py [--body-bytes 0 262144 1000000] [--polls 1000] [--profile]``
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
    start_child,
)

from demo_server.command import command as demo_server_command
from workers.executor import Executor
from workers.runtime import Runtime
from workers.settings import Settings
from workers.submission import validate_submission


@contextmanager
def mcp_server(log_dir: Path) -> Iterator[str]:
    """longcall's MCP server on a free port; its ``/mcp`` URL."""
    port = free_port()

    child = start_child(
        demo_server_command(port),
        env={},
        log_dir=log_dir,
        name="mcp",
        ready=listening(f"http://127.0.0.1:{port}/_control"),
    )
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        child.stop()


def measure(
    executor: Executor, body_bytes: int, polls: int, warmup: int, profile: bool
) -> tuple[float, float]:
    """CPU and wall ms per unchanged poll of one operation carrying ``body_bytes`` more of arguments."""
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
    op_id = submission.operation.id

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--body-bytes", type=int, nargs="+", default=[0, 262_144, 1_000_000])
    parser.add_argument("--polls", type=int, default=1000, help="measured steps per size")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="profile the measured steps (CPU clock)")
    parser.add_argument("--max-s", type=int, default=600, help="bound on the whole run")
    args = parser.parse_args(argv)
    prefix = f"lc-bench-step-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    with (
        alarm(args.max_s),
        log_directory("step-cpu") as log_dir,
        fresh_database() as name,
        mcp_server(log_dir) as url,
    ):
        config = log_dir / "longcall.toml"
        config.write_text(fleet_config(url, 100_000.0))
        runtime = Runtime.from_settings(
            Settings(
                database_url=database_url(name),
                redis_url=SHARED_REDIS_URL,
                broker_keyprefix=prefix,
                config=config,
                lease_s=30,
            )
        )
        try:
            executor = Executor(runtime)
            print(f"one unchanged poll step in process (claim + advance), {args.polls} per size:")
            for size in args.body_bytes:
                cpu_ms, wall_ms = measure(executor, size, args.polls, args.warmup, profile=args.profile)
                print(f"  arguments +{size:>9,} bytes: {cpu_ms:.3f} ms CPU, {wall_ms:.3f} ms wall per poll")
        finally:
            runtime.close()
            delete_prefixed(client, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
