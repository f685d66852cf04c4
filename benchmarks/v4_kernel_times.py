"""DeepSeek-V4's Triton kernels alone at V4-Flash's shapes (64 heads of 512, window 128, CSA rate 4
with index_topk 512, indexer 64 heads of 128), on random paged inputs: what one layer's
attention launch and indexer (scores + top-k) cost, apart from the engine's Python around them.
v4_gpu_speed.py calls `kernel_times` after its engine runs (CUDA only); alone:

    python benchmarks/v4_kernel_times.py

Cases: decode batch 1 at 1,024 tokens, decode batch 64 at 512, one 8,192-token prefill from 0
(every compressed row new in the step). Per case: the sliding layer's attention (window only),
the CSA layer's (window + top-k picks), the indexer, in ms (triton.testing.do_bench, median), and
the attention's useful TFLOP/s (4 * tokens * heads * keys * 512).
"""

from __future__ import annotations

import json

BS, HEADS, DIM, WINDOW, RATE, TOPK, IHEADS, IDIM = 128, 64, 512, 128, 4, 512, 64, 128
CASES = {"decode_b1_1k": [(1024, 1)], "decode_b64_512": [(512, 1)] * 64, "prefill_8k": [(0, 8192)]}


def _layout(torch, chunks, dim, tail, device):
    """Random pages for the chunks (start, tokens): a window cache, a compressed cache with rows
    before each chunk's start, the rows the chunks complete as the step's new rows."""
    g = torch.Generator(device=device).manual_seed(0)
    per_page = BS // RATE
    tables, first_new, new_off, new, used = [], [], [], 0, 0
    for start, n in chunks:
        blocks = -(-(start + n) // BS)
        tables.append(list(range(used + 1, used + 1 + blocks)))
        used += blocks
        first_new.append(start // RATE)
        new_off.append(new)
        new += (start + n) // RATE - start // RATE
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    bf16 = torch.bfloat16
    window = torch.randn((used + 1) * BS, 1, dim, generator=g, device=device, dtype=bf16)
    comp = dict(cache=torch.randn((used + 1) * (per_page + tail), 1, dim, generator=g, device=device, dtype=bf16),
                table=table, new_rows=torch.randn(max(new, 1), dim, generator=g, device=device, dtype=bf16),
                first_new=torch.tensor(first_new, dtype=torch.int32, device=device),
                new_off=torch.tensor(new_off, dtype=torch.int32, device=device), rate=RATE, per_page=per_page,
                page_rows=per_page + tail)
    return window, table, comp


def kernel_times(device: str = "cuda") -> dict:
    import torch
    from triton.testing import do_bench

    from deepinfer.models.deepseek_v4.triton_attention import sparse_attention
    from deepinfer.models.deepseek_v4.triton_indexer import index_scores, select_topk

    out = {}
    for name, chunks in CASES.items():
        tok_chunk = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, (_, n) in enumerate(chunks)]).to(device)
        tok_pos = torch.cat([torch.arange(s, s + n, dtype=torch.int32) for s, n in chunks]).to(device)
        low = (tok_pos - WINDOW + 1).clamp_min(0).to(torch.int32)
        tokens = tok_pos.numel()
        window, table, comp = _layout(torch, chunks, DIM, 2 * RATE, device)
        _, _, keys = _layout(torch, chunks, IDIM, 2 * RATE, device)
        q = torch.randn(tokens, HEADS, DIM, device=device, dtype=torch.bfloat16)
        qi = torch.randn(tokens, IHEADS, IDIM, device=device, dtype=torch.bfloat16)
        w = torch.randn(tokens, IHEADS, device=device) * IHEADS ** -0.5
        sinks = torch.randn(HEADS, device=device)
        rows = max((s + n) // RATE for s, n in chunks)

        def indexer():
            return select_topk(index_scores(qi, w, tok_chunk, tok_pos, keys, rows), TOPK)

        picks = indexer()
        window_keys = (tok_pos - low + 1).sum().item()
        picked = (picks >= 0).sum().item()
        sliding_ms = do_bench(lambda: sparse_attention(q, sinks, tok_chunk, tok_pos, low, window, table, BS))
        csa_ms = do_bench(lambda: sparse_attention(q, sinks, tok_chunk, tok_pos, low, window, table, BS, comp, picks))
        indexer_ms = do_bench(indexer)
        flop = 4 * HEADS * DIM
        out[name] = {"tokens": tokens, "sliding_attention_ms": sliding_ms, "csa_attention_ms": csa_ms,
                     "indexer_ms": indexer_ms,
                     "sliding_tflops": flop * window_keys / sliding_ms / 1e9,
                     "csa_tflops": flop * (window_keys + picked) / csa_ms / 1e9}
        print(f"  kernels {name}: {out[name]}", flush=True)
    return out


if __name__ == "__main__":
    print(json.dumps(kernel_times(), indent=1))
