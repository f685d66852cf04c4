"""The fused Triton kernels of the fast path (deepinfer/layers/fused/) against the reference ops.

Each kernel is compared with the plain PyTorch op it replaces, at the shapes of SmolLM2-135M,
Llama-3-8B and Gemma 3 270M with random token counts: in float32 tightly, and in bf16 (fp16
under Triton's interpreter, which has no bf16) within one rounding of that dtype. The kernels
compute in float32 and round once, so low-precision results are compared with the reference op
run in float32 on the same inputs. A whole tiny Llama (and Gemma 3) forward on the fast path,
fused ops and Triton attention, is compared with the reference path.

Runs on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) where triton is
installed; skipped otherwise.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kv_cache.dtypes import to_cache_dtype
from deepinfer.kv_cache.specs import group_layers, num_slots
from deepinfer.layers.attention import forward_context
from deepinfer.layers.norm import GemmaRMSNorm, RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding
from deepinfer.models.gemma3 import Gemma3ForCausalLM
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.worker.input_batch import build_step_inputs
from deepinfer.worker.request_states import StepChunk
from tests.triton_support import DEVICE, INTERPRETED  # skips this module without a way to run Triton

LOW = torch.float16 if INTERPRETED else torch.bfloat16   # the interpreter runs on NumPy: no bf16
DTYPES = [torch.float32, LOW]

# The kernel modules import triton: only after the skip above.
import deepinfer.layers.fused.activation as activation_module
import deepinfer.layers.fused.gemv as gemv_module
import deepinfer.layers.fused.rms_norm as rms_norm_module
import deepinfer.layers.fused.rotary as rotary_module
from deepinfer.layers.fused.activation import act_and_mul
from deepinfer.layers.fused.kv_write import write_kv_cache
from deepinfer.layers.fused.rms_norm import rms_norm
from deepinfer.layers.fused.rotary import apply_rotary_, rotate_and_write_kv_

SHAPES = {   # hidden, heads, kv_heads, head_dim, intermediate
    "smollm2-135m": (576, 9, 3, 64, 1536),
    "llama3-8b": (4096, 32, 8, 128, 14336),
    "gemma3-270m": (640, 4, 1, 256, 2048),
}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def tol(dtype: torch.dtype) -> dict:
    """float32: rounding-order differences only. Lower precision: one rounding of the dtype."""
    return {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
            torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}[dtype]


def token_counts(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1, rng.randint(2, 9), rng.randint(10, 40)]


def ids(value) -> str:
    return str(value).replace("torch.", "")


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm], ids=lambda c: c.__name__)
def test_add_rms_norm(norm_cls, shape, dtype):
    hidden = SHAPES[shape][0]
    torch.manual_seed(0)
    weight = (torch.randn(hidden, device=DEVICE) * 0.2 + (1.0 if norm_cls is RMSNorm else 0.0)).to(dtype)
    offset = 1.0 if norm_cls is GemmaRMSNorm else 0.0
    # The reference module in float32, with the same (rounded) weight; called outside a forward
    # context, it takes the PyTorch path.
    reference = norm_cls(hidden, 1e-6).to(DEVICE)
    with torch.no_grad():
        reference.weight.copy_(weight.float())
    for tokens in token_counts(hidden):
        x = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE) * 3
        residual = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE)
        total = residual + x   # what the reference path adds, in the activation dtype

        fused_residual = residual.clone()
        out, returned = rms_norm(x, weight, 1e-6, fused_residual, weight_offset=offset)
        assert returned is fused_residual   # updated in place
        # The kernel rounds the sum to the dtype exactly as the reference's `residual + x` does.
        assert torch.equal(fused_residual, total)
        torch.testing.assert_close(out.float(), reference(total.float()).to(dtype).float(), **tol(dtype))
        # Without a residual: the plain norm.
        torch.testing.assert_close(rms_norm(x, weight, 1e-6, weight_offset=offset).float(),
                                   reference(x.float()).to(dtype).float(), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_of_strided_heads(shape, dtype):
    """The q/k norms of Qwen3 and Gemma 3 see [tokens, heads, head_dim] views of the qkv output."""
    _, heads, kv_heads, head_dim, _ = SHAPES[shape]
    torch.manual_seed(1)
    weight = (torch.randn(head_dim, device=DEVICE) * 0.2).to(dtype)
    for tokens in token_counts(head_dim):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
        q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)   # token stride != heads * head_dim
        expected = F.rms_norm(q.float(), (head_dim,), 1.0 + weight.float(), 1e-6).to(dtype)
        out = rms_norm(q, weight, 1e-6, weight_offset=1.0)
        assert out.shape == q.shape
        torch.testing.assert_close(out.float(), expected.float(), **tol(dtype))


def reference_act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """GatedMLP's reference activation, in float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return gate * up


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")   # interpreter: exp(+80) is inf
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul(act, shape, dtype):
    intermediate = SHAPES[shape][4]
    torch.manual_seed(2)
    for tokens in token_counts(intermediate):
        gate_up = torch.randn(tokens, 2 * intermediate, dtype=dtype, device=DEVICE) * 3
        gate_up[0, :4] = torch.tensor([-80.0, -20.0, 20.0, 60.0])   # sigmoid's saturated ends
        out = act_and_mul(gate_up, act)
        assert out.shape == (tokens, intermediate)
        torch.testing.assert_close(out.float(), reference_act_and_mul(gate_up, act).to(dtype).float(),
                                   **tol(dtype))
    with pytest.raises(ValueError, match="not supported"):
        act_and_mul(gate_up, "relu")


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", SHAPES)
def test_rotary_in_place(shape, dtype):
    _, heads, kv_heads, head_dim, _ = SHAPES[shape]
    params = LLAMA3_ROPE if shape == "llama3-8b" else {"rope_type": "default", "rope_theta": 10000.0}
    max_position = 4096
    rotary = RotaryEmbedding(head_dim, params, max_position).to(DEVICE)
    torch.manual_seed(3)
    for tokens in token_counts(head_dim + 1):
        # q and k as the attention layer has them: strided views into the fused qkv output.
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
        positions = torch.randint(0, max_position, (tokens,), device=DEVICE)
        positions[0] = max_position - 1   # the last table row
        before_v = v.clone()
        ref_q, ref_k = rotary(positions, q.float(), k.float())   # the reference op, in float32
        out_q, out_k = apply_rotary_(positions, q, k, rotary.cos, rotary.sin)
        assert out_q is q and out_k is k
        torch.testing.assert_close(q.float(), ref_q.to(dtype).float(), **tol(dtype))
        torch.testing.assert_close(k.float(), ref_k.to(dtype).float(), **tol(dtype))
        assert torch.equal(v, before_v)   # v shares the buffer and must be left alone
    narrow = RotaryEmbedding(head_dim, dict(params, partial_rotary_factor=0.5), max_position).to(DEVICE)
    with pytest.raises(ValueError, match="partial rotary"):
        apply_rotary_(positions, q, k, narrow.cos, narrow.sin)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", SHAPES)
