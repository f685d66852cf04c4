"""The Triton attention kernels against the reference backend, through the real step inputs.

Random batches mix decodes, fresh prefill chunks (from position 0: SDPA's flash kernel over the
step's own K/V when long enough and no window cuts them) and chunks on top of cached prefixes
(the paged prefill kernel); block tables are random permutations of the pool, and windows are
on or off. The prefill kernel's tile split is also checked directly, on small tiles. Runs on a
GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) where triton is installed;
skipped otherwise.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.layers.attention import Attention, forward_context
from deepinfer.worker.input_batch import build_step_inputs
from deepinfer.worker.request_states import StepChunk
from tests.triton_support import (  # skips this module without a way to run Triton
    DEVICE,
    INTERPRETED,
    dense_prefill_reference,
    random_paged_batch,
)

BS = 16

CASES = [   # (heads, kv_heads, head_dim, window, dtype)
    (8, 2, 64, None, torch.float32),
    (9, 3, 64, None, torch.bfloat16),       # SmolLM2-135M's shape: a group of 3 heads
    (4, 1, 256, 20, torch.float32),         # Gemma 3 270M's head size, sliding window
    (32, 8, 128, None, torch.bfloat16),     # Llama-3-8B's shape
    (8, 8, 128, 37, torch.bfloat16),        # no grouping, a window not a multiple of anything
]


MIN_FRESH = 8   # fresh chunks this long go to SDPA in these tests (the engine's threshold is 512)


def random_batch(rng: random.Random, num_blocks: int):
    """Decodes, verifications of draft tokens, fresh prefill chunks (from position 0) and chunks
    on cached prefixes, with distinct random tables."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    chunks = []
    for i in range(rng.randint(1, 6)):
        kind = rng.choice(["decode", "fresh", "extend"])
        context = 0 if kind == "fresh" else rng.randint(0, 150 if not INTERPRETED else 100)
        num_tokens = 1 if kind == "decode" else rng.randint(1, 90 if not INTERPRETED else 40)
        drafts = []
        if kind == "decode":
            context += 1     # a decode has at least its previous token
            if rng.random() < 0.5:   # a speculative verification: 1 known token + drafts
                drafts = [7] * rng.randint(1, 5)
                num_tokens += len(drafts)
        total = context + num_tokens
        blocks = [free.pop() for _ in range(-(-total // BS))]
        chunks.append(StepChunk(f"r{i}", context, num_tokens, [blocks], sample=True, spec_token_ids=drafts))
    return chunks


def run_backends(chunks, heads, kv_heads, head_dim, window, dtype, seed, decode_splits=1, num_blocks=80,
                 cache_dtype=None, rows_as_decodes=False):
    """The layer's output under the reference and the triton backend, and the triton step inputs.
    `cache_dtype`: the caches' storage dtype (kv_cache_dtype), None: the model's.
    `rows_as_decodes`: the triton step lays verifying chunks and short continuations out as
    decode rows (as a CUDA graph replays them); the reference keeps them as prefill chunks."""
    torch.manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    spec = (SlidingWindowSpec(kv_heads, head_dim, dtype, cache_dtype, sliding_window=window) if window
            else FullAttentionSpec(kv_heads, head_dim, dtype, cache_dtype))
    groups = group_layers([spec])
    cache = [(torch.randn(num_blocks * BS, kv_heads, head_dim, device=DEVICE).to(cache_dtype),
              torch.randn(num_blocks * BS, kv_heads, head_dim, device=DEVICE).to(cache_dtype))]
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
                                   decode_splits=decode_splits, fresh_sdpa_min_tokens=MIN_FRESH,
                                   rows_as_decodes=rows_as_decodes and backend == "triton")
        with forward_context(inputs.attention):
            outs[backend] = layer(q, k, v).float()
    return outs["reference"], outs["triton"], inputs


def expected_split(inputs, window, dtype):
    """(SDPA token ranges, kernel prefill rows) the dispatch rule gives for these step inputs."""
    flash = DEVICE.type != "cuda" or dtype != torch.float32
    prefills = inputs.chunks[inputs.attention.num_decode_tokens:]
    sdpa, kernel = [], []
    for i, (c, token_range) in enumerate(zip(prefills, inputs.attention.prefill_query_ranges)):
        if flash and c.start == 0 and c.num_tokens >= MIN_FRESH and (window is None or window >= c.num_tokens):
            sdpa.append(token_range)
        else:
            kernel.append(i)
    return sdpa, kernel


def kernel_rows(group) -> list[int]:
    return [] if group.kernel_prefill_rows is None else group.kernel_prefill_rows.tolist()


def tolerance(dtype):
    return 2e-4 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}w{c[3]}{str(c[4])[6:]}")
@pytest.mark.parametrize("seed", range(3 if not INTERPRETED else 2))
def test_triton_matches_reference(case, seed):
    heads, kv_heads, head_dim, window, dtype = case
    if INTERPRETED and dtype == torch.bfloat16:
        dtype = torch.float16   # the interpreter runs on NumPy, which has no bfloat16
    rng = random.Random(seed)
    chunks = random_batch(rng, 80)
    ref, out, inputs = run_backends(chunks, heads, kv_heads, head_dim, window, dtype, seed,
                                    decode_splits=rng.choice([1, 3, 8]))
    group = inputs.attention.groups[0]
    assert (group.sdpa_prefill_ranges, kernel_rows(group)) == expected_split(inputs, window, dtype)
    torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}w{c[3]}{str(c[4])[6:]}")
