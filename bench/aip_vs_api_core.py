"""Issue 10 benchmark: longcall against google-api-core's operation future on the same AIP-151 operations.

The peer users would pick instead is google-api-core (reference/aip-151.md §4): ``operation.from_http_json``
with an httpx2 ``api_request`` (its REST ``operations_v1`` client needs grpcio and requests) and its
default polling (1 s, x1.5, capped at 20 s, full jitter; no RetryInfo, no Retry-After). Two variants: its
defaults (``result()``: an error on a poll ends the future) and ``result(retry=Retry(predicate=
if_transient_error))`` (its documented way to survive a 429), both with the default polling. Against it,
longcall's fleet (workers + beat + a pipeline worker, ``bench/_fleet.py``) with the AIP-151 adapter,
polling at ``--poll-interval-ms`` (an AIP-151 operation carries no poll hint: this is the server's
configured default, 5 s as client.proto's ``LongRunning.initial_poll_delay``).

Every client gets its own demo AIP-151 server (``python -m demo_server.aip151``, ``well_known_types`` so
api-core can parse the Anys), so each server's request log is one client's; all run at the same time:

* burst: a ``--seconds`` operation; ``--window-at`` s after it is created, for ``--window-s`` s, every
  GetOperation is answered 429 RESOURCE_EXHAUSTED with RetryInfo and ``Retry-After`` (the window's time
  left). Measured from the server's log: GetOperation calls, calls that came while a Retry-After the server
  had given was still running, and the detection lag (the first GetOperation after the operation was done,
  minus its ``endTime``).
* expiry: the same operation on a server that forgets a done operation ``--expire-after-done-s`` s after it
  is done (then 404 NOT_FOUND): what each client ends with. By default one longcall poll interval + 1 s:
  a retention a poller with a bounded interval always sees inside, and that google-api-core's backoff (up
  to 20 s between polls) can jump over. Shorter than longcall's interval, longcall misses it too and hands
  the operation to an operator (DESIGN rule 11: nothing held, no receipt), which the table shows.

Every client runs ``--runs`` operations per scenario (api-core's jitter is random; a fixed-interval poller's
lag depends on where in its interval the operation ends): ``--seconds`` plus i/runs of longcall's poll
interval, the same durations for every client. The table shows the mean and the range.

Goals (PASS/FAIL): longcall makes fewer GetOperation calls than api-core (the variant that survives the
burst), none inside a Retry-After window, a detection lag lower than or equal to api-core's, and a
receipt in the expiry scenario in every run where api-core raises at least once.

Run: ``.venv/bin/python bench/aip_vs_api_core.py [--seconds 60] [--json]`` (``--seconds 10`` for a smoke run).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx2
import psycopg
from _apps import PIPELINE_QUEUE, make_pipeline
from _fleet import Services, longcall_env, services
from _harness import (
    Child,
    alarm,
    database_url,
    free_port,
    listening,
    log_directory,
    raise_on_sigterm,
    start_child,
    start_longcall_fleet,
    verdict,
    wait_for,
)
from celery import Celery
from google.api_core import exceptions as api_exceptions
from google.api_core import operation as api_operation
from google.api_core import retry as api_retry

from demo_server.aip151_command import command as aip_server_command

# protobuf ships no type information: its modules are imported by name (Any to mypy). error_details_pb2
# registers google.rpc.ErrorInfo / RetryInfo, so an Operation.error with details parses.
STRUCT = importlib.import_module("google.protobuf.struct_pb2").Struct
importlib.import_module("google.rpc.error_details_pb2")

PROJECT = "bench"
TOOL = "run_report"
API_CORE_DEFAULT = "google-api-core (defaults)"
API_CORE_RETRY = "google-api-core (retry=if_transient_error)"
LONGCALL = "longcall"
HTTP_TIMEOUT_S = 30.0
#: The ledger state of an operation no rule can decide (DESIGN rule 11: not found, nothing held).
HANDED_OVER = "MANUAL_RECONCILIATION"


# --------------------------------------------------------------------------------------------- servers


@dataclass
class Server:
    """One demo AIP-151 server, serving one client in one scenario."""

    client: str
    scenario: str
    #: The operation's duration on this server.
    seconds: float
    child: Child
    root: str
    config_name: str = ""

    @property
    def control(self) -> str:
        return f"{self.root}/_control"

    def faults(self, **switches: Any) -> None:
        httpx2.post(f"{self.control}/faults", json=switches, timeout=10).raise_for_status()

    def log(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = httpx2.get(f"{self.control}/log", timeout=10).json()["entries"]
        return entries

    def operations(self) -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = httpx2.get(f"{self.control}/operations", timeout=10).json()["operations"]
        return ops


def start_server(client: str, scenario: str, seconds: float, log_dir: Path) -> Server:
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    ready = listening(f"{root}/_control")
    child = start_child(aip_server_command(port), env={}, log_dir=log_dir, name=f"aip-{port}", ready=ready)
    return Server(client, scenario, seconds, child, root)


def arm(server: Server, args: argparse.Namespace) -> None:
    """The scenario's switches, set just before the operation is created."""
    server.faults(well_known_types=True)
    if server.scenario == "burst":
        window = {"rpc": "GetOperation", "seconds": args.window_s, "start_in_s": args.window_at}
        server.faults(rate_limit_window=window)
    else:
        server.faults(expire_after_done_s=args.expire_after_done_s)


