"""N-gram prompt lookup on the device: the drafts of `NgramDrafter.lookup`, batched, in torch ops.

Why it exists: a CUDA engine that chains verify steps wants to launch step t+1 before the host
has read step t's accepted tokens back. The drafts for step t+1 depend on those tokens, so they
have to be computed where the tokens are: on the device, queued on the same stream, with no
host synchronisation (no `.item()`, `.tolist()`, `.cpu()`, boolean indexing or `nonzero`, and no
Python control flow on tensor values). The same code runs on CPU tensors, which is how the tests
compare it with the host drafter.

Semantics (exactly those of `NgramDrafter(k, min_n, max_n).lookup(tokens, k).token_ids`): for n
from min(max_n, length - 1) down to min_n, the last n tokens are looked up among the windows that
start at 0 .. length-n-1 (so never the suffix itself, though a window may overlap it); the most
recent such window wins, the largest n with any hit wins, and the draft is the (up to k) tokens
that followed it, cut at the end of the valid history. No hit, k <= 0 or length < min_n + 1 give
an empty draft. The confidences of the host drafter are not computed here.

How: index windows by their last position e instead of their start (start = e - n + 1). Then the
window of size n ending at e matches the suffix iff history[e - i] == history[length - 1 - i] for
i in 0 .. n-1, so one running AND over i = 0 .. max_n-1 gives, summed, run[e]: the largest n <=
max_n whose window ending at e matches (O(B * L) memory, three elementwise kernels per i). A
window cannot start before 0, so run[e] is capped at e + 1 (this also discards whatever the
comparisons at e < i saw). A window lies inside tokens[:length - 1] iff e <= length - 2; with
run[e] <= e + 1 <= length - 1 that also keeps n <= length - 1. The winner is the largest n with
a hit, then its most recent window: the largest run[e] * L + e over the usable e (run >= min_n),
one max. The draft starts at e + 1, so every hit drafts at least one token.
"""

from __future__ import annotations

import torch


def ngram_drafts(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                 max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """N-gram drafts for every row of a batch, on the tensors' device, without a host sync.

    history: [B, L] int64 token ids; row b is valid in [:lengths[b]], the rest is arbitrary and
    never changes the result. lengths: [B] integer, 0 <= lengths[b] <= L.

    Returns (drafts [B, max(k, 0)] int64, num_drafts [B] int64): row b's first num_drafts[b]
    entries equal `NgramDrafter(k, min_n, max_n).lookup(history[b, :lengths[b]], k).token_ids`,
    the rest are 0.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    if history.dim() != 2 or lengths.shape != history.shape[:1]:
        raise ValueError(f"history must be [B, L] and lengths [B], got {tuple(history.shape)} "
                         f"and {tuple(lengths.shape)}")
    device = history.device
    batch, width = history.shape
    k = max(k, 0)
    drafts = torch.zeros(batch, k, dtype=torch.int64, device=device)
    num_drafts = torch.zeros(batch, dtype=torch.int64, device=device)
    # A hit needs a window ending at e <= length - 2 <= width - 2 (static shapes only here).
    if k == 0 or width < min_n + 1:
        return drafts, num_drafts

    history = history.to(torch.int64)
    lengths = lengths.to(device=device, dtype=torch.int64)
    sizes = min(max_n, width - 1)              # larger n never hit: n <= length - 1 <= width - 1
    ends = torch.arange(width - 1, device=device)                      # e = 0 .. width-2
    # suffix[:, i] = tokens[length - 1 - i]; rows with length <= i read a clamped position, moot:
    # they have no window ending at e <= length - 2 of any size above i.
    back = (lengths.unsqueeze(1) - 1 - torch.arange(sizes, device=device)).clamp(min=0)
    suffix = history.gather(1, back)                                   # [B, sizes]
    match = torch.ones(batch, width - 1, dtype=torch.bool, device=device)
    run = torch.zeros(batch, width - 1, dtype=torch.int32, device=device)
    for i in range(sizes):
        # history[e - i] == tokens[length - 1 - i] for e >= i; match[:, e < i] is left as it was
        # and the cap below undoes what it adds to run.
        match[:, i:] &= history[:, :width - 1 - i] == suffix[:, i:i + 1]
        run += match
    run = torch.minimum(run.to(torch.int64), ends + 1)                 # windows start at 0 or later
    usable = (run >= min_n) & (ends <= (lengths - 2).unsqueeze(1))     # inside tokens[:length-1]
    key = torch.where(usable, run * width + ends, -1).amax(dim=1)      # largest n, then latest e
    best_end = torch.where(key >= 0, key % width, -1)

    first = best_end + 1                                               # the draft follows the window
    available = torch.where(best_end >= 0, lengths - first, 0)         # >= 1 on a hit
    num_drafts = available.clamp(max=k)
    offsets = torch.arange(k, device=device)
    positions = (first.unsqueeze(1) + offsets).clamp(max=width - 1)
    drafts = torch.where(offsets < num_drafts.unsqueeze(1), history.gather(1, positions), 0)
    return drafts, num_drafts
