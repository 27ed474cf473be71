"""The driver: each series through the real executor entry points (no Celery), one step per tick, against
the real ledger and Redis, its server scripted at the wire; then the checks against the oracle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx2

from adapters import AdapterConfig, ToolAdapter, ToolRoute, default_registry
from console.simulation.oracle import Expected, expect
from console.simulation.series import MAX_TICKS, PROTOCOLS, Protocol, Series, generate
from console.simulation.servers import (
    AIP_CREATE,
    AIP_REQUEST_ID,
    AIP_TOOL,
    MCP_TOOL,
    AipServer,
    McpServer,
    ScriptedServer,
    SimulatedCrash,
)
from console.simulation.servers_ext import ANSWER, McpExtServer
from ledger import simulation_runs as runs
from ledger.digests import digest
from ledger.records import Acceptance, NewOperation, OutboxMessage, TerminalEvidence
from ledger.repository import Ledger
from ledger.states import FINAL_STATES, OpState, TerminalKind
from workers import logs
from workers.errors import InputRefused
from workers.executor import Executor
from workers.hot import HotState
from workers.remote import RemotePool
from workers.runtime import Runtime
from workers.settings import FleetConfig, Settings
from workers.steps.dispatch import TASK_FOR_STATE
from workers.steps.result import accept

S = OpState
TOOL_OF: dict[str, str] = {"mcp": MCP_TOOL, "aip151": AIP_TOOL, "mcp-ext": MCP_TOOL}
PROTOCOL_OF: dict[str, str] = {"mcp": "mcp", "aip151": "aip151", "mcp-ext": "mcp"}
VERSION_OF: dict[str, str] = {"mcp": "2025-11-25", "aip151": "v1", "mcp-ext": "2026-07-28"}
#: High enough that no step ever waits for a token (the simulation's time is its tick clock).
QPS = 1_000_000.0


def sim_fleet(name: str, protocol: str) -> FleetConfig:
    """A fleet of one server, the series' own: its budgets and its hold (a Retry-After) are the series'."""
    if protocol == "mcp":
        server: dict[str, Any] = {
            "protocol": "mcp",
            "protocol_version": "2025-11-25",
            "url": "http://sim-mcp.invalid/mcp",
        }
    else:
        server = {
            "protocol": "aip151",
            "protocol_version": "v1",
            "url": "http://sim-aip.invalid",
            "tools": {AIP_TOOL: {"create": AIP_CREATE, "request_id_field": AIP_REQUEST_ID}},
        }
    return FleetConfig.model_validate({"servers": {name: {**server, "poll_qps": QPS, "control_qps": QPS}}})


def scripted_server(series: Series, tag: str) -> ScriptedServer:
    """The scripted server that speaks ``series``' protocol (``servers`` holds the MCP and AIP-151 ones,
    ``servers_ext`` the MCP tasks extension's, built on the same :class:`ScriptedServer`)."""
    if series.protocol == "mcp-ext":
        return McpExtServer(series, tag)
    return McpServer(series, tag) if series.protocol == "mcp" else AipServer(series, tag)


class ScriptedPool(RemotePool):
    """The real adapters, each on an httpx2 client whose transport is this series' scripted server."""

    def __init__(self, fleet: FleetConfig, server: ScriptedServer) -> None:
        super().__init__(fleet)
        self._scripted = server
        self._built: dict[str, ToolAdapter] = {}

    def adapter(
        self, name: str, *, protocol: str | None = None, protocol_version: str | None = None
    ) -> ToolAdapter:
        if name not in self._built:
            server = self.server(name)
            config = AdapterConfig(
                name=name,
                url=server.url,
                protocol=protocol or server.protocol,
                protocol_version=protocol_version or server.protocol_version,
                tools={
                    t: ToolRoute(create=c.create, request_id_field=c.request_id_field)
                    for t, c in server.tools.items()
                },
            )
            client = httpx2.Client(transport=httpx2.MockTransport(self._scripted))
            self._clients.append(client)
            self._built[name] = default_registry().build(config, client)
        return self._built[name]


