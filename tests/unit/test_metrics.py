"""The metric families ``longcall metrics`` builds from the ledger's figures, and the request meter's hook in
the per-request budget: pure, no service."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from console.metrics import as_json, ledger_families
from ledger.metrics_reads import (
    LAG_BUCKETS_S,
    LagHistogram,
    LedgerMetrics,
    OperationCount,
    OutboxLag,
    UnknownOperations,
)
from ledger.states import OpState
from workers.budget import TokenBudget, rate_key
from workers.settings import FleetConfig

FLEET = FleetConfig.model_validate(
    {
        "servers": {
            "reports": {"protocol": "mcp", "protocol_version": "2025-11-25", "url": "http://127.0.0.1:1/mcp"},
            "exports": {"protocol": "aip151", "protocol_version": "v1", "url": "http://127.0.0.1:2"},
        }
    }
)


def figures(**overrides: object) -> LedgerMetrics:
    values: dict[str, object] = {
        "operations": (OperationCount("reports", "mcp", "ACCEPTED", 3),),
        "unknown": (UnknownOperations("reports", 1, 42.5),),
        "outbox": (OutboxLag("terminal", 2, 1.5),),
        "reconciliations": (),
        "cancel_lag": (
            LagHistogram(
                "reports", 2, 3.5, tuple((b, 2 if b >= 2.5 else 1 if b >= 1 else 0) for b in LAG_BUCKETS_S)
            ),
        ),
        "detection_lag": (),
    }
    values.update(overrides)
    return LedgerMetrics(**values)  # type: ignore[arg-type]


class Fixed(Collector):
    def __init__(self, data: LedgerMetrics) -> None:
        self.data = data

    def collect(self) -> Iterator[Metric]:
        return ledger_families(self.data, FLEET)


def scrape(data: LedgerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed(data))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_state_of_every_configured_server_is_listed_zero_included() -> None:
    samples = scrape(figures())
    operations = {k: v for k, v in samples.items() if k[0] == "longcall_operations"}
    # Two configured servers (one per protocol), every state each: an alert needs no absent().
    assert len(operations) == 2 * len(OpState)
    key = ("longcall_operations", (("protocol", "mcp"), ("server", "reports"), ("state", "ACCEPTED")))
    assert operations[key] == 3
    assert sum(operations.values()) == 3
    zero = ("longcall_operations", (("protocol", "aip151"), ("server", "exports"), ("state", "WORKING")))
    assert operations[zero] == 0


def test_a_server_known_only_to_the_ledger_is_listed_too() -> None:
    samples = scrape(figures(operations=(OperationCount("retired", "mcp", "ACCEPTED", 7),)))
    key = ("longcall_operations", (("protocol", "mcp"), ("server", "retired"), ("state", "ACCEPTED")))
    assert samples[key] == 7


def test_unknown_and_outbox_figures_with_zeros_where_there_is_nothing() -> None:
    samples = scrape(figures())
    assert samples[("longcall_unknown_operations", (("server", "reports"),))] == 1
    assert samples[("longcall_unknown_oldest_age_seconds", (("server", "reports"),))] == 42.5
    assert samples[("longcall_unknown_operations", (("server", "exports"),))] == 0
    assert samples[("longcall_outbox_ready", (("kind", "terminal"),))] == 2
    assert samples[("longcall_outbox_ready", (("kind", "input_required"),))] == 0
    assert samples[("longcall_outbox_oldest_ready_age_seconds", (("kind", "terminal"),))] == 1.5


def test_a_lag_histogram_is_cumulative_and_ends_with_its_count() -> None:
    samples = scrape(figures())
    name = "longcall_cancel_confirmation_lag_seconds"
    buckets = sorted(
        (float(dict(labels)["le"]), v) for (n, labels), v in samples.items() if n == f"{name}_bucket"
    )
    assert len(buckets) == len(LAG_BUCKETS_S) + 1
    assert buckets[-1] == (float("inf"), 2.0)
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert samples[(f"{name}_count", (("server", "reports"),))] == 2
    assert samples[(f"{name}_sum", (("server", "reports"),))] == 3.5


def test_json_has_the_same_samples_as_the_text() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed(figures()))
    from_json = {
        (s["name"], tuple(sorted(s["labels"].items()))): s["value"]
        for m in as_json(registry)["metrics"]
        for s in m["samples"]
    }
    assert from_json == scrape(figures())


def test_every_charge_is_metered_once_prepaid_ones_included() -> None:
    taken: list[bool] = []
    metered: list[int] = []

    def take(*, follow_up: bool) -> None:
        taken.append(follow_up)

    budget = TokenBudget("control", take, prepaid=1, meter=lambda: metered.append(1))
    for _ in range(3):
        budget.charge()
    assert taken == [True, True]  # the first charge used the prepaid token
    assert len(metered) == 3  # every request is counted, however its token was paid


def test_rate_keys_are_per_server_bucket_and_second() -> None:
    assert (
        rate_key("p:longcall:", "reports", "poll", 1_700_000_000)
        == "p:longcall:rate:{s:reports}:poll:1700000000"
    )
