"""Loading a DeepSeek-V4 checkpoint directory (safetensors, one file or sharded with
model.safetensors.index.json) into the reference `V4ForCausalLM`.

Two layouts, told apart by the tensor names (`detect_layout`):

- "transformers": our names already (`model.layers.{i}.self_attn.q_a_proj.weight`, routed experts
  stacked as `model.layers.{i}.mlp.experts.gate_up_proj` / `down_proj`, `mtp.{i}.*`), as written by
  `DeepseekV4ForCausalLM.save_pretrained(..., save_original_format=False)`.
- "deepseek": the released checkpoints' names (`layers.{i}.attn.wq_a.weight`,
  `layers.{i}.ffn.experts.{j}.w1.weight`, `embed.weight`, `head.weight`, `mtp.{i}.*`), renamed as
  docs/deepseek_v4.md "Weight names" lists, each expert's w1 / w3 / w2 written into its slice of
  the stacked tensors (gate_up_proj[j] = [w1; w3], down_proj[j] = w2, both [out, in] as
  nn.Linear). transformers' default `save_pretrained` (save_original_format=True) writes a
  hybrid that this layout also reads: a `model.` prefix, our top-level names, DeepSeek's layer
  names, and the attention's kv_norm as `attn.norm`.

Quantized on disk in the released V4-Flash / V4-Pro (config.json: `expert_dtype` "fp4",
`quantization_config` {quant_method fp8, fmt e4m3, scale_fmt ue8m0, weight_block_size [128, 128]}):

- FP8, block-scaled: `X.weight` float8_e4m3fn [out, in] with `X.scale` [ceil(out/128), ceil(in/128)],
  one power-of-two multiplier per 128 x 128 block, stored as ue8m0 (float8_e8m0fnu: an 8-bit
  exponent, 2^(byte - 127)); w = weight * scale. These are the attention's wq_a, wq_b, wkv, wo_a,
  wo_b, the indexer's wq_b, the shared expert's w1 / w2 / w3, and (by DeepSeek's model code, whose
  plain Linear layers default to FP8) MTP's e_proj / h_proj.
- FP4, group-scaled, the routed experts' w1 / w2 / w3: the weight is int8 [out, in/2], two e2m1
  codes per byte, the low nibble holding the even column; `scale` ue8m0 [out, in/32], one
  multiplier per 32 consecutive inputs of a row. e2m1 codes: sign bit 3, then 0, 0.5, 1, 1.5, 2,
  3, 4, 6.
- Everything else is stored as is: embed, head, router gate weight, norms and the compressors' /
  indexer's wkv, wgate, weights_proj in BF16; hc_*, attn_sink, ape and gate.bias in float32;
  tid2eid in int32.

Sources: DeepSeek's inference code shipped with the V4-Flash weights (inference/model.py: Linear
allocates FP8 weight + [ceil(out/128), ceil(in/128)] float8_e8m0fnu `scale`, FP4 weight
[out, in/2] + [out, in/32] scale; inference/convert.py: FP4 read as int8, low nibble first, and
its dequantization of wo_a as weight * scale per block), and transformers 5.x
(conversion_mapping.py "deepseek_v4" for the names and the expert stacking;
integrations/finegrained_fp8.py `Fp8Dequantize` for the same nibble order and the [1, 32] FP4 /
[128, 128] FP8 scale grids; quantizers/quantizer_finegrained_fp8.py, which renames V4's `.scale`
to `weight_scale_inv`, the name a scale also goes by here).

Read for the dequantized path, everything quantized is dequantized here, at load, in float32 and
then cast to each parameter's own dtype (the CPU's path). Where the device multiplies them,
loading.py keeps the FP8 blocks and FP4 experts as stored instead (engine.py, load_from). The
FP8 block comes from config.json's `quantization_config.weight_block_size` (128 x 128 without one); the FP4 group from the scale's
shape. Reading goes shard by shard, one tensor at a time (a scale in another shard is read from
there alongside its weight), so the checkpoint is never held in memory next to the model.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from deepinfer.layers.quantization.fp4 import dequantize as dequantize_fp4_groups
from deepinfer.models.errors import ModelLoadError
from deepinfer.models.hf_loader import read_json, safetensors_files

TRANSFORMERS, DEEPSEEK = "transformers", "deepseek"
DEFAULT_FP8_BLOCK = (128, 128)
FP8_STORAGE = {torch.float8_e4m3fn}
# The release stores FP4 as int8; DeepSeek's convert.py views those bytes unchanged as
# torch.float4_e2m1fn_x2, so a checkpoint in that dtype reads the same way.
FP4_STORAGE = {torch.int8, torch.uint8} | {getattr(torch, "float4_e2m1fn_x2", torch.int8)}
# The same, as safetensors headers spell dtypes (read before any tensor is).
QUANTIZED_HEADER_DTYPES = {"F8_E4M3", "I8", "U8", "F4"}
SHOWN_MISSING = 6


class UnknownTensorError(ModelLoadError):
    """A checkpoint tensor that has no place in the model."""


class MissingTensorError(ModelLoadError):
    """Tensors the model needs that the checkpoint does not hold."""


# --- dequantization -------------------------------------------------------------------------

def scale_multipliers(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32 multipliers. ue8m0 arrives as float8_e8m0fnu, or as its raw exponent
    bytes in uint8 (2^(byte - 127)) from writers without that dtype; float scales as they are."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8_e4m3fn weight [..., R, C] times one multiplier per block x block tile, scale
    [..., ceil(R / bm), ceil(C / bn)] (the last tiles may be partial)."""
    rows, cols = weight.shape[-2:]
    block_rows, block_cols = block
    grid = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(scale.shape[-2:]) != grid or scale.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"an FP8 weight {tuple(weight.shape)} in {block_rows}x{block_cols} blocks needs a "
                         f"scale of {(*weight.shape[:-2], *grid)}, not {tuple(scale.shape)}")
    multipliers = scale_multipliers(scale).repeat_interleave(block_rows, dim=-2)[..., :rows, :]
    return weight.float() * multipliers.repeat_interleave(block_cols, dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fp8_block: tuple[int, int]) -> torch.Tensor:
    """The float32 value of a quantized weight, its format told by the stored dtype."""
    if weight.dtype in FP8_STORAGE:
        return dequantize_fp8_blocks(weight, scale, fp8_block)
    if weight.dtype in FP4_STORAGE:
        return dequantize_fp4_groups(weight, scale)
    raise ValueError(f"a scale came with a {weight.dtype} weight, which is no quantized format")


