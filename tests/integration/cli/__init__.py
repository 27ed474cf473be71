"""The operator's ``longcall`` command on a real ledger: its commands and their errors, ``adapters`` with
both MCP generations, ``metrics``, the launch ``gate``, the simulation, and the refusals that keep an
operator from hiding an operation."""