# ------------------------------------------------------------------------------------ google-api-core


@dataclass
class Outcome:
    """How one client's operation ended: ``ended`` is what the client returned or raised."""

    server: Server
    ended: str = "not finished"
    receipt: bool = False
    op_name: str | None = None
    finished_wall: float | None = None
    call_node_id: str | None = None


def api_request_for(http: httpx2.Client, root: str) -> Callable[..., dict[str, Any]]:
    """The ``api_request(method=, path=)`` google-api-core's HTTP future calls. It asks for
    ``operations/{name}`` (reference §4.2: the prefix comes on top of the full name), so the prefix is
    taken off again; an error answer becomes google-api-core's exception for the HTTP status."""

    def api_request(method: str, path: str) -> dict[str, Any]:
        answer = http.request(method, f"{root}/v1/{path.removeprefix('operations/')}")
        if answer.status_code >= 400:
            body = answer.json()
            message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
            raise api_exceptions.from_http_status(answer.status_code, message)  # type: ignore[no-untyped-call]
        value: dict[str, Any] = answer.json()
        return value

    return api_request


def run_api_core(outcome: Outcome, seconds: float, *, retry: bool) -> None:
    """Create the operation, then ``result()`` of google-api-core's operation future, default polling."""
    server = outcome.server
    with httpx2.Client(timeout=HTTP_TIMEOUT_S) as http:
        created = http.post(
            f"{server.root}/v1/projects/{PROJECT}/reports:run",
            json={"seconds": seconds, "requestId": str(uuid.uuid4())},
        )
        created.raise_for_status()
        operation = created.json()
        outcome.op_name = operation["name"]
        # google-api-core leaves from_http_json and from_http_status unannotated.
        future = api_operation.from_http_json(  # type: ignore[no-untyped-call]
            operation, api_request_for(http, server.root), STRUCT, metadata_type=STRUCT
        )
        try:
            if retry:
                future.result(retry=api_retry.Retry(predicate=api_retry.if_transient_error))
            else:
                future.result()
            outcome.ended = "completed"
        except api_exceptions.GoogleAPICallError as exc:
            outcome.ended = f"raised {type(exc).__name__}"
        except concurrent.futures.TimeoutError:
            outcome.ended = "raised TimeoutError"
        outcome.finished_wall = time.time()


# ------------------------------------------------------------------------------------------- longcall


def fleet_config(servers: list[Server], qps: float, poll_interval_ms: int) -> str:
    lines: list[str] = []
    for server in servers:
        lines += [
            f"[servers.{server.config_name}]",
            'protocol = "aip151"',
            'protocol_version = "v1"',
            f'url = "{server.root}"',
            f"poll_qps = {qps}",
            f"control_qps = {qps}",
            f"default_poll_interval_ms = {poll_interval_ms}",
            f"[servers.{server.config_name}.tools.{TOOL}]",
            'create = "POST /v1/projects/{project}/reports:run"',
            'request_id_field = "requestId"',
        ]
    return "\n".join(lines) + "\n"


