"""deepinfer/models/deepseek_v4/weights.py: V4 checkpoints of both layouts into V4ForCausalLM.

- transformers' save_pretrained, in its own layout and in its default "original format" (a
  hybrid with DeepSeek's layer names): the loaded weights are transformers' exactly, and the
  logits agree with transformers' on a prompt; its layout with transformers' scale names
  (`weight_scale_inv`, stacked FP4 experts with `gate_up_proj_scale_inv`);
- DeepSeek's released names, written here from our state dict by a renamer of the test's own
  (the inverse of docs/deepseek_v4.md "Weight names", experts split per expert), sharded with an
  index and scales in another shard than their weights: exact in float32 and in bf16, and
  quantized as the release is (FP8 e4m3 in ue8m0-scaled blocks, FP4 e2m1 experts in ue8m0-scaled
  row groups, by a small quantizer here): every tensor is the quantizer's grid value times its
  scale, within the format's rounding of the original;
- the formats' bytes decoded by hand; unknown, missing and unscaled tensors give clear errors.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV4ForCausalLM

from deepinfer.layers.linear import Linear
from deepinfer.layers.quantization.fp8 import dequantize
from deepinfer.models.deepseek_v4 import V4ForCausalLM
from deepinfer.models.deepseek_v4.formats import checkpoint_nbytes, held_nbytes
from deepinfer.models.deepseek_v4.loading import load_v4_weights
from deepinfer.models.deepseek_v4.moe import RoutedExperts
from deepinfer.models.deepseek_v4.weights import (
    DEEPSEEK,
    TRANSFORMERS,
    MissingTensorError,
    UnknownTensorError,
    V4Checkpoint,
    dequantize_fp4_groups,
    dequantize_fp8_blocks,
)
from deepinfer.models.errors import ModelLoadError
from tests.models.test_deepseek_v4_layers import ATOL, make_config, randomize

SHAPE, SEED = "r4_16", 0
FP8_BLOCK = (16, 16)      # small, so the tiny shapes span several blocks (and partial ones: 24 rows)
FP4_GROUP = 8             # the release's is 32; 24-wide inputs need a divisor of 24 here
E4M3_MAX, E2M1_MAX = 448.0, 6.0
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                          -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])   # by 4-bit code

# Our names -> DeepSeek's, applied in order (the inverse of the loader's renames, written
# independently of it). Routed experts are split afterwards.
TO_DEEPSEEK = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^(mtp\.\d+)\.hc_head\.hc_(fn|base|scale)$", r"\1.hc_head_\2"),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"compressor\.kv_proj\.", "compressor.wkv."),
    (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"compressor\.position_bias$", "compressor.ape"),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
]
# What the release stores in FP8 blocks, and in FP4 groups (DeepSeek's names).
FP8_NAMES = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123]"
                       r"|^mtp\.\d+\.[eh]_proj)\.weight$")
FP4_NAMES = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def deepseek_state(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict under the released checkpoint's names: experts.{j}.w1 = gate rows of
    gate_up_proj[j], w3 = its up rows, w2 = down_proj[j]; tid2eid as int32."""
    out = {}
    for name, tensor in ours.items():
        for pattern, replacement in TO_DEEPSEEK:
            name = re.sub(pattern, replacement, name)
        if name.endswith(".experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for j in range(tensor.shape[0]):
                out[name.replace("gate_up_proj", f"{j}.w1.weight")] = gate[j].clone()
                out[name.replace("gate_up_proj", f"{j}.w3.weight")] = up[j].clone()
        elif name.endswith(".experts.down_proj"):
            for j in range(tensor.shape[0]):
                out[name.replace("down_proj", f"{j}.w2.weight")] = tensor[j].clone()
        else:
            out[name] = tensor.to(torch.int32) if name.endswith("tid2eid") else tensor.clone()
    return out


def power_of_two_scale(amax: torch.Tensor, grid_max: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= grid_max (a ue8m0 scale, as the release's)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / grid_max)))


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, e8m0 scale per FP8_BLOCK tile, the scale expanded per element)."""
    rows, cols = w.shape
    br, bc = FP8_BLOCK
    pad = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc)
    pad[:rows, :cols] = w.abs()
    amax = pad.unflatten(0, (-1, br)).unflatten(-1, (-1, bc)).amax(dim=(1, 3))
    scale = power_of_two_scale(amax, E4M3_MAX)
    per_element = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    return (w / per_element).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu), per_element


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 packed e2m1 codes, low nibble = even column; e8m0 scale per FP4_GROUP columns of a row;
    the scale expanded per element; the grid value chosen per element)."""
    groups = w.unflatten(-1, (-1, FP4_GROUP))
    scale = power_of_two_scale(groups.abs().amax(-1), E2M1_MAX)
    per_element = scale.repeat_interleave(FP4_GROUP, -1)
    codes = ((w / per_element)[..., None] - E2M1_GRID).abs().argmin(-1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu), per_element, E2M1_GRID[codes]


def write_sharded(directory, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Two shards and an index: the weights of the first two layers and every scale in one, the
    rest in the other, so most quantized weights find their scale in the other shard."""
    first = {n: t for n, t in tensors.items() if n.endswith(".scale") or re.match(r"layers\.[01]\.", n)}
    second = {n: t for n, t in tensors.items() if n not in first}
    weight_map = {}
    for file, part in (("model-00001-of-00002.safetensors", first),
                       ("model-00002-of-00002.safetensors", second)):
        save_file({n: t.contiguous() for n, t in part.items()}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hf_model():
    cfg = make_config(SHAPE)
    torch.manual_seed(SEED)
    hf = DeepseekV4ForCausalLM(cfg).eval()
    randomize(hf, SEED, cfg)
    return cfg, hf


@pytest.fixture(scope="module")
def reference(hf_model):
    """Our model with transformers' weights and random MTP weights: the state to write."""
    cfg, hf = hf_model
    ours = V4ForCausalLM(cfg.to_dict())
    ours.load_state_dict(hf.state_dict(), strict=False)
    randomize(ours.mtp, SEED + 100, cfg)
    return cfg, {n: t.detach().clone() for n, t in ours.state_dict().items()}


def fresh(cfg, with_mtp: bool = True) -> V4ForCausalLM:
    model = V4ForCausalLM(cfg.to_dict(), with_mtp=with_mtp).eval()
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            tensor.fill_(7)      # nothing left over from init can pass for a loaded weight
    return model


@torch.no_grad()
@pytest.mark.parametrize("original_format", [False, True],
                         ids=["transformers-layout", "transformers-original"])
def test_transformers_save_pretrained_loads(hf_model, tmp_path, original_format):
    cfg, hf = hf_model
    hf.save_pretrained(tmp_path, save_original_format=original_format)
    ours = fresh(cfg, with_mtp=False)
    assert load_v4_weights(ours, str(tmp_path)) == (DEEPSEEK if original_format else TRANSFORMERS)
    theirs = hf.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name].to(tensor.dtype)), name
    ids = torch.randint(0, cfg.vocab_size, (1, 50), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(ours(ids), hf(ids, use_cache=False).logits, atol=ATOL, rtol=0)


def test_transformers_layout_quantized(hf_model, tmp_path):
    """transformers' names with its scale names: `weight_scale_inv` beside an FP8 weight, and
    `gate_up_proj_scale_inv` beside FP4 experts still stacked [E, 2I, hidden / 2]."""
    cfg, hf = hf_model
    state = {n: t.contiguous() for n, t in hf.state_dict().items()}
    fp8, fp4 = "model.layers.1.self_attn.q_b_proj.weight", "model.layers.2.mlp.experts.gate_up_proj"
    q, scale, per_element = quantize_fp8(state[fp8])
    expected = {fp8: q.float() * per_element}
    state[fp8], state[fp8 + "_scale_inv"] = q, scale
    packed, scale, per_element, grid_values = quantize_fp4(state[fp4])
    expected[fp4] = grid_values * per_element
    state[fp4], state[fp4 + "_scale_inv"] = packed, scale
    save_file(state, str(tmp_path / "model.safetensors"))
    quantization = {"quantization_config": {"weight_block_size": list(FP8_BLOCK)}}
    (tmp_path / "config.json").write_text(json.dumps(quantization))
    ours = fresh(cfg, with_mtp=False)
    assert load_v4_weights(ours, str(tmp_path)) == TRANSFORMERS
    loaded = ours.state_dict()
    for name, want in expected.items():
        assert torch.equal(loaded[name], want), name


def test_checkpoint_without_mtp_says_to_drop_it(hf_model, tmp_path):
    cfg, hf = hf_model
    hf.save_pretrained(tmp_path, save_original_format=False)
    with pytest.raises(MissingTensorError, match=r"mtp\.0\..*with_mtp=False"):
        load_v4_weights(fresh(cfg), str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_deepseek_layout_round_trip(reference, tmp_path, dtype):
    """DeepSeek's names, unquantized: every tensor back exactly (bf16: the bf16 value)."""
    cfg, state = reference
    on_disk = {n: t.to(dtype) if t.is_floating_point() else t for n, t in deepseek_state(state).items()}
    write_sharded(tmp_path, on_disk, cfg.to_dict())
    ours = fresh(cfg)
    assert load_v4_weights(ours, str(tmp_path)) == DEEPSEEK
    for name, tensor in ours.state_dict().items():
        want = state[name].to(dtype).to(tensor.dtype) if state[name].is_floating_point() else state[name]
        assert torch.equal(tensor, want), name


def write_quantized(cfg, state: dict[str, torch.Tensor], directory):
    """The state in DeepSeek's layout with FP8 / FP4 where the release has them, written sharded
    to `directory`; (original, on_disk, expected loaded value, error bound) by DeepSeek's names."""
    original = deepseek_state(state)
    on_disk = dict(original)
    expected, bounds = {}, {}
    for name in [n for n in on_disk if FP8_NAMES.search(n) or FP4_NAMES.search(n)]:
        w = on_disk[name]
        if FP8_NAMES.search(name):
            q, scale, per_element = quantize_fp8(w)
            expected[name] = q.float() * per_element
            bounds[name] = torch.maximum(w.abs() * 2.0**-4, per_element * 2.0**-10)
        else:
            q, scale, per_element, grid_values = quantize_fp4(w)
            expected[name] = grid_values * per_element
            bounds[name] = torch.maximum(w.abs(), per_element) / 4
        on_disk[name], on_disk[name.removesuffix("weight") + "scale"] = q, scale
    assert any(FP8_NAMES.search(n) for n in expected) and any(FP4_NAMES.search(n) for n in expected)
    config = {**cfg.to_dict(), "expert_dtype": "fp4",
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}}
    write_sharded(directory, on_disk, config)
    return original, on_disk, expected, bounds


def test_deepseek_layout_quantized(reference, tmp_path):
    """FP8 / FP4 as released: each loaded value is its grid value times its scale, and within the
    format's rounding of the original. e4m3 keeps 3 mantissa bits: |error| <= 2^-4 |w| for normal
    values, <= 2^-10 s below the smallest normal (2^-6 s). e2m1 keeps 1: |error| <= |w| / 4 from
    s up, <= s / 4 below (grid 0, 0.5 s, s)."""
    cfg, state = reference
    original, on_disk, expected, bounds = write_quantized(cfg, state, tmp_path)

    loaded = {p.source: p.tensor for p in V4Checkpoint(str(tmp_path)).tensors()}
    assert loaded.keys() == {n for n in on_disk if not n.endswith(".scale")}
    for name, want in expected.items():
        assert torch.equal(loaded[name], want), name
        assert ((loaded[name] - original[name]).abs() <= bounds[name]).all(), name
    assert any(not torch.equal(expected[n], original[n]) for n in expected)   # it did quantize

    ours = fresh(cfg)
    load_v4_weights(ours, str(tmp_path))
    got = deepseek_state(ours.state_dict())
    for name, tensor in got.items():
        assert torch.equal(tensor, expected.get(name, on_disk[name])), name


@torch.no_grad()
def test_fp8_blocks_kept_in_their_own_format(reference, tmp_path):
    """keep_fp8: every whole Linear whose checkpoint weight is FP8 holds the stored codes and
    scales (no dense copy), the rest is loaded as before, and the model computes the same logits
    as the dequantized load (float32: the reference product dequantizes to the same values)."""
    cfg, state = reference
    _, _, expected, _ = write_quantized(cfg, state, tmp_path)
    dense, kept = fresh(cfg), fresh(cfg)
    load_v4_weights(dense, str(tmp_path))
    load_v4_weights(kept, str(tmp_path), keep_fp8=True)
    fp8_layers = {n: m for n, m in kept.named_modules() if isinstance(m, Linear) and m.is_fp8}
    dense_modules = dict(dense.named_modules())
    assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_proj",
            "model.layers.0.self_attn.o_a_proj", "model.layers.0.self_attn.o_b_proj",
            "model.layers.0.mlp.shared_experts.gate_proj"} <= set(fp8_layers)
    for name, layer in fp8_layers.items():
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_block == FP8_BLOCK, name
        back = dequantize(layer.weight, layer.weight_scale, layer.weight_block, torch.float32)
        assert torch.equal(back, dense_modules[name].weight), name
    assert len(fp8_layers) == sum(1 for n in expected if FP8_NAMES.search(n))
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(6))
    assert torch.equal(kept(ids), dense(ids))


