"""The encode stage of E/P/D in the router (`deepinfer router --encoder URL ... --backend URL ...`).

A generation request whose body carries images (an OpenAI image_url part, an Anthropic image
block, a Responses input_image) is first sent, whole, to an encode instance (`deepinfer serve
--kv-role encode --kv-store S`) at POST /v1/encode?route=<the request's route>, which runs the
vision tower and writes each image's encoder output to the store S. The request then goes on as
any other (to a prefill replica under P/D, then a decode replica; or straight to a replica):
those instances, configured with the same store, load the outputs instead of encoding.

The encode stage is a saving, never a condition: an encode instance that is down, slow (past
--encoder-timeout-s) or answers an error leaves the images to the serving instance, which encodes
them itself (counted on both sides: here by outcome, there as store misses). Encode instances
are monitored as the router's replicas are (monitor.py: GET /health every --health-interval-s):
only healthy ones are tried, least busy first. One that refuses or breaks the connection is taken
out at once (the next healthy one is tried) and stays out until a probe finds it healthy again,
so a dead encoder costs at most the one request that found it dead, not one refused connection
per request. With none healthy, a request skips the stage (outcome `unavailable`).
"""

from __future__ import annotations

import logging

import aiohttp

from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.monitor import Monitor
from deepinfer.router.replica import Replica
from deepinfer.router.upstream import TRANSPORT_ERRORS, broke_connection

logger = logging.getLogger(__name__)

ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/responses")
IMAGE_PART_TYPES = {"image_url", "image", "input_image"}


def carries_images(body: dict) -> bool:
    """Whether a chat body has an image part in a message's content (any of the three protocols)."""
    messages = body.get("messages")
    if messages is None:
        messages = body.get("input")
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                             for p in content):
            return True
    return False


class EncodeStage:
    """Sends a request's images to the least busy healthy encode instance and waits for it."""

    def __init__(self, encoders: list[Replica], monitor: Monitor, timeout_s: float, metrics: RouterMetrics,
                 client: aiohttp.ClientSession) -> None:
        self.encoders = encoders
        self.monitor = monitor
        self.metrics = metrics
        self.client = client
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def run(self, path: str, body: dict | None, headers: dict[str, str]) -> str:
        """The outcome (ok, unavailable, failed, timeout, http_<status>; skipped: no image), also
        counted in /metrics."""
        if body is None or path not in ROUTES or not carries_images(body):
            return "skipped"   # not counted: most requests carry no image
        outcome = "unavailable"
        for encoder in sorted((e for e in self.encoders if e.healthy), key=lambda e: (e.in_flight, e.index)):
            if not encoder.healthy:   # found dead meanwhile by another request
                continue
            outcome = await self._encode_on(encoder, path, body, headers)
            if outcome != "gone":
                break
        outcome = "failed" if outcome == "gone" else outcome
        self.metrics.encode.labels(outcome).inc()
        return outcome

    async def _encode_on(self, encoder: Replica, path: str, body: dict, headers: dict[str, str]) -> str:
        encoder.in_flight += 1
        try:
            async with self.client.post(f"{encoder.url}/v1/encode", params={"route": path}, json=body,
                                        headers=headers, timeout=self.timeout) as response:
                await response.read()
            if response.status != 200:
                logger.warning("encode on %s answered %d; the serving instance encodes the images", encoder.url,
                               response.status)
                return f"http_{response.status}"
            encoder.routed += 1
            return "ok"
        except TRANSPORT_ERRORS as exc:
            if broke_connection(exc):   # out until a probe finds it back; a timeout only means slow
                logger.warning("encode on %s failed (%s: %s); trying another encoder", encoder.url,
                               type(exc).__name__, exc)
                self.monitor.mark_failed(encoder, f"encode: {type(exc).__name__}")
                return "gone"
            logger.warning("encode on %s timed out; the serving instance encodes the images", encoder.url)
            return "timeout"
        finally:
            encoder.in_flight -= 1
