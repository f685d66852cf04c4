"""One step's token bitmask: filled on the CPU beside the forward, applied to the logits after it.

The engine core asks the manager for a `BitmaskFill` right after scheduling; a worker thread
fills one int32 row per constrained request (bit t of a row set = token t allowed) while the
runner builds inputs and runs the model. Before queuing the step's sampling the core waits for
the fill (usually long done) and hands its result, a GrammarOutput (types/plan.py), to the
runner, whose `apply_grammar_bitmask` sets every disallowed logit to -inf before the sampler
sees them. Unconstrained rows are untouched.

Thread safety: the fill reads the matchers; the scheduler advances them only in `update`, after
the core waited for the fill of that step, and the next fill starts after that update, so the
two never overlap (plain and overlapped loop alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from deepinfer.platforms.transfer import to_device
from deepinfer.types.plan import GrammarOutput, GrammarRowKey


class BitmaskFill:
    """A fill under way in the manager's worker; lives in the engine core, never in a plan."""

    def __init__(self, rows: dict[GrammarRowKey, int], bitmask: torch.Tensor, blocked: Future) -> None:
        self.rows = rows            # request id (or (request id, j)) -> its row in `bitmask`
        self.bitmask = bitmask      # int32 [len(rows), ceil(grammar vocab / 32)], on the CPU
        # Future of what `apply_grammar_bitmask` reads: on a GPU the packed rows themselves; on the
        # CPU a float32 [len(rows), vocab] bias (0 allowed, -inf not) that the worker expands
        # beside the forward, so only one add is left on the engine loop. (A bool mask, True =
        # not allowed, is also taken: the reference path.)
        self._blocked = blocked

    def result(self) -> GrammarOutput:
        """Wait for the fill; re-raises a failed one."""
        return GrammarOutput(self.rows, self._blocked.result())


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarOutput, keys: Sequence[GrammarRowKey]) -> None:
    """Mask logits in place; logits row i belongs to keys[i] (a request id, or (request id, j))."""
    logit_rows = [i for i, key in enumerate(keys) if key in grammar.rows]
    if not logit_rows:
        return
    filled = grammar.bitmask
    mask_rows = [grammar.rows[keys[i]] for i in logit_rows]
    in_order = logit_rows == list(range(logits.shape[0])) and mask_rows == list(range(filled.shape[0]))
    if filled.dtype == torch.int32 and logits.is_cuda:
        # Packed rows on a GPU: copy 32x fewer bytes, expand and fill in one kernel there.
        from deepinfer.sample.structured.bitmask_kernel import apply_packed_bitmask

        rows = None if in_order else to_device([logit_rows, mask_rows], logits.device, torch.int32)
        apply_packed_bitmask(logits, to_device(filled, logits.device), rows)
        return
    if filled.is_floating_point():   # the CPU's additive bias (bitmask_bias)
        bias = to_device(filled, logits.device)
        if in_order:
            logits.add_(bias)
            return
        index = to_device(logit_rows, logits.device, torch.long)
        logits[index] = logits[index] + bias[to_device(mask_rows, logits.device, torch.long)]
        return
    # The reference path: a bool mask (unpacked here from packed rows off the GPU).
    blocked = ~unpack_bitmask(filled, logits.shape[-1]) if filled.dtype == torch.int32 else filled
    blocked = to_device(blocked, logits.device)
    if in_order:
        logits.masked_fill_(blocked, float("-inf"))   # every row constrained, same order
        return
    index = to_device(logit_rows, logits.device, torch.long)
    logits[index] = logits[index].masked_fill(blocked[to_device(mask_rows, logits.device, torch.long)], float("-inf"))


# _BYTE_BITS[b, j] is bit j of byte b: unpacking a byte is one table lookup.
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] -> bool [rows, vocab_size]; token t is bit t % 32 of word t // 32.

    The int32 words are read as little-endian bytes (byte k of word w holds tokens 32w + 8k ...),
    which is how xgrammar lays them out on every platform torch runs on.
    A model whose logits are wider than the grammar's vocabulary (padded embedding rows) gets
    False for the extra ids: no tokenizer string, never allowed.
    """
    rows = bitmask.shape[0]
    table = _BYTE_BITS.to(bitmask.device)   # the reference path: on the host in the engine
    bits = table[bitmask.contiguous().view(torch.uint8).long()].view(rows, -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.cat([bits, bits.new_zeros(rows, vocab_size - bits.shape[1])], dim=1)


# _BIAS_TABLE[v, j] = 0.0 if bit j of the 16-bit value v is set (token allowed), else -inf.
_BIAS_TABLE: torch.Tensor | None = None


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] -> float32 [rows, vocab_size]: 0.0 where a token is allowed, -inf where
    not; columns past the bitmask's last word are -inf. Same bit order as unpack_bitmask.

    Why a bias: on the CPU, adding it to the logits on the engine loop is far cheaper than a
    masked_fill from a bool mask, and building it is one gather of 16 values per 16-bit half-word
    through a 4 MiB table, in the worker, cheaper than the byte-table unpack. Figures:
    docs/benchmarks/design-measurements.md#grammar-bitmask-bias
    """
    global _BIAS_TABLE
    if _BIAS_TABLE is None:   # built once; a concurrent first use just builds it twice
        values = torch.arange(65536, dtype=torch.int32)
        allowed = ((values[:, None] >> torch.arange(16, dtype=torch.int32)) & 1).bool()
        _BIAS_TABLE = torch.zeros(65536, 16).masked_fill_(~allowed, float("-inf"))
    rows = bitmask.shape[0]
    halves = bitmask.contiguous().view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF).long()
    bias = _BIAS_TABLE.index_select(0, halves.view(-1)).view(rows, -1)
    if bias.shape[1] >= vocab_size:
        return bias[:, :vocab_size]
    return torch.cat([bias, bias.new_full((rows, vocab_size - bias.shape[1]), float("-inf"))], dim=1)