@torch.no_grad()
def test_fp4_experts_kept_in_their_own_format(reference, tmp_path):
    """keep_fp4: the routed experts hold the stored e2m1 codes and ue8m0 exponents (half a byte
    a weight, no dense copy), each expert dequantizes to the dense load's values, and the model
    computes the same logits (float32: the reference loop dequantizes to the same values)."""
    cfg, state = reference
    write_quantized(cfg, state, tmp_path)
    dense, kept = fresh(cfg), fresh(cfg)
    load_v4_weights(dense, str(tmp_path))
    load_v4_weights(kept, str(tmp_path), keep_fp4=True)
    dense_modules = dict(dense.named_modules())
    experts = {n: m for n, m in kept.named_modules() if isinstance(m, RoutedExperts)}
    assert experts and all(m.fp4_group == FP4_GROUP for m in experts.values())
    for name, module in experts.items():
        assert module.gate_up_proj.dtype == torch.uint8
        for part in ("gate_up_proj", "down_proj"):
            whole = getattr(dense_modules[name], part)
            assert getattr(module, part).shape[-1] * 2 == whole.shape[-1]
            for j in range(whole.shape[0]):
                assert torch.equal(module.expert_weight(part, j, torch.float32), whole[j]), (name, part, j)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(7))
    assert torch.equal(kept(ids), dense(ids))


