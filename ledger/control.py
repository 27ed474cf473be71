"""Executor control (rules 13, 14): the single ``executor_control`` row, changed by operators, every change
audited in ``executor_control_audit`` in the same transaction, under the row's lock."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from ledger.guarded import GuardedWrites
from ledger.records import ControlState, adapter_key
from ledger.statements import CONTROL, CONTROL_AUDIT, STATEMENTS, select_control, update_disabled_adapters


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
        return self._change_control(actor, "bump_epoch", {"execution_epoch": CONTROL.c.execution_epoch + 1})

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

    def _change_control(self, actor: str, action: str, values: Mapping[str, Any]) -> ControlState:
        with self._tx() as conn:
            before = conn.execute(select(CONTROL).where(CONTROL.c.id == 1).with_for_update()).one()
            conn.execute(update(CONTROL).where(CONTROL.c.id == 1).values(**values, updated_at=func.now()))
            after = read_control(conn)
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
