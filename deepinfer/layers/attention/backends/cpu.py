"""The CPU backend, the CPU's default: the reference backend with a faster decode and shorter ops.

Prefill rows, the KV write and the masks are the reference's. Decode rows gather their keys
head-major (GatherGroupMetadata.decode_head_rows), K and V in one gather where the two caches
are one allocation (the CPU's, KVLayout.allocate), and attend in two batched matmuls per layer
(attention/cpu_decode.py). Around attention, RMSNorm and rotary run as shorter
chains of eager ops (norm._rms_norm_cpu, RotaryEmbedding.rotate); the projections' int4 and
oneDNN-packed weights are chosen by layers/linear.py itself from the weights a model holds, on
any backend. tests/unit/test_cpu_fast_path.py compares each piece with the reference.
"""

from __future__ import annotations

import numpy as np

from deepinfer.layers.attention.backends.reference import GatherGroupMetadata, ReferenceBackend
from deepinfer.layers.attention.cpu_decode import cpu_decode_attention, kv_paired


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

    # (the step's list of KV tensors, {group id: whether all its layers' K/V are paired}); the list
    # is held so that its id stays its own while the answers are kept.
    _paired: tuple[list, dict[int, bool]] | None = None

    def _set_decode_rows(self, meta: GatherGroupMetadata, gather: np.ndarray, group, step) -> None:
        heads = group.spec.num_kv_heads
        rows = (gather[:, None, :] * heads + np.arange(heads, dtype=np.int64)[None, :, None]).reshape(-1)
        if self._kv_paired(step, group):
            slot = step.kv_caches[step.layer_to_slot[group.layer_ids[0]]][0]
            rows = np.concatenate([rows, rows + slot.shape[0] * heads])
            meta.decode_kv_paired = True
        meta.decode_head_rows = step.to_device(rows)

    def _kv_paired(self, step, group) -> bool:
        """Whether every layer of the group has its V cache right after its K cache (KVLayout.allocate
        on the CPU), worked out once per list of KV tensors."""
        if self._paired is None or self._paired[0] is not step.kv_caches:
            self._paired = (step.kv_caches, {})
        answers = self._paired[1]
        if group.group_id not in answers:
            answers[group.group_id] = all(kv_paired(*step.kv_caches[step.layer_to_slot[layer]])
                                          for layer in group.layer_ids)
        return answers[group.group_id]

    def _attend_decodes(self, layer, group, q, k_cache, v_cache):
        return cpu_decode_attention(q, k_cache, v_cache, group.decode_head_rows, group.decode_bias, layer.scale,
                                    group.decode_kv_paired)
