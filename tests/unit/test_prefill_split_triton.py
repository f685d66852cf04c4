"""The paged prefill kernel split along the keys (triton_prefill.py, flash-decoding style).

Split against unsplit against the dense float32 reference on ragged batches of chunks on cached
prefixes: full attention and windows shorter and longer than a key tile, key floors, split counts
that leave runs with no key (more runs than a program has key tiles), sequences not picked; the
split choice (num_prefill_splits) and the Triton backend choosing a split from its host-side
metadata; on a GPU also SWA Bounded Replay's shape (576 queries over 8k keys, head_dim 256) with
the default tiles. Runs on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1)
where triton is installed; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv_cache.specs import FullAttentionSpec, group_layers
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
CONFIG = (16, 16, 4, 1)   # small tiles: a 200-key sequence is 13 key tiles, so runs are many
# (context, chunk): a long context under a short chunk (few tiles, long key ranges, what the split
# is for), a decode-like row, a fresh chunk, chunks across tile boundaries. Sequence 2 is not picked.
SEQS = [(150, 20), (37, 29), (70, 1), (0, 45), (200, 1), (68, 5), (121, 40)]
PICKED = [4, 0, 1, 6, 3, 5]


def _dtypes():
    # The interpreter runs on NumPy, which has no bfloat16.
    return [torch.float32, torch.float16 if INTERPRETED else torch.bfloat16]


def tolerance(dtype):
    return 2e-4 if dtype == torch.float32 else 2e-2


def attend(batch, window, num_splits, key_floor=None, config=CONFIG, picked=PICKED, max_seq_len=None):
    """The kernel's output with `num_splits` runs (None: its own choice), NaN where not written."""
    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

    out = torch.full_like(batch.q, float("nan"))
    head_dim = batch.q.shape[2]
    floors = None if key_floor is None else torch.tensor(key_floor, dtype=torch.int32, device=DEVICE)
    return paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.table, batch.lens, batch.query_start,
                                   max(batch.q_lens), head_dim ** -0.5, window, BS, out=out,
                                   seq_ids=torch.tensor(picked, dtype=torch.int32, device=DEVICE), config=config,
                                   key_floor=floors, num_splits=num_splits, max_seq_len=max_seq_len)


def picked_rows(batch, picked=PICKED) -> torch.Tensor:
    keep = torch.zeros(batch.q.shape[0], dtype=torch.bool, device=DEVICE)
    for s in picked:
        keep[int(batch.query_start[s]):int(batch.query_start[s + 1])] = True
    return keep


def check(batch, got, unsplit, ref, dtype, picked=PICKED):
    keep = picked_rows(batch, picked)
    assert got[~keep].isnan().all(), "rows of sequences not picked were written"
    assert not got[keep].isnan().any()
    torch.testing.assert_close(got[keep].float(), ref[keep], atol=tolerance(dtype), rtol=tolerance(dtype))
    # Split and unsplit differ only in the order of the sums (and, in 16 bits, in the rounding of
    # the probabilities against another running max).
    close = 1e-5 if dtype == torch.float32 else tolerance(dtype)
    torch.testing.assert_close(got[keep].float(), unsplit[keep].float(), atol=close, rtol=close)


@pytest.mark.parametrize("window", [None, 5, 40], ids=["full", "window<tile", "window>tile"])
@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d)[6:])
def test_split_matches_unsplit_and_reference(window, dtype):
    """2, 3 and 7 runs per program: on the long sequences each run has key tiles of one or more
    of the three loops (window edge, unmasked middle, diagonal), on the short ones the later runs
    have none."""
    torch.manual_seed(0)
    contexts, q_lens = (list(x) for x in zip(*SEQS))
    batch = random_paged_batch(contexts, q_lens, 32, dtype, BS, num_blocks=64)
    ref = dense_prefill_reference(batch, 32 ** -0.5, window, BS)
    unsplit = attend(batch, window, 1)
    check(batch, unsplit, unsplit, ref, dtype)
    for splits in (2, 3, 7):
        check(batch, attend(batch, window, splits), unsplit, ref, dtype)


