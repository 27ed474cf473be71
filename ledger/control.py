"""Executor control (rules 13, 14): the single ``executor_control`` row, changed by operators, every change
audited in ``executor_control_audit`` in the same transaction, under the row's lock."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from ledger.guarded import GuardedWrites
from ledger.records import ControlState, adapter_key
from ledger.statements import (
    CONTROL,
    CONTROL_AUDIT,
    OP,
    STATEMENTS,
    select_control,
    update_disabled_adapters,
)
from ledger.states import FINAL_STATES


def read_control(conn: Connection) -> ControlState:
    """The control row as the caller's transaction sees it."""
    row = conn.execute(STATEMENTS.get(select_control)).one()
    return ControlState(
        execution_epoch=row.execution_epoch,
        admission_open=row.admission_open,
        disabled_adapters=tuple(row.disabled_adapters),
        rollout=dict(row.rollout),
    )


class ExecutorControlTransactions(GuardedWrites):
    """The control transactions of ``Ledger``."""

    def control(self) -> ControlState:
        with self._tx() as conn:
            return read_control(conn)

    def set_admission(self, *, open_: bool, actor: str) -> ControlState:
        return self._change_control(actor, "set_admission", {"admission_open": open_})

    def bump_epoch(self, *, actor: str) -> ControlState:
        """Rule 13: the next execution epoch, and every operation not final yet taken over into it in the
        same transaction. From the commit on, a step of the old epoch still in flight (its fence names the
        old epoch) moves no row and has no receipt accepted: its write is refused as stale. Each guarded
        statement also compares its epoch with the control row's, so a row the take-over could not see (one
        inserted by a transaction still open) is fenced too; a claim takes such a row over."""
        return self._change_control(
            actor, "bump_epoch", {"execution_epoch": CONTROL.c.execution_epoch + 1}, take_over=True
        )

    def set_adapter_disabled(
        self, protocol: str, protocol_version: str, *, disabled: bool, actor: str
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
        )

    def _change_control(
        self, actor: str, action: str, values: Mapping[str, Any], *, take_over: bool = False
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
                    before=_control_json(dict(before._mapping)),
                    after=dataclasses.asdict(after) | {"disabled_adapters": list(after.disabled_adapters)},
                )
            )
            return after


def _control_json(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "execution_epoch": mapping["execution_epoch"],
        "admission_open": mapping["admission_open"],
        "disabled_adapters": list(mapping["disabled_adapters"]),
        "rollout": dict(mapping["rollout"]),
    }
