"""AIP-151: a plain 404 to the repeated create is not proof of "never created" (issue 19, item 4).

The create's answer is lost; the lookup (AIP-155: the create repeated with the same request id) meets a
plain-text 404 (a proxy, a wrong route: the demo server's ``plain_404_create``). Nothing is proved: the
operation goes to an operator (SUBMISSION_UNKNOWN), it is never resubmitted on that answer. Real Postgres and
Redis, longcall's AIP-151 demo server and an in-process executor.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from ledger.reasons import ReconciliationReason
from ledger.records import Fence
from ledger.states import OpState
from tests.support.aip_fleet import AIP_SERVER, AIP_TOOL, aip_config, args
from tests.support.aip_server import start_aip_server
from tests.support.fleet import in_process_runtime, step_until
from workers.executor import Executor
from workers.steps.reconciliation import Resolution
from workers.submission import validate_submission

S = OpState


def test_a_plain_404_to_the_repeated_create_goes_to_an_operator_not_to_never_created(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> None:
    aip = start_aip_server(log_dir)
    config = tmp_path / "longcall-aip.toml"
    config.write_text(aip_config(aip.root, poll_qps=5000, control_qps=5000))
    runtime = in_process_runtime(database_url, broker_prefix, config, lease_s=30)
    try:
        executor = Executor(runtime)
        aip.faults(lose_create_response=1, plain_404_create={"count": 1, "after": 1})
        new = validate_submission(
            {"call_node_id": "n/plain-404", "server": AIP_SERVER, "tool": AIP_TOOL, "arguments": args(600)},
            runtime.fleet,
            max_body_bytes=runtime.settings.max_body_bytes,
        )
        submission, _ = executor.submit(new)  # the create (answer lost), then its lookup at once
        op_id = submission.operation.id
        op = executor.ledger.get(op_id)
        kinds = [e["kind"] for e in executor.ledger.events(op_id)]
        records = executor.ledger.reconciliations_for(op_id)
        runs = [e for e in aip.log() if e["rpc"] == "RunReport"]
        operations = aip.operations()["operations"]
    finally:
        runtime.close()
        aip.stop()

    assert op.state is S.MANUAL_RECONCILIATION, kinds
    assert "never_created" not in kinds, kinds
    assert "resubmission" not in kinds, kinds
    assert [r.reason for r in records] == [ReconciliationReason.SUBMISSION_UNKNOWN]
    assert "404" in records[0].detail["why"], records[0].detail
    assert [e["status"] for e in runs] == [None, 404]  # the lost create, the plain 404 to its lookup
    assert len(operations) == 1  # the one the first create made, for the operator to find


def test_a_cancel_recorded_while_the_create_is_unknown_is_never_looked_up_by_creating_it(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> None:
    """The worker that recorded the create's attempt was killed before its request left: nothing is on the
    server. A cancel is then recorded. The lookup by key would repeat the create (AIP-155), which makes the
    operation when the first never arrived: a create after its cancel. So no lookup is made: an operator
    decides, and proved never created, the operation ends cancelled with no create at all."""
    aip = start_aip_server(log_dir)
    config = tmp_path / "longcall-aip.toml"
    config.write_text(aip_config(aip.root, poll_qps=5000, control_qps=5000))
    runtime = in_process_runtime(database_url, broker_prefix, config, lease_s=30)
    try:
        executor = Executor(runtime)
        new = validate_submission(
            {"call_node_id": "n/aip-cancel", "server": AIP_SERVER, "tool": AIP_TOOL, "arguments": args(600)},
            runtime.fleet,
            max_body_bytes=runtime.settings.max_body_bytes,
        )
        op = executor.ledger.record_submission(new).operation
        claim = executor.ledger.claim(op.id, lease_s=30)
        assert claim is not None
        fence = Fence(op.execution_epoch, op.cancel_generation, claim.poll_cursor)
        executor.ledger.record_create_attempt(op.id, fence, descriptor_version=None, detail={})
        # ... and the worker is killed here, before the create's request.
        executor.request_cancel(op.id)
        with executor.ledger.engine.begin() as conn:  # its lease ran out
            conn.execute(
                text("UPDATE tool_operation SET lease_until = now(), next_poll_at = now() WHERE id = :id"),
                {"id": op.id},
            )
        step_until(executor, op.id, S.MANUAL_RECONCILIATION, S.CANCEL_REQUESTED, S.CANCELLED_ACCEPTED)
        held = executor.ledger.get(op.id)
        records = executor.ledger.reconciliations_for(op.id)
        creates_before = [e for e in aip.log() if e["rpc"] == "RunReport"]
        assert (held.state, creates_before) == (S.MANUAL_RECONCILIATION, [])  # no lookup that creates

        executor.resolve(
            op.id, Resolution("never_created", evidence="no such operation on the server", actor="ops")
        )
        step_until(executor, op.id, S.CANCELLED_ACCEPTED)
        creates = [e for e in aip.log() if e["rpc"] == "RunReport"]
    finally:
        runtime.close()
        aip.stop()

    assert held.state is S.MANUAL_RECONCILIATION
    assert [r.reason for r in records] == [ReconciliationReason.SUBMISSION_UNKNOWN]
    assert "cancel" in records[0].detail["why"]
    assert creates_before == []
    assert creates == []  # no create, ever
