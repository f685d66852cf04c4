"""A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors), read into the
shape deepinfer's layers multiply it in.

PEFT stores, per adapted projection, lora_A [r, in] and lora_B [out, r]; the projection's output
gains scaling * (x @ A.T) @ B.T, scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
deepinfer fuses q/k/v into qkv_proj and gate/up into gate_up_proj (models/base.FUSED_PROJECTIONS),
so an adapter's parts of one fused projection become one pair over its shards:

    A = [A_q; A_k; A_v]                [shards * r, in]      (a shard the adapter leaves out: zeros)
    B = block-diagonal(B_q, B_k, B_v)  [out, shards * r]     times scaling

whose product is exactly the per-shard sum (the off-diagonal blocks are zeros). What PEFT options
change the arithmetic beyond that (DoRA, LoRA biases, modules_to_save, per-module ranks or
alphas, fan_in_fan_out storage, adapters on the embeddings or the head) are refused by name, as
is a rank above max_lora_rank, so an adapter either runs as PEFT runs it or not at all.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors",)
# Projections a LoRA may adapt: PEFT's names, as the checkpoint spells them.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHT_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<half>lora_[AB])(?:\.[^.]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served as PEFT would run it; the message names the field."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # Our module name (e.g. model.layers.0.self_attn.qkv_proj) -> (A [shards * rank, in],
    # B [out, shards * rank] with the scaling folded in), float32 until placed.
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoRAAdapterError(f"LoRA adapter {path}: no {CONFIG_FILE} (a PEFT adapter directory has one)")
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise LoRAAdapterError(f"LoRA adapter {path}: {CONFIG_FILE} is not JSON ({e})") from e


def check_config(path: str, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config, or LoRAAdapterError naming what is not served."""
    where = f"LoRA adapter {path}: {CONFIG_FILE}"
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise LoRAAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"{where}: r={rank} is above max_lora_rank={max_rank}")
    refused = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "fan_in_fan_out": "fan_in_fan_out weights",
               "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks (rank_pattern)",
               "alpha_pattern": "per-module alphas (alpha_pattern)", "layers_to_transform": "layers_to_transform",
               "target_parameters": "target_parameters"}
    for key, what in refused.items():
        if config.get(key):
            raise LoRAAdapterError(f"{where}: {key} is set; {what} not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias={config['bias']!r}; only bias='none' is supported")
    targets = config.get("target_modules")
    if isinstance(targets, str):   # PEFT also takes a regular expression
        raise LoRAAdapterError(f"{where}: target_modules as a pattern ({targets!r}); list the module names")
    unknown = sorted(set(targets or []) - set(SUPPORTED_TARGETS))
    if not targets or unknown:
        raise LoRAAdapterError(f"{where}: target_modules {unknown or targets!r}: supported are "
                               f"{', '.join(SUPPORTED_TARGETS)}")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def load_adapter(name: str, path: str, max_rank: int, layout: dict[str, tuple[int, list[int]]]) -> LoRAAdapter:
    """The adapter at `path` for a model whose projections are `layout[module name] = (inputs,
    output widths of its shards)` (a fused qkv_proj: [q, k, v]; a plain projection: [out])."""
    from deepinfer.models.base import FUSED_PROJECTIONS

    fused_parts = {part: (fused, index) for fused, part, index in FUSED_PROJECTIONS}
    rank, scaling = check_config(path, read_config(path), max_rank)
    files = [os.path.join(path, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))]
    if not files:
        raise LoRAAdapterError(f"LoRA adapter {path}: no {' or '.join(WEIGHT_FILES)}")
    halves: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    with safe_open(files[0], "pt") as f:
        for key in f.keys():
            match = _WEIGHT_NAME.match(key)
            if match is None:
                raise LoRAAdapterError(f"LoRA adapter {path}: tensor {key!r} is not a lora_A / lora_B weight")
            module, half = match["module"], match["half"]
            leaf = module.rsplit(".", 1)[-1]
            fused, index = fused_parts.get(leaf, (leaf, 0))
            target = module[: -len(leaf)] + fused
            if leaf not in SUPPORTED_TARGETS or target not in layout:
                raise LoRAAdapterError(f"LoRA adapter {path}: tensor {key!r} adapts {module}, which this model "
                                       f"does not have as a projection LoRA may adapt")
            halves.setdefault((target, index), {})[half] = f.get_tensor(key).float()
    by_module: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (target, index), pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"LoRA adapter {path}: {target} has {sorted(pair)}, not both lora_A and lora_B")
        by_module.setdefault(target, {})[index] = (pair["lora_A"], pair["lora_B"])
    adapter = LoRAAdapter(name, path, rank, scaling)
    for target, shards in by_module.items():
        adapter.weights[target] = fuse(target, shards, *layout[target], rank, scaling, path)
    return adapter


def fuse(target: str, shards: dict[int, tuple[torch.Tensor, torch.Tensor]], inputs: int, widths: list[int],
         rank: int, scaling: float, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) pair over a projection's shards (the module docstring): A [len(widths) * rank,
    inputs], B [sum(widths), len(widths) * rank] block-diagonal, times scaling; a shard the adapter
    leaves out is zeros (its outputs are unchanged)."""
    count = len(widths)
    a_all = torch.zeros(count * rank, inputs)
    b_all = torch.zeros(sum(widths), count * rank)
    for index, (a, b) in shards.items():
        if index >= count:
            raise LoRAAdapterError(f"LoRA adapter {path}: {target} has no part {index}")
        if tuple(a.shape) != (rank, inputs) or tuple(b.shape) != (widths[index], rank):
            raise LoRAAdapterError(f"LoRA adapter {path}: {target} part {index}: lora_A {tuple(a.shape)}, lora_B "
                                   f"{tuple(b.shape)}; the model needs [{rank}, {inputs}] and [{widths[index]}, {rank}]")
        first = sum(widths[:index])
        a_all[index * rank:(index + 1) * rank] = a
        b_all[first:first + widths[index], index * rank:(index + 1) * rank] = b * scaling
    return a_all, b_all


def projection_layout(model: torch.nn.Module) -> dict[str, tuple[int, list[int]]]:
    """The projections of `model` a LoRA may adapt: name -> (inputs, its shards' output widths),
    whole as the checkpoint (and so an adapter) has them, also where a tensor-parallel rank holds
    a slice (lora/slots.py cuts the rank's part of each adapter)."""
    from deepinfer.layers.linear import Linear
    from deepinfer.layers.parallel import ColumnParallelLinear, RowParallelLinear
    from deepinfer.models.base import FUSED_PROJECTIONS

    leaves = {fused for fused, _, _ in FUSED_PROJECTIONS} | set(SUPPORTED_TARGETS)
    layout = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in leaves:
            if isinstance(module, ColumnParallelLinear):
                layout[name] = (module.in_features, list(module.full_sizes))
            elif isinstance(module, RowParallelLinear):
                layout[name] = (module.in_features * module.group.size, [module.out_features])
            else:
                layout[name] = (module.in_features, list(getattr(module, "shard_sizes", [module.out_features])))
    return layout
