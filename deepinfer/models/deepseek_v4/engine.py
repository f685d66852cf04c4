"""DeepseekV4ForCausalLM as the engine runs it: the reference layers (model.py's V4Model) over
the engine's flat batch of tokens, attention per request chunk on the paged KV (paged.py).

The per-token parts (embedding, mHC, norms, MoE, head) run on every token of the step at once,
as [1, tokens, ...]; only attention splits the step by request. Its KV kinds per main layer
are a sliding window (every layer), compressed rows (CSA and HCA layers) and indexer keys (CSA
layers), listed by `kv_cache_specs` in that order; `LayerKV` says where each layer's are.

Checkpoints load through weights.py (transformers' layout or DeepSeek's, FP8 / FP4 dequantized).
The MTP layer drafts for speculative decoding (mtp_drafter.py). Attention runs the Triton kernels
(paged_kernels.py) where the engine's backend is Triton, the reference (paged.py) elsewhere. Not yet
here: fp8 KV.

Tensor and expert parallelism (parallel.py says what is split): built inside the runner's
`building_with(group)`, each layer takes its rank's part, and weights.py cuts it out of the
whole checkpoint tensors. The KV kinds stay the same on every rank (the K=V head, compressed
rows and indexer keys are replicated), so every rank's pools hold the same block ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deepinfer.kv_cache.specs import CompressedSpec, KVCacheSpec, SlidingWindowSpec
from deepinfer.layers.attention.backends.base import AttentionBackend
from deepinfer.layers.attention.metadata import get_forward_context
from deepinfer.layers.linear import onednn_packing_available, pack_dense
from deepinfer.layers.parallel import ParallelLMHead, gather_logits
from deepinfer.models.base import CausalLM
from deepinfer.models.deepseek_v4.config import CSA, SLIDING, V4Config
from deepinfer.models.deepseek_v4.dummy_weights import randomize
from deepinfer.models.deepseek_v4.formats import (
    checkpoint_formats,
    fp8_block_of,
    kept_formats,
    prepare_layer,
    to_native,
)
from deepinfer.models.deepseek_v4.model import V4Model
from deepinfer.models.deepseek_v4.moe import RoutedExperts, fp4_grouped_supported, grouped_mm_supported
from deepinfer.models.deepseek_v4.mtp import V4MTPLayer
from deepinfer.models.deepseek_v4.mtp_drafter import keep_streams
from deepinfer.models.deepseek_v4.mtp_drafter import propose as propose_mtp_drafts
from deepinfer.models.deepseek_v4.paged import LayerKV, V4StepBackend, attend_paged
from deepinfer.models.deepseek_v4.parallel import check_parallel_sizes
from deepinfer.models.deepseek_v4.rings import ProjectionRings
from deepinfer.types.drafter import Draft, DraftRequest

if TYPE_CHECKING:
    from deepinfer.config import ParallelConfig


def _layer_kv(cfg: V4Config) -> list[LayerKV]:
    n = cfg.num_layers
    compressed = [i for i, t in enumerate(cfg.layer_types) if t != SLIDING]
    sparse = [i for i, t in enumerate(cfg.layer_types) if t == CSA]
    return [LayerKV(window=i,
                    compressed=n + compressed.index(i) if i in compressed else None,
                    index=n + len(compressed) + sparse.index(i) if i in sparse else None) for i in range(n)]


def kv_cache_specs_for(cfg: V4Config, dtype: torch.dtype) -> list[KVCacheSpec]:
    """In _layer_kv's order: every layer's window, then the compressed layers' rows, then the
    CSA layers' index keys (a function of the config alone: benchmarks size the KV of shapes
    too large to build)."""
    specs: list[KVCacheSpec] = [SlidingWindowSpec(1, cfg.head_dim, dtype, shared_kv=True,
                                                  sliding_window=cfg.sliding_window)] * cfg.num_layers
    for t in cfg.layer_types:
        if t != SLIDING:
            rate = cfg.rate(t)
            specs.append(CompressedSpec(1, cfg.head_dim, dtype, shared_kv=True, rate=rate,
                                        tail_rows=2 * rate if t == CSA else 0))
    rate = cfg.rate(CSA)
    specs += [CompressedSpec(1, cfg.index_head_dim, dtype, shared_kv=True, rate=rate, tail_rows=2 * rate)
              for t in cfg.layer_types if t == CSA]
    return specs


class DeepseekV4ForCausalLM(CausalLM):
    def __init__(self, hf_config: dict[str, Any], fp8: bool = False, fp4: bool = False) -> None:
        """fp8 / fp4: build the layers a checkpoint keeps in FP8 / the routed experts in FP4 in
        those formats, layer by layer (formats.py; `build` decides)."""
        super().__init__(hf_config)
        self.cfg = V4Config.from_hf(hf_config)
        self.tie_word_embeddings = self.cfg.tie_word_embeddings
        block = fp8_block_of(hf_config) if fp8 else None
        prepare = (lambda layer: prepare_layer(layer, block, fp4)) if fp8 or fp4 else None
        self.model = V4Model(self.cfg, prepare)
        self.lm_head = ParallelLMHead(self.cfg.hidden_size, self.cfg.vocab_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The MTP layers: the drafter of speculative_config method "mtp" (mtp_drafter.py).
        self.mtp = nn.ModuleList()
        for t in self.cfg.mtp_layer_types:
            self.mtp.append(V4MTPLayer(self.cfg, t, self.model.rotaries))
            if prepare is not None:
                prepare(self.mtp[-1])
        self.layer_kv = _layer_kv(self.cfg)
        # Each request's recent compressor projections between steps (rings.py), allocated by
        # reserve_request_state once the runner knows how many requests it runs.
        compressors, kv_index = {}, {}
        for i, layer in enumerate(self.model.layers):
            if layer.self_attn.compressor is not None:
                compressors[(i, "compressor")] = layer.self_attn.compressor
                kv_index[(i, "compressor")] = self.layer_kv[i].compressed
                if self.layer_kv[i].index is not None:
                    compressors[(i, "indexer")] = layer.self_attn.compressor.indexer
                    kv_index[(i, "indexer")] = self.layer_kv[i].index
        self.rings = ProjectionRings(compressors, kv_index, streams_window=self.cfg.sliding_window if len(self.mtp) else 0,
                                     stream_shape=(self.cfg.hc_mult, self.cfg.hidden_size),
                                     mtp_row_width=self.cfg.head_dim)
        self.mtp_graphs = None   # the MTP drafter's CUDA graphs (mtp_ring.MTPDraftGraphs), where replayed
        for module in self.modules():   # routed experts as grouped GEMMs where torch has them
            if isinstance(module, RoutedExperts):
                module.grouped = True

    @classmethod
    def build(cls, hf_config: dict[str, Any], quantization: str = "auto", dummy: bool = False) -> DeepseekV4ForCausalLM:
        """Built in the formats the weights will be held in (load_from's choice, formats.py): a
        checkpoint's FP8 / FP4 formats where the device multiplies them ("auto") or always
        ("fp8"); random weights of a real shape with "fp8" in both."""
        fp8, fp4 = checkpoint_formats(hf_config)
        if dummy:   # random weights take V4's formats when asked for them
            fp8 = fp4 = quantization == "fp8"
        if not (fp8 or fp4):
            return cls(hf_config)
        keep_fp8, keep_fp4 = kept_formats(quantization, torch.get_default_device())
        return cls(hf_config, fp8=fp8 and keep_fp8, fp4=fp4 and keep_fp4)

    @classmethod
    def check_parallel(cls, hf_config: dict[str, Any], parallel: ParallelConfig) -> None:
        """A ValueError naming the config field tensor_parallel_size does not divide, before any
        rank starts (the layers check again as they are built)."""
        check_parallel_sizes(V4Config.from_hf(hf_config), parallel.tensor_parallel_size,
                             parallel.enable_expert_parallel)

    @classmethod
    def block_size_multiple(cls, hf_config: dict[str, Any]) -> int:
        cfg = V4Config.from_hf(hf_config)
        return math.lcm(*[cfg.rate(t) for t in set(cfg.layer_types) if t != SLIDING] or [1])

    def kv_cache_specs(self, dtype: torch.dtype) -> list[KVCacheSpec]:
        return kv_cache_specs_for(self.cfg, dtype)

    def own_attention_backend(self, device: torch.device, kv_cache_dtype: torch.dtype,
                              engine_backend: AttentionBackend | None = None) -> V4StepBackend:
        """The Triton kernels (paged_kernels.py) where the engine's backend runs model kernels
        (attention_backend "triton", or "auto" on CUDA), with decode steps in CUDA graphs
        (decode_graphs.py) where the MoE is capturable, else the reference path (paged.py)."""
        if kv_cache_dtype != self.lm_head.weight.dtype:
            raise ValueError(f"kv_cache_dtype {str(kv_cache_dtype).removeprefix('torch.')}: DeepSeek-V4 keeps its "
                             "KV in the model's dtype for now (kv_cache_dtype='auto')")
        if engine_backend is not None and engine_backend.model_kernels:
            from deepinfer.models.deepseek_v4.paged_kernels import V4KernelStepBackend

            return V4KernelStepBackend(device, kv_cache_dtype, self.rings, decode_graphs=self._moe_capturable(device))
        return V4StepBackend(device, kv_cache_dtype, self.rings)

    def _moe_capturable(self, device: torch.device) -> bool:
        """Whether every MoE layer runs without waiting for the host (a CUDA graph can hold it):
        the grouped products (the reference loop asks which experts have tokens; float32 on CUDA
        has no grouped GEMM) and no expert-parallel dispatch (its counts cross the host)."""
        probe = torch.empty(0, device=device, dtype=self.lm_head.weight.dtype)
        for experts in self.modules():
            if isinstance(experts, RoutedExperts):
                fast = fp4_grouped_supported(probe) if experts.fp4_group is not None else grouped_mm_supported(probe)
                if experts.expert_parallel or not (experts.grouped and fast):
                    return False
        return True

    def reserve_request_state(self, max_requests: int, rows_per_request: int, graphs: bool = False) -> None:
        """The compressors' rings (rings.py) for max_requests requests writing up to
        rows_per_request positions a step; called before the KV pool is sized from what is left.
        graphs: the MTP drafter's proposals replay as CUDA graphs (mtp_ring.MTPDraftGraphs)."""
        self.rings.allocate(max_requests, rows_per_request, self.lm_head.weight.device, self.lm_head.weight.dtype)
        if graphs and len(self.mtp) and self.lm_head.weight.device.type == "cuda":
            from deepinfer.models.deepseek_v4.mtp_ring import MTPDraftGraphs

            self.mtp_graphs = MTPDraftGraphs(self)

    def pack_weights(self) -> None:
        """The head only (CPU, bf16), as before the attention's and the shared expert's projections
        became deepinfer Linear layers for tensor parallelism: oneDNN copies of those would double
        their memory for a speed-up not measured on V4 yet."""
        if onednn_packing_available(self.head_weight()):
            self.head_packed = pack_dense(self.head_weight())

    def random_weights(self, seed: int) -> None:
        """Random weights in the formats held, routing spread over every expert (dummy_weights.py)."""
        randomize(self, self.cfg.num_experts, seed)

    def quantize_fp8(self) -> None:
        """quantization="fp8": the weights take the formats V4's checkpoints ship them in
        (formats.py): FP8 128 x 128 blocks, FP4 experts. Layers built or loaded in them stay."""
        to_native(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        meta = get_forward_context()
        ids = input_ids[None]
        x = self.model.embed_tokens(ids)
        streams = x.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        attend_fn = attend_paged
        if meta.backend.kernels:   # Triton: one launch per layer over the step (paged_kernels.py)
            from deepinfer.models.deepseek_v4.paged_kernels import attend_paged_kernels as attend_fn
            meta.rope.clear()   # this forward's rope tables (step_metadata.rope_tables)
        for i, (layer, kv) in enumerate(zip(self.model.layers, self.layer_kv)):
            attend = lambda h, layer=layer, kv=kv, i=i: attend_fn(layer.self_attn, h[0], positions, meta, kv, i)[None]
            streams = layer.run(streams, attend, ids)
        if len(self.mtp):   # the MTP drafter reads the latest streams of each request
            keep_streams(meta, streams[0])
        if logits_rows is not None:
            streams = streams[:, logits_rows]
        return self.model.norm(self.model.hc_head(streams))[0]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over the whole vocabulary (the MTP drafter's; ranks' slices all-gathered)."""
        return gather_logits(self.tp, self.lm_head(hidden), self.cfg.vocab_size)

    @property
    def has_mtp(self) -> bool:
        return len(self.mtp) > 0

    def propose_mtp(self, requests: Sequence[DraftRequest], model_states: dict[str, dict]) -> dict[str, Draft]:
        """Drafts from the MTP layer (speculative_config method "mtp"; mtp_drafter.py)."""
        return propose_mtp_drafts(self, requests, model_states)

    def load_from(self, source, keep_int4: bool = False, quantization: str = "auto") -> None:
        """The checkpoint directory in either layout (weights.py, loading.py). Its FP8 block
        weights and FP4 routed experts stay in their own format with quantization "fp8", and with
        "auto" where the device has a product for them (block-scaled FP8: fp8.block_product_available;
        FP4 experts: the Triton kernel, moe.fp4_grouped_supported); otherwise they are
        dequantized. The MTP layers are dropped when it has none (transformers saves none)."""
        from deepinfer.models.deepseek_v4.loading import load_v4_weights
        from deepinfer.models.deepseek_v4.weights import V4Checkpoint

        if not any(entry.name.startswith("mtp.") for entry in V4Checkpoint(source.path).entries):
            self.mtp = nn.ModuleList()
            self.rings.streams_window = 0   # no MTP drafter: no streams to keep
        keep_fp8, keep_fp4 = kept_formats(quantization, self.lm_head.weight.device)
        load_v4_weights(self, source.path, keep_fp8=keep_fp8, keep_fp4=keep_fp4)
