"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`, `.chat(messages)` and
`.embed(prompts)` (vLLM's: one EmbeddingRequestOutput per prompt, `.outputs.embedding`).

It runs the engine core in this process and loops `step()` until every request is done, with a
tqdm bar showing input and output tokens per second. Chats are rendered by the recipe, as the
server's chat routes render them (deepinfer/chat.py): the DeepSeek-V4 format for that
architecture, else the model's chat template, and never a control token from the user's text.

As in vLLM, a call without sampling_params uses `get_default_sampling_params()`: SamplingParams'
defaults overridden by the model's generation_config.json (models/generation_config.py;
`generation_config="vllm"` turns that off). With `skip_tokenizer_init=True` there is no
tokenizer: prompts must be token ids, and outputs carry token ids with empty text.

LoRA adapters, as vLLM: `LLM(..., enable_lora=True, max_loras=2, max_lora_rank=16)`, then
`generate(prompts, params, lora_request=LoRARequest(name, int_id, path))` (one for every prompt,
or a list with one, or None for the base model, per prompt). Each adapter is checked against the
model when first named (lora/registry.py), before any request of the call is added.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

from deepinfer_recipe import Encoder, parse_request
from tqdm.auto import tqdm

from deepinfer.chat import apply_template_kwargs, make_encoder, refuse_images
from deepinfer.engine.admission import EngineFacts, child_requests, pooling_request, to_request
from deepinfer.engine.core import EngineCore
from deepinfer.lora.registry import LoRARegistry
from deepinfer.models.generation_config import default_sampling_overrides
from deepinfer.models.loader import check_load_format, model_source
from deepinfer.models.registry import takes_images
from deepinfer.multimodal.chat_images import ImageFrontEnd
from deepinfer.multimodal.inputs import ImageInputs
from deepinfer.output_processor import OutputProcessor
from deepinfer.outputs import EmbeddingRequestOutput, RequestOutput
from deepinfer.pooling_params import PoolingParams, check_dimensions, pooler_defaults
from deepinfer.sample.structured import validate as validate_structured_outputs
from deepinfer.sampling_params import RequestOutputKind, SamplingParams
from deepinfer.types import traffic_class as traffic
from deepinfer.types.lora import LoRARequest
from deepinfer.vllm_compat import engine_config

logger = logging.getLogger(__name__)

# A prompt is text, a list of token ids, or a dict {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict[str, Any]]


