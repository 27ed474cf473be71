"""The entry points the tasks call, each running one step of the protocol (:mod:`workers.steps`).

Every entry point reads the row, checks that the step applies to its state and that the caller's claim is
still the row's, and maps what a step may meet on the way: a stale write (the row moved on under it) and a
missing token (rescheduled, never blocked). A message sent by name (a submission, a cancel, an input reply)
enters by ``take_*``: its intent recorded through the caller's ``tries`` (the Celery layer's: through
infrastructure faults, then by the broker, ``workers/task_faults.py``), then its step.

No Celery here (``tests/unit/test_layers.py``): what the serializer and Celery say of a value comes from
the runtime (``Runtime.delivery``).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol, TypeVar

import redis

from ledger.errors import StaleTransition
from ledger.events import EventKind
from ledger.moves import RECORD_LOCK_WAIT_S
from ledger.records import Fence, NewOperation, Operation, Submission, UnchangedPoll
from ledger.repository import Ledger
from ledger.shadow import LegacyRecording, ShadowComparison
from ledger.states import OpState
from workers import logs
from workers import members as member_threads
from workers.budget import REDIS_PAUSE_S, TokenBudget
from workers.errors import NoToken, UnknownServer
from workers.faults import INFRASTRUCTURE, describe_fault
from workers.lease import keep_lease
from workers.poll_batch import STRAGGLER_BOUND_TICKS, PollBatch
from workers.runtime import OWNER_SEEN_S, Runtime
from workers.steps import cancel, dispatch, input_rounds, poll, reconciliation, result, submit
from workers.steps.context import StepAction, StepContext, StepOutcome, no_token_delay, spread, utc_now
from workers.steps.dispatch import Dispatch
from workers.steps.reconciliation import Resolution
from workers.submission import canary_admission, operation_summary, parse_legacy_outcome, validate_submission

__all__ = [
    "Dispatch",
    "Executor",
    "PollMember",
    "Resolution",
    "StepOutcome",
    "Tries",
    "once",
    "submit_answer",
]

log = logging.getLogger("longcall.executor")

S = OpState

Step = Callable[[StepContext, Operation, Fence], StepOutcome]

#: What becomes of a batch member whose step failed.
AGAIN_AFTER_LEASE = "it is claimed again when its lease runs out"

P = ParamSpec("P")
R = TypeVar("R")


class Tries(Protocol):
    """How the caller tries an intent's recording: ``tries(what, run)`` returns ``run()``, tried again as
    the caller sees fit (``what`` names the intent in what it logs)."""

    def __call__(self, what: str, run: Callable[[], R], /) -> R: ...


def once(what: str, run: Callable[[], R], /) -> R:
    """Try once (an in-process caller: a test, a simulation)."""
    return run()


def submit_answer(submission: Submission, step: StepOutcome | None) -> dict[str, Any]:
    """What ``longcall.submit`` returns (JSON): the operation (``workers.submission.operation_summary``), and
    what its first step did when this worker made it (``step``, and the state it left)."""
    summary = operation_summary(submission.operation, created=submission.created)
    if step is not None:
        summary["step"] = step.action.value
        summary["state"] = step.state.value if step.state is not None else summary["state"]
    return summary


@dataclass(frozen=True, slots=True)
class PollMember:
    """One member of a batched ``longcall.poll``: the operation, its claim's cursor, and how long after the
    message's start its poll is due (``workers.steps.dispatch.messages``)."""

    op_id: uuid.UUID
    cursor: int
    wait_s: float = 0.0


def _then_leave(run: Callable[[], None], server: str) -> None:
    """Run an admitted member, then free its room (``workers.members.leave``)."""
    try:
        run()
    finally:
        member_threads.leave(server)


#: How many times an answer is stored on a row that moved between its read and its write (each a race lost
#: to another writer) before the stale write is raised.
REPLY_RACES = 3


def _say_not_handed_back(count: int, what: str, exc: Exception) -> None:
    """A hand-back of claims failed: their rows are due when their leases run out. An outage is a warning;
    anything else an error, with its traceback (the batch goes on either way: an error escaping the batch
    would leave its admitted members' room and claims held in the process for good)."""
    if isinstance(exc, INFRASTRUCTURE):
        log.warning("handing back %d %s met %s", count, what, describe_fault(exc))
    else:
        log.error("handing back %d %s failed; each is due when its lease runs out", count, what, exc_info=exc)


def _deferred(op_id: uuid.UUID, fault: BaseException) -> StepOutcome:
    """A batch member's step that failed: its row stays claimed until the lease runs out."""
    return StepOutcome(op_id, StepAction.DEFERRED, None, detail={"fault": describe_fault(fault)})


