"""Executor control (rules 13, 14, and the rollout of issue 12): the single ``executor_control`` row, changed
by operators, every change audited in ``executor_control_audit`` (who: ``actor``, why: ``reason``) in the
same transaction, under the row's lock.

``executor_control.rollout`` holds the rollout (``workers/rollout.py`` reads it): ``canary_percent`` (absent
until a canary is first enabled: everything is routed) and ``shadow`` (shadow mode on or off).

``executor_control.epoch_owner`` names the executor identity that owns the current epoch (rule 13), set by
:meth:`ExecutorControlTransactions.bump_epoch`: a fleet of another identity claims nothing and writes nothing
under a claim (the statements compare it themselves: ``ledger.statements.owner_allows``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from ledger.guarded import GuardedWrites
from ledger.records import ControlState, EpochOwnership, adapter_key
from ledger.statements import (
    CONTROL,
    CONTROL_AUDIT,
    OP,
    STATEMENTS,
    literal_json,
    select_control,
    update_disabled_adapters,
)
from ledger.states import FINAL_STATES

#: The keys of ``executor_control.rollout``.
CANARY_PERCENT = "canary_percent"
SHADOW = "shadow"


@dataclass(frozen=True, slots=True)
class ControlChange:
    """One ``executor_control_audit`` row: who changed what, why, and the control row before and after."""

    id: int
    at: dt.datetime
    actor: str
    action: str
    reason: str | None
    before: Any
    after: Any

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"at": self.at.isoformat()}


def read_control(conn: Connection) -> ControlState:
    """The control row as the caller's transaction sees it."""
    row = conn.execute(STATEMENTS.get(select_control)).one()
    return ControlState(
        execution_epoch=row.execution_epoch,
        admission_open=row.admission_open,
        disabled_adapters=tuple(row.disabled_adapters),
        rollout=dict(row.rollout),
        epoch_owner=row.epoch_owner,
    )


