"""The CUDA fast path's attention against the reference backend and SDPA's flash kernel, per call.

    python benchmarks/attention_kernels.py [--cases prefill,extend,decode,long,replay] [--sweep] [--sweep-dims 64,128,256]
                                           [--kv-cache-dtype auto|fp8] [--replay-contexts 4096,...] [--out FILE.json]

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128), bf16, 16-token blocks
scattered at random over the pool, one layer:

  prefill   one 8192-token chunk from position 0. Ours is what the engine runs (SDPA's flash
            kernel over the step's own K/V); the paged prefill kernel on the same chunk is
            printed too (it still serves windows shorter than the chunk and short chunks).
  extend    1024 new tokens on 7168 cached ones (paged prefill kernel). Anchor: flash over the
            same K/V made contiguous, lower-right causal.
  decode    batch 1 and 64 at 1k and 8k context, and batch 512 at 1152 (the decode steps of
            gpu_fast_path.py's (c)) (paged decode kernel, split along the sequence; timed as a CUDA
            graph replay, as the engine runs decode). Anchor: flash over contiguous K/V. Also KV
            bytes read per second against the copy bandwidth.

  long      chunks on a cached prefix from 1,024 queries on 4,096 keys to 16,384 on 114,688 (the
            last chunk of a 128k prompt): what the engine runs (sdpa_extend.py's cuDNN parts over
            keys gathered from the cache where sdpa_extend.takes says so, the paged prefill kernel
            elsewhere; the gather is timed with it) against the paged prefill kernel, each checked
            against the other; each also with its device time per call (torch's profiler): small
            chunks are bound by the host's launches when timed alone. Not in the default --cases.

  replay    the paged prefill kernel split along the keys (triton_prefill.py) on SWA Bounded
            Replay's shape: 576 queries at the end of a 4k/8k/16k/32k context through a global
            layer of Gemma 3 1B (4 query heads, 1 KV head, head_dim 256, bf16, 16-token blocks),
            and a 1024-token chunk on 127k cached tokens (long-context chunked prefill). Unsplit,
            the kernel's own choice (what the engine runs) and forced split counts, each checked
            against the unsplit kernel (and the 576-query ones against the reference backend);
            then an 8k fresh chunk through the kernel at both shapes, where the choice must stay
            unsplit and the output bit-identical. Not in the default --cases; prints a table and,
            with --out, writes its rows as JSON.

--kv-cache-dtype fp8 stores the caches as float8 e4m3 (kv_cache/dtypes.py): the reference reads
the same fp8 cache, the anchors get it converted to bf16, and the KV rate counts fp8 bytes. The
engine's decode then runs the CUDA C++ kernel (layers/attention/cuda_decode.py); the Triton
decode kernel is checked and timed beside it.

Every case first checks our output against the reference backend (same step inputs, same
cache) and against the anchor, then times. Causal FLOPs = 4 * heads * head_dim * q_len *
(average keys a query sees). Each line is printed as soon as it is measured. --sweep times the
paged prefill kernel over tile choices (BLOCK_M, BLOCK_N, num_warps, num_stages) on the
extend and prefill shapes at each head size in --sweep-dims, the default choice marked '*'.
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
TOL = 2e-2   # bf16, as in tests/unit/test_triton_attention.py


def out(line: str) -> None:
    print(line, flush=True)


def ceilings() -> tuple[float, float]:
    """Device-to-device copy bandwidth (bytes read + written per s) and bf16 8192^3 matmul FLOP/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    import triton.testing

    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    mm_ms = triton.testing.do_bench(lambda: a @ b)
    return 2 * src.numel() / copy_ms * 1e3, 2 * 8192 ** 3 / mm_ms * 1e3


CACHE_DTYPE = DTYPE   # --kv-cache-dtype


