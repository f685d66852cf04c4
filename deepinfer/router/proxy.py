"""Forwarding one request: choose, admit, send, retry before the first byte, stream through.

The invariants, in the order a request meets them:
  1. No healthy replica: 503 (Retry-After), at once; nothing waits for one to come back.
  2. Admission (admission.py) before any forwarding: a request no replica can admit is a 429
     and has cost the replicas nothing.
  3. Retries happen only before the client has been sent a byte. A connection error, a replica
     503/502/504, or a body that breaks off while the router is still reading a non-streaming
     answer: the next replica in the policy's order is tried (at most --max-attempts). A
     connection error also takes the replica out of routing at once (passive detection), and
     its KV index entries with it, so the cache policies stop preferring it; the same for the
     replica the cache policies ask for a prompt's tokens (the next one is asked).
  4. Once the first byte of a stream went to the client, the status line is sent and cannot
     change. The stream is passed through chunk by chunk as it arrives (no buffering, no
     re-framing); if the replica breaks off, the client gets one last error event in the
     route's protocol (OpenAI: `data: {"error": ...}` then `data: [DONE]`; Responses and
     Anthropic: an `event: error`), the same frames the server sends (entrypoints/sse.py).
  5. The router's in-flight count of a replica is decremented exactly once per attempt, in a
     `finally`, also when the client goes away mid-stream (Starlette cancels the generator; the
     upstream response is closed, so the replica sees the disconnect and aborts the request).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from deepinfer.entrypoints.errors import APIError, is_anthropic_path
from deepinfer.router import admission
from deepinfer.router.disaggregation import PrefillStage
from deepinfer.router.encode_stage import EncodeStage
from deepinfer.router.kv_index import KVIndex, PromptHashes
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.monitor import Monitor
from deepinfer.router.options import RouterOptions
from deepinfer.router.policy import Choice, Policy, by_load
from deepinfer.router.replica import Replica
from deepinfer.router.upstream import TRANSPORT_ERRORS, broke_connection, read_timed_out

logger = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
# Hop-by-hop headers and those aiohttp/uvicorn recompute (the body's length and framing, the
# host); never copied across. Content-Encoding is copied: the bytes pass through undecoded.
_DROP_REQUEST = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                 "proxy-connection", "te", "trailer"}
_DROP_RESPONSE = _DROP_REQUEST | {"date", "server"}
_RETRY_STATUS = {502, 503, 504}
_TOKENIZE_PROTOCOL = {"/v1/chat/completions": "chat", "/v1/messages": "messages", "/v1/responses": "responses"}
REPLICA_HEADER = "x-deepinfer-replica"


class ReplicaGone(Exception):
    """The replica asked for a prompt's tokens refused or dropped the connection (now out of routing)."""


@dataclass
class Routed:
    choice: Choice
    prompt_blocks: int
    block_size: int


def _error_events(path: str, error: APIError) -> list[bytes]:
    """entrypoints/sse.py's error frames, per protocol."""
    enc = msgspec.json.encode
    if is_anthropic_path(path):
        body = error.anthropic_body()
        return [b"event: error\ndata: " + enc(body) + b"\n\n"]
    if path.startswith("/v1/responses"):
        body = {"type": "error", "code": str(error.status), "message": error.message, "param": None}
        return [b"event: error\ndata: " + enc(body) + b"\n\n"]
    return [b"data: " + enc(error.openai_body()) + b"\n\n", b"data: [DONE]\n\n"]


