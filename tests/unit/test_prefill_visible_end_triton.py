"""The paged prefill kernel's visible ends (triton_prefill.py): rows that see later keys.

Gemma 3's image tokens attend to the rest of their image (multimodal/step_images.py); the kernel
takes that as one int32 per query row, the key position (exclusive) up to which the row sees.
Here the kernel with visible ends against the dense float32 masked softmax
(tests/triton_support.dense_prefill_reference) on ragged batches: a fresh prompt and chunks on
cached prefixes, image spans at a chunk's start, middle and end (one longer than a query tile),
full attention and windows shorter and longer than a key tile, key floors, the key split on and
off, sequences not picked; visible ends that are all causal give the kernel without them. Runs on
a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) where triton is installed;
skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_support import (  # skips this module without a way to run Triton
    DEVICE,
    INTERPRETED,
    dense_prefill_reference,
    random_paged_batch,
    tiny_paged_prefill,
)

BS = 16
CONFIG = (16, 16, 4, 1)   # small tiles: images cross query and key tiles
# (context, chunk, image spans as (first row of the chunk, length)): an image at the chunk's
# start (a prefix hit that stops right before it), one ending at the chunk's end (the KV length
# bounds it), one in the middle longer than a query tile, two in one chunk, a fresh prompt,
# chunks without images in the same launch, a decode-like row. Sequence 2 is not picked.
SEQS = [
    (40, 30, [(0, 12)]),
    (0, 45, [(3, 20), (30, 15)]),
    (70, 1, []),
    (37, 29, [(10, 19)]),
    (5, 50, [(8, 35)]),
    (121, 40, [(1, 5), (20, 16)]),
    (68, 5, []),
    (16, 33, [(30, 3)]),
]
PICKED = [4, 0, 1, 7, 6, 3, 5]
# A floor per sequence (windows only); at most the chunk's start (SWA Bounded Replay's replay).
FLOORS = [40, 0, 64, 20, 5, 100, 67, 16]


def _dtypes():
    # The interpreter runs on NumPy, which has no bfloat16.
    return [torch.float32, torch.float16 if INTERPRETED else torch.bfloat16]


def tolerance(dtype):
    return 2e-4 if dtype == torch.float32 else 2e-2


def visible_ends(seqs) -> torch.Tensor:
    """One int32 per row of q: position + 1, or the image's end on an image's rows."""
    ends = []
    for context, q_len, spans in seqs:
        row = torch.arange(context + 1, context + q_len + 1, dtype=torch.int32)
        for first, length in spans:
            row[first:first + length] = context + first + length
        ends.append(row)
    return torch.cat(ends).to(DEVICE)


def attend(batch, window, num_splits, visible_end, key_floor=None, config=CONFIG, picked=PICKED, max_seq_len=None):
    """The kernel's output (NaN where not written)."""
    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

    out = torch.full_like(batch.q, float("nan"))
    floors = None if key_floor is None else torch.tensor(key_floor, dtype=torch.int32, device=DEVICE)
    return paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.table, batch.lens, batch.query_start,
                                   max(batch.q_lens), batch.q.shape[2] ** -0.5, window, BS, out=out,
                                   seq_ids=torch.tensor(picked, dtype=torch.int32, device=DEVICE), config=config,
                                   key_floor=floors, num_splits=num_splits, max_seq_len=max_seq_len,
                                   visible_end=visible_end)


def picked_rows(batch, picked=PICKED) -> torch.Tensor:
    keep = torch.zeros(batch.q.shape[0], dtype=torch.bool, device=DEVICE)
    for s in picked:
        keep[int(batch.query_start[s]):int(batch.query_start[s + 1])] = True
    return keep


def make_batch(head_dim, dtype, seqs=SEQS):
    torch.manual_seed(0)
    return random_paged_batch([s[0] for s in seqs], [s[1] for s in seqs], head_dim, dtype, BS)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["unsplit", "split3"])
@pytest.mark.parametrize("window,floors", [(None, False), (5, False), (40, False), (12, True), (40, True)],
                         ids=["full", "window<tile", "window>tile", "window+floor", "window>tile+floor"])
@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d)[6:])
def test_visible_end_matches_dense_reference(num_splits, window, floors, dtype):
    head_dim = 32
    batch = make_batch(head_dim, dtype)
    ends = visible_ends(SEQS)
    key_floor = FLOORS if floors else None
    got = attend(batch, window, num_splits, ends, key_floor)
    ref = dense_prefill_reference(batch, head_dim ** -0.5, window, BS, key_floor, visible_end=ends)
    keep = picked_rows(batch)
    assert got[~keep].isnan().all(), "rows of sequences not picked were written"
    assert not got[keep].isnan().any()
    torch.testing.assert_close(got[keep].float(), ref[keep], atol=tolerance(dtype), rtol=tolerance(dtype))
    # The image term changes what the image rows see (the test would catch a kernel ignoring it).
    causal = dense_prefill_reference(batch, head_dim ** -0.5, window, BS, key_floor)
    assert (causal[keep] - ref[keep]).abs().max() > 0.1


@pytest.mark.parametrize("config", [(32, 16, 4, 2), (16, 32, 4, 2)], ids=lambda c: f"m{c[0]}n{c[1]}")
@pytest.mark.parametrize("window", [None, 9])
def test_visible_end_other_tiles_and_own_split_choice(config, window):
    """Query tiles wider than key tiles and the reverse, float16 (head size 48: padded dims); the
    split count the kernel picks itself from its host bound on the KV length (loose here, so that
    it splits without a context long enough to be slow under the interpreter; with the window, 2
    runs given), against the dense reference."""
    from deepinfer.layers.attention.triton_prefill import split_count

    dtype = torch.float16
    seqs = [(300, 20, [(2, 18)]), (0, 40, [(4, 30)]), (90, 7, [(0, 7)])]
    batch = make_batch(48, dtype, seqs)
    picked = [0, 1, 2]
    ends = visible_ends(seqs)
    max_len = 4 * 512   # a bound on seq_lens: four runs of triton_prefill.MIN_KEYS_PER_SPLIT
    splits = split_count(batch.q.shape[0], 3, batch.q.shape[1], 48, 40, max_len, window, config[0], DEVICE)
    assert (splits > 1) == (window is None)   # a window bounds the keys a program walks: no split
    got = attend(batch, window, None if window is None else 2, ends, config=config, picked=picked,
                 max_seq_len=max_len)
    ref = dense_prefill_reference(batch, 48 ** -0.5, window, BS, visible_end=ends)
    torch.testing.assert_close(got.float(), ref, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_causal_visible_ends_are_the_plain_kernel(num_splits):
    """Visible ends of q + 1 on every row give the kernel without visible ends, with a window
    and floors (the term adds keys ahead, nothing else)."""
    dtype = torch.float32
    batch = make_batch(32, dtype)
    causal = visible_ends([(c, n, []) for c, n, _ in SEQS])
    keep = picked_rows(batch)
    for window, floors in ((None, None), (12, FLOORS)):
        plain = attend(batch, window, num_splits, None, floors)
        with_ends = attend(batch, window, num_splits, causal, floors)
        torch.testing.assert_close(with_ends[keep], plain[keep], atol=1e-6, rtol=1e-6)


def test_visible_end_needs_one_entry_per_row():
    with pytest.raises(ValueError, match="one entry per row of q"):
        tiny_paged_prefill(BS, visible_end=torch.ones(1, dtype=torch.int32, device=DEVICE))
