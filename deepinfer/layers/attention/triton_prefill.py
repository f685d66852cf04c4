"""Paged prefill / extend attention in Triton: variable-length query chunks over cached blocks.

Each sequence contributes `q_len` query tokens (rows `query_start[s]:query_start[s + 1]` of q)
that sit at the end of its `seq_lens[s]` KV positions: the first `seq_lens[s] - q_len` are a
cached prefix (prefix-cache hit, or earlier chunks of a chunked prefill) and the chunk's own K/V
are already written to the paged cache. So every key is read through the block table, and one
kernel covers a fresh prompt, a chunk on top of a prefix, and a sliding window. (The Triton
backend sends long fresh prompts to SDPA's tiled kernels instead, see layer.py, and long chunks on
long prefixes of full-attention layers to cuDNN's, see sdpa_extend.py; this kernel is the one for
the other chunks on cached prefixes, windows, batches of short chunks, and every chunk whose rows
see later keys, below: those kernels take no such mask.)

One program per (query tile, sequence, query head), flash-attention style (online softmax in
fp32, in base 2: log2(e) is folded into the scale so each score costs one exp2). The key range
of a tile is cut to what its causal mask and window can see, and split in three:

    [lo, mid_lo)       window edge: some queries of the tile no longer see these keys  (masked)
    [mid_lo, mid_hi)   every query of the tile sees every key                        (no mask)
    [mid_hi, hi)       the diagonal: later keys are hidden from earlier queries        (masked)

so the mask arithmetic and the "row saw nothing yet" guard run only on the few edge tiles. For
a chunk of 1k queries on 7k cached keys nearly every tile is in the middle part.

A sliding-window layer may also get a key floor per sequence (`key_floor`, SWA Bounded Replay:
the request recomputed its window from that position, and the rows below were never rebuilt):
its queries see keys in [max(q - WINDOW + 1, floor), q]. The floor raises the window edge's
bounds and is one more term of the edge tiles' mask. It is compiled in only under HAS_FLOOR, so
the kernel without floors is the one it always was.

Queries that see later keys (`visible_end`, one per query row: Gemma 3's image tokens attend to
the rest of their image, multimodal/step_images.py). Row q sees keys below visible_end[q] instead
of keys up to q: q + 1 on a causal row, the image's end on an image row. The keys ahead of a
query lie past its position, so only the diagonal part changes: it runs to the largest
visible_end of the tile's rows (a tile whose rows reach ahead walks further), with kv <
visible_end[q] as its causal term. The window edge and the key floor are bounds from below and
stay as they are: they never hide a key ahead. Compiled in only under HAS_VISIBLE_END, like the
floor; the key split below takes it as it is (its runs cut the longer range).

Split along the keys (flash-decoding style). The grid is (query tiles x sequences x heads); a
chunk of few queries over a long cached context (SWA Bounded Replay's 576 queries through a global
layer of a model with 4 query heads: 36 programs) leaves most multiprocessors idle while each
program walks the whole context. Then (num_prefill_splits) each program's key range [lo, hi) is
cut into NUM_SPLITS runs of whole BLOCK_N tiles, one program per run: it walks the parts of the
three loops above that fall in its run, so the masks stay on the same edge tiles, and writes its
rows normalised with their log-sum-exp (base 2) to an fp32 workspace. _combine_kernel merges the
runs by their log-sum-exp into `out`. A run can see no key (a short sequence of a ragged batch, or
a window or floor above it): its rows report -inf and weigh 0. The choice uses only values the
host has (the longest chunk, the number of sequences, a host bound on the longest KV length),
so it costs no device sync; the grid of an ordinary prefill (an 8k chunk has thousands of
programs) keeps the unsplit kernel, compiled as before (SPLIT is a constexpr).

The query heads that share a KV head are not packed into one program (the decode kernel does
that): a prefill tile already reuses each K/V tile across its BLOCK_M queries, and the heads'
programs read the same K/V through L2.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# The key split (module docstring): at most this many runs per program, each of at least this
# many keys (a shorter run spends a larger share of its time loading Q and writing its partial),
# aiming at SPLIT_WAVES programs per multiprocessor. Triton's interpreter has no multiprocessors:
# it is given the count of the sm_90 cards the kernels are tuned for.
MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 512
SPLIT_WAVES = 2
INTERPRETER_SMS = 132
# The split's fp32 workspace reserves max_query_len rows per picked sequence and run; fewer runs
# where that would pass this (a ragged batch of many short chunks beside one long one).
MAX_WORKSPACE_BYTES = 256 << 20


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, q_pos, q_end, n, hi, floor, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head,
    dims, dim_ok, qk_scale, stride_kr, stride_kh, stride_vr, stride_vh, stride_bt,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, EVEN_DIM: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr, HAS_FLOOR: tl.constexpr, HAS_VISIBLE_END: tl.constexpr,
):
    """Fold keys [n, n + BLOCK_N) into the running (acc, l_i, m_i) of one query tile.

    MASKED=False is only called on tiles that every query of the tile sees whole, so it loads
    without bounds checks and skips the causal/window mask. `floor` (the sequence's key floor)
    is read only under HAS_FLOOR, `q_end` (each query's visible end) only under HAS_VISIBLE_END.
    """
    k_pos = n + tl.arange(0, BLOCK_N)
    if MASKED:
        k_ok = k_pos < hi
        block = tl.load(block_table_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        load_mask = k_ok[:, None] & dim_ok[None, :]
    else:
        block = tl.load(block_table_ptr + seq * stride_bt + k_pos // BLOCK_SIZE)
        load_mask = dim_ok[None, :]
    rows = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
    k_ptrs = k_cache_ptr + rows[:, None] * stride_kr + kv_head * stride_kh + dims[None, :]
    v_ptrs = v_cache_ptr + rows[:, None] * stride_vr + kv_head * stride_vh + dims[None, :]
    if EVEN_DIM and not MASKED:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=load_mask, other=0.0)
    k = k.to(q.dtype)   # an fp8 cache, converted in registers

    if IEEE:   # float32 models: exact products, not TF32 (parity tests run in float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        scores = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        if HAS_VISIBLE_END:   # q_end >= q_pos + 1: the causal term, widened on rows that see ahead
            visible = k_ok[None, :] & (k_pos[None, :] < q_end[:, None])
        else:
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:   # bounds keys from below only: it never hides a key ahead of its query
            visible = visible & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        if HAS_FLOOR:
            visible = visible & (k_pos[None, :] >= floor)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no key yet keeps m = -inf (its l and acc stay 0); exponentiate
        # against 0 instead so that -inf - -inf makes no NaN.
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(scores, 1))   # finite: the tile has a visible key per row
        m_exp = m_new
    alpha = tl.math.exp2(m_i - m_exp)
    p = tl.math.exp2(scores - m_exp[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    if EVEN_DIM and not MASKED:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=load_mask, other=0.0)
    v = v.to(q.dtype)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


# The block table's width and the metadata tensors' offsets change from step to step: no
# compile-time specialization on them, or each new combination would compile the kernel again,
# stalling the step that meets it (see triton_decode.py and
# docs/benchmarks/design-measurements.md#triton-compile-stalls).
# Likewise the split count and the workspace strides that follow the step's token count.
SPLIT_ARGS = ["num_splits", "stride_ps", "stride_pb", "stride_ls", "stride_lb"]


@triton.jit(do_not_specialize=["stride_bt", *SPLIT_ARGS],
            do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "query_start_ptr", "seq_ids_ptr",
                                            "key_floor_ptr", "visible_end_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, seq_ids_ptr,
    key_floor_ptr, visible_end_ptr, o_part_ptr, lse_part_ptr, qk_scale,
    stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_bt, stride_ot, stride_oh,
    stride_ps, stride_pb, stride_pt, stride_ph, stride_ls, stride_lb, stride_lt, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, EVEN_DIM: tl.constexpr,
    IEEE: tl.constexpr, HAS_FLOOR: tl.constexpr, HAS_VISIBLE_END: tl.constexpr, SPLIT: tl.constexpr,
):
    # The grid's first axis runs over query tiles in reverse: under a causal mask the last tiles
    # of a chunk see the most keys, and starting them first shortens the tail of the launch.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.load(seq_ids_ptr + tl.program_id(1))
    if SPLIT:   # the third axis runs over (head, split), the splits of a head side by side
        head = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
    else:
        head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len                       # cached positions before this chunk

    m_offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m_offs < q_len
    q_pos = context + m_offs                        # absolute position of each query
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + m_offs)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=m_ok[:, None] & dim_ok[None, :], other=0.0)

    # The tile's queries are positions [first_q, hi). Causal: all of them see keys < first_q + 1,
    # the last sees keys < hi. Window: the first sees keys > first_q - WINDOW, the last only keys
    # > hi - 1 - WINDOW. The unmasked middle is cut on BLOCK_N boundaries inside both limits, and
    # lo <= mid_lo <= mid_hi <= hi holds, so the three loops cover [lo, hi) exactly once.
    # A key floor raises both window limits (no query sees a key below it); it is at most the
    # chunk's first position, so every query still sees its own key.
    first_q = context + tile * BLOCK_M
    hi = tl.minimum(first_q + BLOCK_M, seq_len)
    mid_hi = ((first_q + 1) // BLOCK_N) * BLOCK_N
    lo = 0
    mid_lo = 0
    floor = 0
    if WINDOW > 0:   # a constexpr: one compiled kernel per window size
        first_key = tl.maximum(first_q - WINDOW + 1, 0)
        all_from = tl.maximum(hi - WINDOW, 0)
        if HAS_FLOOR:
            floor = tl.load(key_floor_ptr + seq)
            first_key = tl.maximum(first_key, floor)
            all_from = tl.maximum(all_from, floor)
        lo = (first_key // BLOCK_N) * BLOCK_N
        mid_lo = tl.cdiv(all_from, BLOCK_N) * BLOCK_N
        mid_lo = tl.minimum(tl.maximum(mid_lo, lo), mid_hi)
    # Rows that see ahead (an image's tokens): the diagonal part runs on to the furthest key a row
    # of the tile sees. Only the diagonal changes: a query's keys ahead all lie past its own
    # position, so past mid_hi, and the window's limits above come from the queries' positions,
    # which stay. Clamped to seq_len: the block table holds none of this sequence's keys past it.
    q_end = q_pos
    if HAS_VISIBLE_END:
        q_end = tl.load(visible_end_ptr + q_start + m_offs, mask=m_ok, other=0)
        hi = tl.minimum(tl.maximum(hi, tl.max(q_end, 0)), seq_len)

    edge_lo, edge_hi = lo, mid_lo
    body_lo, body_hi = mid_lo, mid_hi
    diag_lo, diag_hi = mid_hi, hi
    if SPLIT:
        # This program's run: whole BLOCK_N tiles of [lo, hi) from lo (a tile boundary), so every
        # bound below stays on a tile boundary (or is hi) and each loop keeps its own tiles: the
        # unmasked loop still sees only tiles that every query of the tile sees whole. The runs
        # cover [lo, hi) once; a run past hi (more splits than tiles) is empty.
        tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
        run_lo = lo + split * tiles_per_split * BLOCK_N
        run_hi = tl.minimum(run_lo + tiles_per_split * BLOCK_N, hi)
        edge_lo, edge_hi = tl.maximum(edge_lo, run_lo), tl.minimum(edge_hi, run_hi)
        body_lo, body_hi = tl.maximum(body_lo, run_lo), tl.minimum(body_hi, run_hi)
        diag_lo, diag_hi = tl.maximum(diag_lo, run_lo), tl.minimum(diag_hi, run_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    if WINDOW > 0:
        for n in range(edge_lo, edge_hi, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, q_end, n, hi, floor, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head,
                dims, dim_ok, qk_scale, stride_kr, stride_kh, stride_vr, stride_vh, stride_bt,
                BLOCK_SIZE, BLOCK_N, WINDOW, EVEN_DIM, True, IEEE, HAS_FLOOR, HAS_VISIBLE_END)
    for n in range(body_lo, body_hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, q_end, n, hi, floor, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head,
            dims, dim_ok, qk_scale, stride_kr, stride_kh, stride_vr, stride_vh, stride_bt,
            BLOCK_SIZE, BLOCK_N, WINDOW, EVEN_DIM, False, IEEE, HAS_FLOOR, HAS_VISIBLE_END)
    for n in range(diag_lo, diag_hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, q_end, n, hi, floor, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head,
            dims, dim_ok, qk_scale, stride_kr, stride_kh, stride_vr, stride_vh, stride_bt,
            BLOCK_SIZE, BLOCK_N, WINDOW, EVEN_DIM, True, IEEE, HAS_FLOOR, HAS_VISIBLE_END)

    if SPLIT:
        # A run's rows, normalised, with their log-sum-exp in base 2 (the scores are): a row that
        # saw no key in this run (an empty run, or keys all outside its window or floor) has
        # l_i = 0 and reports -inf, which the merge weighs 0.
        has = l_i > 0
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        part = acc / tl.where(has, l_i, 1.0)[:, None]
        slot = tl.program_id(1)   # the workspace's rows: (picked sequence, query of its chunk)
        tl.store(o_part_ptr + split * stride_ps + slot * stride_pb + m_offs[:, None] * stride_pt + head * stride_ph
                 + dims[None, :], part, mask=m_ok[:, None] & dim_ok[None, :])
        tl.store(lse_part_ptr + split * stride_ls + slot * stride_lb + m_offs * stride_lt + head, lse, mask=m_ok)
        return
    # Every real query sees at least its own key, so l_i > 0 on the rows that are stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m_offs)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=SPLIT_ARGS, do_not_specialize_on_alignment=["query_start_ptr", "seq_ids_ptr"])
def _combine_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, query_start_ptr, seq_ids_ptr,
    stride_ps, stride_pb, stride_pt, stride_ph, stride_ls, stride_lb, stride_lt, stride_ot, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """`out` rows of one (query tile, sequence, head): the runs' partials merged by their
    log-sum-exp. Rows of sequences not picked are never read or written."""
    tile = tl.program_id(0)
    slot = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + slot)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    m_offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m_offs < q_len
    lse_ptrs = lse_part_ptr + slot * stride_lb + m_offs * stride_lt + head
    part_ptrs = o_part_ptr + slot * stride_pb + m_offs[:, None] * stride_pt + head * stride_ph
    dims = tl.arange(0, DIM_PAD)
    mask = m_ok[:, None] & (dims[None, :] < HEAD_DIM)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(lse_ptrs + s * stride_ls, mask=m_ok, other=float("-inf")))
    # Every stored row saw its own key in some run, so m is finite there; the guard keeps the
    # rows past q_len free of NaN (-inf - -inf), which are not stored anyway.
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(lse_ptrs + s * stride_ls, mask=m_ok, other=float("-inf"))
        w = tl.math.exp2(lse - m)   # 0 for a run that saw no key of the row
        part = tl.load(part_ptrs + s * stride_ps + dims[None, :], mask=mask, other=0.0)
        acc += part * w[:, None]
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m_offs)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for sm_90 under Triton 3.6.

    bf16/fp16: 128-query tiles on two warpgroups (the Q tile stays in registers for the whole
    key loop; the wider it is, the more tensor-core work per key tile loaded) behind a 3-stage
    copy pipeline; at head_dim 128 the key tiles are 128 wide (timed fastest on the GPU by
    `benchmarks/attention_kernels.py --sweep`, ahead of the 64-wide ones both on an 8k prefill and
    on 1,024 queries on 7,168 keys), at 64 they stay 64 wide (the same speed). At head_dim 256 the
    tiles halve and the pipeline is 2 deep. Figures:
    docs/benchmarks/design-measurements.md#triton-prefill-config. float32 models are for parity
    tests only (IEEE products run on the FMA units): 16-query tiles, which compile without
    spilling at every head size.
    """
    if dtype == torch.float32:
        return (16, 32, 4, 1) if head_dim <= 128 else (16, 32, 8, 1)
    if head_dim == 128:
        return 128, 128, 8, 3
    if head_dim < 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def num_prefill_splits(programs: int, max_keys: int, num_sms: int) -> int:
    """How many runs to cut each program's key range into (1: the unsplit kernel).

    `programs`: the unsplit grid's programs that have queries (query tiles x heads); `max_keys`:
    a bound on the keys one program walks. Only a grid of at most half the multiprocessors is
    split: a fuller one gains little from more, shorter programs and pays the workspace and the
    merge. It then gets SPLIT_WAVES programs per multiprocessor (rounded down: one program more
    than a whole wave costs a wave), at most MAX_SPLITS, each run of at least MIN_KEYS_PER_SPLIT
    keys.
    """
    if 2 * programs > num_sms:
        return 1
    return max(1, min(MAX_SPLITS, SPLIT_WAVES * num_sms // programs, max_keys // MIN_KEYS_PER_SPLIT))


def split_count(num_tokens: int, num_seqs: int, num_heads: int, head_dim: int, max_query_len: int,
                max_seq_len: int, window: int | None, block_m: int, device: torch.device) -> int:
    """paged_prefill_attention's own choice of runs (num_prefill_splits), from host values only."""
    # A tile's queries span BLOCK_M positions, and a window shows each at most WINDOW keys. (Rows
    # with visible ends see up to an image's length more: not counted, as this only picks a count
    # of runs; the runs cover whatever range each program has.)
    max_keys = min(max_seq_len, window + block_m) if window else max_seq_len
    # Programs with queries: the grid gives every sequence the longest chunk's tiles, and the
    # extra ones return at once; T rows make at most (T + S * (BLOCK_M - 1)) // BLOCK_M tiles
    # over S sequences (T counts every row of q, picked or not: a bound).
    tiles = min(triton.cdiv(max_query_len, block_m) * num_seqs, (num_tokens + num_seqs * (block_m - 1)) // block_m)
    splits = num_prefill_splits(tiles * num_heads, max_keys, multiprocessor_count(device))
    per_split = num_seqs * max_query_len * num_heads * (head_dim + 1) * 4   # partials and log-sum-exps
    return max(1, min(splits, MAX_WORKSPACE_BYTES // per_split))


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":   # Triton's interpreter (tests): see INTERPRETER_SMS
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                            max_query_len: int, scale: float, window: int | None, block_size: int,
                            out: torch.Tensor | None = None, seq_ids: torch.Tensor | None = None,
                            config: tuple[int, int, int, int] | None = None,
                            key_floor: torch.Tensor | None = None, max_seq_len: int | None = None,
                            num_splits: int | None = None, visible_end: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] (the chunks back to back) -> [T, H, D].

    `seq_ids` (int32) picks the sequences to attend (rows of block_table / seq_lens, chunks of
    query_start); the others' rows of `out` are left untouched. None: all of them.
    `key_floor` (int32, one per sequence like seq_lens; needs a window): the lowest key position
    each sequence's queries may see. None: no floor.
    `visible_end` (int32, one per row of q like its rows; read on the picked sequences' rows): the
    key position (exclusive) up to which each query may see, its position + 1 for a causal row
    and beyond it for a row that also sees later keys (an image's tokens: the image's end, at
    most the sequence's KV length). The window and the key floor still bound its keys from
    below. None: causal.
    `max_query_len` is the longest chunk among those picked, `max_seq_len` a host-side bound on
    their longest seq_lens entry (the key split's choice, num_prefill_splits; None: never split,
    as the device's seq_lens are not read on the host). `num_splits` overrides that choice (1:
    the unsplit kernel), and `config` (BLOCK_M, BLOCK_N, num_warps, num_stages); both for
    benchmarks and tests.
    """
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    dim_pad = triton.next_power_of_2(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if seq_ids is None:
        seq_ids = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=q.device)
    if num_tokens == 0 or seq_ids.shape[0] == 0 or max_query_len == 0:
        return out
    if key_floor is not None and not window:
        raise ValueError("a key floor cuts sliding windows only; full attention sees every key")
    if visible_end is not None and visible_end.shape != (num_tokens,):
        raise ValueError(f"visible_end needs one entry per row of q ({num_tokens}), got {tuple(visible_end.shape)}")
    block_m, block_n, num_warps, num_stages = config or prefill_config(head_dim, q.dtype)
    grid = (triton.cdiv(max_query_len, block_m), seq_ids.shape[0], num_heads)
    if num_splits is None:
        num_splits = 1 if max_seq_len is None else split_count(
            num_tokens, seq_ids.shape[0], num_heads, head_dim, max_query_len, max_seq_len, window, block_m, q.device)
    split = num_splits > 1
    if split:
        # Per run, a row per (picked sequence, query of its chunk): [splits, S, max_query_len, H, D]
        # partials and [splits, S, max_query_len, H] log-sum-exps. Not a row per row of q: q may
        # also hold long chunks that other kernels attend (backends/triton.py), never read here.
        shape = (num_splits, seq_ids.shape[0], max_query_len, num_heads)
        o_part = torch.empty(*shape, head_dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(shape, dtype=torch.float32, device=q.device)
        grid = (grid[0], grid[1], num_heads * num_splits)
    else:   # never read: the kernel writes `out` itself
        o_part = lse_part = out
    _prefill_kernel[grid](
        # Without a floor (visible ends) the kernel never reads key_floor_ptr (visible_end_ptr):
        # any int32 tensor stands in.
        q, k_cache, v_cache, out, block_table, seq_lens, query_start, seq_ids,
        seq_lens if key_floor is None else key_floor, seq_lens if visible_end is None else visible_end,
        o_part, lse_part, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1),
        *(_part_strides(o_part, lse_part) if split else (0,) * 7), num_splits,
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, WINDOW=window or 0, EVEN_DIM=head_dim == dim_pad,
        IEEE=q.dtype == torch.float32, HAS_FLOOR=key_floor is not None, HAS_VISIBLE_END=visible_end is not None,
        SPLIT=split, num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _combine_kernel[(triton.cdiv(max_query_len, COMBINE_BLOCK_M), seq_ids.shape[0], num_heads)](
            o_part, lse_part, out, query_start, seq_ids, *_part_strides(o_part, lse_part),
            out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_M=COMBINE_BLOCK_M, num_warps=4,
        )
    return out


# Rows per program of the merge: [16, 256] fp32 partials stay in registers at 4 warps.
COMBINE_BLOCK_M = 16


def _part_strides(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[int, ...]:
    return (*o_part.stride()[:4], *lse_part.stride()[:3])
