"""What every route needs: the engine client, the recipe encoder, the served names, the key."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

from fastapi import Request

from deepinfer.entrypoints.errors import APIError
from deepinfer.frontend.engine_client import AsyncEngineClient, EngineDeadError, RequestFailedError, ServerBusyError

DISCONNECT_POLL_S = 0.5


@dataclass
class ServerState:
    client: AsyncEngineClient
    served_model_names: list[str]
    encoder: object | None = None          # deepinfer_recipe Encoder; None: no chat template
    encoder_error: str | None = None
    api_key: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    def check_model(self, body: dict) -> str:
        """The served name to answer with; a named model we do not serve is a 404."""
        model = body.get("model")
        if model is None:
            return self.model_name
        if not isinstance(model, str):
            raise APIError(400, f"model must be a string, got {model!r}", param="model")
        if model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def chat_encoder(self):
        if self.encoder is None:
            raise APIError(400, self.encoder_error or "this model has no chat template; use /v1/completions")
        return self.encoder


def get_state(request: Request) -> ServerState:
    return request.app.state.server


async def read_json(request: Request) -> dict:
    """The body as a JSON object; anything else is a 400 (never FastAPI's 422)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


@contextlib.contextmanager
def engine_errors():
    """Engine-side refusals as HTTP errors: queue full 429, engine gone 503, request failed 500."""
    try:
        yield
    except ServerBusyError as e:
        raise APIError(429, str(e), code="rate_limit_exceeded") from None
    except EngineDeadError as e:
        raise APIError(503, f"the engine is not available: {e}") from None
    except RequestFailedError as e:
        raise APIError(500, f"the request failed: {e}") from None


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, client: AsyncEngineClient, request_ids: list[str]):
    """Abort `request_ids` in the engine as soon as the HTTP client goes away, and on exit.

    Starlette only notices a vanished client when it next writes, and a request still queued
    in the core writes nothing; polling the connection frees its KV blocks promptly either way.
    Aborting on exit is a no-op for finished requests and stops any left running by an error."""
    async def watch() -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                for request_id in request_ids:
                    client.abort(request_id)
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        for request_id in request_ids:
            client.abort(request_id)
