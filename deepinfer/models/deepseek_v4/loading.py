"""Filling a V4 model from a checkpoint directory (weights.py reads it): every parameter and
persistent buffer in its own dtype, the names checked before any tensor is read, each tensor-parallel
rank's part cut out, and the checkpoint's quantized weights kept in their own format where asked:

    keep_fp8   the FP8 block weights of whole `Linear` layers stay FP8 (codes and block scales,
               layers/quantization/fp8.py) instead of being dequantized;
    keep_fp4   the routed experts stay FP4 (e2m1 codes and ue8m0 exponents,
               layers/quantization/fp4.py; RoutedExperts.as_fp4).
Layers split over tensor-parallel ranks are dequantized (a rank's slice may cut through a block
or a group); expert parallelism keeps whole experts, so their FP4 stays.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import torch
from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.layers.quantization import fp4
from deepinfer.layers.quantization.fp8 import FP8
from deepinfer.models.deepseek_v4.moe import RoutedExperts
from deepinfer.models.deepseek_v4.weights import (
    SHOWN_MISSING,
    CheckpointEntry,
    MissingTensorError,
    UnknownTensorError,
    V4Checkpoint,
    V4Tensor,
    scale_multipliers,
)
from deepinfer.models.errors import ModelLoadError

FP8_HEADER = "F8_E4M3"
FP4_HEADERS = {"I8", "U8", "F4"}


@torch.no_grad()
def load_v4_weights(model: nn.Module, path: str, fp8_block: tuple[int, int] | None = None,
                    keep_fp8: bool = False, keep_fp4: bool = False) -> str:
    """Fill every parameter and persistent buffer of `model` (a V4ForCausalLM) from the checkpoint
    at `path`, each in its own dtype and device; returns the layout found. Checks the names
    before reading any tensor: an unknown one raises UnknownTensorError, missing ones
    MissingTensorError. keep_fp8 / keep_fp4: the module docstring."""
    checkpoint = V4Checkpoint(path, fp8_block)
    kept = ((keep_fp8_linears(model, checkpoint) if keep_fp8 else frozenset())
            | (keep_fp4_experts(model, checkpoint) if keep_fp4 else frozenset()))
    targets = model.state_dict(keep_vars=True)
    checkpoint.entries = _rank_entries(model, checkpoint.entries, targets)
    _check_coverage(checkpoint.entries, targets)
    for piece in checkpoint.tensors(kept):
        if piece.scale is not None:
            _load_kept(model, piece, targets)
            continue
        piece = _rank_part(model, piece)
        slot = _slot(targets[piece.name], piece)
        _check_shape(piece, slot)
        if slot.dtype in (FP8, torch.uint8) and piece.tensor.is_floating_point():
            # Built in the checkpoint's formats (formats.py) from config.json, but this tensor
            # is stored wide: copying it would cast values into codes.
            raise ModelLoadError(f"{piece.name}: config.json says the checkpoint stores it quantized "
                                 f"({slot.dtype}), but it is {piece.tensor.dtype}")
        slot.copy_(piece.tensor)
    return checkpoint.layout


def _load_kept(model: nn.Module, piece: V4Tensor, targets: dict[str, torch.Tensor]) -> None:
    """A weight kept in its own format: its codes and its scale into the layer as stored."""
    owner = _owner(model, piece.name)
    if isinstance(owner, RoutedExperts):   # FP4 codes and ue8m0 exponents, this rank's experts
        param = piece.name.rpartition(".")[2]       # gate_up_proj or down_proj
        part = piece.half or param
        codes = replace(piece, tensor=owner.rank_part(piece.tensor.view(torch.uint8), part))
        exps = replace(piece, tensor=owner.rank_part(fp4.scale_exponents(piece.scale), part))
        pairs = [(codes, _slot(targets[piece.name], codes)),
                 (exps, _slot(getattr(owner, owner.exponents_name(param)), exps))]
    else:   # FP8 codes and block multipliers
        pairs = [(piece, owner.weight), (replace(piece, tensor=scale_multipliers(piece.scale)), owner.weight_scale)]
    for value, slot in pairs:
        _check_shape(value, slot)
        slot.copy_(value.tensor)


def _check_shape(piece: V4Tensor, slot: torch.Tensor) -> None:
    if tuple(slot.shape) != tuple(piece.tensor.shape):
        raise ModelLoadError(f"{piece.source!r} has shape {tuple(piece.tensor.shape)}, but {piece.name}"
                             f"{_where(piece.expert, piece.half)} is {tuple(slot.shape)}")


def keep_fp8_linears(model: nn.Module, checkpoint: V4Checkpoint) -> frozenset[str]:
    """Turn the `Linear` layers whose checkpoint weight is FP8 into FP8 block layers, so the
    loader copies codes and scales into them; returns those weights' source names."""
    kept = set()
    for entry in checkpoint.entries:
        if entry.scale is None or entry.dtype != FP8_HEADER or entry.expert is not None:
            continue
        owner = _owner(model, entry.name)
        split = getattr(getattr(owner, "group", None), "size", 1) > 1
        if isinstance(owner, Linear) and entry.name.endswith(".weight") and not split:
            if not owner.is_fp8:
                owner.as_fp8_blocks(checkpoint.fp8_block)
            kept.add(entry.source)
    return frozenset(kept)


