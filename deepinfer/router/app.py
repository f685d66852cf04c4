"""The router's FastAPI app and `run_router` (`deepinfer router --backend URL ... --policy P`).

Routes (what `deepinfer serve` serves, so a client cannot tell the two apart):
    routed by the policy, behind admission:  POST /v1/chat/completions, /v1/completions,
                                             /v1/responses, /v1/messages
    forwarded to the least-loaded replica:   POST /v1/messages/count_tokens, /tokenize, /detokenize;
                                             GET /v1/models, /v1/models/{id}, /tokenizer_info, /version
    the router's own:                        GET /health and /ping (200 while any replica is healthy,
                                             else 503), /metrics (metrics.py), /router/replicas (JSON
                                             state of every replica, for operators and tests)
With --prefill URL ..., each generation request's prompt is first computed on a prefill replica
(disaggregation.py); with --encoder URL ..., a request carrying images first has them encoded
on an encode instance (encode_stage.py). With --api-key the router checks the key itself (the server's middleware, same open paths) and
sends it on, or --backend-api-key instead.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import deepinfer
from deepinfer.entrypoints.errors import install_error_handlers
from deepinfer.entrypoints.middleware import APIKeyMiddleware
from deepinfer.router.disaggregation import PrefillStage
from deepinfer.router.encode_stage import EncodeStage
from deepinfer.router.kv_index import KVEventSubscriber, KVIndex
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.monitor import Monitor
from deepinfer.router.options import RouterOptions
from deepinfer.router.policy import make_policy
from deepinfer.router.proxy import Proxy
from deepinfer.router.replica import Replica
from deepinfer.router.upstream import make_session

logger = logging.getLogger(__name__)

POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
               "/v1/messages/count_tokens", "/tokenize", "/detokenize")
GET_ROUTES = ("/v1/models", "/tokenizer_info", "/version")


def build_app(options: RouterOptions) -> FastAPI:
    replicas = [Replica(url, i, options.kv_events_of(i)) for i, url in enumerate(options.backends)]
    prefill_replicas = [Replica(url, i, None) for i, url in enumerate(options.prefill_backends)]
    encoders = [Replica(url, i, None) for i, url in enumerate(options.encoder_backends)]
    index = KVIndex(len(replicas))
    metrics = RouterMetrics()
    policy = make_policy(options.policy, index, options)
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # One pooled aiohttp session for every replica and every loop (upstream.py says how it is set).
        client = make_session(options)
        monitor = Monitor(replicas, index, metrics, options, client)
        # Prefill replicas are probed and scraped alike, but never routed to by the policy.
        prefill_monitor = Monitor(prefill_replicas, KVIndex(len(prefill_replicas)), metrics, options, client)
        subscriber = KVEventSubscriber(index, [r.kv_events for r in replicas], options.kv_events_topic)
        prefill = PrefillStage(prefill_replicas, prefill_monitor, metrics, options, client) if prefill_replicas else None
        # Encode instances too: probed so that a dead one is skipped until it answers /health again.
        encode_monitor = Monitor(encoders, KVIndex(len(encoders)), metrics, options, client, kind="encoder",
                                 scrape=False)
        encode = EncodeStage(encoders, encode_monitor, options.encoder_timeout_s, metrics, client) if encoders else None
        state["proxy"] = Proxy(replicas, index, policy, metrics, monitor, options, client, prefill, encode)
        # A first probe of every replica before serving, so the first requests have somewhere to go.
        for r in replicas:
            await monitor.probe_once(r)
        for r in prefill_replicas:
            await prefill_monitor.probe_once(r)
        for r in encoders:
            await encode_monitor.probe_once(r)
        monitor.start()
        prefill_monitor.start()
        encode_monitor.start()
        subscriber.start()
        logger.info("router: %s over %d replicas (%d healthy now)", options.policy, len(replicas),
                    sum(r.healthy for r in replicas))
        try:
            yield
        finally:
            await monitor.stop()
            await prefill_monitor.stop()
            await encode_monitor.stop()
            await subscriber.stop()
            await client.close()

    app = FastAPI(title="deepinfer router", version=deepinfer.__version__, lifespan=lifespan)
    app.state.router = state
    if options.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key)

    install_error_handlers(app, "router")

    async def forward(request: Request):
        return await state["proxy"].handle(request, request.url.path)

    for path in POST_ROUTES:
        app.add_api_route(path, forward, methods=["POST"])
    for path in GET_ROUTES:
        app.add_api_route(path, forward, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", forward, methods=["GET"])

    @app.get("/health")
    async def health():
        if any(r.healthy for r in replicas):
            return Response(status_code=200)
        return JSONResponse({"status": "unhealthy", "reason": "no healthy replica"}, status_code=503,
                            headers={"Retry-After": "1"})

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/metrics")
    async def router_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/replicas")
    async def replica_states():
        return {"policy": options.policy, "replicas": [
            {**r.snapshot(), "kv_blocks_indexed": len(index.device[r.index]),
             "kv_events_seen": index.events_seen[r.index]} for r in replicas],
            "store_blocks_indexed": len(index.store),
            "prefill_replicas": [r.snapshot() for r in prefill_replicas],
            "encoders": [r.snapshot() for r in encoders]}

    return app


def run_router(options: RouterOptions) -> None:
    import uvicorn

    app = build_app(options)
    uvicorn.run(app, host=options.host, port=options.port, log_level=options.uvicorn_log_level,
                timeout_keep_alive=30)