@dataclass
class Fleet:
    client: Celery
    sink: str
    svc: Services
    children: dict[str, Child] = field(default_factory=dict)

    def submit(self, server: Server, seconds: float) -> str:
        """``longcall.submit`` of the tool on this server, as a pipeline sends it; returns the node id."""
        call_node_id = f"aip-bench-{server.scenario}-{uuid.uuid4().hex[:8]}"
        on_terminal = dict(self.client.signature("bench.record", queue=PIPELINE_QUEUE))
        self.client.send_task(
            "longcall.submit",
            kwargs={
                "call_node_id": call_node_id,
                "server": server.config_name,
                "tool": TOOL,
                "arguments": {"project": PROJECT, "seconds": seconds},
                "on_terminal": on_terminal,
            },
            queue="longcall.control",
        )
        return call_node_id

    def states(self) -> dict[str, str]:
        """Every operation's ledger state by call node id."""
        with psycopg.connect(database_url(self.svc.db_name), connect_timeout=10) as conn:
            rows = conn.execute("SELECT call_node_id, state FROM tool_operation").fetchall()
        return {str(node): str(state) for node, state in rows}

    def receipts(self) -> list[dict[str, Any]]:
        deliveries = [json.loads(raw) for raw in self.svc.redis.lrange(self.sink, 0, -1)]
        return [{**d["kwargs"]["receipt"], "t": d["t"]} for d in deliveries if "receipt" in d["kwargs"]]


@contextlib.contextmanager
def running_fleet(
    args: argparse.Namespace, log_dir: Path, svc: Services, servers: list[Server]
) -> Iterator[Fleet]:
    """longcall workers and beat, and the pipeline worker; all stopped on the way out."""
    children: dict[str, Child] = {}
    client: Celery | None = None
    try:
        config = log_dir / "longcall.toml"
        config.write_text(fleet_config(servers, args.qps, args.poll_interval_ms))
        sink = f"{svc.prefix}sink"
        start_longcall_fleet(
            children,
            log_dir=log_dir,
            longcall_env=longcall_env(svc, config),
            workers=args.workers,
            concurrency=args.concurrency,
            redis_url=svc.redis_url,
            prefix=svc.prefix,
            sink=sink,
        )
        client = make_pipeline(svc.redis_url, svc.prefix, sink)
        yield Fleet(client, sink, svc, children)
    finally:
        if client is not None:
            client.close()
        for child in reversed(list(children.values())):
            child.stop()


# -------------------------------------------------------------------------------------------- figures