def keep_fp4_experts(model: nn.Module, checkpoint: V4Checkpoint) -> frozenset[str]:
    """Turn the routed experts whose checkpoint weights are FP4 into FP4 experts (the group size
    read off the first scale's shape), so the loader copies codes and exponents into them;
    returns those weights' source names. Experts whose rows are split over tensor-parallel ranks
    stay dense."""
    fp4_entries = [e for e in checkpoint.entries if e.scale is not None and e.dtype in FP4_HEADERS]
    if not fp4_entries:
        return frozenset()
    group = checkpoint.group_size(fp4_entries[0])
    kept, converted = set(), set()
    for entry in fp4_entries:
        owner = _owner(model, entry.name)
        if not isinstance(owner, RoutedExperts) or (owner.group.size > 1 and not owner.expert_parallel):
            continue
        if id(owner) not in converted:
            owner.as_fp4(group)
            converted.add(id(owner))
        kept.add(entry.source)
    return frozenset(kept)


# Tensor parallelism: the checkpoint holds whole tensors; a layer split over ranks keeps its rank's
# part (layers/parallel.py, deepseek_v4/parallel.py), cut here after dequantization (FP8 blocks and
# FP4 groups do not line up with every rank's slice).

def _rank_entries(model: nn.Module, entries: list[CheckpointEntry],
                  targets: dict[str, torch.Tensor]) -> list[CheckpointEntry]:
    """The entries this rank reads: under expert parallelism a DeepSeek-layout routed expert of
    another rank is never read, and this rank's are renumbered to its local experts."""
    kept = []
    for entry in entries:
        owner = _owner(model, entry.name) if entry.expert is not None and entry.name in targets else None
        if isinstance(owner, RoutedExperts):
            local = owner.local_expert(entry.expert)
            if local is None:
                continue
            entry = replace(entry, expert=local)
        kept.append(entry)
    return kept


def _rank_part(model: nn.Module, piece: V4Tensor) -> V4Tensor:
    """This rank's part of a whole checkpoint tensor: its owner module's `rank_part` (a module
    split over ranks has one); the tensor itself where the module is replicated."""
    owner = _owner(model, piece.name)
    if isinstance(owner, RoutedExperts):   # two stacked tensors, and one expert's halves
        part = piece.half or piece.name.rpartition(".")[2]
        return replace(piece, tensor=owner.rank_part(piece.tensor, part))
    if hasattr(owner, "rank_part"):
        return replace(piece, tensor=owner.rank_part(piece.tensor, 0))
    return piece


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


def _slot(target: torch.Tensor, piece: V4Tensor) -> torch.Tensor:
    if piece.expert is None:
        return target
    rows = target[piece.expert]
    if piece.half is None:
        return rows
    inner = rows.shape[0] // 2     # gate_up_proj[j] is [gate rows; up rows]
    return rows[:inner] if piece.half == "gate" else rows[inner:]


def _where(expert: int | None, half: str | None) -> str:
    if expert is None:
        return ""
    return f"[expert {expert}]" if half is None else f"[expert {expert} {half}]"


def _halves(name: str) -> tuple[str | None, ...]:
    return ("gate", "up") if name.endswith("gate_up_proj") else (None,)


def _check_coverage(entries: list[CheckpointEntry], targets: dict[str, torch.Tensor]) -> None:
    provided: dict[str, set[tuple[int | None, str | None]]] = defaultdict(set)
    for entry in entries:
        target = targets.get(entry.name)
        if target is None:
            raise UnknownTensorError(f"checkpoint tensor {entry.source!r} (our name {entry.name!r}) has no "
                                     "place in this model")
        if entry.expert is not None and (target.dim() != 3 or entry.expert >= target.shape[0]):
            raise UnknownTensorError(f"checkpoint tensor {entry.source!r}: {entry.name} has no expert "
                                     f"{entry.expert}")
        slot = (entry.expert, entry.half)
        if slot in provided[entry.name]:
            raise ModelLoadError(f"{entry.name}{_where(*slot)} is in the checkpoint twice ({entry.source!r})")
        provided[entry.name].add(slot)

    # Tied parameters (lm_head = embed_tokens) are one tensor under two names: either name fills it.
    names_of = defaultdict(list)
    for name, tensor in targets.items():
        names_of[id(tensor)].append(name)
    missing = []
    for names in names_of.values():
        gaps = [_gaps(name, provided.get(name, set()), targets[name]) for name in names]
        if all(gaps):
            missing.append(gaps[0])
    if not missing:
        return
    hint = ""
    if all(m.startswith("mtp.") for m in missing) and not any(e.name.startswith("mtp.") for e in entries):
        hint = ("; the checkpoint has no MTP layers (transformers drops them): build "
                "V4ForCausalLM(cfg, with_mtp=False)")
    shown = ", ".join(missing[:SHOWN_MISSING]) + (", ..." if len(missing) > SHOWN_MISSING else "")
    raise MissingTensorError(f"the checkpoint lacks {len(missing)} of the model's tensors: {shown}{hint}")


def _gaps(name: str, slots: set[tuple[int | None, str | None]], target: torch.Tensor) -> str:
    """'' when `slots` fill `name`, else what is missing (for a stacked tensor: which experts)."""
    if (None, None) in slots:
        return ""
    if not slots:
        return name
    wanted = [(j, half) for j in range(target.shape[0]) for half in _halves(name)]
    absent = [slot for slot in wanted if slot not in slots]
    if not absent:
        return ""
    listed = ", ".join(f"{j}" if half is None else f"{j} {half}" for j, half in absent[:4])
    return f"{name} (expert {listed}{', ...' if len(absent) > 4 else ''})"
