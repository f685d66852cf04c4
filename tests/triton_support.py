"""What the Triton kernel tests share: skip without a way to run Triton, patch its interpreter.

Import it at the top of a test module, before the kernel modules:

    from tests.triton_support import DEVICE, INTERPRETED

The module is skipped unless there is a CUDA device, or TRITON_INTERPRET=1 and triton is
installed (then the kernels run on the CPU under Triton's interpreter).
"""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace

import pytest
import torch

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

    if not getattr(_interp, "_deepinfer_patched", False):
        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._deepinfer_patched = True

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")


def random_paged_batch(contexts: list[int], q_lens: list[int], head_dim: int, dtype: torch.dtype,
                       block_size: int, heads: int = 4, kv_heads: int = 2, num_blocks: int = 48) -> SimpleNamespace:
    """Prefill chunks on top of cached contexts, in a paged cache of random K/V with blocks
    scattered at random (block 0, the null block, never used): what the prefill kernel tests
    feed the kernel and the dense reference. Draws from torch's global generator, in a fixed
    order (the block permutation, K, V, q), so a seed gives the same batch everywhere."""
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    perm = torch.randperm(num_blocks - 1) + 1
    tables, used = [], 0
    for n in seq_lens:
        tables.append(perm[used:used + -(-n // block_size)].to(torch.int32))
        used += len(tables[-1])
    table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    q = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype, device=DEVICE)
    return SimpleNamespace(
        seq_lens=seq_lens, q_lens=q_lens, tables=[t.to(DEVICE) for t in tables], table=table.to(DEVICE),
        k_cache=k_cache, v_cache=v_cache, q=q, lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start=torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=DEVICE))


def dense_prefill_reference(batch: SimpleNamespace, scale: float, window: int | None, block_size: int,
                            floors: list[int] | None = None, visible_end: torch.Tensor | None = None) -> torch.Tensor:
    """Each chunk's causal (windowed) attention over its gathered rows, densely in float32; with
    `floors`, a chunk sees no key below its floor (SWA Bounded Replay); with `visible_end` (one
    per row of q), a row sees keys below its entry instead of keys up to its position (an
    image's tokens see the rest of their image), still bounded below by the window and floor."""
    q, k_cache, v_cache = batch.q, batch.k_cache, batch.v_cache
    outs, start = [], 0
    group = q.shape[1] // k_cache.shape[1]
    floors = floors or [0] * len(batch.seq_lens)
    for table, seq_len, q_len, floor in zip(batch.tables, batch.seq_lens, batch.q_lens, floors):
        pos = torch.arange(seq_len, device=q.device)
        rows = table[pos // block_size].long() * block_size + pos % block_size
        keys = k_cache[rows].float().repeat_interleave(group, 1)
        values = v_cache[rows].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len].float(), keys) * scale
        q_pos = pos[seq_len - q_len:]
        ends = q_pos + 1 if visible_end is None else visible_end[start:start + q_len].to(pos.device)
        visible = (pos[None, :] < ends[:, None]) & (pos[None, :] >= floor)
        if window:
            visible &= pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values))
        start += q_len
    return torch.cat(outs)


def tiny_paged_prefill(block_size: int, **extra):
    """The paged prefill kernel (triton_prefill.paged_prefill_attention) on one 4-token sequence
    of one block, with `extra` keywords: what the tests of its argument checks call."""
    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

    q = torch.randn(4, 2, 32, device=DEVICE)
    cache = torch.randn(4 * block_size, 2, 32, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    return paged_prefill_attention(q, cache, cache, one.view(1, 1), one * 4,
                                   torch.tensor([0, 4], dtype=torch.int32, device=DEVICE), 4, 0.1, None,
                                   block_size, **extra)
