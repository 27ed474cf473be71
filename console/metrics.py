"""``longcall metrics``: the fleet's figures for Prometheus, read from the ledger and Redis at scrape time.

The collector keeps no state: every scrape reads the ledger (``ledger.metrics_reads``, one snapshot) and
Redis (the per-second request counters of ``workers.budget.RequestMeter``, the broker's queue lengths), so
any number of ``longcall metrics`` processes give the same answer, and a restart loses nothing.

Names follow the Celery exporters' conventions (``celery_task_*``, labels ``name`` and ``queue_name``)
under the ``longcall_`` prefix: seconds in ``_seconds``, gauges without a ``_total``. A source that cannot
be read makes ``longcall_ledger_up`` or ``longcall_redis_up`` 0 and leaves its metrics out, never a
failed scrape.
"""

from __future__ import annotations

import collections
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import click
import redis
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from ledger.engine import make_engine
from ledger.metrics_reads import LagHistogram, LedgerMetrics, read_metrics
from ledger.states import FINAL_STATES, OpState, TerminalKind
from workers.app import QUEUES, is_redis
from workers.budget import rate_key
from workers.errors import ConfigError
from workers.hot import Budget, RedisClient, connect
from workers.request_outcomes import OUTCOMES, requests_key
from workers.settings import FleetConfig, OAuthClientCredentialsAuth, Settings, load_settings

__all__ = ["RATE_WINDOW_S", "LongcallCollector", "metrics", "registry_for"]

log = logging.getLogger(__name__)

#: How many whole seconds back the request rates look (the counters are kept RATE_KEEP_S seconds).
RATE_WINDOW_S = 10
#: kombu's Redis transport keeps a queue's priorities 3, 6 and 9 in keys of their own beside the queue's.
_PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")
_BUDGETS: tuple[Budget, ...] = ("poll", "control")


