"""DeepSeek-V4 reference layers (deepinfer/models/deepseek_v4) against transformers' own
deepseek_v4, in float32, on tiny random configs that cross many window / compression boundaries:
each part's output, the full model's logits, greedy generation through our V4State vs
transformers' generate, chunked prefill that cuts a compression block, and the MTP layer (which
transformers does not build) against the same math assembled from transformers' parts."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

from deepinfer.models.deepseek_v4 import V4Config, V4ForCausalLM, V4State  # noqa: E402
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING  # noqa: E402

ATOL = 1e-4
NEW_TOKENS = 32

# Two shapes: rates 4/16 with YaRN on the compressed layers, and rates 2/8 with three streams.
# index_topk is below the number of compressed rows of every prompt; the indexer has 32 heads
# so its scores are not exactly tied (see indexer.py on ties).
SHAPES = {
    "r4_16": dict(layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
                  compress_rates={CSA: 4, HCA: 16}, hc_mult=2, index_topk=5, sliding_window=8,
                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                   "beta_fast": 32, "beta_slow": 1}),
    "r2_8": dict(layer_types=[HCA, CSA, SLIDING, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"],
                 compress_rates={CSA: 2, HCA: 8}, hc_mult=3, index_topk=3, sliding_window=8),
}
CASES = [(shape, seed) for shape in SHAPES for seed in (0, 1, 2)]


def make_config(shape: str) -> DeepseekV4Config:
    extra = SHAPES[shape]
    return DeepseekV4Config(
        vocab_size=96, hidden_size=32, moe_intermediate_size=24, num_hidden_layers=len(extra["layer_types"]),
        num_attention_heads=4, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5, n_routed_experts=6,
        num_experts_per_tok=2, hc_sinkhorn_iters=6, o_groups=2, o_lora_rank=8, index_n_heads=32,
        index_head_dim=8, swiglu_limit=1.5, num_nextn_predict_layers=1, **extra)


def randomize(model: torch.nn.Module, seed: int, cfg: DeepseekV4Config) -> None:
    """Every weight random (sinks, position biases and mHC bases included, which HF inits to 0);
    hash tables with distinct experts per token; a small random correction bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if p.dim() < 2 else 0.25
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-seed{n}" for s, n in CASES])
def pair(request):
    shape, seed = request.param
    cfg = make_config(shape)
    torch.manual_seed(seed)
    hf = DeepseekV4ForCausalLM(cfg).eval()
    randomize(hf, seed, cfg)
    ours = V4ForCausalLM(cfg.to_dict()).eval()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("mtp.") for k in missing)
    randomize(ours.mtp, seed + 100, cfg)
    return cfg, hf, ours, seed


def prompt(cfg, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + length)
    return torch.randint(0, cfg.vocab_size, (1, length), generator=g)


def hf_mask(length: int, window: int) -> torch.Tensor:
    """transformers' additive sliding-window causal mask, [1, 1, L, L]."""
    i = torch.arange(length)
    ok = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return torch.where(ok, 0.0, torch.finfo(torch.float32).min)[None, None]


def hf_layer_kwargs(hf, length: int):
    positions = torch.arange(length)[None]
    dummy = torch.zeros(1, length, hf.config.hidden_size)
    rope = {k: hf.model.rotary_emb(dummy, positions, layer_type=k) for k in ("main", "compress")}
    return dict(position_embeddings=rope, position_ids=positions, attention_mask=hf_mask(length, hf.config.sliding_window),
                cache=None)


