"""Prefill/decode disaggregation in the router (`deepinfer router --prefill URL ... --backend URL ...`).

A generation request first goes, as a copy that asks for one token and no stream, to a prefill
replica (`deepinfer serve --kv-role prefill --kv-store S`), which computes the prompt and answers
only once the prompt's KV blocks are written to the store S. The request itself then goes to a
decode replica (`--kv-role decode`, the same store), chosen by the router's policy as any request
is: its prefix look-up finds the blocks in the store, it loads them (WAITING_FOR_KV) and
generates. The transport is the KV store (dir:// on a shared mount, or redis://); a direct
device-to-device hand-over can come later behind the same roles.

A prefill replica found dead (connection refused or reset) is taken out of routing at once and
the next healthy prefill replica tried. Whatever else happens to the prefill (no prefill replica
healthy, an error answer, a timeout), the request still goes to a decode replica, which then
computes what it cannot load: the hand-over is a saving, never a condition (vLLM's kv_load_failure_policy=recompute). Sliding-window layers are
never handed over; the decode side rebuilds them by Bounded Replay.
"""

from __future__ import annotations

import logging

import aiohttp

from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.monitor import Monitor
from deepinfer.router.options import RouterOptions
from deepinfer.router.replica import Replica
from deepinfer.router.upstream import TRANSPORT_ERRORS, broke_connection

logger = logging.getLogger(__name__)

# The fields that bound the answer's length, per route; the first is set to 1, the others dropped.
LENGTH_FIELDS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
                 "/v1/completions": ("max_tokens",),
                 "/v1/messages": ("max_tokens",),
                 "/v1/responses": ("max_output_tokens",)}


def prefill_body(path: str, body: dict) -> dict:
    """The copy a prefill replica gets: the same prompt (so the same token ids and block hashes),
    one greedy token, one choice, no stream, nothing stored for later retrieval."""
    copy = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of")}
    fields = LENGTH_FIELDS[path]
    for name in fields:
        copy.pop(name, None)
    copy[fields[0]] = 1
    copy["temperature"] = 0
    if path == "/v1/responses":
        copy["store"] = False
    return copy


class PrefillStage:
    """Sends a request's prompt to the least busy healthy prefill replica and waits for it."""

    def __init__(self, replicas: list[Replica], monitor: Monitor, metrics: RouterMetrics,
                 options: RouterOptions, client: aiohttp.ClientSession) -> None:
        self.replicas = replicas
        self.monitor = monitor
        self.metrics = metrics
        self.options = options
        self.client = client
        # The prefill answers once the prompt's blocks are stored: bounded as a whole.
        self.timeout = aiohttp.ClientTimeout(total=options.prefill_timeout_s)

    async def run(self, path: str, body: dict | None, headers: dict[str, str]) -> str:
        """The hand-over's outcome (ok, skipped, failed, http_<status>), also counted in /metrics."""
        outcome = await self._run(path, body, headers)
        self.metrics.prefill.labels(outcome).inc()
        return outcome

    async def _run(self, path: str, body: dict | None, headers: dict[str, str]) -> str:
        healthy = [r for r in self.replicas if r.healthy]
        if body is None or path not in LENGTH_FIELDS or not healthy:
            return "skipped"
        # The least busy first; one found dead is taken out and the next tried, as the proxy does
        # for the decode replicas. A slow one or an error answer ends the hand-over instead.
        for replica in sorted(healthy, key=lambda r: (r.in_flight, r.index)):
            if not replica.healthy:   # found dead meanwhile by another request's hand-over
                continue
            outcome = await self._prefill_on(replica, path, body, headers)
            if outcome != "gone":
                return outcome
        return "failed"

    async def _prefill_on(self, replica: Replica, path: str, body: dict, headers: dict[str, str]) -> str:
        replica.in_flight += 1
        try:
            async with self.client.post(replica.url + path, json=prefill_body(path, body), headers=headers,
                                        timeout=self.timeout) as response:
                await response.read()   # the one-token answer; read so the connection is reused
            if response.status != 200:
                logger.warning("prefill on %s answered %d; the decode replica computes the prompt",
                               replica.url, response.status)
                return f"http_{response.status}"
            return "ok"
        except TRANSPORT_ERRORS as exc:
            if broke_connection(exc):   # a timeout only means a slow prefill: the replica stays in
                logger.warning("prefill on %s failed (%s: %s); trying another prefill replica",
                               replica.url, type(exc).__name__, exc)
                self.monitor.mark_failed(replica, f"prefill: {type(exc).__name__}")
                return "gone"
            logger.warning("prefill on %s timed out (%s); the decode replica computes the prompt",
                           replica.url, type(exc).__name__)
            return "failed"
        finally:
            replica.in_flight -= 1
