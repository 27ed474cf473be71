"""The launch gate (``longcall gate``): the seed's rollout criteria over the live ledger and Redis.

:func:`evaluate_gate` reads one ledger snapshot (``ledger.gate_reads``) and the request meter's per-second
peaks in Redis (``workers.budget.RequestMeter``), and sets each figure against its target. Every criterion
says what it measured and how; a failing one names the operations, call nodes or servers behind it (at
most :data:`BEHIND_LIMIT`, then "and N more"). The gate passes only when every criterion does; a
criterion without the evidence it needs (no simulation run yet, Redis unreadable) does not pass either, and
says what is missing: the gate's verdict is then "missing evidence" (a fresh fleet), not "failed".

``longcall rollout --percent N`` asks the same function before raising the canary's percentage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from ledger.gate_reads import Behind, GateFigures, LagFigures, read_gate
from ledger.repository import Ledger
from workers.budget import PEAK_BUCKET_S, PEAK_KEEP_S, peak_key
from workers.hot import Budget, RedisClient, connect
from workers.settings import FleetConfig, Settings

__all__ = [
    "BEHIND_LIMIT",
    "CANCEL_P99_S",
    "UNKNOWN_P99_S",
    "Criterion",
    "GateReport",
    "evaluate_gate",
    "poll_amplification",
]

#: How many operations or servers a failing criterion names before "and N more".
BEHIND_LIMIT = 10
#: The seed's targets: a cancel confirmed within a minute, an UNKNOWN resolved within 15 minutes (p99).
CANCEL_P99_S = 60.0
UNKNOWN_P99_S = 900.0
_BUDGETS: tuple[Budget, ...] = ("poll", "control")


@dataclass(frozen=True, slots=True)
class Criterion:
    """One line of the gate: what was measured (and how), the target, the verdict, what is behind a failure
    (empty when it passes), and the evidence it lacks (``missing``: it neither passes nor fails yet, e.g. no
    simulation run on a fresh fleet; what to do is said)."""

    name: str
    measured: str
    target: str
    passed: bool
    behind: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """``pass``, ``fail``, or ``no evidence`` (not passed, and nothing measured fails it)."""
        if self.passed:
            return "pass"
        return "no evidence" if self.missing and not self.behind else "fail"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


@dataclass(frozen=True, slots=True)
class GateReport:
    criteria: list[Criterion]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.criteria)

    @property
    def failing(self) -> list[Criterion]:
        return [c for c in self.criteria if not c.passed]

    @property
    def verdict(self) -> str:
        """``passed``; ``failed`` when a criterion fails; else ``missing evidence`` (a fresh fleet: nothing
        fails, some criterion has no evidence yet). Only ``passed`` lets a rollout go on."""
        verdicts = {c.verdict for c in self.criteria}
        if "fail" in verdicts:
            return "failed"
        return "missing evidence" if "no evidence" in verdicts else "passed"

    @property
    def missing(self) -> list[str]:
        return [m for c in self.criteria for m in c.missing]

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "verdict": self.verdict,
            "criteria": [c.to_json() for c in self.criteria],
        }


def evaluate_gate(ledger: Ledger, settings: Settings, redis: RedisClient | None = None) -> GateReport:
    """The gate over ``ledger`` and Redis (``redis``, else one opened from ``settings.redis_url`` for this
    call, a cluster client with ``settings.redis_cluster``), against the servers of ``settings.fleet()``."""
    fleet = settings.fleet()
    figures = read_gate(
        ledger.engine,
        cancel_target_s=CANCEL_P99_S,
        unknown_target_s=UNKNOWN_P99_S,
        limit=BEHIND_LIMIT,
        configured_servers=sorted(fleet.servers),
    )
    client = redis
    if client is None:
        client = connect(settings.redis_url, cluster=settings.redis_cluster)
    try:
        amplification = poll_amplification(client, settings, fleet)
    finally:
        if redis is None:
            client.close()
    return GateReport(
        [
            _divergence(figures),
            _second_operations(figures),
            amplification,
            _cancel(figures.cancel),
            _unknown_age(figures.unknown),
            _unknown_overdue(figures),
            _unconfigured(figures),
            _advances(figures),
        ]
    )


def behind_list(names: Sequence[str], total: int) -> list[str]:
    """``names`` as the gate prints them: "and N more" when ``total`` is larger."""
    listed = list(names)
    if total > len(listed):
        listed.append(f"and {total - len(listed)} more")
    return listed


def _named(behind: Behind) -> list[str]:
    return behind_list(behind.names, behind.total)


def _divergence(f: GateFigures) -> Criterion:
    sim = f.simulation
    shadow = f"shadow: {f.shadow.diverged.total} of {f.shadow.compared} compared diverged"
    if f.shadow.pending:
        shadow += f" ({f.shadow.pending} waiting for both outcomes)"
    behind = _named(f.shadow.diverged)
    missing: list[str] = []
    if sim is None:
        simulated = "simulation: no simulation run yet (longcall gate simulate)"
        missing.append("no simulation run yet: run longcall gate simulate")
    else:
        simulated = (
            f"simulation #{sim.id} (seed {sim.seed}, {sim.series} series, "
            f"{sim.finished_at.isoformat(timespec='seconds')}): {sim.divergences}"
        )
        if sim.divergences:
            behind.append(f"simulation #{sim.id} (seed {sim.seed}): {sim.divergences} divergences")
    passed = sim is not None and sim.divergences == 0 and f.shadow.diverged.total == 0
    return Criterion(
        "terminal-state divergence", f"{shadow}; {simulated}", "0", passed, [] if passed else behind, missing
    )


def _second_operations(f: GateFigures) -> Criterion:
    sim = f.simulation
    measured = (
        f"ledger: {f.second_operations} in {f.operations} operations (creates sent or remote ids bound "
        "beyond one, less those undone or proved never created)"
    )
    behind = _named(f.second_operation_ops)
    sim_extra = 0
    if sim is not None:
        sim_extra = sim.second_operations
        measured += f"; simulation #{sim.id}: {sim.second_operations}"
        if sim.second_operations:
            behind.append(f"simulation #{sim.id} (seed {sim.seed}): {sim.second_operations}")
    passed = f.second_operations == 0 and sim_extra == 0
    return Criterion("second operations from duplicate submissions", measured, "0", passed, behind)


def poll_amplification(
    client: RedisClient,
    settings: Settings,
    fleet: FleetConfig,
    *,
    clock: Callable[[], float] = time.time,
) -> Criterion:
    """Each server's highest requests in any one second of the last week (the meter's hourly peaks), by
    budget class, over its budget (``poll_qps`` / ``control_qps``): the highest ratio must be at most 1."""
    prefix = f"{settings.broker_keyprefix}longcall:"
    now = int(clock())
    seconds = range(now - PEAK_KEEP_S, now + 1, PEAK_BUCKET_S)
    worst = 0.0
    parts: list[str] = []
    behind: list[str] = []
    try:
        for name, server in sorted(fleet.servers.items()):
            for budget in _BUDGETS:
                raw = client.mget([peak_key(prefix, name, budget, s) for s in seconds])
                peak = max((int(v) for v in raw if v is not None), default=0)
                qps = server.poll_qps if budget == "poll" else server.control_qps
                ratio = peak / qps
                worst = max(worst, ratio)
                parts.append(f"{name} {budget} {peak}/s of {qps:g} ({ratio:.2f})")
                if ratio > 1.0:
                    behind.append(f"{name} {budget}: {peak} requests in one second, budget {qps:g}/s")
    except redis.RedisError as exc:
        return Criterion(
            "poll amplification",
            f"Redis cannot be read ({type(exc).__name__}): no evidence",
            "<= 1.0",
            False,
            missing=[f"Redis at the configured LONGCALL_REDIS_URL cannot be read: {type(exc).__name__}"],
        )
    if not fleet.servers:
        measured = "no server configured (LONGCALL_CONFIG)"
    else:
        measured = f"max {worst:.2f} (most requests in one second, last 7 days / budget): " + "; ".join(parts)
    passed = worst <= 1.0
    return Criterion("poll amplification", measured, "<= 1.0", passed, [] if passed else behind)


def _p99(lags: LagFigures) -> str:
    if lags.p99_s is None:
        return "none yet"
    return f"{lags.p99_s:.1f} s over {lags.count}" + (f" ({lags.open} still open)" if lags.open else "")


def _cancel(lags: LagFigures) -> Criterion:
    passed = lags.p99_s is None or lags.p99_s < CANCEL_P99_S
    return Criterion(
        "cancel confirmation p99",
        f"{_p99(lags)} (first cancel request to the receipt; open ones by age)",
        f"< {CANCEL_P99_S:g} s",
        passed,
        [] if passed else _named(lags.over),
    )


def _unknown_age(lags: LagFigures) -> Criterion:
    passed = lags.p99_s is None or lags.p99_s < UNKNOWN_P99_S
    return Criterion(
        "UNKNOWN reconciliation age p99",
        f"{_p99(lags)} (records opened to resolved; SUBMISSION_UNKNOWN ended without an operator, in to out; "
        "open ones by age)",
        f"< {UNKNOWN_P99_S / 60:g} min",
        passed,
        [] if passed else _named(lags.over),
    )


def _unknown_overdue(f: GateFigures) -> Criterion:
    passed = f.overdue.total == 0
    return Criterion(
        "UNKNOWN past its deadline",
        f"{f.overdue.total} open reconciliation records past their deadline",
        "none",
        passed,
        [] if passed else _named(f.overdue),
    )


def _advances(f: GateFigures) -> Criterion:
    sim = f.simulation
    traceable = f.advances - f.untraceable.total
    if f.advances:
        measured = f"{100.0 * traceable / f.advances:.1f} % ({traceable} of {f.advances} dispatched advances)"
    else:
        measured = "100 % (no downstream advance dispatched yet)"
    behind = _named(f.untraceable)
    sim_bad = 0
    if sim is not None:
        sim_bad = sim.advances_without_receipt + sim.late_completions_advanced
        measured += (
            f"; simulation #{sim.id}: {sim.advances_without_receipt} without a receipt, "
            f"{sim.late_completions_advanced} late completions advanced"
        )
        if sim_bad:
            behind.append(f"simulation #{sim.id} (seed {sim.seed}): {sim_bad} advances without their receipt")
    passed = f.untraceable.total == 0 and sim_bad == 0
    return Criterion("downstream advances traceable to a terminal receipt", measured, "100 %", passed, behind)


def _unconfigured(f: GateFigures) -> Criterion:
    """Rule 14: no operation is left on a server the configuration no longer names."""
    passed = f.unconfigured_operations == 0
    measured = (
        f"{f.unconfigured_operations} operations in flight on {f.unconfigured.total} servers "
        "LONGCALL_CONFIG does not name"
    )
    return Criterion(
        "operations on unconfigured servers",
        measured,
        "none",
        passed,
        [] if passed else _named(f.unconfigured),
    )