class OldEpochFirst(Ledger):
    """A series' ledger when it has an old-epoch callback (``old_epoch_tick``): just before the first
    acceptance its executor asks for at or after that tick, the same terminal evidence from the previous
    execution epoch (a step a rollback or a take-over fenced, arriving late), carrying that old step's own
    result, is offered first. It must change nothing: the operation, its receipts and its deliveries stay
    as they were, and the current step's acceptance goes on as without it."""

    def __init__(self, ledger: Ledger, server: ScriptedServer, tick: int, call_node_id: str) -> None:
        super().__init__(ledger.engine)
        self.reconcile_deadline = ledger.reconcile_deadline
        self._server = server
        self._tick = tick
        self._node = call_node_id
        #: The acceptance's outcome for the old-epoch evidence, once offered.
        self.offered: str | None = None
        self.problems: list[str] = []

    def accept_terminal(self, op_id: uuid.UUID, evidence: TerminalEvidence) -> Acceptance:
        if self.offered is None and self._server.tick >= self._tick:
            old_result = None if evidence.result is None else {"old_epoch": True, "node": self._node}
            old = dataclasses.replace(
                evidence,
                execution_epoch=evidence.execution_epoch - 1,
                result=old_result,
                result_digest=None if old_result is None else digest(old_result),
            )
            before = runs.series_facts(self, op_id, self._node)
            offered = super().accept_terminal(op_id, old)
            after = runs.series_facts(self, op_id, self._node)
            self.offered = offered.outcome
            if offered.accepted or after != before:
                self.problems.append(
                    f"an old-epoch callback changed the operation: {offered.outcome}, {before.state} -> "
                    f"{after.state}, receipts {len(before.receipts)} -> {len(after.receipts)}"
                )
        return super().accept_terminal(op_id, evidence)


@dataclass
class SeriesResult:
    series: Series
    expected: Expected
    outcome: str
    tasks: int
    receipts: int
    advances_without_receipt: int
    late_completions_advanced: int
    problems: list[str] = field(default_factory=list)
    #: The acceptance point's answer to the series' old-epoch callback (None: none was offered).
    old_epoch: str | None = None

    @property
    def second_operations(self) -> int:
        return max(0, self.tasks - 1)

    @property
    def passed(self) -> bool:
        return not self.problems

    def failure(self) -> dict[str, Any]:
        return {
            "seed": self.series.seed,
            "index": self.series.index,
            "protocol": self.series.protocol,
            "expected": self.expected.outcome,
            "why": self.expected.why,
            "outcome": self.outcome,
            "problems": self.problems,
            "series": self.series.to_json(),
        }


