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
are tried least busy first; one that refuses the connection is skipped until a later request
finds it back, so a dead one costs one refused connection per request at most.
"""

from __future__ import annotations

import logging

import aiohttp

from deepinfer.router.metrics import RouterMetrics
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
    def __init__(self, urls: tuple[str, ...], timeout_s: float, metrics: RouterMetrics,
                 client: aiohttp.ClientSession) -> None:
        self.urls = list(urls)
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.metrics = metrics
        self.client = client
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def run(self, path: str, body: dict | None, headers: dict[str, str]) -> str:
        """The outcome (ok, skipped, failed, timeout, http_<status>), also counted in /metrics."""
        if body is None or path not in ROUTES or not carries_images(body):
            return "skipped"   # not counted: most requests carry no image
        outcome = "failed"
        for url in sorted(self.urls, key=lambda u: self.in_flight[u]):
            outcome = await self._encode_on(url, path, body, headers)
            if outcome != "gone":
                break
        outcome = "failed" if outcome == "gone" else outcome
        self.metrics.encode.labels(outcome).inc()
        return outcome

    async def _encode_on(self, url: str, path: str, body: dict, headers: dict[str, str]) -> str:
        self.in_flight[url] += 1
        try:
            async with self.client.post(f"{url}/v1/encode", params={"route": path}, json=body, headers=headers,
                                        timeout=self.timeout) as response:
                await response.read()
            if response.status != 200:
                logger.warning("encode on %s answered %d; the serving instance encodes the images", url,
                               response.status)
                return f"http_{response.status}"
            return "ok"
        except TRANSPORT_ERRORS as exc:
            if broke_connection(exc):
                logger.warning("encode on %s failed (%s: %s); trying another encoder", url, type(exc).__name__, exc)
                return "gone"
            logger.warning("encode on %s timed out; the serving instance encodes the images", url)
            return "timeout"
        finally:
            self.in_flight[url] -= 1
