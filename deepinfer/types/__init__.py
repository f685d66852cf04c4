"""The types every layer shares, at the bottom of the tree.

    plan.py          the typed boundary between the scheduler and the runner (read first):
                     SchedulerPlan, RunnerResult, the KV connector's transfers, EngineCoreOutput, EngineStats
    request.py       the one object that carries a request's state through the engine core
    block_tables.py  block tables as the runner holds them: diffs out, updates in
    block_hashes.py  the chained content hashes of full KV blocks (prefix caching, the KV store, the router)
    traffic_class.py a request's traffic class (KV store retention)
    tier_stats.py    the KV tier's counters and latency histograms
    spec_stats.py    speculative decoding's acceptance counters
    drafter.py       the drafter protocol: Draft, DraftRequest, Drafter

Nothing here imports a module of deepinfer outside this package except the user-facing vocabulary
that itself imports none (config, sampling_params, outputs); tests/unit/test_structure_guards.py
keeps it so.
"""
