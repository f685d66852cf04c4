"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` parallel streams.

Streams X [B, L, N, hidden] (N = hc_mult). Around each block (attention, then MoE) one
HyperConnection reads all N streams, flattened to N*hidden and normed (no weight), and a single
linear `fn` [(2 + N) * N, N * hidden] gives per token:
  pre  [N]    = sigmoid(a * scale[0] + base_pre) + eps         how the streams sum into the block input
  post [N]    = 2 * sigmoid(b * scale[1] + base_post)           how the block output is spread back
  comb [N, N] = Sinkhorn(softmax_rows(c * scale[2] + base_comb) + eps)
Sinkhorn alternates column / row normalisation (hc_sinkhorn_iters passes in all, columns
first and last) so comb is (nearly) doubly stochastic: mixing streams neither grows nor
shrinks them. Then
  block_in = sum_j pre_j X_j
  X'_k     = post_k * block(block_in) + sum_j comb[j, k] X_j
HyperHead collapses the streams once more before the final norm (pre weights only).
Everything here runs in float32. Where the forward's backend turns on fused_v4_ops (V4's Triton
path), each side of a block is Triton kernels (triton_hyper.py) with these ops as their reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.attention.metadata import current_backend
from deepinfer.models.deepseek_v4.norm import unit_rms


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns, then (rows, columns) iters - 1 times, of m [..., N, N]."""
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    def __init__(self, hidden: int, streams: int, iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.streams, self.iters, self.eps, self.norm_eps = streams, iters, eps, norm_eps
        width = (2 + streams) * streams
        self.fn = nn.Parameter(torch.zeros(width, streams * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, N, hidden] -> (block input [B, L, hidden], post [B, L, N], comb [B, L, N, N])."""
        if current_backend().fused_v4_ops:
            from deepinfer.models.deepseek_v4.triton_hyper import hc_pre
            return hc_pre(x, self.fn, self.base, self.scale, self.eps, self.norm_eps, self.iters)
        n = self.streams
        mixes = F.linear(unit_rms(x.flatten(2).float(), self.norm_eps), self.fn.float())
        a, b, c = mixes.split([n, n, n * n], dim=-1)
        base_a, base_b, base_c = self.base.split([n, n, n * n])
        pre = torch.sigmoid(a * self.scale[0] + base_a) + self.eps
        post = 2 * torch.sigmoid(b * self.scale[1] + base_b)
        comb = torch.softmax(c.unflatten(-1, (n, n)) * self.scale[2] + base_c.view(n, n), dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        block_in = (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)
        return block_in, post, comb

    @staticmethod
    def merge(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams from the old x [B, L, N, hidden] and the block output out [B, L, hidden]."""
        if current_backend().fused_v4_ops:
            from deepinfer.models.deepseek_v4.triton_hyper import hc_merge
            return hc_merge(x, out, post, comb)
        dtype = x.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)


class HyperHead(nn.Module):
    """The final collapse of the N streams (named hc_head.hc_fn / hc_base / hc_scale)."""

    def __init__(self, hidden: int, streams: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(streams, streams * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(streams, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if current_backend().fused_v4_ops:
            from deepinfer.models.deepseek_v4.triton_hyper import hc_head
            return hc_head(x, self.hc_fn, self.hc_base, self.hc_scale, self.eps, self.norm_eps)
        mixes = F.linear(unit_rms(x.flatten(2).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)
