"""Paged decode attention over an fp8 KV cache in CUDA C++ (cuda_decode_fp8.cu), for a 16-bit q.

Why not Triton: over an fp8 cache the Triton decode kernel (triton_decode.py) stays well above
its bandwidth bound. Nsight Compute shows it bound by latency: many registers per thread, few
programs per multiprocessor, issue slots mostly idle (figures:
docs/benchmarks/design-measurements.md#cuda-fp8-decode-kernel). Triton stages the converted tiles through
shared memory and pads its 4 query heads to 16-row tensor-core tiles on both products.

This kernel gives each (sequence, KV head, split) one warp, and lets the memory system run ahead:
  - the fp8 bytes go from global to shared memory with cp.async, STAGES units of 32 keys in
    flight per warp, no registers held while they travel;
  - K and V are converted fp8 -> fp16 (one instruction per pair) straight into tensor-core
    fragments, never written back to shared memory;
  - the output is computed transposed (O^T = V^T P^T), so the scores' accumulator registers are
    the second product's operand as they are and the heads fill 8-wide columns, not 16-row tiles.
Products in float16, accumulators and softmax in float32, as the Triton kernel's fp8 path.

Scope: fp8 cache, q (and out) bf16 or fp16, head_dim 128, 1..8 query heads per KV head, a CUDA
device of compute capability 8.9 or later (e4m3 conversion in hardware). Everything else, and
float32 models, stays on the Triton kernel; the splits are merged by its merge kernel.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from pathlib import Path

import torch

from deepinfer.kv_cache.dtypes import is_fp8

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cuda_decode_fp8.cu")
HEAD_DIM = 128
MAX_GROUP = 8
# cp.async pipeline depth per warp (units of 32 keys). Shared memory per warp is STAGES x 8 KB.
STAGES = 3

_ARG_TYPES = ([ctypes.c_void_p] * 8 + [ctypes.c_float] + [ctypes.c_int] * 3 + [ctypes.c_int64] * 14)


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether this kernel takes the call (module docstring), alignment included: q and out rows
    are read and written 16 bytes at a time, cache rows copied 16 bytes at a time."""
    if not (q.is_cuda and is_fp8(k_cache.dtype) and is_fp8(v_cache.dtype)
            and q.dtype in (torch.bfloat16, torch.float16) and out.dtype == q.dtype):
        return False
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    if head_dim != HEAD_DIM or heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return False
    aligned = all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0
                  for t in (q, out))
    cache_ok = all(c.stride(-1) == 1 and c.data_ptr() % 16 == 0 and c.stride(0) % 16 == 0 and c.stride(1) % 16 == 0
                   for c in (k_cache, v_cache))
    return aligned and cache_ok and available(q.device)


@functools.cache
def _kernel(group: int, block_size: int, bf16: bool, stages: int, device: torch.device):
    from deepinfer.platforms.nvrtc import load_kernel

    options = [f"-DGROUP={group}", f"-DBLOCK_SIZE={block_size}", f"-DQ_BF16={int(bf16)}", f"-DSTAGES={stages}"]
    return load_kernel(SOURCE.read_text(), "decode_fp8", options, _ARG_TYPES, device)


@functools.cache
def available(device: torch.device) -> bool:
    """A device of compute capability 8.9 or later, where NVRTC and the driver compile and load
    the kernel. If not, the Triton kernel serves (a warning says why when the device would do):
    slower over an fp8 cache, the same results up to float rounding."""
    from deepinfer.platforms.nvrtc import NvrtcError

    if torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        _kernel(4, 16, True, STAGES, device)
        return True
    except NvrtcError as e:
        logger.warning("the CUDA decode kernel for fp8 KV caches is unavailable, using Triton's: %s", e)
        return False


def decode_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, window: int | None, block_size: int, num_splits: int,
               out: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor, stages: int = STAGES) -> None:
    """The split kernel: with one split it writes `out`, otherwise o_part / lse_part in the layout
    of triton_decode's merge kernel. Arguments as triton_decode.paged_decode_attention's."""
    batch, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[1]
    kernel = _kernel(num_heads // num_kv_heads, block_size, q.dtype == torch.bfloat16, stages, q.device)
    kernel(batch * num_kv_heads * num_splits, 32,
           q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, out,
           scale * math.log2(math.e), window or 0, num_kv_heads, num_splits,
           q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
           block_table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
           lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1))