class Simulation:
    """One ledger and one Redis for a run; each series gets its scripted server and a fresh runtime."""

    def __init__(self, settings: Settings, ledger: Ledger, hot: HotState) -> None:
        self.settings = settings
        self.ledger = ledger
        self.hot = hot
        #: Call node ids and remote ids of this run (a scratch database keeps earlier runs' rows).
        self.tag = uuid.uuid4().hex[:10]

    def run_series(self, series: Series) -> SeriesResult:
        with logs.bind():  # the steps note their operation: nothing stays bound after the series
            return self._run_series(series)

    def _run_series(self, series: Series) -> SeriesResult:
        server = scripted_server(series, self.tag)
        fleet = sim_fleet(self.server_name(series), series.protocol)
        ledger = self.ledger
        if series.old_epoch_tick is not None:
            ledger = OldEpochFirst(self.ledger, server, series.old_epoch_tick, self.call_node_id(series))
        runtime = Runtime(settings=self.settings, fleet=fleet, _ledger=ledger, _hot=self.hot)
        runtime._remote = ScriptedPool(fleet, server)
        executor = Executor(runtime, jitter=lambda _interval: 0.0)
        delivered: list[OutboxMessage] = []
        notes: list[str] = []
        try:
            op_id = self._drive(series, server, executor, delivered, notes)
        finally:
            runtime._remote.close()
        result = self._check(series, server, executor, op_id, delivered)
        result.problems.extend(notes)
        if isinstance(ledger, OldEpochFirst):
            result.old_epoch = ledger.offered
            result.problems.extend(ledger.problems)
        return result

    def server_name(self, series: Series) -> str:
        return f"sim-{series.protocol}-{self.tag}-{series.index}"

    def call_node_id(self, series: Series) -> str:
        return f"sim/{self.tag}/{series.seed}/{series.index}"

    # ------------------------------------------------------------------------------------- the driver

    def _new(self, series: Series) -> NewOperation:
        body = {"n": series.index}
        return NewOperation(
            call_node_id=self.call_node_id(series),
            request_digest=digest({"tool": TOOL_OF[series.protocol], "arguments": body}),
            server=self.server_name(series),
            protocol=PROTOCOL_OF[series.protocol],
            protocol_version=VERSION_OF[series.protocol],
            adapter_version="sim",
            tool_name=TOOL_OF[series.protocol],
            body=body,
            on_terminal={"task": "sim.downstream", "args": [], "kwargs": {}, "options": {}},
        )

    def _drive(
        self,
        series: Series,
        server: ScriptedServer,
        executor: Executor,
        delivered: list[OutboxMessage],
        notes: list[str],
    ) -> uuid.UUID:
        new = self._new(series)
        server.tick = 0
        if series.cancel_tick == -1:
            op_id = self.ledger.record_submission(new).operation.id  # queued, no worker has it yet
            executor.request_cancel(op_id)
        else:
            submitted: list[uuid.UUID] = []
            self._step(executor, lambda: submitted.append(executor.submit(new)[0].operation.id))
            if not submitted:  # the worker died in the create call: the row is read back as the caller would
                found = self.ledger.find_by_call_node(new.call_node_id)
                if found is None:
                    raise RuntimeError(f"the submission of {new.call_node_id} left no operation row")
                submitted.append(found.id)
            op_id = submitted[0]
        last: Callable[[], object] | None = None
        settled = False
        actions_until = max(series.cancel_tick or 0, *(series.duplicate_ticks or (0,)))
        for tick in range(MAX_TICKS):
            server.tick = tick
            self._run_out_hold(series, server)
            for _ in range(series.duplicate_ticks.count(tick)):
                self.ledger.record_submission(new)  # a second row would fail the check of rows per call node
            if tick == series.cancel_tick:
                self._step(executor, lambda: executor.request_cancel(op_id))
            if tick > 0:
                # The dispatcher's claim, as dispatch_due makes it (every tick: the clock is the series').
                claim = self.ledger.claim(op_id, lease_s=self.settings.lease_s)
                if claim is None:
                    runs.run_out_lease(self.ledger, op_id)  # a crashed worker's lease ran out
                    claim = self.ledger.claim(op_id, lease_s=self.settings.lease_s)
                if claim is None:
                    raise RuntimeError(f"operation {op_id} cannot be claimed after its lease ran out")
                settled = claim.state in FINAL_STATES or claim.state is S.MANUAL_RECONCILIATION
                if claim.state in TASK_FOR_STATE:
                    last = _entry(executor, TASK_FOR_STATE[claim.state], op_id, claim.poll_cursor)
                    self._step(executor, last)
                elif claim.state is S.INPUT_REQUIRED:
                    notes.extend(answer_round(executor, op_id))
            if last is not None and tick in series.redeliver_ticks:
                self._step(executor, last)  # the same message delivered again (same cursor)
            if settled and tick >= actions_until:
                break
        self.ledger.drain_outbox(delivered.append)
        if series.late_offer:
            op = self.ledger.get(op_id)
            # An old step's late completion at the acceptance point: it must never advance.
            accept(executor.ctx, op, TerminalKind.COMPLETED, {"late": True, "index": series.index})
            self.ledger.drain_outbox(delivered.append)
        return op_id

    def _run_out_hold(self, series: Series, server: ScriptedServer) -> None:
        """The series' clock moved on one tick: a wait its server asked for (Retry-After, held fleet-wide in
        Redis time) has run out, as the executor's ledger schedule already assumes (never sooner than it).
        Only a server that asked for a wait since the last tick can have a hold to run out."""
        if not server.asked_wait:
            return
        server.asked_wait = False
        self.hot.client.delete(self.hot.hold_key(self.server_name(series)))

    @staticmethod
    def _step(executor: Executor, call: Callable[[], object]) -> None:
        # A worker that died: its lease runs out and the dispatcher hands the row to another.
        with contextlib.suppress(SimulatedCrash):
            call()

    # ------------------------------------------------------------------------------------- the checks

    def _check(
        self,
        series: Series,
        server: ScriptedServer,
        executor: Executor,
        op_id: uuid.UUID,
        delivered: list[OutboxMessage],
    ) -> SeriesResult:
        expected = expect(series)
        facts = runs.series_facts(self.ledger, op_id, self.call_node_id(series))
        receipts = facts.receipts
        if receipts:
            outcome = str(receipts[0]["terminal_state"])
        elif facts.state == S.MANUAL_RECONCILIATION.value:
            outcome = "manual"
        else:
            outcome = f"stalled in {facts.state}"
        receipt_ids = {str(r["id"]) for r in receipts}
        without = 0
        late = 0
        for delivery in facts.deliveries:
            named = {str(delivery.get("receipt_id")), str(delivery.get("row_receipt_id"))}
            if not named <= receipt_ids:
                without += 1
            if facts.cancel_accepted and delivery.get("terminal_state") != "cancelled":
                late += 1
        problems: list[str] = []
        if outcome != expected.outcome:
            problems.append(f"terminal-state divergence: {outcome}, the oracle says {expected.outcome}")
        if server.truth.tasks > 1:
            problems.append(f"{server.truth.tasks} operations on the server for one call node")
        elif server.truth.tasks != expected.tasks:
            problems.append(
                f"{server.truth.tasks} operations on the server, the oracle says {expected.tasks}"
            )
        if len(receipts) > 1:
            problems.append(f"{len(receipts)} receipts for one call node")
        if without:
            problems.append(f"{without} downstream advances without a receipt")
        if late:
            problems.append(f"{late} late completions advanced after an accepted cancel")
        if isinstance(server, McpExtServer) and server.updates != int(series.ask_input):
            problems.append(
                f"{server.updates} input replies reached the server, {int(series.ask_input)} asked"
            )
        if facts.operations != 1:
            problems.append("more than one operation row for the call node")
        del executor
        return SeriesResult(
            series, expected, outcome, server.truth.tasks, len(receipts), without, late, problems
        )