def test_kv_write(shape, dtype):
    _, heads, kv_heads, head_dim, _ = SHAPES[shape]
    torch.manual_seed(4)
    rows = 64 * 16
    for tokens in token_counts(kv_heads):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
        _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
        slots = torch.randperm(rows, device=DEVICE)[:tokens]
        k_cache = torch.randn(rows, kv_heads, head_dim, dtype=dtype, device=DEVICE)
        v_cache = torch.randn_like(k_cache)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        ref_k.index_copy_(0, slots, k)
        ref_v.index_copy_(0, slots, v)
        write_kv_cache(k, v, k_cache, v_cache, slots)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)   # a copy: exact
    # A float32 K/V into a lower-precision cache is cast on the way, as `k.to(cache dtype)` is.
    if dtype != torch.float32:
        k32, v32 = k.float(), v.float()
        write_kv_cache(k32, v32, k_cache, v_cache, slots)
        assert torch.equal(k_cache[slots], k32.to(dtype)) and torch.equal(v_cache[slots], v32.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", SHAPES)
def test_rotate_and_write_kv(shape, dtype):
    """The attention layer's fused kernel: q and k rotated in place as apply_rotary_ does (the
    reference rotary op in float32), and the rotated K and the V written at their slots exactly."""
    _, heads, kv_heads, head_dim, _ = SHAPES[shape]
    rotary = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0}, 2048).to(DEVICE)
    torch.manual_seed(5)
    rows = 64 * 16
    for tokens in token_counts(head_dim + 2):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
        positions = torch.randint(0, 2048, (tokens,), device=DEVICE)
        slots = torch.randperm(rows, device=DEVICE)[:tokens]
        k_cache = torch.randn(rows, kv_heads, head_dim, dtype=dtype, device=DEVICE)
        v_cache = torch.randn_like(k_cache)
        ref_q, ref_k = rotary(positions, q.float(), k.float())
        untouched = torch.ones(rows, dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        before_k, before_v, v_in = k_cache[untouched].clone(), v_cache[untouched].clone(), v.clone()
        rotate_and_write_kv_(positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache, slots)
        torch.testing.assert_close(q.float(), ref_q.to(dtype).float(), **tol(dtype))
        torch.testing.assert_close(k.float(), ref_k.to(dtype).float(), **tol(dtype))
        assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v_in) and torch.equal(v, v_in)
        assert torch.equal(k_cache[untouched], before_k) and torch.equal(v_cache[untouched], before_v)
    with pytest.raises(ValueError, match="do not fit"):
        rotate_and_write_kv_(positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache, slots[:-1])