class ExecutorControlTransactions(GuardedWrites):
    """The control transactions of ``Ledger``."""

    #: What this ledger last saw of the control row's epoch and owner, and when (``time.monotonic()``).
    _ownership_seen: tuple[float, EpochOwnership] | None = None

    def control(self) -> ControlState:
        with self._tx() as conn:
            control = read_control(conn)
        self._saw_ownership(control.execution_epoch, control.epoch_owner)
        return control

    def epoch_ownership(self, *, max_age_s: float = 0.0, epoch: int | None = None) -> EpochOwnership:
        """Who owns the current execution epoch, and whether this ledger's fleet (``executor_id``) is it
        (rule 13): the control row read now (one statement). With ``max_age_s``: what a statement of this
        ledger read of the control row within that many seconds, when there is one (``get`` reads it with
        the operation's row, so a step's own read answers at no cost), unless that was of an epoch older
        than ``epoch`` (the epoch of an operation read since: the control row moved on meanwhile).

        The fence itself is in every claim and every write under a claim; this is what a step, or an input
        reply about to be sent, asks before it sends anything to a server."""
        seen = self._ownership_seen
        if (
            seen is not None
            and max_age_s > 0
            and time.monotonic() - seen[0] <= max_age_s
            and (epoch is None or seen[1].execution_epoch >= epoch)
        ):
            return seen[1]
        with self._one_statement() as conn:
            row = conn.execute(STATEMENTS.get(select_control)).one()
        return self._saw_ownership(row.execution_epoch, row.epoch_owner)

    def owns_epoch(self, *, max_age_s: float = 0.0, epoch: int | None = None) -> bool:
        """Whether this ledger's fleet may claim and write in the current epoch (see
        :meth:`epoch_ownership`): the control row names no owner, or names this ledger's ``executor_id``,
        or this ledger names none."""
        return self.epoch_ownership(max_age_s=max_age_s, epoch=epoch).owns

    def _saw_ownership(self, epoch: int, owner: str | None) -> EpochOwnership:
        ownership = EpochOwnership(epoch, owner, self.executor_id)
        self._ownership_seen = (time.monotonic(), ownership)  # one assignment: a thread sees old or new
        return ownership

    def set_admission(self, *, open_: bool, actor: str, reason: str | None = None) -> ControlState:
        return self._change_control(actor, "set_admission", {"admission_open": open_}, reason=reason)

    def set_canary_percent(
        self, percent: float, *, actor: str, reason: str | None = None, action: str = "set_canary_percent"
    ) -> ControlState:
        """The share of call nodes routed to longcall (``workers/rollout.py``); whether the launch gate
        allows a raise is the caller's decision (``longcall rollout --percent``), ``action`` says how it
        was taken (e.g. ``force_canary_percent``)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"a canary percentage is within 0..100, not {percent}")
        return self._change_control(actor, action, _rollout_patch({CANARY_PERCENT: percent}), reason=reason)

    def set_shadow(self, *, on: bool, actor: str, reason: str | None = None) -> ControlState:
        """Shadow mode on or off: side-effect-free tools' calls that are not routed live run in shadow."""
        return self._change_control(
            actor, "shadow_on" if on else "shadow_off", _rollout_patch({SHADOW: on}), reason=reason
        )

    def control_history(self, *, limit: int = 100) -> list[ControlChange]:
        """The audit of control changes, newest first."""
        with self._tx() as conn:
            rows = conn.execute(select(CONTROL_AUDIT).order_by(CONTROL_AUDIT.c.id.desc()).limit(limit)).all()
        return [ControlChange(r.id, r.at, r.actor, r.action, r.reason, r.before, r.after) for r in rows]

    def bump_epoch(self, *, actor: str, reason: str | None = None, owner: str | None = None) -> ControlState:
        """Rule 13: the next execution epoch, owned by the executor identity ``owner`` (None: by every
        fleet), and every operation not final yet taken over into it in the same transaction. From the commit
        on, a step of the old epoch still in flight (its fence names the old epoch) moves no row and has no
        receipt accepted: its write is refused as stale. Each guarded statement also compares its epoch with
        the control row's, so a row the take-over could not see (one inserted by a transaction still open)
        is fenced too; a claim takes such a row over. A fleet of another identity than ``owner`` claims
        nothing from then on, and a write it makes under a claim is refused: the rolled-back fleet is fenced
        for good, not only its steps in flight."""
        return self._change_control(
            actor,
            "bump_epoch",
            {"execution_epoch": CONTROL.c.execution_epoch + 1, "epoch_owner": owner},
            take_over=True,
            reason=reason,
        )

    def set_adapter_disabled(
        self, protocol: str, protocol_version: str, *, disabled: bool, actor: str, reason: str | None = None
    ) -> ControlState:
        """Refuse (or admit again) new operations for one adapter. The list is changed by the update itself,
        under the control row's lock, so two operators disabling two adapters at once both get theirs."""
        return self._change_control(
            actor,
            "disable_adapter" if disabled else "enable_adapter",
            {
                "disabled_adapters": update_disabled_adapters(
                    adapter_key(protocol, protocol_version), disabled
                )
            },
            reason=reason,
        )

    def _change_control(
        self,
        actor: str,
        action: str,
        values: Mapping[str, Any],
        *,
        take_over: bool = False,
        reason: str | None = None,
    ) -> ControlState:
        with self._tx() as conn:
            before = conn.execute(select(CONTROL).where(CONTROL.c.id == 1).with_for_update()).one()
            conn.execute(update(CONTROL).where(CONTROL.c.id == 1).values(**values, updated_at=func.now()))
            after = read_control(conn)
            if take_over:
                conn.execute(
                    update(OP)
                    .where(
                        OP.c.state.not_in([s.value for s in FINAL_STATES]),
                        OP.c.execution_epoch < after.execution_epoch,
                    )
                    .values(execution_epoch=after.execution_epoch)
                )
            conn.execute(
                insert(CONTROL_AUDIT).values(
                    actor=actor,
                    action=action,
                    reason=reason,
                    before=_control_json(dict(before._mapping)),
                    after=dataclasses.asdict(after) | {"disabled_adapters": list(after.disabled_adapters)},
                )
            )
        self._saw_ownership(after.execution_epoch, after.epoch_owner)
        return after


def _control_json(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "execution_epoch": mapping["execution_epoch"],
        "admission_open": mapping["admission_open"],
        "disabled_adapters": list(mapping["disabled_adapters"]),
        "rollout": dict(mapping["rollout"]),
        "epoch_owner": mapping["epoch_owner"],
    }


def _rollout_patch(patch: Mapping[str, Any]) -> dict[str, Any]:
    """``rollout`` with ``patch``'s keys replaced, computed by the UPDATE from the row it locked (two
    operators changing two keys at once both get theirs)."""
    return {"rollout": CONTROL.c.rollout.op("||")(literal_json(patch))}
