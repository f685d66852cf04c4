"""The formats DeepSeek-V4's checkpoints keep their weights in, and the layers held in them.

A released checkpoint (config.json: `quantization_config` with fmt e4m3, `expert_dtype` "fp4";
weights.py) stores the projections below in FP8 with 128 x 128 block scales and the routed
experts in FP4 with a power-of-two scale per 32 inputs; the compressors' and the indexer's
kv / gate / weights projections, the router, norms, embeddings and head stay BF16 (or float32).
Where the device multiplies those formats (layers/quantization/), the model holds these layers in
them: built that way layer by layer (`prepare_layer`, so a layer's BF16 copy exists only while it
is built, never the whole model's), filled by the loader (loading.py) or, for random weights,
left at zero codes. `quantization="fp8"` asks for the same formats from any V4 model (`to_native`
from loaded BF16 weights: quantize_fp8).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.layers.quantization.fp8 import block_product_available
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.indexer import Indexer
from deepinfer.models.deepseek_v4.moe import RoutedExperts, fp4_grouped_supported

FP8_BLOCK = (128, 128)   # the FP8 weights' scale blocks
FP4_GROUP = 32           # the FP4 experts' inputs per scale


def checkpoint_formats(hf_config: dict[str, Any]) -> tuple[bool, bool]:
    """(FP8 projections, FP4 experts): what a checkpoint of this config.json stores."""
    quant = hf_config.get("quantization_config") or {}
    fp8 = quant.get("quant_method") == "fp8" or quant.get("fmt") == "e4m3"
    return fp8, fp8 and hf_config.get("expert_dtype") == "fp4"


def kept_formats(quantization: str, device: torch.device) -> tuple[bool, bool]:
    """(FP8 blocks, FP4 experts): whether a checkpoint's quantized layers are held as stored, not
    dequantized: always with quantization "fp8", with "auto" where the device multiplies them
    (fp8.block_product_available; the FP4 experts' kernel, moe.fp4_grouped_supported)."""
    if quantization == "fp8":
        return True, True
    if quantization != "auto":
        return False, False
    return (block_product_available(device),
            fp4_grouped_supported(torch.empty(0, device=device, dtype=torch.bfloat16)))


def fp8_block_of(hf_config: dict[str, Any]) -> tuple[int, int]:
    """The FP8 weights' scale block: config.json's weight_block_size, else the release's."""
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else FP8_BLOCK


def _whole(module: nn.Module) -> bool:
    """Not split over tensor-parallel ranks (a rank's slice may cut through a block or a group)."""
    group = getattr(module, "group", None)
    return group is None or group.size == 1 or getattr(module, "expert_parallel", False)


def fp8_linears(module: nn.Module, whole_only: bool) -> Iterator[Linear]:
    """The Linear layers under `module` a checkpoint stores in FP8 (with whole_only, those not
    split over ranks: the ones a checkpoint's blocks load into as they are)."""
    bf16 = set()
    for m in module.modules():
        if isinstance(m, Compressor):
            bf16 |= {id(m.kv_proj), id(m.gate_proj)}
        if isinstance(m, Indexer):
            bf16.add(id(m.scorer.weights_proj))
    for m in module.modules():
        if isinstance(m, Linear) and id(m) not in bf16 and (_whole(m) or not whole_only):
            yield m


def routed_experts(module: nn.Module, whole_only: bool = True) -> Iterator[RoutedExperts]:
    for m in module.modules():
        if isinstance(m, RoutedExperts) and (_whole(m) or not whole_only):
            yield m


def prepare_layer(layer: nn.Module, fp8: tuple[int, int] | None, fp4: bool) -> None:
    """Make room in the checkpoint's formats (zero codes) for what a loader will fill: right
    after the layer is built, before the next one is. fp8: the FP8 scale block (None: no FP8).
    FP4 experts take the release's group of 32 where their inputs hold whole groups (the loader
    regroups them as the checkpoint's scales say, loading.keep_fp4_experts)."""
    if fp8 is not None:
        for linear in fp8_linears(layer, whole_only=True):
            linear.as_fp8_blocks(fp8)
    if fp4:
        for experts in routed_experts(layer):
            if experts.down_proj.shape[-1] % FP4_GROUP == 0 and experts.gate_up_proj.shape[-1] % FP4_GROUP == 0:
                experts.as_fp4(FP4_GROUP)


@torch.no_grad()
def to_native(model: nn.Module) -> None:
    """The loaded weights into the checkpoint's formats (quantization="fp8"): FP8 blocks for the
    projections (per rank where split: this rank's own blocks), FP4 for the whole experts;
    layers already in them stay."""
    for linear in fp8_linears(model, whole_only=False):
        linear.to_fp8_blocks(FP8_BLOCK)
    for experts in routed_experts(model):
        experts.to_fp4(FP4_GROUP)


def held_nbytes(model: nn.Module) -> int:
    """The device bytes of the model's weights as held: parameters, buffers (the FP4 experts'
    exponents, the hash routers' tables, rope frequencies) and the FP8 layers' float32 scales
    (attributes, not buffers)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for m in model.modules():
        if isinstance(m, Linear) and m.weight_scale is not None:
            tensors[id(m.weight_scale)] = m.weight_scale
    return sum(t.numel() * t.element_size() for t in tensors.values())


def checkpoint_nbytes(model: nn.Module) -> int:
    """The bytes a released checkpoint stores the model's weights in (the module docstring's
    formats), whatever format the model holds them in: for the FP8 projections (fp8_linears) a
    code byte per weight and a ue8m0 byte per scale block (the held block, else the release's
    128 x 128); for the routed experts half a byte per weight and a ue8m0 byte per group of
    inputs (the held group, else the release's 32); the other parameters and persistent buffers
    at the bytes they are held in. Beside held_nbytes it says how far the model's memory is from
    its checkpoint's."""
    counted: set[int] = set()
    total = 0
    for linear in fp8_linears(model, whole_only=False):
        out, inner = linear.weight.shape
        block = linear.weight_block or FP8_BLOCK
        total += out * inner + -(-out // block[0]) * -(-inner // block[1])
        counted.add(id(linear.weight))
    for experts in routed_experts(model, whole_only=False):
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            weights = weight.numel() * (2 if experts.fp4_group else 1)
            total += weights // 2 + weights // (experts.fp4_group or FP4_GROUP)
            counted.add(id(weight))
    for tensor in model.state_dict(keep_vars=True).values():   # parameters, persistent buffers
        if id(tensor) not in counted:
            total += tensor.numel() * tensor.element_size()
            counted.add(id(tensor))
    return total
