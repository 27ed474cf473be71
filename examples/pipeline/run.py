"""Submit one report call from the example pipeline (``examples/pipeline/app.py``) and print longcall's
answer to the submission; the report's receipt then reaches ``pipeline.publish_report`` and
``pipeline.archive`` on the pipeline's worker, once::

    python -m examples.pipeline.run run-42/monthly-report --month 2026-11
"""

from __future__ import annotations

import argparse
import json

from celery import chain

from examples.pipeline.app import app, archive, publish_report
from workers import client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("call_node_id", help="the pipeline's id for this step (the same id never runs twice)")
    parser.add_argument("--server", default="reports", help="a server of the fleet's LONGCALL_CONFIG")
    parser.add_argument("--month", default="2026-11", help="the report's month")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long the demo report runs")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for longcall's answer")
    args = parser.parse_args(argv)
    call = client.call(
        args.call_node_id,
        server=args.server,
        tool="slow_report",
        arguments={"month": args.month, "seconds": args.seconds},
        then=chain(publish_report.s(), archive.s()),
        app=app,
    )
    answer = call.apply_async().get(timeout=args.timeout)
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
