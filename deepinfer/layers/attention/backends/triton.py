"""The Triton backend, CUDA's fast path: paged attention kernels, every fused kernel, CUDA graphs.

Attention reads the block tables directly (no gathered rows): decode rows go to the split decode
kernel (triton_decode.py) or, over an fp8 cache, to the CUDA C++ kernel (cuda_decode.py) where it
takes the call; chunks on top of cached tokens and short fresh chunks go to the paged prefill
kernel (triton_prefill.py), one launch for all of them; long fresh chunks (from position 0, so
the step holds all their K/V) attend with SDPA's tiled kernels over the step's own K/V
(Attention._fresh_chunk), and long chunks on a long cached prefix of a full-attention group with
cuDNN's kernel over keys gathered from the cache (sdpa_extend.py). A step whose rows see later
keys (an image's tokens in Gemma 3, with_visible_end) sends those rows' chunks to the paged
prefill kernel whatever their length, with each row's visible end. Around attention it turns on
every fused kernel of layers/fused/.

Triton is imported only inside the methods that launch kernels: this module is imported on CPU
machines too (selection.py lists every backend).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.kv_cache.dtypes import is_fp8
from deepinfer.layers.attention.backends.base import (
    AttentionBackend,
    AttentionMetadata,
    DecodeGraphBuffers,
    GroupMetadata,
    StepLayout,
    flat_rows,
    sliding_window_of,
)

# A fresh chunk (one that starts at position 0, so this step holds all its K/V) this long or
# longer attends with SDPA's flash kernel over the step's own K/V; see Attention._fresh_chunk.
# Shorter ones stay in the paged prefill kernel, whose one launch covers every short chunk of the
# step: a flash call per short chunk would launch fewer programs (128-query tiles x heads) than
# the GPU has multiprocessors, once per chunk and layer.
FRESH_SDPA_MIN_TOKENS = 512
# (cached, new) of a chunk for the runner's warm-up (TritonBackend.warm_up_steps): few queries
# on keys enough for the paged prefill kernel to split them (at least 2 x
# triton_prefill.MIN_KEYS_PER_SPLIT), so that its split variant and the merge compile at start,
# not in the first step that meets a long context (SWA Bounded Replay's recompute, say).
SPLIT_WARM_UP_CHUNK = (1024, 2)

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TritonGroupMetadata(GroupMetadata):
    # [num_seqs, max_blocks] int32 block ids per row (decodes first), 0-padded.
    block_table: torch.Tensor
    # How this group's prefill rows are attended (a group's sliding window decides, so it is per
    # group). Fresh chunks (the chunk starts at position 0, is long enough to fill the GPU, and no
    # window cuts it) attend over this step's own K/V with SDPA's flash kernel: their token ranges
    # in the step, on the host. Every other prefill row goes to the paged prefill kernel: their
    # indices among the prefill rows [n] int32 (None: there are none), the longest of those
    # chunks (the kernel's grid) and their longest KV length (start + chunk), on the host: the
    # kernel's key split is chosen from it without reading seq_lens back from the device.
    sdpa_prefill_ranges: list[tuple[int, int]] = field(default_factory=list)
    kernel_prefill_rows: torch.Tensor | None = None
    # Long chunks on a long cached prefix of a full-attention group (sdpa_extend.takes): each as
    # (its token range's start, end, its index among the prefill rows, its first position, the
    # cache rows of its positions [0, end) as an int64 device tensor); they attend with cuDNN over
    # keys gathered from the cache, not in the paged prefill kernel. The rows are the same for
    # every layer: computed once a step.
    extend_chunks: list[tuple[int, int, int, int, torch.Tensor]] = field(default_factory=list)
    kernel_max_prefill_len: int = 0
    kernel_max_seq_len: int = 0
    # A sliding-window group's key floor per prefill row [num_prefills] int32 (SWA Bounded
    # Replay: the requests' window floors); None when no prefill row of the step has one, and
    # always for full-attention groups, which see every key.
    kernel_key_floor: torch.Tensor | None = None


@dataclass(kw_only=True)
class TritonMetadata(AttentionMetadata):
    # Shared by every group: KV length per row including this step's tokens [num_seqs] int32
    # (decodes first), where each prefill row starts in q counted from the first prefill token
    # [num_prefills + 1] int32, and the number of sequence splits of the decode kernel (fixed per
    # batch size so CUDA graphs stay valid).
    seq_lens: torch.Tensor
    prefill_query_start: torch.Tensor | None = None
    num_decode_splits: int = 1
    # Per prefill row [num prefill tokens] int32, the key position (exclusive) it sees up to, set
    # (with_visible_end) on steps where some rows see later keys (an image's tokens); the paged
    # prefill kernel then reads it for every row it attends. None: causal (decode rows always).
    prefill_visible_end: torch.Tensor | None = None


def padded_block_table(tables: list[list[int]]) -> np.ndarray:
    """Rows of block ids, right-padded with the null block 0, as int32 (what the kernels read).
    Filled in one pass over all ids: a copy per row cost host time that grew with the batch
    (docs/benchmarks/design-measurements.md#padded-block-table)."""
    lengths = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    out = np.zeros((len(tables), int(lengths.max(initial=1))), dtype=np.int32)
    total = int(lengths.sum())
    if total:
        out[np.arange(out.shape[1]) < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int32, count=total)
    return out


def _flash_takes(group, device: torch.device) -> bool:
    """Whether SDPA's flash backend takes this group's K/V as they are. On CUDA it wants fp16 or
    bf16 and a head size <= 256 (and pads, i.e. copies, one not a multiple of 8); the CPU's flash
    kernel (Triton's interpreter in tests) takes any."""
    spec = group.spec
    if device.type != "cuda":
        return True
    return spec.dtype in (torch.float16, torch.bfloat16) and spec.head_size <= 256 and spec.head_size % 8 == 0


class TritonBackend(AttentionBackend):
    name = "triton"
    fused_norm = True
    fused_rotary = True
    e5m2_cache = False   # its kernels read and write fp8 as e4m3
    fused_activation = True
    fused_gemv = True
    needs_warm_up = True
    supports_decode_graphs = True
    model_kernels = True

    def __init__(self, device: torch.device | None = None, kv_cache_dtype: torch.dtype | None = None) -> None:
        super().__init__(device, kv_cache_dtype)
        self._num_sms: int | None = None
        # The decode choice: over an fp8 cache, the CUDA C++ kernel wherever it takes the call
        # (paged_decode_attention's "auto": cuda_decode.supported, per call, since q's dtype and
        # the strides decide), Triton's split kernel elsewhere; over a 16-bit cache always
        # Triton's. Unknown cache dtype (a backend built by name in tests): "auto".
        self.cuda_fp8_decode = kv_cache_dtype is None or is_fp8(kv_cache_dtype)
        # Set when cuDNN refused a chunk on a cached prefix (attend): the paged kernel takes them all.
        self.extend_failed = False

    def warm_up_steps(self, max_model_len: int) -> list[list[tuple[int, int]]]:
        """One eager step of every attention kind: a decode split along its sequence, a chunk on
        top of cached tokens (the paged prefill kernel) and a fresh chunk (SDPA), so that their
        compiles (each far longer than a step, see
        docs/benchmarks/design-measurements.md#kernel-warm-up) happen at start, as vLLM's warm-up
        does, not in the first steps that serve requests. Then, where the model's length allows
        it, a step of one short chunk on a long context: the paged prefill kernel split along its
        keys, and the merge (a step of its own, or its launch would take the other chunks too and
        the unsplit kernel would not run)."""
        limit = min(max_model_len, 128)
        # The fresh chunk long enough for SDPA where the model allows it.
        steps = [[(limit - 1, 1), (limit // 2, limit - limit // 2), (0, min(FRESH_SDPA_MIN_TOKENS, max_model_len))]]
        if sum(SPLIT_WARM_UP_CHUNK) <= max_model_len:
            steps.append([SPLIT_WARM_UP_CHUNK])
        return steps

    @classmethod
    def check_supported(cls, platform, kv_cache_dtype) -> None:
        if platform.device.type != "cuda":
            raise ValueError(f"attention_backend={cls.name!r} needs CUDA; this platform is "
                             f"{platform.name} (use 'reference', 'cpu' or 'auto')")
        if is_fp8(kv_cache_dtype):
            capability = torch.cuda.get_device_capability(platform.device)
            if capability < (8, 9):   # Triton converts to and from float8 e4m3 from Ada/Hopper on
                raise ValueError(f"an fp8 kv_cache_dtype on the {cls.name} backend needs a GPU of compute "
                                 f"capability 8.9 or newer, this one is {capability[0]}.{capability[1]} "
                                 "(use kv_cache_dtype='auto', or attention_backend='reference')")

    def describe(self) -> str:
        decode = ("decode over the fp8 cache: the CUDA C++ kernel where it applies, else Triton's"
                  if self.cuda_fp8_decode else "decode: Triton's split kernel")
        return f"{super().describe()}; {decode}"

    def workspace_bytes(self, groups, max_model_len: int, max_num_batched_tokens: int, num_heads: int) -> int:
        """Chunks on a long cached prefix gather their keys for cuDNN (sdpa_extend): the most one
        layer's call holds, where a full-attention group can take that path."""
        from deepinfer.layers.attention import sdpa_extend

        if not any(sdpa_extend.takes(max_model_len - tokens, tokens)
                   for tokens, _ in sdpa_extend.EXTEND_MIN_SHAPES if tokens <= max_num_batched_tokens):
            return 0
        device = self.device or torch.device("cpu")
        return max((sdpa_extend.workspace_bytes(max_model_len, max_num_batched_tokens, num_heads, g.spec.num_kv_heads,
                                                g.spec.head_size, g.spec.dtype)
                    for g in groups if not sliding_window_of(g) and _flash_takes(g, device)
                    and sdpa_extend.supported(device, g.spec.head_size)), default=0)

    def decode_splits(self, batch: int, num_kv_heads: int) -> int:
        from deepinfer.layers.attention.triton_decode import num_splits_for

        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return num_splits_for(batch, num_kv_heads, self._num_sms)

    # ----------------------------------------------------------------------------- metadata
    def build_metadata(self, step: StepLayout) -> TritonMetadata:
        from deepinfer.layers.attention import sdpa_extend

        prefills, ordered = step.prefills, step.ordered
        min_fresh = FRESH_SDPA_MIN_TOKENS if step.fresh_sdpa_min_tokens is None else step.fresh_sdpa_min_tokens
        # The prefill rows' window floors, for the sliding-window groups; None where no row has one
        # (the prefill kernel then compiles without a floor). Decode rows never carry a live floor
        # (input_batch.is_decode_row), so the decode kernels and CUDA graphs need none.
        key_floor = (step.to_device(np.array([c.window_floor for c in prefills], dtype=np.int32))
                     if any(c.window_floor for c in prefills) else None)
        groups = []
        for group, tables, slot_mapping in zip(step.groups, step.block_tables, step.slot_mappings):
            window = sliding_window_of(group)
            # Plain causal SDPA is exact for a fresh chunk only if no window cuts it: the last
            # query (position n - 1) sees keys > n - 1 - window, i.e. all of them when window >= n.
            # A window that cuts the chunk would need a mask, and flash takes none. It attends over
            # the step's own K/V, so not in a full group whose write floor keeps cached rows in
            # place of the chunk's (a window floor is at most the chunk's start, so 0 here).
            flash = _flash_takes(group, step.device)
            extend_ok = (flash and not window and not self.extend_failed
                         and sdpa_extend.supported(step.device, group.spec.head_size))
            sdpa_ranges, kernel_rows, extend = [], [], []
            for i, (c, token_range) in enumerate(zip(prefills, step.prefill_query_ranges)):
                if (flash and c.start == 0 and c.num_tokens >= min_fresh
                        and (window >= c.num_tokens if window else c.write_floor == 0)):
                    sdpa_ranges.append(token_range)
                elif extend_ok and sdpa_extend.takes(c.start, c.num_tokens):
                    # Every key read from the cache, as the paged kernel reads them (a write
                    # floor's kept rows included).
                    table = np.asarray(tables[len(step.decodes) + i], dtype=np.int64)
                    rows = step.to_device(flat_rows(table, np.arange(c.start + c.num_tokens), step.block_size))
                    extend.append((*token_range, i, c.start, rows))
                else:
                    kernel_rows.append(i)
            groups.append(TritonGroupMetadata(
                slot_mapping=slot_mapping,
                block_table=step.to_device(padded_block_table(tables)),
                sdpa_prefill_ranges=sdpa_ranges,
                extend_chunks=extend,
                kernel_prefill_rows=step.to_device(np.array(kernel_rows, dtype=np.int32)) if kernel_rows else None,
                kernel_max_prefill_len=max((prefills[i].num_tokens for i in kernel_rows), default=0),
                kernel_max_seq_len=max((prefills[i].start + prefills[i].num_tokens for i in kernel_rows), default=0),
                kernel_key_floor=key_floor if window else None))
        lengths = [c.num_tokens for c in prefills]
        return TritonMetadata(
            groups=groups, **step.metadata_fields(self),
            seq_lens=step.to_device(np.array([c.start + c.num_tokens for c in ordered], dtype=np.int32)),
            prefill_query_start=step.to_device(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
            num_decode_splits=step.decode_splits)

    def with_visible_end(self, meta: TritonMetadata, visible_end: np.ndarray,
                         chunks: list[int]) -> TritonMetadata:
        """The chunks with rows that see later keys go to the paged prefill kernel in every group
        (SDPA's and cuDNN's causal kernels, which build_metadata may have picked for them, take
        no such mask), and its launch reads the visible ends of all its rows: a causal row's is
        its position + 1, so the chunks already there attend as before. Host values only: the
        kernel rows and their bounds are recomputed from the step's layout, not read back."""
        step, prefills = meta.step, meta.step.prefills
        ahead = set(chunks)
        chunk_of = {token_range: i for i, token_range in enumerate(meta.prefill_query_ranges)}
        groups = []
        for group in meta.groups:
            elsewhere = {chunk_of[r] for r in group.sdpa_prefill_ranges} | {e[2] for e in group.extend_chunks}
            if not elsewhere & ahead:
                groups.append(group)
                continue
            rows = [i for i in range(len(prefills)) if i in ahead or i not in elsewhere]
            groups.append(dataclasses.replace(
                group,
                sdpa_prefill_ranges=[r for r in group.sdpa_prefill_ranges if chunk_of[r] not in ahead],
                extend_chunks=[e for e in group.extend_chunks if e[2] not in ahead],
                kernel_prefill_rows=step.to_device(np.array(rows, dtype=np.int32)),
                kernel_max_prefill_len=max(prefills[i].num_tokens for i in rows),
                kernel_max_seq_len=max(prefills[i].start + prefills[i].num_tokens for i in rows)))
        return dataclasses.replace(meta, groups=groups,
                                   prefill_visible_end=step.to_device(np.ascontiguousarray(visible_end, np.int32)))

    # ---------------------------------------------------------------------------- attention
    def write_kv(self, layer, meta, group, q, k, v, positions, rotary, k_cache, v_cache):
        if rotary is not None and self.fused_rotary:   # rotated in place, K/V written, one kernel
            from deepinfer.layers.fused.rotary import rotate_and_write_kv_
            rotate_and_write_kv_(positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache, group.slot_mapping)
            return q, k
        if rotary is not None:
            q, k = rotary(positions, q, k)
        from deepinfer.layers.fused.kv_write import write_kv_cache  # both caches in one kernel
        write_kv_cache(k, v, k_cache, v_cache, group.slot_mapping)
        return q, k

    def attend(self, layer, meta, group, q, k, v, k_cache, v_cache):
        """Decode rows come first. Decodes and most prefill rows read K/V through the block
        tables with the kernels; long fresh prefill chunks attend with SDPA's flash kernel over
        this step's own k/v: the rows just written to the cache, with the values the cache holds
        (an fp8 cache's write kernel rounds k and v in place, see kv_cache/dtypes.py); long
        chunks on a long cached prefix attend with cuDNN (_attend_extend_chunks)."""
        from deepinfer.layers.attention.triton_decode import paged_decode_attention
        from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

        fresh = group.sdpa_prefill_ranges
        if len(fresh) == 1 and fresh[0] == (0, q.shape[0]):
            return layer._fresh_chunk(q, k, v, 0, q.shape[0])   # one fresh chunk: no copy into `out`
        out = torch.empty_like(q)
        n_dec = meta.num_decode_tokens
        if n_dec:
            paged_decode_attention(q[:n_dec], k_cache, v_cache, group.block_table[:n_dec], meta.seq_lens[:n_dec],
                                   layer.scale, layer.sliding_window, meta.block_size, meta.num_decode_splits,
                                   out=out[:n_dec], kernel="auto" if self.cuda_fp8_decode else "triton")
        if group.kernel_prefill_rows is not None:
            paged_prefill_attention(q[n_dec:], k_cache, v_cache, group.block_table[n_dec:], meta.seq_lens[n_dec:],
                                    meta.prefill_query_start, group.kernel_max_prefill_len, layer.scale,
                                    layer.sliding_window, meta.block_size, out=out[n_dec:],
                                    seq_ids=group.kernel_prefill_rows, key_floor=group.kernel_key_floor,
                                    max_seq_len=group.kernel_max_seq_len, visible_end=meta.prefill_visible_end)
        if group.extend_chunks:
            self._attend_extend_chunks(layer, meta, group, q, k_cache, v_cache, out)
        layer._fresh_chunks(q, k, v, fresh, out)
        return out

    def _attend_extend_chunks(self, layer, meta, group, q, k_cache, v_cache, out):
        """Long chunks on a long cached prefix (sdpa_extend): cuDNN over keys gathered from the
        cache, or the paged prefill kernel once cuDNN has refused a shape."""
        from deepinfer.layers.attention import sdpa_extend
        from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

        n_dec = meta.num_decode_tokens
        for start, end, prefill, position, cache_rows in group.extend_chunks:
            if not self.extend_failed:
                try:
                    rows = sdpa_extend.gathered_rows(position, end - start)
                    keys, values = (sdpa_extend.gather_keys(cache, cache_rows, rows, q.dtype)
                                    for cache in (k_cache, v_cache))
                    sdpa_extend.extend_attention(q[start:end], keys, values, position, layer.scale,
                                                 out=out[start:end])
                    continue
                except RuntimeError as e:   # raised on the host, where cuDNN builds its plan
                    # No plan for a shape (a cuDNN or torch build without one): the paged kernel
                    # writes this whole chunk (whatever part ran is overwritten) and takes every
                    # later one.
                    self.extend_failed = True
                    logger.warning("cuDNN's attention failed on a chunk of %d queries on %d cached keys (%s); "
                                   "chunks on cached prefixes use the paged prefill kernel from now on",
                                   end - start, position, str(e).splitlines()[0] if str(e) else type(e).__name__)
            paged_prefill_attention(q[n_dec:], k_cache, v_cache, group.block_table[n_dec:], meta.seq_lens[n_dec:],
                                    meta.prefill_query_start, end - start, layer.scale, None, meta.block_size,
                                    out=out[n_dec:], max_seq_len=position + end - start,
                                    seq_ids=torch.tensor([prefill], dtype=torch.int32, device=q.device))

    # --------------------------------------------------------------------------- CUDA graphs
    def decode_graph_buffers(self, *, num_groups, max_batch, max_blocks_per_seq, num_kv_heads, block_size,
                             layer_to_group, layer_to_slot, kv_caches, device) -> TritonGraphBuffers:
        return TritonGraphBuffers(self, num_groups, max_batch, max_blocks_per_seq, num_kv_heads, block_size,
                                  layer_to_group, layer_to_slot, kv_caches, device)


class TritonGraphBuffers(DecodeGraphBuffers):
    """Per-step inputs of the decode kernels (KV lengths, KV write rows, block tables) in buffers
    sized for the largest bucket. A step's values go into their front; padding rows get length 0
    (the decode kernel skips them) and write into the null block."""

    def __init__(self, backend: TritonBackend, num_groups: int, max_batch: int, max_blocks_per_seq: int,
                 num_kv_heads: int, block_size: int, layer_to_group: list[int], layer_to_slot: list[int],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.backend, self.num_kv_heads, self.block_size = backend, num_kv_heads, block_size
        self.layer_to_group, self.layer_to_slot, self.kv_caches = layer_to_group, layer_to_slot, kv_caches
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.slot_mappings = [torch.zeros(max_batch, dtype=torch.long, device=device) for _ in range(num_groups)]
        self.block_tables = [torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
                             for _ in range(num_groups)]

    def metadata(self, bucket: int) -> TritonMetadata:
        groups = [TritonGroupMetadata(slot_mapping=slots[:bucket], block_table=table[:bucket])
                  for slots, table in zip(self.slot_mappings, self.block_tables)]
        return TritonMetadata(
            backend=self.backend, num_tokens=bucket, num_decode_tokens=bucket, prefill_query_ranges=[],
            groups=groups, layer_to_group=self.layer_to_group, layer_to_slot=self.layer_to_slot,
            kv_caches=self.kv_caches, block_size=self.block_size, seq_lens=self.seq_lens[:bucket],
            num_decode_splits=self.backend.decode_splits(bucket, self.num_kv_heads))

    def fill_for_capture(self) -> None:
        self.seq_lens.fill_(1)   # length-1 sequences reading and writing row 0 of the null block

    def clear_after_capture(self) -> None:
        self.seq_lens.zero_()

    def advance(self, positions: torch.Tensor) -> None:
        """The next step of a verify chain (worker/spec/verify_chain.py), for the rows the last load
        filled: each row now at `positions` [rows] (device), over the block tables it already
        holds. Device ops only, so the host queues it without waiting for the step before."""
        rows = positions.shape[0]
        self.seq_lens[:rows].copy_(positions + 1)
        block, offset = positions // self.block_size, positions % self.block_size
        for slots, table in zip(self.slot_mappings, self.block_tables):
            slots[:rows].copy_(table[:rows].gather(1, block[:, None]).squeeze(1).long() * self.block_size + offset)

    def load(self, meta: TritonMetadata, bucket: int) -> None:
        batch = meta.num_tokens
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        for g, group in enumerate(meta.groups):
            self.slot_mappings[g][:batch].copy_(group.slot_mapping, non_blocking=True)
            width = group.block_table.shape[1]
            self.block_tables[g][:batch, :width].copy_(group.block_table, non_blocking=True)
        if bucket > batch:   # padding rows: nothing to attend to, writes land in the null block
            self.seq_lens[batch:bucket].zero_()
            for slots in self.slot_mappings:
                slots[batch:bucket].zero_()
