"""The LoRA products of a batch whose rows belong to different adapters.

The adapters resident on the device sit in slots of one stack per projection:
    A [slots, R, in], B [slots, out, R]      R = the projection's shards * max_lora_rank
slot 0 holds zeros (the base model: a row without an adapter gains exactly nothing), and a row's
slot says whose weights it takes. A row's output gains (x @ A[slot].T) @ B[slot].T (the scaling
is folded into B: adapter.py).

Three paths compute it:
  lora_reference   one pair of matmuls per slot present in the step (reads the slots on the
                   host): the plain path tests compare against, and the CPU's
  lora_gathered    each row's A and B gathered and multiplied by batched matmuls: no host sync,
                   so it fits CUDA graphs; its memory is rows * R * (in + out), so it is for
                   steps of a few rows only (slots.GATHERED_MAX_ROWS)
  lora_masked      every adapter slot's pair of matmuls over all rows, each kept on its own rows
                   by a mask: no host sync either (fits CUDA graphs), memory of one [rows, out]
                   temporary, at max_loras low-rank products of every row: the device's path for
                   larger steps (a prefill of thousands of rows would not fit the gathered copies)
"""

from __future__ import annotations

import torch


def lora_reference(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x [rows, in], slots [rows] (int) -> the rows' LoRA outputs [rows, out] in x's dtype."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype, device=x.device)
    for slot in torch.unique(slots).tolist():
        if slot == 0:
            continue
        rows = torch.nonzero(slots == slot).flatten()
        out[rows] = ((x[rows] @ a[slot].T.to(x.dtype)) @ b[slot].T.to(x.dtype))
    return out


def lora_gathered(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """lora_reference without a host sync: [rows, 1, in] @ [rows, in, R] @ [rows, R, out]."""
    shrunk = torch.bmm(x[:, None, :], a[slots].transpose(1, 2).to(x.dtype))
    return torch.bmm(shrunk, b[slots].transpose(1, 2).to(x.dtype))[:, 0, :]


def lora_masked(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """lora_reference without a host sync and without per-row copies of the weights: for each
    adapter slot, the rows' shrunk products zeroed outside its rows, then expanded and summed."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype, device=x.device)
    for slot in range(1, a.shape[0]):   # slot 0 is the base model: nothing to add
        mine = (slots == slot).to(x.dtype)[:, None]
        out.addmm_((x @ a[slot].T.to(x.dtype)) * mine, b[slot].T.to(x.dtype))
    return out