class Step:
    """One attention step: a KV pool with these chunks' blocks scattered over it, and their q/k/v."""

    def __init__(self, contexts: list[int], q_lens: list[int], seed: int = 0,
                 heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> None:
        from deepinfer.kv_cache.dtypes import to_cache_dtype
        from deepinfer.kv_cache.specs import FullAttentionSpec, group_layers
        from deepinfer.layers.attention import Attention
        from deepinfer.worker.request_states import StepChunk

        rng = random.Random(seed)
        torch.manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        blocks_per_seq = [-(-(c + n) // BLOCK) for c, n in zip(contexts, q_lens)]
        free = list(range(1, sum(blocks_per_seq) + 1))   # block 0 is the null block
        rng.shuffle(free)
        self.chunks = []
        for i, (c, n, nb) in enumerate(zip(contexts, q_lens, blocks_per_seq)):
            blocks = [free.pop() for _ in range(nb)]
            self.chunks.append(StepChunk(f"r{i}", c, n, [blocks], sample=True))
        self.token_ids = {ch.request_id: [1] * (ch.start + ch.num_tokens) for ch in self.chunks}
        self.groups = group_layers([FullAttentionSpec(kv_heads, head_dim, DTYPE, CACHE_DTYPE)])
        rows = (sum(blocks_per_seq) + 1) * BLOCK
        self.k_cache = to_cache_dtype(torch.randn(rows, kv_heads, head_dim, dtype=DTYPE, device="cuda"), CACHE_DTYPE)
        self.v_cache = to_cache_dtype(torch.randn(rows, kv_heads, head_dim, dtype=DTYPE, device="cuda"), CACHE_DTYPE)
        tokens = sum(q_lens)
        self.q = torch.randn(tokens, heads, head_dim, dtype=DTYPE, device="cuda")
        self.k = torch.randn(tokens, kv_heads, head_dim, dtype=DTYPE, device="cuda")
        self.v = torch.randn(tokens, kv_heads, head_dim, dtype=DTYPE, device="cuda")
        self.layer = Attention(0, heads, kv_heads, head_dim, scale=head_dim ** -0.5)

    def inputs(self, backend: str, **kwargs):
        from deepinfer.worker.input_batch import build_step_inputs

        return build_step_inputs(self.chunks, self.token_ids, self.groups, BLOCK, [0], [0],
                                 [(self.k_cache, self.v_cache)], torch.device("cuda"), backend=backend,
                                 **kwargs)

    def layer_output(self, inputs) -> torch.Tensor:
        """The whole layer (KV write + attention), [tokens, heads, head_dim]."""
        from deepinfer.layers.attention import forward_context

        with forward_context(inputs.attention):
            return self.layer(self.q, self.k, self.v).view_as(self.q)

    def attention_call(self, inputs):
        """The attention the layer runs after its KV write, as a no-argument function to time."""
        meta = inputs.attention
        group = meta.groups[0]
        return lambda: meta.backend.attend(self.layer, meta, group, self.q, self.k, self.v, self.k_cache, self.v_cache)

    def contiguous_kv(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `seq`'s whole K/V (cache + this step's rows already written) as [Hkv, L, D],
        in the model's dtype."""
        chunk = self.chunks[seq]
        table = torch.tensor(chunk.block_ids[0], device="cuda")
        pos = torch.arange(chunk.start + chunk.num_tokens, device="cuda")
        rows = table[pos // BLOCK] * BLOCK + pos % BLOCK
        return (self.k_cache[rows].to(DTYPE).transpose(0, 1), self.v_cache[rows].to(DTYPE).transpose(0, 1))


def causal_flops(heads: int, head_dim: int, context: int, q_len: int) -> float:
    """QK^T and PV of q_len queries at the end of context + q_len keys: each sees context + i + 1."""
    average_keys = context + (q_len + 1) / 2
    return 4 * heads * head_dim * q_len * average_keys


def flash(q, k, v, backend: str = "FLASH_ATTENTION", **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)


def check(name: str, ours: torch.Tensor, against, failures: list[str]) -> None:
    """Compare with a reference output; `against` may be a function (an anchor that may not run)."""
    if callable(against):
        try:
            against = against()
        except RuntimeError as e:   # an anchor this torch build cannot run: say so, keep going
            out(f"  check {name:<50} not run: {str(e).splitlines()[0]}")
            return
    err = (ours.float() - against.float()).abs().max().item()
    ok = torch.allclose(ours.float(), against.float(), atol=TOL, rtol=TOL)
    if not ok:
        failures.append(name)
    out(f"  check {name:<50} max |diff| {err:.2e}  {'ok' if ok else 'FAILED'}")


def timing(name: str, ms: float, flops: float, matmul: float, extra: str = "") -> None:
    tflops = flops / ms / 1e9
    out(f"  {name:<50} {ms * 1e3:9.1f} us  {tflops:6.1f} TFLOP/s ({tflops * 1e12 / matmul:4.0%} of matmul){extra}")


def bench(fn, graph: bool = False) -> float:
    """Milliseconds per call (Triton's do_bench: L2 flushed between calls; or one CUDA graph replayed)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn) if graph else triton.testing.do_bench(fn)


def timed(name: str, fn, flops: float, matmul: float, graph: bool = False, extra=None) -> None:
    try:
        ms = bench(fn, graph)
    except RuntimeError as e:
        out(f"  {name:<50} not run: {str(e).splitlines()[0]}")
        return
    timing(name, ms, flops, matmul, extra(ms) if extra else "")


def case_prefill(matmul: float, failures: list[str], tokens: int = 8192) -> None:
    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

    out(f"prefill: {tokens} tokens from position 0, {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}")
    step = Step([0], [tokens])
    ref = step.layer_output(step.inputs("reference"))
    fast = step.inputs("triton")
    assert fast.attention.groups[0].sdpa_prefill_ranges == [(0, tokens)], "expected the fresh-chunk path"
    ours = step.layer_output(fast)
    paged = step.inputs("triton", fresh_sdpa_min_tokens=1 << 30)   # everything through the kernel
    meta = paged.attention
    kernel = lambda: paged_prefill_attention(
        step.q, step.k_cache, step.v_cache, meta.groups[0].block_table, meta.seq_lens, meta.prefill_query_start,
        tokens, HEAD_DIM ** -0.5, None, BLOCK)
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (step.q, step.k, step.v))
    anchor = lambda: flash(q4, k4, v4, is_causal=True)
    check("engine path (SDPA cuDNN/flash) vs reference", ours, ref, failures)
    check("paged prefill kernel vs reference", kernel(), ref, failures)
    check("engine path vs SDPA flash", ours, lambda: anchor().transpose(1, 2)[0], failures)
    flops = causal_flops(HEADS, HEAD_DIM, 0, tokens)
    timed("engine path (fresh chunk -> SDPA cuDNN/flash)", step.attention_call(fast), flops, matmul)
    timed("paged prefill kernel (same chunk)", kernel, flops, matmul)
    timed("SDPA flash, is_causal (anchor)", anchor, flops, matmul)
    timed("SDPA cuDNN, is_causal (anchor)", lambda: flash(q4, k4, v4, backend="CUDNN_ATTENTION", is_causal=True),
          flops, matmul)


def case_extend(matmul: float, failures: list[str], context: int = 7168, q_len: int = 1024) -> None:
    from torch.nn.attention.bias import causal_lower_right

    out(f"extend: {q_len} tokens on {context} cached, {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}")
    step = Step([context], [q_len])
    ref = step.layer_output(step.inputs("reference"))
    fast = step.inputs("triton")
    assert fast.attention.groups[0].kernel_prefill_rows is not None, "expected the paged prefill kernel"
    ours = step.layer_output(fast)
    keys, values = step.contiguous_kv(0)
    q4 = step.q.unsqueeze(0).transpose(1, 2)
    mask = causal_lower_right(q_len, context + q_len)
    anchor = lambda: flash(q4, keys[None], values[None], attn_mask=mask)
    check("engine path (paged prefill kernel) vs reference", ours, ref, failures)
    check("engine path vs SDPA flash", ours, lambda: anchor().transpose(1, 2)[0], failures)
    flops = causal_flops(HEADS, HEAD_DIM, context, q_len)
    timed("engine path (paged prefill kernel)", step.attention_call(fast), flops, matmul)
    timed("SDPA flash, contiguous K/V, lower-right causal", anchor, flops, matmul)


LONG_SHAPES = [(4096, 1024), (8192, 1024), (2048, 2048), (8192, 2048), (4096, 4096), (8192, 8192),
               (16384, 16384), (114688, 16384)]   # (cached keys, queries)


def device_ms(fn, calls: int = 10) -> float:
    """Milliseconds of device work per call (the kernels' own time, from torch's profiler): what a
    call costs inside a step whose host runs ahead, where do_bench's wall time per call also
    counts the host's launches when they take longer than the kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def case_long(matmul: float, failures: list[str]) -> None:
    from deepinfer.layers.attention.sdpa_extend import takes
    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

    for context, q_len in LONG_SHAPES:
        route = "sdpa_extend" if takes(context, q_len) else "paged kernel"
        out(f"long: {q_len} queries on {context} cached keys, {HEADS}/{KV_HEADS} heads (engine: {route})")
        step = Step([context], [q_len])
        fast = step.inputs("triton")
        meta = fast.attention
        kernel = lambda: paged_prefill_attention(   # noqa: E731
            step.q, step.k_cache, step.v_cache, meta.groups[0].block_table, meta.seq_lens, meta.prefill_query_start,
            q_len, HEAD_DIM ** -0.5, None, BLOCK, max_seq_len=context + q_len)
        engine = step.attention_call(fast)
        check("engine path vs paged prefill kernel", engine(), kernel, failures)
        flops = causal_flops(HEADS, HEAD_DIM, context, q_len)
        engine_device, kernel_device = device_ms(engine), device_ms(kernel)
        timed(f"engine path ({route})", engine, flops, matmul, extra=lambda ms: f", device {engine_device * 1e3:.1f} us")
        timed("paged prefill kernel", kernel, flops, matmul, extra=lambda ms: f", device {kernel_device * 1e3:.1f} us")


def case_decode(matmul: float, bandwidth: float, failures: list[str], batch: int, context: int) -> None:
    from deepinfer.kv_cache.dtypes import is_fp8
    from deepinfer.layers.attention.triton_decode import num_splits_for, paged_decode_attention

    out(f"decode: batch {batch} at {context} context, {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}")
    step = Step([context - 1] * batch, [1] * batch)
    ref = step.layer_output(step.inputs("reference"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fast = step.inputs("triton", decode_splits=num_splits_for(batch, KV_HEADS, sms))
    ours = step.layer_output(fast)
    kv = [step.contiguous_kv(s) for s in range(batch)]
    keys, values = torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])
    q4 = step.q.unsqueeze(2)                                 # [B, H, 1, D]
    anchor = lambda: flash(q4, keys, values)
    check("engine path (paged decode kernel) vs reference", ours, ref, failures)
    check("engine path vs SDPA flash", ours, lambda: anchor()[:, :, 0], failures)
    flops = 4 * HEADS * HEAD_DIM * batch * context
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * CACHE_DTYPE.itemsize

    def kv_rate(ms: float) -> str:
        rate = kv_bytes / ms * 1e3
        return f"  KV read {rate / 1e12:.2f} TB/s ({rate / bandwidth:4.0%} of copy)"

    timed("engine path (paged decode kernel), graph", step.attention_call(fast), flops, matmul, True, kv_rate)
    if is_fp8(CACHE_DTYPE):   # the engine path takes the CUDA C++ kernel (cuda_decode.py); Triton's beside it
        meta = fast.attention
        triton_kernel = lambda: paged_decode_attention(
            step.q, step.k_cache, step.v_cache, meta.groups[0].block_table[:batch], meta.seq_lens[:batch],
            HEAD_DIM ** -0.5, None, BLOCK, meta.num_decode_splits, kernel="triton")
        check("Triton decode kernel vs reference", triton_kernel(), ref, failures)
        timed("Triton decode kernel, graph", triton_kernel, flops, matmul, True, kv_rate)
    timed("SDPA flash, contiguous K/V, graph (anchor)", anchor, flops, matmul, True, kv_rate)


REPLAY_QUERIES = 576            # SWA Bounded Replay's recompute: window 512 + a 64-token turn
REPLAY_SHAPE = (4, 1, 256)      # Gemma 3 1B: query heads, KV heads, head_dim
SPLIT_SWEEP = (2, 4, 8, 16, 32)


def case_replay(matmul: float, failures: list[str], contexts: list[int], rows: list[dict]) -> None:
    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention, prefill_config, split_count

    heads, kv_heads, head_dim = REPLAY_SHAPE
    block_m = prefill_config(head_dim, DTYPE)[0]
    shapes = [(c - REPLAY_QUERIES, REPLAY_QUERIES, True) for c in contexts] + [(127 * 1024, 1024, False)]
    for context, q_len, against_reference in shapes:
        seq_len = context + q_len
        out(f"replay: {q_len} queries on {context} cached, {heads}/{kv_heads} heads, head_dim {head_dim}")
        step = Step([context], [q_len], heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        fast = step.inputs("triton")
        meta, group = fast.attention, fast.attention.groups[0]
        assert group.kernel_prefill_rows is not None and group.kernel_max_seq_len == seq_len
        ours = step.layer_output(fast)   # the engine's layer: KV write, then the kernel's own choice
        if against_reference:
            check(f"{seq_len}: engine path (kernel's choice) vs reference", ours,
                  step.layer_output(step.inputs("reference")), failures)
        run = functools.partial(paged_prefill_attention, step.q, step.k_cache, step.v_cache, group.block_table,
                                meta.seq_lens, meta.prefill_query_start, q_len, head_dim ** -0.5, None, BLOCK)
        chosen = split_count(q_len, 1, heads, head_dim, q_len, seq_len, None, block_m, step.q.device)
        unsplit = run(num_splits=1)
        flops = causal_flops(heads, head_dim, context, q_len)
        row = dict(part="replay" if against_reference else "long chunk", context=context, queries=q_len,
                   keys=seq_len, splits_chosen=chosen, gflop=flops / 1e9)
        for name, splits in [("unsplit", 1), ("chosen", None), *((f"split {n}", n) for n in SPLIT_SWEEP)]:
            kwargs = dict(num_splits=splits) if splits else dict(max_seq_len=seq_len)
            check(f"{seq_len}: {name} vs unsplit", run(**kwargs), unsplit, failures)
            ms = bench(functools.partial(run, **kwargs))
            label = f"kernel, {name}" + (f" ({chosen})" if splits is None else "")
            timing(label, ms, flops, matmul)
            row[f"us_{name.replace(' ', '')}"] = ms * 1e3
        row["speedup"] = row["us_unsplit"] / row["us_chosen"]
        row["tflops_unsplit"] = flops / row["us_unsplit"] / 1e6
        row["tflops_chosen"] = flops / row["us_chosen"] / 1e6
        rows.append(row)
        del step
        torch.cuda.empty_cache()
    # The fresh 8k chunk: thousands of programs, so the choice stays unsplit (the same kernel).
    for shape in ((HEADS, KV_HEADS, HEAD_DIM), REPLAY_SHAPE):
        heads, kv_heads, head_dim = shape
        tokens = 8192
        out(f"replay, unchanged: {tokens} tokens from position 0 through the kernel, {heads}/{kv_heads} heads, "
            f"head_dim {head_dim}")
        step = Step([0], [tokens], heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        meta = step.inputs("triton", fresh_sdpa_min_tokens=1 << 30).attention
        chosen = split_count(tokens, 1, heads, head_dim, tokens, tokens, None, prefill_config(head_dim, DTYPE)[0],
                             step.q.device)
        run = functools.partial(paged_prefill_attention, step.q, step.k_cache, step.v_cache, meta.groups[0].block_table,
                                meta.seq_lens, meta.prefill_query_start, tokens, head_dim ** -0.5, None, BLOCK)
        same = chosen == 1 and torch.equal(run(max_seq_len=tokens), run(num_splits=1))
        out(f"  check {'choice unsplit, output bit-identical':<50} {'ok' if same else 'FAILED'} (choice {chosen})")
        if not same:
            failures.append(f"fresh {tokens} {shape} not unchanged")
        flops = causal_flops(heads, head_dim, 0, tokens)
        row = dict(part="fresh 8k", context=0, queries=tokens, keys=tokens, heads=heads, head_dim=head_dim,
                   splits_chosen=chosen, gflop=flops / 1e9)
        for name, kwargs in (("unsplit", dict(num_splits=1)), ("chosen", dict(max_seq_len=tokens))):
            ms = bench(functools.partial(run, **kwargs))
            timing(f"kernel, {name}", ms, flops, matmul)
            row[f"us_{name}"] = ms * 1e3
            row[f"tflops_{name}"] = flops / ms / 1e9
        rows.append(row)
        del step
        torch.cuda.empty_cache()


def replay_table(rows: list[dict]) -> None:
    from bench_common import print_table

    out("")
    out(f"paged prefill kernel split along the keys, {REPLAY_SHAPE[0]}/{REPLAY_SHAPE[1]} heads, head_dim "
        f"{REPLAY_SHAPE[2]} unless said (us per call; TFLOP/s of the causal FLOPs):")
    print_table(rows, [("part", "part", ""), ("keys", "keys", ","), ("queries", "queries", ","),
                       ("splits_chosen", "chosen", ""), ("us_unsplit", "unsplit us", ",.1f"),
                       ("us_chosen", "chosen us", ",.1f"), ("speedup", "speedup", ".2f"),
                       ("tflops_unsplit", "TFLOP/s unsplit", ".1f"), ("tflops_chosen", "TFLOP/s chosen", ".1f"),
                       *((f"us_split{n}", f"split {n} us", ",.1f") for n in SPLIT_SWEEP)])
    replay = {r["keys"]: r for r in rows if r["part"] == "replay"}
    if len(replay) > 1:
        short, long = replay[min(replay)], replay[max(replay)]
        out(f"{long['keys']} / {short['keys']} keys: unsplit {long['us_unsplit'] / short['us_unsplit']:.2f}x, "
            f"chosen {long['us_chosen'] / short['us_chosen']:.2f}x")


SWEEP_TILES = [(64, 64), (128, 32), (128, 64), (128, 128)]


def sweep(head_dims: list[int], failures: list[str]) -> None:
    """The paged prefill kernel over tile choices, checked against its default choice."""
    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention, prefill_config

    for head_dim in head_dims:
        heads, kv_heads = HEADS * HEAD_DIM // head_dim, KV_HEADS * HEAD_DIM // head_dim   # same hidden size
        default = prefill_config(head_dim, DTYPE)
        for shape, (context, q_len) in (("extend 1024 on 7168", (7168, 1024)), ("prefill 8192", (0, 8192))):
            out(f"sweep: paged prefill kernel, {shape}, {heads}/{kv_heads} heads, head_dim {head_dim}"
                f" (default {default})")
            step = Step([context], [q_len], heads=heads, kv_heads=kv_heads, head_dim=head_dim)
            meta = step.inputs("triton", fresh_sdpa_min_tokens=1 << 30).attention
            flops = causal_flops(heads, head_dim, context, q_len)

            run = functools.partial(paged_prefill_attention, step.q, step.k_cache, step.v_cache,
                                    meta.groups[0].block_table, meta.seq_lens, meta.prefill_query_start, q_len,
                                    head_dim ** -0.5, None, BLOCK)

            expected = run(config=default)
            best = None
            tiles = SWEEP_TILES + [default[:2]] * (default[:2] not in SWEEP_TILES)
            for block_m, block_n in tiles:
                for warps in (4, 8):
                    for stages in (2, 3):
                        config = (block_m, block_n, warps, stages)
                        try:
                            got = run(config=config)
                            ms = bench(functools.partial(run, config=config))
                        except Exception as e:   # noqa: BLE001  (OutOfResources, or a config Triton cannot build)
                            out(f"  {config!s:<22} not run: {type(e).__name__}: {str(e).splitlines()[0]}")
                            continue
                        if not torch.allclose(got.float(), expected.float(), atol=TOL, rtol=TOL):
                            failures.append(f"sweep {config} head_dim {head_dim}")
                            out(f"  {config!s:<22} WRONG OUTPUT")
                            continue
                        mark = "*" if config == default else " "
                        out(f" {mark}{config!s:<22} {ms * 1e3:9.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s")
                        if best is None or ms < best[0]:
                            best = (ms, config)
            if best:
                out(f"  fastest: {best[1]} at {flops / best[0] / 1e9:.1f} TFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="prefill,extend,decode")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-dims", default="64,128,256")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--replay-contexts", default="4096,8192,16384,32768",
                        help="contexts (keys) of the replay case, each ending in its 576 queries")
    parser.add_argument("--out", help="write the replay case's rows here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py measures the CUDA fast path: it needs a CUDA GPU, and "
                 "torch.cuda.is_available() is False here")
    try:
        import triton
    except ImportError:
        sys.exit("attention_kernels.py needs Triton (the fast path's kernels), which is not installed")

    global CACHE_DTYPE
    from deepinfer.kv_cache.dtypes import resolve_cache_dtype

    CACHE_DTYPE = resolve_cache_dtype(args.kv_cache_dtype, DTYPE)
    bandwidth, matmul = ceilings()
    out(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{time.strftime('%Y-%m-%d')}")
    out(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s; "
        f"KV cache {CACHE_DTYPE}")
    failures: list[str] = []
    with torch.inference_mode():
        cases = args.cases.split(",")
        if "prefill" in cases:
            case_prefill(matmul, failures)
        if "extend" in cases:
            case_extend(matmul, failures)
        if "long" in cases:
            case_long(matmul, failures)
        if "decode" in cases:
            for batch, context in ((1, 1024), (1, 8192), (64, 1024), (64, 8192), (512, 1152)):
                case_decode(matmul, bandwidth, failures, batch, context)
        replay_rows: list[dict] = []
        if "replay" in cases:
            try:
                case_replay(matmul, failures, [int(c) for c in args.replay_contexts.split(",")], replay_rows)
            finally:   # what was measured before a failure still prints and saves
                if replay_rows:
                    replay_table(replay_rows)
                if args.out:
                    from bench_common import machine_info, write_json

                    write_json(args.out, {"machine": machine_info(), "matmul_tflops": matmul / 1e12,
                                          "failures": failures, "replay": replay_rows})
        if args.sweep:
            sweep([int(d) for d in args.sweep_dims.split(",")], failures)
        torch.cuda.synchronize()
    if failures:
        sys.exit(f"checks FAILED: {', '.join(failures)}")
    out("all checks passed")


if __name__ == "__main__":
    main()
