"""Background loops that keep each replica's state current: active health probes and gauge scrapes.

    probe   GET /health every --health-interval-s (timeout --health-timeout-s). 200 brings the
            replica (back) into routing; anything else, or no answer, takes it out. A replica taken
            out has its KV index entries forgotten (its cache is gone if it died; if it only
            stalled, its new events rebuild the picture).
    scrape  GET /metrics every --metrics-interval-s of the healthy replicas (replica.parse_metrics),
            and /v1/models once per (re)start for the model id the cache policies hash with.

Passive detection lives in proxy.py: a connection error on a proxied request marks the replica
failed at once, without waiting for the next probe.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from deepinfer.router.kv_index import KVIndex
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.options import RouterOptions
from deepinfer.router.replica import Replica, parse_metrics
from deepinfer.router.upstream import TRANSPORT_ERRORS

logger = logging.getLogger(__name__)


class Monitor:
    def __init__(self, replicas: list[Replica], index: KVIndex, metrics: RouterMetrics, options: RouterOptions,
                 client: aiohttp.ClientSession, kind: str = "replica", scrape: bool = True) -> None:
        """`kind` names the instances in the log ("replica", "encoder"); `scrape`: read their
        gauges (/metrics) for the policies, which encode instances have none of."""
        self.replicas = replicas
        self.kind, self.scrape = kind, scrape
        self.index = index
        self.metrics = metrics
        self.options = options
        self.client = client
        # A probe, a scrape or a model read is bounded as a whole (connect included).
        self.timeout = aiohttp.ClientTimeout(total=options.health_timeout_s)
        self._tasks: list[asyncio.Task] = []
        self.headers = {"Authorization": f"Bearer {options.backend_api_key or options.api_key}"} \
            if (options.backend_api_key or options.api_key) else {}

    def start(self) -> None:
        for r in self.replicas:
            self._tasks.append(asyncio.create_task(self._probe_loop(r), name=f"probe-{r.index}"))
            if self.scrape:
                self._tasks.append(asyncio.create_task(self._scrape_loop(r), name=f"scrape-{r.index}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def mark_failed(self, replica: Replica, reason: str) -> None:
        """Take `replica` out of routing (a probe or a proxied request failed)."""
        if replica.mark_failed(reason):
            logger.warning("%s %s removed from routing: %s", self.kind, replica.url, reason)
            self.index.forget(replica.index)
            replica.model_id = None   # re-read after it is back: it may come back as another model
        self.metrics.healthy.labels(replica.url).set(0)

    async def probe_once(self, replica: Replica) -> None:
        try:
            async with self.client.get(replica.url + "/health", timeout=self.timeout) as response:
                await response.read()   # the connection goes back to the pool only once read
                ok, reason = response.status == 200, f"/health answered {response.status}"
        except TRANSPORT_ERRORS as exc:
            ok, reason = False, f"/health failed: {type(exc).__name__}: {exc}"
        if not ok:
            self.mark_failed(replica, reason)
            return
        if replica.model_id is None:
            await self._read_model(replica)
            if self.scrape:
                await self.scrape_once(replica)   # gauges before the first routed request
        if replica.mark_healthy():
            logger.info("%s %s is healthy: in routing", self.kind, replica.url)
        self.metrics.healthy.labels(replica.url).set(1)

    async def _read_model(self, replica: Replica) -> None:
        try:
            async with self.client.get(replica.url + "/v1/models", headers=self.headers,
                                       timeout=self.timeout) as response:
                cards = (await response.json(content_type=None)).get("data") or []
            # LoRA adapters are listed beside the base model, with it as their `parent`.
            base = [c for c in cards if isinstance(c, dict) and c.get("parent") is None]
            if base:
                replica.served_names = frozenset(c["id"] for c in base if isinstance(c.get("id"), str))
                replica.model_id = base[0].get("root") or base[0].get("id")
        except (*TRANSPORT_ERRORS, ValueError, AttributeError) as exc:
            logger.warning("replica %s: /v1/models unreadable (%s); cache policies skip it", replica.url, exc)

    async def scrape_once(self, replica: Replica) -> None:
        try:
            async with self.client.get(replica.url + "/metrics", timeout=self.timeout) as response:
                if response.status == 200:
                    replica.scraped = parse_metrics(await response.text())
                    replica.scraped_at = time.monotonic()
        except TRANSPORT_ERRORS:
            pass   # the probe decides about health; stale gauges stay until the next scrape

    async def _probe_loop(self, replica: Replica) -> None:
        while True:
            await self.probe_once(replica)
            await asyncio.sleep(self.options.health_interval_s)

    async def _scrape_loop(self, replica: Replica) -> None:
        while True:
            await asyncio.sleep(self.options.metrics_interval_s)
            if replica.healthy:
                await self.scrape_once(replica)
            self.metrics.in_flight.labels(replica.url).set(replica.in_flight)
