"""Long chunks on a cached prefix through SDPA's fused kernel (layers/attention/sdpa_extend.py).

The prefix/diagonal split and the merge by log-sum-exp against dense attention, and the Triton
backend's routing against the reference backend. The buckets and thresholds are shrunk so that
small shapes cross every boundary (a prefix shorter than a bucket, one ending on a bucket, leading
queries, padded parts). On a GPU the parts run on cuDNN; on the CPU under Triton's interpreter on
torch's CPU flash kernel (the merge kernel interpreted).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.worker.request_states import StepChunk
from tests.triton_support import (  # skips this module without a way to run Triton
    DEVICE,
    INTERPRETED,
    dense_prefill_reference,
    random_paged_batch,
)
from tests.unit.test_triton_attention import kernel_rows, run_backends

# Imported after the skip above: the module imports triton.
sdpa_extend = pytest.importorskip("deepinfer.layers.attention.sdpa_extend")

BS = 16
# cuDNN takes half precision only; the CPU kernel runs float32, and the interpreter has no bfloat16.
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
TOL = 2e-4 if DTYPE == torch.float32 else 2e-2


def cache_rows(batch, length: int) -> torch.Tensor:
    pos = torch.arange(length, device=DEVICE)
    return batch.tables[0][pos // BS].long() * BS + pos % BS


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(sdpa_extend, "PREFIX_BUCKET", 32)
    monkeypatch.setattr(sdpa_extend, "LENGTH_BUCKET", 16)
    monkeypatch.setattr(sdpa_extend, "EXTEND_MIN_SHAPES", ((16, 32),))


@pytest.mark.parametrize("start,num_tokens", [(10, 20), (32, 16), (70, 45), (100, 7), (64, 33)],
                         ids=["prefix<bucket", "prefix=bucket", "leading-queries", "few-queries", "two-buckets"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 128), (4, 1, 256)],
                         ids=["gqa", "mha", "d256"])
def test_extend_attention_matches_dense(small_buckets, start, num_tokens, heads, kv_heads, head_dim):
    torch.manual_seed(start + num_tokens)
    batch = random_paged_batch([start], [num_tokens], head_dim, DTYPE, BS, heads=heads, kv_heads=kv_heads,
                               num_blocks=12)
    expected = dense_prefill_reference(batch, head_dim ** -0.5, None, BS)
    rows = sdpa_extend.gathered_rows(start, num_tokens)
    assert rows % 16 == 0 and rows >= start + num_tokens
    keys, values = (sdpa_extend.gather_keys(cache, cache_rows(batch, start + num_tokens), rows, DTYPE)
                    for cache in (batch.k_cache, batch.v_cache))
    assert not keys[start + num_tokens:].any()
    out = sdpa_extend.extend_attention(batch.q, keys, values, start, head_dim ** -0.5)
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)


def test_merge_parts_is_the_softmax_of_both_key_sets():
    """Two parts with their log-sum-exps merge to the attention over the union of their keys,
    also where one part's mass is negligible (lse far apart: no overflow)."""
    torch.manual_seed(0)
    q = torch.randn(40, 3, 32, device=DEVICE)
    k = torch.randn(50, 3, 32, device=DEVICE)
    v = torch.randn(50, 3, 32, device=DEVICE)
    k[30:] *= 40.0   # the second set dominates some rows by far
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.2
    parts = [(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[keys]), torch.logsumexp(s, -1))
             for s, keys in ((scores[..., :30], slice(0, 30)), (scores[..., 30:], slice(30, 50)))]
    out = torch.empty_like(q)
    sdpa_extend.merge_parts(parts[0][0], parts[0][1], parts[1][0], parts[1][1], out)
    expected = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
