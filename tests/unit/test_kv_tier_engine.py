"""The host KV tier through the whole engine: a prefix evicted from the device pool is loaded
back from host memory instead of recomputed, with identical results; requests waiting for KV do
not block others; an abort while loading frees everything; sliding-window KV never reaches the
tier; a salt isolates tenants in the tier too."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.admission import EngineFacts, child_requests, to_request
from deepinfer.types.request import RequestStatus
from tests.models.tiny_models import build_tiny_checkpoint

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
PROMPT = [(5 * i + 3) % 500 + 2 for i in range(100)]            # 6 full blocks
FILLERS = [[(7 * i + 11 * k) % 500 + 2 for i in range(100)] for k in range(1, 6)]


def tiered(directory: str, **kwargs) -> LLM:
    # 24 blocks: one request (7 blocks) at a time plus little cache, so fillers evict the prompt.
    return LLM(directory, dtype="float32", num_kv_blocks=24, max_model_len=256, kv_offloading_size=0.01, **kwargs)


def evict(llm: LLM) -> None:
    for filler in FILLERS:
        llm.generate([filler], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)


def test_evicted_prefix_is_loaded_from_the_host_tier_with_identical_results(tiny_llama):
    plain = LLM(tiny_llama, dtype="float32", num_kv_blocks=24, max_model_len=256)
    expected = plain.generate([PROMPT + [9]], GREEDY, use_tqdm=False)[0]
    llm = tiered(tiny_llama)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    evict(llm)
    assert llm.engine.kv_manager.find_prefix_hit(_request(llm, PROMPT + [9])).num_computed_tokens == 0
    out = llm.generate([PROMPT + [9]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 96                       # 6 blocks, from the tier
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    for ours, ref in zip(out.outputs[0].logprobs, expected.outputs[0].logprobs):
        for token_id, logprob in ref.items():
            assert ours[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-5)
    tier = llm.engine.stats().kv_tier
    assert tier["hits"] == 96 and tier["loaded_blocks"] == 6 and tier["saved_blocks"] > 0
    assert tier["queries"] >= 96 * 2   # asked for the prompt and each filler; only the follow-up hit
    assert llm.engine.kv_manager.blocks_in_use() == {}


def _request(llm: LLM, tokens: list[int], request_id: str = "probe", salt: str | None = None):
    facts = EngineFacts(llm.model_id, llm.max_model_len, llm.eos_token_ids)
    message = child_requests(request_id, tokens, SamplingParams(temperature=0, max_tokens=4), facts,
                             cache_salt=salt)[0]
    request = to_request(message, BS)
    request.hash_root = llm.engine.kv_manager.hash_root
    return request


def test_waiting_for_kv_does_not_block_others_and_abort_frees_everything(tiny_llama):
    llm = tiered(tiny_llama)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    evict(llm)
    core, scheduler = llm.engine, llm.engine.scheduler
    core.add_request(_request(llm, PROMPT + [9], "loading"))
    core.add_request(_request(llm, [3, 4, 5], "other"))
    plan = scheduler.schedule()
    loading = scheduler.requests["loading"]
    assert loading.status is RequestStatus.WAITING_FOR_KV and plan.kv_connector_metadata.loads
    assert [c.request_id for c in plan.chunks] == ["other"]   # admitted while the load is parked
    executor = core.executor
    scheduler.update(plan, executor.collect(executor.sample_tokens(executor.execute_model(plan), None)))
    # Abort while the load is with the worker: its blocks stay parked until the copy is reported,
    # then everything is freed.
    scheduler.abort(["loading"])
    assert "loading" not in scheduler.requests
    while core.has_unfinished():
        core.step()
    assert core.kv_manager.blocks_in_use() == {}
    assert not core.kv_tier.busy


def test_salted_requests_never_hit_another_tenants_tier_entries(tiny_llama):
    llm = tiered(tiny_llama)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    evict(llm)
    lookup = llm.engine.kv_tier.lookup
    assert lookup(_request(llm, PROMPT + [9]).block_hashes, 0) == 6
    assert lookup(_request(llm, PROMPT + [9], salt="tenant-b").block_hashes, 0) == 0


def test_sliding_window_kv_never_reaches_the_tier(tmp_path):
    directory = str(tmp_path / "gemma3")
    build_tiny_checkpoint("gemma3", directory, sliding_window=16)
    llm = LLM(directory, dtype="float32", num_kv_blocks=512, max_model_len=256, kv_offloading_size=0.01)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    tier = llm.engine.stats().kv_tier
    full_groups = [g for g in llm.engine.kv_manager.groups if g.spec.persisted]
    assert tier["saved_blocks"] == 6 * len(full_groups) and tier["refused_saves"] == 0