def _own_log_context(entry: Callable[P, R]) -> Callable[P, R]:
    """An entry point whose steps note the operation they work on (their log lines name it) and leave the
    caller's log context as they found it: run in process (a simulation, a test, an application embedding
    the executor), the caller's next line names no operation of ours."""

    @functools.wraps(entry)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with logs.bind():
            return entry(*args, **kwargs)

    return run


class Executor:
    """One worker's view of the protocol: the runtime, and a step per task."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        jitter: Callable[[float], float] | None = None,
        clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self.rt = runtime
        self.ctx = StepContext(runtime, jitter=jitter or spread, clock=clock or utc_now)

    @property
    def ledger(self) -> Ledger:
        return self.rt.ledger

    def take_submission(
        self, kwargs: Mapping[str, Any], *, tries: Tries = once
    ) -> tuple[Submission, StepOutcome | None]:
        """``longcall.submit`` from its keyword arguments: checked at the boundary (``workers/submission.py``,
        with what the runtime's serializer and Celery say of its signatures), then recorded through
        ``tries`` and routed in the insert's transaction, under the call node's lock (:meth:`submit`). A
        repeat of the insert finds the row the first try committed; once the row is recorded, a fault in its
        first step leaves the step to the dispatcher, and the answer is the operation.

        Raises:
            InvalidSubmission: the submission was refused; nothing was written.
            workers.submission.NotRouted: the call node is outside the canary; nothing was written.
            ledger.errors.CallNodeConflict, ledger.errors.AdmissionClosed, ledger.errors.AdapterDisabled:
                the ledger refused it.
        """
        settings, fleet = self.rt.settings, self.rt.fleet
        new = validate_submission(
            kwargs,
            fleet,
            max_body_bytes=settings.max_body_bytes,
            max_delay_s=settings.max_callback_delay_s,
            delivery=self.rt.delivery,
        )
        return tries(
            f"longcall.submit of call node {new.call_node_id!r}",
            lambda: self.submit(new, admit=canary_admission(fleet, new)),
        )

    def take_cancel(self, op_id: uuid.UUID, *, tries: Tries = once) -> StepOutcome:
        """``longcall.cancel`` of an operator or a pipeline: its intent recorded through ``tries`` until it
        is, then its request sent (:meth:`request_cancel`)."""
        return tries(f"longcall.cancel of {op_id}", lambda: self.request_cancel(op_id))

    def take_cancel_of_call_node(self, call_node_id: str, *, tries: Tries = once) -> StepOutcome | None:
        """``longcall.cancel`` by a pipeline's call node id, tried as :meth:`take_cancel` is: the call node's
        operation cancelled as by its op id; None when it has none yet: the intent is then recorded for the
        call node's first submission (``Ledger.cancel_call_node``), which ends it cancelled, never created."""

        def run() -> StepOutcome | None:
            op = self.ledger.cancel_call_node(call_node_id)
            return None if op is None else self.request_cancel(op.id)

        return tries(f"longcall.cancel of call node {call_node_id!r}", run)

    def take_reply(
        self, op_id: uuid.UUID, input_round: int, response: Mapping[str, Any], *, tries: Tries = once
    ) -> StepOutcome:
        """``longcall.provide_input``, its reply checked at the boundary (``workers/replies.py``): stored
        with its round through ``tries`` until it is (a repeat of the same reply after a lost commit finds
        it stored), then sent, now or by the next step (:meth:`provide_input`)."""
        return tries(
            f"longcall.provide_input of {op_id} round {input_round}",
            lambda: self.provide_input(op_id, input_round, response),
        )

    def record_legacy_outcome(self, kwargs: Mapping[str, Any]) -> tuple[ShadowComparison, LegacyRecording]:
        """``longcall.record_legacy_outcome``: the caller's legacy outcome of a call node, checked at the
        boundary, beside its shadow operation's receipt (issue 12).

        Raises:
            InvalidSubmission: the outcome was refused; nothing was written.
            ledger.shadow.LegacyOutcomeRefused: the ledger refused it.
        """
        legacy = parse_legacy_outcome(kwargs, max_body_bytes=self.rt.settings.max_body_bytes)
        return self.ledger.record_legacy_outcome(
            legacy.call_node_id,
            legacy.terminal_state,
            result_digest=legacy.result_digest,
            detail=legacy.detail,
        )

    @_own_log_context
    def submit(
        self, new: NewOperation, *, admit: Callable[[Mapping[str, Any]], NewOperation] | None = None
    ) -> tuple[Submission, StepOutcome | None]:
        """``longcall.submit``: record the call node's operation (validated at the boundary; routed by
        ``admit`` under the call node's lock, see ``Ledger.record_submission``), then make the create call
        at once when this worker holds its claim."""
        submission = self.ledger.record_submission(new, lease_s=self.rt.settings.lease_s, admit=admit)
        if not submission.created:
            return submission, None
        op = submission.operation
        try:
            return submission, self._guard(op, op.poll_cursor, submit.advance_submission)
        except INFRASTRUCTURE as exc:
            # The row is recorded: the caller's answer is the operation, and its create is the dispatcher's
            # once this claim's lease runs out (a create attempt recorded before the fault is looked up by
            # key then, never made again blindly).
            log.warning("the first step of %s met %s; the dispatcher takes it on", op.id, describe_fault(exc))
            return submission, StepOutcome(
                op.id, StepAction.DEFERRED, op.state, detail={"fault": describe_fault(exc)}
            )

    @_own_log_context
    def advance(self, op_id: uuid.UUID, cursor: int) -> StepOutcome:
        """``longcall.poll``: the step for a SUBMITTING, SUBMISSION_UNKNOWN or WORKING operation.

        A status read never sends the arguments, so the row is read without them (they may be up to
        ``max_body_bytes``, read and parsed on every poll otherwise); a submission's step, which sends them
        (the create) or asks by them (the lookup), reads the whole row."""
        op = self.ledger.get(op_id, with_body=False)
        if op.state in (S.SUBMITTING, S.SUBMISSION_UNKNOWN):
            op = self.ledger.get(op_id)
        if op.state in (S.SUBMITTING, S.SUBMISSION_UNKNOWN):
            return self._guard(op, cursor, submit.advance_submission)
        if op.state is S.WORKING:
            return self._guard(op, cursor, poll.poll)
        return StepOutcome(op.id, StepAction.NOTHING_TO_DO, op.state)

    @_own_log_context
    def advance_batch(self, members: Sequence[PollMember]) -> list[StepOutcome]:
        """``longcall.poll`` with ``ops``, run to its end here: :meth:`start_batch`, then every member's
        answer in order, once all are done."""
        return self.start_batch(members).wait()

    @_own_log_context
    def start_batch(
        self,
        members: Sequence[PollMember],
        *,
        on_step: Callable[[StepOutcome], None] | None = None,
        on_finish: Callable[[list[StepOutcome]], None] | None = None,
    ) -> PollBatch:
        """``longcall.poll`` with ``ops``: the polls of one server, started on its member threads in this
        process (``workers/members.py``), each as a one-operation poll would run (its own log context, its
        own cursor fencing its writes) no earlier than its own due time (at most one dispatch tick on), and
        the batch on its way returned at once (``on_step``: called with each member's answer as it comes;
        ``on_finish``: with all of them, in order, once all are done and recorded).

        The members' rows are read in one statement (``Ledger.get_many``), and the status reads they make
        are booked on their server's poll bucket in one script call (``ServerBudgets.book_slots``), not one
        each. A member whose claim is done already (a copy of this message ran it: its lease let go), or
        runs in this process now (a copy on its way), does nothing. A member's failure is its own: logged,
        answered DEFERRED, never failing the others or the message; a fault of the ledger or of Redis leaves
        its row claimed, and the dispatcher claims it again when the lease runs out, as after a
        one-operation poll that failed. The polls that changed nothing are recorded together
        (:class:`~workers.poll_batch.PollBatch`)."""
        started = time.monotonic()
        tick = self.rt.settings.dispatch_interval_s
        unrecorded = self.rt.unrecorded
        batch = PollBatch(
            len(members),
            unrecorded,
            bound_s=STRAGGLER_BOUND_TICKS * tick,
            on_step=on_step,
            on_finish=on_finish,
        )
        # Each member's claim is held in this process from now until its step is recorded: a copy of this
        # message on its way here runs none of them, nor hands any back (``workers.members.hold_claim``).
        held: list[int] = []
        for index, member in enumerate(members):
            if member_threads.hold_claim(member.op_id, member.cursor):
                held.append(index)
            else:
                running = StepOutcome(
                    member.op_id, StepAction.NOTHING_TO_DO, None, detail={"claim": "running"}
                )
                batch.done(index, running)
        if not held:
            return batch
        earlier = unrecorded.take()  # the process's unchanged polls not yet recorded go with this read
        recorded: set[uuid.UUID] | Exception = RuntimeError("the batch's read did not finish")
        try:
            recorded, rows = self.ledger.record_then_read(earlier.polls, [members[i].op_id for i in held])
        except Exception as exc:
            recorded = exc
            self._let_go(batch, members, held, exc)
            if not isinstance(exc, INFRASTRUCTURE):
                raise
            log.warning(
                "reading a batch of %d polls met %s; %s", len(members), describe_fault(exc), AGAIN_AFTER_LEASE
            )
            return batch
        finally:
            earlier.settle(recorded)
        admitted = self._admit(batch, members, rows, held)
        try:
            slots, refused = self._book_status_reads([members[i] for i in admitted], rows, started)
            if refused:
                without = [i for i in admitted if members[i].op_id in refused]
                admitted = [i for i in admitted if members[i].op_id not in refused]
                self._without_slots(batch, members, rows, refused, without)
        except Exception as exc:
            self._not_started(batch, members, admitted, rows, exc)
            raise
        self._start_members(batch, members, admitted, rows=rows, slots=slots, started=started)
        return batch

    def _start_members(
        self,
        batch: PollBatch,
        members: Sequence[PollMember],
        admitted: Sequence[int],
        *,
        rows: Mapping[uuid.UUID, Operation],
        slots: Mapping[uuid.UUID, TokenBudget],
        started: float,
    ) -> None:
        """The admitted members, each on its server's member threads (``workers.members``) from its due time
        (at most one dispatch tick on) and its booked slot."""
        tick = self.rt.settings.dispatch_interval_s
        threads = member_threads.server_threads(self.rt.settings.poll_batch)
        for position, index in enumerate(admitted):
            member = members[index]
            row = rows.get(member.op_id)
            server = row.server if row is not None else ""
            budget = slots.get(member.op_id)
            run = functools.partial(self._run_member, batch, index, member, row=row, budget=budget)
            # Started at its due time (the dispatcher's delays are within one tick: a wait past it is not
            # one of its own) and its slot, not waiting for them on a thread (workers.members).
            not_before = started + min(member.wait_s, tick)
            if budget is not None and budget.slot_at is not None:
                not_before = max(not_before, budget.slot_at)
            try:
                member_threads.submit(
                    server, threads, functools.partial(_then_leave, run, server), not_before=not_before
                )
            except Exception as exc:  # noqa: BLE001 -- whatever it is, the member was not queued
                # No thread could be started in this process (its limit of threads or of memory: a member
                # thread or the threads' timer): this member and the ones after it are not started; their
                # room and their claims go back, and each is due when its lease runs out. The members
                # started already run as before.
                rest = admitted[position:]
                self._not_started(batch, members, rest, rows, exc)
                log.warning(
                    "no member thread could be started for %d of a batch's %d polls (%s); %s",
                    len(rest),
                    len(members),
                    exc,
                    AGAIN_AFTER_LEASE,
                )
                break

    @classmethod
    def _not_started(
        cls,
        batch: PollBatch,
        members: Sequence[PollMember],
        indexes: Sequence[int],
        rows: Mapping[uuid.UUID, Operation],
        exc: Exception,
    ) -> None:
        """Admitted members not started after all: their room and their claims go back, each answered
        DEFERRED (due when its lease runs out)."""
        for index in indexes:
            row = rows.get(members[index].op_id)
            member_threads.leave(row.server if row is not None else "")
        cls._let_go(batch, members, indexes, exc)

    @staticmethod
    def _let_go(
        batch: PollBatch, members: Sequence[PollMember], indexes: Sequence[int], exc: Exception
    ) -> None:
        """Members not run, answered DEFERRED, their claims let go in this process (each row is claimed again
        when its lease runs out)."""
        for index in indexes:
            member = members[index]
            member_threads.let_go(member.op_id, member.cursor)
            batch.done(index, _deferred(member.op_id, exc))

    def _admit(
        self,
        batch: PollBatch,
        members: Sequence[PollMember],
        rows: Mapping[uuid.UUID, Operation],
        held: Sequence[int],
    ) -> list[int]:
        """The members this process starts now, by server within its room (``workers.members.admit``);
        the others are answered DEFERRED (``shed``) at once, their claims handed back in one statement per
        server, and the process says so (once per ten seconds and server). A row handed back is due again a
        dispatch tick on, or at its own due time if that is later (its wait in the batch): the next tick but
        one claims it again, in whichever process has room, and a process that stays full costs its shed
        polls a tick each, never a round of polls (the claim had set the next poll an interval on). Through
        a fault, it is due when its lease runs out."""
        poll_batch = self.rt.settings.poll_batch
        tick = self.rt.settings.dispatch_interval_s
        by_server: dict[str, list[int]] = {}
        for index in held:
            row = rows.get(members[index].op_id)
            by_server.setdefault(row.server if row is not None else "", []).append(index)
        admitted: list[int] = []
        for server, indexes in by_server.items():
            room = member_threads.admit(
                server,
                len(indexes),
                per_server=member_threads.server_threads(poll_batch),
                per_process=member_threads.process_members(poll_batch),
            )
            admitted += indexes[:room]
            shed = indexes[room:]
            if shed:
                if member_threads.say_shed(server):
                    log.warning(
                        "this process runs all the polls it can (%s: %d shed); they are due again in a"
                        " dispatch tick",
                        server,
                        len(shed),
                    )
                claims = []
                for i in shed:
                    row = rows.get(members[i].op_id)
                    due_in = max(members[i].wait_s, tick)
                    if row is not None:
                        due_in = self.ctx.until_deadline(row, due_in)
                    claims.append((members[i].op_id, members[i].cursor, due_in))
                try:
                    self.ledger.hand_back_claims(claims)
                except Exception as exc:  # noqa: BLE001 -- whatever it met, the batch goes on (below)
                    # Their leases run out instead: each row is claimed again then. Nothing escapes here:
                    # the members admitted above hold their room and their claims until they run.
                    _say_not_handed_back(len(shed), "shed claims", exc)
            for index in shed:
                member_threads.let_go(members[index].op_id, members[index].cursor)
                step = StepOutcome(members[index].op_id, StepAction.DEFERRED, None, detail={"shed": True})
                batch.done(index, step)
        return sorted(admitted)

    def _book_status_reads(
        self, members: Sequence[PollMember], rows: Mapping[uuid.UUID, Operation], started: float
    ) -> tuple[dict[uuid.UUID, TokenBudget], dict[uuid.UUID, NoToken]]:
        """The poll budgets of the members whose step begins with a status read (``poll.reads_status``),
        booked per server in one script call, each slot no earlier than its member is due; and the members
        refused a slot, with the refusal."""
        tick = self.rt.settings.dispatch_interval_s
        now = self.ctx.now()
        elapsed = time.monotonic() - started
        by_server: dict[str, list[tuple[float, uuid.UUID]]] = {}
        for member in members:
            row = rows.get(member.op_id)
            if row is not None and poll.reads_status(row, member.cursor, now):
                offset = max(0.0, min(member.wait_s, tick) - elapsed)
                by_server.setdefault(row.server, []).append((offset, member.op_id))
        budgets: dict[uuid.UUID, TokenBudget] = {}
        refused: dict[uuid.UUID, NoToken] = {}
        for server, asked in by_server.items():
            asked.sort()
            try:
                booked = self.ctx.budget.book_slots(server, "poll", [offset for offset, _ in asked])
            except UnknownServer:
                continue  # each member meets it in its own step (rule 14)
            for index, (_, op_id) in enumerate(asked):
                if index < len(booked.delays_s):
                    budgets[op_id] = booked.budget(index)
                else:
                    refused[op_id] = booked.refused or NoToken(REDIS_PAUSE_S)
        return budgets, refused

    def _without_slots(
        self,
        batch: PollBatch,
        members: Sequence[PollMember],
        rows: Mapping[uuid.UUID, Operation],
        refused: Mapping[uuid.UUID, NoToken],
        indexes: Sequence[int],
    ) -> None:
        """The members refused a slot (the server's poll budget has none within a tick of their time), not
        started: their claims handed back in one statement, each row due again when the bucket said (a
        little spread, never past its wait deadline while it is ahead) and its ``no_token_count`` counted,
        as each member's own step would have rescheduled it, one write and one read each (rule 4). A fleet
        that does not own the epoch hands the claim back instead (rule 13, as the step would). Through a
        fault, each is answered DEFERRED and is due when its lease runs out."""
        claims: list[tuple[uuid.UUID, int, float]] = []
        counted: list[int] = []
        for index in indexes:  # none of them runs: their room goes back first, whatever follows
            member_threads.leave(rows[members[index].op_id].server)
        for index in indexes:
            member = members[index]
            row = rows[member.op_id]
            try:
                not_owner = self._not_owner(row, member.cursor)
            except Exception as exc:  # due when its lease runs out, whatever it met
                if not isinstance(exc, INFRASTRUCTURE):
                    log.exception("reading the epoch's owner for %s failed", member.op_id)
                self._let_go(batch, members, [index], exc)
                continue
            if not_owner is not None:
                member_threads.let_go(member.op_id, member.cursor)
                batch.done(index, not_owner)
                continue
            delay = self.ctx.until_deadline(row, no_token_delay(refused[member.op_id]))
            claims.append((member.op_id, member.cursor, delay))
            counted.append(index)
        fault: Exception | None = None
        if claims:
            try:
                self.ledger.hand_back_claims(claims, no_token=True)
            except Exception as exc:  # noqa: BLE001 -- each is answered DEFERRED below, whatever it met
                _say_not_handed_back(len(claims), "polls without a token", exc)
                fault = exc
        for index, (op_id, cursor, delay) in zip(counted, claims, strict=True):
            member_threads.let_go(op_id, cursor)
            if fault is not None:
                batch.done(index, _deferred(op_id, fault))
            else:
                state = rows[op_id].state
                batch.done(
                    index, StepOutcome(op_id, EventKind.NO_TOKEN, state, detail={"delay_s": round(delay, 3)})
                )

    def _run_member(
        self,
        batch: PollBatch,
        index: int,
        member: PollMember,
        *,
        row: Operation | None,
        budget: TokenBudget | None,
    ) -> None:
        """One member, on a member thread (its claim held in this process by :meth:`start_batch`): its answer
        goes to ``batch``, which lets the claim go once its step is recorded."""
        fence = None
        try:
            # Started no earlier than its due time (rule 3) by the member threads (``not_before``).
            step = self._member_step(member, row, budget)
            if step.unchanged and row is not None:
                fence = Fence(row.execution_epoch, row.cancel_generation, member.cursor)
                if not self._record_may_wait(row):
                    step, fence = self._recorded_alone(step, fence), None
        except Exception as exc:  # the member's own answer, never the batch's failure
            log.exception("the poll of %s failed; %s", member.op_id, AGAIN_AFTER_LEASE)
            step = _deferred(member.op_id, exc)
        batch.done(
            index, step, fence, let_go=functools.partial(member_threads.let_go, member.op_id, member.cursor)
        )

    def _record_may_wait(self, row: Operation) -> bool:
        """Whether the member's claim outlasts the longest its batch's record of an unchanged poll may wait
        (the stragglers' bound, the process's record a tick later, and the record's lock wait). Else its lease
        could run out first, and the row, due meanwhile, be claimed and polled again sooner than its
        interval: its record is written at once instead."""
        tick = self.rt.settings.dispatch_interval_s
        waits_s = (STRAGGLER_BOUND_TICKS + 1) * tick + RECORD_LOCK_WAIT_S
        lease = row.lease_until
        return lease is not None and lease - self.ctx.now() > dt.timedelta(seconds=waits_s)

    def _recorded_alone(self, step: StepOutcome, fence: Fence) -> StepOutcome:
        """An unchanged poll recorded now, alone (``Ledger.record_unchanged_polls``); answered STALE when
        its claim was not the row's any more, as the batch's record would. A fault is the member's own."""
        try:
            written = self.ledger.record_unchanged_polls(
                [UnchangedPoll(step.op_id, fence, step.next_poll_due)]
            )
        except INFRASTRUCTURE as exc:
            log.warning("the poll of %s met %s; %s", step.op_id, describe_fault(exc), AGAIN_AFTER_LEASE)
            return _deferred(step.op_id, exc)
        if step.op_id in written:
            return step
        return StepOutcome(step.op_id, StepAction.STALE, None, detail={"unchanged": "not recorded"})

    def _member_step(
        self, member: PollMember, row: Operation | None, budget: TokenBudget | None
    ) -> StepOutcome:
        try:
            with logs.bind(member.op_id):  # the member's lines name its operation, this thread's only
                return self._advance_member(member, row, budget)
        except INFRASTRUCTURE as exc:
            log.warning("the poll of %s met %s; %s", member.op_id, describe_fault(exc), AGAIN_AFTER_LEASE)
            return _deferred(member.op_id, exc)
        except Exception as exc:
            log.exception("the poll of %s failed; %s", member.op_id, AGAIN_AFTER_LEASE)
            return _deferred(member.op_id, exc)

    def _advance_member(
        self, member: PollMember, op: Operation | None, budget: TokenBudget | None = None
    ) -> StepOutcome:
        """One member of a batch, from the batch's read of its row (``op``; None: there is none), its status
        read paid by ``budget`` when the batch booked it."""
        if op is None:
            return StepOutcome(member.op_id, StepAction.NOTHING_TO_DO, None, detail={"row": "none"})
        if op.poll_cursor == member.cursor and op.lease_until is None:
            # The claim was let go by the step it was for: this is a copy of a message that ran already.
            return StepOutcome(op.id, StepAction.NOTHING_TO_DO, op.state, detail={"claim": "done"})
        if op.state is not S.WORKING:
            return self.advance(member.op_id, member.cursor)  # a phase of its own reads its row itself
        return self._guard(op, member.cursor, functools.partial(poll.poll_scheduled, budget=budget))

    @_own_log_context
    def fetch_result(self, op_id: uuid.UUID, cursor: int) -> StepOutcome:
        """``longcall.fetch_result``: read and accept the result of a TERMINAL_OBSERVED operation."""
        op = self.ledger.get(op_id)
        if op.state not in (S.TERMINAL_OBSERVED, S.FETCHING_RESULT):
            return StepOutcome(op.id, StepAction.NOTHING_TO_DO, op.state)
        return self._guard(op, cursor, result.fetch)

    @_own_log_context
    def send_cancel(self, op_id: uuid.UUID, cursor: int) -> StepOutcome:
        """``longcall.cancel`` with a cursor: send (again) the cancel request of a recorded cancel."""
        op = self.ledger.get(op_id)
        if op.state is not S.CANCEL_REQUESTED:
            return StepOutcome(op.id, StepAction.NOTHING_TO_DO, op.state)
        return self._guard(op, cursor, cancel.send)

    @_own_log_context
    def request_cancel(self, op_id: uuid.UUID) -> StepOutcome:
        """``longcall.cancel``: record the intent (in any state that is not final), then, under a fresh
        claim, send the cancel request at once, or end an operation no create was attempted for cancelled.

        Raises:
            NotCancellable: the row kept moving under every try to record the intent.
        """
        recorded = cancel.record_intent(self.ctx, self.ledger.get(op_id))
        if isinstance(recorded, StepOutcome):
            return recorded
        try:
            if recorded.state is S.CANCEL_REQUESTED:
                return self.send_cancel(op_id, recorded.poll_cursor)
            return self.advance(op_id, recorded.poll_cursor)
        except INFRASTRUCTURE as exc:
            # The intent is recorded (rule 6): the request is the dispatcher's when this claim's lease ends.
            log.warning("the cancel of %s is recorded; sending it met %s", op_id, describe_fault(exc))
            return StepOutcome(
                op_id, StepAction.CANCEL_REQUESTED, recorded.state, detail={"fault": describe_fault(exc)}
            )

    @_own_log_context
    def provide_input(self, op_id: uuid.UUID, input_round: int, response: Mapping[str, Any]) -> StepOutcome:
        """``longcall.provide_input``: the current round only, before its deadline, a reply the adapter takes
        (rule 10). The reply is stored with its round first; then, under a fresh claim, it is sent at once.
        Without the claim (a poll step holds it; or this fleet does not own the epoch), or without a token,
        the step that next finds the reply not yet taken sends it: the answer is "input_recorded".

        Raises:
            InputRefused: the reply was refused (and the refusal recorded).
        """
        recorded = self._record_reply(op_id, input_round, response)
        if isinstance(recorded, StepOutcome):
            return recorded
        try:
            claim = self.ledger.claim(op_id, lease_s=self.rt.settings.lease_s)
            if claim is None:
                return StepOutcome(
                    op_id, StepAction.INPUT_RECORDED, recorded.state, detail={"input_round": input_round}
                )
            op = self.ledger.get(op_id, with_body=False)
            outcome = self._guard(op, claim.poll_cursor, input_rounds.send_reply)
            if outcome.action is StepAction.NOTHING_TO_DO and op.next_poll_at is not None:
                # A step of the dispatcher's sent the reply between its record and this claim, which wrote
                # nothing: it goes back, the row due when it was, not when this claim's lease runs out. (A
                # row no step is due for, in a state that is not polled, keeps its schedule: none.)
                due_in = (op.next_poll_at - self.ctx.now()).total_seconds()
                self.ledger.hand_back_claims([(op_id, claim.poll_cursor, due_in)])
        except INFRASTRUCTURE as exc:
            # The reply is stored (rule 10): the dispatcher's next step sends it.
            log.warning("the reply to %s is recorded; sending it met %s", op_id, describe_fault(exc))
            return StepOutcome(
                op_id, StepAction.INPUT_RECORDED, recorded.state, detail={"fault": describe_fault(exc)}
            )
        return outcome

    def _record_reply(
        self, op_id: uuid.UUID, input_round: int, response: Mapping[str, Any]
    ) -> Operation | StepOutcome:
        """The reply stored on the row as it is now (``input_rounds.record_reply``). A write that lost a race
        (the same reply delivered twice at once, a cancel, the deadline's hand-over, between the read and the
        write) is tried again on the row as the winner left it: answered as a repeat, or refused with its
        reason, rather than a stale write raised to the caller, who would take the answer for lost. Past
        :data:`REPLY_RACES` races in a row, the stale write is raised."""
        for _ in range(REPLY_RACES - 1):
            try:
                return input_rounds.record_reply(self.ctx, self.ledger.get(op_id), input_round, response)
            except StaleTransition:
                continue
        return input_rounds.record_reply(self.ctx, self.ledger.get(op_id), input_round, response)

    @_own_log_context
    def dispatch_due(self, limit: int | None = None) -> list[Dispatch]:
        """``longcall.dispatch_due``: claim what is due, as the messages to publish."""
        return dispatch.dispatch_due(self.ctx, limit)

    @_own_log_context
    def reconcile(self) -> dict[str, int]:
        """``longcall.reconcile``: overdue input rounds to an operator, overdue records flagged once."""
        return reconciliation.reconcile(self.ctx)

    @_own_log_context
    def resolve(self, op_id: uuid.UUID, resolution: Resolution) -> Operation:
        """An operator's decision on an operation in MANUAL_RECONCILIATION (``longcall reconcile``)."""
        return reconciliation.resolve(self.ctx, self.ledger.get(op_id), resolution)

    def _guard(self, op: Operation, cursor: int, step: Step) -> StepOutcome:
        """Run a step under the caller's claim, its lease renewed while it runs (rule 3); map a lost claim, a
        stale write and a missing token."""
        if op.poll_cursor != cursor:
            return StepOutcome(
                op.id, StepAction.SUPERSEDED, op.state, detail={"cursor": cursor, "now": op.poll_cursor}
            )
        not_owner = self._not_owner(op, cursor)
        if not_owner is not None:
            return not_owner
        fence = Fence(op.execution_epoch, op.cancel_generation, cursor)
        try:
            with keep_lease(self.ledger, op.id, fence, self.rt.settings.lease_s, lease_until=op.lease_until):
                return step(self.ctx, op, fence)
        except StaleTransition as stale:
            log.info("stale step on %s: %s", op.id, stale)
            return StepOutcome(op.id, StepAction.STALE, None, detail={"found": stale.found})
        except UnknownServer as unknown:
            return self._server_unconfigured(op, fence, unknown)
        except NoToken as no_token:
            return self._later(op, fence, no_token)
        except redis.RedisError as exc:
            # The buckets are out of reach (Redis restarting, failing over): no token can be had, so no
            # request is sent (rule 4), and the step is due again shortly, as without a token, instead of
            # failing and leaving its row to the dispatcher only when its lease runs out.
            log.warning("Redis failed during the step of %s (%s); it is due again shortly", op.id, exc)
            return self._later(op, fence, NoToken(REDIS_PAUSE_S))

    def _not_owner(self, op: Operation, cursor: int) -> StepOutcome | None:
        """Rule 13: a fleet that does not own the epoch sends nothing, whatever message it took (a step the
        owner's dispatcher claimed, taken from a shared broker; a submission it recorded for the owner). The
        claim goes back at once (its lease cleared, nothing else): the owner's next tick claims the row
        again instead of waiting out the lease. Answered from the control row as the step's own read of the
        operation saw it (no statement of its own)."""
        ownership = self.ledger.epoch_ownership(max_age_s=OWNER_SEEN_S, epoch=op.execution_epoch)
        if ownership.owns:
            return None
        self.ledger.hand_back_claim(op.id, cursor)
        self.rt.say_not_owner(ownership, f"the step of operation {op.id} is handed back to the owner")
        detail = {"epoch_owner": ownership.epoch_owner, "executor_id": ownership.executor_id}
        return StepOutcome(op.id, StepAction.NOT_OWNER, op.state, detail=detail)

    def _server_unconfigured(self, op: Operation, fence: Fence, unknown: UnknownServer) -> StepOutcome:
        """Rule 14: the step met a server this fleet's configuration does not name. An operation older than
        the configuration goes to an operator, or ends where nothing needs the server
        (``reconciliation.server_unconfigured``); a newer one is another fleet's, whose configuration names
        the server: left as it is (its lease runs out, that fleet's dispatcher claims it)."""
        if op.created_at >= self.rt.started_at:
            log.warning(
                "%s; operation %s is newer than this fleet: left to a fleet that names it", unknown, op.id
            )
            return StepOutcome(op.id, StepAction.UNKNOWN_SERVER, op.state, detail={"server": op.server})
        try:
            return reconciliation.server_unconfigured(self.ctx, self.ledger.get(op.id), fence)
        except StaleTransition as stale:
            return StepOutcome(op.id, StepAction.STALE, None, detail={"found": stale.found})

    def _later(self, op: Operation, fence: Fence, no_token: NoToken) -> StepOutcome:
        """Rescheduled in the state the row is in now: the step may have moved it before the refused request
        (an unknown create outcome looked up at once, a proved-safe resubmission made at once)."""
        try:
            return self.ctx.no_token(self.ledger.get(op.id, with_body=False), fence, no_token)
        except StaleTransition as stale:
            return StepOutcome(op.id, StepAction.STALE, None, detail={"found": stale.found})