@dataclass(frozen=True, eq=False)  # eq=False: a registry keeps its collectors by identity (hashed)
class LongcallCollector(Collector):
    """Reads the ledger and Redis on every ``collect``; holds only its connection pools."""

    settings: Settings
    fleet: FleetConfig
    engine: Engine
    #: longcall's Redis (``LONGCALL_REDIS_URL``; a cluster client with ``LONGCALL_REDIS_CLUSTER``).
    client: RedisClient
    _: KW_ONLY
    #: The Redis broker, when it is another Redis than ``client``'s (its queue lengths are read there).
    broker: redis.Redis | None = None
    clock: Callable[[], float] = time.time

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        yield from self._ledger()
        yield from self._redis()

    # ------------------------------------------------------------------------------------------ ledger

    def _ledger(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("longcall_ledger_up", "1 when this scrape could read the ledger, else 0")
        try:
            figures = read_metrics(self.engine)
        except SQLAlchemyError as exc:
            log.warning("longcall metrics: the ledger cannot be read: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from ledger_families(figures, self.fleet)

    # ------------------------------------------------------------------------------------------- redis

    def _redis(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("longcall_redis_up", "1 when this scrape could read Redis, else 0")
        try:
            families = list(self._redis_families())
        except redis.RedisError as exc:
            log.warning("longcall metrics: Redis cannot be read: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _redis_families(self) -> Iterator[Metric]:
        labels = ["server", "class"]
        rate = GaugeMetricFamily(
            "longcall_server_requests_per_second",
            f"HTTP requests sent to the server per second, averaged over the last {RATE_WINDOW_S} whole "
            "seconds, by budget class (poll or control)",
            labels=labels,
        )
        peak = GaugeMetricFamily(
            "longcall_server_requests_max_per_second",
            f"The most HTTP requests sent to the server in any one second of the last {RATE_WINDOW_S} "
            "whole seconds, by budget class (never above its QPS: rule 4)",
            labels=labels,
        )
        limit = GaugeMetricFamily(
            "longcall_server_qps_limit",
            "The server's configured budget: poll_qps for class poll, control_qps for class control",
            labels=labels,
        )
        prefix = f"{self.settings.broker_keyprefix}longcall:"
        now = int(self.clock())
        seconds = range(now - RATE_WINDOW_S, now)
        for name, server in sorted(self.fleet.servers.items()):
            for budget in _BUDGETS:
                raw = self.client.mget([rate_key(prefix, name, budget, s) for s in seconds])
                counts = [int(v) if v is not None else 0 for v in raw]
                rate.add_metric([name, budget], sum(counts) / RATE_WINDOW_S)
                peak.add_metric([name, budget], max(counts))
                limit.add_metric([name, budget], server.poll_qps if budget == "poll" else server.control_qps)
        yield rate
        yield peak
        yield limit
        yield from self._request_counters(prefix)
        if is_redis(self.settings.broker):
            queues = GaugeMetricFamily(
                "longcall_queue_length",
                "Messages waiting in the longcall queue on the Redis broker",
                labels=["queue_name"],
            )
            broker = self.broker or self.client
            for queue in QUEUES:
                pipe = broker.pipeline(transaction=False)
                for suffix in _PRIORITY_SUFFIXES:
                    pipe.llen(f"{self.settings.broker_keyprefix}{queue}{suffix}")
                queues.add_metric([queue], sum(int(n) for n in pipe.execute()))
            yield queues

    def _request_counters(self, prefix: str) -> Iterator[Metric]:
        """``longcall_requests_total`` and ``longcall_polls_total``: the workers' counts of every request they
        sent (``workers.request_outcomes``: added to Redis every few seconds)."""
        requests = CounterMetricFamily(
            "longcall_requests",
            "HTTP requests the workers sent, by server, budget (poll, control; none: no budget paid for"
            " it) and outcome (ok, rate_limited, client_error, server_error, no_answer)",
            labels=["server", "budget", "outcome"],
        )
        polls = CounterMetricFamily(
            "longcall_polls",
            "Status reads sent on the poll budget, whatever their outcome",
            labels=["server"],
        )
        tokens = CounterMetricFamily(
            "longcall_token_requests",
            "Requests to the servers' OAuth token endpoints (not the servers' traffic: no budget pays for"
            " them) by outcome (ok; client_error: the client refused; server_error, no_answer: it is down)",
            labels=["server", "outcome"],
        )
        for name in sorted(self.fleet.servers):
            counted = {
                (k.decode() if isinstance(k, bytes) else str(k)): int(v)
                for k, v in dict(self.client.hgetall(requests_key(prefix, name))).items()
            }
            for budget in (*_BUDGETS, "none"):
                for outcome in OUTCOMES:
                    requests.add_metric([name, budget, outcome], counted.get(f"{budget}:{outcome}", 0))
            polls.add_metric([name], sum(counted.get(f"poll:{outcome}", 0) for outcome in OUTCOMES))
            if isinstance(self.fleet.servers[name].auth, OAuthClientCredentialsAuth):
                for outcome in OUTCOMES:
                    tokens.add_metric([name, outcome], counted.get(f"token:{outcome}", 0))
        yield requests
        yield polls
        yield tokens


def ledger_families(figures: LedgerMetrics, fleet: FleetConfig) -> Iterator[Metric]:
    """The ledger's figures as metric families. Every state of every (server, protocol) seen in the ledger
    or the config is listed, 0 included, so an alert on a state needs no ``absent()``."""
    operations = GaugeMetricFamily(
        "longcall_operations",
        "Operations in the ledger by local state, protocol and server",
        labels=["state", "protocol", "server"],
    )
    counts = {(c.server, c.protocol, c.state): c.count for c in figures.operations}
    pairs = {(server, protocol) for server, protocol, _ in counts}
    pairs |= {(name, s.protocol) for name, s in fleet.servers.items()}
    for server, protocol in sorted(pairs):
        for state in OpState:
            operations.add_metric(
                [state.value, protocol, server], counts.get((server, protocol, state.value), 0)
            )
    yield operations

    unknown = GaugeMetricFamily(
        "longcall_unknown_operations",
        "Operations whose outcome no rule has decided: SUBMISSION_UNKNOWN or MANUAL_RECONCILIATION",
        labels=["server"],
    )
    oldest = GaugeMetricFamily(
        "longcall_unknown_oldest_age_seconds",
        "How long the oldest UNKNOWN operation has been in its state (0 when there is none)",
        labels=["server"],
    )
    found = {u.server: u for u in figures.unknown}
    for server in sorted(set(found) | set(fleet.servers)):
        u = found.get(server)
        unknown.add_metric([server], u.count if u else 0)
        oldest.add_metric([server], u.oldest_age_s if u else 0.0)
    yield unknown
    yield oldest

    # Rule 14: a server removed from (or renamed in) the configuration while operations are in flight on it.
    in_flight: collections.Counter[str] = collections.Counter()
    for c in figures.operations:
        if OpState(c.state) not in FINAL_STATES:
            in_flight[c.server] += c.count
    unconfigured = GaugeMetricFamily(
        "longcall_unconfigured_server_operations",
        "Operations not final on a server LONGCALL_CONFIG does not name (removed or renamed): each goes to "
        "an operator (SERVER_UNCONFIGURED); 0 for every configured server",
        labels=["server"],
    )
    for server in sorted(set(in_flight) | set(fleet.servers)):
        unconfigured.add_metric([server], 0 if server in fleet.servers else in_flight[server])
    yield unconfigured

    ready = GaugeMetricFamily(
        "longcall_outbox_ready", "Outbox rows not yet dispatched, by kind", labels=["kind"]
    )
    ready_age = GaugeMetricFamily(
        "longcall_outbox_oldest_ready_age_seconds",
        "Age of the oldest outbox row not yet dispatched, by kind (0 when there is none)",
        labels=["kind"],
    )
    lags = {o.kind: o for o in figures.outbox}
    for kind in ("input_required", "terminal"):
        o = lags.get(kind)
        ready.add_metric([kind], o.ready if o else 0)
        ready_age.add_metric([kind], o.oldest_age_s if o else 0.0)
    yield ready
    yield ready_age

    dead = GaugeMetricFamily(
        "longcall_outbox_dead_rows",
        "Outbox rows dead-lettered, by kind: not published after LONGCALL_OUTBOX_MAX_ATTEMPTS failed "
        "attempts, each with an OUTBOX_UNDELIVERABLE record (longcall reconcile --resend OUTBOX_ID sends one "
        "again)",
        labels=["kind"],
    )
    dead_counts = {d.kind: d.dead for d in figures.outbox_dead}
    for kind in ("input_required", "terminal"):
        dead.add_metric([kind], dead_counts.get(kind, 0))
    yield dead

    records = GaugeMetricFamily(
        "longcall_reconciliations_open", "Open reconciliation records, by reason", labels=["reason"]
    )
    overdue = GaugeMetricFamily(
        "longcall_reconciliations_overdue",
        "Open reconciliation records past their deadline, by reason",
        labels=["reason"],
    )
    for r in figures.reconciliations:
        records.add_metric([r.reason], r.open)
        overdue.add_metric([r.reason], r.overdue)
    yield records
    yield overdue

    yield from counter_families(figures, pairs)

    yield _histogram(
        "longcall_operation_duration_seconds",
        "From an operation's submission to its receipt",
        figures.duration,
    )

    yield _histogram(
        "longcall_cancel_confirmation_lag_seconds",
        "From an operation's first cancel request to its cancelled receipt",
        figures.cancel_lag,
    )
    yield _histogram(
        "longcall_terminal_detection_lag_seconds",
        "From the last moment the ledger knew an operation open to the poll that saw it ended (an upper "
        "bound of how late the end was detected)",
        figures.detection_lag,
    )


def counter_families(figures: LedgerMetrics, pairs: Iterable[tuple[str, str]]) -> Iterator[Metric]:
    """The ledger's counters (what it keeps for good: receipts, operation rows, reconciliation records), each
    (server, protocol) of ``pairs`` listed, 0 included."""
    pairs = sorted(pairs)
    receipts = CounterMetricFamily(
        "longcall_receipts",
        "Terminal receipts accepted, by terminal state (completed, failed, cancelled), server and protocol",
        labels=["terminal_state", "server", "protocol"],
    )
    accepted = {(r.server, r.protocol, r.terminal_state): r.count for r in figures.receipts}
    for server, protocol in pairs:
        for kind in TerminalKind:
            receipts.add_metric(
                [kind.value, server, protocol], accepted.get((server, protocol, kind.value), 0)
            )
    yield receipts

    creates = CounterMetricFamily(
        "longcall_creates",
        "Operations a create call was made for (each once: never a second create), by server and protocol",
        labels=["server", "protocol"],
    )
    made = {(c.server, c.protocol): c.count for c in figures.creates}
    for server, protocol in pairs:
        creates.add_metric([server, protocol], made.get((server, protocol), 0))
    yield creates

    yield CounterMetricFamily(
        "longcall_outbox_dead",
        "Outbox rows dead-lettered so far (each with an OUTBOX_UNDELIVERABLE record)",
        value=figures.outbox_dead_total,
    )


def _histogram(name: str, documentation: str, histograms: Iterable[LagHistogram]) -> Metric:
    family = HistogramMetricFamily(name, documentation, labels=["server"])
    for h in histograms:
        buckets: list[tuple[str, float]] = [(_le(bound), n) for bound, n in h.buckets]
        buckets.append(("+Inf", h.count))
        family.add_metric([h.server], buckets, h.sum_s)
    return family


def _le(bound: float) -> str:
    return repr(float(bound))


def registry_for(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def as_json(registry: CollectorRegistry) -> dict[str, Any]:
    """The same values as the exposition text: one entry per metric family, its samples with labels."""
    families = [
        {
            "name": family.name,
            "type": family.type,
            "help": family.documentation,
            "samples": [{"name": s.name, "labels": dict(s.labels), "value": s.value} for s in family.samples],
        }
        for family in registry.collect()
    ]
    return {"metrics": families}


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        return


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(1, 65535), default=9808, show_default=True, help="Port to listen on."
)
@click.option("--once", is_flag=True, help="Print the metrics once to stdout and exit (no server).")
@click.option("--json", "as_json_flag", is_flag=True, help="With --once: the same values as JSON.")
def metrics(host: str, port: int, once: bool, as_json_flag: bool) -> None:
    """Serve Prometheus metrics read from the ledger and Redis at each scrape (GET /metrics)."""
    if as_json_flag and not once:
        raise click.UsageError("--json goes with --once (the server always answers the exposition text)")
    try:
        settings = load_settings()
        fleet = settings.fleet()
        engine = make_engine(settings.database_url, pool_size=1, connect_timeout_s=5)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    client = connect(settings.redis_url, cluster=settings.redis_cluster)
    broker = None
    if is_redis(settings.broker) and settings.broker != settings.redis_url:
        broker = redis.Redis.from_url(settings.broker, socket_timeout=5, socket_connect_timeout=5)
    registry = registry_for(LongcallCollector(settings, fleet, engine, client, broker=broker))
    try:
        if once:
            if as_json_flag:
                click.echo(json.dumps(as_json(registry), indent=2))
            else:
                sys.stdout.write(generate_latest(registry).decode("utf-8"))
            return
        _serve(registry, host, port)
    finally:
        engine.dispose()
        client.close()
        if broker is not None:
            broker.close()


def _serve(registry: CollectorRegistry, host: str, port: int) -> None:
    try:
        server: WSGIServer = make_server(host, port, make_wsgi_app(registry), handler_class=_QuietHandler)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    click.echo(f"longcall metrics: serving http://{host}:{port}/metrics", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
