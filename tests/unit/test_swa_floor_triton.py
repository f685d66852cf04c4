"""SWA Bounded Replay on the Triton backend: the paged prefill kernel's key floor.

The steps of tests/unit/test_swa_floor.py (a replayed segment in one chunk and in several, then
decodes past it, beside a plain request) on the Triton backend against the reference; the
kernel's floor directly on small tiles, where a floor falls on and between key-tile boundaries
and inside the diagonal tiles; and the fresh-chunk SDPA path kept away from full groups whose
write floor keeps cached rows. Runs on a GPU, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1) where triton is installed; skipped otherwise.
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
from tests.unit.test_swa_floor import FULL, SCENARIOS, SWA, run_steps, scenario_steps

BS = 16


def _dtypes():
    # The interpreter runs on NumPy, which has no bfloat16.
    return [torch.float32, torch.float16 if INTERPRETED else torch.bfloat16]


def tolerance(dtype):
    return 2e-4 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_replay_steps_match_reference(name, dtype):
    """Every step's output of both layers as the reference computes it; the SWA group's prefill
    rows carry the requests' window floors (the plain request's is 0), the full group none."""
    window, requests, steps = scenario_steps(name)
    _, ref = run_steps("reference", window, requests, steps, dtype, DEVICE)
    _, out = run_steps("triton", window, requests, steps, dtype, DEVICE)
    for step, (r, o) in enumerate(zip(ref, out)):
        meta = o.inputs.attention
        prefills = o.inputs.chunks[meta.num_decode_tokens:]
        if any(c.window_floor for c in prefills):
            assert meta.groups[SWA].kernel_key_floor.tolist() == [c.window_floor for c in prefills]
        else:
            assert meta.groups[SWA].kernel_key_floor is None
        assert meta.groups[FULL].kernel_key_floor is None
        for layer in (SWA, FULL):
            torch.testing.assert_close(o.outs[layer].float(), r.outs[layer].float(), atol=tolerance(dtype),
                                       rtol=tolerance(dtype), msg=lambda m, s=step, la=layer: f"step {s} layer {la}: {m}")


def test_fresh_chunk_under_a_write_floor_stays_in_the_kernel():
    """A replay from position 0 (cached prefix shorter than the window) keeping full rows below
    its write floor: the SWA group may take SDPA over the step's own K/V (it writes them all),
    the full group may not (its cached rows differ from the recomputed ones), and both match."""
    dtype = _dtypes()[1]
    window, requests, steps = scenario_steps("from-zero")
    kw = dict(dtype=dtype, device=DEVICE, fresh_sdpa_min_tokens=8)
    _, ref = run_steps("reference", window, requests, steps, **kw)
    _, out = run_steps("triton", window, requests, steps, **kw)
    first = out[0].inputs.attention
    replay_range = first.prefill_query_ranges[[c.request_id for c in out[0].inputs.chunks].index("replay")]
    assert first.groups[SWA].sdpa_prefill_ranges == [replay_range]   # 16-bit: flash takes them
    assert first.groups[FULL].sdpa_prefill_ranges == []
    for r, o in zip(ref, out):
        for layer in (SWA, FULL):
            torch.testing.assert_close(o.outs[layer].float(), r.outs[layer].float(), atol=tolerance(dtype),
                                       rtol=tolerance(dtype))


@pytest.mark.parametrize("config", [(16, 16, 4, 1), (32, 16, 4, 2), (16, 32, 4, 2)], ids=lambda c: f"m{c[0]}n{c[1]}")
@pytest.mark.parametrize("window", [5, 16, 40])
@pytest.mark.parametrize("head_dim,dtype", [(32, torch.float32), (48, torch.float16)])
def test_prefill_kernel_key_floor(config, window, head_dim, dtype):
    """The floor on small tiles: floors on a key-tile boundary and between, inside the chunk's
    first query tile (the diagonal tiles apply it) and at the chunk's start, with windows
    shorter and longer than a tile; a floor of 0 is the floor-less kernel, and sequences not
    picked keep their rows."""
    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

    torch.manual_seed(0)
    # (context, chunk, floor); a floor is at most the chunk's start (the replay starts there).
    seqs = [(32, 29, 32), (37, 40, 20), (70, 1, 64), (5, 50, 5), (0, 10, 0), (80, 1, 50), (68, 5, 67), (16, 33, 16)]
    contexts, q_lens, floors = (list(x) for x in zip(*seqs))
    batch = random_paged_batch(contexts, q_lens, head_dim, dtype, BS)
    q, query_start = batch.q, batch.query_start
    scale = head_dim ** -0.5
    picked = torch.tensor([3, 0, 1, 7, 6, 4, 5], dtype=torch.int32, device=DEVICE)   # not sequence 2

    def attend(key_floor):
        out = torch.full_like(q, float("nan"))
        return paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.table, batch.lens, query_start,
                                       max(q_lens), scale, window, BS, out=out, seq_ids=picked, config=config,
                                       key_floor=key_floor)

    out = attend(torch.tensor(floors, dtype=torch.int32, device=DEVICE))
    ref = dense_prefill_reference(batch, scale, window, BS, floors)
    skipped = slice(int(query_start[2]), int(query_start[3]))
    assert out[skipped].isnan().all()
    keep = torch.ones(q.shape[0], dtype=torch.bool, device=DEVICE)
    keep[skipped] = False
    torch.testing.assert_close(out[keep].float(), ref[keep], atol=tolerance(dtype), rtol=tolerance(dtype))

    no_floor = attend(None)
    zero_floor = attend(torch.zeros(len(seqs), dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(zero_floor[keep], no_floor[keep], atol=1e-6, rtol=1e-6)


def test_key_floor_needs_a_window():
    with pytest.raises(ValueError, match="sliding windows only"):
        tiny_paged_prefill(BS, key_floor=torch.zeros(1, dtype=torch.int32, device=DEVICE))
