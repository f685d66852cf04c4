"""The HTTP server: FastAPI app, shared routes, auth, error handling, and `run_server`.

    deepinfer serve [MODEL] --port 8000 --api-key KEY --served-model-name NAME

Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages
(+ /v1/messages/count_tokens), /tokenize, /detokenize, /health, /version, /metrics.
The engine core runs in its own process (engine/core_proc.py), started in the app's lifespan;
this process tokenizes, detokenizes and speaks HTTP.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import deepinfer
from deepinfer.config import EngineConfig
from deepinfer.entrypoints.errors import APIError, is_anthropic_path
from deepinfer.entrypoints.options import ServerOptions
from deepinfer.entrypoints.state import ServerState, get_state, read_json
from deepinfer.frontend.engine_client import AsyncEngineClient
from deepinfer.metrics.http import HTTPMetricsMiddleware
from deepinfer.models.loader import ModelSource

logger = logging.getLogger(__name__)

# Routes anyone may call even when --api-key is set (probes and scrapers carry no key).
_OPEN_PATHS = ("/health", "/version", "/metrics", "/docs", "/openapi.json", "/redoc")


def make_encoder(source: ModelSource, chat_format: str = "auto"):
    """The recipe encoder for chat routes: DeepSeek-V4 formats by name, else the model's own
    HF chat template (also for GGUF models, whose tokenizer exists only in memory)."""
    from deepinfer_recipe import get_encoder
    from deepinfer_recipe.encoders.hf_template import HFTemplateEncoder

    if chat_format == "auto":
        architectures = source.hf_config.get("architectures") or []
        chat_format = "deepseek-v4" if any("DeepseekV4" in a for a in architectures) else "template"
    if chat_format in ("deepseek-v4", "deepseek-v4.1"):
        import os

        tokenizer_json = os.path.join(source.path, "tokenizer.json")
        return get_encoder(chat_format, tokenizer_json if os.path.isfile(tokenizer_json) else None)
    if chat_format.startswith("hf:"):
        return get_encoder(chat_format)
    tok = source.tokenizer
    return HFTemplateEncoder.from_tokenizer(tok.backend, tok.chat_template, tok.bos_token, tok.eos_token,
                                            name=f"hf:{source.name}")


def build_app(config: EngineConfig, source: ModelSource, options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    api_key = options.api_key
    client = AsyncEngineClient(config, source, max_pending_requests=options.max_pending_requests,
                               metrics_vllm_names=options.metrics_vllm_names)
    state = ServerState(client, [client.model_id], api_key=api_key)
    try:
        state.encoder = make_encoder(source, options.chat_format)
    except Exception as e:   # no template: completions still work, chat routes say why not
        state.encoder_error = f"chat routes are unavailable for this model: {e}"
        logger.warning("%s", state.encoder_error)
    state.extra["root"] = source.path

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        try:
            yield
        finally:
            await client.shutdown()

    app = FastAPI(title="deepinfer", version=deepinfer.__version__, lifespan=lifespan)
    app.state.server = state

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and not request.url.path.startswith(_OPEN_PATHS):
            if not _key_matches(request, api_key):
                error = APIError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key').",
                                 code="invalid_api_key")
                return error.response(anthropic=is_anthropic_path(request.url.path))
        return await call_next(request)

    # Added after `authenticate`, so it runs outside it and counts its 401s too (as handler "none":
    # they never reach a route).
    app.add_middleware(HTTPMetricsMiddleware, metrics=client.metrics.http)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response(anthropic=is_anthropic_path(request.url.path))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        wrapped = APIError(500, f"internal error: {type(error).__name__}: {error}")
        return wrapped.response(anthropic=is_anthropic_path(request.url.path))

    from deepinfer.entrypoints.anthropic import messages
    from deepinfer.entrypoints.openai import chat, completions

    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(messages.router)
    _add_common_routes(app)
    return app


def _key_matches(request: Request, api_key: str) -> bool:
    bearer = request.headers.get("authorization", "")
    offered = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    return hmac.compare_digest(offered.encode(), api_key.encode())


def _add_common_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request):
        client = get_state(request).client
        if client.healthy:
            return Response(status_code=200)
        return JSONResponse({"status": "unhealthy", "reason": client.unhealthy_reason}, status_code=503)

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
        created = int(state.client.info.started) if state.client.info else int(time.time())
        data = [{"id": name, "object": "model", "created": created, "owned_by": "deepinfer",
                 "root": state.extra.get("root"), "max_model_len": state.max_model_len}
                for name in state.served_model_names]
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        state = get_state(request)
        body = await read_json(request)
        state.check_model(body)
        if "messages" in body:
            from deepinfer.entrypoints import conversation

            body.setdefault("max_tokens", 1)
            ids = conversation.prepare(state, "chat", body).prompt_token_ids
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError(400, "tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
            add_special = body.get("add_special_tokens", True)
            ids = state.client.tokenizer.encode(prompt, add_special_tokens=bool(add_special))
        result: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if body.get("return_token_strs"):
            result["token_strs"] = state.client.tokenizer.convert_ids_to_tokens(ids)
        return result

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state = get_state(request)
        body = await read_json(request)
        state.check_model(body)
        tokens = body.get("tokens")
        vocab = state.client.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise APIError(400, "detokenize needs 'tokens': a list of token ids", param="tokens")
        if any(not 0 <= t < vocab for t in tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": state.client.tokenizer.decode(tokens, skip_special_tokens=False)}


def run_server(config: EngineConfig, options: ServerOptions) -> None:
    import uvicorn

    from deepinfer.models.loader import load_model_source

    # The front end needs only config and tokenizer; the weights load in the core process.
    source = load_model_source(config.model.model)
    app = build_app(config, source, options)
    logger.info("serving %s on http://%s:%d", app.state.server.model_name, options.host, options.port)
    uvicorn.run(app, host=options.host, port=options.port, log_level=options.uvicorn_log_level,
                timeout_graceful_shutdown=5)
