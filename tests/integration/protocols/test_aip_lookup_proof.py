"""AIP-151: a plain 404 to the repeated create is not proof of "never created" (issue 19, item 4).

The create's answer is lost; the lookup (AIP-155: the create repeated with the same request id) meets a
plain-text 404 (a proxy, a wrong route: the demo server's ``plain_404_create``). Nothing is proved: the
operation goes to an operator (SUBMISSION_UNKNOWN), it is never resubmitted on that answer. Real Postgres and
Redis, longcall's AIP-151 demo server and an in-process executor.
"""

from __future__ import annotations

from pathlib import Path

from ledger.reasons import ReconciliationReason
from ledger.states import OpState
from tests.support.aip_fleet import AIP_SERVER, AIP_TOOL, aip_config, args
from tests.support.aip_server import start_aip_server
from tests.support.fleet import in_process_runtime
from workers.executor import Executor
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
