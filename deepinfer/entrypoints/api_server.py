"""The HTTP server: FastAPI app, shared routes, auth, error handling, and `run_server`.

    deepinfer serve [MODEL] --port 8000 --api-key KEY --served-model-name NAME

Routes: /v1/models (+ /v1/models/{id}), /v1/completions, /v1/chat/completions, /v1/responses,
/v1/embeddings, /v1/messages (+ /v1/messages/count_tokens), /tokenize, /detokenize, /tokenizer_info, /health,
/ping, /version, /metrics; with LoRA runtime updating allowed, /v1/load_lora_adapter and
/v1/unload_lora_adapter (entrypoints/lora_routes.py).
The engine core runs in its own process (engine/core_proc.py), started in the app's lifespan;
this process tokenizes, detokenizes and speaks HTTP. If the core cannot be kept alive (it died
more than --max-engine-restarts times), the server stops and `run_server` exits with status 1.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import deepinfer
from deepinfer import envs
from deepinfer.chat import make_encoder
from deepinfer.config import EngineConfig, resolve_max_model_len
from deepinfer.entrypoints.errors import APIError, install_error_handlers
from deepinfer.entrypoints.lora_routes import adapter_card, adapter_cards, add_lora_routes, open_registry
from deepinfer.entrypoints.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from deepinfer.entrypoints.options import ServerOptions, request_body_limit
from deepinfer.entrypoints.state import ServerState, get_state, read_json
from deepinfer.frontend.engine_client import AsyncEngineClient
from deepinfer.metrics.http import HTTPMetricsMiddleware
from deepinfer.models.generation_config import default_sampling_overrides
from deepinfer.models.loader import ModelSource
from deepinfer.models.registry import takes_images
from deepinfer.multimodal.chat_images import ImageFrontEnd

logger = logging.getLogger(__name__)


def build_app(config: EngineConfig, source: ModelSource, options: ServerOptions | None = None,
              on_fatal=None, load_format: str = "auto") -> FastAPI:
    """`load_format="dummy"`: the core keeps random weights of the model's shape (LLM's option,
    `serve --load-format dummy`), for serving benchmarks of a real shape on a GPU."""
    options = options or ServerOptions()
    client = AsyncEngineClient(config, source, load_format=load_format,
                               max_pending_requests=options.max_pending_requests,
                               request_timeout_s=options.request_timeout_s,
                               max_engine_restarts=options.max_engine_restarts,
                               log_requests=options.enable_log_requests, log_stats=not options.disable_log_stats,
                               metrics_vllm_names=options.metrics_vllm_names, on_fatal=on_fatal)
    names = list(options.served_model_name) or [client.model_id]
    state = ServerState(client, names, options, takes_images=takes_images(source.hf_config),
                        images=ImageFrontEnd.from_source(config.multimodal, source),
                        body_limit=request_body_limit(options, resolve_max_model_len(config, source.hf_config)))
    open_registry(state, source.hf_config, config.lora, options.lora_module_list)   # --lora-modules, checked
    try:
        state.encoder = make_encoder(source, options.chat_format, options.chat_template)
    except Exception as e:   # no template: completions still work, chat routes say why not
        state.encoder_error = f"chat routes are unavailable for this model: {e}"
        logger.warning("%s", state.encoder_error)
    state.sampling_defaults = default_sampling_overrides(config.model.generation_config, source,
                                                         config.model.json_field("override_generation_config"))
    if state.sampling_defaults:
        logger.info("sampling defaults from the model's generation config (--generation-config %s): %s",
                    config.model.generation_config, state.sampling_defaults)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        try:
            yield
        finally:
            await client.shutdown()
            state.workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="deepinfer", version=deepinfer.__version__, lifespan=lifespan)
    # --root-path, as vLLM sets it: the app's own, so a path that still carries the prefix (a
    # proxy that forwards /llm/v1/...) and one the proxy stripped (/v1/...) both reach the routes.
    app.root_path = options.root_path
    app.state.server = state
    # The last added runs first: HTTP metrics see every answer (401s and 413s too, as handler
    # "none": they never reach a route), then the size check answers before the key check.
    if options.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key)
    app.add_middleware(BodySizeLimitMiddleware, limit=state.body_limit)
    app.add_middleware(HTTPMetricsMiddleware, metrics=client.metrics.http)
    # Outermost (vLLM's defaults beside --allowed-origins): a browser's preflight is answered
    # before the key check, and every answer, a 401 too, carries the CORS headers.
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_credentials=False,
                       allow_methods=["*"], allow_headers=["*"])

    install_error_handlers(app, "server")

    from deepinfer.entrypoints.anthropic import messages
    from deepinfer.entrypoints.openai import chat, completions, embeddings

    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(embeddings.router)
    app.include_router(messages.router)
    _add_common_routes(app)
    add_lora_routes(app)
    return app


def _created(state: ServerState) -> int:
    return int(state.client.info.started) if state.client.info else int(time.time())


def _model_card(state: ServerState, name: str) -> dict:
    """A served name's /v1/models entry, or a LoRA adapter's (its parent the base model)."""
    lora = state.resolve_model(name)[1]
    if lora is not None:
        return adapter_card(state, lora, _created(state))
    # `root` names the model, never its path on this machine.
    return {"id": name, "object": "model", "created": _created(state), "owned_by": "deepinfer",
            "root": state.client.model_id, "parent": None, "max_model_len": state.max_model_len}


def _add_common_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request):
        client = get_state(request).client
        if client.healthy:
            return Response(status_code=200)
        return JSONResponse({"status": "unhealthy", "reason": client.unhealthy_reason}, status_code=503,
                            headers={"Retry-After": "1"})

    @app.get("/ping")
    async def ping(request: Request):
        return await health(request)

    @app.get("/version")
    async def version():
        return {"version": deepinfer.__version__}

    @app.get("/metrics")
    async def metrics(request: Request):
        client = get_state(request).client
        return Response(client.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        state = get_state(request)
        return {"object": "list", "data": [_model_card(state, name) for name in state.served_model_names]
                + adapter_cards(state, _created(state))}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        state = get_state(request)
        return _model_card(state, state.check_model(model_id))

    if envs.torch_profiler_dir():   # vLLM's routes, present only when a trace directory is set
        @app.post("/start_profile")
        async def start_profile(request: Request):
            get_state(request).client.profile(start=True)
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile(request: Request):
            get_state(request).client.profile(start=False)
            return Response(status_code=200)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """What vLLM's /tokenizer_info gives (lm-eval's remote tokenizer reads it)."""
        state = get_state(request)
        tok = state.tokenizer()
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                "eos_token": tok.eos_token, "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                "chat_template": tok.chat_template, "model_max_length": state.max_model_len,
                "vocab_size": tok.vocab_size, "add_bos_token": tok.bos_token is not None}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        state = get_state(request)
        body = await read_json(request)
        return await state.run_off_loop(_tokenize, state, body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state = get_state(request)
        body = await read_json(request)
        state.check_model(body.get("model"))
        tokens = body.get("tokens")
        vocab = state.client.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise APIError(400, "detokenize needs 'tokens': a list of token ids", param="tokens")
        if any(not 0 <= t < vocab for t in tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": state.tokenizer().decode(tokens, skip_special_tokens=False)}


def _tokenize(state: ServerState, body: dict) -> dict:
    state.check_model(body.get("model"))
    # `protocol` (a deepinfer extension, for the router): tokenize a whole /v1/chat/completions
    # ("chat", the default with `messages`), /v1/messages ("messages") or /v1/responses
    # ("responses") body exactly as that route renders it.
    protocol = body.get("protocol", "chat" if "messages" in body else None)
    if protocol is not None:
        from deepinfer.entrypoints import conversation

        if protocol not in ("chat", "messages", "responses"):
            raise APIError(400, "protocol must be 'chat', 'messages' or 'responses'", param="protocol")
        # add_generation_prompt stays: the chat route takes it (vLLM's, as /tokenize's own is).
        chat = {k: v for k, v in body.items() if k not in ("add_special_tokens", "return_token_strs", "protocol")}
        if protocol != "responses":   # required by those schemas, irrelevant to the prompt
            chat.setdefault("max_tokens", 1)
        ids = conversation.prepare(state, protocol, chat).prompt_token_ids
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise APIError(400, "add_special_tokens must be a boolean", param="add_special_tokens")
        ids = state.tokenizer().encode_many([prompt], add_special)[0]
    result: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if body.get("return_token_strs"):
        result["token_strs"] = state.tokenizer().convert_ids_to_tokens(ids)
    return result


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, saying where it serves once the port answers: its lifespan (the engine
    core starting, the model loading) runs before the socket is bound, so a line logged before
    run() came long before anyone could connect."""

    def __init__(self, config: uvicorn.Config, model_name: str, root_path: str = "") -> None:
        super().__init__(config)
        self.model_name, self.root_path = model_name, root_path

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            config = self.config
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else config.port
            logger.info("serving %s on %s://%s:%d%s", self.model_name, "https" if config.is_ssl else "http",
                        config.host, port, self.root_path)


def run_server(config: EngineConfig, options: ServerOptions, *, load_format: str = "auto") -> None:
    from deepinfer.models.loader import model_source

    fatal: list[str] = []
    server: AnnouncingServer | None = None

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        if server is not None:
            server.should_exit = True

    # The front end needs only config and tokenizer; the weights load in the core process.
    source = model_source(config.model)
    app = build_app(config, source, options, on_fatal=on_fatal, load_format=load_format)
    server = AnnouncingServer(uvicorn.Config(app, host=options.host, port=options.port,
                                             ssl_keyfile=options.ssl_keyfile, ssl_certfile=options.ssl_certfile,
                                             log_level=options.uvicorn_log_level, timeout_graceful_shutdown=5),
                              app.state.server.model_name, options.root_path)
    server.run()
    if fatal:
        logger.critical("exiting: %s", fatal[0])
        sys.exit(1)