class LLM:
    """An engine for offline batch generation.

    Keyword arguments are EngineConfig fields with vLLM's names: dtype, max_model_len, seed,
    block_size, gpu_memory_utilization, cpu_kv_cache_bytes, enable_prefix_caching,
    num_kv_blocks, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, policy,
    generation_config, skip_tokenizer_init, tensor_parallel_size (ranks through the mp or ray
    executor), enable_expert_parallel, distributed_executor_backend, ...
    `load_format="dummy"` keeps random weights (for speed measurements of a real shape).
    `speculative_config={"method": "ngram" | "draft_model" | "mtp", "num_speculative_tokens": 5,
    "model": PATH, "verification": "adaptive" | "fixed"}` turns on speculative decoding; its
    counters are in `llm.spec_decode_stats` and logged after each generate.
    `enable_lora=True` (with max_loras, max_lora_rank, max_cpu_loras) serves LoRA adapters:
    generate's `lora_request`.
    """

    def __init__(self, model: str | None = None, *, load_format: str = "auto", **kwargs: Any) -> None:
        self.config = engine_config(model=model, **kwargs)   # vLLM's names translated (vllm_compat.py)
        if self.config.parallel.data_parallel_size > 1:
            # One engine core runs in this process; N cores behind one endpoint are the server's
            # (vLLM's offline data parallelism is a launcher of one LLM per rank, not this class).
            raise ValueError(f"data_parallel_size={self.config.parallel.data_parallel_size}: the offline LLM runs one "
                             "engine core; use `deepinfer serve --data-parallel-size N` for N engine cores behind "
                             "one server")
        source = model_source(self.config.model)
        load_weights = check_load_format(load_format, source)
        self.model_id = self.config.model.served_model_name or source.name
        self.tokenizer = source.tokenizer   # None with skip_tokenizer_init
        self.eos_token_ids = source.eos_token_ids
        self.default_sampling_overrides = default_sampling_overrides(
            self.config.model.generation_config, source, self.config.model.json_field("override_generation_config"))
        if self.default_sampling_overrides:
            logger.info("Default sampling parameters come from the model's generation config: %s "
                        "(generation_config='vllm' ignores them)", self.default_sampling_overrides)
        self.get_default_sampling_params()   # a bad value in generation_config.json fails here, not later
        self.engine = EngineCore(self.config, source, load_weights=load_weights)
        self.config = self.engine.config   # with the batch limits the platform filled in
        self.max_model_len = self.engine.max_model_len
        self._facts = EngineFacts(self.model_id, self.max_model_len, self.eos_token_ids,   # for admission
                                  traffic.retention_classes(self.config.cache.kv_retention),
                                  pooler_defaults(self.config.model.pooler_config))
        self.vocab_size = source.hf_config["vocab_size"]
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        # What chat() needs to pick and build its encoder, on first use (building one is slow,
        # docs/benchmarks/design-measurements.md#chat-encoder-on-first-use): the source
        # without its weights, which need not stay alive for that.
        self._chat_source = dataclasses.replace(source, _weights=None)
        self._chat_encoders: dict[str | None, Encoder] = {}   # by chat_template (None: the model's)
        self._images = ImageFrontEnd.from_source(self.config.multimodal, source)   # None: a text-only model
        self._loras = LoRARegistry(source.hf_config, self.config.lora)   # adapters checked once each

    def get_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer: it was built with skip_tokenizer_init=True")
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the generation config's overrides (vLLM's method of this name)."""
        return SamplingParams(**self.default_sampling_overrides)

    @property
    def spec_decode_stats(self):
        """Cumulative speculative-decoding counters (spec_decode.SpecDecodeStats), or None."""
        spec = self.engine.spec
        return None if spec is None else spec.stats.copy()

    # --------------------------------------------------------------------------------- public
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable[..., tqdm] = True, priority: Sequence[int] | None = None,
                 cache_salt: str | None = None, traffic_class: str | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`traffic_class`: the retention class (one of kv_retention's) of these requests' KV in a
        KV store; unset: "chat" (types/traffic_class.py). `lora_request`: the LoRA adapter of every
        prompt, or one per prompt (None: the base model); needs enable_lora=True."""
        traffic_class = traffic.resolve(traffic_class, self._facts.traffic_classes)
        prompts = _as_prompt_list(prompts)
        loras = self._lora_requests(lora_request, len(prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _broadcast(sampling_params, len(prompts), "sampling_params")
        priorities = _broadcast(list(priority) if priority is not None else 0, len(prompts), "priority")
        # generate() returns finished outputs only, so none is built before a request finishes
        # (vLLM's LLM does the same): building one per request per step cost the host time on
        # every step at full batch, while the device waited on it
        # (docs/benchmarks/design-measurements.md#generate-final-only).
        params = [dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        # Validate every prompt before adding any, so one bad prompt leaves no stray requests.
        prepared = [self._prepare(p, sp) for p, sp in zip(prompts, params)]
        ids = []
        for (text, token_ids, sp, images), prio, lora in zip(prepared, priorities, loras):
            ids.append(self._add_request(text, token_ids, sp, prio, cache_salt, traffic_class, images, lora))
        return self._run(ids, use_tqdm)

    def generate_as_completed(self, prompts: PromptType | Sequence[PromptType],
                              sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                              traffic_class: str | None = None) -> Iterator[tuple[int, RequestOutput]]:
        """generate(), yielding (index into prompts, output) as each request finishes, in the order
        they finish: a caller keeps each result at once while the others run (`deepinfer eval`
        appends each to its run file). Leaving the loop early aborts the requests not finished."""
        traffic_class = traffic.resolve(traffic_class, self._facts.traffic_classes)
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                  for sp in _broadcast(sampling_params, len(prompts), "sampling_params")]
        prepared = [self._prepare(p, sp) for p, sp in zip(prompts, params)]
        pending = {self._add_request(text, token_ids, sp, 0, None, traffic_class, images): index
                   for index, (text, token_ids, sp, images) in enumerate(prepared)}
        try:
            while pending and self.engine.has_unfinished():
                for out in self._step():
                    if out.finished and out.request_id in pending:
                        yield pending.pop(out.request_id), out
        finally:  # the caller stopped early: free the unfinished requests' blocks
            for request_id in pending:
                self.engine.abort(self.output_processor.abort(request_id))

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool | Callable[..., tqdm] = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             traffic_class: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Render each conversation (OpenAI chat messages) through the recipe, then generate.

        chat_template: a Jinja template (its text) instead of the model's format.
        tools: OpenAI tool definitions; a template that does not show tools gets them written
            into the messages, as the server's chat routes do.
        chat_template_kwargs: `enable_thinking` for every format, any other key a template variable.
        traffic_class: the KV store retention class; unset: "agent" when tools are given (and
            kv_retention has it), else "chat".
        lora_request: as generate's, per conversation.
        """
        traffic_class = traffic.resolve(traffic_class, self._facts.traffic_classes, offers_tools=bool(tools))
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self._chat_prompt(c, chat_template, add_generation_prompt, tools, chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, traffic_class=traffic_class,
                             lora_request=lora_request)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              use_tqdm: bool | Callable[..., tqdm] = True, truncate_prompt_tokens: int | None = None,
              cache_salt: str | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt: the final hidden states pooled as the engine's pooler_config
        says (default: the last token's, L2-normalized), vLLM's `LLM.embed`. Each prompt is a
        prefill with nothing sampled; prompts batch with each other (and with generation) in one
        step. truncate_prompt_tokens: keep only each prompt's last this many tokens. lora_request:
        as generate's (the adapter's hidden states are pooled)."""
        prompts = _as_prompt_list(prompts)
        params = _broadcast(pooling_params or PoolingParams(), len(prompts), "pooling_params")
        loras = self._lora_requests(lora_request, len(prompts))
        prepared = []
        for prompt, pooling in zip(prompts, params):   # every prompt checked before any is added
            text, token_ids = self._prompt_ids(prompt)
            if truncate_prompt_tokens is not None and len(token_ids) > truncate_prompt_tokens >= 1:
                text, token_ids = None, token_ids[-truncate_prompt_tokens:]
            if len(token_ids) > self.max_model_len:
                raise ValueError(f"the prompt is {len(token_ids)} tokens long, but max_model_len is "
                                 f"{self.max_model_len} (truncate_prompt_tokens cuts it)")
            why = check_dimensions(pooling.dimensions, self._chat_source.hf_config)
            if why is not None:
                raise ValueError(why)
            prepared.append((text, token_ids, pooling))
        ids = []
        for (text, token_ids, pooling), lora in zip(prepared, loras):
            request_id = str(next(self._counter))
            message = pooling_request(request_id, token_ids, pooling, self._facts, cache_salt=cache_salt, lora=lora)
            self.output_processor.add_pooling_request(request_id, text, token_ids)
            self.engine.add_request(to_request(message, self.config.cache.block_size))
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is produced (n must be 1)."""
        params = dataclasses.replace(sampling_params or self.get_default_sampling_params(),
                                     output_kind=RequestOutputKind.DELTA)
        if params.n != 1:
            raise ValueError(f"stream() produces one sequence; n must be 1, got {params.n}")
        text, token_ids, params, images = self._prepare(prompt, params)
        request_id = self._add_request(text, token_ids, params, 0, None, images=images)
        try:
            while True:
                for out in self._step():
                    if out.request_id == request_id:
                        if out.outputs[0].text:
                            yield out.outputs[0].text
                        if out.finished:
                            return
        finally:  # the caller stopped early: free the request's blocks
            self.engine.abort(self.output_processor.abort(request_id))

    def stream_chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None, *,
                    chat_template: str | None = None, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                    **template_kwargs: Any) -> Iterator[str]:
        """`chat()` for one conversation, yielding text as it is produced. Extra keyword
        arguments are template variables, as in chat_template_kwargs."""
        prompt = self._chat_prompt(messages, chat_template, add_generation_prompt, tools,
                                   {**(chat_template_kwargs or {}), **template_kwargs})
        return self.stream(prompt, sampling_params)

    # ------------------------------------------------------------------------------ internals
    def _step(self) -> list[RequestOutput]:
        """One engine step; stop strings found by the output processor end requests in the core."""
        processed = self.output_processor.process(self.engine.step())
        if processed.abort_ids:
            self.engine.abort(processed.abort_ids)
        return processed.request_outputs

    def _chat_prompt(self, messages: list[dict[str, Any]], chat_template: str | None, add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """One conversation as a prompt dict: the recipe's ids, and the rendered text beside them."""
        self._require_tokenizer("a chat")
        encoder = self._chat_encoders.get(chat_template)
        if encoder is None:
            # An explicit template wins over the format the architecture would pick.
            chat_format = "auto" if chat_template is None else "template"
            encoder = self._chat_encoders[chat_template] = make_encoder(self._chat_source, chat_format, chat_template)
        body: dict[str, Any] = {"messages": messages}
        if tools:
            body["tools"] = tools
        conversation = parse_request("chat", body)   # RequestError (a ValueError) names the bad field
        refuse_images(conversation, takes_images(self._chat_source.hf_config))
        loaded = self._images.load(conversation) if self._images is not None else []   # RequestError names a bad one
        conversation.add_generation_prompt = add_generation_prompt
        apply_template_kwargs(conversation, template_kwargs or {}, encoder)
        encoding = encoder.encode(conversation)
        if encoding.token_ids is None:
            raise ValueError(f"the chat format {encoder.name} has no tokenizer to encode the prompt with")
        images = self._images.inputs(encoding.token_ids, loaded) if loaded else None
        return {"prompt": encoding.rendered.text, "prompt_token_ids": encoding.token_ids, "image_inputs": images}

    def _require_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and this LLM was built with skip_tokenizer_init=True; "
                             "pass token ids instead (a list of ints, or {'prompt_token_ids': [...]})")

    def _prepare(self, prompt: PromptType, params: SamplingParams
                 ) -> tuple[str | None, list[int], SamplingParams, ImageInputs | None]:
        images = None
        if isinstance(prompt, dict) and (prompt.get("multi_modal_data") or prompt.get("image_inputs")):
            if self._images is None:
                raise ValueError("this model takes text only: multi_modal_data is not supported")
            images = prompt.get("image_inputs")
            if images is None:   # vLLM's multi_modal_data: the markers in the prompt are expanded here
                self._require_tokenizer("multi_modal_data")
                ids, images = self._images.for_prompt(prompt.get("prompt"), prompt.get("prompt_token_ids"),
                                                      prompt["multi_modal_data"], self.tokenizer)
                prompt = {**prompt, "prompt_token_ids": ids}
        text, token_ids = self._prompt_ids(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(token_ids)} tokens long, but max_model_len is "
                             f"{self.max_model_len}; it must be shorter to leave room for output")
        if params.bad_words:
            self._require_tokenizer("bad_words")
            params.update_from_tokenizer(self.tokenizer)
        params.verify_token_ids(self.vocab_size)
        if self.tokenizer is None:
            params = _without_text(params)
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)   # xgrammar's reason, as a ValueError
        return text, token_ids, params, images

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt; its ids checked against the vocabulary."""
        if isinstance(prompt, str):
            self._require_tokenizer("a text prompt")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):
            text = prompt.get("prompt")
            token_ids = prompt.get("prompt_token_ids")
            if token_ids is None:
                if text is None:
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
                self._require_tokenizer("a text prompt")
                token_ids = self.tokenizer.encode(text)
        else:
            text, token_ids = None, list(prompt)
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("the prompt is empty; it needs at least one token")
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return text, token_ids

    def _lora_requests(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                       num_prompts: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked against the model (a LoRAAdapterError,
        a ValueError, names what is wrong) before any request is added."""
        loras = _broadcast(lora_request, num_prompts, "lora_request")
        for lora in loras:
            if lora is not None and not isinstance(lora, LoRARequest):
                raise TypeError(f"lora_request must be a deepinfer.lora.LoRARequest (or None), got {type(lora).__name__}")
        return [self._loras.checked(lora) if lora is not None else None for lora in loras]

    def _add_request(self, text: str | None, token_ids: list[int], params: SamplingParams, priority: int,
                     cache_salt: str | None, traffic_class: str | None = None, images: ImageInputs | None = None,
                     lora: LoRARequest | None = None) -> str:
        request_id = str(next(self._counter))
        children = child_requests(request_id, token_ids, params, self._facts, priority=priority, cache_salt=cache_salt,
                                  traffic_class=traffic_class, images=images, lora=lora)
        self.output_processor.add_request(request_id, text, token_ids, params, lora_request=lora)
        for child in children:
            self.engine.add_request(to_request(child, self.config.cache.block_size))
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list:
        finished: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        bar = None
        if use_tqdm:
            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            bar = make_bar(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        start, n_in, n_out = time.perf_counter(), 0, 0
        while self.engine.has_unfinished():
            for out in self._step():
                if out.finished:
                    finished[out.request_id] = out
                    n_in += len(out.prompt_token_ids or ())
                    if isinstance(out, RequestOutput):
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                    if bar is not None:
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"est. speed input: {n_in / elapsed:.2f} toks/s, "
                                            f"output: {n_out / elapsed:.2f} toks/s", refresh=False)
                        bar.update(1)
        if bar is not None:
            bar.close()
        if self.engine.spec is not None:
            logger.info("Speculative decoding (cumulative): %s", self.engine.spec.stats.summary())
        return [finished[i] for i in request_ids]


def _without_text(params: SamplingParams) -> SamplingParams:
    """Params for an engine without a tokenizer: no text is made (vLLM forces detokenize off
    too), so what needs text is refused here with the reason rather than deeper down."""
    if params.stop:
        raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True); use stop_token_ids")
    if params.structured_outputs is not None:
        raise ValueError("structured outputs need a tokenizer, so they cannot be used with skip_tokenizer_init=True")
    return params if not params.detokenize else dataclasses.replace(params, detokenize=False)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
