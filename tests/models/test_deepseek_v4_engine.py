"""DeepSeek-V4 through the engine (LLM, paged KV, scheduler) against transformers' deepseek_v4,
float32, on the tiny random configs of test_deepseek_v4_layers.py: greedy tokens identical and
top-5 logprobs close for several prompts in one batch, with chunked prefill cutting compression
blocks, with prefix-cache hits that end on block boundaries (the compressor state comes from the
pages' tails), and after preemption. On the CPU this is the reference path (paged.py); on a GPU
the Triton kernels' (paged_kernels.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from test_deepseek_v4_layers import make_config, prompt, randomize  # noqa: E402
from transformers import DeepseekV4ForCausalLM  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.deepseek_v4 import V4ForCausalLM  # noqa: E402

NEW_TOKENS = 32
LENGTHS = (40, 75, 200)
CASES = [("r4_16", 0), ("r4_16", 1), ("r2_8", 0), ("r2_8", 2)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-seed{n}" for s, n in CASES])
def checkpoint(request, tmp_path_factory):
    """(directory of a checkpoint in transformers' module names, the transformers model, config, seed)."""
    shape, seed = request.param
    directory = tmp_path_factory.mktemp(f"v4-{shape}-{seed}")
    return (str(directory), *write_checkpoint(str(directory), shape, seed), seed)


def write_checkpoint(directory: str, shape: str, seed: int):
    """A random transformers V4 model of a tiny shape, saved into `directory`: (model, config)."""
    cfg = make_config(shape)
    torch.manual_seed(seed)
    hf = DeepseekV4ForCausalLM(cfg).eval()
    randomize(hf, seed, cfg)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**cfg.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}, f)
    return hf, cfg


@torch.no_grad()
def hf_greedy(hf, ids: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation, and the log-probabilities at each generated position
    from one forward over prompt + continuation (computed once per model and prompt: kept on
    the model object, which lives as long as its fixture)."""
    memo = hf.__dict__.setdefault("_greedy_memo", {})
    key = (tuple(ids), new_tokens)
    if key not in memo:
        memo[key] = _hf_greedy(hf, ids, new_tokens)
    return memo[key]


def _hf_greedy(hf, ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    x = torch.tensor([ids])
    hf.generation_config.eos_token_id = None
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=0)[0, len(ids):].tolist()
    logits = hf(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
    return out, torch.log_softmax(logits.float(), dim=-1)


def engine(directory: str, **kwargs) -> LLM:
    options = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=320, num_kv_blocks=160,
                   enforce_eager=True)
    llm = LLM(directory, **{**options, **kwargs})
    runner = llm.engine.executor.runner
    if runner.device.type == "cuda":   # the GPU's default backend: the Triton kernels (paged_kernels.py)
        assert runner.attention_backend.kernels
    return llm


def check(outputs, prompts, hf) -> None:
    for ids, out in zip(prompts, outputs):
        want, logprobs = hf_greedy(hf, ids)
        got = out.outputs[0]
        assert got.token_ids == want
        for entry, ref in zip(got.logprobs, logprobs):
            for token_id in ref.topk(5).indices.tolist():
                assert entry[token_id].logprob == pytest.approx(ref[token_id].item(), abs=1e-4)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("budget", [2048, 19], ids=["one-shot", "chunked"])
def test_batch_matches_transformers(checkpoint, budget):
    directory, hf, cfg, seed = checkpoint
    prompts = [prompt(cfg, n, seed)[0].tolist() for n in LENGTHS]
    # A budget of 19 tokens cuts every prompt's prefill inside blocks of every rate (2..16).
    llm = engine(directory, max_num_batched_tokens=budget, enable_chunked_prefill=True)
    check(llm.generate(prompts, GREEDY, use_tqdm=False), prompts, hf)


def test_prefix_hits_resume_from_block_boundaries(checkpoint):
    directory, hf, cfg, seed = checkpoint
    first = prompt(cfg, 200, seed)[0].tolist()
    llm = engine(directory)
    bs = llm.config.cache.block_size
    llm.generate([first], GREEDY, use_tqdm=False)
    # Shares 163 tokens with the first: a hit of 160 (10 blocks), whose compressors resume from
    # the tails of block 9; then a decode-length follow-up on the whole first prompt.
    follow_ups = [first[:163] + prompt(cfg, 30, seed + 7)[0].tolist(), first + [5]]
    outputs = llm.generate(follow_ups, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [160, 200 // bs * bs]
    check(outputs, follow_ups, hf)


def test_preempted_requests_recompute_the_same(checkpoint):
    directory, hf, cfg, seed = checkpoint
    prompts = [prompt(cfg, 100 + i, seed + i)[0].tolist() for i in range(5)]
    # Five requests admitted at 7 blocks a pool, growing to 9: the pools run out, some are
    # preempted and recomputed (from their cached prefix, when it is still there).
    llm = engine(directory, num_kv_blocks=40, max_model_len=160)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    check(outputs, prompts, hf)


def test_loads_what_transformers_saves(checkpoint, tmp_path):
    """save_pretrained writes DeepSeek's layer names (weights.py reads that layout too)."""
    _, hf, cfg, seed = checkpoint
    hf.save_pretrained(tmp_path)
    ids = prompt(cfg, 75, seed)[0].tolist()
    check(engine(str(tmp_path)).generate([ids], GREEDY, use_tqdm=False), [ids], hf)


def write_mtp_checkpoint(directory: str, hf, cfg, seed: int) -> None:
    """transformers' weights plus a random MTP layer (transformers has none), in DeepSeek's names."""
    ours = V4ForCausalLM(cfg.to_dict())
    randomize(ours.mtp, seed + 100, cfg)
    tensors = {**hf.state_dict(), **{f"mtp.{k}": v for k, v in ours.mtp.state_dict().items()}}
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**cfg.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}, f)


def test_mtp_drafts_are_lossless(checkpoint, tmp_path):
    """With the checkpoint's MTP layer (random, as transformers has none) drafting 3 tokens a
    step, verified every step: greedy output identical to decoding without drafts."""
    _, hf, cfg, seed = checkpoint
    write_mtp_checkpoint(str(tmp_path), hf, cfg, seed)
    prompts = [prompt(cfg, n, seed)[0].tolist() for n in LENGTHS]
    llm = engine(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                                   "verification": "fixed"})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.spec_decode_stats.num_draft_tokens > 0
    check(outputs, prompts, hf)