@torch.no_grad()
def test_each_layer_matches(pair):
    """mHC weights, attention, compressor rows and indexer picks, MoE, and each decoder layer,
    fed the same inputs as transformers' layers."""
    cfg, hf, ours, seed = pair
    length = 150
    ids = prompt(cfg, length, seed)
    kwargs = hf_layer_kwargs(hf, length)
    positions = torch.arange(length)
    streams = hf.model.embed_tokens(ids).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
    state = ours.new_state()
    for i, (hf_layer, layer) in enumerate(zip(hf.model.layers, ours.model.layers)):
        post, comb, block_in = hf_layer.attn_hc(streams)
        our_in, our_post, our_comb = layer.attn_hc(streams)
        torch.testing.assert_close(our_in, block_in, atol=ATOL, rtol=0)
        torch.testing.assert_close(our_post, post, atol=ATOL, rtol=0)
        torch.testing.assert_close(our_comb, comb, atol=ATOL, rtol=0)
        x = hf_layer.input_layernorm(block_in)
        want, _ = hf_layer.self_attn(x, **kwargs)
        got = layer.self_attn(x, positions, V4State.empty([cfg.layer_types[i]]).layers[0])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        if hf_layer.self_attn.compressor is not None:
            check_compressor(hf_layer.self_attn, layer.self_attn, x, kwargs, cfg.layer_types[i])
        y = torch.randn(1, length, cfg.hidden_size, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(layer.mlp(y, ids), hf_layer.mlp(y, input_ids=ids), atol=ATOL, rtol=0)
        want_streams = hf_layer(streams, input_ids=ids, **kwargs)
        got_streams = layer(streams, positions, state.layers[i], ids)
        torch.testing.assert_close(got_streams, want_streams, atol=ATOL, rtol=0)
        streams = want_streams
    torch.testing.assert_close(ours.model.hc_head(streams), hf.model.hc_head(streams), atol=ATOL, rtol=0)


def check_compressor(hf_attn, attn, x, kwargs, layer_type: str) -> None:
    """Compressed rows equal; the rows each query may attend (HF's block bias == 0) equal ours."""
    q_residual = hf_attn.q_a_norm(hf_attn.q_a_proj(x))
    rows, bias = hf_attn.compressor(x, q_residual, kwargs["position_ids"], None, 0)
    state = V4State.empty([layer_type]).layers[0]
    got = attn.compressor.compress(x, state.compressor)
    torch.testing.assert_close(got, rows[:, 0], atol=ATOL, rtol=0)
    positions = kwargs["position_ids"][0]
    if layer_type == CSA:
        chosen = attn.compressor.indexer.select(x, q_residual, positions, state.indexer)
        assert chosen.sum(-1).max() == min(attn.compressor.indexer.topk, rows.shape[2])
    else:
        from deepinfer.models.deepseek_v4.compressor import visible_rows
        chosen = visible_rows(positions, got.shape[1], attn.compressor.rate)[None]
    assert torch.equal(chosen, bias[:, 0] == 0)


@torch.no_grad()
@pytest.mark.parametrize("length", [64, 97, 143, 200])
def test_logits_match(pair, length):
    cfg, hf, ours, seed = pair
    ids = prompt(cfg, length, seed)
    torch.testing.assert_close(ours(ids), hf(ids, use_cache=False).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_logits_match_batched(pair):
    cfg, hf, ours, seed = pair
    ids = torch.cat([prompt(cfg, 90, seed), prompt(cfg, 90, seed + 7)])
    torch.testing.assert_close(ours(ids), hf(ids, use_cache=False).logits, atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("length", [70, 131])
def test_greedy_generation_matches_hf_generate(pair, length):
    cfg, hf, ours, seed = pair
    ids = prompt(cfg, length, seed)
    hf.generation_config.eos_token_id = None
    # An explicit mask: with only pad_token_id, generate would take prompt tokens equal to it for padding.
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                       pad_token_id=0)[0, length:]
    got = ours.generate_greedy(ids, NEW_TOKENS)[0]
    assert got.tolist() == want.tolist()


@torch.no_grad()
@pytest.mark.parametrize("cut", [37, 61])      # inside a block of every rate (2, 4, 8, 16)
def test_chunked_prefill_then_decode_equals_one_shot(pair, cut):
    """Prefill in two calls cutting a compression block, then one call per token: the logits of
    every step equal one forward over the whole sequence (ours and transformers')."""
    cfg, hf, ours, seed = pair
    length = 100
    ids = prompt(cfg, length + 20, seed)
    full = ours(ids)
    torch.testing.assert_close(full, hf(ids, use_cache=False).logits, atol=ATOL, rtol=0)
    state = ours.new_state()
    steps = [ours(ids[:, :cut], state), ours(ids[:, cut:length], state)]
    steps += [ours(ids[:, t:t + 1], state) for t in range(length, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    assert ours.generate_greedy(ids[:, :length], 24, first_chunk=cut).tolist() == \
        ours.generate_greedy(ids[:, :length], 24).tolist()


@torch.no_grad()
def test_state_is_bounded_except_compressed_rows(pair):
    """After n tokens a layer keeps min(n, window - 1) raw rows, n // rate compressed rows (and
    as many indexer keys in CSA), fewer than rate pending projections, and one block of Ca."""
    cfg, hf, ours, seed = pair
    ours_cfg = ours.cfg
    n = 123
    state = ours.new_state()
    ours(prompt(cfg, n, seed), state)
    for kind, layer in zip(ours_cfg.layer_types, state.layers):
        assert layer.window.shape[1] == min(n, ours_cfg.sliding_window - 1)
        if kind == SLIDING:
            assert layer.compressor is None
            continue
        rate = ours_cfg.rate(kind)
        parts = [layer.compressor] + ([layer.indexer] if kind == CSA else [])
        for part in parts:
            assert part.num_rows == n // rate and part.pending_kv.shape[1] == n % rate
            assert (part.prev_kv is not None) == (kind == CSA)


@torch.no_grad()
def test_mtp_layer_matches_transformers_parts(pair):
    """transformers drops mtp.*; check our MTP layer against the same composition built from
    transformers' modules (a DecoderLayer of the MTP's kind, its RMSNorm and HyperHead)."""
    cfg, hf, ours, seed = pair
    mtp = ours.mtp[0]
    ext = DeepseekV4Config(**{**cfg.to_dict(), "num_hidden_layers": cfg.num_hidden_layers + 1,
                              "layer_types": cfg.layer_types + [ours.cfg.mtp_layer_types[0]],
                              "mlp_layer_types": cfg.mlp_layer_types + ["moe"]})
    block = hf_v4.DeepseekV4DecoderLayer(ext, cfg.num_hidden_layers).eval()
    head = hf_v4.DeepseekV4HyperHead(ext).eval()
    norms = {n: hf_v4.DeepseekV4RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps) for n in ("enorm", "hnorm", "norm")}
    sd = mtp.state_dict()
    block.load_state_dict({k: v for k, v in sd.items() if k.split(".")[0] not in
                           ("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head")})
    head.load_state_dict({k[len("hc_head."):]: v for k, v in sd.items() if k.startswith("hc_head.")})
    for name, norm in norms.items():
        norm.load_state_dict({"weight": sd[f"{name}.weight"]})

    length = 90
    ids = prompt(cfg, length + 1, seed)
    state = ours.new_state()
    _, streams = ours.model(ids[:, :length], state)
    got, _ = ours.mtp_logits(streams, ids[:, 1:length + 1], state)

    e = norms["enorm"](hf.model.embed_tokens(ids[:, 1:length + 1]))
    x = torch.nn.functional.linear(e, sd["e_proj.weight"]).unsqueeze(2) + \
        torch.nn.functional.linear(norms["hnorm"](streams), sd["h_proj.weight"])
    x = block(x, input_ids=ids[:, 1:length + 1], **hf_layer_kwargs(hf, length))
    want = hf.lm_head(norms["norm"](head(x)))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)

    # Incremental MTP (its own state) equals one call over the whole span.
    state = ours.new_state()
    parts = []
    for lo, hi in ((0, 41), (41, 42), (42, length)):
        _, s = ours.model(ids[:, lo:hi], state)
        parts.append(ours.mtp_logits(s, ids[:, lo + 1:hi + 1], state)[0])
    torch.testing.assert_close(torch.cat(parts, dim=1), got, atol=ATOL, rtol=0)


def test_config_reads_the_checkpoint_spelling():
    """The released config.json spelling (compress_ratios incl. the MTP layer, num_hash_layers,
    qk_rope_head_dim, rope_scaling) gives the same V4Config as transformers' parsed one."""
    raw = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
               qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=8,
               compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=2, index_n_heads=32, index_head_dim=8,
               index_topk=5, hc_mult=2, hc_sinkhorn_iters=6, hc_eps=1e-6, n_routed_experts=6,
               num_experts_per_tok=2, moe_intermediate_size=24, routed_scaling_factor=1.5,
               scoring_func="sqrtsoftplus", swiglu_limit=10.0, rms_norm_eps=1e-6, rope_theta=10000.0,
               compress_rope_theta=160000.0, num_nextn_predict_layers=1,
               rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1})
    ours = V4Config.from_hf(raw)
    theirs = V4Config.from_hf(DeepseekV4Config(**raw).to_dict())
    assert ours.layer_types == theirs.layer_types == [SLIDING, CSA, HCA, CSA]
    assert ours.mlp_types == theirs.mlp_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert ours.rope_dim == theirs.rope_dim == 8 and ours.mtp_layer_types == [SLIDING]
    assert ours.rope["compress"]["rope_type"] == theirs.rope["compress"]["rope_type"] == "yarn"
    for key in ("factor", "original_max_position_embeddings", "rope_theta", "attention_factor"):
        assert ours.rope["compress"][key] == theirs.rope["compress"][key]
    assert ours.rope["main"]["rope_theta"] == theirs.rope["main"]["rope_theta"] == 10000.0
