"""Reading a GGUF file into HF-shaped config and weights.

A GGUF (llama.cpp's format) holds three things we need: metadata (the model's hyper-parameters
and its tokenizer, under llama.cpp key names), tensor descriptors, and the tensor bytes, often
quantized. This module turns them into what the rest of deepinfer expects from any model source:
a config.json-shaped dict and float32 tensors named and laid out as in the HF checkpoint.

The header is parsed here with `struct` and numpy rather than with `gguf.GGUFReader`: the reader
builds a numpy view per string, which takes seconds for SmolLM2's 49k-token vocabulary and
several times that for Gemma 3's 262k (docs/benchmarks/design-measurements.md#gguf-header-parser). The
`gguf` package is still the source of truth for
the type tables and for dequantization (`gguf.quants.dequantize`).

llama.cpp's converter changes some tensors on the way in; we undo exactly those changes:
  * llama (and mistral, which llama.cpp writes as llama): q/k projection rows are interleaved
    per head for its rotary kernel; `_unpermute_qk` puts them back in HF's half-split order.
  * gemma3: every `*norm.weight` was stored as (1 + w), because HF's Gemma RMSNorm multiplies by
    (1 + w) and llama.cpp's by w. HF weights are w, so we subtract 1 (as transformers does).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.layers.linear import Int4Blocks, Int8Blocks
from deepinfer.models.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# Metadata value types of the GGUF spec (the same numbering as gguf.GGUFValueType).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = 0, 1, 2, 3, 4, 5, 6, 7
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = 8, 9, 10, 11, 12
_SCALAR_DTYPES = {
    _UINT8: np.dtype("<u1"), _INT8: np.dtype("<i1"), _UINT16: np.dtype("<u2"),
    _INT16: np.dtype("<i2"), _UINT32: np.dtype("<u4"), _INT32: np.dtype("<i4"),
    _FLOAT32: np.dtype("<f4"), _BOOL: np.dtype("?"), _UINT64: np.dtype("<u8"),
    _INT64: np.dtype("<i8"), _FLOAT64: np.dtype("<f8"),
}

# general.architecture values we can map, and the HF class/model_type each becomes.
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first), i.e. GGUF's ne reversed
    ggml_type: int
    offset: int  # absolute offset of the first byte in the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF header plus a memory map of the file for the tensor bytes."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: mmap of an empty file
            raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as e:
            raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {e}") from e

    # -- header ---------------------------------------------------------------------------

    def _parse(self) -> tuple[dict, list[GGUFTensorInfo]]:
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise ValueError("bad magic (not a GGUF file)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        self._pos = 24
        metadata = {}
        for _ in range(n_kv):
            key = self._read_str()
            (value_type,) = self._unpack("<I")
            metadata[key] = self._read_value(value_type)

        raw = []
        for _ in range(n_tensors):
            name = self._read_str()
            (n_dims,) = self._unpack("<I")
            ne = self._unpack(f"<{n_dims}Q")
            ggml_type, rel_offset = self._unpack("<IQ")
            raw.append((name, ne, ggml_type, rel_offset))

        # Tensor data starts at the next multiple of the alignment after the header.
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        tensors = [self._tensor_info(name, ne, t, data_start + off) for name, ne, t, off in raw]
        # A truncated download fails here, at open, rather than in the middle of a load.
        end = max((t.offset + t.nbytes for t in tensors), default=data_start)
        if end > len(buf):
            raise ValueError(f"file is {len(buf)} bytes but its tensors need {end} (truncated?)")
        return metadata, tensors

    @staticmethod
    def _tensor_info(name: str, ne: tuple[int, ...], ggml_type: int, offset: int) -> GGUFTensorInfo:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(ne)) if ne else 1
        return GGUFTensorInfo(name, tuple(int(d) for d in reversed(ne)), ggml_type, offset,
                              n_elements // block_size * type_size)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _read_str(self) -> str:
        (length,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + length
        if self._pos > len(self._map):
            raise ValueError("string runs past the end of the file")
        return self._map[start:self._pos].decode("utf-8")

    def _read_value(self, value_type: int):
        if value_type == _STRING:
            return self._read_str()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type == _STRING:
                return [self._read_str() for _ in range(count)]
            if item_type == _ARRAY:
                return [self._read_value(_ARRAY) for _ in range(count)]
            dtype = _SCALAR_DTYPES[item_type]
            # Numeric arrays (token types, scores) stay numpy: 262k floats as a list is slow.
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += dtype.itemsize * count
            return values
        dtype = _SCALAR_DTYPES[value_type]
        value = np.frombuffer(self._map, dtype=dtype, count=1, offset=self._pos)[0].item()
        self._pos += dtype.itemsize
        return value

    # -- tensors --------------------------------------------------------------------------

    def read_tensor(self, info: GGUFTensorInfo) -> np.ndarray:
        """Dequantize one tensor to float32, in torch order."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(info.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        row_elements = info.shape[-1] if info.shape else 1
        rows = info.nbytes // (row_elements // block_size * type_size)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        # dequantize() takes bytes shaped (..., bytes_per_row) and returns (..., elements_per_row).
        values = dequantize(raw.reshape(rows, -1), qtype)
        # np.array copies: F32 tensors would otherwise be read-only views into the mmap.
        return np.array(values, dtype=np.float32).reshape(info.shape)


