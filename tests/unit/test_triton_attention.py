"""The Triton attention kernels against the reference backend, through the real step inputs.

Random batches mix decodes with prefill chunks on top of cached prefixes, block tables are
random permutations of the pool, and windows are on or off. Runs on a GPU, or on the CPU under
Triton's interpreter (TRITON_INTERPRET=1) where triton is installed; skipped otherwise.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from deepinfer.engine.plan import ScheduledChunk
from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.layers.attention import Attention, forward_context
from deepinfer.worker.input_batch import build_step_inputs

triton = pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not INTERPRETED:
    pytest.skip("Triton needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
if INTERPRETED:
    # Triton's interpreter turns a loaded scalar into a 1-element array and int()s it for range();
    # NumPy >= 2.4 refuses that. Index through the single element instead (interpreter only).
    import triton.runtime.interpreter as _interp

    _patch_tensor = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
BS = 16

CASES = [   # (heads, kv_heads, head_dim, window, dtype)
    (8, 2, 64, None, torch.float32),
    (9, 3, 64, None, torch.bfloat16),       # SmolLM2-135M's shape: a group of 3 heads
    (4, 1, 256, 20, torch.float32),         # Gemma 3 270M's head size, sliding window
    (32, 8, 128, None, torch.bfloat16),     # Llama-3-8B's shape
    (8, 8, 128, 37, torch.bfloat16),        # no grouping, a window not a multiple of anything
]


def random_batch(rng: random.Random, num_blocks: int):
    """Decodes, verifications of draft tokens and prefill chunks, with distinct random tables."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    chunks = []
    for i in range(rng.randint(1, 6)):
        decode = rng.random() < 0.5
        context = rng.randint(0, 150 if not INTERPRETED else 60)
        num_tokens = 1 if decode else rng.randint(1, 90 if not INTERPRETED else 40)
        if decode:
            context += 1     # a decode has at least its previous token
        drafts = []
        if decode and rng.random() < 0.5:   # a speculative verification: 1 known token + drafts
            drafts = [7] * rng.randint(1, 5)
            num_tokens += len(drafts)
        total = context + num_tokens
        blocks = [free.pop() for _ in range(-(-total // BS))]
        chunks.append(ScheduledChunk(f"r{i}", context, num_tokens, [blocks], sample=True, spec_token_ids=drafts))
    return chunks


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}w{c[3]}{str(c[4])[6:]}")
@pytest.mark.parametrize("seed", range(3 if not INTERPRETED else 1))
def test_triton_matches_reference(case, seed):
    heads, kv_heads, head_dim, window, dtype = case
    if INTERPRETED and dtype == torch.bfloat16:
        dtype = torch.float16   # the interpreter runs on NumPy, which has no bfloat16
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 80
    spec = (SlidingWindowSpec(kv_heads, head_dim, dtype, sliding_window=window) if window
            else FullAttentionSpec(kv_heads, head_dim, dtype))
    groups = group_layers([spec])
    cache = [(torch.randn(num_blocks * BS, kv_heads, head_dim, dtype=dtype, device=DEVICE),
              torch.randn(num_blocks * BS, kv_heads, head_dim, dtype=dtype, device=DEVICE))]
    chunks = random_batch(rng, num_blocks)
    token_ids = {c.request_id: [1] * (c.start + c.num_tokens - len(c.spec_token_ids)) for c in chunks}
    layer = Attention(0, heads, kv_heads, head_dim, scale=head_dim ** -0.5, sliding_window=window)
    num_tokens = sum(c.num_tokens for c in chunks)
    q = torch.randn(num_tokens, heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=DEVICE)

    outs = {}
    for backend in ("reference", "triton"):
        caches = [(kc.clone(), vc.clone()) for kc, vc in cache]
        inputs = build_step_inputs(chunks, token_ids, groups, BS, [0], [0], caches, DEVICE, backend=backend,
                                   decode_splits=rng.choice([1, 3, 8]))
        with forward_context(inputs.attention):
            outs[backend] = layer(q, k, v).float()
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["triton"], outs["reference"], atol=tol, rtol=tol)


def test_empty_and_padded_decode_rows_are_zero():
    """Rows with seq_len 0 (CUDA-graph padding) produce zeros and touch no real block."""
    from deepinfer.layers.attention.triton_decode import paged_decode_attention

    q = torch.randn(3, 4, 64, device=DEVICE)
    kc = torch.randn(4 * BS, 2, 64, device=DEVICE)
    table = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    table[0] = torch.tensor([2, 3])
    seq_lens = torch.tensor([20, 0, 0], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, kc, kc, table, seq_lens, 0.125, None, BS, num_splits=4)
    assert torch.isfinite(out).all() and out[1:].abs().max() == 0
