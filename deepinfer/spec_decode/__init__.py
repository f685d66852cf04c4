"""Speculative decoding (DSpark), the scheduler's side: drafts, what to verify, what was learnt.

Speculation has the KV connector's two roles. This package is the scheduler's side: it never
sees a tensor, and it imports nothing of worker/ (the draft model's runner and the MTP head are
reached through an executor). The worker's side (verify rows, verify chains and the device
n-gram lookup they draft with, the draft model's memory) is worker/spec/. The two meet in the
plan (a chunk's draft tokens, a chain length) and the runner's result (the verdicts).

    method.py       the method and verification mode, resolved once (both roles ask it)
    ngram.py        drafter: prompt lookup (model-free)
    draft_model.py  drafter: a second model sharing the tokenizer, with its own executor and KV
    mtp.py          drafter: a model's own MTP head (run by the executor)
    replay.py       drafter: a recorded continuation at a set acceptance rate (for measuring)
    calibration.py  confidence -> conditional acceptance, learned online
    cost_model.py   step time vs drafts per sequence, profiled at start-up
    policy.py       which draft positions to verify: fixed, or by expected tokens per second
    decoder.py      the scheduler's entry (propose, admit, observe)
    overlap.py      the loop chooser: a verify step or an overlapped one, per batch size
    verifier.py     the acceptance rule (greedy match, rejection sampling) the worker applies

Configured by `speculative_config` (config.SpeculativeConfig); built by `build_speculative_decoder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.spec_decode.decoder import SpeculativeDecoder
from deepinfer.spec_decode.method import DraftSource, SpeculativeMethod
from deepinfer.types.drafter import Drafter

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig
    from deepinfer.executor import Executor
    from deepinfer.models.loader import ModelSource
    from deepinfer.spec_decode.cost_model import StepCostModel

__all__ = ["SpeculativeDecoder", "SpeculativeMethod", "build_speculative_decoder"]


def _ngram(config: EngineConfig, executor: Executor, source: ModelSource, load_weights: bool) -> Drafter:
    from deepinfer.spec_decode.ngram import NgramDrafter

    spec = config.speculative
    return NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def _replay(config: EngineConfig, executor: Executor, source: ModelSource, load_weights: bool) -> Drafter:
    from deepinfer.spec_decode.replay import ReplayDrafter

    return ReplayDrafter.load(config.speculative.replay_path, source.hf_config["vocab_size"], config.model.seed)


def _mtp(config: EngineConfig, executor: Executor, source: ModelSource, load_weights: bool) -> Drafter:
    from deepinfer.spec_decode.mtp import MTPDrafter

    return MTPDrafter(executor, source.hf_config, config.speculative.num_speculative_tokens)


def _draft_model(config: EngineConfig, executor: Executor, source: ModelSource, load_weights: bool) -> Drafter:
    from deepinfer.spec_decode.draft_model import DraftModelDrafter

    spec = config.speculative
    return DraftModelDrafter(spec.model, config, source.tokenizer, source.hf_config["vocab_size"],
                             executor.kv_cache_config.num_blocks, spec.num_speculative_tokens, load_weights)


_DRAFTERS = {DraftSource.NGRAM: _ngram, DraftSource.REPLAY: _replay, DraftSource.MTP: _mtp,
             DraftSource.DRAFT_MODEL: _draft_model}


def build_drafter(config: EngineConfig, method: SpeculativeMethod, executor: Executor, source: ModelSource,
                  load_weights: bool = True) -> Drafter:
    """`executor` runs the target model (MTP drafts with its head; a draft model gets as many
    KV blocks as it has, and random weights where the target has them: load_weights=False)."""
    return _DRAFTERS[method.source](config, executor, source, load_weights)


def build_speculative_decoder(config: EngineConfig, executor: Executor, source: ModelSource,
                              max_model_len: int, cost_model: StepCostModel | None = None,
                              load_weights: bool = True) -> SpeculativeDecoder:
    """The drafter first (it may fail fast on a bad config), then, for adaptive verification, the
    step-cost profile (unless given one)."""
    spec = config.speculative
    method = SpeculativeMethod.resolve(spec)
    drafter = build_drafter(config, method, executor, source, load_weights)
    if method.adaptive and cost_model is None:
        from deepinfer.spec_decode.cost_model import profile_step_cost

        cost_model = profile_step_cost(executor.profile_verify_step, spec.num_speculative_tokens,
                                       config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
    return SpeculativeDecoder(method, drafter, max_model_len, cost_model)
