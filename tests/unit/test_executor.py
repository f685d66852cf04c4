"""The executor seam: chosen by distributed_executor_backend, the only way the core reaches the
runner, and the plans it is handed are final values (nothing is added to them after schedule())."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ParallelConfig
from deepinfer.executor import executor_class
from deepinfer.executor.uniproc import UniProcExecutor
from deepinfer.sampling_params import StructuredOutputsParams
from deepinfer.types.plan import GrammarOutput

KW = {"dtype": "float32", "num_kv_blocks": 256, "block_size": 4}
PROMPTS = [[(7 * i + j) % 500 + 2 for j in range(6 + 5 * i)] for i in range(3)]


def test_the_backend_picks_the_executor():
    from deepinfer.executor.multiproc import MultiprocExecutor
    from deepinfer.executor.ray_executor import RayExecutor

    assert executor_class(ParallelConfig()) is UniProcExecutor
    assert executor_class(ParallelConfig(distributed_executor_backend="uni")) is UniProcExecutor
    assert executor_class(ParallelConfig(tensor_parallel_size=2)) is MultiprocExecutor   # vLLM's default
    assert executor_class(ParallelConfig(distributed_executor_backend="mp")) is MultiprocExecutor
    assert executor_class(ParallelConfig(distributed_executor_backend="ray")) is RayExecutor
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        ParallelConfig(distributed_executor_backend="threads")


def test_mp_with_one_rank_is_the_in_process_runner(tiny_llama):
    """mp at one rank starts no process: rank 0 is the engine core's own runner, as uni's."""
    llm = LLM(tiny_llama, distributed_executor_backend="mp", **KW)
    assert isinstance(llm.engine.executor, UniProcExecutor) and llm.engine.executor.ranks == []
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want = LLM(tiny_llama, **KW).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_the_plain_loop_steps_through_the_executor(tiny_llama):
    llm = LLM(tiny_llama, async_scheduling=False, **KW)
    assert not hasattr(llm.engine, "runner")
    executor, calls = llm.engine.executor, []
    for name in ("execute_model", "sample_tokens", "collect"):
        method = getattr(executor, name)
        setattr(executor, name, lambda *args, _name=name, _method=method: (calls.append(_name), _method(*args))[1])
    try:
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        del executor.execute_model, executor.sample_tokens, executor.collect
    assert calls and calls == ["execute_model", "sample_tokens", "collect"] * (len(calls) // 3)
    assert executor.kv_cache_config.num_blocks == 256 == llm.engine.num_kv_blocks


@pytest.mark.parametrize("overlapped", [False, True], ids=["plain", "overlapped"])
def test_the_plan_is_final_when_schedule_returns(tiny_llama, overlapped):
    """With grammar rows in the batch (their masks fill beside the forward), every plan is, when
    schedule() returns, what the runner later gets: picklable (no Future or lock in it) and
    byte for byte the same after its step; the masks reach sampling apart, as a value."""
    llm = LLM(tiny_llama, async_scheduling=overlapped, **KW)
    engine = llm.engine
    plans, grammars = [], []
    schedule, sample_tokens = engine.scheduler.schedule, engine.executor.sample_tokens

    def recording_schedule(**kwargs):
        plan = schedule(**kwargs)
        plans.append((plan, pickle.dumps(plan)))
        return plan

    def recording_sample_tokens(forward, grammar):
        grammars.append(grammar)
        return sample_tokens(forward, grammar)

    engine.scheduler.schedule, engine.executor.sample_tokens = recording_schedule, recording_sample_tokens
    constrained = SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(regex="(w5w7|w12){1,3}"))
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        llm.generate(PROMPTS, [constrained, free, constrained], use_tqdm=False)
    finally:
        del engine.scheduler.schedule, engine.executor.sample_tokens
    assert len(plans) > 3 and all(pickle.dumps(plan) == raw for plan, raw in plans)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plans[0][0].chunks = []
    masks = [g for g in grammars if g is not None]
    assert masks and all(isinstance(g, GrammarOutput) and isinstance(g.bitmask, torch.Tensor) for g in masks)
    pickle.dumps(masks)   # a finished value, ready to cross to another process


def test_a_draft_model_shares_the_target_kv_budget(tiny_llama):
    """The draft model takes as many KV blocks as the target and loads after the target's pool
    is sized: the pool is sized for both, so the two together stay inside the budget (on the
    CPU, cpu_kv_cache_bytes; a GPU also keeps room for the draft's weights)."""
    from deepinfer.platforms import current_platform

    if current_platform().name != "cpu":
        pytest.skip("the CPU's KV budget is a fixed number of bytes; a GPU's follows its free memory")
    budget = 1 << 20
    kw = {**{k: v for k, v in KW.items() if k != "num_kv_blocks"}, "cpu_kv_cache_bytes": budget}
    plain = LLM(tiny_llama, max_model_len=64, **kw)
    target_block = plain.engine.executor.runner.bytes_per_block
    assert plain.engine.num_kv_blocks == budget // target_block
    llm = LLM(tiny_llama, max_model_len=64, speculative_config={"method": "draft_model", "model": tiny_llama}, **kw)
    draft_block = llm.engine.spec.drafter.executor.runner.bytes_per_block
    assert llm.engine.num_kv_blocks == budget // (target_block + draft_block)
    assert llm.engine.spec.drafter.executor.kv_cache_config.num_blocks == llm.engine.num_kv_blocks


def test_a_draft_model_gets_its_executor_from_the_same_factory(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=64, speculative_config={"method": "draft_model", "model": tiny_llama,
                                                                "verification": "fixed", "num_speculative_tokens": 2},
              **KW)
    draft = llm.engine.spec.drafter.executor
    assert isinstance(draft, UniProcExecutor) and draft is not llm.engine.executor
    assert draft.kv_cache_config.num_blocks == llm.engine.num_kv_blocks
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert llm.spec_decode_stats.num_accepted_tokens > 0   # the target drafting for itself
