"""The engine core: admission, the scheduler, the busy loop (the types it shares are in deepinfer/types/).

    admission.py     one user request -> the core's requests (n fan-out, max_tokens, cache salt)
    scheduler.py     one token-budget rule -> a plan; applies the result
    core.py          the busy loop over an executor (executor/)
    core_proc.py     the core in its own process, behind ZMQ
"""