# --- names ----------------------------------------------------------------------------------

def detect_layout(names: Iterable[str]) -> str:
    """TRANSFORMERS or DEEPSEEK from the tensor names; a mix of both, or neither, is an error."""
    names = list(names)
    ours = [n for n in names if ".self_attn." in n or ".mlp." in n or n == "lm_head.weight"]
    theirs = [n for n in names if ".attn." in n or ".ffn." in n
              or n.removeprefix("model.") in ("embed.weight", "head.weight")]
    if ours and theirs:
        raise ModelLoadError(f"the checkpoint mixes transformers' names ({ours[0]!r}) and DeepSeek's "
                             f"({theirs[0]!r})")
    if ours:
        return TRANSFORMERS
    if theirs:
        return DEEPSEEK
    raise ModelLoadError("no DeepSeek-V4 tensor names in the checkpoint (neither transformers' "
                         "model.layers.N.self_attn.* nor DeepSeek's layers.N.attn.*)")


def scaled_weight_name(name: str, layout: str) -> str | None:
    """The weight a scale tensor belongs to; None when `name` is no scale. transformers calls a
    scale `weight_scale_inv` (stacked experts: `gate_up_proj_scale_inv`); DeepSeek `.scale` next
    to `.weight`. Only in DeepSeek's layout is a `.scale` a quantization scale: transformers' own
    `attn_hc.scale` is a parameter, while DeepSeek spells that one `hc_attn_scale`."""
    if name.endswith("_scale_inv"):
        return name.removesuffix("_scale_inv")
    if layout == DEEPSEEK and name.endswith(".scale"):
        return name.removesuffix("scale") + "weight"
    return None


_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    # transformers' save_pretrained leaves these in our spelling (its renames anchored at the
    # start do not reverse once `model.` is prefixed).
    "embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
    "hc_head.hc_fn": "model.hc_head.hc_fn", "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}
_LAYER_OWN = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{block}_{part}": f"{block}_hc.{part}"
       for block in ("attn", "ffn") for part in ("fn", "base", "scale")},
}
# An MTP layer's own front and head; `norm` stays `norm` here (only a compressor's norm is kv_norm).
_MTP_OWN = {
    **{f"{m}.weight": f"{m}.weight" for m in ("e_proj", "h_proj", "enorm", "hnorm", "norm")},
    "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale",
}
# The MTP layer shares the main model's embedding and head; DeepSeek's convert.py drops these too.
_MTP_SHARED = {"embed.weight", "head.weight"}
_ATTENTION = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
              "kv_norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj",
              "norm": "kv_norm"}  # transformers' save_pretrained writes attn.kv_norm back as attn.norm
