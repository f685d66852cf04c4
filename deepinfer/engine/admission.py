"""Admission: one user request -> the engine core's requests, the same way on every path.

    messages = child_requests(request_id, prompt_ids, params, facts, priority=..., cache_salt=...,
                              traffic_class=...)
    request = to_request(message, block_size)      # in the core (process), one per message

Three callers share it: the offline `LLM` (both halves, in one process), the server's engine
client (the first half; it sends the messages to the core process) and the core process (the
second half). What it decides:

  - max_tokens: the room left before max_model_len (or less, when the request asks for less);
  - n > 1 fans out into n child requests `{id}-{index}`, each with n=1 and, when seeded, its
    own seed (SamplingParams.for_child); the front end's output processor gathers them back;
  - extra_key: model id + cache_salt (+ the LoRA adapter's name and id), part of every block
    hash (types/block_hashes.py), so tenants with different salts never share KV blocks, nor
    requests of different adapters (or an adapter's and the base model's);
  - prompt_logprobs skip the prefix cache: every prompt position must be computed;
  - traffic_class: one of the engine's kv_retention classes (types/traffic_class.py; None:
    "chat"), the retention of the request's blocks in a KV store. Any other is a ValueError.

A pooling request (an embedding, `pooling_request`) is one core request with no output: its
PoolingParams resolved against the engine's pooler_config, greedy placeholder sampling params
that nothing reads, max_tokens 0, and the prefix cache skipped when its pooling reads every
position (MEAN, CLS: a hit's positions are not recomputed, so their states would be missing).

`child_requests` is pure (it registers nothing), so a caller can build and encode everything
before it commits to anything (the engine client's add_request is transactional).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from deepinfer.config import CacheConfig
from deepinfer.multimodal.inputs import ImageInputs
from deepinfer.pooling_params import PoolingParams
from deepinfer.sampling_params import SamplingParams
from deepinfer.types import traffic_class as traffic
from deepinfer.types.block_hashes import extra_key
from deepinfer.types.lora import LoRARequest
from deepinfer.types.request import Request


class AddRequest(msgspec.Struct, tag="add"):
    """One core request, fully resolved: what the core needs to build its Request (and, as a
    message, what the front end sends the core process)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    cache_salt: str | None = None
    extra_key: bytes = b""
    skip_prefix_cache: bool = False
    traffic_class: str = traffic.DEFAULT_CLASS
    pooling: PoolingParams | None = None   # an embedding request (pooling_request)
    images: ImageInputs | None = None   # the prompt's images (multimodal/inputs.py)
    lora: LoRARequest | None = None     # the LoRA adapter it runs under; None: the base model


@dataclass(frozen=True)
class EngineFacts:
    """What admission needs to know about the engine, fixed once it has started."""

    model_id: str                 # served model name: part of every block hash
    max_model_len: int
    eos_token_ids: frozenset[int]
    # The kv_retention classes a request may name (traffic_class).
    traffic_classes: tuple[str, ...] = traffic.retention_classes(CacheConfig.kv_retention)
    # The engine's pooler_config (pooling_params.pooler_defaults): what a pooling request leaves unset.
    pooler: PoolingParams = PoolingParams(normalize=True, pooling_type="LAST")


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def resolve_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    room = max_model_len - num_prompt_tokens
    return room if params.max_tokens is None else min(params.max_tokens, room)


def child_requests(request_id: str, prompt_token_ids: list[int], params: SamplingParams, facts: EngineFacts, *,
                   priority: int = 0, cache_salt: str | None = None,
                   traffic_class: str | None = None, images: ImageInputs | None = None,
                   lora: LoRARequest | None = None) -> list[AddRequest]:
    """The core requests of one user request, in child order (their ids: child_request_ids);
    `images`: the prompt's, shared by the children (their KV blocks are shared too); `lora`: the
    adapter they all run under (checked by the caller: lora/registry.py)."""
    traffic_class = traffic.resolve(traffic_class, facts.traffic_classes)
    max_tokens = resolve_max_tokens(params, len(prompt_token_ids), facts.max_model_len)
    key = extra_key(facts.model_id, cache_salt, lora.cache_key if lora is not None else None)
    eos = sorted(facts.eos_token_ids)
    skip_prefix_cache = params.prompt_logprobs is not None
    return [AddRequest(child_id, prompt_token_ids, params.for_child(index) if params.n > 1 else params, eos,
                       max_tokens, priority, cache_salt, key, skip_prefix_cache, traffic_class, images=images,
                       lora=lora)
            for index, child_id in enumerate(child_request_ids(request_id, params.n))]


# What a pooling request carries as sampling params: read by nothing (it is never sampled), but
# every core request has some.
_NO_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


def pooling_request(request_id: str, prompt_token_ids: list[int], params: PoolingParams, facts: EngineFacts, *,
                    priority: int = 0, cache_salt: str | None = None,
                    traffic_class: str | None = None, lora: LoRARequest | None = None) -> AddRequest:
    """The core request of one pooling (embedding) input. The prompt may fill the whole context:
    nothing is generated after it. `lora`: the adapter whose hidden states are pooled."""
    if len(prompt_token_ids) > facts.max_model_len:
        raise ValueError(f"the input is {len(prompt_token_ids)} tokens long, but max_model_len is "
                         f"{facts.max_model_len}")
    params = params.resolved(facts.pooler)
    return AddRequest(request_id, prompt_token_ids, _NO_SAMPLING, sorted(facts.eos_token_ids), 0, priority,
                      cache_salt, extra_key(facts.model_id, cache_salt, lora.cache_key if lora is not None else None),
                      params.needs_every_position, traffic.resolve(traffic_class, facts.traffic_classes),
                      pooling=params, lora=lora)


def to_request(message: AddRequest, block_size: int) -> Request:
    """The engine core's Request for one admitted child."""
    return Request(message.request_id, message.prompt_token_ids, message.sampling_params,
                   frozenset(message.eos_token_ids), message.max_tokens, priority=message.priority,
                   cache_salt=message.cache_salt, extra_key=message.extra_key, block_size=block_size,
                   skip_prefix_cache=message.skip_prefix_cache, traffic_class=message.traffic_class,
                   pooling=message.pooling, images=message.images, lora=message.lora)