FP8 = torch.float8_e4m3fn


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs on NumPy, which has no float8")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=ids)
def test_kv_write_fp8(dtype):
    """Into fp8 caches: each value clamped to +-448 and rounded as torch's cast rounds it
    (to_cache_dtype), and k and v left in place as the cache holds them. Strided views of a qkv
    output and contiguous k/v of 118 tokens (the shape that once came back garbled, see
    round_to_fp8)."""
    torch.manual_seed(6)
    tokens, heads, kv_heads, head_dim, rows = 118, 32, 8, 128, 64 * 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    _, k_view, v_view = (t.view(tokens, -1, head_dim)
                         for t in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    for k, v in ((k_view, v_view), (torch.randn_like(k_view), torch.randn_like(v_view))):
        k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 430.0])   # saturated twice, exact, 430 -> 416
        k_in, v_in = k.clone(), v.clone()
        slots = torch.randperm(rows, device=DEVICE)[:tokens]
        k_cache = torch.zeros(rows, kv_heads, head_dim, dtype=FP8, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        write_kv_cache(k, v, k_cache, v_cache, slots)
        for cache, before, after in ((k_cache, k_in, k), (v_cache, v_in, v)):
            assert_fp8_rounded(cache[slots], before)
            assert torch.equal(after, cache[slots].to(dtype))
        assert k_cache[slots[0], 0, :4].float().tolist() == [448.0, -448.0, 448.0, 416.0]


def assert_fp8_rounded(cached: torch.Tensor, before: torch.Tensor) -> None:
    """`cached` is `before` rounded to e4m3 as torch rounds it. From float32 inputs Triton may
    round through float16 first, so a value within a float16 rounding of a tie between two e4m3
    values can land on the other one: allowed for at most 1 % of them, one e4m3 step apart."""
    expected = to_cache_dtype(before, FP8)
    if before.dtype != torch.float32:
        assert torch.equal(cached.view(torch.uint8), expected.view(torch.uint8))
        return
    differ = cached.view(torch.uint8) != expected.view(torch.uint8)
    assert differ.float().mean() < 0.01
    torch.testing.assert_close(cached.float()[differ], expected.float()[differ], rtol=2 ** -3, atol=2 ** -9)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs on NumPy, which has no float8")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=ids)
def test_rotate_and_write_kv_fp8(dtype):
    """The fused rotary + KV write into fp8 caches: the rotated k (as apply_rotary_ leaves it in
    the model's dtype) and v are cached rounded to e4m3, and k and v are left as cached."""
    _, heads, kv_heads, head_dim, _ = SHAPES["llama3-8b"]
    rotary = RotaryEmbedding(head_dim, LLAMA3_ROPE, 4096).to(DEVICE)
    torch.manual_seed(7)
    tokens, rows = 29, 64 * 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                 kv_heads * head_dim], dim=-1))
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    slots = torch.randperm(rows, device=DEVICE)[:tokens]
    rotated_q, rotated_k, v_in = q.clone(), k.clone(), v.clone()
    apply_rotary_(positions, rotated_q, rotated_k, rotary.cos, rotary.sin)
    k_cache = torch.zeros(rows, kv_heads, head_dim, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    rotate_and_write_kv_(positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache, slots)
    assert torch.equal(q, rotated_q)
    for cache, before, after in ((k_cache, rotated_k, k), (v_cache, v_in, v)):
        assert_fp8_rounded(cache[slots], before)
        assert torch.equal(after, cache[slots].to(dtype))


# --- whole model -------------------------------------------------------------------------------

TINY = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "tie_word_embeddings": False}
BS = 16


