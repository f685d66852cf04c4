"""The CPU backend, the CPU's default: the reference backend with a faster decode and shorter ops.

Prefill rows, the KV write and the masks are the reference's. Decode rows gather their keys
head-major (GatherGroupMetadata.decode_head_rows) and attend in one gather and two batched
matmuls per layer (attention/cpu_decode.py). Around attention, RMSNorm and rotary run as shorter
chains of eager ops (norm._rms_norm_cpu, RotaryEmbedding.rotate); the projections' int4 and
oneDNN-packed weights are chosen by layers/linear.py itself from the weights a model holds, on
any backend. tests/unit/test_cpu_fast_path.py compares each piece with the reference.
"""

from __future__ import annotations

import numpy as np

from deepinfer.layers.attention.backends.reference import GatherGroupMetadata, ReferenceBackend
from deepinfer.layers.attention.cpu_decode import cpu_decode_attention


class CpuBackend(ReferenceBackend):
    name = "cpu"
    short_cpu_norm = True
    short_cpu_rotary = True
    flat_cpu_layers = True

    @classmethod
    def check_supported(cls, platform, kv_cache_dtype) -> None:
        if platform.device.type != "cpu":
            raise ValueError(f"attention_backend={cls.name!r} is the CPU fast path; this platform is "
                             f"{platform.name} (use 'reference', 'triton' or 'auto')")

    def _set_decode_rows(self, meta: GatherGroupMetadata, gather: np.ndarray, group, step) -> None:
        heads = group.spec.num_kv_heads
        meta.decode_head_rows = step.to_device((gather[:, None, :] * heads
                                                + np.arange(heads, dtype=np.int64)[None, :, None]).reshape(-1))

    def _attend_decodes(self, layer, group, q, k_cache, v_cache):
        return cpu_decode_attention(q, k_cache, v_cache, group.decode_head_rows, group.decode_bias, layer.scale)
