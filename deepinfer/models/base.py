"""What every model shares: the interface the runner calls, and fused-weight loading.

A model is built from an HF config dict and exposes:
  forward(input_ids, positions) -> hidden states [tokens, hidden]
  compute_logits(hidden)        -> logits [rows, vocab] in float32
  kv_cache_specs(dtype)         -> one KV spec per attention layer (or per KV tensor of a layer)
  load_weights(iterable of (HF name, tensor))
Projections that read the same input are fused at load time (q/k/v into qkv_proj, gate/up into
gate_up_proj): one matmul instead of three or two, the cheapest speed-up there is on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from deepinfer.distributed import current_tp_group
from deepinfer.kv_cache.specs import KVCacheSpec
from deepinfer.layers.linear import (
    HEAD_INT4_MAX_ROWS,
    FusedLinear,
    Int4Blocks,
    Int8Blocks,
    Linear,
    dense_matmul,
    int4_available,
    int4_matmul,
    one_row_gemv,
    onednn_packing_available,
    pack_dense,
    pack_int4,
)
from deepinfer.layers.parallel import gather_logits

# (fused parameter name, HF name, shard index)
FUSED_PROJECTIONS = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class CausalLM(nn.Module):
    # HF names the checkpoint may hold that carry nothing we need.
    ignored_weight_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        # The tensor-parallel group the layers are built over (size 1 outside a distributed run).
        self.tp = current_tp_group()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [rows, hidden] of every input row or, given `logits_rows` (row
        indices), of those rows only, in that order. Past the last layer's attention the other
        rows feed nothing (their K/V is written by then), so the last MLP runs on these rows
        alone: in a 16k-token prefill step that is 1/32 of Llama-3-8B's MLP work saved."""
        raise NotImplementedError

    def kv_cache_specs(self, dtype: torch.dtype) -> list[KVCacheSpec]:
        raise NotImplementedError

    @classmethod
    def block_size_multiple(cls, hf_config: dict[str, Any]) -> int:
        """What the KV block size must be a multiple of (DeepSeek-V4: its compress rates)."""
        return 1

    def own_attention_backend(self, device: torch.device, kv_cache_dtype: torch.dtype, engine_backend=None):
        """A model that addresses its KV cache itself returns the backend that builds its steps'
        metadata (DeepSeek-V4), told the engine's own choice (`engine_backend`: whether it runs
        model kernels); None: the engine's `attention_backend` choice."""
        return None

    # The head's weight in 4-bit form, (packed, scales_and_zeros) of Int8Blocks.as_int4_pair,
    # when the checkpoint stores it as Q8_0 and the CPU int4 kernel exists; else None.
    head_int4: tuple[torch.Tensor, torch.Tensor] | None = None
    # The head's dense weight packed in oneDNN's layout (layers/linear.py, pack_dense), or None.
    head_packed: torch.Tensor | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [rows, vocab]; under tensor parallelism each rank computes its slice of
        the vocabulary and every rank gets all of them."""
        return gather_logits(self.tp, self._local_logits(hidden), self.hf_config["vocab_size"])

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype == torch.bfloat16 and hidden.dim() == 2:
            if self.head_int4 is not None and hidden.shape[0] <= HEAD_INT4_MAX_ROWS:
                # The 8-bit head as two 4-bit halves: [x, x] @ [w_hi, w_lo].T (layers/linear.py).
                return int4_matmul(torch.cat((hidden, hidden), dim=-1), *self.head_int4).float()
            if self.head_packed is not None:
                return dense_matmul(hidden, self.head_packed, None).float()
        if one_row_gemv(hidden):   # as Linear.matmul
            from deepinfer.layers.fused.gemv import gemv  # imports triton: CUDA fast path only
            return gemv(hidden.reshape(1, -1), self.head_weight()).float().view(*hidden.shape[:-1], -1)
        return torch.nn.functional.linear(hidden, self.head_weight()).float()

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def pack_weights(self) -> None:
        """CPU, bf16: keep oneDNN-packed copies of the dense projection and head weights, used
        above the int4 crossover (layers/linear.py, pack_dense). Call after load_weights. The
        copies double the dense weights' memory; the plain weights stay the reference."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_weight()
        if onednn_packing_available(self.head_weight()):
            self.head_packed = pack_dense(self.head_weight())

    @classmethod
    def build(cls, hf_config: dict[str, Any], quantization: str = "auto", dummy: bool = False) -> CausalLM:
        """The model for the runner to fill (weights loaded, or random when `dummy`), built in the
        default device and dtype. A model whose checkpoints keep quantized formats may build those
        layers in them directly, so their wider copies never exist (DeepSeek-V4)."""
        return cls(hf_config)

    def random_weights(self, seed: int) -> None:
        """load_format="dummy": the runner's call once the model is built without weights. Most
        models keep their layers' init (nn.Linear's); one whose layers start degenerate (zero
        codes, zero routing tables: DeepSeek-V4) draws realistic random weights here."""

    def reserve_request_state(self, max_requests: int, rows_per_request: int, graphs: bool = False) -> None:
        """Allocate what the model keeps per request on the device beside its KV pages, for up to
        max_requests requests of up to rows_per_request tokens a step (the runner calls it before
        sizing the KV pool; `graphs`: the runner replays decode steps as CUDA graphs). Most models
        keep nothing there; DeepSeek-V4 its compressors' rings."""

    def quantize_fp8(self) -> None:
        """quantization="fp8": every projection's loaded weight becomes FP8 codes with one scale
        per output channel (layers/quantization/fp8.py); the embeddings and the head, which are
        not `Linear`s, keep the model's dtype."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.to_fp8()

    def load_from(self, source, keep_int4: bool = False, quantization: str = "auto") -> None:
        """Fill the weights from a ModelSource (the runner's call); a model whose checkpoints
        need more than a stream of named tensors (DeepSeek-V4) reads its files itself, and keeps
        their quantized weights in their own format where `quantization` (ModelConfig's) says so."""
        self.load_weights(source.iter_weights(keep_int4=keep_int4))

    def streamed_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters load_weights fills (and checks are all there): every one, unless the
        model loads a part of itself another way (a vision model's tower, models/gemma3_mm.py)."""
        return dict(self.named_parameters())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self.streamed_parameters()
        loaded: set[str] = set()
        int4_parts: dict[str, dict[int, Int4Blocks]] = {}   # module name -> shard index -> blocks
        for name, tensor in weights:
            if name.endswith(self.ignored_weight_suffixes):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the head
            target, rows, shard_index = name, slice(None), 0
            for fused, part, index in FUSED_PROJECTIONS:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    module = self.get_submodule(target.rsplit(".", 1)[0])
                    rows, shard_index = module.shard(index), index
                    break
            # 4-bit copies are kept on one rank only: a rank's slice of a GGUF block matrix is
            # loaded dense (the runner asks for none under tensor parallelism).
            if isinstance(tensor, Int8Blocks):
                is_head = name == ("model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight")
                if is_head and self.tp.size == 1 and int4_available(params[target].device, 2 * tensor.shape[1]):
                    self.head_int4 = pack_int4(tensor.as_int4_pair())
                tensor = tensor.dequantize()
            if isinstance(tensor, Int4Blocks):
                if self.tp.size == 1:
                    int4_parts.setdefault(target.rsplit(".", 1)[0], {})[shard_index] = tensor
                tensor = tensor.dequantize()
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            if hasattr(owner, "rank_part"):   # a tensor-parallel layer keeps its rank's slice
                tensor = owner.rank_part(tensor, shard_index)
            param = params[target]
            dest = param.data[rows]
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(f"{name}")
        for module_name, parts in int4_parts.items():
            module = self.get_submodule(module_name)
            n_shards = len(getattr(module, "shard_sizes", [0]))
            if isinstance(module, Linear) and len(parts) == n_shards:  # every shard 4-bit, or none
                module.set_int4(Int4Blocks.concat([parts[i] for i in range(n_shards)]))
        expected = set()
        for pname in params:
            if isinstance(self.get_submodule(pname.rsplit(".", 1)[0]), FusedLinear):
                continue
            expected.add(pname)
        missing = sorted(expected - loaded)
        fused_missing = [f"{pname} ({part})" for pname in params
                         for fused, part, _ in FUSED_PROJECTIONS
                         if f".{fused}." in pname and pname.replace(f".{fused}.", f".{part}.") not in loaded]
        if missing or fused_missing:
            raise ValueError(f"checkpoint lacks tensors: {(missing + fused_missing)[:8]}"
                             + (" ..." if len(missing) + len(fused_missing) > 8 else ""))
