"""Issue 21: the client CPU of one status read, by HTTP client, and the connections each one opens.

A worker runs the polls of one server as a batch of up to ``poll_batch`` members side by side on threads,
every member on the one HTTP client of that server (``workers/remote.py``). This benchmark sends
status-read-sized requests (a JSON-RPC ``tasks/get`` of ~130 bytes, a ~250-byte answer read and decoded)
to a small keep-alive server in a process of its own (``bench/_status_server.py``, which counts the TCP
connections it accepted), from this process, and measures this process's CPU (``time.process_time``):

- each library on its own, the way longcall would use it: ``httpx`` and ``httpx2`` sync clients (their
  default pool, and one sized to the batch), ``urllib3``'s connection pool, all on ``--batch`` threads
  in batches (as ``workers/members.py`` runs them); ``aiohttp`` on one event loop, ``--in-flight`` at once;
- the adapters' status reads (``ToolAdapter.get``) of each protocol on the client a worker makes
  (``workers.remote.RemotePool`` as ``workers.runtime.Runtime`` makes it, on httpx2), in batches of
  ``--batch`` on threads; and MCP 2025-11-25's on a client that keeps 20 connections (every client's
  before issue 21);
- over HTTPS (a certificate of a CA made for the run, ``trustme``): httpx and httpx2, and MCP 2025-11-25's
  status read, where every connection opened costs a TLS handshake.

Printed per client: CPU ms per request (the least of ``--runs`` interleaved runs), requests/s, the TCP
connections the server accepted (the most of any run), and the CPU as a ratio of httpx's default client on
the same scheme (same run). Target: the adapters' client reuses its connections, at most one per member of
a batch over the whole run (``TARGET http.connections_reused``). ``docs/scaling.md``, "The HTTP client",
quotes a run.

Run: ``.venv/bin/python bench/http_clients.py [--quick] [--requests 3200] [--runs 3] [--only NAME ...]
[--profile NAME]``
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import http.client
import json
import os
import pstats
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import aiohttp
import httpx
import httpx2
import trustme
import urllib3
from _harness import free_port, log_directory, raise_on_sigterm, start_child, verdict

from adapters import RemoteRef, ToolAdapter
from workers.budget import TokenBudget
from workers.remote import RemotePool
from workers.runtime import Runtime
from workers.settings import FleetConfig, Settings

#: The batch a worker runs by default (``Settings.poll_batch``).
POLL_BATCH: int = Settings.model_fields["poll_batch"].default
#: One status read as MCP 2025-11-25 sends it: the request's body and headers (the session's).
BODY = json.dumps(
    {
        "jsonrpc": "2.0",
        "id": "lc-0f8e3c9a2b7d4e51a6c0d9f8e7b6a5c4",
        "method": "tasks/get",
        "params": {"taskId": "786512e2-9e0d-44bd-8f92-8d1b5a7e3c10"},
    },
    separators=(",", ":"),
).encode()
HEADERS = {
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
    "MCP-Protocol-Version": "2025-11-25",
    "Mcp-Session-Id": "9d029e60fd9944ec9f36b5431f692087",
}
TASK_ID = "786512e2-9e0d-44bd-8f92-8d1b5a7e3c10"


@dataclass(frozen=True)
class Figure:
    name: str
    requests: int
    cpu_s: float
    wall_s: float
    connections: int

    @property
    def cpu_ms(self) -> float:
        return self.cpu_s * 1000 / self.requests

    @property
    def per_s(self) -> float:
        return self.requests / self.wall_s


class StatusServer:
    """The server process's counters, read over one connection kept for that (counted once, at start)."""

    def __init__(self, url: str, port: int, tls: ssl.SSLContext | None) -> None:
        self.url = url
        self._stats = (
            http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=tls)
            if tls is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        )

    def connections(self) -> int:
        self._stats.request("GET", "/_stats")
        stats: dict[str, int] = json.loads(self._stats.getresponse().read())
        return stats["connections"]

    def close(self) -> None:
        self._stats.close()


