"""FP4 e2m1 weights with one power-of-two scale per group of inputs, as DeepSeek-V4 ships its
routed experts, and the grouped products of a mixture of experts over them.

A weight [..., out, in] is kept as it is stored: uint8 [..., out, in / 2], two e2m1 codes a byte
(the low nibble holds the even column), and uint8 [..., out, in / G] exponents of ue8m0 scales
(the multiplier of a group is 2^(byte - 127)). That is half a byte a weight plus a byte per
group: no wider copy of the weight is kept.

e2m1 by code 0..15: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 1 = 0.5 is the one subnormal).

Two ways to run the experts, as for the FP8 weights (fp8.py):
  reference  each expert that has tokens dequantized to the activations' dtype, then F.linear
             (`dequantize`); exact for the stored weights, on any device;
  grouped    on CUDA, one Triton kernel over every expert's rows (fp4_moe_triton.py) that reads
             the 4-bit codes and decodes them in registers before the bf16 tensor-core product:
             Hopper has no FP4 tensor cores, so the gain is the bytes read, a quarter of bf16's.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# ue8m0: the scale 2^(byte - 127); the byte 255 is NaN in the format and never written.
UE8M0_BIAS = 127


def scale_exponents(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales as their exponent bytes (uint8): from float8_e8m0fnu, or raw uint8 as some
    writers store them. Other (float) scales are no ue8m0: ValueError."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    raise ValueError(f"FP4 group scales must be ue8m0 (float8_e8m0fnu or uint8 bytes), got {scale.dtype}")


def multipliers(exponents: torch.Tensor) -> torch.Tensor:
    """Exponent bytes -> float32 multipliers 2^(byte - 127)."""
    return torch.exp2(exponents.float() - UE8M0_BIAS)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 codes per byte [..., C/2] -> float32 [..., C]. Column 2k is byte k's low nibble
    (DeepSeek's convert.py and transformers' FP4 dequantization both read it so)."""
    codes = packed.contiguous().view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    return table[torch.stack((codes & 0xF, codes >> 4), dim=-1).long()].flatten(-2)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed e2m1 [..., R, C/2] times one multiplier per group of C / G consecutive columns of a
    row, `scale` [..., R, G] (float multipliers, or ue8m0 as float8_e8m0fnu / uint8 exponents)."""
    values = unpack_e2m1(packed)
    groups = scale.shape[-1]
    if scale.shape[:-1] != values.shape[:-1] or groups == 0 or values.shape[-1] % groups:
        raise ValueError(f"an FP4 weight of {tuple(values.shape)} values (packed {tuple(packed.shape)}) "
                         f"needs a scale of {tuple(values.shape[:-1])} x groups dividing "
                         f"{values.shape[-1]}, not {tuple(scale.shape)}")
    factors = scale.float() if scale.is_floating_point() and scale.dtype != getattr(
        torch, "float8_e8m0fnu", None) else multipliers(scale_exponents(scale))
    grouped = values.unflatten(-1, (groups, values.shape[-1] // groups))
    return (grouped * factors[..., None]).flatten(-2).to(dtype)


def quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., R, C/2], exponents uint8 [..., R, C/group]) for a float weight: each
    group's power-of-two scale the smallest whose multiple of 6 covers the group's largest
    magnitude, each value the nearest e2m1 grid value (tests and benchmarks write V4-style
    experts with it)."""
    w = weight.float()
    grouped = w.unflatten(-1, (w.shape[-1] // group, group))
    amax = grouped.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-UE8M0_BIAS, 127)
    scaled = grouped / torch.exp2(exponent)[..., None]
    grid = torch.tensor(E2M1_VALUES[:8], device=w.device)
    index = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)
    codes = (index + 8 * (scaled < 0)).to(torch.uint8).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + UE8M0_BIAS).to(torch.uint8)
