"""The scheduler's one rule, driven with fake runner results (no model)."""

from __future__ import annotations

import torch

from deepinfer.config import SchedulerConfig
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.specs import FullAttentionSpec, group_layers
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.plan import RunnerResult
from deepinfer.types.request import Request

BS = 4


def make_scheduler(num_blocks=64, **config) -> Scheduler:
    manager = KVCacheManager(group_layers([FullAttentionSpec(1, 4, torch.float32)]), num_blocks, BS)
    limits = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}
    return Scheduler(SchedulerConfig(**{**limits, **config}), manager, max_model_len=256)


def make_request(rid: str, n_prompt: int, max_tokens: int = 4, priority: int = 0) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), frozenset({0}),
                   max_tokens, priority=priority, block_size=BS)


def run_step(scheduler: Scheduler, token: int = 5):
    plan = scheduler.schedule()
    result = RunnerResult({c.request_id: [token] for c in plan.chunks if c.sample})
    return plan, scheduler.update(plan, result)


def test_budget_chunks_prefill_and_mixes_with_decode():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 20))
    plan, _ = run_step(scheduler)
    assert [(c.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [("a", 3, True), ("b", 5, False)]
    plan, _ = run_step(scheduler)
    # One rule: a decodes (1 token) while b continues its prompt with the rest of the budget.
    assert [(c.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("a", 3, 1), ("b", 5, 7)]
    assert all(p.num_scheduled_tokens <= 8 for p in [plan])


def test_max_num_seqs_limits_running():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(make_request(str(i), 3))
    plan, _ = run_step(scheduler)
    assert len(plan.chunks) == 2 and scheduler.num_waiting == 2


def test_finishes_on_eos_and_max_tokens_and_frees_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=2))
    _, outputs = run_step(scheduler)
    assert outputs[0].new_token_ids == [5] and not outputs[0].finished
    _, outputs = run_step(scheduler)
    assert outputs[0].finish_reason == "length"
    scheduler.add_request(make_request("b", 3))
    _, outputs = run_step(scheduler, token=0)    # 0 is EOS
    assert outputs[0].finish_reason == "stop"
    assert scheduler.kv.usage() == 0.0 and not scheduler.has_unfinished()


def test_preemption_when_blocks_run_out_then_resume():
    # 5 usable blocks of 4 tokens; two requests of 8 prompt tokens each need 2 blocks, then a third.
    scheduler = make_scheduler(num_blocks=6)
    scheduler.add_request(make_request("a", 8, max_tokens=8))
    scheduler.add_request(make_request("b", 8, max_tokens=8))
    seen_preemption = False
    for _ in range(40):
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
        seen_preemption |= scheduler.num_preemptions > 0
    assert seen_preemption and not scheduler.has_unfinished()
    assert scheduler.kv.usage() == 0.0


def test_priority_policy_admits_and_keeps_lower_values_first():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("low", 3, priority=5))
    scheduler.add_request(make_request("high", 3, priority=-1))
    plan, _ = run_step(scheduler)
    assert [c.request_id for c in plan.chunks] == ["high"]


def test_abort_frees_blocks_and_tells_the_runner():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=50))
    run_step(scheduler)
    assert scheduler.kv.usage() > 0
    outputs = scheduler.abort(["a"])
    assert outputs[0].finish_reason == "abort" and scheduler.kv.usage() == 0.0
    assert scheduler.schedule().finished_request_ids == ["a"]
    assert scheduler.abort(["unknown"]) == []
