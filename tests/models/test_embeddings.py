"""Embeddings (LLM.embed) against transformers: the final hidden states (after the last norm) of
a tiny random Llama, pooled the same way (last token, mean, first token), normalized or not;
single and batched prompts, whole and chunked prefill, with a prefix-cache hit, batched in one
engine step with generating requests, and cut to matryoshka dimensions."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, PoolingParams, SamplingParams
from deepinfer.engine.admission import pooling_request, to_request
from tests.models.tiny_models import build_tiny_checkpoint

SHARED = [(7 * i + 3) % 500 + 2 for i in range(20)]   # longer than one 16-token block
PROMPTS = [SHARED + [11, 12, 13], SHARED + [40 + i for i in range(17)], [5, 6, 7], SHARED[:9], [42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("embed-llama"))
    model = build_tiny_checkpoint("llama", directory)
    return directory, model


def reference(model, prompt: list[int], kind: str, normalize: bool = True, dimensions: int | None = None):
    with torch.no_grad():
        states = model.model(torch.tensor([prompt])).last_hidden_state[0].float()
    vector = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[kind]
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def check(outputs, model, prompts, kind: str, normalize: bool = True, dimensions: int | None = None) -> None:
    for out, prompt in zip(outputs, prompts):
        ours = torch.tensor(out.outputs.embedding)
        ref = reference(model, prompt, kind, normalize, dimensions)
        assert ours.shape == ref.shape
        assert torch.nn.functional.cosine_similarity(ours, ref, dim=0).item() >= 0.9999
        if not normalize:   # the raw vector, not only its direction
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        assert out.prompt_token_ids == prompt and out.finished


def engine(directory: str, kind: str, budget: int = 2048, **kwargs) -> LLM:
    return LLM(directory, dtype="float32", max_num_batched_tokens=budget, num_kv_blocks=128,
               pooler_config={"pooling_type": kind, **kwargs.pop("pooler", {})}, **kwargs)


@pytest.mark.parametrize("budget", [2048, 8], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers(tiny, kind, budget):
    directory, model = tiny
    llm = engine(directory, kind, budget)
    check(llm.embed([list(p) for p in PROMPTS], use_tqdm=False), model, PROMPTS, kind)   # batched
    check(llm.embed(list(PROMPTS[1]), use_tqdm=False), model, PROMPTS[1:2], kind)        # single
    # Second pass over cached prefixes: LAST reuses them, MEAN and CLS compute every position.
    outputs = llm.embed([list(p) for p in PROMPTS], use_tqdm=False)
    check(outputs, model, PROMPTS, kind)
    if kind == "LAST":
        assert outputs[0].num_cached_tokens >= 16
    else:
        assert all(out.num_cached_tokens == 0 for out in outputs)
    assert not llm.engine.kv_manager.blocks_in_use(), "a finished embedding kept KV blocks"


def test_prefix_hit_from_generation_and_raw_vectors(tiny):
    """A prefix computed by a generating request is reused by a LAST embedding; without
    normalization the vector itself (not only its direction) matches."""
    directory, model = tiny
    llm = engine(directory, "LAST", pooler={"normalize": False})
    llm.generate([SHARED + [1, 2]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    out = llm.embed([SHARED + [99, 98, 97]], use_tqdm=False)
    assert out[0].num_cached_tokens >= 16
    check(out, model, [SHARED + [99, 98, 97]], "LAST", normalize=False)
    # The request's own normalize wins over the engine's.
    check(llm.embed([PROMPTS[2]], PoolingParams(normalize=True), use_tqdm=False), model, PROMPTS[2:3], "LAST")


def test_embeddings_batch_with_generation_in_one_step(tiny):
    """Pooling requests and generating ones share engine steps; neither changes the other."""
    directory, model = tiny
    llm = engine(directory, "MEAN")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate([list(p) for p in PROMPTS[:2]], params, use_tqdm=False)
    plans = []
    execute = llm.engine.executor.execute_model

    def recording(plan, *args, **kwargs):
        plans.append(plan)
        return execute(plan, *args, **kwargs)

    llm.engine.executor.execute_model = recording
    ids = [llm._add_request(None, list(p), params, 0, None) for p in PROMPTS[:2]]
    # Two more prompts to embed, added while the generating requests run their first step.
    first = llm._step()
    pooled = []
    for prompt in PROMPTS[2:4]:
        request_id = f"embed-{len(pooled)}"
        message = pooling_request(request_id, list(prompt), PoolingParams(), llm._facts)
        llm.output_processor.add_pooling_request(request_id, None, list(prompt))
        llm.engine.add_request(to_request(message, llm.config.cache.block_size))
        pooled.append(request_id)
    finished = {out.request_id: out for out in first if out.finished}
    while llm.engine.has_unfinished():
        finished.update({out.request_id: out for out in llm._step() if out.finished})
    mixed = [p for p in plans if {c.request_id for c in p.chunks} >= {*ids, *pooled}]
    assert mixed, "no step held both the generating and the pooling requests"
    assert any(c.sample for c in mixed[0].chunks) and not any(c.sample for c in mixed[0].chunks
                                                               if c.request_id in pooled)
    assert [finished[i].outputs[0].token_ids for i in ids] == [o.outputs[0].token_ids for o in alone]
    check([finished[i] for i in pooled], model, PROMPTS[2:4], "MEAN")


def test_matryoshka_dimensions(tiny):
    directory, model = tiny
    llm = engine(directory, "LAST", hf_overrides={"matryoshka_dimensions": [16, 32]})
    check(llm.embed([PROMPTS[0]], PoolingParams(dimensions=16), use_tqdm=False), model, PROMPTS[:1], "LAST",
          dimensions=16)
    with pytest.raises(ValueError, match="matryoshka dimensions"):
        llm.embed([PROMPTS[0]], PoolingParams(dimensions=20), use_tqdm=False)
    plain = engine(directory, "LAST")
    with pytest.raises(ValueError, match="does not support matryoshka"):
        plain.embed([PROMPTS[0]], PoolingParams(dimensions=16), use_tqdm=False)


def test_a_prompt_may_fill_the_context(tiny):
    """Nothing is generated after an embedded prompt: max_model_len tokens fit, one more does not."""
    directory, model = tiny
    llm = engine(directory, "LAST", max_model_len=32)
    prompt = [(3 * i) % 500 + 2 for i in range(32)]
    check(llm.embed([prompt], use_tqdm=False), model, [prompt], "LAST")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([prompt + [5]], use_tqdm=False)
    out = llm.embed([prompt + [5]], use_tqdm=False, truncate_prompt_tokens=32)
    check(out, model, [(prompt + [5])[-32:]], "LAST")


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_overlapped_loop(tiny, kind):
    """async_scheduling (the CUDA default): the next step is planned before a pooling request's
    last chunk is applied; it is not scheduled again, and its blocks are freed."""
    directory, model = tiny
    llm = engine(directory, kind, async_scheduling=True)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    for _ in range(2):   # the second pass over cached prefixes
        check(llm.embed([list(p) for p in PROMPTS], use_tqdm=False), model, PROMPTS, kind)
    assert not llm.engine.kv_manager.blocks_in_use()


def test_sliding_window_model(tmp_path):
    """Gemma 3 (sliding-window and global layers), chunked: the states of every layer kind."""
    model = build_tiny_checkpoint("gemma3", str(tmp_path))
    for kind in ("LAST", "MEAN"):
        llm = engine(str(tmp_path), kind, budget=8)
        check(llm.embed([list(p) for p in PROMPTS], use_tqdm=False), model, PROMPTS, kind)
