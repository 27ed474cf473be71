"""The ten-thousand-series simulation (issue 12): seeded, ordered event series run through the real executor
steps against the real ledger (Postgres) and Redis, with each series' server scripted at the wire (an
``httpx2.MockTransport`` answering in the protocol's own JSON, so the real adapters parse it), and an oracle
that derives each series' one correct outcome from the generated timeline alone.

    series       the generator: a :class:`~console.simulation.series.Series` per (seed, index)
    servers      the scripted servers (MCP 2025-11-25, AIP-151) behind a MockTransport, and their base
    servers_ext  the MCP tasks extension's scripted server (2026-07-28), on the same base
    oracle       the expected outcome of a series, from its timeline and actions only
    runner       the driver: each series' server, one executor step per tick, client actions and delivery
                 effects, the checks
    environment  a run's own database and Redis prefix, the series spread over processes
    command      ``longcall gate simulate``
"""