@pytest.mark.parametrize("window", [16, 40])
@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d)[6:])
def test_split_with_key_floor(window, dtype):
    """Key floors (SWA Bounded Replay) on and between key-tile boundaries and at the chunk's
    start: the runs below a floor see no key and must weigh nothing."""
    torch.manual_seed(1)
    seqs = [(150, 20, 140), (37, 29, 20), (70, 1, 64), (0, 45, 0), (200, 1, 177), (68, 5, 67), (121, 40, 121)]
    contexts, q_lens, floors = (list(x) for x in zip(*seqs))
    batch = random_paged_batch(contexts, q_lens, 32, dtype, BS, num_blocks=64)
    ref = dense_prefill_reference(batch, 32 ** -0.5, window, BS, floors)
    unsplit = attend(batch, window, 1, key_floor=floors)
    check(batch, unsplit, unsplit, ref, dtype)
    for splits in (3, 7):
        check(batch, attend(batch, window, splits, key_floor=floors), unsplit, ref, dtype)


def test_more_runs_than_key_tiles():
    """16 runs over programs of at most 13 key tiles: the last runs of every program are empty,
    for whole programs and for single rows, and the merge gives them no weight."""
    torch.manual_seed(2)
    contexts, q_lens = (list(x) for x in zip(*SEQS))
    batch = random_paged_batch(contexts, q_lens, 48, torch.float32, BS, num_blocks=64)
    ref = dense_prefill_reference(batch, 48 ** -0.5, None, BS)
    unsplit = attend(batch, None, 1)
    check(batch, attend(batch, None, 16), unsplit, ref, torch.float32)


def test_split_choice():
    from deepinfer.layers.attention.triton_prefill import MAX_SPLITS, MIN_KEYS_PER_SPLIT, num_prefill_splits

    # SWA Bounded Replay through a global layer of Gemma 3 1B: 9 tiles x 4 heads on 132 SMs.
    assert num_prefill_splits(36, 32768, 132) == 7           # two waves: 7 x 36 = 252 <= 264
    assert num_prefill_splits(36, 4096, 132) == 7
    assert num_prefill_splits(36, 2048, 132) == 2048 // MIN_KEYS_PER_SPLIT
    assert num_prefill_splits(36, 1000, 132) == 1            # runs of at least MIN_KEYS_PER_SPLIT keys
    assert num_prefill_splits(1, 1 << 20, 132) == MAX_SPLITS
    assert num_prefill_splits(66, 1 << 20, 132) == 4         # half the SMs: still split
    assert num_prefill_splits(67, 1 << 20, 132) == 1         # more: the unsplit kernel
    assert num_prefill_splits(2048, 8192, 132) == 1          # an 8k prefill (64 tiles x 32 heads)


def test_split_count_from_host_values():
    """What paged_prefill_attention chooses: programs with queries bounded by q's rows, the
    workspace by the picked sequences' longest chunk, not by q's other rows."""
    from deepinfer.layers.attention.triton_prefill import MAX_WORKSPACE_BYTES, split_count

    cpu = torch.device("cpu")   # the interpreter's 132 multiprocessors
    # The replay's 576 queries (9 tiles of 64) beside a 64-token chunk: 10 live tiles x 4 heads.
    assert split_count(640, 2, 4, 256, 576, 32768, None, 64, cpu) == 264 // 44
    # A short chunk on a long prefix beside an 8k fresh chunk that SDPA attends (q's rows, not picked).
    assert split_count(8192 + 20, 1, 32, 128, 20, 100_000, None, 128, cpu) == 264 // 32
    # Many sequences under one long chunk: the workspace would pass its bound, so fewer runs.
    per_split = 16 * 4096 * 1 * 129 * 4
    assert split_count(4096 + 15, 16, 1, 128, 4096, 100_000, None, 4096, cpu) == MAX_WORKSPACE_BYTES // per_split


def test_the_warm_up_chunk_splits():
    """The runner's warm-up chunk compiles the split variant: a model of 4 query heads (one
    tile each) and one of 32 (Llama 3 8B's), on an H100/H200's 132 multiprocessors."""
    from deepinfer.layers.attention.backends.triton import SPLIT_WARM_UP_CHUNK
    from deepinfer.layers.attention.triton_prefill import prefill_config, split_count

    cached, new = SPLIT_WARM_UP_CHUNK
    for heads, head_dim in ((4, 256), (32, 128)):
        block_m = prefill_config(head_dim, torch.bfloat16)[0]
        assert split_count(new, 1, heads, head_dim, new, cached + new, None, block_m, torch.device("cpu")) > 1


