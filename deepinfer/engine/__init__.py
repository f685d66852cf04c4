"""The engine core: requests, admission, the scheduler, the typed plan/result boundary, the busy loop.

    admission.py     one user request -> the core's requests (n fan-out, max_tokens, cache salt)
    request.py       one object per request
    plan.py          the typed boundary types (read first)
    block_tables.py  block tables as the runner holds them: diffs out, updates in
    scheduler.py     one token-budget rule -> a plan; applies the result
    core.py          the busy loop over an executor (executor/)
    core_proc.py     the core in its own process, behind ZMQ
"""
