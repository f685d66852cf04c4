"""DeepSeek-V4 (Flash / Pro) as plain PyTorch reference layers; docs/deepseek_v4.md explains the
architecture and what each layer keeps per request.

One file per part: config (V4Config from an HF config dict), rope (interleaved partial rotary),
norm, compressor (CSA / HCA row compression), indexer (CSA's top-k), attention, hyper (mHC),
moe (routers, experts, shared expert), decoder, mtp, model (V4ForCausalLM), state (V4State).
Parameter names follow transformers' DeepseekV4ForCausalLM, so its state_dict loads as is.
"""

from deepinfer.models.deepseek_v4.config import V4Config
from deepinfer.models.deepseek_v4.model import V4ForCausalLM, V4Model
from deepinfer.models.deepseek_v4.state import CompressorState, LayerState, V4State

__all__ = ["CompressorState", "LayerState", "V4Config", "V4ForCausalLM", "V4Model", "V4State"]