# -- config ---------------------------------------------------------------------------------


def _meta(md: dict, key: str, default=None):
    value = md.get(key, default)
    return value.tolist() if isinstance(value, np.ndarray) else value


def resolve_architecture(md: dict, path: str) -> str:
    """general.architecture, with llama.cpp's one alias undone (Mistral is written as llama)."""
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {path} has general.architecture={arch!r}, which deepinfer cannot map; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    if arch == "llama" and "mistral" in str(md.get("general.name", "")).lower():
        return "mistral"
    return arch


def gguf_config(gguf: GGUFFile) -> dict:
    """A config.json-shaped dict from the GGUF metadata, defaults filled per architecture."""
    md, path = gguf.metadata, gguf.path
    arch = resolve_architecture(md, path)
    key = md["general.architecture"]  # metadata keys use the file's own prefix ("llama" for mistral)
    hf_class, model_type = SUPPORTED_ARCHITECTURES[arch]

    def get(suffix, default=None):
        return _meta(md, f"{key}.{suffix}", default)

    try:
        n_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        cfg = {
            "architectures": [hf_class],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
            "max_position_embeddings": int(get("context_length")),
        }
    except (TypeError, KeyError) as e:
        raise ModelLoadError(f"GGUF file {path} lacks required {arch} metadata: {e}") from e
    # head_dim: key_length when written (gemma, qwen3), else the rotary width (llama), else derived.
    cfg["head_dim"] = int(get("attention.key_length") or get("rope.dimension_count") or hidden // n_heads)
    cfg["rms_norm_eps"] = float(get("attention.layer_norm_rms_epsilon", 1e-6))
    tokens = md.get("tokenizer.ggml.tokens")
    cfg["vocab_size"] = int(get("vocab_size") or len(tokens or ()))
    # llama.cpp drops output.weight when it equals the embedding, so its absence means tied.
    cfg["tie_word_embeddings"] = all(t.name != "output.weight" for t in gguf.tensors)
    for field, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                            ("pad_token_id", "padding_token_id")):
        value = md.get(f"tokenizer.ggml.{meta_key}")
        if value is not None:
            cfg[field] = int(value)
    cfg["hidden_act"] = "silu"
    cfg["attention_bias"] = any(t.name.endswith("attn_q.bias") for t in gguf.tensors)

    rope_theta = float(get("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0))
    rope_scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        rope_scaling = {"rope_type": get("rope.scaling.type"), "factor": float(get("rope.scaling.factor", 1.0))}
        if get("rope.scaling.original_context_length"):
            rope_scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    cfg["rope_theta"] = rope_theta
    cfg["rope_scaling"] = rope_scaling

    if arch == "gemma3":
        _fill_gemma3(cfg, get, rope_theta, rope_scaling)
    else:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    return cfg


def _fill_gemma3(cfg: dict, get, rope_theta: float, rope_scaling: dict | None) -> None:
    """Gemma 3 fields the GGUF does not carry take the values of Google's released configs."""
    cfg.pop("hidden_act")
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["sliding_window"] = int(get("attention.sliding_window", 4096))
    # Five sliding-window layers then one global layer, repeating (layer i is global iff
    # (i + 1) % 6 == 0), unless a newer converter wrote the per-layer pattern explicitly.
    pattern = get("attention.sliding_window_pattern")
    n = cfg["num_hidden_layers"]
    if isinstance(pattern, list) and len(pattern) == n:
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        cfg["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    cfg["rope_local_base_freq"] = 10000.0
    cfg["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    cfg["final_logit_softcapping"] = get("final_logit_softcapping")
    cfg["attn_logit_softcapping"] = get("attn_logit_softcapping")
    # Gemma scales embeddings by sqrt(hidden) in the model code; nothing to record here.


# -- tensor names and conversions -----------------------------------------------------------

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per block ("sandwich" norms), so ffn_norm means something else there.
_GEMMA3_BLOCK = {
    **_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp adds that have no HF parameter (HF recomputes them from the config).
_SKIPPED = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None for tensors HF does not store."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    table = _GEMMA3_BLOCK if arch == "gemma3" else _BLOCK
    if match is None or match.group(2) not in table:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no HF equivalent for architecture {arch}")
    layer, leaf, kind = match.groups()
    return f"model.layers.{layer}.{table[leaf]}.{kind}"


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary reordering of q/k projection rows.

    llama.cpp's converter viewed each head's rows as (2, head_dim/2) (the two halves HF's
    rotate_half pairs up) and transposed them to (head_dim/2, 2), interleaving the pairs. The
    inverse views them as (head_dim/2, 2) and transposes back. Works for weights and biases.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_int4_blocks(gguf: GGUFFile, info: GGUFTensorInfo) -> Int4Blocks | None:
    """Q4_0 / Q4_1 tensors as 4-bit values with per-32 scale and offset (no precision lost);
    None for any other type."""
    from gguf import GGMLQuantizationType

    qtype = GGMLQuantizationType(info.ggml_type)
    if qtype not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1) or len(info.shape) != 2:
        return None
    rows, cols = info.shape
    header = 2 if qtype == GGMLQuantizationType.Q4_0 else 4   # f16 scale (+ f16 min for Q4_1)
    raw = np.frombuffer(gguf._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    blocks = raw.reshape(rows, cols // 32, header + 16)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_0:
        offset = -8.0 * scale                        # w = d * (q - 8)
    else:
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)   # w = d * q + m
    packed = blocks[..., header:]
    # Within a block, byte j holds element j in its low nibble and element j + 16 in its high one.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, cols)
    return Int4Blocks(q, scale, offset)


def read_q8_blocks(gguf: GGUFFile, info: GGUFTensorInfo) -> Int8Blocks | None:
    """A Q8_0 matrix as its int8 values and per-32 scales (no precision lost); None for any
    other type."""
    from gguf import GGMLQuantizationType

    if GGMLQuantizationType(info.ggml_type) != GGMLQuantizationType.Q8_0 or len(info.shape) != 2:
        return None
    rows, cols = info.shape
    raw = np.frombuffer(gguf._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    blocks = raw.reshape(rows, cols // 32, 2 + 32)    # f16 scale, then 32 int8 values
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return Int8Blocks(q, scale)


# The tensors that can be the LM head (the embedding when the head is tied to it).
_HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")


def iter_gguf_weights(gguf: GGUFFile, config: dict, keep_int4: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file as (HF name, float32 tensor), conversions undone.

    keep_int4: yield Q4_0/Q4_1 matrices as `Int4Blocks` instead (the model keeps a 4-bit copy),
    and a Q8_0 head (or embedding, which may be the tied head) as `Int8Blocks`.
    """
    arch = resolve_architecture(gguf.metadata, gguf.path)
    for info in gguf.tensors:
        name = hf_tensor_name(info.name, arch)
        if name is None:
            continue
        if keep_int4 and name in _HEAD_NAMES:
            head = read_q8_blocks(gguf, info)
            if head is not None:
                yield name, head
                continue
        blocks = read_int4_blocks(gguf, info) if keep_int4 else None
        if blocks is not None:
            if arch in ("llama", "mistral") and (".attn_q." in info.name or ".attn_k." in info.name):
                heads = config["num_attention_heads" if ".attn_q." in info.name else "num_key_value_heads"]
                blocks = Int4Blocks(*(_unpermute_qk(a, heads) for a in (blocks.q, blocks.scale, blocks.offset)))
            yield name, blocks
            continue
        try:
            w = gguf.read_tensor(info)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"cannot dequantize tensor {info.name} of {gguf.path}: {e}") from e
        if arch in ("llama", "mistral"):
            if ".attn_q." in info.name:
                w = _unpermute_qk(w, config["num_attention_heads"])
            elif ".attn_k." in info.name:
                w = _unpermute_qk(w, config["num_key_value_heads"])
        elif arch == "gemma3" and info.name.endswith("norm.weight"):
            w = w - 1.0
        yield name, torch.from_numpy(np.ascontiguousarray(w))  # contiguous after the swapaxes


def file_cache_key(path: str) -> str:
    """A cheap identity for a file's contents: absolute path, size and mtime."""
    st = os.stat(path)
    return f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
