"""The Triton kernel that applies packed grammar bitmasks (the CUDA path of apply_grammar_bitmask)
against the reference path: unpack_bitmask, then masked_fill.

Random bitmasks (all-allowed, all-blocked and mixed words, bit 31 included), vocabularies that
are and are not multiples of 32 and of the kernel's block, logits wider than the bitmask (the
extra columns are blocked), every row in order, and a subset of logit rows taking mask rows in
another order. Runs on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.sample.structured.bitmask import apply_grammar_bitmask, unpack_bitmask
from deepinfer.types.plan import GrammarOutput
from tests.triton_support import DEVICE  # skips this module without a way to run Triton

# isort: split
from deepinfer.sample.structured.bitmask_kernel import apply_packed_bitmask  # (needs triton)


def random_bitmask(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    words = -(-vocab // 32)
    bits = torch.randint(0, 2**32, (rows, words), generator=gen, dtype=torch.int64)
    kind = torch.randint(0, 4, (rows, words), generator=gen)
    bits = torch.where(kind == 0, torch.zeros_like(bits), bits)              # all blocked
    bits = torch.where(kind == 1, torch.full_like(bits, 2**32 - 1), bits)    # all allowed
    return (bits - (bits >= 2**31) * 2**32).to(torch.int32)                  # same bits as int32


def reference(logits, bitmask, logit_rows, mask_rows):
    out = logits.clone()
    blocked = ~unpack_bitmask(bitmask.cpu(), logits.shape[-1]).to(logits.device)
    out[logit_rows] = out[logit_rows].masked_fill(blocked[mask_rows], float("-inf"))
    return out


@pytest.mark.parametrize("vocab,mask_vocab", [(49152, 49152), (1000, 1000), (4097, 4097), (130, 100), (8200, 8192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_unpack_and_fill(vocab, mask_vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    n = 7
    bitmask = random_bitmask(n, mask_vocab, gen)
    logits = torch.randn(n, vocab, generator=gen).to(dtype).to(DEVICE)
    # every row, in order
    expected = reference(logits, bitmask, list(range(n)), list(range(n)))
    got = logits.clone()
    apply_packed_bitmask(got, bitmask.to(DEVICE))
    assert torch.equal(got, expected)
    # a subset of logit rows, taking mask rows in another order
    logit_rows, mask_rows = [5, 0, 3], [1, 6, 2]
    expected = reference(logits, bitmask, logit_rows, mask_rows)
    got = logits.clone()
    apply_packed_bitmask(got, bitmask.to(DEVICE), torch.tensor([logit_rows, mask_rows], dtype=torch.int32, device=DEVICE))
    assert torch.equal(got, expected)


def test_step_bitmask_apply_packed_matches_unpacked():
    """apply_grammar_bitmask gives the same logits whether the worker unpacked the rows (CPU path)
    or left them packed for the kernel (GPU path), for rows in order and for a mixed batch."""
    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    bitmask = random_bitmask(3, vocab, gen)

    def step(packed: bool) -> GrammarOutput:
        return GrammarOutput({"a": 0, "b": 1, "c": 2}, bitmask if packed else ~unpack_bitmask(bitmask, vocab))

    for request_ids in (["a", "b", "c"], ["x", "c", "y", "a"]):
        logits = torch.randn(len(request_ids), vocab, generator=gen).to(DEVICE)
        unpacked, packed = logits.clone(), logits.clone()
        apply_grammar_bitmask(unpacked, step(False), request_ids)
        apply_grammar_bitmask(packed, step(True), request_ids)
        assert torch.equal(unpacked, packed)
        assert torch.isinf(packed).any() and not torch.isinf(packed[[i for i, r in enumerate(request_ids) if r in "xy"]]).any()
