"""One benchmark run: a single connection pool, requests sent on their arrival schedule, at most
--max-concurrency of them in flight, a progress bar, and the wall time of the whole run.

As in vLLM: every request is a task created at its arrival time; a request waiting for a
concurrency slot has arrived but is not sent yet (that wait is its `queue_time`); the run's
duration is from just before the first arrival until the last request ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from dataclasses import dataclass, replace

import aiohttp
from tqdm import tqdm

from deepinfer.bench.serving.client import StreamResult, chat_body, completion_body, stream_request
from deepinfer.bench.serving.workload import Job, arrival_offsets

# vLLM's client gives a request up to six hours; a benchmark should not wait forever on a hung server.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass(frozen=True)
class RunSettings:
    url: str                   # the endpoint, e.g. http://127.0.0.1:8000/v1/completions
    chat: bool                 # chat completions (messages) instead of completions (prompt)
    model: str                 # the model name sent in each request
    headers: dict
    extra_body: dict           # ignore_eos, sampling fields, --extra-body: merged into every request
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int
    keep_text: bool = False    # assemble every reply's text (--save-detailed)
    num_warmups: int = 0
    ready_check_timeout_s: float = 0.0
    disable_tqdm: bool = False
    request_id_prefix: str | None = None   # requests carry x-request-id: PREFIX<job>[-<turn>]


def _session(max_concurrency: int | None) -> aiohttp.ClientSession:
    # One pool for the whole run; connections are kept alive and reused between requests.
    limit = max_concurrency or 0   # 0: no limit
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT)


def _gate(max_concurrency: int | None):
    """What a request holds while in flight: a slot of --max-concurrency, or nothing."""
    return asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()


async def first_model(base_url: str, headers: dict) -> str:
    """The first model the server lists (what vLLM's client uses when --model is not given)."""
    async with _session(None) as session, session.get(f"{base_url}/v1/models", headers=headers) as response:
        if response.status != 200:
            detail = (await response.text())[:300]
            raise ValueError(f"GET {base_url}/v1/models: HTTP {response.status}: {detail}")
        models = (await response.json()).get("data") or []
    if not models:
        raise ValueError(f"the server at {base_url} lists no models")
    return models[0]["id"]


def _headers(settings: RunSettings, index: int, turn: int) -> dict:
    if settings.request_id_prefix is None:
        return settings.headers
    suffix = f"-{turn}" if settings.chat and turn else ""
    return {**settings.headers, "x-request-id": f"{settings.request_id_prefix}{index}{suffix}"}


async def _send_job(session: aiohttp.ClientSession, settings: RunSettings, job: Job,
                    index: int = 0) -> list[StreamResult]:
    if not settings.chat:
        turn = job.turns[0]
        body = completion_body(settings.model, turn.prompt, turn.output_len, settings.extra_body)
        headers = _headers(settings, index, 0)
        return [await stream_request(session, settings.url, body, headers, turn.prompt_len,
                                     settings.keep_text)]
    # Chat: the turns of a conversation go one after another, each with the history so far.
    results: list[StreamResult] = []
    history: list[dict] = []
    keep_text = settings.keep_text or len(job.turns) > 1   # the reply goes into the next turn
    for number, turn in enumerate(job.turns):
        if results and not results[-1].success:
            results.append(StreamResult(prompt_len=turn.prompt_len, error="not sent: an earlier turn failed"))
            continue
        history.append({"role": "user", "content": turn.prompt})
        body = chat_body(settings.model, history, turn.output_len, settings.extra_body)
        headers = _headers(settings, index, number)
        result = await stream_request(session, settings.url, body, headers, turn.prompt_len, keep_text)
        results.append(result)
        history.append({"role": "assistant", "content": result.text})
    return results


async def _ready_check(session: aiohttp.ClientSession, settings: RunSettings, job: Job) -> None:
    """Send the first request until it succeeds, for up to --ready-check-timeout-sec."""
    deadline = time.monotonic() + settings.ready_check_timeout_s
    settings = replace(settings, request_id_prefix=None)   # ids stay unique to measured requests
    while True:
        result = (await _send_job(session, settings, Job(job.turns[:1])))[0]
        if result.success:
            return
        if time.monotonic() > deadline:
            raise ValueError(f"the server did not answer the first request in time: {result.error}")
        await asyncio.sleep(1)


async def _warm_up(session: aiohttp.ClientSession, settings: RunSettings, job: Job) -> None:
    """--num-warmups copies of the first request, under the same concurrency limit; not measured."""
    gate = _gate(settings.max_concurrency)
    first = Job(job.turns[:1])
    settings = replace(settings, request_id_prefix=None)   # ids stay unique to measured requests

    async def one() -> None:
        async with gate:
            await _send_job(session, settings, first)

    await asyncio.gather(*(one() for _ in range(settings.num_warmups)))


async def run_benchmark(settings: RunSettings, jobs: list[Job]) -> tuple[list[StreamResult], float]:
    """Send every job on its schedule; returns every request's result (in job order) and the duration."""
    offsets = arrival_offsets(len(jobs), settings.request_rate, settings.burstiness, settings.seed)
    async with _session(settings.max_concurrency) as session:
        if settings.ready_check_timeout_s > 0:
            await _ready_check(session, settings, jobs[0])
        if settings.num_warmups > 0:
            await _warm_up(session, settings, jobs[0])

        gate = _gate(settings.max_concurrency)
        bar = tqdm(total=sum(len(job.turns) for job in jobs), disable=settings.disable_tqdm, desc="Requests")
        clock = time.perf_counter

        async def arrive(job: Job, index: int) -> list[StreamResult]:
            arrived = clock()
            async with gate:
                results = await _send_job(session, settings, job, index)
            results[0].queue_time = results[0].start_time - arrived
            bar.update(len(results))
            return results

        # The workload is built and will not change: keep the garbage collector from walking it
        # (and pausing the event loop) during the run, as vLLM's client does.
        gc.collect()
        gc.freeze()
        tasks = []
        start = clock()
        for index, (job, offset) in enumerate(zip(jobs, offsets)):
            delay = start + offset - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(arrive(job, index)))
        groups = await asyncio.gather(*tasks)
        duration = clock() - start
        bar.close()
        gc.unfreeze()
    return [result for group in groups for result in group], duration