_COMPRESSOR = {"wkv": "kv_proj", "wgate": "gate_proj", "norm": "kv_norm"}
_ROUTER = {"weight": "weight", "bias": "e_score_correction_bias", "tid2eid": "tid2eid"}
_SHARED_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_ROUTED_EXPERT = {"w1": ("gate_up_proj", "gate"), "w3": ("gate_up_proj", "up"), "w2": ("down_proj", None)}

Target = tuple[str, int | None, str | None]   # (our name, expert, half), as in V4Tensor


def deepseek_name(name: str) -> Target | None:
    """Our name for a DeepSeek-layout weight (a scale is renamed through its weight); None for a
    tensor that is dropped on purpose. Unknown names raise UnknownTensorError."""
    try:
        return _top_level(name.removeprefix("model.").split("."))
    except (KeyError, IndexError):
        raise UnknownTensorError(f"unknown tensor {name!r} in a DeepSeek-layout checkpoint") from None


def _top_level(parts: list[str]) -> Target | None:
    if parts[0] in ("layers", "mtp") and len(parts) > 2 and parts[1].isdigit():
        inner = parts[2:]
        if parts[0] == "layers":
            name, expert, half = _layer(inner)
            return f"model.layers.{parts[1]}.{name}", expert, half
        key = ".".join(inner)
        if key in _MTP_SHARED:
            return None
        if key in _MTP_OWN:
            return f"mtp.{parts[1]}.{_MTP_OWN[key]}", None, None
        name, expert, half = _layer(inner)
        return f"mtp.{parts[1]}.{name}", expert, half
    return _TOP_LEVEL[".".join(parts)], None, None


def _layer(parts: list[str]) -> Target:
    key = ".".join(parts)
    if key in _LAYER_OWN:
        return _LAYER_OWN[key], None, None
    if parts[0] == "attn":
        return "self_attn." + _attention(parts[1:]), None, None
    if parts[0] == "ffn":
        return _feed_forward(parts[1:])
    raise KeyError(key)


def _attention(parts: list[str]) -> str:
    if parts == ["attn_sink"]:
        return "sinks"
    if parts[0] == "compressor":
        return "compressor." + _compressor(parts[1:])
    if parts[:2] == ["indexer", "compressor"]:
        return "compressor.indexer." + _compressor(parts[2:])
    if parts == ["indexer", "wq_b", "weight"]:
        return "compressor.indexer.q_b_proj.weight"
    if parts == ["indexer", "weights_proj", "weight"]:
        return "compressor.indexer.scorer.weights_proj.weight"
    if len(parts) == 2 and parts[1] == "weight":
        return _ATTENTION[parts[0]] + ".weight"
    raise KeyError(".".join(parts))


def _compressor(parts: list[str]) -> str:
    if parts == ["ape"]:
        return "position_bias"
    if len(parts) == 2 and parts[1] == "weight":
        return _COMPRESSOR[parts[0]] + ".weight"
    raise KeyError(".".join(parts))


def _feed_forward(parts: list[str]) -> Target:
    if parts[0] == "gate" and len(parts) == 2:
        return "mlp.gate." + _ROUTER[parts[1]], None, None
    if parts[0] == "shared_experts" and len(parts) == 3 and parts[2] == "weight":
        return f"mlp.shared_experts.{_SHARED_EXPERT[parts[1]]}.weight", None, None
    if parts[0] == "experts" and len(parts) == 4 and parts[1].isdigit() and parts[3] == "weight":
        stacked, half = _ROUTED_EXPERT[parts[2]]
        return f"mlp.experts.{stacked}", int(parts[1]), half
    raise KeyError(".".join(parts))


# --- the checkpoint -------------------------------------------------------------------------

@dataclass(frozen=True)
class V4Tensor:
    """One checkpoint tensor under our name, dequantized (float32) when it is quantized on disk,
    else as stored. A routed expert of DeepSeek's layout fills a slice of a stacked tensor:
    expert j, and half "gate" / "up" (rows :I / I: of gate_up_proj[j]) or None (all of
    down_proj[j]). `source` is the checkpoint's name for it."""

    name: str
    tensor: torch.Tensor
    source: str
    expert: int | None = None
    half: str | None = None
    # Kept in its own format (loading.py): the weight's scale tensor as stored.
    scale: torch.Tensor | None = None


@dataclass(frozen=True)
class CheckpointEntry:
    """Where one weight is (file, source name, its scale's name and file) and where it goes."""

    name: str
    expert: int | None
    half: str | None
    source: str
    file: str
    scale: str | None = None
    scale_file: str | None = None
    dtype: str = ""        # as the safetensors header spells it


