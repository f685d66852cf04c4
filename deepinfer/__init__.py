"""deepinfer: an LLM inference engine.

A request travels: tokenizer -> scheduler (token budget) -> KV manager (blocks, prefix cache)
-> model runner (forward) -> sampler -> detokenizer -> RequestOutput. Start reading at
`types/plan.py` (the boundary types), then `engine/scheduler.py` and `worker/model_runner.py`.
"""

from deepinfer.llm import LLM
from deepinfer.outputs import (
           CompletionOutput,
           EmbeddingOutput,
           EmbeddingRequestOutput,
           Logprob,
           RequestOutput,
)
from deepinfer.pooling_params import PoolingParams
from deepinfer.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput"]