def tiny_model(arch: str, dtype: torch.dtype):
    if arch == "llama":
        cfg = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                   rope_theta=10000.0, rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=64))
        cls = LlamaForCausalLM
    else:   # Gemma 3: q/k norms, (1 + w) norms, post-norms, GELU, sliding and global layers
        cfg = dict(TINY, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=48,
                   hidden_activation="gelu_pytorch_tanh", rope_theta=1e6, rope_local_base_freq=1e4,
                   sliding_window=12, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   query_pre_attn_scalar=48, final_logit_softcapping=30.0)
        cls = Gemma3ForCausalLM
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # as the model runner builds it: rotary tables stay float32
    try:
        with torch.device(DEVICE):
            model = cls(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:   # ones/zeros at init would hide a norm that ignores its weight
                p.add_(torch.randn_like(p) * 0.2)
    return model


class CallCounter:
    """Counts the calls of the fused entry points (so the test fails if the fast path is skipped)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: dict[str, int] = {}
        for module, name in [(rms_norm_module, "rms_norm"), (activation_module, "act_and_mul"),
                             (rotary_module, "rotate_and_write_kv_"), (gemv_module, "gemv")]:
            monkeypatch.setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted


MIXED_STEP = [(17, 1), (40, 1), (0, 23), (33, 9)]   # two decodes, a fresh prefill, a chunk after a prefix
ONE_ROW_STEP = [(37, 1)]                             # batch-1 decode: the projections run on the GEMV


def run_step(model, dtype: torch.dtype, backend: str, plan=MIXED_STEP):
    """One step of (context already cached, new tokens) chunks, on random KV caches.
    Returns (hidden float32, logits, the caches after the step's writes)."""
    groups = group_layers(model.kv_cache_specs(dtype))
    layer_to_group, layer_to_slot = [0] * TINY["num_hidden_layers"], [0] * TINY["num_hidden_layers"]
    for g in groups:
        for slot, layer in enumerate(g.layer_ids):
            layer_to_group[layer], layer_to_slot[layer] = g.group_id, slot
    spec, num_blocks = groups[0].spec, 40
    torch.manual_seed(1)
    caches = [(torch.randn(num_blocks * BS, spec.num_kv_heads, spec.head_size, device=DEVICE).to(dtype),
               torch.randn(num_blocks * BS, spec.num_kv_heads, spec.head_size, device=DEVICE).to(dtype))
              for _ in range(num_slots(groups))]
    chunks, token_ids, next_block = [], {}, 1
    rng = random.Random(0)
    for i, (context, new) in enumerate(plan):
        total = context + new
        tables = []   # distinct blocks per group: groups share cache slots (kv_cache/specs.py)
        for _ in groups:
            tables.append(list(range(next_block, next_block + -(-total // BS))))
            next_block += len(tables[-1])
        chunks.append(StepChunk(f"r{i}", context, new, tables, sample=True))
        token_ids[f"r{i}"] = [rng.randrange(2, TINY["vocab_size"]) for _ in range(total)]
    inputs = build_step_inputs(chunks, token_ids, groups, BS, layer_to_group, layer_to_slot, caches,
                               DEVICE, backend=backend, decode_splits=2)
    with torch.inference_mode(), forward_context(inputs.attention):
        hidden = model(inputs.input_ids, inputs.positions)
        logits = model.compute_logits(hidden)
    return hidden.float(), logits, caches


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("plan", [MIXED_STEP, ONE_ROW_STEP], ids=["mixed", "one_row"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_whole_model_fast_path_matches_reference(arch, plan, dtype, monkeypatch):
    """Hidden states, logits and the KV written by every layer agree between the reference
    path and the fast path (fused ops, Triton attention, and at one row the GEMV)."""
    model = tiny_model(arch, dtype)
    ref_hidden, ref_logits, ref_caches = run_step(model, dtype, "reference", plan)
    counter = CallCounter(monkeypatch)
    fast_hidden, fast_logits, fast_caches = run_step(model, dtype, "triton", plan)

    layers = TINY["num_hidden_layers"]
    norms_per_layer = 2 if arch == "llama" else 6   # Gemma: 4 layer norms + q/k norms
    expected = {"rms_norm": norms_per_layer * layers + 1, "act_and_mul": layers, "rotate_and_write_kv_": layers}
    if plan == ONE_ROW_STEP:
        expected["gemv"] = 4 * layers + 1   # qkv, o, gate_up, down, and the head
    assert counter.calls == expected
    # Errors grow through the layers: looser than a single op, still far below any real bug.
    t = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-2, "rtol": 2e-2},
         torch.bfloat16: {"atol": 1e-1, "rtol": 5e-2}}[dtype]
    torch.testing.assert_close(fast_hidden, ref_hidden, **t)
    torch.testing.assert_close(fast_logits, ref_logits, **t)
    for (ref_k, ref_v), (fast_k, fast_v) in zip(ref_caches, fast_caches):
        torch.testing.assert_close(fast_k.float(), ref_k.float(), **t)
        torch.testing.assert_close(fast_v.float(), ref_v.float(), **t)