class V4Checkpoint:
    """A V4 checkpoint directory, read up to its headers: the layout, the FP8 block and one entry
    per weight. Unknown names fail here, before any tensor is read."""

    def __init__(self, path: str, fp8_block: tuple[int, int] | None = None) -> None:
        self.path = path
        self.fp8_block = tuple(fp8_block or configured_fp8_block(path))
        file_of, dtype_of = read_headers(safetensors_files(path))
        self.layout = detect_layout(file_of)
        scale_of = {}
        for name in file_of:
            weight = scaled_weight_name(name, self.layout)
            if weight is None:
                continue
            if weight not in file_of:
                raise UnknownTensorError(f"scale tensor {name!r} has no weight {weight!r} in the checkpoint")
            if dtype_of[weight] not in QUANTIZED_HEADER_DTYPES:
                raise ModelLoadError(f"scale tensor {name!r} comes with {weight!r}, which is stored as "
                                     f"{dtype_of[weight]}, no quantized format")
            scale_of[weight] = name
        self.entries: list[CheckpointEntry] = []
        for source, file in file_of.items():
            if scaled_weight_name(source, self.layout) is not None:
                continue       # read together with its weight
            target = (source, None, None) if self.layout == TRANSFORMERS else deepseek_name(source)
            if target is None:
                continue
            scale = scale_of.get(source)
            if scale is None and dtype_of[source] in QUANTIZED_HEADER_DTYPES:
                raise ModelLoadError(f"{source!r} is stored as {dtype_of[source]}, a quantized format, but "
                                     "the checkpoint has no scale for it")
            self.entries.append(CheckpointEntry(*target, source=source, file=file, scale=scale,
                                                scale_file=file_of.get(scale), dtype=dtype_of[source]))

    def tensors(self, kept: frozenset[str] = frozenset()) -> Iterator[V4Tensor]:
        """The entries' tensors, renamed and dequantized, shard by shard, one at a time; those
        named in `kept` (source names) as stored, with their scale as stored beside them."""
        from safetensors import safe_open

        by_file = defaultdict(list)
        for entry in self.entries:
            by_file[entry.file].append(entry)
        for file, entries in by_file.items():
            with safe_open(file, framework="pt") as shard:
                for entry in entries:
                    tensor = shard.get_tensor(entry.source)
                    if entry.scale is not None and entry.source in kept:
                        yield V4Tensor(entry.name, tensor, entry.source, entry.expert, entry.half,
                                       self._scale(entry, shard))
                        continue
                    if entry.scale is not None:
                        tensor = self._dequantized(entry, tensor, shard)
                    yield V4Tensor(entry.name, tensor, entry.source, entry.expert, entry.half)

    def group_size(self, entry: CheckpointEntry) -> int:
        """An FP4 weight's inputs per scale (the release's 32), from the headers' shapes: two
        codes a byte, one scale a group."""
        from safetensors import safe_open

        with safe_open(entry.file, framework="pt") as shard:
            packed = shard.get_slice(entry.source).get_shape()[-1]
        with safe_open(entry.scale_file, framework="pt") as shard:
            groups = shard.get_slice(entry.scale).get_shape()[-1]
        if not groups or (2 * packed) % groups:
            raise ModelLoadError(f"{entry.source!r}: {2 * packed} FP4 inputs do not split into its scale's "
                                 f"{groups} groups")
        return 2 * packed // groups

    def _scale(self, entry: CheckpointEntry, shard) -> torch.Tensor:
        from safetensors import safe_open

        if entry.scale_file == entry.file:
            return shard.get_tensor(entry.scale)
        with safe_open(entry.scale_file, framework="pt") as other:
            return other.get_tensor(entry.scale)

    def _dequantized(self, entry: CheckpointEntry, weight: torch.Tensor, shard) -> torch.Tensor:
        scale = self._scale(entry, shard)
        try:
            return dequantize(weight, scale, self.fp8_block)
        except ValueError as e:
            raise ModelLoadError(f"cannot dequantize {entry.source!r} with {entry.scale!r}: {e}") from e


def read_headers(files: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """{tensor name: its file}, {tensor name: its safetensors dtype} from the files' headers."""
    from safetensors import SafetensorError, safe_open

    file_of, dtype_of = {}, {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():
                    if name in file_of:
                        raise ModelLoadError(f"tensor {name!r} is in both {file_of[name]} and {file}")
                    file_of[name], dtype_of[name] = file, shard.get_slice(name).get_dtype()
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read safetensors file {file}: {e}") from e
    return file_of, dtype_of


def configured_fp8_block(path: str) -> tuple[int, int]:
    """config.json's quantization_config.weight_block_size, else DeepSeek's 128 x 128."""
    config = read_json(os.path.join(path, "config.json"), required=False) or {}
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else DEFAULT_FP8_BLOCK