def test_formats_decode_by_hand():
    """FP4: byte 0x21 holds code 1 (0.5) in its low nibble, the even column, and code 2 (1.0) in
    its high one; 0xF9 holds -0.5 then -6. ue8m0 byte 128 = 2^1, 125 = 2^-2, as float8_e8m0fnu
    or raw uint8. FP8: one scale per block, the last block partial."""
    packed = torch.tensor([[0x21, 0xF9 - 256]], dtype=torch.int8)
    for scale in (torch.tensor([[128]], dtype=torch.uint8), torch.tensor([[2.0]]).to(torch.float8_e8m0fnu)):
        assert dequantize_fp4_groups(packed, scale).tolist() == [[1.0, 2.0, -1.0, -12.0]]
    two_groups = torch.tensor([[128, 125]], dtype=torch.uint8)
    assert dequantize_fp4_groups(packed, two_groups).tolist() == [[1.0, 2.0, -0.125, -1.5]]

    weight = torch.full((3, 5), 1.5).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 4.0, 0.5], [2.0, 8.0, 16.0]]).to(torch.float8_e8m0fnu)
    want = torch.tensor([[1.5, 1.5, 6.0, 6.0, 0.75],
                         [1.5, 1.5, 6.0, 6.0, 0.75],
                         [3.0, 3.0, 12.0, 12.0, 24.0]])
    assert torch.equal(dequantize_fp8_blocks(weight, scale, (2, 2)), want)
    with pytest.raises(ValueError, match="needs a scale"):
        dequantize_fp8_blocks(weight, scale, (128, 128))


