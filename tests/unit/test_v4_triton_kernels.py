"""DeepSeek-V4's Triton kernels (models/deepseek_v4/triton_attention.py, triton_indexer.py) against
the reference math of attention.py and indexer.py, and the engine's kernel path against its
reference path (paged_kernels.py vs paged.py) on a tiny V4 model.

Keys live in pages scattered at random (block 0 never used), the rows a chunk completed this
step in a separate tensor, and the pages' slots for those rows hold other values, so a kernel
that reads the wrong place fails. Cases: several chunks (decodes and prefills), windows that
cross page and tile boundaries, window floors, tokens with fewer complete rows than k, top-k
lists padded with -1 (also between picks), sinks, float32 (IEEE products: tight) and a 16-bit
dtype (bfloat16 on a GPU; float16 under the interpreter, which has no bfloat16). Runs on a GPU,
or on the CPU under Triton's interpreter (TRITON_INTERPRET=1); skipped otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.triton_support import DEVICE, INTERPRETED  # skips this module without a way to run Triton

BS = 16


def _dtypes():
    return [torch.float32, torch.float16 if INTERPRETED else torch.bfloat16]


def _tol(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _paged(chunks, rate, dim, dtype, g, tail=0, num_blocks=40, edit=None):
    """Per chunk (start, tokens, floor, first_new): dense window rows of positions [0, end), dense
    compressed rows [0, end // rate) (passed through `edit` if given); scattered into window pages, compressed pages (rows below
    first_new) and the step's new rows (from first_new on)."""
    per_page = BS // rate
    page_rows = per_page + tail
    win_cache = torch.randn(num_blocks * BS, 1, dim, generator=g).to(dtype)
    comp_cache = torch.randn(num_blocks * page_rows, 1, dim, generator=g).to(dtype)   # garbage where unused
    win_tables, comp_tables, wins, comps, news, first_new, new_off = [], [], [], [], [], [], []
    free_w, free_c = torch.randperm(num_blocks - 1, generator=g) + 1, torch.randperm(num_blocks - 1, generator=g) + 1
    used_w = used_c = offset = 0
    for start, n, _, first in chunks:
        end = start + n
        blocks = -(-end // BS)
        wt, ct = free_w[used_w:used_w + blocks], free_c[used_c:used_c + blocks]
        used_w, used_c = used_w + blocks, used_c + blocks
        win = torch.randn(end, dim, generator=g).to(dtype)
        pos = torch.arange(end)
        win_cache[wt[pos // BS] * BS + pos % BS, 0] = win
        rows = end // rate
        comp = torch.randn(rows, dim, generator=g).to(dtype)
        if edit is not None:
            comp = edit(comp)
        old = torch.arange(min(first, rows))
        comp_cache[ct[old // per_page] * page_rows + old % per_page, 0] = comp[:len(old)]
        news.append(comp[first:])
        first_new.append(first)
        new_off.append(offset)
        offset += max(rows - first, 0)
        win_tables.append(wt)
        comp_tables.append(ct)
        wins.append(win)
        comps.append(comp)

    def table(ts):
        out = torch.zeros(len(ts), max(len(t) for t in ts), dtype=torch.int32)
        for i, t in enumerate(ts):
            out[i, :len(t)] = t
        return out.to(DEVICE)

    new_rows = torch.cat(news) if offset else torch.zeros(1, dim, dtype=dtype)
    comp = dict(cache=comp_cache.to(DEVICE), table=table(comp_tables), new_rows=new_rows.to(DEVICE),
                first_new=torch.tensor(first_new, dtype=torch.int32, device=DEVICE),
                new_off=torch.tensor(new_off, dtype=torch.int32, device=DEVICE), rate=rate, per_page=per_page,
                page_rows=page_rows)
    tok_chunk = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, (_, n, _, _) in enumerate(chunks)])
    tok_pos = torch.cat([torch.arange(s, s + n, dtype=torch.int32) for s, n, _, _ in chunks])
    tok_floor = torch.cat([torch.full((n,), f, dtype=torch.int32) for _, n, f, _ in chunks])
    return SimpleNamespace(win_cache=win_cache.to(DEVICE), win_table=table(win_tables), comp=comp, wins=wins,
                           comps=comps, tok_chunk=tok_chunk.to(DEVICE), tok_pos=tok_pos.to(DEVICE),
                           tok_floor=tok_floor, chunk_of=tok_chunk.tolist(), pos=tok_pos.tolist())


def _random_picks(case, rate, k, g):
    """Per token a random order of a random subset of its complete rows, -1 padded, with some
    -1 between picks; a token with fewer complete rows than k keeps all of them."""
    picks = torch.full((len(case.pos), k), -1, dtype=torch.int32)
    for t, p in enumerate(case.pos):
        count = (p + 1) // rate
        chosen = torch.randperm(count, generator=g)[:min(k, count)]
        if count > k and t % 3 == 0:
            chosen = chosen[:k - 2]
        slots = torch.randperm(k, generator=g)[:len(chosen)]
        picks[t, slots] = chosen.to(torch.int32)
    return picks


def _reference_attention(q, sinks, case, window, rate, picks):
    """attention.py's softmax over the token's window rows and compressed rows (and the sink,
    dropped), in float64."""
    outs = []
    for t, (c, p) in enumerate(zip(case.chunk_of, case.pos)):
        lo = max(p - window + 1, int(case.tok_floor[t]), 0)
        keys = [case.wins[c][lo:p + 1]]
        if rate:
            count = (p + 1) // rate
            rows = torch.arange(count) if picks is None else picks[t][picks[t] >= 0].long()
            keys.append(case.comps[c][rows])
        keys = torch.cat(keys).double()
        logits = q[t].cpu().double() @ keys.T * q.shape[-1] ** -0.5
        probs = torch.cat([logits, sinks.cpu().double()[:, None]], dim=-1).softmax(-1)[:, :-1]
        outs.append(probs @ keys)
    return torch.stack(outs)


# (start, tokens, window floor, first new row) per chunk: decodes, a prefill from 0, a chunk on a
# prefix with a window floor, a replayed chunk whose rows from 6 on are only in the new rows.
CHUNKS = [(37, 1, 0, 9), (70, 1, 0, 17), (0, 21, 0, 0), (45, 30, 40, 11), (20, 12, 12, 6)]


@pytest.mark.parametrize("splits", [1, 3, 16], ids=["one-program", "keys-split-3", "keys-split-16"])
@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_sparse_attention_matches_reference(kind, seed, dtype, splits):
    from deepinfer.models.deepseek_v4.triton_attention import sparse_attention

    g = torch.Generator().manual_seed(seed)
    heads, dim, window = 20, 64, 24 if seed else 11
    rate = {"sliding": 0, "hca": 8, "csa": 4}[kind]
    case = _paged(CHUNKS, rate or 4, dim, dtype, g, tail=8 if kind == "csa" else 0)
    q = torch.randn(len(case.pos), heads, dim, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g) * 2
    picks = _random_picks(case, rate, 6, g) if kind == "csa" else None
    lo = torch.maximum((case.tok_pos.cpu() - window + 1).clamp_min(0), case.tok_floor).to(torch.int32)
    out = sparse_attention(q.to(DEVICE), sinks.to(DEVICE), case.tok_chunk, case.tok_pos, lo.to(DEVICE),
                           case.win_cache, case.win_table, BS, None if kind == "sliding" else case.comp,
                           None if picks is None else picks.to(DEVICE), block_n=16 if seed else 32,
                           splits=splits)
    ref = _reference_attention(q, sinks, case, window, rate, picks)
    torch.testing.assert_close(out.cpu().double(), ref, **_tol(dtype))


def _reference_scores(qi, w, case, rate):
    """indexer.py's scores (float32): sum_h w * relu(q . k) / sqrt(dim), -inf past the complete rows."""
    width = max(len(c) for c in case.comps)
    out = torch.full((len(case.pos), width), float("-inf"))
    for t, (c, p) in enumerate(zip(case.chunk_of, case.pos)):
        count = (p + 1) // rate
        dots = torch.relu(qi[t].float() @ case.comps[c][:count].float().T) * qi.shape[-1] ** -0.5
        out[t, :count] = (dots * w[t][:, None]).sum(0)
    return out


def _reference_picks(scores, k):
    """indexer.py's choice: the k best by a stable sort, the complete rows only."""
    order = scores.sort(dim=-1, descending=True, stable=True).indices
    return [[r for r in order[t, :k].tolist() if scores[t, r] > float("-inf")] for t in range(len(scores))]


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_scores_and_topk_match_reference(seed, dtype):
    from deepinfer.models.deepseek_v4.triton_indexer import index_scores, select_topk

    g = torch.Generator().manual_seed(seed)
    heads, dim, rate, k = 12, 32, 4, 5
    case = _paged(CHUNKS, rate, dim, dtype, g, tail=8)
    qi = torch.randn(len(case.pos), heads, dim, generator=g).to(dtype)
    w = torch.randn(len(case.pos), heads, generator=g)
    width = max(len(c) for c in case.comps)
    scores = index_scores(qi.to(DEVICE), w.to(DEVICE), case.tok_chunk, case.tok_pos, case.comp, width,
                          block_s=16 if seed == 1 else 64)
    ref = _reference_scores(qi, w, case, rate)
    assert torch.equal(scores.cpu().isinf(), ref.isinf())
    torch.testing.assert_close(scores.cpu(), ref, **_tol(dtype))
    picks = select_topk(scores, k).cpu()
    for t, want in enumerate(_reference_picks(ref, k)):
        got = [r for r in picks[t].tolist() if r >= 0]
        assert picks[t].tolist()[len(got):] == [-1] * (k - len(got))   # padding only at the end
        assert sorted(got) == sorted(want), f"token {t}"


def test_topk_ties_go_to_the_earlier_row():
    """Rows whose every head's q.k is negative score exactly 0; with negative head weights 0 is
    the best score: the picks are the earliest such rows, in row order, as indexer.py's."""
    from deepinfer.models.deepseek_v4.triton_indexer import index_scores, select_topk

    g = torch.Generator().manual_seed(5)
    heads, dim, rate, k = 8, 16, 4, 4
    def dead_every_third(comp):   # every third row "dead" (all dots < 0), the others alive
        comp = comp.abs()
        comp[::3] *= -1
        return comp

    case = _paged(CHUNKS, rate, dim, torch.float32, g, tail=8, edit=dead_every_third)
    qi = torch.rand(len(case.pos), heads, dim, generator=g) + 0.1
    w = -torch.rand(len(case.pos), heads, generator=g) - 0.1
    width = max(len(c) for c in case.comps)
    scores = index_scores(qi.to(DEVICE), w.to(DEVICE), case.tok_chunk, case.tok_pos, case.comp, width)
    ref = _reference_scores(qi, w, case, rate)
    picks = select_topk(scores, k).cpu()
    for t, want in enumerate(_reference_picks(ref, k)):
        count = (case.pos[t] + 1) // rate
        dead = list(range(0, count, 3))
        assert want[:min(k, len(dead))] == dead[:k]
        assert [r for r in picks[t].tolist() if r >= 0] == want, f"token {t}"
