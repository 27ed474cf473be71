"""The demo of ``longcall dev``: a dozen report calls submitted through the broker as a pipeline would.

Eight reports of different lengths and one that fails; one cancelled mid-run; one that asks for approval
(answered at the terminal, or at once with ``--yes``); one whose create answer the demo server loses (its
``lose_create_response`` switch). That one is never called again: MCP 2025-11-25 cannot look a task up by
key, so it waits for an operator, who finds the task on the server and says so (``longcall reconcile OP
--found TASK``); the demo plays the operator (asking first without ``--yes``) and then shows that the server
holds exactly one task for that call. Everything shown comes from the ledger.

A question waits at the terminal without stopping anything: the table stays live below it, the other calls
go on, and the answer (``y``, ``n`` or Enter) is read a key at a time (:mod:`console.dev.questions`).
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx2
from celery import Celery
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from console.dev.display import FINAL, ProgressRow, ReceiptRow, progress_table
from console.dev.fleet import LocalFleet, longcall_argv
from console.dev.questions import Asker, Question
from console.dev.services import DevError
from ledger.records import Operation
from ledger.repository import Ledger
from ledger.states import OpState

Role = Literal["report", "fails", "cancel", "input", "lost"]
DEMO_TIMEOUT_S = 180.0
CANCEL_AFTER_S = 3.0
TICK_S = 0.5


@dataclass(frozen=True)
class DemoCall:
    name: str
    tool: str
    arguments: dict[str, Any]
    role: Role
    what: str


def plan() -> list[DemoCall]:
    reports = [
        DemoCall(f"report-{n:02d}", "slow_report", {"seconds": s}, "report", f"report {s}s")
        for n, s in enumerate((2, 3, 4, 5, 6, 8, 10, 12), start=1)
    ]
    return [
        DemoCall("lost-create", "slow_report", {"seconds": 4.5}, "lost", "report 4.5s, answer lost"),
        *reports,
        DemoCall("report-fails", "slow_report", {"seconds": 3, "fail": True}, "fails", "report 3s, fails"),
        DemoCall("cancel-me", "slow_report", {"seconds": 120}, "cancel", "report 120s, cancel"),
        DemoCall(
            "approval",
            "ask_approval",
            {"question": "Publish the monthly report?"},
            "input",
            "approval (input)",
        ),
    ]


@dataclass(frozen=True)
class Waiting:
    """A question the demo has to ask, and what it does with the answer."""

    text: str
    then: Callable[[bool], None]


@dataclass
class Demo:
    fleet: LocalFleet
    console: Console
    asker: Asker
    app: Celery
    ledger: Ledger
    run_id: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S"))
    calls: list[DemoCall] = field(default_factory=plan)
    notes: dict[str, str] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    _terminals: dict[uuid.UUID, str] = field(default_factory=dict)
    #: The questions in the order they came; the first is the one asked (one terminal, one at a time).
    waiting: deque[Waiting] = field(default_factory=deque)
    asking: Question | None = None

    def node(self, call: DemoCall) -> str:
        return f"dev/{self.run_id}/{call.name}"

    def by_role(self, role: Role) -> DemoCall:
        return next(c for c in self.calls if c.role == role)

    # ------------------------------------------------------------------ the pipeline's side
    def submit(self, call: DemoCall) -> None:
        kwargs = {"call_node_id": self.node(call), "server": "reports", "tool": call.tool}
        self.app.send_task(
            "longcall.submit", kwargs={**kwargs, "arguments": call.arguments}, queue="longcall.control"
        )

    def control(self, name: str, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.fleet.demo_control_url}/{name}"
        answer = httpx2.post(url, json=body, timeout=10) if body is not None else httpx2.get(url, timeout=10)
        answer.raise_for_status()
        return answer.json()

    # ------------------------------------------------------------------ the run
    def run(self) -> list[ReceiptRow]:
        lost = self.by_role("lost")
        self.control("faults", {"lose_create_response": 1})
        self.submit(lost)
        submitted_rest = False
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        try:
            with Live(console=self.console, refresh_per_second=4, auto_refresh=True) as live:
                while True:
                    ops = {c.name: self.ledger.find_by_call_node(self.node(c)) for c in self.calls}
                    lost_op = ops[lost.name]
                    if not submitted_rest and lost_op is not None and lost_op.state is not OpState.SUBMITTING:
                        # The lost answer is settled (one create was attempted): the others may go now.
                        for call in self.calls:
                            if call is not lost:
                                self.submit(call)
                        submitted_rest = True
                    self.act(ops)
                    self.take_answers(live)
                    live.update(self.display(ops))
                    if not self.waiting and all(op is not None and op.state in FINAL for op in ops.values()):
                        break
                    if self.asking is not None:
                        deadline += TICK_S  # the time a question waits for a person is not the demo's
                    elif time.monotonic() > deadline:
                        waiting = [n for n, op in ops.items() if op is None or op.state not in FINAL]
                        raise DevError(
                            f"the demo did not finish in {DEMO_TIMEOUT_S:.0f}s: {', '.join(waiting)}"
                        )
                    time.sleep(TICK_S)
        finally:
            if self.asking is not None:
                self.asking.close()  # the terminal as it was, whatever ended the run
        self.console.line()
        return self.receipts({c.name: self.ledger.find_by_call_node(self.node(c)) for c in self.calls})

    def display(self, ops: dict[str, Operation | None]) -> RenderableType:
        """The table, and below it the question that waits for an answer (the table stays live)."""
        table = progress_table(self.rows(ops), self.title())
        if self.asking is None:
            return table
        return Group(table, Text(""), Text(f"? {self.asking.text} ", style="bold"))

    def ask(self, text: str, then: Callable[[bool], None]) -> None:
        """Queue a question; it is asked when those before it are answered, and ``then`` gets the answer."""
        self.waiting.append(Waiting(text, then))

    def take_answers(self, live: Live) -> None:
        """Ask the first waiting question; take its answer when there is one (never waits for it)."""
        while self.waiting:
            if self.asking is None:
                self.asking = self.asker.ask(self.waiting[0].text)
            answer = self.asking.answer()
            if answer is None:
                return
            self.asking.close()
            said = "yes" if answer else "no"
            live.console.print(f"{escape(self.asking.text)} [bold]{said}[/]{escape(self.asking.how)}")
            self.asking = None
            self.waiting.popleft().then(answer)

    def title(self) -> str:
        return f"longcall dev demo (call nodes dev/{self.run_id}/...)"

    def act(self, ops: dict[str, Operation | None]) -> None:
        cancel = ops[self.by_role("cancel").name]
        if (
            cancel is not None
            and "cancel" not in self.done
            and cancel.state is OpState.WORKING
            and _age(cancel) >= CANCEL_AFTER_S
        ):
            self.app.send_task("longcall.cancel", kwargs={"op_id": str(cancel.id)}, queue="longcall.control")
            self.done.add("cancel")
            self.notes["cancel-me"] = f"cancel sent at {_age(cancel):.1f}s"
        approval = ops[self.by_role("input").name]
        if approval is not None and approval.state is OpState.INPUT_REQUIRED:
            key = f"input-{approval.input_round}"
            if key not in self.done:
                self.done.add(key)
                self.answer(approval)
        lost = ops[self.by_role("lost").name]
        if lost is not None and lost.state is OpState.MANUAL_RECONCILIATION and "operator" not in self.done:
            self.done.add("operator")
            self.operate(lost)

    def answer(self, op: Operation) -> None:
        params = (op.input_request or {}).get("params") or {}
        question = str(params.get("message", "(no message)"))
        input_round = op.input_round

        def send(approve: bool) -> None:
            response = {"action": "accept", "content": {"approved": approve}}
            self.app.send_task(
                "longcall.provide_input",
                kwargs={"op_id": str(op.id), "input_round": input_round, "response": response},
                queue="longcall.control",
            )
            self.notes["approval"] = f"answered: approved={str(approve).lower()}"

        self.notes["approval"] = "asked at the terminal"
        self.ask(f"The server asks (round {input_round}): {question!r} Approve?", send)

    def operate(self, op: Operation) -> None:
        """The operator's part: find the task on the server by what was asked, and tell longcall."""
        call = self.by_role("lost")
        tasks = self.server_tasks_for(call)
        if len(tasks) != 1:
            self.notes[call.name] = f"operator: {len(tasks)} matching tasks on the server; left open"
            return
        [task] = tasks

        def reconcile(found: bool) -> None:
            if not found:
                self.notes[call.name] = "left for an operator (longcall reconcile)"
                return
            argv = longcall_argv(
                "reconcile",
                str(op.id),
                "--found",
                str(task["taskId"]),
                "--session",
                str(task["session"]),
                "--evidence",
                f"longcall dev: the demo server lists task {task['taskId']} with these arguments",
            )
            env = {**os.environ, **self.fleet.env}
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)  # noqa: S603
            failed = f"reconcile failed: {done.stderr.strip()[-200:]}"
            self.notes[call.name] = (
                f"operator: found {task['taskId'][:8]}" if done.returncode == 0 else failed
            )

        self.notes[call.name] = "operator asked at the terminal"
        self.ask(
            f"Operator: the create answer for {self.node(call)} was lost; the server lists task "
            f"{task['taskId']} with the same arguments. Record it as found?",
            reconcile,
        )

    def server_tasks_for(self, call: DemoCall) -> list[dict[str, Any]]:
        """The demo server's own list of the tasks it holds for this call (same tool, same arguments)."""
        tasks: list[dict[str, Any]] = self.control("tasks")["tasks"]
        return [t for t in tasks if t["tool"] == call.tool and t["arguments"] == call.arguments]

    # ------------------------------------------------------------------ what is shown
    def rows(self, ops: dict[str, Operation | None]) -> list[ProgressRow]:
        rows = []
        for call in self.calls:
            op = ops[call.name]
            polls = 0 if op is None else op.unchanged_polls + self._polled_events(op.id)
            elapsed = 0.0 if op is None else _age(op, final=op.state in FINAL)
            note = self.notes.get(call.name, "")
            state = None if op is None else op.state
            terminal = self._terminal(op) if op is not None and op.state in FINAL else None
            rows.append(ProgressRow(call.name, call.what, state, polls, elapsed, note, terminal))
        return rows

    def _terminal(self, op: Operation) -> str | None:
        """The receipt's terminal state of an ended operation (read once: a receipt never changes)."""
        if op.id not in self._terminals:
            receipt = self.ledger.receipt_for(op.id)
            if receipt is None:
                return None
            self._terminals[op.id] = receipt.terminal_state.value
        return self._terminals[op.id]

    def _polled_events(self, op_id: uuid.UUID) -> int:
        return sum(1 for e in self.ledger.events(op_id) if e["kind"] == "polled")

    def receipts(self, ops: dict[str, Operation | None]) -> list[ReceiptRow]:
        rows = []
        for call in self.calls:
            op = ops[call.name]
            receipt = None if op is None else self.ledger.receipt_for(op.id)
            if op is None or receipt is None:
                rows.append(ReceiptRow(self.node(call), "(none)", None, ""))
                continue
            rows.append(
                ReceiptRow(
                    self.node(call), receipt.terminal_state.value, receipt.result_digest, summary(op.result)
                )
            )
        return rows


def _age(op: Operation, *, final: bool = False) -> float:
    end = op.updated_at if final else dt.datetime.now(dt.UTC)
    return max(0.0, (end - op.created_at).total_seconds())


def summary(result: Any) -> str:
    """The text of a CallToolResult, shortened; '-' for none."""
    if not isinstance(result, dict):
        return "-" if result is None else str(result)[:60]
    texts = [c.get("text", "") for c in result.get("content", []) if isinstance(c, dict)]
    text = " ".join(t for t in texts if t) or "(no text)"
    prefix = "error: " if result.get("isError") else ""
    return (prefix + text)[:60]
