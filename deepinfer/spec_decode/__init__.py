"""Speculative decoding (DSpark): drafters, lossless verification, variable-length verification.

    drafter.py      the interface: up to k draft tokens per request + a confidence per position
    ngram.py        prompt lookup (model-free)
    draft_model.py  a second model sharing the tokenizer, with its own executor and KV cache
    mtp.py          the hook for a model's own MTP head (run by the executor)
    replay.py       a recorded continuation at a set acceptance rate (for measuring verification)
    calibration.py  confidence -> conditional acceptance, learned online
    cost_model.py   step time vs drafts per sequence, profiled at start-up
    policy.py       which draft positions to verify: fixed, or by expected tokens per second
    decoder.py      the scheduler's side (propose, admit, observe)
    verifier.py     acceptance from the target's logits (greedy match, rejection sampling)
    metrics.py      acceptance counters

The runner's side (logits at every draft position, verify-step timing, the MTP head) is the
model runner's own (worker/model_runner.py), reached through the executor; nothing here imports
the worker.

Configured by `speculative_config` (config.SpeculativeConfig); built by `build_speculative_decoder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.spec_decode.decoder import SpeculativeDecoder
from deepinfer.types.drafter import Drafter

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig
    from deepinfer.executor import Executor
    from deepinfer.models.loader import ModelSource
    from deepinfer.spec_decode.cost_model import StepCostModel

__all__ = ["SpeculativeDecoder", "build_speculative_decoder"]


def build_drafter(config: EngineConfig, executor: Executor, source: ModelSource, load_weights: bool = True) -> Drafter:
    """`executor` runs the target model (MTP drafts with its head; a draft model gets as many
    KV blocks as it has, and random weights where the target has them: load_weights=False)."""
    spec = config.speculative
    if spec.method == "ngram":
        from deepinfer.spec_decode.ngram import NgramDrafter

        return NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "replay":
        from deepinfer.spec_decode.replay import ReplayDrafter

        return ReplayDrafter.load(spec.replay_path, source.hf_config["vocab_size"], config.model.seed)
    if spec.method == "mtp":
        from deepinfer.spec_decode.mtp import MTPDrafter

        return MTPDrafter(executor, source.hf_config, spec.num_speculative_tokens)
    from deepinfer.spec_decode.draft_model import DraftModelDrafter

    return DraftModelDrafter(spec.model, config, source.tokenizer, source.hf_config["vocab_size"],
                             executor.kv_cache_config.num_blocks, spec.num_speculative_tokens, load_weights)


def build_speculative_decoder(config: EngineConfig, executor: Executor, source: ModelSource,
                              max_model_len: int, cost_model: StepCostModel | None = None,
                              load_weights: bool = True) -> SpeculativeDecoder:
    """The drafter first (it may fail fast on a bad config), then, for adaptive verification, the
    step-cost profile (unless given one)."""
    spec = config.speculative
    drafter = build_drafter(config, executor, source, load_weights)
    if spec.verification == "adaptive" and cost_model is None:
        from deepinfer.spec_decode.cost_model import profile_step_cost

        cost_model = profile_step_cost(executor.profile_verify_step, spec.num_speculative_tokens,
                                       config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
    return SpeculativeDecoder(spec, drafter, max_model_len, cost_model)
