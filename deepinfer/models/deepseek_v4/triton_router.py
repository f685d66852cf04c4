"""moe.Router's scoring and top-k after its projection, in one Triton kernel (V4's Triton path).

In PyTorch the router is a softplus, a square root, the top-k of the scores plus their bias, a
gather, a sum, a division and the scaling: eight kernels a MoE layer for a [tokens, experts]
matrix that fits in one program's registers a token. Here one program a token computes the
scores (sqrtsoftplus, sigmoid or softmax of the logits), picks the k best of scores + bias by k
passes of an argmax (or, hash-routed, takes the token's table row), and writes the picked ids and
their scores normalised to sum 1 times the scaling. Scores are computed in float32 and rounded to
the logits' dtype where the reference's are (so picks match it but for ties), weights likewise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _log1p(u):
    """log(1 + u) to float32's precision for small u too (Triton has no log1p): w = 1 + u rounds
    u, and log(w) * u / (w - 1) corrects for that rounding; where w rounds to 1 the answer is u."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, ids_ptr, weights_ptr, experts, scaling,
                  stride_logits, FUNC: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  HASHED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    ok = e < experts
    logits = tl.load(logits_ptr + t * stride_logits + e, mask=ok, other=0.0).to(tl.float32)
    if FUNC == 0:   # softplus as torch's: x above 20 stays x
        scores = tl.sqrt(tl.where(logits > 20.0, logits, _log1p(tl.exp(logits))))
    elif FUNC == 1:
        scores = tl.sigmoid(logits)
    else:
        shifted = tl.exp(tl.where(ok, logits, float("-inf")) - tl.max(tl.where(ok, logits, float("-inf")), axis=0))
        scores = shifted / tl.sum(shifted, axis=0)
    kind = weights_ptr.dtype.element_ty
    scores = tl.where(ok, scores.to(kind).to(tl.float32), 0.0)
    k = tl.arange(0, K_PAD)
    if HASHED:
        token = tl.load(token_ids_ptr + t)
        ids = tl.load(table_ptr + token * K + k, mask=k < K, other=-1)
    else:
        pick = tl.where(ok, scores + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
        ids = tl.full((K_PAD,), -1, tl.int64)
        for j in tl.static_range(K):
            best = tl.argmax(pick, axis=0)
            ids = tl.where(k == j, best.to(tl.int64), ids)
            pick = tl.where(e == best, float("-inf"), pick)
    w = tl.sum(tl.where(e[None, :] == ids[:, None], scores[None, :], 0.0), axis=1)
    w = (w / (tl.sum(w, axis=0) + 1e-20)).to(kind).to(tl.float32) * scaling
    tl.store(ids_ptr + t * K + k, ids, mask=k < K)
    tl.store(weights_ptr + t * K + k, w.to(kind), mask=k < K)


def route(logits: torch.Tensor, func: str, top_k: int, scaling: float, bias: torch.Tensor | None = None,
          table: torch.Tensor | None = None, token_ids: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router.forward after F.linear: logits [T, E] -> (ids [T, k] int64, weights [T, k] in the
    logits' dtype); hash-routed with table [vocab, k] and token_ids [T], else top-k by bias."""
    if func not in FUNCS:
        raise ValueError(f"scoring_func {func!r} is not supported")
    tokens, experts = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    hashed = table is not None
    if tokens:
        _route_kernel[(tokens,)](logits, bias if bias is not None else logits, table if hashed else ids,
                                 token_ids.reshape(-1) if hashed else ids, ids, weights, experts, scaling,
                                 logits.stride(0), FUNC=FUNCS[func], K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                 E_PAD=triton.next_power_of_2(experts), HASHED=hashed)
    return ids, weights