def test_unknown_tensor_is_named(reference, tmp_path):
    cfg, state = reference
    on_disk = deepseek_state(state)
    on_disk["layers.1.attn.wq_c.weight"] = torch.zeros(2, 2)
    write_sharded(tmp_path, on_disk, cfg.to_dict())
    with pytest.raises(UnknownTensorError, match=r"'layers\.1\.attn\.wq_c\.weight'"):
        load_v4_weights(fresh(cfg), str(tmp_path))


def test_tensor_beyond_the_model_is_named(hf_model, tmp_path):
    """A well-formed name the model has no place for (a fifth layer, in transformers' layout)."""
    cfg, hf = hf_model
    state = {n: t.contiguous() for n, t in hf.state_dict().items()}
    state["model.layers.4.input_layernorm.weight"] = torch.ones(cfg.hidden_size)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnknownTensorError, match=r"'model\.layers\.4\.input_layernorm\.weight'.*no place"):
        load_v4_weights(fresh(cfg, with_mtp=False), str(tmp_path))


def test_missing_tensors_are_listed(reference, tmp_path):
    cfg, state = reference
    on_disk = deepseek_state(state)
    del on_disk["layers.2.ffn.experts.3.w3.weight"], on_disk["mtp.0.norm.weight"]
    write_sharded(tmp_path, on_disk, cfg.to_dict())
    with pytest.raises(MissingTensorError,
                       match=r"lacks 2 .*gate_up_proj \(expert 3 up\).*mtp\.0\.norm\.weight"):
        load_v4_weights(fresh(cfg), str(tmp_path))