class Proxy:
    def __init__(self, replicas: list[Replica], index: KVIndex, policy: Policy, metrics: RouterMetrics,
                 monitor: Monitor, options: RouterOptions, client: aiohttp.ClientSession,
                 prefill: PrefillStage | None = None, encode: EncodeStage | None = None) -> None:
        self.replicas = replicas
        self.encode = encode     # E/P/D: the images encoded on an encode instance first (encode_stage.py)
        self.prefill = prefill   # P/D: the prompt computed on a prefill replica first (disaggregation.py)
        self.index = index
        self.policy = policy
        self.metrics = metrics
        self.monitor = monitor
        self.options = options
        self.client = client
        # The router's own look-up before routing: short, and bounded as a whole.
        self.tokenize_timeout = aiohttp.ClientTimeout(total=options.health_timeout_s)

    # ------------------------------------------------------------------------------ headers
    def _upstream_headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        if self.options.backend_api_key:
            headers = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "x-api-key")}
            headers["authorization"] = f"Bearer {self.options.backend_api_key}"
        return headers

    @staticmethod
    def _downstream_headers(response: aiohttp.ClientResponse, replica: Replica) -> dict[str, str]:
        # A header the replica sent more than once is folded into one comma-joined value.
        out: dict[str, str] = {}
        for name, value in response.headers.items():
            key = name.lower()
            if key not in _DROP_RESPONSE:
                out[key] = f"{out[key]}, {value}" if key in out else value
        out[REPLICA_HEADER] = replica.url
        return out

    # ------------------------------------------------------------------------------ routing
    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    async def _token_ids(self, path: str, body: dict, replica: Replica, headers: dict) -> list[int] | None:
        """The prompt's token ids from `replica`'s /tokenize; None when they cannot be known there.
        A replica found dead here is taken out of routing at once (ReplicaGone), so the caller asks
        another one and the policy never chooses it."""
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None   # a batch of prompts: routed by load
            payload = {"prompt": prompt, "model": body.get("model")}
        else:
            payload = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            payload["protocol"] = _TOKENIZE_PROTOCOL[path]
        # The router reads this answer itself, and the session does not decompress.
        own = {k: v for k, v in headers.items() if k != "accept-encoding"}
        try:
            async with self.client.post(replica.url + "/tokenize", json=payload, headers=own,
                                        timeout=self.tokenize_timeout) as response:
                if response.status != 200:
                    return None   # the route itself will say what is wrong with the body
                return (await response.json(content_type=None)).get("tokens")
        except TRANSPORT_ERRORS as exc:
            if broke_connection(exc):
                self.monitor.mark_failed(replica, f"/tokenize: {type(exc).__name__}: {exc}")
                raise ReplicaGone from None
            return None   # slow: routed without the prompt's hashes rather than waiting longer
        except ValueError:
            return None

    async def _hashes(self, path: str, body: dict | None, healthy: list[Replica],
                      headers: dict) -> tuple[PromptHashes | None, int, int]:
        """The prompt's block hashes (None: unknown), its full blocks, and the block size. The
        least-loaded replica that knows the hashing facts is asked for the tokens; one found dead
        is taken out and the next asked. A `model` other than the replica's served names is a
        LoRA adapter: its chains are per replica (kv_index.py)."""
        if body is None or path not in GENERATION_ROUTES:
            return None, 0, 0
        for facts in [r for r in by_load(healthy) if r.model_id and r.scraped.block_size]:
            try:
                ids = await self._token_ids(path, body, facts, headers)
            except ReplicaGone:
                continue
            if not ids:
                return None, 0, 0
            bs = facts.scraped.block_size
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            model = body.get("model")
            adapter = model if isinstance(model, str) and facts.served_names and \
                model not in facts.served_names else None
            hashes = self.index.prompt_hashes(
                ids, [r.index for r in healthy], adapter=adapter,
                model_name=self.options.hash_model_name or facts.model_id, model_id=facts.model_id, block_size=bs,
                kv_cache_dtype=facts.scraped.kv_cache_dtype or "auto", cache_salt=salt)
            return hashes, hashes.blocks, bs
        return None, 0, 0

    # ------------------------------------------------------------------------------ handling
    def _no_healthy_replica(self) -> APIError:
        self.metrics.rejected.labels("no_healthy_replica").inc()
        return APIError(503, "no healthy replica behind the router", headers={"Retry-After": "1"})

    async def handle(self, request: Request, path: str) -> Response:
        start = time.perf_counter()
        raw = await request.body()
        body = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None   # forwarded as it is: the replica answers the 400
            if not isinstance(body, dict):
                body = None
        headers = self._upstream_headers(request)
        healthy = self.healthy()
        if not healthy:
            raise self._no_healthy_replica()
        generation = path in GENERATION_ROUTES and request.method == "POST"
        hashes, prompt_blocks, block_size = None, 0, 0
        if generation and self.policy.needs_hashes:
            hashes, prompt_blocks, block_size = await self._hashes(path, body, healthy, headers)
            healthy = self.healthy()   # without any replica the look-up found dead
            if not healthy:
                raise self._no_healthy_replica()
        if generation:
            ok, reasons = admission.admissible(healthy, self.options, prompt_blocks)
            if not ok:
                self.metrics.rejected.labels("admission").inc()
                raise APIError(429, "no replica can admit this request now (" + "; ".join(reasons) + ")",
                               headers={"Retry-After": str(self.options.retry_after_s)})
            choice = self.policy.choose(ok, hashes)
        else:
            choice = Choice(by_load(healthy), reason="load")
        self.metrics.routing.observe(time.perf_counter() - start)
        routed = Routed(choice, prompt_blocks, block_size)
        stream = bool(body and body.get("stream"))
        if generation and self.encode is not None:
            await self.encode.run(path, body, headers)
        if generation and self.prefill is not None:
            await self.prefill.run(path, body, headers)
        return await self._forward(request, path, raw, headers, routed, stream, start)

    async def _forward(self, request: Request, path: str, raw: bytes, headers: dict, routed: Routed,
                       stream: bool, start: float) -> Response:
        route = path if path in GENERATION_ROUTES else "other"
        errors: list[str] = []
        url_path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        for attempt, replica in enumerate(routed.choice.order[:self.options.max_attempts]):
            replica.in_flight += 1
            blocks = routed.prompt_blocks + 1
            replica.in_flight_blocks += blocks
            released = False
            sent = time.perf_counter()

            def release(ok: bool, replica=replica, blocks=blocks, sent=sent) -> None:
                nonlocal released
                if released:
                    return
                released = True
                replica.in_flight -= 1
                replica.in_flight_blocks -= blocks
                if ok:
                    replica.observe_duration(time.perf_counter() - sent)

            self.metrics.requests.labels(replica.url, route).inc()
            replica.routed += 1
            try:
                # Returns once the status line and headers are in; the body is read below.
                # A redirect is the replica's answer to the client, not the router's to follow.
                response = await self.client.request(request.method, replica.url + url_path, data=raw or None,
                                                     headers=headers, allow_redirects=False)
            except TRANSPORT_ERRORS as exc:
                release(False)
                if read_timed_out(exc):   # reached but slow: another replica would be no faster
                    raise APIError(504, f"replica {replica.url} did not answer in time: "
                                        f"{type(exc).__name__}") from None
                self._failed_before_first_byte(replica, exc, errors, passive=True)
                continue
            if response.status in _RETRY_STATUS and attempt + 1 < min(len(routed.choice.order),
                                                                       self.options.max_attempts):
                response.release()   # closes the connection unless the (short) body was already in
                release(False)
                self._failed_before_first_byte(replica, f"HTTP {response.status}", errors, passive=False)
                continue
            out_headers = self._downstream_headers(response, replica)
            is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
            if not (stream and is_sse):
                try:
                    content = await response.read()   # then the connection is back in the pool
                except TRANSPORT_ERRORS as exc:
                    release(False)
                    response.close()
                    self._failed_before_first_byte(replica, exc, errors, passive=True)
                    continue
                release(response.status < 500)
                now = time.perf_counter()
                self.metrics.first_byte.labels(route).observe(now - start)
                self.metrics.duration.labels(route).observe(now - start)
                # The bytes are the replica's, still in its Content-Encoding if any; Response sets
                # the length of what it sends.
                self._count_cached(replica, routed, content, route)
                return Response(content, status_code=response.status, headers=out_headers)
            # A stream: wait for its first chunk here, so a replica that fails before it can
            # still be replaced by another (invariant 3). iter_any yields what has arrived, as
            # it arrives: no buffering up to a size or a line.
            chunks = response.content.iter_any()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except TRANSPORT_ERRORS as exc:
                release(False)
                response.close()
                self._failed_before_first_byte(replica, exc, errors, passive=True)
                continue
            self.metrics.first_byte.labels(route).observe(time.perf_counter() - start)
            return StreamingResponse(self._relay(path, route, replica, response, first, chunks, release, start),
                                     status_code=response.status, headers=out_headers,
                                     media_type=response.headers.get("content-type"))
        self.metrics.rejected.labels("replicas_failed").inc()
        raise APIError(502, "no replica could answer: " + "; ".join(errors) if errors else "no replica to try",
                       headers={"Retry-After": "1"})

    def _failed_before_first_byte(self, replica: Replica, exc, errors: list[str], *, passive: bool) -> None:
        reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        errors.append(f"{replica.url}: {reason}")
        self.metrics.retries.labels(replica.url).inc()
        logger.warning("replica %s failed before the first byte (%s); trying another", replica.url, reason)
        if passive:
            self.monitor.mark_failed(replica, str(reason))

    async def _relay(self, path: str, route: str, replica: Replica, response: aiohttp.ClientResponse,
                     first: bytes, chunks: AsyncIterator[bytes], release, start: float) -> AsyncIterator[bytes]:
        ok = False
        try:
            if first:
                yield first
            try:
                async for chunk in chunks:
                    yield chunk
                ok = True
            except TRANSPORT_ERRORS as exc:
                # Invariant 4: the status went out with the first chunk; end with an error event.
                self.metrics.stream_errors.labels(replica.url).inc()
                logger.warning("stream from %s cut after its first byte: %s: %s", replica.url,
                               type(exc).__name__, exc)
                if broke_connection(exc):   # a read timeout leaves a slow replica in routing
                    self.monitor.mark_failed(replica, f"stream cut: {type(exc).__name__}")
                error = APIError(502, f"the replica serving this stream failed mid-way ({type(exc).__name__}); "
                                      "the answer is incomplete")
                for frame in _error_events(path, error):
                    yield frame
        finally:
            release(ok)
            # After the last chunk the connection is already back in the pool; a stream left
            # early (the client went away, or the cut) has its connection closed, so the
            # replica sees the disconnect and aborts the request.
            response.close()
            self.metrics.duration.labels(route).observe(time.perf_counter() - start)

    def _count_cached(self, replica: Replica, routed: Routed, content: bytes, route: str) -> None:
        """Expected vs reported prefix hits, from a non-streaming answer's usage (cache policies only)."""
        if not routed.block_size or route == "other":
            return
        self.metrics.expected_cached.labels(replica.url).inc(routed.choice.matched_blocks * routed.block_size)
        try:
            usage = json.loads(content).get("usage") or {}
        except (ValueError, AttributeError):
            return
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None:
            cached = usage.get("cache_read_input_tokens")
        if isinstance(cached, int):
            self.metrics.reported_cached.labels(replica.url).inc(cached)
