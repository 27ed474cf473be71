"""The executor and its steps: the terminal-state protocol end to end, a step's bounds and claims, the
outbox a step drains, the lease keeper, the hot Redis state (token buckets, the cancel CAS), the request
meter and what a charge costs, the poll budget measured at the server, reconciliation, a resubmission's
claim, and a poll that never reads the arguments."""