@contextmanager
def status_server(
    log_dir: Path, latency_ms: float, *, name: str, tls: tuple[Path, Path, ssl.SSLContext] | None = None
) -> Iterator[StatusServer]:
    """``bench/_status_server.py`` on a free port, answering HTTPS with ``tls`` (its certificate, key and
    the client's context trusting it)."""
    port = free_port()
    argv = [sys.executable, str(Path(__file__).with_name("_status_server.py")), str(port), str(latency_ms)]
    if tls is not None:
        argv += [str(tls[0]), str(tls[1])]
    child = start_child(argv, env={}, log_dir=log_dir, name=name, ready=lambda c: "listening" in c.log())
    scheme = "https" if tls is not None else "http"
    stats = StatusServer(f"{scheme}://127.0.0.1:{port}", port, tls[2] if tls is not None else None)
    try:
        yield stats
    finally:
        stats.close()
        child.stop()


@contextmanager
def servers(log_dir: Path, latency_ms: float) -> Iterator[tuple[StatusServer, StatusServer]]:
    """The plain HTTP server and the HTTPS one, with a certificate of a CA made for this run: every client
    made meanwhile trusts that CA alone (``SSL_CERT_FILE``, which httpx, httpx2, urllib3 and aiohttp read
    as the adapters' client does: none is given a context of its own)."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file, ca_file = log_dir / "cert.pem", log_dir / "key.pem", log_dir / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    ca.cert_pem.write_to_path(str(ca_file))
    trusting = ssl.create_default_context(cafile=str(ca_file))
    before = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(ca_file)
    try:
        with (
            status_server(log_dir, latency_ms, name="http-server") as plain,
            status_server(
                log_dir, latency_ms, name="https-server", tls=(cert_file, key_file, trusting)
            ) as tls,
        ):
            yield plain, tls
    finally:
        if before is None:
            del os.environ["SSL_CERT_FILE"]
        else:
            os.environ["SSL_CERT_FILE"] = before


# ------------------------------------------------------------------------------------------ clients

#: A client under test: given the server's URL, the requests to time and the batch, it sends one untimed
#: batch (its connections opened), then times the rest: (CPU s, wall s).
Client = Callable[[str, int, int], tuple[float, float]]


def in_batches(
    pool: ThreadPoolExecutor, send: Callable[[], object], requests: int, batch: int
) -> tuple[float, float]:
    """``send`` ``batch`` at a time on the pool's threads, each batch waited for whole (as a worker runs a
    poll batch), one untimed batch first; the CPU and wall time of the ``requests`` after it."""

    def one_batch() -> None:
        futures = [pool.submit(send) for _ in range(batch)]
        wait(futures)
        for future in futures:
            future.result()

    one_batch()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(requests // batch):
        one_batch()
    return time.process_time() - cpu0, time.perf_counter() - wall0


#: How far apart :func:`one_at_a_time` sends its reads, and how many of the run's it sends (each waits for the
#: server's answer: a run of all of them would take minutes).
LONE_PAUSE_S = 0.005
LONE_SHARE = 8


def one_at_a_time(make: Make) -> Client:
    """A sync client whose reads go one at a time, :data:`LONE_PAUSE_S` apart: the members of a batch whose
    due times spread over a dispatch tick (the soak's), each read alone. It sends one in
    :data:`LONE_SHARE` of the run's reads, and its CPU is scaled to the run's count."""

    def run(url: str, requests: int, batch: int) -> tuple[float, float]:
        send, close = make(url, batch)
        try:
            send()
            sent = max(1, requests // LONE_SHARE)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(sent):
                send()
                time.sleep(LONE_PAUSE_S)
            scale = (requests // batch * batch) / sent
            return (time.process_time() - cpu0) * scale, (time.perf_counter() - wall0) * scale
        finally:
            close()

    return run


class ThreadProfiles:
    """With ``--profile``: a profiler per thread (cProfile sees only the thread it was enabled in), each
    enabled around the requests that thread sends."""

    def __init__(self) -> None:
        self.on = False
        self.profiles: list[cProfile.Profile] = []
        self._local = threading.local()

    def wrap(self, send: Callable[[], object]) -> Callable[[], object]:
        if not self.on:
            return send

        def profiled() -> object:
            profile: cProfile.Profile | None = getattr(self._local, "profile", None)
            if profile is None:
                profile = self._local.profile = cProfile.Profile(time.thread_time)
                self.profiles.append(profile)
            return profile.runcall(send)

        return profiled


PROFILES = ThreadProfiles()


def threads(make: Callable[[str, int], tuple[Callable[[], object], Callable[[], None]]]) -> Client:
    """A sync client run on a batch's threads: ``make(url, batch)`` gives its ``send`` and ``close``."""

    def run(url: str, requests: int, batch: int) -> tuple[float, float]:
        send, close = make(url, batch)
        send = PROFILES.wrap(send)
        try:
            with ThreadPoolExecutor(batch) as pool:
                return in_batches(pool, send, requests, batch)
        finally:
            close()

    return run


def httpx_client(module: Any, *, sized: bool) -> Client:
    """``httpx.Client`` (or httpx2's, the same API): its default pool (20 connections kept), or one that
    keeps a batch's."""

    def make(url: str, batch: int) -> tuple[Callable[[], object], Callable[[], None]]:
        limits = module.Limits(max_connections=max(100, batch), max_keepalive_connections=batch)
        client = module.Client(limits=limits) if sized else module.Client()
        endpoint = module.URL(url + "/mcp")
        return lambda: client.post(endpoint, content=BODY, headers=HEADERS).json(), client.close

    return threads(make)


def urllib3_pool(url: str, batch: int) -> tuple[Callable[[], object], Callable[[], None]]:
    pool = urllib3.PoolManager(maxsize=batch)
    endpoint = url + "/mcp"
    return lambda: json.loads(pool.request("POST", endpoint, body=BODY, headers=HEADERS).data), pool.clear


def aiohttp_session(url: str, requests: int, in_flight: int) -> tuple[float, float]:
    """aiohttp on one event loop, ``in_flight`` requests at once (gathered in batches)."""

    async def main() -> tuple[float, float]:
        connector = aiohttp.TCPConnector(limit=max(100, in_flight))
        async with aiohttp.ClientSession(connector=connector) as session:

            async def send() -> object:
                async with session.post(url + "/mcp", data=BODY, headers=HEADERS) as answer:
                    return await answer.json()

            async def one_batch() -> None:
                await asyncio.gather(*(send() for _ in range(in_flight)))

            await one_batch()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(requests // in_flight):
                await one_batch()
            return time.process_time() - cpu0, time.perf_counter() - wall0

    return asyncio.run(main())


#: The adapters' status reads: (protocol, version, the remote id asked about).
ADAPTERS = {
    "mcp 2025-11-25": ("mcp", "2025-11-25", TASK_ID),
    "mcp 2026-07-28": ("mcp", "2026-07-28", TASK_ID),
    "aip151 v1": ("aip151", "v1", "operations/op-1"),
}


class PollSlot:
    """A poll's budget as the adapter sees it (``workers.budget.TokenBudget``), without Redis: every charge
    granted, and each request labelled ``poll`` as a poll's is (``Settings.status_reads`` sends those)."""

    def __init__(self) -> None:
        self._budget = TokenBudget("poll", lambda **_: None)

    def charge(self) -> None:
        self._budget.charge()


Make = Callable[[str, int], tuple[Callable[[], object], Callable[[], None]]]


def adapter_reads(
    protocol: str,
    version: str,
    remote_id: str,
    *,
    kept: int | None = None,
    status_reads: Literal["httptools", "aiohttp", "httpx2"] = "httpx2",
) -> Client:
    """``ToolAdapter.get`` of one protocol, paid by a poll's budget, on the adapter and client a worker
    makes (its runtime's ``RemotePool``, for a ``poll_batch`` of ``batch``, its status reads sent as
    ``status_reads`` says); with ``kept``, on a pool whose clients keep that many connections instead (20:
    httpx's default, what every client kept before issue 21) and send on httpx2's transport. On a batch's
    threads (:func:`threads`)."""
    return threads(adapter_make(protocol, version, remote_id, kept=kept, status_reads=status_reads))


def adapter_make(
    protocol: str,
    version: str,
    remote_id: str,
    *,
    kept: int | None = None,
    status_reads: Literal["httptools", "aiohttp", "httpx2"] = "httpx2",
) -> Make:
    """What sends one read as :func:`adapter_reads` says, and what closes its pool."""

    def make(url: str, batch: int) -> tuple[Callable[[], object], Callable[[], None]]:
        path = "" if protocol == "aip151" else "/mcp"
        fleet = FleetConfig.model_validate(
            {"servers": {"bench": {"protocol": protocol, "protocol_version": version, "url": url + path}}}
        )
        if kept is None:
            # as a worker makes it
            runtime = Runtime(settings=Settings(poll_batch=batch, status_reads=status_reads), fleet=fleet)
            pool = runtime.remote
        else:
            pool = RemotePool(fleet, connections=kept, status_reads="httpx2")
        adapter: ToolAdapter = pool.adapter("bench")
        ref = RemoteRef(
            remote_id=remote_id,
            session_ref=HEADERS["Mcp-Session-Id"] if version == "2025-11-25" else None,
            protocol_version=version,
            protocol=protocol,
        )
        return lambda: adapter.get(ref, budget=PollSlot()), pool.close

    return make


@dataclass(frozen=True)
class Row:
    name: str
    client: Client
    https: bool = False
    #: An adapter's status read on the client a worker makes: held to the connection target.
    worker: bool = False


#: The status reads' transports (``Settings.status_reads``), by the suffix of their rows' names: httpx2's own,
#: sockets parsed by httptools (the default), the event loop.
WAYS: dict[str, Literal["httptools", "aiohttp", "httpx2"]] = {
    "": "httpx2",
    ", on sockets": "httptools",
    ", on the loop": "aiohttp",
}


def rows(in_flight: int) -> list[Row]:
    aiohttp_client: Client = lambda url, n, _batch: aiohttp_session(url, n, in_flight)  # noqa: E731
    listed = [
        Row("httpx (default pool)", httpx_client(httpx, sized=False)),
        Row("httpx (pool = batch)", httpx_client(httpx, sized=True)),
        Row("httpx2 (default pool)", httpx_client(httpx2, sized=False)),
        Row("httpx2 (pool = batch)", httpx_client(httpx2, sized=True)),
        Row("urllib3 (pool = batch)", threads(urllib3_pool)),
        Row(f"aiohttp ({in_flight} in flight)", aiohttp_client),
    ]
    for name, (protocol, version, remote_id) in ADAPTERS.items():
        listed += [
            Row(
                f"adapter {name} get{where}",
                adapter_reads(protocol, version, remote_id, status_reads=how),
                worker=True,
            )
            for where, how in WAYS.items()
        ]
    listed.append(
        Row("adapter mcp 2025-11-25 get, 20 kept", adapter_reads("mcp", "2025-11-25", TASK_ID, kept=20))
    )
    # Reads that come one at a time: the loop's hand-over is then paid by each read alone.
    listed += [
        Row(
            f"mcp 2026-07-28 get alone{where}",
            one_at_a_time(adapter_make("mcp", "2026-07-28", TASK_ID, status_reads=how)),
        )
        for where, how in WAYS.items()
    ]
    listed += [
        Row("https httpx (default pool)", httpx_client(httpx, sized=False), https=True),
        Row("https httpx (pool = batch)", httpx_client(httpx, sized=True), https=True),
        Row("https httpx2 (pool = batch)", httpx_client(httpx2, sized=True), https=True),
        *(
            Row(
                f"https adapter mcp 2025-11-25 get{where}",
                adapter_reads("mcp", "2025-11-25", TASK_ID, status_reads=how),
                https=True,
                worker=True,
            )
            for where, how in WAYS.items()
        ),
        Row(
            "https adapter mcp 2025-11-25 get, 20 kept",
            adapter_reads("mcp", "2025-11-25", TASK_ID, kept=20),
            https=True,
        ),
    ]
    return listed


# ------------------------------------------------------------------------------------------ the run


def measure(row: Row, server: StatusServer, requests: int, batch: int) -> Figure | str:
    """One run of ``row``, or what ended it. A comparison client that fails is a finding, not the end of
    the bench: httpx's default pool (20 connections kept) in batches of 64 threads failed on 2026-12-07
    with ``ReadTimeout``, ``Bad file descriptor`` and, over TLS, ``SSL: BAD_RECORD_TYPE``; its row says so.
    A failure of a worker's client (``row.worker``) ends the bench."""
    try:
        return _run(row, server, requests, batch)
    except Exception as exc:
        if row.worker:
            raise
        return f"{type(exc).__name__}: {str(exc)[:80]}"


def _run(row: Row, server: StatusServer, requests: int, batch: int) -> Figure:
    before = server.connections()
    cpu, wall = row.client(server.url, requests, batch)
    opened = server.connections() - before
    return Figure(row.name, requests // batch * batch, cpu, wall, opened)


def best(figures: list[Figure]) -> Figure:
    """One client's runs as one figure: the least CPU (the run the other processes on this machine
    disturbed least) and the most connections any run opened."""
    least = min(figures, key=lambda f: f.cpu_ms)
    return replace(least, connections=max(f.connections for f in figures))


def profile(client: Client, server: StatusServer, requests: int, batch: int) -> None:
    """The functions that took the most CPU (every thread's) while ``client`` sent its requests."""
    PROFILES.on = True
    main = cProfile.Profile(time.thread_time)
    main.enable()
    client(server.url, requests, batch)
    main.disable()
    stats = pstats.Stats(main)
    for thread_profile in PROFILES.profiles:
        stats.add(thread_profile)
    stats.sort_stats("tottime").print_stats(40)


def report(figures: list[Figure], batch: int) -> bool:
    """The table, each client's CPU as a ratio of httpx's default client on the same scheme; the target
    line. True when the target holds."""
    print(f"\n{'client':42} {'CPU ms/req':>10} {'req/s':>7} {'connections':>11} {'CPU vs httpx':>12}")
    if not figures:
        return True
    bases = {False: figures[0].cpu_ms}
    bases[True] = next((f.cpu_ms for f in figures if f.name.startswith("https ")), bases[False])
    for f in figures:
        ratio = f.cpu_ms / bases[f.name.startswith("https ")]
        print(f"{f.name:42} {f.cpu_ms:10.3f} {f.per_s:7.0f} {f.connections:11d} {ratio:12.2f}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per client, one run")
    parser.add_argument("--requests", type=int, default=3200, help="timed requests per client and run")
    parser.add_argument("--runs", type=int, default=3, help="runs per client (the least CPU is shown)")
    parser.add_argument("--batch", type=int, default=POLL_BATCH, help="a poll batch (threads at once)")
    parser.add_argument("--in-flight", type=int, default=50, help="aiohttp's requests at once")
    parser.add_argument("--latency-ms", type=float, default=20, help="the server's time to answer")
    parser.add_argument("--profile", help="profile this client (a name printed) instead of measuring all")
    parser.add_argument("--only", nargs="+", default=[], help="measure the clients whose names hold these")
    args = parser.parse_args(argv)
    requests, runs = (640, 1) if args.quick else (args.requests, args.runs)
    raise_on_sigterm()
    listed = [row for row in rows(args.in_flight) if not args.only or any(w in row.name for w in args.only)]
    with log_directory("http-clients") as log_dir, servers(log_dir, args.latency_ms) as (plain, tls):
        if args.profile:
            row = next(row for row in listed if row.name == args.profile)
            profile(row.client, tls if row.https else plain, requests, args.batch)
            return 0
        print(
            f"{requests} status reads per client and run, {runs} run(s), in batches of {args.batch} on "
            f"threads (poll_batch); the server answers after {args.latency_ms:g} ms"
        )
        measured: dict[str, list[Figure]] = {row.name: [] for row in listed}
        failed: dict[str, list[str]] = {row.name: [] for row in listed}
        for _ in range(runs):  # interleaved: a burst of load elsewhere spreads over the clients
            for row in listed:
                figure = measure(row, tls if row.https else plain, requests, args.batch)
                if isinstance(figure, Figure):
                    measured[row.name].append(figure)
                else:
                    print(f"  {row.name}: a run failed ({figure})")
                    failed[row.name].append(figure)
    # A comparison row whose every run failed has no figure (a worker's row always has one: its failure
    # ends the bench), so the rows kept are paired with their figures here, not by position.
    kept = [(row, best(measured[row.name])) for row in listed if measured[row.name]]
    figures = [figure for _, figure in kept]
    report(figures, args.batch)
    for name, errors in failed.items():
        if errors:
            print(f"{name}: {len(errors)} of {runs} runs failed (first: {errors[0]})")
    workers = [figure for row, figure in kept if row.worker]
    if not workers:
        return 0  # --only left out the adapters' rows: no target measured
    worst = max(workers, key=lambda f: f.connections)
    total = worst.requests + args.batch  # the untimed first batch opens the connections
    ok = worst.connections <= args.batch
    print(
        f"TARGET http.connections_reused: {worst.connections} connections opened for {total} status reads "
        f"in batches of {args.batch} ({worst.name}; target <= {args.batch}, one per member) -> {verdict(ok)}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
