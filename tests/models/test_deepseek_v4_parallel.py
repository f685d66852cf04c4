"""DeepSeek-V4 under tensor and expert parallelism (models/deepseek_v4/parallel.py), float32, on
the tiny r4_16 config (sliding, CSA, HCA and CSA layers; two hash-routed MoE layers, two learned):

- the expert-parallel dispatch bookkeeping, by hand;
- two ranks as threads of this process over gloo: each loads its part of a whole checkpoint
  (transformers' layout, and DeepSeek's with FP8 / FP4 weights), the parts put together are the
  whole model's tensors, and the ranks' logits equal the whole model's over a prefill and decode
  steps, for tensor parallelism and for both expert-parallel dispatch forms;
- through `LLM(..., tensor_parallel_size=2)` (the mp executor, spawned ranks): greedy tokens
  identical to one rank's and logprobs within 1e-4, with chunked prefill; with expert parallelism
  and the MTP drafter as well;
- a config tensor_parallel_size does not divide: a ValueError naming the field, before any rank.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.config import ParallelConfig  # noqa: E402
from deepinfer.distributed import building_with, init_distributed, shutdown_distributed  # noqa: E402
from deepinfer.executor.ranked import free_port  # noqa: E402
from deepinfer.models.deepseek_v4 import V4ForCausalLM  # noqa: E402
from deepinfer.models.deepseek_v4.engine import DeepseekV4ForCausalLM  # noqa: E402
from deepinfer.models.deepseek_v4.loading import load_v4_weights  # noqa: E402
from deepinfer.models.deepseek_v4.parallel import plan_dispatch, received_experts, token_share  # noqa: E402
from tests.models.test_deepseek_v4_layers import make_config, prompt, randomize  # noqa: E402
from tests.models.test_deepseek_v4_weights import (  # noqa: E402
    FP4_NAMES,
    FP8_BLOCK,
    FP8_NAMES,
    deepseek_state,
    quantize_fp4,
    quantize_fp8,
    write_sharded,
)

SHAPE, SEED, RANKS = "r4_16", 0, 2
ATOL = 1e-4


# --- dispatch bookkeeping -------------------------------------------------------------------

def test_dispatch_plan_by_hand():
    """4 experts on 2 ranks; 3 tokens, 2 experts each: pairs sorted by expert, counted per
    expert and per destination rank; a receiver's rows labelled with its local experts."""
    ids = torch.tensor([[3, 0], [1, 3], [2, 1]])
    plan = plan_dispatch(ids, num_experts=4, ranks=2)
    assert ids.reshape(-1)[plan.order].tolist() == [0, 1, 1, 2, 3, 3]
    assert (plan.order // 2).tolist() == [0, 1, 2, 2, 0, 1]          # the token of each pair
    assert plan.expert_counts.tolist() == [1, 2, 1, 2]
    assert plan.send_counts == [3, 3]
    # Rank 1 (experts 2, 3) gets 1 row of expert 2 and 2 of 3 from rank 0, then 2 of expert 3 from rank 1.
    assert received_experts(torch.tensor([[1, 2], [0, 2]])).tolist() == [0, 1, 1, 1, 1]


@pytest.mark.parametrize("tokens,shares", [(5, [(0, 3), (3, 5)]), (1, [(0, 1), (1, 1)]),
                                           (0, [(0, 0), (0, 0)])])
def test_token_shares_cover_the_tokens_in_order(tokens, shares):
    class Rank:
        size = 2

        def __init__(self, rank):
            self.rank = rank

    assert [(s.start, s.stop) for s in (token_share(tokens, Rank(r)) for r in range(2))] == shares


# --- two ranks in threads -------------------------------------------------------------------

def on_two_ranks(fn, expert_parallel: bool, dispatch: str = "all_to_all"):
    """fn(group) on two ranks, each a thread with its own gloo group; their results in rank order."""
    port, results, errors = free_port("127.0.0.1"), [None] * RANKS, []

    def body(rank: int) -> None:
        try:
            group = init_distributed(rank, RANKS, "127.0.0.1", port, device=torch.device("cpu"),
                                     timeout_s=120)
            group.enable_expert_parallel = expert_parallel
            group.expert_parallel_dispatch = dispatch
            try:
                results[rank] = fn(group)
            finally:
                shutdown_distributed(group)
        except BaseException as exc:   # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def write_transformers(directory, cfg, state) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**cfg.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}, f)


def write_deepseek_quantized(directory, cfg, state) -> None:
    """DeepSeek's names, FP8 attention / shared expert / MTP projections and FP4 routed experts."""
    on_disk = deepseek_state(state)
    for name in [n for n in on_disk if FP8_NAMES.search(n) or FP4_NAMES.search(n)]:
        quantize = quantize_fp8 if FP8_NAMES.search(name) else quantize_fp4
        on_disk[name], on_disk[name.removesuffix("weight") + "scale"] = quantize(on_disk[name])[:2]
    write_sharded(directory, on_disk, {**cfg.to_dict(), "architectures": ["DeepseekV4ForCausalLM"],
                                       "quantization_config": {"quant_method": "fp8",
                                                               "weight_block_size": list(FP8_BLOCK)}})


@pytest.fixture(scope="module")
def weights():
    """(config, our whole state dict: transformers' random weights plus random MTP weights)."""
    cfg = make_config(SHAPE)
    torch.manual_seed(SEED)
    hf = HFDeepseekV4(cfg).eval()
    randomize(hf, SEED, cfg)
    ours = V4ForCausalLM(cfg.to_dict())
    ours.load_state_dict(hf.state_dict(), strict=False)
    randomize(ours.mtp, SEED + 100, cfg)
    return cfg, {n: t.detach().clone() for n, t in ours.state_dict().items()}


@pytest.fixture(scope="module", params=["transformers", "deepseek-fp8-fp4"])
def checkpoint(request, weights, tmp_path_factory):
    """(config, directory, the whole model loaded from it on one rank)."""
    cfg, state = weights
    directory = tmp_path_factory.mktemp(f"v4-{request.param}")
    write = write_transformers if request.param == "transformers" else write_deepseek_quantized
    write(directory, cfg, state)
    whole = V4ForCausalLM(cfg.to_dict()).eval()
    load_v4_weights(whole, str(directory))
    return cfg, str(directory), whole


@torch.no_grad()
def logits_of(model: V4ForCausalLM, ids: torch.Tensor, decode_steps: int = 2) -> list[torch.Tensor]:
    """Logits of a prefill, then of `decode_steps` one-token steps (greedy), through one state."""
    state = model.new_state()
    out = [model(ids, state)]
    for _ in range(decode_steps):
        out.append(model(out[-1][:, -1:].argmax(-1), state))
    return out


def assembled(name: str, parts: list[torch.Tensor], whole: torch.Tensor) -> torch.Tensor:
    """The ranks' parts of one tensor put back together (replicated: rank 0's)."""
    if parts[0].shape == whole.shape:
        assert all(torch.equal(p, parts[0]) for p in parts), f"{name} differs between ranks"
        return parts[0]
    if name.endswith("experts.gate_up_proj") and parts[0].shape[0] == whole.shape[0]:   # rows of each half
        halves = [p.chunk(2, dim=1) for p in parts]
        return torch.cat([torch.cat([h[i] for h in halves], dim=1) for i in (0, 1)], dim=1)
    dim = next(d for d in range(whole.dim()) if parts[0].shape[d] != whole.shape[d])
    return torch.cat(parts, dim=dim)


@pytest.mark.parametrize("mode", ["tp", "ep-all_to_all", "ep-all_reduce"])
def test_two_ranks_hold_the_whole_model_and_compute_its_logits(checkpoint, mode):
    cfg, directory, whole = checkpoint
    expert_parallel = mode.startswith("ep")
    ids = prompt(cfg, 40, SEED)
    want = logits_of(whole, ids)

    def rank(group):
        with building_with(group):
            model = V4ForCausalLM(cfg.to_dict()).eval()
        load_v4_weights(model, directory)
        return {n: t.clone() for n, t in model.state_dict().items()}, logits_of(model, ids)

    (state0, got0), (state1, got1) = on_two_ranks(rank, expert_parallel, mode.removeprefix("ep-"))
    whole_state = whole.state_dict()
    split = [n for n in whole_state if state0[n].shape != whole_state[n].shape]
    for name, tensor in whole_state.items():
        assert torch.equal(assembled(name, [state0[name], state1[name]], tensor), tensor), name
    assert any("q_b_proj" in n for n in split) and any("o_a_proj" in n for n in split)
    assert any(n.endswith("experts.down_proj") for n in split)
    assert all("compressor" not in n and "kv_proj" not in n for n in split)   # replicated
    assert any("shared_experts" in n for n in split) != expert_parallel
    for step, (a, b, ref) in enumerate(zip(got0, got1, want)):
        torch.testing.assert_close(a, ref, atol=ATOL, rtol=0, msg=f"rank 0, step {step}")
        torch.testing.assert_close(b, ref, atol=ATOL, rtol=0, msg=f"rank 1, step {step}")


# --- the engine, ranks in processes ---------------------------------------------------------

NEW_TOKENS = 8
LENGTHS = (40, 75)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)