#: Another answer to a round already answered: a replay of the round, refused (rule 10).
OTHER_ANSWER = {"confirm": {"action": "decline"}}


def answer_round(executor: Executor, op_id: uuid.UUID) -> list[str]:
    """The approval gate answers the current round; the same answer again (a redelivered message) is a
    repeat that sends nothing; another answer to that round is refused."""
    op = executor.ledger.get(op_id)
    round_no = op.input_round
    executor.provide_input(op_id, round_no, ANSWER)
    problems: list[str] = []
    repeat = executor.provide_input(op_id, round_no, ANSWER)
    if repeat.action != "input_recorded" or not repeat.detail.get("repeat"):
        problems.append(f"the repeat of the answer to round {round_no} was taken as {repeat.action}")
    try:
        executor.provide_input(op_id, round_no, OTHER_ANSWER)
    except InputRefused:
        return problems
    return [*problems, f"another answer to the answered input round {round_no} was accepted"]


def _entry(executor: Executor, task: str, op_id: uuid.UUID, cursor: int) -> Callable[[], object]:
    if task == "longcall.poll":
        return lambda: executor.advance(op_id, cursor)
    if task == "longcall.fetch_result":
        return lambda: executor.fetch_result(op_id, cursor)
    if task == "longcall.cancel":
        return lambda: executor.send_cancel(op_id, cursor)
    raise AssertionError(task)


@dataclass
class Report:
    seed: int
    series: int
    protocols: tuple[str, ...]
    seconds: float
    results: list[SeriesResult]

    @property
    def divergences(self) -> int:
        return sum(
            1
            for r in self.results
            if any(p.startswith("terminal-state") or "oracle says" in p for p in r.problems)
        )

    @property
    def second_operations(self) -> int:
        return sum(r.second_operations for r in self.results)

    @property
    def max_receipts_per_call_node(self) -> int:
        return max((r.receipts for r in self.results), default=0)

    @property
    def advances_without_receipt(self) -> int:
        return sum(r.advances_without_receipt for r in self.results)

    @property
    def late_completions_advanced(self) -> int:
        return sum(r.late_completions_advanced for r in self.results)

    @property
    def series_per_s(self) -> float:
        return len(self.results) / self.seconds if self.seconds > 0 else 0.0

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [r.failure() for r in self.results if not r.passed]

    @property
    def passed(self) -> bool:
        return not self.failures and self.max_receipts_per_call_node <= 1

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "series_run": len(self.results),
            "protocols": list(self.protocols),
            "terminal_state_divergences": self.divergences,
            "second_operations_from_duplicate_submissions": self.second_operations,
            "max_receipts_per_call_node": self.max_receipts_per_call_node,
            "downstream_advances_without_receipt": self.advances_without_receipt,
            "late_completions_after_accepted_cancel_advanced": self.late_completions_advanced,
            "series_per_s": round(self.series_per_s, 2),
            "seconds": round(self.seconds, 2),
            "failures": self.failures,
            "passed": self.passed,
        }


def run(
    simulation: Simulation,
    *,
    seed: int,
    indexes: Iterable[int],
    protocols: tuple[Protocol, ...] = PROTOCOLS,
    progress: Callable[[SeriesResult], None] | None = None,
) -> Report:
    started = time.monotonic()
    results: list[SeriesResult] = []
    for index in indexes:
        result = simulation.run_series(generate(seed, index, protocols))
        results.append(result)
        if progress is not None:
            progress(result)
    return Report(seed, len(results), protocols, time.monotonic() - started, results)
