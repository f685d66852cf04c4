"""Speculative decoding, the worker's side: what the model runner does with a plan's drafts.

The scheduler's side (spec_decode/) decides which drafts a step verifies; they reach the runner
as a chunk's `spec_token_ids` (and a plan's `verify_chain`), and the verdicts go back in the
RunnerResult. Nothing here sees a `Request`.

    draft_verification.py  a step's verify rows: the target's logits after each draft prefix ->
                           the accepted tokens (spec_decode/verifier.py's rule), greedy verdicts
                           taken at collect
    verify_chain.py        several verify steps of one plan back to back on the device, drafting
                           between them (chain_drafters.py)
    chain_drafters.py      the drafts of a chain's later steps, on the device: n-gram lookup
                           (device_ngram.py) or a replay recording's table
    device_ngram.py        the n-gram prompt lookup in batched torch ops, without a host sync
    draft_model_memory.py  the draft model's weights and KV per block, for sizing the KV pool

The runner reaches these through `SpeculativeMethod` (spec_decode/method.py), resolved once.
"""