def test_backend_routes_long_chunks_on_a_prefix(small_buckets, window, cache_dtype):
    """A decode, a fresh chunk, a long chunk on a long prefix (this path), one too short and one
    on too short a prefix (the paged kernel): every row matches the reference backend, which reads
    the same cache (an fp8 one converted as the gather converts it). A sliding window keeps every
    chunk on a prefix in the paged kernel."""
    if INTERPRETED and cache_dtype is not None:
        pytest.skip("the interpreter runs on NumPy, which has no float8")
    dtype = torch.float16 if INTERPRETED else DTYPE
    chunks = [StepChunk("dec", 30, 1, [[1, 2]], sample=True),
              StepChunk("fresh", 0, 24, [[3, 4]], sample=True),
              StepChunk("long", 40, 20, [[5, 6, 7, 8]], sample=True),
              StepChunk("short", 40, 10, [[9, 10, 11, 12]], sample=True),
              StepChunk("near", 20, 30, [[13, 14, 15, 16]], sample=True)]
    ref, out, inputs = run_backends(chunks, 8, 2, 64, window, dtype, seed=0, cache_dtype=cache_dtype)
    group = inputs.attention.groups[0]
    flash = DEVICE.type == "cpu" or dtype != torch.float32
    if window is None and flash:
        [(start, end, prefill, position, rows)] = group.extend_chunks
        assert (start, end, prefill, position) == (25, 45, 1, 40) and kernel_rows(group) == [2, 3]
        assert rows.tolist() == [b * BS + i for b in (5, 6, 7, 8) for i in range(BS)][:60]
    else:
        assert group.extend_chunks == [] and 1 in kernel_rows(group)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_a_refused_chunk_falls_back_to_the_paged_kernel(small_buckets, monkeypatch, caplog):
    """cuDNN refusing a shape (no plan: a build without it) costs a warning, not the step: the
    chunk attends in the paged kernel, matches the reference, and later steps route there."""
    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: No execution plans support the graph.")

    monkeypatch.setattr(sdpa_extend, "_attend", refuse)
    dtype = torch.float16 if INTERPRETED else DTYPE
    chunks = [StepChunk("dec", 30, 1, [[1, 2]], sample=True),
              StepChunk("long", 40, 20, [[5, 6, 7, 8]], sample=True),
              StepChunk("short", 40, 10, [[9, 10, 11, 12]], sample=True)]
    with caplog.at_level("WARNING"):
        ref, out, inputs = run_backends(chunks, 8, 2, 64, None, dtype, seed=1)
    assert len(inputs.attention.groups[0].extend_chunks) == 1   # routed there, then refused
    assert inputs.attention.backend.extend_failed and "paged prefill kernel from now on" in caplog.text
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_routing_rule():
    assert sdpa_extend.takes(2048, 2048) and sdpa_extend.takes(8192, 1024) and sdpa_extend.takes(100_000, 16384)
    assert not sdpa_extend.takes(4096, 1024) and not sdpa_extend.takes(1024, 8192) and not sdpa_extend.takes(8192, 512)


def test_workspace_reserved_only_where_the_path_can_run():
    from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
    from deepinfer.layers.attention.backends.triton import TritonBackend

    backend = TritonBackend(DEVICE, torch.bfloat16)
    full = group_layers([FullAttentionSpec(8, 128, torch.bfloat16, torch.bfloat16)])
    window = group_layers([SlidingWindowSpec(8, 128, torch.bfloat16, torch.bfloat16, sliding_window=512)])
    assert backend.workspace_bytes(full, 3072, 8192, 32) == 0          # no chunk can have a long prefix
    assert backend.workspace_bytes(full, 131072, 512, 32) == 0         # no chunk is long enough
    assert backend.workspace_bytes(window, 131072, 16384, 32) == 0     # windows stay in the kernel
    reserved = backend.workspace_bytes(full, 131072, 16384, 32)
    # keys + values of 128k tokens in bf16 at least, and the queries of a 16k chunk
    assert reserved > 2 * 131072 * 8 * 128 * 2 + 16384 * 32 * 128 * 2


@pytest.mark.skipif(DEVICE.type != "cuda", reason="device memory is measured on a GPU")
def test_workspace_bound_covers_a_call():
    """The reserve (workspace_bytes) bounds what a call on a GPU allocates beyond its inputs."""
    start, num_tokens, heads, kv_heads, head_dim = 9000, 4100, 32, 8, 128
    batch = random_paged_batch([start], [num_tokens], head_dim, DTYPE, BS, heads=heads, kv_heads=kv_heads,
                               num_blocks=-(-(start + num_tokens) // BS) + 2)
    out = torch.empty_like(batch.q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    rows = sdpa_extend.gathered_rows(start, num_tokens)
    keys, values = (sdpa_extend.gather_keys(cache, cache_rows(batch, start + num_tokens), rows, DTYPE)
                    for cache in (batch.k_cache, batch.v_cache))
    sdpa_extend.extend_attention(batch.q, keys, values, start, head_dim ** -0.5, out=out)
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - before
    bound = sdpa_extend.workspace_bytes(start + num_tokens, num_tokens, heads, kv_heads, head_dim, DTYPE)
    assert used <= bound, (used, bound)
    expected = dense_prefill_reference(batch, head_dim ** -0.5, None, BS)
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