def test_window_bounds_the_keys_of_the_choice(monkeypatch):
    """With a window a program walks at most WINDOW + BLOCK_M keys whatever the sequence's
    length, and the choice counts only those; without max_seq_len it never splits."""
    from deepinfer.layers.attention import triton_prefill

    seen = []
    choose = triton_prefill.num_prefill_splits
    monkeypatch.setattr(triton_prefill, "num_prefill_splits", lambda *a: seen.append(a) or choose(*a))
    torch.manual_seed(3)
    batch = random_paged_batch([200], [1], 32, torch.float32, BS, num_blocks=16)
    attend(batch, 40, None, picked=[0], max_seq_len=201)
    attend(batch, None, None, picked=[0], max_seq_len=201)
    attend(batch, None, None, picked=[0])
    assert [keys for _, keys, _ in seen] == [40 + CONFIG[0], 201]


def test_backend_splits_from_host_metadata(monkeypatch):
    """The Triton backend passes its host-side longest KV length; with the split thresholds
    lowered to these sizes it splits, and the layer still matches the reference backend."""
    from deepinfer.layers.attention import triton_prefill

    monkeypatch.setattr(triton_prefill, "MIN_KEYS_PER_SPLIT", 32)
    chosen = []
    choose = triton_prefill.num_prefill_splits
    monkeypatch.setattr(triton_prefill, "num_prefill_splits", lambda *a: chosen.append(choose(*a)) or chosen[-1])
    torch.manual_seed(4)
    heads, kv_heads, head_dim, dtype, num_blocks = 4, 1, 64, _dtypes()[1], 40
    # A decode row, then two chunks on cached prefixes (the kernel's rows), the longer one 190 keys.
    chunks = [StepChunk("d", 60, 1, [[1, 2, 3, 4]], sample=True),
              StepChunk("a", 170, 20, [list(range(5, 17))], sample=True),
              StepChunk("b", 40, 9, [list(range(17, 21))], sample=True)]
    groups = group_layers([FullAttentionSpec(kv_heads, head_dim, dtype, dtype)])
    cache = (torch.randn(num_blocks * BS, kv_heads, head_dim, device=DEVICE).to(dtype),
             torch.randn(num_blocks * BS, kv_heads, head_dim, device=DEVICE).to(dtype))
    token_ids = {c.request_id: [1] * (c.start + c.num_tokens) for c in chunks}
    layer = Attention(0, heads, kv_heads, head_dim, scale=head_dim ** -0.5)
    q, k, v = (torch.randn(30, h, head_dim, dtype=dtype, device=DEVICE) for h in (heads, kv_heads, kv_heads))
    outs = {}
    for backend in ("reference", "triton"):
        caches = [(cache[0].clone(), cache[1].clone())]
        inputs = build_step_inputs(chunks, token_ids, groups, BS, [0], [0], caches, DEVICE, backend=backend)
        with forward_context(inputs.attention):
            outs[backend] = layer(q, k, v).float()
    group = inputs.attention.groups[0]
    assert group.kernel_max_seq_len == 190 and group.kernel_max_prefill_len == 20
    assert chosen and chosen[0] > 1   # the default tiles (16 queries in float32, 64 or more in 16 bits)
    torch.testing.assert_close(outs["triton"], outs["reference"], atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.skipif(INTERPRETED, reason="the replay's shape takes minutes under the interpreter")
def test_replay_shape_with_default_tiles(monkeypatch):
    """SWA Bounded Replay through a global layer of Gemma 3 1B (4 query heads, 1 KV head,
    head_dim 256, bf16, the engine's tiles): 576 queries over 8k keys, beside a short chunk.
    The kernel's own choice splits (about 40 programs with queries on a GPU's 100+ SMs) and
    matches the unsplit kernel and the dense reference."""
    from deepinfer.layers.attention import triton_prefill

    chosen = []
    choose = triton_prefill.num_prefill_splits
    monkeypatch.setattr(triton_prefill, "num_prefill_splits", lambda *a: chosen.append(choose(*a)) or chosen[-1])
    torch.manual_seed(5)
    contexts, q_lens = [8192 - 576, 300], [576, 64]
    batch = random_paged_batch(contexts, q_lens, 256, torch.bfloat16, BS, heads=4, kv_heads=1, num_blocks=560)
    ref = dense_prefill_reference(batch, 256 ** -0.5, None, BS)
    unsplit = attend(batch, None, 1, config=None, picked=[0, 1])
    split = attend(batch, None, None, config=None, picked=[0, 1], max_seq_len=8192)
    assert len(chosen) == 1 and chosen[0] > 1
    check(batch, unsplit, unsplit, ref, torch.bfloat16, picked=[0, 1])
    check(batch, split, unsplit, ref, torch.bfloat16, picked=[0, 1])
