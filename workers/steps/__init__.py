"""The terminal-state protocol (DESIGN §5), one module per phase. No Celery here: the tasks call
:class:`workers.executor.Executor`, which runs these steps and hands back a typed outcome.

Steps flow one way; no module calls back into one that called it::

    submit          create, lookup by key (1, 2)   -> cancel.send, poll.observed, result.fetch
    cancel          the intent, the request (6)    -> poll.observed, result.accept, result.not_found
    poll            status reads (3)               -> input_rounds.ask_for_input, result.fetch, .not_found
    input_rounds    input rounds (10)
    result          fetch, accept, "not found" (7, 8, 11)
    reconciliation  overdue rounds and records, an operator's resolutions (11)
    dispatch        claims of due rows (3, 13)
    context         StepContext (runtime, clock, jitter, tokens, shared moves), StepOutcome: under all

Every step works under a claim (the operation's poll cursor) and writes through the ledger's named, guarded
moves with the full fence, so a step that lost its claim, or whose epoch or cancel generation moved on,
changes nothing. The ledger's ``next_poll_at`` drives all work: a step that cannot finish now (no token, a
transient failure, a server still working) schedules the operation again and returns; ``dispatch_due``
picks it up when it is due.
"""