@pytest.mark.parametrize("seed", range(2))
def test_verifications_as_decode_rows_match_reference(case, seed):
    """A verify step as a CUDA graph runs it: each query of a chunk verifying drafts (or of a short
    continuation) is its own decode row, attending up to its own position, in the decode kernel."""
    heads, kv_heads, head_dim, window, dtype = case
    if INTERPRETED and dtype == torch.bfloat16:
        dtype = torch.float16
    rng = random.Random(100 + seed)
    free = list(range(1, 80))
    rng.shuffle(free)
    chunks = []
    for i in range(rng.randint(2, 6)):
        context = rng.randint(1, 150 if not INTERPRETED else 60)
        drafts = [7] * rng.randint(0, 5)
        # Or a short continuation of known tokens (a draft model catching up), laid out alike.
        known = rng.randint(2, 6) if not drafts and rng.random() < 0.5 else 1
        blocks = [free.pop() for _ in range(-(-(context + known + len(drafts)) // BS))]
        chunks.append(StepChunk(f"r{i}", context, known + len(drafts), [blocks], sample=True, spec_token_ids=drafts))
    # Plain decodes first: then both layouts put the rows in the same order (the reference's
    # decodes, then its prefill chunks), so the same q/k/v rows are the same tokens in both.
    chunks.sort(key=lambda c: c.num_tokens > 1)
    ref, out, inputs = run_backends(chunks, heads, kv_heads, head_dim, window, dtype, seed,
                                    decode_splits=rng.choice([1, 3, 8]), rows_as_decodes=True)
    assert inputs.attention.num_decode_tokens == inputs.attention.num_tokens   # all rows decode rows
    torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs on NumPy, which has no float8")
@pytest.mark.parametrize("case", [c for c in CASES if c[4] == torch.bfloat16] + [(8, 2, 64, None, torch.float32)],
                         ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}w{c[3]}{str(c[4])[6:]}")
@pytest.mark.parametrize("seed", range(2))
def test_fp8_cache_matches_reference(case, seed):
    """kv_cache_dtype="fp8": the kernels convert the e4m3 cache in registers, the write kernel
    rounds the step's own k/v to the cached values, so fresh chunks (SDPA), chunks on cached
    prefixes and decodes all match the reference, which reads the same cache."""
    heads, kv_heads, head_dim, window, dtype = case
    rng = random.Random(seed)
    chunks = random_batch(rng, 80)
    ref, out, inputs = run_backends(chunks, heads, kv_heads, head_dim, window, dtype, seed,
                                    decode_splits=rng.choice([1, 3, 8]), cache_dtype=torch.float8_e4m3fn)
    group = inputs.attention.groups[0]
    assert (group.sdpa_prefill_ranges, kernel_rows(group)) == expected_split(inputs, window, dtype)
    torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("window", [None, 10, 30], ids=["full", "window<chunk", "window>=chunk"])
def test_fresh_chunks_dispatch(window):
    """A decode, a long fresh chunk, a fresh chunk under the threshold and one on a cached prefix:
    the long fresh one goes to SDPA unless a window shorter than it cuts it; all match the reference."""
    dtype = torch.float16 if INTERPRETED else torch.bfloat16
    chunks = [StepChunk("dec", 30, 1, [[1, 2]], sample=True),
              StepChunk("fresh", 0, 24, [[3, 4]], sample=True),
              StepChunk("short", 0, MIN_FRESH - 1, [[5]], sample=True),
              StepChunk("extend", 40, 20, [[6, 7, 8, 9]], sample=True)]
    ref, out, inputs = run_backends(chunks, 8, 2, 64, window, dtype, seed=0)
    group = inputs.attention.groups[0]
    if window == 10:
        assert group.sdpa_prefill_ranges == [] and kernel_rows(group) == [0, 1, 2]
        assert group.kernel_max_prefill_len == 24
    else:
        assert group.sdpa_prefill_ranges == [(1, 25)] and kernel_rows(group) == [1, 2]
        assert group.kernel_max_prefill_len == 20
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bucket", [1, 16, 64], ids=["exact", "next-rows", "zero-padded"])
def test_fresh_chunk_length_buckets(bucket, monkeypatch):
    """SDPA sees each fresh chunk's length rounded up to the bucket (so cuDNN builds few plans),
    over the step's next rows where they exist (bucket 16: 24 -> 32 rows, within the step) or
    zeros past its end (bucket 64); the chunk's own rows match the reference either way."""
    import deepinfer.layers.attention.layer as layer_module

    monkeypatch.setattr(layer_module, "SDPA_LENGTH_BUCKET", bucket)
    seen = []
    causal_flash = Attention._causal_flash
    monkeypatch.setattr(Attention, "_causal_flash",
                        lambda self, q, k, v, batch=1: seen.append(q.shape[0]) or causal_flash(self, q, k, v, batch))
    dtype = torch.float16 if INTERPRETED else torch.bfloat16
    chunks = [StepChunk("dec", 30, 1, [[1, 2]], sample=True),
              StepChunk("fresh", 0, 24, [[3, 4]], sample=True),
              StepChunk("extend", 40, 27, [[6, 7, 8, 9, 10]], sample=True)]
    ref, out, inputs = run_backends(chunks, 8, 2, 64, None, dtype, seed=0)
    assert inputs.attention.groups[0].sdpa_prefill_ranges == [(1, 25)]
    assert seen == [{1: 24, 16: 32, 64: 64}[bucket]]
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_equal_length_runs():
    """Adjacent fresh chunks of one bucket-aligned length go to SDPA as one batch; others alone."""
    from deepinfer.layers.attention.layer import SDPA_LENGTH_BUCKET as B
    from deepinfer.layers.attention.layer import equal_length_runs

    assert equal_length_runs([(0, B), (B, 2 * B), (2 * B, 3 * B)]) == [(0, 3 * B, 3)]
    assert equal_length_runs([(0, B + 1), (B + 1, 2 * B + 2)]) == [(0, B + 1, 1), (B + 1, 2 * B + 2, 1)]
    assert equal_length_runs([(1, B + 1), (B + 1, 3 * B + 1), (3 * B + 1, 5 * B + 1)]) == \
        [(1, B + 1, 1), (B + 1, 5 * B + 1, 2)]
    assert equal_length_runs([(0, B), (B + 5, 2 * B + 5)]) == [(0, B, 1), (B + 5, 2 * B + 5, 1)]   # not adjacent


def test_equal_fresh_chunks_in_one_call(monkeypatch):
    """Three adjacent fresh chunks of 16 tokens with a bucket of 16: one SDPA call of batch 3,
    behind a decode and before an extend, matching the reference."""
    import deepinfer.layers.attention.layer as layer_module

    monkeypatch.setattr(layer_module, "SDPA_LENGTH_BUCKET", 16)
    seen = []
    causal_flash = Attention._causal_flash
    monkeypatch.setattr(Attention, "_causal_flash", lambda self, q, k, v, batch=1: (
        seen.append((q.shape[0], batch)) or causal_flash(self, q, k, v, batch)))
    dtype = torch.float16 if INTERPRETED else torch.bfloat16
    chunks = [StepChunk("dec", 30, 1, [[1, 2]], sample=True)]
    chunks += [StepChunk(f"fresh{i}", 0, 16, [[3 + i]], sample=True) for i in range(3)]
    chunks += [StepChunk("extend", 40, 9, [[6, 7, 8, 9]], sample=True)]
    ref, out, inputs = run_backends(chunks, 8, 2, 64, None, dtype, seed=2)
    assert inputs.attention.groups[0].sdpa_prefill_ranges == [(1, 17), (17, 33), (33, 49)]
    assert seen == [(48, 3)]
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_one_fresh_chunk_step():
    """A step that is one fresh chunk returns SDPA's output without a copy into `out`
    (only rows padded up to the length bucket, dropped by a view)."""
    dtype = torch.float16 if INTERPRETED else torch.bfloat16
    chunks = [StepChunk("fresh", 0, 40, [[4, 2, 7]], sample=True)]
    ref, out, inputs = run_backends(chunks, 32, 8, 128, None, dtype, seed=1)
    group = inputs.attention.groups[0]
    assert group.sdpa_prefill_ranges == [(0, 40)] and group.kernel_prefill_rows is None
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("config", [(16, 16, 4, 1), (32, 16, 4, 2), (16, 32, 4, 2)],
                         ids=lambda c: f"m{c[0]}n{c[1]}")
@pytest.mark.parametrize("window", [None, 5, 16, 40])
@pytest.mark.parametrize("head_dim,dtype", [(32, torch.float32), (48, torch.float16)])
def test_prefill_kernel_tile_split(config, window, head_dim, dtype):
    """The kernel's three key ranges (window edge, unmasked middle, diagonal) on small tiles, so
    that chunks span many of them: contexts and chunk lengths not multiples of any tile size,
    a head size that is not a power of two, a window shorter than a tile and one longer."""
    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

    torch.manual_seed(0)
    # (Picked so that on each config some tile's window edge or diagonal falls exactly on a key
    # tile boundary, where an off-by-one in the split would go unmasked.)
    contexts, q_lens = [0, 37, 70, 5, 0, 80, 68], [45, 29, 1, 50, 10, 1, 5]
    batch = random_paged_batch(contexts, q_lens, head_dim, dtype, BS)
    q, query_start = batch.q, batch.query_start
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    # Attend sequences 0, 1 and 3 only: sequence 2's rows must stay untouched.
    picked = torch.tensor([3, 0, 1, 6, 4, 5], dtype=torch.int32, device=DEVICE)
    paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.table, batch.lens, query_start, max(q_lens),
                            scale, window, BS, out=out, seq_ids=picked, config=config)
    ref = dense_prefill_reference(batch, scale, window, BS)
    skipped = slice(int(query_start[2]), int(query_start[3]))
    assert out[skipped].isnan().all()
    keep = torch.ones(q.shape[0], dtype=torch.bool, device=DEVICE)
    keep[skipped] = False
    torch.testing.assert_close(out[keep].float(), ref[keep], atol=tolerance(dtype), rtol=tolerance(dtype))


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


@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
def test_decode_kernel_compiles_once_per_variant():
    """What changes from step to step is a runtime argument of the decode kernels (see
    triton_decode.py), so launches that differ only in the block table's width, the split count
    and the offset of the lengths reuse what was compiled: one split kernel per SINGLE_SPLIT value
    and one merge kernel. Before, each split count and each new divisibility of the table's width
    compiled again, ~0.5-0.9 s a time on the H200."""
    import triton

    from deepinfer.layers.attention.triton_decode import paged_decode_attention

    compiled: list[str] = []
    hooks = triton.knobs.runtime
    previous = hooks.jit_post_compile_hook
    hooks.jit_post_compile_hook = lambda **kwargs: compiled.append(kwargs["fn"].name)
    try:
        # 5 query heads per KV head and head_dim 80: a shape no other test compiles.
        q = torch.randn(8, 10, 80, device=DEVICE, dtype=torch.float16)
        cache = torch.randn(64 * BS, 2, 80, device=DEVICE, dtype=torch.float16)
        lens = torch.tensor([0, 37, 5, 90, 64, 17, 3, 120, 100], dtype=torch.int32, device=DEVICE)
        for width, splits, offset in [(8, 1, 0), (16, 1, 1), (17, 3, 0), (32, 2, 1), (33, 5, 0), (48, 16, 1)]:
            table = torch.randint(1, 64, (8, width), dtype=torch.int32, device=DEVICE)
            paged_decode_attention(q, cache, cache, table, lens[offset:offset + 8], 0.1, None, BS, num_splits=splits)
        torch.cuda.synchronize()
    finally:
        hooks.jit_post_compile_hook = previous
    assert compiled.count("_decode_split_kernel") <= 2, compiled
    assert compiled.count("_merge_splits_kernel") <= 1, compiled