def test_quantized_weight_without_scale(reference, tmp_path):
    cfg, state = reference
    on_disk = deepseek_state(state)
    on_disk["layers.0.attn.wq_a.weight"] = on_disk["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
    write_sharded(tmp_path, on_disk, cfg.to_dict())
    with pytest.raises(ModelLoadError,
                       match=r"'layers\.0\.attn\.wq_a\.weight' is stored as F8_E4M3.*no scale"):
        load_v4_weights(fresh(cfg), str(tmp_path))


@torch.no_grad()
def test_built_in_the_checkpoint_formats(reference, tmp_path):
    """quantization="fp8" on a checkpoint whose config.json declares V4's formats: the engine's
    model holds the FP8 projections and the FP4 experts in those formats from the moment each
    layer is built (formats.prepare_layer: no BF16 copy of the model first), and loading fills
    them with the stored codes: each dequantizes to the dense load's weight."""
    from deepinfer.models.deepseek_v4.engine import DeepseekV4ForCausalLM as EngineV4

    cfg, state = reference
    write_quantized(cfg, state, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    built = EngineV4.build(config, "fp8")
    q_a = built.model.layers[0].self_attn.q_a_proj
    assert q_a.is_fp8 and not q_a.weight.any()                  # zero codes until loaded
    load_v4_weights(built, str(tmp_path), keep_fp8=True, keep_fp4=True)
    # (The release's experts are built FP4 in groups of 32; these tiny ones, of 24 inputs, are
    # made FP4 by the loader in the checkpoint's groups of 8.)
    experts = [m for m in built.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(m.fp4_group == FP4_GROUP and m.gate_up_proj.dtype == torch.uint8 for m in experts)
    dense = EngineV4(config)
    load_v4_weights(dense, str(tmp_path))
    dense_modules = dict(dense.named_modules())
    for name, module in built.named_modules():
        if isinstance(module, Linear) and module.is_fp8:
            back = dequantize(module.weight, module.weight_scale, module.weight_block, torch.float32)
            assert torch.equal(back, dense_modules[name].weight.float()), name
        elif isinstance(module, RoutedExperts):
            for part in ("gate_up_proj", "down_proj"):
                whole = getattr(dense_modules[name], part)
                for j in range(whole.shape[0]):
                    assert torch.equal(module.expert_weight(part, j, torch.float32), whole[j].float()), (name, j)
    assert EngineV4.build(config, "auto").model.layers[0].self_attn.q_a_proj.weight.dtype != torch.float8_e4m3fn
    # The bytes: checkpoint_nbytes, computed from the model's shapes, is the files' tensors' sum
    # up to what the model holds wider than the files (its int64 hash table); the model built in
    # the formats holds that within 5 % (float32 block scales where a file has a byte), the dense
    # one far more.
    stored = 0
    for path in tmp_path.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            stored += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert checkpoint_nbytes(built) == pytest.approx(stored, rel=0.02)
    assert stored <= held_nbytes(built) <= 1.05 * stored < 2 * stored < held_nbytes(dense)


def test_wide_tensor_for_a_declared_quantized_layer_is_refused(reference, tmp_path):
    """config.json declares FP8 / FP4 but the files hold BF16: the model built in those formats
    refuses the tensor (naming it) instead of casting its values into codes."""
    from deepinfer.models.deepseek_v4.engine import DeepseekV4ForCausalLM as EngineV4

    cfg, state = reference
    config = {**cfg.to_dict(), "expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    write_sharded(tmp_path, deepseek_state(state), config)
    with pytest.raises(ModelLoadError, match="says the checkpoint stores it quantized"):
        load_v4_weights(EngineV4.build(config, "fp8"), str(tmp_path), keep_fp8=True, keep_fp4=True)


@torch.no_grad()
def test_dummy_weights_spread_routing(reference, tmp_path):
    """load_format="dummy" in V4's formats: every FP8 projection and FP4 expert holds the codes
    of random weights (not the zero codes it is built with), the router's weights are drawn, and
    each hash layer's table gives every token distinct experts over the whole range, so a batch
    reads most experts as a real one does; the same seed draws the same weights."""
    from deepinfer.models.deepseek_v4.engine import DeepseekV4ForCausalLM as EngineV4

    cfg, state = reference
    write_quantized(cfg, state, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    models = []
    for _ in range(2):
        model = EngineV4.build(config, "fp8", dummy=True)
        model.random_weights(seed=3)
        models.append(model)
    model = models[0]
    fp8_layers = [m for m in model.modules() if isinstance(m, Linear) and m.is_fp8]
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert fp8_layers and experts
    for layer in fp8_layers:
        weight = dequantize(layer.weight, layer.weight_scale, layer.weight_block, torch.float32)
        assert weight.isfinite().all() and 0.01 < weight.std() < 0.04
    for module in experts:   # (these tiny experts, of 24 inputs, are built FP4 only by a load)
        for part in ("gate_up_proj", "down_proj"):
            weight = module.expert_weight(part, 0, torch.float32)
            assert weight.isfinite().all() and 0.01 < weight.std() < 0.04, part
    gates = [m for m in model.modules() if hasattr(m, "tid2eid")]
    assert gates and all(g.weight.std() > 0 for g in gates)
    for gate in gates:
        table = gate.tid2eid
        if gate.hashed:
            assert (table.sort(dim=-1).values.diff(dim=-1) > 0).all()   # distinct experts per token
            assert table.unique().numel() == cfg.n_routed_experts
    for (name, a), b in zip(model.state_dict().items(), models[1].state_dict().values(), strict=True):
        assert torch.equal(a, b), name