def rfc3339_epoch(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def figures(outcome: Outcome, seconds: float) -> dict[str, Any]:
    """From the client's server log: GetOperation calls, those inside a Retry-After, 429s, and the lag."""
    server = outcome.server
    log = server.log()
    created = next((e for e in log if e["rpc"] == "RunReport" and e["status"] == 200), None)
    if created is None:
        return {"ended": outcome.ended, "calls": 0, "inside_retry_after": 0, "refused_429": 0, "lag_s": None}
    gets = [e for e in log if e["rpc"] == "GetOperation" and e["t"] >= created["t"]]
    done_wall = _done_wall(server, created["t"], seconds)
    seen = [e["t"] for e in gets if e["status"] == 200 and e["t"] >= done_wall]
    return {
        "ended": outcome.ended,
        "calls": len(gets),
        "inside_retry_after": sum(bool(e["inside_retry_after"]) for e in gets),
        "refused_429": sum(e["status"] == 429 for e in gets),
        "lag_s": (min(seen) - done_wall) if seen else None,
    }


def _done_wall(server: Server, created_t: float, seconds: float) -> float:
    """The operation's ``endTime`` as the server wrote it; for a forgotten one, created + seconds."""
    for op in server.operations():
        end = op["metadata"].get("value", {}).get("endTime")
        if op.get("done") and end is not None:
            return rfc3339_epoch(end)
    return created_t + seconds


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    values = [float(r[key]) for r in rows if r[key] is not None]
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


# ----------------------------------------------------------------------------------------------- run


def durations(args: argparse.Namespace) -> list[float]:
    """One operation per run, ``--seconds`` plus i/runs of longcall's poll interval: the end of the
    operation falls at a different phase of a fixed-interval poller in each run (a duration that is a
    multiple of the interval would be seen at once, flattering longcall), the same ones for every client."""
    step = args.poll_interval_ms / 1000 / args.runs
    return [args.seconds + index * step for index in range(args.runs)]


def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        servers: list[Server] = []
        for scenario in ("burst", "expiry"):
            for client in (API_CORE_DEFAULT, API_CORE_RETRY, LONGCALL):
                servers.extend(
                    start_server(client, scenario, seconds, log_dir) for seconds in durations(args)
                )
        for server in servers:
            stack.callback(server.child.stop)
        ours = [s for s in servers if s.client == LONGCALL]
        for index, server in enumerate(ours):
            server.config_name = f"aip_{server.scenario}_{index}"
        svc = stack.enter_context(services(args, log_dir))
        fleet = stack.enter_context(running_fleet(args, log_dir, svc, ours))

        outcomes = [Outcome(server) for server in servers]
        threads: list[threading.Thread] = []
        started = time.time()
        for outcome in outcomes:
            arm(outcome.server, args)
            if outcome.server.client == LONGCALL:
                outcome.call_node_id = fleet.submit(outcome.server, outcome.server.seconds)
                continue
            thread = threading.Thread(
                target=run_api_core,
                args=(outcome, outcome.server.seconds),
                kwargs={"retry": outcome.server.client == API_CORE_RETRY},
                daemon=True,
            )
            thread.start()
            threads.append(thread)
        bound = max(durations(args)) + args.wait_s
        for thread in threads:
            thread.join(timeout=max(0.0, started + bound - time.time()))
        ours_outcomes = [o for o in outcomes if o.server.client == LONGCALL]
        _wait_settled(fleet, [o.call_node_id for o in ours_outcomes if o.call_node_id], started + bound)
        receipts = {r["call_node_id"]: r for r in fleet.receipts()}
        states = fleet.states()
        for outcome in ours_outcomes:
            receipt = receipts.get(outcome.call_node_id or "")
            if receipt is not None:
                outcome.ended = f"receipt {receipt['terminal_state']}"
                outcome.receipt = True
                outcome.finished_wall = receipt["t"]
            elif states.get(outcome.call_node_id or "") == HANDED_OVER:
                outcome.ended = "no receipt: handed to an operator"
            else:
                outcome.ended = f"no receipt within {bound:.0f} s ({states.get(outcome.call_node_id or '')})"
        return evaluate(args, outcomes)


def _wait_settled(fleet: Fleet, call_node_ids: list[str], until: float) -> None:
    """Until every one of longcall's operations has its receipt or is with an operator (bounded)."""

    def settled() -> bool:
        received = {r["call_node_id"] for r in fleet.receipts()}
        states = fleet.states()
        return all(node in received or states.get(node) == HANDED_OVER for node in call_node_ids)

    with contextlib.suppress(TimeoutError):
        wait_for("longcall's receipts", settled, timeout=max(0.0, until - time.time()), interval=0.2)


def evaluate(args: argparse.Namespace, outcomes: list[Outcome]) -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {}
    for scenario in ("burst", "expiry"):
        for client in (API_CORE_DEFAULT, API_CORE_RETRY, LONGCALL):
            rows = [
                figures(o, o.server.seconds)
                for o in outcomes
                if (o.server.client, o.server.scenario) == (client, scenario)
            ]
            endings: dict[str, int] = {}
            for row in rows:
                endings[row["ended"]] = endings.get(row["ended"], 0) + 1
            table[f"{scenario}/{client}"] = {
                "runs": len(rows),
                "calls": summary(rows, "calls"),
                "inside_retry_after": summary(rows, "inside_retry_after"),
                "refused_429": summary(rows, "refused_429"),
                "lag_s": summary(rows, "lag_s"),
                "ended": endings,
            }
    ours, theirs = table[f"burst/{LONGCALL}"], table[f"burst/{API_CORE_RETRY}"]
    expiry_ours = table[f"expiry/{LONGCALL}"]["ended"]
    expiry_theirs = {
        **table[f"expiry/{API_CORE_DEFAULT}"]["ended"],
        **table[f"expiry/{API_CORE_RETRY}"]["ended"],
    }
    goals = {
        "fewer GetOperation calls than google-api-core": _lt(ours["calls"]["mean"], theirs["calls"]["mean"]),
        "no call inside a Retry-After window": ours["inside_retry_after"]["max"] == 0,
        "detection lag <= google-api-core's": _le(ours["lag_s"]["mean"], theirs["lag_s"]["mean"]),
        "a receipt where google-api-core raises": all(k.startswith("receipt") for k in expiry_ours)
        and any(k.startswith("raised") for k in expiry_theirs),
    }
    return {"settings": _settings(args), "table": table, "goals": goals}


def _lt(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and a < b


def _le(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and a <= b


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("seconds", "window_at", "window_s", "expire_after_done_s", "poll_interval_ms", "runs")
    return {k: getattr(args, k) for k in keys}


def _fmt(figure: dict[str, float | None], unit: str = "") -> str:
    if figure["mean"] is None:
        return "-"
    mean, low, high = figure["mean"], figure["min"], figure["max"]
    text = f"{mean:.1f}{unit}"
    return text if low == high else f"{text} ({low:.1f}-{high:.1f})"


def report(result: dict[str, Any]) -> None:
    s = result["settings"]
    window = f"{s['window_at']:.0f}-{s['window_at'] + s['window_s']:.0f} s"
    interval = s["poll_interval_ms"] / 1000
    print(
        f"AIP-151: {s['runs']} operation(s) of {s['seconds']:.0f} s and more per client and scenario; "
        f"GetOperation answered 429 (RetryInfo, Retry-After) at {window}; expiry "
        f"{s['expire_after_done_s']:.1f} s after done; longcall polls every {interval:.1f} s"
    )
    print(
        "(calls: GetOperation requests from the create on; inside Retry-After: sent while a Retry-After the "
        "server gave was running; lag: first GetOperation after the operation's endTime)"
    )
    columns = ("GetOperation calls", "inside Retry-After", "429s", "detection lag")
    header = (
        f"{'scenario / client':52} {columns[0]:>20} {columns[1]:>19} {columns[2]:>14} {columns[3]:>20}  ended"
    )
    print(header)
    print("-" * len(header))
    for name, row in result["table"].items():
        ended = ", ".join(f"{k} x{v}" for k, v in sorted(row["ended"].items()))
        print(
            f"{name:52} {_fmt(row['calls']):>20} {_fmt(row['inside_retry_after']):>19} "
            f"{_fmt(row['refused_429']):>14} {_fmt(row['lag_s'], ' s'):>20}  {ended}"
        )
    print()
    for goal, ok in result["goals"].items():
        print(f"{verdict(ok)}  {goal}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="the operation's duration")
    parser.add_argument(
        "--window-at", type=float, default=None, help="the 429 window opens (default: half way)"
    )
    parser.add_argument("--window-s", type=float, default=None, help="the 429 window's length (default: 1/6)")
    parser.add_argument(
        "--expire-after-done-s",
        type=float,
        default=None,
        help="the expiry server forgets a done operation this long after (default: poll interval + 1 s)",
    )
    parser.add_argument(
        "--poll-interval-ms", type=int, default=5000, help="longcall's default_poll_interval_ms"
    )
    parser.add_argument("--runs", type=int, default=3, help="google-api-core runs per variant and scenario")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--qps", type=float, default=50, help="the servers' poll_qps and control_qps")
    parser.add_argument("--wait-s", type=float, default=120, help="bound on waiting past the operation's end")
    parser.add_argument("--redis-url", default=None, help="a shared Redis instead of a private one")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.runs < 1:
        parser.error("--seconds must be positive and --runs at least 1")
    args.window_at = args.seconds / 2 if args.window_at is None else args.window_at
    args.window_s = max(2.0, args.seconds / 6) if args.window_s is None else args.window_s
    if args.expire_after_done_s is None:
        args.expire_after_done_s = args.poll_interval_ms / 1000 + 1.0
    raise_on_sigterm()
    with (
        log_directory("lc-bench-aip-", keep=args.keep_logs) as log_dir,
        alarm(int(max(durations(args)) + args.wait_s + 180)),
    ):
        result = measure(args, log_dir)
    report(result)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return 0 if all(result["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
