"""`deepinfer serve --kv-role encode --kv-store S`: the encode instance of E/P/D.

It runs only the vision tower and projector (multimodal/vision_encoder.py): no language model,
no KV pool, no engine core. Its one route of work:

    POST /v1/encode[?route=/v1/chat/completions | /v1/messages | /v1/responses]
        body: the chat request itself (what `deepinfer router --encoder URL` forwards; the route
        says which protocol's image parts to read, chat completions by default)
        -> 200 {"model": ..., "images": [{"hash": H, "status": "written" | "present" | "failed"}]}
           every image of the request, in order: written to the store now, already there (not
           encoded again), or encoded but not written (the store down; a serving instance then
           encodes it itself)
        -> 400 {"error": {...}} when an image part is bad (the serving instance will say the same)

Each output goes to S (encoder_store.py, encoder_entry.py) under a key of the image hash, the
processor's settings and the model's name, revision, dtype and shape, where the prefill, decode
or colocated instances of the same model and store look before encoding. Also served: GET
/health, /v1/models, and /metrics (this instance's images encoded, encode time, entries written,
store errors).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from deepinfer_recipe import RequestError
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, generate_latest

from deepinfer.multimodal.chat_images import ImageFrontEnd, LoadedImage
from deepinfer.multimodal.encoder_store import EncoderStore
from deepinfer.multimodal.vision_encoder import build_vision_encoder

logger = logging.getLogger(__name__)

ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/responses")


def _conversation(route: str, body: dict):
    if route == "/v1/messages":
        from deepinfer_recipe.protocols.messages import to_conversation
    elif route == "/v1/responses":
        from deepinfer_recipe.protocols.responses import to_conversation
    else:
        from deepinfer_recipe.protocols.chat_completions import to_conversation
    return to_conversation(body)


class ImageEncoderService:
    """Images in, encoder outputs written to the store: the encode instance's work, apart from
    HTTP so that tests and the offline path drive it directly."""

    def __init__(self, encoder: Any, front_end: ImageFrontEnd, store: EncoderStore) -> None:
        self.encoder = encoder
        self.front_end = front_end
        self.store = store
        self._lock = threading.Lock()   # one batch through the tower at a time
        self.num_encoded = 0
        self.encode_seconds = 0.0

    @classmethod
    def for_source(cls, config: Any, source: Any, dtype: torch.dtype, device: torch.device,
                   backend: Any) -> ImageEncoderService:
        front_end = ImageFrontEnd.from_source(config.multimodal, source)
        if front_end is None:
            raise ValueError(f"--kv-role encode: the model {source.name} reads no images")
        encoder = build_vision_encoder(source, dtype, device)
        return cls(encoder, front_end, EncoderStore.for_model(backend, source, encoder, front_end.processor, dtype))

    def encode_request(self, route: str, body: dict) -> list[dict]:
        """Every image of a chat request: [{"hash", "status"}]; RequestError for a bad part."""
        return self.encode_loaded(self.front_end.load(_conversation(route, body)))

    def encode_loaded(self, images: list[LoadedImage]) -> list[dict]:
        out, todo = [], []
        for image in images:
            present = self.store.has(image.image_hash)
            out.append({"hash": image.image_hash, "status": "present" if present else None})
            if not present and image.image_hash not in {t.image_hash for t in todo}:
                todo.append(image)
        written: dict[str, bool] = {}
        by_shape: dict[tuple[int, ...], list[LoadedImage]] = {}
        for image in todo:
            by_shape.setdefault(image.pixels.shape, []).append(image)
        for batch in by_shape.values():
            with self._lock:
                began = time.perf_counter()
                pixel_values = torch.from_numpy(np.stack([self.front_end.processor.normalize(i.pixels) for i in batch]))
                embeds = self.encoder.encode_images(pixel_values)
                self.num_encoded += len(batch)
                self.encode_seconds += time.perf_counter() - began
            for image, embed in zip(batch, embeds):
                written[image.image_hash] = self.store.save(image.image_hash, embed)
        for item in out:
            if item["status"] is None:
                item["status"] = "written" if written.get(item["hash"]) else "failed"
        return out


def build_encode_app(service: ImageEncoderService, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="deepinfer encode instance")
    registry = CollectorRegistry(auto_describe=True)
    requests = Counter("deepinfer:encode_requests", "Encode requests, by outcome.", ["outcome"], registry=registry)
    if api_key:
        from deepinfer.entrypoints.middleware import APIKeyMiddleware

        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.post("/v1/encode")
    async def encode(request: Request, route: str = "/v1/chat/completions"):
        if route not in ROUTES:
            return JSONResponse({"error": {"message": f"route must be one of {', '.join(ROUTES)}",
                                           "type": "invalid_request_error"}}, status_code=400)
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            images = await run_in_threadpool(service.encode_request, route, body)
        except RequestError as exc:
            requests.labels("bad_request").inc()
            return JSONResponse({"error": {"message": exc.message, "param": exc.path,
                                           "type": "invalid_request_error"}}, status_code=400)
        except ValueError as exc:   # not JSON
            requests.labels("bad_request").inc()
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, status_code=400)
        requests.labels("ok").inc()
        return {"model": model_name, "images": images}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "deepinfer",
                                            "root": model_name}]}

    @app.get("/metrics")
    async def metrics():
        store = service.store.counters()
        lines = [generate_latest(registry).decode()]
        for name, doc, value in (
                ("encoder_images_encoded", "Images run through the vision tower here.", service.num_encoded),
                ("encoder_encode_seconds", "Seconds spent in the vision tower and projector.", service.encode_seconds),
                ("encoder_store_written", "Encoder outputs written to the store.", store["store_written"]),
                ("encoder_store_errors", "Calls to the store that failed (down, unreachable).", store["store_errors"])):
            lines.append(f"# HELP deepinfer:{name}_total {doc}\n# TYPE deepinfer:{name}_total counter\n"
                         f'deepinfer:{name}_total{{model_name="{model_name}"}} {float(value)}\n')
        return Response("".join(lines), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def run_encode_server(config: Any, options: Any) -> None:
    """`deepinfer serve --kv-role encode`: the vision encoder behind /v1/encode on options' host and port."""
    import uvicorn

    from deepinfer.kv_cache.store.factory import open_kv_store
    from deepinfer.models.loader import model_source
    from deepinfer.platforms import current_platform

    platform = current_platform()
    # The serving instances' dtype rule (worker/model_runner.py): the same outputs, the same key.
    dtype = platform.default_dtype if config.model.dtype == "auto" else getattr(torch, config.model.dtype)
    source = model_source(config.model)
    service = ImageEncoderService.for_source(config, source, dtype, platform.device, open_kv_store(config))
    name = (options.served_model_name or (source.name,))[0]
    logger.info("encode instance for %s: encoder outputs to %s", name, service.store.backend.url)
    uvicorn.run(build_encode_app(service, name, options.api_key), host=options.host, port=options.port,
                log_level=options.uvicorn_log_level)
