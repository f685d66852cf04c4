"""LoRA adapters with tensor parallelism on the CPU (gloo, the `mp` executor's rank processes): each
rank keeps its slice of every adapter (lora/slots.py rank_part: column-parallel projections their
rows of B, row-parallel ones their columns of A), and a mixed batch of adapters and the base model
gives transformers + PEFT's greedy tokens, as on one rank; with max_loras below the adapters in
use, slots are reused the same way on every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from tests.unit.test_lora_engine import GREEDY, PROMPTS, adapters, base_model, greedy, make_llm, tokens  # noqa: E402,F401


@pytest.mark.parametrize("max_loras", [4, 2])
def test_two_ranks_give_pefts_tokens(tiny_llama, adapters, base_model, max_loras):  # noqa: F811
    loras = [lora for lora, _ in adapters] + [None]
    want = [greedy(model if model is not None else base_model, prompt)
            for (_, model), prompt in zip(adapters + [(None, None)], PROMPTS)]
    llm = make_llm(tiny_llama, max_loras=max_loras, tensor_parallel_size=2, enable_prefix_caching=False)
    try:
        got = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=loras,
                                  use_tqdm=False))
    finally:
        llm.engine.shutdown()
    assert got == want
