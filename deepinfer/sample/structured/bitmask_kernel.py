"""Packed grammar bitmask -> -inf logits in one Triton kernel (the CUDA path of apply_grammar_bitmask).

The reference path (bitmask.unpack_bitmask, then masked_fill) unpacks the int32 words into a
bool [rows, vocab] tensor through a byte table and fills from it: four or five kernels, and as
many host launches, on the engine loop. Here one program reads BLOCK // 32 packed words of one
row, expands them to bits in registers and writes -inf where a bit is 0: the packed rows are
the only input, and only the masked logits are written.

Same semantics as the reference: logit row `logit_rows[i]` takes mask row `mask_rows[i]`; bit
t % 32 of word t // 32 set = token t allowed; a logit column past the bitmask's last word (a
model whose logits are wider than the grammar's vocabulary) is blocked. tests/unit/
test_structured_bitmask_kernel.py compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096   # vocabulary columns per program: 128 packed words


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab_size, num_words,
                          logits_stride, bitmask_stride, INDEXED: tl.constexpr, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    if INDEXED:   # rows_ptr holds [logit rows..., mask rows...]
        logit_row = tl.load(rows_ptr + pair).to(tl.int64)
        mask_row = tl.load(rows_ptr + tl.num_programs(0) + pair).to(tl.int64)
    else:         # row i of the logits takes row i of the mask
        logit_row = pair.to(tl.int64)
        mask_row = pair.to(tl.int64)
    words = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(bitmask_ptr + mask_row * bitmask_stride + words, mask=words < num_words, other=0)
    blocked = ((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits_ptr + logit_row * logits_stride + cols, float("-inf"),
             mask=(cols < vocab_size) & tl.reshape(blocked, (BLOCK,)))


def apply_packed_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor | None = None) -> None:
    """Set logits[logit_rows[i], t] = -inf where bit t of bitmask[mask_rows[i]] is 0, in place.

    logits [n, vocab] (row stride free, columns contiguous); bitmask int32 [m, words] on the same
    device; rows: None (n == m, row i takes row i) or int32 [2, k] holding logit_rows and
    mask_rows, on the device.
    """
    assert bitmask.dtype == torch.int32 and logits.stride(-1) == 1
    bitmask = bitmask.contiguous()
    num_pairs = logits.shape[0] if rows is None else rows.shape[1]
    vocab = logits.shape[-1]
    if num_pairs and vocab:
        _apply_bitmask_kernel[(num_pairs, triton.cdiv(vocab, BLOCK))](
            logits, bitmask, rows if rows is not None else bitmask, vocab, bitmask.shape[1],
            logits.stride(0), bitmask.stride(0), INDEXED=rows is not None, BLOCK=BLOCK, num_warps=4)