def engine(directory: str, **kwargs) -> LLM:
    # A budget of 19 tokens cuts the prefills inside compression blocks of both rates (4, 16).
    options = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=160, num_kv_blocks=64,
                   enforce_eager=True, max_num_batched_tokens=19, enable_chunked_prefill=True)
    return LLM(directory, **{**options, **kwargs})


@pytest.fixture
def one_thread_per_rank(monkeypatch):
    """Ranks on a small CPU host, each with one torch thread: two ranks of two threads each on two
    cores spin against each other at every collective (a 10x slower step here). Spawned ranks
    read OMP_NUM_THREADS at start; rank 0 runs in this process."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine_checkpoint(weights, tmp_path_factory):
    """(config, directory in transformers' layout with MTP, prompts, one rank's outputs)."""
    cfg, state = weights
    directory = str(tmp_path_factory.mktemp("v4-engine"))
    write_transformers(directory, cfg, state)
    prompts = [prompt(cfg, n, SEED)[0].tolist() for n in LENGTHS]
    return cfg, directory, prompts, engine(directory).generate(prompts, GREEDY, use_tqdm=False)


def rank0_model(llm: LLM):
    return llm.engine.executor.runner.model


def assert_same(outputs, reference) -> None:
    for got, want in zip(outputs, reference):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        for entry, ref in zip(got.logprobs, want.logprobs):
            for token_id, logprob in ref.items():
                assert entry[token_id].logprob == pytest.approx(logprob.logprob, abs=ATOL)


def test_tensor_parallel_engine_matches_one_rank(engine_checkpoint, one_thread_per_rank):
    cfg, directory, prompts, reference = engine_checkpoint
    llm = engine(directory, tensor_parallel_size=2)
    experts = rank0_model(llm).model.layers[0].mlp.experts     # every expert, half its rows
    assert experts.num_local == cfg.n_routed_experts
    assert experts.down_proj.shape[-1] == cfg.moe_intermediate_size // 2
    assert_same(llm.generate(prompts, GREEDY, use_tqdm=False), reference)


def test_expert_parallel_engine_with_mtp_drafts_matches_one_rank(engine_checkpoint, one_thread_per_rank):
    """Experts split whole (all-to-all dispatch) and the MTP layer drafting on both ranks."""
    cfg, directory, prompts, reference = engine_checkpoint
    llm = engine(directory, tensor_parallel_size=2, enable_expert_parallel=True,
                 speculative_config={"method": "mtp", "num_speculative_tokens": 2, "verification": "fixed"})
    model = rank0_model(llm)
    assert len(model.mtp) == 1
    layers = [*model.model.layers, *model.mtp]
    assert [layer.mlp.experts.num_local for layer in layers] == [cfg.n_routed_experts // 2] * len(layers)
    assert_same(llm.generate(prompts, GREEDY, use_tqdm=False), reference)
    assert llm.spec_decode_stats.num_draft_tokens > 0


# --- sizes tensor_parallel_size does not divide ----------------------------------------------

@pytest.mark.parametrize("changes,tp,expert_parallel,message", [
    ({"num_attention_heads": 6, "o_groups": 2}, 4, False, r"num_attention_heads \(6\) is not divisible by "
                                                          r"tensor_parallel_size \(4\)"),
    ({"o_groups": 2}, 4, False, r"o_groups \(2\) is not divisible by tensor_parallel_size \(4\)"),
    ({"o_groups": 4, "moe_intermediate_size": 6}, 4, False, r"moe_intermediate_size \(6\)"),
    ({"o_groups": 4}, 4, True, r"n_routed_experts \(6\) is not divisible by tensor_parallel_size \(4\) "
                               "with enable_expert_parallel"),
])
def test_sizes_not_divisible_are_named(changes, tp, expert_parallel, message):
    hf_config = {**make_config(SHAPE).to_dict(), **changes}
    parallel = ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=expert_parallel)
    with pytest.raises(ValueError, match=message):
        DeepseekV4ForCausalLM.check_parallel(hf_config, parallel)


def test_engine_refuses_a_split_before_starting_ranks(engine_checkpoint):
    """o_groups = 2 over 4 ranks: the engine says so at once (no rank is spawned)."""
    _, directory, _, _ = engine_checkpoint
    with pytest.raises(ValueError, match=r"o_groups \(2\) is not divisible by tensor_parallel_size \(4\)"):
        engine(directory, tensor_parallel_size=4)
