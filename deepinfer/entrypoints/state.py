"""What every route needs: the engine client, the recipe encoder, the options, and the helpers
that keep a route's failure modes uniform (body parsing, engine errors, client disconnects,
CPU-heavy work off the event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from deepinfer.entrypoints.body import decode_json, read_body
from deepinfer.entrypoints.errors import APIError
from deepinfer.entrypoints.options import ServerOptions
from deepinfer.frontend.engine_client import (
    RETRY_AFTER_S,
    AsyncEngineClient,
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    RequestTimeoutError,
    ServerBusyError,
)

if TYPE_CHECKING:
    from deepinfer.lora.registry import LoRARegistry
    from deepinfer.types.lora import LoRARequest


@dataclass
class ServerState:
    client: AsyncEngineClient
    served_model_names: list[str]
    options: ServerOptions = field(default_factory=ServerOptions)
    encoder: object | None = None          # deepinfer_recipe Encoder; None: no chat template
    encoder_error: str | None = None
    # generation_config.json defaults for fields a request leaves out (--generation-config).
    sampling_defaults: dict = field(default_factory=dict)
    # Whether the model reads images (models/registry.takes_images); a text-only model refuses them.
    takes_images: bool = False
    # Its images' front end (multimodal/chat_images.ImageFrontEnd: limits, fetching, decoding), or None.
    images: Any = None
    # The largest body accepted (options.request_body_limit: the flag, else in proportion to the context).
    body_limit: int = 16 << 20
    # Validation, template rendering and tokenization of big requests run here, so the event loop
    # (every other request's tokens, /health) never waits on them. The tokenizer releases the
    # interpreter while it encodes; pure-Python work still shares it, one switch interval
    # (sys.getswitchinterval) at a time.
    workers: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "deepinfer-prepare"))
    _longest_token: dict = field(default_factory=dict)   # id(tokenizer backend) -> its longest token's characters
    # The LoRA adapters requests may name as their `model` (lora/registry.py); None: --enable-lora is off.
    loras: LoRARegistry | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    def check_model(self, model) -> str:
        """The served name to answer with: the first --served-model-name, whichever of the names
        the request gave (so a client that asked for an alias learns which model answered), or
        the LoRA adapter's name when `model` names one; a named model we do not serve is a 404."""
        return self.resolve_model(model)[0]

    def resolve_model(self, model) -> tuple[str, LoRARequest | None]:
        """check_model's name, and the LoRA adapter the request runs under (None: the base
        model), looked up once: an adapter unloaded meanwhile is a 404, never the base model."""
        if model is not None and not isinstance(model, str):
            raise APIError(400, f"model must be a string, got {model!r}", param="model")
        if model is None or model in self.served_model_names:
            return self.model_name, None
        lora = self.loras.get(model) if self.loras is not None else None
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return lora.lora_name, lora

    def chat_encoder(self):
        if self.encoder is None:
            raise APIError(400, self.encoder_error or "this model has no chat template; use /v1/completions")
        return self.encoder

    def tokenizer(self):
        """The tokenizer, or a 400 when the server runs without one (--skip-tokenizer-init)."""
        tokenizer = self.client.tokenizer
        if tokenizer is None:
            raise APIError(400, "the server runs without a tokenizer (--skip-tokenizer-init): send prompts "
                                "as token ids to /v1/completions")
        return tokenizer

    def prompt_char_limit(self, encoder=None) -> int | None:
        """The most characters a prompt that fits the context can have: max_model_len tokens, none
        longer than the vocabulary's longest token (`encoder`'s for a chat, else the model's).
        Longer text is refused before it is tokenized. None: no tokenizer to bound it by."""
        tokenizer = self.client.tokenizer if encoder is None else encoder.tokenizer
        if tokenizer is None:
            return None
        backend = tokenizer.backend if encoder is None else tokenizer.full
        longest = self._longest_token.get(id(backend))
        if longest is None:
            from deepinfer.tokenizer import longest_token_chars

            longest = self._longest_token[id(backend)] = longest_token_chars(backend)
        return self.max_model_len * longest

    def tokens_as_ids(self, fields) -> bool:
        """vLLM's return_tokens_as_token_ids: the request's, else the server's flag."""
        value = getattr(fields, "return_tokens_as_token_ids", None)
        return self.options.return_tokens_as_token_ids if value is None else value

    def sampling_params(self, fields, **kwargs):
        """sampling.build with this server's limits, vocabulary and generation defaults."""
        from deepinfer.entrypoints import sampling

        kwargs.setdefault("detokenize", True)
        kwargs["detokenize"] = kwargs["detokenize"] and self.client.tokenizer is not None
        return sampling.build(fields, options=self.options, vocab_size=self.client.vocab_size,
                              defaults=self.sampling_defaults, tokenizer=self.client.tokenizer, **kwargs)

    async def run_off_loop(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` in a worker thread; its exceptions (APIError included) propagate."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.workers, functools.partial(fn, *args, **kwargs))


def get_state(request: Request) -> ServerState:
    return request.app.state.server


async def read_json(request: Request) -> dict:
    """The body as a JSON object within the size and nesting limits; anything else is a 4xx
    (never FastAPI's 422). Large bodies are decoded off the event loop."""
    state = get_state(request)
    raw = await read_body(request, state.body_limit)
    if len(raw) < 1 << 16:
        return decode_json(raw, state.options.max_json_depth)
    return await state.run_off_loop(decode_json, raw, state.options.max_json_depth)


def engine_error(error: BaseException) -> APIError | None:
    """The HTTP error for an engine-side failure, or None if `error` is not one."""
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(error, ServerBusyError):
        return APIError(429, str(error), code="rate_limit_exceeded", headers=retry)
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine is not available: {error}", code="engine_unavailable", headers=retry)
    if isinstance(error, RequestTimeoutError):
        return APIError(408, str(error), code="request_timeout")
    if isinstance(error, RequestFailedError):
        return APIError(500, f"the request failed: {error}", code="request_failed")
    if isinstance(error, RequestAbortedError):
        return APIError(499, "the client closed the request")
    return None


@contextlib.contextmanager
def engine_errors():
    """Engine-side refusals and failures as HTTP errors (429, 503, 408, 500, 499)."""
    try:
        yield
    except (ServerBusyError, EngineDeadError, RequestTimeoutError, RequestFailedError, RequestAbortedError) as e:
        raise engine_error(e) from None


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, client: AsyncEngineClient, request_ids: list[str]):
    """Abort `request_ids` in the engine as soon as the HTTP client goes away, and on exit.

    After the body is read, the server's next ASGI message for this request is
    `http.disconnect`, sent when the client closes the connection: one waiting task per request,
    no polling. Aborting on exit is a no-op for finished requests and stops any left running by
    an error."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for request_id in request_ids:
            client.abort(request_id)

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        for request_id in request_ids:
            client.abort(request_id)
